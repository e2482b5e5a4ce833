"""Strategies for the pools: ``slot_allocator_states`` and ``req_to_token_pools`` (a pool after a
random history of calls, with its reference), ``mla_token_pools`` and ``recurrent_state_pools``
(data pools with random contents)."""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.config import KimiLinearConfig
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    RecurrentStatePool,
    ReqToTokenPool,
    SlotAllocator,
)
from hybridattn.testing.common import (
    SearchStrategy,
    checked_int,
    composite,
    jit_alloc,
    jit_alloc_reqs,
    jit_free,
    jit_free_reqs,
    jit_write,
    st,
)
from hybridattn.testing.ref_pools import RefReqToTokenPool, RefSlotAllocator


class AllocatorState(NamedTuple):
    """A drawn ``SlotAllocator``, its ``RefSlotAllocator`` model after the same history, and the
    history: ``("alloc", count, ok)`` and ``("free", slot_ids)`` steps, in order.

    >>> s = AllocatorState(SlotAllocator.create(3), RefSlotAllocator(3), ())
    >>> s.reference.check(s.allocator)
    """

    allocator: SlotAllocator
    reference: RefSlotAllocator
    history: tuple


class ReqPoolState(NamedTuple):
    """A drawn request table, its ``RefReqToTokenPool`` model after the same history, and the
    history: ``("alloc_reqs", count, ok)``, ``("free_reqs", rows)`` and ``("write", row, start,
    token_slots)`` steps.

    >>> s = ReqPoolState(HybridReqToTokenPool.create(2, 4), RefReqToTokenPool(2, 4), ())
    >>> s.reference.check(s.pool)
    """

    pool: ReqToTokenPool
    reference: RefReqToTokenPool
    history: tuple


def slot_allocator_states(num_slots: int, *, max_ops: int = 12,
                          max_count: int = 4) -> SearchStrategy[AllocatorState]:
    """A ``SlotAllocator`` over ``num_slots`` slots after a random history of up to ``max_ops``
    real ``alloc`` (of ``0 .. max_count`` slots, failing ones included) and ``free`` calls, with
    its ``RefSlotAllocator`` model (which checked every step of the history) and the history
    itself.

    The free stack of a drawn allocator is in any order a history can leave it. Compiles
    ``alloc`` and ``free`` once per ``num_slots``.

    >>> from hypothesis import given, settings
    >>> from hybridattn.pools import alloc
    >>> @settings(max_examples=5, deadline=None)
    ... @given(slot_allocator_states(6))
    ... def test_alloc_one(s):
    ...     s.reference.alloc(1, *alloc(s.allocator, 1, max_count=1))
    >>> test_alloc_one()
    """
    checked_int("num_slots", num_slots, 2)
    return _allocator_states(num_slots, checked_int("max_ops", max_ops, 0),
                             checked_int("max_count", max_count, 1))


@composite
def _allocator_states(draw, num_slots, max_ops, max_count):
    allocator, ref = SlotAllocator.create(num_slots), RefSlotAllocator(num_slots)
    capacity = num_slots - 1
    history = []
    for _ in range(draw(st.integers(0, max_ops), label="ops")):
        if ref.used and draw(st.booleans(), label="free?"):
            ids = draw(st.lists(st.sampled_from(sorted(ref.used)), min_size=1, unique=True),
                       label="freed")
            padded = np.zeros(capacity, np.int32)
            padded[: len(ids)] = ids
            allocator = jit_free(allocator, jnp.asarray(padded))
            ref.free_slots(ids)
            ref.check(allocator)
            history.append(("free", tuple(ids)))
        else:
            count = draw(st.integers(0, max_count), label="alloc count")
            new, slots, ok = jit_alloc(allocator, jnp.int32(count), max_count=max_count)
            allocator = ref.alloc(count, new, slots, ok)
            history.append(("alloc", count, bool(ok)))
    return AllocatorState(allocator, ref, tuple(history))


def req_to_token_pools(
    max_running_requests: int, max_context_len: int, *, num_state_slots: int | None = None,
    hybrid: bool = True, max_ops: int = 12,
) -> SearchStrategy[ReqPoolState]:
    """A request table (``HybridReqToTokenPool``, or ``ReqToTokenPool`` with ``hybrid=False``)
    after a random history of up to ``max_ops`` real ``alloc_reqs``, ``free_reqs`` and
    ``write_token_slots`` calls (runs of token slots written into live rows), with its
    ``RefReqToTokenPool`` model (which checked every step) and the history.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(req_to_token_pools(3, 8, num_state_slots=3))
    ... def test_live_rows_have_distinct_states(s):
    ...     states = list(s.reference.rows.values())
    ...     assert len(set(states)) == len(states) and 0 not in states
    >>> test_live_rows_have_distinct_states()
    """
    checked_int("max_running_requests", max_running_requests, 1)
    checked_int("max_context_len", max_context_len, 1)
    if num_state_slots is not None:
        checked_int("num_state_slots", num_state_slots, 2)
    return _req_pools(max_running_requests, max_context_len, num_state_slots, bool(hybrid),
                      checked_int("max_ops", max_ops, 0))


