"""The hybrid prefix cache: exact reuse of cached KV and KDA state snapshots.

Oracles: the cache-free ``kimi_linear.apply`` (teacher-forced greedy check of every generated
token) and mlx-lm's own Kimi-Linear (greedy, its own caches), both reading a checkpoint in
the released layout; the same engine without the cache for sampled requests; running a
snapshot's tokens alone from token 0 for the depth invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import CFG, ENGINE, PARAMS, assert_whole, mlx_kimi, prompts_of
from harness import mlx_greedy as greedy_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridattn import serving as S
from hybridattn.demo import check_against_apply
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from hybridattn.pools import alloc_reqs_or_raise

INTERVAL = 32  # the KDA chunk of ENGINE: the smallest grid
CACHED = dict(ENGINE, snapshot_interval=INTERVAL, num_snapshot_slots=41)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """PARAMS written as a checkpoint in the released layout and read back."""
    path = tmp_path_factory.mktemp("kimi") / "ckpt"
    M.save_pretrained(PARAMS, CFG, path, max_shard_bytes=300_000)
    config, params = M.load(path)
    assert config == CFG
    return path, params


@pytest.fixture(scope="module")
def mlx_greedy(loaded):
    model = mlx_kimi(loaded[0], CFG)
    return lambda prompt, n: greedy_oracle(model, prompt, n)


def served(eng: Engine, prompt, n, **kw):
    """``eng``'s tokens for ``prompt`` and how many of its tokens came from the cache."""
    before = eng.stats.cached_tokens
    out = eng.generate([prompt], n, **kw)[0]
    return out, eng.stats.cached_tokens - before


def exact(params, prompts, outputs):
    matched, total, _ = check_against_apply(params, CFG, prompts, outputs)
    assert matched == total, f"{total - matched} of {total} tokens differ from apply"


# --------------------------------------------------------------------------------------------
# exactness, scenario by scenario
# --------------------------------------------------------------------------------------------


def test_cache_hits_are_exact_and_reuse_what_they_should(loaded, mlx_greedy):
    params = loaded[1]
    eng = Engine(CFG, params, **CACHED)
    a = prompts_of([70], seed=1)[0]
    got, cached = served(eng, a, 6)  # cold
    assert cached == 0 and got == mlx_greedy(a, 6)
    again, cached = served(eng, a, 6)  # an exact repeat: only the last token recomputed
    assert again == got and cached == len(a) - 1
    b = a[:45] + prompts_of([9], seed=2)[0]  # leaves a's path at 45, off the grid
    out_b, cached = served(eng, b, 5)
    assert cached == 32  # falls back to the grid snapshot below the branch
    c = a[:45] + prompts_of([11], seed=3)[0]  # a third sibling: the branch-point snapshot
    out_c, cached = served(eng, c, 5)
    assert cached == 45
    assert out_b == mlx_greedy(b, 5) and out_c == mlx_greedy(c, 5)
    exact(params, [a, b, c], [got, out_b, out_c])
    assert eng.stats.snapshots_taken > 0 and eng.stats.hit_rate > 0.3
    assert_whole(eng)


def test_three_turns_of_a_conversation_reuse_prompt_and_answer(loaded, mlx_greedy):
    params = loaded[1]
    eng = Engine(CFG, params, **CACHED)
    turn, prompts, outs = prompts_of([23], seed=4)[0], [], []
    for i in range(3):
        out, cached = served(eng, turn, 6)
        if i:  # all of the last turn ran: prompt + answer but its last, unrun token
            assert cached == len(prompts[-1]) + len(outs[-1]) - 1
        assert out == mlx_greedy(turn, 6)
        prompts.append(turn)
        outs.append(out)
        turn = turn + out + prompts_of([5 + i], seed=5 + i)[0]
    exact(params, prompts, outs)
    assert_whole(eng)


def test_requests_sharing_a_prefix_in_one_step_wait_for_its_snapshots(loaded):
    params = loaded[1]
    eng = Engine(CFG, params, **CACHED)
    system = prompts_of([66], seed=7)[0]
    prompts = [system + t for t in prompts_of([3, 7, 5, 4], seed=8)]
    outs = eng.generate(prompts, 4)  # admitted together: the first computes the prefix
    assert eng.stats.cached_tokens >= 3 * 64  # the others hit its grid snapshot at 64
    exact(params, prompts, outs)
    assert outs == Engine(CFG, params, **ENGINE, prefix_cache=False).generate(prompts, 4)
    assert_whole(eng)


