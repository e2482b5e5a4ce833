"""Reference models of the pools' bookkeeping: ``RefSlotAllocator`` (a slot allocator as two
sets) and ``RefReqToTokenPool`` (the request table as dicts). Each takes a real call's result,
asserts that it is a correct answer and records it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Int

from hybridattn.pools import (
    HybridReqToTokenPool,
    ReqToTokenPool,
    SlotAllocator,
)
from hybridattn.testing.common import (
    checked_int,
    fail,
    free_stack,
    host,
)


class RefSlotAllocator:
    """Plain-Python model of a ``SlotAllocator``: the sets of ``free`` and ``used`` slot ids
    over ``1 .. num_slots - 1`` (slot 0 is the sink).

    It does not predict *which* ids an allocation returns (any free ones are correct): it checks
    a real call's answer and records it. ``alloc`` takes what ``pools.alloc`` returned,
    ``free_slots`` records a ``pools.free``, ``check`` compares a real allocator with the model.
    A wrong answer is an ``AssertionError`` that says what is wrong.

    >>> import jax.numpy as jnp
    >>> from hybridattn.pools import SlotAllocator, alloc, free
    >>> a, ref = SlotAllocator.create(5), RefSlotAllocator(5)
    >>> a = ref.alloc(3, *alloc(a, 3, max_count=4))  # checks the answer, returns the allocator
    >>> sorted(ref.used), sorted(ref.free)
    ([1, 2, 3], [4])
    >>> a = ref.alloc(2, *alloc(a, 2, max_count=4))  # only 1 free: must fail, change nothing
    >>> ref.free_slots([2, 0]), ref.check(free(a, jnp.array([2, 0])))  # 0 ignored, not counted
    (0, None)
    >>> ref.can_alloc(2)
    True
    """

    def __init__(self, num_slots: int):
        self.num_slots = checked_int("num_slots", num_slots, 2)
        self.free: set[int] = set(range(1, num_slots))
        self.used: set[int] = set()

    @classmethod
    def from_allocator(cls, allocator: SlotAllocator) -> RefSlotAllocator:
        """The model of a real allocator's current state (its free stack is checked first)."""
        ref = cls(allocator.num_slots)
        stack = free_stack(allocator)
        ref.free, ref.used = set(stack), set(range(1, allocator.num_slots)) - set(stack)
        ref.check(allocator)
        return ref

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (the sink excluded)."""
        return self.num_slots - 1

    def can_alloc(self, count: int) -> bool:
        """Whether allocating ``count`` slots must succeed."""
        return 0 <= count <= len(self.free)

    def alloc(
        self, count: int, allocator: SlotAllocator, slots: Int[ArrayLike, " M"],
        ok: Bool[ArrayLike, ""],
    ) -> SlotAllocator:
        """Check ``(allocator, slots, ok) = pools.alloc(old, count, max_count)`` and record it.

        ``ok`` must be whether ``count`` slots were free (and ``count <= max_count``); then
        ``slots[:count]`` are distinct free ids and the rest 0, else all of ``slots`` is 0. Then
        ``check`` ``(allocator)``. Returns ``allocator``.
        """
        slots = host(slots).astype(np.int64)
        expect = self.can_alloc(count) and count <= slots.shape[0]
        if bool(ok) != expect:
            fail(f"alloc({count}) with {len(self.free)} free: ok={bool(ok)}, expected "
                  f"{expect}")
        if expect:
            self._take(slots[:count].tolist(), f"alloc({count})")
            if slots[count:].any():
                fail(f"alloc({count}) returned {slots.tolist()}: nonzero past count")
        elif slots.any():
            fail(f"a failed alloc({count}) returned slots {slots.tolist()}, expected zeros")
        self.check(allocator)
        return allocator

    def claim(self, slots: Int[ArrayLike, " M"], allocator: SlotAllocator,
              ok: Bool[ArrayLike, ""], mask: Bool[ArrayLike, " M"] | None = None,
              ) -> SlotAllocator:
        """Check ``(allocator, ok) = pools.claim(old, slots, mask)`` and record it: ``ok``
        must be whether the named slots (``mask``, else the nonzero entries) are distinct and
        free; then ``check`` ``(allocator)``. Returns ``allocator``."""
        slots = host(slots).astype(np.int64).reshape(-1)
        named = slots[slots != 0] if mask is None else slots[host(mask).astype(bool)]
        ids = named.tolist()
        expect = len(set(ids)) == len(ids) and set(ids) <= self.free
        if bool(ok) != expect:
            fail(f"claim({ids}) with free {sorted(self.free)}: ok={bool(ok)}, expected "
                 f"{expect}")
        if expect:
            self._take(ids, f"claim({ids})")
        self.check(allocator)
        return allocator

    def _take(self, got: list[int], what: str) -> None:
        """Record ``got`` as handed out by ``what``: they must be distinct free slots."""
        if len(set(got)) != len(got) or not set(got) <= self.free:
            fail(f"{what} returned {got}: not distinct free slots (free: {sorted(self.free)})")
        self.free -= set(got)
        self.used |= set(got)

    def free_slots(self, slots: Int[ArrayLike, " M"] | Sequence[int],
                   mask: Bool[ArrayLike, " M"] | None = None) -> int:
        """Record ``pools.free(allocator, slots, mask)``: 0, ids outside ``1 .. capacity``,
        slots not in use (a double free) and repeats are ignored, as the real ``free`` does.
        Returns how many slots it ignored that the caller asked to free."""
        slots = host(slots).astype(np.int64).reshape(-1)
        keep = (slots > 0) & (slots <= self.capacity)
        if mask is not None:
            keep &= host(mask).astype(bool).reshape(-1)
        ids = set(slots[keep].tolist()) & self.used
        self.used -= ids
        self.free |= ids
        return int(keep.sum()) - len(ids)

    def check(self, allocator: SlotAllocator) -> None:
        """Assert that ``allocator`` holds exactly the model's free slots, each once."""
        if allocator.num_slots != self.num_slots:
            fail(f"allocator has {allocator.num_slots} slots, the model {self.num_slots}")
        stack = free_stack(allocator)
        if len(stack) != len(set(stack)):
            fail(f"a slot is free twice: free stack {stack}")
        if set(stack) != self.free:
            fail(f"free slots {sorted(stack)}, expected {sorted(self.free)}")
        pos = host(allocator.stack_pos)
        lost = [(s, int(pos[s]), i) for i, s in enumerate(stack) if pos[s] != i]
        if lost:
            fail(f"stack_pos disagrees with the free stack: (slot, stack_pos, place) {lost}")
        if allocator.num_used != len(self.used):
            fail(f"num_used={allocator.num_used}, expected {len(self.used)}")
        in_use = set(np.flatnonzero(host(allocator.in_use)).tolist())
        if in_use != self.used:
            fail(f"in_use marks {sorted(in_use)}, expected {sorted(self.used)}")


