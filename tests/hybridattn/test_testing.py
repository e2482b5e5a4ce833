"""hybridattn.testing: its strategies draw what they promise, and its references catch wrong
answers (a reference that accepts everything would make every property test vacuous)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisDeprecationWarning

from hybridattn import pools
from hybridattn import testing as T
from hybridattn.backends import ForwardBatch, ForwardMode, check_forward_batch
from hybridattn.config import KimiLinearConfig
from hybridattn.serving import ServingState

CFG = KimiLinearConfig.tiny()
# one small geometry for the batch strategies: nothing here compiles a model
GEOMETRY = dict(max_running_requests=3, max_context_len=24, num_requests=4, num_tokens=(16,))


def test_import_hybridattn_does_not_import_hypothesis():
    code = "import sys, hybridattn; sys.exit('hypothesis' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


@given(data=st.data(), hybrid=st.booleans(), moe=st.sampled_from([None, True, False]),
       servable=st.booleans())
def test_configs_follow_their_arguments(data, hybrid, moe, servable):
    cfg = data.draw(T.kimi_linear_configs(num_layers=(2, 5) if hybrid else (1, 3),
                                          hybrid=hybrid, moe=moe, servable=servable,
                                          hidden_sizes=(48,), head_dims=(4, 8)))
    assert cfg.num_hidden_layers in ((2, 5) if hybrid else (1, 3))
    assert cfg.hidden_size == 48 and cfg.linear_head_dim in (4, 8)
    if hybrid:
        assert cfg.kda_layer_ids and cfg.full_attention_layer_ids
    if moe is not None:
        assert (cfg.num_experts > 0) == moe
    assert KimiLinearConfig.from_dict(cfg.to_dict()) == cfg
    if servable and hybrid:  # the serving path takes it
        ServingState.create(cfg, max_running_requests=1, max_context_len=4, num_token_slots=5)


def test_config_arguments_are_checked():
    with pytest.raises(ValueError, match="num_layers"):
        T.kimi_linear_configs(num_layers=(1, 2))  # hybrid needs two layers
    with pytest.raises(ValueError, match="head_dims"):
        T.kimi_linear_configs(head_dims=())
    with pytest.raises(ValueError, match="hybrid configs"):
        T.worker_batches(KimiLinearConfig.tiny(num_hidden_layers=2, kda_layer_ids=(0, 1)))
    with pytest.raises(ValueError, match="kv_width=30 exceeds max_context_len=24"):
        T.worker_batches(CFG, **GEOMETRY, kv_width=30)


# --------------------------------------------------------------------------------------------
# pools
# --------------------------------------------------------------------------------------------

_replay_alloc = jax.jit(pools.alloc, static_argnames="max_count")
_replay_free = jax.jit(pools.free)


@given(T.slot_allocator_states(7, max_count=3))
def test_allocator_states_replay_their_history(s):
    s.reference.check(s.allocator)
    assert s.reference.used | s.reference.free == set(range(1, 7))
    a = pools.SlotAllocator.create(7)  # the history is what made the allocator
    for op in s.history:
        if op[0] == "alloc":
            a, _, ok = _replay_alloc(a, jnp.int32(op[1]), max_count=3)
            assert bool(ok) == op[2]
        else:
            a = _replay_free(a, jnp.asarray(np.pad(np.asarray(op[1], np.int32),
                                                   (0, 6 - len(op[1])))))
    np.testing.assert_array_equal(np.asarray(a.free_slots), np.asarray(s.allocator.free_slots))
    assert int(a.num_free) == int(s.allocator.num_free)


@given(T.req_to_token_pools(3, 6, num_state_slots=3), T.req_to_token_pools(2, 4, hybrid=False))
def test_req_pool_states_match_their_models(hybrid, plain):
    assert isinstance(hybrid.pool, pools.HybridReqToTokenPool)
    assert type(plain.pool) is pools.ReqToTokenPool and not plain.reference.free_states
    for s in (hybrid, plain):
        s.reference.check(s.pool)
        assert T.RefReqToTokenPool.from_pool(s.pool).table == s.reference.table
        written = [op for op in s.history if op[0] == "write"]
        assert all(len(op[3]) >= 1 for op in written)


@given(T.mla_token_pools(CFG, num_slots=5), T.recurrent_state_pools(CFG, num_slots=4))
def test_pool_contents(kv, rs):
    assert kv.layer_ids == CFG.full_attention_layer_ids and kv.num_slots == 5
    assert rs.layer_ids == CFG.kda_layer_ids and rs.num_slots == 4
    for x in jax.tree.leaves((kv, rs)):
        assert np.isfinite(np.asarray(x)).all() and np.asarray(x).std() > 0


# --------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------


def _check_state_holds_prefixes(state: ServingState, rows_prefixes):
    """Every live row's cached positions hold distinct token slots in use; nothing past."""
    ref = T.RefServingPools.from_state(state)  # also checks allocators and tables agree
    live = ref.requests.rows
    slots = []
    for row, prefix in rows_prefixes:
        assert row in live and live[row] > 0
        table = ref.requests.token_slots(row)
        assert 0 not in table[:prefix] and not any(table[prefix:])
    for row in live:
        slots += [s for s in ref.requests.token_slots(row) if s]
    assert len(slots) == len(set(slots)) and set(slots) == ref.tokens.used
    return ref


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(T.worker_batches(CFG, **GEOMETRY))
def test_worker_batches_are_valid(ex):
    b = ex.batch
    B = b.batch_size
    assert B == 4 and b.num_tokens == (4 if b.forward_mode == ForwardMode.DECODE else 16)
    assert b.kv_width == 24
    rows, seq, ext = (np.asarray(x) for x in (b.req_pool_indices, b.seq_lens,
                                               b.extend_seq_lens))
    pad = np.ones(B, bool)
    pad[list(ex.positions)] = False
    assert not rows[pad].any() and not ext[pad].any() and (np.asarray(b.top_ps)[pad] == 1).all()
    ids = []
    for it, p in zip(ex.items, ex.positions, strict=True):
        assert (rows[p], seq[p], ext[p]) == (it.req_index, it.prefix_len + len(it.token_ids),
                                             len(it.token_ids))
        assert np.asarray(b.top_ks)[p] == it.sampling.top_k
        ids += list(it.token_ids)
    if b.forward_mode == ForwardMode.DECODE:
        np.testing.assert_array_equal(np.asarray(b.input_ids)[list(ex.positions)], ids)
    else:
        np.testing.assert_array_equal(np.asarray(b.input_ids)[: len(ids)], ids)
    ref = _check_state_holds_prefixes(ex.state, [(it.req_index, it.prefix_len)
                                                 for it in ex.items])
    assert ref.expect_ok(b)
    # the lengths pass the backends' host checks, like any batch step builds from it
    check_forward_batch(ForwardBatch(
        input_ids=b.input_ids, req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
        extend_seq_lens=b.extend_seq_lens, out_cache_loc=jnp.zeros(b.num_tokens, jnp.int32),
        req_to_token_pool=ex.state.req_to_token_pool,
        token_to_kv_pool=ex.state.token_to_kv_pool,
        recurrent_state_pool=ex.state.recurrent_state_pool, kv_width=b.kv_width,
        max_extend_len=b.max_extend_len, forward_mode=b.forward_mode))


