"""hybridattn.pools: allocators and request tables against plain-Python models (hypothesis
state machines), the data pools by round trips, everything under jit."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridattn import pools, testing
from hybridattn.config import KimiLinearConfig
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    PoolExhausted,
    RecurrentStatePool,
    ReqToTokenPool,
    SlotAllocator,
)

MACHINE_SETTINGS = settings(max_examples=20, stateful_step_count=20)


def host(tree):
    """A pytree's leaves as numpy arrays (same structure)."""
    return jax.tree.map(np.asarray, tree)


def free_list(allocator: SlotAllocator) -> list[int]:
    return np.asarray(allocator.free_slots)[: int(allocator.num_free)].tolist()


# --------------------------------------------------------------------------------------------
# SlotAllocator against a set model
# --------------------------------------------------------------------------------------------

NUM_SLOTS = 9  # capacity 8
MAX_COUNT = 5
FREE_WIDTH = 10  # ids passed to one free

alloc_jit = jax.jit(functools.partial(pools.alloc, max_count=MAX_COUNT))
claim_jit = jax.jit(pools.claim)
free_jit = jax.jit(pools.free)


def draw_free_batch(data, live: list[int], width: int):
    """``(ids, mask, freed)``: a shuffled batch of ``width`` entries holding a random subset of
    ``live`` to free (mask on), other live ids masked off, and zeros with random masks."""
    freed = data.draw(st.lists(st.sampled_from(live), unique=True), label="freed") if live else []
    others = [s for s in live if s not in freed]
    masked = (
        data.draw(st.lists(st.sampled_from(others), unique=True), label="masked off")
        if others
        else []
    )
    entries = [(s, True) for s in freed] + [(s, False) for s in masked]
    assert len(entries) <= width
    zeros = data.draw(st.lists(st.booleans(), min_size=width - len(entries),
                               max_size=width - len(entries)), label="zero masks")
    entries += [(0, m) for m in zeros]
    entries = data.draw(st.permutations(entries), label="order")
    ids = np.array([s for s, _ in entries], np.int32)
    mask = np.array([m for _, m in entries], bool)
    return jnp.asarray(ids), jnp.asarray(mask), set(freed)


class SlotAllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.allocator = SlotAllocator.create(NUM_SLOTS)
        self.ref = testing.RefSlotAllocator(NUM_SLOTS)

    @rule(count=st.integers(-1, MAX_COUNT))
    def alloc(self, count):
        before = host(self.allocator)
        new, slots, ok = alloc_jit(self.allocator, jnp.int32(count))
        assert slots.shape == (MAX_COUNT,)
        # ok iff 0 <= count <= free; then count distinct free ids, zeros after; else zeros
        self.allocator = self.ref.alloc(count, new, slots, ok)
        if not bool(ok):
            event("alloc failed")
            chex.assert_trees_all_equal(new, before)  # the free stack itself is untouched

    @rule(data=st.data(), use_mask=st.booleans())
    def free_some(self, data, use_mask):
        ids, mask, freed = draw_free_batch(data, sorted(self.ref.used), FREE_WIDTH)
        if use_mask:
            self.allocator = free_jit(self.allocator, ids, mask)
        else:  # no mask: everything nonzero is freed, so drop the masked-off ids
            self.allocator = free_jit(self.allocator, jnp.where(mask, ids, 0))
        self.ref.free_slots(ids, mask)
        assert not freed & self.ref.used

    @rule(data=st.data(), use_mask=st.booleans())
    def claim_some(self, data, use_mask):
        # the host names the slots: mostly free ones, sometimes one in use, out of range or
        # listed twice (then nothing changes)
        free = sorted(self.ref.free)
        ids = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=FREE_WIDTH)
                        if free else st.just([]), label="claimed")
        bad = data.draw(st.sampled_from(["none", "none", "used", "range", "twice"]))
        if bad == "used" and self.ref.used:
            ids = [*ids, data.draw(st.sampled_from(sorted(self.ref.used)))][-FREE_WIDTH:]
        elif bad == "range":
            ids = [*ids, data.draw(st.sampled_from([-1, NUM_SLOTS]))][-FREE_WIDTH:]
        elif bad == "twice" and ids:
            ids = [*ids, ids[0]][-FREE_WIDTH:]
        padded = np.zeros(FREE_WIDTH, np.int32)
        padded[: len(ids)] = ids
        order = np.asarray(data.draw(st.permutations(range(FREE_WIDTH))))
        padded = padded[order]
        before = host(self.allocator)
        mask = padded != 0 if use_mask else None
        new, ok = claim_jit(self.allocator, jnp.asarray(padded),
                            None if mask is None else jnp.asarray(mask))
        self.allocator = self.ref.claim(padded, new, ok, mask)
        if not bool(ok):
            event("claim failed")
            chex.assert_trees_all_equal(new, before)

    @invariant()
    def conserved(self):
        # each free slot on the stack once, never 0, exactly the model's free set
        self.ref.check(self.allocator)
        assert self.ref.free | self.ref.used == set(range(1, NUM_SLOTS))
        assert self.allocator.capacity == NUM_SLOTS - 1


