"""RadixCache: unit tests plus a stateful test against a brute-force model.

The model is a dict ``(extra_key, prefix) -> slots of the last page of prefix`` with one entry
per cached page (``prefix`` = the tokens up to and including that page); it is prefix-closed, so
the longest cached prefix is the longest ``prefix`` present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlxcache.radix import RadixCache

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
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots == [] and depth(node) == 0
    assert cache.total_size == cache.evictable_size == cache.protected_size == 0
    assert cache.evict(5) == []


def test_insert_then_match_longest_prefix_and_split():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    slots, node = cache.match_prefix([1, 2, 9])
    assert slots == [10, 11]
    assert node.key == (1, 2) and node.value == (10, 11)  # split mid-edge
    assert [c.key for c in node.children.values()] == [(3, 4)]
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13]
    assert cache.match_prefix([7])[0] == []
    assert cache.total_size == 4


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
    assert cache.evict(1) == [15, 16]  # whole leaves go
    assert cache.evict(1) == [12]
    assert cache.evict(10) == [10, 11]  # [1, 2] became a leaf
    assert cache.total_size == 0
    assert cache.match_prefix([1, 2, 3])[0] == []


def test_evict_zero_and_negative():
    cache = RadixCache()
    cache.insert([1], [10])
    assert cache.evict(0) == []
    with pytest.raises(ValueError, match="-1"):
        cache.evict(-1)


def test_locked_nodes_survive_eviction():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 13])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (3, 1)
    assert cache.evict(100) == [13]
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11, 12]
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    assert sorted(cache.evict(100)) == [10, 11, 12]


def test_locked_interior_node_survives_when_its_children_go():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    _, node = cache.match_prefix([1, 2])  # splits: [1, 2] is now interior
    cache.lock(node)
    assert cache.evict(100) == [12]
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11]
    cache.unlock(node)
    assert cache.evict(100) == [10, 11]


def test_lock_is_reference_counted_and_unlock_below_zero_raises():
    cache = RadixCache()
    cache.insert([1, 2], [10, 11])
    _, node = cache.match_prefix([1, 2])
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10) == []
    cache.unlock(node)
    with pytest.raises(ValueError, match="holds no lock"):
        cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 2


def test_unlock_of_an_ancestor_that_was_not_itself_locked_raises():
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    _, deep = cache.match_prefix([1, 2, 3])
    cache.lock(deep)
    _, mid = cache.match_prefix([1])  # lock_ref 1 through `deep`, but no lock of its own
    with pytest.raises(ValueError, match="no lock of its own"):
        cache.unlock(mid)
    assert cache.protected_size == 3
    cache.unlock(deep)


def test_split_of_locked_node_keeps_sizes_and_locks():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, deep = cache.match_prefix([1, 2, 3, 4])
    cache.lock(deep)
    _, mid = cache.match_prefix([1, 2])  # splits the locked node
    assert mid.lock_ref == deep.lock_ref == 1
    assert cache.protected_size == 4 and cache.evictable_size == 0
    cache.unlock(deep)
    assert cache.protected_size == 0 and cache.evictable_size == 4


def test_lock_of_evicted_node_raises():
    cache = RadixCache()
    cache.insert([1], [10])
    _, node = cache.match_prefix([1])
    cache.evict(1)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)


def test_root_can_be_locked():
    cache = RadixCache()
    slots, root = cache.match_prefix([1])
    cache.lock(root)
    cache.insert([1], [10])
    assert cache.evict(1) == [10]
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
    _, node = cache.match_prefix([1, 2])
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


def test_radix_module_does_not_import_mlx():
    path = Path(__file__).parents[1] / "mlxcache" / "radix.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('radix', {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'mlx imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- stateful vs model --

TOKENS = st.lists(st.integers(0, 3), max_size=9)
EXTRA_KEYS = st.sampled_from([None, "a"])


class RadixMachine(RuleBasedStateMachine):
    """RadixCache against ``model: {(extra_key, prefix): page slots}`` and a list of held locks."""

    @initialize(page_size=st.sampled_from([1, 1, 2, 3]))
    def init(self, page_size):
        self.page = page_size
        self.cache = RadixCache(page_size)
        self.model: dict[tuple, tuple[int, ...]] = {}
        self.locks: list[tuple] = []  # (node, extra_key, matched prefix)
        self.inserted: list[tuple] = []  # (extra_key, tokens)
        self.next_slot = 1
        self.gone: set[int] = set()  # evicted slots, and caller slots never stored

    def page_keys(self, extra_key, tokens, start, stop):
        """Model keys of the pages of ``tokens`` in ``[start, stop)`` (whole pages)."""
        return [
            (extra_key, tuple(tokens[:j])) for j in range(start + self.page, stop + 1, self.page)
        ]

    def cached_len(self, extra_key, tokens) -> int:
        n = 0
        while n + self.page <= len(tokens) and (extra_key, tuple(tokens[: n + self.page])) in (
            self.model
        ):
            n += self.page
        return n

    def check_match(self, tokens, extra_key):
        slots, node = self.cache.match_prefix(tokens, extra_key)
        n = self.cached_len(extra_key, tokens)
        assert slots == [
            s for key in self.page_keys(extra_key, tokens, 0, n) for s in self.model[key]
        ]
        assert depth(node) == n
        assert not self.gone.intersection(slots)
        return node, tuple(tokens[:n])

    @rule(tokens=TOKENS, extra_key=EXTRA_KEYS)
    def insert(self, tokens, extra_key):
        slots = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        expected = self.cached_len(extra_key, tokens)
        assert self.cache.insert(tokens, slots, extra_key) == expected
        whole = len(tokens) - len(tokens) % self.page
        for key in self.page_keys(extra_key, tokens, expected, whole):
            self.model[key] = tuple(slots[len(key[1]) - self.page : len(key[1])])
        self.gone.update(slots[:expected] + slots[whole:])  # duplicates, partial page
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
        node, prefix = self.check_match(list(tokens[:cut]) + tail, extra_key)
        if lock:
            self.cache.lock(node)
            self.locks.append((node, extra_key, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        freed = self.cache.evict(num_tokens)
        assert len(freed) == len(set(freed))
        by_slot = {slot: key for key, page in self.model.items() for slot in page}
        assert set(freed) <= set(by_slot), "evict returned slots that were not cached"
        evicted = {by_slot[slot] for slot in freed}
        assert set(freed) == {s for key in evicted for s in self.model[key]}, "part of a page"
        assert not evicted & self.locked_keys(), "evicted a locked token"
        for key in evicted:
            del self.model[key]
        self.gone.update(freed)
        if len(freed) < num_tokens:
            assert self.cache.evictable_size == 0
        for extra_key, prefix in self.model:  # whole leaves only: still prefix-closed
            assert len(prefix) == self.page or (extra_key, prefix[: -self.page]) in self.model

    @rule()
    def reset(self):
        self.cache.reset()
        self.gone.update(s for page in self.model.values() for s in page)
        self.model.clear()
        self.locks.clear()

    def locked_keys(self) -> set[tuple]:
        return {
            key
            for _, extra_key, prefix in self.locks
            for key in self.page_keys(extra_key, prefix, 0, len(prefix))
        }

    @invariant()
    def sizes_add_up(self):
        cache = self.cache
        cached = self.page * len(self.model)
        assert cache.evictable_size + cache.protected_size == cache.total_size == cached
        locked = self.locked_keys()
        assert locked <= self.model.keys(), "a locked token is no longer cached"
        assert cache.protected_size == self.page * len(locked)


# Pure Python and cheap (~10 ms an example): more examples than the profile's default.
RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40)
TestRadixMachine = RadixMachine.TestCase
