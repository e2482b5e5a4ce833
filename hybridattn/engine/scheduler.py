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
cached prefix + ``max_tokens - 1``: the last sampled token never runs) on top of what
running requests reserved and what the prefix cache holds (evicting unlocked cached prefixes
to make room), so a running request can never run out of slots. A step takes every decoding
request (one token each) and, when some admitted request still has prompt tokens, prompt
chunks up to ``chunked_prefill_size`` tokens (an ``EXTEND`` step); otherwise it is a
``DECODE`` step of every running request.

With ``prefix_cache`` (``hybridattn.engine._prefix_cache``), admission matches the prompt in the
radix tree, locks the path, lets the row borrow the cached KV and restores the deepest
snapshot at most one token short of the prompt; the prefill then recomputes only the rest,
snapshotting on the way. After each chunk that took snapshots (and when the whole prompt has
run) the prompt so far goes into the tree with them, and the row borrows it from then on; a
request that would restore a snapshot another prompt has planned but not taken yet waits for
it. When the request finishes, prompt and answer go in, ending at a snapshot of the end.

>>> sched = Scheduler(capacity=64, max_running_requests=2, chunked_prefill_size=4,
...                   request_buckets=(2,), token_buckets=(8,), kv_buckets=(16,))
>>> req = Request(rid=0, prompt=[5, 6, 7, 8, 9], max_tokens=2)
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
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

from hybridattn.engine._prefix_cache import PrefixCache
from hybridattn.engine.buckets import bucket
from hybridattn.engine.plan import (
    Admission,
    Mode,
    Release,
    Request,
    ShardedPlan,
    StepPlan,
)
from servecore.prefix import cached_len
from servecore.requests import finish_reason

