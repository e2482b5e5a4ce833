"""Attention backends for hybrid models: MLA over a latent pool, KDA over a state pool, and the
:class:`HybridLinearAttnBackend` that dispatches each layer to one of them.

Data flow of one forward (all of it runs inside one ``jax.jit``)::

    ForwardBatch (tokens, request rows, lengths, output slots, the pools)
      -> backend.get_forward_metadata(batch)        # HybridLinearAttentionBackendMetadata
      -> backend = backend.with_forward_metadata(md) # split into the two sub-backends
      -> each layer: out, batch = backend(layer_id, batch, **inputs)
         MLA layers write c_kv / k_pe into batch.token_to_kv_pool and attend over it;
         KDA layers read and write conv + recurrent state in batch.recurrent_state_pool.

Backends hold static configuration (treedef) and the per-forward metadata (arrays); they hold no
memory. The pools travel in the :class:`ForwardBatch` and come back updated, like SGLang's
``ForwardBatch.token_to_kv_pool``, but functionally. Padded rows and tokens point at slot 0 of
every pool (the padding sink), so they never touch a live slot.

Batch layouts (static ``forward_mode``):

* ``EXTEND``: ``T`` packed new tokens of ``B`` requests (request ``b`` owns tokens
  ``[query_start[b], query_start[b] + extend_seq_lens[b])``; padding tokens at the tail).
  A request may have a cached prefix (``seq_lens[b] - extend_seq_lens[b] > 0``). A decode
  request inside an extend batch is simply a request with one new token: a mixed batch.
* ``DECODE``: one token per request, ``T == B``.
"""

from __future__ import annotations

import enum
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from hybridattn._pytree import pytree_dataclass
from hybridattn.config import KimiLinearConfig
from hybridattn.mla import mla_decode, mla_extend, ref_mla_decode, ref_mla_extend
from hybridattn.ops import _recurrent_steps, kda_chunked, kda_decode, l2norm, short_conv
from hybridattn.pools import (
    HybridReqToTokenPool,
    LayerRef,
    MLATokenPool,
    RecurrentStatePool,
    get_linear_recurrent_indices,
    get_mla_kv_flat,
    get_states,
    get_token_slots,
    set_mla_kv,
    set_states,
)

__all__ = [
    "SnapshotSpec",
    "ForwardBatch",
    "ForwardMode",
    "FullAttnMetadata",
    "HybridLinearAttentionBackendMetadata",
    "HybridLinearAttnBackend",
    "KDAAttnBackend",
    "LinearAttnMetadata",
    "MLAAttnBackend",
    "attn_backend_wrapper",
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
    allocates). :func:`hybridattn.batch.make_forward_batch` builds one from requests.
    ``snapshot_pool`` and ``snapshot_spec`` (optional, extend only) say which recurrent-state
    snapshots the KDA layers take along the way (see :class:`SnapshotSpec`).

    A batch of two requests padded to ``B = 3`` rows and ``T = 6`` tokens: row 1 is new (3
    tokens in slots 1-3), row 2 has 2 tokens cached (slots 4, 5) and decodes one (slot 6):

    >>> from hybridattn.batch import BatchRequest, make_forward_batch
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


