"""The ids the host owns on the engine path: request rows and token slots.

The engine picks every row and token slot itself, from an :class:`IdPool` (plain Python, no
device read; under a mesh one per data shard, of its local ids), and names them to the
device: admission claims the row (``pools.claim_reqs``; ``ShardedStep.claim_rows``), a step
claims the token slots its batch names (``ModelWorkerBatch.out_cache_loc``). The device's
allocators only check and record the claims (an id in use fails the step's ``ok``), so the
host never replays them; the device allocator still picks ids for users who drive ``step``
in their own loops.

Which slots a row holds is the host's list ``Request.row_slots`` (position by position, as
the device's ``req_to_token`` will hold them once every run dispatched so far has run): a
launch appends the slots it names, a commit gives back those a request that finished will
not run, a release gives back what the row owns (from its borrowed length up to what it
hands a prefix cache), an eviction gives back what the cache held.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["IdPool"]


class IdPool:
    """Free ids ``1 .. num_ids - 1`` (0 is the device's sink, never handed out), handed out
    last-freed first. Taking more than are free, or giving back an id that is free, is a
    ``RuntimeError`` naming ``what``: the engine's reservations make both impossible, so
    either is a bug, caught where it happens.

    >>> rows = IdPool(4, "request rows")
    >>> rows.take(2), len(rows)
    ([1, 2], 1)
    >>> rows.give([1]); sorted(rows)
    [1, 3]
    >>> rows.give([3])
    Traceback (most recent call last):
    ...
    RuntimeError: request rows: id 3 given back but it is free
    """

    def __init__(self, num_ids: int, what: str):
        self.what = what
        self._free = list(range(num_ids - 1, 0, -1))  # a stack: the next id is the last
        self._used = bytearray(num_ids)  # 1 where handed out
        self._used[0] = 1  # the sink is never free

    def __len__(self) -> int:
        """Ids free now."""
        return len(self._free)

    def __iter__(self):
        """The free ids (the next one handed out last)."""
        return iter(list(self._free))

    def take(self, count: int) -> list[int]:
        """``count`` free ids, now handed out."""
        if count > len(self._free):
            raise RuntimeError(f"{self.what}: {count} ids needed, {len(self._free)} free "
                               "(the reservation should have made room)")
        if count <= 0:
            return []
        ids = self._free[-count:][::-1]
        del self._free[-count:]
        for i in ids:
            self._used[i] = 1
        return ids

    def give(self, ids: Iterable[int]) -> None:
        """Hand ``ids`` back (each must be handed out now)."""
        ids = list(ids)
        for n, i in enumerate(ids):
            if not 0 < i < len(self._used) or not self._used[i]:
                for j in ids[:n]:  # nothing changes
                    self._used[j] = 1
                raise RuntimeError(f"{self.what}: id {i} given back but it is free")
            self._used[i] = 0
        self._free.extend(reversed(ids))
