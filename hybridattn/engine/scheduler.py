"""The host scheduler of ``hybridattn.Engine``: admission, prefix caching, chunked prefill,
reservations, shape buckets and finishing, in plain Python (no JAX).

The engine owns the device pools and calls the scheduler in one fixed order per round; the
scheduler never touches a device array, so it can be driven against the reference pools of
``hybridattn.testing`` without compiling a model::

    run sched.device_ops, then sched.op_done(op) each  # frees, borrows, releases it queued
    while (adm := sched.admit_next()):     # FIFO; a row free, slots for the request's life
        row = <allocate a row; it borrows adm.slots, restores depth adm.computed>
        sched.admitted(adm, row)           #   (or sched.cancel(adm) if that failed)
    plan = sched.plan()                    # what runs this step, and its shape buckets
    ... run plan.items() on the device ...
    events, done = sched.commit(plan, tokens, read_slots)   # outputs, cache inserts, finishing
    run sched.device_ops again             # e.g. release the done requests

Each method commits a decision the engine has carried out (or will carry out from the queue,
in order, retrying an op that failed), so an exception between two calls leaves the scheduler
and the pools in agreement.

Admission reserves a request's whole life (the token slots it will own: prompt tokens past a
cached prefix + ``max_new_tokens - 1``: the last sampled token never runs) on top of what
running requests reserved and what the prefix cache holds (evicting unlocked cached prefixes
to make room), so a running request can never run out of slots. A step takes every decoding
request (one token each) and, when some admitted request still has prompt tokens, prompt
chunks up to ``chunked_prefill_size`` tokens (an ``EXTEND`` step); otherwise it is a
``DECODE`` step of every running request.

With ``prefix_cache`` (see ``hybridattn.prefix_cache``), admission matches the prompt in the
radix tree, locks the path, lets the row borrow the cached KV and restores the deepest
snapshot at most one token short of the prompt; the prefill then recomputes only the rest,
snapshotting on the way. After each chunk that took snapshots (and when the whole prompt has
run) the prompt so far goes into the tree with them, and the row borrows it from then on; a
request that would restore a snapshot another prompt has planned but not taken yet waits for
it. When the request finishes, prompt and answer go in, ending at a snapshot of the end.

>>> sched = Scheduler(capacity=64, max_running_requests=2, chunked_prefill_size=4,
...                   request_buckets=(2,), token_buckets=(8,), kv_buckets=(16,))
>>> req = Request(rid=0, prompt=[5, 6, 7, 8, 9], max_new_tokens=2)
>>> sched.add(req)
>>> adm = sched.admit_next()
>>> sched.admitted(adm, row=1)
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
>>> [type(op).__name__ for op in sched.device_ops]  # the engine releases the row...
['Release']
>>> sched.op_done(sched.device_ops[0]); sched.num_running, sched.reserved  # ... and says so
(0, 0)
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from hybridattn.backends import ForwardMode
from hybridattn.prefix_cache import SnapshotSlots, snapshot_points
from hybridattn.serving import WorkItem
from servecore.radix import RadixCache
from servecore.sampling import SamplingParams

__all__ = ["Admission", "Borrow", "FreeSlots", "Release", "Request", "Scheduler",
           "ShardedPlan", "ShardedScheduler", "StepPlan", "bucket", "kv_ladder", "ladder"]


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


def kv_ladder(hi: int, lo: int = 64, switch: int = 4096) -> tuple[int, ...]:
    """The default attention-width buckets: powers of four from ``lo`` up to ``switch``, then
    powers of two, then ``hi``. Short contexts keep few compilations; at long context, where a
    step's cost grows with its width, padding wastes at most 2x (12 buckets for 1M).

    >>> kv_ladder(96), kv_ladder(4096), len(kv_ladder(1 << 20))
    ((64, 96), (64, 256, 1024, 4096), 12)
    >>> kv_ladder(40000)
    (64, 256, 1024, 4096, 8192, 16384, 32768, 40000)
    """
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 4 if lo < switch else 2
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
    (``max_new_tokens``) or ``"abort"`` once it has finished. With a prefix cache:
    ``borrowed`` tokens of KV come from the cache, ``start`` is the depth of the snapshot it
    restored (``restore``: its slot), ``planned`` / ``taken`` map snapshot depths to slots,
    ``owned`` is its reservation of token slots, ``row_slots`` the token slots of its row's
    first positions as the engine wrote them (``read_slots`` serves them without a device
    read).

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
    row_slots: list = dataclasses.field(default_factory=list)  # the row's slots, host copy
    owned: int = 0
    shard: int = 0  # the data shard it runs on (``ShardedScheduler``; 0 on one device)

    @property
    def need(self) -> int:
        """Token slots over the request's whole life (the last sampled token never runs)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens so far."""
        return self.prompt + self.output

    def token_at(self, i: int) -> int:
        """``tokens[i]`` without building ``tokens`` (a copy of the whole context: 0.3 ms
        a decode step at 64k).

        >>> Request(rid=0, prompt=[1, 2], max_new_tokens=4, output=[7]).token_at(2)
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

    >>> plan = StepPlan(ForwardMode.DECODE, ((Request(0, [1], 2, row=1, computed=1), [7]),),
    ...                 (1, 1, 64, 1))
    >>> plan.items()[0].req_index, plan.items()[0].token_ids, plan.num_tokens
    (1, [7], 1)
    """

    mode: ForwardMode
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

    def items(self) -> list[WorkItem]:
        """The work as ``WorkItem``s for ``make_worker_batch``."""
        out = []
        for i, (r, toks) in enumerate(self.work):
            restore = self.restores[i] if self.restores else 0
            snaps = self.snapshots[i] if self.snapshots else ()
            at = r.computed + (self.ahead[i] if self.ahead else 0)
            out.append(WorkItem(r.row, at, toks, r.sampling, restore, snaps))
        return out


