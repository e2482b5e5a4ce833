"""The pure serving step and the engine around it.

Oracles: mlx-lm's own Kimi-Linear (greedy generation with its own caches) for the engine's
tokens; serving each request alone for continuous batching; plain step-by-step calls for the
``lax.scan`` / ``while_loop`` compositions; ``jax.nn.softmax`` for the sampler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    CFG,
    ENGINE,
    PARAMS,
    STEP,
    assert_whole,
    decode_batch,
    engine,
    mlx_kimi,
    prefilled,
    prompts_of,
    state_with_rows,
)
from harness import mlx_greedy as greedy_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridattn import serving as S
from hybridattn import testing
from hybridattn.backends import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """PARAMS written as a sharded checkpoint directory in the released layout."""
    path = tmp_path_factory.mktemp("kimi") / "ckpt"
    M.save_pretrained(PARAMS, CFG, path, max_shard_bytes=300_000)
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    config, params = M.load(checkpoint)
    assert config == CFG
    return params


@pytest.fixture(scope="module")
def mlx_greedy(checkpoint):
    """Greedy generation with mlx-lm's Kimi-Linear, reading the same checkpoint files through
    its own ``sanitize``, with its own per-request caches."""
    model = mlx_kimi(checkpoint, CFG)

    def generate(prompt, n):
        return greedy_oracle(model, prompt, n)

    return generate


# --------------------------------------------------------------------------------------------
# engine == mlx-lm
# --------------------------------------------------------------------------------------------


@pytest.mark.mlx
@pytest.mark.parametrize("chunked_prefill_size", [64, 7])
def test_engine_greedy_equals_mlx_lm(mlx_greedy, loaded, chunked_prefill_size):
    # shorter than, equal to and longer than one KDA chunk (32), and longer than two
    prompts = prompts_of([5, 32, 45, 70])
    eng = Engine(CFG, loaded, **{**ENGINE, "chunked_prefill_size": chunked_prefill_size})
    got = eng.generate(prompts, max_tokens=6)
    assert got == [mlx_greedy(p, 6) for p in prompts]


@pytest.mark.mlx
def test_engine_many_concurrent_requests_equal_mlx_lm(mlx_greedy, loaded):
    prompts = prompts_of(np.random.default_rng(1).integers(1, 40, 12), seed=1)
    eng = Engine(CFG, loaded, **ENGINE)
    got = eng.generate(prompts, max_tokens=5)
    assert got == [mlx_greedy(p, 5) for p in prompts]
    assert eng.num_running == 0 and eng.num_waiting == 0
    assert_whole(eng)  # every slot came back


def test_unseeded_requests_sample_apart_and_one_seed_samples_alike():
    """``seed=None`` gives each request a seed of its own (the engine's next, in arrival
    order: the first call's prompt i gets seed i), so identical prompts sample apart; one
    seed makes them sample alike, as in mlxcache."""
    prompt = prompts_of([6], seed=9)[0]
    eng = engine()
    apart = eng.generate([prompt] * 4, 6, temperature=1.0)
    assert len({tuple(o) for o in apart}) > 1, apart
    alike = eng.generate([prompt] * 4, 6, temperature=1.0, seed=3)
    assert all(o == alike[0] for o in alike)
    first = engine().generate([prompt] * 2, 6, temperature=1.0, seed=[0, 1])
    assert first == apart[:2]  # a fresh engine's default seeds are 0, 1, ...


def test_stream_yields_what_generate_returns():
    prompts = prompts_of([12, 3, 50], seed=4)
    seen = [[] for _ in prompts]
    order = []
    for i, tok in engine().stream(prompts, 5, temperature=0.9, seed=2):
        seen[i].append(tok)
        order.append(i)
    assert seen == engine().generate(prompts, 5, temperature=0.9, seed=2)
    assert order != sorted(order)  # interleaved: the requests ran together


def test_stop_token_ends_a_request_and_frees_its_slots():
    p = prompts_of([10], seed=8)[0]
    free_run = engine().generate([p], 6)[0]
    stop = free_run[2]
    eng = engine()
    out = eng.generate([p], 6, stop_token_ids=[stop])[0]
    assert out == free_run[: free_run.index(stop) + 1]
    assert_whole(eng)


def test_pool_sizes_from_the_memory_budget(monkeypatch):
    import hybridattn.engine.sizing as E

    monkeypatch.setattr(E, "available_memory_bytes", lambda: 1 << 34)
    eng = Engine(CFG, PARAMS, max_running_requests=4, max_context_len=64)
    assert eng.capacity == 4 * 64  # plenty of memory: every request at full context
    m = eng.memory
    assert m.mla_bytes_per_token == 1 * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4
    assert m.full_attn_bytes_per_token == 4 * 4 * (24 + 16) * 4  # 4 layers x 4 heads x (K+V)
    assert "per token of context" in str(m)
    monkeypatch.setattr(E, "available_memory_bytes", lambda: 1 << 20)  # half < params
    with pytest.raises(ValueError, match="mem_fraction=0.5"):
        Engine(CFG, PARAMS, max_running_requests=4, max_context_len=64)


# --------------------------------------------------------------------------------------------
# continuous batching
# --------------------------------------------------------------------------------------------


def test_continuous_batching_equals_serving_alone():
    """64 requests, random lengths, random arrival, a pool that holds 4 at a time: every
    output equals serving the request alone (greedy and seeded sampling alike)."""
    rng = np.random.default_rng(3)
    n = 64
    lens = rng.integers(1, 60, n)
    news = rng.integers(1, 8, n)
    prompts = prompts_of(lens, seed=3)
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=1.0, top_k=5, seed=12),
             dict(temperature=0.7, top_p=0.9, seed=13)]
    sampling = [kinds[i % 4] for i in range(n)]

    eng = engine(decode_steps=8)
    order = rng.permutation(n)
    rid_of, outs = {}, {}
    arrived, waited = 0, False
    while arrived < n or eng.has_unfinished():
        for _ in range(rng.integers(0, 4) if arrived < n else 0):  # random arrivals
            if arrived < n:
                i = int(order[arrived])
                rid_of[eng.add_request(prompts[i], int(news[i]), **sampling[i])] = i
                arrived += 1
        waited |= eng.num_waiting > 0
        for rid, tok, _ in eng.step():
            outs.setdefault(rid_of[rid], []).append(tok)
    assert waited  # the pool was too small for everything at once

    alone = engine(decode_steps=1, overlap=False)  # one step per round, each committed
    for i in range(n):
        rid = alone.add_request(prompts[i], int(news[i]), **sampling[i])
        got = []
        while alone.has_unfinished():
            got += [tok for r, tok, _ in alone.step() if r == rid]
        assert outs[i] == got, f"request {i}"
    assert_whole(eng)


def _serve_each(eng, requests):
    """Queue ``requests`` (``(prompt, max_tokens, kwargs)``) at once and step ``eng``
    until they end: each request's tokens, and the token slots free after every round."""
    rids = [eng.add_request(p, n, **kw) for p, n, kw in requests]
    outs, free = {r: [] for r in rids}, []
    while eng.has_unfinished():
        for r, tok, _ in eng.step():
            outs[r].append(tok)
        free.append(eng.num_free_slots + eng.num_cached_slots)
    return [outs[r] for r in rids], free


def test_multi_step_decode_with_finishes_inside_the_run_equals_single_steps():
    """decode_steps=8: request 0 samples its stop token, request 2 (sampled) reaches
    max_tokens inside a run, request 1 runs on; tokens, free slots and the prefix cache
    end as with one step per round."""
    prompts = prompts_of([12, 5, 30], seed=21)
    free_run = engine(decode_steps=1).generate(prompts[:1], 14)[0]
    stop = free_run[4]  # inside the first 8-step run (token 0 comes from the prefill)
    requests = [(prompts[0], 14, dict(stop_token_ids=[stop, 255])),
                (prompts[1], 14, {}),
                (prompts[2], 6, dict(temperature=0.8, seed=5))]
    single, multi = engine(decode_steps=1), engine(decode_steps=8)
    want, free_single = _serve_each(single, requests)
    got, free_multi = _serve_each(multi, requests)
    assert got == want
    assert want[0] == free_run[: free_run.index(stop) + 1] and len(want[2]) == 6
    assert len(want[1]) == 14
    # one prefill round, then 8 steps per dispatch: fewer rounds, the same end
    assert len(free_multi) < len(free_single) and free_multi[-1] == free_single[-1]
    assert multi.num_cached_slots == single.num_cached_slots
    assert multi.stats.steps == single.stats.steps  # (decode_tokens leave compiling rounds out)
    assert multi.stats.decode_rounds < single.stats.decode_rounds
    assert any(len(k) == 6 and k[-1] == 8 for k in multi.stats.buckets)  # the 8-step bucket
    assert_whole(multi)


def test_abort_inside_a_stream_drops_the_tokens_of_a_multi_step_run():
    eng = engine(decode_steps=8)
    prompts = prompts_of([9, 14], seed=22)
    stream = eng.stream(prompts, 12)
    got = [[], []]
    for i, tok in stream:
        got[i].append(tok)
        if i == 0 and len(got[0]) == 3:  # mid-run: request 0 has more tokens buffered
            assert eng.abort(stream.request_ids[0])
    assert len(got[0]) == 3 and len(got[1]) == 12
    assert got[1] == engine(decode_steps=1).generate(prompts[1:], 12)[0]
    assert_whole(eng)


def _count_follows(eng: Engine) -> list:
    """Record, on ``eng``, every round that dispatched a step before committing the run in
    flight: ``(plan, follow)`` as ``Core._continuation`` found them."""
    found, real = [], eng.core._continuation

    def spy():
        plan = real()
        if plan is not None:
            found.append(plan)
        return plan

    eng.core._continuation = spy
    return found


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_overlapped_scheduling_equals_the_synchronous_engine(decode_steps):
    """Random arrivals, stop tokens the model samples inside runs, seeded sampling, the
    prefix cache (the second pass hits it): the overlapped engine (the default) gives each
    request the tokens of the synchronous one, and the pools and the cache end alike."""
    rng = np.random.default_rng(31)
    n = 16
    system = prompts_of([24], seed=30)[0]  # a shared prefix, so the cache has hits
    prompts = [system[: i % 3 * 12] + p for i, p in
               enumerate(prompts_of(rng.integers(1, 30, n), seed=31))]
    news = rng.integers(2, 12, n)
    ran = engine(overlap=False).generate(prompts[:6], 10)
    stops = np.argsort(np.bincount(sum(ran, []), minlength=CFG.vocab_size))[-3:].tolist()
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(stop_token_ids=stops),
             dict(temperature=0.9, top_k=5, seed=2, stop_token_ids=stops[-1:])]

    def serve(eng):
        arrivals = np.random.default_rng(4)
        rid_of, outs, k = {}, {}, 0
        while k < n or eng.has_unfinished():
            for _ in range(arrivals.integers(0, 3)):
                if k < n:
                    rid_of[eng.add_request(prompts[k], int(news[k]), **kinds[k % 4])] = k
                    k += 1
            for rid, tok, _ in eng.step():
                outs.setdefault(rid_of[rid], []).append(tok)
            # the host's token slots of each row (it named them; the prefix cache reads
            # them): what ran is in req_to_token; a slot named for a step still in flight
            # that the row will not run (it stops before) is not written there
            table = np.asarray(eng.state.req_to_token_pool.req_to_token)
            for r in eng.scheduler.running:
                have = table[r.row, : len(r.row_slots)].tolist()
                assert have[: r.computed] == r.row_slots[: r.computed]
                assert all(h in (s, 0) for h, s in zip(have, r.row_slots, strict=True))
        return [outs.get(i, []) for i in range(n)]

    sync, over = engine(decode_steps=decode_steps, overlap=False), engine(
        decode_steps=decode_steps)
    follows = _count_follows(over)
    want = [serve(sync), serve(sync)]
    assert [serve(over), serve(over)] == want
    assert any(len(o) < news[i] for i, o in enumerate(want[0]))  # some stopped early
    # steps were dispatched before the tokens of the run in flight, prompt chunks too (with
    # requests admitted meanwhile), fed from the device
    assert any(plan.mode == ForwardMode.DECODE for plan, _ in follows)
    assert any(plan.mode == ForwardMode.EXTEND and follow.fed for plan, follow in follows)
    assert over.stats.cached_tokens > 0 and sync.stats.cached_tokens > 0
    # (the cache's contents may differ: a request admitted a round later can hit more)
    assert_whole(over)


