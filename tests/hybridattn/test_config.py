"""hybridattn.config.KimiLinearConfig: the released checkpoint, the transformers and mlx-lm
readers of the same files as oracles, round trips, and validation."""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings

from hybridattn.config import KimiLinearConfig
from hybridattn.testing import kimi_linear_configs

RELEASED_MLA_1_INDEXED = [4, 8, 12, 16, 20, 24, 27]

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (auto_map shortened).
RELEASED = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                 "AutoModel": "modeling_kimi.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": RELEASED_MLA_1_INDEXED,
        "head_dim": 128,
        "kda_layers": [i for i in range(1, 28) if i not in RELEASED_MLA_1_INDEXED],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.56.0",
    "use_cache": True,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def released():
    return copy.deepcopy(RELEASED)


# Any valid config, as a file may hold it: 1-10 layers of any pattern (all KDA and all MLA
# included), dense or MoE layouts, low-rank queries, rotary MLA, token ids.
ANY_CONFIG = kimi_linear_configs(num_layers=range(1, 11), hybrid=False, servable=False)


# ------------------------------------------------------------------------------------------
# the released checkpoint
# ------------------------------------------------------------------------------------------


def test_released_config():
    cfg = KimiLinearConfig.from_dict(released())
    assert cfg.full_attention_layer_ids == (3, 7, 11, 15, 19, 23, 26)
    assert cfg.kda_layer_ids == tuple(i for i in range(27) if i not in cfg.full_attention_layer_ids)
    assert (cfg.num_kda_layers, cfg.num_mla_layers) == (20, 7)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank) == (2304, 32, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.q_head_dim, cfg.v_head_dim) == (
        128, 64, 192, 128)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (32, 128, 4)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (256, 8, 1)
    assert cfg.moe_intermediate_size == 1024 and cfg.q_lora_rank is None and cfg.mla_use_nope
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.is_kda_layer(0) and not cfg.is_kda_layer(3) and not cfg.is_kda_layer(26)
    assert cfg.mla_layer_index(26) == 6 and cfg.kda_layer_index(25) == 19
    assert cfg.eos_token_id == 163586 and cfg.vocab_size == 163840


def test_released_round_trip_keeps_the_checkpoint_format(tmp_path):
    cfg = KimiLinearConfig.from_dict(released())
    d = cfg.to_dict()
    assert d["linear_attn_config"] == RELEASED["linear_attn_config"]
    for key, value in d.items():
        if key in RELEASED:
            assert value == RELEASED[key], key
    assert KimiLinearConfig.from_dict(d) == cfg
    cfg.save_pretrained(tmp_path / "ckpt")
    assert KimiLinearConfig.from_pretrained(tmp_path / "ckpt") == cfg


def test_tiny_follows_the_released_pattern():
    cfg = KimiLinearConfig.tiny()
    assert (cfg.kda_layer_ids, cfg.full_attention_layer_ids) == ((0, 1, 2), (3,))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads) == (64, 256, 4)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert KimiLinearConfig.tiny(num_hidden_layers=27).full_attention_layer_ids == (
        KimiLinearConfig.from_dict(released()).full_attention_layer_ids)
    assert KimiLinearConfig.tiny(num_hidden_layers=6).full_attention_layer_ids == (3, 5)
    assert KimiLinearConfig.tiny(num_hidden_layers=3, kda_layer_ids=(1,)).layer_types == (
        "full_attention", "linear_attention", "full_attention")


def test_layer_index_helpers():
    cfg = KimiLinearConfig.tiny(num_hidden_layers=8)  # MLA at 3, 7
    assert [cfg.kda_layer_index(i) for i in cfg.kda_layer_ids] == list(range(6))
    assert [cfg.mla_layer_index(i) for i in cfg.full_attention_layer_ids] == [0, 1]
    with pytest.raises(ValueError, match="layer 3 is an MLA layer"):
        cfg.kda_layer_index(3)
    with pytest.raises(ValueError, match="layer 2 is a KDA layer"):
        cfg.mla_layer_index(2)
    for method in (cfg.is_kda_layer, cfg.is_moe_layer, cfg.kda_layer_index, cfg.mla_layer_index):
        with pytest.raises(ValueError, match=r"layer 8 is out of range .*0\.\.7"):
            method(8)
        with pytest.raises(ValueError, match="layer -1 is out of range"):
            method(-1)


