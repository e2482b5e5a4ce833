"""``hybridattn.Engine``: host-side continuous batching around the pure ``hybridattn.step``.

The engine owns a ``hybridattn.serving.ServingState`` and a jitted ``step`` (state
donated). Each ``Engine.step`` is one scheduling round:

1. **Admit** waiting requests (FIFO) while a request row and a recurrent-state slot are free
   (``get_max_running_requests`` bounds the rows) and the token slots can hold the request's
   whole life (prompt + ``max_new_tokens - 1``) on top of what running requests reserved. A
   request that does not fit waits; running requests can never run out of slots.
2. **Schedule**: if some admitted request still has prompt tokens to run, an ``EXTEND`` batch
   takes every decoding request (one token each) plus prompt chunks up to
   ``chunked_prefill_size`` tokens (chunked prefill: a long prompt spans several steps);
   otherwise a ``DECODE`` batch of every running request.
3. **Pad** the batch to shape buckets (requests, tokens, attention width, longest extend), so
   the step compiles once per bucket tuple, and run it.
4. **Finish** requests on a stop token or ``max_new_tokens``: their token slots, row and state
   slot are released at once (``hybridattn.serving.release``) and waiting requests move
   up.

Bad requests (empty prompt, token ids outside the vocabulary, ``max_new_tokens < 1``, a prompt
that cannot fit the context or the pool) raise ``ValueError`` from ``Engine.add_request``
before anything changes; running requests are unaffected.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.backend import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.pools import alloc_reqs
from hybridattn.serving import (
    SamplingParams,
    ServingState,
    WorkItem,
    make_worker_batch,
    release,
    step,
)

__all__ = ["Engine", "EngineStats", "MemoryReport", "available_memory_bytes"]


# The jitted functions are shared by every engine (a second engine of the same config and
# pool sizes reuses the compilations); _TRACES counts traces, i.e. compilations.
_TRACES = [0]


def _counted(fn):
    def traced(*args):
        _TRACES[0] += 1  # runs only while tracing
        return fn(*args)
    return traced


_step = jax.jit(_counted(step), donate_argnums=1)
_release = jax.jit(_counted(release), donate_argnums=0)
_alloc_row = jax.jit(_counted(lambda pool: alloc_reqs(pool, 1, 1)))


def available_memory_bytes() -> int:
    """Memory the OS reports as available, in bytes (``MemAvailable`` on Linux; physical
    pages elsewhere). ``Engine`` sizes its default token pool from it.

    >>> available_memory_bytes() > 0
    True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ladder(lo: int, hi: int, factor: int = 4) -> tuple[int, ...]:
    """``lo, lo * factor, ...`` below ``hi``, then ``hi``: the default shape buckets (few
    buckets, few compilations; padding wastes at most ``factor``x)."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= factor
    return (*out, hi)


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")


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

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"pools {self.pool_bytes / mib:.1f} MiB of a {self.budget_bytes / mib:.0f} MiB budget "
            f"(params {self.param_bytes / mib:.1f} MiB): {self.num_token_slots - 1} token slots, "
            f"{self.max_running_requests} requests x {self.max_context_len} context\n"
            f"per token of context: {self.mla_bytes_per_token} B of MLA latent ("
            f"{self.mla_layers} MLA layers x {self.mla_bytes_per_token // max(self.mla_layers, 1)}"
            f" B) vs "
            f"{self.full_attn_bytes_per_token} B if every layer kept full-attention K/V "
            f"({self.full_attn_bytes_per_token / max(self.mla_bytes_per_token, 1):.1f}x); "
            f"per request: {self.state_bytes_per_request / 1024:.1f} KiB of KDA state"
        )


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built (or ``Engine.reset_stats``): ``Engine.stats``.

    Steps that compiled are left out of the throughput figures. ``prefill_*``: steps that ran
    prompt tokens (decodes riding along in the same mixed step are not counted as tokens, but
    their time is here); ``decode_*``: pure decode steps. ``num_compilations``: traces of the
    engine's jitted functions (the step, one per new shape bucket, plus row allocation and
    release). ``ttft``: seconds from ``add_request`` to the first token, per request.
    ``buckets``: the ``(mode, B, T, W, Q)`` shape buckets the steps used.

    >>> stats = EngineStats(prefill_tokens=512, prefill_seconds=0.25, decode_tokens=64,
    ...                     decode_seconds=0.5, ttft=[0.1, 0.3])
    >>> stats.prefill_tok_s, stats.decode_tok_s, round(stats.mean_ttft, 6)
    (2048.0, 128.0, 0.2)
    """

    steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    num_compilations: int = 0
    compile_seconds: float = 0.0
    ttft: list[float] = dataclasses.field(default_factory=list)
    buckets: set = dataclasses.field(default_factory=set)  # step shape buckets used
    compiled_buckets: list = dataclasses.field(default_factory=list)  # ... that compiled

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second of the prefill (and mixed) steps; 0 before any."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Generated tokens per second of the pure decode steps; 0 before any."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def mean_ttft(self) -> float:
        """Mean time to first token in seconds; 0 before any."""
        return float(np.mean(self.ttft)) if self.ttft else 0.0


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset
    arrival: float
    output: list[int] = dataclasses.field(default_factory=list)
    row: int = 0
    computed: int = 0  # tokens whose KV / state is in the pools
    finished: bool = False

    @property
    def need(self) -> int:
        """Token slots over the request's whole life (the last sampled token never runs)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Engine:
    """Continuous-batching generation for a Kimi-Linear model.

    ``generate`` serves a list of prompts to completion, ``stream`` yields tokens as they
    come, and ``add_request`` / ``step`` drive the scheduler one round at a time. Requests
    are greedy unless given a ``temperature``; a request's samples depend on its prompt and
    seed, not on which other requests share its steps.

    Args:
        config: the model's config (``hybridattn.models.kimi_linear.load`` or
            ``KimiLinearConfig``).
        params: the model's parameters (``kimi_linear.load`` or ``kimi_linear.init_params``).
        max_running_requests: request rows (default 32).
        max_context_len: longest prompt + generation (default ``min(model_max_length, 4096)``).
        num_token_slots: MLA token slots; default: what ``mem_fraction`` of the available
            memory (less the parameters and the KDA states) holds, at most enough for every
            request at full context.
        mem_fraction: the share of ``available_memory_bytes()`` the default pool may use.
        chunked_prefill_size: prompt tokens per step (long prompts span several steps).
        request_buckets: shape buckets of the padded batches' request count (default:
            powers of four up to ``max_running_requests``); the step compiles once per
            bucket tuple used.
        token_buckets: shape buckets of the tokens in a step (default: powers of four from
            16 up to ``chunked_prefill_size + max_running_requests``).
        kv_buckets: shape buckets of the attention width (default: powers of four from 64
            up to ``max_context_len``).
        chunk_size: the KDA prefill chunk.
        dtype: the pools' dtype (MLA latents and conv states; KDA states are float32).
        seed: the base sampling key (``ServingState.create``).

    Attributes:
        state: the ``ServingState`` (pools) the steps update.
        stats: ``EngineStats``: throughput, TTFT, compilations and buckets.
        memory: ``MemoryReport``: pool sizes and bytes per token of context.
        max_running_requests: requests that run at once (rows, state slots and token slots
            permitting).
        capacity: token slots for requests (the sink excluded).

    Raises:
        ValueError: a size, fraction or bucket list that cannot work, naming it.

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
    """

    def __init__(
        self,
        config: KimiLinearConfig,
        params,
        *,
        max_running_requests: int = 32,
        max_context_len: int | None = None,
        num_token_slots: int | None = None,
        mem_fraction: float = 0.5,
        chunked_prefill_size: int = 256,
        request_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        kv_buckets: Sequence[int] | None = None,
        chunk_size: int = 32,
        dtype=jnp.float32,
        seed: int = 0,
    ):
        if max_context_len is None:
            max_context_len = min(config.model_max_length or 4096, 4096)
        for name, v in (("max_running_requests", max_running_requests),
                        ("max_context_len", max_context_len),
                        ("chunked_prefill_size", chunked_prefill_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if not 0 < mem_fraction <= 1:
            raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1]")
        self.config, self.params = config, params
        self.chunked_prefill_size = chunked_prefill_size
        itemsize = jnp.dtype(dtype).itemsize
        n_mla, n_kda = len(config.full_attention_layer_ids), len(config.kda_layer_ids)
        H, Dk, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
        mla_tok = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
        state_req = n_kda * (H * Dk * Dk * 4 + (K - 1) * 3 * H * Dk * itemsize)
        full_tok = (config.num_hidden_layers * config.num_attention_heads
                    * (config.q_head_dim + config.v_head_dim) * itemsize)
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        budget = int(mem_fraction * available_memory_bytes())
        if num_token_slots is None:
            left = budget - param_bytes - (max_running_requests + 1) * state_req
            fit = left // max(mla_tok, 1)
            num_token_slots = int(min(fit, max_running_requests * max_context_len)) + 1
            if num_token_slots < max_context_len + 1:
                raise ValueError(
                    f"mem_fraction={mem_fraction} of the available memory ({budget} bytes) "
                    f"holds {max(num_token_slots - 1, 0)} token slots, less than one "
                    f"max_context_len={max_context_len}: lower max_context_len or raise "
                    "mem_fraction"
                )
        self.state = ServingState.create(
            config, max_running_requests=max_running_requests, max_context_len=max_context_len,
            num_token_slots=num_token_slots, dtype=dtype, chunk_size=chunk_size, seed=seed,
        )
        self.max_running_requests = self.state.max_running_requests
        if self.max_running_requests < 1:
            raise ValueError(f"num_token_slots={num_token_slots} cannot hold one request of "
                             f"max_context_len={max_context_len}")
        self.max_context_len = max_context_len
        self.capacity = num_token_slots - 1
        self.memory = MemoryReport(
            budget_bytes=budget, param_bytes=param_bytes,
            max_running_requests=self.max_running_requests, max_context_len=max_context_len,
            num_token_slots=num_token_slots, mla_layers=n_mla, mla_bytes_per_token=mla_tok,
            full_attn_bytes_per_token=full_tok, state_bytes_per_request=state_req,
            pool_bytes=sum(x.nbytes for x in jax.tree.leaves(self.state)),
        )
        R = self.max_running_requests
        max_t = chunked_prefill_size + R  # prompt chunks (of several requests) + decodes
        self.request_buckets = tuple(request_buckets or _ladder(1, R))
        self.token_buckets = tuple(token_buckets or _ladder(16, max_t))
        self.kv_buckets = tuple(kv_buckets or _ladder(64, max_context_len))
        for name, bk in (("request_buckets", self.request_buckets),
                         ("token_buckets", self.token_buckets), ("kv_buckets", self.kv_buckets)):
            if (not all(isinstance(b, int) and not isinstance(b, bool) for b in bk)
                    or list(bk) != sorted(set(bk)) or bk[0] < 1):
                raise ValueError(f"{name}={bk} must be increasing positive ints")
        if self.kv_buckets[-1] > max_context_len:
            raise ValueError(f"kv_buckets={self.kv_buckets} must not exceed max_context_len="
                             f"{max_context_len}")
        if self.request_buckets[-1] < R:
            raise ValueError(f"request_buckets={self.request_buckets} must reach "
                             f"max_running_requests={R}")
        if self.kv_buckets[-1] < max_context_len:
            raise ValueError(f"kv_buckets={self.kv_buckets} must reach max_context_len="
                             f"{max_context_len}")
        if self.token_buckets[-1] < max_t:
            raise ValueError(f"token_buckets={self.token_buckets} must reach {max_t}: a step "
                             f"takes up to chunked_prefill_size={chunked_prefill_size} prompt "
                             f"tokens and one token of each of {R} running requests")
        self.stats = EngineStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._free_rows = R
        self._reserved = 0
        self._next_rid = 0

    def _call(self, fn, *args):
        """Run a shared jitted function, counting the compilations it needed."""
        before = _TRACES[0]
        out = fn(*args)
        self.stats.num_compilations += _TRACES[0] - before
        return out

    # ---------------------------------------------------------------------------------------
    # requests
    # ---------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> int:
        """Queue a request; returns its id (ids count up from 0). It is admitted by a later
        ``step`` once a row and the token slots for its whole life (prompt +
        ``max_new_tokens - 1``) are free. Generation ends after ``max_new_tokens`` tokens or
        on a token in ``stop_token_ids`` (which is kept). Raises ``ValueError`` naming the
        bad value, and then nothing has changed."""
        req = self._make_request(prompt, max_new_tokens, temperature, top_k, top_p, seed,
                                 stop_token_ids)
        self._next_rid += 1
        self._waiting.append(req)
        return req.rid

    def _make_request(self, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                      stop_token_ids) -> _Request:
        """A validated request with the next id (nothing queued)."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt token ids must be ints, got dtype {ids.dtype}")
        V = self.config.vocab_size
        bad = (ids < 0) | (ids >= V)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"prompt token {i} is {int(ids[i])}, outside the vocabulary "
                             f"[0, {V})")
        if (not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool)
                or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
        for name, v in (("top_k", top_k), ("seed", seed)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{name}={v!r} must be an int")
        sampling = SamplingParams(float(temperature), int(top_k), float(top_p), int(seed))
        sampling.check()
        stops = np.asarray(list(stop_token_ids) if stop_token_ids is not None else [], np.int64)
        if stops.ndim != 1 or ((stops < 0) | (stops >= V)).any():
            raise ValueError(f"stop_token_ids={stop_token_ids!r} must be token ids in [0, {V})")
        req = _Request(self._next_rid, ids.tolist(), int(max_new_tokens), sampling,
                       frozenset(stops.tolist()), time.perf_counter())
        if req.need > self.max_context_len:
            raise ValueError(f"prompt of {ids.size} tokens + max_new_tokens={max_new_tokens} "
                             f"needs a context of {req.need} tokens, more than max_context_len="
                             f"{self.max_context_len}")
        if req.need > self.capacity:
            raise ValueError(f"the request needs {req.need} token slots, more than the pool "
                             f"holds ({self.capacity})")
        return req

    def abort(self, rid: int) -> bool:
        """Drop request ``rid`` (waiting or running; its slots are released at once). Returns
        whether it was still unfinished."""
        for r in self._waiting:
            if r.rid == rid:
                self._waiting.remove(r)
                return True
        for r in self._running:
            if r.rid == rid:
                self._finish([r])
                return True
        return False

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        """Admitted requests (holding a row and their token-slot reservation)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued requests not admitted yet."""
        return len(self._waiting)

    # ---------------------------------------------------------------------------------------
    # one scheduling round
    # ---------------------------------------------------------------------------------------

    def _admit(self) -> None:
        while self._waiting and self._free_rows > 0:
            req = self._waiting[0]
            if self._reserved + req.need > self.capacity:
                break  # wait for running requests to finish
            pool, rows, ok = self._call(_alloc_row, self.state.req_to_token_pool)
            if not bool(ok):  # cannot happen while the host counts agree with the pool
                raise RuntimeError("request-row allocation failed with rows counted free")
            self.state = self.state.replace(req_to_token_pool=pool)
            req.row = int(rows[0])
            self._waiting.popleft()
            self._running.append(req)
            self._free_rows -= 1
            self._reserved += req.need

    def _schedule(self) -> tuple[ForwardMode, list[tuple[_Request, list[int]]]]:
        decoding = [r for r in self._running if r.computed >= len(r.prompt)]
        prefilling = [r for r in self._running if r.computed < len(r.prompt)]
        if not prefilling:
            return ForwardMode.DECODE, [(r, [r.tokens[r.computed]]) for r in decoding]
        work = [(r, [r.tokens[r.computed]]) for r in decoding]
        budget = min(self.chunked_prefill_size, self.token_buckets[-1] - len(decoding))
        for r in prefilling:
            if budget <= 0:
                break
            n = min(budget, len(r.prompt) - r.computed)
            work.append((r, r.prompt[r.computed: r.computed + n]))
            budget -= n
        return ForwardMode.EXTEND, work

    def step(self) -> list[tuple[int, int, bool]]:
        """One scheduling round (admit, schedule, run one step, finish); returns
        ``(request id, new token, finished)`` for every token generated in it (none for a
        step that only ran prompt chunks, or when nothing is queued)."""
        self._admit()
        if not self._running:
            return []
        mode, work = self._schedule()
        items = [WorkItem(r.row, r.computed, toks, r.sampling) for r, toks in work]
        n_tok = sum(len(t) for _, t in work)
        B = _bucket(len(items), self.request_buckets, "requests in a step")
        seq_max = max(r.computed + len(t) for r, t in work)
        W = _bucket(seq_max, self.kv_buckets, "context length")
        if mode == ForwardMode.DECODE:
            T, Q = B, 1
        else:
            T = _bucket(n_tok, self.token_buckets, "tokens in a step")
            Q = min(T, _bucket(max(len(t) for _, t in work), self.token_buckets, "extend"))
        batch = make_worker_batch(
            items, vocab_size=self.config.vocab_size, max_context_len=self.max_context_len,
            forward_mode=mode, num_requests=B, num_tokens=T, kv_width=W, max_extend_len=Q,
        )
        self.stats.buckets.add((int(mode), B, T, W, Q))
        traces = _TRACES[0]
        t0 = time.perf_counter()
        self.state, out = self._call(_step, self.params, self.state, batch)
        tokens = np.asarray(out.next_token_ids)
        if not bool(out.ok):  # the admission reservation makes this unreachable
            raise RuntimeError("token slots ran out inside a step despite the reservation")
        now = time.perf_counter()
        dt = now - t0
        if _TRACES[0] > traces:  # this call compiled
            self.stats.compiled_buckets.append((int(mode), B, T, W, Q))
            self.stats.compile_seconds += dt
        else:
            n_prefill = sum(len(t) for r, t in work if r.computed < len(r.prompt))
            if mode == ForwardMode.DECODE:
                self.stats.decode_tokens += n_tok
                self.stats.decode_seconds += dt
            else:
                self.stats.prefill_tokens += n_prefill
                self.stats.prefill_seconds += dt
        self.stats.steps += 1

        events, done = [], []
        for i, (r, toks) in enumerate(work):
            r.computed += len(toks)
            if r.computed < len(r.prompt):
                continue  # a prompt chunk: its sample is discarded
            tok = int(tokens[i])
            if not r.output:
                self.stats.ttft.append(now - r.arrival)
            r.output.append(tok)
            r.finished = tok in r.stop_token_ids or len(r.output) >= r.max_new_tokens
            events.append((r.rid, tok, r.finished))
            if r.finished:
                done.append(r)
        if done:
            self._finish(done)
        return events

    def _finish(self, done: list[_Request]) -> None:
        R = self.request_buckets[-1]
        rows = np.zeros(R, np.int32)
        rows[: len(done)] = [r.row for r in done]
        self.state = self._call(_release, self.state, jnp.asarray(rows))
        for r in done:
            self._running.remove(r)
            self._free_rows += 1
            self._reserved -= r.need

    # ---------------------------------------------------------------------------------------
    # convenience
    # ---------------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile the smallest buckets (one prefill step, one decode step) by serving a
        one-token request, then reset the throughput counters (compilations are kept). With
        one bucket per dimension that is every compilation the engine will need."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        self.generate([[0]], 2)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the throughput counters and TTFTs; compilation counts and buckets stay."""
        s = self.stats
        self.stats = EngineStats(num_compilations=s.num_compilations,
                                 compile_seconds=s.compile_seconds, buckets=s.buckets,
                                 compiled_buckets=s.compiled_buckets)

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        progress: bool = False,
    ) -> Iterator[tuple[int, int]]:
        """Serve ``prompts`` and yield ``(prompt index, token)`` as tokens are generated.
        Request ``i`` samples with seed ``seed + i``. All prompts are validated first (a
        ``ValueError`` names the bad prompt, and nothing is queued); requests left when the
        consumer stops early are aborted. ``progress`` draws a bar on stderr."""
        rids = {}
        for i, p in enumerate(prompts):  # validate every prompt before queueing any
            try:
                self._make_request(p, max_new_tokens, temperature, top_k, top_p, seed + i,
                                   stop_token_ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        for i, p in enumerate(prompts):
            rids[self.add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed + i,
                                  stop_token_ids=stop_token_ids)] = i
        left = set(rids)
        total = len(rids) * max_new_tokens
        try:
            while left:
                for rid, tok, finished in self.step():
                    if rid in rids:
                        yield rids[rid], tok
                        if finished:
                            left.discard(rid)
                if progress:
                    _progress(total - self._remaining(left), total)
        finally:  # the consumer stopped early (or a step raised): free what is left
            for rid in left:
                self.abort(rid)
        if progress:
            print(file=sys.stderr)

    def _remaining(self, rids) -> int:
        left = 0
        for r in list(self._waiting) + self._running:
            if r.rid in rids:
                left += r.max_new_tokens - len(r.output)
        return left

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        progress: bool = False,
    ) -> list[list[int]]:
        """Generate for every prompt; returns the new tokens of each (a stop token, when hit,
        is the last). Same arguments as ``stream``; see the class docstring for an example."""
        outs: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                  stop_token_ids, progress):
            outs[i].append(tok)
        return outs


def _progress(done: int, total: int, width: int = 40) -> None:
    frac = done / total if total else 1.0
    bar = "#" * int(frac * width)
    print(f"\r[{bar:<{width}}] {done}/{total} tokens", end="", file=sys.stderr, flush=True)
