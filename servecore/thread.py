"""``OwnerThread``: one thread that alone runs an engine's device work; ``ThreadedCore``: an
``EngineCore`` whose every call runs there, whichever thread makes it.

Why: MLX keeps per-thread state in C++ ``thread_local`` storage (the thread's streams, its
random key and the cache of ``mx.compile``'s traces, which holds Python objects). A thread
that ran a compiled function (mlx-lm compiles its activations) destroys that cache when the
operating system ends the thread, after Python has already counted the thread as joined; if
the interpreter is finalizing by then, the destructor cannot take the GIL, the thread is
unwound from a ``noexcept`` frame and the process dies of SIGABRT ("terminate called without
an active exception"), about half the time. A thread that clears its MLX state before it
ends (``mx.clear_streams()``) exits cleanly. Users' threads cannot be made to do that, so an
engine keeps MLX off them: its core lives on a thread the engine owns, every call is handed
to it, and the thread runs ``on_exit`` (``mx.clear_streams``) last when it is closed, by
``close()``, by the finalizer of an engine that was dropped, or at interpreter exit.

The owner thread is a daemon (an engine never closed does not keep the process alive), and
every owner thread still open at interpreter exit is closed by an ``atexit`` hook, which
Python runs after joining the users' threads and before it tears the interpreter down.

A loop that drives the engine (the server's worker) runs best on the owner thread itself
(``OwnerThread.start``): then the engine's calls run inline, with no hand-over per call. Such
a loop keeps the thread's other callers served by running their calls between its own
steps (``serve_calls``) and while it waits for a lock (``acquire``).

>>> owner = OwnerThread("example")
>>> owner.call(lambda: threading.current_thread().name)
'example'
>>> owner.close(); owner.closed
True
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from servecore.engine import EngineCore, Event
from servecore.errors import EngineClosedError
from servecore.requests import GenerationRequest

__all__ = ["LOCK_POLL_S", "OwnerTask", "OwnerThread", "ThreadedCore", "current_owner",
           "daemon_thread", "in_handed_call"]

log = logging.getLogger("servecore.thread")
_local = threading.local()  # .owner: the OwnerThread this thread is; .handed: in a call
_open: weakref.WeakSet[OwnerThread] = weakref.WeakSet()  # closed at interpreter exit


def current_owner() -> OwnerThread | None:
    """The ``OwnerThread`` the calling thread is, or None (a call from there must not wait on
    a lock held by a thread that waits on it).

    >>> current_owner() is None
    True
    >>> owner = OwnerThread()
    >>> owner.call(current_owner) is owner
    True
    """
    return getattr(_local, "owner", None)


def in_handed_call() -> bool:
    """Whether the calling thread is an owner thread running a call another thread handed it
    (that thread may hold a lock it waits on; a loop ``start`` runs is not such a call).

    >>> owner = OwnerThread()
    >>> in_handed_call(), owner.call(in_handed_call)
    (False, True)
    """
    return getattr(_local, "handed", 0) > 0


LOCK_POLL_S = 0.001
"""``OwnerThread.acquire``: how long it waits for the lock between two looks at the queue
(only while another thread holds the lock: a call that thread hands over waits this long at
most before it runs)."""


def daemon_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """``target`` started on a new daemon thread named ``name``: where a loop runs when the
    engine it drives has no thread of its own (``OwnerThread.start`` is the other place).

    >>> t = daemon_thread(lambda: None, "example"); t.join(); t.is_alive()
    False
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class _Call:
    """One call handed to the owner thread, and its outcome (``task``: nobody waits for the
    outcome, ``OwnerThread.start``)."""

    __slots__ = ("args", "done", "error", "fn", "result", "task")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], task: bool = False):
        self.fn, self.args, self.task = fn, args, task
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


_WAKE = _Call(lambda: None, ())  # queued by ``wake``: ends a wait in ``serve_calls``; never run