def test_dense_everywhere_without_experts():
    cfg = KimiLinearConfig.tiny(num_experts=0, moe_intermediate_size=0)
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_moe_layer_freq():
    cfg = KimiLinearConfig.tiny(num_hidden_layers=8, first_k_dense_replace=1, moe_layer_freq=2)
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [2, 4, 6]



def test_hashable_static_jit_argument():
    traces = []

    def f(x, cfg):
        traces.append(cfg)
        return x * cfg.num_kda_layers + cfg.q_head_dim

    f = jax.jit(f, static_argnums=1)
    a, b = KimiLinearConfig.tiny(), KimiLinearConfig.tiny()
    assert a is not b and a == b and hash(a) == hash(b)
    assert float(f(jnp.float32(1.0), a)) == 3 + 24
    assert float(f(jnp.float32(2.0), b)) == 6 + 24
    assert len(traces) == 1  # the equal config hit the cache
    f(jnp.float32(1.0), KimiLinearConfig.tiny(num_hidden_layers=8))
    assert len(traces) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 8


# ------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(ANY_CONFIG)
def test_round_trip(cfg):
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert KimiLinearConfig.from_dict(d) == cfg
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        assert KimiLinearConfig.from_pretrained(tmp) == cfg


# ------------------------------------------------------------------------------------------
# from_dict: both formats, aliases, agreement
# ------------------------------------------------------------------------------------------


def transformers_format(cfg):
    """``cfg`` in the transformers format only: no linear_attn_config, aliased names."""
    d = cfg.to_dict()
    lac = d.pop("linear_attn_config")
    d.update(linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
             linear_conv_kernel_dim=lac["short_conv_kernel_size"])
    for alias, name in [("num_local_experts", "num_experts"),
                        ("num_experts_per_tok", "num_experts_per_token"),
                        ("n_shared_experts", "num_shared_experts"),
                        ("norm_topk_prob", "moe_renormalize"), ("n_group", "num_expert_group"),
                        ("max_position_embeddings", "model_max_length")]:
        d[alias] = d.pop(name)
    del d["first_k_dense_replace"]
    return d


@settings(max_examples=25)
@given(ANY_CONFIG)
def test_transformers_format_reads_the_same(cfg):
    got = KimiLinearConfig.from_dict(transformers_format(cfg))
    # without first_k_dense_replace, the smallest one giving the same MLP kinds is read
    assert got.mlp_layer_types == cfg.mlp_layer_types
    assert got.first_k_dense_replace <= cfg.first_k_dense_replace
    assert dataclasses.replace(got, first_k_dense_replace=cfg.first_k_dense_replace) == cfg


def test_unknown_keys_and_nulls_are_ignored():
    d = released()
    d.update(quantization_config={"bits": 4}, some_future_key=[1, 2], num_key_value_heads=None,
             pad_token_id=None)
    cfg = KimiLinearConfig.from_dict(d)
    assert cfg.num_key_value_heads == 32 and cfg.pad_token_id is None


def test_rope_theta_from_rope_parameters_and_ints_become_floats():
    d = released()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000}
    d["routed_scaling_factor"] = 2
    cfg = KimiLinearConfig.from_dict(d)
    assert cfg.rope_theta == 50000.0 and isinstance(cfg.rope_theta, float)
    assert isinstance(cfg.routed_scaling_factor, float)


def test_eos_list_becomes_tuple():
    d = released()
    d["eos_token_id"] = [163586, 163585]
    cfg = KimiLinearConfig.from_dict(d)
    assert cfg.eos_token_id == (163586, 163585)
    hash(cfg)
    assert cfg.to_dict()["eos_token_id"] == [163586, 163585]


def test_mlp_layer_types_with_moe_layer_freq():
    d = KimiLinearConfig.tiny(num_hidden_layers=8, first_k_dense_replace=3,
                              moe_layer_freq=2).to_dict()
    del d["first_k_dense_replace"]
    cfg = KimiLinearConfig.from_dict(d)
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [4, 6]


