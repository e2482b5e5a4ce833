"""The radix tree with recurrent-state snapshots (``servecore.radix``, ``states=True``) against
a brute-force model.

Oracle: a model that stores every cached prefix (tuples of token ids) with its slot and its
state handle, and answers a match by trying every prefix of the query. A hypothesis state
machine inserts, matches, attaches states, locks, unlocks and evicts tokens and states, and
checks after every step that matches agree with the model (never a state deeper than the KV
match), that sizes equal a recount, that locked paths and their states survive evictions, and
that every slot and handle is in exactly one place: the tree, the caller's free list, or
freed by an eviction. At the end, with everything unlocked and evicted, all are free again.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servecore.radix import Evicted, RadixCache

VOCAB = 3  # few tokens: prompts share prefixes often
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)


class TreeWithStates(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = RadixCache(states=True)
        self.kv: dict[tuple, int] = {}  # cached prefix -> slot of its last token
        self.states: dict[tuple, int] = {}  # prefix -> state handle at its end
        self.locks: list[tuple[tuple, object]] = []  # (prefix locked, node)
        self.free_slots = list(range(1, 400))
        self.free_handles = list(range(1, 200))
        self.all_slots, self.all_handles = set(self.free_slots), set(self.free_handles)

    # -- the model ----------------------------------------------------------------------------
    def model_match(self, tokens):
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.kv:
            n += 1
        depth = max([d for d in range(1, n + 1) if tuple(tokens[:d]) in self.states], default=0)
        return [self.kv[tuple(tokens[: i + 1])] for i in range(n)], depth

    def locked_prefixes(self):
        return {p[:d] for p, _ in self.locks for d in range(1, len(p) + 1)}

    def apply_eviction(self, freed: Evicted):
        slot_of = {s: p for p, s in self.kv.items()}
        handle_of = {h: p for p, h in self.states.items()}
        locked = self.locked_prefixes()
        assert len(set(freed.slots)) == len(freed.slots)
        for s in freed.slots:
            p = slot_of[s]
            assert p not in locked, f"evicted a locked prefix {p}"
            del self.kv[p]
            self.free_slots.append(s)
        for h in freed.states:
            p = handle_of[h]
            assert p not in locked, f"evicted the state of a locked prefix {p}"
            del self.states[p]
            self.free_handles.append(h)
        for p in self.states:  # a state never outlives its KV
            assert p in self.kv

    # -- rules --------------------------------------------------------------------------------
    @rule(tokens=tokens_st)
    def insert(self, tokens):
        slots = [self.free_slots.pop() for _ in tokens]
        n = self.tree.insert(tokens, slots)
        have, _ = self.model_match(tokens)
        assert n == len(have)
        for i in range(n, len(tokens)):
            self.kv[tuple(tokens[: i + 1])] = slots[i]
        self.free_slots += slots[:n]  # duplicates go back to the caller

    def cached_prefix(self, data):
        """A cached prefix (most of the time) or any token list."""
        if self.kv and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(sorted(self.kv)))
        return tuple(data.draw(tokens_st))

    @rule(data=st.data())
    def add_state(self, data):
        prefix = self.cached_prefix(data)
        handle = self.free_handles.pop()
        ok = self.tree.add_state(prefix, handle)
        assert ok == (prefix in self.kv and prefix not in self.states)
        if ok:
            self.states[prefix] = handle
        else:
            self.free_handles.append(handle)

    @rule(tokens=tokens_st)
    def match(self, tokens):
        slots, depth = self.model_match(tokens)
        assert self.tree.peek(tokens) == (len(slots), depth)  # read-only, before the split
        got = self.tree.match_prefix(tokens)
        assert got.slots == slots
        assert got.state_node.depth == depth <= len(got.slots)
        assert got.node.depth == len(got.slots)
        if depth:
            assert got.state_node.state == self.states[tuple(tokens[:depth])]

    @rule(data=st.data())
    def lock(self, data):
        tokens = self.cached_prefix(data)
        got = self.tree.match_prefix(tokens)
        self.tree.lock(got.node)
        self.locks.append((tuple(tokens[: len(got.slots)]), got.node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        _, node = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(n=st.integers(0, 10))
    def evict_tokens(self, n):
        freed = self.tree.evict(n)
        evictable = len(self.kv) - len(self.locked_prefixes())
        assert len(freed.slots) >= min(n, evictable) or not freed.slots == []
        self.apply_eviction(freed)

    @rule(n=st.integers(0, 4))
    def evict_states(self, n):
        evictable = [p for p in self.states if p not in self.locked_prefixes()]
        freed = self.tree.evict_states(n)
        assert len(freed.states) == min(n, len(evictable))
        self.apply_eviction(freed)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def sizes_equal_a_recount_and_nothing_is_lost(self):
        t = self.tree
        assert t.total_size == len(t.all_slots()) == len(self.kv)
        assert sorted(t.all_slots()) == sorted(self.kv.values())
        assert t.num_states == len(t.all_states()) == len(self.states)
        assert sorted(h for _, h in t.all_states()) == sorted(self.states.values())
        assert t.protected_size == len(self.locked_prefixes())
        assert set(self.free_slots) | set(self.kv.values()) == self.all_slots
        assert len(self.free_slots) + len(self.kv) == len(self.all_slots)
        assert set(self.free_handles) | set(self.states.values()) == self.all_handles
        assert len(self.free_handles) + len(self.states) == len(self.all_handles)

    def teardown(self):
        for _, node in self.locks:
            self.tree.unlock(node)
        self.locks.clear()
        self.apply_eviction(self.tree.evict_states(10**6))
        self.apply_eviction(self.tree.evict(10**6))
        assert self.tree.total_size == 0 and self.tree.num_states == 0
        assert set(self.free_slots) == self.all_slots and set(self.free_handles) == self.all_handles


TestTreeWithStates = TreeWithStates.TestCase
TestTreeWithStates.settings = settings(stateful_step_count=40, deadline=None)


def test_a_split_keeps_the_state_at_its_depth():
    tree = RadixCache(states=True)
    tree.insert([1, 2, 3, 4], [5, 6, 7, 8])
    assert tree.add_state([1, 2, 3, 4], "deep")
    m = tree.match_prefix([1, 2, 9])  # splits [1, 2, 3, 4] after [1, 2]
    assert m.node.depth == 2 and m.node.state is None and m.state_node.depth == 0
    assert tree.match_prefix([1, 2, 3, 4]).state_node.state == "deep"
    assert tree.add_state([1, 2], "mid")
    assert [d for d, _ in sorted(tree.all_states())] == [2, 4]


def test_evicting_a_leaf_removes_the_tombstone_leaves_above_it():
    tree = RadixCache(states=True)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [10, 11, 13])
    assert tree.add_state([1, 2, 3], "a") and tree.add_state([1, 2, 4], "b")
    tree.match_prefix([1, 2, 4])  # [1, 2, 3] is least recently used
    assert tree.evict(1) == Evicted([12], ["a"])
    # [1, 2] (a tombstone) still has a child; evicting that child takes the tombstone too
    assert sorted(tree.evict(1).slots) == [10, 11, 13] and tree.total_size == 0


def test_plain_trees_refuse_states_and_keep_tombstone_free_semantics():
    tree = RadixCache()
    with pytest.raises(ValueError, match="holds no states"):
        tree.add_state([1], "a")
    tree.insert([1, 2], [10, 11])
    tree.insert([1, 3], [10, 12])
    assert tree.evict(1).slots in ([11], [12])
    assert tree.total_size == 2  # the shared [1] stays: plain KV is useful on its own
