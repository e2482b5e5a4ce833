"""A zoo of tiny random models built from mlx-lm's own classes, and the greedy oracle for them.

Each entry of ``FAMILIES`` is the ``ModelArgs`` of one mlx-lm model family (the module
``mlx_lm.models.<family>``), shrunk until a forward pass on CPU costs milliseconds: hidden
size 64, 2 to 4 layers, vocabulary 128, heads of 16, MoE layers of 4 experts. Each config has
enough layers that every cache kind of its family appears at least once: a hybrid has at
least one linear-attention / SSM / conv layer (``ArraysCache``) and one full-attention layer
(``KVCache``); ``gemma3_text`` and ``gpt_oss`` have one sliding layer (``RotatingKVCache``,
window ``SLIDING_WINDOW`` = 8, shorter than a test prompt) and one full layer; ``llama4``
has three chunked layers (``ChunkedKVCache``, chunk 8) and one global layer. ``llama`` is the
plain-``KVCache`` baseline. ``make`` builds one, ``cache_kinds`` says which caches it uses
(``make_model`` is apart: the examples' and the benchmark's llama, a little larger):

====================  =================================================================
family                caches (``make_prompt_cache``)
====================  =================================================================
``llama``             KVCache
``qwen3_next``        ArraysCache (gated delta), KVCache; MoE
``qwen3_5``           ArraysCache (gated delta), KVCache; wraps a text model
``nemotron_h``        ArraysCache (Mamba2), KVCache; a MoE layer (no cache)
``lfm2``              ArraysCache (short conv), KVCache
``kimi_linear``       ArraysCache (KDA: 3 conv states + recurrent state), KVCache (MLA)
``falcon_h1``         CacheList(ArraysCache, KVCache): Mamba2 and attention in parallel
``granitemoehybrid``  ArraysCache (Mamba2), KVCache; MoE
``jamba``             ArraysCache (Mamba), KVCache; MoE
``gemma3_text``       RotatingKVCache (sliding), KVCache
``gpt_oss``           RotatingKVCache (sliding), KVCache; MoE, attention sinks
``llama4``            ChunkedKVCache (chunked local attention), KVCache; MoE
====================  =================================================================

The weights are mlx-lm's own random initialisation under ``mx.random.seed(seed)``, then
cast to float32, so an exact comparison against the oracle is not lost in bf16 noise. A
few classes initialise parameters to a constant (norm scales of ones, zero biases, and
``nemotron_h``'s MoE router, all zeros, which ties every expert); ``make`` adds small noise
to every constant parameter so that routing is decided and a bug that mixes up two such
parameters changes the output.

The oracle is ``reference_generate``: mlx-lm greedy decoding with the model's own
``make_prompt_cache`` and no reuse. ``reference_generate_chunked`` prefills in chunks, as
``mlx_lm.generate.generate_step`` does with ``prefill_step_size=chunk``; in float32 both
give the same tokens for every family here.

Examples:
    >>> model = make("qwen3_next")
    >>> cache_kinds(model)
    ('ArraysCache', 'KVCache')
    >>> len(reference_generate(model, list(range(1, 31)), max_tokens=4))
    4
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.cache import CacheList, make_prompt_cache

from mlxcache.engine import Engine, ReuseDisabledWarning
from servecore.testing import save_word_tokenizer

__all__ = [
    "FAMILIES",
    "SLIDING_WINDOW",
    "VOCAB",
    "cache_kinds",
    "make",
    "make_model",
    "reference_generate",
    "reference_generate_chunked",
    "support_table",
]

VOCAB = 128  # every family's vocabulary size
SLIDING_WINDOW = 8  # shorter than the 20-40 token test prompts, so the window wraps

# How far ``make`` moves a parameter that construction left constant: a norm scale of 1
# becomes 1 +- 0.1; a zero router row gives logits of about 0.1 * sqrt(hidden) ~ 0.8.
CONSTANT_NOISE = 0.1

# lfm2 always ties its output head to the embedding, and at mlx-lm's init scale the input
# embedding dominates the residual stream: greedy decoding echoes the last token forever
# (1 distinct token in 8, for 9 of 9 seed x prompt pairs). Embeddings 10x smaller let the
# layers decide (4-8 distinct tokens in 8).
EMBED_SCALE: dict[str, float] = {"lfm2": 0.1}

# The common small attention shape: 4 query heads, 2 KV heads, head_dim 16.
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        **_ATTN,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # tied, a random model echoes its input token
    ),
    # Layer i is linear (gated delta net) unless (i + 1) % full_attention_interval == 0.
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=2,
        full_attention_interval=2,  # layer 0 linear, layer 1 full attention
        intermediate_size=128,
        **_ATTN,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
    ),
    # qwen3_5.Model is the multimodal wrapper mlx_lm.load builds; the text model's args sit
    # under text_config (rope_parameters default to an mrope section, used as plain rope).
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text",
            hidden_size=64,
            num_hidden_layers=2,
            full_attention_interval=2,  # layer 0 linear, layer 1 full attention
            intermediate_size=128,
            **_ATTN,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
            rope_parameters=dict(type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
    ),
    # One block per pattern character: M = Mamba2, * = attention, E = MoE, - = MLP.
    "nemotron_h": dict(
        model_type="nemotron_h",
        hybrid_override_pattern=["M", "*", "E"],
        hidden_size=64,
        intermediate_size=128,
        **_ATTN,
        head_dim=16,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
    ),
    "lfm2": dict(
        model_type="lfm2",
        layer_types=["conv", "full_attention"],
        hidden_size=64,
        num_hidden_layers=2,
        **_ATTN,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        conv_bias=False,
        conv_L_cache=3,
        norm_eps=1e-5,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    ),
    # kda_layers are 1-based: layer 0 is KDA (linear), layer 1 is MLA (full attention, MoE).
    "kimi_linear": dict(
        model_type="kimi_linear",
        hidden_size=64,
        num_hidden_layers=2,
        linear_attn_config=dict(
            kda_layers=[1],
            full_attn_layers=[2],
            num_heads=4,
            head_dim=16,
            short_conv_kernel_size=4,
        ),
        **_ATTN,
        head_dim=16,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        num_expert_group=1,
        topk_group=1,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        model_max_length=4096,
    ),
    # Every layer runs Mamba2 and attention side by side: one CacheList per layer.
    "falcon_h1": dict(
        model_type="falcon_h1",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        **_ATTN,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_chunk_size=16,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # tied, a random model echoes its input token
        max_position_embeddings=4096,
        rope_theta=10000.0,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        layer_types=["mamba", "attention"],
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        **_ATTN,
        attention_bias=False,
        embedding_multiplier=1.0,
        attention_multiplier=0.25,  # 1 / sqrt(head_dim 16)
        logits_scaling=1.0,
        residual_multiplier=1.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # tied, a random model echoes its input token
        max_position_embeddings=4096,
    ),
    # Layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba.
    "jamba": dict(
        model_type="jamba",
        hidden_size=64,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,  # layer 0 Mamba, layer 1 attention
        expert_layer_period=2,
        expert_layer_offset=1,  # layer 1 MoE
        intermediate_size=128,
        **_ATTN,
        mamba_d_conv=4,
        mamba_d_state=16,
        mamba_expand=2,
        num_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # tied, a random model echoes its input token
        max_position_embeddings=4096,
    ),
    # Layer i is global when (i + 1) % sliding_window_pattern == 0, else sliding.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=2,
        sliding_window_pattern=2,  # layer 0 sliding, layer 1 global
        sliding_window=SLIDING_WINDOW,
        intermediate_size=128,
        **_ATTN,
        head_dim=16,
        query_pre_attn_scalar=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=SLIDING_WINDOW,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_ATTN,
        head_dim=16,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000,
    ),
    # Layer i is chunked (ChunkedKVCache) unless (i + 1) % 4 == 0: four layers for one
    # global; the model reads cache[3]. A wrapper, like qwen3_5: args under text_config.
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            model_type="llama4_text",
            hidden_size=64,
            num_hidden_layers=4,
            attention_chunk_size=SLIDING_WINDOW,
            interleave_moe_layer_step=2,  # layers 1 and 3 MoE
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            **_ATTN,
            head_dim=16,
            attention_bias=False,
            use_qk_norm=True,
            rms_norm_eps=1e-5,
            rope_scaling=None,
            rope_theta=10000.0,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
        ),
    ),
}


def make(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny float32 model of ``family``, random weights drawn from ``seed``.

    Builds ``mlx_lm.models.<family>.Model`` from ``FAMILIES[family]`` updated with
    ``overrides`` (for the wrapper families ``qwen3_5`` and ``llama4``, an override other
    than ``model_type`` / ``text_config`` goes into ``text_config``), casts it to float32,
    adds ``CONSTANT_NOISE`` to every parameter that construction left constant, scales the
    token embedding by ``EMBED_SCALE`` (``lfm2`` only), and evaluates the parameters. The
    same ``family``, ``seed`` and ``overrides`` give the same weights.

    Args:
        family: a key of ``FAMILIES``.
        seed: seeds ``mx.random`` before construction (the global MLX generator is reseeded).
        **overrides: ``ModelArgs`` fields to change, e.g. ``num_hidden_layers=4``.

    Returns:
        The model, ready for ``model(tokens[None], cache=make_prompt_cache(model))``.

    Raises:
        KeyError: ``family`` is not in ``FAMILIES``.

    Examples:
        >>> model = make("gemma3_text", seed=1)
        >>> model.model_type, model.args.sliding_window
        ('gemma3_text', 8)
        >>> len(make("llama", num_hidden_layers=3).layers)
        3
    """
    if family not in FAMILIES:
        raise KeyError(f"{family=} is not in FAMILIES; known: {sorted(FAMILIES)}")
    args = copy.deepcopy(FAMILIES[family])
    nested = args.get("text_config")
    for key, value in overrides.items():
        if nested is not None and key not in ("model_type", "text_config"):
            nested[key] = value
        else:
            args[key] = value
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**args))
    model.set_dtype(mx.float32)
    _perturb_constants(model)
    if family in EMBED_SCALE:
        _scale_embedding(model, EMBED_SCALE[family])
    mx.eval(model.parameters())
    return model


