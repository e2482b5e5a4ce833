"""``hybridattn.Engine``: host-side continuous batching around the pure ``hybridattn.step``.

The engine owns a ``hybridattn.serving.ServingState`` and a jitted ``step`` (state donated);
``hybridattn.scheduler.Scheduler`` decides what runs. Each scheduling round:

1. **Admit** waiting requests (FIFO) while a request row and a recurrent-state slot are free
   (``get_max_running_requests`` bounds the rows, at least one: a long-context engine whose
   pool holds less than one ``max_context_len`` runs one request) and the token slots hold its
   whole life (prompt + ``max_new_tokens - 1``) on top of what running requests reserved. A
   request that does not fit waits; running requests can never run out of slots.
2. **Schedule**: if some admitted request still has prompt tokens to run, an ``EXTEND`` batch
   takes every decoding request (one token each) plus prompt chunks up to
   ``chunked_prefill_size`` tokens (chunked prefill: a long prompt spans several steps);
   otherwise a ``DECODE`` batch of every running request.
3. **Pad** the batch to shape buckets (requests, tokens, attention width, longest extend), so
   the step compiles once per bucket tuple, and run it. A ``DECODE`` batch that nothing
   could join before it ends runs ``decode_steps`` steps in one dispatch
   (``hybridattn.serving.decode_steps``): a request that finishes inside the run turns into
   padding there, and the host commits the tokens step by step afterwards.
4. **Finish** requests on a stop token or ``max_new_tokens``: their token slots, row and state
   slot are released (``hybridattn.serving.release``) and waiting requests move up.

**Overlapped scheduling** (``overlap=True``, the default on one device): a step is left on
the device when its round ends. The next round admits what fits in the rows and slots free
now, plans the step that follows from each request's ``computed`` plus what it runs in flight
(``Scheduler.plan(ahead)``) and dispatches it, its decode rows' tokens read on the device from
the step in flight (``_follow``: a request that sampled a stop token there is padding in it);
only then does it wait for the earlier step's tokens, commit them, finish requests and release
their rows. The host's admission, planning, packing, dispatch and commit all happen while the
device computes; the host keeps each row's token slots (``Request.row_slots``) so the prefix
cache reads none back. Each request's tokens are those of synchronous rounds; they reach
callers one round later, and as admission can happen a round later too, what the prefix cache
holds at a given moment may differ.

The contract with callers (``Engine`` docstring): any number of ``generate``, ``stream`` and
``add_request`` / ``step`` users may be interleaved in one thread; each gets its own requests'
tokens (per-request output buffers), each stream ends when its own requests end, and aborting
any request is safe at any point. Calls from several threads are serialized by a lock. A
round is a transaction: an exception anywhere in it (a ``KeyboardInterrupt`` included, which
is held until the round has committed) leaves the pools and the bookkeeping in agreement.

Bad requests (an empty prompt, token ids that are not ints or lie outside the vocabulary,
``max_new_tokens < 1``, sampling settings the device cannot hold, a prompt that cannot fit the
context or the pool) raise ``ValueError`` from ``Engine.add_request`` before anything changes;
running requests are unaffected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.backends import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear
from hybridattn.models.kimi_linear.params import _check_supported
from hybridattn.pools import alloc_reqs, free
from hybridattn.scheduler import (
    Admission,
    Borrow,
    FreeSlots,
    Release,
    Request,
    Scheduler,
    ShardedPlan,
    ShardedScheduler,
    StepPlan,
    bucket,
    kv_ladder,
    ladder,
)
from hybridattn.serving import (
    ServingState,
    borrow_prefix,
    decode_steps,
    make_worker_batch,
    release,
    step,
)
from hybridattn.serving.decode import _padding_unless
from servecore import memory as _memory
from servecore.progress import progress_bar
from servecore.prompts import Prompt, check_text, decode, encode_prompt
from servecore.sampling import SamplingParams
from servecore.stats import ServingStats
from servecore.validate import check_int, check_real, eos_token_ids, prompt_list, stop_ids

__all__ = ["Engine", "EngineStats", "MemoryReport", "Stream", "available_memory_bytes",
           "default_chunked_prefill_size", "default_max_running_requests"]


def _admit_with_prefix(state: ServingState, lens, slots, computed):
    """A row for one request that borrows a cached prefix: allocate it, point its first
    ``lens`` positions at ``slots`` and record ``computed`` tokens of state."""
    pool, rows, ok = alloc_reqs(state.req_to_token_pool, 1, 1)
    state = borrow_prefix(state.replace(req_to_token_pool=pool), rows, lens, slots, computed)
    return state, rows, ok


def _step_tokens(params, state: ServingState, batch):
    """``serving.step`` without the logits (the engine samples on the device and never reads
    them, so the compiled step does not return a ``[B, V]`` array it would have to keep)."""
    new, out = step(params, state, batch)
    return new, out._replace(logits=None)


def _decode_tokens(params, state: ServingState, batch, stop_token_ids, max_tokens, *,
                   num_steps: int):
    """``serving.decode_steps`` with ``num_steps`` bound (one jitted function per count),
    returning the token slots it wrote too."""
    return decode_steps(params, state, batch, num_steps, stop_token_ids, max_tokens,
                        return_slots=True)


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
        return _padding_unless(batch.replace(input_ids=ids), keep)
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
    return batch.replace(input_ids=ids.astype(jnp.int32),
                         req_pool_indices=jnp.where(keep, batch.req_pool_indices, zero),
                         seq_lens=jnp.where(keep, batch.seq_lens, 0).astype(jnp.int32),
                         extend_seq_lens=new_ext.astype(jnp.int32))


STOP_BUCKETS = (4, 16, 64)
"""Widths of the per-row stop-token arrays of a multi-step decode (a request with more stop
ids than the last decodes one step per dispatch)."""


def _alloc_row(pool):
    return alloc_reqs(pool, 1, 1)


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
    >>> c.call(c.alloc_row, ServingState.create(KimiLinearConfig.tiny(
    ...     num_hidden_layers=2, hidden_size=32, vocab_size=64), max_running_requests=1,
    ...     max_context_len=4, num_token_slots=5).req_to_token_pool)[1].tolist(), c.count
    ([1], 1)
    """

    def __init__(self):
        self.count = 0
        self._seen: set = set()
        self._head, self._head_sig = None, None  # the last dict first argument, its signature
        self.step = jax.jit(_step_tokens, donate_argnums=1)
        self.release = jax.jit(release, donate_argnums=0)
        self.alloc_row = jax.jit(_alloc_row)
        self.admit = jax.jit(_admit_with_prefix, donate_argnums=0)
        self.borrow = jax.jit(borrow_prefix, donate_argnums=0)
        self.free_tokens = jax.jit(_free_tokens, donate_argnums=0)
        self.follow = jax.jit(_follow)
        self._decode: dict[int, Any] = {}

    def decode(self, num_steps: int):
        """The jitted ``num_steps``-step decode (state donated), one function per count."""
        if num_steps not in self._decode:
            self._decode[num_steps] = jax.jit(
                functools.partial(_decode_tokens, num_steps=num_steps), donate_argnums=1)
        return self._decode[num_steps]

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


def available_memory_bytes() -> int:
    """Memory available to this process, in bytes: the least of ``MemAvailable`` (physical
    pages off Linux) and what its cgroups still allow (``servecore.memory``). ``Engine``
    sizes its default token pool from it.

    >>> available_memory_bytes() > 0
    True
    """
    return _memory.available_memory_bytes()


REQ_TABLE_POSITIONS = 1 << 23
"""Positions of the default ``req_to_token`` table: about 32 MiB of int32 (32 rows up to 256k,
8 at 1M)."""