@pytest.mark.parametrize("stopped", [(), (0,), (1,), (0, 1)])
def test_follow_feeds_rows_from_the_run_in_flight_and_drops_the_stopped(stopped):
    """``_follow`` against the batch the host would pack knowing the tokens: decode rows 0
    and 1 take the run in flight's samples, prompt chunks keep theirs; a fed row whose token
    is a stop id is padding and the tokens after it move up."""
    from hybridattn.engine._runner import _follow

    prev = jnp.array([[40, 41, 42], [43, -1, 44]])  # a 2-step run: [N, B'] (row 1 stopped)
    sampled = {0: 44, 1: 40}  # decode row 0 <- column 2, row 1 <- column 0 (step 0)
    slots = {0: [50], 1: [51], 2: [52, 53, 54], 3: [55, 56]}  # the host's, moved with them
    items = [S.WorkItem(1, 5, [0], slots=slots[0]), S.WorkItem(2, 7, [0], slots=slots[1]),
             S.WorkItem(3, 0, [11, 12, 13], slots=slots[2]),
             S.WorkItem(4, 2, [21, 22], slots=slots[3])]
    shape = dict(vocab_size=64, max_context_len=32, num_requests=6, num_tokens=10,
                 kv_width=16, max_extend_len=4)
    batch = S.make_worker_batch(items, **shape)
    stops = np.full((6, 2), -1)
    for row in stopped:
        stops[row, 1] = sampled[row]
    got = _follow(batch, prev, jnp.array([2, 0, -1, -1, -1, -1]), jnp.array([1, 0, 0, 0, 0, 0]),
                  jnp.asarray(stops))
    known = [S.WorkItem(it.req_index, it.prefix_len, [sampled[i]] if i in sampled else
                        it.token_ids, slots=it.slots) for i, it in enumerate(items)
             if i not in stopped]
    want = S.make_worker_batch(known, **shape)
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.out_cache_loc.tolist() == want.out_cache_loc.tolist()
    live = [i for i in range(6) if i not in stopped]
    for field in ("req_pool_indices", "seq_lens", "extend_seq_lens"):
        g, w = getattr(got, field).tolist(), getattr(want, field).tolist()
        assert [g[i] for i in live] == w[: len(live)] and all(g[i] == 0 for i in stopped)