SlotAllocatorMachine.TestCase.settings = MACHINE_SETTINGS
TestSlotAllocatorMachine = SlotAllocatorMachine.TestCase


# --------------------------------------------------------------------------------------------
# HybridReqToTokenPool against a dict model
# --------------------------------------------------------------------------------------------

CTX = 5  # max_context_len
REQ_MAX_COUNT = 3
WRITE_WIDTH = 6  # tokens per write

alloc_reqs_jit = jax.jit(functools.partial(pools.alloc_reqs, max_count=REQ_MAX_COUNT))
free_reqs_jit = jax.jit(pools.free_reqs)
write_jit = jax.jit(pools.write_token_slots)
token_slots_jit = jax.jit(functools.partial(pools.get_token_slots, width=CTX))
state_idx_jit = jax.jit(pools.get_linear_recurrent_indices)


def make_hybrid_machine(max_reqs: int, num_state_slots: int):
    rows_all = set(range(1, max_reqs + 1))
    states_all = set(range(1, num_state_slots))

    class HybridPoolMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.pool = HybridReqToTokenPool.create(max_reqs, CTX, num_state_slots)
            self.ref = testing.RefReqToTokenPool(max_reqs, CTX, num_state_slots)

        @rule(count=st.integers(0, REQ_MAX_COUNT))
        def alloc(self, count):
            before = host(self.pool)
            new, rows, ok = alloc_reqs_jit(self.pool, jnp.int32(count))
            if not self.ref.can_alloc(count):  # both allocators (and all else) unchanged
                event("failed: " + ("rows" if count > len(self.ref.free_rows)
                                    else "state slots"))
                chex.assert_trees_all_equal(new, before)
            # ok iff rows and state slots were free; distinct free rows, each with a distinct
            # free state slot; new rows all zeros
            self.pool = self.ref.alloc_reqs(count, new, rows, ok)
            assert set(self.ref.rows) <= rows_all
            assert set(self.ref.rows.values()) <= states_all

        @rule(data=st.data())
        def free(self, data):
            ids, mask, _ = draw_free_batch(data, sorted(self.ref.rows), max_reqs + 2)
            self.pool = free_reqs_jit(self.pool, ids, mask)
            self.ref.free_reqs(ids, mask)

        @rule(data=st.data())
        def write(self, data):
            rows = sorted(self.ref.rows) + [0]
            cell = st.tuples(st.sampled_from(rows), st.integers(0, CTX - 1))
            kept = data.draw(st.lists(cell, unique=True, max_size=WRITE_WIDTH), label="kept")
            tokens = [(r, p, True) for r, p in kept]
            n_off = WRITE_WIDTH - len(tokens)
            tokens += [(r, p, False) for r, p in data.draw(
                st.lists(cell, min_size=n_off, max_size=n_off), label="masked off")]
            tokens = data.draw(st.permutations(tokens), label="order")
            values = data.draw(st.lists(st.integers(1, 99), min_size=WRITE_WIDTH,
                                        max_size=WRITE_WIDTH), label="slots")
            req, pos, mask = (np.array(x) for x in zip(*tokens, strict=True))
            args = (jnp.asarray(req, jnp.int32), jnp.asarray(pos, jnp.int32),
                    jnp.asarray(values, jnp.int32), jnp.asarray(mask, bool))
            self.pool = write_jit(self.pool, *args)
            self.ref.write_token_slots(*args)  # row 0 (padding) writes are dropped

        @invariant()
        def pool_matches_the_model(self):
            # free rows / state slots each once, state slots unshared, both tables
            self.ref.check(self.pool)

        @invariant()
        def getters_read_the_tables(self):
            all_rows = jnp.arange(max_reqs + 1, dtype=jnp.int32)
            np.testing.assert_array_equal(
                np.asarray(token_slots_jit(self.pool, all_rows)),
                [self.ref.token_slots(r) for r in range(max_reqs + 1)])
            np.testing.assert_array_equal(
                np.asarray(state_idx_jit(self.pool, all_rows)),
                [self.ref.rows.get(r, 0) for r in range(max_reqs + 1)])

    HybridPoolMachine.TestCase.settings = MACHINE_SETTINGS
    return HybridPoolMachine


