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
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Shaped

from hybridattn import serving
from hybridattn.config import KimiLinearConfig
from hybridattn.mesh import (
    BATCH_SPEC,
    DATA,
    TENSOR,
    check_divisible,
    is_spec,
    local_config,
    mesh_sizes,
    state_specs,
)
from hybridattn.models import kimi_linear
from hybridattn.models.kimi_linear.partitioning import (
    param_shardings,
    param_specs,
    stacked_param_specs,
)
from hybridattn.pools import alloc_reqs, claim_reqs, free

__all__ = [
    "MeshComm",
    "ShardedStep",
    "natural_conv",
    "place",
    "shard",
    "shard_params",
    "stack_batches",
    "to_host",
]

def shard_params(params, config: KimiLinearConfig, mesh: jax.sharding.Mesh):
    """``params`` placed on ``mesh`` by ``PARAM_RULES`` (each device receives only its
    shard).

    >>> from hybridattn.mesh import make_mesh
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = shard_params(kimi_linear.init_params(cfg, jax.random.key(0)), cfg,
    ...                       make_mesh(1, 1))
    >>> params["model"]["layers"][0]["self_attn"]["q_proj"]["weight"].sharding.spec
    P('tensor', None)
    """
    stacked = isinstance(params["model"]["layers"], kimi_linear.STACKED)
    shardings = param_shardings(config, mesh, stacked=stacked)
    if mesh.is_multi_process:  # each process places its own devices' shards (``place``)
        return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s
                            else place(np.asarray(x), s), params, shardings)
    return jax.device_put(params, shardings)


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

    >>> from hybridattn.mesh import make_mesh
    >>> from hybridattn.serving import create_state
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

    >>> from hybridattn.mesh import make_mesh
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
    return jax.tree.map(lambda a: place(a, NamedSharding(mesh, BATCH_SPEC)), stacked)


