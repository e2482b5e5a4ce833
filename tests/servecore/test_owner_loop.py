"""A long loop on the owner thread (``OwnerThread.start``): the engine's calls from the loop
run inline, other threads' calls run between its steps and while it waits, and a ``close``
from another thread ends it. Over a fake core; tests/server/test_engine_thread.py checks the
server's loop on a real mlxcache engine."""

from __future__ import annotations

import threading
import time

import pytest
from server_harness import within

from servecore.errors import EngineClosedError
from servecore.requests import RequestBuilder
from servecore.streams import Streams
from servecore.testing import FakeCore
from servecore.thread import OwnerThread, ThreadedCore, current_owner

DEADLINE_S = 30  # a test that waits this long is deadlocked


def _within(fn, seconds=DEADLINE_S):
    return within(fn, seconds)


class Where(FakeCore):
    """A fake core that records the thread of every round."""

    def __init__(self):
        super().__init__()
        self.threads: set[int] = set()

    def run_round(self, emit):
        self.threads.add(threading.get_ident())
        return super().run_round(emit)


def test_a_loop_on_the_owner_runs_the_core_inline_and_others_calls_between_steps():
    owner = OwnerThread("owner")
    core = Where()
    streams = Streams(ThreadedCore(core, owner), RequestBuilder(vocab_size=32))
    want = streams.generate([[1], [2]], 3)
    hops = []
    real_call = owner.call

    def call(fn, *args):  # who hands what to the owner
        hops.append(threading.get_ident())
        return real_call(fn, *args)

    owner.call = call
    got, stop = [], threading.Event()

    def loop():
        got.append(streams.generate([[1], [2]], 3))
        while not stop.is_set() and owner.serve_calls(timeout=0.01):
            pass

    task = owner.start(loop, "loop")
    assert _within(lambda: owner.call(current_owner)) is owner  # run by the loop's serve
    assert _within(lambda: streams.generate([[1], [2]], 3)) == want  # from another thread
    stop.set()
    task.join(DEADLINE_S)
    loop_hops = [h for h in hops if h == owner.thread.ident]
    assert got == [want] and not task.is_alive()
    assert core.threads == {owner.thread.ident}  # every round, whoever asked
    assert loop_hops and len(loop_hops) < len(hops)  # the loop's calls ran inline
    streams.close()
    assert owner.closed and not owner.thread.is_alive()


def test_serve_calls_waits_until_woken_and_says_false_once_closing():
    owner = OwnerThread()
    seen = []

    def loop():
        seen.append(owner.serve_calls(timeout=None))  # woken: goes on
        while owner.serve_calls(timeout=None):
            pass
        seen.append(owner.serve_calls())  # closing, asked again: still closing

    task = owner.start(loop, "loop")
    owner.wake()
    end = time.monotonic() + DEADLINE_S
    while not seen and time.monotonic() < end:
        time.sleep(0.001)
    owner.close()  # from another thread: waits for the loop to return
    assert seen == [True, False] and not task.is_alive() and not owner.thread.is_alive()
    with pytest.raises(EngineClosedError, match="is closed"):
        owner.start(loop, "again")


def test_serve_calls_belongs_to_the_owner_thread():
    owner = OwnerThread("mine")
    with pytest.raises(RuntimeError, match="serve_calls is mine's own"):
        owner.serve_calls()
    owner.close()


def test_acquire_runs_the_calls_of_the_locks_holder_meanwhile():
    owner, lock = OwnerThread(), threading.Lock()
    got = []

    def loop():
        owner.acquire(lock)  # held by the main thread, which waits on a call here
        got.append("locked")
        lock.release()
        while owner.serve_calls(timeout=None):
            pass

    with lock:
        task = owner.start(loop, "loop")
        time.sleep(0.05)  # the loop waits for the lock
        assert _within(lambda: owner.call(pow, 2, 5)) == 32
    owner.close()
    assert got == ["locked"] and not task.is_alive()


def test_acquire_gives_up_when_the_lock_holder_closes_the_owner():
    owner, lock = OwnerThread("held"), threading.Lock()
    errors = []

    def loop():
        try:
            owner.acquire(lock)
        except EngineClosedError as e:
            errors.append(str(e))

    with lock:
        owner.start(loop, "loop")
        time.sleep(0.05)
        _within(owner.close)  # the closer holds the lock and waits for the thread
    assert errors == ["held closed while its thread waited for a lock"]


def test_a_loop_that_raises_reports_to_the_excepthook_and_the_owner_goes_on(monkeypatch):
    reported = []
    monkeypatch.setattr(threading, "excepthook", reported.append)
    owner = OwnerThread()
    task = owner.start(lambda: 1 / 0, "loop")
    task.join(DEADLINE_S)
    assert [a.exc_type for a in reported] == [ZeroDivisionError]
    assert reported[0].thread is owner.thread
    assert owner.call(pow, 3, 2) == 9
    owner.close()


def test_a_callback_in_a_round_the_loop_runs_is_refused_not_deadlocked():
    class Calls(FakeCore):
        streams = None

        def run_round(self, emit):
            self.streams.has_unfinished()

    owner, inner = OwnerThread(), Calls()
    streams = inner.streams = Streams(ThreadedCore(inner, owner), RequestBuilder(vocab_size=32))
    errors = []

    def loop():
        streams.add_request([1], 2)
        try:
            streams.step()
        except RuntimeError as e:
            errors.append(str(e))

    owner.start(loop, "loop").join(DEADLINE_S)
    assert len(errors) == 1 and "from inside one of its own steps" in errors[0]
    streams.close()
