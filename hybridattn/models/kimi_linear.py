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

``apply`` is the cache-free forward of a ``[B, T]`` batch of token ids (the reference the
serving path must match, and what one trains with); ``save_pretrained`` and ``load``
write and read Hugging Face checkpoint directories (``config.json`` plus ``model.safetensors``
or shards with ``model.safetensors.index.json``) in the released naming::

    save_pretrained(params, config, "ckpt", dtype=jnp.bfloat16)
    config, params = load("ckpt")
    logits = jax.jit(apply, static_argnums=1)(params, config, input_ids)   # [B, T, V] f32
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key, UInt32
from safetensors import safe_open
from safetensors.numpy import save_file

from hybridattn._pytree import pytree_dataclass
from hybridattn.config import KimiLinearConfig
from hybridattn.ops import kda_chunked, kda_gate, l2norm, short_conv
from hybridattn.pools import LayerRef
from servecore.progress import progress_bar
from servecore.prompts import load_tokenizer as _load_tokenizer

Params = dict

# Shape aliases:
#   B, T  sequences and their tokens (``apply``); T is also the tokens of a serving batch
#   N     tokens, flattened (MLP / MoE inputs); D hidden size; V vocabulary
#   k     experts per token; H heads


def rms_norm(
    x: Float[Array, "*batch D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "*batch D"]:
    """``x / rms(x) * weight`` over the last axis, in f32, returned in ``x.dtype``.

    >>> x = jnp.array([[2.0, -2.0], [4.0, 4.0]])
    >>> rms_norm(x, jnp.array([1.0, 0.5]), eps=0.0).tolist()
    [[1.0, -0.5], [1.0, 0.5]]
    >>> rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), eps=1e-5).dtype
    dtype(bfloat16)
    """
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
    params = checkpoint_layout(params)
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


def dense_mlp(p: Params, x: Float[Array, "N D"], comm=None) -> Float[Array, "N D"]:
    """The SwiGLU MLP of dense layers and shared experts:
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> mlp = init_params(cfg, jax.random.key(0))["model"]["layers"][0]["mlp"]  # dense layer
    >>> mlp["gate_proj"]["weight"].shape  # [intermediate_size, D]
    (128, 32)
    >>> dense_mlp(mlp, jnp.ones((3, 32))).shape
    (3, 32)

    With ``comm`` (``hybridattn.sharding``), ``p`` holds a slice of the intermediate
    channels and ``comm.reduce_rows`` sums the slices' partial outputs.
    """
    y = _linear(jax.nn.silu(_linear(x, p["gate_proj"])) * _linear(x, p["up_proj"]),
                p["down_proj"])
    return y if comm is None else comm.reduce_rows(y)


def route(
    p_gate: Params, config: KimiLinearConfig, x: Float[Array, "N D"]
) -> tuple[Int[Array, "N k"], Float[Array, "N k"]]:
    """Router: ``(expert ids [N, k], weights [N, k])`` for ``N`` tokens ``x [N, D]``.

    Sigmoid (or softmax) scores; the selection adds ``e_score_correction_bias`` and, with
    expert groups, keeps the ``topk_group`` groups of highest top-2 sum; weights are the
    unbiased scores of the chosen experts, renormalised (``moe_renormalize``) and scaled by
    ``routed_scaling_factor``. Weights are float32.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> moe = init_params(cfg, jax.random.key(0))["model"]["layers"][1]["block_sparse_moe"]
    >>> ids, weights = route(moe["gate"], cfg, jnp.ones((3, 32)))
    >>> ids.shape, weights.shape  # top-2 of 4 experts for each of 3 tokens
    ((3, 2), (3, 2))
    >>> bool(jnp.allclose(weights.sum(-1), cfg.routed_scaling_factor))
    True
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


_MOE_BLOCK = 64  # rows per block of the blocked (sorted) expert form


def _moe_blocks(pairs: int, num_experts: int) -> int:
    """Blocks the blocked form needs at most: every expert's group padded to whole blocks."""
    return -(-pairs // _MOE_BLOCK) + num_experts


_MAX_PAIRS = 32  # token-expert pairs up to which the CPU path takes them one at a time


def _pairwise_experts(x, idx, weights, experts):
    """Routed experts one token-expert pair at a time (CPU, few pairs): each pair's expert
    weights taken by a dynamic index (a contiguous block of the stack, read once, also out of
    a layer scan's stack) and applied to its token by plain products, the pairs unrolled.
    On XLA:CPU this ran the routed block of ``bench.serve_config()`` (top-2 of 8 experts) at
    one token 3.1x faster than gathering the chosen experts (``w1[idx]``, an element-wise
    gather), and the decode step at B = 1 about 10% faster. Past ``E`` pairs (8 tokens there)
    every expert on every token was faster in the step, though not alone."""
    N, k = idx.shape

    def weight(name, e):  # [I, D] (w2: [D, I]) of expert e
        return jax.lax.dynamic_index_in_dim(experts[name], e, 0, keepdims=False).astype(x.dtype)

    rows = []
    for n in range(N):
        xn, y = x[n:n + 1], jnp.zeros((1, x.shape[1]), x.dtype)
        for j in range(k):
            e = idx[n, j]
            h = jax.nn.silu(xn @ weight("w1", e).T) * (xn @ weight("w3", e).T)
            down = weight("w2_t", e) if "w2_t" in experts else weight("w2", e).T
            y = y + (h @ down) * weights[n, j].astype(x.dtype)
        rows.append(y)
    return jnp.concatenate(rows)


def _blocked_experts(x, idx, weights, w1, w2t, w3):
    """Routed experts by blocks: token-expert pairs sorted by expert, each expert's group
    padded to whole blocks of ``_MOE_BLOCK`` rows, one ``lax.scan`` step per block with that
    block's expert weights (dynamic slices, no copies of the stacked weights). ``w2t`` is the
    down projection input-major, ``[E, I, D]``."""
    N, D = x.shape
    k = idx.shape[1]
    E = w1.shape[0]
    bs, P = _MOE_BLOCK, N * k
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.bincount(flat, length=E)
    blocks = -(-counts // bs)
    first_block = jnp.cumsum(blocks) - blocks
    first_row = jnp.cumsum(counts) - counts
    dest = first_block[expert] * bs + jnp.arange(P) - first_row[expert]  # padded row per pair
    nb = _moe_blocks(P, E)
    token = order // k
    rows = jnp.zeros((nb * bs, D), x.dtype).at[dest].set(x[token])
    block_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(blocks), jnp.arange(nb), side="right"),
                            0, E - 1)

    def block(_, args):
        xb, e = args
        h = jax.nn.silu(xb @ w1[e].T) * (xb @ w3[e].T)
        return None, h @ w2t[e]

    _, y = jax.lax.scan(block, None, (rows.reshape(nb, bs, D), block_expert))
    ys = y.reshape(nb * bs, D)[dest] * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((N, D), ys.dtype).at[token].add(ys)


def sparse_moe(
    p: Params, config: KimiLinearConfig, x: Float[Array, "N D"], comm=None
) -> Float[Array, "N D"]:
    """Routed experts plus shared experts, for ``x [N, D]``.

    Exact evaluations of the same sum, picked by shape and platform at trace time:

    * on CPU, few token-expert pairs (``N * top_k <= min(E, 32)``: decode): one pair at a
      time, each expert's weights taken by a dynamic index (``_pairwise_experts``).
    * elsewhere ``N * top_k <= E`` (decode, small batches): gather the chosen experts'
      weights per token and contract them; it reads only the experts in use.
    * otherwise on CPU, many tokens (prefill): token-expert pairs sorted by expert into
      blocks of ``_MOE_BLOCK`` rows, each block one expert's (zero-padded), run as a
      ``lax.scan`` over blocks: about ``N * top_k`` rows of work instead of ``N * E``.
    * otherwise on CPU, few tokens: every expert on every token, weighted by the (mostly
      zero) routing weights. XLA:CPU lowers ``ragged_dot`` to this same dense product anyway,
      after copying the transposed expert weights on every call; this skips the copies.
    * otherwise (GPU / TPU): tokens sorted by expert and grouped matmuls (``ragged_dot``).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> moe = init_params(cfg, jax.random.key(0))["model"]["layers"][1]["block_sparse_moe"]
    >>> moe["experts"]["w1"].shape  # stacked routed experts [E, I, D]
    (4, 32, 32)
    >>> sparse_moe(moe, cfg, jnp.ones((3, 32))).shape
    (3, 32)

    ``comm`` (``hybridattn.sharding``; None: one device) runs the routed part where the
    experts live: ``comm.routed_experts(x, idx, weights, experts)``.
    """
    idx, weights = route(p["gate"], config, x)
    if comm is None:
        out = routed_experts(x, idx, weights, p["experts"])
    else:
        out = comm.routed_experts(x, idx, weights, p["experts"])
    if "shared_experts" in p:
        out = out + dense_mlp(p["shared_experts"], x, comm)
    return out.astype(x.dtype)


def routed_experts(
    x: Float[Array, "N D"], idx: Int[Array, "N k"], weights: Float[Array, "N k"],
    experts: Params, first_expert: int | Int[Array, ""] = 0,
) -> Float[Array, "N D"]:
    """``sum_j weights[n, j] * expert_{idx[n, j]}(x[n])`` over the experts stacked in
    ``experts`` (``w1 [E, I, D]``, ``w3 [E, I, D]`` and the down projection, ``w2 [E, D, I]``
    as in the checkpoint or ``w2_t [E, I, D]`` in ``serving_layout``), which are experts
    ``first_expert .. first_expert + E - 1`` of the model: pairs routed to any other expert
    add nothing (a device holding a slice of the experts computes its share of the sum).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> moe = init_params(cfg, jax.random.key(0))["model"]["layers"][1]["block_sparse_moe"]
    >>> x = jnp.ones((3, 32))
    >>> idx, w = route(moe["gate"], cfg, x)
    >>> halves = [routed_experts(x, idx, w, jax.tree.map(lambda a: a[i:i + 2], moe["experts"]),
    ...                          first_expert=i) for i in (0, 2)]
    >>> bool(jnp.allclose(halves[0] + halves[1], routed_experts(x, idx, w, moe["experts"]),
    ...                   atol=1e-6))
    True
    """
    N, D = x.shape
    k = idx.shape[1]
    w1, w3 = (experts[n].astype(x.dtype) for n in ("w1", "w3"))  # [E, I, D]
    # the down projection input-major [E, I, D]: as served, or the checkpoint's transposed
    w2t = (experts["w2_t"] if "w2_t" in experts
           else jnp.swapaxes(experts["w2"], 1, 2)).astype(x.dtype)
    E = w1.shape[0]
    if not (isinstance(first_expert, int) and first_expert == 0):
        local = idx - first_expert
        here = (local >= 0) & (local < E)
        idx, weights = jnp.clip(local, 0, E - 1), jnp.where(here, weights, 0.0)
    if jax.default_backend() == "cpu" and N * k <= min(E, _MAX_PAIRS):
        out = _pairwise_experts(x, idx, weights, experts)
    elif N * k <= E:
        h = (jax.nn.silu(jnp.einsum("nd,nkid->nki", x, w1[idx]))
             * jnp.einsum("nd,nkid->nki", x, w3[idx]))
        ys = jnp.einsum("nki,nkid->nkd", h, w2t[idx])
        out = jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))
    elif jax.default_backend() == "cpu" and _moe_blocks(N * k, E) * _MOE_BLOCK * 2 <= N * E:
        out = _blocked_experts(x, idx, weights, w1, w2t, w3)
    elif jax.default_backend() == "cpu":
        # Every expert on every token, as two plain matrix products: w1 / w3 as one
        # [E*I, D] matrix each, and the weighted hidden states [N, E*I] times w2t as one
        # [E*I, D] matrix (with serving_layout's w2_t, no weight is copied per call). The
        # down projection batched over experts and summed ("eni,edi->end") was 1.6x slower
        # for the whole routed block at N = 8 (bench.serve_config()'s experts, XLA:CPU).
        combine = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], idx].add(weights)
        inter = w1.shape[1]
        h1 = (x @ w1.reshape(E * inter, D).T).reshape(N, E, inter)
        h3 = (x @ w3.reshape(E * inter, D).T).reshape(N, E, inter)
        h = jax.nn.silu(h1) * h3 * combine[:, :, None].astype(h1.dtype)
        out = h.reshape(N, E * inter) @ w2t.reshape(E * inter, D)
    else:
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tokens = order // k
        group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[tokens]
        w1t, w3t = (jnp.swapaxes(w, 1, 2) for w in (w1, w3))
        h = (jax.nn.silu(jax.lax.ragged_dot(xs, w1t, group_sizes))
             * jax.lax.ragged_dot(xs, w3t, group_sizes))
        ys = jax.lax.ragged_dot(h, w2t, group_sizes)  # [N*k, D], sorted by expert
        ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
        out = jnp.zeros((N, D), ys.dtype).at[tokens].add(ys)
    return out


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