@given(T.forward_batches(CFG, **GEOMETRY))
def test_forward_batches_pass_the_host_checks_and_match_their_metadata(ex):
    fb = ex.batch
    check_forward_batch(fb)
    _check_state_holds_prefixes(ex.state, [(r.req_index, r.prefix_len + len(r.token_ids))
                                           for r in ex.requests])
    md = ex.state.backend.get_forward_metadata(fb)
    full, lin = md.full_attn_metadata, md.linear_attn_metadata
    table = np.asarray(ex.state.req_to_token_pool.req_to_token)
    states = np.asarray(ex.state.req_to_token_pool.req_to_state)
    cu = np.asarray(lin.cu_seqlens)
    start = 0
    for b, r in enumerate(ex.requests):
        n = len(r.token_ids)
        assert table[r.req_index, r.prefix_len: r.prefix_len + n].tolist() == list(r.slots)
        np.testing.assert_array_equal(np.asarray(full.page_table)[b], table[r.req_index])
        assert np.asarray(fb.out_cache_loc)[start: start + n].tolist() == list(r.slots)
        assert (cu[b], cu[b + 1]) == (start, start + n)
        assert int(lin.state_indices[b]) == states[r.req_index]
        assert bool(lin.has_initial_state[b]) == (r.prefix_len > 0)
        start += n
    assert cu[-1] == fb.num_tokens and not np.asarray(lin.state_indices)[len(ex.requests):].any()


