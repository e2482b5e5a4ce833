"""The pure serving step: ``new_state, out = step(params, state, batch)``.
"""

from __future__ import annotations

import jax.numpy as jnp

from hybridattn.backends import (
    ForwardBatch,
    ForwardMode,
)
from hybridattn.models import kimi_linear
from hybridattn.pools import (
    alloc,
    claim,
    copy_states_to,
    write_token_slots,
)
from hybridattn.serving.sampling import request_keys, sample
from hybridattn.serving.state import ServingState, StepOutput
from hybridattn.serving.worker_batch import ModelWorkerBatch

__all__ = [
    "step",
]

# --------------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------------


def _token_layout(batch: ModelWorkerBatch):
    """Per token: ``(request index in the batch, position in its request, is live)``, and per
    request the index of its last new token.

    EXTEND: tokens are packed request after request (padding at the tail). DECODE: token
    ``b`` belongs to request ``b`` (padding rows may sit anywhere).
    """
    T, B = batch.num_tokens, batch.batch_size
    ext = batch.extend_seq_lens
    if batch.forward_mode == ForwardMode.DECODE:
        b = jnp.arange(B, dtype=jnp.int32)
        return b, (batch.seq_lens - 1).astype(jnp.int32), ext > 0, b
    ends = jnp.cumsum(ext)
    t = jnp.arange(T, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, B - 1)
    live = t < ends[-1]
    start = ends[b] - ext[b]
    pos = batch.seq_lens[b] - ext[b] + (t - start)
    return b, pos.astype(jnp.int32), live, jnp.clip(ends - 1, 0, T - 1)


def _batch_fits(state: ServingState, batch: ModelWorkerBatch, vocab_size: int):
    """Whether ``batch`` is servable on ``state``, checked inside jit (``make_worker_batch``
    checks the batch-only conditions on the host first, with messages). A batch that does not
    fit fails the step like a full pool does. Every request with new tokens must name an
    allocated row of this pool (not row 0, not negative, not past the pool, not free), each
    row at most once, with ``seq_lens - extend_seq_lens`` equal to the length recorded for
    the row (a stale batch run twice does not fit); lengths must lie within ``kv_width`` /
    ``max_extend_len``, the new tokens within ``T`` and the vocabulary; no row may name a
    negative row or length."""
    pool = state.req_to_token_pool
    rows, seq, ext = batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens
    num_rows = pool.req_to_token.shape[0]
    active = ext > 0
    r = jnp.clip(rows, 0, num_rows - 1)
    row_ok = (rows > 0) & (rows < num_rows) & (pool.req_to_state[r] > 0)
    each = (row_ok & (seq - ext == pool.req_lens[r]) & (seq <= batch.kv_width)
            & (ext <= batch.max_extend_len))
    repeated = jnp.sum((rows[:, None] == rows[None, :]) & active[None, :], axis=1) > 1
    b, _, live, _ = _token_layout(batch)
    ids = batch.input_ids
    ids_ok = jnp.all(jnp.where(live, (ids >= 0) & (ids < vocab_size), True))
    fits = (jnp.all(jnp.where(active, each & ~repeated, True)) & jnp.all(ext >= 0)
            & jnp.all(rows >= 0) & jnp.all(seq >= 0) & (jnp.sum(ext) <= batch.num_tokens)
            & ids_ok)
    snaps = state.snapshot_pool
    S = snaps.num_slots if snaps is not None else 1
    prefix = seq - ext
    if batch.restore_from is not None:  # a snapshot slot, restored only under a prefix
        r = batch.restore_from
        fits &= jnp.all((r >= 0) & (r < S) & ((r == 0) | (active & (prefix > 0))))
    if batch.snapshots is not None:  # depths inside a live request's new tokens, slots apart
        sb, sl, ss = batch.snapshots.batch_index, batch.snapshots.lens, batch.snapshots.slots
        used = ss != 0
        B = rows.shape[0]
        bb = jnp.clip(sb, 0, B - 1)
        good = ((sb >= 0) & (sb < B) & active[bb] & (sl > prefix[bb]) & (sl <= seq[bb])
                & (ss > 0) & (ss < S))
        clash = jnp.sum((ss[:, None] == ss[None, :]) & used[None, :], axis=1) > 1
        fits &= jnp.all(jnp.where(used, good & ~clash, True))
    return fits


