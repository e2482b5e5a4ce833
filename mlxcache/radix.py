"""A token-level radix tree from token ids to KV slot ids, with LRU eviction and locks.

SGLang-style prefix cache, in pure Python (no MLX): each edge holds a run of token ids and the
KV slots that hold their keys and values. ``RadixCache.match_prefix`` finds the longest
cached prefix of a request, ``RadixCache.insert`` adds a finished (or prefilled) sequence,
``RadixCache.lock`` pins a running request's prefix, and ``RadixCache.evict`` frees the
least recently used unlocked leaves.

The tree owns the slots stored in it: a slot leaves the tree only through ``evict``, which
returns it to the caller to free in its allocator.

``page_size > 1`` stores and matches whole pages only: sequences are truncated to a multiple of
``page_size`` and edges split only at page boundaries.

``extra_key`` namespaces the tree (e.g. per LoRA adapter): sequences under different extra keys
never share a prefix. Each extra key has its own root.

Recency is a monotonic counter (one tick per ``match_prefix`` / ``insert``), ties broken
by node creation order, so eviction order is deterministic.

Tokens are checked at the door: a list (or tuple, range) of ints, or a 1-D integer array
(NumPy, MLX), each in the int32 range of token ids; a float, a bool or a nested list is a
ValueError naming it. (An ``mx.array`` scalar hashes by identity, so a tree keyed by them
would never match.) Slots are ints in the same range; an extra key is a hashable value that
is not an array.

Examples:
    >>> cache = RadixCache()
    >>> cache.insert([1, 2, 3], [10, 11, 12])
    0
    >>> cache.match_prefix([1, 2, 9])[0]
    [10, 11]
    >>> cache.evict(1)
    [12]
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import Any

from mlxcache._checks import plain_ints
from servecore.validate import INT32_MAX, is_int, token_ids

__all__ = ["RadixCache", "TreeNode"]


def _tokens(tokens: Any) -> Sequence[int]:
    """``tokens`` as int token ids (int32 range), ValueError naming a bad one."""
    if plain_ints(tokens, INT32_MAX + 1):
        return tokens
    return token_ids("tokens", tokens, vocab_size=INT32_MAX + 1, allow_empty=True)


def _slots(slots: Any) -> Sequence[int]:
    if plain_ints(slots, INT32_MAX + 1):
        return slots
    if isinstance(slots, str | bytes) or not (isinstance(slots, Sequence) or hasattr(
            slots, "tolist")):
        raise ValueError(f"slots must be a list of slot ids, got {type(slots).__name__}")
    if not isinstance(slots, Sequence):  # a NumPy / MLX array
        slots = slots.tolist()
    for i, s in enumerate(slots):
        if not is_int(s) or not 0 <= s <= INT32_MAX:
            raise ValueError(f"slots[{i}]={s!r} must be an int slot id in [0, {INT32_MAX}]")
    return [int(s) for s in slots]


def _check_extra_key(extra_key: Any) -> None:
    if hasattr(extra_key, "shape"):  # arrays compare elementwise and hash by identity
        raise ValueError(f"extra_key must be a hashable value (str, int, tuple), not an array "
                         f"({type(extra_key).__name__})")
    try:
        hash(extra_key)
    except TypeError:
        raise ValueError(f"extra_key={extra_key!r} must be hashable (str, int, tuple)") from None


class TreeNode:
    """One edge of the tree: ``key`` token ids and their ``value`` slots, ``[len(key)]`` each.

    ``lock_ref`` counts the locks held on this node or on any descendant; a node with
    ``lock_ref > 0`` is never evicted. ``own_locks`` counts the locks held on this node itself.
    A root has an empty key and no parent. ``children`` maps a child's first token (its first
    page when ``page_size > 1``) to the child. Nodes are made by ``RadixCache``; you get
    them from ``RadixCache.match_prefix`` and hand them back to ``lock`` / ``unlock``.

    Examples:
        >>> cache = RadixCache()
        >>> cache.insert([1, 2, 3], [10, 11, 12])
        0
        >>> _, node = cache.match_prefix([1, 2])     # splits the edge [1, 2, 3] after [1, 2]
        >>> node.key, node.value, [c.key for c in node.children.values()]
        ((1, 2), (10, 11), [(3,)])
        >>> node.parent.parent is None                # its parent is the root
        True
    """

    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "lock_ref",
        "own_locks",
        "last_access",
        "node_id",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        value: tuple[int, ...],
        parent: TreeNode | None,
        lock_ref: int,
        last_access: int,
        node_id: int,
    ):
        self.key = key
        self.value = value
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.lock_ref = lock_ref
        self.own_locks = 0
        self.last_access = last_access
        self.node_id = node_id

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, key={_short(self.key)}, value={_short(self.value)}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


def _short(xs: tuple[int, ...], limit: int = 8) -> str:
    if len(xs) <= limit:
        return str(list(xs))
    return "[" + ", ".join(map(str, xs[:limit])) + f", ... +{len(xs) - limit}]"


class RadixCache:
    """Radix tree over token ids mapping to KV slot ids (see the module docstring).

    Sizes count tokens: ``evictable_size`` (in unlocked nodes) + ``protected_size`` (in locked
    nodes) == ``total_size``.

    Args:
        page_size: granularity in tokens: only whole pages are stored and matched.

    Examples:
        >>> cache = RadixCache(page_size=2)
        >>> cache.insert([1, 2, 3, 4, 5], [7, 8, 9, 10, 11])   # the lone 5th token is dropped
        0
        >>> slots, node = cache.match_prefix([1, 2, 3, 9])
        >>> slots, cache.total_size
        ([7, 8], 4)
        >>> cache.lock(node)
        >>> cache.evict(4), cache.protected_size
        ([9, 10], 2)
        >>> cache.unlock(node)
    """

    def __init__(self, page_size: int = 1):
        if not is_int(page_size) or not 1 <= page_size <= INT32_MAX:
            raise ValueError(f"page_size={page_size!r} must be an int in [1, {INT32_MAX}]")
        self.page_size = int(page_size)
        self.reset()

    # ---------------------------------------------------------------------------- state ----

    def reset(self) -> None:
        """Drop every node (the caller owns the slots it held) and all locks.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> cache.reset()
            >>> cache.total_size, cache.match_prefix([1, 2])[0]
            (0, [])
        """
        self._roots: dict[Hashable, TreeNode] = {}
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self._evictable = 0
        self._protected = 0

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
        i = 0
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: TreeNode, at: int, tick: int) -> TreeNode:
        """Split ``child`` after ``at`` tokens; returns the new parent (the first ``at``)."""
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

    # ------------------------------------------------------------------------- queries ----

    def match_prefix(
        self, tokens: Sequence[int], extra_key: Hashable | None = None
    ) -> tuple[list[int], TreeNode]:
        """Slots of the longest cached prefix of ``tokens`` and the deepest node of that match.

        The prefix is a whole number of pages. If the match ends inside an edge, that node is
        split so the returned node ends exactly at the match. Marks the path as recently used.

        Returns:
            ``(slots, node)``: ``slots`` is ``[prefix_len]``; ``node`` is the extra key's root
            when nothing matches. Pass ``node`` to ``lock`` / ``unlock``.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2, 3], [10, 11, 12])
            0
            >>> slots, node = cache.match_prefix([1, 2])
            >>> slots, node.key
            ([10, 11], (1, 2))
        """
        _check_extra_key(extra_key)
        tokens = self._pages(_tokens(tokens))
        tick = next(self._clock)
        node = self._root(extra_key)
        node.last_access = tick
        slots: list[int] = []
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
            i += n
        return slots, node

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
            >>> cache.match_prefix([1, 2, 3])[0]
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
        node = self._root(extra_key)
        node.last_access = tick
        i = 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                leaf = self._new_node(tokens[i:], value[i:], node, tick)
                node.children[self._child_key(tokens, i)] = leaf
                self._evictable += len(leaf.key)
                return i
            n = self._match_len(child.key, tokens, i)  # >= page_size: the first page matched
            if n < len(child.key):
                child = self._split(child, n, tick)
            child.last_access = tick
            node = child
            i += n
        return i

    # --------------------------------------------------------------------------- locks ----

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors up to its root; ValueError if it is not in the tree."""
        if not isinstance(node, TreeNode):
            raise ValueError(f"node={node!r} must be a TreeNode (from match_prefix)")
        path = []
        walk: TreeNode | None = node
        while walk is not None:
            path.append(walk)
            walk = walk.parent
        if path[-1] not in self._roots.values():
            raise ValueError(f"{node!r} is not in this cache (evicted, reset, or foreign)")
        return path

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: they are not evicted until ``unlock``.

        Locks are counted: each ``lock`` needs its own ``unlock``. ValueError if ``node`` is
        no longer in the tree (evicted, or dropped by ``reset``).

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> _, node = cache.match_prefix([1, 2])
            >>> cache.lock(node)
            >>> cache.evict(2), cache.protected_size
            ([], 2)
            >>> cache.unlock(node)
            >>> cache.evict(2)
            [10, 11]
        """
        path = self._path(node)
        node.own_locks += 1
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Release one ``lock`` of ``node``; ValueError if ``node`` itself is not locked."""
        path = self._path(node)
        if node.own_locks <= 0:
            raise ValueError(f"unlock of {node!r}, which holds no lock of its own")
        node.own_locks -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)
                self._evictable += len(n.key)

    def release_locks(self) -> None:
        """Drop every lock; the nodes and their slots stay, all of them evictable now.

        Sizes are recounted from the nodes, so this also repairs counts left half-updated by
        an interrupted ``lock`` / ``unlock``. A server that lost track of its running requests
        (an exception inside a step) calls it, then locks again what its surviving requests
        hold.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> cache.lock(cache.match_prefix([1, 2])[1])
            >>> cache.release_locks()
            >>> cache.protected_size, cache.evictable_size
            (0, 2)
        """
        total = 0
        for node in self._nodes():
            node.lock_ref = node.own_locks = 0
            total += len(node.key)
        self._evictable, self._protected = total, 0

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

    def _nodes(self) -> list[TreeNode]:
        """Every node of every root (the roots included; their keys are empty)."""
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------------ eviction ----

    def evict(self, num_tokens: int) -> list[int]:
        """Evict least recently used unlocked leaves until ``num_tokens`` are freed.

        A parent whose children are all evicted becomes a leaf and a candidate in turn. Stops
        early when nothing more is evictable; may free more than asked (whole leaves go).

        Returns:
            exactly the freed slots, for the caller to free in its allocator.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11]), cache.insert([3], [12])
            (0, 0)
            >>> _ = cache.match_prefix([1, 2])   # [3] is now least recently used
            >>> cache.evict(1)
            [12]
        """
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
        heap = [
            (leaf.last_access, leaf.node_id, leaf)
            for root in self._roots.values()
            for leaf in self._leaves(root)
            if leaf.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            self._evictable -= len(leaf.key)
            freed.extend(leaf.value)
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    @staticmethod
    def _leaves(root: TreeNode) -> list[TreeNode]:
        """Nodes below ``root`` with no children (``root`` itself is never a leaf)."""
        out, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    # --------------------------------------------------------------------------- debug ----

    def pretty(self) -> str:
        """The tree as indented text, one line per node.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2, 3], [10, 11, 12]), cache.insert([1, 4], [10, 13])
            (0, 1)
            >>> print(cache.pretty())
            RadixCache(page_size=1, total=4, evictable=4, protected=0)
            root extra_key=None
            └── [1] slots=[10] lock=0
                ├── [2, 3] slots=[11, 12] lock=0
                └── [4] slots=[13] lock=0
        """
        lines = [
            f"RadixCache(page_size={self.page_size}, total={self.total_size}, "
            f"evictable={self.evictable_size}, protected={self.protected_size})"
        ]

        def walk(node: TreeNode, prefix: str) -> None:
            kids = list(node.children.values())
            for j, child in enumerate(kids):
                last = j == len(kids) - 1
                lines.append(
                    f"{prefix}{'└── ' if last else '├── '}{_short(child.key)} "
                    f"slots={_short(child.value)} lock={child.lock_ref}"
                )
                walk(child, prefix + ("    " if last else "│   "))

        for extra_key, root in self._roots.items():
            empty = "" if root.children else " (empty)"
            lines.append(f"root extra_key={extra_key!r}{empty}")
            walk(root, "")
        return "\n".join(lines)
