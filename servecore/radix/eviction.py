"""Eviction for the radix tree, in two LRU orders: whole leaves by their last access
(``evict``), and state snapshots by theirs (``evict_states``; ``servecore.radix`` has the
rules: tombstones, and the stateless leaves that go with a state)."""

from __future__ import annotations

import heapq

from servecore.radix.nodes import Evicted, TreeNode
from servecore.validate import is_int

__all__ = ["LRUEviction"]


class LRUEviction:
    """The eviction half of ``RadixCache`` (a mixin over its roots, sizes and node walk).

    >>> from servecore.radix import RadixCache
    >>> isinstance(RadixCache(), LRUEviction)
    True
    """


    def _remove_leaf(self, leaf: TreeNode, freed: Evicted) -> TreeNode:
        """Detach unlocked ``leaf``; its slots and state go to ``freed``. Returns its parent."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        if self.on_evict is not None:
            self.on_evict(leaf)
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
            >>> from servecore.radix import RadixCache
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
            >>> from servecore.radix import RadixCache
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
