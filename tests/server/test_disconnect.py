"""A client that leaves aborts its request, for both engines: raw sockets send hand-written
HTTP/1.1 requests and close (an orderly FIN or a reset) at a chosen point: a stream after its
first events, a non-streamed answer while it is generated, a long prompt as soon as it is
sent or while it is prefilled in chunks.

Each test checks that the abort lands (the worker runs nothing within a second, the engine
made far fewer tokens than ``max_tokens``, ``servecore_client_disconnects_total`` counts
it), that the engine holds no slot for it (free + cached slots are the whole pool), and that
the same prompt asked again is answered right (its cached prefix stays usable): the
engine's own greedy generation of it, computed alone before the server started.

The engine's rounds are slowed (``wire.slowed``) while a client leaves, so that the point
where it leaves is known: a fast tiny model would otherwise finish first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

import httpx
import numpy as np
import pytest
import wire
from server_harness import MODEL, hybrid_engine, mlx_engine, serving

from servecore.server._generation import Ask, Usage, pieces
from servecore.server._worker import EngineWorker
from servecore.testing import FakeEngine, word_tokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def test_a_cancel_that_meets_an_event_still_cancels():
    """The consumer of ``pieces`` is cancelled (its client left) in the same turn of the
    event loop as an item reaches its queue: the generation still ends and its request is
    aborted. (``asyncio.wait_for`` on Python 3.11 returned the item and dropped the cancel:
    the generation then ran to ``max_tokens`` for nobody.)"""

    worker = EngineWorker(FakeEngine())
    gens = []
    submit = worker.submit
    worker.submit = lambda gen, *a, **kw: (gens.append(gen), submit(gen, *a, **kw))[1]

    async def main():
        it = pieces(worker, Ask([[7, 8]], max_tokens=200_000), word_tokenizer(32), frozenset(),
                    Usage())
        async def consume():
            async for _ in it:
                pass

        task = asyncio.ensure_future(consume())
        while not gens:
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # accepted, its tokens coming
        gens[0].queue.put_nowait((0, 0))  # an item (harmless), and in the same turn the cancel
        task.cancel()
        await asyncio.sleep(0.1)
        assert task.cancelled(), "the cancel was swallowed: the generation goes on"

    worker.start()
    try:
        asyncio.run(main())
        wire.wait_for(lambda: worker.running == 0, 2.0, "the request's abort")
    finally:
        worker.stop()


@dataclasses.dataclass
class Setup:
    """A served engine and its prompts: ``short[route]`` generates ``max_tokens`` tokens
    greedily without an EOS, ``long[route]`` nearly fills the context (several prefill
    chunks); ``want`` is each one's greedy text, served alone."""

    engine: Any
    running: Any
    max_tokens: int
    short: dict[str, Any]
    long: dict[str, Any]
    want: dict[tuple[str, str], str]
    long_max_tokens: int = 4
    decode_delay: float = 0.02  # seconds added to each round while a client leaves
    prefill_delay: float = 0.25
    # mlxcache prefills a prompt in one round (its chunks inside it), hybridattn a chunk a
    # round: a cancel lands between rounds, so it stops the first after the prompt
    # (one token made) and the second after the chunk under way (none made)
    prefill_in_one_round: bool = False

    def body(self, route: str, which: str, **kw: Any) -> dict[str, Any]:
        prompt = (self.short if which == "short" else self.long)[route]
        key = "messages" if route == CHAT else "prompt"
        max_tokens = self.max_tokens if which == "short" else self.long_max_tokens
        return {"model": MODEL, key: prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def _as_prompt(route: str, words: str) -> Any:
    return [{"role": "user", "content": words}] if route == CHAT else words


def _without_eos(engine, route: str, max_tokens: int, rng) -> Any:
    """A short prompt whose greedy answer runs to ``max_tokens`` (no EOS first)."""
    vocab = engine.vocab_size
    for _ in range(20):
        cands = [_as_prompt(route, wire.random_words(rng, vocab, 6)) for _ in range(4)]
        for prompt, out in zip(cands, engine.generate(cands, max_tokens), strict=True):
            if len(out) == max_tokens and out[-1] not in engine.eos_ids:
                return prompt
    raise AssertionError("no prompt generates max_tokens tokens without an EOS")


def _setup(engine, max_tokens: int, long_words: dict[str, int]) -> Setup:
    rng = np.random.default_rng(35)
    vocab = engine.vocab_size
    short = {r: _without_eos(engine, r, max_tokens, rng) for r in (CHAT, COMPLETIONS)}
    long = {r: _as_prompt(r, wire.random_words(rng, vocab, long_words[r]))
            for r in (CHAT, COMPLETIONS)}
    setup = Setup(engine, None, max_tokens, short, long, {})
    for r in (CHAT, COMPLETIONS):  # each alone: the oracle
        setup.want[r, "short"] = engine.generate([short[r]], max_tokens, text=True)[0]
        setup.want[r, "long"] = engine.generate([long[r]], setup.long_max_tokens, text=True)[0]
    engine.reset_cache()
    return setup


@pytest.fixture(scope="module", params=["hybridattn", pytest.param("mlxcache",
                                                                   marks=pytest.mark.mlx)])
def setup(request):
    if request.param == "hybridattn":
        # max_context_len 96, chunked prefill 64: the long prompts take two prefill rounds
        engine = hybrid_engine()
        s = _setup(engine, 80, {CHAT: 87, COMPLETIONS: 89})
    else:  # 32-token prefill steps: the long prompts take 13 rounds
        engine = mlx_engine(num_slots=2048, prefill_step_size=32)
        s = _setup(engine, 200, {CHAT: 400, COMPLETIONS: 410})
        s.prefill_in_one_round = True
    with serving(engine) as running:
        s.running = running
        yield s


def _disconnects(s: Setup) -> float:
    return wire.counter(httpx.get(s.running.url + "/metrics").text,
                        "servecore_client_disconnects_total")


def _landed(s: Setup, made_before: int, disconnects_before: float) -> int:
    """The abort landed: the client is counted as gone (once its answer has stopped and the
    worker was told), then the worker runs nothing within a second. The tokens the engine
    made for the request."""
    worker = s.running.server.worker
    wire.wait_for(lambda: _disconnects(s) == disconnects_before + 1, 5.0,
                  "the disconnect being counted")
    wire.wait_for(lambda: worker.running == 0 and worker.waiting == 0, 1.0,
                  "the abort (worker idle)")
    return wire.generated(s.engine) - made_before


def _served_right_and_whole(s: Setup, route: str, which: str) -> None:
    """The same prompt, asked again, gets its answer; then nothing leaked."""
    r = httpx.post(s.running.url + route, json=s.body(route, which), timeout=60)
    assert r.status_code == 200, r.text
    assert wire.answer_text(r.json(), route) == s.want[route, which]
    s.running.idle()
    wire.assert_no_leak(s.engine)


@pytest.mark.parametrize(("route", "reset"), [(CHAT, False), (COMPLETIONS, True)])
def test_stream_closed_after_its_first_events(setup, route, reset):
    s = setup
    made, gone = wire.generated(s.engine), _disconnects(s)
    with wire.slowed(s.engine, s.decode_delay):
        sock = wire.send(s.running.port, route, s.body(route, "short", stream=True))
        head = wire.read_until(sock, lambda b: b.count(b"data: {") >= 3)
        assert head.startswith(b"HTTP/1.1 200 ")
        wire.close(sock, reset)
        made = _landed(s, made, gone)
    assert 2 <= made <= s.max_tokens // 4, f"{made} tokens made for a client that left"
    _served_right_and_whole(s, route, "short")


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_whole_answer_closed_while_generating(setup, route):
    s = setup
    made, gone = wire.generated(s.engine), _disconnects(s)
    with wire.slowed(s.engine, s.decode_delay):
        sock = wire.send(s.running.port, route, s.body(route, "short"))
        wire.wait_for(lambda: wire.generated(s.engine) >= made + 3, 10.0, "three tokens")
        wire.close(sock)
        made = _landed(s, made, gone)
    assert 3 <= made <= s.max_tokens // 4, f"{made} tokens made for a client that left"
    _served_right_and_whole(s, route, "short")


@pytest.mark.parametrize(("route", "when"), [(CHAT, "sent"), (CHAT, "prefilling"),
                                             (COMPLETIONS, "prefilling")])
def test_long_prompt_closed_before_its_first_token(setup, route, when):
    """``sent``: closed as soon as the request is written; ``prefilling``: once the worker
    runs it (its first prefill round under way). Either way the prefill stops after the
    round under way: hybridattn makes no token (the prompt takes two rounds), mlxcache at
    most the first (its prefill is one round)."""
    s = setup
    worker = s.running.server.worker
    made, gone = wire.generated(s.engine), _disconnects(s)
    requests, most = s.engine.stats.requests, int(s.prefill_in_one_round)
    with wire.slowed(s.engine, s.prefill_delay):
        sock = wire.send(s.running.port, route, s.body(route, "long"))
        if when == "prefilling":
            wire.wait_for(lambda: worker.running == 1, 10.0, "the worker taking it")
        wire.close(sock)
        made = _landed(s, made, gone)
    assert made <= most and s.engine.stats.requests <= requests + most, (
        f"{made} tokens made: the generation went on after its client left")
    _served_right_and_whole(s, route, "long")


@pytest.mark.parametrize("sent", ["headers", "half the body"])
def test_a_client_that_leaves_while_sending_is_no_fault(setup, sent, caplog):
    """Closed before the body is whole: counted as a client gone (499), never logged or
    counted as a fault (500), and the server serves on."""
    s = setup
    caplog.set_level(logging.WARNING)
    gone = _disconnects(s)
    raw = wire.request_bytes(CHAT, s.body(CHAT, "short"))
    head, body = raw.split(b"\r\n\r\n", 1)
    sock = socket.create_connection(("127.0.0.1", s.running.port))
    sock.sendall(head + b"\r\n\r\n" + (b"" if sent == "headers" else body[: len(body) // 2]))
    time.sleep(0.1)  # the route waits for the rest of its body
    wire.close(sock)
    wire.wait_for(lambda: _disconnects(s) == gone + 1, 5.0, "the disconnect being counted")
    metrics = httpx.get(s.running.url + "/metrics").text
    assert 'status="500"' not in metrics and 'status="499"' in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    _served_right_and_whole(s, CHAT, "short")


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_long_prefill_streams_keepalives_then_the_answer(setup, route):
    """While a long prompt is prefilled the stream carries keep-alive comments (the wait
    for the engine times out again and again without losing an event), then its answer:
    the engine's own, whole."""
    s = setup
    server = s.running.server
    server.keepalive = 0.05
    try:
        with wire.slowed(s.engine, s.prefill_delay):
            sock = wire.send(s.running.port, route, s.body(route, "long", stream=True))
            raw = wire.read_until(sock, lambda b: b.endswith(b"0\r\n\r\n"))
            sock.close()
    finally:
        server.keepalive = 10.0
    assert raw.count(b": keep-alive\n\n") >= 2
    assert wire.sse_texts(raw.split(b"\r\n\r\n", 1)[1], route) == [s.want[route, "long"]]
    s.running.idle()
    wire.assert_no_leak(s.engine)
