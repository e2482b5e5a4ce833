"""Hypothesis strategies for hybridattn's inputs, and plain reference models to test against.

Opt-in: ``import hybridattn`` does not import this module (nor hypothesis, a test extra:
``pip install 'hybridattn[test]'``). Every strategy draws *valid* values, built through the
library's own constructors and host validation (``KimiLinearConfig``, the pool functions,
``make_worker_batch``, ``make_forward_batch``), so a property test starts from states the
library itself could have produced:

- ``kimi_linear_configs``: tiny ``KimiLinearConfig`` s (layer patterns, head sizes, MoE);
- ``slot_allocator_states``: a ``SlotAllocator`` after a random alloc / free history;
- ``req_to_token_pools``: a request table after a random alloc / free / write history;
- ``mla_token_pools``, ``recurrent_state_pools``: data pools with random contents;
- ``sampling_params``: per-request ``SamplingParams``;
- ``worker_batches``: a ``ServingState`` and a ``ModelWorkerBatch`` that ``step`` runs on it;
- ``forward_batches``: a ``ForwardBatch`` (slots allocated on the host) for the backends;
- ``kda_inputs``: ``q, k, v, g, beta`` with real gate magnitudes, packed or not.

The references are plain Python / NumPy, independent of the code they check:
``ref_kda`` (the KDA recurrence step by step in float64), ``ref_sample_probs`` (the
distribution a sampling request draws from), and the bookkeeping models
``RefSlotAllocator``, ``RefReqToTokenPool`` and ``RefServingPools`` (sets and
dicts), which take a real call's result, assert that it is a correct answer and record it.

A property test of your own around ``step``, say, then reads::

    from hypothesis import given
    from hybridattn import testing

    step_jit = jax.jit(hybridattn.step)

    @given(testing.worker_batches(config, max_running_requests=4, max_context_len=64))
    def test_step_keeps_the_pool_contract(ex):
        ref = testing.RefServingPools.from_state(ex.state)
        new_state, out = step_jit(params, ex.state, ex.batch)
        ref.step(ex.batch, new_state, out.ok)  # ok, slots, and nothing else written

Compile time. Everything a strategy draws has its shapes from small fixed buckets (the
arguments say which), and array *values* come from a drawn seed, so examples share compiled
programs: a test jits its function once per bucket, not once per example. A config is a
static argument, though: every distinct ``kimi_linear_configs`` draw compiles its own
model. Narrow its buckets (``num_layers=(2,)``, ``moe=False``, one size each) to bound that.

Hypothesis forbids strategies from consuming Python's global ``random``; the runtime type
checkers some test suites install (beartype) do, to spot-check containers. The strategies here
restore the global ``random`` state after every draw, so they work under such checkers.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

try:
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise ImportError(
        "hybridattn.testing needs hypothesis: pip install 'hybridattn[test]'") from e

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from hybridattn import pools
from hybridattn.backend import ForwardBatch, ForwardMode
from hybridattn.batch import BatchRequest, make_forward_batch
from hybridattn.config import KimiLinearConfig
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    RecurrentStatePool,
    ReqToTokenPool,
    SlotAllocator,
)
from hybridattn.serving import (
    ModelWorkerBatch,
    SamplingParams,
    ServingState,
    WorkItem,
    make_worker_batch,
    release,
)

__all__ = [
    "AllocatorState",
    "ForwardBatchExample",
    "KDAInputs",
    "RefReqToTokenPool",
    "RefServingPools",
    "RefSlotAllocator",
    "ReqPoolState",
    "WorkerBatchExample",
    "forward_batches",
    "kda_inputs",
    "kimi_linear_configs",
    "mla_token_pools",
    "recurrent_state_pools",
    "ref_kda",
    "ref_sample_probs",
    "req_to_token_pools",
    "sampling_params",
    "slot_allocator_states",
    "worker_batches",
]

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


def _composite(fn: Callable[..., Any]) -> Callable[..., SearchStrategy]:
    """``st.composite`` whose draws leave Python's global ``random`` as they found it (see the
    module docstring: runtime type checkers consume it, hypothesis forbids that)."""

    @functools.wraps(fn)
    def body(draw, *args, **kwargs):
        saved = random.getstate()
        try:
            return fn(draw, *args, **kwargs)
        finally:
            random.setstate(saved)

    return st.composite(body)


def _ints(name: str, values, minimum: int = 1) -> tuple[int, ...]:
    """``values`` (one int or a non-empty sequence) as a tuple of ints ``>= minimum``."""
    values = (values,) if isinstance(values, int) else tuple(values)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < minimum
                         for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints >= {minimum}, "
                         f"got {values!r}")
    return values


def _int(name: str, value, minimum: int) -> int:
    pools._check_int(name, value, minimum)
    return value


def _host(x) -> np.ndarray:
    return np.asarray(x)


def _free_stack(allocator: SlotAllocator) -> list[int]:
    """The allocator's free slots, bottom of the stack first (the next to be handed out is last)."""
    return _host(allocator.free_slots)[: int(allocator.num_free)].tolist()


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


