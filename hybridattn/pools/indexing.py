"""The row gathers and scatters the data pools share, and how a layer names its row of a
pool (:class:`LayerRef`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Int

__all__ = [
    "LayerRef",
]

# --------------------------------------------------------------------------------------------
# data pools
# --------------------------------------------------------------------------------------------


class LayerRef(NamedTuple):
    """A layer inside a ``lax.scan`` over stacked layers (``kimi_linear.stack_layers``):
    ``layer_id``, the static id of the first layer of its scanned group (its kind and shapes),
    and ``index``, its position (traced) among the pool's layers of that kind. The pool
    functions and the attention backends take one wherever they take a layer id.

    >>> from hybridattn.pools import MLATokenPool, set_mla_kv
    >>> pool = MLATokenPool.create((3, 7), num_slots=4, kv_lora_rank=2, qk_rope_head_dim=1)
    >>> pool = set_mla_kv(pool, LayerRef(3, jnp.int32(1)), jnp.array([2]), jnp.ones((1, 2)),
    ...                   jnp.ones((1, 1)))
    >>> pool.c_kv[1][:, 0].tolist()  # the second MLA layer (7)
    [0.0, 0.0, 1.0, 0.0]
    """

    layer_id: int
    index: Int[Array, ""]


def _layer_index(kind: str, layer_ids: tuple[int, ...], layer) -> int | Int[Array, ""]:
    if isinstance(layer, LayerRef):
        if layer.layer_id not in layer_ids:
            raise ValueError(f"layer_id {layer.layer_id!r} is not {kind} layer of this pool "
                             f"(layer_ids={layer_ids})")
        return layer.index
    try:
        return layer_ids.index(layer)
    except ValueError:
        raise ValueError(
            f"layer_id {layer!r} is not {kind} layer of this pool (layer_ids={layer_ids})"
        ) from None


def _check_layer_ids(layer_ids) -> tuple[int, ...]:
    layer_ids = tuple(layer_ids)
    if not layer_ids or any(not isinstance(i, int) or i < 0 for i in layer_ids):
        raise ValueError(f"layer_ids must be non-empty non-negative ints, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer_ids must be distinct, got {layer_ids}")
    return layer_ids


def _gather_rows(table: Array, i, idx: Int[Array, " B"]) -> Array:
    """``table[i, idx]``, read as a gather of at least two rows (one row is read twice, and
    the second dropped). One row would be read as a dynamic slice, and XLA:CPU then copies
    the whole table around the step's in-place write of that row (a decode step of one request on an
    engine of 128 request slots: 145 ms instead of 7, all of it copies of the state pool)."""
    return table[i, _two_or_more(idx)][: idx.shape[0]]


def _scatter_rows(table: Array, i, idx: Int[Array, " B"], rows: Array) -> Array:
    """``table.at[i, idx].set(rows)`` (cast to the table's dtype), written as a scatter of at
    least two rows (one row is written twice): as with ``_gather_rows``, one row
    would be a dynamic update slice, which XLA:CPU does on a copy of the whole table (the
    state pools here; the latent pool in ``set_mla_kv``)."""
    rows = rows.astype(table.dtype)
    if idx.shape[0] == 1:  # the same row twice
        rows = jnp.concatenate([rows, rows])
    return table.at[i, _two_or_more(idx)].set(rows)


def _two_or_more(idx: Int[Array, " B"]) -> Int[Array, " B2"]:
    """``idx``, its one index repeated when it holds one: a read, write or copy of one row is
    a dynamic slice and update slice, which XLA:CPU does on a copy of the whole pool (see
    ``_gather_rows``); the same row twice is a gather and an in-place scatter, and writing
    the same value twice changes nothing."""
    return idx if idx.shape[0] != 1 else jnp.concatenate([idx, idx])
