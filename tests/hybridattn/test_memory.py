"""hybridattn over a long life: the device holds its pools and parameters alone, inside the
budget it reports, and the stats stay bounded.

The oracle apart from the engine's own report is JAX's list of the arrays alive in the
process (``jax.live_arrays``), sampled after every call of a long session of mixed requests.
"""

from __future__ import annotations

import random

import jax
from harness import CFG, PARAMS, engine

from hybridattn import Engine
from hybridattn.engine.sizing import pool_sizes
from servecore.stats import TTFT_WINDOW


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def test_a_long_mixed_session_holds_the_pools_alone_and_bounded_stats():
    eng = engine(snapshot_interval=32, num_snapshot_slots=41)
    m = eng.memory
    state_bytes = lambda: sum(x.nbytes for x in jax.tree.leaves(eng.state))  # noqa: E731
    assert state_bytes() == m.pool_bytes
    assert m.pool_bytes + m.param_bytes <= m.budget_bytes
    rng = random.Random(11)
    shared = [rng.randrange(2, 200) for _ in range(40)]
    live, n = [], 0
    while n < 144:  # 12 calls (the first 3 compile)
        prompts, max_tokens = [], []
        for i in range(12):
            length = rng.randrange(40, 88) if i % 4 == 0 else rng.randrange(1, 12)
            head = shared[: rng.randrange(0, 40)] if i % 3 == 1 else []
            prompt = (head + [rng.randrange(2, 200) for _ in range(length)])[:88]
            prompts.append(prompt)
            max_tokens.append(rng.randrange(1, 96 - len(prompt) + 1) % 8 + 1)
        outs = eng.generate(prompts, max_tokens)
        assert all(1 <= len(o) <= k for o, k in zip(outs, max_tokens, strict=True))
        n += len(prompts)
        # Idle: nothing running, every token slot free or cached, the pools as built.
        assert eng.num_running == 0 and not eng.has_unfinished()
        assert eng.num_free_slots + eng.num_cached_slots == eng.capacity
        assert state_bytes() == m.pool_bytes
        live.append(_live_bytes())
    # JAX's own count: after the first calls (compiled steps, their constants), an idle
    # engine holds what it held then, whatever ran in between.
    assert max(live[3:]) <= live[2], live
    # What the steps compiled along the way need beside the pools, as XLA reports it.
    assert m.working_bytes > 0 and m.serving_bytes == m.pool_bytes + m.param_bytes + m.working_bytes
    s = eng.stats
    assert s.requests == n and s.ttft_count == n and len(s.ttft) == min(n, TTFT_WINDOW)
    assert abs(s.mean_ttft - s.ttft_sum / n) < 1e-9
    assert s.cached_tokens > 0 and s.state_evictions + s.token_evictions > 0
    # Per-bucket figures are bounded by the buckets, not by the requests.
    assert len(s.compiled_buckets) == len(s.bucket_compile_seconds) <= len(s.buckets) < 64


def test_the_automatic_sizer_reserves_the_largest_steps_working_memory(monkeypatch):
    """A budget that binds: the sizer compiles the largest prefill step first and takes its
    temporaries out of the budget, so pools, parameters and working memory fit in it, and no
    step the engine compiles afterwards (prefill and decode buckets of every size) needs
    more."""
    import hybridattn.engine._core as C
    import hybridattn.engine.sizing as E

    kw = dict(max_running_requests=4, max_context_len=96, decode_steps=4, mem_fraction=0.5,
              chunked_prefill_size=64, prefix_cache=False)
    with monkeypatch.context() as m:  # a roomy budget reserves nothing unless asked to
        assert Engine(CFG, PARAMS, **kw).memory.working_bytes == 0
        m.setattr(C, "RESERVE_ABOVE", 0.0)
        roomy = Engine(CFG, PARAMS, **kw).memory  # every request at full context fits
    assert roomy.num_token_slots == 4 * 96 + 1 and roomy.working_bytes > 0
    # a budget that holds the parameters, the tables, the states, the working memory and
    # 200 token slots
    unit = roomy.mla_bytes_per_token
    budget = (roomy.param_bytes + roomy.working_bytes + roomy.req_to_token_bytes
              + 5 * roomy.state_bytes_per_request + 200 * unit)
    monkeypatch.setattr(E, "available_memory_bytes", lambda: 2 * budget)
    eng = Engine(CFG, PARAMS, **kw)
    m = eng.memory
    reserved = m.working_bytes
    assert reserved == roomy.working_bytes and m.budget_bytes == budget
    assert m.num_token_slots == 201 and eng.capacity == 200 and m.max_running_requests == 2
    assert m.serving_bytes <= m.budget_bytes
    # without the reservation the same budget would have given every request its context
    unreserved = pool_sizes(eng.core.opts, CFG, m.param_bytes, available=2 * budget)
    assert unreserved.num_token_slots == 4 * 96 + 1
    outs = eng.generate([[3] * 90, [4] * 5, [5] * 40, [6] * 64], [6, 30, 20, 9])
    assert [len(o) for o in outs] == [6, 30, 20, 9]
    assert eng.stats.num_compilations >= 3 and m.working_bytes == reserved
    assert f"{reserved / (1 << 20):.1f} MiB" in str(m)
