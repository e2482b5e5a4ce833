"""``RadixCache``: the tree from token ids to slot ids, its matches, inserts, states and locks
(``servecore.radix`` has the contract; eviction is ``servecore.radix.eviction``)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Hashable, Sequence

from servecore.radix.eviction import LRUEviction
from servecore.radix.locks import Locks
from servecore.radix.nodes import (
    PrefixMatch,
    TreeNode,
    _check_extra_key,
    _short,
    _slots,
    _tokens,
)
from servecore.validate import INT32_MAX, is_int

__all__ = ["RadixCache"]


class RadixCache(Locks, LRUEviction):
    """Radix tree over token ids mapping to KV slot ids (see the module docstring).

    Sizes count tokens: ``evictable_size`` (in unlocked nodes) + ``protected_size`` (in locked
    nodes) == ``total_size``. ``num_states`` counts the state handles held.

    Args:
        page_size: granularity in tokens: only whole pages are stored and matched.
        states: whether nodes may hold recurrent-state handles (a hybrid model's cache).

    Examples:
        >>> cache = RadixCache(page_size=2)
        >>> cache.insert([1, 2, 3, 4, 5], [7, 8, 9, 10, 11])   # the lone 5th token is dropped
        0
        >>> slots, node, _ = cache.match_prefix([1, 2, 3, 9])
        >>> slots, cache.total_size
        ([7, 8], 4)
        >>> cache.lock(node)
        >>> cache.evict(4).slots, cache.protected_size
        ([9, 10], 2)
        >>> cache.unlock(node)
    """

    def __init__(self, page_size: int = 1, states: bool = False):
        if not is_int(page_size) or not 1 <= page_size <= INT32_MAX:
            raise ValueError(f"page_size={page_size!r} must be an int in [1, {INT32_MAX}]")
        if not isinstance(states, bool):
            raise ValueError(f"states={states!r} must be a bool")
        self.page_size = int(page_size)
        self.states = states
        # Called with each leaf about to be evicted (attached, its ancestors intact): a disk
        # tier spills it there (``mlxcache.engine._disk``).
        self.on_evict: Callable[[TreeNode], None] | None = None
        self.reset()

    # ---------------------------------------------------------------------------- state ----

    def reset(self) -> None:
        """Drop every node (the caller owns the slots and handles it held) and all locks.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> cache.reset()
            >>> cache.total_size, cache.match_prefix([1, 2]).slots
            (0, [])
        """
        self._roots: dict[Hashable, TreeNode] = {}
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self._evictable = 0
        self._protected = 0
        self._num_states = 0

    @property
    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens held in locked nodes."""
        return self._protected

    @property
    def total_size(self) -> int:
        """Tokens held in the tree."""
        return self._evictable + self._protected

    @property
    def num_states(self) -> int:
        """State handles held in the tree."""
        return self._num_states

    # ------------------------------------------------------------------------- helpers ----

    def _new_node(
        self, key: tuple[int, ...], value: tuple[int, ...], parent: TreeNode | None, tick: int
    ) -> TreeNode:
        return TreeNode(key, value, parent, 0, tick, next(self._ids))

    def _root(self, extra_key: Hashable | None) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = self._new_node((), (), None, 0)
        return root

    def _child_key(self, tokens: Sequence[int], start: int) -> Hashable:
        """Children are keyed by their first token (page_size 1) or first page."""
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    def _match_len(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Length of the common prefix of ``key`` and ``tokens[start:]``, in whole pages."""
        n = min(len(key), len(tokens) - start)
        # The first index where they differ, at C speed (a Python loop cost 2 ms a request
        # over a 512-token prefix): ``compress`` yields the indices where ``ne`` is true.
        part = itertools.islice(tokens, start, start + n)
        i = next(itertools.compress(itertools.count(), map(operator.ne, key, part)), n)
        return i - i % self.page_size

    def _split(self, child: TreeNode, at: int, tick: int) -> TreeNode:
        """Split ``child`` after ``at`` tokens; returns the new parent (the first ``at``). The
        state stays on ``child``, which still ends at the depth the state was taken at."""
        parent = child.parent
        assert parent is not None
        mid = self._new_node(child.key[:at], child.value[:at], parent, tick)
        mid.lock_ref = child.lock_ref  # every lock through `child` also runs through `mid`
        parent.children[self._child_key(child.key, 0)] = mid
        child.key, child.value, child.parent = child.key[at:], child.value[at:], mid
        mid.children[self._child_key(child.key, 0)] = child
        return mid

    def _pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        tokens = tuple(tokens)
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def _walk(self, tokens: tuple[int, ...], extra_key: Hashable | None, tick: int
              ) -> tuple[TreeNode, int, list[int], TreeNode]:
        """Follow ``tokens`` as far as the tree has them, splitting so the last node ends at
        the match: ``(node, matched length, slots, deepest node holding a state)``."""
        node = self._root(extra_key)
        node.last_access = tick
        slots: list[int] = []
        with_state = node
        i = 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            n = self._match_len(child.key, tokens, i)  # >= page_size: the first page matched
            if n < len(child.key):
                child = self._split(child, n, tick)
            child.last_access = tick
            slots.extend(child.value)
            node = child
            if node.state is not None:
                with_state = node
            i += n
        return node, i, slots, with_state

    # ------------------------------------------------------------------------- queries ----

    def match_prefix(
        self, tokens: Sequence[int], extra_key: Hashable | None = None
    ) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` and the deepest state on it.

        The prefix is a whole number of pages. If the match ends inside an edge, that node is
        split so the returned node ends exactly at the match. Marks the path (and the state
        returned) as recently used.

        Returns:
            ``PrefixMatch(slots, node, state_node)``: ``slots`` is ``[prefix_len]``; ``node``
            is the extra key's root when nothing matches; ``state_node`` is the deepest node
            of the path holding a state (the root when none does). Pass ``node`` to ``lock``
            / ``unlock``.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2, 3], [10, 11, 12])
            0
            >>> slots, node, _ = cache.match_prefix([1, 2])
            >>> slots, node.key
            ([10, 11], (1, 2))
        """
        _check_extra_key(extra_key)
        tick = next(self._clock)
        node, _, slots, with_state = self._walk(self._pages(_tokens(tokens)), extra_key, tick)
        if with_state.state is not None:
            with_state.state_access = tick
        return PrefixMatch(slots, node, with_state)

    def peek(self, tokens: Sequence[int], extra_key: Hashable | None = None
             ) -> tuple[int, int]:
        """``(matched, state_depth)``: how many leading tokens of ``tokens`` the tree holds
        (whole pages) and the depth of the deepest state on them (0: none), as
        ``match_prefix`` would find them, but read-only: no edge is split and nothing is marked
        used, so a scheduler may ask it of every waiting request each step. It does not
        validate ``tokens`` (it changes nothing); a value that is no token id matches nothing.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2, 3], [10, 11, 12])
            0
            >>> cache.peek([1, 2, 9]), cache.peek([7])
            ((2, 0), (0, 0))
        """
        _check_extra_key(extra_key)
        node = self._roots.get(extra_key)
        i = state_depth = 0
        n = len(tokens) - len(tokens) % self.page_size
        while node is not None and i < n:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            m = self._match_len(child.key, tokens, i)
            if m < len(child.key):  # the match ends inside this edge: its state is past it
                return i + m, state_depth
            i += m
            node = child
            if node.state is not None:
                state_depth = node.depth
        return i, state_depth

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], extra_key: Hashable | None = None
    ) -> int:
        """Cache ``tokens`` with their KV ``slots``; returns how many leading tokens were cached.

        Both are truncated to whole pages. For the returned number ``n`` of leading positions
        the tree keeps its own slots; the caller's slots ``slots[:n]`` are not stored. Slots the
        caller got from ``match_prefix`` are the tree's own; the rest of ``slots[:n]`` are
        duplicates the caller must free (SGLang: ``free(slots[len(matched):n])``).

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> cache.insert([1, 2, 3], [20, 21, 22])   # 20, 21 are duplicates: free them
            2
            >>> cache.match_prefix([1, 2, 3]).slots
            [10, 11, 22]
        """
        tokens, slots = _tokens(tokens), _slots(slots)
        _check_extra_key(extra_key)
        if len(tokens) != len(slots):
            raise ValueError(
                f"tokens and slots must have the same length, got {len(tokens)} and {len(slots)}"
            )
        tokens = self._pages(tokens)
        value = tuple(slots[: len(tokens)])
        tick = next(self._clock)
        node, i, _, _ = self._walk(tokens, extra_key, tick)
        if i < len(tokens):
            leaf = self._new_node(tokens[i:], value[i:], node, tick)
            node.children[self._child_key(tokens, i)] = leaf
            self._evictable += len(leaf.key)  # a new leaf is unlocked, under a lock or not
        return i

    def add_state(
        self, tokens: Sequence[int], handle: Hashable, extra_key: Hashable | None = None
    ) -> bool:
        """Attach state ``handle`` at depth ``len(tokens)``: the state after ``tokens``, whose
        KV must be cached already (whole pages). Splits an edge so a node ends there. Returns
        False, and stores nothing, if that node already holds a state (the caller frees its
        handle) or the tree does not hold all of ``tokens``.

        Examples:
            >>> tree = RadixCache(states=True)
            >>> tree.insert([1, 2, 3], [10, 11, 12])
            0
            >>> tree.add_state([1, 2], "a"), tree.add_state([1, 2], "b"), tree.add_state([9], "c")
            (True, False, False)
            >>> tree.num_states, tree.match_prefix([1, 2, 3]).state_node.state
            (1, 'a')
        """
        if not self.states:
            raise ValueError("this RadixCache holds no states (RadixCache(states=True))")
        if handle is None:
            raise ValueError("a state handle must not be None")
        tokens = _tokens(tokens)
        _check_extra_key(extra_key)
        if len(tokens) % self.page_size:
            raise ValueError(f"a state sits at a page boundary: len(tokens)={len(tokens)} is not "
                             f"a multiple of page_size={self.page_size}")
        tick = next(self._clock)
        node, i, _, _ = self._walk(tuple(tokens), extra_key, tick)
        if i < len(tokens) or node.state is not None or node.parent is None:
            return False
        node.state, node.state_access = handle, tick
        self._num_states += 1
        return True

    def leaves(self) -> list[TreeNode]:
        """Every leaf, under every root.

        >>> cache = RadixCache()
        >>> _ = cache.insert([1, 2], [7, 8]); _ = cache.insert([1, 3], [7, 9])
        >>> sorted(n.key for n in cache.leaves())
        [(2,), (3,)]
        """
        return [leaf for root in self._roots.values() for leaf in self._leaves(root)
                if leaf.parent is not None]

    def all_slots(self) -> list[int]:
        """Every slot the tree holds (``total_size`` of them), in no particular order.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11]), cache.insert([1, 3], [10, 12])
            (0, 1)
            >>> sorted(cache.all_slots())
            [10, 11, 12]
        """
        return [s for node in self._nodes() for s in node.value]

    def all_states(self) -> list[tuple[int, Hashable]]:
        """Every ``(depth, handle)`` the tree holds (``num_states`` of them), in no order.

        Examples:
            >>> tree = RadixCache(states=True)
            >>> tree.insert([1, 2], [10, 11]), tree.add_state([1], "a")
            (0, True)
            >>> tree.all_states()
            [(1, 'a')]
        """
        return [(n.depth, n.state) for n in self._nodes() if n.state is not None]

    def _nodes(self) -> list[TreeNode]:
        """Every node of every root (the roots included; their keys are empty)."""
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # --------------------------------------------------------------------------- debug ----

    def pretty(self) -> str:
        """The tree as indented text, one line per node (``state=`` where a node holds one).

        Examples:
            >>> cache = RadixCache(states=True)
            >>> cache.insert([1, 2, 3], [10, 11, 12]), cache.insert([1, 4], [10, 13])
            (0, 1)
            >>> cache.add_state([1, 2, 3], 7)
            True
            >>> print(cache.pretty())
            RadixCache(page_size=1, total=4, evictable=4, protected=0, states=1)
            root extra_key=None
            └── [1] slots=[10] lock=0
                ├── [2, 3] slots=[11, 12] lock=0 state=7
                └── [4] slots=[13] lock=0
        """
        states = f", states={self.num_states}" if self.states else ""
        lines = [
            f"RadixCache(page_size={self.page_size}, total={self.total_size}, "
            f"evictable={self.evictable_size}, protected={self.protected_size}{states})"
        ]

        def walk(node: TreeNode, prefix: str) -> None:
            kids = list(node.children.values())
            for j, child in enumerate(kids):
                last = j == len(kids) - 1
                state = "" if child.state is None else f" state={child.state!r}"
                lines.append(
                    f"{prefix}{'└── ' if last else '├── '}{_short(child.key)} "
                    f"slots={_short(child.value)} lock={child.lock_ref}{state}"
                )
                walk(child, prefix + ("    " if last else "│   "))

        for extra_key, root in self._roots.items():
            empty = "" if root.children else " (empty)"
            lines.append(f"root extra_key={extra_key!r}{empty}")
            walk(root, "")
        return "\n".join(lines)