@composite
def _req_pools(draw, R, L, num_state_slots, hybrid, max_ops):
    if hybrid:
        pool = HybridReqToTokenPool.create(R, L, num_state_slots)
    else:
        pool = ReqToTokenPool.create(R, L)
    ref = RefReqToTokenPool(R, L, num_state_slots, hybrid=hybrid)
    max_count = min(R, 3)
    history = []
    for _ in range(draw(st.integers(0, max_ops), label="ops")):
        op = draw(st.sampled_from(["alloc", "free", "write"] if ref.rows else ["alloc"]),
                  label="op")
        if op == "alloc":
            count = draw(st.integers(0, max_count), label="alloc count")
            new, rows, ok = jit_alloc_reqs(pool, jnp.int32(count), max_count=max_count)
            pool = ref.alloc_reqs(count, new, rows, ok)
            history.append(("alloc_reqs", count, bool(ok)))
        elif op == "free":
            rows = draw(st.lists(st.sampled_from(sorted(ref.rows)), min_size=1, unique=True),
                        label="freed rows")
            padded = np.zeros(R + 1, np.int32)
            padded[: len(rows)] = rows
            pool = jit_free_reqs(pool, jnp.asarray(padded))
            ref.free_reqs(rows)
            ref.check(pool)
            history.append(("free_reqs", tuple(rows)))
        else:
            row = draw(st.sampled_from(sorted(ref.rows)), label="row")
            start = draw(st.integers(0, L - 1), label="start")
            n = draw(st.integers(1, L - start), label="tokens")
            values = draw(st.lists(st.integers(1, 4 * R * L), min_size=n, max_size=n),
                          label="token slots")
            args = (jnp.full((L,), row, jnp.int32), jnp.arange(start, start + L, dtype=jnp.int32),
                    jnp.asarray(np.pad(values, (0, L - n)), jnp.int32), jnp.arange(L) < n)
            pool = jit_write(pool, *args)
            ref.write_token_slots(*args)
            ref.check(pool)
            history.append(("write", row, start, tuple(values)))
    return ReqPoolState(pool, ref, tuple(history))


def _random_normal(seed: int, shape, scale: float, dtype) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32), dtype)


def mla_token_pools(config: KimiLinearConfig, *, num_slots: int,
                    dtype=jnp.float32) -> SearchStrategy[MLATokenPool]:
    """An ``MLATokenPool`` for ``config``'s MLA layers with ``num_slots`` slots (sink included)
    of random latents (standard normal, from a drawn seed; every slot, the sink and free ones
    included, as stale slots are in serving).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=2, deadline=None)
    ... @given(mla_token_pools(KimiLinearConfig.tiny(), num_slots=4))
    ... def test_shapes(pool):
    ...     assert pool.c_kv[0].shape == (4, 32) and pool.layer_ids == (3,)
    >>> test_shapes()
    """
    checked_int("num_slots", num_slots, 2)
    if not config.full_attention_layer_ids:
        raise ValueError("mla_token_pools: the config has no MLA layers")
    return st.integers(0, 2**32 - 1).map(functools.partial(_fill_mla, config, num_slots, dtype))


def _fill_mla(config, num_slots, dtype, seed) -> MLATokenPool:
    saved = random.getstate()
    try:
        pool = MLATokenPool.create(config.full_attention_layer_ids, num_slots,
                                   config.kv_lora_rank, config.qk_rope_head_dim, dtype=dtype)
        return fill_kv(pool, seed)
    finally:
        random.setstate(saved)


def fill_kv(pool: MLATokenPool, seed: int) -> MLATokenPool:
    n = len(pool.layer_ids)
    return pool.replace(
        c_kv=jnp.stack([_random_normal(seed + i, x.shape, 1.0, x.dtype)
                   for i, x in enumerate(pool.c_kv)]),
        k_pe=jnp.stack([_random_normal(seed + n + i, x.shape, 1.0, x.dtype)
                   for i, x in enumerate(pool.k_pe)]))


def recurrent_state_pools(config: KimiLinearConfig, *, num_slots: int,
                          dtype=jnp.float32) -> SearchStrategy[RecurrentStatePool]:
    """A ``RecurrentStatePool`` for ``config``'s KDA layers (the layout ``ServingState`` uses:
    conv channels ``3 * H * Dk``, ``Dv = Dk``) with ``num_slots`` slots of random states: conv
    states standard normal, recurrent states normal with std 0.5 (float32), from a drawn seed.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=2, deadline=None)
    ... @given(recurrent_state_pools(KimiLinearConfig.tiny(), num_slots=3))
    ... def test_shapes(pool):
    ...     assert pool.ssm[0].shape == (3, 4, 16, 16) and pool.conv[0].shape == (3, 3, 192)
    >>> test_shapes()
    """
    checked_int("num_slots", num_slots, 2)
    if not config.kda_layer_ids:
        raise ValueError("recurrent_state_pools: the config has no KDA layers")
    return st.integers(0, 2**32 - 1).map(
        functools.partial(_fill_recurrent, config, num_slots, dtype))


def _fill_recurrent(config, num_slots, dtype, seed) -> RecurrentStatePool:
    saved = random.getstate()
    try:
        H, Dk = config.linear_num_heads, config.linear_head_dim
        pool = RecurrentStatePool.create(config.kda_layer_ids, num_slots, 3 * H * Dk,
                                         config.linear_conv_kernel_dim, H, Dk, Dk, dtype=dtype)
        return fill_states(pool, seed)
    finally:
        random.setstate(saved)


def fill_states(pool: RecurrentStatePool, seed: int) -> RecurrentStatePool:
    n = len(pool.layer_ids)
    return pool.replace(
        conv=jnp.stack([_random_normal(seed + 2 * n + i, x.shape, 1.0, x.dtype)
                   for i, x in enumerate(pool.conv)]),
        ssm=jnp.stack([_random_normal(seed + 3 * n + i, x.shape, 0.5, jnp.float32)
                  for i, x in enumerate(pool.ssm)]))
