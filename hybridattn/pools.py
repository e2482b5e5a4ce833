"""Memory pools for serving: slot allocators, request tables, the MLA KV cache, KDA states.

Data flow. The host scheduler owns the allocators. For a new request it allocates a request
row (and, for a hybrid model, a recurrent-state slot: :func:`alloc_reqs`) and, for every
token it will run, a token slot from a :class:`SlotAllocator` over the KV cache's slots (the
token-to-KV allocator is just a ``SlotAllocator``; nothing else is needed). It records where
each token lives with :func:`write_token_slots` (``req_to_token[row, position] = slot``).
The attention backends then read :func:`get_token_slots` (MLA layers gather their latent KV
from :class:`MLATokenPool` at those slots, and write new tokens with :func:`set_mla_kv`) and
:func:`get_linear_recurrent_indices` (KDA layers read and write their conv / SSM states in
:class:`RecurrentStatePool` at those slots). Freeing a request row does not free its token
slots: whoever owns them (the scheduler, or a prefix cache) frees them explicitly.

Slot ownership. Every token slot has exactly one owner: the request row whose table records it
at a position at or past the row's ``borrowed`` length, or a prefix cache (positions below
``borrowed`` hold slots the row only borrows from a cache: ``serving.release`` never frees
them). Allocators keep an ``in_use`` bit per slot, and :func:`free` ignores a slot that is not
in use or is listed twice, so a double free is impossible: it cannot corrupt the free stack.

The slot-0 sink rule. Slot 0 of every pool (token slots, request rows, state slots) is a
reserved padding sink: no allocator ever hands it out, padded batch entries use index 0, and
their reads and writes land in the sink, so a fixed-shape batch needs no masking in the
kernels. Request row 0 is kept all zeros (writes to it are dropped), so a padded request sees
token slot 0 and state slot 0 only.

Everything here is an immutable pytree updated by pure functions, and jit-compiles: counts
are int32 arrays, sizes are static (shapes, ``max_count``, ``width``, layer ids). Inside jit,
running out of capacity is a returned ``ok`` flag, never an exception, and a failed
allocation returns its input unchanged. The ``*_or_raise`` helpers and the size properties
are for the host only.
"""

# Shape aliases (as in maxtext's page_manager):
#   N   allocator capacity: the slots it can hand out (= slots - 1, slot 0 is the sink)
#   M   slot ids passed to one free
#   R   request rows: max_running_requests + 1 (row 0 is the padding row)
#   L   max context length: columns of req_to_token
#   S   slots of a data pool, sink included: token slots (MLA) or state slots (KDA)
#   T   tokens in a batch (padding tokens use request row 0 / token slot 0)
#   B   requests in a batch (padding requests use row 0)
#   r   kv_lora_rank (MLA latent width); dr: qk_rope_head_dim (decoupled RoPE key width)
#   K   short-conv kernel size, C: conv channels; H, Dk, Dv: KDA heads and head dims

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from hybridattn._pytree import pytree_dataclass
from servecore.errors import PoolExhausted

__all__ = [
    "HybridReqToTokenPool",
    "LayerRef",
    "MLATokenPool",
    "PoolExhausted",
    "RecurrentStatePool",
    "ReqToTokenPool",
    "SlotAllocator",
    "alloc",
    "alloc_or_raise",
    "alloc_reqs",
    "alloc_reqs_or_raise",
    "copy_states",
    "copy_states_to",
    "free",
    "free_reqs",
    "get_linear_recurrent_indices",
    "get_mla_kv",
    "get_mla_kv_flat",
    "get_states",
    "get_token_slots",
    "set_mla_kv",
    "set_states",
    "write_token_slots",
]


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------------------------
# slot allocator
# --------------------------------------------------------------------------------------------


