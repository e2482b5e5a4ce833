"""MLA: full attention over the compressed latent pool (:class:`MLAAttnBackend`).
"""

from __future__ import annotations

from typing import no_type_check

import jax.numpy as jnp
from jaxtyping import Array, Float

from hybridattn.backends.base import (
    ForwardBatch,
    ForwardMode,
    FullAttnMetadata,
    _layer_id,
    _pool_key,
    _query_start,
    check_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.ops.mla import mla_decode, mla_extend, ref_mla_decode, ref_mla_extend
from hybridattn.pools import (
    get_mla_kv_flat,
    get_token_slots,
    set_mla_kv,
)
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "MLAAttnBackend",
]

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
    (:mod:`hybridattn.ops.mla`): memory ``O(T + query_block x block_size x H)`` at any context
    length, cost following each request's own length. Decode walks blocks of
    ``decode_block_size`` keys: its one query per request makes a block's scores ``[H, bk]``,
    so wider blocks cost no more workspace than extend's tiles and take fewer loop steps
    (64k keys on the tiny config: 7.3 ms in blocks of 512, 4.9 ms in blocks of 8192, as one
    dense pass 3.4 ms). Decode runs in absorbed form
    (``q_nope W_kc`` moves the query into latent space, attention runs against ``c_kv``
    directly and ``W_vc`` maps the latent output back per head); extend picks per shape
    between that and decompressing K/V block by block (``extend_form="auto"``, by
    :func:`hybridattn.ops.mla.prefers_absorbed` on tiles of ``query_block`` queries; or
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
        request's cached prefix and new tokens (:func:`hybridattn.ops.mla.mla_extend`; ``impl=
        "dense"``: :func:`hybridattn.ops.mla.ref_mla_extend`). Returns ``(out, batch)``; padding
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
        the latents directly (:func:`hybridattn.ops.mla.mla_decode`; ``impl="dense"``:
        :func:`hybridattn.ops.mla.ref_mla_decode`). Returns ``(out, batch)``."""
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
