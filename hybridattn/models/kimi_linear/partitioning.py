"""How Kimi-Linear's parameters are split over a ``(data, tensor)`` mesh: the table
:data:`PARAM_RULES` and the specs and shardings of a parameter tree built from it (checked
against :func:`param_shapes` of the per-device config).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridattn.config import KimiLinearConfig
from hybridattn.mesh import (
    DATA,
    EXPERTS,
    TENSOR,
    check_divisible,
    is_spec,
    local_config,
    mesh_sizes,
    shard_shape,
)
from hybridattn.models.kimi_linear.params import param_shapes
from hybridattn.models.kimi_linear.stacking import STACKED, stack_layer_list

__all__ = [
    "PARAM_RULES",
    "param_shardings",
    "param_specs",
    "stacked_param_specs",
]

# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

#: Parameter shardings, keyed ``"<kind>.<path in the layer>"`` (kinds: ``kda`` / ``mla``
#: attention, ``moe`` and ``mlp`` blocks) or by the top-level path. Leaves not listed are
#: replicated (norms, the router, ``kv_a_proj_with_mqa``, the low-rank ``f_a`` / ``g_a``
#: projections, embeddings and ``lm_head``).
PARAM_RULES: dict[str, P] = {
    # KDA: heads over tensor (weights are [out, in]; head-major rows)
    "kda.q_proj.weight": P(TENSOR, None),
    "kda.k_proj.weight": P(TENSOR, None),
    "kda.v_proj.weight": P(TENSOR, None),
    "kda.q_conv1d.weight": P(TENSOR, None, None),
    "kda.k_conv1d.weight": P(TENSOR, None, None),
    "kda.v_conv1d.weight": P(TENSOR, None, None),
    "kda.A_log": P(None, None, TENSOR, None),
    "kda.dt_bias": P(TENSOR),
    "kda.f_b_proj.weight": P(TENSOR, None),
    "kda.g_b_proj.weight": P(TENSOR, None),
    "kda.b_proj.weight": P(TENSOR, None),
    "kda.o_proj.weight": P(None, TENSOR),  # row-parallel: psum over tensor
    # MLA: query and kv_b (w_kc / w_vc) by head; the latent projection replicated
    "mla.q_proj.weight": P(TENSOR, None),
    "mla.kv_b_proj.weight": P(TENSOR, None),
    "mla.o_proj.weight": P(None, TENSOR),  # row-parallel: psum over tensor
    # MoE: routed experts over (data, tensor); shared experts channel-split over tensor
    "moe.experts.w1": P(EXPERTS, None, None),
    "moe.experts.w2": P(EXPERTS, None, None),
    "moe.experts.w3": P(EXPERTS, None, None),
    "moe.shared_experts.gate_proj.weight": P(TENSOR, None),
    "moe.shared_experts.up_proj.weight": P(TENSOR, None),
    "moe.shared_experts.down_proj.weight": P(None, TENSOR),  # psum over tensor
    # dense MLP layers: channel-split over tensor
    "mlp.gate_proj.weight": P(TENSOR, None),
    "mlp.up_proj.weight": P(TENSOR, None),
    "mlp.down_proj.weight": P(None, TENSOR),  # psum over tensor
}


def _leaf_key(path, config: KimiLinearConfig) -> str:
    names = [p.key if hasattr(p, "key") else p.idx for p in path]
    if names[:2] == ["model", "layers"]:
        i, block, rest = names[2], names[3], names[4:]
        if block == "self_attn":
            kind = "kda" if config.is_kda_layer(i) else "mla"
        elif block == "block_sparse_moe":
            kind = "moe"
        else:
            kind = block  # mlp, input_layernorm, post_attention_layernorm
        return ".".join([kind, *map(str, rest)])
    return ".".join(map(str, names[1:] if names[0] == "model" else names))


def param_specs(config: KimiLinearConfig, mesh: jax.sharding.Mesh, dtype=jnp.float32):
    """The ``PartitionSpec`` of every leaf of ``param_shapes(config)``, from
    ``PARAM_RULES``. Raises ValueError for a count the mesh does not divide, and checks that
    every leaf split over ``tensor`` alone has the per-device shape of
    ``param_shapes(local_config(config, tensor))``.

    >>> from hybridattn.mesh import make_mesh
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> specs = param_specs(cfg, make_mesh(1, 1))
    >>> specs["model"]["layers"][0]["self_attn"]["o_proj"]["weight"]
    P(None, 'tensor')
    """
    data, tensor = mesh_sizes(mesh)
    check_divisible(config, data, tensor)
    shapes = param_shapes(config, dtype)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: PARAM_RULES.get(_leaf_key(path, config), P()), shapes)
    local = jax.tree.leaves(param_shapes(local_config(config, tensor), dtype))
    for (path, full), spec, loc in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                       jax.tree.leaves(specs, is_leaf=is_spec), local,
                                       strict=True):
        # MoE leaves split experts or shared-expert channels, which a config cannot shrink
        # without shrinking the routed experts too: divisibility is all we check there.
        if _leaf_key(path, config).startswith("moe."):
            shard_shape(full.shape, spec, {DATA: data, TENSOR: tensor})
        elif tuple(spec):
            per_device = shard_shape(full.shape, spec, {DATA: data, TENSOR: tensor})
            if per_device != loc.shape:
                raise ValueError(f"{jax.tree_util.keystr(path)}: PARAM_RULES split {full.shape}"
                                 f" to {per_device} per device; param_shapes of the per-device"
                                 f" config says {loc.shape}")
    return specs


def stacked_param_specs(specs, config: KimiLinearConfig):
    """``param_specs`` in the layout of ``kimi_linear.stack_layers``: a stacked layer's leaves
    gain a leading unsplit (repeat or layer) axis.

    >>> from hybridattn.mesh import make_mesh
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> specs = stacked_param_specs(param_specs(cfg, make_mesh(1, 1)), cfg)
    >>> specs["model"]["layers"].kda["self_attn"]["o_proj"]["weight"]  # [layers, D, H Dv]
    P(None, None, 'tensor')
    """
    layers = specs["model"]["layers"]
    if isinstance(layers, STACKED):
        return specs
    stacked = stack_layer_list(
        layers, config,
        lambda items: jax.tree.map(lambda sp: P(None, *sp), items[0], is_leaf=is_spec))
    return {**specs, "model": {**specs["model"], "layers": stacked}}


def param_shardings(config: KimiLinearConfig, mesh: jax.sharding.Mesh, dtype=jnp.float32,
                    *, stacked: bool = False):
    """``param_specs`` as ``NamedSharding``s on ``mesh`` (``stacked``: in the layout of
    ``kimi_linear.stack_layers``).

    >>> from hybridattn.mesh import make_mesh
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> param_shardings(cfg, make_mesh(1, 1))["model"]["layers"][1]["block_sparse_moe"][
    ...     "experts"]["w1"].spec
    P(('data', 'tensor'), None, None)
    """
    specs = param_specs(config, mesh, dtype)
    if stacked:
        specs = stacked_param_specs(specs, config)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
