"""Strategies for batches: ``worker_batches`` (a ``ServingState`` and a ``ModelWorkerBatch`` that
``step`` runs on it) and ``forward_batches`` (a ``ForwardBatch``, slots allocated on the host,
for the backends)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from hybridattn import pools
from hybridattn.backends import BatchRequest, ForwardBatch, ForwardMode, make_forward_batch
from hybridattn.config import KimiLinearConfig
from hybridattn.serving import (
    ModelWorkerBatch,
    SamplingParams,
    ServingState,
    WorkItem,
    make_worker_batch,
)
from hybridattn.testing.common import (
    SearchStrategy,
    checked_int,
    composite,
    host,
    int_tuple,
    jit_alloc,
    jit_release,
    jit_write,
    st,
)
from hybridattn.testing.pool_states import fill_kv, fill_states
from hybridattn.testing.sampling import sampling_params

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


class WorkerBatchExample(NamedTuple):
    """A drawn ``ServingState``, a ``ModelWorkerBatch`` for it, the batch's requests as
    ``WorkItem`` s and the batch row of each (``positions[i]`` is ``items[i]``'s row in
    ``batch``; the other rows are padding).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=3, deadline=None)
    ... @given(worker_batches(KimiLinearConfig.tiny(), max_running_requests=2,
    ...                       max_context_len=16, num_tokens=(8,)))
    ... def test_items_sit_at_their_positions(ex):
    ...     for item, row in zip(ex.items, ex.positions):
    ...         assert int(ex.batch.req_pool_indices[row]) == item.req_index
    ...         assert int(ex.batch.extend_seq_lens[row]) == len(item.token_ids)
    >>> test_items_sit_at_their_positions()
    """

    state: ServingState
    batch: ModelWorkerBatch
    items: tuple
    positions: tuple


class ForwardBatchExample(NamedTuple):
    """A drawn ``ForwardBatch`` (new-token slots allocated on the host and recorded in
    ``req_to_token``, as a scheduler does before a forward), the ``ServingState`` whose pools
    and backend it uses (its token allocator has the new slots taken) and its requests as
    ``BatchRequest`` s.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=3, deadline=None)
    ... @given(forward_batches(KimiLinearConfig.tiny(), max_running_requests=2,
    ...                        max_context_len=16, num_tokens=(8,)))
    ... def test_requests_are_recorded(ex):
    ...     table = np.asarray(ex.batch.req_to_token_pool.req_to_token)
    ...     for r in ex.requests:
    ...         new = slice(r.prefix_len, r.prefix_len + len(r.token_ids))
    ...         assert table[r.req_index, new].tolist() == list(r.slots)
    >>> test_requests_are_recorded()
    """

    batch: ForwardBatch
    state: ServingState
    requests: tuple


def _check_geometry(config, max_running_requests, max_context_len, num_token_slots,
                    num_requests, num_tokens, kv_width, max_extend_len, forward_modes):
    R = checked_int("max_running_requests", max_running_requests, 1)
    L = checked_int("max_context_len", max_context_len, 1)
    S = (R * L + 1 if num_token_slots is None
         else checked_int("num_token_slots", num_token_slots, 2))
    B = R if num_requests is None else checked_int("num_requests", num_requests, 1)
    Ts = int_tuple("num_tokens", num_tokens)
    W = L if kv_width is None else checked_int("kv_width", kv_width, 1)
    if W > L:
        raise ValueError(f"kv_width={W} exceeds max_context_len={L}")
    if max_extend_len is not None:
        checked_int("max_extend_len", max_extend_len, 1)
        if max_extend_len > min(Ts):
            raise ValueError(f"max_extend_len={max_extend_len} exceeds a token bucket {Ts}")
    modes = tuple(ForwardMode(m) for m in forward_modes)
    if not modes:
        raise ValueError("forward_modes must not be empty")
    if not config.kda_layer_ids or not config.full_attention_layer_ids:
        raise ValueError("worker_batches / forward_batches draw for hybrid configs (KDA and "
                         "MLA layers)")
    return R, L, S, B, Ts, W, max_extend_len, modes


def _draw_setup(draw, config, R, L, S, B, Ts, W, Q, modes, sampling, chunk_size,
                random_contents, dtype):
    """A state with live requests (some scheduled now, some bystanders) after some churn,
    and the scheduled requests' ``(row, prefix_len, token_ids, sampling)``."""
    mode = draw(st.sampled_from(modes), label="forward_mode")
    T = B if mode == DECODE else draw(st.sampled_from(Ts), label="num_tokens")
    Qe = 1 if mode == DECODE else (Q or T)
    cap = S - 1
    # the scheduled requests' new tokens, then every live request's cached prefix
    room = min(T, cap)
    exts: list[int] = []
    for _ in range(draw(st.integers(1, min(B, R)), label="scheduled")):
        if room == 0:
            break
        hi = 1 if mode == DECODE else min(room, Qe, W)
        e = draw(st.one_of(st.just(1), st.integers(1, hi)), label="extend_len")
        exts.append(e)
        room -= e
    avail = cap - sum(exts)
    prefixes = []
    for e in exts:
        hi = min(W - e, avail)
        p = draw(st.integers(min(1 if mode == DECODE else 0, hi), hi), label="prefix_len")
        prefixes.append(p)
        avail -= p
    bystanders = []
    for _ in range(draw(st.integers(0, R - len(exts)), label="bystanders")):
        bystanders.append(draw(st.integers(min(1, avail), min(L, avail)), label="their len"))
        avail -= bystanders[-1]
    finished = []
    for _ in range(draw(st.integers(0, min(2, R - len(exts) - len(bystanders))),
                        label="finished")):
        finished.append(draw(st.integers(0, min(L, avail)), label="finished len"))
        avail -= finished[-1]
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    sps = [draw(sampling_params(vocab_size=config.vocab_size)) if sampling else
           SamplingParams() for _ in exts]

    state = ServingState.create(config, max_running_requests=R, max_context_len=L,
                                num_token_slots=S, chunk_size=chunk_size, dtype=dtype)
    lens = prefixes + bystanders + finished
    order = draw(st.permutations(range(len(lens))), label="allocation order")
    req, tok = state.req_to_token_pool, state.token_allocator
    rows = [0] * len(lens)
    for i in order:  # rows and their cached tokens' slots, interleaved
        req, got = pools.alloc_reqs_or_raise(req, 1)
        rows[i] = int(got[0])
        tok, slots, ok = jit_alloc(tok, jnp.int32(lens[i]), max_count=L)
        assert bool(ok)
        req = jit_write(req, jnp.full((L,), rows[i], jnp.int32), jnp.arange(L, dtype=jnp.int32),
                     slots, jnp.arange(L) < lens[i])
    state = state.replace(req_to_token_pool=req, token_allocator=tok)
    if finished:  # released: their rows, state slots and token slots go back, out of order
        done = np.zeros(R, np.int32)
        done[: len(finished)] = rows[len(exts) + len(bystanders):]
        state = jit_release(state, jnp.asarray(done))
    if random_contents:
        state = state.replace(token_to_kv_pool=fill_kv(state.token_to_kv_pool, seed),
                              recurrent_state_pool=fill_states(state.recurrent_state_pool,
                                                                seed))
    rng = np.random.default_rng(seed)
    scheduled = [(rows[i], prefixes[i], rng.integers(0, config.vocab_size, exts[i]).tolist(),
                  sps[i]) for i in range(len(exts))]
    return state, mode, T, Qe, scheduled


