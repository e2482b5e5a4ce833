"""mlxcache: every byte held for serving is inside the budget the engine reports.

A long session of mixed requests (long and short together, shared prefixes, several hundred
of them) samples ``engine.memory`` after every round and MLX's own count of the memory it
holds (``mx.get_active_memory``, an oracle apart from the engine's report) after every
call: the serving bytes never pass the budget, and an idle engine holds its pools alone.
"""

from __future__ import annotations

import random
import warnings

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlxcache import zoo  # noqa: E402
from mlxcache.engine import Engine, ReuseDisabledWarning, sizing  # noqa: E402
from mlxcache.engine.memory import MemoryReport  # noqa: E402
from mlxcache.engine.sizing import pool_sizes  # noqa: E402

pytestmark = pytest.mark.mlx


def _rounds(engine: Engine, budget_checks: list) -> None:
    """Check the report after every round of ``engine`` (wrapping its core)."""
    run_round = engine.core.run_round

    def checked(emit):
        out = run_round(emit)
        core = engine.core  # (engine.memory waits for the round: it is inside one)
        m = MemoryReport.of(core.store, core.path.groups, core.peak_working_bytes,
                            core.working)
        budget_checks.append(m.serving_bytes)
        assert m.serving_bytes <= m.budget_bytes, str(m)
        assert m.working_bytes <= m.working_budget_bytes, str(m)
        return out

    engine.core.run_round = checked