def test_after_state_and_token_evictions_outputs_stay_exact(loaded):
    params = loaded[1]
    # 8 snapshot slots and 200 token slots: serving these evicts states and KV again and again
    eng = Engine(CFG, params, **ENGINE | dict(num_token_slots=201, snapshot_interval=INTERVAL,
                                              num_snapshot_slots=9))
    base = prompts_of([40, 50, 60], seed=9)
    prompts, outs = [], []
    for r in range(3):
        for i, p in enumerate(base):
            prompt = p + prompts_of([3 + r], seed=20 + 3 * r + i)[0]
            prompts.append(prompt)
            outs.append(served(eng, prompt, 4)[0])
    assert eng.stats.state_evictions > 0 and eng.stats.token_evictions > 0
    assert eng.stats.cached_tokens > 0
    exact(params, prompts, outs)
    assert_whole(eng)


def test_a_prompt_of_three_and_a_half_prefill_chunks(loaded, mlx_greedy):
    params = loaded[1]
    eng = Engine(CFG, params, **CACHED | dict(chunked_prefill_size=16, token_buckets=(16, 32)))
    p = prompts_of([56], seed=11)[0]
    out, _ = served(eng, p, 5)
    assert out == mlx_greedy(p, 5)
    longer = p + out + prompts_of([20], seed=12)[0]
    out2, cached = served(eng, longer, 5)
    assert cached == len(p) + len(out) - 1  # the end snapshot of the first request
    assert out2 == mlx_greedy(longer, 5)
    assert_whole(eng)


def test_seeded_sampled_requests_sample_alike_with_and_without_the_cache(loaded):
    params = loaded[1]
    hot, cold = Engine(CFG, params, **CACHED), Engine(CFG, params, **ENGINE, prefix_cache=False)
    system = prompts_of([50], seed=13)[0]
    prompts = [system + t for t in prompts_of([4, 6, 9], seed=14)] * 2
    kw = dict(temperature=0.9, top_p=0.95, seed=3)
    for p in prompts:
        assert served(hot, p, 6, **kw)[0] == served(cold, p, 6, **kw)[0]
    assert hot.stats.cached_tokens > 0


# --------------------------------------------------------------------------------------------
# the depth invariant
# --------------------------------------------------------------------------------------------

_alone_step = jax.jit(S.step)


def _state_alone(params, tokens):
    """Every KDA layer's (conv, ssm) after running ``tokens`` from zero, in one step."""
    state = S.ServingState.create(CFG, max_running_requests=4, max_context_len=96,
                                  num_token_slots=385)
    pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 1)
    state = state.replace(req_to_token_pool=pool)
    batch = S.make_worker_batch([S.WorkItem(int(rows[0]), 0, tokens)],
                                vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4,
                                num_tokens=96, kv_width=96, max_extend_len=96)
    state, out = _alone_step(params, state, batch)
    assert bool(out.ok)
    slot = int(state.req_to_token_pool.req_to_state[int(rows[0])])
    return [(np.asarray(c[slot]), np.asarray(s[slot])) for c, s in
            zip(state.recurrent_state_pool.conv, state.recurrent_state_pool.ssm, strict=True)]


def _states_in_tree(tree):
    """``(tokens of the path, snapshot slot)`` of every node holding a state."""
    out, stack = [], [(root, ()) for root in tree._roots.values()]
    while stack:
        node, path = stack.pop()
        path = path + node.key
        if node.state is not None:
            out.append((list(path), node.state))
        stack.extend((c, path) for c in node.children.values())
    return out


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30)), min_size=2, max_size=7),
       st.integers(0, 2**16))
