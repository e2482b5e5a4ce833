"""A request while the engine serves it (``Job``), and a decode group of them (``Group``).

A job's life: ``"waiting"`` (queued) -> ``"prefill"`` (admitted into this round's prefill
batch) -> ``"running"`` (in a decode group) -> ``"done"``; or ``"cancelled"`` (its caller
aborted it) or ``"aborted"`` (a round serving it failed) from any of them.

Examples:
    >>> from servecore.requests import RequestBuilder
    >>> job = Job(0, RequestBuilder(vocab_size=16).one([1, 2], 2), key=None)
    >>> job.output.append(5); job.done
    False
    >>> job.output.append(6); job.done
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxcache.logprobs import LogprobBatch
from servecore.radix import TreeNode
from servecore.requests import GenerationRequest, finish_reason

__all__ = ["LIVE", "Group", "Job"]

LIVE = frozenset({"waiting", "reloading", "prefill", "running"})
"""The states of a job that holds (or may hold) something."""


@dataclass(eq=False)
class Job:
    """One request's host-side state while it is served.

    Slots: ``tree_slots`` are the prompt's first ``len(tree_slots)`` positions, owned by the
    tree and pinned by the lock on ``node``; ``pending`` are the slots allocated for the rest,
    the request's own until the prompt is inserted. ``cached`` of the ``tree_slots`` positions
    are read from the pool: all of them, except after a full hit, which recomputes the last
    token (its logits are needed) and so needs no new slot at all.

    >>> from servecore.requests import RequestBuilder
    >>> Job(3, RequestBuilder(vocab_size=16).one([1], 1), key=None).state
    'waiting'
    """

    rid: int
    request: GenerationRequest
    key: mx.array | None
    arrival: float = 0.0
    seq: int = 0  # arrival order, for fairness in shortest-first admission
    overtaken: int = 0  # times a later request was admitted first
    state: str = "waiting"
    group: Group | None = None  # the decode group, while running
    output: list[int] = field(default_factory=list)
    cached: int = 0
    node: TreeNode | None = None
    tree_slots: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    restore: int | None = None  # hybrid models: the snapshot slot of the state at `cached`
    points: list[int] = field(default_factory=list)  # depths to snapshot during prefill
    disk_checked: bool = False  # the disk tier looked for its prefix (once)
    # hybrid models, pages of several tokens: (depth, snapshot slot) of the state at the
    # answer's latest page boundary, held by the job until publish_answer hangs it on the tree
    page_state: tuple[int, int] | None = None
    # a request that asked for logprobs: those of its token sampled last and not yet
    # reported, as (the batch's arrays, its row there)
    held_logprobs: tuple[LogprobBatch, int] | None = None

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids."""
        return self.request.tokens

    @property
    def done(self) -> bool:
        """Finished by the shared rule (``servecore.requests.finish_reason``)."""
        return finish_reason(self.output, self.request) is not None

    def forget_prefix(self) -> None:
        """Hold nothing (a waiting job whose admission was cut short)."""
        self.node, self.cached, self.tree_slots, self.pending = None, 0, [], []


@dataclass(eq=False)
class Group:
    """Jobs advanced together by one forward, and their per-layer caches.

    ``feed`` ``(R,)`` holds each row's next input token, possibly still being computed;
    ``unread[i]`` tells that ``feed[i]`` was sampled by the last step and not yet emitted (a
    row that just joined feeds its prefill token, which was emitted already).

    >>> Group([]).feed is None
    True
    """

    caches: list[Any]
    jobs: list[Job] = field(default_factory=list)
    feed: mx.array | None = None
    unread: list[bool] = field(default_factory=list)

    def add(self, job: Job) -> None:
        """Append ``job`` as the last row, feeding its last token."""
        token = mx.array([job.output[-1]], dtype=mx.int32)
        self.feed = token if self.feed is None else mx.concatenate([self.feed, token])
        self.jobs.append(job)
        self.unread.append(False)

    def remove(self, row: int) -> None:
        """Drop ``row``: the last row moves into its place (as in ``RaggedKVCache``)."""
        order = list(range(len(self.jobs)))
        order[row] = order[-1]
        order.pop()
        self.jobs = [self.jobs[i] for i in order]
        self.unread = [self.unread[i] for i in order]
        self.feed = self.feed[mx.array(order, dtype=mx.int32)] if order else None

    def arrays(self) -> list[Any]:
        """What the group keeps between rounds (to schedule): its feed, its caches' state and
        its jobs' sampling keys.

        >>> Group([]).arrays()
        [None]
        """
        return [self.feed, *(c.state for c in self.caches), *(j.key for j in self.jobs)]