def test_abort_of_a_request_whose_run_is_in_flight():
    """Aborting a request while a run computing its next token is on the device: no more of
    its tokens arrive, the other request runs on as if alone, nothing leaks."""
    eng = engine()
    prompts = prompts_of([9, 14], seed=23)
    rids = [eng.add_request(p, 12) for p in prompts]
    got = {r: [] for r in rids}
    while eng.core.runner.inflight is None or len(got[rids[0]]) < 2:
        for r, tok, _ in eng.step():
            got[r].append(tok)
    assert any(r is not None and r.rid == rids[0] for r, _ in eng.core.runner.inflight.plan.work)
    assert eng.abort(rids[0])
    cut = len(got[rids[0]])
    while eng.has_unfinished():
        for r, tok, _ in eng.step():
            got[r].append(tok)
    assert len(got[rids[0]]) == cut < 12
    assert got[rids[1]] == engine(overlap=False).generate(prompts[1:], 12)[0]
    assert_whole(eng)


def test_compilations_bounded_over_200_steps():
    rng = np.random.default_rng(5)
    eng = engine(chunked_prefill_size=24)
    steps = 0
    while steps < 200:
        for _ in range(rng.integers(0, 3)):
            n = int(rng.integers(1, 50))
            eng.add_request(prompts_of([n], seed=steps)[0], int(rng.integers(1, 10)))
        eng.step()
        steps += 1
    assert len(eng.stats.buckets) >= 3  # the composition did change
    # at most one compilation per step bucket (each engine counts its own) ...
    compiled = eng.stats.compiled_buckets
    assert len(compiled) == len(set(compiled)) and set(compiled) <= eng.stats.buckets
    # ... plus, once each, the row admission and prefix borrowing (per kv bucket: one here),
    # the release, the frees of evicted slots (one per power of 2 of slots freed) and the
    # overlapped rounds' _follow (per step bucket and bucket of the run it follows)
    follows = sum(key[0] is eng.core.runner.jit.follow for key in eng.core.runner.jit._seen)
    assert 0 < follows <= len(eng.stats.buckets) ** 2
    helpers = eng.stats.num_compilations - len(compiled) - follows
    assert 0 < helpers <= 3 * len(eng.kv_buckets) + eng.capacity.bit_length() + 1
    # compilations are reused within the engine: a workload it has served compiles nothing
    prompts = prompts_of([30, 5, 17], seed=1)
    eng.generate(prompts, 3)
    eng.generate(prompts, 3)  # the prompts are cached now
    before = eng.stats.num_compilations
    eng.generate(prompts, 3)
    assert eng.stats.num_compilations == before


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ([1, 2, CFG.vocab_size], {}, "256, outside the vocabulary"),
        ([1, -3], {}, "-3, outside the vocabulary"),
        ([], {}, "prompt is empty"),
        ([1, 2], dict(max_tokens=0), "max_tokens=0"),
        (list(range(90)), dict(max_tokens=10), "max_context_len=96"),
        ([1], dict(top_p=0.0), "top_p=0.0"),
        ([1], dict(temperature=-1.0), "temperature=-1.0"),
    ],
)
def test_bad_requests_raise_and_the_engine_keeps_serving(prompt, kwargs, match):
    eng = engine()
    good = prompts_of([9, 20], seed=7)
    expected = engine().generate(good, 4)
    rids = [eng.add_request(p, 4) for p in good]
    outs = {r: [] for r in rids}
    for r, tok, _ in eng.step():  # the good requests are running
        outs[r].append(tok)
    assert eng.num_running == 2
    kw = dict(max_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, kw.pop("max_tokens"), **kw)
    while eng.has_unfinished():
        for r, tok, _ in eng.step():
            outs[r].append(tok)
    assert [outs[r] for r in rids] == expected