def test_every_snapshot_equals_the_state_of_its_tokens_run_alone(shape, seed):
    """Random prompts sharing 0-2 system prompts, served in packed batches of two or three (so
    requests restored from off-grid branch snapshots prefill beside others, from unaligned
    offsets): every state in the tree equals running its path's tokens alone from token 0,
    bit for bit when the path was computed on the chunk grid and to 1e-6 otherwise."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (37, 45, 20)]
    prompts = [systems[s][: rng.integers(10, len(systems[s]) + 1)] + rng.integers(
        0, CFG.vocab_size, t).tolist() for s, t in shape]
    eng = Engine(CFG, PARAMS, **CACHED)
    for i in range(0, len(prompts), 3):
        eng.generate(prompts[i: i + 3], 3)
    snaps = eng.state.snapshot_pool
    checked = 0
    for path, slot in _states_in_tree(eng.tree):
        ref = _state_alone(PARAMS, path)
        for layer, (conv, ssm) in enumerate(ref):
            got_conv = np.asarray(snaps.conv[layer][slot])
            got_ssm = np.asarray(snaps.ssm[layer][slot])
            np.testing.assert_allclose(got_conv, conv, rtol=1e-6, atol=1e-6)
            scale = max(float(np.abs(ssm).max()), 1e-30)
            assert float(np.abs(got_ssm - ssm).max()) <= 1e-6 * scale + 1e-7, (len(path), layer)
        checked += 1
    assert checked > 0


def test_snapshots_on_the_chunk_grid_are_bit_exact():
    eng = Engine(CFG, PARAMS, **CACHED)
    p = prompts_of([80], seed=15)[0]
    eng.generate([p], 2)
    snaps = eng.state.snapshot_pool
    grid = [(path, slot) for path, slot in _states_in_tree(eng.tree) if len(path) == 64]
    assert grid
    for path, slot in grid:  # against the same model alone (the engine's parameter layout)
        for layer, (conv, ssm) in enumerate(_state_alone(eng.params, path)):
            assert np.array_equal(np.asarray(snaps.ssm[layer][slot]), ssm)
            assert np.array_equal(np.asarray(snaps.conv[layer][slot]), conv)


# --------------------------------------------------------------------------------------------
# bad input, memory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(snapshot_interval=48), "snapshot_interval=48 must be a positive multiple of "
                                 "chunk_size=32"),
    (dict(snapshot_interval=0), "snapshot_interval=0"),
    (dict(num_snapshot_slots=1), "num_snapshot_slots=1 holds no snapshot"),
    (dict(prefix_cache=1), "prefix_cache=1 must be a bool"),
    (dict(num_token_slots=None, mem_fraction=1e-9), "holds"),
])
def test_cache_settings_that_cannot_work_are_refused_by_name(kw, match):
    # TypeError where the suite's beartype hook checks the annotation first
    with pytest.raises((ValueError, TypeError), match=match.split("=")[0]):
        Engine(CFG, PARAMS, **ENGINE | kw)


def test_the_memory_report_prices_a_snapshot_in_latent_tokens():
    eng = Engine(CFG, PARAMS, **CACHED)
    m = eng.memory
    assert m.num_snapshot_slots == 41 and m.snapshot_bytes == m.state_bytes_per_request
    assert m.snapshot_tokens == m.snapshot_bytes / m.mla_bytes_per_token
    assert "40 snapshots" in str(m)
    snaps = eng.state.snapshot_pool
    assert snaps.num_slots == 41 and snaps.bytes_per_request == m.snapshot_bytes
    off = Engine(CFG, PARAMS, **ENGINE, prefix_cache=False)
    assert off.state.snapshot_pool is None and off.tree is None


def test_a_snapshot_of_the_released_48b_model_weighs_tens_of_mib():
    from test_config import RELEASED

    from hybridattn.config import KimiLinearConfig
    from hybridattn.engine import MemoryReport

    cfg = KimiLinearConfig.from_dict(RELEASED)
    m = MemoryReport.for_config(cfg, max_running_requests=1, max_context_len=64,
                                num_token_slots=65, dtype=jnp.bfloat16, num_snapshot_slots=2)
    # 20 KDA layers x (32 heads x 128 x 128 float32 state + 3 x 4096 bf16 conv inputs)
    assert m.snapshot_bytes == 20 * (32 * 128 * 128 * 4 + 3 * 3 * 4096 * 2) == 43_417_600
    assert 40 < m.snapshot_bytes / 2**20 < 42  # 41.4 MiB
    assert 2_000 < m.snapshot_tokens < 20_000  # ~5.4k tokens of MLA latent (7 x 1152 B)


# --------------------------------------------------------------------------------------------
# soak
# --------------------------------------------------------------------------------------------


def test_soak_100_requests_with_sessions_tight_pools_and_both_evictions():
    """100 requests arriving at random: 8 system prompts, multi-turn sessions (the next turn is
    the last prompt + its answer + a new message), greedy and seeded sampling, a pool of 240
    token slots and 12 snapshots (both kinds of eviction happen): every output equals the
    engine's without the cache, and nothing leaks."""
    rng = np.random.default_rng(21)
    systems = [rng.integers(0, CFG.vocab_size, n).tolist() for n in rng.integers(20, 50, 8)]
    eng = Engine(CFG, PARAMS, **ENGINE | dict(num_token_slots=241, snapshot_interval=INTERVAL,
                                              num_snapshot_slots=13))
    kinds = [dict(), dict(temperature=0.8, seed=5), dict(temperature=1.0, top_k=8, seed=6)]
    jobs, arrived = {}, 0
    waiting_turns: list[tuple[list[int], int]] = []  # (prompt, kind) of next turns
    target, done = 100, {}
    for _ in range(5000):
        if arrived >= target and not eng.has_unfinished():
            break
        for _ in range(min(rng.integers(0, 3), target - arrived)):
            if waiting_turns and rng.random() < 0.5:
                prompt, kind = waiting_turns.pop(0)
            else:
                s = systems[rng.integers(0, 8)]
                prompt, kind = s + rng.integers(0, CFG.vocab_size, rng.integers(1, 12)).tolist(), \
                    int(rng.integers(0, 3))
            n = int(rng.integers(1, 6))
            rid = eng.add_request(prompt, n, **kinds[kind])
            jobs[rid] = (prompt, n, kind)
            arrived += 1
        for rid, tok, finished in eng.step():
            done.setdefault(rid, []).append(tok)
            if finished:
                prompt, n, kind = jobs[rid]
                nxt = prompt + done[rid] + rng.integers(0, CFG.vocab_size, 4).tolist()
                if len(nxt) + 6 <= 96 and rng.random() < 0.6:
                    waiting_turns.append((nxt, kind))
    assert arrived == target and not eng.has_unfinished()
    s = eng.stats
    assert s.state_evictions > 0 and s.token_evictions > 0 and s.hit_rate > 0.1
    # the oracle: the same requests through the engine without the cache, four at a time
    # (continuous batching equals serving each alone: tests/hybridattn/test_serving.py)
    cold = Engine(CFG, PARAMS, **ENGINE, prefix_cache=False)
    ids = {cold.add_request(prompt, n, **kinds[kind]): rid
           for rid, (prompt, n, kind) in jobs.items()}
    want: dict = {}
    while cold.has_unfinished():
        for rid, tok, _ in cold.step():
            want.setdefault(ids[rid], []).append(tok)
    for rid in jobs:
        assert done[rid] == want[rid], f"request {rid}"
    assert_whole(eng)


def test_automatic_sizing_keeps_tokens_and_snapshots_within_the_budget(monkeypatch):
    import hybridattn.engine._core as C
    import hybridattn.engine.sizing as E

    for cache in (False, True):
        kw = dict(max_running_requests=4, max_context_len=96, prefix_cache=cache)
        monkeypatch.setattr(C, "RESERVE_ABOVE", 0.0)  # reserved however roomy the budget
        working = Engine(CFG, PARAMS, **kw).memory.working_bytes  # the largest step's
        # a budget of 1.5 MiB beside the working memory
        monkeypatch.setattr(E, "available_memory_bytes", lambda w=working: 2 * (w + (3 << 19)))
        eng = Engine(CFG, PARAMS, **kw)
        m = eng.memory
        assert m.working_bytes == working
        assert m.serving_bytes <= 1.05 * m.budget_bytes  # the tables are extra
        monkeypatch.undo()
        if cache:
            assert m.num_snapshot_slots > 1
            assert (m.num_snapshot_slots - 1) * m.snapshot_bytes <= m.budget_bytes / 4
