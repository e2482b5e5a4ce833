"""One decoder layer: KDA or MLA attention through the backend, then the MLP.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.mlp import dense_mlp, sparse_moe
from hybridattn.models.kimi_linear.primitives import Params, _linear, rms_norm
from hybridattn.ops import kda_gate
from hybridattn.pools import LayerRef

__all__ = [
    "decoder_layer",
    "kda_attention",
    "mla_attention",
    "mla_split",
]

# --------------------------------------------------------------------------------------------
# attention layers (serving path)
# --------------------------------------------------------------------------------------------


_KDA_IN_PROJ = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
"""A KDA layer's projections of its input, in the order ``serving_layout`` stacks them."""


def _kda_in_sizes(attn: Params) -> list[int]:
    """Output sizes of ``_KDA_IN_PROJ`` (``[H Dk, H Dk, H Dv, Dk, Dk, H]``), read from the
    layer's other weights (convs ``[C, 1, K]``, ``f_b`` / ``g_b`` ``[H Dk, Dk]``,
    ``A_log [1, 1, H, 1]``; a leading stacked axis or not)."""
    return [attn["q_conv1d"]["weight"].shape[-3], attn["k_conv1d"]["weight"].shape[-3],
            attn["v_conv1d"]["weight"].shape[-3], attn["f_b_proj"]["weight"].shape[-1],
            attn["g_b_proj"]["weight"].shape[-1], attn["A_log"].shape[-2]]


def kda_attention(
    p: Params, config: KimiLinearConfig, layer_id: int | LayerRef, x: Float[Array, "T D"],
    backend, batch, comm=None,
) -> tuple[Float[Array, "T D"], Any]:
    """KDA layer on ``x [T, D]`` through ``backend``: ``(out [T, D], batch)``.

    The layer computes its projections, gate ``g`` (``hybridattn.ops.kda_gate``) and
    ``beta``; ``out, batch = backend(layer_id, batch, **inputs)`` runs the short convs and the
    KDA recurrence (carrying each request's states in ``batch``) and returns ``[T, H, Dv]``;
    the layer then applies the gated RMS-norm and ``o_proj``. Any callable with that
    signature serves; this one only shows what the layer hands it:

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> attn = init_params(cfg, jax.random.key(0))["model"]["layers"][0]["self_attn"]
    >>> def backend(layer_id, batch, **inputs):
    ...     print(layer_id, {name: a.shape for name, a in inputs.items()})
    ...     return jnp.zeros((3, 4, 16)), batch  # [T, H, Dv]
    >>> out, _ = kda_attention(attn, cfg, 0, jnp.ones((3, 32)), backend, None)
    0 {'q': (3, 64), 'k': (3, 64), 'v': (3, 64), 'g': (3, 4, 16), 'beta': (3, 4),
       'q_conv': (64, 1, 4), 'k_conv': (64, 1, 4), 'v_conv': (64, 1, 4)}
    >>> out.shape
    (3, 32)

    Under ``hybridattn.sharding`` ``config`` and ``p`` hold this device's heads and
    ``comm.reduce_rows`` sums the row-parallel ``o_proj``'s partial outputs.
    """
    T = x.shape[0]
    H, Dk = config.linear_num_heads, config.linear_head_dim
    if "in_proj" in p:  # serving_layout: the six projections of x as one product
        q, k, v, f_a, g_a, b = jnp.split(_linear(x, p["in_proj"]),
                                         np.cumsum(_kda_in_sizes(p))[:-1], axis=-1)
    else:
        q, k, v, f_a, g_a, b = (_linear(x, p[n]) for n in _KDA_IN_PROJ)
    a = _linear(f_a, p["f_b_proj"]).reshape(T, H, Dk)
    g = kda_gate(a, p["A_log"], p["dt_bias"])
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    o, batch = backend(
        layer_id, batch, q=q, k=k, v=v, g=g, beta=beta,
        q_conv=p["q_conv1d"]["weight"], k_conv=p["k_conv1d"]["weight"],
        v_conv=p["v_conv1d"]["weight"],
    )
    gate = _linear(g_a, p["g_b_proj"]).reshape(T, H, Dk)
    o = rms_norm(o, p["o_norm"]["weight"], config.rms_norm_eps)
    o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    out = _linear(o.reshape(T, H * Dk), p["o_proj"])
    return (out if comm is None else comm.reduce_rows(out)), batch


