"""The runner's path for models the engine's own caches serve (``Mode.BATCHED`` and
``Mode.SOLO``): prefill rows start from their prefix gathered from the pool (with reuse),
run right-padded in ragged forwards, and join the running batch (batched: one decode group
for every request) or a group of their own (solo).

Examples:
    >>> from mlxcache.engine.support import Support
    >>> from mlxcache.zoo import make_model
    >>> model = make_model()
    >>> path = PooledPath(model, Support.probe(model), store=None, page_size=1)
    >>> len(path.groups), path.cut([5, 3], [0, 0])  # one running batch; pads exactly
    (1, [5, 3])
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from mlxcache.engine.forward import forward_padded, join_rows
from mlxcache.engine.job import Group, Job
from mlxcache.engine.store import PrefixStore
from mlxcache.engine.support import Support
from mlxcache.layers import build, leaves

__all__ = ["PooledPath"]


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
        """Empty decode groups: batched, the one running batch; else one group per request."""
        self.batch = Group(build(self.layout, 0))
        self.groups: list[Group] = [self.batch] if self.batched else []

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
        """Put a prefilled job (row ``row`` of ``caches``) into the running batch, or, not
        batched, into a group of its own."""
        if self.batched:
            group = self.batch
        else:
            group = Group(build(self.layout, 0))
            self.groups.append(group)
        join_rows(group.caches, caches, row, slack=self.page_size)
        group.add(job)
        return group

    def leave(self, group: Group, row: int) -> None:
        """Take row ``row`` out of ``group`` (an emptied group of its own goes)."""
        for c in leaves(group.caches):
            c.remove_row(row)
        group.remove(row)
        if not group.jobs and group is not self.batch:
            self.groups.remove(group)
