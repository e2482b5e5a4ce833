"""``Streams``: the multi-user contract of both engines, written once over an ``EngineCore``.

The contract with callers:

- Any number of ``generate``, ``stream`` and ``add_request`` / ``step`` users may be
  interleaved in one thread (a ``generate`` inside a loop over a stream, two streams read
  alternately, ``step`` calls while a stream is open). Each request's tokens go to the outbox
  of whoever asked for them, whoever ran the round that made them: a stream yields its own
  requests' tokens, ``step`` returns those of requests queued with ``add_request``. Reading
  any stream advances every open request, so no request waits on a stream nobody reads, and
  each stream ends when its own requests end.
- ``abort`` is safe at any point outside a round, for a waiting or a running request (a stream
  that owns it then ends that request without more tokens). A stream closed early
  (``close()``, ``break`` out of a ``with`` block, or garbage-collected) aborts what is left
  of it; one dropped while a round runs is aborted by the next round.
- Calls from several threads are serialized by one lock, a round at a time; a call from inside
  a round (a model or tokenizer calling back into the engine) is refused.
- ``close()`` ends the engine, from any thread, idempotently: it waits for the call under way
  (the lock), then the core releases everything it holds (``EngineCore.close``). A stream
  still unfinished then yields the tokens made before the close and raises
  ``servecore.errors.EngineClosedError`` (a clear end, never a silently short answer); every
  later call (``generate``, ``stream``, ``add_request``, ``step``, ``abort``,
  ``has_unfinished``, ``serialized``) raises it too, naming the engine. Closing a stream
  of a closed engine is a no-op.
- A round that fails raises in the call that ran it. A core that drops the requests it was
  serving says which (a core whose rounds are transactions drops none: they run again): a
  stream that owned a dropped request raises ``RuntimeError`` (caused by it) once its queued
  tokens are read; ``step`` reports each as ``(rid, None, True)``. Nothing else is lost:
  every other request goes on.

``servecore.testing.FakeCore`` makes each request's tokens without a model, one a round:

>>> from servecore.requests import RequestBuilder
>>> from servecore.testing import FakeCore
>>> streams = Streams(FakeCore(), RequestBuilder(vocab_size=32))
>>> streams.generate([[1], [2]], [2, 3])
[[1, 8], [2, 9, 16]]
>>> streams.add_request([3], 2)  # request ids count up from 0 over every call
2
>>> list(streams.stream([[4]], 1))  # its round made request 2's first token too
[(0, 4)]
>>> streams.step()  # that token, then the token of the round step ran
[(2, 3, False), (2, 10, True)]
>>> streams.has_unfinished()
False
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from servecore.engine import EngineCore, Event
from servecore.errors import EngineClosedError
from servecore.progress import progress_bar
from servecore.prompts import check_text, decode
from servecore.requests import DEFAULT_MAX_TOKENS, GenerationRequest, RequestBuilder
from servecore.thread import current_owner, in_handed_call

__all__ = ["Stream", "Streams"]


class Streams:
    """The shared front of an engine: request ids, outboxes, and the calls users make (see the
    module docstring). ``core`` runs the rounds; ``build`` makes checked requests; ``name``
    names the engine in ``EngineClosedError``.

    >>> from servecore.requests import RequestBuilder
    >>> from servecore.testing import FakeCore
    >>> streams = Streams(FakeCore(), RequestBuilder(vocab_size=32))
    >>> rid = streams.add_request([1, 2], 3)
    >>> [streams.step() for _ in range(3)]
    [[(0, 3, False)], [(0, 10, False)], [(0, 17, True)]]
    """

    def __init__(self, core: EngineCore, build: RequestBuilder, *, name: str = "the engine"):
        self.core = core
        self.build = build
        self.name = name
        self._closed = False
        self._lock = threading.RLock()
        self._next_rid = 0
        self._requests: dict[int, GenerationRequest] = {}  # undelivered to their owner yet
        self._owner: dict[int, deque[Event]] = {}  # rid -> the outbox its events go to
        self._steps: deque[Event] = deque()  # the outbox of add_request's requests
        self._in_round = False
        self._depth = 0  # calls inside the lock (a finalizer must not cut into one)
        self._orphans: deque[int] = deque()  # rids of streams dropped while the lock was held

    # ------------------------------------------------------------------ requests ----

    def add_request(self, prompt: Any, max_tokens: Any = DEFAULT_MAX_TOKENS, *,
                    temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                    stop_token_ids: Any = None, logprobs: Any = None) -> int:
        """Queue one request; returns its id. ``step`` returns its tokens (``step_events``
        with their ``logprobs`` when it asked for them). The arguments are those of
        ``servecore.requests``."""
        with self._entered():
            req = self.build.one(prompt, max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
                                 logprobs=logprobs)
            return self._submit([req], self._steps)[0]

    def stream(self, prompts: Any, max_tokens: Any = DEFAULT_MAX_TOKENS, *,
               temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
               stop_token_ids: Any = None, progress: bool = False) -> Stream:
        """Queue one request per prompt (all checked before any is queued) and return the
        ``Stream`` of their ``(prompt index, token)``; iterating it advances the engine.
        ``max_tokens`` and each sampling argument is one value or one per prompt
        (``servecore.requests``); ``progress`` draws a tqdm bar of the tokens on stderr when it
        is a terminal."""
        with self._entered():
            reqs = self.build(prompts, max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, stop_token_ids=stop_token_ids)
            stream = Stream(self, reqs, progress)
            stream._rids = self._submit(reqs, stream._events)
            stream._left = set(stream._rids)
            return stream

    def generate(self, prompts: Any, max_tokens: Any = DEFAULT_MAX_TOKENS, *,
                 temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                 stop_token_ids: Any = None, progress: bool = False, text: bool = False
                 ) -> list[list[int]] | list[str]:
        """The new tokens of each prompt (a stop token, when hit, is the last), or with
        ``text=True`` their text without the stop token that ended them. The arguments are
        ``stream``'s."""
        check_text(text, self.build.tokenizer)
        stream = self.stream(prompts, max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
                             progress=progress)
        outs: list[list[int]] = [[] for _ in range(stream.num_prompts)]
        with stream:
            for i, token in stream:
                outs[i].append(token)
        if text:
            return [decode(self.build.tokenizer, o, r.stop)
                    for o, r in zip(outs, stream.requests, strict=True)]
        return outs

    def _submit(self, reqs: list[GenerationRequest], outbox: deque[Event]) -> list[int]:
        rids = list(range(self._next_rid, self._next_rid + len(reqs)))
        self._next_rid += len(reqs)
        for rid, req in zip(rids, reqs, strict=True):
            self._requests[rid] = req
            self._owner[rid] = outbox
            self.core.submit(rid, req)
        return rids

    # -------------------------------------------------------------------- rounds ----

    def step(self) -> list[tuple[int, int | None, bool]]:
        """One round; returns ``(request id, token, finished)`` for every token of the
        requests queued with ``add_request`` not returned yet, whoever's round made it
        (``token`` None: the request ended without one, dropped by a failed round). A round
        that raises returns nothing: what it and earlier rounds made stays queued, and the
        next ``step`` returns it."""
        return [(ev.rid, ev.token, ev.finished) for ev in self.step_events()]

    def step_events(self) -> list[Event]:
        """``step``, its tokens as the core's ``Event``\\ s (a request's first one says how
        many prompt tokens the prefix cache served; a dropped request's last one names the
        error): what a server needs beside the tokens."""
        with self._entered():
            self._round()
            events = list(self._steps)
            self._steps.clear()
            for ev in events:
                if ev.finished:
                    self._delivered(ev.rid)
            return events

    def abort(self, rid: int) -> bool:
        """End request ``rid`` (waiting or running; what it holds is freed at once); its
        tokens not received yet are dropped. Whether it was unfinished or had such tokens."""
        with self._entered():
            box = self._owner.get(rid)
            dropped = False
            if box is not None:
                kept = [ev for ev in box if ev.rid != rid]
                dropped = len(kept) != len(box)
                box.clear()
                box.extend(kept)
            live = self.core.cancel(rid)
            if box is None:
                return live
            if box is self._steps:
                self._delivered(rid)
            else:
                box.append(Event(rid, None, True))  # the stream ends it without a token
            return live or dropped

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or has tokens in flight."""
        with self._entered():
            self._reap_orphans()
            return self.core.has_work()

    def _round(self) -> bool:
        """One round of the core, its events routed to their owners' outboxes."""
        self._reap_orphans()
        self._in_round = True
        try:
            return self.core.run_round(self._route)
        finally:
            self._in_round = False

    def _route(self, ev: Event) -> None:
        box = self._owner.get(ev.rid)
        if box is not None:  # else aborted: its tokens go nowhere
            box.append(ev)

    def _delivered(self, rid: int) -> None:
        self._owner.pop(rid, None)
        self._requests.pop(rid, None)

    def _reap_orphans(self) -> None:
        while self._orphans:
            rid = self._orphans.popleft()
            self._delivered(rid)
            self.core.cancel(rid)

    def _entered(self, closed_ok: bool = False) -> _Entered:
        return _Entered(self, closed_ok)

    # ------------------------------------------------------------------- closing ----

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def close(self) -> None:
        """End the engine (the module docstring): after the call under way, the core releases
        everything it holds (``EngineCore.close``); unfinished streams raise
        ``EngineClosedError`` once their tokens are read; later calls raise it. Idempotent,
        from any thread; refused from inside a round.

        >>> from servecore.requests import RequestBuilder
        >>> from servecore.testing import FakeCore
        >>> streams = Streams(FakeCore(), RequestBuilder(vocab_size=32), name="demo")
        >>> s = streams.stream([[1]], 3)
        >>> next(s)
        (0, 1)
        >>> streams.close(); streams.close(); streams.core.closed
        True
        >>> next(s)
        Traceback (most recent call last):
        ...
        servecore.errors.EngineClosedError: demo was closed before request(s) [0] of this stream ...
        >>> streams.step()
        Traceback (most recent call last):
        ...
        servecore.errors.EngineClosedError: demo is closed: build a new engine
        """
        with self._entered(closed_ok=True):
            if self._closed:
                return
            self._closed = True
            self._owner.clear()
            self._requests.clear()
            self._steps.clear()
            self._orphans.clear()
            self.core.close()

    def closed_error(self) -> EngineClosedError:
        """The error a call to the closed engine raises (it names the engine)."""
        return EngineClosedError(f"{self.name} is closed: build a new engine")

    def serialized(self) -> _Entered:
        """The engine's lock, for work outside rounds that must not interleave with them (a
        cache reset, reading consistent stats): ``with streams.serialized(): ...``; refused
        from inside a round and once closed (``EngineClosedError``)."""
        return _Entered(self)


