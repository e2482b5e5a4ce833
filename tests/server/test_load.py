"""A bounded load test on loopback, for both engines: ``CLIENTS`` concurrent clients (64)
for ``SECONDS`` (6 here), greedy requests drawn from a small pool of word prompts (chats
behind one system prompt, second turns, stop strings, plain completions, Anthropic
messages), streamed or not, one answer or two (``n=2``). A quarter of the clients leave
every request at a random point (raw sockets: right after sending, after some events, after
a random time); the others read every answer to its end. By hand, the environment sets
another run: ``SERVECORE_LOAD_SECONDS=60`` (a minute), ``SERVECORE_LOAD_CLIENTS``,
``SERVECORE_LOAD_MLX_FAMILY`` (another ``mlxcache.zoo`` model than llama, e.g. the hybrid
``qwen3_next``).

Every answer read to its end equals its prompt served alone by the engine (computed before
the server starts); nothing is logged as an error; at the end the worker is idle, no slot or
snapshot is held for a request that is gone, and the next request is served right. The
latency of the whole answers (p50 / p99) and the counts are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any

import httpx
import numpy as np
import pytest
import wire
from server_harness import MODEL, hybrid_engine, mlx_engine, serving

SECONDS = float(os.environ.get("SERVECORE_LOAD_SECONDS", "6"))
CLIENTS = int(os.environ.get("SERVECORE_LOAD_CLIENTS", "64"))
MLX_FAMILY = os.environ.get("SERVECORE_LOAD_MLX_FAMILY", "llama")  # or qwen3_next, ...
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"


@dataclasses.dataclass
class Item:
    """A pool entry: the route, its request body (without ``stream``) and the engine's
    answer to it served alone."""

    route: str
    body: dict[str, Any]
    want: str


def _pool(engine, seed: int = 35) -> list[Item]:
    """Fourteen prompts: six chats behind one system prompt, two second turns of them, two
    with a stop string, two plain completions, two Anthropic messages; each with its own
    max_tokens; each answered alone (the oracle)."""
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size

    def words(lo, hi):
        return wire.random_words(rng, vocab, int(rng.integers(lo, hi)))

    def max_tokens():
        return int(rng.integers(4, 25))

    system = {"role": "system", "content": words(12, 16)}
    chats = [[system, {"role": "user", "content": words(2, 8)}] for _ in range(8)]
    pool = [_item(engine, CHAT, chat, max_tokens()) for chat in chats[:6]]
    for first in pool[:2]:  # second turns: the first turn, its answer, a new question
        turn = first.body["messages"] + [{"role": "assistant", "content": first.want},
                                         {"role": "user", "content": words(2, 8)}]
        pool.append(_item(engine, CHAT, turn, max_tokens()))
    for chat in chats[6:]:  # a stop string: the answer's third word
        item = _item(engine, CHAT, chat, 24)
        stop = (item.want.split() + ["w6"] * 3)[2]
        if stop in item.want:
            item.want = item.want[:item.want.index(stop)]
        pool.append(dataclasses.replace(item, body={**item.body, "stop": [stop]}))
    pool += [_item(engine, COMPLETIONS, words(3, 20), max_tokens()) for _ in range(2)]
    for _ in range(2):
        user = {"role": "user", "content": words(2, 8)}
        item = _item(engine, CHAT, [system, user], max_tokens())
        body = {"model": MODEL, "system": system["content"], "messages": [user],
                "max_tokens": item.body["max_tokens"], "temperature": 0}
        pool.append(Item(MESSAGES, body, item.want))
    engine.reset_cache()
    return pool


def _item(engine, route: str, prompt: Any, max_tokens: int) -> Item:
    key = "messages" if route == CHAT else "prompt"
    want = engine.generate([prompt], max_tokens, text=True)[0]
    return Item(route, {"model": MODEL, key: prompt, "max_tokens": max_tokens,
                        "temperature": 0}, want)


def _body(item: Item, stream: bool, n: int) -> dict[str, Any]:
    return {**item.body, "stream": stream, **({"n": n} if item.route != MESSAGES else {})}


@dataclasses.dataclass
class Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    streamed: int = 0
    left: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)


async def _whole(http: httpx.AsyncClient, item: Item, stream: bool, n: int) -> list[str]:
    """Ask for ``item`` (``n`` choices) and read its answer to the end; their texts."""
    body = _body(item, stream, n)
    if not stream:
        r = await http.post(item.route, json=body)
        assert r.status_code == 200, r.text
        return wire.answer_texts(r.json(), item.route)
    async with http.stream("POST", item.route, json=body) as r:
        assert r.status_code == 200, await r.aread()
        raw = b"".join([chunk async for chunk in r.aiter_bytes()])
    end = b'data: {"type":"message_stop"}' if item.route == MESSAGES else b"data: [DONE]"
    assert raw.rstrip().endswith(end), raw[-200:]
    return wire.sse_texts(raw, item.route)


async def _leave(port: int, item: Item, stream: bool, n: int,
                 rng: np.random.Generator) -> None:
    """Send ``item`` on a raw socket and close it at a random point: at once, after a few
    of the stream's events, or after a random time."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire.request_bytes(item.route, _body(item, stream, n)))
    await writer.drain()
    how = rng.random()
    if stream and how < 0.6:
        events, seen = int(rng.integers(1, 8)), b""
        while seen.count(b"data: ") < events and not seen.endswith(b"0\r\n\r\n"):
            async with asyncio.timeout(60):
                more = await reader.read(4096)
            if not more:
                break
            seen += more
    elif how < 0.9:
        await asyncio.sleep(float(rng.uniform(0, 0.4)))
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _client(i: int, url: str, port: int, pool: list[Item], deadline: float,
                  tally: Tally) -> None:
    rng = np.random.default_rng(1000 + i)
    leaves = i % 4 == 0  # a quarter of the clients
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            item = pool[int(rng.integers(len(pool)))]
            stream = bool(rng.random() < 0.5)
            n = 2 if rng.random() < 0.2 and item.route != MESSAGES else 1  # greedy: twice
            if leaves:
                await _leave(port, item, stream, n, rng)
                tally.left += 1
                continue
            t0 = time.perf_counter()
            got = await _whole(http, item, stream, n)
            tally.latencies.append(time.perf_counter() - t0)
            tally.streamed += stream
            if got != [item.want] * n:
                tally.wrong.append(f"{item.body} (stream={stream}, n={n}): {got!r} != "
                                   f"{item.want!r}")


