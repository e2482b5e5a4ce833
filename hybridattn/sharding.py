"""The serving step sharded over a JAX mesh: tensor, data and expert parallel.

A mesh has two axes, ``("data", "tensor")`` (``make_mesh``, explicit axis types). The step
runs under ``jax.shard_map``: every device runs the ordinary single-device ``serving.step``
on its own shard, and JAX's collectives join the shards at four points per layer kind.

* ``tensor`` splits heads. KDA: the q/k/v/gate projections, the short-conv weights,
  ``A_log``, ``dt_bias`` and the state pool by head; MLA: ``q_proj`` and ``kv_b_proj`` (the
  absorbed ``w_kc`` / ``w_vc``) by head, the latent pool replicated (it has no head axis).
  ``o_proj`` is row-parallel: one ``psum`` over ``tensor`` per attention layer. Dense MLPs
  and shared experts split their intermediate channels the same way (one ``psum`` each).
* ``data`` splits requests. A sharded ``ServingState`` is ``D`` single-device states stacked
  on a leading axis: each data shard has its own request rows, state slots, token slots,
  allocators and **its own slot-0 sinks**, and every index it holds is local to it. Padding
  rows write only their own shard's sinks; no shard can name another shard's slot.
* routed experts are split over ``("data", "tensor")`` together, the router replicated. A MoE
  layer gathers the tokens of every data shard (``all_gather`` over ``data``), computes its
  own experts' share for all of them, and sums the shares back onto the shards they came
  from (``psum_scatter`` over ``data``, ``psum`` over ``tensor``). XLA:CPU has no all-to-all,
  so none is used.

Every sharding lives in one table, ``PARAM_RULES`` (parameters, keyed by layer kind and path)
plus ``state_specs`` / ``BATCH_SPEC`` (pools and batches); docs/sharding.md prints the same
table. ``param_specs`` checks the tensor-split leaves against ``param_shapes`` of the
per-device config (the single source of the parameter layout), so a table row that splits
anything but heads or channels fails loudly.

The KDA conv-state pool ``conv [S, K-1, 3*H*Dk]`` packs q, k, v channels; split over
``tensor``, each device holds ``[q | k | v]`` of its own heads, so the global array's channels
are ordered device by device. ``natural_conv`` reorders them for comparison with an unsharded
state; nothing else reads the global order.

A sharded step, built once per engine (``ShardedStep`` holds its own compiled functions)::

    mesh = make_mesh(2, 4)
    params = shard_params(params, config, mesh)          # or kimi_linear.load(path, mesh=mesh)
    state = ServingState.create(config, ..., mesh=mesh)  # D stacked shards
    run = ShardedStep(config, mesh)
    state, rows = run.alloc_rows(state, [2, 1])          # local row ids, per data shard
    batch = run.make_batch([[WorkItem(1, 0, ids)], [WorkItem(1, 0, ids2)]], **bucket)
    state, out = run(params, state, batch)               # out.next_token_ids [D, B]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Shaped

from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear
from hybridattn.pools import alloc_reqs

DATA, TENSOR = "data", "tensor"
EXPERTS = (DATA, TENSOR)  # routed experts: split over both axes together

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

#: Batches: every leaf of a stacked ``ModelWorkerBatch`` is ``[D, ...]``, split over data.
BATCH_SPEC = P(DATA)


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


def mesh_sizes(mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """``(data, tensor)`` sizes of a mesh with those two axes; ValueError otherwise.

    >>> mesh_sizes(make_mesh(1, 1))
    (1, 1)
    """
    if tuple(mesh.axis_names) != (DATA, TENSOR):
        raise ValueError(f"mesh axes are {tuple(mesh.axis_names)}, expected ('data', 'tensor')"
                         " (hybridattn.sharding.make_mesh)")
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


def param_specs(config: KimiLinearConfig, mesh: jax.sharding.Mesh, dtype=jnp.float32):
    """The ``PartitionSpec`` of every leaf of ``kimi_linear.param_shapes(config)``, from
    ``PARAM_RULES``. Raises ValueError for a count the mesh does not divide, and checks that
    every leaf split over ``tensor`` alone has the per-device shape of
    ``param_shapes(local_config(config, tensor))``.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> specs = param_specs(cfg, make_mesh(1, 1))
    >>> specs["model"]["layers"][0]["self_attn"]["o_proj"]["weight"]
    P(None, 'tensor')
    """
    data, tensor = mesh_sizes(mesh)
    check_divisible(config, data, tensor)
    shapes = kimi_linear.param_shapes(config, dtype)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: PARAM_RULES.get(_leaf_key(path, config), P()), shapes)
    local = jax.tree.leaves(kimi_linear.param_shapes(local_config(config, tensor), dtype))
    for (path, full), spec, loc in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                       jax.tree.leaves(specs, is_leaf=_is_spec), local,
                                       strict=True):
        # MoE leaves split experts or shared-expert channels, which a config cannot shrink
        # without shrinking the routed experts too: divisibility is all we check there.
        if _leaf_key(path, config).startswith("moe."):
            _shard_shape(full.shape, spec, {DATA: data, TENSOR: tensor})
        elif tuple(spec):
            per_device = _shard_shape(full.shape, spec, {DATA: data, TENSOR: tensor})
            if per_device != loc.shape:
                raise ValueError(f"{jax.tree_util.keystr(path)}: PARAM_RULES split {full.shape}"
                                 f" to {per_device} per device; param_shapes of the per-device"
                                 f" config says {loc.shape}")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _shard_shape(shape, spec, sizes) -> tuple[int, ...]:
    out = list(shape)
    for i, axes in enumerate(spec):
        for a in (axes,) if isinstance(axes, str) else (axes or ()):
            if out[i] % sizes[a]:
                raise ValueError(f"dimension {i} of shape {tuple(shape)} is not divisible by "
                                 f"the mesh's {a} size {sizes[a]}")
            out[i] //= sizes[a]
    return tuple(out)


def stacked_param_specs(specs, config: KimiLinearConfig):
    """``param_specs`` in the layout of ``kimi_linear.stack_layers``: a stacked layer's leaves
    gain a leading unsplit (repeat or layer) axis.

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> specs = stacked_param_specs(param_specs(cfg, make_mesh(1, 1)), cfg)
    >>> specs["model"]["layers"].kda["self_attn"]["o_proj"]["weight"]  # [layers, D, H Dv]
    P(None, None, 'tensor')
    """
    layers = specs["model"]["layers"]
    if isinstance(layers, kimi_linear.STACKED):
        return specs
    stacked = kimi_linear.stack_layer_list(
        layers, config,
        lambda items: jax.tree.map(lambda sp: P(None, *sp), items[0], is_leaf=_is_spec))
    return {**specs, "model": {**specs["model"], "layers": stacked}}


def param_shardings(config: KimiLinearConfig, mesh: jax.sharding.Mesh, dtype=jnp.float32,
                    *, stacked: bool = False):
    """``param_specs`` as ``NamedSharding``s on ``mesh`` (``stacked``: in the layout of
    ``kimi_linear.stack_layers``).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> param_shardings(cfg, make_mesh(1, 1))["model"]["layers"][1]["block_sparse_moe"][
    ...     "experts"]["w1"].spec
    P(('data', 'tensor'), None, None)
    """
    specs = param_specs(config, mesh, dtype)
    if stacked:
        specs = stacked_param_specs(specs, config)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_params(params, config: KimiLinearConfig, mesh: jax.sharding.Mesh):
    """``params`` placed on ``mesh`` by ``PARAM_RULES`` (each device receives only its
    shard).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = shard_params(kimi_linear.init_params(cfg, jax.random.key(0)), cfg,
    ...                       make_mesh(1, 1))
    >>> params["model"]["layers"][0]["self_attn"]["q_proj"]["weight"].sharding.spec
    P('tensor', None)
    """
    stacked = isinstance(params["model"]["layers"], kimi_linear.STACKED)
    return jax.device_put(params, param_shardings(config, mesh, stacked=stacked))


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

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = create_state(cfg, make_mesh(1, 1), max_running_requests=2, max_context_len=8,
    ...                      num_token_slots=18)
    >>> specs = state_specs(state)
    >>> specs.recurrent_state_pool.ssm, specs.token_to_kv_pool.c_kv, specs.rng
    (P('data', None, None, 'tensor'), P('data',), P())
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: _state_leaf_spec(path), state)


def create_state(config: KimiLinearConfig, mesh: jax.sharding.Mesh, *,
                 max_running_requests: int, max_context_len: int, num_token_slots: int,
                 dtype=jnp.float32, chunk_size: int = 32, seed: int = 0,
                 num_snapshot_slots: int = 0):
    """A sharded ``ServingState`` (``ServingState.create(..., mesh=mesh)`` calls this):
    ``D`` = ``mesh``'s data size shards, each with ``max_running_requests / D`` rows and
    ``num_token_slots / D`` token slots (its own sink included), built in place on the mesh
    (no shard passes through another device).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = create_state(cfg, make_mesh(1, 1), max_running_requests=2, max_context_len=8,
    ...                      num_token_slots=18)
    >>> state.mesh_shape, state.token_to_kv_pool.c_kv.shape  # [D, Lm, slots, kv_lora_rank]
    ((1, 1), (1, 1, 18, 32))
    """
    from hybridattn.serving import ServingState

    data, tensor = mesh_sizes(mesh)
    check_divisible(config, data, tensor)
    for name, n in (("max_running_requests", max_running_requests),
                    ("num_token_slots", num_token_slots),
                    ("num_snapshot_slots", num_snapshot_slots)):
        if n % data:
            raise ValueError(f"{name}={n} is not divisible by the mesh's data size {data}")

    def build():
        one = ServingState.create(
            config, max_running_requests=max_running_requests // data,
            max_context_len=max_context_len, num_token_slots=num_token_slots // data,
            dtype=dtype, chunk_size=chunk_size, seed=seed,
            num_snapshot_slots=num_snapshot_slots // data)
        stacked = jax.tree_util.tree_map_with_path(
            lambda path, x: x if path[0].name == "rng"
            else jnp.broadcast_to(x[None], (data, *x.shape)), one)
        return stacked.replace(mesh_shape=(data, tensor))

    shapes = jax.eval_shape(build)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(shapes),
                             is_leaf=_is_spec)
    return jax.jit(build, out_shardings=shardings)()


def natural_conv(conv: Shaped[Array, "*lead C"], tensor: int) -> Shaped[Array, "*lead C"]:
    """A sharded conv-state pool ``[..., 3*H*Dk]`` (channels device by device, each device
    ``[q | k | v]`` of its heads) in the unsharded order ``[q | k | v]`` of all heads.

    >>> c = jnp.arange(12)  # 2 devices, q|k|v of 2 channels each
    >>> natural_conv(c, 2).tolist()
    [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    """
    *lead, C = conv.shape
    x = conv.reshape(*lead, tensor, 3, C // (3 * tensor))
    return jnp.swapaxes(x, -3, -2).reshape(*lead, C)


def shard(state, k: int):
    """Data shard ``k`` of a sharded state, as an ordinary single-device ``ServingState``
    (for inspection and tests; conv channels in the sharded order, see ``natural_conv``).

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = create_state(cfg, make_mesh(1, 1), max_running_requests=2, max_context_len=8,
    ...                      num_token_slots=18)
    >>> one = shard(state, 0)
    >>> one.mesh_shape, one.token_to_kv_pool.c_kv[0].shape
    (None, (18, 32))
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if path[0].name == "rng" else x[k], state).replace(mesh_shape=None)


