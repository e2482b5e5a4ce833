"""What an ``mlxcache.Engine`` holds for serving, part by part, and the rule that keeps it
inside its budget.

Three parts, all inside ``budget_bytes`` (``mlxcache.engine.sizing``):

- the KV pool: ``num_slots`` token slots of every attention layer's K/V (a fixed size);
- the state pool (hybrid models): ``num_snapshots`` snapshots of the recurrent layers' state
  (a fixed size);
- the running batches' decode buffers (``mlxcache.cache.RaggedKVCache`` and the recurrent
  rows): they grow as requests join and decode, shrink as they leave and are freed when
  no request runs.

The decode buffers stay inside their part, ``working_budget_bytes``, by admission: a request
is admitted only while the buffers that the running requests and it could come to need
(``batch_bytes``: each at its prompt plus ``max_tokens``, in its length bucket, rows
rounded as the buffers round them) fit, unless nothing else runs: one request always runs
(its row is what serving it takes, whatever the budget). The figures are read between
rounds; inside a round a prefill batch's own caches (at most ``prefill_step_size`` tokens
of new K/V, plus the prefixes it gathers) and a buffer being grown or shrunk exist for a
moment beside them.

Examples:
    >>> from mlxcache.engine import Engine
    >>> from mlxcache.zoo import make_model
    >>> engine = Engine(make_model(), num_slots=64)
    >>> m = engine.memory
    >>> m.kv_pool_bytes == 64 * m.bytes_per_slot, m.working_bytes, m.working_budget_bytes
    (True, 0, 65536)
    >>> _ = engine.generate([[1, 2, 3]], max_tokens=4)
    >>> engine.memory.peak_working_bytes > 0, engine.memory.working_bytes  # idle: freed
    (True, 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mlxcache.cache import capacity
from mlxcache.engine._forward import arrays_in
from mlxcache.engine._job import Group, Job
from mlxcache.engine._path_pooled import length_bucket
from mlxcache.engine.options import EngineOptions
from mlxcache.engine.sizing import PoolSizes, buffer_sizes
from mlxcache.engine.support import Support
from mlxcache.layers import leaves
from mlxcache.pool import bytes_per_token_slot

__all__ = ["MemoryReport", "WorkingBudget", "batch_bytes", "working_budget", "working_bytes"]


def batch_bytes(rows: Iterable[tuple[int, int]], per_token: int, per_row: int) -> int:
    """Bytes of the decode buffers of running batches whose rows are ``(prompt tokens, most
    tokens the row may hold)``: per length bucket of the prompts, the rows rounded up to a
    power of two times the ``capacity`` of the longest, at ``per_token`` bytes a token of a
    row, plus ``per_row`` bytes of recurrent state a row.

    >>> batch_bytes([(960, 976)] + [(8, 24)] * 7, per_token=1024, per_row=0)   # 1 x 1024 + 8 x 32
    1310720
    >>> batch_bytes([(960, 976)] + [(8, 24)] * 7, per_token=1024, per_row=0) < 8 * 1024 * 1024
    True
    """
    buckets: dict[int, list[int]] = {}
    for prompt, most in rows:
        buckets.setdefault(length_bucket(prompt), []).append(most)
    total = 0
    for most in buckets.values():
        n = len(most)
        total += (1 << (n - 1).bit_length()) * capacity(max(most)) * per_token + n * per_row
    return total


def _nbytes(cache: Any) -> int:
    try:
        return int(cache.nbytes)  # a buffer's capacity, not only what it holds
    except (AttributeError, NotImplementedError):
        return sum(a.nbytes for a in arrays_in(cache.state))


def working_bytes(groups: Sequence[Group]) -> int:
    """Bytes the decode groups' caches hold now (their buffers' capacity).

    >>> working_bytes([])
    0
    """
    return sum(_nbytes(c) for g in groups for c in leaves(g.caches))


class WorkingBudget:
    """The admission rule of the module docstring: ``fits(jobs)`` tells whether the running
    jobs of ``groups()`` and ``jobs`` could all run to their end inside ``limit`` bytes, the
    decode buffers' part of the budget ``sizes``.

    >>> b = WorkingBudget(lambda: [], 1024, 0, PoolSizes(0, 0, "test", 1 << 20, 1 << 20))
    >>> b.limit, b.need([])
    (1048576, 0)
    """

    def __init__(self, groups: Callable[[], Sequence[Group]], per_token: int, per_row: int,
                 sizes: PoolSizes):
        self.groups, self.sizes = groups, sizes
        self.per_token, self.per_row, self.limit = per_token, per_row, sizes.working_bytes

    def need(self, jobs: Sequence[Job]) -> int:
        """Bytes the running jobs and ``jobs`` could come to need (``batch_bytes``)."""
        running = [j for g in self.groups() for j in g.jobs]
        return batch_bytes(((len(j.tokens), len(j.tokens) + j.request.max_tokens)
                            for j in [*running, *jobs]), self.per_token, self.per_row)

    def fits(self, jobs: Sequence[Job]) -> bool:
        """Whether ``need(jobs)`` is inside the limit."""
        return self.need(jobs) <= self.limit


def working_budget(support: Support, opts: EngineOptions, store: Any,
                   groups: Callable[[], Sequence[Group]]) -> WorkingBudget | None:
    """The decode buffers' budget of an engine: with reuse, the part of the store's budget
    (``store.sizes``); without, ``sizing.buffer_sizes``; None for a model served on mlx-lm's
    own caches (their layout is not the engine's: no budget).

    >>> from mlxcache.engine.options import check_options
    >>> from mlxcache.zoo import make_model
    >>> opts = check_options(prefix_cache=False)
    >>> b = working_budget(Support.probe(make_model(), False), opts, None, lambda: [])
    >>> b.per_token, b.sizes.num_slots, b.limit == b.sizes.budget_bytes
    (1024, 0, True)
    """
    if store is not None:
        states = store.states
        return WorkingBudget(groups, store.pool.bytes_per_slot,
                             0 if states is None else states.bytes_per_slot, store.sizes)
    if support.kv is None or not support.supported:
        return None
    heads, head_dim, v_head_dim, dtype = support.kv
    layout = support.layout
    per_token = bytes_per_token_slot(len(layout.kv_leaves), heads, head_dim, dtype, v_head_dim,
                                     layout.kv_quant)
    per_row = sum(math.prod(x[0]) * x[1].size for leaf in layout.like for x in leaf
                  if x is not None)
    return WorkingBudget(groups, per_token, per_row, buffer_sizes(opts.mem_fraction))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What an engine holds for serving (``mlxcache.Engine.memory``; see the module
    docstring), in bytes. Names as in ``hybridattn.engine.sizing.MemoryReport`` where the
    concept is the same: ``budget_bytes``, ``pool_bytes`` (every pool), ``snapshot_bytes``
    (one snapshot).

    Attributes:
        budget_bytes: everything below is inside it (without reuse: the decode buffers'
            alone; 0 for a model served on mlx-lm's own caches: no budget).
        working_budget_bytes: the decode buffers' part of it.
        kv_pool_bytes / snapshot_pool_bytes: the KV pool, the state pool (fixed sizes).
        working_bytes / peak_working_bytes: the decode buffers now, and the most they held
            (read after each round).
        num_slots, bytes_per_slot, num_snapshots, snapshot_bytes: the pools' geometry.
        origin: where the budget came from (``"given"`` sizes, or the automatic figure).

    >>> m = MemoryReport(4096, 1024, 2048, 512, 256, 1024, 16, 128, 2, 256, "given")
    >>> m.pool_bytes, m.serving_bytes, m.peak_serving_bytes
    (2560, 2816, 3584)
    >>> print(m)
    serving 2.8 KiB of a 4.0 KiB budget (given)
      KV pool 2.0 KiB (16 slots x 128 B)
      snapshots 512 B (2 x 256 B)
      decode buffers 256 B (peak 1.0 KiB, limit 1.0 KiB)
    """

    budget_bytes: int
    working_budget_bytes: int
    kv_pool_bytes: int
    snapshot_pool_bytes: int
    working_bytes: int
    peak_working_bytes: int
    num_slots: int
    bytes_per_slot: int
    num_snapshots: int
    snapshot_bytes: int
    origin: str = ""

    @classmethod
    def of(cls, store: Any, groups: Sequence[Group], peak_working_bytes: int,
           working: WorkingBudget | None = None) -> MemoryReport:
        """The report of an engine whose prefix store is ``store`` (None: no reuse), whose
        decode groups are ``groups`` and whose decode buffers' budget is ``working``.

        >>> MemoryReport.of(None, [], 0).origin
        "mlx-lm's own caches: no budget"
        """
        now = working_bytes(groups)
        peak = max(peak_working_bytes, now)
        if store is None:
            if working is None:
                return cls(0, 0, 0, 0, now, peak, 0, 0, 0, 0, "mlx-lm's own caches: no budget")
            sizes = working.sizes
            return cls(sizes.budget_bytes, sizes.working_bytes, 0, 0, now, peak, 0,
                       working.per_token, 0, 0, sizes.origin)
        sizes, states = store.sizes, store.states
        return cls(
            budget_bytes=sizes.budget_bytes, working_budget_bytes=sizes.working_bytes,
            kv_pool_bytes=store.pool.nbytes,
            snapshot_pool_bytes=0 if states is None else states.nbytes,
            working_bytes=now, peak_working_bytes=peak, num_slots=store.num_slots,
            bytes_per_slot=store.pool.bytes_per_slot,
            num_snapshots=0 if states is None else states.num_slots,
            snapshot_bytes=0 if states is None else states.bytes_per_slot, origin=sizes.origin)

    @property
    def pool_bytes(self) -> int:
        """The pools: KV and state (fixed at construction)."""
        return self.kv_pool_bytes + self.snapshot_pool_bytes

    @property
    def serving_bytes(self) -> int:
        """All the engine holds for serving now: the pools and the decode buffers."""
        return self.pool_bytes + self.working_bytes

    @property
    def peak_serving_bytes(self) -> int:
        """The pools and the most the decode buffers held."""
        return self.pool_bytes + self.peak_working_bytes

    def __str__(self) -> str:
        return (f"serving {_size(self.serving_bytes)} of a {_size(self.budget_bytes)} budget "
                f"({self.origin})\n  KV pool {_size(self.kv_pool_bytes)} ({self.num_slots} "
                f"slots x {self.bytes_per_slot} B)\n  snapshots "
                f"{_size(self.snapshot_pool_bytes)} ({self.num_snapshots} x "
                f"{self.snapshot_bytes} B)\n  decode buffers {_size(self.working_bytes)} (peak "
                f"{_size(self.peak_working_bytes)}, limit {_size(self.working_budget_bytes)})")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