@pytree_dataclass()
class SlotAllocator:
    """A stack of free slot ids over slots ``1 .. N`` (slot 0 is the sink, never handed out).

    ``free_slots[:num_free]`` are the free ids, the top of the stack at ``num_free - 1``;
    entries past ``num_free`` are stale. The capacity ``N`` is ``free_slots.shape[0]``.
    ``in_use[s]`` says whether slot ``s`` is handed out (``in_use[0]``, the sink, is always
    False); :func:`free` reads it to ignore double frees. Allocating and freeing return a new
    allocator; the old one is left as it was.

    >>> a = SlotAllocator.create(5)  # slots 1..4 can be handed out
    >>> a.free_slots.shape, a.capacity, a.num_slots, a.num_used
    ((4,), 4, 5, 0)
    >>> b, slots, ok = a.alloc(2, max_count=2)
    >>> slots.tolist(), bool(ok), b.num_used, a.num_used
    ([1, 2], True, 2, 0)
    """

    free_slots: Int[Array, " N"]
    num_free: Int[Array, ""]
    in_use: Bool[Array, " S"]

    @classmethod
    def create(cls, num_slots: int) -> SlotAllocator:
        """An allocator over ``num_slots`` slots (sink included): ``1 .. num_slots-1`` free,
        handed out in increasing order from a fresh allocator."""
        _check_int("num_slots", num_slots, 2)
        n = num_slots - 1
        return cls(
            free_slots=jnp.arange(n, 0, -1, dtype=jnp.int32),  # top of the stack is slot 1
            num_free=jnp.asarray(n, jnp.int32),
            in_use=jnp.zeros((num_slots,), bool),
        )

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (the sink excluded)."""
        return self.free_slots.shape[0]

    @property
    def num_slots(self) -> int:
        """All slots, the sink included (``capacity + 1``)."""
        return self.capacity + 1

    @property
    def num_used(self) -> int:
        """Slots handed out and not freed (host int)."""
        return self.capacity - int(self.num_free)

    def alloc(self, count: int | Int[Array, ""], max_count: int):
        """Same as :func:`alloc`."""
        return alloc(self, count, max_count)

    def free(self, slots: Int[Array, " M"], mask: Bool[Array, " M"] | None = None):
        """Same as :func:`free`."""
        return free(self, slots, mask)


def alloc(
    allocator: SlotAllocator, count: int | Int[Array, ""], max_count: int
) -> tuple[SlotAllocator, Int[Array, " max_count"], Bool[Array, ""]]:
    """Take ``count`` free slots: ``(allocator, slots, ok)``.

    ``slots[:count]`` are the new ids and the rest of the ``[max_count]`` array is 0.
    ``count`` may be traced; ``max_count`` is static. If ``count`` is negative, above
    ``max_count`` or above the number of free slots, ``ok`` is False, the allocator comes back
    unchanged and ``slots`` is all zeros. A python ``count > max_count`` is a ValueError.

    Running out is the returned ``ok`` flag, never an exception, so ``alloc`` works inside
    ``jax.jit``; :func:`alloc_or_raise` is the host-side variant that raises.

    >>> a = SlotAllocator.create(8)
    >>> a, slots, ok = alloc(a, 3, max_count=4)
    >>> slots.tolist(), bool(ok), int(a.num_free)
    ([1, 2, 3, 0], True, 4)
    >>> a, slots, ok = alloc(a, 5, max_count=5)
    >>> slots.tolist(), bool(ok), int(a.num_free)
    ([0, 0, 0, 0, 0], False, 4)
    >>> a = free(a, jnp.array([2, 0]))
    >>> alloc(a, 2, max_count=2)[1].tolist()
    [2, 4]
    """
    _check_int("max_count", max_count, 0)
    if isinstance(count, int) and count > max_count:
        raise ValueError(f"count {count} exceeds max_count {max_count}")
    count = jnp.asarray(count, jnp.int32)
    n = allocator.free_slots.shape[0]
    ok = (count >= 0) & (count <= max_count) & (count <= allocator.num_free)
    i = jnp.arange(max_count, dtype=jnp.int32)
    src = jnp.clip(allocator.num_free - 1 - i, 0, max(n - 1, 0))  # pop from the top
    slots = jnp.where(ok & (i < count), allocator.free_slots[src], 0).astype(jnp.int32)
    num_free = allocator.num_free - jnp.where(ok, count, 0)
    in_use = allocator.in_use.at[jnp.where(slots > 0, slots, n + 1)].set(True, mode="drop")
    return allocator.replace(num_free=num_free, in_use=in_use), slots, ok


def free(
    allocator: SlotAllocator, slots: Int[Array, " M"], mask: Bool[Array, " M"] | None = None
) -> SlotAllocator:
    """Push back every ``slots[i]`` with ``mask[i]`` true (all if ``mask`` is None).

    Slot 0 is always ignored, and so are ids outside ``1 .. N``, slots that are not in use
    (a double free is a no-op) and every repeat of a slot after its first. Freed slots go on top
    of the stack, so they are the next handed out (last freed, first out).

    >>> a, slots, ok = alloc(SlotAllocator.create(8), 3, max_count=4)
    >>> slots.tolist()
    [1, 2, 3, 0]
    >>> a = free(a, slots, mask=jnp.array([True, False, True, True]))  # 1 and 3; 0 is ignored
    >>> int(a.num_free), alloc(a, 2, max_count=2)[1].tolist()
    (6, [3, 1])
    >>> b = free(a, jnp.array([2, 2, 3, 5]))  # 2 once; 3 and 5 are free already: ignored
    >>> int(b.num_free), _free_ids(b)[-1]
    (7, 2)
    """
    n = allocator.free_slots.shape[0]
    slots = slots.astype(jnp.int32)
    idx = jnp.clip(slots, 0, n)
    keep = (slots > 0) & (slots <= n) & allocator.in_use[idx]
    if mask is not None:
        keep = keep & mask
    # a slot listed several times is freed by its first listing only
    i = jnp.arange(slots.shape[0], dtype=jnp.int32)
    first = jnp.full((n + 1,), slots.shape[0], jnp.int32).at[jnp.where(keep, idx, n + 1)].min(
        i, mode="drop")
    keep = keep & (first[idx] == i)
    pos = allocator.num_free + jnp.cumsum(keep, dtype=jnp.int32) - 1  # compact the kept ids
    free_slots = allocator.free_slots.at[jnp.where(keep, pos, n)].set(slots, mode="drop")
    num_free = allocator.num_free + jnp.sum(keep, dtype=jnp.int32)
    in_use = allocator.in_use.at[jnp.where(keep, idx, n + 1)].set(False, mode="drop")
    return allocator.replace(free_slots=free_slots, num_free=num_free, in_use=in_use)


def _free_ids(allocator: SlotAllocator) -> list[int]:
    """The free stack as a list, bottom first (host only; for examples and tests)."""
    return np.asarray(allocator.free_slots)[: int(allocator.num_free)].tolist()


def alloc_or_raise(
    allocator: SlotAllocator, count: int, what: str = "slots"
) -> tuple[SlotAllocator, np.ndarray]:
    """Host helper: :func:`alloc` exactly ``count`` slots, returned as a numpy array, or raise
    :class:`PoolExhausted` naming ``what`` and the numbers. Compiled once per power of two of
    ``count``; the allocator is left unchanged when it raises.

    >>> a, slots = alloc_or_raise(SlotAllocator.create(4), 2, what="token slots")
    >>> slots.tolist()
    [1, 2]
    >>> alloc_or_raise(a, 2, what="token slots")
    Traceback (most recent call last):
    ...
    servecore.errors.PoolExhausted: token slots exhausted: requested 2, 1 available of 3
    """
    _check_int("count", count, 0)
    bucket = 1 << max(count - 1, 0).bit_length()  # one compile per power of two
    new, slots, ok = _alloc_jit(allocator, jnp.asarray(count, jnp.int32), max_count=bucket)
    if not bool(ok):
        raise PoolExhausted(count, int(allocator.num_free), what, allocator.capacity)
    return new, np.asarray(slots)[:count]


_alloc_jit = jax.jit(alloc, static_argnames="max_count")


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


# --------------------------------------------------------------------------------------------
# data pools
# --------------------------------------------------------------------------------------------


class LayerRef(NamedTuple):
    """A layer inside a ``lax.scan`` over stacked layers (``kimi_linear.stack_layers``):
    ``layer_id``, the static id of the first layer of its scanned group (its kind and shapes),
    and ``index``, its position (traced) among the pool's layers of that kind. The pool
    functions and the attention backends take one wherever they take a layer id.

    >>> pool = MLATokenPool.create((3, 7), num_slots=4, kv_lora_rank=2, qk_rope_head_dim=1)
    >>> pool = set_mla_kv(pool, LayerRef(3, jnp.int32(1)), jnp.array([2]), jnp.ones((1, 2)),
    ...                   jnp.ones((1, 1)))
    >>> pool.c_kv[1][:, 0].tolist()  # the second MLA layer (7)
    [0.0, 0.0, 1.0, 0.0]
    """

    layer_id: int
    index: Int[Array, ""]


def _layer_index(kind: str, layer_ids: tuple[int, ...], layer) -> int | Int[Array, ""]:
    if isinstance(layer, LayerRef):
        if layer.layer_id not in layer_ids:
            raise ValueError(f"layer_id {layer.layer_id!r} is not {kind} layer of this pool "
                             f"(layer_ids={layer_ids})")
        return layer.index
    try:
        return layer_ids.index(layer)
    except ValueError:
        raise ValueError(
            f"layer_id {layer!r} is not {kind} layer of this pool (layer_ids={layer_ids})"
        ) from None


def _check_layer_ids(layer_ids) -> tuple[int, ...]:
    layer_ids = tuple(layer_ids)
    if not layer_ids or any(not isinstance(i, int) or i < 0 for i in layer_ids):
        raise ValueError(f"layer_ids must be non-empty non-negative ints, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer_ids must be distinct, got {layer_ids}")
    return layer_ids


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


@pytree_dataclass(static=("layer_ids",))
class RecurrentStatePool:
    """Per KDA layer, the short-conv state ``conv [S, K-1, C]`` (model dtype) and the delta-rule
    state ``ssm [S, H, Dk, Dv]`` (float32) of every state slot, stacked over the layers
    (``ssm [Lk, S, H, Dk, Dv]``). Slot 0 is the sink.

    ``layer_ids`` (static) are the model layer ids of the KDA layers, in order.

    >>> pool = RecurrentStatePool.create(layer_ids=(0, 1), num_slots=3, conv_dim=6,
    ...                                  conv_kernel=4, num_heads=2, head_k_dim=4, head_v_dim=4)
    >>> pool.conv[0].shape, pool.ssm[0].shape  # [S, K-1, C], [S, H, Dk, Dv]
    ((3, 3, 6), (3, 2, 4, 4))
    >>> pool.bytes_per_request  # float32: 2 layers x (3*6 + 2*4*4) x 4 bytes
    400
    """

    conv: Float[Array, "Lk S Km1 C"]
    ssm: Float[Array, "Lk S H Dk Dv"]
    layer_ids: tuple[int, ...]

    @classmethod
    def create(
        cls,
        layer_ids,
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype=jnp.float32,
    ) -> RecurrentStatePool:
        """Zero states for ``num_slots`` state slots (sink included) of every layer."""
        layer_ids = _check_layer_ids(layer_ids)
        _check_int("num_slots", num_slots, 2)
        _check_int("conv_dim", conv_dim, 1)
        _check_int("conv_kernel", conv_kernel, 1)
        _check_int("num_heads", num_heads, 1)
        _check_int("head_k_dim", head_k_dim, 1)
        _check_int("head_v_dim", head_v_dim, 1)
        n = len(layer_ids)
        return cls(
            conv=jnp.zeros((n, num_slots, conv_kernel - 1, conv_dim), dtype),
            ssm=jnp.zeros((n, num_slots, num_heads, head_k_dim, head_v_dim), jnp.float32),
            layer_ids=layer_ids,
        )

    @property
    def num_slots(self) -> int:
        """State slots, the sink included."""
        return self.ssm.shape[-4]

    @property
    def dtype(self):
        """The conv-state dtype (the SSM state is always float32)."""
        return self.conv.dtype

    @property
    def bytes_per_request(self) -> int:
        """Bytes of one state slot over all layers (conv + ssm)."""
        return sum(x.nbytes // self.num_slots for x in jax.tree.leaves(self))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def get_states(
    pool: RecurrentStatePool, layer_id: int | LayerRef, idx: Int[Array, " B"]
) -> tuple[Float[Array, "B Km1 C"], Float[Array, "B H Dk Dv"]]:
    """The states of layer ``layer_id`` at slots ``idx``: ``(conv [B, K-1, C], ssm [B, H, Dk,
    Dv])``.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> conv, ssm = get_states(pool, 0, jnp.array([2, 1, 0]))
    >>> conv.shape, ssm.shape
    ((3, 3, 6), (3, 2, 4, 4))
    """
    i = _layer_index("a KDA", pool.layer_ids, layer_id)
    return _gather_rows(pool.conv, i, idx), _gather_rows(pool.ssm, i, idx)


def _gather_rows(table: Array, i, idx: Int[Array, " B"]) -> Array:
    """``table[i, idx]``, read as a gather of at least two rows (one row is read twice, and
    the second dropped). One row would be read as a dynamic slice, and XLA:CPU then copies
    the whole table around the step's in-place write of that row (a decode step of one request on an
    engine of 128 request slots: 145 ms instead of 7, all of it copies of the state pool)."""
    return table[i, _two_or_more(idx)][: idx.shape[0]]


def set_states(
    pool: RecurrentStatePool,
    layer_id: int | LayerRef,
    idx: Int[Array, " B"],
    conv: Float[Array, "B Km1 C"],
    ssm: Float[Array, "B H Dk Dv"],
) -> RecurrentStatePool:
    """Write the states of layer ``layer_id`` at slots ``idx`` (``conv`` cast to the pool dtype,
    ``ssm`` to float32). Padding entries carry slot 0 and land in the sink.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> idx = jnp.array([2, 0])  # a request in slot 2, and a padding entry
    >>> pool = set_states(pool, 0, idx, jnp.ones((2, 3, 6)), jnp.ones((2, 2, 4, 4)))
    >>> pool.ssm[0][:, 0, 0, 0].tolist()  # slot 0 is the sink: its contents are junk
    [1.0, 0.0, 1.0, 0.0]
    """
    i = _layer_index("a KDA", pool.layer_ids, layer_id)
    if conv.shape[1:] != pool.conv.shape[2:] or ssm.shape[1:] != pool.ssm.shape[2:]:
        raise ValueError(
            f"conv {conv.shape} / ssm {ssm.shape} do not match the pool's per-slot shapes "
            f"{pool.conv.shape[2:]} / {pool.ssm.shape[2:]}"
        )
    return pool.replace(conv=_scatter_rows(pool.conv, i, idx, conv),
                        ssm=_scatter_rows(pool.ssm, i, idx, ssm.astype(jnp.float32)))


def _scatter_rows(table: Array, i, idx: Int[Array, " B"], rows: Array) -> Array:
    """``table.at[i, idx].set(rows)`` (cast to the table's dtype), written as a scatter of at
    least two rows (one row is written twice): as with ``_gather_rows``, one row
    would be a dynamic update slice, which XLA:CPU does on a copy of the whole table (the
    state pools here; the latent pool in ``set_mla_kv``)."""
    rows = rows.astype(table.dtype)
    if idx.shape[0] == 1:  # the same row twice
        rows = jnp.concatenate([rows, rows])
    return table.at[i, _two_or_more(idx)].set(rows)


def copy_states(
    pool: RecurrentStatePool, src_idx: Int[Array, " B"], dst_idx: Int[Array, " B"]
) -> RecurrentStatePool:
    """Copy every layer's states from slots ``src_idx`` to slots ``dst_idx`` (all sources are
    read before any write; a ``dst`` of 0 lands in the sink). This forks a request's state,
    e.g. for a second request that shares its prefix.

    >>> pool = RecurrentStatePool.create((0,), 4, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> pool = set_states(pool, 0, jnp.array([1]), jnp.ones((1, 3, 6)), jnp.ones((1, 2, 4, 4)))
    >>> pool = copy_states(pool, src_idx=jnp.array([1]), dst_idx=jnp.array([3]))
    >>> pool.ssm[0][:, 0, 0, 0].tolist(), pool.conv[0][:, 0, 0].tolist()
    ([0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0])
    """
    src_idx, dst_idx = _two_or_more(src_idx), _two_or_more(dst_idx)
    return pool.replace(conv=pool.conv.at[:, dst_idx].set(pool.conv[:, src_idx]),
                        ssm=pool.ssm.at[:, dst_idx].set(pool.ssm[:, src_idx]))


def _two_or_more(idx: Int[Array, " B"]) -> Int[Array, " B2"]:
    """``idx``, its one index repeated when it holds one: a read, write or copy of one row is
    a dynamic slice and update slice, which XLA:CPU does on a copy of the whole pool (see
    ``_gather_rows``); the same row twice is a gather and an in-place scatter, and writing
    the same value twice changes nothing."""
    return idx if idx.shape[0] != 1 else jnp.concatenate([idx, idx])


def copy_states_to(
    src: RecurrentStatePool,
    src_idx: Int[Array, " B"],
    dst: RecurrentStatePool,
    dst_idx: Int[Array, " B"],
) -> RecurrentStatePool:
    """Copy every layer's states from slots ``src_idx`` of ``src`` into slots ``dst_idx`` of
    ``dst``, another pool of the same layers and per-slot shapes (a snapshot pool and the
    working pool, either way round); returns the new ``dst``. A ``dst`` index of 0 lands in
    ``dst``'s sink. The recurrent state keeps float32 and the conv state ``dst``'s dtype, so a
    snapshot is exactly the state it copies when both pools share a dtype.

    >>> work = RecurrentStatePool.create((0,), 3, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                  head_k_dim=4, head_v_dim=4)
    >>> snaps = RecurrentStatePool.create((0,), 5, conv_dim=6, conv_kernel=4, num_heads=2,
    ...                                   head_k_dim=4, head_v_dim=4)
    >>> work = set_states(work, 0, jnp.array([2]), jnp.ones((1, 3, 6)), jnp.ones((1, 2, 4, 4)))
    >>> snaps = copy_states_to(work, jnp.array([2]), snaps, jnp.array([4]))  # take a snapshot
    >>> snaps.ssm[0][:, 0, 0, 0].tolist()
    [0.0, 0.0, 0.0, 0.0, 1.0]
    """
    if src.layer_ids != dst.layer_ids or any(
            a.shape[:1] + a.shape[2:] != b.shape[:1] + b.shape[2:]
            for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(dst), strict=True)):
        raise ValueError(f"copy_states_to needs pools of the same layers and per-slot shapes, "
                         f"got layers {src.layer_ids} and {dst.layer_ids}")
    src_idx, dst_idx = _two_or_more(src_idx), _two_or_more(dst_idx)
    return dst.replace(conv=dst.conv.at[:, dst_idx].set(src.conv[:, src_idx].astype(dst.dtype)),
                       ssm=dst.ssm.at[:, dst_idx].set(src.ssm[:, src_idx]))
