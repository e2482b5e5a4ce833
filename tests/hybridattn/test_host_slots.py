"""Token slots and request rows the caller chooses (``pools.claim``, ``claim_reqs``, the
batch's ``token_slots``, ``decode_steps(token_slots=...)``).

Oracle: the same work with the device allocators choosing. Slot ids never change a token,
so a step on the caller's slots samples what the allocator's step samples, and with the ids
the allocator would have chosen every pool ends bit for bit the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import CFG, PARAMS, STEP, assert_whole, engine, prompts_of, state_with_rows

from hybridattn import serving as S
from hybridattn import testing
from hybridattn.backends import ForwardMode
from hybridattn.pools import (
    HybridReqToTokenPool,
    SlotAllocator,
    alloc,
    alloc_reqs,
    claim,
    claim_reqs,
    free,
    requests,
)
from hybridattn.serving import one_step

BUCKET = dict(vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4, num_tokens=80,
              kv_width=96, max_extend_len=80)


def _free_set(a: SlotAllocator) -> list[int]:
    return sorted(np.asarray(a.free_slots)[: int(a.num_free)].tolist())


def test_claim_keeps_the_free_stack_the_free_set():
    rng = np.random.default_rng(0)
    a = SlotAllocator.create(17)
    held: set[int] = set()
    for _ in range(40):
        if rng.random() < 0.5:
            free_now = sorted(set(range(1, 17)) - held)
            pick = rng.choice(free_now, size=min(len(free_now), rng.integers(0, 4)),
                              replace=False).tolist()
            a, ok = claim(a, jnp.asarray(pick + [0], jnp.int32))
            assert bool(ok)
            held |= set(pick)
        else:
            drop = rng.choice(sorted(held), size=min(len(held), 2), replace=False).tolist() \
                if held else []
            a = free(a, jnp.asarray(drop + [0], jnp.int32))
            held -= set(drop)
        assert _free_set(a) == sorted(set(range(1, 17)) - held)
        assert np.asarray(a.in_use).nonzero()[0].tolist() == sorted(held)


def test_failed_claim_changes_nothing():
    a, _ = claim(SlotAllocator.create(9), jnp.array([2, 5]))
    for bad in ([3, 5], [4, 4], [9], [-1], [3, 20]):
        b, ok = claim(a, jnp.array(bad))
        assert not bool(ok), bad
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                        strict=True))
    b, ok = claim(a, jnp.array([3, 5]), mask=jnp.array([True, False]))  # 5 masked off
    assert bool(ok) and _free_set(b) == [1, 4, 6, 7, 8]


def test_claim_reqs_takes_rows_and_state_slots():
    pool = HybridReqToTokenPool.create(max_running_requests=3, max_context_len=8)
    pool, ok = claim_reqs(pool, jnp.array([3, 0]), jnp.array([3, 0]))
    assert bool(ok) and pool.req_to_state.tolist() == [0, 0, 0, 3]
    same, ok = claim_reqs(pool, jnp.array([3]), jnp.array([1]))  # row 3 is taken
    assert not bool(ok) and same.req_to_state.tolist() == pool.req_to_state.tolist()
    assert int(same.state_allocator.num_free) == 2
    _, rows, _ = alloc_reqs(pool, 2, max_count=2)
    assert rows.tolist() == [1, 2]


def _items(rows, prompts, slots=None):
    return [S.WorkItem(r, 0, p, token_slots=None if slots is None else s)
            for r, p, s in zip(rows, prompts, slots or [None] * len(rows), strict=True)]


def test_step_on_chosen_slots_is_the_allocators_step():
    state, rows = state_with_rows(2)
    prompts = prompts_of([11, 30], seed=9)
    ref_state, ref = STEP(PARAMS, state, S.make_worker_batch(_items(rows, prompts), **BUCKET))
    # the allocator's own choice: slots 1..41 in order; every pool the same bit for bit
    same = [list(range(1, 12)), list(range(12, 42))]
    new, out = STEP(PARAMS, state, S.make_worker_batch(_items(rows, prompts, same), **BUCKET))
    assert bool(out.ok)
    for x, y in zip(jax.tree.leaves((ref_state, ref)), jax.tree.leaves((new, out)),
                    strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(x, y)
    # other slots: the same tokens and logits, the table and allocator say where they went
    other = [list(range(300, 289, -1)), list(range(100, 160, 2))]
    model = testing.RefServingPools.from_state(state)
    batch = S.make_worker_batch(_items(rows, prompts, other), **BUCKET)
    new, out = STEP(PARAMS, state, batch)
    assert bool(out.ok)
    model.step(batch, new, out.ok)  # the reference model of the pools agrees
    np.testing.assert_array_equal(out.next_token_ids, ref.next_token_ids)
    np.testing.assert_array_equal(out.logits, ref.logits)
    table = np.asarray(new.req_to_token_pool.req_to_token)
    assert table[rows[0], :11].tolist() == other[0] and table[rows[1], :30].tolist() == other[1]
    assert _free_set(new.token_allocator) == sorted(set(range(1, 385)) - set(sum(other, [])))
    # a chosen slot in use: the step fails and changes nothing live
    taken = [[other[0][0]] + list(range(12, 22)), list(range(22, 52))]
    batch = S.make_worker_batch(
        [S.WorkItem(r, n, p, token_slots=s) for r, n, p, s in
         zip(rows, (11, 30), prompts_of([11, 30], seed=1), taken, strict=True)], **BUCKET)
    assert not model.expect_ok(batch)
    bad, out = STEP(PARAMS, new, batch)
    assert not bool(out.ok)
    model.step(batch, bad, out.ok)
    assert _free_set(bad.token_allocator) == _free_set(new.token_allocator)
    np.testing.assert_array_equal(bad.req_to_token_pool.req_to_token, table)


def test_decode_steps_on_chosen_slots():
    state, rows = state_with_rows(2)
    prompts = prompts_of([11, 30], seed=9)
    state, out = STEP(PARAMS, state, S.make_worker_batch(_items(rows, prompts), **BUCKET))
    first = [int(t) for t in out.next_token_ids[:2]]
    batch = S.make_worker_batch([S.WorkItem(r, n, [t]) for r, n, t in
                                 zip(rows, (11, 30), first, strict=True)],
                                **{**BUCKET, "num_tokens": 4, "max_extend_len": 1},
                                forward_mode=ForwardMode.DECODE)
    run = jax.jit(S.decode_steps, static_argnums=3, static_argnames="return_slots")
    stops = jnp.array([[-1], [-1], [-1], [-1]])
    lim = jnp.array([5, 3, 0, 0])
    _, ref, ok, ref_slots = run(PARAMS, state, batch, 5, stops, lim, return_slots=True)
    table = np.zeros((5, 4), np.int32)
    table[:, :2] = np.arange(200, 210).reshape(5, 2)
    new, toks, ok2, slots = run(PARAMS, state, batch, 5, stops, lim, return_slots=True,
                                token_slots=jnp.asarray(table))
    assert bool(ok) and bool(ok2)
    np.testing.assert_array_equal(toks, ref)
    used = np.where(np.asarray(toks) >= 0, table, 0)
    np.testing.assert_array_equal(slots, used)
    row = np.asarray(new.req_to_token_pool.req_to_token)
    assert row[rows[1], 30:33].tolist() == table[:3, 1].tolist()
    assert int(new.token_allocator.num_free) == 384 - 41 - 8  # the unused ones stay free
    assert 207 in _free_set(new.token_allocator)  # row 1's slot of step 3: it ran 3


def test_allocating_alloc_keeps_order_after_claim():
    """After a claim, the allocator hands out the rest in the order it would have."""
    a, _, _ = alloc(SlotAllocator.create(8), 2, max_count=2)  # 1, 2
    b, ok = claim(a, jnp.array([4]))
    assert bool(ok)
    assert alloc(b, 4, max_count=4)[1].tolist() == [3, 5, 6, 7]


def _device_free(eng) -> list[int]:
    return _free_set(eng.core.runner.state.token_allocator)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_engine_chooses_every_row_and_slot_on_the_host(monkeypatch, decode_steps):
    """The engine path never runs a device allocator (a spy on every allocation the step,
    the rows and the sharded rows could trace), and the host's free lists stay the device's
    free sets through prefix-cache hits, multi-step decodes, stops and an abort."""
    calls = []

    def spy(real):
        return lambda *a, **k: (calls.append(real.__name__), real(*a, **k))[1]

    monkeypatch.setattr(one_step, "alloc", spy(one_step.alloc))
    monkeypatch.setattr(requests, "alloc", spy(requests.alloc))
    jax.clear_caches()  # trace the engine's functions again, under the spies
    eng = engine(snapshot_interval=32, num_snapshot_slots=41, decode_steps=decode_steps)
    runner = eng.core.runner
    shared = prompts_of([40], seed=3)[0]
    prompts = [shared + p for p in prompts_of([5, 9, 20], seed=4)] + prompts_of([7], seed=5)
    first = eng.generate(prompts, 6)
    assert sorted(runner.token_slots.free) == _device_free(eng)
    again = eng.generate(prompts[:2], 6)  # cache hits
    assert again == first[:2]
    assert sorted(runner.token_slots.free) == _device_free(eng)
    rid = eng.add_request(prompts[2], 30)
    eng.add_request(prompts[3], 8)
    for _ in range(3):
        eng.step()
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert sorted(runner.token_slots.free) == _device_free(eng)
    pool = runner.state.req_to_token_pool
    assert sorted(runner.free_rows) == _free_set(pool.allocator)
    assert_whole(eng)
    assert calls == []
    state, rows = state_with_rows(1)  # the spies see a step that allocates
    jax.jit(S.step)(PARAMS, state, S.make_worker_batch([S.WorkItem(rows[0], 0, [1, 2])],
                                                       **BUCKET))
    assert calls.count("alloc") >= 1
