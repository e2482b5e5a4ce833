"""The prefix policy (``servecore.prefix``) against the radix tree, without MLX or JAX.

Random trees (prompts inserted with slots from a ``IdPool`` store, states hung at random
depths, some prefixes locked) and random requests check the rules of the module docstring:
the last prompt token always runs, a state is restored only at the deepest snapshot on
``prompt[:-1]``, ``cached_len`` agrees with ``match``, and ``make_room`` either hands out
exactly ``n`` slots, evicting no more than the shortfall's leaves, or changes nothing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from servecore.ids import IdPool
from servecore.prefix import (
    SlotSink,
    SlotStore,
    cached_len,
    evict_shortfall,
    keep_state,
    make_room,
    match,
    take_states,
)
from servecore.radix import RadixCache

prompts_st = st.lists(st.integers(0, 2), min_size=1, max_size=7)


@st.composite
def trees(draw, states: bool):
    """A tree with some prompts inserted (slots from a 64-slot store), states on some of their
    prefixes (handles from a 16-slot store) and some prefixes locked."""
    tree, kv, snaps = RadixCache(states=states), IdPool(64), IdPool(16)
    for prompt in draw(st.lists(prompts_st, max_size=6)):
        got, evicted = make_room(tree, kv, len(prompt), snaps)
        assert got is not None and not evicted.slots
        cached = tree.insert(prompt, got)
        kv.give(got[:cached])
        if states and draw(st.booleans()):
            depth = draw(st.integers(1, len(prompt)))
            handles, _ = take_states(tree, snaps, 1, kv)
            if handles and not tree.add_state(prompt[:depth], handles[0]):
                snaps.give(handles)
        if draw(st.booleans()):
            tree.lock(tree.match_prefix(prompt).node)
    return tree, kv, snaps


def held(tree, kv, snaps):
    return (sorted(tree.all_slots()), kv.num_free, sorted(h for _, h in tree.all_states()),
            snaps.num_free)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), states=st.booleans(), prompt=prompts_st)
def test_the_last_prompt_token_always_runs_and_peek_agrees(data, states, prompt):
    tree, _, _ = data.draw(trees(states))
    want = cached_len(tree, prompt)
    m = match(tree, prompt)
    assert m.cached == want <= len(prompt) - 1
    assert len(m.slots) >= m.cached  # K/V borrowed at least as deep as the usable prefix
    assert len(m.slots) == tree.peek(prompt)[0]  # ... and as deep as the tree has the prompt
    if not states:
        assert m.restore is None and m.cached == min(len(m.slots), len(prompt) - 1)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), prompt=prompts_st)
def test_a_state_is_restored_only_at_the_deepest_snapshot_before_the_last_token(data, prompt):
    tree, _, _ = data.draw(trees(True))
    depths = {len(t): h for t, h in ((_path(tree, h), h) for _, h in tree.all_states())
              if list(t) == prompt[:len(t)] and len(t) <= len(prompt) - 1}
    m = match(tree, prompt)
    if not depths:
        assert (m.cached, m.restore) == (0, None)
    else:
        deepest = max(depths)
        assert (m.cached, m.restore) == (deepest, depths[deepest])


def _path(tree, handle):
    """The tokens from the root to the node holding state ``handle``."""
    for node in tree._nodes():
        if node.state == handle:
            out = []
            while node.parent is not None:
                out[:0] = node.key
                node = node.parent
            return tuple(out)
    raise AssertionError(handle)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), states=st.booleans(), n=st.integers(0, 70))
def test_make_room_evicts_only_for_the_shortfall_or_nothing(data, states, n):
    tree, kv, snaps = data.draw(trees(states))
    before = held(tree, kv, snaps)
    free, evictable = kv.num_free, tree.evictable_size
    got, evicted = make_room(tree, kv, n, snaps)
    if got is None:
        assert n > free + evictable and held(tree, kv, snaps) == before
        assert not evicted.slots and not evicted.states
        return
    assert len(got) == n == len(set(got)) and not set(got) & set(tree.all_slots())
    if n <= free:
        assert not evicted.slots
    else:  # whole leaves go: never more than the shortfall plus one leaf's tokens
        assert len(evicted.slots) >= n - free
        assert len(evicted.slots) < n - free + 7
    assert kv.num_free + n + len(tree.all_slots()) == before[1] + len(before[0])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), states=st.booleans(), free=st.integers(0, 8), n=st.integers(0, 70))
def test_evict_shortfall_is_make_rooms_rule_without_the_store(data, states, free, n):
    tree, _, _ = data.draw(trees(states))
    size, evictable = tree.total_size, tree.evictable_size
    evicted = evict_shortfall(tree, free, n)
    if evicted is None:
        assert n - free > evictable and tree.total_size == size
    elif n <= free:
        assert evicted == ([], []) and tree.total_size == size
    else:
        assert n - free <= len(evicted.slots) == size - tree.total_size


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(0, 4))
def test_take_states_hands_out_free_slots_before_evicting(data, n):
    tree, kv, snaps = data.draw(trees(True))
    free = snaps.num_free
    got, evicted = take_states(tree, snaps, n, kv)
    if n <= free:
        assert not evicted.states and len(got) == n
    else:  # every free slot first, then what the eviction freed
        assert set(got[free:]) == set(evicted.states) and len(got) == free + len(evicted.states)


def test_keep_state_hangs_a_snapshot_once_or_gives_it_back():
    tree, kv, snaps = RadixCache(states=True), IdPool(8), IdPool(4)
    tree.insert([1, 2, 3], kv.take(3))
    a, b, c = snaps.take(3)
    assert keep_state(tree, [1, 2], a, snaps) and match(tree, [1, 2, 3]).restore == a
    assert not keep_state(tree, [1, 2], b, snaps)  # a state is there already
    assert not keep_state(tree, [7], c, snaps)  # the tree lacks the tokens
    assert snaps.num_free == 2 and isinstance(kv, SlotSink)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(0, 4))
def test_take_states_gives_back_what_it_evicts(data, n):
    tree, kv, snaps = data.draw(trees(True))
    slots_before = kv.num_free + len(tree.all_slots())
    handles_before = snaps.num_free + tree.num_states
    got, evicted = take_states(tree, snaps, n, kv)
    assert len(got) <= n and len(set(got)) == len(got)
    assert snaps.num_free + tree.num_states + len(got) == handles_before
    assert kv.num_free + len(tree.all_slots()) == slots_before
    if len(got) < n:  # fewer only when no unlocked state was left to evict
        assert all(node.lock_ref > 0 for node in tree._nodes() if node.state is not None)
    assert not set(got) & {h for _, h in tree.all_states()} and len(evicted.states) <= n


def test_the_snapshot_free_list_is_a_slot_store():
    assert isinstance(IdPool(4), SlotStore)
