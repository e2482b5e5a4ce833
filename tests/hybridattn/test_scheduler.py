"""The host scheduler against the reference pools, with no model and no compilation.

Oracle: ``hybridattn.testing.RefServingPools`` (plain-Python pools that accept exactly the
batches ``step`` accepts and record what it, ``borrow_prefix`` and ``release`` would do). A
hypothesis state machine adds requests (with shared prefixes), runs rounds with drawn sampled
tokens and aborts requests, with and without the prefix cache; after every rule the scheduler,
its radix tree and the reference pools must agree on rows, recorded lengths, borrowed
prefixes, token slots, snapshot slots and reservations, and every request must have been fed
exactly its tokens from the depth it started at.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridattn.backends import ForwardMode
from hybridattn.engine._runner import work_items
from hybridattn.engine.buckets import ladder
from hybridattn.engine.plan import Borrow, FreeSlots, Release, Request
from hybridattn.engine.scheduler import Scheduler
from hybridattn.serving import make_worker_batch
from hybridattn.testing import RefReqToTokenPool, RefServingPools, RefSlotAllocator
from servecore.sampling import SamplingParams

V, L, R, C, P = 8, 24, 3, 48, 7  # vocabulary, context, rows, token slots, prefill chunk
SYSTEMS = ([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [4, 4, 4, 4, 4, 4])  # shared starts


class SchedulerAgainstRefPools(RuleBasedStateMachine):
    cache = False

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(capacity=C, max_running_requests=R, chunked_prefill_size=P,
                               request_buckets=ladder(1, R), token_buckets=ladder(4, P + R),
                               kv_buckets=(8, L), num_snapshot_slots=9 if self.cache else 0,
                               snapshot_interval=4, snapshot_buckets=(0, 4, 16),
                               chunk_size=2 if self.cache else None)
        self.ref = RefServingPools(RefSlotAllocator(C + 1), RefReqToTokenPool(R, L),
                                   vocab_size=V)
        self.reqs: list[Request] = []
        self.fed: dict[int, list[int]] = {}
        self.admitted_order: list[int] = []

    # -- the engine's part, against the reference pools ----------------------------------
    def read_slots(self, req, n):
        return self.ref.requests.token_slots(req.row)[:n]

    def run_ops(self):
        sched = self.sched
        while sched.device_ops:
            op = sched.device_ops[0]
            if isinstance(op, FreeSlots):
                assert self.ref.tokens.free_slots(list(op.slots)) == 0, "freed a free slot"
            elif isinstance(op, Borrow):
                self.ref.borrow(op.req.row, list(op.slots))
            elif isinstance(op, Release):
                self.ref.release([r.row for r in op.reqs],
                                 keep_from=[r.keep_from for r in op.reqs])
            sched.op_done(op)

    def round(self, tokens_for):
        self.run_ops()
        while (adm := self.sched.admit_next()) is not None:
            (row,) = self.ref.requests.take(1)
            if adm.slots:
                self.ref.borrow(row, list(adm.slots), adm.computed)
            self.sched.admitted(adm, row)
            self.admitted_order.append(adm.req.rid)
            self.fed[adm.req.rid] = []
        self.run_ops()
        plan = self.sched.plan()
        if plan is None:
            assert not self.sched.running
            return
        B, T, W, Q = plan.buckets
        batch = make_worker_batch(work_items(plan), vocab_size=V, max_context_len=L,
                                  forward_mode=ForwardMode(plan.mode), num_requests=B, num_tokens=T,
                                  kv_width=W, max_extend_len=Q, num_snapshots=plan.num_snapshots,
                                  snapshot_chunk=self.sched.chunk_size)
        assert self.ref.apply(batch), "the scheduler built a batch that step refuses"
        for r, toks in plan.work:
            self.fed[r.rid] += toks
        tokens = tokens_for(B)
        before = {r.rid: len(r.output) for r, _ in plan.work}
        events, done = self.sched.commit(plan, tokens, self.read_slots)
        sampled = {r.rid: tokens[i] for i, (r, _) in enumerate(plan.work) if not r.prefilling}
        assert [(rid, tok) for rid, tok, _ in events] == [
            (r.rid, sampled[r.rid]) for r, _ in plan.work
            if r.rid in sampled and len(r.output) > before[r.rid]]
        for rid, _, finished in events:
            assert finished == any(r.rid == rid for r in done)
        self.run_ops()

    # -- rules --------------------------------------------------------------------------------
    @rule(system=st.sampled_from([None, 0, 1]),
          tail=st.lists(st.integers(0, V - 1), min_size=0, max_size=10),
          new=st.integers(1, 6), stop=st.one_of(st.none(), st.integers(0, V - 1)))
    def add(self, system, tail, new, stop):
        prompt = (list(SYSTEMS[system]) if system is not None else []) + tail
        if not prompt:
            prompt = [0]
        prompt = prompt[: L - 1]
        new = min(new, L - len(prompt) + 1)
        req = Request(len(self.reqs), prompt, new, SamplingParams(),
                      frozenset() if stop is None else frozenset([stop]))
        self.reqs.append(req)
        self.sched.add(req)

    @rule(data=st.data())
    def step(self, data):
        self.round(lambda B: data.draw(st.lists(st.integers(0, V - 1), min_size=B, max_size=B)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        was = req.finished
        got = self.sched.abort(req.rid)
        assert (got is None) == was
        self.run_ops()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_reference_pools(self):
        sched, ref = self.sched, self.ref
        running = sched.running
        assert not sched.releasing and not sched.device_ops
        assert sorted(r.row for r in running) == sorted(ref.requests.rows)
        assert len({r.row for r in running}) == len(running) <= R
        owned = []  # slots the rows own: from their borrowed length to their recorded one
        for r in running:
            assert ref.requests.lens[r.row] == r.computed
            assert ref.requests.borrowed[r.row] == r.borrowed
            row = ref.requests.token_slots(r.row)
            owned += row[r.borrowed: r.computed]
            assert len(row[r.borrowed: r.computed]) <= r.owned
        tree_slots = sched.tree.all_slots() if sched.tree is not None else []
        assert sorted(ref.tokens.used) == sorted(owned + tree_slots), "a slot leaked or is shared"
        assert sched.reserved == sum(r.owned for r in running)
        assert sched.cached_size + sched.reserved <= C
        for r in self.reqs:
            fed = self.fed.get(r.rid, [])
            assert fed == r.tokens[r.start: r.start + len(fed)]
            assert len(r.output) <= r.max_tokens
            if r.finish_reason == "stop":
                assert r.output[-1] in r.stop_token_ids
            elif r.finish_reason == "length":
                assert len(r.output) == r.max_tokens
        assert self.admitted_order == sorted(self.admitted_order)  # FIFO admission
        if sched.tree is not None:
            held = sum(len(r.planned) + len(r.taken) + bool(r.finish_slot) for r in running)
            assert (sched.snapshot_slots.num_free + sched.tree.num_states + held
                    == sched.snapshot_slots.capacity), "a snapshot slot leaked"
            for r in running:  # borrowed positions are the tree's, locked
                row = ref.requests.token_slots(r.row)
                assert set(row[: r.borrowed]) <= set(tree_slots)
            assert sched.tree.protected_size >= max(
                [r.borrowed for r in running], default=0)

    def teardown(self):
        bound = sum(r.need for r in self.reqs) + len(self.reqs) + 1
        for _ in range(bound):  # every request finishes within its own token count
            if not (self.sched.waiting or self.sched.running):
                break
            self.round(lambda B: [0] * B)
            self.agrees_with_the_reference_pools()
        else:
            pytest.fail("the scheduler did not finish its requests")
        assert not self.ref.requests.rows and self.sched.reserved == 0
        tree = self.sched.tree
        if tree is not None:
            assert sorted(self.ref.tokens.used) == sorted(tree.all_slots())
            assert tree.protected_size == 0
            freed = tree.evict_states(10**6)
            more = tree.evict(10**6)
            self.ref.tokens.free_slots(freed.slots + more.slots)
            self.sched.snapshot_slots.give(freed.states + more.states)
            assert self.sched.snapshot_slots.num_free == self.sched.snapshot_slots.capacity
        assert not self.ref.tokens.used


class CachedSchedulerAgainstRefPools(SchedulerAgainstRefPools):
    cache = True


def test_a_chunk_that_ends_inside_the_borrowed_kv_keeps_the_borrow():
    """The state machine's find, replayed: request 16 borrows its whole 6-token prompt's KV
    but no state (those were evicted), recomputes from token 0 and snapshots at token 5,
    inside what it borrows. Inserting that chunk shrank the borrow to 5, so the row owned
    (and its release freed) a slot the tree still served, and the cache and reservations
    outgrew the pool."""
    m = CachedSchedulerAgainstRefPools()
    for new, system, tail in [
            (4, None, []), (1, 1, []), (1, None, []), (1, None, []), (1, None, []),
            (1, None, [0] * 9), (1, None, []), (1, None, []), (3, 0, [5, 0, 0, 0, 0]),
            (1, 1, [0, 0]), (5, 0, []), (1, None, [0] * 5), (4, 0, [0, 0, 0]),
            (2, 1, [0] * 9), (1, 0, []), (5, None, [1, 0]), (4, 1, []), (4, None, [0] * 5),
            (1, None, [])]:
        m.add(system=system, tail=tail, new=new, stop=None)
        m.agrees_with_the_reference_pools()
    m.teardown()  # rounds of token 0 to the end, the invariants checked after each


TestSchedulerAgainstRefPools = SchedulerAgainstRefPools.TestCase
TestSchedulerAgainstRefPools.settings = settings(stateful_step_count=40, deadline=None)
TestCachedSchedulerAgainstRefPools = CachedSchedulerAgainstRefPools.TestCase
TestCachedSchedulerAgainstRefPools.settings = settings(stateful_step_count=40, deadline=None)


def test_the_scheduler_layer_imports_no_jax():
    """The scheduler, its plan data, the prefix policy and the bucket ladders import the
    standard library, ``servecore`` and each other only (function bodies included): no JAX,
    no device code, so the host logic runs without a model."""
    import ast
    import pathlib
    import sys

    import hybridattn.engine

    root = pathlib.Path(hybridattn.engine.__file__).parent
    plain = {"scheduler", "plan", "_prefix_cache", "buckets"}
    for name in sorted(plain):
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                ok = (top in sys.stdlib_module_names or top == "servecore"
                      or mod.removeprefix("hybridattn.engine.") in plain)
                assert ok, f"hybridattn.engine.{name} imports {mod}"