def test_generate_names_the_bad_prompt_and_changes_nothing():
    eng = engine()
    with pytest.raises(ValueError, match="prompt 1: .*outside the vocabulary"):
        eng.generate([[1, 2], [5, 999]], 3)
    assert eng.num_waiting == 0 and not eng.has_unfinished()
    assert eng.generate([[1, 2]], 3) == engine().generate([[1, 2]], 3)


# --------------------------------------------------------------------------------------------
# the pure step composes
# --------------------------------------------------------------------------------------------


_step = STEP


def test_decode_steps_in_scan_equal_step_by_step():
    state, rows = state_with_rows(2)
    a, b = prompts_of([11, 30], seed=9)
    wb = S.make_worker_batch([S.WorkItem(rows[0], 0, a), S.WorkItem(rows[1], 0, b)],
                             vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4,
                             num_tokens=80, kv_width=96, max_extend_len=80)
    state, out = _step(PARAMS, state, wb)
    first = S.make_worker_batch(
        [S.WorkItem(rows[0], 11, [int(out.next_token_ids[0])],
                    S.SamplingParams(temperature=0.9, seed=4)),
         S.WorkItem(rows[1], 30, [int(out.next_token_ids[1])])],
        vocab_size=CFG.vocab_size, max_context_len=96, forward_mode=ForwardMode.DECODE,
        num_requests=4, kv_width=96,
    )
    n = 5
    s1, batch, manual = state, first, []
    for _ in range(n):
        s1, o = _step(PARAMS, s1, batch)
        manual.append(np.asarray(o.next_token_ids))
        batch = batch.next_decode(o.next_token_ids)
    s2, tokens, ok = jax.jit(S.decode_steps, static_argnums=3)(PARAMS, state, first, n)
    assert bool(ok)
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens[:, :2], np.stack(manual)[:, :2])
    assert (tokens[:, 2:] == -1).all()  # the padding rows ran no step
    for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_decode_steps_rows_finishing_inside_the_run_become_padding():
    """Row 0 samples its stop token at step 2, row 1 has a budget of 3 tokens: each is
    stepped, one step at a time, only until its finish, and the pools end the same."""
    state, rows = state_with_rows(2)
    a, b = prompts_of([11, 30], seed=9)
    wb = S.make_worker_batch([S.WorkItem(rows[0], 0, a), S.WorkItem(rows[1], 0, b)],
                             vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4,
                             num_tokens=80, kv_width=96, max_extend_len=80)
    state, out = _step(PARAMS, state, wb)
    samp = [S.SamplingParams(temperature=0.9, seed=4), S.SamplingParams()]
    start = [int(t) for t in out.next_token_ids[:2]]
    n = 6
    first = S.make_worker_batch(
        [S.WorkItem(rows[i], [11, 30][i], [start[i]], samp[i]) for i in range(2)],
        vocab_size=CFG.vocab_size, max_context_len=96, forward_mode=ForwardMode.DECODE,
        num_requests=4, kv_width=96)
    run = jax.jit(S.decode_steps, static_argnums=3)  # one compile: the same shapes twice
    no_stops = jnp.full((4, 2), -1, jnp.int32)
    free_run = np.asarray(run(PARAMS, state, first, n, no_stops, jnp.full(4, n))[1])
    stop = int(free_run[2, 0])
    stops_at = list(free_run[:, 0]).index(stop)  # its first occurrence, at step 2 or before
    budget = [n, 3]
    # the reference: one step at a time, each row in the batch until it finishes
    s1, manual = state, [[], []]
    lens, nxt, alive = [11, 30], list(start), [True, True]
    while any(alive):
        items = [S.WorkItem(rows[i], lens[i], [nxt[i]], samp[i]) for i in range(2) if alive[i]]
        batch = S.make_worker_batch(items, vocab_size=CFG.vocab_size, max_context_len=96,
                                    forward_mode=ForwardMode.DECODE, num_requests=4,
                                    kv_width=96)
        s1, o = _step(PARAMS, s1, batch)
        for j, i in enumerate(i for i in range(2) if alive[i]):
            tok = int(o.next_token_ids[j])
            manual[i].append(tok)
            lens[i], nxt[i] = lens[i] + 1, tok
            alive[i] = not (i == 0 and tok == stop) and len(manual[i]) < budget[i]
    assert len(manual[0]) == stops_at + 1 and len(manual[1]) == 3
    stops = no_stops.at[0, 0].set(stop)
    s2, tokens, ok = run(PARAMS, state, first, n, stops, jnp.array(budget + [n, n], jnp.int32))
    assert bool(ok)
    tokens = np.asarray(tokens)
    for i in range(2):
        ran = tokens[:, i][tokens[:, i] >= 0].tolist()
        assert ran == manual[i] and (tokens[len(ran):, i] == -1).all()
    assert (tokens[:, 2:] == -1).all()
    assert int(s2.token_allocator.num_used) == int(s1.token_allocator.num_used)
    for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_while_loop_stops_on_the_ok_flag_and_the_failed_step_changes_nothing():
    state, rows = state_with_rows(1)
    alloc = jax.jit(lambda a: a.alloc(345, 345))  # leave 39 of the 384 slots free
    allocator, _, _ = alloc(state.token_allocator)
    state = state.replace(token_allocator=allocator)
    wb = S.make_worker_batch([S.WorkItem(rows[0], 0, prompts_of([30])[0])],
                             vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4,
                             num_tokens=80, kv_width=96, max_extend_len=80)
    state, out = _step(PARAMS, state, wb)
    dec = S.make_worker_batch([S.WorkItem(rows[0], 30, [int(out.next_token_ids[0])])],
                              vocab_size=CFG.vocab_size, max_context_len=96,
                              forward_mode=ForwardMode.DECODE, num_requests=4, kv_width=96)

    def cond(c):
        return c[2] & (c[3] < 50)

    def body(c):
        st, batch, _, i = c
        st, o = S.step(PARAMS, st, batch)
        return st, jax.tree.map(lambda x, y: jnp.where(o.ok, x, y),
                                batch.next_decode(o.next_token_ids), batch), o.ok, i + 1

    final, _, ok, i = jax.jit(lambda s, b: jax.lax.while_loop(
        cond, body, (s, b, jnp.bool_(True), 0)))(state, dec)
    assert not bool(ok) and int(i) == 10  # 9 decode steps fit in the 9 slots left
    assert int(final.token_allocator.num_free) == 0
    assert int(final.req_to_token_pool.req_to_token[rows[0], :39].min()) > 0
    assert int(final.req_to_token_pool.req_to_token[rows[0], 39:].max()) == 0