def kimi_linear_configs(
    *,
    num_layers: Sequence[int] = (2, 3, 4),
    hybrid: bool = True,
    moe: bool | None = None,
    servable: bool = True,
    vocab_size: int = 64,
    hidden_sizes: Sequence[int] = (32, 64),
    num_heads: Sequence[int] = (1, 2),
    head_dims: Sequence[int] = (8, 16),
    conv_kernel_sizes: Sequence[int] = (2, 4),
) -> SearchStrategy[KimiLinearConfig]:
    """Valid tiny ``KimiLinearConfig`` s.

    Each draw picks a layer count from ``num_layers``, a pattern of KDA and MLA layers, every
    width from the size buckets (head dims for KDA, MLA nope / value heads, ``kv_lora_rank = 2 *
    head_dim``, ``qk_rope_head_dim = head_dim // 2``), and either dense MLPs everywhere or 4
    experts (top-1 or 2, with or without a shared expert, sigmoid or softmax router, expert
    groups, dense first layers through ``first_k_dense_replace``, ``moe_layer_freq`` 1-3).

    Args:
        num_layers: the layer counts to draw from.
        hybrid: at least one KDA and one MLA layer (what ``ServingState`` serves); False also
            draws all-KDA and all-MLA models.
        moe: True: MoE layers; False: dense MLPs only; None: either.
        servable: only configs ``hybridattn.serving`` and ``kimi_linear.apply`` run, with
            the fields that do not shape the model (token ids, ``rope_theta``, ...) left at
            their defaults. False: any valid config, also low-rank queries (``q_lora_rank``),
            rotary MLA and random token ids: what a config *file* must round-trip.
        vocab_size: the vocabulary size of every draw.
        hidden_sizes: the ``hidden_size`` bucket (``intermediate_size = 2 * hidden_size``).
        num_heads: the bucket of MLA and KDA head counts.
        head_dims: the bucket of head dims.
        conv_kernel_sizes: the bucket of KDA short-conv kernel sizes.

    Returns:
        A strategy of ``KimiLinearConfig``. Every distinct config is a distinct static
        argument (one compilation each): narrow the buckets to keep a test's compile time
        down.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(kimi_linear_configs(num_layers=(2, 4)))
    ... def test_round_trip(cfg):
    ...     assert cfg.kda_layer_ids and cfg.full_attention_layer_ids  # hybrid
    ...     assert KimiLinearConfig.from_dict(cfg.to_dict()) == cfg
    >>> test_round_trip()
    """
    num_layers = _ints("num_layers", num_layers, 2 if hybrid else 1)
    _int("vocab_size", vocab_size, 2)
    sizes = dict(hidden_sizes=_ints("hidden_sizes", hidden_sizes),
                 num_heads=_ints("num_heads", num_heads),
                 head_dims=_ints("head_dims", head_dims, 2),
                 conv_kernel_sizes=_ints("conv_kernel_sizes", conv_kernel_sizes, 2))
    return _configs(num_layers, bool(hybrid), moe, bool(servable), vocab_size, **sizes)


@_composite
def _configs(draw, num_layers, hybrid, moe, servable, vocab_size, hidden_sizes, num_heads,
             head_dims, conv_kernel_sizes):
    n = draw(st.sampled_from(num_layers), label="num_hidden_layers")
    layers = st.integers(0, n - 1)
    mla = draw(st.sets(layers, min_size=1, max_size=n - 1) if hybrid
               else st.sets(layers, max_size=n), label="MLA layers")
    dim = lambda label: draw(st.sampled_from(head_dims), label=label)
    hidden = draw(st.sampled_from(hidden_sizes), label="hidden_size")
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=n,
        num_attention_heads=draw(st.sampled_from(num_heads), label="num_attention_heads"),
        kv_lora_rank=2 * dim("kv_lora_rank / 2"),
        qk_nope_head_dim=dim("qk_nope_head_dim"),
        qk_rope_head_dim=max(1, dim("2 * qk_rope_head_dim") // 2),
        v_head_dim=dim("v_head_dim"),
        linear_num_heads=draw(st.sampled_from(num_heads), label="linear_num_heads"),
        linear_head_dim=dim("linear_head_dim"),
        linear_conv_kernel_dim=draw(st.sampled_from(conv_kernel_sizes), label="conv kernel"),
        full_attention_layer_ids=tuple(sorted(mla)),
        kda_layer_ids=tuple(i for i in range(n) if i not in mla),
        tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
        model_max_length=4096,
    )
    if draw(st.booleans(), label="moe") if moe is None else moe:
        groups = draw(st.sampled_from([1, 2]), label="num_expert_group")
        kw.update(
            num_experts=4,
            num_experts_per_token=draw(st.integers(1, 2), label="num_experts_per_token"),
            num_shared_experts=draw(st.integers(0, 1), label="num_shared_experts"),
            moe_intermediate_size=dim("moe_intermediate_size"),
            moe_router_activation_func=draw(st.sampled_from(["sigmoid", "softmax"]),
                                            label="router"),
            moe_renormalize=draw(st.booleans(), label="moe_renormalize"),
            routed_scaling_factor=draw(st.sampled_from([1.0, 2.446]),
                                       label="routed_scaling_factor"),
            first_k_dense_replace=draw(st.integers(0, n), label="first_k_dense_replace"),
            moe_layer_freq=draw(st.integers(1, 3), label="moe_layer_freq"),
            num_expert_group=groups,
            topk_group=draw(st.integers(1, groups), label="topk_group"),
        )
    if not servable:
        kw.update(
            q_lora_rank=draw(st.sampled_from([None, *(2 * d for d in head_dims)]),
                             label="q_lora_rank"),
            mla_use_nope=draw(st.booleans(), label="mla_use_nope"),
            rope_theta=draw(st.sampled_from([10000.0, 50000.0]), label="rope_theta"),
            bos_token_id=draw(st.sampled_from([None, 0]), label="bos_token_id"),
            eos_token_id=draw(st.sampled_from([None, 1, (1, 2)]), label="eos_token_id"),
        )
    return KimiLinearConfig(**kw)