def step(
    params, state: ServingState, batch: ModelWorkerBatch, comm=None
) -> tuple[ServingState, StepOutput]:
    """One serving step: ``new_state, out = step(params, state, batch)``. Pure; jit it with
    the state donated (``jax.jit(step, donate_argnums=1)``); it compiles once per shape bucket
    of ``batch``.

    Allocates a token slot for every new token (or claims those the batch names in
    ``out_cache_loc``) and records it in ``req_to_token``; runs the model through the hybrid
    backend (MLA latents and KDA states written to the pools); samples each request's next
    token from its last new token's logits. Rows with no new token are padding. If the token
    slots run out (or one ``out_cache_loc`` names is in use, outside the pool or named
    twice), or the batch does not fit the state (a row that is negative, past the pool, free
    or repeated, a padding row carrying tokens, ``seq_lens`` that disagree with a row's
    recorded length, a token outside the vocabulary, a length beyond the batch's buckets),
    ``ok`` is False: every request runs as padding, so only the slot-0 sinks are written.

    ``comm`` is for ``hybridattn.sharding``, which runs this step on every device of a mesh
    with that device's shard of ``params`` and ``state`` (None: one device).

    Two prompts in one EXTEND batch; row 2's prompt ``[8, 9, 10, 11]`` comes in two chunks:

    >>> from hybridattn.config import KimiLinearConfig
    >>> import jax
    >>> from hybridattn.serving import WorkItem, make_worker_batch, release
    >>> from hybridattn.models import kimi_linear
    >>> from hybridattn.pools import alloc_reqs_or_raise
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = kimi_linear.init_params(cfg, jax.random.key(0))
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 2)  # rows 1 and 2
    >>> state = state.replace(req_to_token_pool=pool)
    >>> bucket = dict(vocab_size=64, max_context_len=16, num_requests=2, num_tokens=8,
    ...               kv_width=16, max_extend_len=8)
    >>> run = jax.jit(step, donate_argnums=1)
    >>> batch = make_worker_batch([WorkItem(1, 0, [5, 6, 7]), WorkItem(2, 0, [8, 9])], **bucket)
    >>> state, out = run(params, state, batch)
    >>> bool(out.ok), out.next_token_ids.shape, out.logits.shape
    (True, (2,), (2, 64))
    >>> state.token_allocator.num_used  # one MLA token slot per new token
    5

    A mixed batch in the same bucket (no new compilation): row 1 decodes the token it
    sampled while row 2 runs the rest of its prompt (its sample above was discarded):

    >>> first = int(out.next_token_ids[0])
    >>> batch = make_worker_batch([WorkItem(1, 3, [first]), WorkItem(2, 2, [10, 11])],
    ...                           **bucket)
    >>> state, out = run(params, state, batch)
    >>> state.req_to_token_pool.req_to_token[1:, :5].tolist()  # token slot per position
    [[1, 2, 3, 6, 0], [4, 5, 7, 8, 0]]

    A failed step changes nothing live. ``release`` frees row 1 and its 4 token slots; a
    batch that still names row 1 comes back with ``ok`` False:

    >>> state = release(state, jnp.array([1]))
    >>> state.token_allocator.num_used
    4
    >>> state, out = run(params, state, make_worker_batch([WorkItem(1, 4, [3])], **bucket))
    >>> bool(out.ok), out.next_token_ids.tolist(), state.token_allocator.num_used
    (False, [0, 0], 4)
    """
    cfg = state.config
    allocator, ok, go, slots, fb = _forward_batch(state, batch)
    backend = state.backend.with_forward_metadata(state.backend.get_forward_metadata(fb))
    hidden, fb = kimi_linear.forward(params, cfg, backend, fb, comm)
    _, _, _, last = _token_layout(batch)
    logits = kimi_linear.compute_logits(params, cfg, hidden[last])
    keys = request_keys(state.rng, batch.seeds, batch.seq_lens)
    tokens = sample(logits, batch.temperatures, batch.top_ks, batch.top_ps, keys)
    tokens = jnp.where(go, tokens, 0)
    new = state.replace(
        req_to_token_pool=fb.req_to_token_pool,
        token_allocator=allocator,
        token_to_kv_pool=fb.token_to_kv_pool,
        recurrent_state_pool=fb.recurrent_state_pool,
        snapshot_pool=fb.snapshot_pool,
    )
    return new, StepOutput(tokens, logits, ok, slots)


