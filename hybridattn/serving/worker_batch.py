"""One step's batch as the host packs it: :class:`WorkItem` per request,
:func:`make_worker_batch` checks and pads them into a :class:`ModelWorkerBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybridattn.backends import (
    ForwardMode,
    SnapshotSpec,
)
from hybridattn.pytree import pytree_dataclass
from hybridattn.serving.state import ServingState
from servecore.sampling import SamplingParams
from servecore.validate import check_int, token_ids

__all__ = [
    "ModelWorkerBatch",
    "WorkItem",
    "make_worker_batch",
]

@pytree_dataclass(static=("forward_mode", "kv_width", "max_extend_len"))
class ModelWorkerBatch:
    """One step's work, padded to shape buckets.

    Request ``b`` (row ``req_pool_indices[b]``; 0 for padding) runs ``extend_seq_lens[b]`` new
    tokens and has ``seq_lens[b]`` tokens in the pools after the step; its new tokens are
    packed in ``input_ids`` after those of the requests before it. Sampling settings are per
    request: ``temperatures`` (0 = greedy), ``top_ks`` (0 = off), ``top_ps`` (1 = off),
    ``seeds``. Static: ``forward_mode``, ``kv_width`` (positions MLA attends over, >= every
    ``seq_lens``) and ``max_extend_len`` (>= every ``extend_seq_lens``). The static fields
    and the array shapes are the step's shape bucket: ``jax.jit(step)`` compiles once per
    bucket. Build one with ``make_worker_batch``.

    With a snapshot pool (a prefix cache), an ``EXTEND`` batch may also carry
    ``restore_from`` (per request, a snapshot slot copied into the request's working state
    before the forward; 0: none) and ``snapshots`` (``SnapshotSpec``: states to copy into
    snapshot slots at given depths along the extend).

    ``out_cache_loc`` (``[T]``, laid out as ``input_ids``; None: ``step`` allocates) is the
    token slot each new token is written to when the host owns the slot ids (an engine):
    ``step`` then claims those slots instead of allocating (``pools.claim``); an entry for a
    token below its row's borrowed length, or for padding, is ignored (write 0 there).

    A mixed batch padded to ``B = 3`` requests and ``T = 8`` tokens: row 1 prefills a 3-token
    prompt while row 2, with 4 tokens in the pools, decodes one more:

    >>> batch = make_worker_batch(
    ...     [WorkItem(req_index=1, prefix_len=0, token_ids=[5, 6, 7]),
    ...      WorkItem(req_index=2, prefix_len=4, token_ids=[9], sampling=SamplingParams(0.7))],
    ...     vocab_size=64, max_context_len=16, num_requests=3, num_tokens=8)
    >>> batch.forward_mode, batch.batch_size, batch.num_tokens
    (<ForwardMode.EXTEND: 1>, 3, 8)
    >>> batch.input_ids.tolist()  # new tokens packed request by request, padding at the tail
    [5, 6, 7, 9, 0, 0, 0, 0]
    >>> batch.req_pool_indices.tolist(), batch.seq_lens.tolist(), batch.extend_seq_lens.tolist()
    ([1, 2, 0], [3, 5, 0], [3, 1, 0])
    >>> batch.temperatures  # per request; the padding row is greedy
    Array([0. , 0.7, 0. ], dtype=float32)
    >>> batch.kv_width, batch.max_extend_len  # defaults: the longest request, most new tokens
    (5, 3)

    After the step, ``next_decode`` feeds each request's sampled token back as a DECODE
    batch (``kv_width`` must leave room for it):

    >>> dec = batch.replace(kv_width=16).next_decode(jnp.array([11, 12, 0]))
    >>> dec.forward_mode, dec.input_ids.tolist(), dec.seq_lens.tolist()
    (<ForwardMode.DECODE: 2>, [11, 12, 0], [4, 6, 0])
    """

    input_ids: Int[Array, " T"]
    req_pool_indices: Int[Array, " B"]
    seq_lens: Int[Array, " B"]
    extend_seq_lens: Int[Array, " B"]
    temperatures: Float[Array, " B"]
    top_ks: Int[Array, " B"]
    top_ps: Float[Array, " B"]
    seeds: Int[Array, " B"]
    kv_width: int
    max_extend_len: int
    forward_mode: ForwardMode = ForwardMode.EXTEND
    restore_from: Int[Array, " B"] | None = None
    snapshots: SnapshotSpec | None = None
    out_cache_loc: Int[Array, " T"] | None = None

    @property
    def batch_size(self) -> int:
        """``B``: request rows of the batch, padding included."""
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        """``T``: token positions of the batch, padding included."""
        return self.input_ids.shape[0]

    def next_decode(self, next_token_ids: Int[Array, " B"]) -> ModelWorkerBatch:
        """The DECODE batch that feeds each live request's sampled token back (pure; use it in
        a ``lax.scan``). ``kv_width`` must already leave room for the new token; sampling
        settings are kept, padding rows stay padding."""
        live = self.req_pool_indices > 0
        return self.replace(
            input_ids=jnp.where(live, next_token_ids, 0).astype(jnp.int32),
            seq_lens=jnp.where(live, self.seq_lens + 1, 0).astype(jnp.int32),
            extend_seq_lens=live.astype(jnp.int32),
            forward_mode=ForwardMode.DECODE,
            max_extend_len=1,
            restore_from=None,
            snapshots=None,
            out_cache_loc=None if self.out_cache_loc is None else jnp.zeros_like(
                self.req_pool_indices),  # [B]: the host names the next step's slots
        )


class WorkItem(NamedTuple):
    """One request's share of a step: row ``req_index`` with ``prefix_len`` tokens already in
    the pools runs ``token_ids`` now (a prompt, a prompt chunk, or one token to decode).

    With a prefix cache: ``restore_from`` is a snapshot slot whose states the request starts
    from (its first chunk after a cache hit at depth ``prefix_len``), and ``snapshots`` lists
    ``(depth, snapshot slot)`` pairs: copy the request's states after its first ``depth``
    tokens (``prefix_len < depth <= prefix_len + len(token_ids)``) into that slot.

    >>> prefill = WorkItem(req_index=1, prefix_len=0, token_ids=[5, 6, 7])
    >>> decode = WorkItem(2, 4, [9], SamplingParams(temperature=0.7, seed=3))
    >>> decode.prefix_len + len(decode.token_ids)  # the request's length after the step
    5
    >>> hit = WorkItem(3, 64, [7, 8], restore_from=2, snapshots=((65, 5),))

    ``slots`` (one per token; empty: the step allocates) are the token slots the host chose
    for ``token_ids`` (0 for a position the row borrows), carried as the batch's
    ``out_cache_loc``; the items of one batch all give them or none does.
    """

    req_index: int
    prefix_len: int
    token_ids: Sequence[int]
    sampling: SamplingParams = SamplingParams()
    restore_from: int = 0
    snapshots: tuple[tuple[int, int], ...] = ()
    slots: Sequence[int] = ()


def make_worker_batch(
    items: Sequence[WorkItem],
    *,
    vocab_size: int,
    max_context_len: int,
    forward_mode: ForwardMode = ForwardMode.EXTEND,
    num_requests: int | None = None,
    num_tokens: int | None = None,
    kv_width: int | None = None,
    max_extend_len: int | None = None,
    state: ServingState | None = None,
    num_snapshots: int | tuple[int, int] | None = None,
    snapshot_chunk: int | None = None,
) -> ModelWorkerBatch:
    """Host side: pack ``items`` into a ``ModelWorkerBatch`` padded to ``num_requests``
    rows and ``num_tokens`` tokens (defaults: exactly what the items need; ``kv_width`` and
    ``max_extend_len`` default to the longest request and the most new tokens).

    Raises ``ValueError`` naming the item for an empty token list, a token id that is not an
    int or lies outside the vocabulary, a row below 1 (row 0 is padding), a row used twice, a
    request outgrowing ``max_context_len``, more than one token per request in a DECODE
    batch, sampling that is not a ``SamplingParams``, or a batch that does not fit its
    buckets. Given the ``state`` the batch will run on, it also checks what ``step`` checks
    against the pools (each row allocated, ``prefix_len`` equal to the row's recorded length),
    at the cost of reading two small arrays from the device. ``num_snapshots`` (``M``, a shape
    bucket) makes an ``EXTEND`` batch carry ``restore_from`` and ``M`` snapshot entries (the
    items' ``snapshots``, padded); None: only when an item asks for them. As a pair
    ``(Mw, Ma)`` with ``snapshot_chunk`` (the KDA chunk), the entries between chunk
    boundaries come first, padded to ``Mw``, and those on the chunk grid of their request's
    extend (or at its end), which cost no extra work, after them, padded to ``Ma``.

    >>> batch = make_worker_batch([WorkItem(1, 0, [5, 6, 7]), WorkItem(2, 0, [8, 9])],
    ...                           vocab_size=64, max_context_len=16)
    >>> batch.batch_size, batch.num_tokens, batch.kv_width, batch.max_extend_len
    (2, 5, 3, 3)
    >>> dec = make_worker_batch([WorkItem(1, 3, [4])], vocab_size=64, max_context_len=16,
    ...                         forward_mode=ForwardMode.DECODE, num_requests=2, kv_width=16)
    >>> dec.input_ids.tolist(), dec.req_pool_indices.tolist(), dec.seq_lens.tolist()
    ([4, 0], [1, 0], [4, 0])
    >>> make_worker_batch([WorkItem(1, 0, [70])], vocab_size=64, max_context_len=16)
    Traceback (most recent call last):
    ...
    ValueError: request 0 (row 1): token_ids: token 0 is 70, outside the vocabulary [0, 64)
    """
    if not items:
        raise ValueError("make_worker_batch needs at least one request")
    tokens = _check_items(items, vocab_size, max_context_len, forward_mode, state)
    lens, seq, B, T, W, Q = _buckets(items, tokens, forward_mode, max_context_len,
                                     num_requests, num_tokens, kv_width, max_extend_len)
    extras = _snapshot_fields(items, tokens, forward_mode, B, num_snapshots, snapshot_chunk)
    if any(len(it.slots) for it in items):
        extras["out_cache_loc"] = _pad(np.concatenate([it.slots for it in items]), T)
    sp = [it.sampling for it in items]
    return ModelWorkerBatch(
        input_ids=_pad(np.concatenate(tokens), T),
        req_pool_indices=_pad([it.req_index for it in items], B),
        seq_lens=_pad(seq, B),
        extend_seq_lens=_pad(lens, B),
        temperatures=_pad([0.0 if s.greedy else s.temperature for s in sp], B, np.float32),
        top_ks=_pad([s.top_k for s in sp], B),
        top_ps=_pad([s.top_p for s in sp], B, np.float32, 1.0),
        seeds=_pad([s.seed or 0 for s in sp], B),
        kv_width=W,
        max_extend_len=Q,
        forward_mode=forward_mode,
        **extras,
    )


def _check_items(items, vocab_size, max_context_len, forward_mode, state):
    """The host checks of :func:`make_worker_batch`, one ``ValueError`` naming the item; the
    items' token ids, checked."""
    recorded = None
    if state is not None:  # the state-dependent checks step makes inside jit, with messages
        pool = state.req_to_token_pool
        recorded = (np.asarray(pool.req_to_state), np.asarray(pool.req_lens))
    seen: set[int] = set()
    seen_slots = [any(len(it.slots) for it in items)]
    return [_check_item(n, it, vocab_size, max_context_len, forward_mode, recorded, seen,
                        seen_slots) for n, it in enumerate(items)]


def _check_item(n, it, vocab_size, max_context_len, forward_mode, recorded, seen, seen_slots):
    """Item ``n``'s checks (``seen``: the rows of the items before it, this one added;
    ``seen_slots[0]``: whether the batch gives token slots); returns its token ids."""
    row = check_int(f"request {n}: req_index", it.req_index, 1)
    where = f"request {n} (row {row})"
    ids = token_ids(f"{where}: token_ids", it.token_ids, vocab_size)
    if row in seen:
        raise ValueError(f"request {n}: row {row} appears twice in the batch")
    seen.add(row)
    prefix = check_int(f"{where}: prefix_len", it.prefix_len, 0)
    if prefix + len(ids) > max_context_len:
        raise ValueError(f"{where}: {prefix + len(ids)} tokens exceed "
                         f"max_context_len={max_context_len}")
    if forward_mode == ForwardMode.DECODE and len(ids) != 1:
        raise ValueError(f"{where}: a DECODE batch takes one token per request, got "
                         f"{len(ids)}")
    if not isinstance(it.sampling, SamplingParams):
        raise ValueError(f"{where}: sampling={it.sampling!r} must be a SamplingParams")
    if len(it.slots) != (len(ids) if seen_slots[0] else 0):
        raise ValueError(f"{where}: {len(it.slots)} token slots for {len(ids)} tokens (the "
                         "items of a batch all give one slot per token, or none does)")
    if recorded is not None:
        states, lens = recorded
        if row >= states.shape[0] or states[row] == 0:
            raise ValueError(f"{where}: row {row} is not allocated in this state")
        if lens[row] != prefix:
            raise ValueError(f"{where}: prefix_len={prefix} but the row records "
                             f"{int(lens[row])} tokens (a stale or repeated batch?)")
    check_int(f"{where}: restore_from", it.restore_from, 0)
    if it.restore_from and prefix == 0:
        raise ValueError(f"{where}: restore_from={it.restore_from} needs a prefix to restore")
    for depth, slot in it.snapshots:
        if not prefix < check_int(f"{where}: snapshot depth", depth, 1) <= prefix + len(ids):
            raise ValueError(f"{where}: snapshot depth {depth} is outside this step's tokens "
                             f"({prefix}, {prefix + len(ids)}]")
        check_int(f"{where}: snapshot slot", slot, 1)
    return ids


def _buckets(items, tokens, forward_mode, max_context_len, num_requests, num_tokens, kv_width,
             max_extend_len):
    """``(lens, seq, B, T, W, Q)``: the items' new and total lengths and the batch's buckets
    (the defaults: exactly what the items need), checked."""
    lens = np.array([len(t) for t in tokens], np.int32)
    seq = lens + np.array([it.prefix_len for it in items], np.int32)
    B = num_requests or len(items)
    T = num_tokens or (B if forward_mode == ForwardMode.DECODE else int(lens.sum()))
    W = kv_width or int(seq.max())
    Q = max_extend_len or int(lens.max())
    if B < len(items):
        raise ValueError(f"num_requests={B} < {len(items)} requests")
    if T < lens.sum():
        raise ValueError(f"num_tokens={T} < {int(lens.sum())} new tokens")
    if forward_mode == ForwardMode.DECODE and T != B:
        raise ValueError(f"a DECODE batch has num_tokens == num_requests, got {T} and {B}")
    if not seq.max() <= W <= max_context_len:
        raise ValueError(f"kv_width={W} must be in {int(seq.max())}..{max_context_len}")
    if not lens.max() <= Q <= T:
        raise ValueError(f"max_extend_len={Q} must be in {int(lens.max())}..{T}")
    return lens, seq, B, T, W, Q


def _pad(values, size, dtype=np.int32, fill=0):
    out = np.full(size, fill, dtype)
    out[: len(values)] = values
    return jnp.asarray(out)


def _snapshot_fields(items, tokens, forward_mode, B, num_snapshots, snapshot_chunk) -> dict:
    """The batch's ``restore_from`` and ``snapshots`` fields (none when ``num_snapshots`` is
    None and no item asks for them): see :func:`make_worker_batch`."""
    snaps = [(n, d, sl) for n, it in enumerate(items) for d, sl in it.snapshots]
    if num_snapshots is None and (snaps or any(it.restore_from for it in items)):
        num_snapshots = len(snaps)
    if num_snapshots is None:
        return {}
    if forward_mode == ForwardMode.DECODE:
        raise ValueError("a DECODE batch restores and snapshots nothing")
    if isinstance(num_snapshots, tuple):  # (windowed, aligned), split by the chunk grid
        chunk = check_int("snapshot_chunk", snapshot_chunk, 1)
        on_grid = [(d - items[n].prefix_len) % chunk == 0
                   or d == items[n].prefix_len + len(tokens[n]) for n, d, _ in snaps]
        parts = [[e for e, g in zip(snaps, on_grid, strict=True) if g == want]
                 for want in (False, True)]
        sizes = [check_int(f"num_snapshots[{i}]", m, len(p))
                 for i, (m, p) in enumerate(zip(num_snapshots, parts, strict=True))]
        windowed = sizes[0]
        snaps = parts[0] + [(0, 0, 0)] * (sizes[0] - len(parts[0])) + parts[1]
        M = sum(sizes)
    else:
        M = check_int("num_snapshots", num_snapshots, len(snaps))
        windowed = None
    cols = list(zip(*snaps, strict=True)) if snaps else [[], [], []]
    return dict(
        restore_from=_pad([it.restore_from for it in items], B),
        snapshots=SnapshotSpec(batch_index=_pad(cols[0], M), lens=_pad(cols[1], M),
                               slots=_pad(cols[2], M), windowed=windowed))