def make_model(seed: int = 0) -> llama.Model:
    """The examples' model: mlx-lm's ``llama.Model``, hidden 128, 2 layers, 4 heads, 2 KV
    heads, vocabulary 1000, float32, random weights drawn from ``seed``.

    Not a ``FAMILIES`` entry: mlx-lm's initialisation as it is (no ``CONSTANT_NOISE``), the
    model of the docstring examples, the MLX notebook and ``python -m mlxcache.bench``
    (whose outputs and figures depend on these exact weights). ``mx.random`` is reseeded.

    Examples:
        >>> model = make_model()
        >>> model.args.hidden_size, len(model.layers), model.args.vocab_size
        (128, 2, 1000)
        >>> cache_kinds(model)
        ('KVCache',)
    """
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=1000,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _perturb_constants(model: nn.Module) -> None:
    # Noise on every parameter whose entries are all equal (ones, zeros): a zero router ties
    # every expert, and equal norm scales hide a per-channel layout bug.
    params = tree_flatten(model.parameters())
    changed = [
        (name, p + CONSTANT_NOISE * mx.random.normal(p.shape, dtype=p.dtype))
        for name, p in params
        if p.size > 1 and mx.issubdtype(p.dtype, mx.floating) and (p == p.flatten()[0]).all()
    ]
    if changed:
        model.update(tree_unflatten(changed))


