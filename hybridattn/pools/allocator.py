"""Slot allocators: a free stack of slot ids over a pool, with an ``in_use`` bit per slot
(see the package docstring for ownership and the slot-0 sink rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from hybridattn.pytree import pytree_dataclass
from servecore.errors import PoolExhausted

__all__ = [
    "SlotAllocator",
    "alloc",
    "alloc_or_raise",
    "claim",
    "free",
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
    False); :func:`free` reads it to ignore double frees. ``stack_pos[s]`` is where a free
    slot ``s`` sits in ``free_slots`` (stale for slots in use): :func:`claim` reads it to take
    the slots a caller names in ``O(count)``. Allocating, claiming and freeing return a new
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
    stack_pos: Int[Array, " S"]

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
            # slot s sits at n - s (slot 0, the sink, nowhere: n, past the stack)
            stack_pos=jnp.arange(n, -1, -1, dtype=jnp.int32),
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

    def claim(self, slots: Int[Array, " M"], mask: Bool[Array, " M"] | None = None):
        """Same as :func:`claim`."""
        return claim(self, slots, mask)


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
    stack_pos = allocator.stack_pos.at[jnp.where(keep, idx, n + 1)].set(pos, mode="drop")
    return allocator.replace(free_slots=free_slots, num_free=num_free, in_use=in_use,
                             stack_pos=stack_pos)


def claim(
    allocator: SlotAllocator, slots: Int[Array, " M"], mask: Bool[Array, " M"] | None = None
) -> tuple[SlotAllocator, Bool[Array, ""]]:
    """Take the slots a caller names: ``(allocator, ok)``. The host that owns the ids (an
    engine) picks them; the allocator checks and records them, so the two cannot disagree.

    Every ``slots[i]`` with ``mask[i]`` true (without a mask: every nonzero entry) is claimed.
    ``ok`` is False, and the allocator comes back unchanged, if one of them is outside
    ``1 .. N``, in use, or listed twice. The free stack stays a stack of exactly the free
    slots, so :func:`alloc`, :func:`claim` and :func:`free` mix freely. ``O(M log M)`` work
    (``stack_pos`` locates each slot; the claimed ones that sit below the new top swap with
    the free ones above it), never ``O(N)``.

    >>> a = SlotAllocator.create(8)  # free stack, top first: 1 2 3 4 5 6 7
    >>> b, ok = claim(a, jnp.array([5, 2, 0]))  # 0 is ignored
    >>> bool(ok), b.num_used, alloc(b, 5, max_count=5)[1].tolist()
    (True, 2, [3, 4, 1, 6, 7])
    >>> c, ok = claim(b, jnp.array([3, 5]))  # 5 is in use: nothing changes
    >>> bool(ok), c.num_used
    (False, 2)
    >>> bool(claim(a, jnp.array([4, 4]))[1]), bool(claim(a, jnp.array([8]))[1])
    (False, False)
    """
    n = allocator.free_slots.shape[0]
    slots = slots.astype(jnp.int32)
    want = (slots != 0) if mask is None else mask
    if slots.shape[0] == 1:  # one index alone is a dynamic update slice, which XLA:CPU does
        # on a copy of the whole array (``indexing._two_or_more``): pad with one ignored entry
        slots, want = jnp.concatenate([slots, slots * 0]), jnp.concatenate([want, want & False])
    M = slots.shape[0]
    idx = jnp.clip(slots, 0, n)
    valid = jnp.all(~want | ((slots > 0) & (slots <= n) & ~allocator.in_use[idx]))
    named = jnp.sort(jnp.where(want, slots, -1 - jnp.arange(M, dtype=jnp.int32)))
    ok = valid & ~jnp.any(named[1:] == named[:-1])  # each slot listed once
    want = want & ok
    k = jnp.sum(want, dtype=jnp.int32)
    top = allocator.num_free - k  # the new top of the stack
    in_use = allocator.in_use.at[jnp.where(want, idx, n + 1)].set(True, mode="drop")
    # Claimed slots below ``top`` swap with the unclaimed free slots in [top, num_free):
    # there are as many of each, paired by rank.
    pos = allocator.stack_pos[idx]
    low = want & (pos < top)
    i = jnp.arange(M, dtype=jnp.int32)
    above = allocator.free_slots[jnp.clip(top + i, 0, max(n - 1, 0))]
    spare = (i < k) & ~in_use[above]
    by_rank = jnp.zeros((M,), jnp.int32).at[
        jnp.where(spare, jnp.cumsum(spare) - 1, M)].set(above, mode="drop")
    moved = by_rank[jnp.clip(jnp.cumsum(low) - 1, 0, max(M - 1, 0))]
    free_slots = allocator.free_slots.at[jnp.where(low, pos, n)].set(moved, mode="drop")
    stack_pos = allocator.stack_pos.at[jnp.where(low, moved, n + 1)].set(pos, mode="drop")
    return allocator.replace(free_slots=free_slots, num_free=top, in_use=in_use,
                             stack_pos=stack_pos), ok


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
