"""What every attention backend shares: the batch it runs on (:class:`ForwardBatch`, its
:class:`ForwardMode` and :class:`SnapshotSpec`), the per-forward metadata types, and the
:class:`AttnBackend` protocol (the contract the model's layers call).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from hybridattn.pools import (
    HybridReqToTokenPool,
    LayerRef,
    MLATokenPool,
    RecurrentStatePool,
)
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "AttnBackend",
    "SnapshotSpec",
    "ForwardBatch",
    "ForwardMode",
    "FullAttnMetadata",
    "HybridLinearAttentionBackendMetadata",
    "LinearAttnMetadata",
    "check_forward_batch",
]

# Shape aliases used in annotations:
#   B  requests in the batch (padded rows included)      T  tokens in the batch (padded)
#   W  page-table width: max keys one request attends   Q  max new tokens of one request
#   H  attention heads; dn / dr / dv MLA nope / rope / value head dims; r kv_lora_rank
#   Hk KDA heads; Dk / Dv KDA key / value head dims; Cc conv channels (2 Hk Dk + Hk Dv)
#   HkDk, HkDv: Hk * Dk and Hk * Dv (KDA projections before the heads are split)
#
# The layer methods of the sub-backends are @no_type_check: their annotations document the
# shapes, and ``_check`` / ``_prepare`` check them with errors that name the layer.


class ForwardMode(enum.IntEnum):
    """What a batch does: ``EXTEND`` (prefill, chunked prefill, mixed) or ``DECODE``.

    >>> ForwardMode.DECODE, ForwardMode(1)
    (<ForwardMode.DECODE: 2>, <ForwardMode.EXTEND: 1>)
    """

    EXTEND = 1
    DECODE = 2


@pytree_dataclass(static=("windowed",))
class SnapshotSpec:
    """Recurrent-state snapshots an extend forward takes: entry ``m`` copies the KDA states of
    batch request ``batch_index[m]`` after its first ``lens[m]`` tokens (a depth inside this
    forward's extend: ``prefix < lens[m] <= seq_lens``) into slot ``slots[m]`` of the
    snapshot pool, every KDA layer. Unused entries have slot 0 (the snapshot pool's sink).

    A depth on the KDA chunk grid of its request's extend (``lens - prefix`` a multiple of the
    chunk) or at its end is a state the kernel computes anyway; one in between costs one more
    chunk of work. The first ``windowed`` entries (static; default all) may lie in between,
    the rest must not (their states are read off the kernel as they are).

    >>> spec = SnapshotSpec(batch_index=jnp.array([0, 0, 1, 0]), lens=jnp.array([40, 32, 7, 0]),
    ...                     slots=jnp.array([3, 4, 5, 0]), windowed=1)  # 40 is off the grid
    >>> spec.num_snapshots
    4
    """

    batch_index: Int[Array, " M"]
    lens: Int[Array, " M"]
    slots: Int[Array, " M"]
    windowed: int | None = None

    @property
    def num_snapshots(self) -> int:
        """``M``: entries, unused ones included (a static shape)."""
        return self.slots.shape[0]


@pytree_dataclass(static=("kv_width", "max_extend_len", "forward_mode"))
class ForwardBatch:
    """One forward's inputs and the pools it reads and writes.

    Request ``b`` has ``seq_lens[b]`` tokens after this forward, the last
    ``extend_seq_lens[b]`` of them new (so ``seq_lens - extend_seq_lens`` are already in the
    pools: its cached prefix). ``kv_width`` (static) is how many token positions of each
    request the MLA layers attend over (>= every ``seq_lens[b]``); ``max_extend_len``
    (static) bounds ``extend_seq_lens``. The host picks both from a few buckets so shapes
    repeat and nothing recompiles. Before the forward, ``req_to_token[req, prefix:seq_len]``
    must hold ``out_cache_loc`` of the request's new tokens (the scheduler writes them when it
    allocates). :func:`hybridattn.backends.batch.make_forward_batch` builds one from requests.
    ``snapshot_pool`` and ``snapshot_spec`` (optional, extend only) say which recurrent-state
    snapshots the KDA layers take along the way (see :class:`SnapshotSpec`).

    A batch of two requests padded to ``B = 3`` rows and ``T = 6`` tokens: row 1 is new (3
    tokens in slots 1-3), row 2 has 2 tokens cached (slots 4, 5) and decodes one (slot 6):

    >>> from hybridattn.config import KimiLinearConfig
    >>> from hybridattn.backends import BatchRequest, make_forward_batch
    >>> from hybridattn.pools import alloc_reqs_or_raise, write_token_slots
    >>> cfg = KimiLinearConfig.tiny()
    >>> req, rows = alloc_reqs_or_raise(HybridReqToTokenPool.create(2, 8), 2)  # rows 1, 2
    >>> req = write_token_slots(req, jnp.array([1, 1, 1, 2, 2, 2]),
    ...                         jnp.array([0, 1, 2, 0, 1, 2]), jnp.array([1, 2, 3, 4, 5, 6]))
    >>> batch = make_forward_batch(
    ...     [BatchRequest(1, 0, [7, 8, 9], [1, 2, 3]), BatchRequest(2, 2, [10], [6])],
    ...     req_to_token_pool=req, num_requests=3, num_tokens=6,
    ...     token_to_kv_pool=MLATokenPool.create((3,), 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim),
    ...     recurrent_state_pool=RecurrentStatePool.create((0, 1, 2), 3, 3 * 64, 4, 4, 16, 16))
    >>> batch.batch_size, batch.num_tokens, batch.kv_width, batch.max_extend_len
    (3, 6, 3, 3)
    >>> batch.input_ids.tolist(), batch.out_cache_loc.tolist()
    ([7, 8, 9, 10, 0, 0], [1, 2, 3, 6, 0, 0])
    >>> batch.seq_lens.tolist(), batch.extend_seq_lens.tolist(), batch.prefix_lens.tolist()
    ([3, 3, 0], [3, 1, 0], [0, 2, 0])
    """

    input_ids: Int[Array, " T"]
    req_pool_indices: Int[Array, " B"]
    seq_lens: Int[Array, " B"]
    extend_seq_lens: Int[Array, " B"]
    out_cache_loc: Int[Array, " T"]
    req_to_token_pool: HybridReqToTokenPool
    token_to_kv_pool: MLATokenPool
    recurrent_state_pool: RecurrentStatePool
    kv_width: int
    max_extend_len: int
    forward_mode: ForwardMode = ForwardMode.EXTEND
    snapshot_pool: RecurrentStatePool | None = None
    snapshot_spec: SnapshotSpec | None = None

    @property
    def prefix_lens(self) -> Int[Array, " B"]:
        """Tokens of each request already in the pools before this forward."""
        return self.seq_lens - self.extend_seq_lens

    @property
    def batch_size(self) -> int:
        """``B``: requests in the batch, padding rows included."""
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        """``T``: tokens in the batch, padding tokens included."""
        return self.input_ids.shape[0]


def check_forward_batch(batch: ForwardBatch) -> None:
    """Host-boundary validation; raises ``ValueError`` naming the field or value.

    Shapes, static sizes and pool sizes are checked always (also while tracing, at no cost);
    lengths are checked too when the batch holds concrete arrays (outside ``jax.jit``).
    Every backend's ``get_forward_metadata`` calls it.

    >>> batch = ForwardBatch(
    ...     input_ids=jnp.array([7, 8, 9]), req_pool_indices=jnp.array([1]),
    ...     seq_lens=jnp.array([3]), extend_seq_lens=jnp.array([3]),
    ...     out_cache_loc=jnp.array([1, 2, 3]), kv_width=3, max_extend_len=3,
    ...     req_to_token_pool=HybridReqToTokenPool.create(1, 8),
    ...     token_to_kv_pool=MLATokenPool.create((1,), 8, 4, 2),
    ...     recurrent_state_pool=RecurrentStatePool.create((0,), 2, 12, 4, 1, 4, 4))
    >>> check_forward_batch(batch)  # fine: returns None
    >>> check_forward_batch(batch.replace(kv_width=2))
    Traceback (most recent call last):
    ...
    ValueError: request 0 of the batch: seq_lens > kv_width=2 (seq_lens=3, extend_seq_lens=3)
    """
    B, T = batch.batch_size, batch.num_tokens
    for name in ("req_pool_indices", "seq_lens", "extend_seq_lens"):
        shape = getattr(batch, name).shape
        if shape != (B,):
            raise ValueError(f"ForwardBatch.{name} has shape {shape}, expected ({B},)")
    if batch.out_cache_loc.shape != (T,):
        raise ValueError(f"ForwardBatch.out_cache_loc has shape {batch.out_cache_loc.shape}, "
                         f"expected ({T},)")
    if batch.forward_mode == ForwardMode.DECODE and T != B:
        raise ValueError(f"a DECODE batch has one token per request: got {T} tokens, {B} requests")
    max_ctx = batch.req_to_token_pool.max_context_len
    if not 1 <= batch.kv_width <= max_ctx:
        raise ValueError(f"ForwardBatch.kv_width={batch.kv_width} must be in 1..{max_ctx}")
    if not 1 <= batch.max_extend_len <= T:
        raise ValueError(f"ForwardBatch.max_extend_len={batch.max_extend_len} must be in 1..{T}")
    states = batch.recurrent_state_pool.num_slots
    if batch.req_to_token_pool.num_state_slots > states:
        raise ValueError(f"the request pool hands out {batch.req_to_token_pool.num_state_slots} "
                         f"state slots but the recurrent-state pool has {states}")
    spec, snaps = batch.snapshot_spec, batch.snapshot_pool
    if spec is not None:
        if snaps is None:
            raise ValueError("ForwardBatch.snapshot_spec needs a snapshot_pool to write into")
        if batch.forward_mode == ForwardMode.DECODE and spec.num_snapshots:
            raise ValueError("a DECODE batch takes no snapshots (snapshot_spec must be empty)")
        for name in ("batch_index", "lens"):
            if getattr(spec, name).shape != spec.slots.shape:
                raise ValueError(f"SnapshotSpec.{name} has shape {getattr(spec, name).shape}, "
                                 f"expected {spec.slots.shape}")
    if snaps is not None and snaps.layer_ids != batch.recurrent_state_pool.layer_ids:
        raise ValueError(f"the snapshot pool has layers {snaps.layer_ids}, the recurrent-state "
                         f"pool {batch.recurrent_state_pool.layer_ids}")
    arrays = (batch.seq_lens, batch.extend_seq_lens)
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        return
    seq, ext = np.asarray(batch.seq_lens), np.asarray(batch.extend_seq_lens)
    checks = (
        ("extend_seq_lens < 0", ext < 0),
        ("extend_seq_lens > seq_lens", ext > seq),
        (f"seq_lens > kv_width={batch.kv_width}", seq > batch.kv_width),
        (f"extend_seq_lens > max_extend_len={batch.max_extend_len}", ext > batch.max_extend_len),
    )
    for what, bad in checks:
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"request {b} of the batch: {what} (seq_lens={int(seq[b])}, "
                             f"extend_seq_lens={int(ext[b])})")
    if ext.sum() > T:
        raise ValueError(f"the batch has {int(ext.sum())} new tokens but T={T}")
    if batch.forward_mode == ForwardMode.DECODE and (ext[seq > 0] != 1).any():
        raise ValueError("a DECODE batch has exactly one new token per live request")


# --------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------


@pytree_dataclass(static=("max_extend_len",))
class FullAttnMetadata:
    """MLA metadata: per-request lengths, query offsets, token-slot tables, output slots.

    :meth:`MLAAttnBackend.get_forward_metadata` builds it. For the batch of
    :class:`ForwardBatch`'s example (rows 1 and 2 and a padding row; ``W = kv_width = 3``):

    >>> md = FullAttnMetadata(
    ...     seq_lens=jnp.array([3, 3, 0]), prefix_lens=jnp.array([0, 2, 0]),
    ...     extend_lens=jnp.array([3, 1, 0]), query_start_loc=jnp.array([0, 3, 4, 4]),
    ...     page_table=jnp.array([[1, 2, 3], [4, 5, 6], [0, 0, 0]]),  # req_to_token[:, :W]
    ...     out_cache_loc=jnp.array([1, 2, 3, 6, 0, 0]), max_extend_len=3)
    >>> md.page_table.shape, md.query_start_loc.shape  # [B, W], [B + 1]
    ((3, 3), (4,))
    """

    seq_lens: Int[Array, " B"]
    prefix_lens: Int[Array, " B"]
    extend_lens: Int[Array, " B"]
    query_start_loc: Int[Array, " Bp1"]
    page_table: Int[Array, "B W"]
    out_cache_loc: Int[Array, " T"]
    max_extend_len: int = 1


@pytree_dataclass(static=("snapshot_windowed",))
class LinearAttnMetadata:
    """KDA metadata: packed sequence offsets, recurrent-state slots, has-initial-state flags.

    ``cu_seqlens`` has ``B + 2`` entries: the ``B`` requests, then one padding sequence that
    spans the tail padding tokens (its state goes to the sink slot 0).

    :meth:`KDAAttnBackend.get_forward_metadata` builds it. For the batch of
    :class:`ForwardBatch`'s example (row 1: 3 new tokens; row 2: 2 cached + 1 new; a padding
    row; ``T = 6``):

    >>> md = LinearAttnMetadata(
    ...     cu_seqlens=jnp.array([0, 3, 4, 4, 6]),  # tokens 4, 5: the padding sequence
    ...     state_indices=jnp.array([1, 2, 0]),  # req_to_state of each row
    ...     has_initial_state=jnp.array([False, True, False]))  # prefix_lens > 0
    >>> md.cu_seqlens.shape  # [B + 2]
    (5,)
    """

    cu_seqlens: Int[Array, " Bp2"]
    state_indices: Int[Array, " B"]
    has_initial_state: Bool[Array, " B"]
    snapshot_seqs: Int[Array, " M"] | None = None  # batch request of each snapshot
    snapshot_offsets: Int[Array, " M"] | None = None  # its depth within this extend (1..ext)
    snapshot_slots: Int[Array, " M"] | None = None  # where it goes in the snapshot pool
    snapshot_windowed: int = 0  # the first entries that may lie between chunk boundaries


@runtime_checkable
class AttnBackend(Protocol):
    """What the model's layers need of an attention backend (:class:`MLAAttnBackend`,
    :class:`KDAAttnBackend` and :class:`HybridLinearAttnBackend` all are one): per forward,
    ``backend.with_forward_metadata(backend.get_forward_metadata(batch))``, then per layer
    ``out, batch = backend.forward_extend(layer, batch, **inputs)`` (or ``forward_decode``,
    or ``backend(layer, batch, **inputs)``, which picks by ``batch.forward_mode``); the
    host sizes its pools with ``get_max_running_requests``.

    >>> from hybridattn.backends import MLAAttnBackend
    >>> from hybridattn.config import KimiLinearConfig
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2)
    >>> isinstance(MLAAttnBackend.from_config(cfg, num_token_slots=64), AttnBackend)
    True
    """

    def get_forward_metadata(self, batch: ForwardBatch) -> Any:
        """The per-forward metadata of ``batch`` (arrays, computed once per forward)."""

    def with_forward_metadata(self, md: Any) -> AttnBackend:
        """This backend holding ``md`` (what :meth:`get_forward_metadata` returned)."""

    def get_max_running_requests(self, max_context_len: int, page_size: int = 1) -> int:
        """How many requests of ``max_context_len`` tokens the backend's pools hold."""

    def forward_extend(self, layer: Any, batch: ForwardBatch,
                       **inputs: Any) -> tuple[Any, ForwardBatch]:
        """One layer over an ``EXTEND`` batch: ``(out, batch)`` with its pools updated."""

    def forward_decode(self, layer: Any, batch: ForwardBatch,
                       **inputs: Any) -> tuple[Any, ForwardBatch]:
        """One layer over a ``DECODE`` batch: ``(out, batch)`` with its pools updated."""



