"""``kimi_linear_configs``: tiny ``KimiLinearConfig`` s (layer patterns, head sizes, MoE)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridattn.config import KimiLinearConfig
from hybridattn.testing.common import (
    SearchStrategy,
    checked_int,
    composite,
    int_tuple,
    st,
)


def kimi_linear_configs(
    *,
    num_layers: Sequence[int] = (2, 3, 4),
    hybrid: bool = True,
    moe: bool | None = None,
    servable: bool = True,
    vocab_size: int = 64,
    hidden_sizes: Sequence[int] = (32, 64),
    num_heads: Sequence[int] = (1, 2),
    head_dims: Sequence[int] = (8, 16),
    conv_kernel_sizes: Sequence[int] = (2, 4),
) -> SearchStrategy[KimiLinearConfig]:
    """Valid tiny ``KimiLinearConfig`` s.

    Each draw picks a layer count from ``num_layers``, a pattern of KDA and MLA layers, every
    width from the size buckets (head dims for KDA, MLA nope / value heads, ``kv_lora_rank = 2 *
    head_dim``, ``qk_rope_head_dim = head_dim // 2``), and either dense MLPs everywhere or 4
    experts (top-1 or 2, with or without a shared expert, sigmoid or softmax router, expert
    groups, dense first layers through ``first_k_dense_replace``, ``moe_layer_freq`` 1-3).

    Args:
        num_layers: the layer counts to draw from.
        hybrid: at least one KDA and one MLA layer (what ``ServingState`` serves); False also
            draws all-KDA and all-MLA models.
        moe: True: MoE layers; False: dense MLPs only; None: either.
        servable: only configs ``hybridattn.serving`` and ``kimi_linear.apply`` run, with
            the fields that do not shape the model (token ids, ``rope_theta``, ...) left at
            their defaults. False: any valid config, also low-rank queries (``q_lora_rank``),
            rotary MLA and random token ids: what a config *file* must round-trip.
        vocab_size: the vocabulary size of every draw.
        hidden_sizes: the ``hidden_size`` bucket (``intermediate_size = 2 * hidden_size``).
        num_heads: the bucket of MLA and KDA head counts.
        head_dims: the bucket of head dims.
        conv_kernel_sizes: the bucket of KDA short-conv kernel sizes.

    Returns:
        A strategy of ``KimiLinearConfig``. Every distinct config is a distinct static
        argument (one compilation each): narrow the buckets to keep a test's compile time
        down.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(kimi_linear_configs(num_layers=(2, 4)))
    ... def test_round_trip(cfg):
    ...     assert cfg.kda_layer_ids and cfg.full_attention_layer_ids  # hybrid
    ...     assert KimiLinearConfig.from_dict(cfg.to_dict()) == cfg
    >>> test_round_trip()
    """
    num_layers = int_tuple("num_layers", num_layers, 2 if hybrid else 1)
    checked_int("vocab_size", vocab_size, 2)
    sizes = dict(hidden_sizes=int_tuple("hidden_sizes", hidden_sizes),
                 num_heads=int_tuple("num_heads", num_heads),
                 head_dims=int_tuple("head_dims", head_dims, 2),
                 conv_kernel_sizes=int_tuple("conv_kernel_sizes", conv_kernel_sizes, 2))
    return _configs(num_layers, bool(hybrid), moe, bool(servable), vocab_size, **sizes)


@composite
def _configs(draw, num_layers, hybrid, moe, servable, vocab_size, hidden_sizes, num_heads,
             head_dims, conv_kernel_sizes):
    n = draw(st.sampled_from(num_layers), label="num_hidden_layers")
    layers = st.integers(0, n - 1)
    mla = draw(st.sets(layers, min_size=1, max_size=n - 1) if hybrid
               else st.sets(layers, max_size=n), label="MLA layers")
    dim = lambda label: draw(st.sampled_from(head_dims), label=label)
    hidden = draw(st.sampled_from(hidden_sizes), label="hidden_size")
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=n,
        num_attention_heads=draw(st.sampled_from(num_heads), label="num_attention_heads"),
        kv_lora_rank=2 * dim("kv_lora_rank / 2"),
        qk_nope_head_dim=dim("qk_nope_head_dim"),
        qk_rope_head_dim=max(1, dim("2 * qk_rope_head_dim") // 2),
        v_head_dim=dim("v_head_dim"),
        linear_num_heads=draw(st.sampled_from(num_heads), label="linear_num_heads"),
        linear_head_dim=dim("linear_head_dim"),
        linear_conv_kernel_dim=draw(st.sampled_from(conv_kernel_sizes), label="conv kernel"),
        full_attention_layer_ids=tuple(sorted(mla)),
        kda_layer_ids=tuple(i for i in range(n) if i not in mla),
        tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
        model_max_length=4096,
    )
    if draw(st.booleans(), label="moe") if moe is None else moe:
        groups = draw(st.sampled_from([1, 2]), label="num_expert_group")
        kw.update(
            num_experts=4,
            num_experts_per_token=draw(st.integers(1, 2), label="num_experts_per_token"),
            num_shared_experts=draw(st.integers(0, 1), label="num_shared_experts"),
            moe_intermediate_size=dim("moe_intermediate_size"),
            moe_router_activation_func=draw(st.sampled_from(["sigmoid", "softmax"]),
                                            label="router"),
            moe_renormalize=draw(st.booleans(), label="moe_renormalize"),
            routed_scaling_factor=draw(st.sampled_from([1.0, 2.446]),
                                       label="routed_scaling_factor"),
            first_k_dense_replace=draw(st.integers(0, n), label="first_k_dense_replace"),
            moe_layer_freq=draw(st.integers(1, 3), label="moe_layer_freq"),
            num_expert_group=groups,
            topk_group=draw(st.integers(1, groups), label="topk_group"),
        )
    if not servable:
        kw.update(
            q_lora_rank=draw(st.sampled_from([None, *(2 * d for d in head_dims)]),
                             label="q_lora_rank"),
            mla_use_nope=draw(st.booleans(), label="mla_use_nope"),
            rope_theta=draw(st.sampled_from([10000.0, 50000.0]), label="rope_theta"),
            bos_token_id=draw(st.sampled_from([None, 0]), label="bos_token_id"),
            eos_token_id=draw(st.sampled_from([None, 1, (1, 2)]), label="eos_token_id"),
        )
    return KimiLinearConfig(**kw)