def with_changes(d, **changes):
    d = copy.deepcopy(d)
    for key, value in changes.items():
        if key.startswith("lac_"):
            d["linear_attn_config"][key[4:]] = value
        elif value is ...:
            del d[key]
        else:
            d[key] = value
    return d


TINY = KimiLinearConfig.tiny().to_dict()  # 4 layers, MLA at 1-indexed 4


@pytest.mark.parametrize("changes, match", [
    (dict(lac_full_attn_layers=[5], lac_kda_layers=[1, 2, 3]),
     r"full_attn_layers: layer 5 is out of range for num_hidden_layers=4 \(1-indexed: 1\.\.4\)"),
    (dict(lac_full_attn_layers=[0], lac_kda_layers=[1, 2, 3]),
     r"full_attn_layers: layer 0 is out of range .*1-indexed: 1\.\.4"),
    (dict(lac_full_attn_layers=[3, 4], layer_types=...),
     r"full_attn_layers: layer 3 is listed in both kda_layers and full_attn_layers"),
    (dict(lac_kda_layers=[1, 1, 2, 3], layer_types=...), r"kda_layers: layer 1 is listed twice"),
    (dict(lac_kda_layers=[1, 2], layer_types=...), r"layers \[3\] \(1-indexed\) are in neither"),
    (dict(lac_full_attn_layers=[3], lac_kda_layers=[1, 2, 4]),
     r"layer kinds .*linear_attn_config=.* disagrees with layer_types="),
    (dict(lac_full_attn_layers=None, layer_types=...),
     r"linear_attn_config: has kda_layers but not full_attn_layers"),
    (dict(lac_kda_layers=None, lac_full_attn_layers=None, layer_types=...), r"no layer kinds"),
    (dict(layer_types=["linear_attention"] * 3), r"layer_types: expected 4 entries"),
    (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), r"layer_types: expected 4"),
    (dict(num_local_experts=8), r"num_experts: num_experts=4 disagrees with num_local_experts=8"),
    (dict(max_position_embeddings=8), r"model_max_length: model_max_length=4096 disagrees"),
    (dict(linear_num_heads=8),
     r"linear_num_heads: linear_num_heads=8 disagrees with linear_attn_config.num_heads=4"),
    (dict(mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
     r"mlp_layer_types: .* disagrees with first_k_dense_replace=1"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse", "sparse"], first_k_dense_replace=...),
     r"mlp_layer_types: .* is not expressible"),
    (dict(mlp_layer_types=["dense"] * 3 + ["sparse"], num_experts=0, first_k_dense_replace=...),
     r"mlp_layer_types: .* not expressible .*num_experts=0"),
    (dict(hidden_size=...), r"missing required keys \['hidden_size'\]"),
    (dict(model_type="deepseek_v3"), r"model_type: expected 'kimi_linear', got 'deepseek_v3'"),
])
def test_from_dict_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        KimiLinearConfig.from_dict(with_changes(TINY, **changes))


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    (dict(full_attention_layer_ids=(3, 4)),
     r"full_attention_layer_ids: layer 4 is out of range for num_hidden_layers=4 "
     r"\(0-indexed: 0\.\.3\)"),
    (dict(kda_layer_ids=(0, 1, 2, 3), full_attention_layer_ids=(3,)),
     r"full_attention_layer_ids: layer 3 is listed in both kda_layer_ids and "
     r"full_attention_layer_ids"),
    (dict(kda_layer_ids=(0, 1, 1), full_attention_layer_ids=(3,)),
     r"kda_layer_ids: layer 1 is listed twice"),
    (dict(kda_layer_ids=(0, 1), full_attention_layer_ids=(3,)), r"layers \[2\] .*in neither"),
    (dict(model_type="kimi"), r"model_type: expected 'kimi_linear', got 'kimi'"),
    (dict(hidden_size=0), r"hidden_size: must be positive, got 0"),
    (dict(vocab_size=-1), r"vocab_size: must be positive, got -1"),
    (dict(num_hidden_layers=0), r"num_hidden_layers: must be positive, got 0"),
    (dict(num_attention_heads=0), r"num_attention_heads: must be positive, got 0"),
    (dict(num_key_value_heads=0), r"num_key_value_heads: must be positive, got 0"),
    (dict(kv_lora_rank=0), r"kv_lora_rank: must be positive, got 0"),
    (dict(q_lora_rank=0), r"q_lora_rank: must be positive or None, got 0"),
    (dict(qk_nope_head_dim=0), r"qk_nope_head_dim: must be positive, got 0"),
    (dict(qk_rope_head_dim=0), r"qk_rope_head_dim: must be positive, got 0"),
    (dict(v_head_dim=0), r"v_head_dim: must be positive, got 0"),
    (dict(linear_num_heads=0), r"linear_num_heads: must be positive, got 0"),
    (dict(linear_head_dim=0), r"linear_head_dim: must be positive, got 0"),
    (dict(linear_conv_kernel_dim=1), r"linear_conv_kernel_dim: must be at least 2, got 1"),
    (dict(rms_norm_eps=0.0), r"rms_norm_eps: must be positive, got 0.0"),
    (dict(rope_theta=-1.0), r"rope_theta: must be positive, got -1.0"),
    (dict(num_experts=-1), r"num_experts: must be >= 0, got -1"),
    (dict(num_experts_per_token=5), r"num_experts_per_token: must be in 1..num_experts=4, got 5"),
    (dict(num_experts_per_token=0), r"num_experts_per_token: must be in 1..num_experts=4, got 0"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size: must be positive when num_experts"),
    (dict(num_shared_experts=-1), r"num_shared_experts: must be >= 0, got -1"),
    (dict(moe_router_activation_func="relu"), r"moe_router_activation_func: must be one of"),
    (dict(num_expert_group=3), r"num_expert_group: must be >= 1 and divide num_experts=4, got 3"),
    (dict(num_expert_group=2, topk_group=3),
     r"topk_group: must be in 1..num_expert_group=2, got 3"),
    (dict(first_k_dense_replace=-1), r"first_k_dense_replace: must be >= 0, got -1"),
    (dict(moe_layer_freq=0), r"moe_layer_freq: must be >= 1, got 0"),
    (dict(model_max_length=0), r"model_max_length: must be positive, got 0"),
])
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        KimiLinearConfig.tiny(**overrides)


