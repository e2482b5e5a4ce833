"""The hybrid dispatcher: :class:`HybridLinearAttnBackend` sends each layer to the MLA or the
KDA backend (:func:`attn_backend_wrapper` builds it from a config).
"""

from __future__ import annotations

from typing import Any

from hybridattn.backends.base import ForwardMode, HybridLinearAttentionBackendMetadata, _layer_id
from hybridattn.backends.kda import KDAAttnBackend
from hybridattn.config import KimiLinearConfig
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "HybridLinearAttnBackend",
    "attn_backend_wrapper",
]

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

    >>> import jax.numpy as jnp
    >>> from hybridattn.pools import HybridReqToTokenPool, MLATokenPool, RecurrentStatePool
    >>> from hybridattn.backends import MLAAttnBackend
    >>> from hybridattn.backends import BatchRequest, make_forward_batch
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

    >>> from hybridattn.backends import MLAAttnBackend
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
