"""Locks of the radix tree: a running request pins its prefix (the node it matched and every
ancestor, their KV and their states) until it lets go; the tree's ``evictable_size`` and
``protected_size`` move with them."""

from __future__ import annotations

from servecore.radix.nodes import TreeNode

__all__ = ["Locks"]


class Locks:
    """The locking half of ``RadixCache`` (a mixin over its roots, sizes and node walk).

    >>> from servecore.radix import RadixCache
    >>> isinstance(RadixCache(), Locks)
    True
    """


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
            >>> from servecore.radix import RadixCache
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
            >>> from servecore.radix import RadixCache
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
