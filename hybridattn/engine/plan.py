"""The scheduler's decisions as data: requests, admissions, device ops and step plans.

Plain Python, no JAX: ``hybridattn.engine.scheduler`` makes these, ``hybridattn.engine._runner``
carries them out on the device (``runner.work_items`` turns a plan into the device's
``WorkItem``\\ s). ``Mode`` is a step's kind, with the values of
``hybridattn.backends.ForwardMode`` (the runner passes ``ForwardMode(plan.mode)``).

>>> r = Request(rid=0, prompt=[5, 6], max_tokens=2, row=1)
>>> StepPlan(Mode.EXTEND, ((r, [5, 6]),), (1, 2, 64, 2)).num_tokens
2
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from servecore.sampling import SamplingParams

__all__ = ["Admission", "Borrow", "FreeSlots", "Mode", "Release", "Request", "ShardedPlan",
           "StepPlan"]


class Mode(enum.IntEnum):
    """What a step does: ``EXTEND`` (prompt chunks, with decodes riding along) or ``DECODE``
    (one token of every running request); the values of ``backend.ForwardMode``.

    >>> Mode.DECODE == 2, Mode(1).name
    (True, 'EXTEND')
    """

    EXTEND = 1
    DECODE = 2


@dataclasses.dataclass(eq=False)
class Request:
    """One request's host-side state.

    ``computed`` counts its tokens whose KV / state is in the pools; ``output`` its generated
    tokens; ``finish_reason`` is ``"stop"`` (a stop token, which is kept), ``"length"``
    (``max_tokens``) or ``"abort"`` once it has finished. With a prefix cache:
    ``borrowed`` tokens of KV come from the cache, ``start`` is the depth of the snapshot it
    restored (``restore``: its slot), ``planned`` / ``taken`` map snapshot depths to slots,
    ``owned`` is its reservation of token slots, ``row_slots`` the token slots of its row's
    positions, named by the engine (``servecore.ids.IdPool``; ``read_slots`` serves them
    without a device read), ``row_borrowed`` how many of them the row borrows. ``logprobs``
    (None, or ``k``): the request wants each token's log-probability and its ``k`` most
    likely alternatives (the steps that run it return them).

    >>> r = Request(rid=3, prompt=[1, 2], max_tokens=4)
    >>> r.need, r.finished, r.tokens
    (5, False, [1, 2])
    """

    rid: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset = frozenset()
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    output: list[int] = dataclasses.field(default_factory=list)
    row: int = 0
    computed: int = 0
    finish_reason: str | None = None
    # prefix cache
    borrowed: int = 0
    start: int = 0
    restore: int = 0
    node: Any = None
    planned: dict = dataclasses.field(default_factory=dict)
    taken: dict = dataclasses.field(default_factory=dict)
    finish_slot: int = 0
    inserted: bool = False
    prompt_slots: list = dataclasses.field(default_factory=list)
    keep_from: int | None = None
    end_depth: int = 0  # tokens that ran, once finished and inserted
    row_slots: list = dataclasses.field(default_factory=list)  # the row's slots (host's ids)
    row_borrowed: int = 0  # positions of row_slots the row borrows (the device's borrowed)
    logprobs: int | None = None  # None, or k: each token's log-probability and its top k
    owned: int = 0
    shard: int = 0  # the data shard it runs on (``ShardedScheduler``; 0 on one device)

    @property
    def need(self) -> int:
        """Token slots over the request's whole life (the last sampled token never runs)."""
        return len(self.prompt) + self.max_tokens - 1

    @property
    def stop(self) -> frozenset:
        """``stop_token_ids``, under the name ``servecore.requests.finish_reason`` reads."""
        return self.stop_token_ids

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens so far."""
        return self.prompt + self.output

    def token_at(self, i: int) -> int:
        """``tokens[i]`` without building ``tokens`` (a copy of the whole context: 0.3 ms
        a decode step at 64k).

        >>> Request(rid=0, prompt=[1, 2], max_tokens=4, output=[7]).token_at(2)
        7
        """
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    @property
    def finished(self) -> bool:
        """Whether the request has ended (stop token, length or abort)."""
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to run."""
        return self.computed < len(self.prompt)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request ``admit_next`` chose: its row borrows the cache's token slots ``slots`` (the
    first ``len(slots)`` positions) and has ``computed`` tokens' states (a snapshot of that
    depth is restored by its first step).

    >>> Admission(Request(0, [1, 2], 1), slots=(7, 9), computed=1).borrowed
    2
    """

    req: Request
    slots: tuple[int, ...] = ()
    computed: int = 0

    @property
    def borrowed(self) -> int:
        """Positions the row borrows from the cache."""
        return len(self.slots)


@dataclasses.dataclass(frozen=True, eq=False)
class FreeSlots:
    """Device op: free these token slots (the prefix cache evicted them).

    >>> FreeSlots((4, 5)).slots
    (4, 5)
    """

    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Borrow:
    """Device op: ``req``'s row borrows the cache's ``slots`` for its first ``len(slots)``
    positions (``serving.borrow_prefix``; the row's own duplicates there are freed).

    >>> Borrow(Request(0, [1], 1), (3,)).slots
    (3,)
    """

    req: Request
    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Release:
    """Device op: release the finished ``reqs`` (``serving.release``), each keeping positions
    from ``req.keep_from`` on for the cache and snapshotting its end into
    ``req.finish_slot`` when ``req.end_depth`` is set.

    >>> Release((Request(0, [1], 1),)).reqs[0].rid
    0
    """

    reqs: tuple[Request, ...]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's work: ``work`` lists ``(request, tokens to run)``; ``buckets`` is the padded
    shape ``(B, T, W, Q)`` (requests, tokens, attention width, longest extend). With a prefix
    cache, ``restores[i]`` and ``snapshots[i]`` are work item ``i``'s snapshot to restore and
    ``(depth, slot)`` snapshots to take, and ``num_snapshots`` the bucket ``M`` of snapshot
    entries (None without a cache, and in DECODE steps). ``ahead[i]`` (overlapped
    scheduling; empty: none) counts the tokens request ``i`` runs in a step still on the
    device, which the host has not committed yet: this step runs it from position
    ``computed + ahead[i]`` on, its token coming from that step's output.

    >>> plan = StepPlan(Mode.DECODE, ((Request(0, [1], 2, row=1, computed=1), [7]),),
    ...                 (1, 1, 64, 1))
    >>> plan.num_tokens, plan.prompt_tokens
    (1, 0)
    """

    mode: Mode
    work: tuple[tuple[Request, list[int]], ...]
    buckets: tuple[int, int, int, int]
    restores: tuple[int, ...] = ()
    snapshots: tuple[tuple[tuple[int, int], ...], ...] = ()
    num_snapshots: int | tuple[int, int] | None = None
    ahead: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs (padding excluded)."""
        return sum(len(t) for _, t in self.work)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step runs (decode tokens riding along excluded)."""
        return sum(len(t) for r, t in self.work if r.prefilling)



@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """One step of a sharded engine: ``plans[k]`` is data shard ``k``'s ``StepPlan`` (None: the
    shard runs padding only), all run in one batch of ``mode`` and ``buckets`` (the shards'
    batches must share their shapes). A shard whose own plan is a ``DECODE`` step runs its
    decodes as one-token extends when another shard prefills.

    >>> r = Request(0, [1], 2, row=1, computed=1)
    >>> p = ShardedPlan(Mode.DECODE, (StepPlan(Mode.DECODE, ((r, [7]),),
    ...                 (1, 1, 64, 1)), None), (1, 1, 64, 1))
    >>> [r.rid for r, _ in p.work], p.num_tokens
    ([0], 1)
    """

    mode: Mode
    plans: tuple[StepPlan | None, ...]
    buckets: tuple[int, int, int, int]
    num_snapshots: int | tuple[int, int] | None = None  # M: the shards' largest

    @property
    def work(self) -> tuple[tuple[Request, list[int]], ...]:
        """Every shard's work, shard by shard."""
        return tuple(w for p in self.plans if p is not None for w in p.work)

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs on all shards (padding excluded)."""
        return sum(p.num_tokens for p in self.plans if p is not None)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step runs on all shards."""
        return sum(p.prompt_tokens for p in self.plans if p is not None)

