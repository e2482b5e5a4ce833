"""The cache-free forward of a ``[B, T]`` batch of token ids (:func:`apply`): the reference the
serving path must match, and what one trains with.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.forward import compute_logits
from hybridattn.models.kimi_linear.layers import decoder_layer
from hybridattn.models.kimi_linear.params import check_supported
from hybridattn.models.kimi_linear.primitives import Params, rms_norm
from hybridattn.models.kimi_linear.stacking import unstack_layers
from hybridattn.ops import kda_chunked, l2norm, short_conv

__all__ = [
    "apply",
]

# --------------------------------------------------------------------------------------------
# the cache-free forward
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DenseAttention:
    """Attention backend of ``apply``: every layer sees the whole ``[B, T]`` batch (tokens
    flattened to ``B * T``, batch-major) and no cache; ``batch`` passes through untouched."""

    config: KimiLinearConfig
    batch_size: int
    seq_len: int
    chunk_size: int

    def __call__(self, layer_id, batch, **inputs):
        if self.config.is_kda_layer(getattr(layer_id, "layer_id", layer_id)):
            return self._kda(**inputs), batch
        return self._mla(**inputs), batch

    def _kda(self, *, q, k, v, g, beta, q_conv, k_conv, v_conv):
        """Short conv (q | k | v weights concatenated), L2-normalised q / k, chunked KDA."""
        B, T = self.batch_size, self.seq_len
        H, Dk = self.config.linear_num_heads, self.config.linear_head_dim
        Dv = v.shape[-1] // H
        weight = jnp.concatenate([w[:, 0, :] if w.ndim == 3 else w
                                  for w in (q_conv, k_conv, v_conv)], axis=0)
        y, _ = short_conv(jnp.concatenate([q, k, v], axis=-1).reshape(B, T, -1), weight)
        qc, kc, vc = jnp.split(y, [H * Dk, 2 * H * Dk], axis=-1)
        qh = l2norm(qc.reshape(B, T, H, Dk).astype(jnp.float32))
        kh = l2norm(kc.reshape(B, T, H, Dk).astype(jnp.float32))
        o, _ = kda_chunked(qh, kh, vc.reshape(B, T, H, Dv), g.reshape(B, T, H, Dk),
                           beta.reshape(B, T, H), chunk_size=self.chunk_size)
        return o.reshape(B * T, H, Dv).astype(v.dtype)

    def _mla(self, *, q_nope, q_pe, c_kv, k_pe, w_kc, w_vc):
        """Causal softmax attention with K / V decompressed from ``c_kv`` (f32 inside)."""
        B, T = self.batch_size, self.seq_len
        H = self.config.num_attention_heads
        f32 = jnp.float32
        ckv = c_kv.reshape(B, T, -1).astype(f32)
        k_nope = jnp.einsum("btr,hdr->bthd", ckv, w_kc.astype(f32))
        v = jnp.einsum("btr,hdr->bthd", ckv, w_vc.astype(f32))
        kpe = jnp.broadcast_to(k_pe.reshape(B, T, 1, -1).astype(f32),
                               (B, T, H, k_pe.shape[-1]))
        q = jnp.concatenate([q_nope, q_pe], axis=-1).reshape(B, T, H, -1).astype(f32)
        k = jnp.concatenate([k_nope, kpe], axis=-1)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.config.q_head_dim**-0.5
        causal = jnp.tril(jnp.ones((T, T), bool))
        scores = jnp.where(causal, scores, jnp.finfo(f32).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return out.reshape(B * T, H, -1).astype(q_nope.dtype)


def apply(
    params: Params,
    config: KimiLinearConfig,
    input_ids: Int[Array | np.ndarray, "B T"],
    *,
    chunk_size: int = 64,
) -> Float[Array, "B T V"]:
    """Cache-free forward of ``input_ids [B, T]``: logits ``[B, T, vocab]`` in float32.

    Every row is one sequence starting at position 0 (no padding). The layers are the serving
    path's own (``decoder_layer``); attention runs densely over each row: KDA through
    ``hybridattn.ops.kda_chunked``, MLA as causal softmax attention over the decompressed
    keys and values. Pure and differentiable; compiles with ``config`` static
    (``jax.jit(apply, static_argnums=1)``; ``static_argnames="chunk_size"`` too to set the
    KDA chunk, a power of two, which changes no result). Matmuls run in the parameters' dtype
    (bf16 parameters give a bf16 forward), recurrent states and attention in float32.

    The dense oracle, practical up to about 8k tokens per row: MLA scores ``[B, H, T, T]``
    are materialised, so memory grows as ``T**2``. Measured on ``KimiLinearConfig.tiny()``,
    one row, jitted on CPU (process peak RSS, compilation included): 4k 0.9 GB (16 s), 8k
    2.5 GB (22 s), 16k 10.6 GB (43 s). Longer sequences belong to the serving path
    (``hybridattn.Engine``; ``python -m hybridattn.bench longctx``).

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> fwd = jax.jit(apply, static_argnums=1)
    >>> input_ids = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    >>> logits = fwd(params, cfg, input_ids)
    >>> logits.shape, logits.dtype  # [B, T, V]
    ((2, 4, 64), dtype('float32'))
    >>> greedy_next = logits[:, -1].argmax(-1)  # each row's next token, [B]

    Causal: changing the last token changes no earlier position's logits.

    >>> other = fwd(params, cfg, input_ids.at[:, -1].set(9))
    >>> bool(jnp.allclose(other[:, :-1], logits[:, :-1], atol=1e-5))
    True
    """
    check_supported(config)
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be an integer array [B, T], got dtype "
                         f"{input_ids.dtype} and shape {input_ids.shape}")
    B, T = input_ids.shape
    backend = _DenseAttention(config, B, T, chunk_size)
    params = unstack_layers(params)
    x = params["model"]["embed_tokens"]["weight"][input_ids.reshape(B * T)]
    for i, layer in enumerate(params["model"]["layers"]):
        x, _ = decoder_layer(layer, config, i, x, backend, None)
    hidden = rms_norm(x, params["model"]["norm"]["weight"], config.rms_norm_eps)
    return compute_logits(params, config, hidden).reshape(B, T, -1)