def forward(
    params: Params, config: KimiLinearConfig, backend, batch, comm=None
) -> tuple[Float[Array, "T D"], Any]:
    """Serving forward over ``batch.input_ids [T]``: ``(hidden [T, D], batch)`` with the
    batch's pools updated by every layer. ``backend`` must carry this batch's metadata;
    ``comm`` (None: one device) is how ``hybridattn.sharding`` joins the shards of a mesh.
    ``hybridattn.step`` runs it for you; by hand, one 3-token prompt in row 1 (token slots
    1-3), shapes only (``jax.eval_shape`` compiles nothing):

    >>> from hybridattn import BatchRequest, ServingState, make_forward_batch
    >>> from hybridattn.pools import alloc_reqs_or_raise, write_token_slots
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=1, max_context_len=8,
    ...                             num_token_slots=9)
    >>> req, rows = alloc_reqs_or_raise(state.req_to_token_pool, 1)
    >>> req = write_token_slots(req, jnp.array([1, 1, 1]), jnp.arange(3), jnp.array([1, 2, 3]))
    >>> batch = make_forward_batch(
    ...     [BatchRequest(req_index=1, prefix_len=0, token_ids=[5, 6, 7], slots=[1, 2, 3])],
    ...     req_to_token_pool=req, token_to_kv_pool=state.token_to_kv_pool,
    ...     recurrent_state_pool=state.recurrent_state_pool)
    >>> backend = state.backend.with_forward_metadata(state.backend.get_forward_metadata(batch))
    >>> hidden, batch = jax.eval_shape(lambda p, b: forward(p, cfg, backend, b),
    ...                                param_shapes(cfg), batch)
    >>> hidden.shape, batch.token_to_kv_pool.c_kv.shape  # [T, D]; the updated MLA pool
    ((3, 32), (1, 9, 32))
    """
    _check_supported(config)
    x = params["model"]["embed_tokens"]["weight"][batch.input_ids]
    layers = params["model"]["layers"]
    if isinstance(layers, StackedLayers):
        x, batch = _stacked_forward(layers, config, x, backend, batch, comm)
    elif isinstance(layers, GroupedLayers):
        x, batch = _grouped_forward(layers, config, x, backend, batch, comm)
    else:
        for i, layer in enumerate(layers):
            x, batch = decoder_layer(layer, config, i, x, backend, batch, comm)
    return rms_norm(x, params["model"]["norm"]["weight"], config.rms_norm_eps), batch