# --------------------------------------------------------------------------------------------
# reference models of the pools
# --------------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    raise AssertionError(message)


class RefSlotAllocator:
    """Plain-Python model of a ``SlotAllocator``: the sets of ``free`` and ``used`` slot ids
    over ``1 .. num_slots - 1`` (slot 0 is the sink).

    It does not predict *which* ids an allocation returns (any free ones are correct): it checks
    a real call's answer and records it. ``alloc`` takes what ``pools.alloc`` returned,
    ``free_slots`` records a ``pools.free``, ``check`` compares a real allocator with the model.
    A wrong answer is an ``AssertionError`` that says what is wrong.

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
        self.num_slots = _int("num_slots", num_slots, 2)
        self.free: set[int] = set(range(1, num_slots))
        self.used: set[int] = set()

    @classmethod
    def from_allocator(cls, allocator: SlotAllocator) -> RefSlotAllocator:
        """The model of a real allocator's current state (its free stack is checked first)."""
        ref = cls(allocator.num_slots)
        stack = _free_stack(allocator)
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
        slots = _host(slots).astype(np.int64)
        expect = self.can_alloc(count) and count <= slots.shape[0]
        if bool(ok) != expect:
            _fail(f"alloc({count}) with {len(self.free)} free: ok={bool(ok)}, expected "
                  f"{expect}")
        if expect:
            self._take(slots[:count].tolist(), f"alloc({count})")
            if slots[count:].any():
                _fail(f"alloc({count}) returned {slots.tolist()}: nonzero past count")
        elif slots.any():
            _fail(f"a failed alloc({count}) returned slots {slots.tolist()}, expected zeros")
        self.check(allocator)
        return allocator

    def _take(self, got: list[int], what: str) -> None:
        """Record ``got`` as handed out by ``what``: they must be distinct free slots."""
        if len(set(got)) != len(got) or not set(got) <= self.free:
            _fail(f"{what} returned {got}: not distinct free slots (free: {sorted(self.free)})")
        self.free -= set(got)
        self.used |= set(got)

    def free_slots(self, slots: Int[ArrayLike, " M"] | Sequence[int],
                   mask: Bool[ArrayLike, " M"] | None = None) -> int:
        """Record ``pools.free(allocator, slots, mask)``: 0, ids outside ``1 .. capacity``,
        slots not in use (a double free) and repeats are ignored, as the real ``free`` does.
        Returns how many slots it ignored that the caller asked to free."""
        slots = _host(slots).astype(np.int64).reshape(-1)
        keep = (slots > 0) & (slots <= self.capacity)
        if mask is not None:
            keep &= _host(mask).astype(bool).reshape(-1)
        ids = set(slots[keep].tolist()) & self.used
        self.used -= ids
        self.free |= ids
        return int(keep.sum()) - len(ids)

    def check(self, allocator: SlotAllocator) -> None:
        """Assert that ``allocator`` holds exactly the model's free slots, each once."""
        if allocator.num_slots != self.num_slots:
            _fail(f"allocator has {allocator.num_slots} slots, the model {self.num_slots}")
        stack = _free_stack(allocator)
        if len(stack) != len(set(stack)):
            _fail(f"a slot is free twice: free stack {stack}")
        if set(stack) != self.free:
            _fail(f"free slots {sorted(stack)}, expected {sorted(self.free)}")
        if allocator.num_used != len(self.used):
            _fail(f"num_used={allocator.num_used}, expected {len(self.used)}")
        in_use = set(np.flatnonzero(_host(allocator.in_use)).tolist())
        if in_use != self.used:
            _fail(f"in_use marks {sorted(in_use)}, expected {sorted(self.used)}")


