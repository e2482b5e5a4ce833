"""The core's path for models the engine's own caches serve (``Mode.BATCHED`` and
``Mode.SOLO``): prefill rows start from their prefix gathered from the pool (with reuse),
run right-padded in ragged forwards, and join a running batch (batched: one decode group per
length bucket) or a group of their own (solo).

Why length buckets: a decode group keeps one dense buffer per layer, rows x its longest row
(``mlxcache.cache``), so one 960-token request among seven of 8 tokens made a buffer of 8 x
1024 token rows, 7x the live K/V. A request joins the batch of its bucket
(``length_bucket``: up to ``BUCKET_BASE`` tokens, then each ``BUCKET_RATIO`` times longer),
so a batch's rows differ at most that much in length when they join; each batch is one
forward per decode step. A batch whose last row leaves goes, its buffers with it, and a
leave shrinks its buffers to what the batch still needs (``RaggedKVCache.fit``): an idle
engine holds no decode buffer. Measured (``make_model``, 960 + 7 x 8 tokens, 16 generated,
a pool of 2000 slots): the peak buffers went from 8.4 MB to 1.3 MB, for 1.2 MB of live K/V,
and an idle engine's from 8.4 MB to none.

Examples:
    >>> from mlxcache.engine.support import Support
    >>> from mlxcache.zoo import make_model
    >>> model = make_model()
    >>> path = PooledPath(model, Support.probe(model), store=None, page_size=1)
    >>> len(path.groups), path.cut([5, 3], [0, 0])  # no batch until one joins; pads exactly
    (0, [5, 3])
    >>> [length_bucket(n) for n in (8, 256, 257, 960, 1025)]
    [0, 0, 1, 1, 2]
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from mlxcache.cache import RaggedKVCache
from mlxcache.engine._forward import forward_padded, join_rows
from mlxcache.engine._job import Group, Job
from mlxcache.engine._store import PrefixStore
from mlxcache.engine.support import Support
from mlxcache.layers import build, leaves

__all__ = ["BUCKET_BASE", "BUCKET_RATIO", "PooledPath", "length_bucket"]

BUCKET_BASE, BUCKET_RATIO = 256, 4
"""Length buckets of the running batches: up to ``BUCKET_BASE`` tokens, then each
``BUCKET_RATIO`` times longer than the one before."""


def length_bucket(tokens: int) -> int:
    """The running batch a request of ``tokens`` tokens joins (see the module docstring).

    >>> length_bucket(1), length_bucket(1024), length_bucket(4097)
    (0, 1, 3)
    """
    bucket, top = 0, BUCKET_BASE
    while tokens > top:
        bucket, top = bucket + 1, top * BUCKET_RATIO
    return bucket


class PooledPath:
    """Prefill caches, forwards and decode groups on the engine's own caches.

    >>> from mlxcache.engine.support import Mode, Support
    >>> from mlxcache.zoo import make_model
    >>> model = make_model()
    >>> solo = Support(Mode.SOLO, Support.probe(model).layout)  # no padding part-way
    >>> PooledPath(model, solo, None, 1).cut([5, 3], [0, 0])
    [3, 3]
    """

    def __init__(self, model: nn.Module, support: Support, store: PrefixStore | None,
                 page_size: int):
        self.model = model
        self.layout = support.layout
        self.batched = support.batched
        self.pads_exactly = support.pads_exactly
        self.store = store
        self.page_size = page_size
        self.new_groups()

    def new_groups(self) -> None:
        """No decode group: batched, one per length bucket comes with its first request;
        else one per request."""
        self.groups: list[Group] = []
        self.buckets: dict[int, Group] = {}  # batched: the running batch of each bucket

    def prefill_caches(self, jobs: list[Job]) -> list[Any]:
        """Caches whose row ``i`` holds job ``i``'s cached prefix (empty without reuse)."""
        if self.store is None:
            return build(self.layout, len(jobs))
        return self.store.prefix_caches(jobs)

    def cut(self, stop: list[int], pos: list[int]) -> list[int]:
        """Where each row's next prefill forward stops: where asked when a row may be padded
        part-way, else no row runs further than the narrowest unfinished one."""
        if self.pads_exactly:
            return stop
        width = min((t - p for t, p in zip(stop, pos, strict=True) if t > p), default=0)
        return [min(t, p + width) for t, p in zip(stop, pos, strict=True)]

    def forward(self, caches: list[Any], rows: list[list[int]], width: int) -> None:
        """One prefill forward of ``rows`` right-padded to ``width``."""
        forward_padded(self.model, caches, rows, width)

    def join(self, job: Job, caches: list[Any], row: int) -> Group:
        """Put a prefilled job (row ``row`` of ``caches``) into the running batch of its
        length bucket, or, not batched, into a group of its own."""
        bucket = length_bucket(len(job.tokens))
        group = self.buckets.get(bucket) if self.batched else None
        if group is None:
            group = Group(build(self.layout, 0))
            self.groups.append(group)
            if self.batched:
                self.buckets[bucket] = group
        join_rows(group.caches, caches, row, slack=self.page_size)
        group.add(job)
        return group

    def leave(self, group: Group, row: int) -> None:
        """Take row ``row`` out of ``group``: an emptied group goes (its buffers with it),
        else its buffers shrink to what the rows need (``RaggedKVCache.fit``)."""
        for c in leaves(group.caches):
            c.remove_row(row)
        group.remove(row)
        if not group.jobs:
            self.groups.remove(group)
            self.buckets = {b: g for b, g in self.buckets.items() if g is not group}
            return
        for c in leaves(group.caches):
            if isinstance(c, RaggedKVCache):
                c.fit()