# state slots run out before request rows, and the other way round
TestHybridPoolFewStates = make_hybrid_machine(max_reqs=4, num_state_slots=4).TestCase
TestHybridPoolFewRows = make_hybrid_machine(max_reqs=3, num_state_slots=6).TestCase


# --------------------------------------------------------------------------------------------
# from any reachable state (hybridattn.testing)
# --------------------------------------------------------------------------------------------

CAPACITY = NUM_SLOTS - 1
alloc_all_jit = jax.jit(functools.partial(pools.alloc, max_count=CAPACITY))


@given(testing.slot_allocator_states(NUM_SLOTS, max_count=MAX_COUNT), st.booleans())
def test_after_any_history_every_free_slot_and_no_more_can_be_taken(s, one_more):
    ref, a = s.reference, s.allocator
    count = len(ref.free) + one_more
    a = ref.alloc(count, *alloc_all_jit(a, jnp.int32(count)))  # one more than free: fails
    used = np.asarray(sorted(ref.used), np.int32)
    a = free_jit(a, jnp.asarray(np.pad(used, (0, CAPACITY - len(used)))))
    ref.free_slots(sorted(ref.used))
    ref.check(a)  # every slot back, each once
    assert int(a.num_free) == CAPACITY


@given(testing.req_to_token_pools(4, CTX, num_state_slots=4), st.data())
def test_after_any_history_freeing_rows_clears_them(s, data):
    live = sorted(s.reference.rows)
    gone = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
    ids = jnp.asarray(np.pad(np.asarray(gone, np.int32), (0, 5 - len(gone))))
    pool = free_reqs_jit(s.pool, ids)
    s.reference.free_reqs(ids)
    s.reference.check(pool)
    assert not np.asarray(pool.req_to_token)[gone].any()
    # and the pool keeps matching its model when rows are taken again
    n = min(len(gone), REQ_MAX_COUNT)
    s.reference.alloc_reqs(n, *alloc_reqs_jit(pool, jnp.int32(n)))


TINY = KimiLinearConfig.tiny()
copy_jit = jax.jit(pools.copy_states)


