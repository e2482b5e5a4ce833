"""The core of ``hybridattn.Engine``: ``servecore.engine.EngineCore`` over the plain-Python
scheduler (``hybridattn.engine.scheduler``) and the device runner (``hybridattn.engine._runner``).

It knows requests by the id ``servecore.streams.Streams`` gives them. Each round
(``run_round``):

1. **Admit** waiting requests (FIFO) while a request row and a recurrent-state slot are free
   and the token slots hold their whole life (prompt + ``max_tokens - 1``) on top of what
   running requests reserved; a request that does not fit waits.
2. **Schedule**: an ``EXTEND`` step of prompt chunks (up to ``chunked_prefill_size``
   tokens) with every decoding request riding along, or a ``DECODE`` step of every running
   request; a ``DECODE`` step nothing could join runs ``decode_steps`` steps in one dispatch.
3. **Pad** the plan to its shape buckets and dispatch it (``Runner.launch``).
4. **Commit** its tokens (``hybridattn.engine._commit``), emitting an ``Event`` per token;
   finished requests release their rows and slots, and waiting ones move up.

**Overlapped scheduling** (``overlap``, the default on one device): a step is left on the
device when its round ends. The next round admits what fits in the rows and slots free now,
plans the step that follows from each request's ``computed`` plus what it runs in flight
(``Scheduler.plan(ahead)``) and dispatches it, its decode rows' tokens read on the device from
the step in flight (``runner._follow``: a request that sampled a stop token there is padding
in it); only then does it wait for the earlier step's tokens and commit them. Each request's
tokens are those of synchronous rounds; they reach callers one round later.

A round is a transaction: an exception anywhere in it (a ``KeyboardInterrupt`` included, which
is held until the round has committed) leaves the pools and the bookkeeping in agreement, and
drops no request (``run_round`` emits no error events: every request goes on with the next
round).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from hybridattn import sharding
from hybridattn.config import KimiLinearConfig
from hybridattn.engine._commit import (
    StatsClock,
    decode_run_steps,
    live_part,
    one_step_plans,
    read_logprobs,
    read_output,
)
from hybridattn.engine._runner import Follow, Run, Runner, largest_step_bytes
from hybridattn.engine.buckets import STOP_BUCKETS, StepBuckets, bucket
from hybridattn.engine.options import EngineOptions
from hybridattn.engine.plan import Mode, Request, ShardedPlan, StepPlan
from hybridattn.engine.scheduler import Scheduler, ShardedScheduler
from hybridattn.engine.sizing import MemoryReport, PoolSizes, pool_sizes
from hybridattn.engine.stats import EngineStats
from hybridattn.models import kimi_linear
from hybridattn.serving import ServingState
from servecore.engine import Event
from servecore.errors import InvalidRequest
from servecore.requests import GenerationRequest
from servecore.sampling import default_seeds

__all__ = ["Core", "build_core"]


@contextlib.contextmanager
def _deferred_interrupts():
    """Hold a ``SIGINT`` (Ctrl-C) that arrives inside the block and raise it at the end, so a
    round that has started committing finishes first. Python delivers signals to the main
    thread only, so elsewhere this is a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    except (ValueError, TypeError):  # no signals here (a sub-interpreter, say)
        yield
        return
    if old is None:  # a handler installed outside Python: leave it alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
        old = signal.default_int_handler
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if caught and callable(old):
            old(signal.SIGINT, caught[0])  # Python's default handler raises KeyboardInterrupt
        elif caught and old == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)  # the default action, now that it is back