class OwnerTask:
    """A long function ``OwnerThread.start`` runs on the owner thread; joined like a thread.

    >>> owner = OwnerThread()
    >>> task = owner.start(lambda: None, "example")
    >>> task.join(5); task.is_alive(), task.name
    (False, 'example')
    >>> owner.close()
    """

    def __init__(self, call: _Call, name: str):
        self._call = call
        self.name = name

    def is_alive(self) -> bool:
        """Whether it has not returned yet (queued or running)."""
        return not self._call.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until it returns, ``timeout`` seconds at most (None: no limit)."""
        self._call.done.wait(timeout)


class OwnerThread:
    """A daemon thread that runs the calls given to ``call``, one at a time in order, and
    ``on_exit()`` last, on itself, when ``close()`` ends it.

    Args:
        name: the thread's name.
        on_exit: called on the thread after its last call (``mx.clear_streams`` for MLX).

    ``call`` from the owner thread itself runs the function at once. ``close()`` is
    idempotent and safe from any thread (from the owner thread it only asks the thread to
    end); later ``call``s raise ``EngineClosedError``.

    ``start(target)`` runs a long function there instead (a loop that drives the engine): it
    must call ``serve_calls`` between its steps and while it idles, or every other caller
    waits until it returns; ``serve_calls`` returning False means the thread is closing and
    the function must return.

    >>> seen = []
    >>> owner = OwnerThread("worker", on_exit=lambda: seen.append("exit"))
    >>> owner.call(pow, 2, 10), owner.call(current_owner) is owner
    (1024, True)
    >>> owner.close(); owner.close(); seen
    ['exit']
    """

    def __init__(self, name: str = "servecore-owner",
                 on_exit: Callable[[], Any] | None = None):
        self.name = name
        self._on_exit = on_exit
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._last: list[Callable[[], Any]] = []  # ``at_close``: run before ``on_exit``
        self._thread = threading.Thread(target=_serve, args=(self, self._queue, on_exit,
                                                             self._last),
                                        name=name, daemon=True)
        self._thread.start()
        _open.add(self)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def thread(self) -> threading.Thread:
        """The owner thread."""
        return self._thread

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run on the owner thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        if self._closed:
            raise EngineClosedError(f"{self.name} is closed: its thread has ended")
        job = _Call(fn, args)
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            error, job.error = job.error, None
            raise error
        return job.result

    def at_close(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the thread when it ends, however it is ended (``close``, an
        engine's finalizer, interpreter exit), before ``on_exit``: what must not be lost
        when an engine is dropped unclosed (its disk tier's spill, its directory's lock). An
        exception there is logged, not raised.

        >>> owner, seen = OwnerThread(), []
        >>> owner.at_close(lambda: seen.append(current_owner() is not None))
        >>> owner.close(); seen
        [True]
        """
        self._last.append(fn)

    def start(self, target: Callable[[], Any], name: str) -> OwnerTask:
        """Run ``target()`` on the owner thread after the calls already queued, without
        waiting for it (the class docstring says what it owes the other callers). An
        exception it raises goes to ``threading.excepthook``, as a thread's would.

        >>> owner = OwnerThread()
        >>> ran = []
        >>> def loop():
        ...     ran.append(current_owner() is owner)
        ...     while owner.serve_calls(timeout=None):  # idle: run others' calls meanwhile
        ...         pass
        >>> task = owner.start(loop, "loop")
        >>> owner.call(pow, 2, 5)  # run by the loop's serve_calls
        32
        >>> owner.close(); task.is_alive(), ran
        (False, [True])
        """
        if self._closed:
            raise EngineClosedError(f"{self.name} is closed: its thread has ended")
        job = _Call(target, (), task=True)
        self._queue.put(job)
        return OwnerTask(job, name)

    def serve_calls(self, timeout: float | None = 0) -> bool:
        """From a function ``start`` runs: run the calls queued now; with none queued, wait
        ``timeout`` seconds for one (None: until one comes, or ``wake``). Whether the thread
        goes on (False: it is closing; the function must return, and the engine's state is
        no longer its to touch)."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError(f"serve_calls is {self.name}'s own: called from "
                               f"{threading.current_thread().name}")
        try:
            job = self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if job is None:  # close(): put it back for the thread's own loop, which ends
                self._queue.put(None)
                return False
            if job is not _WAKE:
                _run(job)
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return True

    def wake(self) -> None:
        """End a wait of ``serve_calls`` (a loop waiting for its own work, which just came)."""
        self._queue.put(_WAKE)

    def acquire(self, lock: Any) -> None:
        """From a function ``start`` runs: take ``lock``, running the calls queued while it
        waits (the thread holding the lock may be waiting on one of them). Raises
        ``EngineClosedError`` if the thread closes first (whoever closes it may hold the
        lock)."""
        if lock.acquire(blocking=False):
            return
        while True:
            if not self.serve_calls():
                raise EngineClosedError(f"{self.name} closed while its thread waited for a "
                                        "lock")
            if lock.acquire(timeout=LOCK_POLL_S):
                return

    def close(self) -> None:
        """End the thread after the calls already queued, then ``at_close``'s calls and
        ``on_exit``; wait for it (unless called from the owner thread itself)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        _open.discard(self)
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _serve(owner: OwnerThread, jobs: queue.SimpleQueue[_Call | None],
           on_exit: Callable[[], Any] | None, last: list[Callable[[], Any]]) -> None:
    """The owner thread's loop. It keeps no reference to what it ran between calls (a call's
    function may be a bound method of the engine that a finalizer closes)."""
    _local.owner = owner
    del owner  # not kept alive by its own thread
    try:
        while (job := jobs.get()) is not None:
            if job is not _WAKE:
                _run(job)
            job = None
    finally:
        for fn in last:
            try:
                fn()
            except Exception:  # noqa: BLE001 - ending anyway: the others still run
                log.exception("a closing call of %s failed", threading.current_thread().name)
        last.clear()
        if on_exit is not None:
            on_exit()
        _local.owner = None


