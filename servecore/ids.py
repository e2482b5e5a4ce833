"""``IdPool``: the host's free list of ids, one concept for every pool whose ids the host
hands out (the KV pool's token slots and the snapshot slots of a prefix cache, request rows).

Ids run ``1 .. num_ids - 1``: id 0 is the pool's sink, which padding reads and writes and no
request ever owns, so it is never handed out. The list is a stack in a NumPy array (the last
id given back is the next handed out: recently used memory is warm) with a free mask beside
it, so a ``take`` or a ``give`` costs the ids it moves, never the pool's size (pools of 2^20
slots are common), and giving back an id that is free already, or one outside the pool, is
caught where it happens and changes nothing.

Two ways to take: ``take(n)`` hands out at most ``n`` (fewer when fewer are free: a prefix
cache's best effort), ``claim(n)`` exactly ``n`` or raises (an engine whose reservations make
a shortfall impossible: a shortfall is a bug, caught before anything changed).

>>> ids = IdPool(4, "snapshot slot")
>>> ids.take(2), ids.num_free
([1, 2], 1)
>>> ids.give([2]); ids.take(5)  # fewer than asked when fewer are free
[2, 3]
>>> ids.claim(1)
Traceback (most recent call last):
...
RuntimeError: snapshot slot: 1 ids needed, 0 free (the reservation should have made room)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["IdPool"]


class IdPool:
    """Free ids ``1 .. num_ids - 1`` (see the module docstring); ``what`` names them in
    errors.

    >>> rows = IdPool(4, "request row")
    >>> rows.claim(2), len(rows), rows.capacity
    ([1, 2], 1, 3)
    >>> rows.give([1]); sorted(rows)
    [1, 3]
    >>> rows.give([3])
    Traceback (most recent call last):
    ...
    ValueError: request row 3 is not in use
    """

    def __init__(self, num_ids: int, what: str = "id"):
        self.num_ids, self.what = num_ids, what
        self._stack = np.zeros(max(num_ids, 1), dtype=np.int64)  # [:_top] free; id 1 on top
        self._stack[: num_ids - 1] = np.arange(num_ids - 1, 0, -1)
        self._top = num_ids - 1
        self._is_free = np.ones(max(num_ids, 1), dtype=bool)
        self._is_free[0] = False  # the sink

    @property
    def num_free(self) -> int:
        """Ids that ``take`` can hand out."""
        return self._top

    @property
    def capacity(self) -> int:
        """Ids that can be handed out at all (the sink excluded)."""
        return self.num_ids - 1

    @property
    def free_ids(self) -> np.ndarray:
        """The free ids, the next one handed out last (a read-only copy)."""
        out = self._stack[: self._top].copy()
        out.flags.writeable = False
        return out

    def __len__(self) -> int:
        """Ids free now."""
        return self._top

    def __iter__(self) -> Iterator[int]:
        """The free ids (the next one handed out last)."""
        return iter(self._stack[: self._top].tolist())

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free ids (all of them when fewer are free), now handed out."""
        n = max(0, min(int(n), self._top))
        out = self._stack[self._top - n: self._top][::-1]
        self._is_free[out] = False
        self._top -= n
        return out.tolist()

    def claim(self, n: int) -> list[int]:
        """Exactly ``n`` free ids; fewer free is a ``RuntimeError`` that hands out none."""
        if n > self._top:
            raise RuntimeError(f"{self.what}: {n} ids needed, {self._top} free (the "
                               "reservation should have made room)")
        return self.take(n)

    def give(self, ids: Iterable[int]) -> None:
        """Return ``ids``; one that is free already (or listed twice), or out of range, is a
        ``ValueError`` (a bookkeeping bug: it would be handed out twice) and returns none."""
        arr = np.fromiter((int(i) for i in ids), dtype=np.int64)
        bad = arr[(arr <= 0) | (arr >= self.num_ids)]
        if not bad.size:
            bad = arr[self._is_free[arr]]
        if not bad.size and arr.size > 1:  # listed twice
            uniq, counts = np.unique(arr, return_counts=True)
            bad = uniq[counts > 1]
        if bad.size:
            raise ValueError(f"{self.what} {int(bad[0])} is not in use")
        self._stack[self._top: self._top + arr.size] = arr
        self._is_free[arr] = True
        self._top += arr.size

    def rebuild(self, held: Iterable[int]) -> None:
        """Every id free but exactly ``held`` (what a cache still holds after a restore).

        >>> ids = IdPool(6)
        >>> ids.rebuild([2, 4]); sorted(ids)
        [1, 3, 5]
        """
        mask = np.ones(self.num_ids, dtype=bool)
        mask[0] = False
        mask[np.fromiter((int(i) for i in held), dtype=np.int64)] = False
        free = np.flatnonzero(mask)[::-1]
        self._stack[: free.size] = free
        self._top = free.size
        self._is_free = mask