# The geometry and buckets of the tests above, so that the drawn batches reuse their compiled
# steps: one EXTEND bucket (B=4, T=80) and one DECODE bucket (B=4).
DRAWN = testing.worker_batches(CFG, max_running_requests=4, max_context_len=96,
                               num_token_slots=385, num_requests=4, num_tokens=(80,))
_release = jax.jit(S.release)


@settings(max_examples=12)
@given(ex=DRAWN, data=st.data())
def test_step_on_drawn_batches_keeps_the_pool_contract_and_samples_within_support(ex, data):
    """Any valid batch on any reachable state (fragmented free lists, bystanders, cached
    prefixes, padding rows anywhere, mixed sampling): ``step`` succeeds, allocates exactly
    the new tokens' slots, writes nothing it does not own, and samples every request's token
    from its allowed set; ``release`` then returns exactly what the released rows held."""
    ref = testing.RefServingPools.from_state(ex.state)
    new, out = _step(PARAMS, ex.state, ex.batch)
    ref.step(ex.batch, new, out.ok)  # asserts ok, the bookkeeping and the untouched slots
    logits, tokens = np.asarray(out.logits), np.asarray(out.next_token_ids)
    b = ex.batch
    for it, p in zip(ex.items, ex.positions, strict=True):
        assert np.isfinite(logits[p]).all()
        # top_p loosened by 1e-4: the step's float32 running sum may keep one token more
        probs = testing.ref_sample_probs(logits[p], float(b.temperatures[p]), int(b.top_ks[p]),
                                         min(1.0, float(b.top_ps[p]) + 1e-4))
        assert probs[tokens[p]] > 0, (it.sampling, tokens[p])
    assert not np.delete(tokens, list(ex.positions)).any()  # padding rows sample 0
    done = data.draw(st.lists(st.sampled_from([it.req_index for it in ex.items]), unique=True),
                     label="released")
    rows = np.zeros(4, np.int32)
    rows[: len(done)] = done
    ref.release(rows)
    ref.check(_release(new, jnp.asarray(rows)))


