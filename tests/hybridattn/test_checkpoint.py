"""Checkpoint directories (``save_pretrained`` / ``load``) and the cache-free ``apply``.

``apply`` is checked against mlx-lm's ``kimi_linear.Model`` loaded from the very directory
``save_pretrained`` wrote (its ``config.json`` and safetensors files, through mlx-lm's own
``sanitize``, strict), at released head sizes (Dk = 128, kv_lora_rank = 512, rope dim 64) and
real gate magnitudes (``exp(A_log)`` up to 200), for sequences shorter than, equal to and
longer than the KDA chunk.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M

# LLVM's optimisation passes dominate compile time on CPU and change no result: the tests
# compile six programs, so they skip them. Otherwise this is jax.jit(apply, static_argnums=1).
_FAST = {"xla_backend_optimization_level": 0}
_apply = jax.jit(M.apply, static_argnums=1, static_argnames="chunk_size", compiler_options=_FAST)

# 1 KDA layer (dense MLP) + 1 MLA layer (MoE with a shared expert): every kind of tensor.
SMALL = KimiLinearConfig.tiny(num_hidden_layers=2, kda_layer_ids=(0,))


def _tree_equal(a, b) -> bool:
    same = jax.tree.map(lambda x, y: x.dtype == y.dtype and x.shape == y.shape
                        and bool((np.asarray(x) == np.asarray(y)).all()), a, b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


def _ids(cfg, B, T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)),
                       jnp.int32)


@pytest.fixture(scope="module")
def small_params():
    return M.init_params(SMALL, jax.random.key(1))


@pytest.fixture(scope="module")
def small_f32(small_params):
    """``(ids, loss, grads, logits)``: next-token loss of ``apply`` on SMALL (two rows of 20
    tokens, KDA chunk 16: one whole chunk and a tail), its gradient and the logits."""
    ids = _ids(SMALL, 2, 21, seed=3)

    def loss(p):
        logits = M.apply(p, SMALL, ids[:, :-1], chunk_size=16)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                     compiler_options=_FAST)(small_params)
    return ids[:, :-1], value, grads, logits


# --------------------------------------------------------------------------------------------
# shapes and round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {},
    {"num_experts": 0, "tie_word_embeddings": True},
    {"num_shared_experts": 0, "moe_layer_freq": 2, "first_k_dense_replace": 0},
])
def test_param_shapes_match_init_params(overrides):
    cfg = KimiLinearConfig.tiny(num_hidden_layers=5, **overrides)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.tree.map(lambda s: (s.shape, s.dtype), M.param_shapes(cfg, dtype))
        want = jax.tree.map(lambda a: (a.shape, a.dtype), M.init_params(cfg, jax.random.key(0),
                                                                         dtype))
        assert got == want


def test_round_trip_single_file_and_sharded(tmp_path, small_params):
    cfg, params = SMALL, small_params
    M.save_pretrained(params, cfg, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="np") as f:
        assert set(f.keys()) == set(M.to_checkpoint(params))
    got_cfg, got = M.load(tmp_path)
    assert got_cfg == cfg and _tree_equal(got, params)

    # Sharded into the same directory: the single file goes, the shards and index come.
    M.save_pretrained(params, cfg, tmp_path, max_shard_bytes=40_000)
    shards = sorted(glob.glob(str(tmp_path / "model-*.safetensors")))
    n = len(shards)
    assert n > 2 and not (tmp_path / "model.safetensors").exists()
    assert [os.path.basename(s) for s in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    flat = M.to_checkpoint(params)
    assert set(index["weight_map"]) == set(flat)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in flat.values())
    for s in shards:
        with safe_open(s, framework="np") as f:
            names = list(f.keys())
        assert {k for k, v in index["weight_map"].items() if v == os.path.basename(s)} == set(names)
        # a shard exceeds the limit only when it is one tensor larger than the limit
        assert sum(flat[k].nbytes for k in names) <= 40_000 or len(names) == 1
    got_cfg, got = M.load(tmp_path)
    assert got_cfg == cfg and _tree_equal(got, params)

    # And back to one file: the shards and the index go.
    M.save_pretrained(params, cfg, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_an_engines_serving_layout_saves_the_checkpoint_it_was_built_from(tmp_path,
                                                                           small_params):
    """``save_pretrained`` of stacked, serving-laid-out params (what ``Engine`` holds) writes
    the same tensors as the checkpoint layout, and ``check_params`` accepts them."""
    cfg, params = SMALL, small_params
    served = M.serving_layout(M.stack_layers(params, cfg))
    M.check_params(served, cfg)
    flat, want = M.to_checkpoint(served), M.to_checkpoint(params)
    assert set(flat) == set(want)
    assert all(np.array_equal(flat[k], want[k]) for k in want)
    M.save_pretrained(served, cfg, tmp_path)
    _, got = M.load(tmp_path)
    assert _tree_equal(got, params)


def test_tied_embeddings_round_trip(tmp_path):
    cfg = KimiLinearConfig.tiny(tie_word_embeddings=True, num_experts=0)
    params = M.init_params(cfg, jax.random.key(2))
    M.save_pretrained(params, cfg, tmp_path)
    _, got = M.load(tmp_path)
    assert "lm_head" not in got and _tree_equal(got, params)
    # a tied checkpoint that also carries lm_head.weight loads (mlx-lm drops it too)
    flat = M.to_checkpoint(params)
    flat["lm_head.weight"] = flat["model.embed_tokens.weight"]
    save_file(flat, str(tmp_path / "model.safetensors"))
    assert _tree_equal(M.load(tmp_path)[1], params)


def test_bf16_checkpoint(tmp_path, small_params, small_f32):
    cfg, params = SMALL, small_params
    M.save_pretrained(params, cfg, tmp_path, dtype=jnp.bfloat16)
    with safe_open(tmp_path / "model.safetensors", framework="np") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    kept = ("A_log", "dt_bias", "e_score_correction_bias")
    assert {k for k, v in dtypes.items() if v == "F32"} == {
        k for k in dtypes if k.rsplit(".", 1)[-1] in kept}
    assert {v for v in dtypes.values()} == {"BF16", "F32"}

    _, p16 = M.load(tmp_path, dtype=jnp.bfloat16)
    assert _tree_equal(p16, M.from_checkpoint(M.to_checkpoint(params), cfg, jnp.bfloat16))
    assert p16["model"]["layers"][0]["self_attn"]["A_log"].dtype == jnp.float32
    assert p16["model"]["layers"][0]["self_attn"]["q_proj"]["weight"].dtype == jnp.bfloat16
    # bf16 params written as they are read back bit for bit
    M.save_pretrained(p16, cfg, tmp_path / "again")
    assert _tree_equal(M.load(tmp_path / "again", dtype=jnp.bfloat16)[1], p16)

    ids, _, _, logits32 = small_f32
    logits16 = _apply(p16, cfg, ids, chunk_size=16)
    assert logits16.dtype == jnp.float32 and logits16.shape == logits32.shape
    logits16, logits32 = np.asarray(logits16), np.asarray(logits32)
    assert np.isfinite(logits16).all()
    assert np.abs(logits16 - logits32).max() < 0.05 * np.abs(logits32).max()
    # a float32 checkpoint cast on load gives the same bf16 params
    M.save_pretrained(params, cfg, tmp_path / "f32")
    assert _tree_equal(M.load(tmp_path / "f32", dtype=jnp.bfloat16)[1], p16)


def test_transformers_dense_mlp_naming(tmp_path, small_params):
    cfg, params = SMALL, small_params
    flat = M.to_checkpoint(params)
    renamed = {k.replace("model.layers.0.mlp.", "model.layers.0.block_sparse_moe."): v
               for k, v in flat.items()}
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in renamed
    cfg.save_pretrained(tmp_path)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    assert _tree_equal(M.load(tmp_path)[1], params)
    # both namings of the same tensor: refused
    renamed["model.layers.0.mlp.up_proj.weight"] = flat["model.layers.0.mlp.up_proj.weight"]
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        M.load(tmp_path)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

_Q = "model.layers.0.self_attn.q_proj.weight"  # [64, 64] in SMALL
_EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"


@pytest.mark.parametrize("edit, pattern", [
    (lambda f: f.pop(_Q), rf"missing tensor '{_Q}' \(expected shape \(64, 64\)\)"),
    (lambda f: f.pop(_EXPERT), rf"missing tensor '{_EXPERT}' \(expected shape \(64, 32\)\)"),
    (lambda f: f.pop("lm_head.weight"), r"missing tensor 'lm_head\.weight'"),
    (lambda f: f.update({"model.layers.1.block_sparse_moe.experts.4.w2.weight":
                         np.zeros((64, 32), np.float32)}),
     r"unexpected tensor 'model\.layers\.1\.block_sparse_moe\.experts\.4\.w2\.weight' of "
     r"shape \(64, 32\)"),
    (lambda f: f.update({"model.layers.1.self_attn.q_proj.bias": np.zeros(96, np.float32)}),
     r"unexpected tensor 'model\.layers\.1\.self_attn\.q_proj\.bias'"),
    (lambda f: f.update({_Q: np.zeros((64, 65), np.float32)}),
     rf"tensor '{_Q}' has shape \(64, 65\), expected \(64, 64\)"),
    (lambda f: f.update({_Q: np.zeros((64, 64), np.int32)}), rf"tensor '{_Q}'.*floating"),
])
def test_mismatched_checkpoint_raises(tmp_path, small_params, edit, pattern):
    flat = M.to_checkpoint(small_params)
    edit(flat)
    with pytest.raises(ValueError, match=pattern):
        M.from_checkpoint(flat, SMALL)
    SMALL.save_pretrained(tmp_path)
    save_file(flat, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=pattern):
        M.load(tmp_path)


def test_wrong_params_are_not_saved(tmp_path, small_params):
    bad = jax.tree.map(lambda x: x, small_params)
    bad["model"]["layers"][0]["self_attn"]["q_proj"]["weight"] = jnp.zeros((64, 63))
    with pytest.raises(ValueError, match=rf"tensor '{_Q}' has shape \(64, 63\)"):
        M.save_pretrained(bad, SMALL, tmp_path)
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        M.save_pretrained(small_params, SMALL, tmp_path, max_shard_bytes=0)


def test_missing_files_raise(tmp_path, small_params):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        M.load(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load(tmp_path)
    SMALL.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        M.load(tmp_path)
    M.save_pretrained(small_params, SMALL, tmp_path, max_shard_bytes=100_000)
    shard = sorted(glob.glob(str(tmp_path / "model-*.safetensors")))[-1]
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=re.escape(os.path.basename(shard))):
        M.load(tmp_path)


def test_inconsistent_index_raises(tmp_path, small_params):
    M.save_pretrained(small_params, SMALL, tmp_path, max_shard_bytes=100_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][_Q] = shards[-1] if index["weight_map"][_Q] != shards[-1] else shards[0]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"lists tensor '{_Q}' in"):
        M.load(tmp_path)
    del index["weight_map"][_Q]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{_Q}' of .* is not in"):
        M.load(tmp_path)


# --------------------------------------------------------------------------------------------
# apply
# --------------------------------------------------------------------------------------------


def test_grad_of_apply_is_finite(small_params, small_f32):
    ids, value, grads, logits = small_f32
    assert logits.shape == (*ids.shape, SMALL.vocab_size)
    assert np.isfinite(float(value))
    assert jax.tree.structure(grads) == jax.tree.structure(small_params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    attn = grads["model"]["layers"][0]["self_attn"]
    for g in (attn["q_proj"]["weight"], attn["q_conv1d"]["weight"], attn["A_log"],
              grads["model"]["layers"][1]["self_attn"]["kv_b_proj"]["weight"],
              grads["model"]["embed_tokens"]["weight"]):
        assert np.abs(np.asarray(g)).max() > 0


def test_apply_rejects_bad_input_ids(small_params):
    # TypeError where jaxtyping checks the annotations (as in this test suite)
    with pytest.raises((ValueError, TypeError), match="input_ids"):
        M.apply(small_params, SMALL, jnp.zeros((5,), jnp.int32))


# Released head sizes, small widths: MLA at 0-indexed 3, a dense first layer, MoE with a
# shared expert after it.
MLX_CFG = KimiLinearConfig.tiny(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
    kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
    linear_num_heads=2, linear_head_dim=128, num_experts=4, num_experts_per_token=2,
    num_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
)


@pytest.fixture(scope="module")
def mlx_case(tmp_path_factory):
    mx = pytest.importorskip("mlx.core")
    kimi = pytest.importorskip("mlx_lm.models.kimi_linear")
    cfg = MLX_CFG
    assert cfg.kda_layer_ids == (0, 1, 2) and cfg.full_attention_layer_ids == (3,)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.num_shared_experts
    params = M.init_params(cfg, jax.random.key(3))
    # Real gate magnitudes: exp(A_log) up to 200 (the release's largest decays).
    rng = np.random.default_rng(3)
    rates = rng.uniform(1.0, 200.0, (cfg.num_kda_layers, cfg.linear_num_heads))
    rates[0, 0] = 200.0
    for j, i in enumerate(cfg.kda_layer_ids):
        params["model"]["layers"][i]["self_attn"]["A_log"] = jnp.log(
            jnp.asarray(rates[j], jnp.float32)).reshape(1, 1, -1, 1)
    path = tmp_path_factory.mktemp("mlx_ckpt")
    M.save_pretrained(params, cfg, path, max_shard_bytes=1 << 20)
    assert (path / "model.safetensors.index.json").exists()

    # mlx-lm's own loading (mlx_lm.utils.load_model, minus its tokenizer imports).
    config = json.loads((path / "config.json").read_text())
    model = kimi.Model(kimi.ModelArgs.from_dict(config))
    weights = {}
    for f in glob.glob(str(path / "model*.safetensors")):
        weights.update(mx.load(f))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    loaded_cfg, loaded = M.load(path)
    assert loaded_cfg == cfg
    return cfg, loaded, model


@pytest.mark.mlx
@pytest.mark.parametrize("T", [5, 64, 100])  # shorter than, one, and over one KDA chunk (64)
def test_apply_matches_mlx_lm(mlx_case, T):
    import mlx.core as mx

    cfg, params, model = mlx_case
    ids = _ids(cfg, 2, T, seed=T)
    ref = model(mx.array(np.asarray(ids)))
    mx.eval(ref)
    ref = np.array(ref.astype(mx.float32))
    got = np.asarray(_apply(params, cfg, ids))
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max() / scale
    print(f"T={T}: max |apply - mlx-lm| / max |logit| = {err:.2e}")
    assert err < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99


@pytest.mark.mlx
def test_engine_greedy_matches_mlx_lm_at_released_head_sizes(mlx_case):
    """The engine on the checkpoint ``load`` read (Dk=128, kv_lora_rank=512, rope 64,
    exp(A_log) up to 200) generates mlx-lm's greedy tokens, for prompts shorter than, equal
    to and longer than one KDA chunk (32 here), served together."""
    from harness import mlx_greedy

    from hybridattn.engine import Engine

    cfg, params, model = mlx_case
    prompts = [np.asarray(_ids(cfg, 1, n, seed=n))[0].tolist() for n in (5, 32, 45)]
    engine = Engine(cfg, params, max_running_requests=4, max_context_len=64,
                    num_token_slots=4 * 64 + 1, chunk_size=32, chunked_prefill_size=96,
                    request_buckets=(4,), token_buckets=(100,), kv_buckets=(64,))
    got = engine.generate(prompts, 4)
    assert got == [mlx_greedy(model, p, 4) for p in prompts]
