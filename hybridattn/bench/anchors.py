"""Independent anchors for the serving benchmark: other implementations of Kimi-Linear serving
on the same weights, and this machine's memory-bandwidth floor for a decode step.

- :func:`mlx_lm_serve`: mlx-lm's ``kimi_linear.Model`` (our weights, f32) serving ``B``
  same-length prompts with its own batched cache: one prefill forward, then greedy decode.
- :func:`transformers_serve`: transformers' ``KimiLinearForCausalLM`` (torch, f32, CPU) loading
  our checkpoint from disk and timing ``generate``; needs the ``bench`` extra (``torch``) and
  reports why it did not run otherwise.
- :func:`memory_bandwidth_gbs` and :func:`decode_bytes_per_step`: the least time a decode step
  can take, ``bytes / bandwidth``; :func:`peak_gflops` and :func:`decode_flops_per_step`: the
  least time its arithmetic takes, ``flops / peak``. The larger of the two is the step's
  roofline.
- :func:`products_step_seconds`: what this backend makes of that arithmetic: the matrix
  products of one step alone, timed. No step that runs them is faster here, whatever the rest
  of it does; on a CPU, skinny products run far below the peak of a large one.

Token convention (both serving anchors, as ``generate(max_new_tokens=N)``): ``new_tokens``
tokens are generated per request; the first comes from the prefill's last logits, the other
``new_tokens - 1`` from timed ``[B, 1]`` decode steps. ``tokens[b]`` lists request ``b``'s
generated tokens (the prompt excluded).

mlx and mlx-lm (the ``mlx`` extra) and torch / transformers are imported inside the functions
that need them, so importing this module needs neither.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M
from hybridattn.models.kimi_linear.mlp import MAX_PAIRS
from servecore.validate import check_int

__all__ = [
    "decode_bytes_per_step", "decode_flops_per_step", "memory_bandwidth_gbs", "mlx_lm_model",
    "mlx_lm_serve", "peak_gflops", "products_step", "products_step_seconds",
    "transformers_model", "transformers_serve", "transformers_unavailable",
]


# -------------------------------------------------------------------------------------------
# prompts
# -------------------------------------------------------------------------------------------


def _prompts(config: KimiLinearConfig, batch_size: int, prompt_len: int, seed: int,
             prompts: Sequence[Sequence[int]] | None) -> np.ndarray:
    """``[B, P]`` int32 prompt ids: the given ``prompts`` (all one length) or random ids in
    ``1..vocab_size-1`` drawn from ``seed``."""
    if prompts is None:
        if batch_size < 1 or prompt_len < 1:
            raise ValueError(f"batch_size and prompt_len must be positive, got {batch_size}, "
                             f"{prompt_len}")
        rng = np.random.default_rng(seed)
        return rng.integers(1, config.vocab_size, (batch_size, prompt_len)).astype(np.int32)
    lens = {len(p) for p in prompts}
    if len(prompts) == 0 or len(lens) != 1 or 0 in lens:
        raise ValueError(f"prompts: expected a non-empty list of non-empty prompts of one "
                         f"length, got lengths {sorted(lens)}")
    ids = np.asarray(prompts, np.int64)
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"prompts: token ids must be in 0..{config.vocab_size - 1}")
    return ids.astype(np.int32)


def _summary(B: int, P: int, new_tokens: int, prefill_s: float,
             decode_steps_s: list[float] | None) -> dict[str, Any]:
    steps = new_tokens - 1
    out: dict[str, Any] = dict(batch_size=B, prompt_len=P, new_tokens=new_tokens,
                               decode_steps=steps, prefill_s=prefill_s,
                               prefill_tok_s=B * P / prefill_s)
    if steps and decode_steps_s:
        step = sum(decode_steps_s) / steps
        out.update(decode_s=sum(decode_steps_s), decode_step_s=step,
                   decode_step_median_s=statistics.median(decode_steps_s),
                   decode_tok_s=B / step)
    else:
        out.update(decode_s=0.0, decode_step_s=None, decode_step_median_s=None,
                   decode_tok_s=None)
    return out


# -------------------------------------------------------------------------------------------
# mlx-lm
# -------------------------------------------------------------------------------------------


def mlx_lm_model(config: KimiLinearConfig, params: M.Params):
    """mlx-lm's ``kimi_linear.Model`` holding ``params`` in f32, loaded through its own
    ``sanitize`` from our released-checkpoint naming (strict: every tensor must match)."""
    import mlx.core as mx
    from mlx_lm.models import kimi_linear

    model = kimi_linear.Model(kimi_linear.ModelArgs.from_dict(config.to_dict()))
    weights = {k: mx.array(np.asarray(v, np.float32))
               for k, v in M.to_checkpoint(params).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def _mlx_generate(model, ids: np.ndarray, new_tokens: int):
    """One greedy run of ``model`` on ``ids [B, P]`` with a fresh batched cache:
    ``(tokens [B, new_tokens], prefill_s, [decode step s])``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array(ids)
    t0 = time.perf_counter()
    tok = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(tok)
    prefill_s = time.perf_counter() - t0
    out, steps = [tok], []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        tok = mx.argmax(model(tok[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(tok)
        steps.append(time.perf_counter() - t0)
        out.append(tok)
    tokens = np.stack([np.array(t) for t in out], axis=1)
    return tokens, prefill_s, steps


def mlx_lm_serve(config: KimiLinearConfig, params: M.Params, *, batch_size: int = 1,
                 prompt_len: int = 64, new_tokens: int = 16, seed: int = 0, repeats: int = 1,
                 prompts: Sequence[Sequence[int]] | None = None, model=None,
                 warmup: bool = True) -> dict[str, Any]:
    """Time mlx-lm's Kimi-Linear serving ``B`` same-length prompts with its own batched cache.

    Prefill: one forward over ``[B, P]`` with a fresh ``make_prompt_cache(model)`` (evaluated,
    timed, the first token taken greedily from its last logits); then ``new_tokens - 1`` greedy
    decode steps of ``[B, 1]``, each evaluated and timed. An untimed warm-up at the same batch
    size (a prefill of the prompts' first ``min(P, 8)`` tokens and two decode steps) comes
    first, so that MLX's lazy set-up and ``mx.compile`` traces are excluded (a full-shape
    warm-up measured no faster, and at ``B=32`` it would cost as much as the prefill). With
    ``repeats > 1`` the best prefill and the best decode total over the repeats are reported.

    ``prompts`` (a list of ``B`` token-id lists of one length) replaces the random prompts
    (``batch_size`` / ``prompt_len`` are then taken from it); ``model`` reuses a model from
    :func:`mlx_lm_model` (``params`` is then unused).

    Returns ``{"engine": "mlx-lm", "batch_size", "prompt_len", "new_tokens", "decode_steps",
    "prefill_s", "prefill_tok_s" (B*P / prefill_s), "decode_s" (all steps), "decode_step_s"
    (mean), "decode_step_median_s", "decode_tok_s" (B / decode_step_s), "tokens" (B lists of
    new_tokens generated ids), "prompts" (the B prompts), "warmup_s", "load_s"}``; the decode
    entries are ``None`` when ``new_tokens == 1``.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ids = _prompts(config, batch_size, prompt_len, seed, prompts)
    B, P = ids.shape
    t0 = time.perf_counter()
    if model is None:
        model = mlx_lm_model(config, params)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if warmup:
        _mlx_generate(model, ids[:, :8], 3)
    warmup_s = time.perf_counter() - t0
    best_prefill, best_steps, tokens = math.inf, None, None
    for _ in range(repeats):
        toks, prefill_s, steps = _mlx_generate(model, ids, new_tokens)
        if tokens is not None and not np.array_equal(toks, tokens):
            raise RuntimeError("mlx-lm: greedy tokens differ between repeats")
        tokens = toks
        best_prefill = min(best_prefill, prefill_s)
        if best_steps is None or sum(steps) < sum(best_steps):
            best_steps = steps
    out = {"engine": "mlx-lm", **_summary(B, P, new_tokens, best_prefill, best_steps)}
    out.update(tokens=tokens.tolist(), prompts=ids.tolist(), warmup_s=warmup_s, load_s=load_s)
    return out


# -------------------------------------------------------------------------------------------
# transformers
# -------------------------------------------------------------------------------------------


def transformers_unavailable() -> str | None:
    """Why :func:`transformers_serve` cannot run here (``None`` when it can)."""
    for mod, hint in (("torch", "torch not installed (pip install -e '.[bench]')"),
                      ("transformers", "transformers not installed (pip install -e '.[bench]')")):
        if importlib.util.find_spec(mod) is None:
            return hint
    try:
        from transformers import KimiLinearForCausalLM  # noqa: F401
    except ImportError as e:  # an older transformers without Kimi-Linear
        return f"transformers has no KimiLinearForCausalLM ({e})"
    return None


def transformers_model(config: KimiLinearConfig, params: M.Params):
    """transformers' ``KimiLinearForCausalLM`` (f32, CPU, eager attention) loaded by
    ``from_pretrained`` from a temporary directory holding ``config.to_dict()`` and our
    checkpoint in the released naming: transformers' own conversion mapping renames it
    (``block_sparse_moe.`` -> ``mlp.``, experts merged into ``gate_up_proj`` / ``down_proj``,
    ``q/k/v_conv1d`` concatenated into ``conv1d``, ``f_a/f_b_proj``, ``A_log``, ``dt_bias``
    into ``forget_gate``). Raises if any tensor is missing, unexpected or mismatched."""
    import torch
    from safetensors.numpy import save_file
    from transformers import KimiLinearForCausalLM

    ckpt = {k: np.ascontiguousarray(np.asarray(v, np.float32))
            for k, v in M.to_checkpoint(params).items()}
    with tempfile.TemporaryDirectory(prefix="hybridattn-hf-") as d:
        config.save_pretrained(d)
        save_file(ckpt, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        model, info = KimiLinearForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"transformers: checkpoint did not load cleanly: {info}")
    model.eval()
    return model


def transformers_serve(config: KimiLinearConfig, params: M.Params, *, batch_size: int = 1,
                       prompt_len: int = 64, new_tokens: int = 16, seed: int = 0,
                       repeats: int = 1, prompts: Sequence[Sequence[int]] | None = None,
                       num_threads: int | None = None, model=None) -> dict[str, Any]:
    """Time transformers' ``KimiLinearForCausalLM`` (torch, f32, CPU) on the same prompts.

    Greedy ``generate`` on ``[B, P]`` (no padding): the prefill time is that of
    ``generate(max_new_tokens=1)``; the decode step time is
    ``(t(generate(max_new_tokens=new_tokens)) - t(prefill)) / (new_tokens - 1)``. Both are
    best of ``repeats`` rounds (each runs both) after an untimed warm-up. ``model`` reuses a
    model from :func:`transformers_model`; ``num_threads`` sets torch's thread count.

    Returns ``{"skipped": reason}`` when it cannot run (see :func:`transformers_unavailable`),
    otherwise ``{"skipped": None, "engine": "transformers", ...}`` with the keys of
    :func:`mlx_lm_serve` (``decode_step_median_s`` is ``None``: ``generate`` is timed whole).
    """
    reason = transformers_unavailable()
    if reason is not None:
        return {"skipped": reason}
    import torch

    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    ids = _prompts(config, batch_size, prompt_len, seed, prompts)
    B, P = ids.shape
    t0 = time.perf_counter()
    if model is None:
        model = transformers_model(config, params)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    load_s = time.perf_counter() - t0
    x = torch.from_numpy(ids.astype(np.int64))
    mask = torch.ones_like(x)

    def gen(n: int):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 use_cache=True)
        return out[:, P:].numpy(), time.perf_counter() - t0

    t0 = time.perf_counter()
    gen(min(new_tokens, 3))
    warmup_s = time.perf_counter() - t0
    # Interleaved rounds, so that a noisy neighbour slows both alike; best of each.
    prefill_s = total_s = math.inf
    for _ in range(repeats):
        prefill_s = min(prefill_s, gen(1)[1])
        tokens, t = gen(new_tokens)
        total_s = min(total_s, t)
    steps = None
    if new_tokens > 1 and total_s > prefill_s:
        steps = [(total_s - prefill_s) / (new_tokens - 1)] * (new_tokens - 1)
    out = {"skipped": None, "engine": "transformers",
           **_summary(B, P, new_tokens, prefill_s, steps)}
    out.update(decode_step_median_s=None, tokens=tokens.tolist(), prompts=ids.tolist(),
               warmup_s=warmup_s, load_s=load_s, torch=torch.__version__,
               threads=torch.get_num_threads())
    return out


# -------------------------------------------------------------------------------------------
# the bandwidth floor of a decode step
# -------------------------------------------------------------------------------------------


def memory_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """This machine's measured read bandwidth in GB/s (1e9 bytes): the best over ``repeats``
    of a jitted JAX sum and a NumPy sum over an ``nbytes`` f32 array (far larger than the
    caches), after a warm-up of each."""
    n = max(nbytes // 4, 1)
    host = np.ones(n, np.float32)
    dev = jnp.ones((n,), jnp.float32)
    jsum = jax.jit(jnp.sum)
    runs = (lambda: jsum(dev).block_until_ready(), lambda: host.sum())
    best = math.inf
    for run in runs:
        run()
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return 4 * n / best / 1e9


def _projection_sizes(c: KimiLinearConfig) -> tuple[int, int, int]:
    """Weights in the products of a KDA layer's attention (q, k, v, f, g, b in; o out), of an
    MLA layer's (q, kv_a, kv_b, o) and of one routed or shared expert (w1, w2, w3)."""
    D, H, Dk = c.hidden_size, c.linear_num_heads, c.linear_head_dim
    HD = H * Dk
    kda = 3 * D * HD + 2 * (D * Dk + Dk * HD) + D * H + HD * D
    Hm, r, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    mla = (D * Hm * c.q_head_dim + D * (r + dr)
           + Hm * (c.qk_nope_head_dim + c.v_head_dim) * r + Hm * c.v_head_dim * D)
    return kda, mla, 3 * D * c.moe_intermediate_size


def decode_bytes_per_step(config: KimiLinearConfig, batch_size: int, context_len: int,
                          dtype_bytes: int = 4) -> dict[str, int]:
    """The least bytes one decode step of ``batch_size`` requests, each with ``context_len``
    tokens of context, must move (weights and caches in ``dtype_bytes``; the KDA state in f32).

    - ``embedding``: the ``B`` embedding rows looked up (0 with tied embeddings: the head
      reads the whole matrix anyway);
    - ``lm_head``: the whole output head;
    - ``layer_weights``: every other weight outside the routed experts (attention, norms,
      dense MLPs, routers and their bias, shared experts, the final norm);
    - ``routed_experts``: ``min(E, B * top_k)`` experts (``w1``, ``w2``, ``w3``) per MoE layer;
    - ``kda_state``: per request and KDA layer the conv state (``K - 1`` positions of q, k, v)
      and the recurrent state ``S [H, Dk, Dv]`` (f32), each read and written;
    - ``mla_cache``: per request and MLA layer, ``kv_lora_rank + qk_rope_head_dim`` latent
      values per token of context, read;
    - ``weights`` (the sum of the first four), ``state`` (of the last two), ``total``.
    """
    c, b = config, dtype_bytes
    B = batch_size
    D, V = c.hidden_size, c.vocab_size
    H, Dk, K = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    HD = H * Dk
    r, dr = c.kv_lora_rank, c.qk_rope_head_dim
    kda_proj, mla_proj, expert = _projection_sizes(c)
    kda_attn = kda_proj + 3 * HD * K + H + HD + Dk  # + convs, A_log, dt_bias, the norm
    mla_attn = mla_proj + r  # + kv_a_layernorm
    layer_weights, routed = D, 0  # the final norm
    for i in range(c.num_hidden_layers):
        layer_weights += 2 * D + (kda_attn if c.is_kda_layer(i) else mla_attn)
        if c.is_moe_layer(i):
            E = c.num_experts
            layer_weights += E * D + E + c.num_shared_experts * expert
            routed += min(E, B * c.num_experts_per_token) * expert
        else:
            layer_weights += 3 * D * c.intermediate_size
    out = {
        "embedding": 0 if c.tie_word_embeddings else min(B, V) * D * b,
        "lm_head": V * D * b,
        "layer_weights": layer_weights * b,
        "routed_experts": routed * b,
        "kda_state": 2 * B * c.num_kda_layers * ((K - 1) * 3 * HD * b + H * Dk * Dk * 4),
        "mla_cache": B * c.num_mla_layers * (r + dr) * context_len * b,
    }
    out["weights"] = (out["embedding"] + out["lm_head"] + out["layer_weights"]
                      + out["routed_experts"])
    out["state"] = out["kda_state"] + out["mla_cache"]
    out["total"] = out["weights"] + out["state"]
    return out


# -------------------------------------------------------------------------------------------
# the compute floor of a decode step
# -------------------------------------------------------------------------------------------


def peak_gflops(n: int = 2048, repeats: int = 7) -> float:
    """This machine's measured f32 matrix-product rate in GFLOP/s: the best over ``repeats``
    of a jitted ``[n, n] @ [n, n]`` (``2 n^3`` flops), after a warm-up. A step's products
    are far smaller and run well below it, so ``flops / peak_gflops()`` is a floor."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def decode_flops_per_step(config: KimiLinearConfig, batch_size: int, context_len: int
                          ) -> dict[str, int]:
    """The least floating-point operations (a multiply-add is two) of one decode step of
    ``batch_size`` requests, each with ``context_len`` tokens of context: the products no
    exact implementation can skip. Norms, activations, the softmax and the sampler are left
    out (a few per value, against ``2 D`` per weight row).

    - ``lm_head``: the output head's product;
    - ``projections``: every other weight matrix a token passes through (attention in and
      out, the MLA absorption of ``kv_b_proj``, dense MLPs, routers, shared experts);
    - ``routed_experts``: ``top_k`` experts per token and MoE layer;
    - ``kda``: per KDA layer the short convolutions (``K`` taps over q, k, v) and the delta
      rule on ``S [H, Dk, Dv]``: decay, ``k^T S``, the rank-one update and ``q^T S``
      (``7 Dk Dv`` per head);
    - ``mla_attention``: per MLA layer and head, the absorbed scores over the context
      (``r + dr`` per token) and the latent values (``r`` per token);
    - ``total``.
    """
    c, B = config, batch_size
    D, V = c.hidden_size, c.vocab_size
    H, Dk, K = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    HD = H * Dk
    Hm, r, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    kda_proj, mla_proj, expert = _projection_sizes(c)
    proj = routed = kda = mla = 0  # multiply-adds per token
    for i in range(c.num_hidden_layers):
        if c.is_kda_layer(i):
            proj += kda_proj
            kda += 3 * HD * K + 7 * H * Dk * Dk
        else:
            proj += mla_proj
            mla += Hm * context_len * (2 * r + dr)
        if c.is_moe_layer(i):
            proj += c.num_experts * D + c.num_shared_experts * expert
            routed += c.num_experts_per_token * expert
        else:
            proj += 3 * D * c.intermediate_size
    out = {"lm_head": 2 * B * D * V, "projections": 2 * B * proj,
           "routed_experts": 2 * B * routed, "kda": 2 * B * kda, "mla_attention": 2 * B * mla}
    out["total"] = sum(out.values())
    return out


def products_step(config: KimiLinearConfig, rows: int, seed: int = 0):
    """``(fn, args)``: a jitted function and its arguments that run the weight products of
    one step of ``rows`` tokens through ``config``'s layers and output head, and nothing
    else. Timing it (:func:`products_step_seconds`) bounds a step that runs the same products
    from below, on this backend:

    - weights ``[in, out]``, as ``x @ w`` multiplies them (alone, at 1-8 rows, 10-25% faster
      than the checkpoint's ``[out, in]`` that the step multiplies transposed);
    - a KDA layer's six input projections as one product (``serving_layout``'s ``in_proj``),
      then the low-rank ``f_b``, ``g_b`` and ``o_proj``; an MLA layer's ``q_proj``,
      ``kv_a_proj``, the absorbed ``W_kc`` / ``W_vc`` per head and ``o_proj``;
    - gate, up and down projections apart, as the step runs them (dense MLP, shared experts);
    - the routed experts as the CPU step takes them (``kimi_linear.routed_experts``): with
      few token-expert pairs (``rows * top_k <= num_experts``) each pair's expert alone (the
      pairs on distinct experts, as many as there are), else every expert on every row, as
      two ``[rows, D] x [D, E I]`` products and one ``[rows, E I] x [E I, D]``; and the router;
    - the output head.

    The layers chain through the residual with only an activation and a product between two
    projections: no norm, convolution, recurrence, attention over the context, pool traffic
    or sampling. The weights are scaled so that the activations stay finite.

    >>> fn, args = products_step(KimiLinearConfig.tiny(), rows=2)
    >>> logits = fn(*args)
    >>> logits.shape, bool(np.isfinite(logits).all())
    ((2, 256), True)
    """
    rows = check_int("rows", rows, 1)
    c = config
    pairwise = rows * c.num_experts_per_token <= min(c.num_experts, MAX_PAIRS)
    rng = np.random.default_rng(seed)
    layers, head = _products_weights(c, rng, pairwise)
    x = jnp.asarray(rng.standard_normal((rows, c.hidden_size), np.float32))
    return jax.jit(_products_chain(c, pairwise)), (x, layers, head)


def _products_weights(c: KimiLinearConfig, rng, pairwise: bool) -> tuple[list[dict], Any]:
    """:func:`products_step`'s weights, ``[in, out]``, drawn from ``rng``: per layer its
    attention (KDA or MLA) projections and its MLP or experts (one block per expert when
    ``pairwise``, else every expert side by side); and the output head."""
    D, H, Dk = c.hidden_size, c.linear_num_heads, c.linear_head_dim
    HD = H * Dk
    Hm, r, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dn, dv = c.qk_nope_head_dim, c.v_head_dim
    E, I_e = c.num_experts, c.moe_intermediate_size
    I_s = c.num_shared_experts * I_e

    def w(*shape):  # small enough that the residual stream stays finite through the layers
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.2 * shape[-2] ** -0.5)

    def mlp(inter):
        return dict(gate=w(D, inter), up=w(D, inter), down=w(inter, D))

    layers = []
    for i in range(c.num_hidden_layers):
        if c.is_kda_layer(i):
            L = dict(in_proj=w(D, 3 * HD + 2 * Dk + H), f_b=w(Dk, HD), g_b=w(Dk, HD),
                     o=w(HD, D))
        else:
            L = dict(q=w(D, Hm * (dn + dr)), kv_a=w(D, r + dr), w_kc=w(Hm, dn, r),
                     w_vc=w(Hm, r, dv), o=w(Hm * dv, D))
        if c.is_moe_layer(i):
            L["router"] = w(D, E)
            # pairwise: one [D, I] / [I, D] block per expert; dense: every expert side by side
            L["routed"] = ([mlp(I_e) for _ in range(E)] if pairwise else
                           dict(gate=w(D, E * I_e), up=w(D, E * I_e), down=w(E * I_e, D)))
            if I_s:
                L["shared"] = mlp(I_s)
        else:
            L["mlp"] = mlp(c.intermediate_size)
        layers.append(L)
    return layers, w(D, c.vocab_size)


def _products_chain(c: KimiLinearConfig, pairwise: bool):
    """``step(x, layers, head)``: :func:`products_step`'s layers chained through the residual,
    then the output head."""
    H, Dk = c.linear_num_heads, c.linear_head_dim
    HD = H * Dk
    Hm, r, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dn, dv = c.qk_nope_head_dim, c.v_head_dim
    k, I_e = c.num_experts_per_token, c.moe_intermediate_size

    def glu(x, m, gate=None):
        a = jax.nn.silu(x @ m["gate"]) * (x @ m["up"])
        return (a if gate is None else a * gate) @ m["down"]

    def step(x, layers, head):
        n = x.shape[0]
        for L in layers:
            if "in_proj" in L:
                h = x @ L["in_proj"]
                f, g = h[:, 3 * HD:3 * HD + Dk], h[:, 3 * HD + Dk:3 * HD + 2 * Dk]
                attn = (h[:, :HD] + f @ L["f_b"]) * jax.nn.sigmoid(g @ L["g_b"])
            else:
                q = (x @ L["q"]).reshape(n, Hm, dn + dr)[..., :dn]
                lat = jnp.einsum("nhd,hdr->nhr", q, L["w_kc"]) + (x @ L["kv_a"])[:, None, :r]
                attn = jnp.einsum("nhr,hrd->nhd", lat, L["w_vc"]).reshape(n, Hm * dv)
            x = x + attn @ L["o"]
            if "router" in L:
                route = jax.nn.sigmoid(x @ L["router"])
                if pairwise:  # pair (t, j) on expert t k + j
                    y = jnp.concatenate([sum(glu(x[t:t + 1], L["routed"][t * k + j],
                                                 route[t:t + 1, t * k + j:t * k + j + 1])
                                             for j in range(k)) for t in range(n)])
                else:
                    y = glu(x, L["routed"], jnp.repeat(route, I_e, axis=1))
                if "shared" in L:
                    y = y + glu(x, L["shared"])
            else:
                y = glu(x, L["mlp"])
            x = x + y
        return x @ head

    return step


def products_step_seconds(config: KimiLinearConfig, rows: int, rounds: int = 30) -> float:
    """Median seconds over ``rounds`` runs (after a compiling one) of :func:`products_step`:
    the matrix products alone of one step of ``rows`` tokens, on this backend."""
    rounds = check_int("rounds", rounds, 1)
    fn, args = products_step(config, rows)
    fn(*args).block_until_ready()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
