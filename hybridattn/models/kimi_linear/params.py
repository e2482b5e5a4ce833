"""Kimi-Linear's parameters: a nested dict in the released checkpoint's layout, initialised
(:func:`init_params`), their expected shapes (:func:`param_shapes`) and the check of a
loaded tree (:func:`check_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Key, UInt32

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.layout import checkpoint_layout
from hybridattn.models.kimi_linear.primitives import Params

__all__ = [
    "check_params",
    "check_supported",
    "init_params",
    "param_shapes",
]


def check_supported(config: KimiLinearConfig) -> None:
    """``ValueError`` naming the first config value this implementation does not support
    (a low-rank query projection, rotary MLA, another activation or router); nothing for a
    config it serves.

    >>> check_supported(KimiLinearConfig.tiny())
    >>> check_supported(KimiLinearConfig.tiny(hidden_act="gelu"))
    Traceback (most recent call last):
    ...
    ValueError: KimiLinearConfig.hidden_act='gelu' is not supported: the MLPs and the KDA \
output gate are implemented for 'silu' only
    """
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
    if config.hidden_act != "silu":
        raise ValueError(
            f"KimiLinearConfig.hidden_act={config.hidden_act!r} is not supported: the MLPs and "
            "the KDA output gate are implemented for 'silu' only"
        )
    if not config.use_grouped_topk and config.num_experts and config.num_expert_group > 1:
        raise ValueError(
            f"KimiLinearConfig.use_grouped_topk=False with num_expert_group="
            f"{config.num_expert_group} is not supported: the router always selects expert "
            "groups first (as mlx-lm and transformers do)"
        )


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------


def init_params(
    config: KimiLinearConfig, key: Key[Array, ""] | UInt32[Array, " 2"], dtype=jnp.float32
) -> Params:
    """Random parameters in the checkpoint layout (the tree of ``param_shapes``):
    normal(0, 0.02) weights, unit norms, conv weights normal(0, 0.3), ``dt_bias`` normal(0,
    0.5), router bias normal(0, 0.1) and ``A_log = log(U(1, 16))`` as mlx-lm initialises it.
    Drawn on the host with NumPy (no compilation); the same key gives the same parameters.

    >>> cfg = KimiLinearConfig.tiny()
    >>> p = init_params(cfg, jax.random.key(0))
    >>> p["model"]["layers"][0]["self_attn"]["q_conv1d"]["weight"].shape
    (64, 1, 4)
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())

    def draw(name: str, spec: jax.ShapeDtypeStruct):
        shape, last = spec.shape, name.rsplit(".", 2)
        if name.endswith("norm.weight"):
            x = np.ones(shape, np.float32)
        elif name.endswith("A_log"):
            x = np.log(rng.uniform(1.0, 16.0, shape))
        else:
            std = (0.3 if last[-2].endswith("conv1d") else 0.5 if last[-1] == "dt_bias"
                   else 0.1 if last[-1] == "e_score_correction_bias" else 0.02)
            x = std * rng.standard_normal(shape, np.float32)
        return jnp.asarray(x, spec.dtype)

    def walk(prefix: str, node):
        if isinstance(node, dict):
            return {k: walk(f"{prefix}.{k}" if prefix else k, v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(f"{prefix}.{n}", v) for n, v in enumerate(node)]
        return draw(prefix, node)

    return walk("", param_shapes(config, dtype))


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------

# Parameters kept in float32 whatever the model's dtype (as init_params and mlx-lm keep them).
_F32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
_MAX_PROBLEMS = 20


def _keeps_f32(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _F32_PARAMS


def check_params(params: Params, config: KimiLinearConfig) -> None:
    """Raise ``ValueError`` naming the first parameter whose path, shape or dtype kind does not
    match ``param_shapes(config)`` (every leaf a floating array, any float dtype). ``Engine``
    calls it, so params of another config never run silently.

    >>> import dataclasses
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> check_params(init_params(cfg, jax.random.key(0)), cfg)  # fits: returns None
    >>> check_params(init_params(cfg, jax.random.key(0)), dataclasses.replace(cfg, vocab_size=65))
    Traceback (most recent call last):
    ...
    ValueError: params do not match the config: lm_head.weight has shape (64, 32), the config \
needs (65, 32)
    """
    if not isinstance(params, Mapping):  # a path, say: kimi_linear.load reads one
        raise ValueError(f"params must be the nested dict of arrays of param_shapes(config) "
                         f"(kimi_linear.load(path) or init_params), got "
                         f"{type(params).__name__}: {params!r:.60}")
    want = dict(_flat(param_shapes(config)))
    try:
        got = dict(_flat(jax.eval_shape(checkpoint_layout, params)))
    except Exception as e:  # not a tree of arrays at all
        raise ValueError(f"params must be the nested dict of arrays of param_shapes(config): "
                         f"{e}") from None
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"params do not match the config ({config.num_hidden_layers} layers): "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    for name, spec in want.items():
        leaf = got[name]
        shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
        if shape != spec.shape:
            raise ValueError(f"params do not match the config: {name} has shape {shape}, the "
                             f"config needs {spec.shape}")
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params: {name} has dtype {dtype}, expected a floating dtype")


def _flat(tree) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf)
            for path, leaf in leaves]


