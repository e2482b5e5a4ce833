"""``IdPool``: the host's free list of ids, one concept for every pool whose ids the host
hands out (token slots and snapshot slots of a prefix cache, request rows).

Ids run ``1 .. num_ids - 1``: id 0 is the pool's sink, which padding reads and writes and no
request ever owns, so it is never handed out. The list is a stack (the last id given back is
the next handed out: recently used memory is warm), with a set beside it so that giving
back an id that is free already, or one outside the pool, is caught where it happens.

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
        self._free = list(range(num_ids - 1, 0, -1))  # the top of the stack is id 1
        self._is_free = set(self._free)

    @property
    def num_free(self) -> int:
        """Ids that ``take`` can hand out."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Ids that can be handed out at all (the sink excluded)."""
        return self.num_ids - 1

    def __len__(self) -> int:
        """Ids free now."""
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        """The free ids (the next one handed out last)."""
        return iter(list(self._free))

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free ids (all of them when fewer are free), now handed out."""
        n = min(n, len(self._free))
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._is_free.difference_update(out)
        return out

    def claim(self, n: int) -> list[int]:
        """Exactly ``n`` free ids; fewer free is a ``RuntimeError`` that hands out none."""
        if n > len(self._free):
            raise RuntimeError(f"{self.what}: {n} ids needed, {len(self._free)} free (the "
                               "reservation should have made room)")
        return self.take(n)

    def give(self, ids: Iterable[int]) -> None:
        """Return ``ids``; one that is free already (or listed twice), or out of range, is a
        ``ValueError`` (a bookkeeping bug: it would be handed out twice) and returns none."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if not 0 < i < self.num_ids or i in self._is_free or i in seen:
                raise ValueError(f"{self.what} {i} is not in use")
            seen.add(i)
        self._free.extend(ids)
        self._is_free.update(ids)
