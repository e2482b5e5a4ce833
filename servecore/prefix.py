"""The prefix policy: what a request may take from the radix tree, and how the tree makes room.

Written once over ``servecore.radix`` and a small slot-store protocol (``SlotStore``), in
plain Python: an engine keeps its token slots and snapshot slots in whatever allocator it
likes (a NumPy free stack, a host list) and hands an adapter to these functions.

The rules:

* **The last prompt token always runs**: its logits give the first sampled token, so even a
  full hit recomputes it (its K/V is in the tree already: it needs no new slot).
* **K/V are borrowed at any depth** (``match``'s ``slots``: every matched token's slot, the
  whole prompt's at most), but a **recurrent state is restored only at the deepest snapshot
  on ``prompt[:-1]``**: a hybrid model's usable prefix (``cached``) ends there and the tokens
  after it run again (their K/V stay the tree's). A tree without states has
  ``cached = min(matched, n - 1)``.
* ``cached_len`` is ``match``'s ``cached`` from a read-only peek (no split, no LRU touch), for
  a scheduler that orders every waiting request each round.
* ``make_room``: on a shortfall, evict exactly that much (the least recently used unlocked
  prefixes), or, when even that would not be enough, evict nothing and let the request wait
  (``evict_shortfall`` is the rule alone, for an engine whose device hands out the slots).
* ``take_states``: snapshot slots, the free ones first, then evicting least recently used
  unlocked states for the rest; fewer than asked when that is all there is (a snapshot is
  best effort). ``keep_state`` hangs a snapshot on the tree, or gives it back.

Everything an eviction frees goes back to its store (``give_back``; a ``SlotSink`` is enough)
and is returned, so the caller counts it.

>>> from servecore.radix import RadixCache
>>> from servecore.ids import IdPool
>>> tree, slots = RadixCache(), IdPool(8)  # slots 1..7
>>> got, _ = make_room(tree, slots, 3)
>>> tree.insert([5, 6, 7], got)
0
>>> m = match(tree, [5, 6, 7])  # a full hit: the last token runs again
>>> m.slots, m.cached, cached_len(tree, [5, 6, 9, 9])
([1, 2, 3], 2, 2)
>>> make_room(tree, slots, 8)  # more than free + evictable: nothing is evicted
(None, Evicted(slots=[], states=[]))
>>> make_room(tree, slots, 5)[1]  # 4 free: one short; the leaf holding it goes whole
Evicted(slots=[1, 2, 3], states=[])
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from servecore.radix import Evicted, RadixCache, TreeNode

__all__ = ["Match", "SlotSink", "SlotStore", "cached_len", "evict_shortfall",
           "give_back", "keep_state", "make_room", "match", "take_states"]


@runtime_checkable
class SlotSink(Protocol):
    """Where freed slots go back: a ``SlotStore``, or an engine's queue of frees for a device
    that owns the allocator (``hybridattn``).

    >>> from servecore.ids import IdPool
    >>> isinstance(IdPool(4), SlotSink)
    True
    """

    def give(self, slots: Sequence[int]) -> None:
        """Return ``slots`` (each in use)."""


@runtime_checkable
class SlotStore(SlotSink, Protocol):
    """Where an engine keeps its free slots (token slots or snapshot slots).
    ``servecore.ids.IdPool`` is one.

    >>> from servecore.ids import IdPool
    >>> isinstance(IdPool(4), SlotStore)
    True
    """

    @property
    def num_free(self) -> int:
        """Slots ``take`` can hand out."""

    def take(self, n: int) -> list[int]:
        """``min(n, num_free)`` free slots."""


class Match(NamedTuple):
    """What a request takes from the tree: the tree's ``slots`` of the longest cached prefix
    (K/V it borrows) and their ``node`` (to lock while it runs), the tokens it skips
    (``cached``), and the snapshot handle to restore at ``cached`` (``restore``; None: the
    zero state, or a tree without states).

    >>> Match([4], None, 0, None).cached
    0
    """

    slots: list[int]
    node: TreeNode
    cached: int
    restore: Hashable | None


def match(tree: RadixCache, tokens: Sequence[int]) -> Match:
    """The prefix ``tokens`` (a prompt) may take from ``tree`` (marks it recently used).

    >>> tree = RadixCache(states=True)
    >>> tree.insert([1, 2, 3, 4], [9, 8, 7, 6])
    0
    >>> tree.add_state([1, 2], "s2")
    True
    >>> m = match(tree, [1, 2, 3, 4, 5])  # K/V for 4 tokens, a state at 2
    >>> m.slots, m.cached, m.restore
    ([9, 8, 7, 6], 2, 's2')
    >>> m = match(tree, [1, 2])  # a state at the prompt's end: its last token runs again
    >>> m.slots, m.cached  # (its K/V is borrowed all the same)
    ([9, 8], 0)
    """
    slots, node, _ = tree.match_prefix(tokens)
    if not tree.states:
        return Match(slots, node, min(len(slots), len(tokens) - 1), None)
    at = tree.match_prefix(tokens[:-1]).state_node
    if at.parent is None:  # the root: no state on the path, start from the zero state
        return Match(slots, node, 0, None)
    return Match(slots, node, at.depth, at.state)


def cached_len(tree: RadixCache, tokens: Sequence[int]) -> int:
    """``match(tree, tokens).cached``, read-only (no split, nothing marked used).

    >>> tree = RadixCache()
    >>> tree.insert([1, 2, 3], [4, 5, 6])
    0
    >>> cached_len(tree, [1, 2, 3]), cached_len(tree, [1, 2, 3, 4]), cached_len(tree, [7])
    (2, 3, 0)
    """
    if not tree.states:
        return min(tree.peek(tokens)[0], len(tokens) - 1)
    return tree.peek(tokens[:-1])[1]


def give_back(evicted: Evicted, slots: SlotSink, states: SlotSink | None = None) -> None:
    """Return what an eviction freed to its stores (token slots; snapshot handles).

    >>> from servecore.ids import IdPool
    >>> kv = IdPool(4)
    >>> give_back(Evicted(kv.take(2), []), kv); kv.num_free
    3
    """
    if evicted.slots:
        slots.give(evicted.slots)
    if evicted.states:
        if states is None:
            raise ValueError(f"the tree evicted states {evicted.states[:8]} but no state "
                             "store was given")
        states.give(evicted.states)


def make_room(tree: RadixCache, slots: SlotStore, n: int, states: SlotStore | None = None
              ) -> tuple[list[int] | None, Evicted]:
    """``n`` free token slots and what was evicted for them: on a shortfall the tree evicts
    exactly that many tokens' worth of least recently used unlocked prefixes (whole leaves:
    a few more when a leaf is longer), or, when free and evictable slots together are fewer
    than ``n``, nothing at all: ``(None, nothing)``, the request waits.

    >>> from servecore.ids import IdPool
    >>> tree, store = RadixCache(), IdPool(4)
    >>> tree.insert([1, 2], store.take(2))
    0
    >>> tree.lock(tree.match_prefix([1]).node)
    >>> make_room(tree, store, 2)  # 1 free, 1 evictable ([2]; [1] is locked)
    ([2, 3], Evicted(slots=[2], states=[]))
    """
    evicted = evict_shortfall(tree, slots.num_free, n)
    if evicted is None:
        return None, Evicted([], [])
    give_back(evicted, slots, states)
    if slots.num_free < n:  # unreachable: the evictable prefixes were all evictable
        return None, evicted
    return slots.take(n), evicted


def evict_shortfall(tree: RadixCache, num_free: int, n: int) -> Evicted | None:
    """What ``make_room`` evicts for ``n`` token slots when ``num_free`` are free: exactly the
    shortfall (whole least recently used unlocked leaves), nothing when there is none, and
    None (nothing evicted: wait) when free and evictable slots together are fewer than
    ``n``. For an engine that counts its free slots but lets its device hand them out; the
    caller gives the result back (``give_back``).

    >>> tree = RadixCache()
    >>> tree.insert([1, 2], [5, 6]), tree.insert([3], [7])
    (0, 0)
    >>> evict_shortfall(tree, 1, 2), evict_shortfall(tree, 0, 4)
    (Evicted(slots=[5, 6], states=[]), None)
    """
    short = n - num_free
    if short <= 0:
        return Evicted([], [])
    if short > tree.evictable_size:
        return None
    return tree.evict(short)


def take_states(tree: RadixCache, states: SlotStore, n: int, slots: SlotSink
                ) -> tuple[list[int], Evicted]:
    """Up to ``n`` snapshot slots: the free ones first, then, when too few are free, the
    least recently used unlocked states' (evicted; the token slots of leaves that go with
    them are given back to ``slots``); what was evicted.

    >>> from servecore.ids import IdPool
    >>> tree, kv, snaps = RadixCache(states=True), IdPool(8), IdPool(3)
    >>> tree.insert([1, 2], kv.take(2))
    0
    >>> [tree.add_state([1], h) for h in snaps.take(1)] + [tree.add_state([1, 2], h)
    ...                                                   for h in snaps.take(1)]
    [True, True]
    >>> take_states(tree, snaps, 1, kv)  # none free: the older state goes ([1] stays)
    ([1], Evicted(slots=[], states=[1]))
    """
    got, evicted = states.take(n), Evicted([], [])
    if len(got) < n:
        evicted = tree.evict_states(n - len(got))
        give_back(evicted, slots, states)
        got += states.take(n - len(got))
    return got, evicted


def keep_state(tree: RadixCache, tokens: Sequence[int], handle: int, states: SlotSink) -> bool:
    """Hang snapshot ``handle`` on ``tree`` at ``tokens``' end; give it back to ``states``
    when the tree has a state there already or lacks the tokens (their K/V were not kept, or
    were evicted). Whether it was kept.

    >>> from servecore.ids import IdPool
    >>> tree, snaps = RadixCache(states=True), IdPool(4)
    >>> tree.insert([1, 2], [8, 9])
    0
    >>> h = snaps.take(2)
    >>> keep_state(tree, [1], h[0], snaps), keep_state(tree, [1], h[1], snaps), snaps.num_free
    (True, False, 2)
    """
    if tree.add_state(tokens, handle):
        return True
    states.give([handle])
    return False
