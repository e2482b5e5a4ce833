"""Continuous-batching generation with radix prefix reuse for unmodified mlx-lm models.

``Engine`` serves many prompts at once. Its host side is plain Python (a waiting queue,
admission, finishing); its device side is the model called as ``model(inputs, cache=caches)``
with ``RaggedKVCache`` caches. Nothing in the model is patched.

One request's life (prefix reuse on):

1. *admit*: ``match_prefix`` finds the longest cached prefix and the matched node is locked;
   slots for the tokens the tree lacks are allocated, evicting least recently used unlocked
   prefixes if the pool is short. (A full hit runs its last token again, for its logits, but
   needs no slot: that token's K/V is in the tree already.) If even
   that fails while other requests run, the request waits for them to finish. Requests are
   admitted fewest uncached tokens first, together into one *prefill batch* while their
   padded new tokens fit ``prefill_step_size`` and their uncached tokens
   ``prefill_batch_tokens`` (on MLX's CPU device also at most ``round(sqrt(c N / n))`` of the
   ``N`` waiting, ``n`` uncached tokens each on average: ``CPU_FORWARD_COST_TOKENS``); a
   request that shares a good part of its uncached tokens with one
   already in the batch waits for the next batch, so that it reuses that prefix once inserted.
   While requests wait, prefill batches run back to back, before the next decode step.
2. *prefill*: each row starts from its prefix gathered from the pool; only the new tokens run
   through the model, all rows in one forward (one long prompt alone, in chunks). The new K/V
   are written to the pool at the new slots, each prompt is inserted into the radix tree
   (duplicate slots, when another request inserted the same tokens first, are freed) and each
   request's lock moves to its whole prompt.
3. *decode*: the request joins the running batch (a row of every layer's decode cache); all
   running requests advance one token per forward, each with its own sampling parameters.
   The next step is queued before the host reads this step's tokens (``mx.async_eval``).
4. *finish*: the K/V of the generated tokens are written to the pool and prompt + answer are
   inserted, so a follow-up turn reuses them; the lock is released.

Models whose cache is not plain ``KVCache`` (hybrid/SSM ``ArraysCache``, sliding-window
``RotatingKVCache``, ``QuantizedKVCache``, ...) cannot be served from a KV-only tree without
restoring stale state. They are served without reuse, one request per forward with mlx-lm's own
caches, after a ``ReuseDisabledWarning``. So are models whose attention rejects per-row
positions (detected by a probe at start), minus the reuse restriction: those keep reuse.

Examples:
    A tiny random llama (mlx-lm's own class; any ``mlx_lm.load``-ed model serves the same way),
    two prompts that share a prefix, then a follow-up turn that reuses prompt and answer:

    >>> from mlxcache.zoo import make_model
    >>> engine = Engine(make_model(), num_slots=256)
    >>> first, second = engine.generate([[5, 6, 7, 8], [5, 6, 7, 9]], max_tokens=3)
    >>> len(first), len(second), engine.stats.cached_tokens   # [5, 6, 7] was reused
    (3, 3, 3)
    >>> follow_up = [5, 6, 7, 8, *first, 10]
    >>> _ = engine.generate([follow_up], max_tokens=2)
    >>> engine.stats.cached_tokens - 3          # the first prompt and its whole answer
    7
    >>> engine.stats.cached_tokens, engine.stats.prompt_tokens, engine.stats.hit_rate
    (10, 16, 0.625)
    >>> print(engine.tree.pretty())                             # doctest: +ELLIPSIS
    RadixCache(page_size=1, total=..., evictable=..., protected=0)
    root extra_key=None
    └── [5, 6, 7] slots=[...] lock=0
    ...
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.cache import RaggedArraysCache, RaggedKVCache
from mlxcache.layers import Layout, build, describe, leaves
from mlxcache.pool import (
    POOL_NAME,
    PoolExhausted,
    alloc,
    bytes_per_token_slot,
    free,
    get_states,
    init_allocator,
    init_pool,
    init_state_pool,
    set_kv_all_layers,
    set_states,
)
from mlxcache.radix import RadixCache, TreeNode
from mlxcache.sampling import SamplingParams, next_key, sample
from servecore.memory import memory_budget
from servecore.prompts import Prompt, check_text, decode, encode_prompt
from servecore.snapshots import snapshot_points
from servecore.stats import ServingStats
from servecore.validate import (
    check_int,
    check_real,
    eos_token_ids,
    prompt_list,
    stop_ids,
)

__all__ = ["Engine", "EngineStats", "ReuseDisabledWarning", "auto_num_slots"]

log = logging.getLogger("mlxcache")

MAX_AUTO_SLOTS = 1 << 20
"""Upper bound on an automatically sized pool (about a million tokens)."""

MIN_AUTO_SNAPSHOTS, MAX_AUTO_SNAPSHOTS = 8, 4096
"""Bounds on an automatically sized state pool (hybrid models)."""

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


class ReuseDisabledWarning(UserWarning):
    """The model is served, correctly, but without prefix reuse, or one request per forward."""


@dataclass
class EngineStats(ServingStats):
    """Counters over an engine's life (see ``Engine.stats``): ``servecore.ServingStats``, the
    names and rates both engines share.

    Here ``cached_tokens`` are prompt tokens served from the radix tree and ``prefill_tokens``
    the ones run through the model (``prompt_tokens == cached_tokens + prefill_tokens``);
    ``token_evictions`` counts tokens the tree evicted to make room (``reset_cache`` is not
    counted); ``ttft`` holds each request's seconds from its arrival (its ``generate`` call,
    or the first ``next`` of its ``stream``) to its first token. ``effective_prefill_tok_s``
    counts cached prompt tokens too; ``prefill_tok_s`` only the computed ones.

    Examples:
        >>> stats = EngineStats(requests=2, prompt_tokens=40, cached_tokens=30,
        ...                     prefill_tokens=10, prefill_seconds=0.5, ttft=[0.2, 0.4])
        >>> stats.hit_rate, stats.prefill_tok_s, stats.effective_prefill_tok_s
        (0.75, 20.0, 80.0)
        >>> round(stats.mean_ttft, 6), EngineStats().hit_rate   # nothing yet: 0, not an error
        (0.3, 0.0)

    Hybrid models also count ``snapshots_taken`` (recurrent-state snapshots stored in the
    state pool) and ``state_evictions`` (snapshots evicted to make room).
    """

    snapshots_taken: int = 0
    state_evictions: int = 0


# A request's life: "new" (made, its stream not read yet) -> "waiting" (queued) -> "prefill"
# (admitted into this step's prefill batch) -> "running" (in a decode group) -> "done"; or
# "cancelled" (its stream was closed) or "aborted" (a step serving it failed) from any of them.
_LIVE = frozenset({"waiting", "prefill", "running"})


@dataclass(eq=False)
class _Request:
    """One request's host-side state while it is served.

    Slots: ``tree_slots`` are the prompt's first ``len(tree_slots)`` positions, owned by the
    tree and pinned by the lock on ``node``; ``pending`` are the slots allocated for the rest,
    the request's own until the prompt is inserted. ``cached`` of the ``tree_slots`` positions
    are read from the pool: all of them, except after a full hit, which recomputes the last
    token (its logits are needed) and so needs no new slot at all.
    """

    index: int
    tokens: list[int]
    max_tokens: int
    params: SamplingParams
    stop: frozenset[int]
    key: mx.array | None
    arrival: float = 0.0
    seq: int = 0  # arrival order, for fairness in shortest-first admission
    overtaken: int = 0  # times a later request was admitted first
    owner: _Stream | None = None
    state: str = "new"
    group: _Group | None = None  # the decode group, while running
    output: list[int] = field(default_factory=list)
    cached: int = 0
    node: TreeNode | None = None
    tree_slots: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    restore: int | None = None  # hybrid models: the snapshot slot of the state at `cached`
    points: list[int] = field(default_factory=list)  # depths to snapshot during prefill

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens or (
            bool(self.output) and self.output[-1] in self.stop
        )


@dataclass(eq=False)
class _Stream:
    """One ``stream`` / ``generate`` call: its requests, and the tokens produced for them that
    its reader has not taken yet (any step may produce them, whoever's read ran it)."""

    reqs: list[_Request]
    queue: deque[tuple[int, int]] = field(default_factory=deque)
    error: BaseException | None = None  # a step that served one of its requests failed

    @property
    def live(self) -> bool:
        return any(r.state in _LIVE for r in self.reqs)


@dataclass(eq=False)
class _Group:
    """Requests advanced together by one forward, and their per-layer caches.

    ``feed`` ``(R,)`` holds each row's next input token, possibly still being computed;
    ``unread[i]`` tells that ``feed[i]`` was sampled by the last step and not yet emitted (a
    row that just joined feeds its prefill token, which was emitted already).
    """

    caches: list[Any]
    reqs: list[_Request] = field(default_factory=list)
    feed: mx.array | None = None
    unread: list[bool] = field(default_factory=list)

    def add(self, req: _Request) -> None:
        token = mx.array([req.output[-1]], dtype=mx.int32)
        self.feed = token if self.feed is None else mx.concatenate([self.feed, token])
        self.reqs.append(req)
        self.unread.append(False)

    def remove(self, row: int) -> None:
        """Drop ``row``: the last row moves into its place (as in ``RaggedKVCache``)."""
        order = list(range(len(self.reqs)))
        order[row] = order[-1]
        order.pop()
        self.reqs = [self.reqs[i] for i in order]
        self.unread = [self.unread[i] for i in order]
        self.feed = self.feed[mx.array(order, dtype=mx.int32)] if order else None


def _vocab_size(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            return module.weight.shape[0]
    raise ValueError("cannot tell the model's vocabulary size (no args.vocab_size, no Embedding)")


def _memory_budget() -> tuple[int, str]:
    """Bytes the pool may draw from, and where the figure came from.

    On Apple silicon the pool lives in Metal's working set; elsewhere MLX allocates host
    memory, so ``servecore.memory_budget`` (``MemAvailable``, capped by any cgroup limit: a
    container with 4 GiB on a 512 GiB host sizes from 4 GiB).
    """
    if mx.metal.is_available():
        info = mx.device_info()
        total = int(info.get("max_recommended_working_set_size", info["memory_size"]))
        return max(total - mx.get_active_memory(), 0), "Metal working set"
    return memory_budget()


def auto_num_slots(
    bytes_per_slot: int, mem_fraction: float, max_slots: int = MAX_AUTO_SLOTS
) -> tuple[int, int, str]:
    """Pool size from free memory: ``(num_slots, budget_bytes, source)``.

    ``num_slots = min(max_slots, mem_fraction * free_memory // bytes_per_slot)`` (at least 2).

    Examples:
        >>> n, _, _ = auto_num_slots(bytes_per_slot=1 << 20, mem_fraction=0.001)
        >>> 2 <= n <= MAX_AUTO_SLOTS
        True
    """
    budget, source = _memory_budget()
    budget = int(budget * mem_fraction)
    return max(2, min(max_slots, budget // bytes_per_slot)), budget, source


def _join_rows(dst: list[Any], src: list[Any], row: int, slack: int = 0) -> None:
    """Append row ``row`` of the engine caches ``src`` to the engine caches ``dst``; a
    sliding layer keeps only its last ``window - 1 + slack`` tokens (what its next query sees,
    and ``slack`` more)."""
    for d, c in zip(leaves(dst), leaves(src), strict=True):
        if isinstance(c, RaggedArraysCache):
            d.add_row(c.row(row))
            continue
        k, v = c.row(row)
        start, n = c.starts[row], k.shape[2]
        if c.window is not None and n > c.window - 1 + slack:
            drop = n - (c.window - 1 + slack)
            k, v, start = k[:, :, drop:], v[:, :, drop:], start + drop
        d.add_row(k, v, start)


def _probe_layout(model: nn.Module, layout: Layout) -> tuple[Layout, tuple | None, str | None]:
    """Run two tokens through the model with the engine's caches: the layout with each state
    array's shape, and ``((n_kv_heads, head_dim, v_head_dim, dtype), None)`` when every
    attention cache
    wrote keys and values of one shape (what one KV pool holds), else ``(None, reason)``."""
    caches = build(layout, 1)
    mx.eval(model(mx.array([[0, 0]]), cache=caches))
    flat = leaves(caches)
    like = [[None if x is None else (tuple(x.shape[1:]), x.dtype) for x in flat[i].cache]
            for i in layout.state_leaves]
    layout = layout.with_states(like)
    shapes = set()
    for i in layout.kv_leaves:
        c = flat[i]
        if c.keys is None:
            return layout, None, f"cache {i} never wrote its keys"
        shapes.add((c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))
    if not shapes:
        return layout, None, "the model has no attention layer (nothing for a KV pool)"
    if len(shapes) != 1:
        return layout, None, f"layers disagree on K/V shapes {sorted(map(str, shapes))}"
    ((heads, dk, dv, dtype),) = shapes
    return layout, (heads, dk, dv, dtype), None


def _probe_ragged_batch(model: nn.Module, layout: Layout, pads: bool) -> str | None:
    """None if a ragged batch (per-row positions, masks and states, right padding where
    ``pads``) computes what the model's own caches compute request by request, for a
    prefill and a decode step; else why not."""
    prefixes, new = [[0], [0, 0, 0]], [[1, 2, 6], [3, 4]] if pads else [[1, 6], [3, 4]]
    solo = []
    for p, n in zip(prefixes, new, strict=True):
        caches = make_prompt_cache(model)
        model(mx.array([p]), cache=caches)
        prefill = model(mx.array([n]), cache=caches)[:, -1]
        solo.append((prefill, model(mx.array([[5]]), cache=caches)[:, -1]))
    batch = build(layout, 0)
    for p in prefixes:
        caches = build(layout, 1)
        model(mx.array([p]), cache=caches)
        _join_rows(batch, caches, 0)
    try:
        width = max(map(len, new))
        last = _forward_padded(model, batch, [n[:-1] for n in new], width - 1)
        prefill = model(mx.array([n[-1:] for n in new]), cache=batch)[:, -1]
        decode = model(mx.array([[5], [5]]), cache=batch)[:, -1]
        mx.eval(prefill, decode, last)
    except Exception as e:  # any model that cannot take per-row offsets / masks
        return f"{type(e).__name__}: {e}"
    for got, want in ((prefill, [a for a, _ in solo]), (decode, [b for _, b in solo])):
        want = mx.concatenate(want)
        scale = max(1.0, mx.abs(want).max().item())
        if not mx.allclose(got, want, rtol=1e-2, atol=1e-2 * scale).item():
            return "batched logits differ from per-request logits"
    return None


def _padding(model: nn.Module, layout: Layout) -> tuple[bool, bool]:
    """Does right padding leave a row's state as it should? ``(part, whole)``: a row padded
    part-way (2 real tokens in a 3-token forward), and a row that is all padding in a forward.
    Some models' recurrent layers mask padding out of their outputs but not out of the state
    they carry (mlx-lm's Mamba2 SSM under a mask and no ``lengths`` loses the real tokens'
    contribution; a conv state without ``lengths`` shifts the padding in): a model that pads
    whole forwards exactly is served with forwards cut so that no row is padded part-way; one
    that does not is served one request per forward."""
    if not layout.state_leaves:
        return True, True
    outs = []
    for empty, width in ((0, 2), (0, 3), (2, 2)):
        caches = build(layout, 1)
        model(mx.array([[0, 1, 2]]), cache=caches)
        if empty:
            _forward_padded(model, caches, [[]], empty)
        _forward_padded(model, caches, [[3, 4]], width)
        outs.append(model(mx.array([[5]]), cache=caches)[:, -1])
    mx.eval(outs)
    scale = max(1.0, mx.abs(outs[0]).max().item())
    return tuple(mx.allclose(outs[0], x, rtol=1e-3, atol=1e-3 * scale).item()
                 for x in outs[1:])


def _forward_padded(model: nn.Module, caches: list[Any], rows: list[list[int]], width: int
                    ) -> mx.array | None:
    """Run ``rows`` (row ``i``'s next tokens, at most ``width``) right-padded to ``width``
    through the model: attention caches drop the padding after the forward, recurrent states
    never take it in (``prepare(lengths=...)``). Returns the logits, None if ``width`` is 0."""
    if width == 0:
        return None
    n = [len(r) for r in rows]
    ragged = min(n) < width
    flat = leaves(caches)
    if ragged:
        for c in flat:
            if isinstance(c, RaggedArraysCache):
                c.prepare(lengths=n)
    before = [None if isinstance(c, RaggedArraysCache) else list(c.lengths) for c in flat]
    try:
        out = model(mx.array([r + [0] * (width - len(r)) for r in rows]), cache=caches)
    finally:
        for c in flat:
            if isinstance(c, RaggedArraysCache):
                c.finalize()
    if ragged:
        for c, was in zip(flat, before, strict=True):
            if was is not None:
                c.truncate([w + k for w, k in zip(was, n, strict=True)])
    return out


def _rebuilt(n: int, held_slots: list[int]) -> Any:
    """An allocator of ``n`` slots where exactly ``held_slots`` (and the sink) are in use."""
    held = np.zeros(n, dtype=bool)
    held[0] = True  # the sink is never free
    held[held_slots] = True
    everything, _, _ = alloc(init_allocator(n), n - 1)
    return free(everything, np.flatnonzero(~held))


def _arrays_in(tree: Any) -> list[mx.array]:
    """The ``mx.array`` leaves of nested lists and tuples (a cache's ``state`` may hold None)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, list | tuple):
        return [a for x in tree for a in _arrays_in(x)]
    return []


def _per_prompt(value: Any) -> bool:
    """A list, tuple or 1-D NumPy array gives one value per prompt; anything else is shared."""
    return isinstance(value, list | tuple) or isinstance(value, np.ndarray) and value.ndim == 1


def _listify(name: str, value: Any, n: int) -> list[Any]:
    """``value`` for each of ``n`` requests: a scalar is shared, a list must have length n."""
    if _per_prompt(value):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _check_options(num_slots, page_size, mem_fraction, max_batch_size, prefill_step_size,
                   prefix_cache, num_snapshots=None, snapshot_interval=256,
                   prefill_batch_tokens=None) -> dict[str, Any]:
    """The engine's options, checked (a ValueError names the bad one), as plain Python values.
    The CLI checks its flags with this before it loads a model."""
    out = dict(
        num_slots=None if num_slots is None else check_int("num_slots", num_slots, 2),
        page_size=check_int("page_size", page_size, 1),
        max_batch_size=check_int("max_batch_size", max_batch_size, 1),
        prefill_step_size=check_int("prefill_step_size", prefill_step_size, 1),
        mem_fraction=check_real("mem_fraction", mem_fraction),
        num_snapshots=(None if num_snapshots is None
                       else check_int("num_snapshots", num_snapshots, 2)),
        snapshot_interval=check_int("snapshot_interval", snapshot_interval, 1),
        prefill_batch_tokens=(None if prefill_batch_tokens is None
                              else check_int("prefill_batch_tokens", prefill_batch_tokens, 1)),
    )
    if not 0 < out["mem_fraction"] <= 1:
        raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1]")
    if not isinstance(prefix_cache, bool | np.bool_):
        raise ValueError(f"prefix_cache={prefix_cache!r} must be True or False")
    out["prefix_cache"] = bool(prefix_cache)
    return out


class Engine:
    """Serve an unmodified mlx-lm model with radix prefix reuse and continuous batching.

    Args:
        model: an mlx-lm model (``model(inputs, cache=...)`` -> logits).
        tokenizer: optional (mlx-lm ``TokenizerWrapper`` or HF tokenizer); needed for text
            and chat prompts and for ``generate(..., text=True)``; its EOS ids are the
            default stop tokens.
        num_slots: KV pool size in token slots (slot 0 is padding); None sizes it from free
            memory times ``mem_fraction`` (Metal working set on Apple silicon, else
            ``servecore.memory_budget``: ``MemAvailable`` capped by any cgroup memory limit),
            capped at ``MAX_AUTO_SLOTS``.
        page_size: radix tree granularity in tokens.
        mem_fraction: share of free memory the automatic pool may take.
        max_batch_size: most requests decoded at once.
        prefix_cache: False serves the same way without a pool or tree (no reuse).
        prefill_step_size: most tokens (padding included) in one prefill forward; a longer
            prompt runs alone, in chunks of this many tokens.
        prefill_batch_tokens: most uncached tokens admitted into one prefill batch (a request
            alone may have more). None: ``CPU_PREFILL_BATCH_TOKENS`` on MLX's CPU device, and
            there the batch is also sized for the mean TTFT (``CPU_FORWARD_COST_TOKENS``);
            ``prefill_step_size`` on a GPU.

    Scheduling, for time to first token: a step that admitted a prefill batch does not decode
    while admissible requests still wait (prefill first, as SGLang schedules: the running
    requests wait at most until ``max_batch_size`` are running or the queue is empty), and
    admission takes the waiting request with the fewest uncached tokens first
    (``SHORTEST_FIRST_LOOKAHEAD``; one overtaken ``MAX_OVERTAKEN`` times goes next).

    One engine, many users (the contract the tests hold it to):

    * *One thread*: any number of ``generate`` and ``stream`` users may be interleaved: two
      streams read alternately, a ``generate`` inside a ``for`` loop over a stream, a stream
      abandoned or ``close()``-d at any point, ``reset_cache()`` at any point. One scheduler
      serves them all: reading any stream (or calling ``generate``) advances every open
      request, and each token waits in its own stream until read. So every request's tokens
      reach whoever asked for them, in order, each stream ends when its own requests end, and
      no request waits on a stream nobody reads. A stream's requests join at its first
      ``next`` (a stream never read costs nothing); closing it (``close()``, ``break``,
      dropping the last reference) releases its unfinished requests at once. A stream that is
      kept but not read keeps its requests running while others read (to ``max_tokens`` at
      most); its tokens wait for it.
    * *Several threads*: calls are serialized by a lock, one engine step at a time, so two
      threads reading two streams (or calling ``generate``) take turns step by step. MLX
      (>= 0.31.2) ties an array that is not yet scheduled to the thread that built it, so
      every call leaves all the device state it keeps scheduled (``mx.async_eval``, no wait)
      before it lets another thread in; tested with four threads. One stream must not be read
      from two threads at once (Python refuses: "generator already executing").
    * *Failures*: an exception inside a step (the model raising, a ``KeyboardInterrupt``, a
      ``MemoryError``) propagates to the call that ran the step. The requests the failed part
      was serving are dropped: a failed prefill drops the requests being prefilled; a failed
      decode step drops every running request, since their decode caches may be half-updated.
      Another stream that owned a dropped request raises ``RuntimeError`` (caused by the
      original exception) once its queued tokens are read. The slot allocator and the tree's
      locks are then rebuilt from what survives (the tree and the running requests), so no
      slot is leaked or both free and cached, no lock is left behind, and later requests are
      exact.

    Examples:
        >>> from mlxcache.zoo import make_model     # a tiny random llama, or mlx_lm.load(path)
        >>> engine = Engine(make_model(), num_slots=128, max_batch_size=4)
        >>> engine.num_slots, engine.num_free_slots
        (128, 127)
        >>> events = list(engine.stream([[5, 6, 7], [8, 9]], max_tokens=2))
        >>> sorted(i for i, _ in events)                # (prompt index, token) pairs
        [0, 0, 1, 1]
        >>> engine.num_free_slots + engine.tree.total_size   # every slot is free or cached
        127

        Two streams read alternately, with a ``generate`` between reads: each gets what the
        same prompts get served together.

        >>> want = engine.generate([[5, 6, 7], [8, 9]], max_tokens=3)
        >>> a, b = engine.stream([[5, 6, 7]], max_tokens=3), engine.stream([[8, 9]], max_tokens=3)
        >>> got_a, got_b = [next(a)[1]], [next(b)[1]]
        >>> got_a.append(next(a)[1])
        >>> engine.generate([[8, 9]], max_tokens=3) == [want[1]]
        True
        >>> got_b += [t for _, t in b]                 # b to its end while a is still open
        >>> got_a += [t for _, t in a]
        >>> [got_a, got_b] == want, engine.tree.protected_size   # nothing left locked
        (True, 0)
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        num_slots: int | None = None,
        page_size: int = 1,
        mem_fraction: float = 0.5,
        max_batch_size: int = 32,
        prefix_cache: bool = True,
        prefill_step_size: int = 2048,
        num_snapshots: int | None = None,
        snapshot_interval: int = 256,
        prefill_batch_tokens: int | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an mlx-lm model (an mlx.nn.Module, e.g. from "
                             f"mlx_lm.load), got {type(model).__name__}: {model!r:.60}")
        opts = _check_options(num_slots, page_size, mem_fraction, max_batch_size,
                              prefill_step_size, prefix_cache, num_snapshots, snapshot_interval,
                              prefill_batch_tokens)
        num_slots, mem_fraction, prefix_cache = (
            opts["num_slots"], opts["mem_fraction"], opts["prefix_cache"])
        page_size, max_batch_size, prefill_step_size = (
            opts["page_size"], opts["max_batch_size"], opts["prefill_step_size"])
        # The tokenizer's EOS ids, whichever form it keeps them in (mlx-lm: a set; Hugging
        # Face: an int, a list or None; transformers 5 may give eos_token_ids as an int).
        self._eos = eos_token_ids(tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        # With no cap given, on MLX's CPU device the batch is also sized for the mean TTFT
        # (CPU_FORWARD_COST_TOKENS); a GPU amortizes a forward's fixed cost over many rows.
        self._forward_cost: float | None = None
        if opts["prefill_batch_tokens"] is not None:
            self.prefill_batch_tokens = opts["prefill_batch_tokens"]
        elif mx.default_device().type == mx.DeviceType.cpu:
            self.prefill_batch_tokens = CPU_PREFILL_BATCH_TOKENS
            self._forward_cost = CPU_FORWARD_COST_TOKENS
        else:
            self.prefill_batch_tokens = prefill_step_size
        self.vocab_size = _vocab_size(model)
        self.stats = EngineStats()

        self.snapshot_interval = opts["snapshot_interval"]
        layout = describe(make_prompt_cache(model))
        self.num_layers = len(layout.entries)
        self.cache_kinds = layout.kinds
        # Every cache kind known (see mlxcache.layers): served with the engine's own caches,
        # batched and with reuse; else with the model's caches, one request at a time.
        self.supported = not layout.unsupported
        kv = None
        if self.supported:
            layout, kv, why = _probe_layout(model, layout)
        self.layout = layout
        self.has_states = self.supported and bool(layout.state_leaves)
        self.reuse = self.supported and prefix_cache
        self.batched = self.supported
        if not self.supported:
            self._warn(f"model caches {list(layout.kinds)}: {list(layout.unsupported)} "
                       "cannot be restored from a prefix cache: no reuse, no batching")
        elif self.reuse and kv is None:
            self.reuse = False
            self._warn(f"{why}: the pool cannot hold this model's K/V, no reuse")
        # Whether a prefill row may be padded part-way (else forwards are cut so that each
        # row runs whole or not at all; see _padding).
        part, whole = _padding(model, layout) if self.supported else (False, False)
        self.pads_exactly = part
        if self.batched and not whole:
            self.batched = False
            self._warn("right padding changes the recurrent state (the model's recurrent "
                       "layers take no lengths): serving one request per forward")
        if self.batched:
            why = _probe_ragged_batch(model, layout, self.pads_exactly)
            if why is not None:
                self.batched = False
                self._warn(f"ragged batches fail ({why}): serving one request per forward")

        self._pool = self._alloc = self._tree = None
        self._states = self._state_alloc = None
        if self.reuse:
            heads, head_dim, v_head_dim, dtype = kv
            n_kv = len(layout.kv_leaves)
            per_slot = bytes_per_token_slot(n_kv, heads, head_dim, dtype, v_head_dim)
            per_snapshot = sum(math.prod(x[0]) * x[1].size for leaf in layout.like
                               for x in leaf if x is not None)
            num_snapshots = opts["num_snapshots"]
            if num_slots is None:
                num_slots, budget, source = auto_num_slots(per_slot, mem_fraction)
                origin = f"auto: {mem_fraction:g} x {source} = {budget / 2**30:.2f} GiB"
            else:
                budget, origin = num_slots * per_slot, "given"
            if self.has_states and num_snapshots is None:
                # Snapshots take a quarter of the cache memory: the token pool keeps the rest.
                if origin != "given":
                    num_slots = max(2, num_slots * 3 // 4)
                num_snapshots = int(min(MAX_AUTO_SNAPSHOTS,
                                        max(MIN_AUTO_SNAPSHOTS, budget // 4 // per_snapshot)))
            self._pool = init_pool(n_kv, num_slots, heads, head_dim, dtype, v_head_dim)
            self._alloc = init_allocator(num_slots)
            self._tree = RadixCache(page_size, states=self.has_states)
            mx.eval(self._pool)
            if self.has_states:
                self._states = init_state_pool(
                    [x for leaf in layout.like for x in leaf if x is not None], num_snapshots)
                self._state_alloc = init_allocator(num_snapshots)
                mx.eval(self._states)
            log.info(
                "mlxcache: KV pool %d slots x %d B = %.2f GiB (%s); %d attention layers, %d kv "
                "heads, head_dim %d, %s, page_size %d; state pool %d snapshots x %d B",
                num_slots, per_slot, num_slots * per_slot / 2**30, origin, n_kv, heads,
                head_dim, dtype, page_size, self.num_snapshots, self.snapshot_bytes,
            )  # fmt: skip

        # One scheduler for every stream (see the class docstring): the waiting queue, the
        # decode groups (batched: the one running batch), and the lock that serializes threads.
        self._waiting: deque[_Request] = deque()
        self._arrivals = itertools.count()
        self._batch = self._groups = None
        self._new_groups()
        self._lock = threading.RLock()
        self._stepping = False  # a step is running (in the thread holding the lock)
        self._closed_in_step: list[_Stream] = []  # streams finalized by the GC inside a step

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(f"mlxcache: {message}", ReuseDisabledWarning, stacklevel=3)

    # ------------------------------------------------------------------ introspection ----

    @property
    def num_slots(self) -> int:
        """Pool size in slots (0 without reuse)."""
        return self._pool.num_slots if self._pool is not None else 0

    @property
    def num_free_slots(self) -> int:
        """Pool slots not held by the radix tree nor by a running request (0 without reuse)."""
        return self._alloc.num_free if self._alloc is not None else 0

    @property
    def num_snapshots(self) -> int:
        """State pool size in snapshot slots (0 without states or reuse)."""
        return self._states.num_slots if self._states is not None else 0

    @property
    def num_free_snapshots(self) -> int:
        """Snapshot slots not held by the radix tree."""
        return self._state_alloc.num_free if self._state_alloc is not None else 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot: every recurrent layer's state arrays of one request."""
        return self._states.bytes_per_slot if self._states is not None else 0

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV pool and the state pool together (fixed at construction)."""
        return sum(x.nbytes for x in (self._pool, self._states) if x is not None)

    @property
    def tree(self) -> RadixCache | None:
        """The radix tree (None without reuse). Read it; do not modify it."""
        return self._tree

    def reset_cache(self) -> None:
        """Forget every cached prefix that no running request holds: evict all that is
        evictable and free its slots.

        Safe at any point, streams open or not: a running request's locked prefix stays until
        the request finishes (then it and its answer are cached as usual); requests that have
        not started hold nothing. With nothing running, the tree ends empty and every slot is
        free. Not counted in ``stats.token_evictions``.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=64)
            >>> events = engine.stream([[1, 2, 3, 4]], max_tokens=4)
            >>> _ = next(events)                          # running: its prompt is locked
            >>> engine.reset_cache()
            >>> engine.tree.total_size, engine.tree.protected_size
            (4, 4)
            >>> _ = list(events)                          # finished: prompt + answer cached
            >>> engine.reset_cache()
            >>> engine.tree.total_size, engine.num_free_slots
            (0, 63)
        """
        with self._serialized():
            if self._tree is not None:
                self._free(self._tree.evict(self._tree.evictable_size))
                if self.has_states:
                    self._free(self._tree.evict_states(self._tree.num_states))

    # -------------------------------------------------------------------------- API ----

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_tokens: int | Sequence[int] = 256,
        temperature: float | Sequence[float] = 0.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        seed: int | None | Sequence[int | None] = None,
        stop_token_ids: Sequence[int] | None = None,
        *,
        text: bool = False,
    ) -> list[list[int]] | list[str]:
        """Generated token ids per prompt (a stop token, when hit, is the last one), or with
        ``text=True`` their text (``servecore.prompts.decode``: the tokenizer's decoding,
        without the stop token that ended the request).

        Every sampling argument is one value for all prompts or a list with one per prompt;
        see ``stream``.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=64)
            >>> outs = engine.generate([[1, 2, 3], [4, 5]], max_tokens=[2, 3],
            ...                        temperature=[0.0, 0.8], seed=[None, 7])
            >>> [len(o) for o in outs]
            [2, 3]

            With a tokenizer, prompts may be text or chats, and the answers text
            (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``):

            >>> from servecore.testing import word_tokenizer
            >>> engine = Engine(make_model(), word_tokenizer(1000), num_slots=64)
            >>> chat = [{"role": "user", "content": "w7 w8"}]
            >>> ids = engine.generate([[4, 7, 8, 5]], max_tokens=3)[0]
            >>> engine.generate([chat], max_tokens=3)[0] == ids  # <|user|> w7 w8 <|assistant|>
            True
            >>> engine.generate([chat], max_tokens=3, text=True)[0] == engine.tokenizer.decode(ids)
            True
        """
        check_text(text, self.tokenizer)
        reqs = self._make_requests(
            prompts, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
        )
        out: list[list[int]] = [[] for _ in reqs]
        for i, token in self._run(reqs):
            out[i].append(token)
        if text:
            return [decode(self.tokenizer, o, r.stop) for o, r in zip(out, reqs, strict=True)]
        return out

    def stream(
        self,
        prompts: Sequence[Prompt],
        max_tokens: int | Sequence[int] = 256,
        temperature: float | Sequence[float] = 0.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        seed: int | None | Sequence[int | None] = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt_index, token)`` as tokens are produced, all prompts concurrently.

        Args:
            prompts: a list (or any iterable, read once) of prompts, each a list or 1-D int
                array of token ids, a string, or a chat (a list of ``{"role": ..., "content":
                ...}`` dicts, rendered by the tokenizer's chat template); text and chats need
                a tokenizer. One prompt alone is ``[prompt]`` (``servecore.prompts`` has the
                rule).
            max_tokens: >= 1 tokens per request.
            temperature: 0 is greedy.
            top_p: nucleus filter mass (1.0 = off).
            top_k: top-k filter (0 = off).
            seed: per-request reproducible sampling (None: MLX's global generator).
            stop_token_ids: finish a request on any of these: one id or a list (default: the
                tokenizer's EOS ids).

        Every sampling argument and ``max_tokens`` is one value for all prompts or a list (or
        1-D NumPy array) with one per prompt. All inputs are checked before any work starts,
        for the type and range they have on the device (int32 ids and counts, float32
        settings): a ValueError names the bad value; nothing is rounded or coerced.
        The requests join the engine at the stream's first ``next``; closing the stream
        (``close()``, leaving a ``for`` loop, dropping it) releases those not finished. See the
        class docstring for interleaving streams, threads and failures.
        """
        reqs = self._make_requests(
            prompts, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
        )
        return self._run(reqs)

    # ------------------------------------------------------------------- validation ----

    def _encode(self, i: int, prompt: Prompt) -> list[int]:
        # ids, text or a chat, by the rule both engines share; a new list (the caller may
        # change theirs while this waits)
        tokens = encode_prompt(f"prompt {i}", prompt, self.tokenizer, self.vocab_size)
        if self.reuse and len(tokens) > self.num_slots - 1:
            raise ValueError(
                f"prompt {i} has {len(tokens)} tokens but the KV pool holds at most "
                f"{self.num_slots - 1} (num_slots={self.num_slots}); raise num_slots"
            )
        return tokens

    def _make_requests(
        self, prompts, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
    ) -> list[_Request]:
        prompts = prompt_list(prompts)  # read once: a generator is not read twice
        n = len(prompts)
        tokens = [self._encode(i, p) for i, p in enumerate(prompts)]
        maxes = [
            check_int("max_tokens" if not _per_prompt(max_tokens) else f"max_tokens[{i}]", m, 1)
            for i, m in enumerate(_listify("max_tokens", max_tokens, n))
        ]
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        columns = {name: _listify(name, value, n) for name, value in given.items()}
        params = []
        for i in range(n):
            try:
                params.append(SamplingParams(**{name: col[i] for name, col in columns.items()}))
            except ValueError as e:
                where = f"prompt {i}: " if any(map(_per_prompt, given.values())) else ""
                raise ValueError(f"{where}{e}") from None
        stop = self._eos if stop_token_ids is None else stop_ids(stop_token_ids, self.vocab_size)
        keys = [None if p.seed is None else mx.random.key(p.seed) for p in params]
        mx.eval(_arrays_in(keys))  # built in the caller's thread: evaluated, any thread uses it
        return [
            _Request(
                index=i,
                tokens=tokens[i],
                max_tokens=maxes[i],
                params=params[i],
                stop=stop,
                key=keys[i],
            )
            for i in range(n)
        ]

    # --------------------------------------------------------------------- serving ----
    #
    # One scheduler serves every open stream. The waiting queue and the decode groups are the
    # engine's; each request knows the stream that owns it, and a step pushes every token it
    # produces onto its owner's queue. A reader that needs a token runs steps until its queue
    # has one; those steps advance every other open request too. So no request ever waits on
    # a stream nobody reads: reading any one moves them all.

    @contextmanager
    def _serialized(self) -> Iterator[None]:
        """Hold the engine's lock (threads take turns), refusing a call from inside a step."""
        with self._lock:
            if self._stepping:
                raise RuntimeError(
                    "mlxcache: the engine was called from inside one of its own steps (by the "
                    "model or the tokenizer?); it serves one step at a time"
                )
            yield

    def _run(self, reqs: list[_Request]) -> Iterator[tuple[int, int]]:
        """The generator behind ``stream`` and ``generate``: ``(prompt index, token)``."""
        stream = _Stream(reqs)
        try:
            with self._serialized():
                now = time.perf_counter()
                for r in reqs:
                    r.owner, r.arrival, r.state = stream, now, "waiting"
                    r.seq = next(self._arrivals)
                self._waiting.extend(reqs)
            while True:
                with self._serialized():
                    while not stream.queue and stream.error is None and stream.live:
                        if not self._step():
                            raise RuntimeError(  # a bug, not a user error: say so, never hang
                                "mlxcache: internal error: a stream has live requests but the "
                                "engine has nothing to run"
                            )
                    if not stream.queue:
                        if stream.error is not None:
                            lost = [r.index for r in reqs if r.state == "aborted"]
                            raise RuntimeError(
                                f"mlxcache: request(s) {lost} of this stream were dropped: a "
                                f"step serving them failed ({stream.error!r})"
                            ) from stream.error
                        return
                    event = stream.queue.popleft()
                yield event
        finally:
            self._close(stream)

    def _close(self, stream: _Stream) -> None:
        """Release what the stream's unfinished requests hold (it was closed or dropped)."""
        with self._lock:
            if self._stepping:  # the GC finalized it inside a step: release after the step
                self._closed_in_step.append(stream)
            else:
                self._cancel(stream)

    def _cancel(self, stream: _Stream) -> None:
        try:
            for req in stream.reqs:
                if req.state == "waiting":
                    self._waiting.remove(req)
                    req.state = "cancelled"
                elif req.state == "running":
                    self._finish(req, req.group, publish=False, state="cancelled")
            self._settle()
        except BaseException as e:  # removing a row failed half-way: the caches are suspect
            self._abort(e, stream.reqs, groups=True)
            raise

    def _step(self) -> bool:
        """One round: admit and prefill a batch if one fits, then one decode step of every
        group. False if there was nothing to do."""
        self._stepping = True
        try:
            prefilled = self._admit_and_prefill()
            if prefilled and self._waiting:  # prefill first: more may be admissible now
                self._settle()  # the reader may take its first token to another thread
                return True
            decoded = False
            for group in list(self._groups):
                if group.reqs:
                    decoded = True
                    try:
                        self._decode_step(group)
                    except BaseException as e:
                        self._abort(e, [], groups=True)
                        raise
            self._settle()
            return prefilled or decoded
        finally:
            self._stepping = False
            while self._closed_in_step:
                self._cancel(self._closed_in_step.pop())

    def _admit_and_prefill(self) -> bool:
        batch: list[_Request] = []
        try:
            self._admit_batch(batch)
            if not batch:
                if self._waiting and not self._num_running():
                    # Unreachable while every prompt fits the pool (checked at the door):
                    # with nothing running nothing is locked, so all slots are free or
                    # evictable. Drop the request rather than retry it forever.
                    req = self._waiting[0]
                    need = len(req.tokens) - len(self._tree.match_prefix(req.tokens).slots)
                    err = PoolExhausted(
                        need, self.num_free_slots + self._tree.evictable_size, what=POOL_NAME
                    )
                    self._abort(err, [req], groups=False)
                    raise err
                return False
            caches = self._prefill(batch)
        except BaseException as e:
            self._abort(e, batch, groups=False)
            raise
        try:
            for row, req in enumerate(batch):
                self._emit(req, req.output[-1])
                if req.done:
                    self._finish(req, None)
                else:
                    self._join(req, caches, row)
        except BaseException as e:  # a half-joined row: the running batch's caches are suspect
            self._abort(e, batch, groups=True)
            raise
        return True

    def _emit(self, req: _Request, token: int) -> None:
        req.owner.queue.append((req.index, token))

    def _num_running(self) -> int:
        return sum(len(g.reqs) for g in self._groups)

    def _new_groups(self) -> None:
        """Empty decode groups: batched, the one running batch; else one group per request."""
        self._batch = _Group(build(self.layout, 0) if self.supported else [])
        self._groups = [self._batch] if self.batched else []

    def _abort(self, exc: BaseException, reqs: list[_Request], groups: bool) -> None:
        """After an exception inside a step: drop ``reqs`` and, with ``groups``, every running
        request (their decode caches may be half-updated), then rebuild the allocator and the
        tree's locks from what survives, so that wherever the exception struck, no slot is
        leaked, none is both free and cached, and no lock is left behind."""
        dropped = list(reqs)
        if groups:
            dropped += [r for g in self._groups for r in g.reqs]
            self._new_groups()
        for req in dropped:
            if req.state not in _LIVE:
                continue
            if req.state == "waiting":
                self._waiting.remove(req)
            req.state, req.group = "aborted", None
            if req.owner.error is None:
                req.owner.error = exc
        self._reconcile()

    def _reconcile(self) -> None:
        """Rebuild the slot bookkeeping from the tree and the running requests (the only
        holders left after ``_abort``): locks are what running requests hold, free slots are
        all those the tree does not hold."""
        for req in self._waiting:  # a waiting request holds nothing (an admission may have
            req.node, req.cached, req.tree_slots, req.pending = None, 0, [], []  # been cut)
        if not self.reuse:
            self._settle()
            return
        mx.async_eval(self._pool)  # the fault may have struck between a write and its eval
        self._tree.release_locks()
        running = [r for g in self._groups for r in g.reqs]
        try:
            for req in running:
                self._tree.lock(req.node)
        except ValueError:  # a node lost from the tree: drop every running request too
            for req in running:
                req.state, req.group, req.node = "aborted", None, None
                if req.owner.error is None:
                    req.owner.error = RuntimeError("mlxcache: a running prefix was lost")
            self._new_groups()
            self._tree.release_locks()
        self._settle()
        self._alloc = _rebuilt(self.num_slots, self._tree.all_slots())
        if self.has_states:
            mx.async_eval(self._states)
            self._state_alloc = _rebuilt(self.num_snapshots,
                                         [h for _, h in self._tree.all_states()])

    def _settle(self) -> None:
        """Schedule every array the engine keeps between calls (``mx.async_eval``: no wait, so
        the decode pipelining stays). MLX (>= 0.31.2) ties an array that is not yet scheduled
        to the stream of the thread that built it, and another thread evaluating it fails
        ("There is no Stream(cpu, N) in current thread"); a scheduled one any thread may wait
        on. So the next call gets only scheduled arrays, whichever thread makes it. (The pool
        is scheduled after each write already.)"""
        arrays = []
        for group in self._groups:
            arrays.append(group.feed)
            arrays.extend(c.state for c in group.caches)
            arrays.extend(r.key for r in group.reqs)
        mx.async_eval(_arrays_in(arrays))

    def _free(self, evicted: Any) -> None:
        """Give what the tree evicted (``Evicted``: token slots, state handles) back."""
        if evicted.slots:
            self._alloc = free(self._alloc, evicted.slots)
        if evicted.states:
            self._state_alloc = free(self._state_alloc, evicted.states)

    def _alloc_slots(self, n: int) -> list[int] | None:
        """``n`` free slots, evicting unlocked prefixes if needed; None if they cannot be had."""
        a, slots, ok = alloc(self._alloc, n)
        if not ok:
            evicted = self._tree.evict(n - self._alloc.num_free)
            self._free(evicted)
            self.stats.token_evictions += len(evicted.slots)
            self.stats.state_evictions += len(evicted.states)
            a, slots, ok = alloc(self._alloc, n)
            if not ok:
                return None
        self._alloc = a
        return slots

    def _alloc_snapshot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used unlocked state if none is
        free; None if none can be had (the snapshot is skipped: the cache is only less
        useful)."""
        a, slots, ok = alloc(self._state_alloc, 1)
        if not ok:
            evicted = self._tree.evict_states(1)
            self._free(evicted)
            self.stats.state_evictions += len(evicted.states)
            self.stats.token_evictions += len(evicted.slots)
            a, slots, ok = alloc(self._state_alloc, 1)
            if not ok:
                return None
        self._state_alloc = a
        return slots[0]

    def _match(self, tokens: list[int]) -> tuple[list[int], TreeNode, int, int | None]:
        """``(slots, node, cached, restore)``: the tree's slots for the longest cached prefix
        of ``tokens`` and its node (to lock), the tokens the request may skip, and (hybrid
        models) the snapshot to restore at that depth.

        Plain KV: every matched token is skipped, except that a full hit recomputes its last
        token (its logits are needed). Hybrid: the prompt but its last token is matched, and
        the usable prefix ends at the deepest state on the match; the tokens after it run
        again (their K/V stay the tree's: they need no slot).
        """
        if not self.has_states:
            slots, node, _ = self._tree.match_prefix(tokens)
            return slots, node, min(len(slots), len(tokens) - 1), None
        slots, node, at = self._tree.match_prefix(tokens[:-1])
        if at.parent is None:  # the root: no state on the path, start from the zero state
            return slots, node, 0, None
        return slots, node, at.depth, at.state

    def _cached(self, tokens: list[int]) -> int:
        """The tokens ``_match`` would let a request skip, from a read-only ``peek``."""
        if not self.has_states:
            return min(self._tree.peek(tokens)[0], len(tokens) - 1)
        return self._tree.peek(tokens[:-1])[1]

    def _admit_batch(self, batch: list[_Request]) -> None:
        """Move the next prefill batch from the waiting queue into ``batch`` (maybe none: the
        pool is full). ``batch`` is filled in place so that an exception part-way leaves every
        reserved request in it, for ``_abort`` to drop."""
        widest = total = 0
        running = self._num_running()
        todo = self._shortest_first() if self.reuse else None
        most = self.max_batch_size - running
        if todo and self._forward_cost is not None:  # sized for the mean TTFT
            mean = sum(todo) / len(todo)
            most = min(most, max(1, round(math.sqrt(self._forward_cost * len(todo) / mean))))
        while self._waiting and len(batch) < most:
            req = self._waiting[0]
            slots, node, cached, restore = (self._match(req.tokens) if self.reuse
                                            else ([], None, 0, None))
            todo = len(req.tokens) - cached
            if batch and (
                not self.batched
                or (len(batch) + 1) * max(widest, todo) > self.prefill_step_size
                or total + todo > self.prefill_batch_tokens
                or self._shares_uncached(req, cached, batch)
            ):
                break
            if self.reuse and not self._reserve(req, slots, node, cached, restore):
                break
            batch.append(req)
            self._waiting.popleft()
            for other in itertools.islice(self._waiting, SHORTEST_FIRST_LOOKAHEAD):
                other.overtaken += other.seq < req.seq
            req.state = "prefill"
            widest, total = max(widest, todo), total + todo

    def _shortest_first(self) -> list[int]:
        """Reorder the head of the waiting queue by uncached tokens, fewest first (stable),
        among the first ``SHORTEST_FIRST_LOOKAHEAD``; a request overtaken ``MAX_OVERTAKEN``
        times keeps its place ahead of the rest. Returns the head's uncached counts."""
        if len(self._waiting) < 2:
            return [len(r.tokens) - self._cached(r.tokens) for r in self._waiting]
        head = [self._waiting.popleft()
                for _ in range(min(len(self._waiting), SHORTEST_FIRST_LOOKAHEAD))]
        # Only the order uses these counts (read-only peeks: no split, no LRU touch):
        # admission matches each request again, since reserving slots for one may evict
        # prefixes another counted here.
        todo = {id(r): len(r.tokens) - self._cached(r.tokens) for r in head}
        order = sorted(head, key=lambda r: (r.overtaken < MAX_OVERTAKEN, todo[id(r)]))
        self._waiting.extendleft(reversed(order))
        return list(todo.values())

    def _shares_uncached(self, req: _Request, cached: int, batch: list[_Request]) -> bool:
        """Would ``req`` reuse enough of a batch member's prompt, once it is inserted?"""
        want = max(1, min(DEFER_SHARED_TOKENS, (len(req.tokens) - cached + 1) // 2))
        head = req.tokens[: cached + want]
        return len(head) == cached + want and any(
            other.tokens[: cached + want] == head for other in batch
        )

    def _reserve(self, req: _Request, slots: list[int], node: TreeNode, cached: int,
                 restore: int | None) -> bool:
        """Lock the matched prefix and allocate slots for the tokens the tree lacks; False to
        wait. A full hit needs none: the token it recomputes is in the tree already. Hybrid
        models also plan where the prefill takes snapshots (``servecore.snapshots``)."""
        self._tree.lock(node)
        new = self._alloc_slots(len(req.tokens) - len(slots))
        if new is None:
            self._tree.unlock(node)
            return False
        req.node, req.tree_slots, req.cached, req.pending = node, slots, cached, new
        req.restore = restore
        if self.has_states:
            req.points = [d for d in snapshot_points(len(req.tokens), len(slots), cached,
                                                     self.snapshot_interval)
                          if d % self.page_size == 0]
        return True

    def _prefill(self, reqs: list[_Request]) -> list[Any]:
        """Run the requests' uncached tokens; sample each first token; publish the prompts.

        Returns the per-layer caches, row ``i`` holding request ``i``'s prompt.
        """
        tic = time.perf_counter()
        todo = [r.tokens[r.cached :] for r in reqs]
        caches = self._prefill_caches(reqs) if self.supported else make_prompt_cache(self.model)
        # All but the last token first, evaluating only the caches, so the LM head runs for
        # one position per request (as in mlx-lm's generators); then the last tokens. The
        # first part runs in forwards of at most prefill_step_size tokens per row, each row
        # stopping at its next snapshot point (hybrid models), right-padded to the longest.
        pos = [r.cached for r in reqs]
        ends = [len(r.tokens) - 1 for r in reqs]
        points = [[d for d in r.points if d > r.cached] for r in reqs]
        snaps: list[tuple[int, int, int]] = []  # (request, depth, snapshot slot)
        while True:
            stop = [min(end, p + self.prefill_step_size, *pts[:1])
                    for p, end, pts in zip(pos, ends, points, strict=True)]
            if self.supported and not self.pads_exactly:  # no row padded part-way
                width = min((t - p for t, p in zip(stop, pos, strict=True) if t > p), default=0)
                stop = [min(t, p + width) for t, p in zip(stop, pos, strict=True)]
            rows = [r.tokens[p:t] for r, p, t in zip(reqs, pos, stop, strict=True)]
            width = max(map(len, rows))
            if width == 0:
                break
            if self.supported:
                _forward_padded(self.model, caches, rows, width)
            else:
                self.model(mx.array(rows), cache=caches)
            taken = [i for i, (t, pts) in enumerate(zip(stop, points, strict=True))
                     if pts and pts[0] == t]
            for i in taken:
                points[i].pop(0)
            snaps += self._snapshot(caches, taken, [stop[i] for i in taken])
            # Each chunk is evaluated before the next is built (bounded memory, as mlx-lm's
            # prefill); the last one only scheduled, so building the last tokens' forward
            # overlaps its compute.
            final = stop == ends
            (mx.async_eval if final else mx.eval)(
                _arrays_in([c.state for c in leaves(caches)]),
                _arrays_in([self._states and self._states.arrays]))
            pos = stop
        last = self.model(mx.array([t[-1:] for t in todo]), cache=caches)[:, -1, :]
        tokens = self._sample(reqs, last)
        mx.eval(tokens, _arrays_in([c.state for c in leaves(caches)]))
        for req, token in zip(reqs, tokens.tolist(), strict=True):
            req.output.append(token)
        if self.reuse:
            self._publish_prompts(reqs, caches, snaps)
        toc = time.perf_counter()
        s = self.stats
        s.requests += len(reqs)
        s.prompt_tokens += sum(len(r.tokens) for r in reqs)
        s.cached_tokens += sum(r.cached for r in reqs)
        s.prefill_tokens += sum(map(len, todo))
        s.prefill_seconds += toc - tic
        s.ttft.extend(toc - r.arrival for r in reqs)
        return caches

    def _prefill_caches(self, reqs: list[_Request]) -> list[Any]:
        """The engine's caches for a prefill batch: each row starts from its cached prefix,
        the attention layers' K/V gathered from the pool, the recurrent layers' state copied
        from its snapshot (copy-on-write: the snapshot stays as it was)."""
        layout = self.layout
        if not self.reuse:
            return build(layout, len(reqs))
        prefixes = [r.tree_slots[: r.cached] for r in reqs]
        widest = max(len(r.tokens) - r.cached for r in reqs)  # the prefill's widest row
        flat = list(layout.leaves)
        out: list[Any] = [None] * len(flat)
        kv = RaggedKVCache.from_pool_layers(
            self._pool, range(len(layout.kv_leaves)), prefixes,
            [flat[i].window for i in layout.kv_leaves], reserve=widest)
        for i, cache in zip(layout.kv_leaves, kv, strict=True):
            out[i] = cache
        if self.has_states:
            restoring = [k for k, r in enumerate(reqs) if r.restore is not None]
            got = (get_states(self._states, [reqs[k].restore for k in restoring])
                   if restoring else ())
            at = {k: j for j, k in enumerate(restoring)}
            arrays = itertools.count()
            for leaf, like in zip(layout.state_leaves, layout.like, strict=True):
                which = [None if x is None else next(arrays) for x in like]
                rows = [None if k not in at else
                        [None if w is None else got[w][at[k] : at[k] + 1] for w in which]
                        for k in range(len(reqs))]
                out[leaf] = RaggedArraysCache.from_rows(flat[leaf].size, like, rows)
        return build(layout, leaf_caches=out)

    def _snapshot(self, caches: list[Any], rows: list[int], depths: list[int]
                  ) -> list[tuple[int, int, int]]:
        """Store the recurrent states of ``rows`` of ``caches`` in the state pool (one slot
        each, while slots can be had); ``(row, depth, slot)`` of those stored."""
        if not rows:
            return []
        taken = []
        for row, depth in zip(rows, depths, strict=True):
            slot = self._alloc_snapshot()
            if slot is None:
                break
            taken.append((row, depth, slot))
        if taken:
            flat = leaves(caches)
            states = [mx.concatenate([flat[i].row(row)[j] for row, _, _ in taken])
                      for i, like in zip(self.layout.state_leaves, self.layout.like, strict=True)
                      for j, x in enumerate(like) if x is not None]
            self._states = set_states(self._states, [slot for _, _, slot in taken], states)
            self.stats.snapshots_taken += len(taken)
        return taken

    def _publish_prompts(self, reqs: list[_Request], caches: list[Any],
                         snaps: list[tuple[int, int, int]]) -> None:
        """Write the new K/V to the pool, insert the prompts (and hang the snapshots taken
        along them on the tree), move each lock onto its prompt."""
        new = [(i, r) for i, r in enumerate(reqs) if r.pending]  # a full hit writes nothing
        if new:
            flat = leaves(caches)
            kv = [flat[i] for i in self.layout.kv_leaves]
            rows = [[c.row(i, len(r.tree_slots)) for i, r in new] for c in kv]
            self._pool = set_kv_all_layers(
                self._pool,
                mx.array([s for _, r in new for s in r.pending], dtype=mx.int32),
                [mx.concatenate([k for k, _ in layer], axis=2) for layer in rows],
                [mx.concatenate([v for _, v in layer], axis=2) for layer in rows],
            )
            mx.async_eval(self._pool)  # scheduled (in place); the tree work below overlaps it
        for req in reqs:
            self._insert(req.tokens, req.tree_slots + req.pending, len(req.tree_slots))
            req.pending = []
        for row, depth, slot in snaps:
            self._add_state(reqs[row].tokens[:depth], slot)
        for req in reqs:
            slots, node, _ = self._tree.match_prefix(req.tokens)
            self._tree.lock(node)
            self._tree.unlock(req.node)
            req.node, req.tree_slots = node, slots

    def _add_state(self, tokens: list[int], slot: int) -> None:
        """Hang snapshot ``slot`` on the tree at ``tokens``' end; give it back if the tree
        has a state there already (or lacks the tokens: their K/V were not kept)."""
        if not self._tree.add_state(tokens, slot):
            self._state_alloc = free(self._state_alloc, [slot])

    def _insert(self, tokens: list[int], slots: list[int], owned: int) -> None:
        """Insert ``tokens``; ``slots[:owned]`` are the tree's already, the rest are ours.

        Ours that the tree does not keep (it had those tokens already, or they are past the
        last whole page) are freed.
        """
        kept_until = len(tokens) - len(tokens) % self.page_size
        cached = self._tree.insert(tokens, slots)
        drop = slots[owned : max(owned, cached)] + slots[max(owned, kept_until) :]
        if drop:
            self._alloc = free(self._alloc, drop)

    def _join(self, req: _Request, caches: list[Any], row: int) -> None:
        """Put a prefilled request (row ``row`` of ``caches``) into the running batch, or,
        unbatched, into a group of its own."""
        if not self.supported:  # mlx-lm's own caches, one request
            group = _Group(caches)
            self._groups.append(group)
        else:
            if self.batched:
                group = self._batch
            else:
                group = _Group(build(self.layout, 0))
                self._groups.append(group)
            _join_rows(group.caches, caches, row, slack=self.page_size)
        group.add(req)
        req.group, req.state = group, "running"

    def _decode_step(self, group: _Group) -> None:
        """One forward for the group; emits the tokens sampled by the *previous* step.

        The step's own samples stay on the device (``mx.async_eval``) and feed the next step,
        so building the next graph overlaps this step's compute, as in mlx-lm's generators.
        A request that finishes costs one wasted row of one step.
        """
        tic = time.perf_counter()
        feed, unread = group.feed, group.unread
        logits = self.model(feed[:, None], cache=group.caches)[:, -1, :]
        group.feed = self._sample(group.reqs, logits)
        group.unread = [True] * len(group.reqs)
        mx.async_eval(group.feed)
        fed = feed.tolist()
        self.stats.decode_seconds += time.perf_counter() - tic
        finished = []
        for req, token, new in zip(list(group.reqs), fed, unread, strict=True):
            if new:
                req.output.append(token)
                self.stats.decode_tokens += 1
                self._emit(req, token)
                if req.done:
                    finished.append(req)
        # Last rows first: a finished row at the end leaves without moving another row.
        for req in sorted(finished, key=group.reqs.index, reverse=True):
            self._finish(req, group)

    def _sample(self, reqs: list[_Request], logits: mx.array) -> mx.array:
        keys = []
        for r in reqs:
            if r.key is not None and not r.params.greedy:
                r.key, use = next_key(r.key)
                keys.append(use)
            else:
                keys.append(None)
        return sample(logits, [r.params for r in reqs], keys)

    def _finish(
        self, req: _Request, group: _Group | None, publish: bool = True, state: str = "done"
    ) -> None:
        """Cache prompt + answer (when there is room and ``publish``), leave the group, drop
        the lock."""
        if group is not None:
            row = group.reqs.index(req)
            if self.reuse and publish:
                self._publish_answer(req, group, row)
            if self.supported:
                for c in leaves(group.caches):
                    c.remove_row(row)
            group.remove(row)
            if not group.reqs and group is not self._batch:
                self._groups.remove(group)
        if req.node is not None:
            self._tree.unlock(req.node)
            req.node = None
        req.state, req.group = state, None

    def _publish_answer(self, req: _Request, group: _Group, row: int) -> None:
        """Write the K/V of the generated tokens that ran (all of them: a request finishes in
        the step that fed its last token) to the pool and insert prompt + answer; hybrid
        models also snapshot the state there, for the next turn of a conversation."""
        flat = leaves(group.caches)
        kv = [flat[i] for i in self.layout.kv_leaves]
        ran = kv[0].end(row)
        seq = (req.tokens + req.output)[:ran]
        total = len(seq) - len(seq) % self.page_size
        start = len(req.tree_slots)
        if total <= start:
            return
        new = self._alloc_slots(total - start)
        if new is None:  # the pool is full of locked prefixes: skip caching this answer
            return
        rows = [c.row(row, start) for c in kv]
        self._pool = set_kv_all_layers(
            self._pool,
            mx.array(new, dtype=mx.int32),
            [k[:, :, : total - start] for k, _ in rows],
            [v[:, :, : total - start] for _, v in rows],
        )
        mx.eval(self._pool)
        self._insert(seq[:total], req.tree_slots + new, start)
        if self.has_states and total == ran:
            taken = self._snapshot(group.caches, [row], [ran])
            mx.eval(self._states)
            for _, depth, slot in taken:
                self._add_state(seq[:depth], slot)
