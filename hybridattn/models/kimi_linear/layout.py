"""The two parameter layouts: the checkpoint's (one tensor per expert, separate KDA input
projections) and the serving one (stacked experts, fused projections), and the maps between.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hybridattn.models.kimi_linear.layers import _KDA_IN_PROJ, _kda_in_sizes
from hybridattn.models.kimi_linear.primitives import Params
from hybridattn.models.kimi_linear.stacking import GroupedLayers, StackedLayers, unstack_layers

__all__ = [
    "checkpoint_layout",
    "serving_layout",
    "to_checkpoint",
]

def to_checkpoint(params: Params) -> dict[str, np.ndarray]:
    """Flat ``{tensor name: array}`` in the released checkpoint's naming (what a
    ``model.safetensors`` holds): routed experts unstacked to ``experts.N.w1.weight``.

    >>> from hybridattn.config import KimiLinearConfig
    >>> import jax
    >>> from hybridattn.models.kimi_linear import init_params
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

    >>> from hybridattn.config import KimiLinearConfig
    >>> import jax
    >>> from hybridattn.models.kimi_linear import init_params, stack_layers
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

    >>> from hybridattn.config import KimiLinearConfig
    >>> import jax
    >>> from hybridattn.models.kimi_linear import init_params, stack_layers
    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64, moe_intermediate_size=16)
    >>> served = serving_layout(stack_layers(init_params(cfg, jax.random.key(0)), cfg))
    >>> layers = checkpoint_layout(served)["model"]["layers"]
    >>> len(layers), layers[1]["block_sparse_moe"]["experts"]["w2"].shape  # [E, D, I]
    (4, (4, 32, 16))
    """
    params = _map_layers(unstack_layers(params), _split_kda_in)
    return _map_experts(params, lambda e: _rename_transposed(e, "w2_t", "w2"))
