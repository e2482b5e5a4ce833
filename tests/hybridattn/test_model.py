"""The whole hybrid serving forward against mlx-lm's Kimi-Linear on the same weights.

Our parameters are written in the released checkpoint's naming (``to_checkpoint``), loaded into
mlx-lm's ``kimi_linear.Model`` through its own ``sanitize``, and both models score the same
tokens: mlx-lm in one cache-free pass, ours through the pools and the hybrid backend (a prefill
split into two chunks, a second request prefilling alongside, then decode steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import DECODE, Harness

from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M

pytestmark = pytest.mark.mlx


def mlx_model(cfg: KimiLinearConfig, params):
    mx = pytest.importorskip("mlx.core")
    kimi = pytest.importorskip("mlx_lm.models.kimi_linear")
    model = kimi.Model(kimi.ModelArgs.from_dict(cfg.to_dict()))
    weights = {k: mx.array(v) for k, v in M.to_checkpoint(params).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    return model


def mlx_logits(model, ids):
    import mlx.core as mx

    out = model(mx.array([ids]))
    mx.eval(out)
    return np.array(out[0].astype(mx.float32))


@jax.jit
def _forward(params, backend, fb):
    backend = backend.with_forward_metadata(backend.get_forward_metadata(fb))
    hidden, fb = M.forward(params, _CFG, backend, fb)
    return M.compute_logits(params, _CFG, hidden), fb


# 3 KDA : 1 MLA twice over (MLA at 0-indexed 3 and 7), MoE with expert groups after layer 0.
_CFG = KimiLinearConfig.tiny(num_hidden_layers=8, num_experts=8, num_experts_per_token=2,
                             num_expert_group=2, topk_group=1)


@pytest.mark.parametrize("layout", ["checkpoint", "serving"])
def test_serving_forward_equals_mlx_lm_kimi_linear(layout):
    """In the checkpoint's layout and in ``serving_layout`` (the engine's: routed down
    projections input-major), against mlx-lm reading the checkpoint."""
    cfg = _CFG
    assert cfg.full_attention_layer_ids == (3, 7) and cfg.is_moe_layer(1)
    params = M.init_params(cfg, jax.random.key(7))
    ref_model = mlx_model(cfg, params)
    if layout == "serving":
        params = M.serving_layout(params)
        assert "w2_t" in params["model"]["layers"][1]["block_sparse_moe"]["experts"]
    rng = np.random.default_rng(0)
    a = rng.integers(1, cfg.vocab_size, 23).tolist()
    b = rng.integers(1, cfg.vocab_size, 11).tolist()
    ref_a, ref_b = mlx_logits(ref_model, a), mlx_logits(ref_model, b)

    h = Harness(cfg, chunk=16)
    shapes = dict(B=4, T=32, W=32, Q=16)
    got_a, got_b = [], []
    # a: first 14 prompt tokens; then a's last 7 (cached prefix) with b's whole prompt
    logits, fb = _forward(params, h.backend, h.batch([("a", a[:14])], **shapes))
    h.absorb(fb)
    got_a.append(logits[:14])
    logits, fb = _forward(params, h.backend, h.batch([("a", a[14:21]), ("b", b)], **shapes))
    h.absorb(fb)
    got_a.append(logits[:7])
    got_b.append(logits[7:18])
    # two decode steps for a (b idles)
    for t in a[21:]:
        logits, fb = _forward(params, h.backend, h.batch([("a", [t])], mode=DECODE, B=4, T=4,
                                                         W=32))
        h.absorb(fb)
        got_a.append(logits[:1])
    got_a, got_b = np.concatenate(got_a), np.concatenate(got_b)
    scale = np.abs(ref_a).max()
    np.testing.assert_allclose(got_a, ref_a, atol=2e-4 * scale, rtol=0)
    np.testing.assert_allclose(got_b, ref_b, atol=2e-4 * scale, rtol=0)
    assert (got_a.argmax(-1) == ref_a.argmax(-1)).all()


@pytest.mark.parametrize("n_tokens", [1, 3, 40, 300])
def test_moe_paths_agree(monkeypatch, n_tokens):
    """The pairwise (CPU, few pairs), gathered (N * top_k <= E), dense and blocked (CPU, few /
    many tokens) and grouped ragged_dot (GPU / TPU) forms of the routed experts give the
    same sum."""
    cfg = _CFG
    params = M.init_params(cfg, jax.random.key(3))
    p = params["model"]["layers"][1]["block_sparse_moe"]
    served = M.serving_layout(params)["model"]["layers"][1]["block_sparse_moe"]
    x = jax.random.normal(jax.random.key(4), (n_tokens, cfg.hidden_size))
    got = M.sparse_moe(p, cfg, x)
    # the same path with the down projections input-major (serving_layout)
    np.testing.assert_allclose(np.asarray(M.sparse_moe(served, cfg, x)), np.asarray(got),
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    big = jnp.concatenate([x] * 8)  # enough tokens for the grouped form
    for q in (p, served):
        grouped = M.sparse_moe(q, cfg, big)[:n_tokens]
        np.testing.assert_allclose(np.asarray(got), np.asarray(grouped), atol=1e-5, rtol=1e-5)
        # off the CPU, few tokens take the gathered form
        np.testing.assert_allclose(np.asarray(M.sparse_moe(q, cfg, x)), np.asarray(got),
                                   atol=1e-5, rtol=1e-5)