_REENTERED = ("the engine was called from inside one of its own steps (by the model or the "
              "tokenizer?); it serves one step at a time")


class _Entered:
    """The lock, refusing a call from inside a round (the model or the tokenizer calling
    back): a round must not start inside another; and, unless ``closed_ok``, a call to a
    closed engine."""

    def __init__(self, streams: Streams, closed_ok: bool = False):
        self._streams = streams
        self._closed_ok = closed_ok

    def __enter__(self) -> None:
        s = self._streams
        # A callback on the core's owner thread (``servecore.thread``) in a round another
        # thread handed it: the lock is held by that thread, waiting for the round, so
        # refuse before waiting on it. (In a round the owner runs for itself, the lock is
        # its own: the check after taking it refuses.)
        owner = current_owner()
        on_owner = owner is not None and owner is getattr(s.core, "owner", None)
        if s._in_round and on_owner and in_handed_call():
            raise RuntimeError(_REENTERED)
        if on_owner:  # a loop on the owner thread (the server's): the lock's holder may be
            owner.acquire(s._lock)  # waiting on a call only this thread can run
        else:
            s._lock.acquire()
        if s._in_round:
            s._lock.release()
            raise RuntimeError(_REENTERED)
        if s._closed and not self._closed_ok:
            s._lock.release()
            raise s.closed_error()
        s._depth += 1

    def __exit__(self, *exc: Any) -> None:
        self._streams._depth -= 1
        self._streams._lock.release()