@given(testing.recurrent_state_pools(TINY, num_slots=6), st.data())
def test_copy_states_equals_numpy(pool, data):
    """Any pairs of slots (sources may repeat or be destinations; the sink may be either):
    every layer's states move as NumPy's fancy assignment moves them (reads before writes)."""
    n = data.draw(st.integers(1, 4))
    dst = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    src = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    new = copy_jit(pool, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    for old, got in zip(jax.tree.leaves(pool), jax.tree.leaves(new), strict=True):
        want = np.asarray(old).copy()  # [layers, slots, ...]
        want[:, dst] = np.asarray(old)[:, src]
        np.testing.assert_array_equal(np.asarray(got), want)


# --------------------------------------------------------------------------------------------
# allocator and request-table units
# --------------------------------------------------------------------------------------------



def test_fresh_allocator_hands_out_increasing_ids():
    a = SlotAllocator.create(8)
    a, s1, ok1 = alloc_jit(a, jnp.int32(3))
    a, s2, ok2 = alloc_jit(a, jnp.int32(2))
    assert bool(ok1) and bool(ok2)
    assert np.asarray(s1).tolist() == [1, 2, 3, 0, 0]
    assert np.asarray(s2).tolist() == [4, 5, 0, 0, 0]
    assert a.capacity == 7 and a.num_slots == 8 and a.num_used == 5


def test_alloc_argument_errors():
    a = SlotAllocator.create(4)
    with pytest.raises(ValueError, match="count 3 exceeds max_count 2"):
        pools.alloc(a, 3, 2)
    with pytest.raises(ValueError, match="max_count"):
        pools.alloc(a, 0, -1)
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator.create(1)
    # a traced count above max_count cannot raise: it fails like exhaustion
    new, slots, ok = alloc_jit(a, jnp.int32(MAX_COUNT + 1))
    assert not bool(ok) and not np.asarray(slots).any()
    chex.assert_trees_all_equal(new, a)


def test_alloc_or_raise():
    a = SlotAllocator.create(64)
    a, slots = pools.alloc_or_raise(a, 51, what="token slots")
    assert isinstance(slots, np.ndarray) and slots.tolist() == list(range(1, 52))
    with pytest.raises(PoolExhausted,
                       match=r"^token slots exhausted: requested 40, 12 available of 63$"):
        pools.alloc_or_raise(a, 40, what="token slots")
    a, slots = pools.alloc_or_raise(a, 12)
    assert a.num_used == 63 and len(slots) == 12
    with pytest.raises(PoolExhausted, match="slots exhausted: requested 1, 0 available of 63"):
        pools.alloc_or_raise(a, 1)


def test_methods_forward():
    a = SlotAllocator.create(4)
    a, slots, ok = a.alloc(2, 3)
    assert bool(ok) and np.asarray(slots).tolist() == [1, 2, 0]
    a = a.free(slots)
    assert int(a.num_free) == 3


def test_hybrid_failed_alloc_leaves_both_allocators():
    # rows available, state slots exhausted
    pool = HybridReqToTokenPool.create(4, CTX, num_state_slots=3)
    pool, rows, ok = alloc_reqs_jit(pool, jnp.int32(2))
    assert bool(ok) and np.asarray(rows).tolist() == [1, 2, 0]
    new, rows, ok = alloc_reqs_jit(pool, jnp.int32(1))
    assert not bool(ok) and not np.asarray(rows).any()
    chex.assert_trees_all_equal(new, pool)
    # state slots available, rows exhausted
    pool = HybridReqToTokenPool.create(2, CTX, num_state_slots=8)
    pool, _, ok = alloc_reqs_jit(pool, jnp.int32(2))
    new, _, ok2 = alloc_reqs_jit(pool, jnp.int32(1))
    assert bool(ok) and not bool(ok2)
    chex.assert_trees_all_equal(new, pool)
    assert pool.num_state_slots == 8 and pool.max_running_requests == 2


def test_plain_req_pool_under_jit():
    pool = ReqToTokenPool.create(3, 4)
    assert pool.max_running_requests == 3 and pool.max_context_len == 4
    pool, rows, ok = alloc_reqs_jit(pool, jnp.int32(2))
    assert bool(ok) and isinstance(pool, ReqToTokenPool)
    assert not isinstance(pool, HybridReqToTokenPool)
    req = jnp.array([1, 1, 2, 0], jnp.int32)  # the last token is padding (row 0)
    pos = jnp.array([0, 1, 0, 0], jnp.int32)
    pool = write_jit(pool, req, pos, jnp.array([7, 8, 9, 5], jnp.int32))
    got = jax.jit(functools.partial(pools.get_token_slots, width=2))(
        pool, jnp.array([1, 2, 0], jnp.int32))
    assert np.asarray(got).tolist() == [[7, 8], [9, 0], [0, 0]]
    pool = free_reqs_jit(pool, jnp.array([1, 0], jnp.int32))
    assert np.asarray(pool.req_to_token).tolist()[1] == [0, 0, 0, 0]
    assert np.asarray(pool.req_to_token).tolist()[2][0] == 9
    assert free_list(pool.allocator) == [3, 1]


def test_get_token_slots_width_and_create_errors():
    pool = ReqToTokenPool.create(2, 4)
    with pytest.raises(ValueError, match=r"width must be an int in \[0, 4\], got 5"):
        pools.get_token_slots(pool, jnp.array([1], jnp.int32), 5)
    with pytest.raises(ValueError, match="max_running_requests"):
        ReqToTokenPool.create(0, 4)
    with pytest.raises(ValueError, match="num_state_slots"):
        HybridReqToTokenPool.create(2, 4, num_state_slots=1)


# --------------------------------------------------------------------------------------------
# data pools
# --------------------------------------------------------------------------------------------

MLA_LAYERS = (1, 3, 7)
R_, DR = 8, 4


def test_mla_round_trip_and_padding_sink():
    pool = MLATokenPool.create(MLA_LAYERS, 10, R_, DR, dtype=jnp.bfloat16)
    assert pool.num_slots == 10 and pool.dtype == jnp.bfloat16
    assert pool.bytes_per_token == 3 * (R_ + DR) * 2
    assert pool.nbytes == 10 * pool.bytes_per_token
    set_kv = jax.jit(pools.set_mla_kv, static_argnums=1)
    rng = np.random.default_rng(0)
    c = rng.standard_normal((4, R_)).astype(np.float32)
    k = rng.standard_normal((4, DR)).astype(np.float32)
    slots = np.array([4, 2, 0, 0], np.int32)  # two padding tokens
    new = set_kv(pool, 3, jnp.asarray(slots), jnp.asarray(c), jnp.asarray(k))
    c_all, k_all = jax.jit(pools.get_mla_kv, static_argnums=1)(new, 3)
    assert c_all.dtype == jnp.bfloat16 and c_all.shape == (10, R_) and k_all.shape == (10, DR)
    c_all, k_all = np.asarray(c_all, np.float32), np.asarray(k_all, np.float32)
    np.testing.assert_allclose(c_all[[4, 2]], c[:2], rtol=1e-2)
    np.testing.assert_allclose(k_all[[4, 2]], k[:2], rtol=1e-2)
    # only slots 4, 2 and the sink changed, and only in layer 3
    untouched = np.ones(10, bool)
    untouched[[0, 2, 4]] = False
    assert not c_all[untouched].any() and not k_all[untouched].any()
    for lid in (1, 7):
        assert not any(np.asarray(x).any() for x in pools.get_mla_kv(new, lid))
    # padding-only writes touch only the sink
    pad = set_kv(pool, 1, jnp.zeros(4, jnp.int32), jnp.asarray(c), jnp.asarray(k))
    c0 = np.asarray(pad.c_kv[0], np.float32)
    assert not c0[1:].any() and c0[0].any()


def test_mla_errors():
    pool = MLATokenPool.create(MLA_LAYERS, 6, R_, DR)
    with pytest.raises(ValueError, match=r"layer_id 2 is not an MLA layer .*\(1, 3, 7\)"):
        pools.get_mla_kv(pool, 2)
    with pytest.raises(ValueError, match="layer_id 5"):
        pools.set_mla_kv(pool, 5, jnp.zeros(1, jnp.int32), jnp.zeros((1, R_)), jnp.zeros((1, DR)))
    with pytest.raises(ValueError, match="kv_lora_rank=8"):
        pools.set_mla_kv(pool, 1, jnp.zeros(1, jnp.int32), jnp.zeros((1, 3)), jnp.zeros((1, DR)))
    with pytest.raises(ValueError, match="distinct"):
        MLATokenPool.create((1, 1), 6, R_, DR)
    with pytest.raises(ValueError, match="non-empty"):
        MLATokenPool.create((), 6, R_, DR)


KDA_LAYERS = (0, 2)
K_, C_, H_, DK_, DV_ = 4, 6, 2, 3, 5


def test_recurrent_get_set_copy():
    pool = RecurrentStatePool.create(KDA_LAYERS, 5, C_, K_, H_, DK_, DV_, dtype=jnp.bfloat16)
    assert pool.num_slots == 5 and pool.dtype == jnp.bfloat16
    per_slot = 2 * ((K_ - 1) * C_ * 2 + H_ * DK_ * DV_ * 4)
    assert pool.bytes_per_request == per_slot and pool.nbytes == 5 * per_slot
    set_st = jax.jit(pools.set_states, static_argnums=1)
    get_st = jax.jit(pools.get_states, static_argnums=1)
    rng = np.random.default_rng(0)
    conv = rng.standard_normal((3, K_ - 1, C_)).astype(np.float32)
    ssm = rng.standard_normal((3, H_, DK_, DV_)).astype(np.float32)
    idx = jnp.array([3, 0, 1], jnp.int32)  # the middle entry is padding
    pool = set_st(pool, 2, idx, jnp.asarray(conv), jnp.asarray(ssm, jnp.bfloat16))
    assert pool.conv[1].dtype == jnp.bfloat16 and pool.ssm[1].dtype == jnp.float32
    c, s = get_st(pool, 2, jnp.array([3, 1, 4], jnp.int32))
    assert c.shape == (3, K_ - 1, C_) and s.shape == (3, H_, DK_, DV_)
    assert c.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    c, s = np.asarray(c, np.float32), np.asarray(s)
    np.testing.assert_allclose(c[:2], conv[[0, 2]], rtol=1e-2)
    np.testing.assert_allclose(s[:2], ssm[[0, 2]], rtol=1e-2)  # went through bf16
    assert not c[2].any() and not s[2].any()
    c_other, s_other = get_st(pool, 0, jnp.arange(5, dtype=jnp.int32))
    assert not np.asarray(c_other, np.float32).any() and not np.asarray(s_other).any()
    # copy slot 3 -> 4 and slot 1 -> 3 at once (reads happen before writes), for all layers
    pool = jax.jit(pools.copy_states)(pool, jnp.array([3, 1]), jnp.array([4, 3]))
    c2, s2 = get_st(pool, 2, jnp.array([4, 3, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(c2, np.float32)[:2], c[:2])
    np.testing.assert_array_equal(np.asarray(s2)[:2], s[:2])


def test_recurrent_errors():
    pool = RecurrentStatePool.create(KDA_LAYERS, 4, C_, K_, H_, DK_, DV_)
    with pytest.raises(ValueError, match=r"layer_id 1 is not a KDA layer .*\(0, 2\)"):
        pools.get_states(pool, 1, jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="per-slot shapes"):
        pools.set_states(pool, 0, jnp.zeros(1, jnp.int32), jnp.zeros((1, K_, C_)),
                         jnp.zeros((1, H_, DK_, DV_)))
    with pytest.raises(ValueError, match="conv_kernel"):
        RecurrentStatePool.create(KDA_LAYERS, 4, C_, 0, H_, DK_, DV_)


# --------------------------------------------------------------------------------------------
# pytree behaviour
# --------------------------------------------------------------------------------------------

ALL_POOLS = {
    "allocator": lambda: SlotAllocator.create(5),
    "req": lambda: ReqToTokenPool.create(3, 4),
    "hybrid": lambda: HybridReqToTokenPool.create(3, 4, 6),
    "mla": lambda: MLATokenPool.create(MLA_LAYERS, 6, R_, DR),
    "recurrent": lambda: RecurrentStatePool.create(KDA_LAYERS, 4, C_, K_, H_, DK_, DV_),
}


@pytest.mark.parametrize("name", sorted(ALL_POOLS))
def test_pytree_map_eval_shape_and_jit(name):
    pool = ALL_POOLS[name]()
    nones = jax.tree.map(lambda x: None, pool)
    assert type(nones) is type(pool) and jax.tree.leaves(nones) == []
    shapes = jax.eval_shape(ALL_POOLS[name])
    assert type(shapes) is type(pool)
    assert jax.tree.structure(shapes) == jax.tree.structure(pool)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert [x.shape for x in jax.tree.leaves(shapes)] == [x.shape for x in jax.tree.leaves(pool)]
    # created inside jit, passed through jit: same type, same static fields
    made = jax.jit(ALL_POOLS[name])()
    chex.assert_trees_all_equal(made, pool)
    chex.assert_trees_all_equal(jax.jit(lambda p: p)(pool), pool)


def test_layer_ids_are_static():
    a = MLATokenPool.create((1, 3), 4, 2, 2)
    b = MLATokenPool.create((1, 5), 4, 2, 2)
    assert jax.tree.structure(a) != jax.tree.structure(b)
    out = jax.eval_shape(lambda p: pools.set_mla_kv(p, 5, jnp.zeros(2, jnp.int32),
                                                    jnp.ones((2, 2)), jnp.ones((2, 2))), b)
    assert out.layer_ids == (1, 5)


def test_alloc_reqs_or_raise_names_what_ran_out():
    P = pools
    pool = P.HybridReqToTokenPool.create(4, 8, num_state_slots=3)
    pool, rows = P.alloc_reqs_or_raise(pool, 2)
    assert rows.tolist() == [1, 2]
    before = jax.tree.map(np.asarray, pool)
    msg = "recurrent-state slots exhausted: requested 1, 0 available of 2"
    with pytest.raises(P.PoolExhausted, match=msg):
        P.alloc_reqs_or_raise(pool, 1)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, pool))
    plain = P.ReqToTokenPool.create(1, 8)
    plain, _ = P.alloc_reqs_or_raise(plain, 1)
    with pytest.raises(P.PoolExhausted,
                       match="request rows exhausted: requested 2, 0 available of 1"):
        P.alloc_reqs_or_raise(plain, 2)


def test_one_token_writes_copy_no_pool_in_a_step_that_reads_the_pools():
    """A decode step of one request writes one token's latents and one ``req_to_token``
    entry, then attends over the pool. Written as one-row updates (dynamic update slices),
    XLA:CPU copied the latent pool four times per step around the attention's loop (a
    one-request decode step of the tiny config at 64k: 5.1-5.9 ms against 3.1-3.7 without);
    written as scatters of two rows, nothing pool-sized is copied."""
    from hybridattn.ops.mla import mla_decode

    S, W, r, dr = 4099, 4096, 8, 4
    pool = MLATokenPool.create((0,), num_slots=S, kv_lora_rank=r, qk_rope_head_dim=dr)
    req = ReqToTokenPool.create(max_running_requests=1, max_context_len=W)
    H, d = 2, 4

    def step(pool, req, slot, c_kv, k_pe, q_nope, q_pe, w_kc, w_vc):
        pool = pools.set_mla_kv(pool, 0, slot, c_kv, k_pe)
        req = pools.write_token_slots(req, jnp.array([1]), jnp.array([W - 1]), slot)
        c_all, k_all, offset = pools.get_mla_kv_flat(pool, 0)
        page = pools.get_token_slots(req, jnp.array([1]), W)
        out = mla_decode(q_nope, q_pe, c_all, k_all, w_kc, w_vc, page, jnp.array([W]),
                         scale=0.5, block_size=1024, slot_offset=offset)
        return pool, req, out

    args = (pool, req, jnp.array([S - 1]), jnp.ones((1, r)), jnp.ones((1, dr)),
            jnp.ones((1, H, d)), jnp.ones((1, H, dr)), jnp.ones((H, d, r)), jnp.ones((H, d, r)))
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and any(f"[{n}" in line or f",{n}" in line for n in (S, W))]
    assert not copies, "\n".join(copies)
