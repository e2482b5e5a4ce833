"""``AdmissionPolicy``: which waiting requests go into the next prefill batch.

Requests are admitted fewest uncached tokens first (among the first
``SHORTEST_FIRST_LOOKAHEAD`` waiting; one overtaken ``MAX_OVERTAKEN`` times goes next),
together into one *prefill batch* while their padded new tokens fit ``prefill_step_size`` and
their uncached tokens ``prefill_batch_tokens`` (on MLX's CPU device also at most
``round(sqrt(c N / n))`` of the ``N`` waiting, ``n`` uncached tokens each on average:
``CPU_FORWARD_COST_TOKENS``). A request that shares a good part of its uncached tokens with
one already in the batch waits for the next batch, so that it reuses that prefix once
inserted. With prefix reuse each admitted request's matched prefix is locked and its new
slots reserved (``PrefixStore.reserve``); when they cannot be had, admission stops and the
request waits for running ones to finish. So it does when the decode buffers that the
running requests and it could come to need would not fit their budget
(``mlxcache.engine.memory.WorkingBudget``), unless nothing else runs.

Examples:
    >>> from mlxcache.engine.options import check_options
    >>> a = AdmissionPolicy(check_options(prefill_batch_tokens=64), store=None, batched=True)
    >>> a.prefill_batch_tokens, a.forward_cost, len(a.waiting)
    (64, None, 0)
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import mlx.core as mx

from mlxcache.engine._job import Job
from mlxcache.engine._store import PrefixStore
from mlxcache.engine.memory import WorkingBudget
from mlxcache.engine.options import EngineOptions

__all__ = ["CPU_FORWARD_COST_TOKENS", "CPU_PREFILL_BATCH_TOKENS", "DEFER_SHARED_TOKENS",
           "MAX_OVERTAKEN", "SHORTEST_FIRST_LOOKAHEAD", "AdmissionPolicy"]

DEFER_SHARED_TOKENS = 64
"""A request waits for the next prefill batch when it shares this many uncached tokens (or
half of its uncached tokens, if fewer) with a request already in the batch."""

CPU_PREFILL_BATCH_TOKENS = 128
"""``prefill_batch_tokens`` on MLX's CPU device. There a forward costs about what its rows
cost one by one (measured, a tiny llama: a row of 16-48 tokens costs 0.6-0.9 of its cost
alone in a batch of 2-16, a 256-token row more), so a large batch only makes every first token
wait for the last row's; a GPU amortizes a forward's fixed cost over many rows."""

CPU_FORWARD_COST_TOKENS = 28
"""A prefill forward's fixed cost on MLX's CPU device, in prompt tokens of compute, doubled.
Admission sizes the prefill batch by it: ``N`` waiting requests of ``n`` uncached tokens on
average, served in equal batches of ``b`` at ``a + b r`` a batch (a fixed cost ``a``, ``r`` a
row), get their first tokens in a mean time that is least at ``b* = sqrt(a N / r)`` (the sum
of completion times, ``(a + b r) N (N / b + 1) / 2``, is least where ``b^2 = a N / r``); so a
long queue of short suffixes goes in a few batches, cold prompts alone. Measured on a tiny
llama, a batch of ``b`` rows of 16 tokens over a cached 512-token prefix took 4.3 ms + 5.0 ms
a row (0.31 ms a token): ``a`` is 14 tokens. Doubled, ``b`` is ``1.4 b*``: the mean TTFT is
flat near its least (the part that depends on ``b`` grows 6%) while fewer forwards save
their fixed cost, which the throughput keeps."""

SHORTEST_FIRST_LOOKAHEAD = 64
"""Admission takes the request with the fewest uncached tokens among the first this many
waiting (ties: the earliest)."""

MAX_OVERTAKEN = 16
"""A waiting request overtaken this many times by shorter ones is admitted next."""


class AdmissionPolicy:
    """The waiting queue and the rule that takes prefill batches from it (see the module
    docstring). ``store`` is the prefix store (None without reuse); ``batched``: whether a
    batch may hold more than one request; ``working``: the decode buffers' budget (None:
    none).

    >>> from mlxcache.engine.options import check_options
    >>> AdmissionPolicy(check_options(), store=None, batched=False).max_batch_size
    32
    """

    def __init__(self, opts: EngineOptions, store: PrefixStore | None, batched: bool,
                 working: WorkingBudget | None = None):
        self.store = store
        self.working = working
        self.batched = batched
        self.max_batch_size = opts.max_batch_size
        self.prefill_step_size = opts.prefill_step_size
        # With no cap given, on MLX's CPU device the batch is also sized for the mean TTFT
        # (CPU_FORWARD_COST_TOKENS); a GPU amortizes a forward's fixed cost over many rows.
        self.forward_cost: float | None = None
        if opts.prefill_batch_tokens is not None:
            self.prefill_batch_tokens = opts.prefill_batch_tokens
        elif mx.default_device().type == mx.DeviceType.cpu:
            self.prefill_batch_tokens = CPU_PREFILL_BATCH_TOKENS
            self.forward_cost = CPU_FORWARD_COST_TOKENS
        else:
            self.prefill_batch_tokens = opts.prefill_step_size
        self.waiting: deque[Job] = deque()
        self._arrivals = itertools.count()

    def push(self, job: Job) -> None:
        """Queue ``job`` (arrival order kept for fairness)."""
        job.seq = next(self._arrivals)
        self.waiting.append(job)

    def admit(self, batch: list[Job], running: int) -> None:
        """Move the next prefill batch from the waiting queue into ``batch`` (maybe none: the
        pool is full), ``running`` requests decoding already. ``batch`` is filled in place so
        that an exception part-way leaves every reserved request in it, to be dropped."""
        widest = total = 0
        store = self.store
        todo = self._shortest_first() if store is not None else None
        most = self.max_batch_size - running
        if todo and self.forward_cost is not None:  # sized for the mean TTFT
            mean = sum(todo) / len(todo)
            most = min(most, max(1, round(math.sqrt(self.forward_cost * len(todo) / mean))))
        while self.waiting and len(batch) < most:
            job = self.waiting[0]
            m = store.match(job.tokens) if store is not None else None
            cached = m.cached if m is not None else 0
            todo = len(job.tokens) - cached
            if batch and (
                not self.batched
                or (len(batch) + 1) * max(widest, todo) > self.prefill_step_size
                or total + todo > self.prefill_batch_tokens
                or self._shares_uncached(job, cached, batch)
            ):
                break
            if (batch or running) and self.working and not self.working.fits([*batch, job]):
                break
            if store is not None and not store.reserve(job, m):
                break
            batch.append(job)
            self.waiting.popleft()
            for other in itertools.islice(self.waiting, SHORTEST_FIRST_LOOKAHEAD):
                other.overtaken += other.seq < job.seq
            job.state = "prefill"
            widest, total = max(widest, todo), total + todo

    def _shortest_first(self) -> list[int]:
        """Reorder the head of the waiting queue by uncached tokens, fewest first (stable),
        among the first ``SHORTEST_FIRST_LOOKAHEAD``; a request overtaken ``MAX_OVERTAKEN``
        times keeps its place ahead of the rest. Returns the head's uncached counts."""
        cached = self.store.cached
        if len(self.waiting) < 2:
            return [len(j.tokens) - cached(j.tokens) for j in self.waiting]
        head = [self.waiting.popleft()
                for _ in range(min(len(self.waiting), SHORTEST_FIRST_LOOKAHEAD))]
        # Only the order uses these counts (read-only peeks: no split, no LRU touch):
        # admission matches each request again, since reserving slots for one may evict
        # prefixes another counted here.
        todo = {id(j): len(j.tokens) - cached(j.tokens) for j in head}
        order = sorted(head, key=lambda j: (j.overtaken < MAX_OVERTAKEN, todo[id(j)]))
        self.waiting.extendleft(reversed(order))
        return list(todo.values())

    @staticmethod
    def _shares_uncached(job: Job, cached: int, batch: list[Job]) -> bool:
        """Would ``job`` reuse enough of a batch member's prompt, once it is inserted?"""
        want = max(1, min(DEFER_SHARED_TOKENS, (len(job.tokens) - cached + 1) // 2))
        head = job.tokens[: cached + want]
        return len(head) == cached + want and any(
            other.tokens[: cached + want] == head for other in batch
        )
