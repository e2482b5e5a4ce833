"""The KDA recurrent-state pool: per state slot and KDA layer, the short-conv inputs and
the delta-rule state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybridattn.pools.allocator import _check_int
from hybridattn.pools.indexing import (
    LayerRef,
    _check_layer_ids,
    _gather_rows,
    _layer_index,
    _scatter_rows,
    _two_or_more,
)
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "RecurrentStatePool",
    "copy_states",
    "copy_states_to",
    "get_states",
    "set_states",
]

@pytree_dataclass(static=("layer_ids",))
class RecurrentStatePool:
    """Per KDA layer, the short-conv state ``conv [S, K-1, C]`` (model dtype) and the delta-rule
    state ``ssm [S, H, Dk, Dv]`` (float32) of every state slot, stacked over the layers
    (``ssm [Lk, S, H, Dk, Dv]``). Slot 0 is the sink.

    ``layer_ids`` (static) are the model layer ids of the KDA layers, in order.

    >>> pool = RecurrentStatePool.create(layer_ids=(0, 1), num_slots=3, conv_dim=6,
    ...                                  conv_kernel=4, num_heads=2, head_k_dim=4, head_v_dim=4)
    >>> pool.conv[0].shape, pool.ssm[0].shape  # [S, K-1, C], [S, H, Dk, Dv]
    ((3, 3, 6), (3, 2, 4, 4))
    >>> pool.bytes_per_request  # float32: 2 layers x (3*6 + 2*4*4) x 4 bytes
    400
    """

    conv: Float[Array, "Lk S Km1 C"]
    ssm: Float[Array, "Lk S H Dk Dv"]
    layer_ids: tuple[int, ...]

    @classmethod
    def create(
        cls,
        layer_ids,
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype=jnp.float32,
    ) -> RecurrentStatePool:
        """Zero states for ``num_slots`` state slots (sink included) of every layer."""
        layer_ids = _check_layer_ids(layer_ids)
        _check_int("num_slots", num_slots, 2)
        _check_int("conv_dim", conv_dim, 1)
        _check_int("conv_kernel", conv_kernel, 1)
        _check_int("num_heads", num_heads, 1)
        _check_int("head_k_dim", head_k_dim, 1)
        _check_int("head_v_dim", head_v_dim, 1)
        n = len(layer_ids)
        return cls(
            conv=jnp.zeros((n, num_slots, conv_kernel - 1, conv_dim), dtype),
            ssm=jnp.zeros((n, num_slots, num_heads, head_k_dim, head_v_dim), jnp.float32),
            layer_ids=layer_ids,
        )

    @property
    def num_slots(self) -> int:
        """State slots, the sink included."""
        return self.ssm.shape[-4]

    @property
    def dtype(self):
        """The conv-state dtype (the SSM state is always float32)."""
        return self.conv.dtype

    @property
    def bytes_per_request(self) -> int:
        """Bytes of one state slot over all layers (conv + ssm)."""
        return sum(x.nbytes // self.num_slots for x in jax.tree.leaves(self))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def get_states(
    pool: RecurrentStatePool, layer_id: int | LayerRef, idx: Int[Array, " B"]
) -> tuple[Float[Array, "B Km1 C"], Float[Array, "B H Dk Dv"]]:
    """The states of layer ``layer_id`` at slots ``idx``: ``(conv [B, K-1, C], ssm [B, H, Dk,
    Dv])``.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> conv, ssm = get_states(pool, 0, jnp.array([2, 1, 0]))
    >>> conv.shape, ssm.shape
    ((3, 3, 6), (3, 2, 4, 4))
    """
    i = _layer_index("a KDA", pool.layer_ids, layer_id)
    return _gather_rows(pool.conv, i, idx), _gather_rows(pool.ssm, i, idx)


def set_states(
    pool: RecurrentStatePool,
    layer_id: int | LayerRef,
    idx: Int[Array, " B"],
    conv: Float[Array, "B Km1 C"],
    ssm: Float[Array, "B H Dk Dv"],
) -> RecurrentStatePool:
    """Write the states of layer ``layer_id`` at slots ``idx`` (``conv`` cast to the pool dtype,
    ``ssm`` to float32). Padding entries carry slot 0 and land in the sink.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> idx = jnp.array([2, 0])  # a request in slot 2, and a padding entry
    >>> pool = set_states(pool, 0, idx, jnp.ones((2, 3, 6)), jnp.ones((2, 2, 4, 4)))
    >>> pool.ssm[0][:, 0, 0, 0].tolist()  # slot 0 is the sink: its contents are junk
    [1.0, 0.0, 1.0, 0.0]
    """
    i = _layer_index("a KDA", pool.layer_ids, layer_id)
    if conv.shape[1:] != pool.conv.shape[2:] or ssm.shape[1:] != pool.ssm.shape[2:]:
        raise ValueError(
            f"conv {conv.shape} / ssm {ssm.shape} do not match the pool's per-slot shapes "
            f"{pool.conv.shape[2:]} / {pool.ssm.shape[2:]}"
        )
    return pool.replace(conv=_scatter_rows(pool.conv, i, idx, conv),
                        ssm=_scatter_rows(pool.ssm, i, idx, ssm.astype(jnp.float32)))


def copy_states(
    pool: RecurrentStatePool, src_idx: Int[Array, " B"], dst_idx: Int[Array, " B"]
) -> RecurrentStatePool:
    """Copy every layer's states from slots ``src_idx`` to slots ``dst_idx`` (all sources are
    read before any write; a ``dst`` of 0 lands in the sink). This forks a request's state,
    e.g. for a second request that shares its prefix.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> pool = set_states(pool, 0, jnp.array([1]), jnp.ones((1, 3, 6)), jnp.ones((1, 2, 4, 4)))
    >>> pool = copy_states(pool, src_idx=jnp.array([1]), dst_idx=jnp.array([3]))
    >>> pool.ssm[0][:, 0, 0, 0].tolist(), pool.conv[0][:, 0, 0].tolist()
    ([0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0])
    """
    src_idx, dst_idx = _two_or_more(src_idx), _two_or_more(dst_idx)
    return pool.replace(conv=pool.conv.at[:, dst_idx].set(pool.conv[:, src_idx]),
                        ssm=pool.ssm.at[:, dst_idx].set(pool.ssm[:, src_idx]))


def copy_states_to(
    src: RecurrentStatePool,
    src_idx: Int[Array, " B"],
    dst: RecurrentStatePool,
    dst_idx: Int[Array, " B"],
) -> RecurrentStatePool:
    """Copy every layer's states from slots ``src_idx`` of ``src`` into slots ``dst_idx`` of
    ``dst``, another pool of the same layers and per-slot shapes (a snapshot pool and the
    working pool, either way round); returns the new ``dst``. A ``dst`` index of 0 lands in
    ``dst``'s sink. The recurrent state keeps float32 and the conv state ``dst``'s dtype, so a
    snapshot is exactly the state it copies when both pools share a dtype.

    >>> work = RecurrentStatePool.create((0,), 3, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> snaps = RecurrentStatePool.create((0,), 5, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                   head_k_dim=4, head_v_dim=4)
    >>> work = set_states(work, 0, jnp.array([2]), jnp.ones((1, 3, 6)), jnp.ones((1, 2, 4, 4)))
    >>> snaps = copy_states_to(work, jnp.array([2]), snaps, jnp.array([4]))  # take a snapshot
    >>> snaps.ssm[0][:, 0, 0, 0].tolist()
    [0.0, 0.0, 0.0, 0.0, 1.0]
    """
    if src.layer_ids != dst.layer_ids or any(
            a.shape[:1] + a.shape[2:] != b.shape[:1] + b.shape[2:]
            for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(dst), strict=True)):
        raise ValueError(f"copy_states_to needs pools of the same layers and per-slot shapes, "
                         f"got layers {src.layer_ids} and {dst.layer_ids}")
    src_idx, dst_idx = _two_or_more(src_idx), _two_or_more(dst_idx)
    return dst.replace(conv=dst.conv.at[:, dst_idx].set(src.conv[:, src_idx].astype(dst.dtype)),
                       ssm=dst.ssm.at[:, dst_idx].set(src.ssm[:, src_idx]))
