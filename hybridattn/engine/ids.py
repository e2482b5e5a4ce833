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

from servecore.snapshots import SnapshotSlots

__all__ = ["IdPool"]


class IdPool(SnapshotSlots):
    """Free ids ``1 .. num_ids - 1`` (0 is the device's sink, never handed out), handed out
    last-freed first: the host free list of ``servecore.snapshots.SnapshotSlots``, taking
    exactly what is asked. Taking more than are free is a ``RuntimeError``, giving back an id
    that is free a ``ValueError``, each naming ``what``: the engine's reservations make both
    impossible, so either is a bug, caught where it happens (and changes nothing).

    >>> rows = IdPool(4, "request row")
    >>> rows.take(2), len(rows)
    ([1, 2], 1)
    >>> rows.give([1]); sorted(rows)
    [1, 3]
    >>> rows.give([3])
    Traceback (most recent call last):
    ...
    ValueError: request row 3 is not in use
    """

    def __len__(self) -> int:
        """Ids free now."""
        return self.num_free

    def __iter__(self):
        """The free ids (the next one handed out last)."""
        return iter(list(self._free))

    def take(self, count: int) -> list[int]:
        """``count`` free ids, now handed out."""
        if count > self.num_free:
            raise RuntimeError(f"{self.what}: {count} ids needed, {self.num_free} free (the "
                               "reservation should have made room)")
        return super().take(count)