class Core:
    """The ``EngineCore`` of ``hybridattn.Engine`` (see the module docstring): ``scheduler``
    decides, ``runner`` runs on the device, ``stats`` counts; ``memory`` and the geometry
    attributes are those the ``Engine`` shows.

    >>> from servecore.engine import EngineCore
    >>> issubclass(Core, EngineCore)
    True
    """

    def __init__(self, scheduler: Scheduler | ShardedScheduler, runner: Runner, *,
                 overlap: bool, memory: MemoryReport, capacity: int, shard_capacity: int,
                 buckets: StepBuckets, opts: EngineOptions):
        self.scheduler, self.runner = scheduler, runner
        self.overlap = overlap
        self.memory = memory
        self.capacity, self.shard_capacity = capacity, shard_capacity
        self.buckets = buckets
        self.opts = opts
        self.stats = runner.stats
        self.clock = StatsClock(self.stats)
        # seed=None: each request its own seed, in the order requests arrive (the first
        # call's prompt i gets seed i, as the engine's default seed=0 + i did), wrapping
        # within the int32 seeds the device holds
        self._default_seeds = default_seeds()
        self._emit: Callable[[Event], None] = _nowhere
        # called with each round's plan before it is dispatched (``engine.processes``)
        self.on_plan: Callable[[StepPlan | ShardedPlan | None], None] = _no_check

    # ---------------------------------------------------------------- EngineCore ----

    def check(self, name: str, req: GenerationRequest) -> None:
        """``InvalidRequest`` (naming the prompt ``name``) when ``req`` cannot fit the context
        or a token pool (``servecore.requests.RequestBuilder``'s ``check``): its field is the
        prompt when the prompt alone does not fit, else ``max_tokens``."""
        o, need = self.opts, req.context_len
        if req.logprobs is not None and o.mesh is not None:
            raise InvalidRequest(f"{name}: logprobs={req.logprobs} is not supported by an "
                                 "engine on a mesh (mesh=...): build it on one device, or ask "
                                 "for logprobs=None", field="logprobs", value=req.logprobs)
        limit = min(o.max_context_len, self.shard_capacity)
        if need > limit:
            short = ("max_context_len" if need > o.max_context_len else
                     "the token pool" if o.mesh is None else "a data shard's token pool")
            field, value = (("prompt", len(req.tokens)) if len(req.tokens) > limit
                            else ("max_tokens", req.max_tokens))
            raise InvalidRequest(
                f"{name} of {len(req.tokens)} tokens + max_tokens={req.max_tokens} needs a "
                f"context of {need} tokens, more than {short} holds: this engine has "
                f"max_context_len={o.max_context_len} and {self.shard_capacity} token slots "
                f"(num_token_slots={self.shard_capacity + 1}, the sink included)"
                + ("" if o.mesh is None else f" per data shard (of {o.num_data_shards})")
                + "; shorten the prompt or build the engine with more of both",
                field=field, value=value)

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """Queue ``request`` (checked) as request ``rid``; ``seed=None`` draws the next of the
        engine's own seeds, so unseeded requests sample apart."""
        sampling = request.sampling
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=next(self._default_seeds))
        self.scheduler.add(Request(rid, list(request.tokens), request.max_tokens,
                                   sampling, frozenset(request.stop),
                                   logprobs=request.logprobs))

    def cancel(self, rid: int) -> bool:
        """End request ``rid`` (waiting or running; its rows and slots are released at once);
        whether it was unfinished."""
        with _deferred_interrupts():
            req = self.scheduler.abort(rid)
            if req is not None:
                self.runner.flush_ops(self.scheduler)
            return req is not None

    def has_work(self) -> bool:
        """Whether any request is waiting, running or releasing."""
        s = self.scheduler
        return bool(s.waiting or s.running or s.releasing)

    def run_round(self, emit: Callable[[Event], None]) -> bool:
        """One round (the module docstring), ``emit`` called for each token committed; returns
        whether a step ran or was committed."""
        self._emit = emit
        try:
            with _deferred_interrupts():
                return self._round()
        finally:
            self._emit = _nowhere

    def num_free_slots(self) -> int:
        """Token slots neither held by a request nor by the prefix cache, summed over data
        shards: the host's count (it owns the ids)."""
        return sum(map(len, self.runner.slots))

    def reset_cache(self) -> None:
        """Evict every cached prefix and snapshot no running request holds."""
        with _deferred_interrupts():
            self.scheduler.reset_cache()
            self.runner.flush_ops(self.scheduler)

    def close(self) -> None:
        """Release the device buffers (``Engine.close``): the step in flight is waited for
        and dropped, the pools' arrays (``runner.state``) are deleted and the engine's
        parameters let go of (``runner.state`` and ``runner.params`` become None). The
        scheduler is left as it was: no call follows (``Streams.close``). Idempotent."""
        runner = self.runner
        if runner.state is None:
            return
        with _deferred_interrupts():
            inflight, runner.inflight = runner.inflight, None
            if inflight is not None:
                jax.block_until_ready(inflight.tokens)
            state, runner.state, runner.params = runner.state, None, None
            for leaf in jax.tree.leaves(state):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()

    def reset_stats(self) -> None:
        """Zero the throughput and cache counters and TTFTs; compilation counts and buckets
        stay."""
        self.scheduler.reset_counters()
        s = self.stats
        self.stats = EngineStats(num_compilations=s.num_compilations,
                                 compile_seconds=s.compile_seconds, buckets=s.buckets,
                                 compiled_buckets=s.compiled_buckets,
                                 bucket_compile_seconds=s.bucket_compile_seconds,
                                 shard_prompt_tokens=[0] * len(s.shard_prompt_tokens),
                                 shard_cached_tokens=[0] * len(s.shard_cached_tokens))
        self.runner.stats = self.clock.stats = self.stats

    # -------------------------------------------------------------------- rounds ----

    def _round(self) -> bool:
        """One round; returns whether a step ran or was committed.

        With a run in flight (overlapped scheduling) the round first admits what fits now
        and dispatches the step that follows that run (``_continuation``), then commits the
        run, and ends. Otherwise (nothing in flight, or nothing to follow it) it commits, then
        admits, plans and dispatches; with ``overlap`` the step stays in flight."""
        runner, ran = self.runner, False
        if runner.inflight is not None:
            t_plan = time.perf_counter()
            prev = runner.inflight
            if prev.ready_by is None and prev.tokens.is_ready():
                prev.ready_by = t_plan
            follow = self._continuation()
            nxt = None if follow is None else self._launch(follow[0], t_plan, follow[1])
            runner.inflight = nxt
            self._commit(prev)
            if nxt is not None and all(r.finished for r, _ in nxt.plan.work):
                # every request of it finished in the step before (a stop token): it runs
                # padding only; commit it now rather than leave it for a later round
                runner.inflight = None
                self._commit(nxt)
                nxt = None
            if nxt is not None:
                return True
            ran = True
        self._admit()
        t_plan = time.perf_counter()
        plan = self.scheduler.plan()
        self.on_plan(plan)
        if plan is None:
            return ran
        run = self._launch(plan, t_plan)
        if self.overlap:
            runner.inflight = run
        else:
            self._commit(run)
        return True

    def _launch(self, plan: StepPlan | ShardedPlan, t_plan: float,
                follow: Follow | None = None) -> Run:
        return self.runner.launch(plan, t_plan, self._multi_step_limits(plan, follow), follow)

    def _admit(self) -> None:
        """Admit waiting requests while rows and token slots allow (FIFO), then carry out
        the device ops admission queued (frees of what it evicted) before a step allocates."""
        while (adm := self.scheduler.admit_next()) is not None:
            try:
                row = self.runner.admit_row(adm)
            except BaseException:
                self.scheduler.cancel(adm)
                raise
            self.scheduler.admitted(adm, row)
        self.runner.flush_ops(self.scheduler)

    def _continuation(self) -> tuple[StepPlan, Follow] | None:
        """The step that can follow the run in flight before its tokens are known, and how
        that run's output feeds it; None when there is nothing to run without them.

        Requests waiting are admitted first, into the rows and token slots free now (those
        that the run in flight frees come with the next round). Each running request is
        planned from ``computed`` + the tokens it runs in flight (``Scheduler.plan(ahead)``):
        its prompt's next chunk, or one decode token that, when the run in flight samples
        it, comes from that run's output on the device (``runner._follow``). A request that
        reaches ``max_tokens`` in flight is left out; one that samples a stop token there is
        padding on the device and skipped at this step's commit."""
        run, sched = self.runner.inflight, self.scheduler
        plan = run.plan
        ahead, samples, fed, leaving = {}, {}, {}, []
        for j, (r, toks) in enumerate(plan.work):
            if r.finished:  # aborted since the run was dispatched
                continue
            k = run.limits[j] if run.limits is not None else len(toks)
            ahead[r] = k
            if r.computed + k < len(r.prompt):  # still prefilling after it: no token kept
                continue
            samples[r] = k if r.computed >= len(r.prompt) else 1  # tokens it samples there
            fed[r] = (j, k - 1 if run.limits is not None else 0)
            if len(r.output) + samples[r] >= r.max_tokens:
                leaving.append(r)
        self._admit()
        nxt = sched.plan(ahead, leaving)
        if nxt is None:
            return None
        rows = [r for r, _ in nxt.work if r in fed]
        if rows and max(len(r.stop_token_ids) for r in rows) > STOP_BUCKETS[-1]:
            return None  # more stop ids than the device checks: wait for the tokens
        cols, last = zip(*(fed.get(r, (-1, 0)) for r, _ in nxt.work), strict=True)
        return nxt, Follow(cols, last, tuple(rows), samples, len(leaving))

    def _multi_step_limits(self, plan: StepPlan | ShardedPlan,
                           follow: Follow | None = None) -> list[int] | None:
        """The steps each request of ``plan`` may run in one multi-step decode dispatch
        (None: this round runs one step). Only a pure ``DECODE`` plan on one device, and only
        when nothing could join before the run ends: no request waits, or none running can
        reach its ``max_tokens`` before the run's last step (the head of the queue waits
        for a row or token slots that only a finish frees), and none of its requests wants
        log-probabilities (one step returns them). Each request runs at most its
        tokens left and what the plan's attention-width bucket has room for, counting, for a
        plan that follows a run in flight (``follow``), the tokens it runs there
        (``plan.ahead``) and samples there; a request leaving in flight (its row frees when
        that run is committed) counts as finishing before the run's last step."""
        N = self.runner.decode_steps
        if N == 1 or self.runner.sharded is not None or plan.mode != Mode.DECODE:
            return None
        if any(r.logprobs is not None for r, _ in plan.work):
            return None  # the multi-step decode returns no log-probabilities
        ahead = plan.ahead or (0,) * len(plan.work)
        samples = follow.samples if follow is not None else {}
        left = [r.max_tokens - len(r.output) - samples.get(r, 0) for r, _ in plan.work]
        leaving = follow is not None and follow.leaving > 0
        if self.scheduler.waiting and (leaving or min(left) < N):
            return None
        if max(len(r.stop_token_ids) for r, _ in plan.work) > STOP_BUCKETS[-1]:
            return None
        W = plan.buckets[2]
        limits = [min(N, k, W - r.computed - a)
                  for (r, _), k, a in zip(plan.work, left, ahead, strict=True)]
        return limits if max(limits) > 1 else None


    def _commit(self, run: Run) -> None:
        """Wait for ``run``'s tokens and commit them (one step, or a multi-step decode step by
        step), emitting each; then carry out the device ops it queued (releases). Requests
        that finished since it was dispatched (aborted, or stopped in the run before it) are
        skipped."""
        t_wait = time.perf_counter()
        tokens, now = read_output(run)
        logprobs = read_logprobs(run)  # by request (one step only: no multi-step decode)
        self.runner.check_rows()
        sched, read = self.scheduler, self.runner.read_slots
        # -- commit: plain Python from here on --
        plan, tokens, limits = live_part(run.plan, tokens, run.limits)
        if limits is None:
            steps = [(plan, tokens.tolist())] if plan.work else []
        else:  # checked before anything is recorded
            steps = decode_run_steps(plan, tokens, limits)
        start, ready = self.clock.run_window(run, now)
        if not plan.work:  # all its requests had finished: it ran padding, nothing to count
            self.runner.flush_ops(sched)
            return
        decoded = plan.num_tokens if limits is None else sum(len(t) for _, t in steps)
        prefill = self.clock.steps(run, plan, len(steps), decoded, start, ready)
        first = [r for r, toks in plan.work if r.computed + len(toks) == len(r.prompt)]
        events, done = [], []
        if limits is None:
            if steps:
                events, done = sched.commit(plan, steps[0][1], read)
        else:
            for sub, toks in one_step_plans(plan, steps):  # each step as it ran alone
                ev, dn = sched.commit(sub, toks, read)
                events += ev
                done += dn
        self.runner.finished(done)
        self.clock.first_tokens(first, ready)
        s = self.stats
        s.snapshots_taken, s.state_evictions, s.token_evictions = sched.counters()
        cached = {r.rid: r.start for r in first}  # the first token says what the cache served
        for rid, token, finished in events:
            self._emit(Event(rid, token, finished, cached=cached.pop(rid, None),
                             logprobs=logprobs.get(rid)))
        # the commit is hidden while the next run computes (if it is still computing)
        nxt = self.runner.inflight
        self.clock.host_time(run, prefill, t_wait, now,
                             nxt is not None and not nxt.tokens.is_ready())
        self.runner.flush_ops(sched)