class Stream(Iterator[tuple[int, int]]):
    """What ``Streams.stream`` returns: ``(prompt index, token)`` of its own requests in the
    order they were made, running rounds when it has none buffered. It ends when each of its
    requests has finished or was aborted; ``close()`` (also on leaving a ``with`` block, or
    when the stream is garbage-collected) aborts what is left.

    >>> from servecore.requests import RequestBuilder
    >>> from servecore.testing import FakeCore
    >>> streams = Streams(FakeCore(), RequestBuilder(vocab_size=32))
    >>> with streams.stream([[1], [2]], 3) as s:
    ...     first = next(s)
    >>> first, s.request_ids, streams.has_unfinished()  # leaving the block aborted the rest
    ((0, 1), [0, 1], False)
    """

    def __init__(self, streams: Streams, requests: list[GenerationRequest], progress: bool):
        self._streams = streams
        self.requests = requests
        self._rids: list[int] = []
        self._left: set[int] = set()
        self._events: deque[Event] = deque()
        self._error: BaseException | None = None
        self._lost: list[int] = []
        self._got = [0] * len(requests)
        total = sum(r.max_tokens for r in requests)
        self._bar = (progress_bar(total=total, unit="tok", desc="generating", leave=False)
                     if progress else None)

    @property
    def num_prompts(self) -> int:
        """How many prompts the stream serves."""
        return len(self.requests)

    @property
    def request_ids(self) -> list[int]:
        """The engine's request id of each prompt, in prompt order (for ``abort``)."""
        return list(self._rids)

    def describe(self, text: str) -> None:
        """Name what the progress bar counts (no effect without one)."""
        if self._bar is not None:
            self._bar.set_description(text)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> tuple[int, int]:
        s = self._streams
        while True:
            with s._entered(closed_ok=True):
                got = self._take()
                if got is not None:
                    return got
                if not self._left:
                    self._end()
                    if self._error is not None:
                        raise RuntimeError(
                            f"request(s) {self._lost} of this stream were dropped: a step "
                            f"serving them failed ({self._error!r})") from self._error
                    raise StopIteration
                if s._closed:
                    left, self._left = sorted(self._left), set()
                    self._end()
                    raise EngineClosedError(
                        f"{s.name} was closed before request(s) "
                        f"{[rid - self._rids[0] for rid in left]} of this stream finished")
                if not s._round() and not self._events:  # a bug, never a user error
                    raise RuntimeError(f"the engine has nothing to run but requests "
                                       f"{sorted(self._left)} of this stream are unfinished")

    def _take(self) -> tuple[int, int] | None:
        """The next buffered token, settling the ends and failures before it."""
        while self._events:
            ev = self._events.popleft()
            i = ev.rid - self._rids[0]
            if ev.finished:
                self._left.discard(ev.rid)
                self._streams._delivered(ev.rid)
                if self._bar is not None:
                    self._bar.update(self.requests[i].max_tokens - self._got[i]
                                     - (ev.token is not None))
            if ev.error is not None and self._error is None:
                self._error = ev.error
            if ev.error is not None:
                self._lost.append(i)
            if ev.token is not None:
                self._got[i] += 1
                if self._bar is not None:
                    self._bar.update(1)
                return i, ev.token
        return None

    def close(self) -> None:
        """Abort this stream's unfinished requests and stop yielding (on a closed engine:
        stop yielding)."""
        s = self._streams
        with s._entered(closed_ok=True):
            left, self._left = sorted(self._left), set()
            if s._closed:
                left = []
            failed: BaseException | None = None
            for rid in left:  # every one, even after a cancel failed: none is left orphaned
                s._delivered(rid)
                try:
                    s.core.cancel(rid)
                except BaseException as e:  # noqa: BLE001 - raised below, once all are gone
                    failed = failed or e
            self._events.clear()
            self._end()
            if failed is not None:
                raise failed

    def _end(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer may run anywhere, inside a call of this thread or another included:
        # abort now only when the lock is free without waiting and no call is under way
        # (the lock is reentrant); otherwise the next round (or has_unfinished) aborts what
        # is left.
        try:
            s = self._streams
            if not self._left or s._closed:
                return
            if s._lock.acquire(blocking=False):
                try:
                    if not s._depth:
                        self.close()
                        return
                finally:
                    s._lock.release()
            s._orphans.extend(self._left)
        except Exception:  # interpreter shutdown
            pass
