"""``EngineWorker``: the one loop that drives an engine for the server, on the engine's thread.

The event loop never calls the engine. It hands the worker jobs through a thread-safe queue
(``submit`` a request, ``cancel`` a generation) and the worker hands back what happened
through each generation's ``asyncio.Queue`` (``loop.call_soon_threadsafe``): the request's id
once it is accepted, an ``APIError`` when the engine refuses it, then its
``servecore.engine.Event``\\ s. Between two rounds the worker takes every job that arrived, so
a cancel lands before the next round runs: a client that left stops costing work within one
scheduling round, and what its request held is freed at once.

The worker runs the engine's ``step_events`` while any request is unfinished and sleeps on the job
queue otherwise. A round that raises is a fault of the engine, not of a request: the requests
it dropped end with their error (500) and the worker goes on serving; after
``MAX_FAILED_ROUNDS`` failures in a row every request still running ends with the error, so a
fault that repeats cannot spin forever.

Where the loop runs is the engine's to say: ``engine.start_thread(target, name)`` when it has
one. An ``mlxcache.Engine`` runs it on the thread that owns its MLX work (``servecore.thread``),
so every call of a round runs inline, with no hand-over between two threads per call; there
the loop also runs the calls other threads hand that thread (``close``, ``reset_cache``, a
``generate`` beside the server) between rounds and while it idles, and it ends when the
engine is closed (what it still holds, and every later submit, gets a 503). hybridattn's
engine has no such thread: the loop gets a thread of its own (``EngineClient.start_thread``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from servecore.client import EngineClient
from servecore.engine import Event
from servecore.errors import EngineClosedError, InvalidRequest
from servecore.server._errors import APIError
from servecore.thread import OwnerThread, current_owner

__all__ = ["MAX_FAILED_ROUNDS", "EngineWorker", "Generation"]

MAX_FAILED_ROUNDS = 3
"""Rounds that may fail in a row before every running request ends with the error."""

log = logging.getLogger("servecore.server")

_ENDED = "the engine is closed: the server serves no more requests"


class Generation:
    """One HTTP request's requests to the engine (its ``n`` choices), on the event loop side:
    ``queue`` receives ``(choice, item)`` with item the request id (accepted), an
    ``APIError`` (refused or failed) or an ``Event``; ``submitted_at`` and ``first_at`` time
    it (``time.perf_counter``).

    >>> Generation(asyncio.new_event_loop(), 2).rids
    {}
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1,
                 prompt_field: str = "prompt"):
        self.loop = loop
        self.n = n
        self.prompt_field = prompt_field  # what the API calls the prompt, for errors
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.rids: dict[int, int] = {}  # choice -> request id (the worker's side)
        self.cancelled = False  # the worker's side
        self.submitted_at = time.perf_counter()
        self.first_at: float | None = None


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[Generation, int, Any]]
               ) -> None:
    """Put ``items`` into their generations' queues on ``loop``: one wake-up for them all."""
    def put_all() -> None:
        for gen, choice, item in items:
            gen.queue.put_nowait((choice, item))

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop is closed: nobody is listening
        pass


