"""The server's loop on an mlxcache engine's own thread (``Engine.start_thread``): a real
uvicorn server on 127.0.0.1 and the real ``openai`` client. Every round runs on the engine's
thread with no hand-over between threads; other threads' calls (``generate``, ``memory``,
``reset_cache``, ``close``) still run, whether the server idles or streams."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_harness import MODEL, mlx_engine, serving, within

pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEADLINE_S = 60  # a call that waits this long is deadlocked
CHAT = [{"role": "user", "content": "w30 w31 w32 w33"}]


def _within(fn, seconds=DEADLINE_S):
    return within(fn, seconds)


def _chat(client, content, max_tokens, stream=False):
    messages = [{"role": "user", "content": content}]
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=max_tokens, temperature=0)
    return client.chat.completions.create(model=MODEL, messages=messages,
                                          max_tokens=max_tokens, temperature=0, stream=True)


def _streamed(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_every_round_under_the_server_runs_on_the_engines_thread_with_no_hop():
    engine = mlx_engine(num_slots=512)
    owner = engine.owner
    prompts = [f"w{40 + i} w{50 + i} w{60 + i}" for i in range(4)]
    want = [engine.generate([[{"role": "user", "content": p}]], 8, text=True)[0]
            for p in prompts]
    rounds, callers = [], []
    real_round, real_call = engine.core.run_round, owner.call

    def run_round(emit):  # the core's round, wherever it runs
        rounds.append(threading.get_ident())
        return real_round(emit)

    def call(fn, *args):  # every call handed to the owner, and from where
        callers.append(threading.get_ident())
        return real_call(fn, *args)

    engine.core.run_round, owner.call = run_round, call
    with engine, serving(engine) as srv:
        client = srv.openai()
        got = [None] * len(prompts)

        def ask(i):  # streamed and whole answers, at once
            if i % 2:
                got[i] = _chat(client, prompts[i], 8).choices[0].message.content
            else:
                got[i] = _streamed(_chat(client, prompts[i], 8, stream=True))

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in clients:
            t.start()
        for t in clients:
            t.join(DEADLINE_S)
        srv.idle()
        assert got == want
        assert srv.server.worker.alive
        assert "servecore-engine" not in {t.name for t in threading.enumerate()}
        engine.core.run_round, owner.call = real_round, real_call
    assert rounds and set(rounds) == {owner.thread.ident}
    assert callers and set(callers) == {owner.thread.ident}  # each call ran inline


def test_other_threads_calls_run_while_the_server_idles_and_while_it_streams():
    engine = mlx_engine(num_slots=512)
    want = engine.generate([CHAT], 6, text=True)[0]
    long = [{"role": "user", "content": "w70 w71 w72"}]
    want_long = engine.generate([long], 150, text=True)[0]
    with engine, serving(engine) as srv:
        client = srv.openai()
        assert _within(lambda: engine.memory.serving_bytes) > 0  # idle: the loop waits
        _within(engine.reset_cache)
        assert _within(lambda: engine.generate([CHAT], 6, text=True)[0]) == want
        chunks = iter(_chat(client, "w70 w71 w72", 150, stream=True))
        first = [next(chunks)]  # the loop streams now
        assert _within(lambda: engine.generate([CHAT], 6, text=True)[0]) == want
        _within(engine.reset_cache)
        assert _streamed(first + list(chunks)) == want_long
        srv.idle()
        assert engine.tree.protected_size == 0


def test_close_from_another_thread_while_the_server_streams_ends_it_cleanly():
    engine = mlx_engine(num_slots=512)
    with serving(engine) as srv:
        client = srv.openai()
        chunks = iter(_chat(client, "w80 w81 w82", 400, stream=True))
        next(chunks)  # running
        _within(engine.close)  # from another thread than the loop's
        assert engine.closed and not engine.owner.thread.is_alive()
        with pytest.raises(openai.APIError, match="closed"):
            list(chunks)  # the stream ends with an error event, not a short answer
        worker = srv.server.worker
        assert not worker.alive and worker.running == 0 and worker.waiting == 0
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "engine thread stopped"
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(client, "w1 w2", 4)
        assert refused.value.status_code == 503 and "closed" in refused.value.message
        assert worker.waiting == 0
