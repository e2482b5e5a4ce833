"""The device side of ``hybridattn.Engine``: its jitted calls, how a plan is packed and
dispatched, the device ops carried out, and what a run hands back.

``Runner`` owns the ``ServingState`` and the engine's own jitted functions (``_Compiled``:
the step with its state donated, the multi-step decode, row allocation, release, prefix
borrowing, slot frees, ``_follow``), or under a mesh the engine's ``sharding.ShardedStep``.
``launch`` packs a ``StepPlan`` to its buckets and dispatches it, returning a ``Run`` whose
outputs are still on the device; ``hybridattn.engine._commit`` reads and commits them. The
runner owns the request rows and token slots (``servecore.ids.IdPool``; under a mesh each
data shard's local ids): it names them to the device, which claims them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import sharding
from hybridattn.backends import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.engine.buckets import LOGPROB_BUCKETS, STOP_BUCKETS, bucket
from hybridattn.engine.plan import (
    Admission,
    Borrow,
    FreeSlots,
    Release,
    Request,
    ShardedPlan,
    StepPlan,
)
from hybridattn.engine.sizing import MemoryReport, step_working_bytes
from hybridattn.engine.stats import EngineStats
from hybridattn.pools import claim_reqs, free
from hybridattn.serving import (
    ServingState,
    WorkItem,
    borrow_prefix,
    decode_steps,
    make_worker_batch,
    release,
    step,
    token_logprobs,
)
from hybridattn.serving.decode import padding_unless
from servecore.ids import IdPool

__all__ = ["Follow", "Run", "Runner", "largest_step_bytes", "logprob_width", "work_items"]


def work_items(plan: StepPlan, slots: Sequence[Sequence[int]] | None = None,
               ) -> list[WorkItem]:
    """A plan's work as the device's ``WorkItem``\\ s (for ``make_worker_batch``): each
    request's row, the position it runs from (``computed``, plus what it runs in a step still
    in flight), its tokens, sampling, snapshot to restore and snapshots to take, and with
    ``slots`` the token slots named for its tokens.

    >>> from hybridattn.engine.plan import Mode
    >>> r = Request(0, [5, 6], 2, row=1)
    >>> [it[:3] for it in work_items(StepPlan(Mode.EXTEND, ((r, [5, 6]),), (1, 2, 64, 2)))]
    [(1, 0, [5, 6])]
    """
    out = []
    for i, (r, toks) in enumerate(plan.work):
        restore = plan.restores[i] if plan.restores else 0
        snaps = plan.snapshots[i] if plan.snapshots else ()
        at = r.computed + (plan.ahead[i] if plan.ahead else 0)
        out.append(WorkItem(r.row, at, toks, r.sampling, restore, snaps,
                            () if slots is None else slots[i]))
    return out


def shard_items(plan: ShardedPlan, slots: Sequence | None = None) -> list[list[WorkItem]]:
    """Each data shard's work as ``WorkItem``\\ s (local rows; with ``slots``, shard ``k``'s
    named token slots ``slots[k]``), for ``ShardedStep.make_batch``."""
    return [[] if p is None else work_items(p, None if slots is None else slots[k])
            for k, p in enumerate(plan.plans)]


def _admit_with_prefix(state: ServingState, rows, lens, slots, computed):
    """The row the host named for one request that borrows a cached prefix: claim it, point
    its first ``lens`` positions at ``slots`` and record ``computed`` tokens of state."""
    pool, ok = claim_reqs(state.req_to_token_pool, rows)
    state = borrow_prefix(state.replace(req_to_token_pool=pool), rows, lens, slots, computed)
    return state, ok


def _step_tokens(params, state: ServingState, batch):
    """``serving.step`` without the logits (the engine samples on the device and never reads
    them, so the compiled step does not return a ``[B, V]`` array it would have to keep)."""
    new, out = step(params, state, batch)
    return new, out._replace(logits=None)


def _step_logprobs(params, state: ServingState, batch, *, k: int):
    """``_step_tokens`` that also returns each row's log-probabilities
    (``serving.token_logprobs`` of its logits: ``[B]`` of the sampled token, ``[B, k]`` top
    ids and values), for a plan with a request that asked for them (``k`` bound: one jitted
    function per ``LOGPROB_BUCKETS`` width)."""
    new, out = step(params, state, batch)
    return new, out._replace(logits=None), token_logprobs(out.logits, out.next_token_ids, k)


def logprob_width(plan: StepPlan | ShardedPlan) -> int | None:
    """The top-``k`` width a step of ``plan`` returns log-probabilities for: the largest
    ``logprobs`` of its requests (at least 1) in ``LOGPROB_BUCKETS``; None when none asks
    (the plain step, which returns none).

    >>> from hybridattn.engine.plan import Mode
    >>> a, b = Request(0, [5], 2, row=1, logprobs=2), Request(1, [6], 2, row=2)
    >>> logprob_width(StepPlan(Mode.EXTEND, ((a, [5]), (b, [6])), (2, 2, 64, 1)))
    20
    >>> logprob_width(StepPlan(Mode.EXTEND, ((b, [6]),), (1, 1, 64, 1))) is None
    True
    """
    if not isinstance(plan, StepPlan):
        return None  # (refused at submission under a mesh)
    ks = [r.logprobs for r, _ in plan.work if r.logprobs is not None]
    return bucket(max(ks + [1]), LOGPROB_BUCKETS, "logprobs") if ks else None


def largest_step_bytes(config: KimiLinearConfig, params: Any, state: Any,
                       sharded: sharding.ShardedStep | None, **shape) -> int:
    """XLA's temporaries of the engine's step (one prompt token in row 1, padded to the
    buckets ``shape`` names, as ``Runner.packed`` packs it) over pools shaped like ``state``
    (``ShapeDtypeStruct``\\ s will do): what the automatic sizer reserves for the largest
    prefill step (``sizing.step_working_bytes``), before any pool exists.

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = jax.eval_shape(lambda: ServingState.create(
    ...     cfg, max_running_requests=1, max_context_len=16, num_token_slots=17))
    >>> params = kimi_linear.serving_layout(kimi_linear.init_params(cfg, jax.random.key(0)))
    >>> largest_step_bytes(cfg, params, state, None, max_context_len=16, num_requests=1,
    ...                    num_tokens=16, kv_width=16, max_extend_len=16) > 0
    True
    """
    shape = dict(shape, vocab_size=config.vocab_size, forward_mode=ForwardMode.EXTEND)
    item = [WorkItem(1, 0, [0])]
    if sharded is None:
        return step_working_bytes(jax.jit(_step_tokens, donate_argnums=1), params, state,
                                  make_worker_batch(item, **shape))
    items = [item] + [[] for _ in range(sharded.data - 1)]
    return step_working_bytes(sharded, params, sharded.abstract(state),
                              sharded.make_batch(items, **shape))


def _decode_tokens(params, state: ServingState, batch, stop_token_ids, max_tokens, slots, *,
                   num_steps: int):
    """``serving.decode_steps`` with ``num_steps`` bound (one jitted function per count) and
    the host's token ``slots [num_steps, B]``."""
    return decode_steps(params, state, batch, num_steps, stop_token_ids, max_tokens,
                        slots=slots)


