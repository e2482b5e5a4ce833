"""``RefServingPools``: the reference of what one serving ``step`` may do to the pools (which
slots it allocates, which cells it writes, and nothing else), over ``RefSlotAllocator`` and
``RefReqToTokenPool``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Int

from hybridattn.backends import ForwardMode
from hybridattn.serving import (
    ModelWorkerBatch,
    ServingState,
)
from hybridattn.testing.common import (
    fail,
    host,
)
from hybridattn.testing.ref_pools import RefReqToTokenPool, RefSlotAllocator


class RefServingPools:
    """Model of a ``ServingState``'s bookkeeping, for tests around ``step`` and ``release``.

    Holds a ``RefSlotAllocator`` of the token slots (``tokens``), a ``RefReqToTokenPool``
    (``requests``) and a copy of the pools' contents. ``step`` checks a step's result against
    the serving contract: ``ok`` exactly when the batch fits (allocated rows, lengths within its
    buckets) and enough token slots are free; then every live request's new tokens got distinct,
    previously free token slots, recorded at its new positions, and nothing else in the tables
    changed; and, ok or not, no MLA latent or KDA state outside the sink, the new tokens' slots
    and the batch's own state slots changed, bit for bit.

    >>> from hybridattn import KimiLinearConfig, ServingState, WorkItem, make_worker_batch
    >>> state = ServingState.create(KimiLinearConfig.tiny(), max_running_requests=2,
    ...                             max_context_len=8, num_token_slots=17)
    >>> ref = RefServingPools.from_state(state)
    >>> batch = make_worker_batch([WorkItem(1, 0, [5, 6])], vocab_size=256, max_context_len=8)
    >>> ref.expect_ok(batch)  # row 1 is not allocated: step would return ok=False
    False
    """

    def __init__(self, tokens: RefSlotAllocator, requests: RefReqToTokenPool,
                 vocab_size: int | None = None):
        self.tokens = tokens
        self.requests = requests
        self.vocab_size = vocab_size
        self._contents: tuple | None = None

    @classmethod
    def from_state(cls, state: ServingState) -> RefServingPools:
        """The model of a real state (checked against it, contents copied)."""
        ref = cls(RefSlotAllocator.from_allocator(state.token_allocator),
                  RefReqToTokenPool.from_pool(state.req_to_token_pool), state.config.vocab_size)
        ref.check(state)
        return ref

    def expect_ok(self, batch: ModelWorkerBatch) -> bool:
        """Whether ``step`` must succeed on ``batch``: no negative row, length or token count;
        every request with new tokens names a distinct row in use (never row 0) whose recorded
        length is ``seq_lens - extend_seq_lens``, with ``seq_lens <= kv_width`` and
        ``extend_seq_lens <= max_extend_len``; its tokens lie in the vocabulary; the new tokens
        fit ``T`` and the free token slots (positions a row borrows take none)."""
        rows, seq, ext = (host(x).astype(np.int64) for x in
                          (batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens))
        if (rows < 0).any() or (seq < 0).any() or (ext < 0).any():
            return False
        ids = host(batch.input_ids).astype(np.int64)
        start = 0
        seen: set[int] = set()
        for b, (r, s, e) in enumerate(zip(rows.tolist(), seq.tolist(), ext.tolist(),
                                          strict=True)):
            if e == 0:
                continue
            if r in seen or r not in self.requests.rows or self.requests.lens[r] != s - e:
                return False
            if s > batch.kv_width or e > batch.max_extend_len:
                return False
            seen.add(r)
            mine = ids[b: b + 1] if batch.forward_mode == ForwardMode.DECODE else ids[
                start: start + e]
            start += e
            if self.vocab_size is not None and ((mine < 0) | (mine >= self.vocab_size)).any():
                return False
        # new token slots: every new position but those the row borrows from a prefix cache
        fresh = sum(max(s - max(s - e, self.requests.borrowed[r]), 0)
                    for r, s, e in zip(rows.tolist(), seq.tolist(), ext.tolist(), strict=True)
                    if e > 0)
        return int(ext.sum()) <= batch.num_tokens and self.tokens.can_alloc(fresh)

    def step(self, batch: ModelWorkerBatch, state: ServingState,
             ok: Bool[ArrayLike, ""]) -> ServingState:
        """Check ``(state, out) = step(params, old, batch)`` given ``state`` and ``out.ok`` (see
        the class docstring) and record it. Returns ``state``."""
        expect = self.expect_ok(batch)
        if bool(ok) != expect:
            fail(f"step returned ok={bool(ok)}, expected {expect}")
        rows, seq, ext = (host(x).astype(np.int64) for x in
                          (batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens))
        table = host(state.req_to_token_pool.req_to_token)
        new_slots: list[int] = []
        live_states: set[int] = set()
        if expect:
            for r, s, e in zip(rows, seq, ext, strict=True):
                if r > 0 and e > 0:
                    lo = max(s - e, self.requests.borrowed[r])  # borrowed positions keep theirs
                    got = table[r, lo: s].tolist()
                    new_slots += got
                    live_states.add(self.requests.rows[r])
                    self.requests.table[r][lo: s] = got
                    self.requests.lens[r] = s
            self.tokens._take(new_slots, "the step's new-token allocation")
        self._check_untouched(state, {0, *new_slots}, {0, *live_states})
        self.check(state)
        return state

    def apply(self, batch: ModelWorkerBatch) -> bool:
        """Simulate ``step``'s bookkeeping without a device (for host schedulers driven against
        the model): when ``expect_ok(batch)``, every live request's new tokens take the
        smallest free token slots, recorded at their positions. Returns the ``ok`` that
        ``step`` would return.

        >>> ref = RefServingPools(RefSlotAllocator(9), RefReqToTokenPool(2, 8), vocab_size=64)
        >>> row = ref.requests.take(1)[0]
        >>> from hybridattn import WorkItem, make_worker_batch
        >>> ref.apply(make_worker_batch([WorkItem(row, 0, [5, 6])], vocab_size=64,
        ...                             max_context_len=8))
        True
        >>> ref.requests.token_slots(row)[:3], ref.requests.lens[row]
        ([1, 2, 0], 2)
        """
        if not self.expect_ok(batch):
            return False
        rows, seq, ext = (host(x).astype(np.int64) for x in
                          (batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens))
        for r, n, e in zip(rows.tolist(), seq.tolist(), ext.tolist(), strict=True):
            if e > 0:
                lo = max(n - e, self.requests.borrowed[r])  # borrowed positions keep theirs
                got = sorted(self.tokens.free)[: max(n - lo, 0)]
                self.tokens._take(got, "apply")
                self.requests.table[r][lo: n] = got
                self.requests.lens[r] = n
        return True

    def borrow(self, row: int, slots: Sequence[int], computed: int | None = None) -> None:
        """Record ``serving.borrow_prefix``: the row borrows ``slots``; the row's own slots
        they replace are freed."""
        self.tokens.free_slots(self.requests.borrow(row, slots, computed))

    def release(self, req_pool_indices: Int[ArrayLike, " B"] | Sequence[int],
                mask: Bool[ArrayLike, " B"] | None = None,
                keep_from: Sequence[int | None] | None = None) -> None:
        """Record ``serving.release(state, req_pool_indices, mask, keep_from=...)``: every row in
        use (each once; row 0, free rows and repeats ignored) gives back the token slots it
        owns (recorded at positions from its borrowed length up to ``keep_from``), its row
        and its state slot."""
        rows = host(req_pool_indices).astype(np.int64).reshape(-1)
        keep = np.ones_like(rows, bool) if mask is None else host(mask).astype(bool)
        upto = [None] * len(rows) if keep_from is None else list(keep_from)
        done: list[int] = []
        for r, k, u in zip(rows.tolist(), keep.reshape(-1).tolist(), upto, strict=True):
            if k and r in self.requests.rows and r not in done:
                done.append(r)
                lo = self.requests.borrowed[r]
                hi = self.requests.max_context_len if u is None else u
                self.tokens.free_slots([s for s in self.requests.table[r][lo:hi] if s])
        self.requests.free_reqs(np.asarray(done, np.int64))

    def check(self, state: ServingState) -> None:
        """Assert that ``state``'s allocators and tables hold exactly the model; its pool
        contents become the reference the next ``step`` is compared with."""
        self.tokens.check(state.token_allocator)
        self.requests.check(state.req_to_token_pool)
        self._snapshot(state)

    def _snapshot(self, state: ServingState) -> None:
        """Copy the pool contents, which the next ``step`` may only change where it writes."""
        self._contents = tuple(
            tuple(host(x) for x in xs) for xs in (
                state.token_to_kv_pool.c_kv, state.token_to_kv_pool.k_pe,
                state.recurrent_state_pool.conv, state.recurrent_state_pool.ssm))

    def _check_untouched(self, state: ServingState, token_slots: set[int],
                         state_slots: set[int]) -> None:
        if self._contents is None:
            return
        kv, rs = state.token_to_kv_pool, state.recurrent_state_pool
        new = (kv.c_kv, kv.k_pe, rs.conv, rs.ssm)
        names = ("MLA c_kv", "MLA k_pe", "KDA conv state", "KDA recurrent state")
        for name, olds, news, may in zip(names, self._contents, new,
                                         (token_slots, token_slots, state_slots, state_slots),
                                         strict=True):
            for layer, (old, now) in enumerate(zip(olds, news, strict=True)):
                keep = np.ones(old.shape[0], bool)
                keep[sorted(may)] = False
                now = host(now)
                changed = np.flatnonzero(keep & ~np.all(
                    (old == now).reshape(old.shape[0], -1), axis=1))
                if changed.size:
                    fail(f"{name} of layer #{layer} changed at slots {changed.tolist()}, "
                          f"which the step may not write")