# --------------------------------------------------------------------------------------------
# layers of one kind compiled once: a scan over stacked layers
# --------------------------------------------------------------------------------------------


def layer_plan(config: KimiLinearConfig) -> tuple[int, int, int]:
    """``(start, period, repeats)``: layers ``start .. start + period * repeats - 1`` repeat
    one pattern of ``period`` layers (kind and MLP: KDA or MLA, dense or MoE) ``repeats``
    times, the longest such run (then the earliest, then the shortest period); ``(0, 0, 0)``
    when nothing repeats. ``stack_layers`` stacks that run; the step compiles ``period``
    layers for it instead of ``period * repeats``.

    The released 27-layer pattern (MLA every 4th layer and the last; layer 0 dense): one
    layer, six repeats of (KDA, KDA, MLA, KDA), two more; 7 layers compiled instead of 27.

    >>> layer_plan(KimiLinearConfig.tiny(num_hidden_layers=27))
    (1, 4, 6)
    >>> layer_plan(KimiLinearConfig.tiny())  # 4 layers: 1 and 2 (KDA, MoE) repeat
    (1, 1, 2)
    >>> layer_plan(KimiLinearConfig.tiny(num_hidden_layers=2))  # nothing repeats
    (0, 0, 0)
    """
    n = config.num_hidden_layers
    sig = [(config.is_kda_layer(i), config.is_moe_layer(i)) for i in range(n)]
    best, saved = (0, 0, 0), 0
    for start in range(n):
        for period in range(1, (n - start) // 2 + 1):
            unit, reps = sig[start:start + period], 1
            while sig[start + reps * period:start + (reps + 1) * period] == unit:
                reps += 1
            if (reps - 1) * period > saved:
                best, saved = (start, period, reps), (reps - 1) * period
    return best


@pytree_dataclass(static=("plan",))
class StackedLayers:
    """``params["model"]["layers"]`` of ``stack_layers``: the layers before the repeated run
    (``head``, as they are), the run (``body``: ``period`` layer dicts whose leaves are
    stacked ``[repeats, ...]``, position ``j`` holding layers ``start + j + k * period``) and
    the layers after it (``tail``). ``plan`` is ``layer_plan(config)``.

    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64)  # layers 1 and 2 repeat
    >>> layers = stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"]
    >>> layers.plan, len(layers.head), len(layers.body), len(layers.tail)
    ((1, 1, 2), 1, 1, 1)
    >>> layers.body[0]["input_layernorm"]["weight"].shape  # [repeats, D]
    (2, 32)
    """

    head: Any
    body: Any
    tail: Any
    plan: tuple[int, int, int]


def group_plan(config: KimiLinearConfig) -> tuple[int, tuple[int, ...], int]:
    """``(start, groups, tail)``: from layer ``start`` on, the layers are groups of
    ``groups[g]`` KDA layers followed by one MLA layer, every KDA layer there alike and every
    MLA layer alike (kind and MLP), then ``tail`` more layers; ``(0, (), 0)`` when there are
    not two such groups. ``stack_layers`` may run them (``_plans`` says when) as one
    ``lax.scan`` over the groups with a loop over each group's KDA layers, the ``start``
    layers before them in the first group's loop too when ``folded_layers`` says so: the step
    then compiles ``2 + tail`` layers (``start + 2 + tail`` when they are not folded).

    The released 27-layer pattern (MLA every 4th layer and the last; layer 0 dense): layer 0,
    then seven groups; 2 layers compiled instead of 27 (the period plan compiles 7).

    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=27))
    (1, (2, 3, 3, 3, 3, 3, 2), 0)
    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=10, full_attention_layer_ids=(3, 7)))
    (1, (2, 3), 2)
    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=2))
    (0, (), 0)
    """
    n = config.num_hidden_layers
    sig = [(config.is_kda_layer(i), config.is_moe_layer(i)) for i in range(n)]
    start = 0
    while start < n and len(set(sig[start:])) > 2:
        start += 1
    mla = [i for i in range(start, n) if not sig[i][0]]
    if len(mla) < 2 or not any(sig[i][0] for i in range(start, mla[-1])):
        return 0, (), 0
    groups = tuple(b - a - 1 for a, b in zip([start - 1, *mla[:-1]], mla, strict=True))
    return start, groups, n - mla[-1] - 1


def folded_layers(config: KimiLinearConfig) -> int:
    """How many layers before ``group_plan``'s groups run inside the first group's loop of KDA
    layers: all of them (``start``) when they are KDA layers with one kind of MLP, else 0.
    Their MLP is not the groups' (else they would be in the groups), so the loop runs it by a
    ``lax.cond`` on the layer's index. The released pattern's dense layer 0 is so: the step
    compiles one KDA layer for all 20 and one MLA layer for all 7.

    >>> folded_layers(KimiLinearConfig.tiny(num_hidden_layers=27))
    1
    >>> folded_layers(KimiLinearConfig.tiny(num_hidden_layers=27, num_experts=0))  # no head
    0
    """
    start, groups, _ = group_plan(config)
    head = range(start)
    if not groups or not all(config.is_kda_layer(i) for i in head):
        return 0
    return start if len({config.is_moe_layer(i) for i in head}) == 1 else 0


def compiled_layers(config: KimiLinearConfig) -> int:
    """Layers the serving step compiles once ``stack_layers`` has stacked what repeats.

    >>> [compiled_layers(KimiLinearConfig.tiny(num_hidden_layers=n)) for n in (2, 4, 8, 27)]
    [2, 3, 6, 2]
    """
    return _plans(config)[1]


def _plans(config: KimiLinearConfig) -> tuple[str | None, int]:
    """``(plan, compiled)``: how ``stack_layers`` stacks ``config``'s layers (``"period"``,
    ``"groups"`` or None: not at all) and the layers the step then compiles.

    The groups when they compile fewer layers than the period and the period already runs
    at least half the layers in its scan. A layer in a loop reads its weights by a traced
    index, which XLA:CPU copies out of the stack before each product: with 27 layers, where
    the period scans 24, the groups' step decoded in 0.94x the period's time and prefilled
    in 0.93x (``bench.serve_config``'s widths, B = 8); with 8, where the period scans 3 and
    runs 5 layers unrolled, the groups' decode took 1.14x.
    """
    n = config.num_hidden_layers
    _, period, reps = layer_plan(config)
    start, groups, tail = group_plan(config)
    looped = period * reps if reps >= 2 else 0
    by_period = n - looped + period if looped else n
    by_groups = start - folded_layers(config) + 2 + tail
    if groups and by_groups < by_period and 2 * looped >= n:
        return "groups", by_groups
    return ("period", by_period) if looped else (None, n)


@pytree_dataclass(static=("start", "groups", "folded"))
class GroupedLayers:
    """``params["model"]["layers"]`` of ``stack_layers`` by ``group_plan``: the layers before
    the groups that do not run in their loop (``head``), the loop's KDA layers (``kda``: one
    layer dict whose leaves are stacked in layer order: ``[folded + sum(groups), ...]``, the
    MLP's ``[sum(groups), ...]``), the MLPs of the ``folded`` layers before the groups that
    run in the loop (``fold``: stacked ``[folded, ...]``, None when none;
    ``folded_layers``), the groups' MLA layers (``mla``: stacked ``[len(groups), ...]``) and
    the layers after them (``tail``).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> layers = stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"]
    >>> layers.start, layers.groups, layers.folded, len(layers.head), len(layers.tail)
    (1, (2, 3, 3), 1, 0, 0)
    >>> layers.kda["input_layernorm"]["weight"].shape, layers.mla["input_layernorm"][
    ...     "weight"].shape  # layer 0 and the groups' 8 KDA layers; 3 MLA layers
    ((9, 32), (3, 32))
    >>> layers.kda["block_sparse_moe"]["gate"]["weight"].shape  # the groups' MoE: 8 layers
    (8, 4, 32)
    >>> layers.fold["mlp"]["gate_proj"]["weight"].shape  # layer 0's dense MLP
    (1, 128, 32)
    """

    head: Any
    kda: Any
    mla: Any
    tail: Any
    fold: Any
    start: int
    groups: tuple[int, ...]
    folded: int = 0


STACKED = (StackedLayers, GroupedLayers)
"""The layouts of ``params["model"]["layers"]`` that ``stack_layers`` makes."""


def stack_layer_list(layers: list, config: KimiLinearConfig,
                     stack: Callable[[list], Any]) -> Any:
    """``layers`` (one item per layer: a parameter dict, or anything laid out alike) as
    ``stack_layers`` lays them out, ``stack`` joining the items of layers run as one
    (``GroupedLayers`` or ``StackedLayers``); ``layers`` itself when nothing repeats.
    ``sharding.stacked_param_specs`` lays out its specs with it.

    A folded layer's MLP (``folded_layers``) is stacked apart from its other entries, so with
    folded layers the items must be dicts keyed like a layer's parameters. Each layer's id as
    the leaf of its items:

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12)
    >>> items = [{"self_attn": i, ("block_sparse_moe" if i else "mlp"): i} for i in range(12)]
    >>> out = stack_layer_list(items, cfg, lambda xs: jax.tree.map(lambda *i: i, *xs))
    >>> out.head, out.kda["self_attn"], out.kda["block_sparse_moe"], out.fold
    ([], (0, 1, 2, 4, 5, 6, 8, 9, 10), (1, 2, 4, 5, 6, 8, 9, 10), {'mlp': (0,)})
    >>> out.mla["self_attn"], out.tail
    ((3, 7, 11), [])
    """
    n = len(layers)
    plan, _ = _plans(config)
    if plan == "groups":
        start, groups, tail = group_plan(config)
        folded = folded_layers(config)
        run = range(start, n - tail)
        kda = [layers[i] for i in run if config.is_kda_layer(i)]
        mla = [layers[i] for i in run if not config.is_kda_layer(i)]
        fold = None
        if folded:  # their MLPs apart; the rest of them first in the KDA stack
            head = [_mlp_apart(p) for p in layers[:folded]]
            parts = [_mlp_apart(p) for p in kda]
            kda = {**stack([p for p, _ in head] + [p for p, _ in parts]),
                   **stack([m for _, m in parts])}
            fold = stack([m for _, m in head])
        else:
            kda = stack(kda)
        return GroupedLayers(head=list(layers[folded:start]), kda=kda, mla=stack(mla),
                             tail=list(layers[n - tail:]), fold=fold, start=start,
                             groups=groups, folded=folded)
    start, period, reps = plan = layer_plan(config)
    if reps < 2:
        return layers
    end = start + period * reps
    body = [stack(layers[start + j:end:period]) for j in range(period)]
    return StackedLayers(head=list(layers[:start]), body=body, tail=list(layers[end:]),
                         plan=plan)


_MLP_KEYS = ("mlp", "block_sparse_moe")


def _mlp_apart(layer: dict) -> tuple[dict, dict]:
    """A layer dict as ``(everything but its MLP, its MLP)``."""
    return ({k: v for k, v in layer.items() if k not in _MLP_KEYS},
            {k: v for k, v in layer.items() if k in _MLP_KEYS})


def stack_layers(params: Params, config: KimiLinearConfig) -> Params:
    """``params`` with the layers that repeat stacked, so that ``forward`` runs them as one
    ``lax.scan`` and the step compiles each kind of layer there once: by ``layer_plan``'s
    repeated period (``StackedLayers``) or by ``group_plan``'s groups of KDA layers ending in
    an MLA layer (``GroupedLayers``) when they compile fewer layers and the period already
    loops over at least half of them (``compiled_layers``). Unchanged when nothing repeats or
    when already stacked.
    ``unstack_layers`` is the inverse; ``save_pretrained`` and ``to_checkpoint`` write the
    checkpoint layout either way.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> stacked = stack_layers(params, cfg)
    >>> layers = stacked["model"]["layers"]  # layer 0, then groups of 2, 3 and 3 KDA + 1 MLA
    >>> type(layers).__name__, layers.groups, layers.folded, len(layers.head), len(layers.tail)
    ('GroupedLayers', (2, 3, 3), 1, 0, 0)
    >>> layers.kda["self_attn"]["q_proj"]["weight"].shape  # layers 0, 1, 2, 4, 5, 6, 8, 9, 10
    (9, 64, 32)
    >>> back = unstack_layers(stacked)
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, params))
    True
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=6, num_experts=0, hidden_size=32,
    ...                             vocab_size=64, full_attention_layer_ids=(1, 3, 5))
    >>> stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"].plan
    (0, 2, 3)
    """
    layers = params["model"]["layers"]
    if isinstance(layers, STACKED):
        return params
    stacked = stack_layer_list(layers, config,
                               lambda items: jax.tree.map(lambda *xs: jnp.stack(xs), *items))
    if stacked is layers:
        return params
    return {**params, "model": {**params["model"], "layers": stacked}}


def unstack_layers(params: Params) -> Params:
    """The checkpoint layout (a list of layer dicts) of ``params``, stacked or not.

    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> layers = unstack_layers(stack_layers(params, cfg))["model"]["layers"]
    >>> len(layers), layers[2]["self_attn"]["q_proj"]["weight"].shape
    (4, (64, 32))
    >>> unstack_layers(params) is params  # not stacked: as it is
    True
    """
    layers = params["model"]["layers"]
    if isinstance(layers, GroupedLayers):
        F = layers.folded
        rest, mlps = _mlp_apart(layers.kda)

        def take(tree, i):
            return jax.tree.map(lambda x: x[i], tree)

        def kda(k):  # the k-th KDA layer of the loop
            return {**take(rest, k), **(take(layers.fold, k) if k < F else take(mlps, k - F))}

        run, k = [kda(k) for k in range(F)], F
        for g, count in enumerate(layers.groups):
            run += [kda(k + j) for j in range(count)]
            run.append(jax.tree.map(lambda x, g=g: x[g], layers.mla))
            k += count
        return {**params, "model": {**params["model"],
                                    "layers": [*run[:F], *layers.head, *run[F:],
                                               *layers.tail]}}
    if not isinstance(layers, StackedLayers):
        return params
    start, period, reps = layers.plan
    run = [jax.tree.map(lambda x, k=k: x[k], layers.body[j])
           for k in range(reps) for j in range(period)]
    return {**params, "model": {**params["model"],
                                "layers": [*layers.head, *run, *layers.tail]}}


def _map_experts(params: Params, fn: Callable[[Params], Params]) -> Params:
    """``params`` with ``fn`` applied to every MoE layer's ``experts`` dict (stacked or not)."""

    def layer(p):
        moe = p.get("block_sparse_moe")
        return p if moe is None else {**p, "block_sparse_moe": {**moe,
                                                                 "experts": fn(moe["experts"])}}

    return _map_layers(params, layer)


def _rename_transposed(experts: Params, old: str, new: str) -> Params:
    if old not in experts:
        return experts
    out = {k: v for k, v in experts.items() if k != old}
    out[new] = jnp.swapaxes(experts[old], -1, -2)
    return out


def _fuse_kda_in(p: Params) -> Params:
    """A KDA layer's ``self_attn`` with its input projections stacked into ``in_proj``."""
    attn = p.get("self_attn", {})  # ({}: a folded layer's MLP, stacked apart)
    if ("q_conv1d" not in attn or "in_proj" in attn
            or len({attn[n]["weight"].dtype for n in _KDA_IN_PROJ}) > 1):
        return p  # an MLA layer, laid out already, or weights of several dtypes (kept apart)
    w = jnp.concatenate([attn[n]["weight"] for n in _KDA_IN_PROJ], axis=-2)  # [.., out, D]
    attn = {k: v for k, v in attn.items() if k not in _KDA_IN_PROJ}
    return {**p, "self_attn": {**attn, "in_proj": {"weight": w}}}


def _split_kda_in(p: Params) -> Params:
    """The inverse of ``_fuse_kda_in``."""
    attn = p.get("self_attn", {})
    if "in_proj" not in attn:
        return p
    parts = jnp.split(attn["in_proj"]["weight"], np.cumsum(_kda_in_sizes(attn))[:-1], axis=-2)
    rest = {k: v for k, v in attn.items() if k != "in_proj"}
    return {**p, "self_attn": {**rest, **{n: {"weight": a}
                                          for n, a in zip(_KDA_IN_PROJ, parts, strict=True)}}}


def _map_layers(params: Params, fn: Callable[[Params], Params]) -> Params:
    """``params`` with ``fn`` applied to every layer's dict (stacked or not)."""
    layers = params["model"]["layers"]
    if isinstance(layers, StackedLayers):
        layers = layers.replace(head=[fn(p) for p in layers.head],
                                body=[fn(p) for p in layers.body],
                                tail=[fn(p) for p in layers.tail])
    elif isinstance(layers, GroupedLayers):
        layers = layers.replace(head=[fn(p) for p in layers.head], kda=fn(layers.kda),
                                mla=fn(layers.mla), tail=[fn(p) for p in layers.tail],
                                fold=None if layers.fold is None else fn(layers.fold))
    else:
        layers = [fn(p) for p in layers]
    return {**params, "model": {**params["model"], "layers": layers}}


def serving_layout(params: Params) -> Params:
    """``params`` laid out for the serving step: every MoE layer's routed down projections
    stored input-major, ``experts["w2"] [E, D, I]`` (the checkpoint's ``[D, I]`` per expert,
    stacked) becoming ``experts["w2_t"] [E, I, D]``, so that ``routed_experts`` multiplies by
    them as they lie: on CPU, every expert's down projection of a decode step is then one
    plain matrix product (the routed block 1.6x faster at 8 tokens than the products batched
    over experts and summed, ``bench.serve_config()``'s experts). And every KDA layer's six
    projections of its input (``q_proj``, ``k_proj``, ``v_proj``, ``f_a_proj``, ``g_a_proj``,
    ``b_proj``) stacked into one ``self_attn["in_proj"]``, so a step runs one product for
    them instead of six (at one request a decode step on XLA:CPU is mostly small products,
    each with its fixed cost). Stacked layers too; unchanged when already laid out.
    ``Engine`` does this on one device. ``forward``, ``apply``, ``to_checkpoint`` and
    ``save_pretrained`` take either layout; ``checkpoint_layout`` is the inverse.

    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64, moe_intermediate_size=16)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> experts = serving_layout(params)["model"]["layers"][1]["block_sparse_moe"]["experts"]
    >>> sorted(experts), experts["w2_t"].shape  # [E, I, D]; the checkpoint's w2 is [E, D, I]
    (['w1', 'w2_t', 'w3'], (4, 16, 32))
    >>> serving_layout(params)["model"]["layers"][0]["self_attn"]["in_proj"]["weight"].shape
    (228, 32)
    >>> back = checkpoint_layout(serving_layout(stack_layers(params, cfg)))
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, params))
    True
    """
    params = _map_experts(params, lambda e: _rename_transposed(e, "w2", "w2_t"))
    return _map_layers(params, _fuse_kda_in)


def checkpoint_layout(params: Params) -> Params:
    """``params`` in the layout of ``init_params`` and ``load``, the checkpoint's: layers
    unstacked (``unstack_layers``), the routed down projections ``w2 [E, D, I]`` and the KDA
    input projections apart (the inverse of ``serving_layout``); unchanged when already so.

    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64, moe_intermediate_size=16)
    >>> served = serving_layout(stack_layers(init_params(cfg, jax.random.key(0)), cfg))
    >>> layers = checkpoint_layout(served)["model"]["layers"]
    >>> len(layers), layers[1]["block_sparse_moe"]["experts"]["w2"].shape  # [E, D, I]
    (4, (4, 32, 16))
    """
    params = _map_layers(unstack_layers(params), _split_kda_in)
    return _map_experts(params, lambda e: _rename_transposed(e, "w2_t", "w2"))


def _stacked_forward(layers: StackedLayers, config: KimiLinearConfig, x, backend, batch, comm):
    """``forward``'s layers over stacked parameters: the head and tail layer by layer, the
    repeated run as one ``lax.scan`` whose body is one period. A layer at position ``j`` of
    repeat ``k`` reaches its pools through ``LayerRef(start + j, first[j] + k * per[j])``:
    its kind's pool index is the first repeat's plus ``k`` times that kind's count per
    period."""
    start, period, reps = layers.plan
    for i, p in enumerate(layers.head):
        x, batch = decoder_layer(p, config, i, x, backend, batch, comm)
    ids = range(start, start + period)
    kinds = [config.kda_layer_ids if config.is_kda_layer(i) else config.full_attention_layer_ids
             for i in ids]
    first = [kind.index(i) for kind, i in zip(kinds, ids, strict=True)]
    per = [sum(j in kind for j in ids) for kind in kinds]

    def one_period(carry, xs):
        x, batch = carry
        k, ps = xs
        for j, i in enumerate(ids):
            layer = LayerRef(i, first[j] + k * per[j])
            x, batch = decoder_layer(ps[j], config, layer, x, backend, batch, comm)
        return (x, batch), None

    (x, batch), _ = jax.lax.scan(one_period, (x, batch),
                                 (jnp.arange(reps, dtype=jnp.int32), list(layers.body)))
    for k, p in enumerate(layers.tail):
        x, batch = decoder_layer(p, config, start + period * reps + k, x, backend, batch, comm)
    return x, batch


def _grouped_forward(layers: GroupedLayers, config: KimiLinearConfig, x, backend, batch,
                     comm):
    """``forward``'s layers over ``GroupedLayers``: the head and tail layer by layer, the
    groups as one ``lax.scan`` whose body runs its group's KDA layers in a loop (their count
    a scanned value; the first group's loop runs the ``folded`` layers before it too) and
    then its MLA layer. The ``j``-th KDA layer of the loop reaches its pools through
    ``LayerRef(first KDA id, its KDA index)``, MLA layer ``g`` likewise. A folded layer's MLP
    is not the groups' kind: the loop picks it with a ``lax.cond`` on ``j``, each branch
    taking its own weights (only the branch that runs reads them)."""
    start, groups, F = layers.start, layers.groups, layers.folded
    for i, p in enumerate(layers.head):
        x, batch = decoder_layer(p, config, F + i, x, backend, batch, comm)
    end = start + sum(groups) + len(groups)
    kda_ids = [*range(F), *(i for i in range(start, end) if config.is_kda_layer(i))]
    mla_ids = [i for i in range(start, end) if not config.is_kda_layer(i)]
    kda0 = config.kda_layer_ids.index(kda_ids[0])
    mla0 = config.full_attention_layer_ids.index(mla_ids[0])
    rest, mlps = _mlp_apart(layers.kda)
    index = lambda tree, j: jax.tree.map(  # noqa: E731
        lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), tree)

    def kda_layer(j, carry):
        x, h, batch = _attend(index(rest, j), config, LayerRef(kda_ids[0], kda0 + j),
                              carry[0], backend, carry[1], comm)

        def mlp(tree, k, layer):
            return lambda h: _mlp(index(tree, k), config, layer, h, comm)

        if F:
            m = jax.lax.cond(j < F, mlp(layers.fold, j, 0), mlp(mlps, j - F, kda_ids[F]), h)
        else:
            m = mlp(mlps, j, kda_ids[0])(h)
        return x + m, batch

    def group(carry, xs):
        first, count, g, p = xs
        x, batch = jax.lax.fori_loop(first, first + count, kda_layer, carry)
        x, batch = decoder_layer(p, config, LayerRef(mla_ids[0], mla0 + g), x, backend, batch,
                                 comm)
        return (x, batch), None

    counts = np.asarray(groups, np.int32)
    counts[0] += F
    firsts = np.cumsum(counts, dtype=np.int32) - counts
    (x, batch), _ = jax.lax.scan(
        group, (x, batch), (jnp.asarray(firsts), jnp.asarray(counts),
                            jnp.arange(len(groups), dtype=jnp.int32), layers.mla))
    for k, p in enumerate(layers.tail):
        x, batch = decoder_layer(p, config, end + k, x, backend, batch, comm)
    return x, batch