def _no_check(plan: StepPlan | ShardedPlan | None) -> None:
    """``Core.on_plan`` of an engine on one process: nothing to check."""


def _nowhere(event: Event) -> None:
    raise RuntimeError(f"a token ({event}) was committed outside a round")


def build_core(config: KimiLinearConfig, params: Any, opts: EngineOptions) -> Core:
    """The core of an engine of ``config`` and ``params`` (checked by the caller) with the
    resolved options ``opts``: the parameters in the engine's layout, the pools sized
    (``sizing.pool_sizes``) and created, the step buckets, the scheduler and the runner.
    ``servecore.streams.Streams`` serves it (``hybridattn.Engine`` does just that):

    >>> from hybridattn.models import kimi_linear
    >>> from servecore.requests import RequestBuilder
    >>> from servecore.streams import Streams
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> opts = EngineOptions(max_running_requests=2, max_context_len=16,
    ...                      num_token_slots=33).resolved(cfg)
    >>> core = build_core(cfg, kimi_linear.init_params(cfg, jax.random.key(0)), opts)
    >>> core.capacity, core.has_work()
    (32, False)
    >>> streams = Streams(core, RequestBuilder(vocab_size=64, check=core.check))
    >>> [len(out) for out in streams.generate([[1, 2, 3]], 2)]
    [2]
    """
    mesh, D = opts.mesh, opts.num_data_shards
    if opts.scan_layers:
        params = kimi_linear.stack_layers(params, config)
    if mesh is None:  # (kimi_linear.PARAM_RULES name the checkpoint's leaves)
        params = kimi_linear.serving_layout(params)
    sharded = None
    if mesh is not None:
        params = sharding.shard_params(params, config, mesh)  # a no-op if placed
        sharded = sharding.ShardedStep(  # this engine's own
            config, mesh, scan_layers=isinstance(params["model"]["layers"],
                                                 kimi_linear.STACKED))
    sizes, buckets, working = _sized(config, params, opts, sharded)
    state = ServingState.create(config, num_token_slots=sizes.num_token_slots,
                                num_snapshot_slots=sizes.num_snapshot_slots,
                                max_running_requests=sizes.rows, mesh=mesh,
                                max_context_len=opts.max_context_len, dtype=opts.dtype,
                                chunk_size=opts.chunk_size, seed=opts.seed)
    memory = dataclasses.replace(
        sizes.unit, budget_bytes=sizes.budget_bytes, max_running_requests=sizes.rows,
        num_token_slots=sizes.num_token_slots, num_snapshot_slots=sizes.num_snapshot_slots,
        pool_bytes=sum(x.nbytes for x in jax.tree.leaves(state)), working_bytes=working,
        req_to_token_bytes=sum(x.nbytes for x in jax.tree.leaves(state.req_to_token_pool)))
    R = sizes.rows // D  # rows of one data shard (its batch's requests)
    common = dict(max_running_requests=R, chunked_prefill_size=opts.chunked_prefill_size,
                  request_buckets=buckets.request, token_buckets=buckets.token,
                  kv_buckets=buckets.kv, chunk_size=opts.chunk_size)
    if mesh is None:
        scheduler = Scheduler(capacity=D * sizes.shard_capacity,
                              num_snapshot_slots=sizes.num_snapshot_slots,
                              snapshot_interval=opts.snapshot_interval,
                              snapshot_buckets=buckets.snapshot, **common)
    else:
        scheduler = ShardedScheduler(D, capacity=sizes.shard_capacity,
                                     num_snapshot_slots=sizes.num_snapshot_slots // D,
                                     snapshot_interval=opts.snapshot_interval,
                                     snapshot_buckets=buckets.snapshot, **common)
    runner = Runner(config, params, state, max_context_len=opts.max_context_len,
                    max_running_requests=sizes.rows, num_data_shards=D,
                    request_buckets=buckets.request, kv_buckets=buckets.kv,
                    chunk_size=opts.chunk_size, decode_steps=opts.decode_steps,
                    prefix_cache=sizes.num_snapshot_slots > 0,
                    stats=EngineStats(shard_prompt_tokens=[0] * D if mesh is not None else [],
                                      shard_cached_tokens=[0] * D if mesh is not None else []),
                    sharded=sharded, shard_token_slots=sizes.shard_capacity + 1,
                    memory=memory)
    return Core(scheduler, runner, overlap=opts.overlap, memory=memory,
                capacity=D * sizes.shard_capacity, shard_capacity=sizes.shard_capacity,
                buckets=buckets, opts=opts)


