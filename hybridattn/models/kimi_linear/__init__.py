"""Kimi-Linear in JAX: parameters in the released checkpoint's layout and the serving forward.

Parameters are a plain nested dict whose paths are the checkpoint's tensor names, e.g.
``params["model"]["layers"][3]["self_attn"]["kv_b_proj"]["weight"]``. Routed experts are
stacked per layer (``block_sparse_moe.experts.w1 [E, I, D]``; the checkpoint stores them one
by one as ``experts.N.w1.weight``).

The serving forward runs every layer through an attention backend (``hybridattn.backends``)::

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

from hybridattn.models.kimi_linear.checkpoint import (
    from_checkpoint,
    load,
    load_tokenizer,
    save_pretrained,
)
from hybridattn.models.kimi_linear.forward import compute_logits, forward
from hybridattn.models.kimi_linear.layers import (
    decoder_layer,
    kda_attention,
    mla_attention,
    mla_split,
)
from hybridattn.models.kimi_linear.layout import checkpoint_layout, serving_layout, to_checkpoint
from hybridattn.models.kimi_linear.mlp import dense_mlp, route, routed_experts, sparse_moe
from hybridattn.models.kimi_linear.params import (
    check_params,
    check_supported,
    init_params,
    param_shapes,
)
from hybridattn.models.kimi_linear.partitioning import (
    PARAM_RULES,
    param_shardings,
    param_specs,
    stacked_param_specs,
)
from hybridattn.models.kimi_linear.primitives import rms_norm
from hybridattn.models.kimi_linear.reference import apply
from hybridattn.models.kimi_linear.stacking import (
    STACKED,
    GroupedLayers,
    StackedLayers,
    compiled_layers,
    folded_layers,
    group_plan,
    layer_plan,
    stack_layer_list,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "PARAM_RULES",
    "param_shardings",
    "param_specs",
    "stacked_param_specs",
    "STACKED",
    "GroupedLayers",
    "StackedLayers",
    "apply",
    "check_supported",
    "check_params",
    "checkpoint_layout",
    "compiled_layers",
    "compute_logits",
    "dense_mlp",
    "decoder_layer",
    "folded_layers",
    "forward",
    "from_checkpoint",
    "group_plan",
    "init_params",
    "kda_attention",
    "layer_plan",
    "load",
    "load_tokenizer",
    "mla_attention",
    "mla_split",
    "param_shapes",
    "rms_norm",
    "route",
    "routed_experts",
    "save_pretrained",
    "serving_layout",
    "sparse_moe",
    "stack_layer_list",
    "stack_layers",
    "to_checkpoint",
    "unstack_layers",
]
