"""mlxcache on hybrid and sliding-window mlx-lm models: prefix reuse and batching, exact.

Every model is a tiny random one built from mlx-lm's own classes (``mlxcache.zoo``); the
oracle is mlx-lm's greedy decoding with the model's own ``make_prompt_cache`` and no reuse
(``zoo.reference_generate``). Each scenario runs on a fresh engine with a small snapshot
grid (8 tokens) so grid, branch-point and finish snapshots all occur in 20-40 token prompts;
the sliding-window families have a window of 8, shorter than every prompt.
"""

from __future__ import annotations

import random
import warnings

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlxcache import zoo  # noqa: E402
from mlxcache.engine import Engine, ReuseDisabledWarning  # noqa: E402

pytestmark = pytest.mark.mlx

HYBRID = ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "kimi_linear", "falcon_h1"]
SLIDING = ["gemma3_text", "gpt_oss"]
FAMILIES = HYBRID + SLIDING
GRID = 8
MAX = 5

_MODELS: dict[str, object] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = zoo.make(family)
    return _MODELS[family]


def engine(family: str, **kw) -> Engine:
    opts = dict(num_slots=512, num_snapshots=48, snapshot_interval=GRID, max_batch_size=8)
    if kw.get("prefix_cache") is False:  # the pools' options would do nothing (refused)
        opts = dict(max_batch_size=8)
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseDisabledWarning)  # none for these families
        return Engine(model_of(family), **opts)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, zoo.VOCAB) for _ in range(n)]


