"""RadixCache: unit tests, then property tests against the brute-force references of
``mlxcache.testing``, which are themselves tested here (strategies draw what they promise, the
reference catches broken caches).

The reference (``RefRadixCache``) is a dict ``(extra_key, prefix) -> slots of the last page of
prefix`` with one entry per cached page (``prefix`` = the tokens up to and including that
page); it is prefix-closed, so the longest cached prefix is the longest ``prefix`` present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlxcache.radix import RadixCache
from mlxcache.testing import (
    RadixOp,
    RefRadixCache,
    check_radix_program,
    radix_operations,
    ref_longest_prefix,
    shared_prefix_batches,
    token_sequences,
)

# ------------------------------------------------------------------------------------- unit --


def depth(node) -> int:
    """Tokens on the path from the root down to ``node``."""
    n = 0
    while node is not None:
        n += len(node.key)
        node = node.parent
    return n


def test_page_size_must_be_positive():
    with pytest.raises(ValueError, match="page_size.*0"):
        RadixCache(page_size=0)


def test_empty_cache_matches_nothing():
    cache = RadixCache()
    slots, node, _ = cache.match_prefix([1, 2, 3])
    assert slots == [] and depth(node) == 0
    assert cache.total_size == cache.evictable_size == cache.protected_size == 0
    assert cache.evict(5).slots == []


def test_insert_then_match_longest_prefix_and_split():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    slots, node, _ = cache.match_prefix([1, 2, 9])
    assert slots == [10, 11]
    assert node.key == (1, 2) and node.value == (10, 11)  # split mid-edge
    assert [c.key for c in node.children.values()] == [(3, 4)]
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13]
    assert cache.match_prefix([7])[0] == []
    assert cache.total_size == 4


def test_peek_splits_nothing_and_leaves_the_lru_order():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([5, 6], [14, 15])
    before = cache.pretty()
    assert cache.peek([1, 2, 9]) == (2, 0) and cache.peek([5, 6, 7]) == (2, 0)
    assert cache.pretty() == before  # no split
    assert cache.evict(2).slots == [10, 11, 12, 13]  # [1, 2, 3, 4] is still the oldest


def test_insert_returns_already_cached_and_keeps_tree_slots():
    cache = RadixCache()
    assert cache.insert([1, 2, 3], [10, 11, 12]) == 0
    assert cache.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24]) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2, 3], [30, 31, 32]) == 3
    assert cache.insert([1, 9], [40, 41]) == 1
    assert cache.match_prefix([1, 9])[0] == [10, 41]
    assert cache.total_size == 6


def test_insert_length_mismatch_names_lengths():
    with pytest.raises(ValueError, match="3 and 2"):
        RadixCache().insert([1, 2, 3], [1, 2])


def test_evict_is_lru_and_cascades_to_parents():
    cache = RadixCache()
    cache.insert([1, 2], [10, 11])
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([5, 6], [15, 16])
    cache.match_prefix([1, 2, 3])  # [5, 6] is now the least recently used
    assert cache.evict(1).slots == [15, 16]  # whole leaves go
    assert cache.evict(1).slots == [12]
    assert cache.evict(10).slots == [10, 11]  # [1, 2] became a leaf
    assert cache.total_size == 0
    assert cache.match_prefix([1, 2, 3])[0] == []


def test_evict_zero_and_negative():
    cache = RadixCache()
    cache.insert([1], [10])
    assert cache.evict(0).slots == []
    with pytest.raises(ValueError, match="-1"):
        cache.evict(-1)


def test_locked_nodes_survive_eviction():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 13])
    _, node, _ = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (3, 1)
    assert cache.evict(100).slots == [13]
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11, 12]
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    assert sorted(cache.evict(100).slots) == [10, 11, 12]


def test_locked_interior_node_survives_when_its_children_go():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    _, node, _ = cache.match_prefix([1, 2])  # splits: [1, 2] is now interior
    cache.lock(node)
    assert cache.evict(100).slots == [12]
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11]
    cache.unlock(node)
    assert cache.evict(100).slots == [10, 11]


def test_lock_is_reference_counted_and_unlock_below_zero_raises():
    cache = RadixCache()
    cache.insert([1, 2], [10, 11])
    _, node, _ = cache.match_prefix([1, 2])
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10).slots == []
    cache.unlock(node)
    with pytest.raises(ValueError, match="holds no lock"):
        cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 2


def test_unlock_of_an_ancestor_that_was_not_itself_locked_raises():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    _, deep, _ = cache.match_prefix([1, 2, 3])
    cache.lock(deep)
    _, mid, _ = cache.match_prefix([1])  # lock_ref 1 through `deep`, but no lock of its own
    with pytest.raises(ValueError, match="no lock of its own"):
        cache.unlock(mid)
    assert cache.protected_size == 3
    cache.unlock(deep)


def test_split_of_locked_node_keeps_sizes_and_locks():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, deep, _ = cache.match_prefix([1, 2, 3, 4])
    cache.lock(deep)
    _, mid, _ = cache.match_prefix([1, 2])  # splits the locked node
    assert mid.lock_ref == deep.lock_ref == 1
    assert cache.protected_size == 4 and cache.evictable_size == 0
    cache.unlock(deep)
    assert cache.protected_size == 0 and cache.evictable_size == 4


def test_lock_of_evicted_node_raises():
    cache = RadixCache()
    cache.insert([1], [10])
    _, node, _ = cache.match_prefix([1])
    cache.evict(1)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)


def test_root_can_be_locked():
    cache = RadixCache()
    slots, root, _ = cache.match_prefix([1])
    cache.lock(root)
    cache.insert([1], [10])
    assert cache.evict(1).slots == [10]
    cache.unlock(root)


def test_page_size_truncates_to_whole_pages():
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]) == 0
    assert cache.total_size == 4
    assert cache.match_prefix([1, 2, 3, 9])[0] == [10, 11]  # 3 alone is not a page
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11]
    assert cache.match_prefix([1, 9])[0] == []
    assert cache.insert([1, 2, 3, 9], [20, 21, 22, 23]) == 2
    assert cache.match_prefix([1, 2, 3, 9])[0] == [10, 11, 22, 23]


def test_page_size_children_keyed_by_first_page():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.insert([1, 5, 6, 7], [20, 21, 22, 23]) == 0
    assert cache.match_prefix([1, 5, 6, 7])[0] == [20, 21, 22, 23]
    assert cache.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    assert cache.total_size == 8


def test_extra_key_isolates_namespaces():
    cache = RadixCache()
    assert cache.insert([1, 2], [10, 11], extra_key="lora-a") == 0
    assert cache.match_prefix([1, 2])[0] == []
    assert cache.match_prefix([1, 2], extra_key="lora-b")[0] == []
    assert cache.insert([1, 2], [20, 21]) == 0
    assert cache.match_prefix([1, 2], extra_key="lora-a")[0] == [10, 11]
    assert cache.match_prefix([1, 2])[0] == [20, 21]
    assert cache.total_size == 4


def test_reset_drops_everything():
    cache = RadixCache()
    cache.insert([1, 2], [10, 11])
    _, node, _ = cache.match_prefix([1, 2])
    cache.lock(node)
    cache.reset()
    assert cache.total_size == 0 and cache.match_prefix([1, 2])[0] == []
    with pytest.raises(ValueError, match="not in this cache"):
        cache.unlock(node)


def test_pretty_shows_tree():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 4], [10, 13], extra_key="a")
    text = cache.pretty()
    assert "total=5" in text
    assert "[1, 2, 3] slots=[10, 11, 12] lock=0" in text
    assert "root extra_key='a'" in text
    long = RadixCache()
    long.insert(list(range(20)), list(range(20)))
    assert "+12]" in long.pretty()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.insert([1, 2.0], [10, 11]), "token 1 is 2.0 \\(float\\), not an int"),
        (lambda c: c.insert([1, True], [10, 11]), "token 1 is True \\(bool\\)"),
        (lambda c: c.insert([[1, 2]], [10]), "token 0 is \\[1, 2\\] \\(list\\)"),
        (lambda c: c.insert([1, -1], [10, 11]), "token 1 is -1, outside"),
        (lambda c: c.insert([1, 2**31], [10, 11]), "token 1 is 2147483648, outside"),
        (lambda c: c.insert("ab", [10, 11]), "tokens must be a list of token ids"),
        (lambda c: c.insert(np.array([1.0, 2.0]), [10, 11]), "1-D array of int.*float64"),
        (lambda c: c.insert([1, 2], [10, 1.5]), "slots\\[1\\]=1.5 must be an int slot id"),
        (lambda c: c.insert([1, 2], [10, -1]), "slots\\[1\\]=-1"),
        (lambda c: c.match_prefix([1, 2.5]), "token 1 is 2.5"),
        (lambda c: c.match_prefix([1], extra_key=[1]), "extra_key=\\[1\\] must be hashable"),
        (lambda c: c.match_prefix([1], extra_key=np.array([1])), "not an array"),
        (lambda c: c.lock("node"), "node='node' must be a TreeNode"),
        (lambda c: c.unlock(None), "node=None must be a TreeNode"),
        (lambda c: c.evict(True).slots, "num_tokens=True must be an int >= 0"),
        (lambda c: RadixCache(page_size=2.0), "page_size=2.0 must be an int"),
    ],
)
def test_bad_tokens_slots_keys_and_nodes_are_named_and_change_nothing(call, message):
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    before = cache.pretty()
    with pytest.raises(ValueError, match=message):
        call(cache)
    assert cache.pretty() == before


def test_numpy_tokens_and_slots_match_like_lists():
    cache = RadixCache()
    assert cache.insert(np.array([1, 2, 3], dtype=np.int32), np.array([10, 11, 12])) == 0
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11, 12]
    assert cache.match_prefix(np.array([1, 2, 9], dtype=np.uint16))[0] == [10, 11]
    assert cache.insert((1, 2, 3, 4), range(20, 24)) == 3


def test_release_locks_leaves_everything_evictable_and_all_slots_lists_the_tree():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 4], [10, 13])
    _, node, _ = cache.match_prefix([1, 2])
    cache.lock(node)
    cache.lock(node)
    assert cache.protected_size == 2
    cache.release_locks()
    assert (cache.protected_size, cache.evictable_size, cache.total_size) == (0, 4, 4)
    assert sorted(cache.all_slots()) == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="no lock of its own"):
        cache.unlock(node)
    assert sorted(cache.evict(4).slots) == [10, 11, 12, 13]
    assert cache.all_slots() == [] and cache.total_size == 0


def test_radix_module_does_not_import_mlx():
    path = Path(__file__).parents[2] / "mlxcache" / "radix.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('radix', {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'mlx imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------- properties vs the reference --


@given(radix_operations(extra_keys=[None, "a"]), st.sampled_from([1, 2, 3]))
def test_random_programs_agree_with_the_reference(program, page_size):
    check_radix_program(program, RadixCache(page_size))


@given(shared_prefix_batches(vocab_size=4, max_len=12), st.sampled_from([1, 2, 4]))
def test_shared_prefix_batches_insert_and_match_like_brute_force(prompts, page_size):
    cache = RadixCache(page_size)
    for i, p in enumerate(prompts):
        # what is cached already is the longest prefix over the prompts inserted before
        assert cache.insert(p, [1000 * i + j for j in range(len(p))]) == ref_longest_prefix(
            prompts[:i], p, page_size
        )
    for p in prompts:
        slots, node, _ = cache.match_prefix(p)
        assert len(slots) == depth(node) == len(p) - len(p) % page_size
        if slots:  # the first prompt that cached p's first page owns its slot
            owner = next(i for i, q in enumerate(prompts) if ref_longest_prefix([q], p, page_size))
            assert slots[0] == 1000 * owner
    distinct_pages = {
        tuple(p[:j]) for p in prompts for j in range(page_size, len(p) + 1, page_size)
    }
    assert cache.total_size == page_size * len(distinct_pages)


# ------------------------------------------------------ the references and strategies --


def _nodes(cache):
    """Every node of ``cache``, roots included."""
    out, stack = [], list(cache._roots.values())
    while stack:
        out.append(stack.pop())
        stack.extend(out[-1].children.values())
    return out


class _MostRecentlyUsedFirst(RadixCache):
    """A broken cache: evicts the most recently used leaves first."""

    def evict(self, num_tokens):
        nodes = _nodes(self)
        for n in nodes:
            n.last_access = -n.last_access
        try:
            return super().evict(num_tokens)
        finally:
            for n in nodes:
                n.last_access = -n.last_access


class _IgnoresLocks(RadixCache):
    """A broken cache: eviction ignores locks."""

    def evict(self, num_tokens):
        saved = [(n, n.lock_ref) for n in _nodes(self)]
        for n, _ in saved:
            n.lock_ref = 0
        try:
            return super().evict(num_tokens)
        finally:
            for n, lock_ref in saved:
                n.lock_ref = lock_ref


class _ForgetsToTouch(RadixCache):
    """A broken cache: matching does not refresh recency."""

    def match_prefix(self, tokens, extra_key=None):
        before = {id(n): n.last_access for n in _nodes(self)}
        out = super().match_prefix(tokens, extra_key)
        for n in _nodes(self):
            n.last_access = before.get(id(n), n.last_access)
        return out


@pytest.mark.parametrize(
    "broken, program, message",
    [
        (
            _MostRecentlyUsedFirst,
            [RadixOp("insert", (1,)), RadixOp("insert", (2,)), RadixOp("evict", n=1)],
            "least recently used first",
        ),
        (
            _IgnoresLocks,
            [RadixOp("insert", (1,)), RadixOp("match", (1,), lock=True), RadixOp("evict", n=1)],
            "evicted locked pages",
        ),
        (
            _ForgetsToTouch,
            [
                RadixOp("insert", (1,)),
                RadixOp("insert", (2,)),
                RadixOp("match", (1,)),
                RadixOp("evict", n=1),
            ],
            "least recently used first",
        ),
    ],
)
def test_the_reference_catches_broken_caches(broken, program, message):
    with pytest.raises(AssertionError, match=rf"op \d+ evict\(1\).*{message}"):
        check_radix_program(program, broken())
    check_radix_program(program, RadixCache())  # the real cache passes it


def test_ref_apply_eviction_rejects_each_invalid_eviction():
    def ref_with_tree():
        ref = RefRadixCache()
        ref.insert([1, 2, 3], [1, 2, 3])
        ref.insert([1, 4], [1, 4])  # 4's own slot is 4 (the 1 is a duplicate)
        return ref

    cases = [
        ([3, 3], 2, "evicted twice"),
        ([99], 1, "not cached"),
        ([2], 1, "extensions stay cached"),
        ([], 1, "while 4 evictable remain"),
        ([4], 1, "least recently used first"),  # [1, 2, 3] was used before [1, 4]
    ]
    for freed, n, message in cases:
        with pytest.raises(AssertionError, match=message):
            ref_with_tree().apply_eviction(freed, n)
    paged = RefRadixCache(page_size=2)
    paged.insert([1, 2], [10, 11])
    with pytest.raises(AssertionError, match="part of a page"):
        paged.apply_eviction([11], 1)
    ref = ref_with_tree()
    ref.apply_eviction([3, 2], 2)  # [2, 3] was one leaf edge: it goes whole
    assert ref.total_size == 2 and ref.match_prefix([1, 2])[0] == [1]


def test_ref_longest_prefix_and_ref_cache_agree():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [7]]
    ref = RefRadixCache(page_size=2)
    for i, s in enumerate(seqs):
        ref.insert(s, [10 * i + j for j in range(len(s))])
    for query in ([1, 2, 3, 4, 5], [1, 2, 5, 6], [1, 9], [7], []):
        assert ref.cached_len(query) == ref_longest_prefix(seqs, query, page_size=2)
    with pytest.raises(ValueError, match="page_size"):
        ref_longest_prefix(seqs, [1], page_size=0)


def test_radix_op_repr_is_the_call():
    assert repr(RadixOp("insert", (1, 2), extra_key="a")) == "insert([1, 2], extra_key='a')"
    assert repr([RadixOp("unlock", n=3), RadixOp("reset")]) == "[unlock(3), reset()]"


@given(token_sequences(vocab_size=5, min_len=3, max_len=10, length_multiple=3))
def test_token_sequences_respect_their_bounds(tokens):
    assert len(tokens) in (3, 6, 9) and all(0 <= t < 5 for t in tokens)


@given(shared_prefix_batches(vocab_size=6, min_size=2, max_size=6, min_len=2, max_len=12,
                             length_multiple=2))  # fmt: skip
def test_shared_prefix_batches_respect_their_bounds(prompts):
    assert 2 <= len(prompts) <= 6
    assert all(2 <= len(p) <= 12 and len(p) % 2 == 0 for p in prompts)
    assert all(0 <= t < 6 for p in prompts for t in p)


# The first example found, unshrunk (shrinking would cost seconds and show nothing more).
FIND = settings(max_examples=500, database=None, derandomize=True, phases=[Phase.generate])


def _shapes(prompts):
    """Which tree shapes a batch shows."""
    pairs = [(a, b) for i, a in enumerate(prompts) for j, b in enumerate(prompts) if i != j]
    return {
        "duplicate": any(a == b for a, b in pairs),
        "prefix of another": any(len(a) < len(b) and b[: len(a)] == a for a, b in pairs),
        "branch": any(0 < ref_longest_prefix([a], b) < min(len(a), len(b)) for a, b in pairs),
        "shorter first": any(
            len(a) < len(b) and b[: len(a)] == a
            for i, a in enumerate(prompts)
            for b in prompts[i + 1 :]
        ),
    }


@pytest.mark.parametrize("shape", ["duplicate", "prefix of another", "branch", "shorter first"])
def test_shared_prefix_batches_draw_every_tree_shape(shape):
    find(
        shared_prefix_batches(vocab_size=64),
        lambda prompts: _shapes(prompts)[shape],
        settings=FIND,
    )


def test_common_root_prefix_is_drawn():
    batch = find(
        shared_prefix_batches(vocab_size=64, min_size=3),
        lambda ps: len({p[0] for p in ps}) == 1 and len({tuple(p) for p in ps}) == len(ps),
        settings=FIND,
    )
    assert ref_longest_prefix(batch[1:], batch[0]) >= 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: token_sequences(vocab_size=0), "vocab_size"),
        (lambda: token_sequences(min_len=5, max_len=6, length_multiple=4), "no multiple"),
        (lambda: shared_prefix_batches(min_size=3, max_size=2), "max_size"),
        (lambda: radix_operations(extra_keys=[]), "extra_keys"),
        (lambda: RefRadixCache(page_size=0), "page_size"),
    ],
)
def test_strategy_arguments_are_checked_eagerly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------ stateful vs the reference --

TOKENS = token_sequences(vocab_size=4, max_len=9)
EXTRA_KEYS = st.sampled_from([None, "a"])


class RadixMachine(RuleBasedStateMachine):
    """RadixCache against ``mlxcache.testing.RefRadixCache`` and a list of held locks."""

    @initialize(page_size=st.sampled_from([1, 1, 2, 3]))
    def init(self, page_size):
        self.cache = RadixCache(page_size)
        self.ref = RefRadixCache(page_size)
        self.locks: list[tuple] = []  # (node, the reference's handle)
        self.inserted: list[tuple] = []  # (extra_key, tokens)
        self.next_slot = 1

    def check_match(self, tokens, extra_key):
        peeked = self.cache.peek(tokens, extra_key)  # read-only: before the split
        slots, node, _ = self.cache.match_prefix(tokens, extra_key)
        assert peeked == (len(slots), 0)
        want, handle = self.ref.match_prefix(tokens, extra_key)
        assert slots == want
        assert depth(node) == len(handle[1])
        return node, handle

    @rule(tokens=TOKENS, extra_key=EXTRA_KEYS)
    def insert(self, tokens, extra_key):
        slots = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        want = self.ref.insert(tokens, slots, extra_key)
        assert self.cache.insert(tokens, slots, extra_key) == want
        self.inserted.append((extra_key, tuple(tokens)))

    @rule(tokens=TOKENS, extra_key=EXTRA_KEYS)
    def match(self, tokens, extra_key):
        self.check_match(tokens, extra_key)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), lock=st.booleans())
    def match_inserted(self, data, lock):
        extra_key, tokens = data.draw(st.sampled_from(self.inserted))
        cut = data.draw(st.integers(0, len(tokens)))
        tail = data.draw(TOKENS)
        node, handle = self.check_match(list(tokens[:cut]) + tail, extra_key)
        if lock:
            self.cache.lock(node)
            self.ref.lock(handle)
            self.locks.append((node, handle))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, handle = self.locks.pop(i)
        self.cache.unlock(node)
        self.ref.unlock(handle)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        # whole pages, no locked page, leaves only, LRU first, enough unless nothing is left
        self.ref.apply_eviction(self.cache.evict(num_tokens).slots, num_tokens)

    @rule()
    def reset(self):
        self.cache.reset()
        self.ref.reset()
        self.locks.clear()

    @invariant()
    def sizes_add_up(self):
        cache, ref = self.cache, self.ref
        assert cache.evictable_size + cache.protected_size == cache.total_size == ref.total_size
        assert ref.locked_pages() <= ref.pages.keys(), "a locked token is no longer cached"
        assert cache.protected_size == ref.protected_size


# Pure Python and cheap (~10 ms an example): more examples than the profile's default.
RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40)
TestRadixMachine = RadixMachine.TestCase