class Scheduler:
    """FIFO admission, prefix caching, chunked prefill and finishing over ``capacity`` token
    slots and ``max_running_requests`` rows (see the module docstring).

    Args:
        capacity: token slots requests and the prefix cache may hold (the sink excluded).
        max_running_requests: requests that run at once.
        chunked_prefill_size: prompt tokens per step.
        request_buckets: the shape buckets of ``B`` (the last must hold every row).
        token_buckets: the shape buckets of ``T`` and ``Q`` (the last must hold a step's
            prompt chunk and one token of each decoding request).
        kv_buckets: the shape buckets of ``W`` (the last must hold the longest context).
        num_snapshot_slots: snapshot slots (the sink included); 0: no prefix cache.
        snapshot_interval: the snapshot grid (a multiple of the KDA chunk).
        snapshot_buckets: the shape buckets of ``M``, snapshot entries in a step (with
            ``chunk_size``: of the entries between chunk boundaries and of those on the grid,
            each).
        chunk_size: the KDA chunk; given, a step's snapshots on the chunk grid (which cost no
            extra work) are told apart from the others (``StepPlan.num_snapshots`` is then a
            pair).

    >>> sched = Scheduler(capacity=8, max_running_requests=1, chunked_prefill_size=4,
    ...                   request_buckets=(1,), token_buckets=(4,), kv_buckets=(8,))
    >>> sched.add(Request(0, [1, 2, 3], max_new_tokens=2))
    >>> sched.add(Request(1, [4], max_new_tokens=1))
    >>> sched.admitted(sched.admit_next(), row=1)
    >>> sched.admit_next() is None  # one row: the second waits
    True
    """

    def __init__(self, *, capacity: int, max_running_requests: int, chunked_prefill_size: int,
                 request_buckets: Sequence[int], token_buckets: Sequence[int],
                 kv_buckets: Sequence[int], num_snapshot_slots: int = 0,
                 snapshot_interval: int = 256, snapshot_buckets: Sequence[int] = (0, 4, 16),
                 chunk_size: int | None = None):
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
        self.device_ops: deque = deque()  # FreeSlots / Borrow / Release, in order
        self.tree: RadixCache | None = None
        self.snapshot_slots: SnapshotSlots | None = None
        if num_snapshot_slots:
            self.tree = RadixCache(states=True)
            self.snapshot_slots = SnapshotSlots(num_snapshot_slots)
        self.snapshot_interval = snapshot_interval
        self.snapshot_buckets = tuple(snapshot_buckets)
        self.chunk_size = chunk_size
        # counters the engine reports
        self.snapshots_taken = self.state_evictions = self.token_evictions = 0

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

    @property
    def cached_size(self) -> int:
        """Token slots the prefix cache holds."""
        return self.tree.total_size if self.tree is not None else 0

    def add(self, req: Request) -> None:
        """Queue ``req`` (validated by the caller) at the back."""
        self.waiting.append(req)

    # ------------------------------------------------------------------ admission ----

    def admit_next(self) -> Admission | None:
        """Choose the next waiting request to admit (FIFO: a large request is not overtaken),
        or None: no row free, not enough token slots even after evicting unlocked cached
        prefixes, or (with a cache) a prompt still prefilling would give this one a snapshot
        soon. Commit it with ``admitted`` once the engine has its row, or ``cancel``."""
        if not self.waiting or self.rows_held >= self.max_running_requests:
            return None
        req = self.waiting[0]
        if self.tree is None:
            if self.reserved + req.need > self.capacity:
                return None
            req.owned = req.need
            return Admission(req)
        if self._defer(req):
            return None
        tree, L = self.tree, len(req.prompt)
        kv = tree.match_prefix(req.prompt)
        st = tree.match_prefix(req.prompt[:-1]).state_node  # logits need the last token run
        tree.lock(kv.node)
        P, S = len(kv.slots), st.depth
        need = L - P + req.max_new_tokens - 1
        short = tree.total_size + self.reserved + need - self.capacity
        if short > tree.evictable_size:  # even an empty cache would not make room: wait for
            tree.unlock(kv.node)          # running requests, and keep the cache as it is
            return None
        if short > 0:
            self._evicted(tree.evict(short))
        points = snapshot_points(L, P, S, self.snapshot_interval)
        # The end of the request, one before the end of the prompt and the branch point may
        # evict older states for their slots (they serve the next turn, a repeat, a sibling);
        # grid points take free slots only, the deepest first.
        key = [p for p in dict.fromkeys((L - 1, P)) if p in points]  # P may be L - 1
        slots = self._take_snapshot_slots(len(key) + 1)
        req.finish_slot = slots.pop(0) if slots else 0
        grid = sorted((p for p in points if p not in key), reverse=True)
        slots += self.snapshot_slots.take(len(grid))
        req.planned = dict(zip(key + grid, slots, strict=False))
        req.node, req.borrowed, req.start = kv.node, P, S
        req.restore = st.state if st.state is not None else 0
        req.owned = need
        return Admission(req, tuple(kv.slots), S)

    def _defer(self, req: Request) -> bool:
        """Wait while a prompt still prefilling will put a snapshot (planned, not taken yet)
        on the part it shares with this prompt, deeper than what the tree gives now; taken
        snapshots go into the tree after each chunk."""
        have = self.tree.match_prefix(req.prompt[:-1]).state_node.depth
        for r in self.running:
            if not r.planned:
                continue
            n, limit = 0, min(len(req.prompt) - 1, len(r.prompt) - 1)
            while n < limit and req.prompt[n] == r.prompt[n]:
                n += 1
            if any(have < d <= n for d in r.planned):
                return True
        return False

    def _take_snapshot_slots(self, n: int) -> list[int]:
        slots = self.snapshot_slots.take(n)
        if len(slots) < n:
            self._evicted(self.tree.evict_states(n - len(slots)), states=True)
            slots += self.snapshot_slots.take(n - len(slots))
        return slots

    def _evicted(self, freed, states: bool = False) -> None:
        """Give what the tree evicted back: token slots through the device queue, snapshot
        slots to the free list."""
        if freed.slots:
            self.device_ops.append(FreeSlots(tuple(freed.slots)))
            self.token_evictions += len(freed.slots)
        if freed.states:
            self.snapshot_slots.give(freed.states)
            self.state_evictions += len(freed.states)

    def reset_cache(self) -> None:
        """Evict every cached prefix and snapshot no running request holds (the token slots
        are freed through ``device_ops``)."""
        if self.tree is not None:
            self._evicted(self.tree.evict_states(self.tree.num_states))
            self._evicted(self.tree.evict(self.tree.total_size))

    def admitted(self, adm: Admission, row: int) -> None:
        """Commit the admission ``adm`` (the front of the queue) into ``row``."""
        req = adm.req
        if not self.waiting or self.waiting[0] is not req:
            raise ValueError(f"request {req.rid} is not the next waiting request")
        self.waiting.popleft()
        req.row, req.computed = row, adm.computed
        self.running.append(req)
        self.reserved += req.owned

    def cancel(self, adm: Admission) -> None:
        """Undo ``admit_next`` (the engine could not set up the row): the request stays at the
        front of the queue; its lock and snapshot slots are given back."""
        req = adm.req
        if req.node is not None:
            self.tree.unlock(req.node)
        self._give_snapshots(req)
        req.node, req.borrowed, req.start, req.restore, req.owned = None, 0, 0, 0, 0

    def _give_snapshots(self, req: Request) -> None:
        slots = [*req.planned.values(), *req.taken.values()]
        if req.finish_slot and not req.end_depth:
            slots.append(req.finish_slot)
            req.finish_slot = 0
        if slots:
            self.snapshot_slots.give(slots)
        req.planned, req.taken = {}, {}

    # ----------------------------------------------------------------------- steps ----

    def plan(self, ahead: Mapping[Request, int] | None = None,
             leaving: Collection[Request] = ()) -> StepPlan | None:
        """The next step (reads only), or None when nothing is running.

        ``ahead`` (overlapped scheduling) maps requests to the tokens they run in a step still
        on the device, whose samples the host has not committed: they are planned from
        ``computed + ahead`` on (``StepPlan.ahead``), and a request whose next token is one
        it samples there gets a placeholder 0 (the device supplies it). ``leaving``: requests
        that finish in that step whatever it samples (they reach ``max_new_tokens``); they
        are left out."""
        ahead = ahead or {}
        running = [r for r in self.running if r not in leaving]
        if not running:
            return None
        at = {r: r.computed + ahead.get(r, 0) for r in running}
        decoding = [r for r in running if at[r] >= len(r.prompt)]
        work = [(r, [r.token_at(at[r]) if at[r] < len(r.prompt) + len(r.output) else 0])
                for r in decoding]
        prefilling = [r for r in running if at[r] < len(r.prompt)]

        def done(plan):
            return plan if not ahead else dataclasses.replace(
                plan, ahead=tuple(ahead.get(r, 0) for r, _ in plan.work))

        if not prefilling:
            B = bucket(len(work), self.request_buckets, "requests in a step")
            W = bucket(max(at[r] + 1 for r in decoding), self.kv_buckets, "context length")
            return done(StepPlan(ForwardMode.DECODE, tuple(work), (B, B, W, 1)))
        budget = min(self.chunked_prefill_size, self.token_buckets[-1] - len(decoding))
        for r in prefilling:
            if budget <= 0:
                break
            n = min(budget, len(r.prompt) - at[r])
            work.append((r, r.prompt[at[r]: at[r] + n]))
            budget -= n
        B = bucket(len(work), self.request_buckets, "requests in a step")
        W = bucket(max(at[r] + len(t) for r, t in work), self.kv_buckets, "context length")
        T = bucket(sum(len(t) for _, t in work), self.token_buckets, "tokens in a step")
        Q = min(T, bucket(max(len(t) for _, t in work), self.token_buckets, "extend"))
        if self.tree is None:
            return done(StepPlan(ForwardMode.EXTEND, tuple(work), (B, T, W, Q)))
        restores = tuple(r.restore if at[r] == r.start and at[r] < len(r.prompt) else 0
                         for r, _ in work)
        snaps = tuple(tuple(sorted((d, s) for d, s in r.planned.items()
                                   if at[r] < d <= at[r] + len(t)))
                      for r, t in work)
        if self.chunk_size is None:
            M = bucket(sum(map(len, snaps)), self.snapshot_buckets, "snapshots in a step")
        else:
            C = self.chunk_size
            aligned = sum((d - at[r]) % C == 0 or d == at[r] + len(t)
                          for (r, t), ss in zip(work, snaps, strict=True) for d, _ in ss)
            windowed = sum(map(len, snaps)) - aligned
            M = tuple(bucket(n, self.snapshot_buckets, "snapshots in a step")
                      for n in (windowed, aligned))
        return done(StepPlan(ForwardMode.EXTEND, tuple(work), (B, T, W, Q), restores, snaps,
                             M))

    def commit(self, plan: StepPlan, tokens: Sequence[int],
               read_slots: Callable[[Request, int], Sequence[int]] | None = None,
               ) -> tuple[list[tuple[int, int, bool]], list[Request]]:
        """Record that ``plan`` ran and sampled ``tokens`` (one per work item, in order):
        returns ``(events, done)``, ``events`` the ``(rid, token, finished)`` generated (a
        prompt chunk's sample is discarded) and ``done`` the requests that finished (their
        release is queued in ``device_ops``). With a prefix cache, ``read_slots(req, n)``
        gives the token slots of the first ``n`` positions of ``req``'s row (the engine
        reads them off the device) for what goes into the tree; every read happens before
        anything is recorded, so a read that fails leaves the scheduler as it was."""
        if self.tree is not None:
            read_slots = self._read_ahead(plan, tokens, read_slots)
        events, done = [], []
        for i, ((r, toks), tok) in enumerate(zip(plan.work, tokens, strict=False)):
            was_prefilling = r.prefilling
            r.computed += len(toks)
            if plan.snapshots:
                for d, s in plan.snapshots[i]:
                    r.taken[d] = r.planned.pop(d, s)
            if was_prefilling and self.tree is not None and (r.taken or not r.prefilling):
                self._insert_prompt(r, read_slots)
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
        for r in done:
            if self.tree is not None and r.inserted:
                self._insert_answer(r, read_slots)
        self._retire(done)
        return events, done

    def _read_ahead(self, plan: StepPlan, tokens: Sequence[int], read_slots):
        """The row slots ``commit`` will need (requests whose prompt goes into the tree now,
        and requests that finish), read up front; returns a reader of that copy."""
        rows = {}
        for i, ((r, toks), tok) in enumerate(zip(plan.work, tokens, strict=False)):
            after = r.computed + len(toks)
            took = bool(plan.snapshots and plan.snapshots[i])
            inserts = r.prefilling and (took or after >= len(r.prompt))
            samples = after >= len(r.prompt) and not r.finished
            finishes = samples and (int(tok) in r.stop_token_ids
                                    or len(r.output) + 1 >= r.max_new_tokens)
            if inserts or finishes:
                rows[r.rid] = list(read_slots(r, after))
        return lambda r, n: rows[r.rid][:n]

    def _insert_prompt(self, r: Request, read_slots) -> None:
        """The prompt tokens computed so far go into the tree with the snapshots taken on
        them (after a chunk that took snapshots, so requests waiting for them can start, and
        once the whole prompt is in), and the row borrows them from then on (a device op
        frees the row's duplicates)."""
        tree, n = self.tree, r.computed
        if n < r.borrowed:
            # A chunk that ended inside the KV the row borrows (recomputed from a shallower
            # snapshot, e.g. after the deeper states were evicted): those tokens are in the
            # tree already and the row keeps borrowing (and locking) all of them; only the
            # states it took are new. Shrinking the borrow here would hand the tree's slots
            # past n to the row, which would free them at its release.
            self._add_taken_states(r)
            return
        tokens = r.prompt[:n]
        tree.insert(tokens, list(read_slots(r, n)))
        m = tree.match_prefix(tokens)
        tree.lock(m.node)
        tree.unlock(r.node)
        r.node, r.prompt_slots = m.node, list(m.slots)
        r.inserted = not r.prefilling
        self._add_taken_states(r)
        self.device_ops.append(Borrow(r, tuple(r.prompt_slots)))
        self.reserved -= n - r.borrowed
        r.owned -= n - r.borrowed
        r.borrowed = n

    def _add_taken_states(self, r: Request) -> None:
        """The snapshots ``r`` took go into the tree, at depths its prompt path reaches."""
        for d, s in sorted(r.taken.items()):
            if self.tree.add_state(r.prompt[:d], s):
                self.snapshots_taken += 1
            else:  # a concurrent request put a state there first
                self.snapshot_slots.give([s])
        r.taken = {}

    def _insert_answer(self, r: Request, read_slots) -> None:
        """A finished request: prompt and the answer tokens that ran go into the tree, the row
        hands the answer's new slots over (``keep_from``), and its release snapshots the end."""
        L, F = len(r.prompt), len(r.prompt) + len(r.output) - 1
        ran = r.tokens[:F]
        slots = r.prompt_slots + list(read_slots(r, F))[L:]
        r.keep_from = self.tree.insert(ran, slots)
        if r.finish_slot:
            r.end_depth = F

    def abort(self, rid: int) -> Request | None:
        """End request ``rid``: a waiting one leaves the queue; a running one finishes
        (``"abort"``) and is released like any finished request. Returns it, or None if
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
        if not done:
            return
        for r in done:
            self.running.remove(r)
            self.releasing.append(r)
            if r.node is not None:
                self.tree.unlock(r.node)
                r.node = None
            if self.snapshot_slots is not None:
                self._give_snapshots(r)
        self.device_ops.append(Release(tuple(done)))

    # --------------------------------------------------------------- device ops ----

    def op_done(self, op) -> None:
        """The engine carried out ``op`` (the front of ``device_ops``) on the device."""
        if not self.device_ops or self.device_ops[0] is not op:
            raise ValueError(f"{type(op).__name__} is not the next device op")
        self.device_ops.popleft()
        if isinstance(op, Release):
            self._released(op.reqs)

    def _released(self, done: Sequence[Request]) -> None:
        """The rows and token slots of the finished ``done`` are free again, and their end
        snapshots are written: they go into the tree."""
        for r in done:
            self.releasing.remove(r)
            self.reserved -= r.owned
            r.owned = 0
            if r.end_depth:
                if self.tree.add_state(r.tokens[: r.end_depth], r.finish_slot):
                    self.snapshots_taken += 1
                else:  # the tree has a state there already, or evicted that path
                    self.snapshot_slots.give([r.finish_slot])
                r.finish_slot, r.end_depth = 0, 0


# --------------------------------------------------------------------------------------------
# data shards
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """One step of a sharded engine: ``plans[k]`` is data shard ``k``'s ``StepPlan`` (None: the
    shard runs padding only), all run in one batch of ``mode`` and ``buckets`` (the shards'
    batches must share their shapes). A shard whose own plan is a ``DECODE`` step runs its
    decodes as one-token extends when another shard prefills.

    >>> r = Request(0, [1], 2, row=1, computed=1)
    >>> p = ShardedPlan(ForwardMode.DECODE, (StepPlan(ForwardMode.DECODE, ((r, [7]),),
    ...                 (1, 1, 64, 1)), None), (1, 1, 64, 1))
    >>> [len(items) for items in p.items()], p.num_tokens
    ([1, 0], 1)
    """

    mode: ForwardMode
    plans: tuple[StepPlan | None, ...]
    buckets: tuple[int, int, int, int]
    num_snapshots: None = None  # no prefix cache under a mesh

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

    def items(self) -> list[list[WorkItem]]:
        """Each shard's work as ``WorkItem``s (local rows), for ``ShardedStep.make_batch``."""
        return [[] if p is None else p.items() for p in self.plans]


