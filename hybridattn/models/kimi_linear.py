"""Kimi-Linear in JAX: parameters in the released checkpoint's layout and the serving forward.

Parameters are a plain nested dict whose paths are the checkpoint's tensor names, e.g.
``params["model"]["layers"][3]["self_attn"]["kv_b_proj"]["weight"]``. Routed experts are
stacked per layer (``block_sparse_moe.experts.w1 [E, I, D]``; the checkpoint stores them one
by one as ``experts.N.w1.weight``).

The serving forward runs every layer through an attention backend (``hybridattn.backend``)::

    hidden, batch = forward(params, config, backend, batch)   # batch carries the pools
    logits = compute_logits(params, config, hidden)

KDA layers hand the backend their projections, conv weights, gate and beta; MLA layers hand it
the query, the latent ``c_kv`` / ``k_pe`` and ``kv_b_proj`` split per head. Kimi-Linear's MLA
applies no rotary embedding (``mla_use_nope``), as in mlx-lm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from hybridattn.config import KimiLinearConfig
from hybridattn.ops import kda_gate

Params = dict


def rms_norm(x, weight, eps: float):
    """``x / rms(x) * weight`` over the last axis, in f32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def _linear(x, p):
    return x @ p["weight"].T.astype(x.dtype)


def _check_supported(config: KimiLinearConfig) -> None:
    if config.q_lora_rank is not None:
        raise ValueError(
            f"KimiLinearConfig.q_lora_rank={config.q_lora_rank} (low-rank query projection) is "
            "not supported: Kimi-Linear's MLA uses a plain q_proj"
        )
    if not config.mla_use_nope:
        raise ValueError(
            "KimiLinearConfig.mla_use_nope=False (rotary MLA) is not supported: Kimi-Linear's "
            "MLA layers use no rotary embedding"
        )
    if config.num_experts and config.moe_router_activation_func not in ("sigmoid", "softmax"):
        raise ValueError(
            f"moe_router_activation_func={config.moe_router_activation_func!r}: "
            "expected 'sigmoid' or 'softmax'"
        )


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------


