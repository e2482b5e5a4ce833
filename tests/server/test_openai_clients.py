"""The server as users call it: the real ``openai`` and ``anthropic`` clients against a uvicorn
server on 127.0.0.1, for both engines. The oracle of every answer is the engine itself serving
the same prompt through ``Engine.generate`` (whose tokens the engines' own tests check against
mlx-lm and the cache-free model)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_harness import MODEL, hybrid_engine, mlx_engine, serving

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHAT = [{"role": "system", "content": "w20 w21 w22"},
        {"role": "user", "content": "w30 w31 w32 w33 w34 w35"}]


def _engine(kind):
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
        return mlx_engine(num_slots=384)  # a pool that refuses the overlong prompts
    return hybrid_engine()


@pytest.fixture(scope="module", params=["hybridattn", "mlx"])
def srv(request):
    engine = _engine(request.param)
    with engine, serving(engine) as running:
        running.engine, running.kind = engine, request.param
        yield running


def _alone(engine, prompt, max_tokens, **kw):
    return engine.generate([prompt], max_tokens, text=True, **kw)[0]


def test_chat_streamed_equals_whole_equals_the_engine(srv):
    client = srv.openai()
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert whole.choices[0].message.content == streamed == _alone(srv.engine, CHAT, 12)
    if srv.kind == "mlx":  # and mlx-lm's own greedy decoding of the same prompt agrees
        from mlxcache import zoo
        from servecore.prompts import encode_prompt

        tok = srv.engine.tokenizer
        ids = encode_prompt("chat", CHAT, tok, zoo.VOCAB)
        want = zoo.reference_generate(srv.engine.model, ids, 12)
        eos = {tok.eos_token_id}
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert streamed == tok.decode(want[:cut])
    assert finishes == [whole.choices[0].finish_reason] and len(finishes) == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    srv.idle()


def test_completions_of_text_texts_and_token_ids(srv):
    client = srv.openai()
    text = "w40 w41 w42 w43"
    out = client.completions.create(model=MODEL, prompt=[text, [40, 41, 42, 43]],
                                    max_tokens=6, temperature=0)
    want = _alone(srv.engine, [40, 41, 42, 43], 6)
    assert [c.text for c in out.choices] == [want, want]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=text, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == want


def test_n_choices_share_the_prompt_and_each_finishes_once(srv):
    client = srv.openai()
    chat = [{"role": "user", "content": "w50 w51 w52 w53 w54 w55 w56 w57"}]
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5,
                                         temperature=0, n=2)
    assert len(out.choices) == 2 and out.choices[0].message.content == \
        out.choices[1].message.content == _alone(srv.engine, chat, 5)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=5, temperature=0.9, seed=5, n=3, stream=True))
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]
    # the siblings found the whole prompt cached: only the first prompt costs prefill
    again = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5,
                                           temperature=0, n=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_same_seed_gives_the_same_text(srv):
    client = srv.openai()
    ask = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, top_p=0.95,
               seed=1234)
    a, b = (client.chat.completions.create(**ask).choices[0].message.content for _ in "ab")
    assert a == b == _alone(srv.engine, CHAT, 10, temperature=1.0, top_p=0.95, seed=1234)


def test_stop_strings_cut_the_text_and_never_leak(srv):
    client = srv.openai()
    whole = _alone(srv.engine, CHAT, 12)
    full = whole.split(" ")
    assert len(full) >= 4
    stop = " ".join(full[2:4])  # two words across a token boundary
    want = whole[: whole.index(stop)]
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                              temperature=0, stop=[stop, "w999"],
                                              stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        else:
            text = out.choices[0].message.content
            assert out.choices[0].finish_reason == "stop"
        assert text == want and stop not in text
    srv.idle()


def test_a_second_chat_turn_reports_cached_tokens(srv):
    client = srv.openai()
    first = [{"role": "user", "content": "w60 w61 w62 w63 w64 w65 w66 w67 w68 w69"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6,
                                            temperature=0)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "w70 w71"}]
    again = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == _alone(srv.engine, second, 6)


def test_anthropic_messages_whole_streamed_and_counted(srv):
    client = srv.anthropic()
    msgs = [{"role": "user", "content": "w30 w31 w32 w33 w34 w35"}]
    # (the client of this day has no temperature argument: the API's field goes as extra)
    ask = dict(model=MODEL, system="w20 w21 w22", messages=msgs, max_tokens=12,
               extra_body={"temperature": 0})
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert whole.content[0].text == streamed == _alone(srv.engine, CHAT, 12)
    assert whole.stop_reason == final.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens == final.usage.output_tokens
    # a repeat reads its prompt from the cache, counted as OpenAI's cached_tokens are
    assert client.messages.create(**ask).usage.cache_read_input_tokens > 0
    count = client.messages.count_tokens(model=MODEL, system="w20 w21 w22", messages=msgs)
    assert count.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    text = whole.content[0].text
    word = text.split(" ")[1]
    cut = client.messages.create(**ask, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]


def test_models_health_and_metrics(srv):
    client = srv.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    text = httpx.get(srv.url + "/metrics").text
    for name in ("servecore_requests_total", "servecore_prompt_tokens_total",
                 "servecore_cached_tokens_total", "servecore_requests_waiting",
                 "servecore_time_to_first_token_seconds_bucket"):
        assert name in text


BAD = [  # (route, body, status, the field named)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": "other", "messages": CHAT}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": "8"}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 3}, 400,
     "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "x"}]},
     400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                              "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "frequency_penalty": 0.5},
     400, "frequency_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logit_bias": {"5": 1}},
     400, "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "frobnicate": 1}, 400,
     "frobnicate"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool",
                                                            "content": "w5"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content":
                                                            " ".join(["w9"] * 500)}]},
     400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": " ".join(["w9"] * 500), "stream": True},
     400, "prompt"),  # refused before the stream starts
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 0}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "stop": ["a"] * 9}, 400, "stop"),
    ("/v1/nowhere", {"model": MODEL}, 404, None),
]


@pytest.mark.parametrize("route, body, status, param", BAD)
def test_bad_requests_get_their_status_and_the_next_is_served(srv, route, body, status,
                                                              param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    good = srv.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                temperature=0)
    assert good.choices[0].message.content == _alone(srv.engine, CHAT, 4)


def test_anthropic_errors_have_its_shape(srv):
    r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "messages": CHAT[1:]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_a_full_queue_is_a_429_and_then_serves(srv):
    worker = srv.server.worker
    limit = worker.max_waiting
    worker.max_waiting = 0
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w5"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        worker.max_waiting = limit
    assert httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w5",
                                                         "max_tokens": 2}).status_code == 200


def _FakeEngine(core=None):
    """``servecore.testing.FakeEngine``: tokens and log-probabilities without a model
    (``fake_logprobs``: the token at -0.5, the next ids at -1.5, ...)."""
    from servecore.testing import FakeEngine, word_tokenizer

    return FakeEngine(core, vocab_size=32, tokenizer=word_tokenizer(32))


def test_logprobs_in_the_shapes_of_both_openai_apis():
    with serving(_FakeEngine()) as fake:
        client = fake.openai()
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "w17"}], max_tokens=3,
                   temperature=0, logprobs=True, top_logprobs=2)
        whole = client.chat.completions.create(**ask)
        content = whole.choices[0].logprobs.content
        words = whole.choices[0].message.content.split(" ")
        assert [c.token for c in content] == words and len(words) == 3
        assert [c.logprob for c in content] == [-0.5] * 3
        assert [[t.logprob for t in c.top_logprobs] for c in content] == [[-0.5, -1.5]] * 3
        assert content[0].top_logprobs[0].token == words[0]
        chunks = [c for c in client.chat.completions.create(**ask, stream=True)
                  if c.choices and c.choices[0].logprobs]
        assert [t.token for c in chunks for t in c.choices[0].logprobs.content] == words
        plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
        assert plain.choices[0].logprobs is None
        out = client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, logprobs=1,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert "".join(lp.tokens).replace("w", " w").strip() == out.choices[0].text
        assert lp.token_logprobs == [-0.5] * 3 and len(lp.top_logprobs) == 3
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        for body, param in (({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
                            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
            r = httpx.post(fake.url + "/v1/chat/completions", json={**ask, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = httpx.post(fake.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "w5", "logprobs": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_stream_sends_keepalives_while_the_prompt_is_prefilled():
    from servecore.testing import FakeCore

    class SlowPrefill(FakeCore):  # the first round (the prefill) takes 0.4 s
        slow = True

        def run_round(self, emit):
            if self.slow:
                self.slow = False
                time.sleep(0.4)
            return super().run_round(emit)

    fake = _FakeEngine(SlowPrefill(vocab_size=32))
    with serving(fake, keepalive=0.05) as srv:
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        first = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert first >= 3 and all(line == ": keep-alive" for line in lines[:first])
        assert lines[-1] == "data: [DONE]"
        streamed = srv.openai().completions.create(model=MODEL, prompt="w5", max_tokens=2,
                                                   stream=True)
        assert len([c for c in streamed if c.choices]) >= 2  # the client skips comments


def test_a_fault_of_the_engine_is_a_500_and_the_server_goes_on():
    fake = _FakeEngine()
    with serving(fake) as srv:
        client = srv.openai()
        fake.core.fail_next = True  # the next round drops what it serves and raises
        r = httpx.post(srv.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "w5", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "the engine failed" in r.json()["error"]["message"]
        fake.core.fail_next = True
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                "stream": True}) as s:
            lines = list(s.iter_lines())
        if s.status_code == 200:  # the stream had started: an error event ends it
            events = [line for line in lines if line.startswith("data:")]
            assert '"server_error"' in events[-2] and events[-1] == "data: [DONE]"
        else:  # the failure came before the stream started: its status
            assert s.status_code == 500 and "server_error" in "".join(lines)
        out = client.completions.create(model=MODEL, prompt="w5", max_tokens=3)
        assert out.choices[0].finish_reason == "length" and len(out.choices[0].text.split()) == 3
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert srv.server.worker.running == 0 and srv.server.worker.waiting == 0


def test_misbehaving_clients_get_400s_and_hurt_nobody():
    fake = _FakeEngine()
    with serving(fake, max_queue=4, max_body_bytes=1 << 16) as srv:
        client = srv.openai()
        chat = [{"role": "user", "content": "w5"}]
        first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
        # the openai client's own reply object sent back (refusal, annotations, ...)
        again = client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=chat + [first.choices[0].message,
                                                        {"role": "user", "content": "w6"}])
        assert again.choices[0].finish_reason == "length"

        def post(route, body, **kw):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            return httpx.post(srv.url + route, content=raw, **kw)

        cases = [  # (route, body, status, param)
            ("/v1/completions", {"model": MODEL, "prompt": [[5]] * 3, "n": 2}, 429, None),
            ("/v1/completions", {"model": MODEL, "prompt": [[5]] * 40, "n": 2}, 400, "prompt"),
            ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": chat})[:-1].encode()
             + b', "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
            ("/v1/chat/completions", b"[" * 60000, 400, None),  # RecursionError
            ("/v1/chat/completions", {"model": MODEL, "messages": chat, "top_k": 2**40}, 400,
             "top_k"),
            ("/v1/completions", {"model": MODEL, "prompt": "w9 " * 30000}, 413, None),
            ("/v1/completions", {"model": MODEL, "prompt": "w5", "stop": ["x" * 1001]}, 400,
             "stop"),
        ]
        for route, body, status, param in cases:
            r = post(route, body)
            assert r.status_code == status, (route, r.text[:200])
            assert r.json()["error"]["param"] == param
        r = post("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "w7"}, {"role": "assistant", "content": "w9"}]})
        assert r.status_code == 400 and "prefill" in r.json()["error"]["message"]
        # a body cut short by a client that leaves is no fault of the server's
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: 1000\r\n\r\n{\"model\"")
        time.sleep(0.2)
        assert not any(status >= 500 for _, status in srv.server.metrics.requests)
        assert client.completions.create(model=MODEL, prompt="w5", max_tokens=2).choices
        srv.idle()


def test_clients_that_leave_at_once_are_aborted_within_rounds():
    """Python 3.11's ``wait_for`` could swallow the cancel of a client that left, leaving its
    request to run to ``max_tokens``: 80 clients (streaming or not, n of 1, 2 or 4) that close
    their socket 0-100 ms after sending are all aborted, long before their 3 s of tokens."""
    import random
    import threading

    from servecore.testing import FakeCore

    class Slow(FakeCore):  # 20 ms rounds
        def run_round(self, emit):
            time.sleep(0.02)
            return super().run_round(emit)

    def leave(port, body, after):
        raw = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: %d\r\n\r\n" % len(raw) + raw)
            time.sleep(after)

    fake = _FakeEngine(Slow(rows=64, vocab_size=32))
    rng = random.Random(0)
    with serving(fake) as srv:
        threads = [threading.Thread(target=leave, args=(srv.port, {
            "model": MODEL, "messages": [{"role": "user", "content": "w7"}], "max_tokens": 150,
            "stream": rng.random() < 0.5, "n": rng.choice([1, 2, 4]), "seed": i},
            rng.random() * 0.1)) for i in range(80)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        srv.idle(timeout=1.0)  # 150 tokens take 3 s