def compute_logits(
    params: Params, config: KimiLinearConfig, hidden: Float[Array, "N D"]
) -> Float[Array, "N V"]:
    """Logits (float32) of final hidden states ``[N, D]``: ``lm_head``, or the embedding
    when ``tie_word_embeddings``.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> compute_logits(params, cfg, jnp.ones((3, 32), jnp.bfloat16)).dtype
    dtype('float32')
    >>> compute_logits(params, cfg, jnp.ones((3, 32))).shape  # [N, V]
    (3, 64)
    """
    head = (params["model"]["embed_tokens"] if config.tie_word_embeddings
            else params["lm_head"])["weight"]
    return hidden.astype(jnp.float32) @ head.T.astype(jnp.float32)


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
    _check_supported(config)
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


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------

# Parameters kept in float32 whatever the model's dtype (as init_params and mlx-lm keep them).
_F32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# transformers writes a dense layer's MLP under block_sparse_moe; the release under mlp.
_DENSE_ALIAS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)"
                          r"\.weight")
_MAX_PROBLEMS = 20


def _keeps_f32(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _F32_PARAMS


def check_params(params: Params, config: KimiLinearConfig) -> None:
    """Raise ``ValueError`` naming the first parameter whose path, shape or dtype kind does not
    match ``param_shapes(config)`` (every leaf a floating array, any float dtype). ``Engine``
    calls it, so params of another config never run silently.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> check_params(init_params(cfg, jax.random.key(0)), cfg)  # fits: returns None
    >>> check_params(init_params(cfg, jax.random.key(0)), dataclasses.replace(cfg, vocab_size=65))
    Traceback (most recent call last):
    ...
    ValueError: params do not match the config: lm_head.weight has shape (64, 32), the config \
needs (65, 32)
    """
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
    _check_supported(config)
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


def _expected_tensors(config: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of a checkpoint of ``config``, named as ``to_checkpoint``
    names them (run on zero-strided placeholders, so nothing is allocated)."""
    ghost = jax.tree.map(lambda x: np.broadcast_to(np.zeros((), np.float32), x.shape),
                         param_shapes(config))
    return {name: a.shape for name, a in to_checkpoint(ghost).items()}


def _accepted_shapes(name: str, want: tuple[int, ...],
                     config: KimiLinearConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes a checkpoint may store ``name`` in: the released one, plus the flat ``A_log
    [H]`` and the per-head ``dt_bias [H, Dk]`` of other writers (read as the released ones)."""
    leaf = name.rsplit(".", 1)[-1]
    H, Dk = config.linear_num_heads, config.linear_head_dim
    if leaf == "A_log":
        return want, (H,)
    if leaf == "dt_bias":
        return want, (H, Dk)
    return (want,)


def _canonical_names(names, config: KimiLinearConfig) -> dict[str, str]:
    """``{released name: name in the file}``: a dense layer's MLP may be stored under
    ``block_sparse_moe.`` (transformers) instead of ``mlp.`` (the release). A tied
    ``lm_head.weight`` is dropped."""
    out: dict[str, str] = {}
    for name in names:
        canon = name
        m = _DENSE_ALIAS.fullmatch(name)
        if m and int(m[1]) < config.num_hidden_layers and not config.is_moe_layer(int(m[1])):
            canon = f"model.layers.{m[1]}.mlp.{m[2]}.weight"
        if canon == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if canon in out:
            raise ValueError(f"tensors {out[canon]!r} and {name!r} are both {canon!r}")
        out[canon] = name
    return out


def _check_tensors(found: Mapping[str, tuple[tuple[int, ...], bool]], names: Mapping[str, str],
                   config: KimiLinearConfig, source: str) -> None:
    """Check ``found`` (``{released name: (shape, is floating)}``) against the tensors a
    checkpoint of ``config`` holds; one ValueError lists every missing, unexpected,
    wrong-shape or non-floating tensor (by its name in the file, ``names``)."""
    expected = _expected_tensors(config)
    problems = []
    for name, want in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name!r} (expected shape {want})")
            continue
        shape, floating = found[name]
        if shape not in _accepted_shapes(name, want, config):
            problems.append(f"tensor {names[name]!r} has shape {shape}, expected {want}")
        elif not floating:
            problems.append(f"tensor {names[name]!r} (shape {shape}) is not floating point")
    for name in found.keys() - expected.keys():
        problems.append(f"unexpected tensor {names[name]!r} of shape {found[name][0]}")
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        raise ValueError(
            f"{source} does not match the config ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:_MAX_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _float_dtype(dtype, what: str):
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{what} must be a floating dtype, got {dtype!r}")
    return np.dtype(dtype)


def _unflatten(node, prefix: str, fetch: Callable[[str], np.ndarray]):
    """Rebuild the ``node`` subtree of ``param_shapes`` from checkpoint tensors (the
    inverse of ``to_checkpoint``'s walk; routed experts re-stacked)."""
    if isinstance(node, dict):
        if prefix.endswith("block_sparse_moe.experts"):
            return {name: np.stack([fetch(f"{prefix}.{e}.{name}.weight")
                                    for e in range(spec.shape[0])])
                    for name, spec in node.items()}
        return {key: _unflatten(child, f"{prefix}.{key}" if prefix else key, fetch)
                for key, child in node.items()}
    if isinstance(node, list):
        return [_unflatten(child, f"{prefix}.{i}", fetch) for i, child in enumerate(node)]
    return fetch(prefix)


def _assemble(get: Callable[[str], np.ndarray], found, names, config: KimiLinearConfig,
              dtype, source: str, progress: bool = False, shardings=None) -> Params:
    """Check the tensors ``found`` and read them (``get(name in the file)``) into params,
    each placed with its ``shardings`` leaf when given (host -> its devices' shards);
    ``progress``: a bar of the tensors read."""
    dt = _float_dtype(dtype, "dtype")
    _check_tensors(found, names, config, source)
    expected = _expected_tensors(config)
    bar = progress_bar(total=len(expected), unit="tensor", desc=f"reading {source}",
                       enabled=progress, leave=False)

    def fetch(name):
        a = np.asarray(get(names[name])).reshape(expected[name])
        bar.update(1)
        return a.astype(np.float32 if _keeps_f32(name) else dt, copy=False)

    with bar:
        host = _unflatten(param_shapes(config), "", fetch)
    if shardings is None:
        return jax.tree.map(jnp.asarray, host)
    return jax.tree.map(jax.device_put, host, shardings)


def from_checkpoint(tensors: Mapping[str, np.ndarray | Array], config: KimiLinearConfig,
                    dtype=jnp.float32) -> Params:
    """Parameters in the ``init_params`` layout from a flat ``{tensor name: array}`` in
    the released naming (the inverse of ``to_checkpoint``).

    Routed experts are re-stacked; floating tensors are cast to ``dtype`` except ``A_log``,
    ``dt_bias`` and ``e_score_correction_bias`` (float32). A dense layer's MLP may be named
    ``block_sparse_moe.{gate,up,down}_proj`` (as transformers writes it); ``lm_head.weight``
    is ignored when ``tie_word_embeddings``. Missing, unexpected or wrong-shape tensors raise
    one ValueError naming each.

    >>> cfg = KimiLinearConfig.tiny()
    >>> p = init_params(cfg, jax.random.key(0))
    >>> q = from_checkpoint(to_checkpoint(p), cfg)
    >>> all(jax.tree.leaves(jax.tree.map(np.array_equal, p, q)))
    True
    """
    names = _canonical_names(tensors, config)
    found = {c: (tuple(np.shape(tensors[n])),
                 bool(jnp.issubdtype(tensors[n].dtype, jnp.floating)))
             for c, n in names.items()}
    return _assemble(tensors.__getitem__, found, names, config, dtype, "checkpoint")


def _weight_files(path: str) -> tuple[dict[str, str] | None, str]:
    """``(weight_map, source)``: the index's ``{tensor name: shard file}`` and the index's
    path, or ``(None, path of model.safetensors)`` for a single-file checkpoint."""
    index = os.path.join(path, _INDEX_FILE)
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' of tensor names to files")
        return weight_map, index
    if os.path.isfile(single):
        return None, single
    raise FileNotFoundError(f"checkpoint directory {path!r} has neither {_SINGLE_FILE} nor "
                            f"{_INDEX_FILE}")


def load(path: str | os.PathLike[str], dtype=jnp.float32, *, mesh=None,
         progress: bool = False) -> tuple[KimiLinearConfig, Params]:
    """Read a Hugging Face checkpoint directory: ``(config, params)``.

    ``path`` holds ``config.json`` and ``model.safetensors`` or shards listed by
    ``model.safetensors.index.json``. Every tensor's name and shape is checked against the
    config before any is read (see ``from_checkpoint`` for the naming, dtypes and
    errors). Params come out in the ``init_params`` layout, floating tensors in ``dtype``
    but for the float32 ``A_log``, ``dt_bias`` and ``e_score_correction_bias``. With a
    ``(data, tensor)`` ``mesh`` each tensor goes from the file straight to its shards on
    the mesh (``hybridattn.sharding.param_shardings``), never whole onto one device.
    ``progress`` shows the tensors read as a tqdm bar on stderr when it is a terminal. The
    directory's tokenizer, if it ships one, is ``load_tokenizer``'s.

    A round trip through ``save_pretrained``:

    >>> import tempfile
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(params, cfg, path)
    ...     config, loaded = load(path, dtype=jnp.bfloat16)
    >>> config == cfg
    True
    >>> attn = loaded["model"]["layers"][0]["self_attn"]
    >>> attn["q_proj"]["weight"].dtype, attn["A_log"].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"checkpoint directory {path!r} has no config.json")
    config = KimiLinearConfig.from_pretrained(path)
    weight_map, source = _weight_files(path)
    with contextlib.ExitStack() as stack:
        files = sorted(set(weight_map.values())) if weight_map else [_SINGLE_FILE]
        handles = {}
        for f in files:
            file_path = os.path.join(path, f)
            if not os.path.isfile(file_path):
                raise FileNotFoundError(f"{file_path} (listed in {source}) does not exist")
            handles[f] = stack.enter_context(safe_open(file_path, framework="np"))
        where: dict[str, str] = {}
        for f, h in handles.items():
            for name in h.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} is in both {where[name]} and {f}")
                where[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if name not in where:
                    raise ValueError(f"{source} lists tensor {name!r} in {f}, which does not "
                                     f"hold it")
                if where[name] != f:
                    raise ValueError(f"{source} lists tensor {name!r} in {f}, but it is in "
                                     f"{where[name]}")
            unlisted = sorted(where.keys() - weight_map.keys())
            if unlisted:
                raise ValueError(f"tensor {unlisted[0]!r} of {where[unlisted[0]]} is not in "
                                 f"{source}")
        names = _canonical_names(where, config)
        found = {}
        for c, n in names.items():
            sl = handles[where[n]].get_slice(n)
            dt = sl.get_dtype()
            found[c] = (tuple(sl.get_shape()), dt.startswith("F") or dt == "BF16")
        shardings = None
        if mesh is not None:
            from hybridattn.sharding import param_shardings
            shardings = param_shardings(config, mesh, dtype)
        params = _assemble(lambda n: handles[where[n]].get_tensor(n), found, names, config,
                           dtype, path, progress, shardings)
    return config, params


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False):
    """The tokenizer a checkpoint directory ships, or ``None`` when it has none (serve token
    ids then): transformers' ``AutoTokenizer`` on the local files
    (``servecore.prompts.load_tokenizer``). Give it to ``hybridattn.Engine(...,
    tokenizer=...)`` for text and chat prompts.

    The released Kimi-Linear's tokenizer is code that ships with the checkpoint
    (``tokenization_kimi.py``, on ``tiktoken``): it loads only with ``trust_remote_code=True``
    (a ``ValueError`` says so otherwise) and ``pip install tiktoken`` (an ``ImportError``
    names it otherwise).

    >>> import tempfile
    >>> from servecore.testing import save_word_tokenizer
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(init_params(cfg, jax.random.key(0)), cfg, path)
    ...     ids_only = load_tokenizer(path)      # config.json and weights: no tokenizer
    ...     save_word_tokenizer(path, 64)        # tokenizer.json, tokenizer_config.json
    ...     tok = load_tokenizer(path)
    >>> ids_only is None, tok.encode("w6 w7"), tok.eos_token_id
    (True, [6, 7], 1)
    """
    return _load_tokenizer(path, trust_remote_code=trust_remote_code)


def save_pretrained(params: Params, config: KimiLinearConfig, path: str | os.PathLike[str], *,
                    dtype=None, max_shard_bytes: int | None = None) -> None:
    """Write ``params`` as a Hugging Face checkpoint directory readable by ``load``,
    mlx-lm and transformers: ``config.json`` plus ``model.safetensors``, or, when the tensors
    exceed ``max_shard_bytes``, shards ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``.

    Tensor names are ``to_checkpoint``'s (the release's). ``dtype`` (e.g.
    ``jnp.bfloat16``) casts every tensor but ``A_log``, ``dt_bias`` and
    ``e_score_correction_bias``, which are written float32; ``None`` writes each as it is.
    ``params`` are checked against ``config`` first. A previous checkpoint's weight files in
    ``path`` are removed.

    >>> import tempfile
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(params, cfg, path, max_shard_bytes=150_000)
    ...     files = sorted(os.listdir(path))
    ...     _, loaded = load(path)
    >>> files
    ['config.json', 'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors',
     'model.safetensors.index.json']
    >>> all(jax.tree.leaves(jax.tree.map(np.array_equal, params, loaded)))
    True
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    dt = None if dtype is None else _float_dtype(dtype, "dtype")
    flat = to_checkpoint(params)
    found = {n: (a.shape, bool(jnp.issubdtype(a.dtype, jnp.floating))) for n, a in flat.items()}
    _check_tensors(found, {n: n for n in flat}, config, "params")

    def cast(name, a):
        if dt is not None:
            a = a.astype(np.float32 if _keeps_f32(name) else dt)
        return np.ascontiguousarray(a)

    tensors = {name: cast(name, a) for name, a in flat.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and max_shard_bytes is not None and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f in (_SINGLE_FILE, _INDEX_FILE) or _SHARD_FILE.fullmatch(f):
            os.remove(os.path.join(path, f))
    config.save_pretrained(path)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE_FILE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, f), metadata=meta)
        weight_map.update(dict.fromkeys(shard, f))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    with open(os.path.join(path, _INDEX_FILE), "w") as fh:
        json.dump(index, fh, indent=2)
        fh.write("\n")


__all__ = [
    "STACKED", "GroupedLayers", "StackedLayers", "apply", "check_params", "checkpoint_layout",
    "compiled_layers", "compute_logits", "dense_mlp", "decoder_layer",
    "folded_layers", "forward", "from_checkpoint", "group_plan",
    "init_params", "kda_attention", "layer_plan", "load", "load_tokenizer", "mla_attention",
    "mla_split", "param_shapes",
    "rms_norm", "route", "routed_experts", "save_pretrained", "serving_layout", "sparse_moe",
    "stack_layer_list", "stack_layers", "to_checkpoint", "unstack_layers",
]