def _forward_batch(state: ServingState, batch: ModelWorkerBatch):
    """Step's allocation and its model batch: ``(token_allocator, ok, go, slots,
    forward_batch)``. ``ok``: the batch fits and its fresh tokens got slots; ``go``: the rows
    that run; ``slots``: each token's slot (0 where it wrote none)."""
    if state.snapshot_pool is None and (batch.restore_from is not None
                                        or batch.snapshots is not None):
        raise ValueError("the batch restores or takes snapshots but the state has no "
                         "snapshot_pool (ServingState.create(..., num_snapshot_slots=...))")
    fits = _batch_fits(state, batch, state.config.vocab_size)
    T = batch.num_tokens
    pool = state.req_to_token_pool
    num_rows = pool.req_to_token.shape[0]
    b, pos, live, _ = _token_layout(batch)
    # Positions below a row's borrowed length already hold a prefix cache's slots: tokens
    # recomputed there (from a snapshot shallower than the cached KV) write to the sink.
    borrowed = pool.borrowed[jnp.clip(batch.req_pool_indices, 0, num_rows - 1)]
    fresh = live & (pos >= borrowed[b])
    if batch.out_cache_loc is None:  # the step picks the slots
        allocator, packed, ok = alloc(state.token_allocator,
                                      jnp.where(fits, jnp.sum(fresh), -1), max_count=T)
        slots = packed[jnp.clip(jnp.cumsum(fresh) - 1, 0, T - 1)]
    else:  # the host named them: each must be free (and named once)
        allocator, ok = claim(state.token_allocator, batch.out_cache_loc, fresh & fits)
        ok &= fits
        slots = batch.out_cache_loc
    # A failed step turns every request into padding: row 0, state slot 0, token slot 0 (the
    # sinks), so the forward runs but writes nothing live; no lax.cond, no pool copies.
    go = ok & (batch.extend_seq_lens > 0)
    req_rows = jnp.where(go, batch.req_pool_indices, 0)
    fresh = fresh & ok
    slots = jnp.where(fresh, slots, 0)
    req_pool = write_token_slots(pool, jnp.where(fresh, req_rows[b], 0), pos, slots, fresh)
    req_pool = req_pool.replace(req_lens=req_pool.req_lens.at[
        jnp.where(req_rows > 0, req_rows, num_rows)].set(batch.seq_lens, mode="drop"))
    states, spec, snaps = state.recurrent_state_pool, None, state.snapshot_pool
    if batch.restore_from is not None:  # copy-on-write: the snapshot is only read
        src = jnp.where(go, batch.restore_from, 0)
        dst = jnp.where(src > 0, pool.req_to_state[req_rows], 0)
        states = copy_states_to(snaps, src, states, dst)
    if batch.snapshots is not None:
        spec = batch.snapshots.replace(slots=jnp.where(ok, batch.snapshots.slots, 0))
    fb = ForwardBatch(
        input_ids=batch.input_ids,
        req_pool_indices=req_rows,
        seq_lens=batch.seq_lens,
        extend_seq_lens=batch.extend_seq_lens,
        out_cache_loc=slots,
        req_to_token_pool=req_pool,
        token_to_kv_pool=state.token_to_kv_pool,
        recurrent_state_pool=states,
        kv_width=batch.kv_width,
        max_extend_len=batch.max_extend_len,
        forward_mode=batch.forward_mode,
        snapshot_pool=snaps,
        snapshot_spec=spec,
    )
    return allocator, ok, go, slots, fb