def test_moe_fields_unchecked_when_dense():
    cfg = KimiLinearConfig.tiny(num_experts=0, num_experts_per_token=8, moe_intermediate_size=0)
    assert cfg.num_experts == 0


def test_unsorted_layer_ids_are_sorted():
    cfg = KimiLinearConfig.tiny(kda_layer_ids=(2, 0, 1), full_attention_layer_ids=(3,))
    assert cfg == KimiLinearConfig.tiny()


# ------------------------------------------------------------------------------------------
# oracle: transformers reads the same files to the same layer kinds
# ------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_transformers_reads_the_released_config_to_the_same_layer_kinds():
    transformers = pytest.importorskip("transformers")
    ref = transformers.KimiLinearConfig(**released())
    cfg = KimiLinearConfig.from_dict(released())
    assert ref.layer_types == list(cfg.layer_types)
    assert ref.mlp_layer_types == list(cfg.mlp_layer_types)


@settings(max_examples=15)
@given(ANY_CONFIG)
def test_transformers_derives_the_same_layer_kinds_from_linear_attn_config(cfg):
    transformers = pytest.importorskip("transformers")
    d = cfg.to_dict()
    del d["layer_types"], d["mlp_layer_types"]  # make transformers derive them
    ref = transformers.KimiLinearConfig(**d)
    assert ref.layer_types == list(cfg.layer_types)
    if cfg.num_experts and cfg.moe_layer_freq == 1:  # transformers ignores both
        assert ref.mlp_layer_types == list(cfg.mlp_layer_types)
    # given both lists, as to_dict writes them, transformers reads ours as they are
    ref = transformers.KimiLinearConfig(**cfg.to_dict())
    assert (ref.layer_types, ref.mlp_layer_types) == (list(cfg.layer_types),
                                                       list(cfg.mlp_layer_types))


