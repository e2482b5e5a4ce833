"""How big the engine's pools are: given, or sized from free memory.

The KV pool holds ``num_slots`` token slots of every attention layer's K/V; a hybrid model's
state pool holds ``num_snapshots`` snapshots of every recurrent layer's state. Given no
``num_slots``, the pools take ``mem_fraction`` of the memory the pool may draw from (the
Metal working set on Apple silicon, else ``servecore.memory_budget``: ``MemAvailable``
capped by any cgroup limit); snapshots then take a quarter of it.

Examples:
    >>> s = pool_sizes(per_slot=1024, per_snapshot=0, num_slots=64, num_snapshots=None,
    ...                mem_fraction=0.5, has_states=False)
    >>> s.num_slots, s.origin
    (64, 'given')
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from servecore.memory import memory_budget

__all__ = ["MAX_AUTO_SLOTS", "MAX_AUTO_SNAPSHOTS", "MIN_AUTO_SNAPSHOTS", "PoolSizes",
           "auto_num_slots", "pool_sizes"]

MAX_AUTO_SLOTS = 1 << 20
"""Upper bound on an automatically sized pool (about a million tokens)."""

MIN_AUTO_SNAPSHOTS, MAX_AUTO_SNAPSHOTS = 8, 4096
"""Bounds on an automatically sized state pool (hybrid models)."""


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
    """The pools' sizes and where the figure came from (``origin``, for the log).

    >>> PoolSizes(8, 0, "given").num_snapshots
    0
    """

    num_slots: int
    num_snapshots: int
    origin: str


def pool_sizes(*, per_slot: int, per_snapshot: int, num_slots: int | None,
               num_snapshots: int | None, mem_fraction: float, has_states: bool) -> PoolSizes:
    """The pools' sizes: given ones kept; without ``num_slots``, from free memory (see the
    module docstring); without ``num_snapshots`` (hybrid models), a quarter of the budget
    in snapshots, within ``[MIN_AUTO_SNAPSHOTS, MAX_AUTO_SNAPSHOTS]``.

    >>> pool_sizes(per_slot=10, per_snapshot=100, num_slots=400, num_snapshots=None,
    ...            mem_fraction=0.5, has_states=True)
    PoolSizes(num_slots=400, num_snapshots=10, origin='given')
    """
    if num_slots is None:
        num_slots, budget, source = auto_num_slots(per_slot, mem_fraction)
        origin = f"auto: {mem_fraction:g} x {source} = {budget / 2**30:.2f} GiB"
    else:
        budget, origin = num_slots * per_slot, "given"
    if not has_states:
        return PoolSizes(num_slots, 0, origin)
    if num_snapshots is None:
        # Snapshots take a quarter of the cache memory: the token pool keeps the rest.
        if origin != "given":
            num_slots = max(2, num_slots * 3 // 4)
        num_snapshots = int(min(MAX_AUTO_SNAPSHOTS,
                                max(MIN_AUTO_SNAPSHOTS, budget // 4 // per_snapshot)))
    return PoolSizes(num_slots, num_snapshots, origin)