def param_shapes(config: KimiLinearConfig, dtype=jnp.float32) -> Params:
    """The tree ``init_params`` returns, as ``jax.ShapeDtypeStruct`` leaves (nothing is
    allocated): ``A_log``, ``dt_bias`` and ``e_score_correction_bias`` are float32, the rest
    ``dtype``.

    >>> param_shapes(KimiLinearConfig.tiny())["model"]["layers"][1]["block_sparse_moe"][
    ...     "experts"]["w2"].shape
    (4, 64, 32)
    """
    check_supported(config)
    D = config.hidden_size

    def s(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt)

    def lin(out_dim, in_dim):
        return {"weight": s(out_dim, in_dim)}

    def mlp(inter):
        return {"gate_proj": lin(inter, D), "up_proj": lin(inter, D), "down_proj": lin(D, inter)}

    layers = []
    for i in range(config.num_hidden_layers):
        if config.is_kda_layer(i):
            H, Dk = config.linear_num_heads, config.linear_head_dim
            K = config.linear_conv_kernel_dim
            attn = {
                "q_proj": lin(H * Dk, D), "k_proj": lin(H * Dk, D), "v_proj": lin(H * Dk, D),
                "q_conv1d": {"weight": s(H * Dk, 1, K)},
                "k_conv1d": {"weight": s(H * Dk, 1, K)},
                "v_conv1d": {"weight": s(H * Dk, 1, K)},
                "A_log": s(1, 1, H, 1, dt=jnp.float32),
                "dt_bias": s(H * Dk, dt=jnp.float32),
                "f_a_proj": lin(Dk, D), "f_b_proj": lin(H * Dk, Dk),
                "g_a_proj": lin(Dk, D), "g_b_proj": lin(H * Dk, Dk),
                "b_proj": lin(H, D),
                "o_norm": {"weight": s(Dk)},
                "o_proj": lin(D, H * Dk),
            }
        else:
            H, r = config.num_attention_heads, config.kv_lora_rank
            attn = {
                "q_proj": lin(H * config.q_head_dim, D),
                "kv_a_proj_with_mqa": lin(r + config.qk_rope_head_dim, D),
                "kv_a_layernorm": {"weight": s(r)},
                "kv_b_proj": lin(H * (config.qk_nope_head_dim + config.v_head_dim), r),
                "o_proj": lin(D, H * config.v_head_dim),
            }
        layer = {"self_attn": attn, "input_layernorm": {"weight": s(D)},
                 "post_attention_layernorm": {"weight": s(D)}}
        if config.is_moe_layer(i):
            E, inter = config.num_experts, config.moe_intermediate_size
            moe = {
                "gate": {"weight": s(E, D), "e_score_correction_bias": s(E, dt=jnp.float32)},
                "experts": {"w1": s(E, inter, D), "w2": s(E, D, inter), "w3": s(E, inter, D)},
            }
            if config.num_shared_experts:
                moe["shared_experts"] = mlp(inter * config.num_shared_experts)
            layer["block_sparse_moe"] = moe
        else:
            layer["mlp"] = mlp(config.intermediate_size)
        layers.append(layer)
    params = {"model": {"embed_tokens": lin(config.vocab_size, D), "layers": layers,
                        "norm": {"weight": s(D)}}}
    if not config.tie_word_embeddings:
        params["lm_head"] = lin(config.vocab_size, D)
    return params