def test_transformers_written_config_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    types = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
             "full_attention", "full_attention"]
    ref = transformers.KimiLinearConfig(
        vocab_size=512, hidden_size=96, intermediate_size=192, moe_intermediate_size=48,
        num_hidden_layers=6, num_attention_heads=6, kv_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=10, num_local_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, first_k_dense_replace=2, max_position_embeddings=2048,
        layer_types=types, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=3,
        eos_token_id=[7, 9], rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    ref.save_pretrained(tmp_path)
    cfg = KimiLinearConfig.from_pretrained(tmp_path)
    assert list(cfg.layer_types) == ref.layer_types == types
    assert list(cfg.mlp_layer_types) == ref.mlp_layer_types
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "num_experts", "num_experts_per_token", "num_shared_experts",
                 "model_max_length", "linear_num_heads", "linear_head_dim",
                 "linear_conv_kernel_dim", "routed_scaling_factor", "rms_norm_eps"):
        assert getattr(cfg, name) == getattr(ref, name), name
    assert cfg.first_k_dense_replace == 2 and cfg.q_head_dim == ref.qk_head_dim
    assert cfg.eos_token_id == (7, 9) and cfg.rope_theta == 50000.0
    assert KimiLinearConfig.from_dict(ref.to_dict()) == cfg


def test_our_file_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = KimiLinearConfig.tiny(num_hidden_layers=9, moe_layer_freq=2)
    cfg.save_pretrained(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(ref, transformers.KimiLinearConfig)
    assert (ref.layer_types, ref.mlp_layer_types) == (list(cfg.layer_types),
                                                       list(cfg.mlp_layer_types))
    assert (ref.num_local_experts, ref.num_experts_per_tok, ref.linear_num_heads) == (
        cfg.num_experts, cfg.num_experts_per_token, cfg.linear_num_heads)


# ------------------------------------------------------------------------------------------
# oracle: mlx-lm builds a model with the same layer kinds from to_dict()
# ------------------------------------------------------------------------------------------


@pytest.mark.mlx
def test_mlx_lm_builds_the_same_layer_kinds():
    kimi = pytest.importorskip("mlx_lm.models.kimi_linear")
    cfg = KimiLinearConfig.tiny(num_hidden_layers=7, full_attention_layer_ids=(0, 4, 5),
                                first_k_dense_replace=2, moe_layer_freq=2)
    model = kimi.Model(kimi.ModelArgs.from_dict(cfg.to_dict()))
    layers = model.model.layers
    assert [layer.is_linear for layer in layers] == [cfg.is_kda_layer(i) for i in range(7)]
    assert [isinstance(layer.mlp, kimi.KimiSparseMoE) for layer in layers] == [
        cfg.is_moe_layer(i) for i in range(7)]
    attn = layers[0].self_attn
    assert (attn.q_head_dim, attn.v_head_dim, attn.kv_lora_rank) == (
        cfg.q_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
    kda = layers[1].self_attn
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel) == (
        cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim)


@pytest.mark.mlx
def test_mlx_lm_reads_the_released_config_like_ours():
    kimi = pytest.importorskip("mlx_lm.models.kimi_linear")
    cfg = KimiLinearConfig.from_dict(released())
    for d in (released(), cfg.to_dict()):
        args = kimi.ModelArgs.from_dict(d)
        kda = args.linear_attn_config["kda_layers"]  # KimiDecoderLayer: (i + 1) in kda_layers
        assert [(i + 1) in kda for i in range(27)] == [cfg.is_kda_layer(i) for i in range(27)]
        moe = [args.num_experts > 0 and i >= args.first_k_dense_replace
               and i % args.moe_layer_freq == 0 for i in range(27)]
        assert moe == [cfg.is_moe_layer(i) for i in range(27)]
        for name in ("hidden_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "num_experts", "num_experts_per_token", "mla_use_nope",
                     "routed_scaling_factor", "model_max_length", "rope_theta"):
            assert getattr(args, name) == getattr(cfg, name), name