class EngineWorker:
    """Drives ``engine`` (a ``servecore.client.EngineClient``) on the engine's thread or on
    its own (see the module docstring). ``max_waiting`` bounds the requests accepted but not
    started (no first token yet): ``reserve`` refuses more with a 429.

    >>> from servecore.testing import FakeEngine
    >>> worker = EngineWorker(FakeEngine(), max_waiting=4)
    >>> worker.start(); worker.waiting
    0
    >>> worker.stop()
    """

    def __init__(self, engine: EngineClient, *, max_waiting: int = 256):
        self.engine = engine
        self.max_waiting = max_waiting
        self._jobs: queue.SimpleQueue[tuple[str, Generation | None, Any]] = queue.SimpleQueue()
        self._live: dict[int, tuple[Generation, int]] = {}  # rid -> (generation, choice)
        self._outbox: list[tuple[Generation, int, Any]] = []  # handed over after each batch
        self._unstarted: set[int] = set()  # live requests without a first token
        self._lock = threading.Lock()
        self._waiting = 0  # reserved and not started (loop and worker both count)
        self.running = 0  # requests accepted and not finished (the worker's count)
        self.failed_rounds = 0
        self._thread: Any = None  # what start_thread returned: is_alive(), join(timeout)
        self._owner: OwnerThread | None = None  # the owner thread the loop runs on, if any
        self._ended = False  # the loop returned: later submits are refused (under _lock)

    @property
    def alive(self) -> bool:
        """Whether the loop runs (started, and neither stopped nor ended by the engine's
        close)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        """Requests reserved (queued here or in the engine) that have no first token yet."""
        return self._waiting

    def reserve(self, count: int, force: bool = False) -> None:
        """Count ``count`` requests as waiting, or refuse them (429) when that would put more
        than ``max_waiting`` in the queue (``force``: count them anyway, for the later
        choices of a generation already accepted). ``submit`` follows for each."""
        with self._lock:
            if not force and self._waiting + count > self.max_waiting:
                raise APIError(429, f"the server's queue is full ({self._waiting} requests "
                               f"waiting, --max-queue={self.max_waiting}): retry later",
                               code="queue_full")
            self._waiting += count

    def release(self, count: int) -> None:
        """Give back ``count`` reservations that were never submitted."""
        if count > 0:
            self._started(count)

    def _started(self, count: int = 1) -> None:
        with self._lock:
            self._waiting = max(0, self._waiting - count)

    # ------------------------------------------------------------ the loop's calls ----

    def start(self) -> None:
        """Start the loop where the engine's ``start_thread`` puts it (default: a thread of
        its own)."""
        self._thread = self.engine.start_thread(self._serve, "servecore-engine")

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the job queue's work, end the loop (requests still running are aborted)
        and wait for it."""
        self._put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, gen: Generation, choice: int, tokens: list[int], max_tokens: int,
               **sampling: Any) -> None:
        """Queue choice ``choice`` of ``gen`` (reserved with ``reserve`` first); once the
        loop has ended it is refused at once (503)."""
        with self._lock:
            if not self._ended:
                self._put(("submit", gen, (choice, tokens, max_tokens, sampling)))
                return
        self._started()
        _hand_over(gen.loop, [(gen, choice, APIError(503, _ENDED))])

    def cancel(self, gen: Generation) -> None:
        """Abort every request of ``gen`` (the client left, or a stop string ended it)."""
        self._put(("cancel", gen, None))

    def cancel_choice(self, gen: Generation, choice: int) -> None:
        """Abort choice ``choice`` of ``gen`` alone (a stop string ended it)."""
        self._put(("cancel", gen, choice))

    def _put(self, job: tuple[str, Generation | None, Any]) -> None:
        self._jobs.put(job)
        owner = self._owner
        if owner is not None:  # the loop may be waiting in the owner's queue: wake it
            owner.wake()

    # --------------------------------------------------------------- the thread ----

    def _serve(self) -> None:
        """The loop (module docstring); on the way out, whatever ended it, every request it
        holds or that is queued ends with a 503."""
        self._owner = current_owner()
        try:
            self._loop()
        finally:
            with self._lock:
                self._ended = True  # no submit is queued after this
            self._owner = None
            self._refuse_queued()
            self._flush()

    def _loop(self) -> None:
        while True:
            jobs = self._take_jobs(block=not self._live)
            if jobs is None:  # the engine closed its thread under the loop
                self._abort_all(APIError(503, _ENDED), engine=False)
                return
            for kind, gen, arg in jobs:
                if kind == "stop":
                    self._abort_all(APIError(503, "the server is shutting down"))
                    return
                try:
                    if kind == "submit":
                        self._submit(gen, *arg)
                    else:
                        self._cancel(gen, arg)
                except Exception as e:  # a fault, not the request's: it alone fails
                    log.exception("a %s job failed", kind)
                    if kind == "submit" and arg[0] not in gen.rids:
                        self._started()  # its reservation
                    self._post(gen, arg[0] if kind == "submit" else 0,
                            APIError(500, f"the engine failed: {e!r}"))
            self._flush()  # acceptances now: a stream's headers need not wait for the round
            if self._live:
                if not self._round():
                    return
                self._flush()

    def _take_jobs(self, block: bool) -> list[tuple[str, Generation | None, Any]] | None:
        """Every job queued; with ``block``, waiting for one first. On the owner thread the
        owner's queued calls run here too, and None says the owner is closing."""
        owner = self._owner
        if owner is not None:
            if not owner.serve_calls():
                return None
            while block and self._jobs.empty():  # (a job's put wakes the wait)
                if not owner.serve_calls(timeout=None):
                    return None
        jobs = []
        if block and owner is None:
            jobs.append(self._jobs.get())
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _refuse_queued(self) -> None:
        """Answer every job left in the queue: a submit is refused (503)."""
        while True:
            try:
                kind, gen, arg = self._jobs.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._started()
                self._post(gen, arg[0], APIError(503, _ENDED))

    def _submit(self, gen: Generation, choice: int, tokens: list[int], max_tokens: int,
                sampling: dict[str, Any]) -> None:
        if gen.cancelled:
            self._started()
            return
        try:
            rid = self.engine.add_request(tokens, max_tokens, **sampling)
        except InvalidRequest as e:  # the engine's own checks: the prompt's length, say
            self._started()
            field = gen.prompt_field if e.field == "prompt" else e.field
            self._post(gen, choice, APIError(400, str(e), param=field))
            return
        except EngineClosedError as e:
            self._started()
            self._post(gen, choice, APIError(503, str(e)))
            return
        gen.rids[choice] = rid
        self._live[rid] = (gen, choice)
        self._unstarted.add(rid)
        self.running += 1
        self._post(gen, choice, rid)

    def _cancel(self, gen: Generation, choice: int | None) -> None:
        if choice is None:
            gen.cancelled = True
        for c, rid in list(gen.rids.items()):
            if (choice is None or c == choice) and rid in self._live:
                self.engine.abort(rid)
                self._end(rid)

    def _end(self, rid: int) -> None:
        """Forget live request ``rid`` (finished or aborted)."""
        self._live.pop(rid)
        self.running -= 1
        if rid in self._unstarted:
            self._unstarted.discard(rid)
            self._started()

    def _post(self, gen: Generation, choice: int, item: Any) -> None:
        self._outbox.append((gen, choice, item))

    def _flush(self) -> None:
        """Hand what this pass made to the event loop(s): one wake-up per loop."""
        by_loop: dict[Any, list] = {}
        for entry in self._outbox:
            by_loop.setdefault(entry[0].loop, []).append(entry)
        self._outbox = []
        for loop, items in by_loop.items():
            _hand_over(loop, items)

    def _round(self) -> bool:
        """One round, its events to their generations; False when the loop must end (the
        engine closed its owner thread under it)."""
        try:
            events = self.engine.step_events()
        except EngineClosedError as e:  # closed: no round will run again
            on_owner = self._owner is not None
            self._abort_all(APIError(503, str(e)), engine=not on_owner)
            return not on_owner
        except Exception as e:  # a fault of the engine: it named the requests it dropped
            self.failed_rounds += 1
            log.exception("a round failed (%d in a row)", self.failed_rounds)
            if self.failed_rounds >= MAX_FAILED_ROUNDS:
                self._abort_all(APIError(500, f"the engine failed: {e!r}"))
            return True
        self.failed_rounds = 0
        for ev in events:
            self._deliver(ev)
        return True

    def _deliver(self, ev: Event) -> None:
        live = self._live.get(ev.rid)
        if live is None:
            return
        gen, choice = live
        if ev.rid in self._unstarted:
            self._unstarted.discard(ev.rid)
            self._started()
        if ev.error is not None:
            self._post(gen, choice, APIError(500, f"the engine failed serving this request: "
                                     f"{ev.error!r}"))
        else:
            self._post(gen, choice, ev)
        if ev.finished:
            self._end(ev.rid)

    def _abort_all(self, error: APIError, engine: bool = True) -> None:
        """End every live request with ``error`` (``engine``: abort each in the engine too;
        not while the engine's closer holds it and waits for this thread to end)."""
        for rid, (gen, choice) in list(self._live.items()):
            if engine:
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
            self._end(rid)
            self._post(gen, choice, error)