def _follow(batch, prev_tokens, cols, last, stop_token_ids):
    """The batch of a run dispatched while the run before it is still on the device
    (overlapped scheduling), with the tokens that run sampled: row ``b`` with ``cols[b] >= 0``
    feeds ``prev_tokens[last[b], cols[b]]``, the last token its request sampled there
    (``prev_tokens`` is a multi-step run's ``[N, B']`` or a single step's ``[B']``); the other
    rows keep theirs (prompt chunks, padding). A fed row whose token is -1 or one of its
    ``stop_token_ids`` finished inside that run and becomes padding: no token slot, nothing
    written; in an ``EXTEND`` batch the tokens after it move up one place, as if it had not
    been planned (its row index, and so any snapshot entry of another row, stays)."""
    prev = prev_tokens.reshape(-1, prev_tokens.shape[-1])
    fed = cols >= 0
    tok = prev[last, jnp.maximum(cols, 0)]
    dead = fed & ((tok < 0) | jnp.any(tok[:, None] == stop_token_ids, axis=1))
    keep = (batch.req_pool_indices > 0) & ~dead
    if batch.forward_mode == ForwardMode.DECODE:  # one token per row, at the row's index
        ids = jnp.where(fed, tok, batch.input_ids)
        return padding_unless(batch.replace(input_ids=ids), keep)
    ext = batch.extend_seq_lens
    T = batch.input_ids.shape[0]
    start = jnp.cumsum(ext) - ext  # each row's first token
    ids = batch.input_ids.at[jnp.where(fed, start, T)].set(tok, mode="drop")
    new_ext = jnp.where(keep, ext, 0)
    end = jnp.cumsum(new_ext)
    t = jnp.arange(T)
    row = jnp.minimum(jnp.searchsorted(end, t, side="right"), ext.shape[0] - 1)
    src = start[row] + t - (end - new_ext)[row]
    ids = jnp.where(t < end[-1], ids[jnp.clip(src, 0, T - 1)], 0)
    zero = jnp.zeros_like(batch.req_pool_indices)
    loc = batch.out_cache_loc  # the host's slots move with their tokens
    if loc is not None:
        loc = jnp.where(t < end[-1], loc[jnp.clip(src, 0, T - 1)], 0).astype(jnp.int32)
    return batch.replace(input_ids=ids.astype(jnp.int32),
                         req_pool_indices=jnp.where(keep, batch.req_pool_indices, zero),
                         seq_lens=jnp.where(keep, batch.seq_lens, 0).astype(jnp.int32),
                         extend_seq_lens=new_ext.astype(jnp.int32), out_cache_loc=loc)