def stack_batches(batches: Sequence, mesh: jax.sharding.Mesh):
    """One ``ModelWorkerBatch`` per data shard (same buckets, local row ids) stacked into the
    sharded step's batch, placed on ``mesh`` (``BATCH_SPEC``).

    >>> from hybridattn.serving import WorkItem, make_worker_batch
    >>> b = make_worker_batch([WorkItem(1, 0, [5, 6, 7])], vocab_size=64, max_context_len=8)
    >>> stack_batches([b], make_mesh(1, 1)).input_ids.shape  # [D, T]
    (1, 3)
    """
    data, _ = mesh_sizes(mesh)
    if len(batches) != data:
        raise ValueError(f"{len(batches)} batches for a mesh with data size {data}")
    defs = {jax.tree.structure(b) for b in batches}
    if len(defs) != 1:
        raise ValueError("the batches of one sharded step must share their buckets "
                         "(forward_mode, kv_width, max_extend_len and array shapes)")
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)
    return jax.device_put(stacked, NamedSharding(mesh, BATCH_SPEC))


# --------------------------------------------------------------------------------------------
# the collectives and the step
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshComm:
    """How one device's shard of a layer joins the others (``comm`` of ``serving.step``).
    Its methods run inside ``jax.shard_map`` over a ``(data, tensor)`` mesh of these sizes;
    on a 1x1 mesh they are the one-device computation.

    >>> MeshComm(data=1, tensor=1).reduce_rows(jnp.ones(2))
    Array([1., 1.], dtype=float32)
    """

    data: int
    tensor: int

    def reduce_rows(self, y):
        """Sum of the tensor shards' partial outputs of a row-parallel projection."""
        return lax.psum(y, TENSOR) if self.tensor > 1 else y

    def routed_experts(self, x, idx, weights, experts):
        """Routed experts with the experts split over ``(data, tensor)``: gather every data
        shard's tokens, compute this device's experts' share, sum the shares back onto the
        tokens' own data shard."""
        if self.data * self.tensor == 1:
            return kimi_linear.routed_experts(x, idx, weights, experts)
        if self.data > 1:
            x, idx, weights = (lax.all_gather(a, DATA, axis=0, tiled=True)
                               for a in (x, idx, weights))
        n_local = experts["w1"].shape[0]
        first = (lax.axis_index(DATA) * self.tensor + lax.axis_index(TENSOR)) * n_local
        y = kimi_linear.routed_experts(x, idx, weights, experts, first_expert=first)
        if self.data > 1:
            y = lax.psum_scatter(y, DATA, scatter_dimension=0, tiled=True)
        return lax.psum(y, TENSOR) if self.tensor > 1 else y


