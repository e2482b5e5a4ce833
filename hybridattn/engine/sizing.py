"""How big an engine's pools are: a pure function of its options and the memory budget.

``pool_sizes`` splits ``mem_fraction`` of the available memory (less the parameters, the
``req_to_token`` table, the working KDA states and the largest step's working memory): a
quarter to the prefix cache's state snapshots (unless their number is given), the rest to MLA
token slots (at most every request at full context). ``MemoryReport`` says what the pools
hold, what the steps need beside them and what a token of context costs.

The defaults of the options themselves (``default_max_running_requests``, ...) are in
``hybridattn.engine.options``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.config import KimiLinearConfig
from hybridattn.engine.options import EngineOptions, default_max_running_requests
from hybridattn.models import kimi_linear
from hybridattn.serving import ServingState
from servecore import memory as _memory
from servecore.validate import check_int

__all__ = ["MemoryReport", "PoolSizes", "available_memory_bytes", "pool_sizes",
           "step_working_bytes"]


def available_memory_bytes() -> int:
    """Memory available to this process, in bytes: the least of ``MemAvailable`` (physical
    pages off Linux) and what its cgroups still allow (``servecore.memory``). ``Engine``
    sizes its default token pool from it.

    >>> available_memory_bytes() > 0
    True
    """
    return _memory.available_memory_bytes()


def step_working_bytes(fn, *args) -> int:
    """The temporaries XLA allocates while the jitted ``fn`` runs on ``args`` (arrays or
    ``ShapeDtypeStruct``\\ s: nothing runs), beside its arguments and outputs: the working
    memory of a step. Compiling here fills JAX's caches, so the step's first call with
    arguments of these shapes does not compile again. 0 where the backend does not say.

    >>> step_working_bytes(jax.jit(lambda x: (x @ x) @ x),  # x @ x is a temporary
    ...                    jax.ShapeDtypeStruct((256, 256), jnp.float32)) >= 256 * 256 * 4
    True
    """
    analysis = fn.lower(*args).compile().memory_analysis()
    return 0 if analysis is None else int(analysis.temp_size_in_bytes)


def _nbytes(x) -> int:
    """Bytes of an array or a ``ShapeDtypeStruct`` (a PRNG key counts its key data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return 8 * int(np.prod(x.shape))
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize



@dataclasses.dataclass
class MemoryReport:
    """Pool sizes and what a token of context costs (``hybridattn.Engine.memory``; ``str()`` gives a
    two-line summary).

    In the tiny model below, one MLA layer keeps ``kv_lora_rank + qk_rope_head_dim = 40``
    float32 numbers per token, where full attention in both layers would keep K and V of 4
    heads (``(24 + 16) * 4`` numbers per layer):

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> m = MemoryReport.for_config(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
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
    # XLA's temporaries of the largest step (``step_working_bytes``; per device under a
    # mesh): what the automatic sizer reserved, and at least what every step compiled so
    # far needs
    working_bytes: int = 0

    @property
    def serving_bytes(self) -> int:
        """Every byte the engine holds for serving: pools, parameters and step working memory
        (what ``budget_bytes`` must hold when the sizer chose the pools)."""
        return self.pool_bytes + self.param_bytes + self.working_bytes

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
        and 9 MiB of slot allocator; the 8 default rows need 8x the pool:

        >>> cfg = KimiLinearConfig.tiny()
        >>> r4k, r1m = MemoryReport.by_context_len(cfg, (4096, 1 << 20), max_running_requests=1)
        >>> r4k.mla_bytes_per_token, r1m.pool_bytes // (1 << 20), r1m.req_to_token_bytes >> 20
        (160, 177, 8)
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
            f"(req_to_token {self.req_to_token_bytes / mib:.1f} MiB); steps' working memory "
            f"{self.working_bytes / mib:.1f} MiB\n"
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



@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """What ``pool_sizes`` chose: the token slots (over all data shards, each shard's sink
    included), the snapshot slots (the sink included; 0 without a prefix cache), the request
    rows (over all data shards), the memory budget and the report of one row's costs
    (``unit``: what ``MemoryReport.for_config`` says of this geometry) and the data
    shards.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> unit = MemoryReport.for_config(cfg, max_running_requests=2, max_context_len=16,
    ...                                num_token_slots=2)
    >>> PoolSizes(33, 9, 2, 1 << 30, unit).shard_capacity  # the sink is no request's
    32
    """

    num_token_slots: int
    num_snapshot_slots: int
    rows: int
    budget_bytes: int
    unit: MemoryReport
    num_data_shards: int = 1

    @property
    def shard_capacity(self) -> int:
        """Token slots one data shard's requests may draw on (its sink excluded)."""
        return self.num_token_slots // self.num_data_shards - 1


def pool_sizes(opts: EngineOptions, config: KimiLinearConfig, param_bytes: int,
               available: int | None = None, working_bytes: int = 0) -> PoolSizes:
    """The pools of an engine with the (resolved) options ``opts``, ``param_bytes`` of
    parameters and steps that need ``working_bytes`` of temporaries, from
    ``opts.mem_fraction`` of ``available`` bytes (default ``available_memory_bytes()``);
    ``ValueError`` naming the option when they cannot fit.

    >>> from hybridattn.engine.options import EngineOptions
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> opts = EngineOptions(max_running_requests=2, max_context_len=16,
    ...                      num_token_slots=33).resolved(cfg)
    >>> p = pool_sizes(opts, cfg, param_bytes=0, available=1 << 30)
    >>> p.num_token_slots, p.rows, p.num_snapshot_slots > 1
    (33, 2, True)
    """
    R, L, D = opts.max_running_requests, opts.max_context_len, opts.num_data_shards
    budget = int(opts.mem_fraction * (available_memory_bytes() if available is None
                                      else available))
    unit = MemoryReport.for_config(config, num_token_slots=2, max_running_requests=R,
                                   max_context_len=L, dtype=opts.dtype, param_bytes=param_bytes)
    # The budget, after the parameters, the working states and the steps' temporaries, is
    # split: a quarter to the prefix cache's snapshots (unless their number is given), the
    # rest to token slots.
    snap_bytes = unit.state_bytes_per_request
    if unit.req_to_token_bytes > budget:
        raise ValueError(
            f"mem_fraction={opts.mem_fraction} of the available memory ({budget} bytes) holds "
            f"no req_to_token table of max_running_requests={R} rows x max_context_len={L} "
            f"int32 positions ({unit.req_to_token_bytes} bytes): lower max_running_requests "
            f"(the default at this context is {default_max_running_requests(L)})")
    left = budget - param_bytes - working_bytes - unit.req_to_token_bytes - (R + 1) * snap_bytes
    if not opts.prefix_cache:
        snap_share = 0
    elif opts.num_snapshot_slots is None:
        snap_share = max(left, 0) // 4
    else:
        snap_share = opts.num_snapshot_slots * snap_bytes
    num_token_slots = opts.num_token_slots
    if num_token_slots is None:
        num_token_slots = _default_token_slots(
            opts, budget, left - snap_share, unit.mla_bytes_per_token,
            f"after {param_bytes} bytes of parameters and {working_bytes} of step working "
            "memory")
    # Rows the token pool cannot fill at full context are not allocated (their
    # req_to_token rows and KDA states would sit idle); one row always, so a pool smaller
    # than one max_context_len serves one request at a time. Admission reserves each
    # request's own need, so requests shorter than max_context_len never run out. Under
    # a mesh this holds per data shard.
    shard_slots = num_token_slots // D
    rows = D * min(R // D, max(1, (shard_slots - 1) // L))
    return PoolSizes(num_token_slots, _snapshot_slots(opts, num_token_slots, rows, snap_share,
                                                      snap_bytes),
                     rows, budget, unit, D)


def _default_token_slots(opts: EngineOptions, budget: int, share: int,
                         bytes_per_token: int, spent: str) -> int:
    """The token slots ``share`` bytes hold, at most every request at full context: under a
    mesh the share is split evenly over the data shards, each with its own sink, and each
    shard's pool must hold one context."""
    R, L, D = opts.max_running_requests, opts.max_context_len, opts.num_data_shards
    fit = share // max(bytes_per_token, 1) // D
    per_shard = int(min(fit, R // D * L)) + 1
    if per_shard < L + 1:
        raise ValueError(
            f"mem_fraction={opts.mem_fraction} of the available memory ({budget} bytes) "
            f"holds {max(per_shard - 1, 0)} token slots"
            + (f" per data shard (of {D})" if opts.mesh is not None else "")
            + f" {spent}, less than one max_context_len={L}: lower max_context_len (or "
            "chunked_prefill_size, which the working memory grows with), raise mem_fraction, "
            "or give num_token_slots (a pool smaller than one context serves prompts up to its "
            "size)")
    return per_shard * D


def _snapshot_slots(opts: EngineOptions, num_token_slots: int, rows: int, share: int,
                    snap_bytes: int) -> int:
    """The snapshot slots (the sink included): given, or a grid snapshot for every interval
    the token pool can cache and a few more per request (the branch point, the last-but-one
    prompt token, the end), within ``share`` bytes; 0 without a prefix cache."""
    n = opts.num_snapshot_slots
    if not opts.prefix_cache:
        return 0
    if n is None:
        want = num_token_slots // opts.snapshot_interval + 4 * rows
        n = min(want, share // max(snap_bytes, 1)) + 1
        if n < 2:
            raise ValueError(
                f"a quarter of the memory budget left ({share} bytes) holds no KDA "
                f"snapshot of {snap_bytes} bytes: raise mem_fraction, give "
                "num_snapshot_slots, or pass prefix_cache=False")
    elif n < 2 * opts.num_data_shards:
        raise ValueError(f"num_snapshot_slots={n} holds no snapshot (slot 0 is the sink"
                         + (f" of each of {opts.num_data_shards} data shards"
                            if opts.num_data_shards > 1 else "")
                         + "): give at least 2 per shard, or pass prefix_cache=False")
    D = opts.num_data_shards  # under a mesh each data shard gets an equal share, with a sink
    return n if n % D == 0 else max(2, n // D) * D