def worker_batches(
    config: KimiLinearConfig,
    *,
    max_running_requests: int = 4,
    max_context_len: int = 64,
    num_token_slots: int | None = None,
    num_requests: int | None = None,
    num_tokens: Sequence[int] = (32,),
    kv_width: int | None = None,
    max_extend_len: int | None = None,
    forward_modes: Sequence[ForwardMode] = (EXTEND, DECODE),
    sampling: bool = True,
    padding_anywhere: bool = True,
    random_contents: bool = True,
    chunk_size: int = 32,
    dtype=jnp.float32,
) -> SearchStrategy[WorkerBatchExample]:
    """A ``ServingState`` and a ``ModelWorkerBatch`` that ``step`` can run on it, as
    ``WorkerBatchExample`` s.

    The state holds live requests after some churn (rows, state slots and token slots allocated
    in a random order, finished requests released through ``release``, so the free lists are
    fragmented): the batch's requests, each with a cached prefix of 0 or more tokens already in
    the pools (KDA states and MLA latents from a drawn seed with ``random_contents``, every
    slot, stale ones included), and bystanders that are not in the batch. An ``EXTEND`` batch
    mixes prefill, chunked prefill after a prefix and one-token (decode) requests; a ``DECODE``
    batch has one token per request, prefix >= 1 where slots allow. Every request draws its
    ``SamplingParams`` (greedy only with ``sampling=False``). The batch is built by
    ``make_worker_batch`` (host validation) and padded to the buckets; with ``padding_anywhere``
    its padding rows may sit between live rows. Enough token slots are always free: ``step``
    returns ``ok=True`` on every draw.

    Args:
        config: a hybrid config that ``ServingState`` serves (e.g. from
            ``kimi_linear_configs``).
        max_running_requests: request rows of the state.
        max_context_len: positions per request.
        num_token_slots: MLA token slots (sink included); default enough for every row
            to hold a full context.
        num_requests: the batch's request bucket ``B`` (default ``max_running_requests``).
        num_tokens: the ``EXTEND`` token buckets ``T`` (a ``DECODE`` batch has ``T == B``).
        kv_width: the batch's ``kv_width`` (default ``max_context_len``).
        max_extend_len: the batch's ``max_extend_len`` for ``EXTEND`` (default ``T``).
        forward_modes: the modes to draw.
        sampling: draw sampling settings (False: every request greedy).
        padding_anywhere: let padding rows sit anywhere, not only at the tail.
        random_contents: fill the pools with random values (False: zeros).
        chunk_size: the KDA chunk size of the state's backend.
        dtype: the MLA latent and conv-state dtype.

    Returns:
        A strategy of ``WorkerBatchExample``. Its static shapes come only from the
        arguments, so ``jax.jit(step)`` compiles once per mode and token bucket.

    >>> from hypothesis import given, settings
    >>> from hybridattn.testing import RefServingPools
    >>> @settings(max_examples=5, deadline=None)
    ... @given(worker_batches(KimiLinearConfig.tiny(), max_running_requests=2,
    ...                       max_context_len=16, num_tokens=(8,)))
    ... def test_rows_are_live(ex):
    ...     live = ex.batch.extend_seq_lens > 0
    ...     assert (ex.state.req_to_token_pool.req_to_state[ex.batch.req_pool_indices[live]]
    ...             > 0).all()
    ...     assert RefServingPools.from_state(ex.state).expect_ok(ex.batch)
    >>> test_rows_are_live()
    """
    R, L, S, B, Ts, W, Q, modes = _check_geometry(
        config, max_running_requests, max_context_len, num_token_slots, num_requests,
        num_tokens, kv_width, max_extend_len, forward_modes)
    return _worker_batches(config, R, L, S, B, Ts, W, Q, modes, bool(sampling),
                           bool(padding_anywhere), bool(random_contents),
                           checked_int("chunk_size", chunk_size, 1), dtype)