def _claim_row(pool, rows):
    return claim_reqs(pool, rows)


def _free_tokens(state: ServingState, slots):
    return state.replace(token_allocator=free(state.token_allocator, slots))


def _signature(args, kwargs) -> tuple:
    """What a jitted function compiles for: the arguments' tree (static fields included) and
    every leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves)


class _Compiled:
    """One engine's own jitted functions (the step with its state donated, row allocation,
    release, prefix borrowing, slot frees), built when the engine is, and ``count``, the
    compilations this engine has needed: the distinct argument signatures (shape buckets) it
    has called them with. Nothing here is module-level, so two engines keep apart counts;
    within one engine a shape bucket is prepared once. (JAX itself keys its in-process and
    on-disk caches on the function and the shapes, so a second engine of the same geometry
    gets the executable of the first without tracing the model again; each engine still
    counts every bucket it needed.)

    >>> c = _Compiled()
    >>> c.count, c.step is _Compiled().step
    (0, False)
    >>> pool = ServingState.create(KimiLinearConfig.tiny(
    ...     num_hidden_layers=2, hidden_size=32, vocab_size=64), max_running_requests=1,
    ...     max_context_len=4, num_token_slots=5).req_to_token_pool
    >>> bool(c.call(c.claim_row, pool, jnp.array([1]))[1]), c.count
    (True, 1)
    """

    def __init__(self):
        self.count = 0
        self._seen: set = set()
        self._head, self._head_sig = None, None  # the last dict first argument, its signature
        self.step = jax.jit(_step_tokens, donate_argnums=1)
        self.release = jax.jit(release, donate_argnums=0)
        self.claim_row = jax.jit(_claim_row)
        self.admit = jax.jit(_admit_with_prefix, donate_argnums=0)
        self.borrow = jax.jit(borrow_prefix, donate_argnums=0)
        self.free_tokens = jax.jit(_free_tokens, donate_argnums=0)
        self.follow = jax.jit(_follow)
        self._decode: dict[int, Any] = {}
        self._logprobs: dict[int, Any] = {}

    def decode(self, num_steps: int):
        """The jitted ``num_steps``-step decode (state donated), one function per count."""
        if num_steps not in self._decode:
            self._decode[num_steps] = jax.jit(
                functools.partial(_decode_tokens, num_steps=num_steps), donate_argnums=1)
        return self._decode[num_steps]

    def step_logprobs(self, k: int):
        """The jitted step that also returns log-probabilities with ``k`` top tokens (state
        donated), one function per width."""
        if k not in self._logprobs:
            self._logprobs[k] = jax.jit(functools.partial(_step_logprobs, k=k),
                                        donate_argnums=1)
        return self._logprobs[k]

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, counting a signature this engine has not used before. A
        first argument that is a dict (the parameters) keeps its signature while it is the
        same object: reading every parameter's shape took 0.3 of the 1.6 ms a multi-step
        decode's call spent on the host (``bench.serve_config()``, B = 8)."""
        head = args[0] if args else None
        if isinstance(head, dict):
            if head is not self._head:
                self._head, self._head_sig = head, _signature(args[:1], {})
            key = (fn, self._head_sig, _signature(args[1:], kwargs))
        else:
            key = (fn, _signature(args, kwargs))
        out = fn(*args, **kwargs)
        if key not in self._seen:
            self._seen.add(key)
            self.count += 1
        return out