@pytree_dataclass()
class HybridLinearAttentionBackendMetadata:
    """The two sub-backends' metadata, side by side.

    :meth:`HybridLinearAttnBackend.get_forward_metadata` returns one and
    :meth:`HybridLinearAttnBackend.with_forward_metadata` splits it again (see that class's
    example). An unbound backend's halves are ``None``:

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


# --------------------------------------------------------------------------------------------
# MLA: full attention over the compressed latent pool
# --------------------------------------------------------------------------------------------


@pytree_dataclass(
    static=("layer_ids", "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "kv_lora_rank", "num_token_slots", "block_size", "query_block", "extend_form",
            "impl", "decode_block_size")
)
class MLAAttnBackend:
    """Multi-head latent attention over :class:`MLATokenPool`.

    Per layer the pool keeps ``c_kv [S, r]`` and ``k_pe [S, dr]`` only. Attention walks each
    request's pages in key blocks of ``block_size`` tokens with an exact online softmax
    (:mod:`hybridattn.mla`): memory ``O(T + query_block x block_size x H)`` at any context
    length, cost following each request's own length. Decode walks blocks of
    ``decode_block_size`` keys: its one query per request makes a block's scores ``[H, bk]``,
    so wider blocks cost no more workspace than extend's tiles and take fewer loop steps
    (64k keys on the tiny config: 7.3 ms in blocks of 512, 4.9 ms in blocks of 8192, as one
    dense pass 3.4 ms). Decode runs in absorbed form
    (``q_nope W_kc`` moves the query into latent space, attention runs against ``c_kv``
    directly and ``W_vc`` maps the latent output back per head); extend picks per shape
    between that and decompressing K/V block by block (``extend_form="auto"``, by
    :func:`hybridattn.mla.prefers_absorbed` on tiles of ``query_block`` queries; or
    ``"absorbed"`` / ``"decompressed"``). ``impl="dense"`` runs the dense oracles instead
    (``[B, W]`` pages, ``[B, H, Q, W]`` scores). Positional rotation (if any) is applied by
    the model to ``q_pe`` / ``k_pe`` before the call.

    Layer inputs (``T`` tokens): ``q_nope [T, H, dn]``, ``q_pe [T, H, dr]``, ``c_kv [T, r]``
    (after ``kv_a_layernorm``), ``k_pe [T, dr]``, ``w_kc [H, dn, r]``, ``w_vc [H, dv, r]``
    (``kv_b_proj.weight`` reshaped to ``[H, dn + dv, r]`` and split). Output ``[T, H, dv]``.
    :class:`HybridLinearAttnBackend`'s example runs a layer.

    >>> mla = MLAAttnBackend.from_config(KimiLinearConfig.tiny(), num_token_slots=1025)
    >>> mla.layer_ids, mla.num_heads, mla.kv_lora_rank, round(mla.scale, 4)
    ((3,), 4, 32, 0.2041)
    >>> mla.get_max_running_requests(max_context_len=256)  # 1024 usable slots / 256
    4
    >>> mla.block_size, mla.query_block, mla.decode_block_size, mla.extend_form, mla.impl
    (512, 512, 8192, 'auto', 'blockwise')
    """

    layer_ids: tuple[int, ...]
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    num_token_slots: int
    forward_metadata: FullAttnMetadata | None = None
    block_size: int = 512
    query_block: int = 512
    extend_form: str = "auto"
    impl: str = "blockwise"
    decode_block_size: int = 8192

    def __post_init__(self):
        for name in ("block_size", "query_block", "decode_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLAAttnBackend.{name}={value!r} must be an int >= 1")
        if self.extend_form not in ("auto", "absorbed", "decompressed"):
            raise ValueError(f"MLAAttnBackend.extend_form={self.extend_form!r} must be 'auto', "
                             f"'absorbed' or 'decompressed'")
        if self.impl not in ("blockwise", "dense"):
            raise ValueError(f"MLAAttnBackend.impl={self.impl!r} must be 'blockwise' (bounded "
                             f"memory) or 'dense' (the reference)")

    @classmethod
    def from_config(cls, config: KimiLinearConfig, num_token_slots: int,
                    **options) -> MLAAttnBackend:
        """The backend for ``config``'s MLA layers over ``num_token_slots`` token slots (the
        sink included), without metadata; ``options``: ``block_size``, ``query_block``,
        ``decode_block_size``, ``extend_form``, ``impl``."""
        return cls(
            layer_ids=tuple(config.full_attention_layer_ids),
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            kv_lora_rank=config.kv_lora_rank,
            num_token_slots=num_token_slots,
            **options,
        )

    @property
    def scale(self) -> float:
        """The softmax scale, ``(dn + dr) ** -0.5``."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def get_forward_metadata(self, batch: ForwardBatch) -> FullAttnMetadata:
        """This backend's metadata for ``batch`` (validated by :func:`check_forward_batch`)."""
        check_forward_batch(batch)
        if batch.token_to_kv_pool.num_slots != self.num_token_slots:
            raise ValueError(f"MLAAttnBackend has num_token_slots={self.num_token_slots} but "
                             f"the MLA pool has {batch.token_to_kv_pool.num_slots} slots")
        return FullAttnMetadata(
            seq_lens=batch.seq_lens.astype(jnp.int32),
            prefix_lens=batch.prefix_lens.astype(jnp.int32),
            extend_lens=batch.extend_seq_lens.astype(jnp.int32),
            query_start_loc=_query_start(batch.extend_seq_lens),
            page_table=get_token_slots(
                batch.req_to_token_pool, batch.req_pool_indices, batch.kv_width
            ),
            out_cache_loc=batch.out_cache_loc.astype(jnp.int32),
            max_extend_len=batch.max_extend_len,
        )

    def with_forward_metadata(self, md: FullAttnMetadata) -> MLAAttnBackend:
        """A copy bound to ``md``, ready to run the layers of one forward."""
        return self.replace(forward_metadata=md)

    def get_max_running_requests(self, max_context_len: int, page_size: int = 1) -> int:
        """How many requests of ``max_context_len`` tokens the token slots hold at once."""
        usable = (self.num_token_slots - 1) // page_size * page_size
        return usable // max_context_len

    def _md(self) -> FullAttnMetadata:
        if self.forward_metadata is None:
            raise ValueError("MLAAttnBackend has no forward metadata: call with_forward_metadata")
        return self.forward_metadata

    def _check(self, layer_id: int, T: int, q_nope, q_pe, c_kv, k_pe, w_kc, w_vc):
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not an MLA layer (MLA layers: {self.layer_ids})")
        H, dn, dr, dv, r = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                            self.v_head_dim, self.kv_lora_rank)
        want = dict(q_nope=(T, H, dn), q_pe=(T, H, dr), c_kv=(T, r), k_pe=(T, dr),
                    w_kc=(H, dn, r), w_vc=(H, dv, r))
        got = dict(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_kc=w_kc, w_vc=w_vc)
        for name, shape in want.items():
            if got[name].shape != shape:
                raise ValueError(f"MLA layer {layer_id}: {name} has shape {got[name].shape}, "
                                 f"expected {shape}")

    def _write(self, layer, batch, c_kv, k_pe):
        pool = set_mla_kv(batch.token_to_kv_pool, _pool_key(layer), self._md().out_cache_loc,
                          c_kv, k_pe)
        batch = batch.replace(token_to_kv_pool=pool)
        ckv_all, kpe_all, offset = get_mla_kv_flat(pool, _pool_key(layer))
        return batch, ckv_all, kpe_all, offset

    @no_type_check
    def forward_extend(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q_nope: Float[Array, "T H dn"],
        q_pe: Float[Array, "T H dr"],
        c_kv: Float[Array, "T r"],
        k_pe: Float[Array, "T dr"],
        w_kc: Float[Array, "H dn r"],
        w_vc: Float[Array, "H dv r"],
    ) -> tuple[Float[Array, "T H dv"], ForwardBatch]:
        """Write the new tokens' latents at ``out_cache_loc``, then attend causally over each
        request's cached prefix and new tokens (:func:`hybridattn.mla.mla_extend`; ``impl=
        "dense"``: :func:`hybridattn.mla.ref_mla_extend`). Returns ``(out, batch)``; padding
        tokens get zeros."""
        layer_id = _layer_id(layer)
        md = self._md()
        T = q_nope.shape[0]
        self._check(layer_id, T, q_nope, q_pe, c_kv, k_pe, w_kc, w_vc)
        batch, ckv_all, kpe_all, offset = self._write(layer, batch, c_kv, k_pe)
        args = (q_nope, q_pe, ckv_all, kpe_all, w_kc, w_vc, md.page_table, md.seq_lens,
                md.extend_lens, md.query_start_loc[:-1])
        if self.impl == "dense":
            out = ref_mla_extend(*args, max_extend_len=md.max_extend_len, scale=self.scale,
                                 slot_offset=offset)
        else:
            absorbed = {"auto": None, "absorbed": True, "decompressed": False}[self.extend_form]
            out = mla_extend(*args, max_extend_len=md.max_extend_len, scale=self.scale,
                             block_size=self.block_size, query_block=self.query_block,
                             absorbed=absorbed, slot_offset=offset)
        return out.astype(q_nope.dtype), batch

    @no_type_check
    def forward_decode(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q_nope: Float[Array, "B H dn"],
        q_pe: Float[Array, "B H dr"],
        c_kv: Float[Array, "B r"],
        k_pe: Float[Array, "B dr"],
        w_kc: Float[Array, "H dn r"],
        w_vc: Float[Array, "H dv r"],
    ) -> tuple[Float[Array, "B H dv"], ForwardBatch]:
        """One new token per request (``T == B``), in absorbed form: attention runs against
        the latents directly (:func:`hybridattn.mla.mla_decode`; ``impl="dense"``:
        :func:`hybridattn.mla.ref_mla_decode`). Returns ``(out, batch)``."""
        layer_id = _layer_id(layer)
        md = self._md()
        self._check(layer_id, q_nope.shape[0], q_nope, q_pe, c_kv, k_pe, w_kc, w_vc)
        batch, ckv_all, kpe_all, offset = self._write(layer, batch, c_kv, k_pe)
        args = (q_nope, q_pe, ckv_all, kpe_all, w_kc, w_vc, md.page_table, md.seq_lens)
        if self.impl == "dense":
            out = ref_mla_decode(*args, scale=self.scale, slot_offset=offset)
        else:
            out = mla_decode(*args, scale=self.scale, block_size=self.decode_block_size,
                             slot_offset=offset)
        return out.astype(q_nope.dtype), batch

    def __call__(self, layer, batch: ForwardBatch, **inputs):
        """``out, batch = backend(layer, batch, **inputs)``: dispatch on the batch's mode."""
        if batch.forward_mode == ForwardMode.DECODE:
            return self.forward_decode(layer, batch, **inputs)
        return self.forward_extend(layer, batch, **inputs)


