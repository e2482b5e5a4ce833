"""The serving state (:class:`ServingState`: the pools, allocators, backend and sampling key
one model serves from), its sharded constructor :func:`create_state`, and what a step returns
(:class:`StepOutput`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jaxtyping import Array, Bool, Float, Int, Key

from hybridattn.backends import (
    HybridLinearAttnBackend,
    MLAAttnBackend,
    attn_backend_wrapper,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.mesh import check_divisible, is_spec, mesh_sizes, state_specs
from hybridattn.models.kimi_linear.params import check_supported
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    RecurrentStatePool,
    SlotAllocator,
)
from hybridattn.pytree import pytree_dataclass
from servecore.validate import check_int

__all__ = [
    "create_state",
    "ServingState",
    "StepOutput",
]

# Shape aliases:
#   B  requests in the batch (padding rows use request row 0)
#   T  tokens in the batch (new tokens packed request by request, padding at the tail)
#   V  vocabulary
#   N  decode steps of one ``decode_steps`` call


@pytree_dataclass(static=("config", "mesh_shape"))
class ServingState:
    """Everything a serving step reads and writes (all arrays) plus the static model config.

    ``backend`` carries only static configuration between steps (its per-forward metadata is
    ``None``); it is a child so that a state is self-contained: ``step(params, state, batch)``.
    Build one with ``create``; take request rows from ``req_to_token_pool`` before a step
    names them, and give them back with ``release``.

    >>> from hybridattn.pools import alloc_reqs_or_raise
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> cfg.kda_layer_ids, cfg.full_attention_layer_ids
    ((0,), (1,))
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> state.max_running_requests, state.max_context_len, state.token_allocator.capacity
    (2, 16, 32)
    >>> state.token_to_kv_pool.c_kv[0].shape  # MLA latents: [token slots, kv_lora_rank]
    (33, 32)
    >>> state.recurrent_state_pool.ssm[0].shape  # KDA states: [state slots, H, Dk, Dv]
    (3, 4, 16, 16)
    >>> pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 2)
    >>> state = state.replace(req_to_token_pool=pool)
    >>> rows.tolist()
    [1, 2]
    """

    req_to_token_pool: HybridReqToTokenPool
    token_allocator: SlotAllocator
    token_to_kv_pool: MLATokenPool
    recurrent_state_pool: RecurrentStatePool
    backend: HybridLinearAttnBackend | MLAAttnBackend
    rng: Key[Array, ""]
    config: KimiLinearConfig
    snapshot_pool: RecurrentStatePool | None = None
    mesh_shape: tuple[int, int] | None = None

    @classmethod
    def create(
        cls,
        config: KimiLinearConfig,
        *,
        max_running_requests: int,
        max_context_len: int,
        num_token_slots: int,
        dtype=jnp.float32,
        chunk_size: int = 32,
        seed: int = 0,
        num_snapshot_slots: int = 0,
        mesh=None,
    ) -> ServingState:
        """Empty pools for ``max_running_requests`` requests of up to ``max_context_len``
        tokens sharing ``num_token_slots`` MLA token slots (slot 0, the sink, included).
        ``dtype`` is the MLA latent and conv-state dtype (KDA states are always float32);
        ``chunk_size`` is the KDA prefill chunk; ``seed`` makes the base sampling key;
        ``num_snapshot_slots`` (the sink included; 0: none) sizes the ``snapshot_pool``, a
        ``RecurrentStatePool`` of the same layout whose slots a prefix cache fills with exact
        copies of request states (``step`` takes and restores them). Raises ``ValueError``
        for a config that is not hybrid (KDA and MLA layers both).

        With a ``(data, tensor)`` ``mesh`` (``hybridattn.mesh.make_mesh``) the state is
        sharded (:func:`create_state`): ``data`` stacked shards, each with
        ``max_running_requests / data`` rows and ``num_token_slots / data`` token slots (its
        own sinks included), KDA states split by head; ``mesh_shape`` records the mesh."""
        if mesh is not None:
            return create_state(
                config, mesh, max_running_requests=max_running_requests,
                max_context_len=max_context_len, num_token_slots=num_token_slots, dtype=dtype,
                chunk_size=chunk_size, seed=seed, num_snapshot_slots=num_snapshot_slots)
        check_supported(config)
        if not config.kda_layer_ids or not config.full_attention_layer_ids:
            raise ValueError(
                f"ServingState serves hybrid models: KDA layers {config.kda_layer_ids} and MLA "
                f"layers {config.full_attention_layer_ids} must both be non-empty")
        req = HybridReqToTokenPool.create(max_running_requests, max_context_len)
        H, Dk = config.linear_num_heads, config.linear_head_dim
        kv = MLATokenPool.create(
            config.full_attention_layer_ids, num_token_slots, config.kv_lora_rank,
            config.qk_rope_head_dim, dtype=dtype,
        )
        states = RecurrentStatePool.create(
            config.kda_layer_ids, req.num_state_slots, 3 * H * Dk, config.linear_conv_kernel_dim,
            H, Dk, Dk, dtype=dtype,
        )
        snapshots = None
        if num_snapshot_slots:
            check_int("num_snapshot_slots", num_snapshot_slots, 2)
            snapshots = RecurrentStatePool.create(
                config.kda_layer_ids, num_snapshot_slots, 3 * H * Dk,
                config.linear_conv_kernel_dim, H, Dk, Dk, dtype=dtype)
        backend = attn_backend_wrapper(
            config, MLAAttnBackend.from_config(config, num_token_slots),
            num_state_slots=req.num_state_slots, chunk_size=chunk_size,
        )
        return cls(
            req_to_token_pool=req,
            token_allocator=SlotAllocator.create(num_token_slots),
            token_to_kv_pool=kv,
            recurrent_state_pool=states,
            backend=backend,
            rng=jax.random.key(seed),
            config=config,
            snapshot_pool=snapshots,
        )

    @property
    def max_running_requests(self) -> int:
        """Requests that fit at once: request rows, state slots and, for full contexts, the
        token slots (``backend.get_max_running_requests``), whichever is least."""
        return min(self.req_to_token_pool.max_running_requests,
                   self.backend.get_max_running_requests(self.max_context_len))

    @property
    def max_context_len(self) -> int:
        """Positions per request row: the longest prompt + generation a request may reach."""
        return self.req_to_token_pool.max_context_len

class StepOutput(NamedTuple):
    """What a step returns besides the new state: per request the sampled next token and the
    last new token's logits (float32), and ``ok``; per token of the batch the token slot its
    KV went to (``token_slots``, 0 for padding and for positions below a borrowed prefix,
    whose slots stay the borrowed ones), so a host can follow each row's slots without reading
    ``req_to_token`` back. ``ok`` False: the token slots ran out or the batch did not fit its
    buckets / named a free row; every request ran as padding, so only the slot-0 sinks
    changed, the tokens and slots are 0 and the logits meaningless.

    Its shapes, from ``jax.eval_shape`` (traces the step, computes and compiles nothing):

    >>> from hybridattn.serving import WorkItem, make_worker_batch, step
    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> batch = make_worker_batch([WorkItem(1, 0, [5, 6, 7]), WorkItem(2, 0, [8, 9])],
    ...                           vocab_size=64, max_context_len=16)
    >>> _, out = jax.eval_shape(step, kimi_linear.param_shapes(cfg), state, batch)
    >>> out.next_token_ids.shape, out.logits.shape, out.ok.shape  # [B], [B, V], []
    ((2,), (2, 64), ())
    >>> out.token_slots.shape  # [T]
    (5,)
    """

    next_token_ids: Int[Array, " B"]
    logits: Float[Array, "B V"]
    ok: Bool[Array, ""]
    token_slots: Int[Array, " T"] | None = None



def create_state(config: KimiLinearConfig, mesh: jax.sharding.Mesh, *,
                 max_running_requests: int, max_context_len: int, num_token_slots: int,
                 dtype=jnp.float32, chunk_size: int = 32, seed: int = 0,
                 num_snapshot_slots: int = 0):
    """A sharded ``ServingState`` (``ServingState.create(..., mesh=mesh)`` calls this):
    ``D`` = ``mesh``'s data size shards, each with ``max_running_requests / D`` rows and
    ``num_token_slots / D`` token slots (its own sink included), built in place on the mesh
    (no shard passes through another device).

    >>> from hybridattn.mesh import make_mesh
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = create_state(cfg, make_mesh(1, 1), max_running_requests=2, max_context_len=8,
    ...                      num_token_slots=18)
    >>> state.mesh_shape, state.token_to_kv_pool.c_kv.shape  # [D, Lm, slots, kv_lora_rank]
    ((1, 1), (1, 1, 18, 32))
    """
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
                             is_leaf=is_spec)
    return jax.jit(build, out_shardings=shardings)()