@dataclasses.dataclass(frozen=True)
class Follow:
    """How a step dispatched before the run in flight is committed takes that run's output:
    per work item the column and the step of the run's tokens that feed it (-1: none, its
    token is the host's), the requests so fed, and the tokens each request samples in the
    run in flight (for the core's ``_multi_step_limits``).

    >>> Follow(cols=(0, -1), last=(0, 0), fed=(), samples={}).cols
    (0, -1)
    """

    cols: tuple[int, ...]
    last: tuple[int, ...]
    fed: tuple[Request, ...]
    samples: dict
    leaving: int = 0  # requests that reach max_tokens in flight (their rows free then)


@dataclasses.dataclass
class Run:
    """A step (or multi-step decode) on the device whose tokens the host has not committed:
    its plan and step limits (None: one step), its outputs (device arrays), its bucket key,
    whether dispatching it compiled, when its round began planning it (``t_plan``), packing
    it (``t_pack``) and when the dispatch returned (``t_call``), and of the host seconds
    before that, ``exposed``: those during which the device had nothing queued; ``fed``: the
    requests whose tokens came from the run before it; ``ready_by``: a time a later round
    found its outputs ready (its stats then end there, not at the commit); ``logprobs``: the
    step's log-probabilities (``_step_logprobs``) when a request of it asked for them.

    >>> from hybridattn.engine.plan import Mode
    >>> plan = StepPlan(Mode.EXTEND, ((Request(0, [5, 6], 4, row=1), [5, 6]),), (1, 2, 64, 2))
    >>> run = Run(plan, None, np.array([7]), np.array(True), np.array([3, 4]), (1, 1, 2, 64, 2),
    ...           False, 0.0, 0.0, 0.0, 0.0)
    >>> run.limits is None  # one step
    True
    """

    plan: StepPlan | ShardedPlan
    limits: list[int] | None
    tokens: Any
    ok: Any
    slots: Any  # per work item the token slots the host named (a list; () under a mesh)
    key: tuple
    compiled: bool
    t_plan: float
    t_pack: float
    t_call: float
    exposed: float
    fed: tuple = ()  # requests whose token came from the run before it (Follow.fed)
    ready_by: float | None = None  # a time its outputs were found ready (before the commit)
    logprobs: Any = None  # (token [B], top ids [B, K], top values [B, K]) if a request asked