def _buckets(opts: EngineOptions, rows: int) -> StepBuckets:
    """The step buckets of an engine whose data shards have ``rows`` request rows each."""
    return StepBuckets.of(
        rows=rows, chunked_prefill_size=opts.chunked_prefill_size,
        max_context_len=opts.max_context_len, snapshot_interval=opts.snapshot_interval,
        request=opts.request_buckets, token=opts.token_buckets, kv=opts.kv_buckets,
        snapshot=opts.snapshot_buckets, sharded=opts.mesh is not None)


# The share of the budget above which pools and parameters leave too little room to take
# the steps' working memory on trust: the automatic sizer then compiles the largest step
# first (about 10 s cold for a serving-sized model) and reserves what it needs.
RESERVE_ABOVE = 0.5


def _sized(config: KimiLinearConfig, params: Any, opts: EngineOptions,
           sharded: sharding.ShardedStep | None) -> tuple[PoolSizes, StepBuckets, int]:
    """The pools (``sizing.pool_sizes``: bytes per token and per request read from the
    pools' own layout) and step buckets of an engine, and the step working memory reserved.
    With the token pool sized automatically and the pools and parameters taking more than
    ``RESERVE_ABOVE`` of the budget, the largest prefill step is compiled first on the
    shapes of the pools it would get (``runner.largest_step_bytes``; the engine reuses that
    compilation when it runs that step) and its temporaries come out of the budget. Below
    that the rest of the budget is the reserve, and the working memory is measured as the
    steps compile, as it is for a pool of a given size."""
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    D, L = opts.num_data_shards, opts.max_context_len
    sizes = pool_sizes(opts, config, param_bytes)
    buckets = _buckets(opts, sizes.rows // D)
    if opts.num_token_slots is not None:  # the user sized the pool: nothing to reserve
        return sizes, buckets, 0
    state = jax.eval_shape(lambda: ServingState.create(
        config, num_token_slots=sizes.num_token_slots, max_context_len=L,
        num_snapshot_slots=sizes.num_snapshot_slots, max_running_requests=sizes.rows,
        mesh=opts.mesh, dtype=opts.dtype, chunk_size=opts.chunk_size, seed=opts.seed))
    pools = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    if pools + param_bytes <= RESERVE_ABOVE * sizes.budget_bytes:
        return sizes, buckets, 0
    T = buckets.token[-1]
    M = buckets.snapshot[-1] if sizes.num_snapshot_slots else None
    working = largest_step_bytes(
        config, params, state, sharded, max_context_len=L, num_requests=buckets.request[-1],
        num_tokens=T, kv_width=buckets.kv[-1], snapshot_chunk=opts.chunk_size,
        max_extend_len=min(T, bucket(min(opts.chunked_prefill_size, L), buckets.token,
                                     "extend")),
        num_snapshots=None if M is None else (M, M))
    final = pool_sizes(opts, config, param_bytes, working_bytes=working)
    return final, (buckets if final.rows == sizes.rows else _buckets(opts, final.rows // D)), \
        working