def _session(engine: Engine, n_requests: int, seed: int, long: tuple[int, int]) -> list[int]:
    """Serve ``n_requests`` in calls of 12 (a few long prompts among short ones, some
    sharing a prefix, replies of 1-12 tokens); MLX's active bytes when idle after each."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, zoo.VOCAB) for _ in range(48)]
    idle = []
    done = 0
    while done < n_requests:
        prompts = []
        for i in range(12):
            if i % 6 == 0:
                n = rng.randrange(*long)
            else:
                n = rng.randrange(2, 16)
            head = shared[: rng.randrange(0, 48)] if i % 3 == 1 else []
            prompts.append(head + [rng.randrange(1, zoo.VOCAB) for _ in range(n)])
        outs = engine.generate(prompts, max_tokens=[rng.randrange(1, 13) for _ in prompts])
        assert all(outs)
        done += len(prompts)
        m = engine.memory
        assert m.working_bytes == 0, str(m)  # idle: the pools alone
        assert m.serving_bytes == m.pool_bytes == engine.cache_bytes
        assert m.peak_serving_bytes <= m.budget_bytes, str(m)
        mx.synchronize()
        idle.append(mx.get_active_memory())
    return idle


@pytest.mark.parametrize("family, n_requests, long", [
    ("llama", 360, (200, 700)),
    ("qwen3_next", 240, (60, 300)),  # a hybrid: snapshots too
])
def test_a_long_mixed_session_stays_inside_the_budget_and_idles_at_the_pools(
        family, n_requests, long):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseDisabledWarning)
        engine = Engine(zoo.make(family), num_slots=2048, max_batch_size=8,
                        snapshot_interval=64)
    served: list[int] = []
    _rounds(engine, served)
    idle = _session(engine, n_requests, seed=7, long=long)
    m = engine.memory
    assert engine.stats.requests == n_requests and len(served) > n_requests // 8
    assert m.peak_working_bytes > 0 and max(served) > m.pool_bytes  # buffers were used
    # MLX's own count (parameters, pools and anything else alive): after the first calls,
    # an idle engine holds what it held then, whatever ran in between (measured: the same
    # byte count after every call, for both models).
    assert max(idle[2:]) - idle[1] <= m.pool_bytes // 16, idle
    s = engine.stats
    assert s.ttft_count == s.requests and len(s.ttft) == min(s.requests, len(s.ttft))
    assert abs(s.mean_ttft - s.ttft_sum / s.ttft_count) < 1e-12


def test_one_long_request_among_short_ones_takes_buffers_near_its_own_size():
    """One 960-token request among seven of 8 tokens: the decode buffers stay within 1.5x the
    live K/V (not 8 rows of 1024 tokens, 7x it) and are freed when the engine is idle."""
    engine = Engine(zoo.make_model(), num_slots=4096, max_batch_size=8)
    per_token = engine.memory.bytes_per_slot
    live = (960 + 16 + 7 * (8 + 16)) * per_token  # the rows at their longest
    peak = []
    _rounds(engine, peak)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 200) for _ in range(960)]]
    prompts += [[rng.randrange(1, 200) for _ in range(8)] for _ in range(7)]
    outs = engine.generate(prompts, max_tokens=16)
    m = engine.memory
    assert m.peak_working_bytes <= 1.5 * live, (m.peak_working_bytes, live)
    assert m.working_bytes == 0
    assert outs == [zoo.reference_generate(engine.model, p, 16) for p in prompts]


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_requests_of_very_different_lengths_decode_exactly_in_their_own_batches(family):
    """A 300-token prompt and short ones run in two batches at once (two length buckets):
    each request gets what mlx-lm alone gives it (recurrent and sliding layers too)."""
    model = zoo.make(family)
    engine = Engine(model, num_slots=1024, max_batch_size=8, snapshot_interval=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, zoo.VOCAB) for _ in range(n)] for n in (300, 5, 9, 290, 3)]
    groups = []
    run_round = engine.core.run_round
    engine.core.run_round = lambda emit: (groups.append(len(engine.core.path.groups)),
                                          run_round(emit))[1]
    outs = engine.generate(prompts, max_tokens=6)
    assert max(groups) == 2  # both batches were running together
    assert outs == [zoo.reference_generate(model, p, 6) for p in prompts]


def test_a_small_given_pool_holds_requests_back_rather_than_grow_past_its_budget():
    """With num_slots=64 the decode buffers may hold 64 token rows: eight requests that
    could each grow to 24 tokens (32 rows of capacity) run two at a time, not all at once."""
    engine = Engine(zoo.make_model(), num_slots=64, max_batch_size=8)
    served: list[int] = []
    _rounds(engine, served)
    prompts = [[i + 1] * 8 for i in range(8)]
    outs = engine.generate(prompts, max_tokens=16)
    alone = Engine(zoo.make_model(), num_slots=64).generate(prompts, max_tokens=16)
    assert outs == alone
    m = engine.memory
    assert m.working_budget_bytes == 64 * m.bytes_per_slot
    assert m.peak_working_bytes <= m.working_budget_bytes and m.working_bytes == 0


@pytest.mark.parametrize("budget", [1 << 20, 8 << 20, 64 << 20, 1 << 30])
@pytest.mark.parametrize("per_slot, per_snapshot, states", [
    (1024, 0, False), (256, 16384, True), (4096, 1 << 20, True)])
def test_the_automatic_sizer_never_passes_its_budget(monkeypatch, budget, per_slot,
                                                       per_snapshot, states):
    monkeypatch.setattr(sizing, "_memory_budget", lambda: (budget, "test"))
    try:
        s = pool_sizes(per_slot=per_slot, per_snapshot=per_snapshot, num_slots=None,
                       num_snapshots=None, mem_fraction=0.5, has_states=states)
    except ValueError as e:  # too small for a useful cache: said, with the numbers
        assert "mem_fraction=0.5" in str(e) and f"budget of {budget // 2} B" in str(e)
        pools = budget // 2 - budget // 2 // sizing.WORKING_SHARE
        assert pools < sizing.MIN_AUTO_SLOTS * per_slot + (
            sizing.MIN_AUTO_SNAPSHOTS * per_snapshot if states else 0)
        return
    held = s.num_slots * per_slot + s.num_snapshots * per_snapshot + s.working_bytes
    assert held <= s.budget_bytes == budget // 2
    assert s.num_slots >= sizing.MIN_AUTO_SLOTS
    assert not states or s.num_snapshots >= sizing.MIN_AUTO_SNAPSHOTS


def test_a_hybrid_model_on_a_tiny_automatic_budget_is_an_error_naming_it(monkeypatch):
    """An automatic budget too small for the minimum of snapshots is an error naming it (it
    does not grow past the budget to fit them); a large enough one holds pools and buffers
    within it."""
    monkeypatch.setattr(sizing, "_memory_budget", lambda: (64 << 10, "test memory"))
    with pytest.raises(ValueError, match=r"mem_fraction=0.5 of the test memory \(65536 B\) "
                                         r"is a budget of 32768 B.*num_slots"):
        Engine(zoo.make("qwen3_next"), mem_fraction=0.5)
    monkeypatch.setattr(sizing, "_memory_budget", lambda: (64 << 20, "test memory"))
    m = Engine(zoo.make("qwen3_next"), mem_fraction=0.5).memory
    assert m.budget_bytes == 32 << 20
    assert m.pool_bytes + m.working_budget_bytes <= m.budget_bytes
    assert m.num_snapshots >= sizing.MIN_AUTO_SNAPSHOTS
    assert "budget (auto: 0.5 x test memory" in str(m)


def test_without_reuse_the_budget_is_the_decode_buffers_alone(monkeypatch):
    """No pools: mem_fraction of the memory is the decode buffers' budget (here 48 KiB, for
    rows of 1 KiB a token: eight 24-token requests, 32 rows of capacity each, fit one at a
    time), and a model on mlx-lm's own caches reports that it has none."""
    monkeypatch.setattr(sizing, "_memory_budget", lambda: (96 << 10, "test memory"))
    engine = Engine(zoo.make_model(), prefix_cache=False, max_batch_size=8, mem_fraction=0.5)
    served: list[int] = []
    _rounds(engine, served)
    prompts = [[i + 1] * 8 for i in range(8)]
    assert engine.generate(prompts, max_tokens=16) == [
        zoo.reference_generate(engine.model, p, 16) for p in prompts]
    m = engine.memory
    assert (m.budget_bytes, m.working_budget_bytes, m.pool_bytes) == (48 << 10, 48 << 10, 0)
    assert 0 < m.peak_working_bytes <= m.budget_bytes and m.working_bytes == 0
    assert str(m).startswith("serving 0 B of a 48.0 KiB budget (no reuse: 0.5 x test memory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReuseDisabledWarning)
        plain = Engine(zoo.make("llama4"), num_slots=64)
    assert plain.generate([[1, 2, 3]], max_tokens=2) and plain.memory.budget_bytes == 0