def init_params(config: KimiLinearConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters in the checkpoint layout (normal(0, 0.02) weights, unit norms,
    ``A_log = log(U(1, 16))`` as mlx-lm initialises it).

    >>> cfg = KimiLinearConfig.tiny()
    >>> p = init_params(cfg, jax.random.key(0))
    >>> p["model"]["layers"][0]["self_attn"]["q_conv1d"]["weight"].shape
    (64, 1, 4)
    """
    _check_supported(config)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    D = config.hidden_size

    def w(*shape, std=0.02):
        return jnp.asarray(std * rng.standard_normal(shape, np.float32), dtype)

    def lin(out_dim, in_dim):
        return {"weight": w(out_dim, in_dim)}

    def norm(n):
        return {"weight": jnp.ones((n,), dtype)}

    def mlp(inter):
        return {"gate_proj": lin(inter, D), "up_proj": lin(inter, D), "down_proj": lin(D, inter)}

    layers = []
    for i in range(config.num_hidden_layers):
        if config.is_kda_layer(i):
            H, Dk = config.linear_num_heads, config.linear_head_dim
            K = config.linear_conv_kernel_dim
            attn = {
                "q_proj": lin(H * Dk, D), "k_proj": lin(H * Dk, D), "v_proj": lin(H * Dk, D),
                "q_conv1d": {"weight": w(H * Dk, 1, K, std=0.3)},
                "k_conv1d": {"weight": w(H * Dk, 1, K, std=0.3)},
                "v_conv1d": {"weight": w(H * Dk, 1, K, std=0.3)},
                "A_log": jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, (1, 1, H, 1)), jnp.float32)),
                "dt_bias": w(H * Dk, std=0.5).astype(jnp.float32),
                "f_a_proj": lin(Dk, D), "f_b_proj": lin(H * Dk, Dk),
                "g_a_proj": lin(Dk, D), "g_b_proj": lin(H * Dk, Dk),
                "b_proj": lin(H, D),
                "o_norm": norm(Dk),
                "o_proj": lin(D, H * Dk),
            }
        else:
            H = config.num_attention_heads
            r, dr = config.kv_lora_rank, config.qk_rope_head_dim
            attn = {
                "q_proj": lin(H * config.q_head_dim, D),
                "kv_a_proj_with_mqa": lin(r + dr, D),
                "kv_a_layernorm": norm(r),
                "kv_b_proj": lin(H * (config.qk_nope_head_dim + config.v_head_dim), r),
                "o_proj": lin(D, H * config.v_head_dim),
            }
        layer = {
            "self_attn": attn,
            "input_layernorm": norm(D),
            "post_attention_layernorm": norm(D),
        }
        if config.is_moe_layer(i):
            E, inter = config.num_experts, config.moe_intermediate_size
            moe = {
                "gate": {"weight": w(E, D),
                         "e_score_correction_bias": w(E, std=0.1).astype(jnp.float32)},
                "experts": {"w1": w(E, inter, D), "w2": w(E, D, inter), "w3": w(E, inter, D)},
            }
            if config.num_shared_experts:
                moe["shared_experts"] = mlp(inter * config.num_shared_experts)
            layer["block_sparse_moe"] = moe
        else:
            layer["mlp"] = mlp(config.intermediate_size)
        layers.append(layer)

    params = {
        "model": {
            "embed_tokens": {"weight": w(config.vocab_size, D)},
            "layers": layers,
            "norm": norm(D),
        }
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = lin(config.vocab_size, D)
    return params


def to_checkpoint(params: Params) -> dict[str, np.ndarray]:
    """Flat ``{tensor name: array}`` in the released checkpoint's naming (what a
    ``model.safetensors`` holds): routed experts unstacked to ``experts.N.w1.weight``.

    >>> p = init_params(KimiLinearConfig.tiny(), jax.random.key(0))
    >>> ckpt = to_checkpoint(p)
    >>> ckpt["model.layers.3.self_attn.kv_b_proj.weight"].shape
    (128, 32)
    >>> "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ckpt
    True
    """
    flat: dict[str, np.ndarray] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            if prefix.endswith("block_sparse_moe.experts"):
                for name, stacked in node.items():
                    for e in range(stacked.shape[0]):
                        flat[f"{prefix}.{e}.{name}.weight"] = np.asarray(stacked[e])
                return
            for key, child in node.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(f"{prefix}.{i}", child)
        else:
            flat[prefix] = np.asarray(node)

    walk("", params)
    return flat


# --------------------------------------------------------------------------------------------
# MLPs
# --------------------------------------------------------------------------------------------


def dense_mlp(p: Params, x):
    return _linear(jax.nn.silu(_linear(x, p["gate_proj"])) * _linear(x, p["up_proj"]),
                   p["down_proj"])


def route(p_gate: Params, config: KimiLinearConfig, x):
    """Router: ``(expert ids [N, k], weights [N, k])`` for ``N`` tokens ``x [N, D]``.

    Sigmoid (or softmax) scores; the selection adds ``e_score_correction_bias`` and, with
    expert groups, keeps the ``topk_group`` groups of highest top-2 sum; weights are the
    unbiased scores of the chosen experts, renormalised and scaled by ``routed_scaling_factor``.
    """
    logits = _linear(x.astype(jnp.float32), {"weight": p_gate["weight"].astype(jnp.float32)})
    if config.moe_router_activation_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    sel = scores + p_gate["e_score_correction_bias"].astype(jnp.float32)
    G = config.num_expert_group
    if G > 1:
        E = sel.shape[-1]
        grouped = sel.reshape(sel.shape[0], G, E // G)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        keep = jax.lax.top_k(group_score, config.topk_group)[1]  # [N, topk_group]
        kept = jnp.zeros(group_score.shape, bool).at[
            jnp.arange(sel.shape[0])[:, None], keep].set(True)
        sel = jnp.where(kept[:, :, None], grouped, 0.0).reshape(sel.shape)
    idx = jax.lax.top_k(sel, config.num_experts_per_token)[1]
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if config.num_experts_per_token > 1 and config.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx, weights * config.routed_scaling_factor


def sparse_moe(p: Params, config: KimiLinearConfig, x):
    """Routed experts (grouped matmuls over tokens sorted by expert) plus shared experts."""
    N, D = x.shape
    k, E = config.num_experts_per_token, config.num_experts
    idx, weights = route(p["gate"], config, x)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tokens = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[tokens]
    ex = p["experts"]
    w1 = jnp.swapaxes(ex["w1"], 1, 2).astype(x.dtype)  # [E, D, I]
    w3 = jnp.swapaxes(ex["w3"], 1, 2).astype(x.dtype)
    w2 = jnp.swapaxes(ex["w2"], 1, 2).astype(x.dtype)  # [E, I, D]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w1, group_sizes)) * jax.lax.ragged_dot(
        xs, w3, group_sizes
    )
    ys = jax.lax.ragged_dot(h, w2, group_sizes)  # [N*k, D], sorted by expert
    ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
    out = jnp.zeros((N, D), ys.dtype).at[tokens].add(ys)
    if "shared_experts" in p:
        out = out + dense_mlp(p["shared_experts"], x)
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# attention layers (serving path)
# --------------------------------------------------------------------------------------------


def kda_attention(p: Params, config: KimiLinearConfig, layer_id: int, x, backend, batch):
    """KDA layer on ``x [T, D]`` through ``backend``: ``(out [T, D], batch)``."""
    T = x.shape[0]
    H, Dk = config.linear_num_heads, config.linear_head_dim
    a = _linear(_linear(x, p["f_a_proj"]), p["f_b_proj"]).reshape(T, H, Dk)
    g = kda_gate(a, p["A_log"], p["dt_bias"])
    beta = jax.nn.sigmoid(_linear(x, p["b_proj"]).astype(jnp.float32))
    o, batch = backend(
        layer_id, batch,
        q=_linear(x, p["q_proj"]), k=_linear(x, p["k_proj"]), v=_linear(x, p["v_proj"]),
        g=g, beta=beta,
        q_conv=p["q_conv1d"]["weight"], k_conv=p["k_conv1d"]["weight"],
        v_conv=p["v_conv1d"]["weight"],
    )
    gate = _linear(_linear(x, p["g_a_proj"]), p["g_b_proj"]).reshape(T, H, Dk)
    o = rms_norm(o, p["o_norm"]["weight"], config.rms_norm_eps)
    o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    return _linear(o.reshape(T, H * Dk), p["o_proj"]), batch


def mla_split(p: Params, config: KimiLinearConfig, x):
    """MLA projections of ``x [T, D]``: ``q_nope, q_pe, c_kv, k_pe, w_kc, w_vc``."""
    T = x.shape[0]
    H, dn, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    r = config.kv_lora_rank
    q = _linear(x, p["q_proj"]).reshape(T, H, config.q_head_dim)
    kv = _linear(x, p["kv_a_proj_with_mqa"])
    c_kv = rms_norm(kv[:, :r], p["kv_a_layernorm"]["weight"], config.rms_norm_eps)
    kv_b = p["kv_b_proj"]["weight"].reshape(H, dn + dv, r)
    return dict(q_nope=q[..., :dn], q_pe=q[..., dn:], c_kv=c_kv, k_pe=kv[:, r:],
                w_kc=kv_b[:, :dn], w_vc=kv_b[:, dn:])


def mla_attention(p: Params, config: KimiLinearConfig, layer_id: int, x, backend, batch):
    """MLA layer on ``x [T, D]`` through ``backend``: ``(out [T, D], batch)``."""
    T = x.shape[0]
    o, batch = backend(layer_id, batch, **mla_split(p, config, x))
    return _linear(o.reshape(T, -1), p["o_proj"]), batch


def decoder_layer(p: Params, config: KimiLinearConfig, layer_id: int, x, backend, batch):
    h = rms_norm(x, p["input_layernorm"]["weight"], config.rms_norm_eps)
    attn = kda_attention if config.is_kda_layer(layer_id) else mla_attention
    a, batch = attn(p["self_attn"], config, layer_id, h, backend, batch)
    x = x + a
    h = rms_norm(x, p["post_attention_layernorm"]["weight"], config.rms_norm_eps)
    if config.is_moe_layer(layer_id):
        m = sparse_moe(p["block_sparse_moe"], config, h)
    else:
        m = dense_mlp(p["mlp"], h)
    return x + m, batch


def forward(params: Params, config: KimiLinearConfig, backend, batch):
    """Serving forward over ``batch.input_ids [T]``: ``(hidden [T, D], batch)`` with the
    batch's pools updated by every layer. ``backend`` must carry this batch's metadata."""
    _check_supported(config)
    x = params["model"]["embed_tokens"]["weight"][batch.input_ids]
    for i, layer in enumerate(params["model"]["layers"]):
        x, batch = decoder_layer(layer, config, i, x, backend, batch)
    return rms_norm(x, params["model"]["norm"]["weight"], config.rms_norm_eps), batch


def compute_logits(params: Params, config: KimiLinearConfig, hidden) -> Float[Array, "N V"]:
    """Logits (float32) of final hidden states ``[N, D]``."""
    head = (params["model"]["embed_tokens"] if config.tie_word_embeddings
            else params["lm_head"])["weight"]
    return hidden.astype(jnp.float32) @ head.T.astype(jnp.float32)


__all__ = [
    "compute_logits", "dense_mlp", "decoder_layer", "forward", "init_params", "kda_attention",
    "mla_attention", "mla_split", "rms_norm", "route", "sparse_moe", "to_checkpoint",
]
