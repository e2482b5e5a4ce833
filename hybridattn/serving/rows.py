"""A request row's life outside the step: :func:`release` frees it (and the token slots it
owns), :func:`borrow_prefix` points a new row at a prefix cache's slots.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from hybridattn.pools import (
    copy_states_to,
    free,
    free_reqs,
)
from hybridattn.serving.state import ServingState

__all__ = [
    "borrow_prefix",
    "release",
]

def release(
    state: ServingState,
    req_pool_indices: Int[Array, " B"],
    mask: Bool[Array, " B"] | None = None,
    *,
    keep_from: Int[Array, " B"] | None = None,
    snapshot_slots: Int[Array, " B"] | None = None,
) -> ServingState:
    """Free finished requests: the token slots their rows own, their rows and their
    recurrent-state slots. Row 0, rows not in use and repeats are ignored, as are rows whose
    ``mask`` entry is False. Pure; jit it with the state donated.

    A row owns the slots recorded at positions from its ``borrowed`` length on (below it they
    belong to a prefix cache). ``keep_from[b]``: positions from there on were just handed to a
    prefix cache too, and are not freed either. ``snapshot_slots[b]`` (0: none): first copy
    the request's final states into that slot of the snapshot pool (a prefix cache's
    snapshot at the end of the request).

    Row 2 holds 3 token slots (written here by hand, as ``step`` would):

    >>> from hybridattn.config import KimiLinearConfig
    >>> from hybridattn.pools import alloc, alloc_reqs_or_raise, write_token_slots
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 2)
    >>> allocator, slots, ok = alloc(state.token_allocator, 3, max_count=3)
    >>> pool = write_token_slots(pool, jnp.array([2, 2, 2]), jnp.arange(3), slots)
    >>> state = state.replace(req_to_token_pool=pool, token_allocator=allocator)
    >>> kept = release(state, jnp.array([2]), keep_from=jnp.array([1]))  # 2 slots to a cache
    >>> kept.token_allocator.num_used
    2
    >>> state = release(state, jnp.array([2, 0, 2]))  # row 0 and the repeat are ignored
    >>> state.token_allocator.num_used, state.req_to_token_pool.req_to_state.tolist()
    (0, [0, 1, 0])
    """
    pool = state.req_to_token_pool
    num_rows = pool.req_to_token.shape[0]
    rows = jnp.clip(req_pool_indices, 0, num_rows - 1)
    B = rows.shape[0]
    cand = (req_pool_indices > 0) & (req_pool_indices < num_rows)
    if mask is not None:
        cand = cand & mask
    same = (req_pool_indices[:, None] == req_pool_indices[None, :]) & cand[None, :]
    first = jnp.argmax(same, axis=1) == jnp.arange(B)
    # only rows in use (their state slot is set), each once: releasing twice is a no-op
    keep = cand & first & (pool.req_to_state[rows] > 0)
    if snapshot_slots is not None:
        if state.snapshot_pool is None:
            raise ValueError("release(snapshot_slots=...) needs a state with a snapshot_pool")
        dst = jnp.where(keep & (snapshot_slots > 0) & (snapshot_slots
                                                       < state.snapshot_pool.num_slots),
                        snapshot_slots, 0)
        state = state.replace(snapshot_pool=copy_states_to(
            state.recurrent_state_pool, jnp.where(dst > 0, pool.req_to_state[rows], 0),
            state.snapshot_pool, dst))
    slots = pool.req_to_token[rows]  # [B, L]; unused positions hold 0, which free ignores
    p = jnp.arange(slots.shape[1])[None, :]
    owned = keep[:, None] & (p >= pool.borrowed[rows][:, None])
    if keep_from is not None:
        owned &= p < keep_from[:, None]
    allocator = free(state.token_allocator, slots.reshape(-1), owned.reshape(-1))
    return state.replace(token_allocator=allocator,
                         req_to_token_pool=free_reqs(pool, req_pool_indices, keep))


def borrow_prefix(
    state: ServingState,
    req_pool_indices: Int[Array, " B"],
    lens: Int[Array, " B"],
    slots: Int[Array, "B W"],
    computed: Int[Array, " B"] | None = None,
) -> ServingState:
    """Point the first ``lens[b]`` positions of row ``req_pool_indices[b]`` at a prefix
    cache's token slots ``slots[b, :lens[b]]`` (``lens <= W``): the row borrows them from now
    on (its ``borrowed`` length becomes at least ``lens[b]``, never less than it was;
    ``release`` never frees them), and the
    row's own slots there that the cache replaces are freed. ``computed[b]``, when given, is
    how many tokens of the request the pools now hold (its state depth: a request admitted on
    a cache hit restores a snapshot of that depth). Row 0 and rows not in use are ignored.
    The host calls it on admission (a hit: the row borrows the matched KV, no copy) and when
    the cache adopts a prefilled prompt.

    Row 1 borrows three cached slots, of which it has computed two:

    >>> from hybridattn.config import KimiLinearConfig
    >>> from hybridattn.pools import alloc_reqs_or_raise
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=8,
    ...                             num_token_slots=17)
    >>> pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 1)
    >>> state = borrow_prefix(state.replace(req_to_token_pool=pool), jnp.array([1]),
    ...                       jnp.array([3]), jnp.array([[9, 4, 7, 0]]), computed=jnp.array([2]))
    >>> p = state.req_to_token_pool
    >>> p.req_to_token[1].tolist(), int(p.borrowed[1]), int(p.req_lens[1])
    ([9, 4, 7, 0, 0, 0, 0, 0], 3, 2)
    """
    pool = state.req_to_token_pool
    num_rows, L = pool.req_to_token.shape
    W = slots.shape[1]
    if W > L:
        raise ValueError(f"slots has width {W}, more than max_context_len={L}")
    rows = jnp.clip(req_pool_indices, 0, num_rows - 1)
    valid = (req_pool_indices > 0) & (req_pool_indices < num_rows) & (pool.req_to_state[rows] > 0)
    p = jnp.arange(W)[None, :]
    cur = pool.req_to_token[rows, :W]
    inside = valid[:, None] & (p < lens[:, None])
    replaced = inside & (p >= pool.borrowed[rows][:, None]) & (cur > 0) & (cur != slots)
    allocator = free(state.token_allocator, cur.reshape(-1), replaced.reshape(-1))
    dest = jnp.where(valid, req_pool_indices, num_rows)
    table = pool.req_to_token.at[dest[:, None], p].set(
        jnp.where(inside, slots, cur).astype(jnp.int32), mode="drop")
    # a row never borrows less than it did: what it borrowed stays the cache's to free
    new_pool = pool.replace(req_to_token=table, borrowed=pool.borrowed.at[dest].max(
        lens.astype(jnp.int32), mode="drop"))
    if computed is not None:
        new_pool = new_pool.replace(req_lens=new_pool.req_lens.at[dest].set(computed,
                                                                          mode="drop"))
    return state.replace(token_allocator=allocator, req_to_token_pool=new_pool)