class RefReqToTokenPool:
    """Plain-Python model of a ``ReqToTokenPool`` or ``HybridReqToTokenPool``: ``rows`` maps
    each live request row to its recurrent-state slot (0 on a plain pool), ``table`` each live
    row to its ``max_context_len`` token slots.

    Like ``RefSlotAllocator`` it checks real answers (``alloc_reqs``), records updates
    (``free_reqs``, ``write_token_slots``) and compares (``check``).

    >>> import jax.numpy as jnp
    >>> from hybridattn.pools import HybridReqToTokenPool, alloc_reqs, write_token_slots
    >>> pool, ref = HybridReqToTokenPool.create(2, 4), RefReqToTokenPool(2, 4)
    >>> pool = ref.alloc_reqs(1, *alloc_reqs(pool, 1, max_count=2))
    >>> row = next(iter(ref.rows))
    >>> args = jnp.array([row, row]), jnp.array([0, 1]), jnp.array([7, 9])
    >>> pool = write_token_slots(pool, *args); ref.write_token_slots(*args); ref.check(pool)
    >>> ref.token_slots(row)
    [7, 9, 0, 0]
    """

    def __init__(self, max_running_requests: int, max_context_len: int,
                 num_state_slots: int | None = None, hybrid: bool = True):
        self.max_running_requests = checked_int("max_running_requests", max_running_requests, 1)
        self.max_context_len = checked_int("max_context_len", max_context_len, 1)
        self.hybrid = bool(hybrid)
        self.num_state_slots = (max_running_requests + 1 if num_state_slots is None
                                else checked_int("num_state_slots", num_state_slots, 2))
        self.rows: dict[int, int] = {}
        self.table: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}  # recorded length of each live row
        self.borrowed: dict[int, int] = {}  # leading positions each row borrows from a cache

    @classmethod
    def from_pool(cls, pool: ReqToTokenPool) -> RefReqToTokenPool:
        """The model of a real pool's current state (checked against it first)."""
        hybrid = isinstance(pool, HybridReqToTokenPool)
        ref = cls(pool.max_running_requests, pool.max_context_len,
                  pool.num_state_slots if hybrid else None, hybrid=hybrid)
        free = set(free_stack(pool.allocator))
        states = host(pool.req_to_state) if hybrid else None
        table, lens, bor = host(pool.req_to_token), host(pool.req_lens), host(pool.borrowed)
        for row in sorted(set(range(1, pool.max_running_requests + 1)) - free):
            ref.rows[row] = int(states[row]) if hybrid else 0
            ref.table[row] = table[row].tolist()
            ref.lens[row] = int(lens[row])
            ref.borrowed[row] = int(bor[row])
        ref.check(pool)
        return ref

    @property
    def free_rows(self) -> set[int]:
        """Request rows not in use."""
        return set(range(1, self.max_running_requests + 1)) - set(self.rows)

    @property
    def free_states(self) -> set[int]:
        """State slots not in use (empty on a plain pool)."""
        if not self.hybrid:
            return set()
        return set(range(1, self.num_state_slots)) - set(self.rows.values())

    def can_alloc(self, count: int) -> bool:
        """Whether allocating ``count`` request rows (and state slots) must succeed."""
        fit = count <= len(self.free_rows)
        if self.hybrid:
            fit = fit and count <= len(self.free_states)
        return 0 <= count and fit

    def take(self, count: int) -> list[int]:
        """Simulate ``alloc_reqs`` without a device: the ``count`` smallest free rows, each with
        the smallest free state slot; an ``AssertionError`` if they are not free.

        >>> ref = RefReqToTokenPool(max_running_requests=3, max_context_len=4)
        >>> ref.take(2), ref.rows
        ([1, 2], {1: 1, 2: 2})
        """
        if not self.can_alloc(count):
            fail(f"take({count}): {len(self.free_rows)} free rows, {len(self.free_states)} "
                  "free state slots")
        rows = sorted(self.free_rows)[:count]
        for r in rows:
            self.rows[r] = min(self.free_states) if self.hybrid else 0
            self.table[r] = [0] * self.max_context_len
            self.lens[r] = self.borrowed[r] = 0
        return rows

    def borrow(self, row: int, slots: Sequence[int], computed: int | None = None) -> list[int]:
        """Record ``serving.borrow_prefix`` for ``row``: its first ``len(slots)`` positions
        hold ``slots`` (a cache's) and are borrowed; returns the row's own slots it replaced
        (the real call frees them).

        >>> ref = RefReqToTokenPool(max_running_requests=1, max_context_len=4)
        >>> row = ref.take(1)[0]
        >>> ref.borrow(row, [7, 8], computed=1), ref.token_slots(row), ref.borrowed[row]
        ([], [7, 8, 0, 0], 2)
        """
        if row not in self.rows:
            fail(f"borrow into row {row}, which is not in use")
        old = self.table[row][: len(slots)]
        replaced = [o for p, (o, n) in enumerate(zip(old, slots, strict=True))
                    if p >= self.borrowed[row] and o and o != n]
        self.table[row][: len(slots)] = list(slots)
        self.borrowed[row] = len(slots)
        if computed is not None:
            self.lens[row] = computed
        return replaced

    def token_slots(self, row: int) -> list[int]:
        """The token slots recorded for ``row`` (all zeros for a free row)."""
        return list(self.table.get(row, [0] * self.max_context_len))

    def alloc_reqs(
        self, count: int, pool: ReqToTokenPool, req_indices: Int[ArrayLike, " M"],
        ok: Bool[ArrayLike, ""],
    ) -> ReqToTokenPool:
        """Check ``(pool, req_indices, ok) = pools.alloc_reqs(old, count, max_count)`` and
        record it: ``ok`` iff rows (and state slots) were free; the new rows distinct free rows,
        each with a distinct free state slot, rest zeros. Then ``check`` ``(pool)``. Returns
        ``pool``."""
        rows = host(req_indices).astype(np.int64)
        expect = self.can_alloc(count) and count <= rows.shape[0]
        if bool(ok) != expect:
            fail(f"alloc_reqs({count}) with {len(self.free_rows)} free rows, "
                  f"{len(self.free_states)} free state slots: ok={bool(ok)}, expected {expect}")
        if not expect:
            if rows.any():
                fail(f"a failed alloc_reqs({count}) returned rows {rows.tolist()}")
            self.check(pool)
            return pool
        got = rows[:count].tolist()
        if len(set(got)) != count or not set(got) <= self.free_rows or rows[count:].any():
            fail(f"alloc_reqs({count}) returned rows {rows.tolist()} (free rows: "
                  f"{sorted(self.free_rows)})")
        states = [0] * count
        if self.hybrid:
            states = [int(s) for s in host(pool.req_to_state)[got]]
            if len(set(states)) != count or not set(states) <= self.free_states:
                fail(f"new rows {got} got state slots {states} (free: "
                      f"{sorted(self.free_states)})")
        for r, s in zip(got, states, strict=True):
            self.rows[r] = s
            self.table[r] = [0] * self.max_context_len
            self.lens[r] = self.borrowed[r] = 0
        self.check(pool)
        return pool

    def free_reqs(self, req_indices: Int[ArrayLike, " M"] | Sequence[int],
                  mask: Bool[ArrayLike, " M"] | None = None) -> None:
        """Record ``pools.free_reqs(pool, req_indices, mask)``: row 0, rows out of range, rows
        not in use and repeats are ignored."""
        rows = host(req_indices).astype(np.int64).reshape(-1)
        keep = (rows > 0) & (rows <= self.max_running_requests)
        if mask is not None:
            keep &= host(mask).astype(bool).reshape(-1)
        for r in set(rows[keep].tolist()) & set(self.rows):
            del self.rows[r], self.table[r], self.lens[r], self.borrowed[r]

    def write_token_slots(
        self, req_indices: Int[ArrayLike, " T"], positions: Int[ArrayLike, " T"],
        slots: Int[ArrayLike, " T"], mask: Bool[ArrayLike, " T"] | None = None,
    ) -> None:
        """Record ``pools.write_token_slots(pool, req_indices, positions, slots, mask)``: row 0,
        masked-off tokens and positions outside ``0 .. max_context_len - 1`` write nothing.
        Writing into a free row, or one cell twice, is a caller bug."""
        rows, pos, vals = (host(x).astype(np.int64).reshape(-1)
                           for x in (req_indices, positions, slots))
        keep = (rows > 0) & (rows <= self.max_running_requests) & (pos >= 0) & (
            pos < self.max_context_len)
        if mask is not None:
            keep &= host(mask).astype(bool).reshape(-1)
        cells = list(zip(rows[keep].tolist(), pos[keep].tolist(), strict=True))
        if len(set(cells)) != len(cells):
            fail(f"write_token_slots writes a cell twice: {cells}")
        for (r, p), v in zip(cells, vals[keep].tolist(), strict=True):
            if r not in self.rows:
                fail(f"write_token_slots into row {r}, which is not in use")
            self.table[r][p] = v
            self.lens[r] = max(self.lens[r], p + 1)

    def check(self, pool: ReqToTokenPool) -> None:
        """Assert that ``pool`` holds exactly the model: free rows and state slots (each once),
        ``req_to_state`` and ``req_to_token`` (zeros in row 0 and free rows)."""
        if (pool.max_running_requests, pool.max_context_len) != (
                self.max_running_requests, self.max_context_len):
            fail("pool geometry differs from the model's")
        _check_free(pool.allocator, self.free_rows, "request rows")
        table = np.zeros((self.max_running_requests + 1, self.max_context_len), np.int64)
        for r, slots in self.table.items():
            table[r] = slots
        got = host(pool.req_to_token)
        if not np.array_equal(got, table):
            bad = sorted({int(r) for r in np.argwhere(got != table)[:, 0]})
            fail(f"req_to_token differs from the model in rows {bad}")
        lens = np.zeros(self.max_running_requests + 1, np.int64)
        for r, n in self.lens.items():
            lens[r] = n
        if not np.array_equal(host(pool.req_lens), lens):
            fail(f"req_lens {host(pool.req_lens).tolist()}, expected {lens.tolist()}")
        bor = np.zeros(self.max_running_requests + 1, np.int64)
        for r, n in self.borrowed.items():
            bor[r] = n
        if not np.array_equal(host(pool.borrowed), bor):
            fail(f"borrowed {host(pool.borrowed).tolist()}, expected {bor.tolist()}")
        if isinstance(pool, HybridReqToTokenPool) != self.hybrid:
            fail(f"the model is {'hybrid' if self.hybrid else 'plain'}, the pool is not")
        if self.hybrid:
            _check_free(pool.state_allocator, self.free_states, "state slots")
            states = np.zeros(self.max_running_requests + 1, np.int64)
            for r, s in self.rows.items():
                states[r] = s
            if not np.array_equal(host(pool.req_to_state), states):
                fail(f"req_to_state {host(pool.req_to_state).tolist()}, expected "
                      f"{states.tolist()}")


def _check_free(allocator: SlotAllocator, free: set[int], what: str) -> None:
    stack = free_stack(allocator)
    if len(stack) != len(set(stack)) or set(stack) != free:
        fail(f"free {what} {sorted(stack)} (stack {stack}), expected {sorted(free)}")