def _is_rng(path) -> bool:
    """Whether a leaf is the state's base sampling key (replicated, not stacked); a bare
    array (an empty path) is not."""
    return bool(path) and getattr(path[0], "name", None) == "rng"


def _unstack(tree):
    return jax.tree_util.tree_map_with_path(lambda path, x: x if _is_rng(path) else x[0], tree)


def _restack(tree):
    return jax.tree_util.tree_map_with_path(lambda path, x: x if _is_rng(path) else x[None],
                                            tree)


def _padding_like(batch):
    """A batch of ``batch``'s buckets whose every row is padding (row 0, no tokens, greedy)."""
    pad = jax.tree.map(jnp.zeros_like, batch)
    return pad.replace(top_ps=jnp.ones_like(batch.top_ps))


class ShardedStep:
    """The serving step (and the host helpers a scheduler needs) on ``mesh``, compiled for
    this object alone: ``state, out = run(params, state, batch)`` with ``in_shardings`` /
    ``out_shardings`` from the table and the state donated, so every output keeps its input's
    sharding and the pools update in place. ``out.next_token_ids [D, B]``, ``out.ok [D]``;
    ``out.logits [D, B, V]`` only with ``logits=True`` (else None).

    >>> from hybridattn.serving import ServingState, WorkItem
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> mesh = make_mesh(1, 1)
    >>> params = shard_params(kimi_linear.init_params(cfg, jax.random.key(0)), cfg, mesh)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=8,
    ...                             num_token_slots=18, mesh=mesh)
    >>> run = ShardedStep(cfg, mesh)
    >>> state, rows = run.alloc_rows(state, [1])
    >>> rows
    [[1]]
    >>> batch = run.make_batch([[WorkItem(1, 0, [5, 6, 7])]], vocab_size=64, max_context_len=8,
    ...                        num_requests=2, num_tokens=4)
    >>> state, out = run(params, state, batch)
    >>> out.next_token_ids.shape, out.ok.tolist(), out.logits is None
    ((1, 2), [True], True)
    """

    def __init__(self, config: KimiLinearConfig, mesh: jax.sharding.Mesh, *,
                 logits: bool = False, dtype=jnp.float32, scan_layers: bool = False):
        self.config, self.mesh = config, mesh
        self.data, self.tensor = mesh_sizes(mesh)
        check_divisible(config, self.data, self.tensor)
        self.local_config = local_config(config, self.tensor)
        self.comm = MeshComm(self.data, self.tensor)
        self.logits = logits
        # scan_layers: params in the layout of kimi_linear.stack_layers (its repeated layers
        # run as one lax.scan inside each device's step)
        self.param_shardings = param_shardings(config, mesh, dtype, stacked=scan_layers)
        self._param_specs = param_specs(config, mesh, dtype)
        if scan_layers:
            self._param_specs = stacked_param_specs(self._param_specs, config)
        self._compiled: dict[Any, Any] = {}
        # per engine, not global: traces of this object's functions (the step's variants, row
        # allocations, releases), i.e. its compilations
        self.trace_count = 0

    # -- the per-shard view ------------------------------------------------------------------

    def _local(self, state):
        b = state.backend
        t = self.tensor
        backend = b.replace(
            full_attn_backend=b.full_attn_backend.replace(
                num_heads=b.full_attn_backend.num_heads // t),
            linear_attn_backend=b.linear_attn_backend.replace(
                num_heads=b.linear_attn_backend.num_heads // t))
        return _unstack(state).replace(config=self.local_config, backend=backend,
                                       mesh_shape=None)

    def _global(self, local, like):
        return _restack(local).replace(config=like.config, backend=like.backend,
                                       mesh_shape=like.mesh_shape)

    def _shardings(self, tree_specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), tree_specs, is_leaf=_is_spec)

    def _check_state(self, state):
        if state.mesh_shape != (self.data, self.tensor):
            raise ValueError(f"state.mesh_shape={state.mesh_shape}, expected "
                             f"{(self.data, self.tensor)}: build it with "
                             "ServingState.create(..., mesh=mesh) on this step's mesh")

    # -- the step ----------------------------------------------------------------------------

    def _build_step(self, state_spec):
        from hybridattn.serving import StepOutput
        from hybridattn.serving import step as serving_step

        want_logits = self.logits

        def body(params, state, batch):
            self.trace_count += 1
            new, out = serving_step(params, self._local(state), _unstack(batch), self.comm)
            out = StepOutput(out.next_token_ids[None],
                             out.logits[None] if want_logits else None, out.ok[None])
            return self._global(new, state), out

        out_spec = StepOutput(P(DATA), P(DATA) if want_logits else None, P(DATA))
        sharded = jax.shard_map(body, mesh=self.mesh,
                                in_specs=(self._param_specs, state_spec, BATCH_SPEC),
                                out_specs=(state_spec, out_spec), check_vma=False)
        state_sh = self._shardings(state_spec)
        batch_sh = NamedSharding(self.mesh, BATCH_SPEC)
        return jax.jit(sharded, in_shardings=(self.param_shardings, state_sh, batch_sh),
                       out_shardings=(state_sh, self._shardings(out_spec)),
                       donate_argnums=1)

    def jitted(self, state):
        """The jitted sharded step for states shaped like ``state`` (cached per treedef)."""
        self._check_state(state)
        key = jax.tree.structure(state)
        if key not in self._compiled:
            self._compiled[key] = self._build_step(state_specs(state))
        return self._compiled[key]

    def __call__(self, params, state, batch):
        return self.jitted(state)(params, state, batch)

    def lower(self, params, state, batch):
        """``jax.jit(...).lower`` of the step (for ``compile().as_text()`` / memory stats)."""
        return self.jitted(state).lower(params, state, batch)

    # -- host helpers ------------------------------------------------------------------------

    def make_batch(self, items_per_shard, **bucket):
        """``serving.make_worker_batch`` per data shard (local rows; a shard with no items is
        all padding) stacked with ``stack_batches``; ``bucket`` must fix ``num_requests`` and
        ``num_tokens`` so the shards agree."""
        from hybridattn.serving import make_worker_batch

        if len(items_per_shard) != self.data:
            raise ValueError(f"{len(items_per_shard)} item lists for {self.data} data shards")
        if not any(items_per_shard):
            raise ValueError("a sharded batch needs at least one request on some data shard")
        batches = [make_worker_batch(items, **bucket) if items else None
                   for items in items_per_shard]
        like = next(b for b in batches if b is not None)
        return stack_batches([_padding_like(like) if b is None else b for b in batches],
                             self.mesh)

    def _map(self, fn, state, *args, key):
        """``fn(local_state, *local_args) -> (local_state, outs)`` run on every shard."""
        self._check_state(state)
        ck = (key, jax.tree.structure(state))
        if ck not in self._compiled:
            spec = state_specs(state)

            def body(state, *args):
                self.trace_count += 1
                new, outs = fn(self._local(state), *_unstack(args))
                return self._global(new, state), _restack(outs)

            sharded = jax.shard_map(body, mesh=self.mesh,
                                    in_specs=(spec, *(P(DATA),) * len(args)),
                                    out_specs=(spec, P(DATA)), check_vma=False)
            sh = self._shardings(spec)
            self._compiled[ck] = jax.jit(sharded, out_shardings=(sh, NamedSharding(
                self.mesh, P(DATA))), donate_argnums=0)
        args = tuple(jax.device_put(np.asarray(a), NamedSharding(self.mesh, P(DATA)))
                     for a in args)
        return self._compiled[ck](state, *args)

    def alloc_rows(self, state, counts: Sequence[int]):
        """Take ``counts[k]`` request rows on data shard ``k``: ``(state, rows)`` with
        ``rows[k]`` the list of shard ``k``'s new (local) row ids. ValueError if a shard has
        too few free rows (``state`` is donated: use ``try_alloc_rows`` to keep the new state
        when that happens)."""
        new, rows, ok = self.try_alloc_rows(state, counts)
        if not ok.all():
            raise ValueError(f"data shards {np.flatnonzero(~ok).tolist()} have too few free "
                             f"request rows for counts={list(map(int, counts))}")
        return new, rows

    def try_alloc_rows(self, state, counts: Sequence[int]):
        """``alloc_rows`` returning the flags: ``(state, rows, ok)``, ``ok[k]`` False when
        shard ``k`` had too few free rows (then it allocated nothing and ``rows[k]`` is
        empty)."""
        counts = np.asarray(counts, np.int32)
        if counts.shape != (self.data,):
            raise ValueError(f"counts has shape {counts.shape}, expected ({self.data},)")
        width = max(int(counts.max()), 1)

        def fn(local, n):
            pool, rows, ok = alloc_reqs(local.req_to_token_pool, n, width)
            return local.replace(req_to_token_pool=pool), (rows, ok)

        new, (rows, ok) = self._map(fn, state, counts, key=("alloc", width))
        ok, rows = np.asarray(ok), np.asarray(rows)
        return new, [rows[k, : counts[k]].tolist() if ok[k] else [] for k in range(self.data)], ok

    def release(self, state, rows_per_shard: Sequence[Sequence[int]]):
        """Free the given local rows (and their token and state slots) on each data shard."""
        from hybridattn.serving import release

        width = max(max((len(r) for r in rows_per_shard), default=1), 1)
        rows = np.zeros((self.data, width), np.int32)
        for k, r in enumerate(rows_per_shard):
            rows[k, : len(r)] = r

        def fn(local, r):
            return release(local, r), r

        new, _ = self._map(fn, state, rows, key=("release", width))
        return new


__all__ = [
    "BATCH_SPEC",
    "DATA",
    "EXPERTS",
    "MeshComm",
    "PARAM_RULES",
    "ShardedStep",
    "TENSOR",
    "check_divisible",
    "create_state",
    "local_config",
    "make_mesh",
    "mesh_sizes",
    "natural_conv",
    "param_shardings",
    "param_specs",
    "shard",
    "shard_params",
    "stacked_param_specs",
    "stack_batches",
    "state_specs",
]