def test_release_returns_every_slot():
    eng = engine()
    eng.generate(prompts_of([40, 3, 17], seed=2), 4)
    assert_whole(eng)
    # 384 slots hold 4 full contexts: the engine allocates those 4 of the 8 rows asked for
    assert eng.max_running_requests == 4
    assert int(eng.state.req_to_token_pool.allocator.num_free) == 4
    assert int(eng.state.req_to_token_pool.state_allocator.num_free) == 4
    assert int(jnp.abs(eng.state.req_to_token_pool.req_to_token).sum()) == 0


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def test_sampler_filters_and_distribution():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8)) * 2, jnp.float32)
    n = 4000
    keys = jax.random.split(jax.random.key(1), n)
    draw = jax.jit(jax.vmap(lambda k, t, tk, tp: S.sample(logits, t[None], tk[None], tp[None],
                                                           k[None])[0]))

    def freq(t, tk, tp):
        d = draw(keys, jnp.full(n, t), jnp.full(n, tk, jnp.int32), jnp.full(n, tp))
        return np.bincount(np.asarray(d), minlength=8) / n

    # Against the float64 reference distribution: zero where it is zero, close elsewhere.
    for t, tk, tp in [(0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6),
                      (0.7, 4, 0.8)]:
        want = testing.ref_sample_probs(logits[0], t, tk, tp)
        got = freq(t, tk, tp)
        assert got[want == 0].sum() == 0, (t, tk, tp)
        np.testing.assert_allclose(got, want, atol=0.03, err_msg=str((t, tk, tp)))


def test_each_row_draws_what_jax_random_categorical_draws_with_its_key():
    """A sampled row's token is ``jax.random.categorical`` of its key over its logits scaled
    by its temperature, with the tokens top-k / top-p drop at -inf (their set from the float64
    reference), whatever the other rows do: rows with and without filters in one batch."""
    rng = np.random.default_rng(2)
    V = 16
    temps = np.array([0.0, 0.7, 1.0, 1.3, 0.9, 1.0], np.float32)
    top_ks = np.array([0, 0, 5, 0, 3, 0], np.int32)
    top_ps = np.array([1.0, 1.0, 1.0, 0.8, 0.9, 1.0], np.float32)
    sample = jax.jit(S.sample)
    for trial in range(20):
        logits = (rng.normal(size=(6, V)) * 2).astype(np.float32)
        keys = S.request_keys(jax.random.key(7), jnp.arange(6), jnp.full(6, trial))
        rows = range(6) if trial % 2 else range(1, 6, 2)  # with and without filtered rows
        sel = np.array(list(rows))
        got = np.asarray(sample(jnp.asarray(logits[sel]), jnp.asarray(temps[sel]),
                                jnp.asarray(top_ks[sel]), jnp.asarray(top_ps[sel]), keys[sel]))
        for j, b in enumerate(sel):
            if temps[b] == 0:
                assert got[j] == int(np.argmax(logits[b]))
                continue
            support = testing.ref_sample_probs(logits[b], float(temps[b]), int(top_ks[b]),
                                               float(top_ps[b])) > 0
            x = jnp.where(jnp.asarray(support), jnp.asarray(logits[b]) / temps[b], -jnp.inf)
            assert got[j] == int(jax.random.categorical(keys[b], x)), (trial, b)


def test_sampling_keys_depend_on_seed_and_position_only():
    base = jax.random.key(0)
    k1 = S.request_keys(base, jnp.array([3, 4]), jnp.array([10, 10]))
    k2 = S.request_keys(base, jnp.array([9, 3]), jnp.array([1, 10]))
    assert (jax.random.key_data(k1[0]) == jax.random.key_data(k2[1])).all()
    assert not (jax.random.key_data(k1[0]) == jax.random.key_data(k1[1])).all()