@composite
def _worker_batches(draw, config, R, L, S, B, Ts, W, Q, modes, sampling, padding_anywhere,
                    random_contents, chunk_size, dtype):
    state, mode, T, Qe, scheduled = _draw_setup(draw, config, R, L, S, B, Ts, W, Q, modes,
                                                sampling, chunk_size, random_contents, dtype)
    items = tuple(WorkItem(row, prefix, ids, sp) for row, prefix, ids, sp in scheduled)
    batch = make_worker_batch(items, vocab_size=config.vocab_size, max_context_len=L,
                              forward_mode=mode, num_requests=B, num_tokens=T, kv_width=W,
                              max_extend_len=Qe)
    n = len(items)
    positions = tuple(range(n))
    if padding_anywhere and n < B:
        positions = tuple(sorted(draw(st.permutations(range(B)), label="rows")[:n]))
        batch = _spread(batch, positions)
    return WorkerBatchExample(state, batch, items, positions)


def _spread(batch: ModelWorkerBatch, positions) -> ModelWorkerBatch:
    """Move the first ``len(positions)`` rows of ``batch`` to rows ``positions`` (increasing),
    padding elsewhere; a DECODE batch's token ``b`` moves with its request."""
    n, B = len(positions), batch.batch_size
    idx = np.asarray(positions)

    def move(x, fill):
        out = np.full(B, fill, host(x).dtype)
        out[idx] = host(x)[:n]
        return jnp.asarray(out)

    out = batch.replace(
        req_pool_indices=move(batch.req_pool_indices, 0), seq_lens=move(batch.seq_lens, 0),
        extend_seq_lens=move(batch.extend_seq_lens, 0),
        temperatures=move(batch.temperatures, 0), top_ks=move(batch.top_ks, 0),
        top_ps=move(batch.top_ps, 1), seeds=move(batch.seeds, 0))
    if batch.forward_mode == DECODE:
        out = out.replace(input_ids=move(batch.input_ids, 0))
    return out


