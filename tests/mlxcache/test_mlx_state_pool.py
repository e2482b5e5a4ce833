"""The state-carrying tree machine of ``tests/servecore/test_radix_states.py`` driving mlxcache's
state pool: every state handle is a slot of an MLX ``StatePool`` (from a ``SlotAllocator``), written
with ``set_states`` when the tree takes it and read back with ``get_states`` on every match.
Checked after every step, besides the tree machine's own invariants: pool functions never
change their inputs, a match restores exactly the state stored for that depth, and no snapshot
slot leaks (free + held by the tree == capacity).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

mx = pytest.importorskip("mlx.core")

from mlxcache.pool import alloc, free, get_states, init_allocator, init_state_pool, set_states  # noqa: E402
from tests.servecore.test_radix_states import TreeWithStates, tokens_st  # noqa: E402

pytestmark = pytest.mark.mlx

SHAPES = [((2, 3), mx.float32), ((4,), mx.bfloat16)]  # a conv window and a recurrent state
CAPACITY = 24  # snapshot slots, the sink included: small, so the pool runs out


def _value(prefix: tuple, j: int) -> mx.array:
    """A state that says which prefix it belongs to (exact in bfloat16 too)."""
    shape, dtype = SHAPES[j]
    base = float(sum((t + 1) * 3**i for i, t in enumerate(prefix)) % 97)
    return (mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(1, *shape) + base
            ).astype(dtype)


class StatePoolMachine(TreeWithStates):
    def __init__(self):
        super().__init__()
        self.pool = init_state_pool(SHAPES, CAPACITY)
        self.alloc = init_allocator(CAPACITY)
        self.free_handles = self.alloc.free_slots.tolist()  # handles come from the allocator
        self.all_handles = set(range(1, CAPACITY))

    def apply_eviction(self, freed):
        self.free_handles = []  # the base class keeps its own list; ours is the allocator
        super().apply_eviction(freed)
        if freed.states:
            self.alloc = free(self.alloc, freed.states)
        self.free_handles = self.alloc.free_slots.tolist()

    @rule(data=st.data())
    def add_state(self, data):
        prefix = tuple(self.cached_prefix(data))
        a, slots, ok = alloc(self.alloc, 1)
        if not ok:
            return  # the pool is full: a snapshot is skipped, as the engine does
        (slot,) = slots
        before = [np.array(x.astype(mx.float32)) for x in self.pool.arrays]
        new = set_states(self.pool, [slot], [_value(prefix, j) for j in range(len(SHAPES))])
        for old, was in zip(self.pool.arrays, before, strict=True):  # the input is unchanged
            assert np.array_equal(np.array(old.astype(mx.float32)), was)
        if self.tree.add_state(prefix, slot):
            assert prefix in self.kv and prefix not in self.states
            self.states[prefix] = slot
            self.pool, self.alloc = new, a
        else:
            assert prefix not in self.kv or prefix in self.states
        self.free_handles = self.alloc.free_slots.tolist()

    @rule(tokens=tokens_st)
    def restore(self, tokens):
        got = self.tree.match_prefix(tokens)
        depth = got.state_node.depth
        if depth:
            restored = get_states(self.pool, [got.state_node.state])
            for j, x in enumerate(restored):
                assert x.dtype == SHAPES[j][1]
                assert mx.array_equal(x, _value(tuple(tokens[:depth]), j)).item()

    @invariant()
    def no_snapshot_slot_leaks(self):
        held = sorted(self.states.values())
        assert self.alloc.num_free + len(held) == CAPACITY - 1
        assert not set(held) & set(self.alloc.free_slots.tolist())


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(stateful_step_count=30, max_examples=40, deadline=None)
