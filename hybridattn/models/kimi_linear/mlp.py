"""The MLPs: the dense SwiGLU MLP and the routed mixture of experts (router, blocked and
pairwise expert evaluation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.primitives import Params, _linear

__all__ = [
    "dense_mlp",
    "route",
    "routed_experts",
    "sparse_moe",
]

# --------------------------------------------------------------------------------------------
# MLPs
# --------------------------------------------------------------------------------------------


def dense_mlp(p: Params, x: Float[Array, "N D"], comm=None) -> Float[Array, "N D"]:
    """The SwiGLU MLP of dense layers and shared experts:
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    >>> from hybridattn.models.kimi_linear import init_params
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

    >>> from hybridattn.models.kimi_linear import init_params
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


MAX_PAIRS = 32  # token-expert pairs up to which the CPU path takes them one at a time


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

    >>> from hybridattn.models.kimi_linear import init_params
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

    >>> from hybridattn.models.kimi_linear import init_params
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
    if jax.default_backend() == "cpu" and N * k <= min(E, MAX_PAIRS):
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