def place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The host array ``value`` as a global array of ``sharding``; with several processes
    (``jax.distributed``) every process passes the same ``value`` and places the shards of
    its own devices (a ``jax.device_put`` across processes would need them all).

    >>> from hybridattn.mesh import make_mesh
    >>> place(np.arange(4), NamedSharding(make_mesh(1, 1), P("data"))).tolist()
    [0, 1, 2, 3]
    """
    value = np.asarray(value)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(x: Any) -> np.ndarray:
    """``x`` (an output of a sharded call) as one NumPy array of its global value; a shard
    another process holds comes through JAX's collectives (``process_allgather``), so every
    process must ask for it at the same point.

    >>> to_host(jnp.arange(3)).tolist()
    [0, 1, 2]
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


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

    >>> from hybridattn.mesh import make_mesh
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
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), tree_specs, is_leaf=is_spec)

    def abstract(self, state):
        """``state``'s shapes (arrays or ``ShapeDtypeStruct``\\ s) as ``ShapeDtypeStruct``\\ s
        placed as this step places them: what ``lower`` needs to compile the step before a
        state exists."""
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            state, self._shardings(state_specs(state)))

    def _check_state(self, state):
        if state.mesh_shape != (self.data, self.tensor):
            raise ValueError(f"state.mesh_shape={state.mesh_shape}, expected "
                             f"{(self.data, self.tensor)}: build it with "
                             "ServingState.create(..., mesh=mesh) on this step's mesh")

    # -- the step ----------------------------------------------------------------------------

    def _build_step(self, state_spec):

        want_logits = self.logits

        def body(params, state, batch):
            self.trace_count += 1
            new, out = serving.step(params, self._local(state), _unstack(batch), self.comm)
            out = serving.StepOutput(out.next_token_ids[None],
                             out.logits[None] if want_logits else None, out.ok[None])
            return self._global(new, state), out

        out_spec = serving.StepOutput(P(DATA), P(DATA) if want_logits else None, P(DATA))
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

        if len(items_per_shard) != self.data:
            raise ValueError(f"{len(items_per_shard)} item lists for {self.data} data shards")
        if not any(items_per_shard):
            raise ValueError("a sharded batch needs at least one request on some data shard")
        batches = [serving.make_worker_batch(items, **bucket) if items else None
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
        args = tuple(place(a, NamedSharding(self.mesh, P(DATA))) for a in args)
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
        ok, rows = to_host(ok), to_host(rows)
        return new, [rows[k, : counts[k]].tolist() if ok[k] else [] for k in range(self.data)], ok

    def claim_rows(self, state, rows_per_shard: Sequence[Sequence[int]]):
        """Claim the local rows a host names on each data shard (``pools.claim_reqs``; the
        host owns the ids): ``(state, ok)``, ``ok [D]`` left on the device, False where a
        shard refused (a row in use or out of range; that shard then changed nothing)."""
        width = max(max((len(r) for r in rows_per_shard), default=1), 1)
        rows = np.zeros((self.data, width), np.int32)
        for k, r in enumerate(rows_per_shard):
            rows[k, : len(r)] = r

        def fn(local, r):
            pool, ok = claim_reqs(local.req_to_token_pool, r)
            return local.replace(req_to_token_pool=pool), ok

        return self._map(fn, state, rows, key=("claim", width))

    def release(self, state, rows_per_shard: Sequence[Sequence[int]],
                keep_from: Sequence[Sequence[int]] | None = None,
                snapshot_slots: Sequence[Sequence[int]] | None = None):
        """Free the given local rows (and their token and state slots) on each data shard;
        with a prefix cache, ``keep_from`` and ``snapshot_slots`` per row as
        ``serving.release`` takes them (the positions the cache keeps, the snapshot of the
        end)."""
        width = _width(rows_per_shard)
        rows = _padded(rows_per_shard, width, 0)
        if keep_from is None:

            def fn(local, r):
                return serving.release(local, r), r

            new, _ = self._map(fn, state, rows, key=("release", width))
            return new
        keep = _padded(keep_from, width, np.iinfo(np.int32).max)
        snaps = _padded(snapshot_slots, width, 0)

        def keeping(local, r, k, s):
            return serving.release(local, r, keep_from=k, snapshot_slots=s), r

        new, _ = self._map(keeping, state, rows, keep, snaps, key=("release-keep", width))
        return new

    def admit(self, state, rows_per_shard: Sequence[Sequence[int]],
              slots_per_row: Sequence[Sequence[Sequence[int]]],
              computed: Sequence[Sequence[int]], kv_width: int):
        """Claim the named local rows on each data shard, each borrowing a cached prefix
        (``slots_per_row[k][i]``, padded to ``kv_width``) and recording ``computed`` tokens
        of state (a prefix cache hit): ``(state, ok [D])`` as ``claim_rows``."""
        width = _width(rows_per_shard)
        rows = _padded(rows_per_shard, width, 0)
        lens = _padded([[len(x) for x in per] for per in slots_per_row], width, 0)
        slots = _slot_table(slots_per_row, width, kv_width)
        done = _padded(computed, width, 0)

        def fn(local, r, n, ss, c):
            pool, ok = claim_reqs(local.req_to_token_pool, r)
            local = serving.borrow_prefix(local.replace(req_to_token_pool=pool), r, n, ss, c)
            return local, ok

        return self._map(fn, state, rows, lens, slots, done, key=("admit", width, kv_width))

    def borrow(self, state, rows_per_shard: Sequence[Sequence[int]],
               slots_per_row: Sequence[Sequence[Sequence[int]]], kv_width: int):
        """Point each named row's first positions at a prefix cache's token slots
        (``serving.borrow_prefix``), on each data shard."""
        width = _width(rows_per_shard)
        rows = _padded(rows_per_shard, width, 0)
        lens = _padded([[len(x) for x in per] for per in slots_per_row], width, 0)
        slots = _slot_table(slots_per_row, width, kv_width)

        def fn(local, r, n, ss):
            return serving.borrow_prefix(local, r, n, ss), r

        new, _ = self._map(fn, state, rows, lens, slots, key=("borrow", width, kv_width))
        return new

    def free_tokens(self, state, slots_per_shard: Sequence[Sequence[int]]):
        """Give the named token slots back to each data shard's allocator (slots a prefix
        cache evicted; 0 is the sink and ignored)."""
        width = 1 << max(_width(slots_per_shard) - 1, 0).bit_length()  # a compile per 2^k
        slots = _padded(slots_per_shard, width, 0)

        def fn(local, ss):
            return local.replace(token_allocator=free(local.token_allocator, ss)), ss

        new, _ = self._map(fn, state, slots, key=("free", width))
        return new


def _width(lists: Sequence[Sequence[Any]]) -> int:
    return max(max((len(x) for x in lists), default=1), 1)


def _padded(lists: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
    """``[D, width]`` int32: ``lists[k]`` then ``fill``."""
    out = np.full((len(lists), width), fill, np.int32)
    for k, x in enumerate(lists):
        out[k, : len(x)] = x
    return out


def _slot_table(slots_per_row: Sequence[Sequence[Sequence[int]]], width: int,
                kv_width: int) -> np.ndarray:
    """``[D, width, kv_width]`` int32 of each shard's rows' token slots (0: padding)."""
    out = np.zeros((len(slots_per_row), width, kv_width), np.int32)
    for k, per in enumerate(slots_per_row):
        for i, x in enumerate(per):
            out[k, i, : len(x)] = x
    return out
