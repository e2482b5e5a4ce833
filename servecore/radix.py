"""A token-level radix tree from token ids to KV slot ids, with recurrent-state snapshots,
two LRU orders and locks. One tree for both engines (pure Python: no JAX, no MLX).

SGLang-style prefix cache: each edge holds a run of token ids and the KV slots that hold their
keys and values. ``RadixCache.match_prefix`` finds the longest cached prefix of a request,
``RadixCache.insert`` adds a finished (or prefilled) sequence, ``RadixCache.lock`` pins a
running request's prefix, and ``RadixCache.evict`` frees the least recently used unlocked
leaves.

**States** (``RadixCache(states=True)``, for hybrid models). A linear-attention or SSM layer's
recurrent state is valid only at the exact depth where it was taken, so a node may also hold a
snapshot *handle* (the caller's id of a stored state, such as a snapshot slot): the state after
consuming every token from the root to the end of that node's key. ``add_state`` attaches one
(splitting an edge so a node ends exactly at its depth; a split leaves the state on the node
that still ends at the state's depth). ``match_prefix`` returns, beside the KV match, the
deepest node on the matched path that holds a state: the *usable* prefix is that node's depth
(the root stands for the empty prefix, whose state is the zero state). States and KV are
evicted separately, each in its own LRU order: ``evict_states`` drops states (an inner node
keeps its KV as a *tombstone*; a leaf goes, KV and all, with the tombstone leaves above it),
and ``evict`` drops whole leaves with their states (tombstone leaves left childless go too:
without a state below or at them their KV serves no match). Locks protect both.

The tree owns the slots and handles stored in it: they leave it only through ``evict`` and
``evict_states``, which return them (``Evicted``) to the caller to free.

``page_size > 1`` stores and matches whole pages only: sequences are truncated to a multiple of
``page_size`` and edges split only at page boundaries (states sit at page boundaries too).

``extra_key`` namespaces the tree (e.g. per LoRA adapter): sequences under different extra keys
never share a prefix. Each extra key has its own root.

Recency is a monotonic counter (one tick per ``match_prefix`` / ``insert`` / ``add_state``),
ties broken by node creation order, so eviction order is deterministic.

Tokens are checked at the door: a list (or tuple, range) of ints, or a 1-D integer array
(NumPy, MLX), each in the int32 range of token ids; a float, a bool or a nested list is a
ValueError naming it. (An ``mx.array`` scalar hashes by identity, so a tree keyed by them
would never match.) Slots are ints in the same range; an extra key is a hashable value that
is not an array; a state handle is any hashable value but ``None``.

Examples:
    >>> cache = RadixCache()
    >>> cache.insert([1, 2, 3], [10, 11, 12])
    0
    >>> cache.match_prefix([1, 2, 9]).slots
    [10, 11]
    >>> cache.evict(1).slots
    [12]

    With states: the usable prefix is the deepest state on the matched path.

    >>> tree = RadixCache(states=True)
    >>> tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    0
    >>> tree.add_state([1, 2], "s2"), tree.add_state([1, 2, 3, 4], "s4")
    (True, True)
    >>> m = tree.match_prefix([1, 2, 3, 9])
    >>> m.slots, m.state_node.state, m.state_node.depth  # KV for 3 tokens, a state at 2
    ([10, 11, 12], 's2', 2)
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from servecore.validate import INT32_MAX, is_int, plain_ints, token_ids

__all__ = ["Evicted", "PrefixMatch", "RadixCache", "TreeNode"]


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

    ``depth`` is the number of tokens from the root to the end of ``key``; ``state`` the
    snapshot handle of the state at that depth, or None. ``lock_ref`` counts the locks held on
    this node or on any descendant; a node with ``lock_ref > 0`` is never evicted, nor is its
    state. ``own_locks`` counts the locks held on this node itself. A root has an empty key,
    depth 0 and no parent. ``children`` maps a child's first token (its first page when
    ``page_size > 1``) to the child. Nodes are made by ``RadixCache``; you get them from
    ``RadixCache.match_prefix`` and hand them back to ``lock`` / ``unlock``.

    Examples:
        >>> cache = RadixCache()
        >>> cache.insert([1, 2, 3], [10, 11, 12])
        0
        >>> node = cache.match_prefix([1, 2]).node  # splits the edge [1, 2, 3] after [1, 2]
        >>> node.key, node.value, node.depth, [c.key for c in node.children.values()]
        ((1, 2), (10, 11), 2, [(3,)])
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
        "depth",
        "state",
        "state_access",
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
        self.depth = (parent.depth if parent is not None else 0) + len(key)
        self.state: Hashable | None = None
        self.state_access = 0

    def __repr__(self) -> str:
        state = "" if self.state is None else f", state={self.state!r}"
        return (
            f"TreeNode(id={self.node_id}, key={_short(self.key)}, value={_short(self.value)}, "
            f"depth={self.depth}{state}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access})"
        )


class PrefixMatch(NamedTuple):
    """What ``RadixCache.match_prefix`` found: ``slots`` of the longest cached prefix, the
    ``node`` ending exactly there (to ``lock``), and the deepest node of that path holding a
    state, ``state_node`` (the root when none does: the empty prefix). ``state_node.depth``
    is the usable prefix of a hybrid model, ``state_node.state`` its snapshot handle.

    Examples:
        >>> m = RadixCache().match_prefix([1, 2])
        >>> m.slots, m.node.depth, m.state_node is m.node, m.state_node.state
        ([], 0, True, None)
    """

    slots: list[int]
    node: TreeNode
    state_node: TreeNode


class Evicted(NamedTuple):
    """What an eviction freed: token ``slots`` and state handles (``states``), for the caller
    to give back to its allocators.

    Examples:
        >>> Evicted([4, 5], ["s"]).slots
        [4, 5]
    """

    slots: list[int]
    states: list[Hashable]


def _short(xs: tuple[int, ...], limit: int = 8) -> str:
    if len(xs) <= limit:
        return str(list(xs))
    return "[" + ", ".join(map(str, xs[:limit])) + f", ... +{len(xs) - limit}]"


class RadixCache:
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
        """Pin ``node`` and its ancestors, their KV and their states: they are not evicted
        until ``unlock``.

        Locks are counted: each ``lock`` needs its own ``unlock``. ValueError if ``node`` is
        no longer in the tree (evicted, or dropped by ``reset``).

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11])
            0
            >>> node = cache.match_prefix([1, 2]).node
            >>> cache.lock(node)
            >>> cache.evict(2).slots, cache.protected_size
            ([], 2)
            >>> cache.unlock(node)
            >>> cache.evict(2).slots
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
            >>> cache.lock(cache.match_prefix([1, 2]).node)
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

    # ------------------------------------------------------------------------ eviction ----

    def _remove_leaf(self, leaf: TreeNode, freed: Evicted) -> TreeNode:
        """Detach unlocked ``leaf``; its slots and state go to ``freed``. Returns its parent."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._child_key(leaf.key, 0)]
        leaf.parent = None
        self._evictable -= len(leaf.key)
        freed.slots.extend(leaf.value)
        if leaf.state is not None:
            freed.states.append(leaf.state)
            leaf.state = None
            self._num_states -= 1
        return parent

    def _prune(self, node: TreeNode, freed: Evicted) -> TreeNode:
        """With states, remove the tombstone leaves from ``node`` up (childless, unlocked,
        stateless: no match can use their KV). Returns the first node kept."""
        while (self.states and node.parent is not None and not node.children
               and node.lock_ref == 0 and node.state is None):
            node = self._remove_leaf(node, freed)
        return node

    def evict(self, num_tokens: int) -> Evicted:
        """Evict least recently used unlocked leaves until ``num_tokens`` slots are freed.

        A parent whose children are all evicted becomes a leaf and a candidate in turn (with
        states, a stateless one goes at once: see the module docstring). Stops early when
        nothing more is evictable; may free more than asked (whole leaves go).

        Returns:
            ``Evicted(slots, states)``: exactly the freed slots and the state handles of the
            evicted nodes, for the caller to free.

        Examples:
            >>> cache = RadixCache()
            >>> cache.insert([1, 2], [10, 11]), cache.insert([3], [12])
            (0, 0)
            >>> _ = cache.match_prefix([1, 2])   # [3] is now least recently used
            >>> cache.evict(1)
            Evicted(slots=[12], states=[])
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
        freed = Evicted([], [])
        while len(freed.slots) < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or leaf.children:  # pruned already, or not a leaf now
                continue
            parent = self._prune(self._remove_leaf(leaf, freed), freed)
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def evict_states(self, num_states: int) -> Evicted:
        """Evict the ``num_states`` least recently used states of unlocked nodes (fewer if no
        more are evictable). An inner node keeps its KV as a tombstone (matches through it
        fall back to an ancestor's state); a leaf goes with its KV, and so do the tombstone
        leaves above it.

        Returns:
            ``Evicted(slots, states)``: the freed state handles and the token slots of the
            nodes that went with them.

        Examples:
            >>> tree = RadixCache(states=True)
            >>> tree.insert([1, 2, 3], [10, 11, 12])
            0
            >>> tree.add_state([1], "a"), tree.add_state([1, 2, 3], "b")
            (True, True)
            >>> tree.evict_states(1)  # "a" is older: [1] stays, as a tombstone
            Evicted(slots=[], states=['a'])
            >>> tree.evict_states(1)  # "b" sits on a leaf: the leaf and the tombstone go
            Evicted(slots=[11, 12, 10], states=['b'])
        """
        if not is_int(num_states) or num_states < 0:
            raise ValueError(f"num_states={num_states!r} must be an int >= 0")
        heap = [(n.state_access, n.node_id, n) for n in self._nodes()
                if n.state is not None and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = Evicted([], [])
        while len(freed.states) < num_states and heap:
            _, _, node = heapq.heappop(heap)
            freed.states.append(node.state)
            node.state = None
            self._num_states -= 1
            self._prune(node, freed)
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