# --------------------------------------------------------------------------------------------
# layouts, bad batches, repeats, aborts
# --------------------------------------------------------------------------------------------


def test_decode_padding_rows_anywhere():
    state, rows, lens, toks = prefilled()
    s1, packed = _step(PARAMS, state, decode_batch(rows, lens, toks, [0, 1]))
    s2, spread = _step(PARAMS, state, decode_batch(rows, lens, toks, [0, 2]))
    assert bool(packed.ok) and bool(spread.ok)
    np.testing.assert_allclose(np.asarray(spread.logits[jnp.array([0, 2])]),
                               np.asarray(packed.logits[:2]), atol=1e-5)
    for r, n in zip(rows, lens, strict=True):  # each request's new slot holds its own latent
        for s in (s1, s2):
            slot = int(s.req_to_token_pool.req_to_token[r, n])
            assert slot > 0
        c1 = s1.token_to_kv_pool.c_kv[0][int(s1.req_to_token_pool.req_to_token[r, n])]
        c2 = s2.token_to_kv_pool.c_kv[0][int(s2.req_to_token_pool.req_to_token[r, n])]
        np.testing.assert_allclose(np.asarray(c1), np.asarray(c2), atol=1e-5)


@pytest.mark.parametrize("bad", ["free_row", "row_out_of_range", "past_kv_width"])
def test_a_batch_that_does_not_fit_fails_the_step_and_changes_nothing_live(bad):
    state, rows, lens, toks = prefilled()
    batch = decode_batch(rows, lens, toks, [0, 1])
    if bad == "free_row":
        batch = batch.replace(req_pool_indices=batch.req_pool_indices.at[1].set(3))
    elif bad == "row_out_of_range":
        batch = batch.replace(req_pool_indices=batch.req_pool_indices.at[1].set(9))
    else:
        batch = batch.replace(seq_lens=batch.seq_lens.at[1].set(97))
    new, out = _step(PARAMS, state, batch)
    assert not bool(out.ok) and int(out.next_token_ids.max()) == 0
    assert int(new.token_allocator.num_free) == int(state.token_allocator.num_free)
    np.testing.assert_array_equal(np.asarray(new.req_to_token_pool.req_to_token),
                                  np.asarray(state.req_to_token_pool.req_to_token))
    for a, b in zip(new.recurrent_state_pool.ssm, state.recurrent_state_pool.ssm, strict=True):
        np.testing.assert_array_equal(np.asarray(a[1:]), np.asarray(b[1:]))  # all but the sink


@pytest.mark.parametrize("bad", [None, "in_use", "twice", "out_of_range", "missing"])
def test_a_step_claims_the_slots_the_host_names(bad):
    """A batch that names its token slots (``out_cache_loc``) runs exactly as the step that
    allocates (same tokens and logits; the latents at the named slots), records them in
    ``req_to_token`` and leaves the allocator a stack of the rest; naming a slot in use, one
    twice, one outside the pool or none for a new token fails the step and changes nothing."""
    state, rows, lens, toks = prefilled()
    want_state, want = _step(PARAMS, state, decode_batch(rows, lens, toks, [0, 1]))
    used = set(np.flatnonzero(np.asarray(state.token_allocator.in_use)).tolist())
    named = {None: [300, 200], "in_use": [300, min(used)], "twice": [300, 300],
             "out_of_range": [300, 385], "missing": [300, 0]}[bad]
    loc = np.zeros(4, np.int32)
    loc[:2] = named
    batch = decode_batch(rows, lens, toks, [0, 1]).replace(out_cache_loc=jnp.asarray(loc))
    new, out = _step(PARAMS, state, batch)
    a = new.token_allocator
    if bad is not None:
        assert not bool(out.ok)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(state.token_allocator), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(new.req_to_token_pool.req_to_token),
                                      np.asarray(state.req_to_token_pool.req_to_token))
        return
    assert bool(out.ok) and out.next_token_ids.tolist() == want.next_token_ids.tolist()
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(want.logits), atol=1e-6)
    table = np.asarray(new.req_to_token_pool.req_to_token)
    assert [int(table[r, n]) for r, n in zip(rows, lens, strict=True)] == named
    assert out.token_slots.tolist()[:2] == named
    for r, n, slot in zip(rows, lens, named, strict=True):
        got = want_state.req_to_token_pool.req_to_token[r, n]
        np.testing.assert_allclose(np.asarray(new.token_to_kv_pool.c_kv[0][slot]),
                                   np.asarray(want_state.token_to_kv_pool.c_kv[0][got]),
                                   atol=1e-6)
    free = np.asarray(a.free_slots)[: int(a.num_free)].tolist()
    assert sorted(free) == sorted(set(range(1, 385)) - used - set(named))
    assert all(int(a.stack_pos[f]) == i for i, f in enumerate(free))


def test_release_twice_is_a_no_op():
    state, rows, _, _ = prefilled()
    rel = jax.jit(S.release)
    once = rel(state, jnp.array([rows[0], 0, 0, 0]))
    twice = rel(once, jnp.array([rows[0], rows[0], 0, 0]))
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice), strict=True):
        if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(twice.req_to_token_pool.allocator.num_free) == 3  # 4 rows, one still in use


