"""The radix tree's values: its nodes, what a match finds, what an eviction frees, and the
checks of what callers hand it (``servecore.radix`` has the contract)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from servecore.validate import INT32_MAX, is_int, plain_ints, token_ids

__all__ = ["Evicted", "PrefixMatch", "TreeNode", "path_of"]


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
        >>> from servecore.radix import RadixCache
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
        >>> from servecore.radix import RadixCache
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


def path_of(node: TreeNode) -> tuple[list[int], list[int], dict[int, Hashable]]:
    """The tokens and slots from the root to the end of ``node``, and the state handles on
    that path by depth.

    >>> from servecore.radix import RadixCache
    >>> cache = RadixCache()
    >>> _ = cache.insert([1, 2], [7, 8]); _ = cache.insert([1, 2, 3], [7, 8, 9])
    >>> path_of(cache.match_prefix([1, 2, 3]).node)[:2]
    ([1, 2, 3], [7, 8, 9])
    """
    edges, states = [], {}
    while node is not None and node.parent is not None:
        edges.append(node)
        if node.state is not None:
            states[node.depth] = node.state
        node = node.parent
    edges.reverse()
    return ([t for n in edges for t in n.key], [s for n in edges for s in n.value], states)