class ShardedScheduler:
    """The host scheduler of an engine on a mesh with ``num_shards`` data shards: one
    ``Scheduler`` per shard (its own rows, token slots and reservations, no prefix cache)
    behind one FIFO queue. ``admit_next`` gives the request at the front of the queue to the
    least loaded shard (fewest rows held, then fewest token slots reserved) that has a free row
    and room for its whole life; when no shard has, it waits (FIFO: a large request is not
    overtaken). ``plan`` joins the shards' plans into one ``ShardedPlan``; ``commit`` takes the
    sampled tokens per shard. Device ops (releases) stay in each shard's ``device_ops``.

    Same call order as ``Scheduler`` (the module docstring), with ``Request.shard`` saying
    where each admitted request runs.

    >>> sched = ShardedScheduler(2, capacity=8, max_running_requests=1, chunked_prefill_size=4,
    ...                          request_buckets=(1,), token_buckets=(4, 8), kv_buckets=(8,))
    >>> for rid, prompt in enumerate([[1, 2, 3], [4, 5], [6]]):
    ...     sched.add(Request(rid, prompt, max_new_tokens=2))
    >>> while (adm := sched.admit_next()) is not None:
    ...     sched.admitted(adm, row=1)
    >>> [(r.rid, r.shard) for r in sched.running], sched.num_waiting  # one row per shard
    ([(0, 0), (1, 1)], 1)
    >>> plan = sched.plan()
    >>> plan.mode.name, plan.buckets, [[i.token_ids for i in it] for it in plan.items()]
    ('EXTEND', (1, 4, 8, 4), [[[1, 2, 3]], [[4, 5]]])
    >>> sched.commit(plan, [[9], [8]])[0]  # each prompt's first token
    [(0, 9, False), (1, 8, False)]
    """

    def __init__(self, num_shards: int, *, capacity: int, max_running_requests: int,
                 chunked_prefill_size: int, request_buckets: Sequence[int],
                 token_buckets: Sequence[int], kv_buckets: Sequence[int],
                 chunk_size: int | None = None):
        self.shards = [Scheduler(capacity=capacity, max_running_requests=max_running_requests,
                                 chunked_prefill_size=chunked_prefill_size,
                                 request_buckets=request_buckets, token_buckets=token_buckets,
                                 kv_buckets=kv_buckets, chunk_size=chunk_size)
                       for _ in range(num_shards)]
        self.capacity = capacity  # per shard
        self.max_running_requests = max_running_requests  # per shard
        self.request_buckets = tuple(request_buckets)
        self.token_buckets = tuple(token_buckets)
        self.kv_buckets = tuple(kv_buckets)
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.tree = None  # no prefix cache under a mesh
        self.snapshots_taken = self.state_evictions = self.token_evictions = 0

    @property
    def running(self) -> list[Request]:
        """Admitted, unfinished requests of every shard, shard by shard."""
        return [r for s in self.shards for r in s.running]

    @property
    def releasing(self) -> list[Request]:
        """Finished requests whose rows are not released yet."""
        return [r for s in self.shards for r in s.releasing]

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished."""
        return sum(s.num_running for s in self.shards)

    @property
    def num_waiting(self) -> int:
        """Queued requests not admitted yet."""
        return len(self.waiting)

    @property
    def cached_size(self) -> int:
        """Token slots a prefix cache holds: none."""
        return 0

    @property
    def device_ops(self) -> list:
        """Every shard's queued device ops (``Release``), shard by shard."""
        return [op for s in self.shards for op in s.device_ops]

    def add(self, req: Request) -> None:
        """Queue ``req`` (validated by the caller) at the back."""
        self.waiting.append(req)

    def admit_next(self) -> Admission | None:
        """Choose the request at the front and its shard (``req.shard``), or None: no shard
        has a free row and the token slots for it."""
        if not self.waiting:
            return None
        req = self.waiting[0]
        fits = [k for k, s in enumerate(self.shards)
                if s.rows_held < s.max_running_requests and s.reserved + req.need <= s.capacity]
        if not fits:
            return None
        k = min(fits, key=lambda k: (self.shards[k].rows_held, self.shards[k].reserved, k))
        shard = self.shards[k]
        req.shard = k
        shard.add(req)
        adm = shard.admit_next()
        if adm is None:  # unreachable: the checks above are the shard's own
            shard.waiting.remove(req)
        return adm

    def admitted(self, adm: Admission, row: int) -> None:
        """Commit ``adm`` into local ``row`` of shard ``adm.req.shard``."""
        req = adm.req
        if not self.waiting or self.waiting[0] is not req:
            raise ValueError(f"request {req.rid} is not the next waiting request")
        self.shards[req.shard].admitted(adm, row)
        self.waiting.popleft()

    def cancel(self, adm: Admission) -> None:
        """Undo ``admit_next``: the request stays at the front of the queue."""
        shard = self.shards[adm.req.shard]
        shard.cancel(adm)
        shard.waiting.remove(adm.req)

    def reset_cache(self) -> None:
        """Nothing to forget: no prefix cache."""

    def plan(self) -> ShardedPlan | None:
        """Every shard's next step, in one batch shape, or None when nothing is running.
        ``EXTEND`` if any shard prefills (the others' decodes ride along as one-token
        extends), else ``DECODE``; each shard fills its own prompt-chunk budget."""
        plans = tuple(s.plan() for s in self.shards)
        live = [p for p in plans if p is not None]
        if not live:
            return None
        work = [w for p in live for w in p.work]
        B = bucket(max(len(p.work) for p in live), self.request_buckets, "requests in a step")
        W = bucket(max(r.computed + len(t) for r, t in work), self.kv_buckets, "context length")
        if all(p.mode == ForwardMode.DECODE for p in live):
            return ShardedPlan(ForwardMode.DECODE, plans, (B, B, W, 1))
        T = bucket(max(p.num_tokens for p in live), self.token_buckets, "tokens in a step")
        Q = min(T, bucket(max(len(t) for _, t in work), self.token_buckets, "extend"))
        return ShardedPlan(ForwardMode.EXTEND, plans, (B, T, W, Q))

    def commit(self, plan: ShardedPlan, tokens: Sequence[Sequence[int]], read_slots=None,
               ) -> tuple[list[tuple[int, int, bool]], list[Request]]:
        """Record that ``plan`` ran; ``tokens[k]`` are shard ``k``'s samples, one per work item
        of its plan (padding after). Returns ``(events, done)`` as ``Scheduler.commit``."""
        events, done = [], []
        for s, p, toks in zip(self.shards, plan.plans, tokens, strict=True):
            if p is not None:
                e, d = s.commit(p, list(toks)[: len(p.work)])
                events += e
                done += d
        return events, done

    def abort(self, rid: int) -> Request | None:
        """End request ``rid`` (waiting: it leaves the queue; running: its shard releases it).
        Returns it, or None if it is not waiting or running."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                r.finish_reason = "abort"
                return r
        for s in self.shards:
            r = s.abort(rid)
            if r is not None:
                return r
        return None

    def op_done(self, op) -> None:
        """The engine carried out ``op`` (the front of its shard's ``device_ops``)."""
        for s in self.shards:
            if s.device_ops and s.device_ops[0] is op:
                s.op_done(op)
                return
        raise ValueError(f"{type(op).__name__} is not the next device op of any shard")
