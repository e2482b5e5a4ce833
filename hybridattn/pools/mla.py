"""The MLA latent KV pool: one compressed latent and one RoPE key per token slot and MLA layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybridattn.pools.allocator import _check_int
from hybridattn.pools.indexing import LayerRef, _check_layer_ids, _layer_index, _scatter_rows
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "MLATokenPool",
    "get_mla_kv",
    "get_mla_kv_flat",
    "set_mla_kv",
]

@pytree_dataclass(static=("layer_ids",))
class MLATokenPool:
    """The MLA latent KV cache: per MLA layer, ``c_kv [S, r]`` (the compressed KV after its
    norm) and ``k_pe [S, dr]`` (the RoPE'd shared key) of every token slot, stacked over the
    layers (``c_kv [Lm, S, r]``: one leaf, and a traced layer index inside a scan over
    layers). Slot 0 is the sink.

    ``layer_ids`` (static) are the model layer ids of the MLA layers, in order; ``c_kv[i]``
    belongs to ``layer_ids[i]``.

    >>> pool = MLATokenPool.create(layer_ids=(3, 7), num_slots=8, kv_lora_rank=4,
    ...                            qk_rope_head_dim=2)
    >>> len(pool.c_kv), pool.c_kv[0].shape, pool.k_pe[0].shape
    (2, (8, 4), (8, 2))
    >>> pool.num_slots, pool.bytes_per_token, pool.nbytes  # float32: 2 layers x (4 + 2) x 4
    (8, 48, 384)
    """

    c_kv: Float[Array, "Lm S r"]
    k_pe: Float[Array, "Lm S dr"]
    layer_ids: tuple[int, ...]

    @classmethod
    def create(
        cls,
        layer_ids,
        num_slots: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype=jnp.float32,
    ) -> MLATokenPool:
        """Zeros for ``num_slots`` token slots (sink included) of every layer in
        ``layer_ids``."""
        layer_ids = _check_layer_ids(layer_ids)
        _check_int("num_slots", num_slots, 2)
        _check_int("kv_lora_rank", kv_lora_rank, 1)
        _check_int("qk_rope_head_dim", qk_rope_head_dim, 1)
        n = len(layer_ids)
        return cls(
            c_kv=jnp.zeros((n, num_slots, kv_lora_rank), dtype),
            k_pe=jnp.zeros((n, num_slots, qk_rope_head_dim), dtype),
            layer_ids=layer_ids,
        )

    @property
    def num_slots(self) -> int:
        """Token slots, the sink included."""
        return self.c_kv.shape[-2]

    @property
    def kv_lora_rank(self) -> int:
        """Latent width ``r`` of ``c_kv``."""
        return self.c_kv.shape[-1]

    @property
    def qk_rope_head_dim(self) -> int:
        """Width ``dr`` of the shared rope key ``k_pe``."""
        return self.k_pe.shape[-1]

    @property
    def dtype(self):
        """The cache dtype (of ``c_kv`` and ``k_pe``)."""
        return self.c_kv.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes over all layers: ``sum (r + dr) * itemsize``."""
        n = len(self.layer_ids)
        return n * (self.c_kv.shape[-1] * self.c_kv.dtype.itemsize
                    + self.k_pe.shape[-1] * self.k_pe.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def set_mla_kv(
    pool: MLATokenPool,
    layer_id: int | LayerRef,
    slots: Int[Array, " T"],
    c_kv: Float[Array, "T r"],
    k_pe: Float[Array, "T dr"],
) -> MLATokenPool:
    """Write the latent KV of ``T`` tokens of layer ``layer_id`` at ``slots`` (cast to the pool
    dtype). Padding tokens carry slot 0 and land in the sink.

    >>> pool = MLATokenPool.create((3,), num_slots=8, kv_lora_rank=4, qk_rope_head_dim=2)
    >>> slots = jnp.array([5, 6, 0])  # the third token is padding: slot 0, the sink
    >>> pool = set_mla_kv(pool, 3, slots, jnp.ones((3, 4)), jnp.full((3, 2), 2.0))
    >>> pool.c_kv[0][:, 0].tolist()
    [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    """
    i = _layer_index("an MLA", pool.layer_ids, layer_id)
    if c_kv.shape[1] != pool.kv_lora_rank or k_pe.shape[1] != pool.qk_rope_head_dim:
        raise ValueError(
            f"c_kv {c_kv.shape} / k_pe {k_pe.shape} do not match the pool's "
            f"kv_lora_rank={pool.kv_lora_rank}, qk_rope_head_dim={pool.qk_rope_head_dim}"
        )
    # ``_scatter_rows``: one token (a decode of one request) written as one row was a dynamic
    # update slice, which XLA:CPU did on copies of the pool when the step then read the pool
    # (the attention's loop): four copies of c_kv and of k_pe per decode step. Written twice,
    # none: a one-request decode step of the tiny config took 3.1-3.7 ms instead of 5.1-5.9 at
    # 64k tokens of context, 1.4-1.6 instead of 2.1-2.2 at 16k.
    return pool.replace(c_kv=_scatter_rows(pool.c_kv, i, slots, c_kv),
                        k_pe=_scatter_rows(pool.k_pe, i, slots, k_pe))


def get_mla_kv(
    pool: MLATokenPool, layer_id: int | LayerRef
) -> tuple[Float[Array, "S r"], Float[Array, "S dr"]]:
    """The whole cache of layer ``layer_id``: ``(c_kv [S, r], k_pe [S, dr])``.

    Index it with a page table (:func:`get_token_slots`) to get each request's tokens.

    >>> pool = MLATokenPool.create((3,), num_slots=8, kv_lora_rank=4, qk_rope_head_dim=2)
    >>> c_kv, k_pe = get_mla_kv(pool, 3)
    >>> c_kv.shape, k_pe.shape, c_kv[jnp.array([[5, 6, 0]])].shape  # [B, W] -> [B, W, r]
    ((8, 4), (8, 2), (1, 3, 4))
    """
    i = _layer_index("an MLA", pool.layer_ids, layer_id)
    return pool.c_kv[i], pool.k_pe[i]


def get_mla_kv_flat(
    pool: MLATokenPool, layer_id: int | LayerRef
) -> tuple[Float[Array, "LmS r"], Float[Array, "LmS dr"], Int[Array, ""] | int]:
    """Every layer's cache as one table, ``(c_kv [Lm * S, r], k_pe [Lm * S, dr], offset)``:
    layer ``layer_id``'s slot ``s`` is row ``offset + s``. A gather at ``page_table +
    offset`` reads that layer's tokens without slicing the layer out first (a copy of its
    whole cache, when the layer index is traced).

    >>> pool = MLATokenPool.create((3, 7), num_slots=8, kv_lora_rank=4, qk_rope_head_dim=2)
    >>> c_kv, k_pe, offset = get_mla_kv_flat(pool, 7)
    >>> c_kv.shape, k_pe.shape, offset
    ((16, 4), (16, 2), 8)
    """
    i = _layer_index("an MLA", pool.layer_ids, layer_id)
    S = pool.num_slots
    return (pool.c_kv.reshape(-1, pool.kv_lora_rank), pool.k_pe.reshape(-1, pool.qk_rope_head_dim),
            i * S)
