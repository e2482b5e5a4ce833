"""Request tables: which token slots (and which recurrent-state slot) each request row owns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from hybridattn.pools.allocator import SlotAllocator, _check_int, alloc, claim, free
from hybridattn.pools.indexing import _two_or_more
from hybridattn.pytree import pytree_dataclass
from servecore.errors import PoolExhausted

__all__ = [
    "HybridReqToTokenPool",
    "ReqToTokenPool",
    "alloc_reqs",
    "alloc_reqs_or_raise",
    "claim_reqs",
    "free_reqs",
    "get_linear_recurrent_indices",
    "get_token_slots",
    "write_token_slots",
]

# --------------------------------------------------------------------------------------------
# request tables
# --------------------------------------------------------------------------------------------


@pytree_dataclass()
class ReqToTokenPool:
    """Token slot of every (request row, position), and the allocator of request rows.

    Row 0 is the padding row: never allocated, never written, all zeros. Per row,
    ``req_lens`` is how many positions are recorded (what ``serving.step`` checks a batch's
    ``seq_lens`` against) and ``borrowed`` how many leading positions hold slots the row
    borrows from a prefix cache (see the module docstring: the row never frees those).

    >>> pool = ReqToTokenPool.create(max_running_requests=2, max_context_len=4)
    >>> pool.req_to_token.shape, pool.max_running_requests, pool.max_context_len
    ((3, 4), 2, 4)
    >>> pool, rows, ok = alloc_reqs(pool, 1, max_count=1)
    >>> pool = write_token_slots(pool, jnp.array([1, 1]), jnp.array([0, 1]), jnp.array([7, 3]))
    >>> pool.req_to_token.tolist(), pool.req_lens.tolist()
    ([[0, 0, 0, 0], [7, 3, 0, 0], [0, 0, 0, 0]], [0, 2, 0])
    """

    req_to_token: Int[Array, "R L"]
    allocator: SlotAllocator
    req_lens: Int[Array, " R"]
    borrowed: Int[Array, " R"]

    @classmethod
    def create(cls, max_running_requests: int, max_context_len: int) -> ReqToTokenPool:
        """An empty table with ``max_running_requests + 1`` rows of ``max_context_len``."""
        _check_int("max_running_requests", max_running_requests, 1)
        _check_int("max_context_len", max_context_len, 1)
        return cls(
            req_to_token=jnp.zeros((max_running_requests + 1, max_context_len), jnp.int32),
            allocator=SlotAllocator.create(max_running_requests + 1),
            req_lens=jnp.zeros((max_running_requests + 1,), jnp.int32),
            borrowed=jnp.zeros((max_running_requests + 1,), jnp.int32),
        )

    @property
    def max_running_requests(self) -> int:
        """Request rows that can be handed out (row 0 excluded)."""
        return self.req_to_token.shape[0] - 1

    @property
    def max_context_len(self) -> int:
        """Positions per request row."""
        return self.req_to_token.shape[1]


@pytree_dataclass()
class HybridReqToTokenPool(ReqToTokenPool):
    """A :class:`ReqToTokenPool` that also gives every request row a recurrent-state slot.

    ``req_to_state[row]`` is the state slot of the request in ``row`` (0 for free rows and the
    padding row); ``state_allocator`` hands out state slots ``1 .. num_state_slots - 1``.

    >>> pool = HybridReqToTokenPool.create(max_running_requests=2, max_context_len=8)
    >>> pool.req_to_token.shape, pool.req_to_state.shape, pool.num_state_slots
    ((3, 8), (3,), 3)
    >>> pool, rows, ok = alloc_reqs(pool, 2, max_count=2)
    >>> rows.tolist(), pool.req_to_state.tolist()  # row -> state slot
    ([1, 2], [0, 1, 2])
    """

    req_to_state: Int[Array, " R"]
    state_allocator: SlotAllocator

    @classmethod
    def create(
        cls, max_running_requests: int, max_context_len: int, num_state_slots: int | None = None
    ) -> HybridReqToTokenPool:
        """Like :meth:`ReqToTokenPool.create`, with ``num_state_slots`` state slots (sink
        included; default ``max_running_requests + 1``)."""
        base = ReqToTokenPool.create(max_running_requests, max_context_len)
        if num_state_slots is None:
            num_state_slots = max_running_requests + 1
        _check_int("num_state_slots", num_state_slots, 2)
        return cls(
            req_to_token=base.req_to_token,
            allocator=base.allocator,
            req_lens=base.req_lens,
            borrowed=base.borrowed,
            req_to_state=jnp.zeros((max_running_requests + 1,), jnp.int32),
            state_allocator=SlotAllocator.create(num_state_slots),
        )

    @property
    def num_state_slots(self) -> int:
        """State slots, the sink included."""
        return self.state_allocator.num_slots


def alloc_reqs(
    pool: ReqToTokenPool, count: int | Int[Array, ""], max_count: int
) -> tuple[ReqToTokenPool, Int[Array, " max_count"], Bool[Array, ""]]:
    """Allocate ``count`` request rows: ``(pool, req_indices, ok)``, as :func:`alloc`.

    On a :class:`HybridReqToTokenPool` every row also gets a state slot (recorded in
    ``req_to_state``); ``ok`` only if both allocations succeed, and on failure the pool (both
    allocators) comes back unchanged and ``req_indices`` is all zeros. New rows are all zeros:
    :func:`free_reqs` clears the rows it frees.

    >>> pool = HybridReqToTokenPool.create(max_running_requests=2, max_context_len=8)
    >>> pool, rows, ok = alloc_reqs(pool, 1, max_count=2)
    >>> rows.tolist(), bool(ok), get_linear_recurrent_indices(pool, rows).tolist()
    ([1, 0], True, [1, 0])
    >>> pool, rows, ok = alloc_reqs(pool, 2, max_count=2)  # only one row is left
    >>> rows.tolist(), bool(ok), pool.max_running_requests - int(pool.allocator.num_free)
    ([0, 0], False, 1)
    """
    allocator, rows, ok = alloc(pool.allocator, count, max_count)
    if not isinstance(pool, HybridReqToTokenPool):
        return pool.replace(allocator=allocator), rows, ok
    state_allocator, states, ok_state = alloc(pool.state_allocator, count, max_count)
    ok = ok & ok_state
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    allocator = pick(allocator, pool.allocator)
    state_allocator = pick(state_allocator, pool.state_allocator)
    rows = jnp.where(ok, rows, 0)
    num_rows = pool.req_to_state.shape[0]
    req_to_state = pool.req_to_state.at[jnp.where(rows > 0, rows, num_rows)].set(
        jnp.where(ok, states, 0), mode="drop"
    )
    pool = pool.replace(
        allocator=allocator, state_allocator=state_allocator, req_to_state=req_to_state
    )
    return pool, rows, ok


_alloc_reqs_jit = jax.jit(alloc_reqs, static_argnames="max_count")


def claim_reqs(
    pool: ReqToTokenPool, req_indices: Int[Array, " B"], mask: Bool[Array, " B"] | None = None
) -> tuple[ReqToTokenPool, Bool[Array, ""]]:
    """Take the request rows the host names (every nonzero ``req_indices[i]``, or those with
    ``mask[i]``): ``(pool, ok)``, as :func:`pools.claim <hybridattn.pools.claim>`. On a
    :class:`HybridReqToTokenPool` each also gets a state slot (allocated: the host never
    names those). ``ok`` False (a row in use, out of range or named twice; too few state
    slots): the pool comes back unchanged.

    >>> pool = HybridReqToTokenPool.create(max_running_requests=3, max_context_len=8)
    >>> pool, ok = claim_reqs(pool, jnp.array([3, 0]))
    >>> bool(ok), pool.req_to_state.tolist()  # row 3 got state slot 1
    (True, [0, 0, 0, 1])
    >>> bool(claim_reqs(pool, jnp.array([3]))[1])  # in use already
    False
    """
    allocator, ok = claim(pool.allocator, req_indices, mask)
    if not isinstance(pool, HybridReqToTokenPool):
        return pool.replace(allocator=allocator), ok
    want = (req_indices != 0) if mask is None else mask
    B = req_indices.shape[0]
    count = jnp.where(ok, jnp.sum(want, dtype=jnp.int32), -1)  # -1: allocates nothing
    state_allocator, states, ok = alloc(pool.state_allocator, count, max_count=B)
    allocator = jax.tree.map(lambda a, b: jnp.where(ok, a, b), allocator, pool.allocator)
    num_rows = pool.req_to_state.shape[0]
    rows = jnp.where(want & ok, req_indices, num_rows)
    req_to_state = pool.req_to_state.at[rows].set(
        states[jnp.clip(jnp.cumsum(want) - 1, 0, B - 1)], mode="drop")
    return pool.replace(allocator=allocator, state_allocator=state_allocator,
                        req_to_state=req_to_state), ok


def alloc_reqs_or_raise(pool: ReqToTokenPool, count: int) -> tuple[ReqToTokenPool, np.ndarray]:
    """Host helper: :func:`alloc_reqs` exactly ``count`` request rows (and, on a hybrid pool,
    state slots), returned as a numpy array, or raise :class:`PoolExhausted` with the numbers
    of whichever ran out; the pool is left unchanged when it raises.

    >>> pool, rows = alloc_reqs_or_raise(HybridReqToTokenPool.create(2, 8), 2)
    >>> rows.tolist()
    [1, 2]
    >>> alloc_reqs_or_raise(pool, 1)
    Traceback (most recent call last):
    ...
    servecore.errors.PoolExhausted: request rows exhausted: requested 1, 0 available of 2
    """
    _check_int("count", count, 0)
    bucket = 1 << max(count - 1, 0).bit_length()  # one compile per power of two
    new, rows, ok = _alloc_reqs_jit(pool, jnp.asarray(count, jnp.int32), max_count=bucket)
    if not bool(ok):
        short = [(what, a) for what, a in (("request rows", pool.allocator),
                 ("recurrent-state slots", getattr(pool, "state_allocator", None)))
                 if a is not None and int(a.num_free) < count]
        what, a = short[0]
        raise PoolExhausted(count, int(a.num_free), what, a.capacity)
    return new, np.asarray(rows)[:count]


def free_reqs(
    pool: ReqToTokenPool, req_indices: Int[Array, " B"], mask: Bool[Array, " B"] | None = None
) -> ReqToTokenPool:
    """Free the request rows ``req_indices[i]`` with ``mask[i]`` true (row 0 is ignored) and
    clear them to 0; on a :class:`HybridReqToTokenPool` also free their state slots and clear
    their ``req_to_state``. Token slots are not freed (see the module docstring). A row that
    is not in use is ignored, and a row listed twice is freed once.

    >>> pool, rows, ok = alloc_reqs(HybridReqToTokenPool.create(2, 4), 2, max_count=2)
    >>> pool = write_token_slots(pool, rows, jnp.array([0, 0]), jnp.array([5, 6]))
    >>> pool = free_reqs(pool, rows, mask=jnp.array([True, False]))  # free row 1 only
    >>> pool.req_to_token[:, 0].tolist(), pool.req_to_state.tolist()
    ([0, 0, 6], [0, 0, 2])
    >>> alloc_reqs(pool, 1, max_count=1)[1].tolist()  # row 1 is free again
    [1]
    """
    num_rows = pool.req_to_token.shape[0]
    keep = (req_indices > 0) & (req_indices < num_rows)
    if mask is not None:
        keep = keep & mask
    keep = keep & pool.allocator.in_use[jnp.clip(req_indices, 0, num_rows - 1)]
    rows = jnp.where(keep, req_indices, num_rows)  # out of range: dropped
    pool = pool.replace(
        allocator=free(pool.allocator, req_indices, keep),
        req_to_token=pool.req_to_token.at[rows].set(0, mode="drop"),
        req_lens=pool.req_lens.at[rows].set(0, mode="drop"),
        borrowed=pool.borrowed.at[rows].set(0, mode="drop"),
    )
    if isinstance(pool, HybridReqToTokenPool):
        states = pool.req_to_state[jnp.clip(req_indices, 0, num_rows - 1)]
        pool = pool.replace(
            state_allocator=free(pool.state_allocator, states, keep),
            req_to_state=pool.req_to_state.at[rows].set(0, mode="drop"),
        )
    return pool


def write_token_slots(
    pool: ReqToTokenPool,
    req_indices: Int[Array, " T"],
    positions: Int[Array, " T"],
    slots: Int[Array, " T"],
    mask: Bool[Array, " T"] | None = None,
) -> ReqToTokenPool:
    """Record ``req_to_token[req_indices[t], positions[t]] = slots[t]`` for every token with
    ``mask[t]`` true, and grow each written row's ``req_lens`` to cover its written positions.
    Masked-off tokens, tokens of row 0 and out-of-range positions write nothing. Two kept
    tokens with the same (row, position) is a caller bug (either may win).

    >>> pool = ReqToTokenPool.create(max_running_requests=2, max_context_len=4)
    >>> pool = write_token_slots(pool, req_indices=jnp.array([1, 1, 1, 0]),
    ...                          positions=jnp.array([0, 1, 2, 0]), slots=jnp.array([5, 9, 2, 7]))
    >>> pool.req_to_token.tolist()  # the padding token (row 0) wrote nothing
    [[0, 0, 0, 0], [5, 9, 2, 0], [0, 0, 0, 0]]
    """
    num_rows, max_len = pool.req_to_token.shape
    keep = (req_indices > 0) & (positions >= 0) & (positions < max_len)
    if mask is not None:
        keep = keep & mask
    rows = jnp.where(keep, req_indices, num_rows)
    # one token written twice: a scatter, not a copy of the table (``_scatter_rows``)
    rows, positions, slots = (_two_or_more(x) for x in (rows, positions, slots))
    table = pool.req_to_token.at[rows, positions].set(slots.astype(jnp.int32), mode="drop")
    lens = pool.req_lens.at[rows].max((positions + 1).astype(jnp.int32), mode="drop")
    return pool.replace(req_to_token=table, req_lens=lens)


def get_token_slots(
    pool: ReqToTokenPool, req_indices: Int[Array, " B"], width: int
) -> Int[Array, "B width"]:
    """The token slots of the first ``width`` positions of each request: ``[B, width]``
    (``width`` static, ``<= max_context_len``). Row 0 reads all zeros. This is the page table
    an MLA layer gathers its latents with.

    >>> pool = write_token_slots(ReqToTokenPool.create(2, 4), jnp.array([1, 1, 2]),
    ...                          jnp.array([0, 1, 0]), jnp.array([5, 9, 3]))
    >>> get_token_slots(pool, jnp.array([2, 1, 0]), width=2).tolist()  # row 0: padding
    [[3, 0], [5, 9], [0, 0]]
    """
    max_len = pool.req_to_token.shape[1]
    if not isinstance(width, int) or isinstance(width, bool) or not 0 <= width <= max_len:
        raise ValueError(f"width must be an int in [0, {max_len}], got {width!r}")
    return pool.req_to_token[req_indices, :width]


def get_linear_recurrent_indices(
    pool: HybridReqToTokenPool, req_indices: Int[Array, " B"]
) -> Int[Array, " B"]:
    """The recurrent-state slot of each request row (row 0 and free rows: 0, the sink).

    >>> pool = HybridReqToTokenPool.create(max_running_requests=3, max_context_len=4)
    >>> pool, rows, ok = alloc_reqs(pool, 2, max_count=2)
    >>> get_linear_recurrent_indices(pool, jnp.array([2, 1, 0, 3])).tolist()  # 3 is free
    [2, 1, 0, 0]
    """
    return pool.req_to_state[req_indices]