def _run(job: _Call) -> None:
    """Run ``job`` here; its outcome to its caller (a task's exception to the excepthook)."""
    handed = not job.task
    _local.handed = getattr(_local, "handed", 0) + handed
    try:
        job.result = job.fn(*job.args)
    except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
        if job.task:
            threading.excepthook(threading.ExceptHookArgs(
                (type(e), e, e.__traceback__, threading.current_thread())))
        else:
            job.error = e
    finally:
        _local.handed -= handed
    job.fn = job.args = None
    job.done.set()


@atexit.register
def _close_all() -> None:
    """At interpreter exit (after the users' threads are joined, before teardown): end every
    owner thread still open, so each clears its state while Python can still run it."""
    for owner in list(_open):
        owner.close()


class ThreadedCore:
    """An ``EngineCore`` over ``core`` whose every call runs on ``owner``; ``close()`` closes
    the core there, then ends the thread.

    >>> from servecore.requests import RequestBuilder
    >>> from servecore.streams import Streams
    >>> from servecore.testing import FakeCore
    >>> core = ThreadedCore(FakeCore(), OwnerThread())
    >>> streams = Streams(core, RequestBuilder(vocab_size=32))
    >>> streams.generate([[1, 2]], 2)
    [[3, 10]]
    >>> streams.close(); core.owner.closed
    True
    """

    def __init__(self, core: EngineCore, owner: OwnerThread):
        self.core = core
        self.owner = owner

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """``core.submit`` on the owner thread."""
        self.owner.call(self.core.submit, rid, request)

    def cancel(self, rid: int) -> bool:
        """``core.cancel`` on the owner thread."""
        return self.owner.call(self.core.cancel, rid)

    def run_round(self, emit: Callable[[Event], None]) -> bool:
        """``core.run_round`` on the owner thread (``emit`` is called there)."""
        return self.owner.call(self.core.run_round, emit)

    def has_work(self) -> bool:
        """``core.has_work`` on the owner thread."""
        return self.owner.call(self.core.has_work)

    def close(self) -> None:
        """``core.close`` on the owner thread, then the thread ends (idempotent)."""
        if not self.owner.closed:
            try:
                self.owner.call(self.core.close)
            finally:
                self.owner.close()
