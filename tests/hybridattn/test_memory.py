"""hybridattn over a long life: the device holds its pools and parameters alone, inside the
budget it reports, and the stats stay bounded.

The oracle apart from the engine's own report is JAX's list of the arrays alive in the
process (``jax.live_arrays``), sampled after every call of a long session of mixed requests.
"""

from __future__ import annotations

import random

import jax
from harness import engine

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
    while n < 300:
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
    s = eng.stats
    assert s.requests == n and s.ttft_count == n and len(s.ttft) == min(n, TTFT_WINDOW)
    assert abs(s.mean_ttft - s.ttft_sum / n) < 1e-9
    assert s.cached_tokens > 0 and s.state_evictions + s.token_evictions > 0
    # Per-bucket figures are bounded by the buckets, not by the requests.
    assert len(s.compiled_buckets) == len(s.bucket_compile_seconds) <= len(s.buckets) < 64
