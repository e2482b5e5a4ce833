"""The pure serving step: ``new_state, out = step(params, state, batch)``.

``ServingState`` holds everything a serving step reads and writes: the request table
(with each request's recurrent-state slot), the token-slot allocator, the MLA latent pool, the
KDA state pool, the attention backend (static configuration only) and the base RNG key.
``ModelWorkerBatch`` is one step's work, padded to shape buckets: extend requests (a whole
prompt, a chunk of one, or a chunk after a cached prefix) and decode requests (one token each)
mixed in one ``EXTEND`` batch, or a ``DECODE`` batch of one token per request.

One step, all inside one ``jax.jit``::

    allocate a token slot for every new token  (a failed allocation: ok=False, state unchanged)
    req_to_token[row, position] = slot
    ForwardBatch -> backend metadata -> model forward (MLA latents and KDA states written)
    last-token logits of every request -> per-request sampling -> next tokens

Sampling is per request (greedy when ``temperature == 0``, else temperature, top-k, top-p) and
reproducible: the key of a request's token at position ``p`` is derived from the state's base
key, the request's ``seed`` and ``p`` only, so a request samples the same tokens whichever
other requests share its batches (up to floating-point rounding: a step's shapes choose the
kernels, so logits agree to ~1e-6, and a near-tie may break either way). Requests with equal
seeds and prompts sample alike; give them different seeds for different samples.

The step composes: ``decode_steps`` runs up to N decode steps in a ``lax.while_loop`` (rows
that sample a stop token or reach their token budget turn into padding inside it), and users
may write their own loops around ``step`` the same way.

Request rows are allocated by the host (``hybridattn.pools.alloc_reqs_or_raise`` on
``state.req_to_token_pool``) and released with ``release``, which frees a request's token
slots, its row and its state slot together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key

from hybridattn._pytree import pytree_dataclass
from hybridattn.backends import (
    ForwardBatch,
    ForwardMode,
    HybridLinearAttnBackend,
    MLAAttnBackend,
    SnapshotSpec,
    attn_backend_wrapper,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear
from hybridattn.models.kimi_linear.params import _check_supported
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    RecurrentStatePool,
    SlotAllocator,
    alloc,
    copy_states_to,
    free,
    free_reqs,
    write_token_slots,
)
from servecore.sampling import SamplingParams
from servecore.validate import check_int, token_ids

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

        With a ``(data, tensor)`` ``mesh`` (``hybridattn.sharding.make_mesh``) the state is
        sharded (``hybridattn.sharding.create_state``): ``data`` stacked shards, each with
        ``max_running_requests / data`` rows and ``num_token_slots / data`` token slots (its
        own sinks included), KDA states split by head; ``mesh_shape`` records the mesh."""
        if mesh is not None:
            from hybridattn import sharding
            return sharding.create_state(
                config, mesh, max_running_requests=max_running_requests,
                max_context_len=max_context_len, num_token_slots=num_token_slots, dtype=dtype,
                chunk_size=chunk_size, seed=seed, num_snapshot_slots=num_snapshot_slots)
        _check_supported(config)
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
    """

    req_index: int
    prefix_len: int
    token_ids: Sequence[int]
    sampling: SamplingParams = SamplingParams()
    restore_from: int = 0
    snapshots: tuple[tuple[int, int], ...] = ()


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
    return [_check_item(n, it, vocab_size, max_context_len, forward_mode, recorded, seen)
            for n, it in enumerate(items)]


def _check_item(n, it, vocab_size, max_context_len, forward_mode, recorded, seen):
    """Item ``n``'s checks (``seen``: the rows of the items before it, this one added);
    returns its token ids."""
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

class StepOutput(NamedTuple):
    """What a step returns besides the new state: per request the sampled next token and the
    last new token's logits (float32), and ``ok``; per token of the batch the token slot its
    KV went to (``token_slots``, 0 for padding and for positions below a borrowed prefix,
    whose slots stay the borrowed ones), so a host can follow each row's slots without reading
    ``req_to_token`` back. ``ok`` False: the token slots ran out or the batch did not fit its
    buckets / named a free row; every request ran as padding, so only the slot-0 sinks
    changed, the tokens and slots are 0 and the logits meaningless.

    Its shapes, from ``jax.eval_shape`` (traces the step, computes and compiles nothing):

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


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def sample(
    logits: Float[Array, "B V"],
    temperatures: Float[Array, " B"],
    top_ks: Int[Array, " B"],
    top_ps: Float[Array, " B"],
    keys: Key[Array, " B"],
) -> Int[Array, " B"]:
    """Per-row sampling: argmax where ``temperature == 0``; otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens (0: all)
    and to the smallest set of most likely tokens whose probability reaches ``top_p``.
    ``keys`` holds one typed PRNG key per row (``request_keys``). Row 0 below is greedy,
    row 1 samples from its top-1 token only:

    >>> logits = jnp.array([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> sample(logits, jnp.array([0.0, 1.0]), jnp.array([0, 1]), jnp.ones(2), keys).tolist()
    [1, 1]
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperatures > 0
    needs_sort = jnp.any(sampling & ((top_ks > 0) | (top_ps < 1)))
    temps = jnp.maximum(temperatures, 1e-6)[:, None]
    B, V = logits.shape

    def kept(_):  # top-k / top-p need the logits sorted
        order = jnp.argsort(-logits, axis=-1)
        scaled = jnp.take_along_axis(logits, order, axis=-1) / temps
        rank = jnp.arange(V)[None]
        keep = (top_ks[:, None] <= 0) | (rank < top_ks[:, None])
        probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
        # rank 0 always kept (even if top_p rounded to 0 in float32); top_p == 1 keeps
        # everything (the f32 running sum may round)
        keep &= (((jnp.cumsum(probs, axis=-1) - probs) < top_ps[:, None])
                 | (top_ps[:, None] >= 1) | (rank == 0))
        return jnp.zeros_like(keep).at[jnp.arange(B)[:, None], order].set(keep)  # vocab order

    def drawn(_):
        # jax.random.categorical(key, x) is argmax(gumbel(key) + x): one draw of the noise
        # serves the filtered rows and the others (a row without filters draws exactly as
        # with none), and the sort runs only when some row filters
        keep = jax.lax.cond(needs_sort, kept, lambda _: jnp.ones((B, V), bool), None)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        return jnp.argmax(noise + jnp.where(keep, logits / temps, -jnp.inf),
                          axis=-1).astype(jnp.int32)

    tokens = jax.lax.cond(jnp.any(sampling), drawn, lambda _: greedy, None)
    return jnp.where(sampling, tokens, greedy)


def request_keys(
    base: Key[Array, ""], seeds: Int[Array, " B"], positions: Int[Array, " B"]
) -> Key[Array, " B"]:
    """The sampling key of each request's token at ``positions``: a function of the base key,
    the request's seed and the position only (so not of the batch it runs in).

    >>> base = jax.random.key(0)
    >>> keys = request_keys(base, jnp.array([3, 3, 4]), jnp.array([10, 10, 10]))
    >>> keys.shape
    (3,)
    >>> [bool((jax.random.key_data(keys[0]) == jax.random.key_data(k)).all()) for k in keys]
    [True, True, False]
    """
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(
        seeds, positions
    )


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

    Allocates a token slot for every new token and records it in ``req_to_token``; runs the
    model through the hybrid backend (MLA latents and KDA states written to the pools);
    samples each request's next token from its last new token's logits. Rows with no new
    token are padding. If the token slots run out, or the batch does not fit the state (a row
    that is negative, past the pool, free or repeated, a padding row carrying tokens,
    ``seq_lens`` that disagree with a row's recorded length, a token outside the vocabulary, a
    length beyond the batch's buckets), ``ok`` is False: every request runs as padding, so only
    the slot-0 sinks are written and every live slot is unchanged.

    ``comm`` is for ``hybridattn.sharding``, which runs this step on every device of a mesh
    with that device's shard of ``params`` and ``state`` (None: one device).

    Two prompts in one EXTEND batch; row 2's prompt ``[8, 9, 10, 11]`` comes in two chunks:

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
    allocator, packed, ok = alloc(state.token_allocator, jnp.where(fits, jnp.sum(fresh), -1),
                                  max_count=T)
    # A failed step turns every request into padding: row 0, state slot 0, token slot 0 (the
    # sinks), so the forward runs but writes nothing live; no lax.cond, no pool copies.
    go = ok & (batch.extend_seq_lens > 0)
    req_rows = jnp.where(go, batch.req_pool_indices, 0)
    fresh = fresh & ok
    slots = jnp.where(fresh, packed[jnp.clip(jnp.cumsum(fresh) - 1, 0, T - 1)], 0)
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

def _padding_unless(batch: ModelWorkerBatch, keep: Bool[Array, " B"]) -> ModelWorkerBatch:
    """``batch`` with the rows where ``keep`` is False turned into padding (row 0, no new
    token): they allocate no token slot and write only the slot-0 sinks."""
    zero = jnp.zeros_like(batch.req_pool_indices)
    return batch.replace(
        input_ids=jnp.where(keep, batch.input_ids, 0).astype(jnp.int32),
        req_pool_indices=jnp.where(keep, batch.req_pool_indices, zero),
        seq_lens=jnp.where(keep, batch.seq_lens, 0).astype(jnp.int32),
        extend_seq_lens=jnp.where(keep, batch.extend_seq_lens, 0).astype(jnp.int32),
    )


def _decode_limits(batch: ModelWorkerBatch, num_steps: int, stop_token_ids, max_tokens):
    """:func:`decode_steps`'s checked ``(stop_token_ids [B, S], limits [B])`` (the steps each
    row may run), with their defaults (no stop token; ``num_steps``)."""
    if batch.forward_mode != ForwardMode.DECODE:
        raise ValueError(f"decode_steps starts from a DECODE batch, got forward_mode="
                         f"{batch.forward_mode.name} (run the prompt with step, then "
                         "next_decode)")
    B = batch.batch_size
    if stop_token_ids is None:
        stop_token_ids = jnp.full((B, 1), -1, jnp.int32)
    if stop_token_ids.ndim != 2 or stop_token_ids.shape[0] != B:
        raise ValueError(f"stop_token_ids has shape {stop_token_ids.shape}, expected "
                         f"[B={B}, S]")
    limits = (jnp.full((B,), num_steps, jnp.int32) if max_tokens is None
              else jnp.minimum(max_tokens, num_steps).astype(jnp.int32))
    if limits.shape != (B,):
        raise ValueError(f"max_tokens has shape {limits.shape}, expected [B={B}]")
    return stop_token_ids, limits


def decode_steps(
    params,
    state: ServingState,
    batch: ModelWorkerBatch,
    num_steps: int,
    stop_token_ids: Int[Array, "B S"] | None = None,
    max_tokens: Int[Array, " B"] | None = None,
    return_slots: bool = False,
) -> (tuple[ServingState, Int[Array, "N B"], Bool[Array, ""]]
      | tuple[ServingState, Int[Array, "N B"], Bool[Array, ""], Int[Array, "N B"]]):
    """Up to ``num_steps`` greedy-or-sampled decode steps in one ``lax.while_loop``,
    starting from a DECODE ``batch`` whose ``input_ids`` are each request's next token and
    whose ``kv_width`` has room for the tokens each request may run. Returns ``(state,
    tokens [num_steps, B], ok)``: ``tokens[i, b]`` is what row ``b`` sampled at step ``i``,
    or -1 where the row ran no step ``i`` (padding, a finished row, a failed step); ``ok``
    is False if a step ran out of slots (that step and the later ones changed nothing). With
    ``return_slots``, also ``slots [num_steps, B]``: the token slot each step wrote row
    ``b``'s token to (0 where it ran none), as ``StepOutput.token_slots``.

    A request finishes inside the run when it samples one of its ``stop_token_ids[b]``
    (padded with -1; default: none) or has run ``max_tokens[b]`` steps (default:
    ``num_steps``; 0: it runs none). From the next step on its row is padding: no token slot,
    no ``req_to_token`` entry, no MLA latent or KDA state written, so the pools end as if it
    had been stepped alone up to its finish. The loop ends early once every row has
    finished. Sampling keys depend on the request and position only, so the tokens are those
    of ``step`` called step by step.

    Jit it with ``num_steps`` static: ``jax.jit(decode_steps, static_argnums=3,
    donate_argnums=1)``; it compiles once per batch bucket, ``num_steps`` and stop-set width
    ``S``. Here only its shapes (``jax.eval_shape`` compiles nothing), for rows 1 and 2 with
    3 and 2 tokens in the pools; row 2 stops on token 7 or after 4 tokens:

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> batch = make_worker_batch([WorkItem(1, 3, [11]), WorkItem(2, 2, [12])],
    ...                           vocab_size=64, max_context_len=16,
    ...                           forward_mode=ForwardMode.DECODE, kv_width=16)
    >>> stops, limits = jnp.array([[-1], [7]]), jnp.array([8, 4])
    >>> _, tokens, ok = jax.eval_shape(lambda p, s, b: decode_steps(p, s, b, 8, stops, limits),
    ...                                kimi_linear.param_shapes(cfg), state, batch)
    >>> tokens.shape, tokens.dtype, ok.shape  # [num_steps, B]
    ((8, 2), dtype('int32'), ())
    """
    check_int("num_steps", num_steps, 1)
    stop_token_ids, limits = _decode_limits(batch, num_steps, stop_token_ids, max_tokens)
    B = batch.batch_size
    alive = (batch.req_pool_indices > 0) & (batch.extend_seq_lens > 0) & (limits > 0)
    tokens = jnp.full((num_steps, B), -1, jnp.int32)
    slots = jnp.zeros((num_steps, B), jnp.int32)

    def cond(carry):
        i, _, _, alive, _, _, _, _ = carry
        return (i < num_steps) & jnp.any(alive)

    def body(carry):
        i, state, batch, alive, ran, ok, tokens, slots = carry
        state, out = step(params, state, batch)
        ok &= out.ok
        stepped = alive & out.ok  # a failed step ran every row as padding
        tok = out.next_token_ids
        tokens = tokens.at[i].set(jnp.where(stepped, tok, -1))
        slots = slots.at[i].set(jnp.where(stepped, out.token_slots, 0))
        ran += stepped
        hit = jnp.any(tok[:, None] == stop_token_ids, axis=1)
        alive = stepped & ~hit & (ran < limits)
        # finished rows run as padding from here on (next_decode keeps padding as padding)
        batch = _padding_unless(batch.next_decode(tok), alive)
        return i + 1, state, batch, alive, ran, ok, tokens, slots

    carry = (jnp.int32(0), state, _padding_unless(batch, alive), alive,
             jnp.zeros(B, jnp.int32), jnp.bool_(True), tokens, slots)
    _, state, _, _, _, ok, tokens, slots = jax.lax.while_loop(cond, body, carry)
    return (state, tokens, ok, slots) if return_slots else (state, tokens, ok)


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


__all__ = [
    "ModelWorkerBatch",
    "borrow_prefix",
    "SamplingParams",
    "ServingState",
    "StepOutput",
    "WorkItem",
    "decode_steps",
    "make_worker_batch",
    "release",
    "request_keys",
    "sample",
    "step",
]
