"""What the disconnect and load tests share: hand-written HTTP/1.1 requests on raw sockets,
the engines' leak checks, a slowed engine, and the server's counters.

A raw socket is the one client that can leave at an exact point (after the headers, after
the first event, in the middle of a prefill) without a library retrying or draining first.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np


def request_bytes(path: str, body: dict[str, Any]) -> bytes:
    """A complete ``POST path`` request with the JSON ``body``."""
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n")
    return head.encode() + raw


def send(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A socket to the server on ``port`` that has sent the whole request."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(request_bytes(path, body))
    return sock


def read_until(sock: socket.socket, done, timeout: float = 30.0) -> bytes:
    """Bytes read from ``sock`` until ``done(bytes so far)`` (AssertionError on a timeout or
    the server closing first)."""
    buf, end = b"", time.monotonic() + timeout
    while not done(buf):
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            more = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"timed out waiting; read so far: {buf[:400]!r}") from None
        if not more:
            raise AssertionError(f"the server closed first; read: {buf[:400]!r}")
        buf += more
    return buf


def close(sock: socket.socket, reset: bool = False) -> None:
    """Leave: an orderly close (FIN), or with ``reset`` a connection reset (RST)."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def sse_texts(body: bytes, route: str) -> list[str]:
    """The text of each choice a stream of ``route`` carried (its events' deltas, joined)."""
    out: dict[int, str] = {}
    for line in body.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("type") == "content_block_delta":  # /v1/messages
            out[0] = out.get(0, "") + event["delta"]["text"]
        for choice in event.get("choices", []):
            delta = (choice["delta"].get("content") if route == "/v1/chat/completions"
                     else choice.get("text"))
            out[choice["index"]] = out.get(choice["index"], "") + (delta or "")
    return [out[i] for i in sorted(out)]


def answer_texts(body: dict[str, Any], route: str) -> list[str]:
    """The text of each choice of a whole (non-streamed) answer of ``route``."""
    if route == "/v1/messages":
        return ["".join(b["text"] for b in body["content"] if b["type"] == "text")]
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if route == "/v1/chat/completions":
        return [c["message"]["content"] for c in choices]
    return [c["text"] for c in choices]


def answer_text(body: dict[str, Any], route: str) -> str:
    """The text of a whole answer's first choice."""
    return answer_texts(body, route)[0]


def counter(metrics_text: str, name: str) -> float:
    """The value of the unlabelled metric ``name`` in ``/metrics``' text."""
    m = re.search(rf"^{name} (\S+)$", metrics_text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def random_words(rng: np.random.Generator, vocab_size: int, n: int) -> str:
    """``n`` random words of the word tokenizer (``w6`` and up: no special token)."""
    return " ".join(f"w{int(i)}" for i in rng.integers(6, vocab_size, n))


@contextlib.contextmanager
def slowed(engine: Any, seconds: float) -> Iterator[None]:
    """Every engine round takes ``seconds`` longer for the block (the worker's
    ``engine.step_events``), so that a client can leave at a known point of a generation."""
    step = engine.step_events

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step_events = slow_step
    try:
        yield
    finally:
        del engine.step_events


def generated(engine: Any) -> int:
    """Tokens the engine has produced so far (each prompt's first, and every decoded one)."""
    return engine.stats.requests + engine.stats.decode_tokens


def wait_for(cond, timeout: float = 10.0, what: str = "the condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen in {timeout} s")
        time.sleep(0.002)


def assert_no_leak(engine: Any) -> None:
    """Idle ``engine``: every token slot (and recurrent-state snapshot) is free or held by
    the prefix cache, none by a request that is gone."""
    if hasattr(engine, "capacity"):  # hybridattn
        from harness import assert_whole

        assert not engine.has_unfinished()
        assert engine.num_free_slots + engine.num_cached_slots == engine.capacity, (
            engine.num_free_slots, engine.num_cached_slots, engine.capacity)
        assert_whole(engine)  # (resets the prefix cache at the end)
        if engine.tree is not None:  # and with the cache gone every snapshot slot is free
            slots = engine.scheduler.snapshot_slots
            assert engine.tree.num_states == 0 and slots.num_free == slots.capacity
        states = engine.state.req_to_token_pool.state_allocator
        assert int(states.num_free) == states.capacity, "a request's state slot leaked"
        return
    tree = engine.tree  # mlxcache: slot 0 is the padding sink
    assert not engine.has_unfinished() and not engine.core.jobs, "a request outlived its client"
    assert engine.num_free_slots + tree.total_size == engine.num_slots - 1, (
        engine.num_free_slots, tree.total_size, engine.num_slots)
    assert tree.protected_size == 0, "a prefix lock outlived its request"
    if engine.has_states:
        assert engine.num_free_snapshots + tree.num_states == engine.num_snapshots - 1