def default_max_running_requests(max_context_len: int) -> int:
    """The default request rows: 32, fewer when 32 rows of ``max_context_len`` positions would
    make the ``req_to_token`` table larger than ``REQ_TABLE_POSITIONS`` int32 (32 MiB), and
    at least one. A row is a whole context of slot ids whether or not a request fills it, so
    at 1M the default keeps 8 rows (32 MiB) rather than 32 (128 MiB); a 1M context also needs
    a token pool of that many tokens per running request, which few machines hold 32 times.

    >>> [default_max_running_requests(n) for n in (4096, 1 << 18, 1 << 19, 1 << 20, 1 << 24)]
    [32, 32, 16, 8, 1]
    """
    check_int("max_context_len", max_context_len, 1)
    return min(32, max(1, REQ_TABLE_POSITIONS // max_context_len))


def default_chunked_prefill_size(max_context_len: int) -> int:
    """The default prompt tokens per step: 256 up to 4096 tokens of context (short prompts,
    small compiled shapes), 2048 beyond. A long prompt then takes 8x fewer steps, each
    query tile of the blockwise MLA meets more queries per key block, and fewer width
    buckets are met: a 64k prompt on the tiny config prefilled in 39 s instead of 48 s and
    compiled in 67 s instead of 98 (``bench longctx``, docs/benchmarks.md).

    >>> [default_chunked_prefill_size(n) for n in (4096, 4097, 1 << 20)]
    [256, 2048, 2048]
    """
    check_int("max_context_len", max_context_len, 1)
    return 256 if max_context_len <= 4096 else 2048


def _nbytes(x) -> int:
    """Bytes of an array or a ``ShapeDtypeStruct`` (a PRNG key counts its key data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return 8 * int(np.prod(x.shape))
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


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


@dataclasses.dataclass
class MemoryReport:
    """Pool sizes and what a token of context costs (``Engine.memory``; ``str()`` gives a
    two-line summary).

    In the tiny model below, one MLA layer keeps ``kv_lora_rank + qk_rope_head_dim = 40``
    float32 numbers per token, where full attention in both layers would keep K and V of 4
    heads (``(24 + 16) * 4`` numbers per layer):

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = kimi_linear.init_params(cfg, jax.random.key(0))
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33)
    >>> m = engine.memory
    >>> m.mla_bytes_per_token, m.full_attn_bytes_per_token, m.num_token_slots
    (160, 1280, 33)
    >>> m.state_bytes_per_request  # KDA: 4 x 16 x 16 float32 state + 3 x 192 conv state
    6400
    """

    budget_bytes: int
    param_bytes: int
    max_running_requests: int
    max_context_len: int
    num_token_slots: int
    mla_layers: int
    mla_bytes_per_token: int  # latent c_kv + k_pe, summed over the MLA layers
    full_attn_bytes_per_token: int  # K and V of every layer if all were full multi-head attention
    state_bytes_per_request: int  # KDA conv + recurrent state, summed over the KDA layers
    pool_bytes: int
    num_snapshot_slots: int = 0  # prefix-cache snapshot slots, the sink included
    req_to_token_bytes: int = 0  # the request table: (rows + 1) x max_context_len int32 + maps

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one prefix-cache snapshot: every KDA layer's conv and recurrent state."""
        return self.state_bytes_per_request

    @property
    def snapshot_tokens(self) -> float:
        """What one snapshot weighs in tokens of MLA latent (the budget trades the two)."""
        return self.snapshot_bytes / max(self.mla_bytes_per_token, 1)

    @classmethod
    def for_config(cls, config: KimiLinearConfig, *, max_running_requests: int,
                   max_context_len: int, num_token_slots: int, dtype=jnp.float32,
                   budget_bytes: int = 0, param_bytes: int | None = None,
                   num_snapshot_slots: int = 0) -> MemoryReport:
        """The report of an engine of this geometry, from the pools' layout alone (shapes:
        nothing is allocated, no parameters are needed; ``param_bytes`` defaults to the size
        of ``param_shapes(config, dtype)``).

        >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
        >>> r = MemoryReport.for_config(cfg, max_running_requests=2, max_context_len=16,
        ...                             num_token_slots=33)
        >>> r.mla_bytes_per_token, r.state_bytes_per_request
        (160, 6400)
        """
        shapes = jax.eval_shape(lambda: ServingState.create(
            config, max_running_requests=max_running_requests, max_context_len=max_context_len,
            num_token_slots=num_token_slots, dtype=dtype, num_snapshot_slots=num_snapshot_slots))
        if param_bytes is None:
            param_bytes = sum(_nbytes(x) for x in jax.tree.leaves(
                kimi_linear.param_shapes(config, dtype)))
        return cls(
            budget_bytes=budget_bytes, param_bytes=param_bytes,
            max_running_requests=max_running_requests, max_context_len=max_context_len,
            num_token_slots=num_token_slots, mla_layers=config.num_mla_layers,
            mla_bytes_per_token=shapes.token_to_kv_pool.bytes_per_token,
            full_attn_bytes_per_token=(config.num_hidden_layers * config.num_attention_heads
                                       * (config.q_head_dim + config.v_head_dim)
                                       * jnp.dtype(dtype).itemsize),
            state_bytes_per_request=sum(
                _nbytes(x) // shapes.recurrent_state_pool.num_slots
                for x in jax.tree.leaves(shapes.recurrent_state_pool)),
            pool_bytes=sum(_nbytes(x) for x in jax.tree.leaves(shapes)),
            num_snapshot_slots=num_snapshot_slots,
            req_to_token_bytes=sum(_nbytes(x) for x in jax.tree.leaves(
                shapes.req_to_token_pool)),
        )

    @classmethod
    def by_context_len(cls, config: KimiLinearConfig, context_lens: Sequence[int] = (
            1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20), *,
            max_running_requests: int | None = None, dtype=jnp.float32,
            param_bytes: int | None = None) -> list[MemoryReport]:
        """What an engine must hold to run ``max_running_requests`` requests of each context
        length at once (default rows: ``default_max_running_requests``), each with a token
        pool of exactly that many full contexts and no prefix cache: a report per length,
        from shapes alone. ``format_table`` prints them. The tiny model keeps 160 B of latent
        per token, so one 1M context holds 160 MiB of latents, 8 MiB of ``req_to_token`` row
        and 5 MiB of slot allocator; the 8 default rows need 8x the pool:

        >>> cfg = KimiLinearConfig.tiny()
        >>> r4k, r1m = MemoryReport.by_context_len(cfg, (4096, 1 << 20), max_running_requests=1)
        >>> r4k.mla_bytes_per_token, r1m.pool_bytes // (1 << 20), r1m.req_to_token_bytes >> 20
        (160, 173, 8)
        >>> [r.max_running_requests for r in MemoryReport.by_context_len(cfg, (4096, 1 << 20))]
        [32, 8]
        """
        out = []
        for n in context_lens:
            check_int("context_len", n, 1)
            R = (default_max_running_requests(n) if max_running_requests is None
                 else check_int("max_running_requests", max_running_requests, 1))
            out.append(cls.for_config(config, max_running_requests=R, max_context_len=n,
                                      num_token_slots=R * n + 1, dtype=dtype,
                                      param_bytes=param_bytes))
        return out

    @staticmethod
    def format_table(reports: Sequence[MemoryReport]) -> str:
        """A table of reports (``by_context_len``): per context length the request rows, the
        MLA latents of the token pool, the ``req_to_token`` table, the KDA states of the rows,
        all pools (allocators included), and the parameters, in MiB.

        >>> cfg = KimiLinearConfig.tiny()
        >>> print(MemoryReport.format_table(MemoryReport.by_context_len(
        ...     cfg, (4096, 1 << 20), max_running_requests=1)).splitlines()[0])
        context | rows | latent MiB | req_to_token MiB | states MiB | pools MiB | params MiB
        """
        mib = 1 << 20
        lines = ["context | rows | latent MiB | req_to_token MiB | states MiB | pools MiB | "
                 "params MiB"]
        for r in reports:
            kv = r.num_token_slots * r.mla_bytes_per_token
            states = (r.max_running_requests + 1) * r.state_bytes_per_request
            lines.append(f"{r.max_context_len:>7} | {r.max_running_requests:>4} | "
                         f"{kv / mib:10.1f} | {r.req_to_token_bytes / mib:16.2f} | "
                         f"{states / mib:10.2f} | {r.pool_bytes / mib:9.1f} | "
                         f"{r.param_bytes / mib:10.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"pools {self.pool_bytes / mib:.1f} MiB of a {self.budget_bytes / mib:.0f} MiB budget "
            f"(params {self.param_bytes / mib:.1f} MiB): {self.num_token_slots - 1} token slots, "
            f"{self.max_running_requests} requests x {self.max_context_len} context "
            f"(req_to_token {self.req_to_token_bytes / mib:.1f} MiB)\n"
            f"per token of context: {self.mla_bytes_per_token} B of MLA latent ("
            f"{self.mla_layers} MLA layers x {self.mla_bytes_per_token // max(self.mla_layers, 1)}"
            f" B) vs "
            f"{self.full_attn_bytes_per_token} B if every layer kept full-attention K/V "
            f"({self.full_attn_bytes_per_token / max(self.mla_bytes_per_token, 1):.1f}x); "
            f"per request: {self.state_bytes_per_request / 1024:.1f} KiB of KDA state"
            + (f"\nprefix cache: {self.num_snapshot_slots - 1} snapshots of "
               f"{self.snapshot_bytes / 1024:.1f} KiB (each {self.snapshot_tokens:.0f} tokens "
               "of MLA latent)" if self.num_snapshot_slots else "")
        )


@dataclasses.dataclass
class EngineStats(ServingStats):
    """Counters since the engine was built (or ``Engine.reset_stats``): ``Engine.stats``.

    The core counters and rates are ``servecore.ServingStats``'s, named and defined as in
    ``mlxcache.EngineStats``. Steps that compiled are left out of the throughput figures.
    ``prefill_*``: steps that ran prompt tokens (decodes riding along in the same mixed step
    are not counted as tokens, but their time is here); ``decode_*``: pure decode steps.
    Here: ``steps`` (device steps: a multi-step decode dispatch counts each step it ran);
    ``decode_rounds``: the pure-decode dispatches (rounds) among them; ``snapshots_taken`` /
    ``state_evictions``: KDA state snapshots the prefix cache stored / evicted;
    ``num_compilations``: compilations this engine needed (its own count: the step, one per
    new shape bucket, plus row allocation and release; JAX may load one from its cache when
    another engine of the same geometry compiled it); ``buckets``: the
    ``(mode, B, T, W, Q)`` shape buckets the steps used, ``compiled_buckets`` those that were
    new to it, ``bucket_compile_seconds`` each of those to the wall time of the step that
    compiled it (tracing, lowering, compiling and its first run; ``compile_seconds`` is their
    sum).

    Where a step's time goes (steps that compiled left out, as above): ``*_host_seconds``
    is the Python side of those steps' rounds outside the wait for their outputs (planning
    the step, packing the batch, the jitted call until it returns: argument flattening,
    transfers, dispatch; then committing the sampled tokens); ``*_wait_seconds`` the time
    then spent blocked on the outputs: the device's work that the host side did not
    overlap. Without overlapped scheduling, host + wait is each round from planning to
    commit; ``prefill_seconds`` / ``decode_seconds`` run from the packing to the outputs
    (from the previous run's outputs on, for a run dispatched before them), so they add up
    to the wall time of the steps (``hybridattn.bench serve`` times the step alone on the
    device apart). ``decode_exposed_seconds``: the part of ``decode_host_seconds`` the
    device did not hide, during which it had nothing queued (all of it without
    overlapping; with it, an upper bound: a stretch of host work counts whole when the
    device was found idle at its end).

    >>> stats = EngineStats(prefill_tokens=512, prefill_seconds=0.25, decode_tokens=64,
    ...                     decode_seconds=0.5, ttft=[0.1, 0.3])
    >>> stats.prefill_tok_s, stats.decode_tok_s, round(stats.mean_ttft, 6)
    (2048.0, 128.0, 0.2)
    """

    steps: int = 0
    decode_rounds: int = 0
    snapshots_taken: int = 0
    state_evictions: int = 0
    num_compilations: int = 0
    compile_seconds: float = 0.0
    buckets: set = dataclasses.field(default_factory=set)  # step shape buckets used
    compiled_buckets: list = dataclasses.field(default_factory=list)  # ... that compiled
    bucket_compile_seconds: dict = dataclasses.field(default_factory=dict)  # bucket -> s
    prefill_host_seconds: float = 0.0
    prefill_wait_seconds: float = 0.0
    decode_host_seconds: float = 0.0
    decode_wait_seconds: float = 0.0
    decode_exposed_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Follow:
    """How a step dispatched before the run in flight is committed takes that run's output:
    per work item the column and the step of the run's tokens that feed it (-1: none, its
    token is the host's), the requests so fed, and the tokens each request samples in the
    run in flight (for ``_multi_step_limits``)."""

    cols: tuple[int, ...]
    last: tuple[int, ...]
    fed: tuple[Request, ...]
    samples: dict
    leaving: int = 0  # requests that reach max_new_tokens in flight (their rows free then)


@dataclasses.dataclass
class _Run:
    """A step (or multi-step decode) on the device whose tokens the host has not committed:
    its plan and step limits (None: one step), its outputs (device arrays), its bucket key,
    whether dispatching it compiled, when its round began planning it (``t_plan``), packing
    it (``t_pack``) and when the dispatch returned (``t_call``), and of the host seconds
    before that, ``exposed``: those during which the device had nothing queued; ``fed``: the
    requests whose tokens came from the run before it; ``ready_by``: a time a later round
    found its outputs ready (its stats then end there, not at the commit)."""

    plan: StepPlan | ShardedPlan
    limits: list[int] | None
    tokens: Any
    ok: Any
    slots: Any  # the token slots the run wrote (StepOutput.token_slots; None under a mesh)
    key: tuple
    compiled: bool
    t_plan: float
    t_pack: float
    t_call: float
    exposed: float
    fed: tuple = ()  # requests whose token came from the run before it (_Follow.fed)
    ready_by: float | None = None  # a time its outputs were found ready (before the commit)


class Engine:
    """Continuous-batching generation for a Kimi-Linear model.

    ``generate`` serves a list of prompts to completion, ``stream`` yields tokens as they
    come, and ``add_request`` / ``step`` drive the scheduler one round at a time. Requests
    are greedy unless given a ``temperature``; a request's samples depend on its prompt and
    seed, not on which other requests share its steps.

    The contract with callers:

    - Any number of ``generate``, ``stream`` and ``add_request`` / ``step`` users may be
      interleaved in one thread (a ``generate`` inside a loop over a stream, two streams
      consumed alternately, ``step`` calls while a stream is open). Every request's tokens
      reach whoever asked for them: a stream yields its own requests' tokens, whoever
      advanced the engine; ``step`` returns the tokens of requests queued with
      ``add_request``, including those generated while a stream or ``generate`` was advancing
      the engine. Each stream ends when its own requests end.
    - ``abort`` is safe at any point, for a waiting or a running request, from inside a loop
      over a stream too (that stream then ends that request without more tokens). A stream
      closed early (``close()``, ``break``, or garbage-collected) aborts what is left of it.
    - Calls from several threads are **serialized**: one lock guards every round, request and
      abort, so threads sharing an engine each get their own requests' tokens.
    - A scheduling round is a transaction: an exception anywhere in it leaves the pools and the
      bookkeeping in agreement (a ``KeyboardInterrupt`` that arrives mid-round is held until
      the round has committed, then raised).

    Args:
        config: the model's config (``hybridattn.models.kimi_linear.load`` or
            ``KimiLinearConfig``).
        params: the model's parameters (``kimi_linear.load`` or ``kimi_linear.init_params``);
            checked against ``kimi_linear.param_shapes(config)``.
        max_running_requests: request rows (default ``default_max_running_requests``: 32,
            fewer above 256k of context, so the ``req_to_token`` table stays within 32 MiB);
            never more than the token slots hold at full context, and at least one.
        max_context_len: longest prompt + generation (default ``min(model_max_length, 4096)``);
            up to 1M tokens and beyond: only the ``req_to_token`` rows grow with it, the token
            pool is sized on its own (a pool smaller than one full context serves one request
            at a time, each prompt + generation within the pool).
        num_token_slots: MLA token slots; default: what ``mem_fraction`` of the available
            memory (less the parameters, the ``req_to_token`` table and the KDA states) holds,
            at most enough for every request at full context.
        mem_fraction: the share of ``available_memory_bytes()`` the default pool may use.
        chunked_prefill_size: prompt tokens per step (long prompts span several steps);
            default ``default_chunked_prefill_size(max_context_len)``: 256, or 2048 past
            4096 tokens of context.
        request_buckets: shape buckets of the padded batches' request count (default:
            powers of four up to ``max_running_requests``); the step compiles once per
            bucket tuple used.
        token_buckets: shape buckets of the tokens in a step (default: powers of four from
            16 up to ``chunked_prefill_size + max_running_requests``).
        kv_buckets: shape buckets of the attention width (default: powers of four from 64
            up to 4096, then powers of two up to ``max_context_len``: at long context a
            width pads by at most 2x, 12 buckets for 1M).
        snapshot_buckets: shape buckets of the state snapshots an extend step takes (default:
            0, then powers of four from 4 up to what a step can take: one per grid interval
            of a prefill chunk and three per request); one bucket means one variant.
        chunk_size: the KDA prefill chunk.
        dtype: the pools' floating dtype (MLA latents and conv states; KDA states are float32).
        seed: the base sampling key (``ServingState.create``).
        prefix_cache: reuse cached prefixes (a radix tree over the token slots, with exact
            KDA state snapshots; see ``hybridattn.prefix_cache``). False re-prefills every
            prompt from token 0. Default: on, but off under a ``mesh``, where it is not
            supported (``prefix_cache=True`` with a mesh raises ``ValueError``).
        snapshot_interval: the snapshot grid along every prefill, a positive multiple of
            ``chunk_size`` (default: the multiple of it nearest 256, at least one chunk).
        num_snapshot_slots: snapshot slots (the sink included); default: one per grid
            interval of the token pool and four per request row, within a quarter of the
            memory budget left after the parameters and working states (the token pool's
            default gets the rest).
        tokenizer: optional, the checkpoint's tokenizer (``kimi_linear.load_tokenizer``, or
            any Hugging Face tokenizer): prompts may then be text or chats (rendered by its
            chat template), ``generate(..., text=True)`` returns text, and its EOS ids with
            ``config.eos_token_id`` (an int or a list) end requests unless
            ``stop_token_ids`` is given.
        decode_steps: decode steps per dispatch when a round would be a pure ``DECODE``
            step that nothing can join before it ends: no request waits, or none running can
            reach its ``max_new_tokens`` inside the run (so only a stop token could free a
            row for a waiting one). The steps run in one ``lax.while_loop`` on the device
            (``hybridattn.serving.decode_steps``), each request at most up to its
            ``max_new_tokens`` and the batch's attention-width bucket; a request that samples
            a stop token inside the run becomes padding from the next step on (no token slot,
            no state written), so the pools, the tokens and the stats are those of stepping
            one at a time. It saves the host's planning, packing, dispatch and read-back of
            every step but the first; a request finishing early in the run holds its row
            until the run ends. 1 (the default): one step per round; 8 cut the host time
            per decode step 5-9x in ``bench serve``. Each count compiles its own decode
            function per bucket, so a short-lived engine (or a test) pays a compile for it.
            Under a ``mesh`` the engine decodes one step per round (``ShardedStep`` wraps
            the single step only).
        overlap: overlapped scheduling (default on; one device): a step stays on the
            device while its round ends, and the next round admits what fits, plans and
            dispatches the step that follows it before reading its tokens: that step takes
            each decoding request's last token from the device (one that sampled a stop
            token there becomes padding), and the host then commits the earlier step's
            tokens, finishes requests and releases them, all while the device computes.
            JAX dispatch is asynchronous, so the device does not wait for the host between
            steps. Each request's tokens are those of the synchronous engine
            (``overlap=False``; what the prefix cache holds may differ with admission
            timing); a step's tokens reach ``step`` / ``stream`` one round
            later, and a waiting request admitted into a row that a finish frees one round
            later too.
        scan_layers: run the layers that repeat as one ``lax.scan`` over stacked parameters
            and pools (``kimi_linear.stack_layers``, done here): the released 27 layers are
            layer 0 and seven groups of 2-3 KDA layers each ending in an MLA layer
            (``kimi_linear.group_plan``), layer 0 running in the first group's loop
            (``kimi_linear.folded_layers``), so each bucket compiles 2 layers instead of 27; a
            model that repeats a period of layers instead (``kimi_linear.layer_plan``)
            compiles one period. The engine
            then holds the stacked copy of ``params`` (under a ``mesh``, placed by
            ``sharding.stacked_param_specs``). No effect on a model whose layers do not
            repeat. On one device the engine's copy is also in
            ``kimi_linear.serving_layout`` (routed down projections input-major, each KDA
            layer's input projections as one).
        mesh: a ``(data, tensor)`` mesh (``hybridattn.sharding.make_mesh``) to serve on
            (docs/sharding.md): the step runs sharded (``sharding.ShardedStep``, this engine's
            own), ``params`` are placed by ``sharding.PARAM_RULES``, and the pools are split
            into ``data`` shards, each with ``max_running_requests / data`` rows and
            ``num_token_slots / data`` token slots (its own sink included; both must divide).
            Each request runs on one data shard: the least loaded one with a free row and
            the token slots for its whole life (admission is FIFO over all shards). Every
            step runs one work list per shard; the buckets (``request_buckets`` reaching a
            shard's rows, ``token_buckets`` a shard's prompt chunk and decodes) are per shard.
            Heads and MLP channels must divide by ``tensor``, routed experts by
            ``data * tensor``. No prefix cache.

    Attributes:
        state: the ``ServingState`` (pools) the steps update.
        stats: ``EngineStats``: throughput, TTFT, compilations and buckets.
        memory: ``MemoryReport``: pool sizes and bytes per token of context.
        max_running_requests: requests that run at once (rows, state slots and token slots
            permitting), over all data shards.
        capacity: token slots for requests (the sinks excluded), over all data shards.
        shard_capacity: token slots of one data shard (``capacity`` without a mesh): the
            most one request may use.
        num_data_shards: the mesh's data size (1 without a mesh).

    Raises:
        ValueError: a size, fraction, dtype, bucket list or parameter tree that cannot work,
            or a config value that is not implemented, naming it.

    Two greedy prompts on a tiny random model; the engine compiles one EXTEND and one
    DECODE step here (one per shape bucket used):

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = kimi_linear.init_params(cfg, jax.random.key(0))
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33)
    >>> prompts = [[1, 2, 3], [4, 5]]
    >>> outs = engine.generate(prompts, max_new_tokens=4)
    >>> [len(o) for o in outs], all(0 <= t < cfg.vocab_size for o in outs for t in o)
    ([4, 4], True)
    >>> sorted(mode for mode, *_ in engine.stats.buckets)  # ForwardMode.EXTEND, DECODE
    [1, 2]

    ``stream`` yields ``(prompt index, token)`` as steps finish; sampling is reproducible
    from the seed (request ``i`` uses ``seed + i``):

    >>> got = [[], []]
    >>> for i, token in engine.stream(prompts, max_new_tokens=4):
    ...     got[i].append(token)
    >>> got == outs
    True
    >>> a = engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    >>> a == engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    True
    >>> engine.num_running, engine.has_unfinished()  # finished requests are released
    (0, False)

    A request queued with ``add_request`` gets its tokens from ``step`` even when a
    ``generate`` advanced the engine in between:

    >>> rid = engine.add_request([7, 8], 2)
    >>> _ = engine.generate([[1]], 3)
    >>> [tok for r, tok, _ in engine.step() if r == rid] == engine.generate([[7, 8]], 2)[0]
    True

    With a tokenizer, a prompt may be text or a chat, and ``text=True`` decodes the answers
    (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``, and its chat
    template writes ``<|user|> ... <|assistant|>``, tokens 4 and 5; its EOS id, 1, ends a
    request by default):

    >>> from servecore.testing import word_tokenizer
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33, tokenizer=word_tokenizer(64))
    >>> chat = [{"role": "user", "content": "w7 w8"}]
    >>> engine.generate(["w7 w8", chat], 4) == engine.generate([[7, 8], [4, 7, 8, 5]], 4)
    True
    >>> engine.generate([chat], 4, text=True)[0] == engine.tokenizer.decode(
    ...     engine.generate([[4, 7, 8, 5]], 4)[0])
    True
    """

    def __init__(
        self,
        config: KimiLinearConfig,
        params,
        *,
        max_running_requests: int | None = None,
        max_context_len: int | None = None,
        num_token_slots: int | None = None,
        mem_fraction: float = 0.5,
        chunked_prefill_size: int | None = None,
        request_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        kv_buckets: Sequence[int] | None = None,
        snapshot_buckets: Sequence[int] | None = None,
        chunk_size: int = 32,
        dtype=jnp.float32,
        seed: int = 0,
        prefix_cache: bool | None = None,
        snapshot_interval: int | None = None,
        num_snapshot_slots: int | None = None,
        tokenizer: Any = None,
        decode_steps: int = 1,
        overlap: bool = True,
        scan_layers: bool = True,
        mesh: Any = None,  # a jax.sharding.Mesh; checked by _check_mesh (ValueError)
    ):
        if not isinstance(config, KimiLinearConfig):
            raise ValueError(f"config must be a KimiLinearConfig, got {type(config).__name__}")
        _check_supported(config)  # unimplemented config values, by name
        kimi_linear.check_params(params, config)
        if max_context_len is None:
            max_context_len = min(config.model_max_length or 4096, 4096)
        check_int("max_context_len", max_context_len, 1)
        D = self._check_mesh(config, mesh, prefix_cache, max_running_requests, num_token_slots)
        if prefix_cache is None:
            prefix_cache = mesh is None
        if max_running_requests is None:
            max_running_requests = default_max_running_requests(max_context_len)
            max_running_requests = max(D, max_running_requests - max_running_requests % D)
        check_int("max_running_requests", max_running_requests, 1)
        if chunked_prefill_size is None:
            chunked_prefill_size = default_chunked_prefill_size(max_context_len)
        check_int("chunked_prefill_size", chunked_prefill_size, 1)
        check_int("chunk_size", chunk_size, 1)
        check_int("seed", seed, 0)
        self.decode_steps = check_int("decode_steps", decode_steps, 1)
        if snapshot_interval is None:
            snapshot_interval = max(1, round(256 / chunk_size)) * chunk_size
        if check_int("snapshot_interval", snapshot_interval, 1) % chunk_size:
            raise ValueError(f"snapshot_interval={snapshot_interval} must be a positive multiple "
                             f"of chunk_size={chunk_size} (snapshots sit on the KDA chunk grid)")
        if num_snapshot_slots is not None:
            check_int("num_snapshot_slots", num_snapshot_slots, 0)
        if num_token_slots is not None:
            check_int("num_token_slots", num_token_slots, 2)
        if check_real("mem_fraction", mem_fraction) <= 0 or mem_fraction > 1:
            raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1]")
        try:
            floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"dtype={dtype!r} must be a floating dtype (the pools hold "
                             "activations)")
        # With a tokenizer, a request ends by default where the checkpoint says text ends:
        # the tokenizer's EOS ids and the config's eos_token_id (an int or a list, as
        # config.json has it, and as transformers' generate and mlx_lm.load read it).
        # Without one (ids in, ids out) only stop_token_ids end a request early.
        eos = frozenset()
        if tokenizer is not None:
            eos = eos_token_ids(tokenizer) | eos_token_ids(config)
        if any(t >= config.vocab_size for t in eos):
            raise ValueError(f"the EOS ids {sorted(eos)} of the tokenizer and config must lie "
                             f"in the model's vocabulary [0, {config.vocab_size})")
        self.tokenizer, self._eos = tokenizer, eos
        for name, flag in (("overlap", overlap), ("scan_layers", scan_layers)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.overlap = overlap and mesh is None
        if scan_layers:
            params = kimi_linear.stack_layers(params, config)
        if mesh is None:  # (sharding.PARAM_RULES name the checkpoint's leaves)
            params = kimi_linear.serving_layout(params)
        self.config, self.params = config, params
        self.chunked_prefill_size = chunked_prefill_size
        geometry = dict(max_context_len=max_context_len, dtype=dtype, chunk_size=chunk_size,
                        seed=seed)
        # Bytes per token and per request, read from the pools' own layout (shapes only).
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        budget = int(mem_fraction * available_memory_bytes())
        unit = MemoryReport.for_config(config, num_token_slots=2, max_running_requests=
                                       max_running_requests, max_context_len=max_context_len,
                                       dtype=dtype, param_bytes=param_bytes)
        # The budget, after the parameters and the working states, is split: a quarter to the
        # prefix cache's snapshots (unless their number is given), the rest to token slots.
        snap_bytes = unit.state_bytes_per_request
        if unit.req_to_token_bytes > budget:
            raise ValueError(
                f"mem_fraction={mem_fraction} of the available memory ({budget} bytes) holds no "
                f"req_to_token table of max_running_requests={max_running_requests} rows x "
                f"max_context_len={max_context_len} int32 positions ({unit.req_to_token_bytes} "
                "bytes): lower max_running_requests (the default at this context is "
                f"{default_max_running_requests(max_context_len)})")
        left = (budget - param_bytes - unit.req_to_token_bytes
                - (max_running_requests + 1) * snap_bytes)
        if not prefix_cache:
            snap_share = 0
        elif num_snapshot_slots is None:
            snap_share = max(left, 0) // 4
        else:
            snap_share = num_snapshot_slots * snap_bytes
        if num_token_slots is None:
            # under a mesh the budget is split evenly over the data shards, each with its own
            # sink, and each shard's pool must hold one context
            fit = (left - snap_share) // max(unit.mla_bytes_per_token, 1) // D
            per_shard = int(min(fit, max_running_requests // D * max_context_len)) + 1
            if per_shard < max_context_len + 1:
                raise ValueError(
                    f"mem_fraction={mem_fraction} of the available memory ({budget} bytes) "
                    f"holds {max(per_shard - 1, 0)} token slots"
                    + (f" per data shard (of {D})" if mesh is not None else "")
                    + f", less than one max_context_len={max_context_len}: lower "
                    "max_context_len, raise mem_fraction, or give num_token_slots (a pool "
                    "smaller than one context serves prompts up to its size)"
                )
            num_token_slots = per_shard * D
        # Rows the token pool cannot fill at full context are not allocated (their
        # req_to_token rows and KDA states would sit idle); one row always, so a pool smaller
        # than one max_context_len serves one request at a time. Admission reserves each
        # request's own need, so requests shorter than max_context_len never run out. Under
        # a mesh this holds per data shard.
        shard_slots = num_token_slots // D
        rows = D * min(max_running_requests // D, max(1, (shard_slots - 1) // max_context_len))
        if not prefix_cache:
            num_snapshot_slots = 0
        elif num_snapshot_slots is None:
            # a grid snapshot for every interval the token pool can cache, and a few more per
            # request (the branch point, the last-but-one prompt token, the end)
            want = num_token_slots // snapshot_interval + 4 * rows
            num_snapshot_slots = min(want, snap_share // max(snap_bytes, 1)) + 1
            if num_snapshot_slots < 2:
                raise ValueError(
                    f"a quarter of the memory budget left ({snap_share} bytes) holds no KDA "
                    f"snapshot of {snap_bytes} bytes: raise mem_fraction, give "
                    "num_snapshot_slots, or pass prefix_cache=False")
        elif num_snapshot_slots < 2:
            raise ValueError(f"num_snapshot_slots={num_snapshot_slots} holds no snapshot (slot 0 "
                             "is the sink): give at least 2, or pass prefix_cache=False")
        self.prefix_cache, self.snapshot_interval = prefix_cache, snapshot_interval
        self.mesh, self.num_data_shards = mesh, D
        self.state = ServingState.create(config, num_token_slots=num_token_slots,
                                         num_snapshot_slots=num_snapshot_slots,
                                         max_running_requests=rows, mesh=mesh, **geometry)
        self.max_running_requests = rows
        self.max_context_len = max_context_len
        self.shard_capacity = shard_slots - 1  # token slots one request may draw on
        self.capacity = D * self.shard_capacity
        self.memory = dataclasses.replace(
            unit, budget_bytes=budget, max_running_requests=self.max_running_requests,
            num_token_slots=num_token_slots, num_snapshot_slots=num_snapshot_slots,
            pool_bytes=sum(x.nbytes for x in jax.tree.leaves(self.state)),
            req_to_token_bytes=sum(x.nbytes for x in jax.tree.leaves(
                self.state.req_to_token_pool)))
        R = self.max_running_requests // D  # rows of one data shard (its batch's requests)
        max_t = chunked_prefill_size + R  # prompt chunks (of several requests) + decodes
        self.request_buckets = _buckets("request_buckets", request_buckets, ladder(1, R))
        self.token_buckets = _buckets("token_buckets", token_buckets, ladder(16, max_t))
        self.kv_buckets = _buckets("kv_buckets", kv_buckets, kv_ladder(max_context_len))
        # snapshots one step may take: a grid point per interval of its prompt tokens and one
        # more per request (a chunk rarely starts on the grid), a branch point and the
        # last-but-one prompt token per request
        most = chunked_prefill_size // snapshot_interval + 3 * R
        sb = tuple((0, *ladder(4, max(4, most))) if snapshot_buckets is None
                   else snapshot_buckets)
        if (not sb or not all(isinstance(b, int) and not isinstance(b, bool) for b in sb)
                or list(sb) != sorted(set(sb)) or sb[0] < 0 or sb[-1] < most):
            raise ValueError(f"snapshot_buckets={snapshot_buckets!r} must be increasing ints >= 0 "
                             f"reaching {most}: a step may take a snapshot per grid interval of a "
                             f"prefill chunk and three per request")
        self.snapshot_buckets = sb
        if self.kv_buckets[-1] > max_context_len:
            raise ValueError(f"kv_buckets={self.kv_buckets} must not exceed max_context_len="
                             f"{max_context_len}")
        if self.request_buckets[-1] < R:
            raise ValueError(f"request_buckets={self.request_buckets} must reach "
                             + (f"max_running_requests={R}" if mesh is None else
                                f"the {R} rows of a data shard"))
        if self.kv_buckets[-1] < max_context_len:
            raise ValueError(f"kv_buckets={self.kv_buckets} must reach max_context_len="
                             f"{max_context_len}")
        if self.token_buckets[-1] < max_t:
            raise ValueError(f"token_buckets={self.token_buckets} must reach {max_t}: a step "
                             f"takes up to chunked_prefill_size={chunked_prefill_size} prompt "
                             f"tokens and one token of each of {R} running requests")
        self.stats = EngineStats()
        self._sharded = None
        if mesh is None:
            self.scheduler = Scheduler(
                capacity=self.capacity, max_running_requests=R,
                chunked_prefill_size=chunked_prefill_size, request_buckets=self.request_buckets,
                token_buckets=self.token_buckets, kv_buckets=self.kv_buckets,
                num_snapshot_slots=num_snapshot_slots, snapshot_interval=snapshot_interval,
                snapshot_buckets=self.snapshot_buckets, chunk_size=chunk_size)
        else:
            from hybridattn import sharding

            self.scheduler = ShardedScheduler(
                D, capacity=self.shard_capacity, max_running_requests=R,
                chunked_prefill_size=chunked_prefill_size, request_buckets=self.request_buckets,
                token_buckets=self.token_buckets, kv_buckets=self.kv_buckets,
                chunk_size=chunk_size)
            self.params = sharding.shard_params(params, config, mesh)  # a no-op if placed
            self._sharded = sharding.ShardedStep(  # this engine's own
                config, mesh, scan_layers=isinstance(self.params["model"]["layers"],
                                                     kimi_linear.STACKED))
        self._lock = threading.RLock()
        self._next_rid = 0
        self._sinks: dict[int, deque] = {}  # rid -> the output buffer of the stream owning it
        self._outbox: list[tuple[int, int, bool]] = []  # tokens of add_request requests
        self._orphans: deque[int] = deque()  # rids of streams dropped mid-transaction
        self._busy = 0  # depth of transactions (rounds, aborts) in progress
        self._jit = _Compiled()  # this engine's own compilations
        self._inflight: _Run | None = None  # a step not committed yet (overlap)
        # the device's free stack of request rows, mirrored (pops from the end, as alloc)
        self._free_rows = list(range(self.max_running_requests, 0, -1))
        self._row_checks: list = []  # (rows, ok, expected row) of admissions not checked
        self._last_ready = 0.0  # when the last committed run's tokens were read

    @contextlib.contextmanager
    def _transaction(self):
        """The lock, interrupts held, and the busy mark finalizers look at."""
        with self._lock, _deferred_interrupts():
            self._busy += 1
            try:
                yield
            finally:
                self._busy -= 1

    def _compilations(self) -> int:
        """Compilations this engine has needed so far (``_Compiled.count``, or the traces of
        its ``ShardedStep`` under a mesh)."""
        return self._jit.count + (0 if self._sharded is None else self._sharded.trace_count)

    @staticmethod
    def _check_mesh(config, mesh, prefix_cache, max_running_requests, num_token_slots) -> int:
        """The mesh's data size (1 without a mesh); ValueError for a mesh, option or count
        that cannot work on it."""
        if prefix_cache is not None and not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache={prefix_cache!r} must be a bool")
        if mesh is None:
            return 1
        from hybridattn.mesh import check_divisible, mesh_sizes

        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh with axes ('data', "
                             "'tensor') (hybridattn.sharding.make_mesh)")
        D, tensor = mesh_sizes(mesh)
        check_divisible(config, D, tensor)
        if prefix_cache:
            raise ValueError("prefix_cache=True is not supported with a mesh: the prefix cache "
                             "(a radix tree over one token pool, with KDA state snapshots) "
                             "serves one device; pass prefix_cache=False or leave it unset "
                             "(the default is False under a mesh)")
        for name, n in (("max_running_requests", max_running_requests),
                        ("num_token_slots", num_token_slots)):
            if n is not None:
                check_int(name, n, 1)
                if n % D:
                    raise ValueError(f"{name}={n} is not divisible by the mesh's data size "
                                     f"{D} (each data shard has its own rows and token slots)")
        if num_token_slots is not None and num_token_slots // D < 2:
            raise ValueError(f"num_token_slots={num_token_slots} leaves a data shard (of {D}) "
                             "no token slot besides its sink")
        return D

    def _call(self, fn, *args, **kwargs):
        """Run one of this engine's jitted functions, counting a compilation it needed."""
        before = self._compilations()
        if self._sharded is None:
            out = self._jit.call(fn, *args, **kwargs)
        else:  # the ShardedStep's own functions: they count their traces
            out = fn(*args, **kwargs)
        self.stats.num_compilations += self._compilations() - before
        return out

    # ---------------------------------------------------------------------------------------
    # requests
    # ---------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = 0,
        stop_token_ids: int | Sequence[int] | None = None,
    ) -> int:
        """Queue a request; returns its id (ids count up from 0). It is admitted by a later
        round once a row and the token slots for its whole life (prompt +
        ``max_new_tokens - 1``) are free; ``step`` returns its tokens. ``prompt`` is token
        ids, text or a chat (``servecore.prompts``; text and chats need the tokenizer).
        Generation ends after ``max_new_tokens`` tokens or on a token in ``stop_token_ids``
        (which is kept; default: the EOS ids of the tokenizer and the config, none without a
        tokenizer).
        Raises ``ValueError`` naming the bad value, and then nothing has changed."""
        with self._lock:
            req = self._make_request(prompt, max_new_tokens, temperature, top_p, top_k, seed,
                                     stop_token_ids)
            self._next_rid += 1
            self.scheduler.add(req)
            return req.rid

    def _make_request(self, prompt, max_new_tokens, temperature, top_p, top_k, seed,
                      stop_token_ids, what: str = "prompt") -> Request:
        """A validated request with the next id (nothing queued)."""
        V = self.config.vocab_size
        ids = encode_prompt(what, prompt, self.tokenizer, V)
        check_int("max_new_tokens", max_new_tokens, 1)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed)
        stop = self._eos if stop_token_ids is None else stop_ids(stop_token_ids, V)
        req = Request(self._next_rid, ids, int(max_new_tokens), sampling, stop)
        if req.need > min(self.max_context_len, self.shard_capacity):
            short = ("max_context_len" if req.need > self.max_context_len else
                     "the token pool" if self.mesh is None else "a data shard's token pool")
            raise ValueError(
                f"{what} of {len(ids)} tokens + max_new_tokens={max_new_tokens} needs a context "
                f"of {req.need} tokens, more than {short} holds: this engine has max_context_len="
                f"{self.max_context_len} and {self.shard_capacity} token slots (num_token_slots="
                f"{self.shard_capacity + 1}, the sink included)"
                + ("" if self.mesh is None else f" per data shard (of {self.num_data_shards})")
                + "; shorten the prompt or build the engine with more of both")
        return req

    def abort(self, rid: int) -> bool:
        """End request ``rid`` (waiting or running; its slots are released at once). Safe at
        any point; a stream owning it ends that request, and tokens of it generated but not
        received yet (a round commits several per request with ``decode_steps``) are dropped,
        from the stream and from what ``step`` returns. Returns whether it was still
        unfinished, or had tokens not received yet."""
        with self._transaction():
            sink = self._sinks.get(rid)
            dropped = False
            for buf in (sink, self._outbox):
                if buf is not None and any(e[0] == rid for e in buf):
                    kept = [e for e in buf if e[0] != rid]
                    buf.clear()
                    buf.extend(kept)
                    dropped = True
            req = self.scheduler.abort(rid)
            if req is None and not dropped:
                return False
            if req is not None:
                self._flush_ops()
            if sink is not None:
                sink.append((rid, None, True))
            return True

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        with self._lock:
            if self._orphans and not self._busy:
                with self._transaction():
                    self._reap_orphans()
            s = self.scheduler
            return bool(s.waiting or s.running or s.releasing)

    def _reap_orphans(self) -> None:
        """Abort the requests of streams dropped while a transaction was in progress."""
        while self._orphans:
            rid = self._orphans.popleft()
            self._sinks.pop(rid, None)
            self.scheduler.abort(rid)
        self._flush_ops()

    @property
    def num_running(self) -> int:
        """Admitted requests (holding a row and their token-slot reservation)."""
        return self.scheduler.num_running

    @property
    def num_free_slots(self) -> int:
        """Token slots neither held by a request nor by the prefix cache (a device read)."""
        return int(np.sum(self.state.token_allocator.num_free))  # summed over data shards

    @property
    def num_cached_slots(self) -> int:
        """Token slots the prefix cache holds (0 without it)."""
        return self.scheduler.cached_size

    @property
    def tree(self):
        """The prefix cache's radix tree (``servecore.radix.RadixCache``; None without a
        cache). Read it (``tree.pretty()``); do not modify it."""
        return self.scheduler.tree

    def reset_cache(self) -> None:
        """Forget every cached prefix and snapshot that no running request holds (their token
        and snapshot slots are freed); what running requests hold stays until they finish.

        >>> from hybridattn.models import kimi_linear
        >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
        >>> engine = Engine(cfg, kimi_linear.init_params(cfg, jax.random.key(0)),
        ...                 max_running_requests=2, max_context_len=16, num_token_slots=33,
        ...                 snapshot_interval=32, num_snapshot_slots=9)
        >>> _ = engine.generate([[1, 2, 3]], 2)
        >>> engine.num_cached_slots, engine.tree.num_states  # prompt + answer, 2 snapshots
        (4, 2)
        >>> engine.reset_cache()
        >>> engine.num_cached_slots, engine.num_free_slots == engine.capacity
        (0, True)
        """
        with self._transaction():
            self.scheduler.reset_cache()
            self._flush_ops()

    @property
    def num_waiting(self) -> int:
        """Queued requests not admitted yet."""
        return self.scheduler.num_waiting

    # ---------------------------------------------------------------------------------------
    # one scheduling round
    # ---------------------------------------------------------------------------------------

    def step(self) -> list[tuple[int, int, bool]]:
        """One scheduling round (admit, schedule, run one step, finish); returns ``(request
        id, token, finished)`` for every token of the requests queued with ``add_request``
        that nobody has received yet: those committed by this round and by rounds a
        ``stream`` or ``generate`` ran since the last ``step`` (none for a round that only ran
        prompt chunks, or when nothing is queued). With ``overlap`` a step's tokens are
        committed by the round after it, so they come with the next call."""
        with self._lock:
            self._round()
            events, self._outbox = self._outbox, []
            return events

    def _round(self) -> bool:
        """One round, as a transaction; returns whether a step ran or was committed.

        With a run in flight (overlapped scheduling) the round first admits what fits now
        and dispatches the step that follows that run (``_continuation``), then commits the
        run, and ends. Otherwise (nothing in flight, or nothing to follow it) it commits, then
        admits, plans and dispatches; with ``overlap`` the step stays in flight."""
        with self._transaction():
            self._reap_orphans()
            ran = False
            if self._inflight is not None:
                t_plan = time.perf_counter()
                prev = self._inflight
                if prev.ready_by is None and prev.tokens.is_ready():
                    prev.ready_by = t_plan
                follow = self._continuation()
                nxt = None if follow is None else self._launch(follow[0], t_plan, follow[1])
                self._inflight = nxt
                self._commit(prev)
                self._flush_ops()
                if nxt is not None and all(r.finished for r, _ in nxt.plan.work):
                    # every request of it finished in the step before (a stop token): it runs
                    # padding only; commit it now rather than leave it for a later round
                    self._inflight = None
                    self._commit(nxt)
                    self._flush_ops()
                    nxt = None
                if nxt is not None:
                    return True
                ran = True
            self._admit()
            t_plan = time.perf_counter()
            plan = self.scheduler.plan()
            if plan is None:
                return ran
            run = self._launch(plan, t_plan)
            if self.overlap:
                self._inflight = run
            else:
                self._commit(run)
                self._flush_ops()
            return True

    def _admit(self) -> None:
        """Admit waiting requests while rows and token slots allow (FIFO), then carry out
        the device ops admission queued (frees of what it evicted) before a step allocates."""
        while (adm := self.scheduler.admit_next()) is not None:
            try:
                row = self._admit_row(adm)
            except BaseException:
                self.scheduler.cancel(adm)
                raise
            self.scheduler.admitted(adm, row)
        self._flush_ops()

    def _continuation(self) -> tuple[StepPlan, _Follow] | None:
        """The step that can follow the run in flight before its tokens are known, and how
        that run's output feeds it; None when there is nothing to run without them.

        Requests waiting are admitted first, into the rows and token slots free now (those
        that the run in flight frees come with the next round). Each running request is
        planned from ``computed`` + the tokens it runs in flight (``Scheduler.plan(ahead)``):
        its prompt's next chunk, or one decode token that, when the run in flight samples
        it, comes from that run's output on the device (``_follow``). A request that reaches
        ``max_new_tokens`` in flight is left out; one that samples a stop token there is
        padding on the device and skipped at this step's commit."""
        run, sched = self._inflight, self.scheduler
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
            if len(r.output) + samples[r] >= r.max_new_tokens:
                leaving.append(r)
        self._admit()
        nxt = sched.plan(ahead, leaving)
        if nxt is None:
            return None
        rows = [r for r, _ in nxt.work if r in fed]
        if rows and max(len(r.stop_token_ids) for r in rows) > STOP_BUCKETS[-1]:
            return None  # more stop ids than the device checks: wait for the tokens
        cols, last = zip(*(fed.get(r, (-1, 0)) for r, _ in nxt.work), strict=True)
        return nxt, _Follow(cols, last, tuple(rows), samples, len(leaving))

    def _packed(self, plan: StepPlan | ShardedPlan) -> tuple[Any, Any]:
        """The jitted step that runs ``plan`` and its batch, packed on the host to the plan's
        buckets: ``self._call(fn, self.params, self.state, batch)`` runs it."""
        B, T, W, Q = plan.buckets
        shape = dict(vocab_size=self.config.vocab_size, max_context_len=self.max_context_len,
                     forward_mode=plan.mode, num_requests=B, num_tokens=T, kv_width=W,
                     max_extend_len=Q, num_snapshots=plan.num_snapshots,
                     snapshot_chunk=self.scheduler.chunk_size)
        if self._sharded is None:
            return self._jit.step, make_worker_batch(plan.items(), **shape)
        # one work list per data shard, one step for all of them
        return self._sharded, self._sharded.make_batch(plan.items(), **shape)

    def _multi_step_limits(self, plan: StepPlan | ShardedPlan,
                           follow: _Follow | None = None) -> list[int] | None:
        """The steps each request of ``plan`` may run in one multi-step decode dispatch
        (None: this round runs one step). Only a pure ``DECODE`` plan on one device, and only
        when nothing could join before the run ends: no request waits, or none running can
        reach its ``max_new_tokens`` before the run's last step (the head of the queue waits
        for a row or token slots that only a finish frees). Each request runs at most its
        tokens left and what the plan's attention-width bucket has room for, counting, for a
        plan that follows a run in flight (``follow``), the tokens it runs there
        (``plan.ahead``) and samples there; a request leaving in flight (its row frees when
        that run is committed) counts as finishing before the run's last step."""
        N = self.decode_steps
        if N == 1 or self._sharded is not None or plan.mode != ForwardMode.DECODE:
            return None
        ahead = plan.ahead or (0,) * len(plan.work)
        samples = follow.samples if follow is not None else {}
        left = [r.max_new_tokens - len(r.output) - samples.get(r, 0) for r, _ in plan.work]
        leaving = follow is not None and follow.leaving > 0
        if self.scheduler.waiting and (leaving or min(left) < N):
            return None
        if max(len(r.stop_token_ids) for r, _ in plan.work) > STOP_BUCKETS[-1]:
            return None
        W = plan.buckets[2]
        limits = [min(N, k, W - r.computed - a)
                  for (r, _), k, a in zip(plan.work, left, ahead, strict=True)]
        return limits if max(limits) > 1 else None

    def _stop_ids(self, plan: StepPlan, only: Collection[Request] | None = None) -> np.ndarray:
        """Each work item's stop ids ``[B, S]`` (with ``only``, those requests' alone),
        padded with -1 (``S`` from ``STOP_BUCKETS``)."""
        which = [(i, r) for i, (r, _) in enumerate(plan.work) if only is None or r in only]
        S = bucket(max([1, *(len(r.stop_token_ids) for _, r in which)]), STOP_BUCKETS,
                   "stop token ids of a request")
        stops = np.full((plan.buckets[0], S), -1, np.int32)
        for i, r in which:
            stops[i, : len(r.stop_token_ids)] = sorted(r.stop_token_ids)
        return stops

    def _packed_decode(self, plan: StepPlan, limits: Sequence[int]) -> tuple[Any, tuple]:
        """The jitted multi-step decode and its arguments after the state: the DECODE batch,
        each row's stop ids ``[B, S]`` (``_stop_ids``) and its step limit ``[B]`` (0 for
        padding rows)."""
        B, T, W, Q = plan.buckets
        batch = make_worker_batch(plan.items(), vocab_size=self.config.vocab_size,
                                  max_context_len=self.max_context_len,
                                  forward_mode=ForwardMode.DECODE, num_requests=B,
                                  num_tokens=T, kv_width=W, max_extend_len=Q)
        lim = np.zeros(B, np.int32)
        lim[: len(limits)] = limits
        return self._jit.decode(self.decode_steps), (batch, jnp.asarray(self._stop_ids(plan)),
                                                     jnp.asarray(lim))

    def _decode_run_steps(self, plan: StepPlan, tokens: np.ndarray,
                          limits: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """A multi-step decode's ``tokens [N, B]`` as the single steps it ran: per step the
        indices in ``plan.work`` of the requests that ran it and their tokens, in order.
        Checked against the host's own finishing rule (each request runs until a stop token
        or its limit) before anything is committed; a disagreement raises ``RuntimeError``
        and changes nothing."""
        runs = []
        for j, ((r, _), limit) in enumerate(zip(plan.work, limits, strict=True)):
            col = tokens[:, j].tolist()
            n = next((i for i, t in enumerate(col) if t < 0), len(col))
            ran = col[:n]
            stopped = [i for i, t in enumerate(ran) if t in r.stop_token_ids]
            if (any(t >= 0 for t in col[n:]) or (stopped and stopped[0] != n - 1)
                    or not (n == limit or stopped)):
                raise RuntimeError(f"a multi-step decode ran request {r.rid} for {n} steps "
                                   f"({ran}); the host expected a stop token in "
                                   f"{sorted(r.stop_token_ids)} or {limit} steps")
            runs.append(ran)
        steps = []
        for i in range(max(map(len, runs), default=0)):
            idx = [j for j, ran in enumerate(runs) if i < len(ran)]
            steps.append((idx, [runs[j][i] for j in idx]))
        return steps

    def _launch(self, plan: StepPlan | ShardedPlan, t_plan: float,
                follow: _Follow | None = None) -> _Run:
        """Pack and dispatch ``plan`` (planned from ``t_plan`` on): one step, or a multi-step
        decode (``decode_steps``); returns the run, its outputs still on the device. With
        ``follow`` (``_continuation``'s) the rows it names take their tokens from the output
        of the run in flight."""
        limits = self._multi_step_limits(plan, follow)
        key = (int(plan.mode), *plan.buckets) + (() if plan.num_snapshots is None else (
            plan.num_snapshots,)) + (() if limits is None else (self.decode_steps,))
        traces = self._compilations()
        t_pack = time.perf_counter()
        if limits is None:
            fn, batch = self._packed(plan)
            rest = ()
        else:
            fn, (batch, *rest) = self._packed_decode(plan, limits)
        prev = self._inflight if follow is not None else None
        if follow is not None and follow.fed:
            B = plan.buckets[0]
            cols, last = np.full(B, -1, np.int32), np.zeros(B, np.int32)
            cols[: len(follow.cols)], last[: len(follow.last)] = follow.cols, follow.last
            stops = rest[0] if rest else jnp.asarray(self._stop_ids(plan, follow.fed))
            batch = self._call(self._jit.follow, batch, prev.tokens, jnp.asarray(cols),
                               jnp.asarray(last), stops)
        if limits is None:
            self.state, out = self._call(fn, self.params, self.state, batch)
            tokens, ok, slots = out.next_token_ids, out.ok, out.token_slots
        else:
            self.state, tokens, ok, slots = self._call(fn, self.params, self.state, batch,
                                                       *rest)
        t_call = time.perf_counter()  # dispatched: the host side is done until the outputs
        # the device had nothing queued while this run was planned, unless the run before
        # it was still computing when it was dispatched
        busy = prev is not None and not prev.tokens.is_ready()
        return _Run(plan, limits, tokens, ok, slots, key, self._compilations() > traces,
                    t_plan, t_pack, t_call, 0.0 if busy else t_call - t_plan,
                    follow.fed if follow is not None else ())

    def _commit(self, run: _Run) -> None:
        """Wait for ``run``'s tokens and commit them: one step, or a multi-step decode whose
        tokens are committed step by step. Requests that finished since it was dispatched
        (aborted, or stopped in the run before it) are skipped."""
        t_wait = time.perf_counter()
        tokens = np.asarray(run.tokens)  # [B], [D][B] under a mesh, or [N, B]
        # read, not reduced on the device: a reduction would queue behind the next run
        ok = np.asarray(run.ok)
        now = time.perf_counter()
        if not ok.all():  # unreachable (the reservation); only the sinks were written
            raise RuntimeError("token slots ran out inside a step despite the reservation")
        self._check_rows()
        plan, limits = run.plan, run.limits
        sched = self.scheduler
        if sched.tree is not None:  # the slots the prefix cache will read
            self._record_slots(run, tokens, np.asarray(run.slots))
        # -- commit: plain Python from here on --
        if isinstance(plan, StepPlan) and any(r.finished for r, _ in plan.work):
            keep = [j for j, (r, _) in enumerate(plan.work) if not r.finished]
            plan = dataclasses.replace(
                plan, work=tuple(plan.work[j] for j in keep), ahead=(),
                restores=tuple(plan.restores[j] for j in keep) if plan.restores else (),
                snapshots=tuple(plan.snapshots[j] for j in keep) if plan.snapshots else ())
            tokens = tokens[..., keep]
            limits = None if limits is None else [limits[j] for j in keep]
        if limits is None:
            steps = [(plan, tokens.tolist())] if plan.work else []
        else:  # checked before anything is recorded
            reqs = [r for r, _ in plan.work]
            steps = self._decode_run_steps(plan, tokens, limits)
        s = self.stats
        # when its outputs were ready: now, or earlier if a round found them ready before
        ready = now if run.ready_by is None else min(now, run.ready_by)
        start = max(run.t_pack, self._last_ready)  # a run dispatched early starts at the last
        self._last_ready = ready
        s.buckets.add(run.key)
        if run.compiled:  # this call compiled (the step, or the _follow of its bucket)
            # compiling is the dispatch's (synchronous) part, then its first run
            sec = (run.t_call - run.t_pack) + max(0.0, ready - max(run.t_call, start))
            if run.key not in s.bucket_compile_seconds:
                s.compiled_buckets.append(run.key)
            s.bucket_compile_seconds[run.key] = s.bucket_compile_seconds.get(run.key, 0.0) + sec
            s.compile_seconds += sec
        if not plan.work:  # all its requests had finished: it ran padding, nothing more to count
            return
        s.steps += len(steps)
        prefill = plan.prompt_tokens > 0  # read before the commit advances the requests
        if not prefill:
            s.decode_rounds += 1
        if prefill and not run.compiled:  # (a compiling run's time is the compile's, above)
            s.prefill_tokens += plan.prompt_tokens
            s.prefill_seconds += ready - start
        elif not run.compiled:
            s.decode_tokens += (plan.num_tokens if limits is None
                                else sum(len(toks) for _, toks in steps))
            s.decode_seconds += ready - start
        first = [r for r, toks in plan.work if r.computed + len(toks) == len(r.prompt)]
        events = []
        if limits is None:
            if steps:
                events, _ = sched.commit(plan, steps[0][1], self._read_slots)
        else:
            for idx, toks in steps:  # each step as it would have run alone
                sub = StepPlan(ForwardMode.DECODE, tuple(
                    (reqs[j], [reqs[j].token_at(reqs[j].computed)]) for j in idx),
                    plan.buckets)
                events += sched.commit(sub, toks, self._read_slots)[0]
        for r in first:
            s.requests += 1
            s.prompt_tokens += len(r.prompt)
            s.cached_tokens += r.start
            s.ttft.append(ready - r.arrival)
        s.snapshots_taken, s.state_evictions, s.token_evictions = (
            sched.snapshots_taken, sched.state_evictions, sched.token_evictions)
        for event in events:
            self._sinks.get(event[0], self._outbox).append(event)
        if not run.compiled:
            done = time.perf_counter()
            # the commit is hidden while the next run computes (if it is still computing)
            covered = self._inflight is not None and not self._inflight.tokens.is_ready()
            host = (run.t_call - run.t_plan) + (done - now)
            if prefill:
                s.prefill_host_seconds += host
                s.prefill_wait_seconds += now - t_wait
            else:
                s.decode_host_seconds += host
                s.decode_wait_seconds += now - t_wait
                s.decode_exposed_seconds += run.exposed + (0.0 if covered else done - now)

    @staticmethod
    def _record_slots(run: _Run, tokens: np.ndarray, slots: np.ndarray) -> None:
        """Extend each request's ``row_slots`` by the token slots ``run`` wrote for it (one
        ``EXTEND`` step: ``slots [T]``, its tokens packed in work order, a row that ``_follow``
        made padding holding none; one ``DECODE`` step: ``[B]``, row by row; a multi-step
        decode: ``[N, B]``, the steps each row ran). A position below what a row borrows
        keeps the borrowed slot (the step wrote the recomputed token to the sink), as
        ``req_to_token`` does."""
        dead = {r for r in run.fed if r.finish_reason == "stop"}  # padding on the device
        extend = run.plan.mode != ForwardMode.DECODE
        at = 0
        for j, (r, toks) in enumerate(run.plan.work):
            if run.limits is not None:
                new = slots[: int(np.sum(tokens[:, j] >= 0)), j].tolist()
            elif not extend:
                new = [] if r in dead else [int(slots[j])]
            else:
                n = 0 if r in dead else len(toks)
                new, at = slots[at: at + n].tolist(), at + n
            if r.finished:  # aborted, or stopped in the run before: nothing to record
                continue
            have = r.row_slots
            skip = len(have) - r.computed  # positions from computed on already held
            if skip < 0:  # cannot happen: admission records what the row borrows
                raise RuntimeError(f"request {r.rid}: the host holds {len(have)} of its row's "
                                   f"token slots but {r.computed} positions ran")
            if skip < len(new):
                have.extend(new[max(skip, 0):])

    def _admit_row(self, adm: Admission) -> int:
        """Allocate the admitted request's row on the device; with a cache hit the row also
        borrows the matched KV and records the restored depth. Returns the row."""
        if self._sharded is not None:  # a local row of the request's data shard
            counts = [int(k == adm.req.shard) for k in range(self.num_data_shards)]
            new, rows, oks = self._call(self._sharded.try_alloc_rows, self.state, counts)
            rows, ok = rows[adm.req.shard] or [0], oks[adm.req.shard]
        else:
            # The row is known on the host (the device's free stack, mirrored), so nothing
            # is read back: with a step in flight a read would wait for it. The device's
            # answer is checked at the next commit (_check_rows).
            if self.scheduler.tree is None:
                pool, rows, ok = self._call(self._jit.alloc_row, self.state.req_to_token_pool)
                new = self.state.replace(req_to_token_pool=pool)
            else:
                W = bucket(max(adm.borrowed, 1), self.kv_buckets, "cached prefix")
                slots = np.zeros((1, W), np.int32)
                slots[0, : adm.borrowed] = adm.slots
                new, rows, ok = self._call(self._jit.admit, self.state,
                                           jnp.asarray([adm.borrowed], jnp.int32),
                                           jnp.asarray(slots),
                                           jnp.asarray([adm.computed], jnp.int32))
            self.state = new
            row = self._free_rows.pop()
            self._row_checks.append((rows, ok, row))
            adm.req.row_slots = list(adm.slots)
            return row
        self.state = new
        if not bool(ok):  # cannot happen while the host counts agree with the pool
            raise RuntimeError("request-row allocation failed with rows counted free")
        return int(rows[0])

    def _check_rows(self) -> None:
        """The rows the device allocated equal the host's mirror of its free stack (read at a
        commit, when they are ready); a disagreement cannot happen and raises."""
        checks, self._row_checks = self._row_checks, []
        for rows, ok, row in checks:
            got = int(np.asarray(rows)[0])
            if not bool(np.asarray(ok)) or got != row:
                raise RuntimeError(f"request-row allocation gave row {got} (ok="
                                   f"{bool(np.asarray(ok))}); the host expected row {row}")

    def _flush_ops(self) -> None:
        """Carry out the device ops the scheduler queued, in order (frees of evicted slots,
        borrowed prompts, releases of finished requests); one that fails stays queued and is
        retried by the next round."""
        sched = self.scheduler
        if self._sharded is not None:
            self._flush_sharded()
            return
        while sched.device_ops:
            op = sched.device_ops[0]
            if isinstance(op, FreeSlots):
                n = 1 << max(len(op.slots) - 1, 0).bit_length()  # one compile per power of 2
                slots = np.zeros(n, np.int32)
                slots[: len(op.slots)] = op.slots
                self.state = self._call(self._jit.free_tokens, self.state, jnp.asarray(slots))
            elif isinstance(op, Borrow):
                W = bucket(len(op.slots), self.kv_buckets, "cached prompt")
                slots = np.zeros((1, W), np.int32)
                slots[0, : len(op.slots)] = op.slots
                self.state = self._call(self._jit.borrow, self.state,
                                        jnp.asarray([op.req.row], jnp.int32),
                                        jnp.asarray([len(op.slots)], jnp.int32),
                                        jnp.asarray(slots))
                op.req.row_slots[: len(op.slots)] = op.slots
            elif isinstance(op, Release):
                self.state = self._release_rows(op.reqs)
            sched.op_done(op)

    def _flush_sharded(self) -> None:
        """Under a mesh the only device ops are releases: every shard's queued releases in one
        sharded call (each shard's rows padded with row 0 to its row count, one compile)."""
        sched = self.scheduler
        ops = sched.device_ops
        if not ops:
            return
        R = self.max_running_requests // self.num_data_shards
        rows = [[] for _ in range(self.num_data_shards)]
        for op in ops:
            for r in op.reqs:
                rows[r.shard].append(r.row)
        self.state = self._call(self._sharded.release, self.state,
                                [r + [0] * (R - len(r)) for r in rows])
        for op in ops:
            sched.op_done(op)

    def _release_rows(self, done: Sequence[Request]) -> ServingState:
        R = self.request_buckets[-1]
        rows = np.zeros(R, np.int32)
        rows[: len(done)] = [r.row for r in done]
        if self.scheduler.tree is None:
            state = self._call(self._jit.release, self.state, jnp.asarray(rows))
        else:
            keep = np.full(R, self.max_context_len, np.int32)
            keep[: len(done)] = [self.max_context_len if r.keep_from is None else r.keep_from
                                 for r in done]
            snaps = np.zeros(R, np.int32)
            snaps[: len(done)] = [r.finish_slot if r.end_depth else 0 for r in done]
            state = self._call(self._jit.release, self.state, jnp.asarray(rows),
                               keep_from=jnp.asarray(keep), snapshot_slots=jnp.asarray(snaps))
        self._free_rows.extend(r.row for r in done)  # freed in this order, as the device does
        return state

    def _read_slots(self, req: Request, n: int) -> list[int]:
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

    def warmup(self, progress: bool = False) -> None:
        """Compile the smallest buckets (one prefill step, one decode step) by serving a
        one-token request, then reset the throughput counters (compilations are kept). With
        one bucket per dimension that is every compilation the engine will need.
        ``progress`` shows the two steps as a tqdm bar on stderr when it is a terminal."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        # no stop ids: a first token that is the tokenizer's EOS must not skip the decode step
        with self.stream([[0]], 2, stop_token_ids=[], progress=progress) as stream:
            if stream._bar is not None:
                stream._bar.set_description("compiling the prefill and decode steps")
            for _ in stream:
                pass
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the throughput and cache counters and TTFTs; compilation counts and buckets
        stay."""
        sched = self.scheduler
        sched.snapshots_taken = sched.state_evictions = sched.token_evictions = 0
        s = self.stats
        self.stats = EngineStats(num_compilations=s.num_compilations,
                                 compile_seconds=s.compile_seconds, buckets=s.buckets,
                                 compiled_buckets=s.compiled_buckets,
                                 bucket_compile_seconds=s.bucket_compile_seconds)

    def stream(
        self,
        prompts: Iterable[Prompt],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop_token_ids: int | Sequence[int] | None = None,
        progress: bool = False,
    ) -> Stream:
        """Serve ``prompts`` and yield ``(prompt index, token)`` as tokens are generated.
        ``prompts`` is a list of prompts, each token ids, text or a chat (a list of
        ``{"role", "content"}`` dicts): ``servecore.prompts`` has the rule. Request ``i``
        samples with seed ``seed + i``. All prompts are validated and queued before this
        returns (a ``ValueError`` names the bad prompt, and then nothing is queued); the
        returned ``Stream`` advances the engine as it is iterated. Requests left when the
        consumer stops early (``close()``, ``break``, or dropping the stream) are aborted.
        ``progress`` draws a tqdm bar of the tokens on stderr when it is a terminal."""
        prompts = prompt_list(prompts)
        check_int("seed", seed, 0)
        with self._lock:
            reqs = []
            for i, p in enumerate(prompts):  # validate every prompt before queueing any
                req = self._make_request(p, max_new_tokens, temperature, top_p, top_k,
                                         seed + i, stop_token_ids, what=f"prompt {i}")
                req.rid = self._next_rid + i
                reqs.append(req)
            self._next_rid += len(reqs)
            out = Stream(self, {r.rid: i for i, r in enumerate(reqs)}, progress,
                         len(reqs) * int(max_new_tokens))
            for req in reqs:
                self.scheduler.add(req)
            return out

    def generate(
        self,
        prompts: Iterable[Prompt],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop_token_ids: int | Sequence[int] | None = None,
        progress: bool = False,
        text: bool = False,
    ) -> list[list[int]] | list[str]:
        """Generate for every prompt; returns the new tokens of each (a stop token, when hit,
        is the last), or with ``text=True`` their text (``servecore.prompts.decode``: the
        tokenizer's decoding, without the stop token that ended the request). Same arguments
        as ``stream``; see the class docstring for examples."""
        check_text(text, self.tokenizer)
        stream = self.stream(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
                             progress=progress)
        outs: list[list[int]] = [[] for _ in range(stream.num_prompts)]
        with stream:
            for i, tok in stream:
                outs[i].append(tok)
        if text:
            stop = self._eos if stop_token_ids is None else stop_ids(stop_token_ids,
                                                                     self.config.vocab_size)
            return [decode(self.tokenizer, o, stop) for o in outs]
        return outs


def _buckets(name: str, given: Sequence[int] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    if given is None:
        return default
    bk = tuple(given)
    if not bk or not all(isinstance(b, int) and not isinstance(b, bool) for b in bk) or (
            list(bk) != sorted(set(bk)) or bk[0] < 1):
        raise ValueError(f"{name}={given!r} must be increasing positive ints")
    return bk


class Stream(Iterator[tuple[int, int]]):
    """The iterator ``Engine.stream`` returns: ``(prompt index, token)`` of its own requests,
    in the order they were generated, advancing the engine when it has none buffered. It ends
    when each of its requests has finished (or was aborted); ``close()`` (also on leaving a
    ``with`` block, or when the stream is garbage-collected) aborts what is left.

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> engine = Engine(cfg, kimi_linear.init_params(cfg, jax.random.key(0)),
    ...                 max_running_requests=2, max_context_len=16, num_token_slots=33)
    >>> a, b = engine.stream([[1, 2]], 3), engine.stream([[3]], 3)
    >>> [next(a)[1], next(b)[1]] == [engine.generate([[1, 2]], 1)[0][0],
    ...                              engine.generate([[3]], 1)[0][0]]
    True
    >>> a.close(); len(list(b)), engine.has_unfinished()
    (2, False)
    """

    def __init__(self, engine: Engine, index: dict[int, int], progress: bool, total: int):
        self._engine = engine
        self._index = index  # rid -> prompt index
        self._left = set(index)
        self._events: deque = deque()
        # tokens of this stream's requests, generated (or given up: a stop token ends a
        # request early) out of len(index) * max_new_tokens
        self._total = total
        self._bar = progress_bar(total=total, unit="tok", desc="generating",
                                 enabled=progress, leave=False) if progress else None
        for rid in index:
            engine._sinks[rid] = self._events

    @property
    def num_prompts(self) -> int:
        """How many prompts the stream serves."""
        return len(self._index)

    @property
    def request_ids(self) -> list[int]:
        """The engine's request id of each prompt, in prompt order (for ``Engine.abort``)."""
        return sorted(self._index, key=self._index.__getitem__)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> tuple[int, int]:
        eng = self._engine
        while True:
            with eng._lock:
                while self._events:
                    rid, tok, finished = self._events.popleft()
                    if finished:
                        self._left.discard(rid)
                        eng._sinks.pop(rid, None)
                    if tok is not None:
                        return self._index[rid], tok
                if not self._left:
                    self._end()
                    raise StopIteration
                ran = eng._round()
                if self._bar is not None:
                    left = sum(r.max_new_tokens - len(r.output) for r in
                               (*eng.scheduler.waiting, *eng.scheduler.running)
                               if r.rid in self._left)
                    self._bar.update(self._total - left - self._bar.n)
                if not ran and not self._events:  # cannot happen: validation ensures a fit
                    raise RuntimeError(f"the engine has nothing to run but requests "
                                       f"{sorted(self._left)} of this stream are unfinished")

    def close(self) -> None:
        """Abort this stream's unfinished requests and stop yielding."""
        eng = self._engine
        with eng._lock:
            left, self._left = sorted(self._left), set()
            for rid in left:
                eng._sinks.pop(rid, None)
                eng.abort(rid)
            self._events.clear()
            self._end()

    def _end(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer may run anywhere, a round of this thread or another included: abort now
        # only when no transaction is in progress and the lock is free without waiting;
        # otherwise the engine's next round (or has_unfinished) aborts what is left.
        try:
            if not self._left:
                return
            eng = self._engine
            if not eng._busy and eng._lock.acquire(blocking=False):
                try:
                    if not eng._busy:
                        self.close()
                        return
                finally:
                    eng._lock.release()
            eng._orphans.extend(self._left)
        except Exception:  # interpreter shutdown
            pass