def _scale_embedding(model: nn.Module, scale: float) -> None:
    params = tree_flatten(model.parameters())
    scaled = [(name, scale * p) for name, p in params if name.endswith("embed_tokens.weight")]
    model.update(tree_unflatten(scaled))


def cache_kinds(model: nn.Module) -> tuple[str, ...]:
    """The sorted distinct class names of the caches ``make_prompt_cache(model)`` builds.

    A ``CacheList`` (one layer holding several caches, as in ``falcon_h1``) counts as its
    members: ``CacheList(ArraysCache, KVCache)`` gives ``ArraysCache`` and ``KVCache``.

    Examples:
        >>> cache_kinds(make("gpt_oss"))
        ('KVCache', 'RotatingKVCache')
        >>> cache_kinds(make("falcon_h1"))
        ('ArraysCache', 'KVCache')
    """

    def names(cache):
        if isinstance(cache, CacheList):
            for member in cache.caches:
                yield from names(member)
        else:
            yield type(cache).__name__

    return tuple(sorted({n for c in make_prompt_cache(model) for n in names(c)}))


def reference_generate(model: nn.Module, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens from plain mlx-lm decoding: the oracle an engine is compared against.

    A fresh ``make_prompt_cache(model)``; the whole prompt in one forward pass; then the
    argmax of the last logits, fed back one token at a time. No reuse, no batching.

    Args:
        model: an mlx-lm model (any family).
        prompt: the prompt's token ids, at least one.
        max_tokens: how many tokens to generate.

    Returns:
        ``max_tokens`` generated token ids (the prompt not included).

    Examples:
        >>> model = make("llama")
        >>> out = reference_generate(model, [1, 2, 3, 4], max_tokens=3)
        >>> len(out), out == reference_generate(model, [1, 2, 3, 4], max_tokens=3)
        (3, True)
    """
    return reference_generate_chunked(model, prompt, max_tokens, chunk=None)


def reference_generate_chunked(
    model: nn.Module, prompt: Sequence[int], max_tokens: int, chunk: int | None
) -> list[int]:
    """``reference_generate`` with the prompt prefilled ``chunk`` tokens at a time.

    As ``mlx_lm.generate.generate_step`` with ``prefill_step_size=chunk``: all but the last
    prompt token in chunks of ``chunk`` (the last chunk may be shorter), then the last token
    alone, whose logits give the first generated token. ``chunk=None`` feeds the whole
    prompt at once (``reference_generate``).

    Args:
        model: an mlx-lm model (any family).
        prompt: the prompt's token ids, at least one.
        max_tokens: how many tokens to generate.
        chunk: prefill chunk length (>= 1), or None for one pass.

    Returns:
        ``max_tokens`` generated token ids.

    Raises:
        ValueError: the prompt is empty, or ``chunk`` is below 1.

    Examples:
        >>> model = make("lfm2")
        >>> prompt = list(range(1, 31))
        >>> reference_generate_chunked(model, prompt, 5, chunk=7) == reference_generate(
        ...     model, prompt, 5)
        True
    """
    prompt = list(prompt)
    if not prompt:
        raise ValueError("prompt is empty: greedy decoding needs at least one token")
    if chunk is not None and chunk < 1:
        raise ValueError(f"{chunk=} must be >= 1 (or None for one pass)")
    cache = make_prompt_cache(model)
    if chunk is None:
        head, last = [], prompt
    else:
        head, last = prompt[:-1], prompt[-1:]
    for start in range(0, len(head), chunk or 1):
        model(mx.array(head[start : start + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out: list[int] = []
    tokens = last
    for _ in range(max_tokens):
        logits = model(mx.array(tokens)[None], cache=cache)
        token = mx.argmax(logits[0, -1], axis=-1)
        mx.eval(token)
        tokens = [token.item()]
        out.append(tokens[0])
    return out


WIDE_HEADS = {"lfm2": {"hidden_size": 256, "block_dim": 256},
              "granitemoehybrid": {"hidden_size": 256}, "jamba": {"hidden_size": 256},
              "kimi_linear": {"kv_lora_rank": 64, "qk_rope_head_dim": 64}}
"""Overrides that give each family's attention heads of 64 values (default ``head_dim=64``),
as real checkpoints have: the ``kv_bits`` column of ``support_table`` is measured on them."""


def support_table() -> list[tuple[str, str, str, str, str]]:
    """What ``mlxcache.Engine`` does with each family of ``FAMILIES``, found by building
    each one: ``(family, cache kinds, reuse, batching, kv_bits=8)``, the rows of the support
    table in the README (a test keeps the two equal). "reuse" and "batching" are "yes" or
    what the engine's ``ReuseDisabledWarning`` names; "kv_bits=8" is ``Engine.quantized``
    with ``kv_bits=8, kv_group_size=64`` on the family with heads of 64 values
    (``WIDE_HEADS``).

    Examples:
        >>> [row for row in support_table() if row[0] == "gemma3_text"][0][:4]
        ('gemma3_text', 'KVCache, RotatingKVCache', 'yes', 'yes')
    """
    rows = []
    for family in FAMILIES:
        model = make(family)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ReuseDisabledWarning)
            engine = Engine(model, num_slots=64, num_snapshots=4)
        said = " ".join(str(w.message).removeprefix("mlxcache: ") for w in caught
                        if issubclass(w.category, ReuseDisabledWarning))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (said above)
            wide = Engine(make(family, **WIDE_HEADS.get(family, {"head_dim": 64})),
                          num_slots=64, num_snapshots=4, kv_bits=8, kv_group_size=64)
        rows.append((
            family,
            ", ".join(cache_kinds(model)),
            "yes" if engine.reuse else f"no ({said})",
            "yes" if engine.batched else "no, one request per forward",
            wide.quantized,
        ))
    return rows


def save_checkpoint(family: str, path: str | os.PathLike[str], seed: int = 0,
                    **overrides: Any) -> None:
    """Write ``make(family, seed, **overrides)`` into the directory ``path`` as mlx-lm's
    checkpoints are laid out: ``config.json``, ``model.safetensors`` and the word tokenizer
    of ``VOCAB`` tokens (``servecore.testing.save_word_tokenizer``: the word ``wN`` is token
    ``N``, with a chat template), so ``mlx_lm.load(path)`` (and ``mlx_lm.server``) load the
    same model.

    >>> import tempfile
    >>> import mlx_lm
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_checkpoint("llama", path, num_hidden_layers=1)
    ...     model, tokenizer = mlx_lm.load(path)
    >>> len(model.layers), tokenizer.encode("w7 w9", add_special_tokens=False)
    (1, [7, 9])
    """
    model = make(family, seed, **overrides)
    args = copy.deepcopy(FAMILIES[family])
    nested = args.get("text_config")
    for key, value in overrides.items():
        (nested if nested is not None and key not in ("model_type", "text_config")
         else args)[key] = value
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(args, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"),
                        dict(tree_flatten(model.parameters())))
    save_word_tokenizer(out, VOCAB)
