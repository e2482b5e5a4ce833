"""The options of ``hybridattn.Engine``, checked in one place: ``EngineOptions``.

Every option is a field of a frozen dataclass; ``resolved(config)`` checks each (a
``ValueError`` names the option and its value) and fills the defaults that depend on the
model, the context or the mesh. Each field's docstring says what it does.

>>> from hybridattn.config import KimiLinearConfig
>>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
>>> opts = EngineOptions(max_context_len=1 << 20).resolved(cfg)
>>> opts.max_running_requests, opts.chunked_prefill_size, opts.snapshot_interval
(8, 2048, 256)
>>> EngineOptions(mem_fraction=2.0).resolved(cfg)
Traceback (most recent call last):
...
ValueError: mem_fraction=2.0 must be in (0, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from hybridattn.config import KimiLinearConfig
from hybridattn.mesh import check_divisible, mesh_sizes
from servecore.validate import check_int, check_real

__all__ = ["REQ_TABLE_POSITIONS", "EngineOptions", "default_chunked_prefill_size",
           "default_max_running_requests"]


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



@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """``hybridattn.Engine``'s options, each field's meaning beside it: ``Engine(config,
    params, tokenizer=..., **options)`` takes any of them by name. None means "the default",
    which ``resolved`` fills in from the model, the context and the mesh.

    >>> EngineOptions(decode_steps=8).decode_steps, EngineOptions().num_data_shards
    (8, 1)
    """

    max_running_requests: int | None = None
    """Request rows (default ``default_max_running_requests``: 32, fewer above 256k of
    context, so the ``req_to_token`` table stays within 32 MiB); never more than the token
    slots hold at full context, and at least one."""

    max_context_len: int | None = None
    """Longest prompt + generation (default ``min(model_max_length, 4096)``); up to 1M tokens
    and beyond: only the ``req_to_token`` rows grow with it, the token pool is sized on its
    own (a pool smaller than one full context serves one request at a time)."""

    num_token_slots: int | None = None
    """MLA token slots; default: what ``mem_fraction`` of the available memory holds beside
    the parameters, tables, KDA states and step working memory (the largest step's, compiled
    first if pools fill half), at most every row full."""

    mem_fraction: float = 0.5
    """The share of ``servecore.available_memory_bytes()`` the default pools may use."""

    chunked_prefill_size: int | None = None
    """Prompt tokens per step (long prompts span several steps); default
    ``default_chunked_prefill_size``: 256, or 2048 past 4096 tokens of context."""

    request_buckets: Sequence[int] | None = None
    """Shape buckets of the padded batches' request count (default: powers of four up to
    ``max_running_requests``); the step compiles once per bucket tuple used."""

    token_buckets: Sequence[int] | None = None
    """Shape buckets of the tokens in a step (default: powers of four from 16 up to
    ``chunked_prefill_size + max_running_requests``)."""

    kv_buckets: Sequence[int] | None = None
    """Shape buckets of the attention width (default: powers of four from 64 up to 4096, then
    powers of two up to ``max_context_len``: a width pads by at most 2x, 12 buckets for 1M)."""

    snapshot_buckets: Sequence[int] | None = None
    """Shape buckets of the state snapshots an extend step takes (default: 0, then powers of
    four from 4 up to what a step can take: one per grid interval of a prefill chunk and
    three per request); one bucket means one variant."""

    chunk_size: int = 32
    """The KDA prefill chunk, a power of two."""

    dtype: Any = jnp.float32
    """The pools' floating dtype (MLA latents and conv states; KDA states are float32)."""

    seed: int = 0
    """The base sampling key (``ServingState.create``)."""

    prefix_cache: bool | None = None
    """Reuse cached prefixes: a radix tree over the token slots with exact KDA state snapshots
    (``hybridattn.engine._prefix_cache``); False re-prefills every prompt from token 0.
    Default: on; under a ``mesh`` one tree per data shard, each request routed to the shard
    holding its longest usable prefix (``ShardedScheduler``)."""

    snapshot_interval: int | None = None
    """The snapshot grid along every prefill, a positive multiple of ``chunk_size`` (default:
    the multiple of it nearest 256, at least one chunk)."""

    num_snapshot_slots: int | None = None
    """Snapshot slots (the sink included); default: one per grid interval of the token pool
    and four per request row, within a quarter of the memory budget left after the
    parameters and working states (the token pool gets the rest)."""

    decode_steps: int = 1
    """Decode steps per dispatch when a round would be a pure decode step that nothing can
    join before it ends (no request waits, or none running can reach its ``max_tokens``
    inside the run). The steps run in one ``lax.while_loop`` on the device
    (``hybridattn.serving.decode_steps``), each request at most up to its ``max_tokens``; a
    request that samples a stop token inside the run becomes padding from the next step on,
    so pools, tokens and stats are those of stepping one at a time. It saves the host's
    planning, packing, dispatch and read-back of every step but the first; a request that
    finishes early holds its row until the run ends. Each count compiles its own decode
    function per bucket. One step per round under a ``mesh``."""

    overlap: bool | None = None
    """Overlapped scheduling (default: on with one device, off under a ``mesh``, where True is
    refused): a step stays on the device while its round ends, and the next round admits,
    plans and dispatches the step after it before reading its tokens (each decoding row's
    last token comes from the device); the host then commits the earlier step's tokens while
    the device computes. Each request's tokens are those of ``overlap=False``; a step's
    tokens reach ``step`` / ``stream`` one round later."""

    scan_layers: bool = True
    """Run the layers that repeat as one ``lax.scan`` over stacked parameters and pools
    (``kimi_linear.stack_layers``): the released 27 layers are layer 0 and seven groups of
    2-3 KDA layers each ending in an MLA layer (``kimi_linear.group_plan``), so each bucket
    compiles 2 layers instead of 27. The engine then holds the stacked copy of ``params``
    (under a mesh, placed by ``kimi_linear.stacked_param_specs``; on one device also in
    ``kimi_linear.serving_layout``). No effect on a model whose layers do not repeat."""

    mesh: Any = None
    """A ``(data, tensor)`` ``jax.sharding.Mesh`` (``hybridattn.mesh.make_mesh``) to serve on
    (docs/sharding.md): the step runs sharded (``sharding.ShardedStep``), ``params`` are placed
    by ``kimi_linear.PARAM_RULES``, and the pools split into ``data`` shards, each with
    ``max_running_requests / data`` rows and ``num_token_slots / data`` token slots (its own
    sink included; both must divide) and its own prefix cache. Each request runs on one data
    shard for its whole life. Heads and MLP channels must divide by ``tensor``, routed experts
    by ``data * tensor``. Across processes every process builds the same engine; process 0
    serves and the others ``follow()`` (``hybridattn.engine.processes``)."""

    @property
    def num_data_shards(self) -> int:
        """The mesh's data size (1 without a mesh)."""
        return 1 if self.mesh is None else mesh_sizes(self.mesh)[0]

    def resolved(self, config: KimiLinearConfig) -> EngineOptions:
        """These options checked, with every default that depends on ``config``, the context
        or the mesh filled in (``overlap`` is then whether the engine overlaps: never under a
        mesh). ``ValueError`` names the first option that cannot work."""
        L = self.max_context_len
        if L is None:
            L = min(config.model_max_length or 4096, 4096)
        check_int("max_context_len", L, 1)
        D = self._check_mesh(config)
        prefix_cache = True if self.prefix_cache is None else self.prefix_cache
        R = self.max_running_requests
        if R is None:
            R = default_max_running_requests(L)
            R = max(D, R - R % D)
        check_int("max_running_requests", R, 1)
        chunked = self.chunked_prefill_size
        if chunked is None:
            chunked = default_chunked_prefill_size(L)
        check_int("chunked_prefill_size", chunked, 1)
        C = check_int("chunk_size", self.chunk_size, 1)
        if C & (C - 1):
            raise ValueError(f"chunk_size={C} must be a power of two (the KDA kernel's chunk)")
        check_int("seed", self.seed, 0)
        check_int("decode_steps", self.decode_steps, 1)
        interval = self.snapshot_interval
        if interval is None:
            interval = max(1, round(256 / C)) * C
        if check_int("snapshot_interval", interval, 1) % C:
            raise ValueError(f"snapshot_interval={interval} must be a positive multiple "
                             f"of chunk_size={C} (snapshots sit on the KDA chunk grid)")
        if self.num_snapshot_slots is not None:
            check_int("num_snapshot_slots", self.num_snapshot_slots, 0)
        if self.num_token_slots is not None:
            check_int("num_token_slots", self.num_token_slots, 2)
        self._check_memory()
        for name in ("overlap", "scan_layers"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "overlap" and value is None):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        self._check_inert(prefix_cache)
        return dataclasses.replace(
            self, max_context_len=L, prefix_cache=prefix_cache, max_running_requests=R,
            chunked_prefill_size=chunked, snapshot_interval=interval,
            overlap=self.overlap is not False and self.mesh is None)

    def _check_inert(self, prefix_cache: bool) -> None:
        """``ValueError`` naming an option the caller gave that would do nothing in the mode
        chosen (and the option that chose it): the prefix cache's options without a prefix
        cache, ``overlap=True`` or several ``decode_steps`` under a mesh (it steps one at a
        time, synchronously). Defaults never trip it: only values that were given."""
        why = "prefix_cache=False"
        for name in ("snapshot_interval", "num_snapshot_slots", "snapshot_buckets"):
            if not prefix_cache and getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} does nothing with {why}: "
                                 f"leave {name} unset, or turn the prefix cache on")
        if self.mesh is not None and self.overlap is True:
            raise ValueError("overlap=True does nothing with a mesh (a sharded engine steps "
                             "synchronously): leave overlap unset, or pass mesh=None")
        if self.mesh is not None and self.decode_steps != 1:
            raise ValueError(f"decode_steps={self.decode_steps} does nothing with a mesh (a "
                             "sharded engine decodes one step per round): leave decode_steps "
                             "unset, or pass mesh=None")

    def _check_memory(self) -> None:
        """``mem_fraction`` in (0, 1] and a floating ``dtype``."""
        f = self.mem_fraction
        if check_real("mem_fraction", f) <= 0 or f > 1:
            raise ValueError(f"mem_fraction={f!r} must be in (0, 1]")
        try:  # (None is no dtype here, though NumPy reads it as float64)
            floating = self.dtype is not None and jnp.issubdtype(jnp.dtype(self.dtype),
                                                                 jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"dtype={self.dtype!r} must be a floating dtype (the pools hold "
                             "activations)")

    def _check_mesh(self, config: KimiLinearConfig) -> int:
        """The mesh's data size (1 without a mesh); ValueError for a mesh, option or count
        that cannot work on it."""
        mesh, prefix_cache = self.mesh, self.prefix_cache
        if prefix_cache is not None and not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache={prefix_cache!r} must be a bool")
        if mesh is None:
            return 1
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh with axes ('data', "
                             "'tensor') (hybridattn.mesh.make_mesh)")
        D, tensor = mesh_sizes(mesh)
        check_divisible(config, D, tensor)
        for name in ("max_running_requests", "num_token_slots", "num_snapshot_slots"):
            n = getattr(self, name)
            if n is not None:
                check_int(name, n, 1)
                if n % D:
                    raise ValueError(f"{name}={n} is not divisible by the mesh's data size "
                                     f"{D} (each data shard has its own rows, token slots and "
                                     "snapshot slots)")
        n = self.num_token_slots
        if n is not None and n // D < 2:
            raise ValueError(f"num_token_slots={n} leaves a data shard (of {D}) "
                             "no token slot besides its sink")
        return D