def forward_batches(
    config: KimiLinearConfig,
    *,
    max_running_requests: int = 4,
    max_context_len: int = 64,
    num_token_slots: int | None = None,
    num_requests: int | None = None,
    num_tokens: Sequence[int] = (32,),
    kv_width: int | None = None,
    max_extend_len: int | None = None,
    forward_modes: Sequence[ForwardMode] = (EXTEND, DECODE),
    random_contents: bool = True,
    chunk_size: int = 32,
    dtype=jnp.float32,
) -> SearchStrategy[ForwardBatchExample]:
    """A ``ForwardBatch`` for the attention backends, as ``ForwardBatchExample`` s: the same
    states and request mixes as ``worker_batches`` (the same geometry arguments), but the host
    allocates the new tokens' slots and records them in ``req_to_token``, and
    ``make_forward_batch`` packs the batch (so it passed ``check_forward_batch``). Get its
    metadata with ``ex.state.backend.get_forward_metadata(ex.batch)``.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(forward_batches(KimiLinearConfig.tiny(), max_running_requests=2,
    ...                        max_context_len=16, num_tokens=(8,)))
    ... def test_kda_metadata(ex):
    ...     md = ex.state.backend.get_forward_metadata(ex.batch).linear_attn_metadata
    ...     assert int(md.cu_seqlens[-2]) == int(ex.batch.extend_seq_lens.sum())
    >>> test_kda_metadata()
    """
    R, L, S, B, Ts, W, Q, modes = _check_geometry(
        config, max_running_requests, max_context_len, num_token_slots, num_requests,
        num_tokens, kv_width, max_extend_len, forward_modes)
    return _forward_batches(config, R, L, S, B, Ts, W, Q, modes, bool(random_contents),
                            checked_int("chunk_size", chunk_size, 1), dtype)


@composite
def _forward_batches(draw, config, R, L, S, B, Ts, W, Q, modes, random_contents, chunk_size,
                     dtype):
    state, mode, T, Qe, scheduled = _draw_setup(draw, config, R, L, S, B, Ts, W, Q, modes,
                                                False, chunk_size, random_contents, dtype)
    req, tok = state.req_to_token_pool, state.token_allocator
    requests = []
    for row, prefix, ids, _ in scheduled:
        tok, slots, ok = jit_alloc(tok, jnp.int32(len(ids)), max_count=L)
        assert bool(ok)
        req = jit_write(req, jnp.full((L,), row, jnp.int32),
                     prefix + jnp.arange(L, dtype=jnp.int32), slots, jnp.arange(L) < len(ids))
        requests.append(BatchRequest(row, prefix, ids, host(slots)[: len(ids)].tolist()))
    state = state.replace(req_to_token_pool=req, token_allocator=tok)
    batch = make_forward_batch(
        requests, req_to_token_pool=req, token_to_kv_pool=state.token_to_kv_pool,
        recurrent_state_pool=state.recurrent_state_pool, forward_mode=mode, num_requests=B,
        num_tokens=T, kv_width=W, max_extend_len=Qe)
    return ForwardBatchExample(batch, state, tuple(requests))
