"""How big the engine's pools are, and its memory budget: given, or sized from free memory.

The KV pool holds ``num_slots`` token slots of every attention layer's K/V; a hybrid model's
state pool holds ``num_snapshots`` snapshots of every recurrent layer's state; the running
batches' decode buffers (``mlxcache.cache``) hold what the running requests have computed.
All three are inside one budget (``PoolSizes.budget_bytes``):

- given no ``num_slots``, the budget is ``mem_fraction`` of the memory the pools may draw
  from (the Metal working set on Apple silicon, else ``servecore.memory_budget``:
  ``MemAvailable`` capped by any cgroup limit). The decode buffers get a quarter of it
  (``WORKING_SHARE``); of the rest, snapshots take a quarter (at least
  ``MIN_AUTO_SNAPSHOTS``, unless their number is given) and the token pool what is left.
  A budget that cannot hold ``MIN_AUTO_SLOTS`` token slots (and, for a hybrid model,
  ``MIN_AUTO_SNAPSHOTS`` snapshots) is a ``ValueError`` naming the numbers: such a cache
  would be of no use, and the sizer never goes past its budget.
- without reuse there are no pools: the budget, ``mem_fraction`` of that memory, is the
  decode buffers' alone (``buffer_sizes``).
- given ``num_slots``, the budget is what the sizes take: the pool, the snapshots (given, or
  a quarter of the pool's bytes, at least ``MIN_AUTO_SNAPSHOTS``) and as many bytes of
  decode buffers as the pool holds.

Admission keeps the decode buffers inside their part (``PoolSizes.working_bytes``):
``mlxcache.engine.memory``.

Examples:
    >>> s = pool_sizes(per_slot=1024, per_snapshot=0, num_slots=64, num_snapshots=None,
    ...                mem_fraction=0.5, has_states=False)
    >>> s.num_slots, s.origin, s.working_bytes, s.budget_bytes
    (64, 'given', 65536, 131072)
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from servecore.memory import memory_budget

__all__ = ["MAX_AUTO_SLOTS", "MAX_AUTO_SNAPSHOTS", "MIN_AUTO_SLOTS", "MIN_AUTO_SNAPSHOTS",
           "WORKING_SHARE", "PoolSizes", "auto_num_slots", "buffer_sizes", "pool_sizes"]

MAX_AUTO_SLOTS = 1 << 20
"""Upper bound on an automatically sized pool (about a million tokens)."""

MIN_AUTO_SLOTS = 256
"""The fewest token slots an automatic budget must hold (else a ``ValueError``)."""

MIN_AUTO_SNAPSHOTS, MAX_AUTO_SNAPSHOTS = 8, 4096
"""Bounds on an automatically sized state pool (hybrid models), taken from the budget
(an automatic budget that cannot hold the least of them and ``MIN_AUTO_SLOTS`` is a
``ValueError``) or added to a given ``num_slots``."""

WORKING_SHARE = 4
"""An automatic budget gives ``1 / WORKING_SHARE`` of itself to the decode buffers."""


def _memory_budget() -> tuple[int, str]:
    """Bytes the pool may draw from, and where the figure came from.

    On Apple silicon the pool lives in Metal's working set; elsewhere MLX allocates host
    memory, so ``servecore.memory_budget`` (``MemAvailable``, capped by any cgroup limit: a
    container with 4 GiB on a 512 GiB host sizes from 4 GiB).
    """
    if mx.metal.is_available():
        info = mx.device_info()
        total = int(info.get("max_recommended_working_set_size", info["memory_size"]))
        return max(total - mx.get_active_memory(), 0), "Metal working set"
    return memory_budget()


def auto_num_slots(
    bytes_per_slot: int, mem_fraction: float, max_slots: int = MAX_AUTO_SLOTS
) -> tuple[int, int, str]:
    """Pool size from free memory: ``(num_slots, budget_bytes, source)``.

    ``num_slots = min(max_slots, mem_fraction * free_memory // bytes_per_slot)`` (at least 2).

    Examples:
        >>> n, _, _ = auto_num_slots(bytes_per_slot=1 << 20, mem_fraction=0.001)
        >>> 2 <= n <= MAX_AUTO_SLOTS
        True
    """
    budget, source = _memory_budget()
    budget = int(budget * mem_fraction)
    return max(2, min(max_slots, budget // bytes_per_slot)), budget, source


class PoolSizes(NamedTuple):
    """The pools' sizes, where the figure came from (``origin``, for the log), the whole
    budget and the decode buffers' part of it, in bytes.

    >>> PoolSizes(8, 0, "given").num_snapshots
    0
    """

    num_slots: int
    num_snapshots: int
    origin: str
    budget_bytes: int = 0
    working_bytes: int = 0


def pool_sizes(*, per_slot: int, per_snapshot: int, num_slots: int | None,
               num_snapshots: int | None, mem_fraction: float, has_states: bool) -> PoolSizes:
    """The pools' sizes and the budget (see the module docstring): ``per_slot`` bytes a
    token slot, ``per_snapshot`` a snapshot; given sizes are kept.

    >>> s = pool_sizes(per_slot=10, per_snapshot=100, num_slots=400, num_snapshots=None,
    ...                mem_fraction=0.5, has_states=True)
    >>> s.num_snapshots, s.origin, s.budget_bytes, s.working_bytes   # 4000 + 1000 + 4000
    (10, 'given', 9000, 4000)
    """
    if num_slots is not None:
        pool = num_slots * per_slot
        if has_states and num_snapshots is None:
            num_snapshots = int(min(MAX_AUTO_SNAPSHOTS,
                                    max(MIN_AUTO_SNAPSHOTS, pool // 4 // per_snapshot)))
        num_snapshots = num_snapshots if has_states else 0
        return PoolSizes(num_slots, num_snapshots, "given",
                         2 * pool + num_snapshots * per_snapshot, pool)
    avail, source = _memory_budget()
    budget = int(avail * mem_fraction)
    working = budget // WORKING_SHARE
    cache = budget - working  # the pools' part
    origin = f"auto: {mem_fraction:g} x {source} = {budget / 2**30:.2f} GiB"
    if not has_states:
        num_snapshots = 0
    elif num_snapshots is None:  # a quarter of the pools' part, at least the minimum
        num_snapshots = int(min(MAX_AUTO_SNAPSHOTS,
                                max(MIN_AUTO_SNAPSHOTS, cache // 4 // per_snapshot)))
    num_slots = int(min(MAX_AUTO_SLOTS, (cache - num_snapshots * per_snapshot) // per_slot))
    if num_slots < MIN_AUTO_SLOTS or (has_states and num_snapshots < MIN_AUTO_SNAPSHOTS):
        states = (f" and {MIN_AUTO_SNAPSHOTS} snapshots of {per_snapshot} B"
                  if has_states else "")
        raise ValueError(
            f"mem_fraction={mem_fraction:g} of the {source} ({avail} B) is a budget of "
            f"{budget} B, which holds {max(num_slots, 0)} token slots of {per_slot} B and "
            f"{num_snapshots} snapshots after a quarter for the decode buffers: too small for "
            f"a useful cache (at least {MIN_AUTO_SLOTS} slots{states}). Raise mem_fraction "
            "or give num_slots (and num_snapshots)")
    return PoolSizes(num_slots, num_snapshots, origin, budget, working)


def buffer_sizes(mem_fraction: float) -> PoolSizes:
    """The budget of an engine without reuse: no pools, ``mem_fraction`` of the memory
    (as an automatic budget) for the decode buffers alone.

    >>> s = buffer_sizes(0.25)
    >>> s.num_slots, s.working_bytes == s.budget_bytes > 0
    (0, True)
    """
    avail, source = _memory_budget()
    budget = int(avail * mem_fraction)
    return PoolSizes(0, 0, f"no reuse: {mem_fraction:g} x {source} = {budget / 2**30:.2f} GiB",
                     budget, budget)