def ref(family: str, prompt: list[int], max_tokens: int = MAX) -> list[int]:
    return zoo.reference_generate(model_of(family), prompt, max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_serves_with_reuse_and_batching(family):
    e = engine(family)
    assert e.reuse and e.batched, (e.reuse, e.batched)
    assert e.has_states == (family in HYBRID)


@pytest.mark.parametrize("family", FAMILIES)
def test_cold_and_full_hit(family):
    e = engine(family)
    p = tokens(1, 27)
    want = ref(family, p)
    assert e.generate([p], max_tokens=MAX) == [want]
    assert e.stats.cached_tokens == 0
    assert e.generate([p], max_tokens=MAX) == [want]  # a full hit: only the last token runs
    assert e.stats.cached_tokens == len(p) - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_off_grid_divergence_then_a_sibling_at_the_branch_point(family):
    e = engine(family)
    shared = tokens(2, 21)  # 21 is off the 8-token grid
    a, b, c = (shared + [100 + s] + tokens(s, 5) for s in (3, 4, 5))  # part at token 21
    for p in (a, b):
        assert e.generate([p], max_tokens=MAX) == [ref(family, p)]
    # b matched 21 tokens of K/V; a hybrid resumes from the grid state at 16 (and takes a
    # snapshot at the branch point, 21), a sliding-window model from all 21 tokens.
    before = e.stats.cached_tokens
    assert e.generate([c], max_tokens=MAX) == [ref(family, c)]
    assert e.stats.cached_tokens - before == 21  # the sibling starts at the branch point
    if family in HYBRID:
        assert e.stats.snapshots_taken > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turns_of_a_conversation(family):
    e = engine(family)
    turn, previous = tokens(6, 19), 0
    for k in range(3):
        want = ref(family, turn)
        before = e.stats.cached_tokens
        (out,) = e.generate([turn], max_tokens=MAX)
        assert out == want, k
        if k:  # the whole previous turn, its answer included, is reused
            assert e.stats.cached_tokens - before == previous
        previous = len(turn) + len(out)
        turn = turn + out + tokens(10 + k, 7)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("family", HYBRID)
def test_a_second_chat_turn_reuses_whole_pages_of_a_hybrid_model(family, page_size):
    """Pages of several tokens: the snapshots a hybrid model takes (the prompt's last token
    but one, the grid, the end of the answer) sit on the page boundary at or below where
    they were planned, so the next turn, matched page by page, resumes from the last whole
    page of prompt + answer, as an attention-only model does (a point off a page boundary
    moves down to one; it is not dropped). The tokens are mlx-lm's, served without reuse."""
    e = engine(family, page_size=page_size, snapshot_interval=256)  # no grid point in play
    turn, ran = tokens(40, 37), 0  # 36, the last token but one, is off the 16-token page
    for k in range(3):
        before = e.stats.cached_tokens
        (out,) = e.generate([turn], max_tokens=MAX + k)
        assert out == ref(family, turn, MAX + k), k
        if k:  # prompt + answer that ran, down to its last whole page
            assert e.stats.cached_tokens - before == ran - ran % page_size > 0, k
        ran = len(turn) + len(out) - 1  # the last token is sampled, never fed
        turn = turn + out + tokens(50 + k, 6)
    assert e.num_free_snapshots + e.tree.num_states == e.num_snapshots - 1  # none leaked


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_requests_sharing_a_prefix(family):
    e = engine(family)
    shared = tokens(7, 26)
    prompts = [shared + tokens(20 + i, 3 + i) for i in range(4)] + [tokens(30, 12)]
    assert e.generate(prompts, max_tokens=MAX) == [ref(family, p) for p in prompts]
    assert e.stats.hit_rate > 0
    assert e.tree.protected_size == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_after_state_and_kv_evictions(family):
    e = engine(family, num_slots=128, num_snapshots=24)
    prompts = [tokens(40 + i % 3, 18) + tokens(50 + i, 9) for i in range(9)]
    for p in prompts:
        assert e.generate([p], max_tokens=MAX) == [ref(family, p)]
    assert e.stats.token_evictions > 0
    if family in HYBRID:
        assert e.stats.state_evictions > 0
    assert e.stats.hit_rate > 0
    # nothing leaked: every slot is free or in the tree, every snapshot too
    assert e.num_free_slots + e.tree.total_size == e.num_slots - 1
    assert e.num_free_snapshots + e.tree.num_states == max(e.num_snapshots - 1, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_with_reuse_matches_serving_without(family):
    shared = tokens(8, 20)
    prompts = [shared + tokens(60 + i, 5) for i in range(3)]
    kw = dict(max_tokens=MAX, temperature=0.8, seed=[1, 2, 3])
    want = engine(family, prefix_cache=False).generate(prompts, **kw)
    e = engine(family)
    assert e.generate(prompts, **kw) == want
    assert e.generate(prompts, **kw) == want  # all hits now
    assert e.stats.hit_rate > 0.4


def test_a_long_session_stays_within_the_configured_memory():
    """Many sessions of many turns through a small pool: the pools never grow (they are fixed
    arrays), the tree never holds more than they have, and both evict to make room."""
    family = "qwen3_next"
    e = engine(family, num_slots=120, num_snapshots=10)
    budget = e.num_slots * e.core.store.pool.bytes_per_slot + e.num_snapshots * e.snapshot_bytes
    assert e.cache_bytes == budget
    for session in range(3):
        turn = tokens(70 + session, 15)
        for k in range(4):
            (out,) = e.generate([turn], max_tokens=MAX)
            if k == 3:
                assert out == ref(family, turn)
            assert e.cache_bytes == budget
            assert e.tree.total_size <= e.num_slots - 1
            assert e.tree.num_states <= e.num_snapshots - 1
            turn = turn + out + tokens(80 + 4 * session + k, 6)
    assert e.stats.token_evictions > 0 and e.stats.state_evictions > 0
    assert e.stats.hit_rate > 0.3


def test_snapshots_take_a_quarter_of_an_automatic_budget(monkeypatch):
    from mlxcache.engine import sizing

    monkeypatch.setattr(sizing, "_memory_budget", lambda: (64 << 20, "test"))
    e = Engine(model_of("qwen3_next"), mem_fraction=0.5)
    kv_bytes = e.num_slots * e.core.store.pool.bytes_per_slot
    snap_bytes = e.num_snapshots * e.snapshot_bytes
    assert kv_bytes + snap_bytes <= 32 << 20
    assert 0.2 < snap_bytes / (kv_bytes + snap_bytes) < 0.3


@pytest.mark.parametrize("family", SLIDING)
def test_a_sliding_layer_holds_only_its_window(family):
    """A restored or running request keeps the last window - 1 tokens of a sliding layer (and
    what it generates); full layers keep everything."""
    from mlxcache.layers import leaves

    e = engine(family)
    window = e.layout.windows[0]
    p = tokens(90, 37)
    e.generate([p], max_tokens=2)
    stream = e.stream([p + tokens(91, 4)], max_tokens=4)
    got = [next(stream)[1], next(stream)[1]]
    [group] = e.core.path.groups  # the one request's running batch
    caches = leaves(group.caches)
    ran = max(c.end(0) for c in caches)  # the prompt and the tokens decoded so far
    assert ran > len(p) + 4
    for leaf, c in zip(e.layout.leaves, caches, strict=True):
        assert c.end(0) == ran
        if leaf.kind == "window":
            assert c.lengths[0] <= window - 1 + e.page_size + (ran - len(p) - 4)
        else:
            assert c.lengths[0] == ran
    got += [t for _, t in stream]
    assert got == ref(family, p + tokens(91, 4), 4)
