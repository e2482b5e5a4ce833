"""The serving benchmark's anchors: mlx-lm's batched greedy serving against a step-by-step
loop, the decode byte count by hand and against real parameters, the decode flop count by hand
and against XLA's cost analysis of the engine's compiled decode step, the products-alone step
against that count, the bandwidth and matmul probes, and (slow, where torch is installed)
transformers' greedy tokens against mlx-lm's on the same weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hybridattn.bench import anchors as A
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M

_CFG = KimiLinearConfig.tiny()


@pytest.fixture(scope="module")
def params():
    return M.init_params(_CFG, jax.random.key(3))


def _greedy_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of one prompt, one token at a time, with a fresh cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


@pytest.mark.mlx
def test_mlx_lm_serve_batched_equals_step_by_step_greedy(params):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    model = A.mlx_lm_model(_CFG, params)
    res = A.mlx_lm_serve(_CFG, params, batch_size=2, prompt_len=12, new_tokens=6, seed=5,
                         repeats=2)
    assert res["engine"] == "mlx-lm"
    assert (res["batch_size"], res["prompt_len"], res["decode_steps"]) == (2, 12, 5)
    assert len(res["prompts"]) == 2 and all(len(p) == 12 for p in res["prompts"])
    for key in ("prefill_s", "prefill_tok_s", "decode_step_s", "decode_tok_s"):
        assert res[key] > 0, key
    assert res["prefill_tok_s"] == pytest.approx(24 / res["prefill_s"])
    assert res["decode_tok_s"] == pytest.approx(2 / res["decode_step_s"])
    assert np.shape(res["tokens"]) == (2, 6)
    for prompt, got in zip(res["prompts"], res["tokens"], strict=True):
        assert got == _greedy_loop(model, prompt, 6)

    # Cache-free as well: one forward over prompt + generated tokens predicts each of them.
    import mlx.core as mx

    full = [p + t[:-1] for p, t in zip(res["prompts"], res["tokens"], strict=True)]
    pred = np.array(mx.argmax(model(mx.array(full))[:, 11:], axis=-1))
    np.testing.assert_array_equal(pred, res["tokens"])

    # Explicit prompts, a reused model, one generated token (no decode step).
    again = A.mlx_lm_serve(_CFG, params, prompts=res["prompts"], new_tokens=1, model=model)
    assert again["tokens"] == [t[:1] for t in res["tokens"]]
    assert again["decode_steps"] == 0 and again["decode_tok_s"] is None
    with pytest.raises(ValueError, match="one length"):
        A.mlx_lm_serve(_CFG, params, prompts=[[1, 2, 3], [4, 5]], new_tokens=2, model=model)


def test_decode_bytes_per_step_by_hand():
    # tiny: D=64, V=256; KDA layers 0-2 (H=4, Dk=16, K=4), MLA layer 3 (4 heads, r=32, dr=8,
    # dn=dv=16); layer 0 dense (I=128), layers 1-3 MoE (E=4, top-2, 1 shared, I=32).
    kda_attn = (3 * 64 * 64 + 3 * 64 * 4 + 4 + 64 + 4 * 64 * 16 + 64 * 4 + 16 + 64 * 64)
    mla_attn = 64 * 4 * 24 + 64 * 40 + 32 + 4 * 32 * 32 + 4 * 16 * 64
    assert (kda_attn, mla_attn) == (21588, 16928)
    moe_fixed = 4 * 64 + 4 + 3 * 64 * 32  # router, its bias, the shared expert
    layers = (128 + kda_attn + 3 * 64 * 128) + 2 * (128 + kda_attn + moe_fixed) \
        + (128 + mla_attn + moe_fixed) + 64
    assert layers == 126056
    expert = 3 * 64 * 32

    got = A.decode_bytes_per_step(_CFG, batch_size=1, context_len=10)
    want = dict(embedding=64 * 4, lm_head=256 * 64 * 4, layer_weights=layers * 4,
                routed_experts=3 * 2 * expert * 4,  # 3 MoE layers, top-2 of 4
                kda_state=3 * 2 * (3 * 3 * 64 * 4 + 4 * 16 * 16 * 4),
                mla_cache=1 * 40 * 10 * 4)
    assert {k: got[k] for k in want} == want
    assert got["total"] == sum(want.values())
    assert got["weights"] + got["state"] == got["total"]

    got = A.decode_bytes_per_step(_CFG, batch_size=3, context_len=100, dtype_bytes=2)
    assert got["embedding"] == 3 * 64 * 2
    assert got["routed_experts"] == 3 * 4 * expert * 2  # min(E=4, 3 * 2) experts
    assert got["kda_state"] == 3 * 3 * 2 * (3 * 3 * 64 * 2 + 4 * 16 * 16 * 4)
    assert got["mla_cache"] == 3 * 40 * 100 * 2


@pytest.mark.parametrize("cfg", [
    _CFG,
    KimiLinearConfig.tiny(num_hidden_layers=8, num_experts=8, num_expert_group=2,
                          num_shared_experts=2, tie_word_embeddings=True),
    KimiLinearConfig.tiny(num_experts=0),
], ids=["tiny", "tied-groups", "dense"])
def test_decode_bytes_weights_match_real_parameters(cfg):
    """With every expert hit, the weights read are every parameter (embedding rows aside)."""
    p = M.init_params(cfg, jax.random.key(0))
    nbytes = sum(np.asarray(v).nbytes for v in M.to_checkpoint(p).values())
    B = 1000  # >= E / top_k: every expert is read
    got = A.decode_bytes_per_step(cfg, batch_size=B, context_len=1)
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 4
    assert got["weights"] - got["embedding"] + table == nbytes


def test_decode_flops_per_step_by_hand():
    # tiny (as above): per token, a multiply-add counted as two flops.
    kda_proj = 3 * 64 * 64 + 2 * (64 * 16 + 16 * 64) + 64 * 4 + 64 * 64  # q k v, f, g, b, o
    kda = 3 * 64 * 4 + 7 * 4 * 16 * 16  # short convolutions, the delta rule on S [4, 16, 16]
    mla_proj = 64 * 4 * 24 + 64 * 40 + 4 * 32 * 32 + 4 * 16 * 64  # q, kv_a, kv_b absorbed, o
    mlp = 3 * 64 * 128 + 3 * (4 * 64 + 3 * 64 * 32)  # layer 0 dense; routers, shared experts
    assert (kda_proj, kda, mla_proj, mlp) == (20736, 7936, 16896, 43776)

    got = A.decode_flops_per_step(_CFG, batch_size=2, context_len=10)
    want = dict(lm_head=2 * 2 * 64 * 256,
                projections=2 * 2 * (3 * kda_proj + mla_proj + mlp),
                routed_experts=2 * 2 * 3 * 2 * 3 * 64 * 32,  # 3 MoE layers, top-2
                kda=2 * 2 * 3 * kda,
                mla_attention=2 * 2 * 4 * 10 * (2 * 32 + 8))  # 4 heads, scores + values
    assert {k: got[k] for k in want} == want
    assert got["total"] == sum(want.values())


def test_decode_flops_bound_xlas_count_of_the_engines_step():
    """XLA's own count for the engine's compiled decode step (one request, layers unrolled so
    no loop body is counted once for several layers) is at least the least count, and not
    far above it: what it adds is element-wise work (norms, activations, the sampler)."""
    from hybridattn.backends import ForwardMode
    from hybridattn.engine import Engine
    from hybridattn.engine.buckets import bucket
    from hybridattn.serving import WorkItem, make_worker_batch

    e = Engine(_CFG, M.init_params(_CFG, jax.random.key(0)), max_running_requests=1,
               max_context_len=64, num_token_slots=65, prefix_cache=False, scan_layers=False)
    W = bucket(1, e.kv_buckets, "width")
    batch = make_worker_batch(
        [WorkItem(1, 1, [1], slots=[1])], vocab_size=_CFG.vocab_size,
        max_context_len=e.max_context_len,
        forward_mode=ForwardMode.DECODE, num_requests=1, num_tokens=1, kv_width=W,
        max_extend_len=1, snapshot_chunk=e.scheduler.chunk_size)
    cost = e.core.runner.jit.step.trace(e.params, e.state, batch).lower().compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    least = A.decode_flops_per_step(_CFG, batch_size=1, context_len=W)["total"]
    assert least <= cost["flops"] <= 1.3 * least


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cfg", [_CFG, KimiLinearConfig.tiny(num_hidden_layers=5, hidden_size=48,
                                                             num_shared_experts=0)])
def test_products_step_runs_every_product_of_the_step(cfg, rows):
    """The products-alone step holds the products ``decode_flops_per_step`` counts (checked
    above against XLA's count of the engine's step), with the routed experts in the CPU
    step's form: one token's top-k experts alone (1 row: 2 pairs of 4 experts), every expert
    on every row otherwise (3 rows: 6 pairs); and little besides: XLA's own count of it sits
    just above that. Its logits stay finite."""
    fn, args = A.products_step(cfg, rows)
    cost = fn.trace(*args).lower().compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    least = A.decode_flops_per_step(cfg, batch_size=rows, context_len=0)
    pairwise = rows * cfg.num_experts_per_token <= cfg.num_experts
    dense = 1 if pairwise else cfg.num_experts / cfg.num_experts_per_token
    want = least["lm_head"] + least["projections"] + least["routed_experts"] * dense
    assert want <= cost["flops"] <= 1.1 * want
    logits = fn(*args)
    assert logits.shape == (rows, cfg.vocab_size) and bool(np.isfinite(logits).all())
    assert A.products_step_seconds(cfg, rows, rounds=2) > 0


def test_products_step_refuses_a_count_below_one():
    with pytest.raises(ValueError, match="rows"):
        A.products_step(_CFG, 0)
    with pytest.raises(ValueError, match="rounds"):
        A.products_step_seconds(_CFG, 1, rounds=0)


def test_peak_gflops_is_positive():
    peak = A.peak_gflops(n=256, repeats=2)
    assert np.isfinite(peak) and peak > 0


def test_memory_bandwidth_is_positive():
    bw = A.memory_bandwidth_gbs(nbytes=32 << 20, repeats=2)
    assert np.isfinite(bw) and bw > 0


def test_transformers_serve_reports_why_it_skips(monkeypatch, params):
    real = A.importlib.util.find_spec
    monkeypatch.setattr(A.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    res = A.transformers_serve(_CFG, params, batch_size=1, prompt_len=4, new_tokens=2)
    assert res["skipped"].startswith("torch not installed")


@pytest.mark.slow
@pytest.mark.mlx
def test_transformers_greedy_equals_mlx_lm(params):
    """transformers' KimiLinearForCausalLM, loading our checkpoint through its own conversion
    mapping, generates mlx-lm's greedy tokens (a check of the names and of both models)."""
    pytest.importorskip("mlx_lm")
    if A.transformers_unavailable():
        pytest.skip(A.transformers_unavailable())
    import torch

    ours = A.mlx_lm_serve(_CFG, params, batch_size=2, prompt_len=10, new_tokens=5, seed=1,
                          warmup=False)
    model = A.transformers_model(_CFG, params)
    x = torch.tensor(ours["prompts"])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert out[:, 10:].tolist() == ours["tokens"]
