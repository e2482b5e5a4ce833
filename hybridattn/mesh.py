"""The ``(data, tensor)`` mesh the sharded step runs on, without the step: its axes
(:data:`DATA`, :data:`TENSOR`, :data:`EXPERTS`), :func:`make_mesh` and its sizes, the config
one device runs (:func:`local_config`), and the ``PartitionSpec`` of every leaf of a sharded
serving state (:func:`state_specs`) and batch (:data:`BATCH_SPEC`).

Pure: it imports no model and no serving code, so the model's partitioning rules
(``hybridattn.models.kimi_linear.partitioning``), the serving state and
``hybridattn.sharding`` (the sharded step, above both) all build on it. docs/sharding.md
describes the layout.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from hybridattn.config import KimiLinearConfig

__all__ = [
    "BATCH_SPEC",
    "DATA",
    "EXPERTS",
    "TENSOR",
    "check_divisible",
    "local_config",
    "make_mesh",
    "mesh_sizes",
    "state_specs",
]

DATA, TENSOR = "data", "tensor"
EXPERTS = (DATA, TENSOR)  # routed experts: split over both axes together

#: Batches: every leaf of a stacked ``ModelWorkerBatch`` is ``[D, ...]``, split over data.
BATCH_SPEC = P(DATA)


def mesh_sizes(mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """``(data, tensor)`` sizes of a mesh with those two axes; ValueError otherwise.

    >>> mesh_sizes(make_mesh(1, 1))
    (1, 1)
    """
    if tuple(mesh.axis_names) != (DATA, TENSOR):
        raise ValueError(f"mesh axes are {tuple(mesh.axis_names)}, expected ('data', 'tensor')"
                         " (hybridattn.mesh.make_mesh)")
    return mesh.shape[DATA], mesh.shape[TENSOR]


def make_mesh(data: int, tensor: int, devices=None) -> jax.sharding.Mesh:
    """A ``(data, tensor)`` mesh with explicit axis types over the first ``data * tensor``
    devices (or ``devices``).

    >>> mesh = make_mesh(1, 1)
    >>> mesh.axis_names, mesh_sizes(mesh)
    (('data', 'tensor'), (1, 1))
    """
    for name, n in (("data", data), ("tensor", tensor)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive int")
    if devices is None:
        if data * tensor > len(jax.devices()):
            raise ValueError(f"a {data}x{tensor} mesh needs {data * tensor} devices; JAX has "
                             f"{len(jax.devices())} (set jax_num_cpu_devices before JAX starts)")
        devices = jax.devices()[: data * tensor]
    return jax.make_mesh((data, tensor), (DATA, TENSOR), devices=devices,
                         axis_types=(AxisType.Explicit, AxisType.Explicit))


def check_divisible(config: KimiLinearConfig, data: int, tensor: int) -> None:
    """ValueError naming the count that a ``data x tensor`` mesh does not divide: KDA and MLA
    heads and MLP channels by ``tensor``, routed experts by ``data * tensor``.

    >>> check_divisible(KimiLinearConfig.tiny(), 1, 4)  # 4 heads, 4 experts: fine
    >>> check_divisible(KimiLinearConfig.tiny(), 2, 4)
    Traceback (most recent call last):
    ...
    ValueError: num_experts=4 is not divisible by the mesh's data*tensor size 8
    """
    need = [("linear_num_heads", config.linear_num_heads, tensor, "tensor"),
            ("num_attention_heads", config.num_attention_heads, tensor, "tensor"),
            ("intermediate_size", config.intermediate_size, tensor, "tensor")]
    if config.num_experts:
        need += [("num_experts", config.num_experts, data * tensor, "data*tensor"),
                 ("moe_intermediate_size*num_shared_experts",
                  config.moe_intermediate_size * max(config.num_shared_experts, 1), tensor,
                  "tensor")]
    for name, n, k, axis in need:
        if n % k:
            raise ValueError(f"{name}={n} is not divisible by the mesh's {axis} size {k}")


def local_config(config: KimiLinearConfig, tensor: int) -> KimiLinearConfig:
    """The config one device of a ``tensor``-wide mesh row runs: its share of the KDA and MLA
    heads and of the dense MLP channels (experts keep their count: the router sees all).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> local_config(cfg, 2).linear_num_heads, local_config(cfg, 2).num_attention_heads
    (2, 2)
    """
    if tensor == 1:
        return config
    return dataclasses.replace(
        config, linear_num_heads=config.linear_num_heads // tensor,
        num_attention_heads=config.num_attention_heads // tensor,
        num_key_value_heads=max(config.num_key_value_heads // tensor, 1),
        intermediate_size=config.intermediate_size // tensor)


def is_spec(x) -> bool:
    return isinstance(x, P)


def shard_shape(shape, spec, sizes) -> tuple[int, ...]:
    out = list(shape)
    for i, axes in enumerate(spec):
        for a in (axes,) if isinstance(axes, str) else (axes or ()):
            if out[i] % sizes[a]:
                raise ValueError(f"dimension {i} of shape {tuple(shape)} is not divisible by "
                                 f"the mesh's {a} size {sizes[a]}")
            out[i] //= sizes[a]
    return tuple(out)


# --------------------------------------------------------------------------------------------
# pools and batches
# --------------------------------------------------------------------------------------------


def _state_leaf_spec(path) -> P:
    names = [p.name if hasattr(p, "name") else getattr(p, "idx", None) for p in path]
    if names[0] == "rng":
        return P()  # one base key; per-request keys come from seeds and positions
    if names[0] in ("recurrent_state_pool", "snapshot_pool"):
        if names[1] == "ssm":
            return P(DATA, None, None, TENSOR)  # [D, Lk, S, H, Dk, Dv]: heads over tensor
        if names[1] == "conv":  # [D, Lk, S, K-1, C]: each device its heads' q|k|v
            return P(DATA, None, None, None, TENSOR)
    return P(DATA)  # request table, allocators, MLA latents: split by request only


def state_specs(state):
    """The ``PartitionSpec`` of every leaf of a sharded ``ServingState``: the leading (data
    shard) axis over ``data``, KDA state heads and conv channels over ``tensor``, the MLA
    latent pool replicated over ``tensor``, the base key replicated.

    >>> from hybridattn.serving import create_state
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = create_state(cfg, make_mesh(1, 1), max_running_requests=2, max_context_len=8,
    ...                      num_token_slots=18)
    >>> specs = state_specs(state)
    >>> specs.recurrent_state_pool.ssm, specs.token_to_kv_pool.c_kv, specs.rng
    (P('data', None, None, 'tensor'), P('data',), P())
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: _state_leaf_spec(path), state)
