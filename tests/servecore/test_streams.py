"""The shared stream layer (``servecore.streams``) driven over a fake engine core (no model).

A hypothesis state machine interleaves ``add_request`` / ``step``, streams opened, read, closed
and dropped, ``generate`` calls, ``abort``s and rounds that fail, and checks the contract the
module docstring states against a plain model of who asked for what: each token reaches the
one who asked for it, in order, exactly the core's tokens for that request; a stream ends when
its own requests end; a failed round drops only the requests it served; and at the end the
core holds nothing and the layer keeps no outbox.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from servecore.engine import EngineCore
from servecore.requests import RequestBuilder
from servecore.streams import Streams
from servecore.testing import FakeCore, FakeFailure
from servecore.testing import fake_tokens as expected_tokens

VOCAB = 32
STOP = 0


def test_fake_core_meets_the_protocol():
    assert isinstance(FakeCore(), EngineCore)


prompts = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=3)


class StreamsMachine(RuleBasedStateMachine):
    """The model: for each request its owner, the tokens it must get, what it got, its end."""

    streams = Bundle("streams")

    def __init__(self):
        super().__init__()
        self.core = FakeCore()
        self.front = Streams(self.core, RequestBuilder(vocab_size=VOCAB,
                                                       eos_ids=frozenset({STOP})))
        self.want: dict[int, list[int]] = {}
        self.got: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}  # rid -> "finished" | "aborted" | "dropped"
        self.step_rids: set[int] = set()
        self.open: dict[int, object] = {}  # id(stream) -> stream, not ended yet
        self.unread: list[weakref.ref] = []  # streams dropped but still referenced

    # ------------------------------------------------------------------ helpers ----

    def _run(self, call):
        """Run ``call`` (it may run a round); a failure it raises must be the core's, and the
        requests the core dropped end as dropped."""
        try:
            return call()
        except FakeFailure:
            for rid in self.core.dropped:
                self.ended.setdefault(rid, "dropped")
            self.core.dropped = []
            raise

    def _received(self, rid: int, token: int) -> None:
        # a dropped request may still deliver what it made before the failure; an aborted
        # one nothing more
        assert self.ended.get(rid) != "aborted", (rid, self.ended)
        self.got[rid].append(token)
        assert self.got[rid] == self.want[rid][: len(self.got[rid])], rid
        if len(self.got[rid]) == len(self.want[rid]):
            self.ended[rid] = "finished"

    # -------------------------------------------------------------------- rules ----

    @rule(prompt=prompts, n=st.integers(1, 4), seed=st.none() | st.integers(0, 5))
    def add_request(self, prompt, n, seed):
        rid = self.front.add_request(prompt, n, seed=seed)
        self.want[rid] = expected_tokens(self.front.build.one(prompt, n, seed=seed))
        self.got[rid] = []
        self.step_rids.add(rid)

    @rule(target=streams, ps=st.lists(prompts, min_size=1, max_size=3), n=st.integers(1, 4))
    def open_stream(self, ps, n):
        s = self.front.stream(ps, n)
        for rid, req in zip(s.request_ids, s.requests, strict=True):
            self.want[rid] = expected_tokens(req)
            self.got[rid] = []
        self.open[id(s)] = s
        return s

    @rule(s=streams)
    def read_stream(self, s):
        if id(s) not in self.open:
            return
        try:
            i, token = self._run(lambda: next(s))
        except StopIteration:
            for rid in s.request_ids:  # it ends when its own requests end, not before
                assert rid in self.ended, (rid, s.request_ids)
            del self.open[id(s)]
            return
        except FakeFailure:
            return
        except RuntimeError as e:  # a request of it was dropped by someone else's round
            assert "were dropped" in str(e)
            assert any(self.ended.get(r) == "dropped" for r in s.request_ids)
            del self.open[id(s)]
            return
        self._received(s.request_ids[i], token)

    @rule(s=consumes(streams), drop=st.booleans())
    def close_stream(self, s, drop):
        self.open.pop(id(s), None)
        rids = s.request_ids
        if drop:  # dropped: aborted once collected (hypothesis may keep a reference)
            ref = weakref.ref(s)
            del s
            gc.collect()
            if ref() is not None:
                self.unread.append(ref)  # kept but unread: its requests go on
                return
        else:
            s.close()
        for rid in rids:
            self.ended.setdefault(rid, "aborted")

    @rule(ps=st.lists(prompts, min_size=1, max_size=2), n=st.integers(1, 3))
    def generate(self, ps, n):
        reqs = self.front.build(ps, n)
        try:
            outs = self._run(lambda: self.front.generate(ps, n))
        except (FakeFailure, RuntimeError):
            return
        assert outs == [expected_tokens(r) for r in reqs]

    @rule()
    def step(self):
        try:
            events = self._run(self.front.step)
        except FakeFailure:
            return
        for rid, token, finished in events:
            assert rid in self.step_rids
            if token is None:
                assert finished and self.ended.get(rid) == "dropped"
                continue
            self._received(rid, token)
            assert finished == (self.ended.get(rid) == "finished")

    @precondition(lambda self: bool(self.want))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.want)))
        self.front.abort(rid)
        self.ended.setdefault(rid, "aborted")

    @rule()
    def fail_next_round(self):
        self.core.fail_next = True

    @invariant()
    def nothing_ended_runs(self):
        live = set(self.core.waiting) | set(self.core.running)
        assert not live & {r for r, how in self.ended.items() if how != "finished"}

    def teardown(self):
        for s in [*self.open.values(), *(ref() for ref in self.unread)]:
            if s is not None:
                s.close()
        self.open.clear()
        for rid in sorted(self.step_rids):
            self.front.abort(rid)
        gc.collect()
        self.core.fail_next = False
        while self.front.has_unfinished():
            self.front.step()
        assert not self.core.waiting and not self.core.running
        assert not self.front._owner and not self.front._requests


TestStreamsMachine = StreamsMachine.TestCase
TestStreamsMachine.settings = settings(stateful_step_count=30)


def test_a_step_that_fails_keeps_the_tokens_made_before_for_the_next_step():
    """Tokens committed for ``add_request`` requests (here by a stream's round) are not lost
    when the ``step`` that would return them fails: the next ``step`` returns them, then the
    requests the failure dropped."""
    core = FakeCore()
    front = Streams(core, RequestBuilder(vocab_size=VOCAB))
    rid = front.add_request([1], 3)
    stream = front.stream([[2]], 3)
    first = next(stream)  # its round made request rid's first token too
    core.fail_next = True
    with pytest.raises(FakeFailure):
        front.step()
    want = expected_tokens(front.build.one([1], 3))
    assert front.step() == [(rid, want[0], False), (rid, None, True)]
    assert first == (0, expected_tokens(stream.requests[0])[0])
    with pytest.raises(RuntimeError, match="were dropped"):
        list(stream)
    assert not front.has_unfinished() and not front._owner


def test_a_stream_yields_what_the_core_makes_and_ends_with_its_requests():
    front = Streams(FakeCore(rows=1), RequestBuilder(vocab_size=VOCAB))
    s = front.stream([[1, 2], [3]], [2, 3])
    events = list(s)
    reqs = front.build([[1, 2], [3]], [2, 3])
    assert sorted(events) == sorted((i, t) for i, r in enumerate(reqs)
                                    for t in expected_tokens(r))
    assert not front.has_unfinished() and not front._owner


def test_a_failed_round_raises_where_it_ran_and_in_the_streams_it_dropped():
    core = FakeCore(rows=4)
    front = Streams(core, RequestBuilder(vocab_size=VOCAB))
    a, b = front.stream([[1]], 3), front.stream([[2]], 3)
    assert next(a)[0] == 0
    core.fail_next = True
    with pytest.raises(FakeFailure):
        next(a)
    with pytest.raises(RuntimeError, match="were dropped") as info:
        list(b)  # b's first token came before the failure: it is yielded, then the error
    assert isinstance(info.value.__cause__, FakeFailure)
    assert front.generate([[5]], 2) == [expected_tokens(front.build.one([5], 2))]
    assert not core.has_work()


def test_abort_ends_a_streams_request_without_more_tokens():
    front = Streams(FakeCore(), RequestBuilder(vocab_size=VOCAB))
    s = front.stream([[1], [2]], 4)
    first = next(s)
    assert front.abort(s.request_ids[1 - first[0]]) is True
    rest = list(s)
    assert {i for i, _ in rest} <= {first[0]}
    assert not front.has_unfinished()


def test_a_call_from_inside_a_round_is_refused():
    front = None

    class Reentrant(FakeCore):
        def run_round(self, emit):
            front.add_request([1], 1)

    front = Streams(Reentrant(), RequestBuilder(vocab_size=VOCAB))
    front.add_request([1], 1)
    with pytest.raises(RuntimeError, match="inside one of its own steps"):
        front.step()


def test_threads_each_get_their_own_tokens():
    front = Streams(FakeCore(rows=2), RequestBuilder(vocab_size=VOCAB))
    results: dict[int, list] = {}

    def work(k):
        results[k] = front.generate([[k + 1], [k + 2]], 5)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        want = [expected_tokens(r) for r in front.build([[k + 1], [k + 2]], 5)]
        assert results[k] == want
    assert not front.has_unfinished()


def test_bad_arguments_are_refused_before_anything_is_queued():
    core = FakeCore()
    front = Streams(core, RequestBuilder(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="prompt 1: token 0 is 99"):
        front.stream([[1], [99]], 2)
    with pytest.raises(ValueError, match="max_tokens has 3 entries for 2 prompts"):
        front.stream([[1], [2]], [1, 2, 3])
    with pytest.raises(ValueError, match="max_tokens=0"):
        front.add_request([1], 0)
    assert not core.has_work() and front._next_rid == 0


def test_max_tokens_defaults_to_default_max_tokens():
    front = Streams(FakeCore(), RequestBuilder(vocab_size=VOCAB))
    assert len(front.generate([[1]])[0]) == 256  # DEFAULT_MAX_TOKENS


class _CancelFailsOnce(FakeCore):
    """A core whose first ``cancel`` raises after dropping its request (a row move failed)."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def cancel(self, rid):
        live = super().cancel(rid)
        if not self.failed:
            self.failed = True
            raise FakeFailure("cancel failed")
        return live


def test_closing_a_stream_cancels_every_request_even_when_one_cancel_fails():
    core = _CancelFailsOnce()
    streams = Streams(core, RequestBuilder(vocab_size=VOCAB))
    stream = streams.stream([[1], [2], [3], [4]], 5)  # one waits: the core has 3 rows
    next(stream)
    with pytest.raises(FakeFailure, match="cancel failed"):
        stream.close()
    assert not core.has_work() and not streams.has_unfinished()
    assert list(stream) == []