class Runner:
    """One engine's device side: the pools (``state``), the parameters, the jitted calls and
    the run in flight (see the module docstring). It owns the request rows (``rows``) and
    token slots (``slots``): one ``servecore.ids.IdPool`` of each per data shard. The
    device claims what the host names, and ``check_rows`` reads the row claims' flags at the
    next commit.

    ``stats`` is the engine's ``EngineStats``: ``call`` adds the compilations it needed.

    >>> import jax
    >>> from hybridattn.engine._core import build_core
    >>> from hybridattn.engine.options import EngineOptions
    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> opts = EngineOptions(max_running_requests=2, max_context_len=16,
    ...                      num_token_slots=33).resolved(cfg)
    >>> runner = build_core(cfg, kimi_linear.init_params(cfg, jax.random.key(0)), opts).runner
    >>> runner.compilations(), len(runner.rows[0]), len(runner.slots[0]), runner.inflight is None
    (0, 2, 32, True)
    """

    def __init__(self, config: KimiLinearConfig, params: Any, state: ServingState, *,
                 max_context_len: int, max_running_requests: int, num_data_shards: int,
                 request_buckets: Sequence[int], kv_buckets: Sequence[int],
                 chunk_size: int | None, decode_steps: int, prefix_cache: bool,
                 stats: EngineStats, sharded: sharding.ShardedStep | None = None,
                 shard_token_slots: int | None = None, memory: MemoryReport | None = None):
        self.config, self.params, self.state = config, params, state
        self.memory = memory  # its working_bytes grows to cover every step compiled
        self.max_context_len = max_context_len
        self.max_running_requests = max_running_requests
        self.num_data_shards = num_data_shards
        self.request_buckets, self.kv_buckets = tuple(request_buckets), tuple(kv_buckets)
        self.chunk_size, self.decode_steps = chunk_size, decode_steps
        self.prefix_cache = prefix_cache
        self.stats = stats
        self.jit = _Compiled()  # this engine's own compilations
        self.sharded = sharded  # under a mesh: this engine's own ShardedStep
        self.inflight: Run | None = None  # a step not committed yet (overlap)
        # the ids the host owns, per data shard (local ids; one shard on one device)
        D, S = num_data_shards, shard_token_slots or state.token_allocator.num_slots
        self.rows = [IdPool(max_running_requests // D + 1, "request row") for _ in range(D)]
        self.slots = [IdPool(S, "token slot") for _ in range(D)]
        self._row_checks: list = []  # (row, ok) of row claims not checked yet

    def compilations(self) -> int:
        """Compilations this engine has needed so far (``_Compiled.count``, or the traces of
        its ``ShardedStep`` under a mesh)."""
        return self.jit.count + (0 if self.sharded is None else self.sharded.trace_count)

    def call(self, fn, *args, **kwargs):
        """Run one of this engine's jitted functions, counting a compilation it needed."""
        before = self.compilations()
        if self.sharded is None:
            out = self.jit.call(fn, *args, **kwargs)
        else:  # the ShardedStep's own functions: they count their traces
            out = fn(*args, **kwargs)
        self.stats.num_compilations += self.compilations() - before
        return out

    def packed(self, plan: StepPlan | ShardedPlan, slots=None) -> tuple[Any, Any]:
        """The jitted step that runs ``plan`` and its batch (with ``slots``, the token slots
        named per work item; under a mesh per shard), packed on the host to the plan's
        buckets: ``self.call(fn, self.params, self.state, batch)`` runs it."""
        B, T, W, Q = plan.buckets
        shape = dict(vocab_size=self.config.vocab_size, max_context_len=self.max_context_len,
                     forward_mode=ForwardMode(plan.mode), num_requests=B, num_tokens=T, kv_width=W,
                     max_extend_len=Q, num_snapshots=plan.num_snapshots,
                     snapshot_chunk=self.chunk_size)
        if self.sharded is None:
            return self.jit.step, make_worker_batch(work_items(plan, slots), **shape)
        # one work list per data shard, one step for all of them
        return self.sharded, self.sharded.make_batch(shard_items(plan, slots), **shape)

    def stop_ids(self, plan: StepPlan, only: Collection[Request] | None = None) -> np.ndarray:
        """Each work item's stop ids ``[B, S]`` (with ``only``, those requests' alone),
        padded with -1 (``S`` from ``STOP_BUCKETS``)."""
        which = [(i, r) for i, (r, _) in enumerate(plan.work) if only is None or r in only]
        S = bucket(max([1, *(len(r.stop_token_ids) for _, r in which)]), STOP_BUCKETS,
                   "stop token ids of a request")
        stops = np.full((plan.buckets[0], S), -1, np.int32)
        for i, r in which:
            stops[i, : len(r.stop_token_ids)] = sorted(r.stop_token_ids)
        return stops

    def packed_decode(self, plan: StepPlan, limits: Sequence[int],
                      slots: Sequence[Sequence[int]]) -> tuple[Any, tuple]:
        """The jitted multi-step decode and its arguments after the state: the DECODE batch,
        each row's stop ids ``[B, S]`` (``_stop_ids``), its step limit ``[B]`` (0 for
        padding rows) and the token slots named for its steps (``slots[j]`` for work item
        ``j``, as ``[N, B]``)."""
        B, T, W, Q = plan.buckets
        batch = make_worker_batch(work_items(plan), vocab_size=self.config.vocab_size,
                                  max_context_len=self.max_context_len,
                                  forward_mode=ForwardMode.DECODE, num_requests=B,
                                  num_tokens=T, kv_width=W, max_extend_len=Q)
        lim = np.zeros(B, np.int32)
        lim[: len(limits)] = limits
        named = np.zeros((self.decode_steps, B), np.int32)
        for j, ss in enumerate(slots):
            named[: len(ss), j] = ss
        return self.jit.decode(self.decode_steps), (batch, jnp.asarray(self.stop_ids(plan)),
                                                     jnp.asarray(lim), jnp.asarray(named))

    def launch(self, plan: StepPlan | ShardedPlan, t_plan: float, limits: list[int] | None,
               follow: Follow | None = None) -> Run:
        """Pack and dispatch ``plan`` (planned from ``t_plan`` on): one step, or with
        ``limits`` (each request's steps) a multi-step decode (``decode_steps``); returns the
        run, its outputs still on the device. With ``follow`` (the core's ``_continuation``)
        the rows it names take their tokens from the output of the run in flight."""
        width = None if limits is not None else logprob_width(plan)
        key = (int(plan.mode), *plan.buckets) + (() if plan.num_snapshots is None else (
            plan.num_snapshots,)) + (() if limits is None else (self.decode_steps,))
        traces = self.compilations()
        t_pack = time.perf_counter()
        if self.sharded is None:
            named = self.name_slots(plan, limits)
            flat = named
        else:  # each shard names its own (local) slots
            named = [[] if p is None else self.name_slots(p, None, k)
                     for k, p in enumerate(plan.plans)]
            flat = [ss for per in named for ss in per]  # plan.work's order: shard by shard
        try:
            run = self._dispatch(plan, limits, follow, named, width)
        except BaseException:  # nothing was dispatched: the slots are free again
            for (r, _), ss in zip(plan.work, flat, strict=True):
                self.slots[r.shard].give(s for s in ss if s)
            raise
        for (r, _), ss in zip(plan.work, flat, strict=True):
            r.row_slots.extend(s for s in ss if s)  # (0: a position the row holds)
        tokens, ok, prev, logprobs = run
        t_call = time.perf_counter()  # dispatched: the host side is done until the outputs
        # the device had nothing queued while this run was planned, unless the run before
        # it was still computing when it was dispatched
        busy = prev is not None and not prev.tokens.is_ready()
        return Run(plan, limits, tokens, ok, flat, key, self.compilations() > traces,
                   t_plan, t_pack, t_call, 0.0 if busy else t_call - t_plan,
                   follow.fed if follow is not None else (), logprobs=logprobs)

    def name_slots(self, plan: StepPlan, limits: list[int] | None,
                   shard: int = 0) -> list[list[int]]:
        """The token slots a run of ``plan`` writes, per work item, taken from ``shard``'s
        ``slots``: one per token at a position past what the row holds
        (``Request.row_slots``; a position the row borrows gets 0), or with ``limits`` one
        per step it may run."""
        need = []
        for j, (r, toks) in enumerate(plan.work):
            if limits is not None:
                need.append((0, limits[j]))
                continue
            at = r.computed + (plan.ahead[j] if plan.ahead else 0)
            held = min(max(len(r.row_slots) - at, 0), len(toks))  # borrowed positions
            need.append((held, len(toks) - held))
        taken = self.slots[shard].claim(sum(n for _, n in need))
        named, i = [], 0
        for held, n in need:
            named.append([0] * held + taken[i: i + n])
            i += n
        return named

    def _dispatch(self, plan, limits, follow, named, width=None):
        """Pack and dispatch (``launch``): ``(tokens, ok, run before, logprobs)``, on the
        device; with ``width`` (``logprob_width``) the step that returns log-probabilities."""
        logprobs = None
        if limits is None:
            fn, batch = self.packed(plan, named)
            if width is not None:
                fn = self.jit.step_logprobs(width)
            rest = ()
        else:
            fn, (batch, *rest) = self.packed_decode(plan, limits, named)
        prev = self.inflight if follow is not None else None
        if follow is not None and follow.fed:
            B = plan.buckets[0]
            cols, last = np.full(B, -1, np.int32), np.zeros(B, np.int32)
            cols[: len(follow.cols)], last[: len(follow.last)] = follow.cols, follow.last
            stops = rest[0] if rest else jnp.asarray(self.stop_ids(plan, follow.fed))
            batch = self.call(self.jit.follow, batch, prev.tokens, jnp.asarray(cols),
                               jnp.asarray(last), stops)
        before = self.compilations()
        if limits is None and width is not None:
            self.state, out, logprobs = self.call(fn, self.params, self.state, batch)
            tokens, ok = out.next_token_ids, out.ok
        elif limits is None:
            self.state, out = self.call(fn, self.params, self.state, batch)
            tokens, ok = out.next_token_ids, out.ok
        else:
            self.state, tokens, ok = self.call(fn, self.params, self.state, batch, *rest)
        if self.compilations() > before and self.memory is not None:
            self._measure(fn, batch, rest)
        return tokens, ok, prev, logprobs

    def _measure(self, fn, batch, rest) -> None:
        """A new step executable: raise ``memory.working_bytes`` to what it needs beside the
        pools (its compile is cached, so asking costs no compilation). A report, never a
        reason for the round to fail: a step that cannot say (not a jitted function) is
        skipped."""
        try:
            need = step_working_bytes(fn, self.params, self.state, batch, *rest)
        except Exception:  # noqa: BLE001 - see the docstring
            return
        self.memory.working_bytes = max(self.memory.working_bytes, need)

    def admit_row(self, adm: Admission) -> int:
        """Name the admitted request's row (a local row of its data shard under a mesh) and
        claim it on the device; with a cache hit the row also borrows the matched KV and
        records the restored depth. Returns the row. Nothing is read back (with a step in
        flight a read would wait for it): the claim is checked at the next commit."""
        shard = adm.req.shard
        [row] = self.rows[shard].claim(1)
        try:
            self.state, ok = self._claim_row(adm, row)
        except BaseException:
            self.rows[shard].give([row])
            raise
        self._row_checks.append((row, ok, shard))
        adm.req.row_slots, adm.req.row_borrowed = list(adm.slots), adm.borrowed
        return row

    def _claim_row(self, adm: Admission, row: int) -> tuple[ServingState, Any]:
        """Claim ``row`` on the device for ``adm`` (borrowing its cached prefix, if any)."""
        if self.sharded is not None:  # ok [D]
            mine = [[row] if k == adm.req.shard else [] for k in range(self.num_data_shards)]
            if not self.prefix_cache:
                return self.call(self.sharded.claim_rows, self.state, mine)
            W = bucket(max(adm.borrowed, 1), self.kv_buckets, "cached prefix")
            return self.call(self.sharded.admit, self.state, mine, [
                [adm.slots[: adm.borrowed]] if rows else [] for rows in mine],
                [[adm.computed] if rows else [] for rows in mine], W)
        rows = jnp.asarray([row], jnp.int32)
        if not self.prefix_cache:
            pool, ok = self.call(self.jit.claim_row, self.state.req_to_token_pool, rows)
            return self.state.replace(req_to_token_pool=pool), ok
        W = bucket(max(adm.borrowed, 1), self.kv_buckets, "cached prefix")
        slots = np.zeros((1, W), np.int32)
        slots[0, : adm.borrowed] = adm.slots
        return self.call(self.jit.admit, self.state, rows,
                         jnp.asarray([adm.borrowed], jnp.int32), jnp.asarray(slots),
                         jnp.asarray([adm.computed], jnp.int32))

    def check_rows(self) -> None:
        """The device claimed every row the host named (read at a commit, when the flags are
        ready); a refusal cannot happen and raises."""
        checks, self._row_checks = self._row_checks, []
        for row, ok, shard in checks:
            if not bool(sharding.to_host(ok).reshape(-1)[shard if self.sharded else 0]):
                raise RuntimeError(f"the device refused request row {row}, which the host "
                                   "holds free")

    def finished(self, done: Sequence[Request]) -> None:
        """``done`` finished in the commit now: the slots named for positions they will not
        run (the rest of a multi-step decode, a step dispatched behind them, in which they
        are padding) are free again."""
        for r in done:
            # Safe only because a run dispatched behind a request that finishes now runs it as
            # padding: a stop token (``_follow``), or its length (left out: ``_continuation``).
            # A finish the device cannot see would have it claim slots given back here.
            if r.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"request {r.rid} finished at a commit with "
                                   f"{r.finish_reason!r}, which a run in flight cannot see")
            self.slots[r.shard].give(r.row_slots[r.computed:])
            del r.row_slots[r.computed:]

    def flush_ops(self, sched) -> None:
        """Carry out the device ops the scheduler queued, in order (frees of evicted slots,
        borrowed prompts, releases of finished requests); one that fails stays queued and is
        retried by the next round."""
        if self.sharded is not None:
            self._flush_sharded(sched)
            return
        while sched.device_ops:
            op = sched.device_ops[0]
            if isinstance(op, FreeSlots):
                n = 1 << max(len(op.slots) - 1, 0).bit_length()  # one compile per power of 2
                slots = np.zeros(n, np.int32)
                slots[: len(op.slots)] = op.slots
                self.state = self.call(self.jit.free_tokens, self.state, jnp.asarray(slots))
                self.slots[0].give(op.slots)  # (the prefix cache: one device)
            elif isinstance(op, Borrow):
                W = bucket(len(op.slots), self.kv_buckets, "cached prompt")
                slots = np.zeros((1, W), np.int32)
                slots[0, : len(op.slots)] = op.slots
                self.state = self.call(self.jit.borrow, self.state,
                                        jnp.asarray([op.req.row], jnp.int32),
                                        jnp.asarray([len(op.slots)], jnp.int32),
                                        jnp.asarray(slots))
                self._borrowed(op.req, op.slots)
            elif isinstance(op, Release):
                self.state = self._release_rows(op.reqs)
            sched.op_done(op)

    def _flush_sharded(self, sched) -> None:
        """Under a mesh each data shard has its own queue of device ops (its prefix cache's
        frees and borrows, its releases), carried out in its order: each sharded call takes
        the front op of every shard whose front op is of one kind (the others run padding)."""
        while any(s.device_ops for s in sched.shards):
            fronts = [s.device_ops[0] if s.device_ops else None for s in sched.shards]
            kind = type(next(op for op in fronts if op is not None))
            ops = [op if isinstance(op, kind) else None for op in fronts]
            if kind is FreeSlots:
                self.state = self.call(self.sharded.free_tokens, self.state,
                                        [op.slots if op else [] for op in ops])
                for k, op in enumerate(ops):
                    if op is not None:
                        self.slots[k].give(op.slots)
            elif kind is Borrow:
                W = bucket(max(len(op.slots) for op in ops if op), self.kv_buckets,
                           "cached prompt")
                self.state = self.call(self.sharded.borrow, self.state,
                                        [[op.req.row] if op else [] for op in ops],
                                        [[op.slots] if op else [] for op in ops], W)
                for op in ops:
                    if op is not None:
                        self._borrowed(op.req, op.slots)
            else:
                self.state = self._release_sharded([op.reqs if op else () for op in ops])
            for op in ops:
                if op is not None:
                    sched.op_done(op)

    def _release_sharded(self, done: Sequence[Sequence[Request]]) -> ServingState:
        """Release ``done[k]`` on data shard ``k`` (rows padded with row 0 to a shard's row
        count: one compile); with a prefix cache, what it keeps and the end snapshots."""
        R = self.max_running_requests // self.num_data_shards
        rows = [[r.row for r in d] + [0] * (R - len(d)) for d in done]
        if not self.prefix_cache:
            state = self.call(self.sharded.release, self.state, rows)
        else:
            C = self.max_context_len
            keep = [[C if r.keep_from is None else r.keep_from for r in d] + [C] * (R - len(d))
                    for d in done]
            snaps = [[r.finish_slot if r.end_depth else 0 for r in d] + [0] * (R - len(d))
                     for d in done]
            state = self.call(self.sharded.release, self.state, rows, keep, snaps)
        self._give_back([r for d in done for r in d])
        return state

    def _borrowed(self, r: Request, slots: Sequence[int]) -> None:
        """The row of ``r`` borrows ``slots`` now: the slots of its own they replace are free
        again (as ``serving.borrow_prefix`` frees them on the device)."""
        n, have = len(slots), r.row_slots
        self.slots[r.shard].give(
            old for p, (old, new) in enumerate(zip(have[:n], slots, strict=False))
            if p >= r.row_borrowed and old and old != new)
        have[:n] = slots
        r.row_borrowed = max(r.row_borrowed, n)

    def _release_rows(self, done: Sequence[Request]) -> ServingState:
        R = self.request_buckets[-1]
        rows = np.zeros(R, np.int32)
        rows[: len(done)] = [r.row for r in done]
        if not self.prefix_cache:
            state = self.call(self.jit.release, self.state, jnp.asarray(rows))
        else:
            keep = np.full(R, self.max_context_len, np.int32)
            keep[: len(done)] = [self.max_context_len if r.keep_from is None else r.keep_from
                                 for r in done]
            snaps = np.zeros(R, np.int32)
            snaps[: len(done)] = [r.finish_slot if r.end_depth else 0 for r in done]
            state = self.call(self.jit.release, self.state, jnp.asarray(rows),
                               keep_from=jnp.asarray(keep), snapshot_slots=jnp.asarray(snaps))
        self._give_back(done)
        return state

    def _give_back(self, done: Sequence[Request]) -> None:
        """The released rows of ``done`` and the token slots they own (past what they borrow,
        up to what a cache keeps), each shard's at once: a give that raised part way would
        leave the release queued with part of it done."""
        for k in range(self.num_data_shards):
            mine = [r for r in done if r.shard == k]
            self.slots[k].give([s for r in mine for s in r.row_slots[r.row_borrowed:
                                                                       r.keep_from]])
            self.rows[k].give(r.row for r in mine)

    def read_slots(self, req: Request, n: int) -> list[int]:
        """The token slots of the first ``n`` positions of ``req``'s row, from the host's copy
        (``Request.row_slots``: what admission borrowed, each step's ``token_slots``, each
        ``Borrow``). Never a device read: with a run in flight a read would wait for it."""
        if len(req.row_slots) < n:  # cannot happen: every step's slots are recorded
            raise RuntimeError(f"request {req.rid}: the host holds {len(req.row_slots)} of "
                               f"its row's token slots, {n} are needed")
        return req.row_slots[:n]

    # ---------------------------------------------------------------------------------------
    # convenience
    # ---------------------------------------------------------------------------------------
