"""The core's path for models the pool cannot serve (``Mode.PLAIN``: a cache kind the
engine does not know): mlx-lm's own caches, one request per forward, no reuse; each running
request is a decode group of its own.

Examples:
    >>> from mlxcache.zoo import make_model
    >>> path = PlainPath(make_model())
    >>> path.groups, path.batched
    ([], False)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.engine._job import Group, Job

__all__ = ["PlainPath"]


class PlainPath:
    """Prefill caches, forwards and decode groups on the model's own caches.

    >>> from mlxcache.zoo import make_model
    >>> PlainPath(make_model()).cut([7], [0])
    [7]
    """

    batched = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.new_groups()

    def new_groups(self) -> None:
        """No decode group: each request gets its own when it joins."""
        self.batch = None
        self.groups: list[Group] = []

    def prefill_caches(self, jobs: list[Job]) -> list[Any]:
        """The model's own fresh caches (one job)."""
        return make_prompt_cache(self.model)

    def cut(self, stop: list[int], pos: list[int]) -> list[int]:
        """One row: it runs where asked."""
        return stop

    def forward(self, caches: list[Any], rows: list[list[int]], width: int) -> None:
        """One prefill forward (one row, never padded)."""
        self.model(mx.array(rows), cache=caches)

    def join(self, job: Job, caches: list[Any], row: int) -> Group:
        """A group of its own, on the prefill's caches."""
        group = Group(caches)
        self.groups.append(group)
        group.add(job)
        return group

    def leave(self, group: Group, row: int) -> None:
        """The job's group goes with it."""
        group.remove(row)
        if not group.jobs:
            self.groups.remove(group)