__all__ = ["Scheduler", "ShardedScheduler"]


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
    >>> sched.add(Request(0, [1, 2, 3], max_tokens=2))
    >>> sched.add(Request(1, [4], max_tokens=1))
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
        self.cache: PrefixCache | None = None
        if num_snapshot_slots:
            self.cache = PrefixCache(num_snapshot_slots=num_snapshot_slots,
                                     snapshot_interval=snapshot_interval,
                                     device_ops=self.device_ops)
        self.snapshot_interval = snapshot_interval
        self.snapshot_buckets = tuple(snapshot_buckets)
        self.chunk_size = chunk_size

    @property
    def tree(self):
        """The prefix cache's radix tree (None without a cache)."""
        return None if self.cache is None else self.cache.tree

    @property
    def snapshot_slots(self):
        """The prefix cache's snapshot slots (None without a cache)."""
        return None if self.cache is None else self.cache.snapshot_slots

    def counters(self) -> tuple[int, int, int]:
        """``(snapshots_taken, state_evictions, token_evictions)`` of the prefix cache."""
        c = self.cache
        return (0, 0, 0) if c is None else (c.snapshots_taken, c.state_evictions,
                                            c.token_evictions)

    def reset_counters(self) -> None:
        """Zero the prefix cache's counters."""
        if self.cache is not None:
            c = self.cache
            c.snapshots_taken = c.state_evictions = c.token_evictions = 0

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
        return self.cache.size if self.cache is not None else 0

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
        if self.cache is None:
            if self.reserved + req.need > self.capacity:
                return None
            req.owned = req.need
            return Admission(req)
        got = self.cache.admit(req, self.running, self.capacity - self.reserved)
        if got is None:
            return None
        slots, computed = got
        return Admission(req, slots, computed)

    def reset_cache(self) -> None:
        """Evict every cached prefix and snapshot no running request holds (the token slots
        are freed through ``device_ops``)."""
        if self.cache is not None:
            self.cache.reset()

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
        if self.cache is not None:
            self.cache.cancel(req)
        req.owned = 0

    # ----------------------------------------------------------------------- steps ----

    def plan(self, ahead: Mapping[Request, int] | None = None,
             leaving: Collection[Request] = ()) -> StepPlan | None:
        """The next step (reads only), or None when nothing is running.

        ``ahead`` (overlapped scheduling) maps requests to the tokens they run in a step still
        on the device, whose samples the host has not committed: they are planned from
        ``computed + ahead`` on (``StepPlan.ahead``), and a request whose next token is one
        it samples there gets a placeholder 0 (the device supplies it). ``leaving``: requests
        that finish in that step whatever it samples (they reach ``max_tokens``); they
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
            return done(StepPlan(Mode.DECODE, tuple(work), (B, B, W, 1)))
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
        if self.cache is None:
            return done(StepPlan(Mode.EXTEND, tuple(work), (B, T, W, Q)))
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
        return done(StepPlan(Mode.EXTEND, tuple(work), (B, T, W, Q), restores, snaps,
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
        if self.cache is not None:
            read_slots = self.cache.read_ahead(plan, tokens, read_slots)
        events, done = [], []
        for i, ((r, toks), tok) in enumerate(zip(plan.work, tokens, strict=False)):
            was_prefilling = r.prefilling
            r.computed += len(toks)
            if plan.snapshots:
                for d, s in plan.snapshots[i]:
                    r.taken[d] = r.planned.pop(d, s)
            if was_prefilling and self.cache is not None and (r.taken or not r.prefilling):
                self.reserved -= self.cache.insert_prompt(r, read_slots)
            if r.prefilling or r.finished:
                continue
            tok = int(tok)
            r.output.append(tok)
            r.finish_reason = finish_reason(r.output, r)  # the rule of both engines
            events.append((r.rid, tok, r.finished))
            if r.finished:
                done.append(r)
        for r in done:
            if self.cache is not None and r.inserted:
                self.cache.insert_answer(r, read_slots)
        self._retire(done)
        return events, done

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
            if self.cache is not None:
                self.cache.retire(r)
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
            if self.cache is not None:
                self.cache.released(r)



class ShardedScheduler:
    """The host scheduler of an engine on a mesh with ``num_shards`` data shards: one
    ``Scheduler`` per shard (its own rows, token slots and reservations, and with
    ``num_snapshot_slots`` its own prefix cache: a radix tree over its own token and snapshot
    slots, the one-device policy unchanged) behind one FIFO queue. ``plan`` joins the shards'
    plans into one ``ShardedPlan``; ``commit`` takes the sampled tokens per shard. Device ops
    (frees, borrows, releases) stay in each shard's ``device_ops``, in its order.

    Routing (``admit_next``): the request at the front of the queue goes to the shard whose
    tree holds the longest usable prefix of it (``servecore.prefix.cached_len``: what its
    row would not compute) among the shards that can admit it (a free row, and its whole
    life's token slots after evicting that shard's unlocked cached prefixes); ties, and a
    request no tree helps, go to the least loaded shard (fewest rows held, then fewest token
    slots reserved, then the lowest index). A hot prefix cannot pin all traffic to one shard:
    a shard holding more than ``ROUTE_SLACK`` rows beyond the least loaded one gets no credit
    for its prefix, so the request goes where the load is, computes the prefix there, and
    from then on two shards hold it. When no shard can admit it, it waits (FIFO: a large
    request is not overtaken).

    Same call order as ``Scheduler`` (the module docstring), with ``Request.shard`` saying
    where each admitted request runs.

    >>> sched = ShardedScheduler(2, capacity=8, max_running_requests=1, chunked_prefill_size=4,
    ...                          request_buckets=(1,), token_buckets=(4, 8), kv_buckets=(8,))
    >>> for rid, prompt in enumerate([[1, 2, 3], [4, 5], [6]]):
    ...     sched.add(Request(rid, prompt, max_tokens=2))
    >>> while (adm := sched.admit_next()) is not None:
    ...     sched.admitted(adm, row=1)
    >>> [(r.rid, r.shard) for r in sched.running], sched.num_waiting  # one row per shard
    ([(0, 0), (1, 1)], 1)
    >>> plan = sched.plan()
    >>> plan.mode.name, plan.buckets, [[t for _, t in p.work] for p in plan.plans]
    ('EXTEND', (1, 4, 8, 4), [[[1, 2, 3]], [[4, 5]]])
    >>> sched.commit(plan, [[9], [8]])[0]  # each prompt's first token
    [(0, 9, False), (1, 8, False)]
    """

    ROUTE_SLACK = 1
    """Rows a shard may hold beyond the least loaded shard and still be chosen for the
    prefix its tree holds."""

    def __init__(self, num_shards: int, *, capacity: int, max_running_requests: int,
                 chunked_prefill_size: int, request_buckets: Sequence[int],
                 token_buckets: Sequence[int], kv_buckets: Sequence[int],
                 chunk_size: int | None = None, num_snapshot_slots: int = 0,
                 snapshot_interval: int = 256, snapshot_buckets: Sequence[int] = (0, 4, 16)):
        self.shards = [Scheduler(capacity=capacity, max_running_requests=max_running_requests,
                                 chunked_prefill_size=chunked_prefill_size,
                                 request_buckets=request_buckets, token_buckets=token_buckets,
                                 kv_buckets=kv_buckets, chunk_size=chunk_size,
                                 num_snapshot_slots=num_snapshot_slots,
                                 snapshot_interval=snapshot_interval,
                                 snapshot_buckets=snapshot_buckets)
                       for _ in range(num_shards)]
        self.capacity = capacity  # per shard
        self.max_running_requests = max_running_requests  # per shard
        self.request_buckets = tuple(request_buckets)
        self.token_buckets = tuple(token_buckets)
        self.kv_buckets = tuple(kv_buckets)
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()

    @property
    def tree(self) -> tuple | None:
        """Each data shard's radix tree (None without a prefix cache)."""
        return None if self.shards[0].cache is None else tuple(s.tree for s in self.shards)

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
        """Token slots the shards' prefix caches hold."""
        return sum(s.cached_size for s in self.shards)

    @property
    def device_ops(self) -> list:
        """Every shard's queued device ops (``Release``), shard by shard."""
        return [op for s in self.shards for op in s.device_ops]

    def add(self, req: Request) -> None:
        """Queue ``req`` (validated by the caller) at the back."""
        self.waiting.append(req)

    def admit_next(self) -> Admission | None:
        """Choose the request at the front and its shard (``req.shard``; the routing of the
        class docstring), or None: no shard can admit it now."""
        if not self.waiting:
            return None
        req = self.waiting[0]
        for k in self.route(req):
            shard = self.shards[k]
            if shard.rows_held >= shard.max_running_requests:
                continue
            req.shard = k
            shard.add(req)
            adm = shard.admit_next()  # (with a cache: may evict that shard's cached prefixes)
            if adm is not None:
                return adm
            shard.waiting.remove(req)
        return None

    def route(self, req: Request) -> list[int]:
        """The shards in the order ``admit_next`` tries them for ``req`` (read-only).

        >>> sched = ShardedScheduler(2, capacity=64, max_running_requests=4,
        ...                          chunked_prefill_size=8, request_buckets=(4,),
        ...                          token_buckets=(16,), kv_buckets=(64,),
        ...                          num_snapshot_slots=8, snapshot_interval=8)
        >>> sched.shards[1].tree.insert([1, 2, 3, 4], [5, 6, 7, 8])
        0
        >>> sched.shards[1].tree.add_state([1, 2, 3, 4], 3)  # (a KDA state: usable there)
        True
        >>> sched.route(Request(0, [1, 2, 3, 4, 9], 2)), sched.route(Request(1, [7, 7], 2))
        ([1, 0], [0, 1])
        """
        shards = self.shards
        least = min(s.rows_held for s in shards)

        def credit(s: Scheduler) -> int:
            if s.cache is None or s.rows_held - least > self.ROUTE_SLACK:
                return 0
            return cached_len(s.tree, req.prompt)

        return sorted(range(len(shards)), key=lambda k: (
            -credit(shards[k]), shards[k].rows_held, shards[k].reserved, k))

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
        """Evict, on every shard, each cached prefix and snapshot no running request holds."""
        for s in self.shards:
            s.reset_cache()

    def counters(self) -> tuple[int, int, int]:
        """``(snapshots_taken, state_evictions, token_evictions)`` summed over the shards."""
        return tuple(sum(x) for x in zip(*(s.counters() for s in self.shards), strict=True))

    def reset_counters(self) -> None:
        """Zero every shard's prefix-cache counters."""
        for s in self.shards:
            s.reset_counters()

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
        if all(p.mode == Mode.DECODE for p in live):
            return ShardedPlan(Mode.DECODE, plans, (B, B, W, 1))
        T = bucket(max(p.num_tokens for p in live), self.token_buckets, "tokens in a step")
        Q = min(T, bucket(max(len(t) for _, t in work), self.token_buckets, "extend"))
        return ShardedPlan(Mode.EXTEND, plans, (B, T, W, Q), _snapshots(live))

    def commit(self, plan: ShardedPlan, tokens: Sequence[Sequence[int]], read_slots=None,
               ) -> tuple[list[tuple[int, int, bool]], list[Request]]:
        """Record that ``plan`` ran; ``tokens[k]`` are shard ``k``'s samples, one per work item
        of its plan (padding after). Returns ``(events, done)`` as ``Scheduler.commit``."""
        events, done = [], []
        for s, p, toks in zip(self.shards, plan.plans, tokens, strict=True):
            if p is not None:
                e, d = s.commit(p, list(toks)[: len(p.work)], read_slots)
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


def _snapshots(plans: Sequence[StepPlan]) -> int | tuple[int, int] | None:
    """The snapshot bucket ``M`` of a sharded step: the largest of its shards' (each already
    a bucket; a pair, part by part), None when no shard takes or restores any."""
    ms = [p.num_snapshots for p in plans if p.num_snapshots is not None]
    if not ms:
        return None
    if isinstance(ms[0], tuple):
        return tuple(max(m[i] for m in ms) for i in range(len(ms[0])))
    return max(ms)