@given(st.data())
def test_strategies_leave_the_global_random_alone(data):
    """Hypothesis checks ``data.draw``; the test suite's beartype hook spot-checks containers
    with ``random`` inside the library calls a strategy makes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", HypothesisDeprecationWarning)
        data.draw(T.kimi_linear_configs())
        data.draw(T.worker_batches(CFG, **GEOMETRY))
        data.draw(T.req_to_token_pools(2, 4))


# --------------------------------------------------------------------------------------------
# KDA and sampling
# --------------------------------------------------------------------------------------------


@given(T.kda_inputs(num_tokens=(20,), num_seqs=3, max_decay_rate=500.0),
       T.kda_inputs(batch_size=2, num_tokens=(5, 9), head_v_dim=4, dtype=jnp.bfloat16))
def test_kda_inputs(packed, rows):
    cu = np.asarray(packed.cu_seqlens)
    assert cu[0] == 0 and cu[-1] == 20 and (np.diff(cu) >= 0).all() and cu.shape == (4,)
    assert packed.q.shape == (1, 20, 2, 16) and packed.initial_state.shape == (3, 2, 16, 8)
    assert rows.cu_seqlens is None and rows.v.shape[::3] == (2, 4)
    assert rows.q.dtype == jnp.bfloat16 and rows.g.dtype == jnp.float32
    for x in (packed, rows):
        g = np.asarray(x.g)
        assert (g <= 0).all() and np.isfinite(g).all()
        np.testing.assert_allclose(np.linalg.norm(np.asarray(x.k, np.float32), axis=-1), 1,
                                   atol=1e-2)
        beta = np.asarray(x.beta, np.float32)
        assert ((beta >= 0) & (beta <= 1)).all()


def test_ref_kda_is_the_recurrence():
    """Two steps by hand, and packed sequences equal the same sequences run one by one."""
    q = k = np.array([1.0, 0.0]).reshape(1, 1, 1, 2).repeat(2, 1)
    v = np.array([2.0, 4.0]).reshape(1, 1, 1, 2).repeat(2, 1)
    g = np.log(np.full((1, 2, 1, 2), 0.5))
    beta = np.full((1, 2, 1), 0.5)
    o, s = T.ref_kda(q, k, v, g, beta, scale=1.0)
    # S1 = 0.5 k v^T; S2 = 0.5 S1 + 0.5 k (v - 0.5 S1^T k)^T; o_t = S_t^T k
    s1 = 0.5 * np.outer([1, 0], [2, 4])
    s2 = 0.5 * s1 + 0.5 * np.outer([1, 0], np.array([2, 4]) - 0.5 * s1.T @ [1, 0])
    np.testing.assert_allclose(o[0, :, 0], [s1.T @ [1, 0], s2.T @ [1, 0]])
    np.testing.assert_allclose(s[0, 0], s2)
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((1, 7, 2, 3)) for _ in range(3)] + [
        -rng.uniform(0, 2, (1, 7, 2, 3)), rng.uniform(0, 1, (1, 7, 2))]
    s0 = rng.standard_normal((2, 2, 3, 3))
    o, s = T.ref_kda(*x, initial_state=s0, cu_seqlens=np.array([0, 3, 7]))
    for n, (a, e) in enumerate([(0, 3), (3, 7)]):
        o_n, s_n = T.ref_kda(*(y[:, a:e] for y in x), initial_state=s0[n: n + 1])
        np.testing.assert_allclose(o[:, a:e], o_n)
        np.testing.assert_allclose(s[n], s_n[0])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        T.ref_kda(*x, cu_seqlens=np.array([0, 5, 3, 7]))


@given(logits=st.lists(st.floats(-4, 4, allow_subnormal=False, width=32), min_size=2,
                       max_size=8), sp=T.sampling_params(vocab_size=8))
def test_ref_sample_probs(logits, sp):
    p = T.ref_sample_probs(np.asarray(logits, np.float32), sp.temperature, sp.top_k, sp.top_p)
    assert p.shape == (len(logits),) and np.isclose(p.sum(), 1) and (p >= 0).all()
    support = np.flatnonzero(p)
    assert int(np.argmax(logits)) in support  # the most likely token is always allowed
    if sp.temperature == 0 or sp.top_k == 1:
        assert len(support) == 1
    elif sp.top_k:
        assert len(support) <= sp.top_k


# --------------------------------------------------------------------------------------------
# the references reject wrong answers
# --------------------------------------------------------------------------------------------


def test_ref_slot_allocator_rejects_wrong_answers():
    a = pools.SlotAllocator.create(5)
    ref = T.RefSlotAllocator(5)
    a = ref.alloc(2, *pools.alloc(a, 2, max_count=3))
    used = sorted(ref.used)
    for slots, ok, match in [
        ([used[0], 3, 0], True, "distinct free"),  # hands out a slot in use
        ([3, 3, 0], True, "distinct free"),
        ([3, 4, 1], True, "nonzero past count"),
        ([0, 0, 0], False, "ok=False, expected True"),
    ]:
        with pytest.raises(AssertionError, match=match):
            T.RefSlotAllocator.from_allocator(a).alloc(2, a, jnp.array(slots), jnp.bool_(ok))
    assert ref.free_slots([4, used[0], used[0]]) == 2  # 4 was never allocated, and a repeat
    assert used[0] in ref.free and 4 in ref.free  # ... the real free ignores both too
    a = pools.free(a, jnp.array([4, used[0], used[0]]))
    ref.check(a)
    broken = a.replace(num_free=a.num_free - 1)  # loses a free slot
    with pytest.raises(AssertionError, match="free slots"):
        ref.check(broken)


def test_ref_req_pool_and_serving_pools_reject_wrong_answers():
    pool = pools.HybridReqToTokenPool.create(3, 4, num_state_slots=3)
    ref = T.RefReqToTokenPool(3, 4, num_state_slots=3)
    pool = ref.alloc_reqs(2, *pools.alloc_reqs(pool, 2, max_count=2))
    new, rows, ok = pools.alloc_reqs(pool, 1, max_count=1)  # state slots ran out
    assert not bool(ok)
    with pytest.raises(AssertionError, match="ok=True, expected False"):
        ref.alloc_reqs(1, new, jnp.array([3]), jnp.bool_(True))
    row = sorted(ref.rows)[0]
    with pytest.raises(AssertionError, match="req_to_token differs"):
        ref.check(pools.write_token_slots(pool, jnp.array([row]), jnp.array([1]),
                                          jnp.array([9])))
    with pytest.raises(AssertionError, match="not in use"):
        ref.write_token_slots(jnp.array([3]), jnp.array([0]), jnp.array([5]))

    state = ServingState.create(CFG, max_running_requests=2, max_context_len=8,
                                num_token_slots=17)
    req, _ = pools.alloc_reqs_or_raise(state.req_to_token_pool, 1)
    state = state.replace(req_to_token_pool=req)
    sref = T.RefServingPools.from_state(state)
    from hybridattn.serving import WorkItem, make_worker_batch

    batch = make_worker_batch([WorkItem(1, 0, [5, 6])], vocab_size=CFG.vocab_size,
                              max_context_len=8)
    assert sref.expect_ok(batch)
    assert not sref.expect_ok(batch.replace(kv_width=1))
    # a "step" that claims success but wrote nothing, or that touched a bystander's latents
    with pytest.raises(AssertionError, match="not distinct free slots"):
        T.RefServingPools.from_state(state).step(batch, state, jnp.bool_(True))
    kv = state.token_to_kv_pool
    touched = state.replace(token_to_kv_pool=kv.replace(
        c_kv=(kv.c_kv[0].at[5].set(1.0),)))
    with pytest.raises(AssertionError, match=r"MLA c_kv of layer #0 changed at slots \[5\]"):
        sref.step(batch.replace(kv_width=1), touched, jnp.bool_(False))  # ok=False is right