class RefReqToTokenPool:
    """Plain-Python model of a ``ReqToTokenPool`` or ``HybridReqToTokenPool``: ``rows`` maps
    each live request row to its recurrent-state slot (0 on a plain pool), ``table`` each live
    row to its ``max_context_len`` token slots.

    Like ``RefSlotAllocator`` it checks real answers (``alloc_reqs``), records updates
    (``free_reqs``, ``write_token_slots``) and compares (``check``).

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
        self.max_running_requests = _int("max_running_requests", max_running_requests, 1)
        self.max_context_len = _int("max_context_len", max_context_len, 1)
        self.hybrid = bool(hybrid)
        self.num_state_slots = (max_running_requests + 1 if num_state_slots is None
                                else _int("num_state_slots", num_state_slots, 2))
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
        free = set(_free_stack(pool.allocator))
        states = _host(pool.req_to_state) if hybrid else None
        table, lens, bor = _host(pool.req_to_token), _host(pool.req_lens), _host(pool.borrowed)
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
            _fail(f"take({count}): {len(self.free_rows)} free rows, {len(self.free_states)} "
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
            _fail(f"borrow into row {row}, which is not in use")
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
        rows = _host(req_indices).astype(np.int64)
        expect = self.can_alloc(count) and count <= rows.shape[0]
        if bool(ok) != expect:
            _fail(f"alloc_reqs({count}) with {len(self.free_rows)} free rows, "
                  f"{len(self.free_states)} free state slots: ok={bool(ok)}, expected {expect}")
        if not expect:
            if rows.any():
                _fail(f"a failed alloc_reqs({count}) returned rows {rows.tolist()}")
            self.check(pool)
            return pool
        got = rows[:count].tolist()
        if len(set(got)) != count or not set(got) <= self.free_rows or rows[count:].any():
            _fail(f"alloc_reqs({count}) returned rows {rows.tolist()} (free rows: "
                  f"{sorted(self.free_rows)})")
        states = [0] * count
        if self.hybrid:
            states = [int(s) for s in _host(pool.req_to_state)[got]]
            if len(set(states)) != count or not set(states) <= self.free_states:
                _fail(f"new rows {got} got state slots {states} (free: "
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
        rows = _host(req_indices).astype(np.int64).reshape(-1)
        keep = (rows > 0) & (rows <= self.max_running_requests)
        if mask is not None:
            keep &= _host(mask).astype(bool).reshape(-1)
        for r in set(rows[keep].tolist()) & set(self.rows):
            del self.rows[r], self.table[r], self.lens[r], self.borrowed[r]

    def write_token_slots(
        self, req_indices: Int[ArrayLike, " T"], positions: Int[ArrayLike, " T"],
        slots: Int[ArrayLike, " T"], mask: Bool[ArrayLike, " T"] | None = None,
    ) -> None:
        """Record ``pools.write_token_slots(pool, req_indices, positions, slots, mask)``: row 0,
        masked-off tokens and positions outside ``0 .. max_context_len - 1`` write nothing.
        Writing into a free row, or one cell twice, is a caller bug."""
        rows, pos, vals = (_host(x).astype(np.int64).reshape(-1)
                           for x in (req_indices, positions, slots))
        keep = (rows > 0) & (rows <= self.max_running_requests) & (pos >= 0) & (
            pos < self.max_context_len)
        if mask is not None:
            keep &= _host(mask).astype(bool).reshape(-1)
        cells = list(zip(rows[keep].tolist(), pos[keep].tolist(), strict=True))
        if len(set(cells)) != len(cells):
            _fail(f"write_token_slots writes a cell twice: {cells}")
        for (r, p), v in zip(cells, vals[keep].tolist(), strict=True):
            if r not in self.rows:
                _fail(f"write_token_slots into row {r}, which is not in use")
            self.table[r][p] = v
            self.lens[r] = max(self.lens[r], p + 1)

    def check(self, pool: ReqToTokenPool) -> None:
        """Assert that ``pool`` holds exactly the model: free rows and state slots (each once),
        ``req_to_state`` and ``req_to_token`` (zeros in row 0 and free rows)."""
        if (pool.max_running_requests, pool.max_context_len) != (
                self.max_running_requests, self.max_context_len):
            _fail("pool geometry differs from the model's")
        _check_free(pool.allocator, self.free_rows, "request rows")
        table = np.zeros((self.max_running_requests + 1, self.max_context_len), np.int64)
        for r, slots in self.table.items():
            table[r] = slots
        got = _host(pool.req_to_token)
        if not np.array_equal(got, table):
            bad = sorted({int(r) for r in np.argwhere(got != table)[:, 0]})
            _fail(f"req_to_token differs from the model in rows {bad}")
        lens = np.zeros(self.max_running_requests + 1, np.int64)
        for r, n in self.lens.items():
            lens[r] = n
        if not np.array_equal(_host(pool.req_lens), lens):
            _fail(f"req_lens {_host(pool.req_lens).tolist()}, expected {lens.tolist()}")
        bor = np.zeros(self.max_running_requests + 1, np.int64)
        for r, n in self.borrowed.items():
            bor[r] = n
        if not np.array_equal(_host(pool.borrowed), bor):
            _fail(f"borrowed {_host(pool.borrowed).tolist()}, expected {bor.tolist()}")
        if isinstance(pool, HybridReqToTokenPool) != self.hybrid:
            _fail(f"the model is {'hybrid' if self.hybrid else 'plain'}, the pool is not")
        if self.hybrid:
            _check_free(pool.state_allocator, self.free_states, "state slots")
            states = np.zeros(self.max_running_requests + 1, np.int64)
            for r, s in self.rows.items():
                states[r] = s
            if not np.array_equal(_host(pool.req_to_state), states):
                _fail(f"req_to_state {_host(pool.req_to_state).tolist()}, expected "
                      f"{states.tolist()}")


def _check_free(allocator: SlotAllocator, free: set[int], what: str) -> None:
    stack = _free_stack(allocator)
    if len(stack) != len(set(stack)) or set(stack) != free:
        _fail(f"free {what} {sorted(stack)} (stack {stack}), expected {sorted(free)}")



class RefServingPools:
    """Model of a ``ServingState``'s bookkeeping, for tests around ``step`` and ``release``.

    Holds a ``RefSlotAllocator`` of the token slots (``tokens``), a ``RefReqToTokenPool``
    (``requests``) and a copy of the pools' contents. ``step`` checks a step's result against
    the serving contract: ``ok`` exactly when the batch fits (allocated rows, lengths within its
    buckets) and enough token slots are free; then every live request's new tokens got distinct,
    previously free token slots, recorded at its new positions, and nothing else in the tables
    changed; and, ok or not, no MLA latent or KDA state outside the sink, the new tokens' slots
    and the batch's own state slots changed, bit for bit.

    >>> from hybridattn import ServingState, WorkItem, make_worker_batch, release
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
        rows, seq, ext = (_host(x).astype(np.int64) for x in
                          (batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens))
        if (rows < 0).any() or (seq < 0).any() or (ext < 0).any():
            return False
        ids = _host(batch.input_ids).astype(np.int64)
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
            _fail(f"step returned ok={bool(ok)}, expected {expect}")
        rows, seq, ext = (_host(x).astype(np.int64) for x in
                          (batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens))
        table = _host(state.req_to_token_pool.req_to_token)
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
        rows, seq, ext = (_host(x).astype(np.int64) for x in
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
        rows = _host(req_pool_indices).astype(np.int64).reshape(-1)
        keep = np.ones_like(rows, bool) if mask is None else _host(mask).astype(bool)
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
            tuple(_host(x) for x in xs) for xs in (
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
                now = _host(now)
                changed = np.flatnonzero(keep & ~np.all(
                    (old == now).reshape(old.shape[0], -1), axis=1))
                if changed.size:
                    _fail(f"{name} of layer #{layer} changed at slots {changed.tolist()}, "
                          f"which the step may not write")


# --------------------------------------------------------------------------------------------
# pool strategies
# --------------------------------------------------------------------------------------------


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


_alloc = jax.jit(pools.alloc, static_argnames="max_count")
_free = jax.jit(pools.free)
_alloc_reqs = jax.jit(pools.alloc_reqs, static_argnames="max_count")
_free_reqs = jax.jit(pools.free_reqs)
_write = jax.jit(pools.write_token_slots)
_release = jax.jit(release)


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
    _int("num_slots", num_slots, 2)
    return _allocator_states(num_slots, _int("max_ops", max_ops, 0),
                             _int("max_count", max_count, 1))


@_composite
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
            allocator = _free(allocator, jnp.asarray(padded))
            ref.free_slots(ids)
            ref.check(allocator)
            history.append(("free", tuple(ids)))
        else:
            count = draw(st.integers(0, max_count), label="alloc count")
            new, slots, ok = _alloc(allocator, jnp.int32(count), max_count=max_count)
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
    _int("max_running_requests", max_running_requests, 1)
    _int("max_context_len", max_context_len, 1)
    if num_state_slots is not None:
        _int("num_state_slots", num_state_slots, 2)
    return _req_pools(max_running_requests, max_context_len, num_state_slots, bool(hybrid),
                      _int("max_ops", max_ops, 0))


@_composite
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
            new, rows, ok = _alloc_reqs(pool, jnp.int32(count), max_count=max_count)
            pool = ref.alloc_reqs(count, new, rows, ok)
            history.append(("alloc_reqs", count, bool(ok)))
        elif op == "free":
            rows = draw(st.lists(st.sampled_from(sorted(ref.rows)), min_size=1, unique=True),
                        label="freed rows")
            padded = np.zeros(R + 1, np.int32)
            padded[: len(rows)] = rows
            pool = _free_reqs(pool, jnp.asarray(padded))
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
            pool = _write(pool, *args)
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
    _int("num_slots", num_slots, 2)
    if not config.full_attention_layer_ids:
        raise ValueError("mla_token_pools: the config has no MLA layers")
    return st.integers(0, 2**32 - 1).map(functools.partial(_fill_mla, config, num_slots, dtype))


def _fill_mla(config, num_slots, dtype, seed) -> MLATokenPool:
    saved = random.getstate()
    try:
        pool = MLATokenPool.create(config.full_attention_layer_ids, num_slots,
                                   config.kv_lora_rank, config.qk_rope_head_dim, dtype=dtype)
        return _fill_kv(pool, seed)
    finally:
        random.setstate(saved)


def _fill_kv(pool: MLATokenPool, seed: int) -> MLATokenPool:
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
    _int("num_slots", num_slots, 2)
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
        return _fill_states(pool, seed)
    finally:
        random.setstate(saved)


def _fill_states(pool: RecurrentStatePool, seed: int) -> RecurrentStatePool:
    n = len(pool.layer_ids)
    return pool.replace(
        conv=jnp.stack([_random_normal(seed + 2 * n + i, x.shape, 1.0, x.dtype)
                   for i, x in enumerate(pool.conv)]),
        ssm=jnp.stack([_random_normal(seed + 3 * n + i, x.shape, 0.5, jnp.float32)
                  for i, x in enumerate(pool.ssm)]))


# --------------------------------------------------------------------------------------------
# sampling and batches
# --------------------------------------------------------------------------------------------


def sampling_params(*, vocab_size: int = 64, greedy: bool | None = None,
                    ) -> SearchStrategy[SamplingParams]:
    """Valid per-request ``SamplingParams``: greedy (``temperature == 0``) or a temperature in
    ``[1/16, 2]``, with top-k off or in ``1 .. vocab_size``, top-p off or in ``[1/16, 1]`` and
    any seed. ``greedy``: True only greedy, False never, None either.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(sampling_params(vocab_size=8))
    ... def test_valid(sp):  # SamplingParams checks its values when it is built
    ...     assert 0 <= sp.top_k <= 8 and 0 < sp.top_p <= 1
    >>> test_valid()
    """
    _int("vocab_size", vocab_size, 1)
    floats = functools.partial(st.floats, allow_nan=False, allow_infinity=False,
                               allow_subnormal=False, width=32)
    temperature = (st.just(0.0) if greedy else floats(0.0625, 2.0)) if greedy is not None else (
        st.one_of(st.just(0.0), floats(0.0625, 2.0)))
    return st.builds(
        SamplingParams,
        temperature=temperature,
        top_k=st.one_of(st.just(0), st.integers(1, vocab_size)),
        top_p=st.one_of(st.just(1.0), floats(0.0625, 1.0)),
        seed=st.integers(0, 2**31 - 1),
    )


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
    R = _int("max_running_requests", max_running_requests, 1)
    L = _int("max_context_len", max_context_len, 1)
    S = (R * L + 1 if num_token_slots is None else _int("num_token_slots", num_token_slots, 2))
    B = R if num_requests is None else _int("num_requests", num_requests, 1)
    Ts = _ints("num_tokens", num_tokens)
    W = L if kv_width is None else _int("kv_width", kv_width, 1)
    if W > L:
        raise ValueError(f"kv_width={W} exceeds max_context_len={L}")
    if max_extend_len is not None:
        _int("max_extend_len", max_extend_len, 1)
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
        tok, slots, ok = _alloc(tok, jnp.int32(lens[i]), max_count=L)
        assert bool(ok)
        req = _write(req, jnp.full((L,), rows[i], jnp.int32), jnp.arange(L, dtype=jnp.int32),
                     slots, jnp.arange(L) < lens[i])
    state = state.replace(req_to_token_pool=req, token_allocator=tok)
    if finished:  # released: their rows, state slots and token slots go back, out of order
        done = np.zeros(R, np.int32)
        done[: len(finished)] = rows[len(exts) + len(bystanders):]
        state = _release(state, jnp.asarray(done))
    if random_contents:
        state = state.replace(token_to_kv_pool=_fill_kv(state.token_to_kv_pool, seed),
                              recurrent_state_pool=_fill_states(state.recurrent_state_pool,
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
                           _int("chunk_size", chunk_size, 1), dtype)


@_composite
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
        out = np.full(B, fill, _host(x).dtype)
        out[idx] = _host(x)[:n]
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
                            _int("chunk_size", chunk_size, 1), dtype)


@_composite
def _forward_batches(draw, config, R, L, S, B, Ts, W, Q, modes, random_contents, chunk_size,
                     dtype):
    state, mode, T, Qe, scheduled = _draw_setup(draw, config, R, L, S, B, Ts, W, Q, modes,
                                                False, chunk_size, random_contents, dtype)
    req, tok = state.req_to_token_pool, state.token_allocator
    requests = []
    for row, prefix, ids, _ in scheduled:
        tok, slots, ok = _alloc(tok, jnp.int32(len(ids)), max_count=L)
        assert bool(ok)
        req = _write(req, jnp.full((L,), row, jnp.int32),
                     prefix + jnp.arange(L, dtype=jnp.int32), slots, jnp.arange(L) < len(ids))
        requests.append(BatchRequest(row, prefix, ids, _host(slots)[: len(ids)].tolist()))
    state = state.replace(req_to_token_pool=req, token_allocator=tok)
    batch = make_forward_batch(
        requests, req_to_token_pool=req, token_to_kv_pool=state.token_to_kv_pool,
        recurrent_state_pool=state.recurrent_state_pool, forward_mode=mode, num_requests=B,
        num_tokens=T, kv_width=W, max_extend_len=Qe)
    return ForwardBatchExample(batch, state, tuple(requests))


# --------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------


class KDAInputs(NamedTuple):
    """Drawn inputs of the KDA kernels (the layouts of ``hybridattn.ops``): ``q, k [B, T, H,
    Dk]`` (L2-normalised), ``v [B, T, H, Dv]``, ``g [B, T, H, Dk]`` (float32, ``<= 0``), ``beta
    [B, T, H]``, ``initial_state [N, H, Dk, Dv]`` (float32; ``N = B``, or the number of packed
    sequences) and ``cu_seqlens [N + 1]`` (``None`` unless packed).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(kda_inputs(num_tokens=(16,), num_seqs=2))
    ... def test_fields(x):
    ...     assert np.allclose(np.linalg.norm(x.q, axis=-1), 1, atol=1e-3)
    ...     assert (x.g <= 0).all() and x.initial_state.shape[0] == 2
    ...     assert int(x.cu_seqlens[0]) == 0 and int(x.cu_seqlens[-1]) == 16
    >>> test_fields()
    """

    q: Float[Array, "B T H Dk"]
    k: Float[Array, "B T H Dk"]
    v: Float[Array, "B T H Dv"]
    g: Float[Array, "B T H Dk"]
    beta: Float[Array, "B T H"]
    initial_state: Float[Array, "N H Dk Dv"]
    cu_seqlens: Int[Array, " Np1"] | None


def kda_inputs(
    *,
    batch_size: int = 1,
    num_tokens: Sequence[int] = (16, 64),
    num_seqs: int | None = None,
    num_heads: int = 2,
    head_k_dim: int = 16,
    head_v_dim: int = 8,
    max_decay_rate: float = 200.0,
    dtype=jnp.float32,
) -> SearchStrategy[KDAInputs]:
    """Inputs of the KDA kernels as the model produces them, as ``KDAInputs``.

    ``q`` and ``k`` are L2-normalised, ``v`` standard normal, ``beta = sigmoid(normal)``; ``g``
    is Kimi-Linear's gate ``-exp(A_log) * softplus(a + dt_bias)`` with a per-head decay rate
    ``exp(A_log)`` drawn up to 1, 16 or ``max_decay_rate`` (real checkpoints reach the hundreds:
    per-token ``|g|`` in the hundreds and chunk sums far past ``exp``'s float32 range). The
    initial state is zeros or normal with std 0.5. Values come from a drawn seed (computed in
    NumPy, not with ``hybridattn.ops``); shapes from the arguments only.

    Args:
        batch_size: ``B`` (must be 1 with ``num_seqs``).
        num_tokens: the bucket of ``T``.
        num_seqs: pack this many sequences of drawn lengths (0 included) into the ``T``
            tokens of one row, with ``cu_seqlens``; None: ``B`` rows of ``T`` tokens.
        num_heads: ``H``.
        head_k_dim: ``Dk``.
        head_v_dim: ``Dv``.
        max_decay_rate: the largest ``exp(A_log)`` drawn.
        dtype: the dtype of ``q, k, v, beta`` (``g`` and the state are float32).

    >>> from hypothesis import given, settings
    >>> from hybridattn.ops import kda_recurrent
    >>> recurrent = jax.jit(kda_recurrent)
    >>> @settings(max_examples=3, deadline=None)
    ... @given(kda_inputs(batch_size=2, num_tokens=(12,)))
    ... def test_recurrent_matches_ref(x):
    ...     o, s = recurrent(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state)
    ...     o_ref, s_ref = ref_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state)
    ...     np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-4)
    >>> test_recurrent_matches_ref()

    Packed: ``kda_inputs(num_tokens=(64,), num_seqs=3)`` draws three sequences of any lengths (0
    included) summing to 64, for ``kda_chunked(..., cu_seqlens=x.cu_seqlens)`` and
    ``ref_kda(..., cu_seqlens=x.cu_seqlens)``.
    """
    B = _int("batch_size", batch_size, 1)
    Ts = _ints("num_tokens", num_tokens)
    if num_seqs is not None:
        _int("num_seqs", num_seqs, 1)
        if B != 1:
            raise ValueError(f"packed sequences (num_seqs) need batch_size=1, got {B}")
    if not max_decay_rate >= 1.0:
        raise ValueError(f"max_decay_rate must be >= 1, got {max_decay_rate!r}")
    dims = (_int("num_heads", num_heads, 1), _int("head_k_dim", head_k_dim, 1),
            _int("head_v_dim", head_v_dim, 1))
    return _kda_inputs(B, Ts, num_seqs, dims, float(max_decay_rate), dtype)


@_composite
def _kda_inputs(draw, B, Ts, num_seqs, dims, max_decay_rate, dtype):
    H, Dk, Dv = dims
    T = draw(st.sampled_from(Ts), label="T")
    cu = None
    N = B
    if num_seqs is not None:
        cuts = draw(st.lists(st.integers(0, T), min_size=num_seqs - 1, max_size=num_seqs - 1),
                    label="cuts")
        cu = jnp.asarray([0, *sorted(cuts), T], jnp.int32)
        N = num_seqs
    rate = draw(st.sampled_from(sorted({1.0, min(16.0, max_decay_rate), max_decay_rate})),
                label="max decay rate")
    with_state = draw(st.booleans(), label="initial state")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = unit((B, T, H, Dk)), unit((B, T, H, Dk))
    v = rng.standard_normal((B, T, H, Dv))
    A = rng.uniform(1.0, rate, H)
    a = rng.standard_normal((B, T, H, Dk))
    dt_bias = 0.5 * rng.standard_normal((H, Dk))
    g = -A[:, None] * np.logaddexp(0.0, a + dt_bias)  # -exp(A_log) * softplus(a + dt_bias)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = 0.5 * rng.standard_normal((N, H, Dk, Dv)) if with_state else np.zeros((N, H, Dk, Dv))
    cast = lambda x: jnp.asarray(x.astype(np.float32), dtype)
    f32 = lambda x: jnp.asarray(x.astype(np.float32))
    return KDAInputs(cast(q), cast(k), cast(v), f32(g), cast(beta), f32(s0), cu)


def ref_kda(
    q: Float[ArrayLike, "B T H Dk"],
    k: Float[ArrayLike, "B T H Dk"],
    v: Float[ArrayLike, "B T H Dv"],
    g: Float[ArrayLike, "B T H Dk"],
    beta: Float[ArrayLike, "B T H"],
    scale: float | None = None,
    initial_state: Float[ArrayLike, "N H Dk Dv"] | None = None,
    cu_seqlens: Int[ArrayLike, " Np1"] | None = None,
) -> tuple[Float[np.ndarray, "B T H Dv"], Float[np.ndarray, "N H Dk Dv"]]:
    """The KDA recurrence, token by token, in NumPy float64: ``(o, final_state)``.

    Per head, with ``S`` the ``[Dk, Dv]`` state::

        S <- diag(exp(g_t)) S
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = scale * S^T q_t

    ``scale`` defaults to ``Dk ** -0.5``. With ``cu_seqlens`` (``B == 1``) the ``N`` packed
    sequences run separately, each from its own ``initial_state[n]`` (zeros if None), and the
    final states are per sequence. Slow and plain on purpose: an oracle for ``kda_recurrent``,
    ``kda_chunked`` and ``kda_decode``.

    >>> from hybridattn.ops import kda_recurrent
    >>> x = [jnp.full((1, 3, 1, 2), 0.5)] * 3 + [jnp.full((1, 3, 1, 2), -1.0),
    ...                                          jnp.full((1, 3, 1), 0.5)]
    >>> o, s = ref_kda(*x)
    >>> o.dtype, o.shape, s.shape
    (dtype('float64'), (1, 3, 1, 2), (1, 1, 2, 2))
    >>> bool(np.allclose(kda_recurrent(*x)[0], o, atol=1e-6))
    True
    """
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got B={B}")
        cu = np.asarray(cu_seqlens).astype(np.int64).tolist()
        if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
        spans = [(0, a, b) for a, b in zip(cu, cu[1:], strict=False)]
    N = len(spans)
    states = (np.zeros((N, H, Dk, Dv)) if initial_state is None
              else np.array(initial_state, np.float64))
    if states.shape != (N, H, Dk, Dv):
        raise ValueError(f"initial_state has shape {states.shape}, expected {(N, H, Dk, Dv)}")
    o = np.zeros((B, T, H, Dv))
    for n, (b, start, end) in enumerate(spans):
        S = states[n]
        for t in range(start, end):
            S = S * np.exp(g[b, t])[:, :, None]
            u = beta[b, t][:, None] * (v[b, t] - np.einsum("hk,hkv->hv", k[b, t], S))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = scale * np.einsum("hk,hkv->hv", q[b, t], S)
        states[n] = S
    return o, states


def ref_sample_probs(
    logits: Float[ArrayLike, " V"], temperature: float, top_k: int = 0, top_p: float = 1.0,
) -> Float[np.ndarray, " V"]:
    """The distribution one request samples its next token from, in float64.

    Greedy (``temperature == 0``): all mass on the first largest logit. Otherwise
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (0: all; ties
    keep the lower token id) and, of those, to the smallest run of most likely tokens whose
    probability reaches ``top_p`` (1: all), renormalised. A token ``step`` samples for a request
    must have non-zero probability here (up to float32 rounding at the ``top_p`` boundary).

    >>> ref_sample_probs(np.array([0.0, 3.0, 1.0]), 1.0, top_k=2).round(3).tolist()
    [0.0, 0.881, 0.119]
    >>> ref_sample_probs(np.array([0.0, 3.0, 1.0]), 0.0).tolist()
    [0.0, 1.0, 0.0]
    """
    x = np.asarray(logits, np.float64).reshape(-1)
    V = x.shape[0]
    if temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    order = np.argsort(-x, kind="stable")
    scaled = x[order] / max(float(temperature), 1e-6)
    keep = np.ones(V, bool) if top_k <= 0 else np.arange(V) < top_k
    p = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        keep &= (np.cumsum(p) - p) < top_p
    p = np.where(keep, p, 0.0)
    out = np.zeros(V)
    out[order] = p / p.sum()
    return out
