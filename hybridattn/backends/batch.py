"""Host side: assemble a padded :class:`~hybridattn.backends.base.ForwardBatch` from requests.

The scheduler decides, per request, which request row it owns, how many of its tokens are
already in the pools (``prefix_len``), which new tokens run now and which token slots they go
to (already written into ``req_to_token``). :func:`make_forward_batch` packs that into arrays
padded to the given buckets: padded requests use request row 0 and padded tokens slot 0, the
padding sinks of every pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from hybridattn.backends.base import ForwardBatch, ForwardMode, check_forward_batch
from hybridattn.pools import HybridReqToTokenPool, MLATokenPool, RecurrentStatePool

__all__ = [
    "BatchRequest",
    "make_forward_batch",
]


class BatchRequest(NamedTuple):
    """One request's share of a forward: row ``req_index``, ``prefix_len`` tokens already
    cached, new ``token_ids`` at positions ``prefix_len ...`` stored in ``slots``.

    >>> r = BatchRequest(req_index=1, prefix_len=4, token_ids=[7], slots=[12])  # one decode
    >>> r.prefix_len + len(r.token_ids)  # the request's length after the forward
    5
    """

    req_index: int
    prefix_len: int
    token_ids: Sequence[int]
    slots: Sequence[int]


def make_forward_batch(
    requests: Sequence[BatchRequest],
    *,
    req_to_token_pool: HybridReqToTokenPool,
    token_to_kv_pool: MLATokenPool,
    recurrent_state_pool: RecurrentStatePool,
    forward_mode: ForwardMode = ForwardMode.EXTEND,
    num_requests: int | None = None,
    num_tokens: int | None = None,
    kv_width: int | None = None,
    max_extend_len: int | None = None,
) -> ForwardBatch:
    """Pack ``requests`` into a :class:`ForwardBatch` padded to ``num_requests`` rows and
    ``num_tokens`` tokens (defaults: exactly what the requests need). ``kv_width`` defaults
    to the longest request, ``max_extend_len`` to the most new tokens of one request.

    Raises ``ValueError`` naming the request when its tokens and slots disagree, a row or slot
    is out of range, the padding sink or used twice, a decode request has more than one
    token, a request outgrows ``max_context_len``, or the batch does not fit the buckets.

    Two requests, padded to ``B = 3`` rows and ``T = 8`` tokens: row 1 is new (3 tokens), row
    2 has 4 tokens cached and decodes one more. The scheduler has already allocated the rows
    and token slots and written the slots into ``req_to_token``:

    >>> from hybridattn import pools
    >>> req, rows = pools.alloc_reqs_or_raise(pools.HybridReqToTokenPool.create(2, 16), 2)
    >>> req = pools.write_token_slots(req, jnp.array([1, 1, 1, 2, 2, 2, 2, 2]),
    ...                               jnp.array([0, 1, 2, 0, 1, 2, 3, 4]),
    ...                               jnp.array([1, 2, 3, 4, 5, 6, 7, 8]))
    >>> kv = pools.MLATokenPool.create((1,), 32, kv_lora_rank=8, qk_rope_head_dim=4)
    >>> st = pools.RecurrentStatePool.create((0,), 3, 12, 4, 1, 4, 4)
    >>> batch = make_forward_batch(
    ...     [BatchRequest(1, 0, [11, 12, 13], [1, 2, 3]), BatchRequest(2, 4, [14], [8])],
    ...     req_to_token_pool=req, token_to_kv_pool=kv, recurrent_state_pool=st,
    ...     num_requests=3, num_tokens=8)
    >>> batch.input_ids.tolist(), batch.out_cache_loc.tolist()  # padding tokens: slot 0
    ([11, 12, 13, 14, 0, 0, 0, 0], [1, 2, 3, 8, 0, 0, 0, 0])
    >>> batch.req_pool_indices.tolist(), batch.seq_lens.tolist(), batch.prefix_lens.tolist()
    ([1, 2, 0], [3, 5, 0], [0, 4, 0])
    >>> batch.kv_width, batch.max_extend_len  # defaults: the longest request, most new tokens
    (5, 3)
    """
    if not requests:
        raise ValueError("make_forward_batch needs at least one request")
    _check_requests(requests, req_to_token_pool, token_to_kv_pool.num_slots, forward_mode)
    lens = np.array([len(r.token_ids) for r in requests], np.int32)
    prefix = np.array([r.prefix_len for r in requests], np.int32)
    B = num_requests or len(requests)
    T = num_tokens or (B if forward_mode == ForwardMode.DECODE else int(lens.sum()))
    if B < len(requests):
        raise ValueError(f"num_requests={B} < {len(requests)} requests")
    if T < lens.sum():
        raise ValueError(f"num_tokens={T} < {int(lens.sum())} new tokens")

    ids = np.concatenate([np.asarray(r.token_ids, np.int32) for r in requests])
    slots = np.concatenate([np.asarray(r.slots, np.int32) for r in requests])
    seq = prefix + lens
    batch = ForwardBatch(
        input_ids=_pad(ids, T),
        req_pool_indices=_pad([r.req_index for r in requests], B),
        seq_lens=_pad(seq, B),
        extend_seq_lens=_pad(lens, B),
        out_cache_loc=_pad(slots, T),
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        recurrent_state_pool=recurrent_state_pool,
        forward_mode=forward_mode,
        kv_width=kv_width or int(seq.max()),
        max_extend_len=max_extend_len or int(lens.max()),
    )
    check_forward_batch(batch)
    return batch


def _check_requests(requests, req_to_token_pool, num_slots, forward_mode):
    """The host checks of :func:`make_forward_batch`, one ``ValueError`` naming the request:
    tokens and slots agree, rows and slots are in range, not the sink and not used twice, a
    decode request has one token and no request outgrows ``max_context_len``."""
    rows = req_to_token_pool.req_to_token.shape[0]
    seen_rows: dict[int, int] = {}
    seen_slots: dict[int, int] = {}
    for n, r in enumerate(requests):
        if len(r.token_ids) != len(r.slots):
            raise ValueError(f"request {n} (row {r.req_index}): {len(r.token_ids)} tokens but "
                             f"{len(r.slots)} slots")
        if not 1 <= r.req_index < rows:
            raise ValueError(f"request {n}: req_index={r.req_index} must be in 1..{rows - 1} "
                             "(row 0 is the padding row)")
        if r.req_index in seen_rows:
            raise ValueError(f"request {n}: row {r.req_index} is also request "
                             f"{seen_rows[r.req_index]} of this batch")
        seen_rows[r.req_index] = n
        if r.prefix_len < 0:
            raise ValueError(f"request {n}: prefix_len={r.prefix_len} < 0")
        end = r.prefix_len + len(r.token_ids)
        if end > req_to_token_pool.max_context_len:
            raise ValueError(f"request {n}: {end} tokens exceed max_context_len="
                             f"{req_to_token_pool.max_context_len}")
        if forward_mode == ForwardMode.DECODE and len(r.token_ids) != 1:
            raise ValueError(f"request {n}: a DECODE batch takes one token per request, got "
                             f"{len(r.token_ids)}")
        for slot in r.slots:
            if not 1 <= int(slot) < num_slots:
                raise ValueError(f"request {n}: token slot {int(slot)} must be in "
                                 f"1..{num_slots - 1} (slot 0 is the padding sink)")
            if int(slot) in seen_slots:
                raise ValueError(f"request {n}: token slot {int(slot)} is also used by request "
                                 f"{seen_slots[int(slot)]} of this batch")
            seen_slots[int(slot)] = n


def _pad(values, size, fill=0):
    out = np.full(size, fill, np.int32)
    out[: len(values)] = values
    return jnp.asarray(out)
