"""``python -m hybridattn.serve`` as a user starts it on a fresh clone (the built-in demo model
and its word tokenizer), called with the ``openai`` client; ``python -m mlxcache.serve`` with
``--cache-dir``, restarted; ``python -m mlxcache.serve`` also runs in the server benchmark's
test (tests/mlxcache/test_bench_server.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError("the server did not come up")


def _start(module: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """``python -m module --port P flags...`` on a free port, up: the process and its URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *flags,
                             "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a user stops a server: uvicorn shuts down, then exits by the signal it
    caught; it must not have printed a traceback."""
    proc.terminate()
    try:
        assert proc.wait(60) in (0, -15)
        out = proc.stdout.read()
        assert "Traceback" not in out, out
    finally:
        proc.kill()


def test_the_hybridattn_demo_server_answers_the_openai_client():
    openai = pytest.importorskip("openai")
    proc, url = _start("hybridattn.serve", "--max-running", "2", "--max-context-len", "64",
                       "--num-token-slots", "129", "--chunked-prefill", "32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["hybridattn-demo"]
        chat = [{"role": "user", "content": "w5 w6 w7"}]
        out = client.chat.completions.create(model="hybridattn-demo", messages=chat,
                                             max_tokens=6, temperature=0)
        words = out.choices[0].message.content.split(" ")
        assert len(words) == 6 and all(w.startswith("w") for w in words)
        again = client.chat.completions.create(model="hybridattn-demo", messages=chat,
                                               max_tokens=6, temperature=0)
        assert again.choices[0].message.content == out.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        _stop(proc)


@pytest.mark.mlx
def test_a_restarted_mlxcache_server_finds_the_conversation_on_disk(tmp_path):
    """``python -m mlxcache.serve --cache-dir DIR`` as a user runs it: a chat, the server
    stopped (SIGTERM: it closes the engine, which spills its prefixes), a new server on the same
    directory: the same chat reports cached tokens from the first call and answers the same."""
    openai = pytest.importorskip("openai")
    zoo = pytest.importorskip("mlxcache.zoo")
    zoo.save_checkpoint("qwen3_next", tmp_path / "model")  # hybrid: states come back too
    # past the first state snapshot (the 256-token grid): a hybrid reload needs a state
    chat = [{"role": "system", "content": " ".join(f"w{5 + i % 100}" for i in range(300))},
            {"role": "user", "content": "w9 w8 w7"}]
    answers = []
    for _ in range(2):
        proc, url = _start("mlxcache.serve", "--model", str(tmp_path / "model"),
                           "--num-slots", "1024", "--cache-dir", str(tmp_path / "cache"))
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            answers.append(client.chat.completions.create(model="model", messages=chat,
                                                          max_tokens=6, temperature=0))
        finally:
            _stop(proc)
    first, second = answers
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 256  # read back from disk
    assert second.choices[0].message.content == first.choices[0].message.content


@pytest.mark.mlx
def test_an_mlxcache_server_with_kv_bits_answers_as_mlx_lm_does(tmp_path):
    """``python -m mlxcache.serve --kv-bits 8``: four chats sharing a system prompt, sent at
    once with the ``openai`` client (one ragged batch), each answer equal to mlx-lm's greedy
    text with a ``QuantizedKVCache`` of the same bits from token 0; a repeated chat reports
    cached tokens (prefix reuse over quantized pages)."""
    openai = pytest.importorskip("openai")
    zoo = pytest.importorskip("mlxcache.zoo")
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    zoo.save_checkpoint("llama", tmp_path / "model", head_dim=64)
    system = {"role": "system", "content": " ".join(f"w{5 + i % 90}" for i in range(40))}
    chats = [[system, {"role": "user", "content": " ".join(f"w{20 + i + j}"
                                                           for j in range(i + 1))}]
             for i in range(4)]
    model, tok = mlx_lm.load(str(tmp_path / "model"))

    def oracle(chat: list[dict]) -> str:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True)
        cache = [QuantizedKVCache(group_size=32, bits=8) if type(c) is KVCache else c
                 for c in make_prompt_cache(model)]
        logits, out = model(mx.array([ids]), cache=cache), []
        for _ in range(6):
            out.append(mx.argmax(logits[0, -1]).item())
            if out[-1] in tok.eos_token_ids:
                out.pop()
                break
            logits = model(mx.array([out[-1:]]), cache=cache)
        return tok.decode(out)

    proc, url = _start("mlxcache.serve", "--model", str(tmp_path / "model"), "--num-slots",
                       "1024", "--kv-bits", "8", "--kv-group-size", "32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(chat: list[dict]):
            return client.chat.completions.create(model="model", messages=chat, max_tokens=6,
                                                  temperature=0)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, chats))
        assert [a.choices[0].message.content for a in answers] == [oracle(c) for c in chats]
        again = ask(chats[0])
        assert again.choices[0].message.content == answers[0].choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 40
    finally:
        _stop(proc)
