"""The host scheduler against the reference pools, with no model and no compilation.

Oracle: ``hybridattn.testing.RefServingPools`` (plain-Python pools that accept exactly the
batches ``step`` accepts and record what it would allocate). A hypothesis state machine adds
requests, runs rounds with drawn sampled tokens and aborts requests; after every rule the
scheduler and the reference pools must agree on rows, recorded lengths, token slots and
reservations, and every request must have been fed exactly its prompt and then its outputs.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridattn.scheduler import Request, Scheduler, ladder
from hybridattn.serving import make_worker_batch
from hybridattn.testing import RefReqToTokenPool, RefServingPools, RefSlotAllocator
from servecore.sampling import SamplingParams

V, L, R, C, P = 32, 24, 3, 40, 7  # vocabulary, context, rows, token slots, prefill chunk


class SchedulerAgainstRefPools(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = Scheduler(capacity=C, max_running_requests=R, chunked_prefill_size=P,
                               request_buckets=ladder(1, R), token_buckets=ladder(4, P + R),
                               kv_buckets=(8, L))
        self.ref = RefServingPools(RefSlotAllocator(C + 1), RefReqToTokenPool(R, L),
                                   vocab_size=V)
        self.reqs: list[Request] = []
        self.fed: dict[int, list[int]] = {}
        self.admitted_order: list[int] = []

    @rule(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=14),
          new=st.integers(1, 8), stop=st.one_of(st.none(), st.integers(0, V - 1)))
    def add(self, prompt, new, stop):
        new = min(new, L - len(prompt) + 1)
        req = Request(len(self.reqs), prompt, new, SamplingParams(),
                      frozenset() if stop is None else frozenset([stop]))
        self.reqs.append(req)
        self.fed[req.rid] = []
        self.sched.add(req)

    def _release(self, done):
        self.ref.release([r.row for r in done])
        self.sched.released(done)

    @rule(data=st.data())
    def round(self, data):
        for req in self.sched.admissible():
            (row,) = self.ref.requests.take(1)
            self.sched.admitted(req, row)
            self.admitted_order.append(req.rid)
        plan = self.sched.plan()
        if plan is None:
            assert not self.sched.running
            return
        B, T, W, Q = plan.buckets
        batch = make_worker_batch(plan.items(), vocab_size=V, max_context_len=L,
                                  forward_mode=plan.mode, num_requests=B, num_tokens=T,
                                  kv_width=W, max_extend_len=Q)
        assert self.ref.apply(batch), "the scheduler built a batch that step refuses"
        for r, toks in plan.work:
            self.fed[r.rid] += toks
        tokens = data.draw(st.lists(st.integers(0, V - 1), min_size=B, max_size=B))
        before = {r.rid: len(r.output) for r, _ in plan.work}
        events, done = self.sched.commit(plan, tokens)
        sampled = {r.rid: tokens[i] for i, (r, _) in enumerate(plan.work) if not r.prefilling}
        assert [(rid, tok) for rid, tok, _ in events] == [
            (r.rid, sampled[r.rid]) for r, _ in plan.work
            if r.rid in sampled and len(r.output) > before[r.rid]]
        for rid, _, finished in events:
            assert finished == any(r.rid == rid for r in done)
        self._release(done)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        was = req.finished
        got = self.sched.abort(req.rid)
        assert (got is None) == was
        if got is not None and got in self.sched.releasing:
            self._release([got])

    @invariant()
    def agrees_with_the_reference_pools(self):
        running = self.sched.running
        assert not self.sched.releasing
        assert sorted(r.row for r in running) == sorted(self.ref.requests.rows)
        assert len({r.row for r in running}) == len(running) <= R
        assert len(self.ref.tokens.used) == sum(r.computed for r in running)
        assert self.sched.reserved == sum(r.need for r in running) <= C
        for r in running:
            assert self.ref.requests.lens[r.row] == r.computed
        for r in self.reqs:
            assert self.fed[r.rid] == r.tokens[: len(self.fed[r.rid])]
            assert len(r.output) <= r.max_new_tokens
            if r.finish_reason == "stop":
                assert r.output[-1] in r.stop_token_ids
            elif r.finish_reason == "length":
                assert len(r.output) == r.max_new_tokens
        assert self.admitted_order == sorted(self.admitted_order)  # FIFO admission

    def teardown(self):
        bound = sum(r.need for r in self.reqs) + len(self.reqs) + 1
        for _ in range(bound):  # every request finishes within its own token count
            if not (self.sched.waiting or self.sched.running):
                break
            for req in self.sched.admissible():
                (row,) = self.ref.requests.take(1)
                self.sched.admitted(req, row)
            plan = self.sched.plan()
            B, T, W, Q = plan.buckets
            assert self.ref.apply(make_worker_batch(
                plan.items(), vocab_size=V, max_context_len=L, forward_mode=plan.mode,
                num_requests=B, num_tokens=T, kv_width=W, max_extend_len=Q))
            self._release(self.sched.commit(plan, [0] * B)[1])
        else:
            pytest.fail("the scheduler did not finish its requests")
        assert not self.ref.requests.rows and not self.ref.tokens.used
        assert self.sched.reserved == 0


TestSchedulerAgainstRefPools = SchedulerAgainstRefPools.TestCase
TestSchedulerAgainstRefPools.settings = settings(stateful_step_count=40, deadline=None)