def mla_split(
    p: Params, config: KimiLinearConfig, x: Float[Array, "T D"]
) -> dict[str, Float[Array, "..."]]:
    """MLA projections of ``x [T, D]``: ``q_nope, q_pe, c_kv, k_pe, w_kc, w_vc``, the inputs
    an MLA backend receives. ``c_kv`` (after its norm) and ``k_pe`` are what the latent
    cache keeps per token; ``w_kc`` / ``w_vc`` are ``kv_b_proj`` split per head, which
    decompress a latent into a head's key and value.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> attn = init_params(cfg, jax.random.key(0))["model"]["layers"][1]["self_attn"]
    >>> {name: a.shape for name, a in mla_split(attn, cfg, jnp.ones((3, 32))).items()}
    {'q_nope': (3, 4, 16), 'q_pe': (3, 4, 8), 'c_kv': (3, 32), 'k_pe': (3, 8),
     'w_kc': (4, 16, 32), 'w_vc': (4, 16, 32)}
    """
    T = x.shape[0]
    H, dn, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    r = config.kv_lora_rank
    q = _linear(x, p["q_proj"]).reshape(T, H, config.q_head_dim)
    kv = _linear(x, p["kv_a_proj_with_mqa"])
    c_kv = rms_norm(kv[:, :r], p["kv_a_layernorm"]["weight"], config.rms_norm_eps)
    kv_b = p["kv_b_proj"]["weight"].reshape(H, dn + dv, r)
    return dict(q_nope=q[..., :dn], q_pe=q[..., dn:], c_kv=c_kv, k_pe=kv[:, r:],
                w_kc=kv_b[:, :dn], w_vc=kv_b[:, dn:])


def mla_attention(
    p: Params, config: KimiLinearConfig, layer_id: int | LayerRef, x: Float[Array, "T D"],
    backend, batch, comm=None,
) -> tuple[Float[Array, "T D"], Any]:
    """MLA layer on ``x [T, D]`` through ``backend``: ``(out [T, D], batch)``.

    ``out, batch = backend(layer_id, batch, **mla_split(p, config, x))`` attends (writing
    the new tokens' latents into the cache in ``batch``) and returns ``[T, H, dv]``; the
    layer applies ``o_proj``. A backend with no cache, in which every token attends to
    itself only (its value, decompressed from its latent):

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> attn = init_params(cfg, jax.random.key(0))["model"]["layers"][1]["self_attn"]
    >>> def itself(layer_id, batch, *, c_kv, w_vc, **_):
    ...     return jnp.einsum("tr,hdr->thd", c_kv, w_vc), batch
    >>> out, _ = mla_attention(attn, cfg, 1, jnp.ones((3, 32)), itself, None)
    >>> out.shape
    (3, 32)
    """
    T = x.shape[0]
    o, batch = backend(layer_id, batch, **mla_split(p, config, x))
    out = _linear(o.reshape(T, -1), p["o_proj"])
    return (out if comm is None else comm.reduce_rows(out)), batch


def decoder_layer(
    p: Params, config: KimiLinearConfig, layer_id: int | LayerRef, x: Float[Array, "T D"],
    backend, batch, comm=None,
) -> tuple[Float[Array, "T D"], Any]:
    """One pre-norm residual block on ``x [T, D]``: ``(x, batch)``. Attention (KDA or MLA by
    ``layer_id``, through ``backend``) then the MLP (dense, or ``sparse_moe`` on MoE layers).
    ``layer_id`` is an int, or a ``hybridattn.pools.LayerRef`` inside a scan over stacked
    layers (``stack_layers``); the backend receives it as it is.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> layers = init_params(cfg, jax.random.key(0))["model"]["layers"]
    >>> def backend(layer_id, batch, **inputs):  # shows which inputs each layer type sends
    ...     print(layer_id, sorted(inputs))
    ...     return jnp.zeros((3, 4, 16)), batch  # [T, H, Dv]
    >>> x, _ = decoder_layer(layers[0], cfg, 0, jnp.ones((3, 32)), backend, None)
    0 ['beta', 'g', 'k', 'k_conv', 'q', 'q_conv', 'v', 'v_conv']
    >>> x, _ = decoder_layer(layers[1], cfg, 1, x, backend, None)
    1 ['c_kv', 'k_pe', 'q_nope', 'q_pe', 'w_kc', 'w_vc']
    >>> x.shape
    (3, 32)
    """
    x, h, batch = _attend(p, config, layer_id, x, backend, batch, comm)
    return x + _mlp(p, config, getattr(layer_id, "layer_id", layer_id), h, comm), batch


def _attend(p: Params, config: KimiLinearConfig, layer_id: int | LayerRef, x, backend, batch,
            comm):
    """A layer's first half: ``(x + attention, the MLP's input, batch)``."""
    kind = getattr(layer_id, "layer_id", layer_id)  # the int id of its kind and shapes
    h = rms_norm(x, p["input_layernorm"]["weight"], config.rms_norm_eps)
    attn = kda_attention if config.is_kda_layer(kind) else mla_attention
    a, batch = attn(p["self_attn"], config, layer_id, h, backend, batch, comm)
    x = x + a
    return x, rms_norm(x, p["post_attention_layernorm"]["weight"], config.rms_norm_eps), batch


def _mlp(p: Params, config: KimiLinearConfig, layer: int, h, comm):
    """A layer's MLP on ``h``: ``sparse_moe`` on MoE layers, else ``dense_mlp``."""
    if config.is_moe_layer(layer):
        return sparse_moe(p["block_sparse_moe"], config, h, comm)
    return dense_mlp(p["mlp"], h, comm)
