"""The host scheduler of ``hybridattn.Engine``: admission, chunked prefill, reservations,
shape buckets and finishing, in plain Python (no JAX).

The engine owns the device pools and calls the scheduler in one fixed order per round; the
scheduler never touches a device array, so it can be driven against the reference pools of
``hybridattn.testing`` without compiling a model::

    for req in sched.admissible():         # FIFO: a row free, and slots for its whole life
        sched.admitted(req, row)           #   (row: allocated on the device by the engine)
    plan = sched.plan()                    # what runs this step, and its shape buckets
    ... run plan.items() on the device ...
    events, done = sched.commit(plan, tokens)   # outputs, finishing (nothing is freed yet)
    ... release the done requests' rows and slots on the device ...
    sched.released(done)                   # their rows and reservations come back

Every method either only reads (``admissible``, ``plan``) or commits a decision the engine has
already carried out on the device, so an exception between two calls leaves the scheduler
and the pools in agreement.

Admission reserves a request's whole life (prompt + ``max_new_tokens - 1`` token slots: the
last sampled token never runs) on top of what running requests reserved, so a running request
can never run out of slots. A step takes every decoding request (one token each) and, when
some admitted request still has prompt tokens, prompt chunks up to ``chunked_prefill_size``
tokens (an ``EXTEND`` step); otherwise it is a ``DECODE`` step of every running request.

>>> sched = Scheduler(capacity=64, max_running_requests=2, chunked_prefill_size=4,
...                   request_buckets=(2,), token_buckets=(8,), kv_buckets=(16,))
>>> req = Request(rid=0, prompt=[5, 6, 7, 8, 9], max_new_tokens=2)
>>> sched.add(req)
>>> [r.rid for r in sched.admissible()]
[0]
>>> sched.admitted(req, row=1)
>>> plan = sched.plan()
>>> plan.mode.name, [(r.rid, toks) for r, toks in plan.work], plan.buckets
('EXTEND', [(0, [5, 6, 7, 8])], (2, 8, 16, 8))
>>> sched.commit(plan, [42])  # a prompt chunk: its sample is discarded
([], [])
>>> plan = sched.plan()
>>> sched.commit(plan, [11])  # the prompt's last token: the first generated token
([(0, 11, False)], [])
>>> events, done = sched.commit(sched.plan(), [12])  # a DECODE step
>>> events, [r.rid for r in done], done[0].finish_reason
([(0, 12, True)], [0], 'length')
>>> sched.released(done); sched.num_running, sched.reserved
(0, 0)
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence

from hybridattn.backend import ForwardMode
from hybridattn.serving import WorkItem
from servecore.sampling import SamplingParams

__all__ = ["Request", "Scheduler", "StepPlan", "bucket", "ladder"]


def ladder(lo: int, hi: int, factor: int = 4) -> tuple[int, ...]:
    """``lo, lo * factor, ...`` below ``hi``, then ``hi``: the default shape buckets (few
    buckets, few compilations; padding wastes at most ``factor``x).

    >>> ladder(16, 200)
    (16, 64, 200)
    """
    out = []
    while lo < hi:
        out.append(lo)
        lo *= factor
    return (*out, hi)


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket that holds ``n``; ``ValueError`` naming ``what`` if none does.

    >>> bucket(17, (16, 64), "tokens in a step")
    64
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(eq=False)
class Request:
    """One request's host-side state.

    ``computed`` counts its tokens whose KV / state is in the pools; ``output`` its generated
    tokens; ``finish_reason`` is ``"stop"`` (a stop token, which is kept), ``"length"``
    (``max_new_tokens``) or ``"abort"`` once it has finished.

    >>> r = Request(rid=3, prompt=[1, 2], max_new_tokens=4)
    >>> r.need, r.finished, r.tokens
    (5, False, [1, 2])
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset = frozenset()
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    output: list[int] = dataclasses.field(default_factory=list)
    row: int = 0
    computed: int = 0
    finish_reason: str | None = None

    @property
    def need(self) -> int:
        """Token slots over the request's whole life (the last sampled token never runs)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens so far."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        """Whether the request has ended (stop token, length or abort)."""
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to run."""
        return self.computed < len(self.prompt)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's work: ``work`` lists ``(request, tokens to run)``; ``buckets`` is the padded
    shape ``(B, T, W, Q)`` (requests, tokens, attention width, longest extend).

    >>> plan = StepPlan(ForwardMode.DECODE, ((Request(0, [1], 2, row=1, computed=1), [7]),),
    ...                 (1, 1, 64, 1))
    >>> plan.items()[0].req_index, plan.items()[0].token_ids, plan.num_tokens
    (1, [7], 1)
    """

    mode: ForwardMode
    work: tuple[tuple[Request, list[int]], ...]
    buckets: tuple[int, int, int, int]

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs (padding excluded)."""
        return sum(len(t) for _, t in self.work)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step runs (decode tokens riding along excluded)."""
        return sum(len(t) for r, t in self.work if r.prefilling)

    def items(self) -> list[WorkItem]:
        """The work as ``WorkItem``s for ``make_worker_batch``."""
        return [WorkItem(r.row, r.computed, toks, r.sampling) for r, toks in self.work]


class Scheduler:
    """FIFO admission, chunked prefill and finishing over ``capacity`` token slots and
    ``max_running_requests`` rows (see the module docstring).

    Args:
        capacity: token slots requests may reserve (the sink excluded).
        max_running_requests: requests that run at once.
        chunked_prefill_size: prompt tokens per step.
        request_buckets: the shape buckets of ``B`` (the last must hold every row).
        token_buckets: the shape buckets of ``T`` and ``Q`` (the last must hold a step's
            prompt chunk and one token of each decoding request).
        kv_buckets: the shape buckets of ``W`` (the last must hold the longest context).

    >>> sched = Scheduler(capacity=8, max_running_requests=1, chunked_prefill_size=4,
    ...                   request_buckets=(1,), token_buckets=(4,), kv_buckets=(8,))
    >>> sched.add(Request(0, [1, 2, 3], max_new_tokens=2))
    >>> sched.add(Request(1, [4], max_new_tokens=1))
    >>> [r.rid for r in sched.admissible()]  # one row: the second waits
    [0]
    """

    def __init__(self, *, capacity: int, max_running_requests: int, chunked_prefill_size: int,
                 request_buckets: Sequence[int], token_buckets: Sequence[int],
                 kv_buckets: Sequence[int]):
        self.capacity = capacity
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.request_buckets = tuple(request_buckets)
        self.token_buckets = tuple(token_buckets)
        self.kv_buckets = tuple(kv_buckets)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.releasing: list[Request] = []  # finished, rows and slots not given back yet
        self.reserved = 0  # token slots reserved by running and releasing requests

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests not admitted yet."""
        return len(self.waiting)

    @property
    def rows_held(self) -> int:
        """Rows held by running requests and by finished ones not released yet."""
        return len(self.running) + len(self.releasing)

    def add(self, req: Request) -> None:
        """Queue ``req`` (validated by the caller) at the back."""
        self.waiting.append(req)

    def admissible(self) -> list[Request]:
        """The waiting requests to admit now, in order (reads only): FIFO while a row is free
        and the token slots of the request's whole life fit beside every reservation."""
        out, rows, reserved = [], self.rows_held, self.reserved
        for req in self.waiting:
            if rows >= self.max_running_requests or reserved + req.need > self.capacity:
                break  # strictly FIFO: a large request is not overtaken
            out.append(req)
            rows += 1
            reserved += req.need
        return out

    def admitted(self, req: Request, row: int) -> None:
        """Commit the admission of ``req`` (the front of the queue) into ``row``."""
        if not self.waiting or self.waiting[0] is not req:
            raise ValueError(f"request {req.rid} is not the next waiting request")
        self.waiting.popleft()
        req.row, req.computed = row, 0
        self.running.append(req)
        self.reserved += req.need

    def plan(self) -> StepPlan | None:
        """The next step (reads only), or None when nothing is running."""
        if not self.running:
            return None
        decoding = [r for r in self.running if not r.prefilling]
        work = [(r, [r.tokens[r.computed]]) for r in decoding]
        prefilling = [r for r in self.running if r.prefilling]
        if not prefilling:
            B = bucket(len(work), self.request_buckets, "requests in a step")
            W = bucket(max(r.computed + 1 for r in decoding), self.kv_buckets, "context length")
            return StepPlan(ForwardMode.DECODE, tuple(work), (B, B, W, 1))
        budget = min(self.chunked_prefill_size, self.token_buckets[-1] - len(decoding))
        for r in prefilling:
            if budget <= 0:
                break
            n = min(budget, len(r.prompt) - r.computed)
            work.append((r, r.prompt[r.computed: r.computed + n]))
            budget -= n
        B = bucket(len(work), self.request_buckets, "requests in a step")
        W = bucket(max(r.computed + len(t) for r, t in work), self.kv_buckets, "context length")
        T = bucket(sum(len(t) for _, t in work), self.token_buckets, "tokens in a step")
        Q = min(T, bucket(max(len(t) for _, t in work), self.token_buckets, "extend"))
        return StepPlan(ForwardMode.EXTEND, tuple(work), (B, T, W, Q))

    def commit(self, plan: StepPlan, tokens: Sequence[int]
               ) -> tuple[list[tuple[int, int, bool]], list[Request]]:
        """Record that ``plan`` ran and sampled ``tokens`` (one per work item, in order):
        returns ``(events, done)``, ``events`` the ``(rid, token, finished)`` generated (a
        prompt chunk's sample is discarded) and ``done`` the requests that finished. They
        keep their rows and reservations until ``released``."""
        events, done = [], []
        for (r, toks), tok in zip(plan.work, tokens, strict=False):
            r.computed += len(toks)
            if r.prefilling or r.finished:
                continue
            tok = int(tok)
            r.output.append(tok)
            if tok in r.stop_token_ids:
                r.finish_reason = "stop"
            elif len(r.output) >= r.max_new_tokens:
                r.finish_reason = "length"
            events.append((r.rid, tok, r.finished))
            if r.finished:
                done.append(r)
        self._retire(done)
        return events, done

    def abort(self, rid: int) -> Request | None:
        """End request ``rid``: a waiting one leaves the queue; a running one finishes
        (``"abort"``) and must be released like any finished request. Returns it, or None if
        it is not waiting or running."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                r.finish_reason = "abort"
                return r
        for r in self.running:
            if r.rid == rid:
                r.finish_reason = "abort"
                self._retire([r])
                return r
        return None

    def _retire(self, done: list[Request]) -> None:
        for r in done:
            self.running.remove(r)
            self.releasing.append(r)

    def released(self, done: Sequence[Request]) -> None:
        """Commit that the rows and token slots of the finished ``done`` are free again."""
        for r in done:
            self.releasing.remove(r)
            self.reserved -= r.need
