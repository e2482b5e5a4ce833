"""``Streams.close`` and the owner thread (``servecore.thread``) over a fake core (no model).

The engines' ``close()`` is ``Streams.close``: these tests pin its contract once, for both
(tests/mlxcache/test_mlx_threads.py and tests/hybridattn/test_engine_close.py check it on the
real engines).
"""

from __future__ import annotations

import threading

import pytest

from servecore.engine import EngineCore
from servecore.errors import EngineClosedError
from servecore.requests import RequestBuilder
from servecore.streams import Streams
from servecore.testing import FakeCore, fake_tokens
from servecore.thread import OwnerThread, ThreadedCore, current_owner

VOCAB = 32


def _streams(core=None, name="engine X"):
    return Streams(core if core is not None else FakeCore(), RequestBuilder(vocab_size=VOCAB),
                   name=name)


def test_close_is_idempotent_and_closes_the_core_once():
    closes = []

    class Counting(FakeCore):
        def close(self):
            closes.append(1)
            super().close()

    streams = _streams(Counting())
    assert isinstance(streams.core, EngineCore)
    streams.close()
    streams.close()
    assert streams.closed and closes == [1]


@pytest.mark.parametrize("call", ["generate", "stream", "add_request", "step", "abort",
                                  "has_unfinished", "serialized"])
def test_every_call_after_close_raises_naming_the_engine(call):
    streams = _streams()
    rid = streams.add_request([1], 2)
    streams.close()
    args = {"generate": ([[1]], 2), "stream": ([[1]], 2), "add_request": ([1], 2),
            "abort": (rid,)}.get(call, ())
    with pytest.raises(EngineClosedError, match="engine X is closed"):
        out = getattr(streams, call)(*args)
        if call == "serialized":
            with out:
                pass


def test_an_open_stream_yields_what_was_made_then_raises_once():
    core = FakeCore(rows=1)
    streams = _streams(core)
    req = RequestBuilder(vocab_size=VOCAB).one([5], 4)
    s = streams.stream([[5], [6]], 4)  # one row: the second waits
    first = next(s)
    other = streams.stream([[7]], 1)
    streams.close()
    assert core.closed and not core.has_work()
    assert first == (0, fake_tokens(req, VOCAB)[0])
    with pytest.raises(EngineClosedError, match=r"engine X was closed before request\(s\) "
                                                r"\[0, 1\] of this stream finished"):
        next(s)
    assert list(s) == []  # ended
    with pytest.raises(EngineClosedError, match=r"request\(s\) \[0\]"):
        list(other)
    s.close()  # a no-op now


def test_a_finished_stream_still_reads_its_tokens_after_close():
    streams = _streams()
    s = streams.stream([[1]], 2)
    assert streams.generate([[3]], 2)  # its round made s's tokens too
    streams.close()
    assert [t for _, t in s] == fake_tokens(RequestBuilder(vocab_size=VOCAB).one([1], 2), VOCAB)


def test_close_waits_for_the_call_under_way_in_another_thread():
    entered, release = threading.Event(), threading.Event()

    class Slow(FakeCore):
        def run_round(self, emit):
            entered.set()
            release.wait(timeout=30)
            return super().run_round(emit)

    streams = _streams(Slow())
    results: list = []
    reader = threading.Thread(target=lambda: results.append(
        _tokens_or_error(streams.stream([[1]], 30))))
    reader.start()
    assert entered.wait(timeout=30)
    closer = threading.Thread(target=streams.close)
    closer.start()
    closer.join(timeout=0.2)
    assert closer.is_alive() and not streams.closed  # waiting for the round
    release.set()
    closer.join(timeout=30)
    reader.join(timeout=30)
    got, error = results[0]
    want = fake_tokens(RequestBuilder(vocab_size=VOCAB).one([1], 30), VOCAB)
    assert streams.closed and not reader.is_alive()
    assert got == want[: len(got)] and len(got) >= 1  # the round under way made its token
    assert isinstance(error, EngineClosedError) or got == want  # then an error, or the end


def _tokens_or_error(stream):
    got = []
    try:
        for _, token in stream:
            got.append(token)
    except EngineClosedError as e:
        return got, e
    return got, None


def test_close_from_inside_a_round_is_refused():
    class Closing(FakeCore):
        streams = None

        def run_round(self, emit):
            self.streams.close()

    core = Closing()
    streams = core.streams = _streams(core)
    streams.add_request([1], 2)
    with pytest.raises(RuntimeError, match="from inside one of its own steps"):
        streams.step()
    assert not streams.closed


# --------------------------------------------------------------------- the owner ----

def test_owner_thread_runs_calls_in_order_and_raises_their_errors_here():
    seen = []
    owner = OwnerThread("t", on_exit=lambda: seen.append(threading.current_thread().name))
    assert owner.call(lambda: threading.current_thread().name) == "t"
    assert owner.call(current_owner) is owner and current_owner() is None
    with pytest.raises(ZeroDivisionError):
        owner.call(lambda: 1 / 0)
    assert owner.call(owner.call, pow, 2, 3) == 8  # from its own thread: at once
    owner.close()
    owner.close()
    assert seen == ["t"] and not owner.thread.is_alive()
    with pytest.raises(EngineClosedError, match="t is closed"):
        owner.call(pow, 2, 3)


def test_owner_thread_closed_from_its_own_thread_ends_after_the_call():
    owner = OwnerThread()
    owner.call(owner.close)
    owner.thread.join(timeout=30)
    assert owner.closed and not owner.thread.is_alive()


def test_a_threaded_core_serves_every_thread_on_its_owner():
    threads = set()

    class Where(FakeCore):
        def run_round(self, emit):
            threads.add(threading.current_thread().name)
            return super().run_round(emit)

    core = ThreadedCore(Where(), OwnerThread("owner"))
    streams = _streams(core)
    want = streams.generate([[1], [2]], 3)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(streams.generate([[1], [2]], 3)))
    worker.start()
    worker.join(timeout=30)
    assert got == [want] and threads == {"owner"}
    streams.close()
    assert core.core.closed and core.owner.closed


def test_a_callback_on_the_owner_thread_is_refused_not_deadlocked():
    class Calls(FakeCore):
        streams = None

        def run_round(self, emit):
            self.streams.has_unfinished()

    inner = Calls()
    streams = inner.streams = _streams(ThreadedCore(inner, OwnerThread()))
    streams.add_request([1], 2)
    with pytest.raises(RuntimeError, match="from inside one of its own steps"):
        streams.step()
    streams.close()