@pytest.fixture(params=["hybridattn", pytest.param("mlxcache", marks=pytest.mark.mlx)])
def engine(request):
    if request.param == "hybridattn":  # max_context_len 96, 8 rows, 384 token slots
        return hybrid_engine()
    return mlx_engine(MLX_FAMILY, num_slots=1024, max_batch_size=16)


def test_clients_that_stay_get_their_answers_and_those_that_leave_leak_nothing(
        engine, caplog):
    pool = _pool(engine)
    tally = Tally()
    caplog.set_level(logging.WARNING)
    with serving(engine) as running:
        deadline = time.monotonic() + SECONDS

        async def main():
            await asyncio.gather(*[_client(i, running.url, running.port, pool, deadline, tally)
                                   for i in range(CLIENTS)])

        t0 = time.perf_counter()
        asyncio.run(main())
        wall = time.perf_counter() - t0
        running.idle(10)
        metrics = httpx.get(running.url + "/metrics").text
        item = pool[-1]  # and the server still serves right
        r = httpx.post(running.url + item.route, json=item.body, timeout=60)
        assert r.status_code == 200 and wire.answer_text(r.json(), item.route) == item.want
        running.idle(10)
    lat = np.asarray(tally.latencies)
    gone = wire.counter(metrics, "servecore_client_disconnects_total")
    print(f"\n{type(engine).__module__}: {CLIENTS} clients, {wall:.1f} s: "
          f"{len(lat)} answers read whole ({tally.streamed} streamed), {tally.left} left "
          f"({gone:.0f} while answered), latency p50 {np.percentile(lat, 50):.3f} s, "
          f"p99 {np.percentile(lat, 99):.3f} s, max {lat.max():.3f} s; "
          f"{json.dumps({k: round(v, 3) for k, v in _stats(engine).items()})}")
    assert not tally.wrong, f"{len(tally.wrong)} wrong answers, e.g. {tally.wrong[:3]}"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]
    leavers = len(range(0, CLIENTS, 4))  # each client makes at least one request
    assert len(lat) >= CLIENTS - leavers and tally.left >= leavers and gone > 0
    wire.assert_no_leak(engine)


def _stats(engine) -> dict[str, float]:
    s = engine.stats
    return {"requests": s.requests, "hit_rate": s.hit_rate, "decode_tokens": s.decode_tokens}