def test_engine_defaults_and_bucket_checks():
    eng = Engine(CFG, PARAMS, max_running_requests=4, num_token_slots=4 * 4096 + 1)
    assert eng.max_context_len == min(CFG.model_max_length, 4096)
    long_chunks = Engine(CFG, PARAMS, max_running_requests=4, max_context_len=64,
                         num_token_slots=257, chunked_prefill_size=256)
    assert long_chunks.token_buckets[-1] >= 256 + 4  # several prompts can share a step
    with pytest.raises(ValueError, match="must not exceed max_context_len=96"):
        engine(kv_buckets=(32, 128))
    with pytest.raises((ValueError, TypeError), match=r"80\.5"):  # TypeError: jaxtyping hook
        engine(kv_buckets=(80.5, 96))


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=2.5), r"top_k\W+2\.5"), (dict(seed=1.5), r"seed\W+1\.5"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(stop_token_ids=[CFG.vocab_size]), "stop_token_ids"),
])
def test_add_request_rejects_loose_values(kwargs, match):
    # TypeError where the test suite's jaxtyping/beartype hook checks the annotations first
    eng = engine()
    kw = dict(max_tokens=3) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        eng.add_request([1, 2], kw.pop("max_tokens"), **kw)
    with pytest.raises((ValueError, TypeError), match=r"ints|prompt"):
        eng.add_request([1.5, 2.0], 3)
    assert not eng.has_unfinished()


def test_abandoned_stream_and_abort_free_everything():
    eng = engine()
    for _ in eng.stream(prompts_of([20, 5, 9, 30, 12, 3], seed=6), 6):
        break  # the consumer walks away after the first token
    assert not eng.has_unfinished()
    assert_whole(eng)
    rid = eng.add_request(prompts_of([10])[0], 5)
    eng.step()
    assert eng.abort(rid) and not eng.abort(rid)
    assert int(eng.state.req_to_token_pool.allocator.num_free) == eng.max_running_requests
    assert_whole(eng)


def test_demo_serves_a_checkpoint_directory(checkpoint, capsys, monkeypatch):
    from hybridattn import demo

    monkeypatch.setenv("HYBRIDATTN_JAX_CACHE", "0")  # keep the suite's compilation cache

    rc = demo.main(["--model", str(checkpoint), "--requests", "3", "--max-tokens", "3",
                    "--min-prompt", "2", "--max-prompt", "20", "--max-running", "2",
                    "--chunked-prefill", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"checkpoint {checkpoint}" in out and "9/9 tokens match: OK" in out


@pytest.mark.parametrize("scan", [False, True])
def test_one_request_steps_without_copying_the_state_pool(scan):
    """A decode step, a prompt and a cache hit's prompt (a snapshot restored, one taken) of
    one request write the KDA states in place: the compiled step holds no copy of the state
    or snapshot pool, whose sizes are set by the engine, not by the batch. (Read as one row,
    a state reads as a dynamic slice and its write as a dynamic update slice; XLA:CPU then
    copied the whole pool around the write, several times a step: 93 ms a step at 128 rows
    against 5.6 ms without the copies.)"""
    cfg = KimiLinearConfig.tiny(num_hidden_layers=4, hidden_size=32, vocab_size=64)
    eng = Engine(cfg, M.init_params(cfg, jax.random.key(0)), max_running_requests=16,
                 max_context_len=128, num_token_slots=16 * 128 + 1, snapshot_interval=32,
                 num_snapshot_slots=9, scan_layers=scan)
    pools = (eng.state.recurrent_state_pool, eng.state.snapshot_pool)
    shapes = {f"f32[{','.join(map(str, a.shape))}]" for p in pools for a in (p.ssm, p.conv)}
    # and the token allocator the step claims the named slots from (free stack, stack_pos)
    shapes |= {f"s32[{n}]" for n in (16 * 128, 16 * 128 + 1)} | {f"pred[{16 * 128 + 1}]"}
    W = 128
    for mode, item, snaps in (  # as the engine packs them: the slots named
            (ForwardMode.DECODE, S.WorkItem(1, 1, [1], slots=[7]), None),
            (ForwardMode.EXTEND, S.WorkItem(1, 0, [1] * 16, slots=range(1, 17)), None),
            # a cache hit: restores a snapshot, takes one
            (ForwardMode.EXTEND, S.WorkItem(1, 64, [1] * 16, restore_from=2,
                                            snapshots=((72, 5),), slots=range(1, 17)), 1)):
        tokens = len(item.token_ids)
        batch = S.make_worker_batch(
            [item], vocab_size=cfg.vocab_size, max_context_len=eng.max_context_len,
            forward_mode=mode, num_requests=1, num_tokens=tokens, kv_width=W,
            max_extend_len=tokens, num_snapshots=snaps, snapshot_chunk=eng.scheduler.chunk_size)
        step = eng.core.runner.jit.step
        hlo = step.trace(eng.params, eng.state, batch).lower().compile().as_text()
        copies = [line.strip()[:120] for line in hlo.splitlines()
                  if " copy(" in line and any(f"= {s}" in line for s in shapes)]
        assert not copies, (mode, copies)