@pytree_dataclass()
class HybridLinearAttentionBackendMetadata:
    """The two sub-backends' metadata, side by side.

    :meth:`HybridLinearAttnBackend.get_forward_metadata` returns one and
    :meth:`HybridLinearAttnBackend.with_forward_metadata` splits it again (see that class's
    example). An unbound backend's halves are ``None``:

    >>> from hybridattn.backends import MLAAttnBackend, attn_backend_wrapper
    >>> from hybridattn.config import KimiLinearConfig
    >>> cfg = KimiLinearConfig.tiny()
    >>> backend = attn_backend_wrapper(cfg, MLAAttnBackend.from_config(cfg, 16), num_state_slots=3)
    >>> md = backend.forward_metadata
    >>> type(md).__name__, md.full_attn_metadata, md.linear_attn_metadata
    ('HybridLinearAttentionBackendMetadata', None, None)
    """

    full_attn_metadata: Any
    linear_attn_metadata: Any


def _query_start(extend_lens):
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(extend_lens, dtype=jnp.int32)])


def _layer_id(layer) -> int:
    layer_id = getattr(layer, "layer_id", layer)
    if not isinstance(layer_id, int) or isinstance(layer_id, bool):
        raise TypeError(f"layer must be an int layer id or have .layer_id, got {layer!r}")
    return layer_id


def _pool_key(layer):
    """How the pools find ``layer``: a ``LayerRef`` (a traced index inside a scan over
    stacked layers) as it is, anything else by its int id."""
    return layer if isinstance(layer, LayerRef) else _layer_id(layer)