# --------------------------------------------------------------------------------------------
# KDA: linear attention over the recurrent-state pool
# --------------------------------------------------------------------------------------------


@pytree_dataclass(
    static=("layer_ids", "num_heads", "head_k_dim", "head_v_dim", "conv_kernel",
            "num_state_slots", "chunk_size")
)
class KDAAttnBackend:
    """Kimi Delta Attention over :class:`RecurrentStatePool`.

    Layer inputs (``T`` tokens): the projections ``q, k [T, Hk*Dk]``, ``v [T, Hk*Dv]`` before
    the short convolution, the conv weights ``q_conv, k_conv, v_conv`` (``[C, 1, K]`` or
    ``[C, K]``), the log-decay ``g [T, Hk, Dk]`` (:func:`hybridattn.ops.kda_gate`) and
    ``beta [T, Hk]``. The backend runs the short conv (carrying each request's conv state), the
    q/k L2 norm and the recurrence (:func:`kda_chunked` over the packed requests on extend,
    :func:`kda_decode` on decode), reading a request's state from the pool when it has a cached
    prefix and writing every request's final state back. Output ``[T, Hk, Dv]``.

    >>> kda = KDAAttnBackend.from_config(KimiLinearConfig.tiny(), num_state_slots=9)
    >>> kda.layer_ids, kda.num_heads, kda.head_k_dim, kda.conv_kernel, kda.chunk_size
    ((0, 1, 2), 4, 16, 4, 32)
    >>> kda.get_max_running_requests(max_context_len=1_000_000)  # one state slot a request
    8
    """

    layer_ids: tuple[int, ...]
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    num_state_slots: int
    chunk_size: int = 32
    forward_metadata: LinearAttnMetadata | None = None

    @classmethod
    def from_config(
        cls, config: KimiLinearConfig, num_state_slots: int, chunk_size: int = 32
    ) -> KDAAttnBackend:
        """The backend for ``config``'s KDA layers over ``num_state_slots`` state slots (the
        sink included); ``chunk_size`` is the :func:`kda_chunked` chunk on extend."""
        return cls(
            layer_ids=tuple(config.kda_layer_ids),
            num_heads=config.linear_num_heads,
            head_k_dim=config.linear_head_dim,
            head_v_dim=config.linear_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_state_slots=num_state_slots,
            chunk_size=chunk_size,
        )

    def get_forward_metadata(self, batch: ForwardBatch) -> LinearAttnMetadata:
        """This backend's metadata for ``batch`` (validated by :func:`check_forward_batch`)."""
        check_forward_batch(batch)
        if batch.recurrent_state_pool.num_slots != self.num_state_slots:
            raise ValueError(f"KDAAttnBackend has num_state_slots={self.num_state_slots} but "
                             f"the recurrent-state pool has "
                             f"{batch.recurrent_state_pool.num_slots} slots")
        T = batch.num_tokens
        qs = _query_start(batch.extend_seq_lens)
        snaps = {}
        spec = batch.snapshot_spec
        if spec is not None and spec.num_snapshots:
            b = spec.batch_index.astype(jnp.int32)
            used = spec.slots > 0
            snaps = dict(
                snapshot_windowed=(spec.num_snapshots if spec.windowed is None
                                   else min(spec.windowed, spec.num_snapshots)),
                snapshot_seqs=jnp.where(used, b, 0),
                snapshot_offsets=jnp.where(used, spec.lens - batch.prefix_lens[b], 0).astype(
                    jnp.int32),
                snapshot_slots=jnp.where(used, spec.slots, 0).astype(jnp.int32),
            )
        return LinearAttnMetadata(
            cu_seqlens=jnp.concatenate([qs, jnp.full((1,), T, jnp.int32)]),
            state_indices=get_linear_recurrent_indices(
                batch.req_to_token_pool, batch.req_pool_indices
            ).astype(jnp.int32),
            has_initial_state=batch.prefix_lens > 0,
            **snaps,
        )

    def with_forward_metadata(self, md: LinearAttnMetadata) -> KDAAttnBackend:
        """A copy bound to ``md``, ready to run the layers of one forward."""
        return self.replace(forward_metadata=md)

    def get_max_running_requests(self, max_context_len: int, page_size: int = 1) -> int:
        """``num_state_slots - 1``: a request's state has the same size at any length."""
        del max_context_len, page_size  # the state is the same size at any context length
        return self.num_state_slots - 1

    def _md(self) -> LinearAttnMetadata:
        if self.forward_metadata is None:
            raise ValueError("KDAAttnBackend has no forward metadata: call with_forward_metadata")
        return self.forward_metadata

    def _prepare(self, layer, T, q, k, v, g, beta, q_conv, k_conv, v_conv):
        layer_id = _layer_id(layer)
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not a KDA layer (KDA layers: {self.layer_ids})")
        H, Dk, Dv = self.num_heads, self.head_k_dim, self.head_v_dim
        want = dict(q=(T, H * Dk), k=(T, H * Dk), v=(T, H * Dv), g=(T, H, Dk), beta=(T, H))
        got = dict(q=q, k=k, v=v, g=g, beta=beta)
        for name, shape in want.items():
            if got[name].shape != shape:
                raise ValueError(f"KDA layer {layer_id}: {name} has shape {got[name].shape}, "
                                 f"expected {shape}")
        convs = dict(q_conv=(q_conv, H * Dk), k_conv=(k_conv, H * Dk), v_conv=(v_conv, H * Dv))
        for name, (w, channels) in convs.items():
            if _conv2d(w).shape != (channels, self.conv_kernel):
                raise ValueError(f"KDA layer {layer_id}: {name} has shape {w.shape}, expected "
                                 f"{(channels, 1, self.conv_kernel)} or "
                                 f"{(channels, self.conv_kernel)}")
        weight = jnp.concatenate([_conv2d(w) for w, _ in convs.values()], axis=0)
        return _pool_key(layer), weight, jnp.concatenate([q, k, v], axis=-1)

    def _split_heads(self, y, T):
        H, Dk, Dv = self.num_heads, self.head_k_dim, self.head_v_dim
        qc, kc, vc = jnp.split(y, [H * Dk, 2 * H * Dk], axis=-1)
        q = l2norm(qc.reshape(T, H, Dk).astype(jnp.float32))
        k = l2norm(kc.reshape(T, H, Dk).astype(jnp.float32))
        return q, k, vc.reshape(T, H, Dv)

    @no_type_check
    def forward_extend(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q: Float[Array, "T HkDk"],
        k: Float[Array, "T HkDk"],
        v: Float[Array, "T HkDv"],
        g: Float[Array, "T Hk Dk"],
        beta: Float[Array, "T Hk"],
        q_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        k_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        v_conv: Float[Array, "HkDv 1 K"] | Float[Array, "HkDv K"],
    ) -> tuple[Float[Array, "T Hk Dv"], ForwardBatch]:
        """Run the packed requests (short conv, L2 norm, :func:`kda_chunked`), starting from
        their pooled states where they have a cached prefix: ``(out, batch)``. On a CPU a
        batch whose requests extend by at most ``RECURRENT_MAX_EXTEND`` tokens and that takes
        no snapshot runs the recurrence of :func:`kda_recurrent` over the requests side by
        side instead (``_packed_recurrent``): faster there at these lengths, and a much
        smaller program."""
        md = self._md()
        T = q.shape[0]
        layer_id, weight, mixed = self._prepare(layer, T, q, k, v, g, beta, q_conv, k_conv, v_conv)
        pool = batch.recurrent_state_pool
        idx = jnp.concatenate([md.state_indices, jnp.zeros((1,), jnp.int32)])  # + padding seq
        has = jnp.concatenate([md.has_initial_state, jnp.zeros((1,), bool)])
        conv0, ssm0 = _initial_states(pool, layer_id, idx, has, mixed.dtype)
        y, conv1 = short_conv(mixed[None], weight, conv0, cu_seqlens=md.cu_seqlens)
        qh, kh, vh = self._split_heads(y[0], T)
        snapshots = md.snapshot_slots is not None
        if (not snapshots and batch.max_extend_len <= RECURRENT_MAX_EXTEND
                and jax.default_backend() == "cpu"):
            o, ssm1 = _packed_recurrent(qh, kh, vh, g, beta, ssm0, md.cu_seqlens,
                                        batch.max_extend_len)
        else:
            o, ssm1, *cs = kda_chunked(
                qh[None], kh[None], vh[None], g[None], beta[None], initial_state=ssm0,
                chunk_size=self.chunk_size, cu_seqlens=md.cu_seqlens,
                return_chunk_states=snapshots,
            )
            o = o[0]
        pool = set_states(pool, layer_id, idx, conv1, ssm1)
        if snapshots:
            conv_s, ssm_s = self._snapshot_states(md, cs[0], mixed, conv0, ssm0, ssm1,
                                                  (qh, kh, vh, g, beta))
            snap_pool = set_states(batch.snapshot_pool, layer_id, md.snapshot_slots, conv_s,
                                   ssm_s)
            batch = batch.replace(snapshot_pool=snap_pool)
        return o.astype(v.dtype), batch.replace(recurrent_state_pool=pool)

    def _snapshot_states(self, md, cs, mixed, conv0, ssm0, ssm1, inputs):
        """Conv and recurrent states of each snapshot: request ``b`` after ``off`` tokens of
        this extend. The recurrent state is exact where it is a chunk state of
        ``kda_chunked`` (``off`` a multiple of the chunk) or the final state (``off`` = the
        whole extend); in between it continues from the chunk state at or before ``off`` over
        the remaining ``< C`` tokens with one more ``kda_chunked`` chunk (the same math in
        another order: equal to rounding). The conv state is the last ``K - 1`` inputs before
        ``off``, read from the layer's inputs or the initial conv state."""
        b, off = md.snapshot_seqs, md.snapshot_offsets
        C, K, T = self.chunk_size, self.conv_kernel, mixed.shape[0]
        start = md.cu_seqlens[b]
        ext = md.cu_seqlens[b + 1] - start
        c = (off // C) * C  # the chunk boundary at or before each snapshot
        match = (cs.seq_ids[0][None, :] == b[:, None]) & (cs.num_tokens[0][None, :] == c[:, None])
        at_c = jnp.where((match.any(1) & (c > 0))[:, None, None, None],
                         cs.states[0][jnp.argmax(match, axis=1)], ssm0[b])
        Mw = md.snapshot_windowed  # only these entries may lie between chunk boundaries
        if Mw:
            i = jnp.arange(C, dtype=jnp.int32)
            rest = (off - c)[:Mw]
            valid = i[None, :] < rest[:, None]  # [Mw, C]: the tokens after the boundary
            tok = jnp.clip(start[:Mw, None] + c[:Mw, None] + i[None, :], 0, T - 1)

            def window(x):  # [T, ...] -> [Mw, C, ...], neutral (zero) where not valid
                w = x[tok]
                return jnp.where(valid.reshape(valid.shape + (1,) * (w.ndim - 2)), w, 0)

            qw, kw, vw, gw, bw = (window(x.astype(jnp.float32)) for x in inputs)
            _, cont = kda_chunked(qw, kw, vw, gw, bw, initial_state=at_c[:Mw], chunk_size=C)
            at_c = at_c.at[:Mw].set(jnp.where((rest == 0)[:, None, None, None], at_c[:Mw],
                                              cont))
        ssm = jnp.where((off == ext)[:, None, None, None], ssm1[b], at_c)
        pos = off[:, None] - (K - 1) + jnp.arange(K - 1, dtype=jnp.int32)[None, :]  # [M, K-1]
        from_x = mixed[jnp.clip(start[:, None] + pos, 0, T - 1)]
        from_state = conv0[b[:, None], jnp.clip(K - 1 + pos, 0, K - 2)]
        conv = jnp.where((pos >= 0)[..., None], from_x, from_state.astype(mixed.dtype))
        return conv, ssm

    @no_type_check
    def forward_decode(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q: Float[Array, "B HkDk"],
        k: Float[Array, "B HkDk"],
        v: Float[Array, "B HkDv"],
        g: Float[Array, "B Hk Dk"],
        beta: Float[Array, "B Hk"],
        q_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        k_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        v_conv: Float[Array, "HkDv 1 K"] | Float[Array, "HkDv K"],
    ) -> tuple[Float[Array, "B Hk Dv"], ForwardBatch]:
        """One new token per request (``T == B``) through :func:`kda_decode`:
        ``(out, batch)``."""
        md = self._md()
        B = q.shape[0]
        layer_id, weight, mixed = self._prepare(layer, B, q, k, v, g, beta, q_conv, k_conv, v_conv)
        pool = batch.recurrent_state_pool
        conv0, ssm0 = _initial_states(pool, layer_id, md.state_indices, md.has_initial_state,
                                      mixed.dtype)
        y, conv1 = short_conv(mixed[:, None], weight, conv0)  # [B, 1, Cc]
        qh, kh, vh = self._split_heads(y[:, 0], B)
        o, ssm1 = kda_decode(qh, kh, vh, g, beta, ssm0)
        pool = set_states(pool, layer_id, md.state_indices, conv1, ssm1)
        return o.astype(v.dtype), batch.replace(recurrent_state_pool=pool)

    def __call__(self, layer, batch: ForwardBatch, **inputs):
        """``out, batch = backend(layer, batch, **inputs)``: dispatch on the batch's mode."""
        if batch.forward_mode == ForwardMode.DECODE:
            return self.forward_decode(layer, batch, **inputs)
        return self.forward_extend(layer, batch, **inputs)


RECURRENT_MAX_EXTEND = 64
"""The longest extend (``ForwardBatch.max_extend_len``) that ``KDAAttnBackend`` runs with
:func:`kda_recurrent` on a CPU (when the batch takes no snapshot). Measured on a 2-core CPU at
4 heads of 64 (one request, ``kda_recurrent`` against ``kda_chunked``, its chunk 64): 16
tokens 0.19 against 0.81 ms, 64 tokens 0.66 against 0.92 ms, 8 requests of 64 tokens 11.9
against 17.5 ms; at 4 requests of 256 tokens the two are level (``kda_recurrent`` over the
whole bucket; the extend stops after its longest request). Compiling the recurrence is about
a fifth of the chunked form's (0.34 against 1.75 s for one call)."""


def _packed_recurrent(q, k, v, g, beta, initial_state, cu_seqlens, max_len: int):
    """:func:`kda_recurrent` over packed requests: ``(o [T, H, Dv], final [N, H, Dk, Dv])``
    for the ``N`` sequences of ``cu_seqlens`` (``[N + 1]``, the last one the batch's padding),
    each of the first ``N - 1`` at most ``max_len`` tokens. Their tokens are laid side by side
    as ``[N - 1, max_len]`` with neutral tokens after each request's end (``k = v = 0``, ``g =
    0``, ``beta = 0``: the state passes unchanged), so every request's output and final state
    are those of the recurrence over its own tokens; the loop stops after the longest request
    (a 24-token prompt in the 64-token bucket runs 24 steps). The padding sequence is not run:
    its tokens' outputs are 0 and its final state is its initial one (the sink slot's)."""
    T = q.shape[0]
    start, lens = cu_seqlens[:-2], cu_seqlens[1:-1] - cu_seqlens[:-2]
    i = jnp.arange(max_len, dtype=jnp.int32)
    live = i[None, :] < lens[:, None]  # [R, max_len]
    tok = jnp.where(live, start[:, None] + i[None, :], T)  # T: a neutral token (dropped)

    def side_by_side(x):  # [T, ...] -> [max_len, R, ...] (time-major), zero past each end
        x = jnp.concatenate([x.astype(jnp.float32), jnp.zeros((1,) + x.shape[1:], jnp.float32)])
        return x[tok.T]

    o, final = _recurrent_steps(*(side_by_side(x) for x in (q, k, v, g, beta)),
                                initial_state[:-1], jnp.max(lens))
    out = jnp.zeros((T + 1,) + o.shape[2:], v.dtype).at[tok].set(
        jnp.swapaxes(o, 0, 1).astype(v.dtype))[:T]
    return out, jnp.concatenate([final, initial_state[-1:]])


def _initial_states(pool, layer_id, idx, has, dtype):
    """Conv and recurrent states of slots ``idx``; zeros where ``has`` is false (a request
    without a cached prefix starts from zero, whatever its slot held before)."""
    conv, ssm = get_states(pool, layer_id, idx)
    conv = jnp.where(has[:, None, None], conv, 0).astype(dtype)
    return conv, jnp.where(has[:, None, None, None], ssm, 0.0)


def _conv2d(w):
    """Conv weight as ``[C, K]`` (accepts the checkpoint's ``[C, 1, K]``)."""
    return w[:, 0, :] if w.ndim == 3 else w


# --------------------------------------------------------------------------------------------
# the hybrid dispatcher
# --------------------------------------------------------------------------------------------


@pytree_dataclass(static=("full_attn_layers",))
class HybridLinearAttnBackend:
    """One backend for a hybrid model: layers in ``full_attn_layers`` go to the full-attention
    sub-backend, every other layer to the linear one.

    Holds no memory and no metadata of its own: :meth:`with_forward_metadata` splits the
    aggregated metadata into the sub-backends, and :attr:`forward_metadata` reads it back.

    One forward, by hand: the batch of :class:`ForwardBatch`'s example, its metadata, and the
    MLA layer (layer 3 of the tiny config) run on it. The pools come back updated in the batch.

    >>> from hybridattn.batch import BatchRequest, make_forward_batch
    >>> from hybridattn.pools import alloc_reqs_or_raise, write_token_slots
    >>> cfg = KimiLinearConfig.tiny()  # layers 0, 1, 2: KDA; layer 3: MLA
    >>> backend = attn_backend_wrapper(cfg, MLAAttnBackend.from_config(cfg, 16), num_state_slots=3)
    >>> type(backend.backend_for(3)).__name__, type(backend.backend_for(0)).__name__
    ('MLAAttnBackend', 'KDAAttnBackend')
    >>> req, rows = alloc_reqs_or_raise(HybridReqToTokenPool.create(2, 8), 2)  # rows 1, 2
    >>> req = write_token_slots(req, jnp.array([1, 1, 1, 2, 2, 2]),
    ...                         jnp.array([0, 1, 2, 0, 1, 2]), jnp.array([1, 2, 3, 4, 5, 6]))
    >>> batch = make_forward_batch(
    ...     [BatchRequest(1, 0, [7, 8, 9], [1, 2, 3]), BatchRequest(2, 2, [10], [6])],
    ...     req_to_token_pool=req, num_requests=3, num_tokens=6,
    ...     token_to_kv_pool=MLATokenPool.create((3,), 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim),
    ...     recurrent_state_pool=RecurrentStatePool.create((0, 1, 2), 3, 3 * 64, 4, 4, 16, 16))
    >>> md = backend.get_forward_metadata(batch)
    >>> md.full_attn_metadata.page_table.tolist(), md.linear_attn_metadata.cu_seqlens.tolist()
    ([[1, 2, 3], [4, 5, 6], [0, 0, 0]], [0, 3, 4, 4, 6])
    >>> bound = backend.with_forward_metadata(md)
    >>> T, H, r = batch.num_tokens, cfg.num_attention_heads, cfg.kv_lora_rank  # dn=dv=16, dr=8
    >>> out, batch = bound(3, batch, q_nope=jnp.ones((T, H, 16)), q_pe=jnp.ones((T, H, 8)),
    ...                    c_kv=jnp.ones((T, r)), k_pe=jnp.ones((T, 8)),
    ...                    w_kc=jnp.ones((H, 16, r)), w_vc=jnp.ones((H, 16, r)))
    >>> out.shape  # [T, H, dv]
    (6, 4, 16)
    >>> batch.token_to_kv_pool.c_kv[0][:8, 0].tolist()  # slots 1-3 and 6; padding: sink 0
    [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    """

    full_attn_backend: Any
    linear_attn_backend: Any
    full_attn_layers: tuple[int, ...]

    def __post_init__(self):
        layers = tuple(self.full_attn_layers)
        if any(not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"full_attn_layers must be distinct layer ids >= 0, got {layers}")
        object.__setattr__(self, "full_attn_layers", tuple(sorted(layers)))

    def get_forward_metadata(self, batch) -> HybridLinearAttentionBackendMetadata:
        """Both sub-backends' metadata for ``batch``."""
        return HybridLinearAttentionBackendMetadata(
            full_attn_metadata=self.full_attn_backend.get_forward_metadata(batch),
            linear_attn_metadata=self.linear_attn_backend.get_forward_metadata(batch),
        )

    def with_forward_metadata(
        self, md: HybridLinearAttentionBackendMetadata
    ) -> HybridLinearAttnBackend:
        """A copy whose sub-backends are bound to their halves of ``md``."""
        if not isinstance(md, HybridLinearAttentionBackendMetadata):
            raise TypeError(f"expected HybridLinearAttentionBackendMetadata, got {type(md)}")
        return self.replace(
            full_attn_backend=self.full_attn_backend.with_forward_metadata(md.full_attn_metadata),
            linear_attn_backend=self.linear_attn_backend.with_forward_metadata(
                md.linear_attn_metadata
            ),
        )

    @property
    def forward_metadata(self) -> HybridLinearAttentionBackendMetadata:
        """The sub-backends' current metadata, side by side (``None`` halves when unbound)."""
        return HybridLinearAttentionBackendMetadata(
            full_attn_metadata=self.full_attn_backend.forward_metadata,
            linear_attn_metadata=self.linear_attn_backend.forward_metadata,
        )

    def backend_for(self, layer):
        """The sub-backend that serves ``layer`` (an int id or an object with ``.layer_id``)."""
        layer_id = _layer_id(layer)
        if layer_id < 0:
            raise ValueError(f"layer id must be >= 0, got {layer_id}")
        if layer_id in self.full_attn_layers:
            return self.full_attn_backend
        return self.linear_attn_backend

    def _dispatch(self, method: str, layer, batch, **inputs):
        return getattr(self.backend_for(layer), method)(layer, batch, **inputs)

    def forward_extend(self, layer, batch, **inputs):
        """The ``forward_extend`` of the sub-backend that serves ``layer``."""
        return self._dispatch("forward_extend", layer, batch, **inputs)

    def forward_decode(self, layer, batch, **inputs):
        """The ``forward_decode`` of the sub-backend that serves ``layer``."""
        return self._dispatch("forward_decode", layer, batch, **inputs)

    def __call__(self, layer, batch, **inputs):
        """``out, batch = backend(layer, batch, **inputs)``: dispatch on layer and mode."""
        if batch.forward_mode == ForwardMode.DECODE:
            return self.forward_decode(layer, batch, **inputs)
        return self.forward_extend(layer, batch, **inputs)

    def get_max_running_requests(self, max_context_len: int, page_size: int = 1) -> int:
        """The smaller of the two sub-backends' limits."""
        return min(
            self.full_attn_backend.get_max_running_requests(max_context_len, page_size),
            self.linear_attn_backend.get_max_running_requests(max_context_len, page_size),
        )


def attn_backend_wrapper(
    config: KimiLinearConfig,
    full_attn_backend,
    linear_attn_backend=None,
    *,
    num_state_slots: int | None = None,
    chunk_size: int = 32,
):
    """Wrap ``full_attn_backend`` for a hybrid model, as SGLang's model runner does.

    Returns a :class:`HybridLinearAttnBackend` whose linear sub-backend is
    ``linear_attn_backend`` or a :class:`KDAAttnBackend` built from ``config`` (then
    ``num_state_slots`` is required) and whose ``full_attn_layers`` come from ``config``.
    A config without KDA layers gets ``full_attn_backend`` back unchanged.

    >>> cfg = KimiLinearConfig.tiny()
    >>> mla = MLAAttnBackend.from_config(cfg, num_token_slots=64)
    >>> backend = attn_backend_wrapper(cfg, mla, num_state_slots=9)
    >>> type(backend).__name__, backend.full_attn_layers, backend.backend_for(0).num_state_slots
    ('HybridLinearAttnBackend', (3,), 9)
    >>> backend.get_max_running_requests(max_context_len=16)  # min(63 // 16, 9 - 1)
    3
    >>> all_mla = KimiLinearConfig.tiny(full_attention_layer_ids=(0, 1, 2, 3))
    >>> attn_backend_wrapper(all_mla, mla) is mla  # no KDA layers: nothing to wrap
    True
    """
    if not config.kda_layer_ids:
        return full_attn_backend
    if linear_attn_backend is None:
        if num_state_slots is None:
            raise ValueError("attn_backend_wrapper needs num_state_slots to build a KDAAttnBackend")
        linear_attn_backend = KDAAttnBackend.from_config(config, num_state_slots, chunk_size)
    return HybridLinearAttnBackend(
        full_attn_backend, linear_attn_backend, tuple(config.full_attention_layer_ids)
    )

