"""mlxcache engine and caches against mlx-lm's own generation, on tiny random models.

Every model is built with mlx-lm's classes (float32, fixed seed). The reference is mlx-lm's
``generate_step`` with a fresh ``make_prompt_cache`` per request: no reuse, no batching. The
property tests draw shared-prefix workloads with ``mlxcache.testing.shared_prefix_batches``.
"""

from __future__ import annotations

import io
import json
import random
import warnings
from contextlib import redirect_stdout

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import llama, mamba, qwen3  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from mlxcache.cache import RaggedKVCache  # noqa: E402
from mlxcache.engine import Engine, ReuseDisabledWarning  # noqa: E402
from mlxcache.pool import init_pool, set_kv_all_layers  # noqa: E402
from mlxcache.testing import ref_longest_prefix, shared_prefix_batches  # noqa: E402

pytestmark = pytest.mark.mlx

VOCAB = 128


def _build(module, **args):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(**args))
    mx.eval(model.parameters())
    return model


LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
)
QWEN3 = dict(
    model_type="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
GQA = {**LLAMA, "num_key_value_heads": 1, "tie_word_embeddings": False}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gqa"])
def model(request):
    return {
        "llama": lambda: _build(llama, **LLAMA),
        "qwen3": lambda: _build(qwen3, **QWEN3),
        "gqa": lambda: _build(llama, **GQA),
    }[request.param]()


@pytest.fixture(scope="module")
def llama_model():
    return _build(llama, **LLAMA)


def reference(model, prompt, max_tokens):
    """mlx-lm's greedy generation, fresh cache, no reuse."""
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


_REFERENCE: dict[tuple, list[int]] = {}


def cached_reference(model, prompt, max_tokens):
    """``reference``, remembered: hypothesis draws the same prompts again and again."""
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference(model, prompt, max_tokens)
    return _REFERENCE[key]


def tokens(rng, n):
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def assert_intact(engine):
    """Every slot is free or in the tree exactly once; nothing is locked between calls."""
    tree = engine.tree
    assert tree.protected_size == 0
    assert engine.num_free_slots + tree.total_size == engine.num_slots - 1


# ------------------------------------------------------------------------------ caches ----


def test_batched_prefill_from_pool_matches_full_prefill(model):
    """Rows seeded from the pool (ragged prefixes) + right-padded new tokens, one forward ==
    each whole prompt through mlx-lm's KVCache."""
    rng = random.Random(0)
    n_layers, heads = len(model.layers), model.layers[0].self_attn.n_kv_heads
    head_dim = model.layers[0].self_attn.k_proj.weight.shape[0] // heads
    prompts = [tokens(rng, 12), tokens(rng, 7), tokens(rng, 9)]
    cached = [8, 0, 6]  # tokens each request finds in the pool
    pool = init_pool(n_layers, 64, heads, head_dim, dtype=mx.float32)
    want, prefixes, next_slot = [], [], 1
    for p, c in zip(prompts, cached, strict=True):
        full = [KVCache() for _ in range(n_layers)]
        want.append(model(mx.array([p]), cache=full)[0, -1])
        slots = list(range(next_slot, next_slot + c))
        next_slot += c
        if c:
            pool = set_kv_all_layers(
                pool,
                mx.array(slots),
                [f.keys[:, :, :c] for f in full],
                [f.values[:, :, :c] for f in full],
            )
        prefixes.append(slots)
    caches = [RaggedKVCache.from_pool(pool, layer, prefixes) for layer in range(n_layers)]
    assert caches[0].offset.tolist() == cached
    todo = [p[c:] for p, c in zip(prompts, cached, strict=True)]
    widest = max(map(len, todo))
    out = model(mx.array([t + [0] * (widest - len(t)) for t in todo]), cache=caches)
    for i, t in enumerate(todo):
        assert mx.allclose(out[i, len(t) - 1], want[i], atol=1e-4).item(), i
    for c in caches:
        c.truncate([len(p) for p in prompts])
    assert caches[0].row(1, 0)[0].shape == (1, heads, 7, head_dim)


def test_batched_decode_cache_matches_per_request_kvcache(model):
    """Ragged rows, one forward, joins and leaves mid-way == each request with its KVCache."""
    rng = random.Random(1)
    n_layers = len(model.layers)
    prompts = [tokens(rng, n) for n in (3, 9, 5, 1)]
    solo = []
    for p in prompts:
        c = [KVCache() for _ in range(n_layers)]
        model(mx.array([p]), cache=c)
        solo.append(c)
    batch = [RaggedKVCache() for _ in range(n_layers)]

    def join(i):
        for b, c in zip(batch, solo[i], strict=True):
            b.add_row(c.keys[:, :, : c.offset], c.values[:, :, : c.offset])

    rows = [0, 1, 2]
    for i in rows:
        join(i)
    for step in range(6):
        if step == 2:  # request 1 leaves: the last row moves into its place
            for b in batch:
                b.remove_row(1)
            rows = [0, 2]
        if step == 3:  # request 3 joins
            join(3)
            rows.append(3)
        feed = [rng.randrange(VOCAB) for _ in rows]
        got = model(mx.array([[t] for t in feed]), cache=batch)[:, -1]
        for r, (i, t) in enumerate(zip(rows, feed, strict=True)):
            want = model(mx.array([[t]]), cache=solo[i])[:, -1]
            assert mx.allclose(got[r : r + 1], want, atol=1e-4).item(), (step, i)
    assert batch[0].lengths == [solo[i][0].offset for i in rows]


# ------------------------------------------------------------------------ equivalence ----


def test_cold_repeat_and_shared_prefix_match_mlx_lm(model):
    rng = random.Random(2)
    engine = Engine(model, num_slots=1024)
    prefix = tokens(rng, 20)
    a, b = prefix + tokens(rng, 5), prefix + tokens(rng, 7)

    assert engine.generate([a], max_tokens=8) == [reference(model, a, 8)]  # cold
    assert engine.stats.cached_tokens == 0
    assert engine.generate([a], max_tokens=8) == [reference(model, a, 8)]  # full hit
    assert engine.stats.cached_tokens == len(a) - 1  # only the last token is recomputed
    before = engine.stats.cached_tokens
    assert engine.generate([b], max_tokens=8) == [reference(model, b, 8)]  # shared prefix
    assert engine.stats.cached_tokens - before >= len(prefix)
    assert_intact(engine)


def test_concurrent_requests_share_a_prefix(model):
    rng = random.Random(3)
    engine = Engine(model, num_slots=1024, max_batch_size=4)
    prefix = tokens(rng, 24)
    prompts = [prefix + tokens(rng, n) for n in (1, 4, 9, 2, 6, 3)] + [prefix]
    max_tokens = [5, 9, 3, 7, 1, 6, 4]
    out = engine.generate(prompts, max_tokens=max_tokens)
    assert out == [reference(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    # every request after the first found the prefix the first one inserted
    assert engine.stats.cached_tokens >= (len(prompts) - 1) * (len(prefix) - 1)
    assert_intact(engine)


def test_follow_up_turn_reuses_the_answer(llama_model):
    rng = random.Random(4)
    engine = Engine(llama_model, num_slots=512)
    first = tokens(rng, 10)
    (answer,) = engine.generate([first], max_tokens=6)
    turn = first + answer + tokens(rng, 3)
    before = engine.stats.cached_tokens
    assert engine.generate([turn], max_tokens=5) == [reference(llama_model, turn, 5)]
    # all of the prompt and the answer were cached (the answer's last token ran in the
    # decode step that emitted it)
    assert engine.stats.cached_tokens - before == len(first) + len(answer)


def test_eviction_under_pressure_keeps_outputs_exact(model):
    rng = random.Random(5)
    # 3 concurrent requests of 30 tokens cannot all fit 69 usable slots: the third waits for
    # a running one to finish; the running ones' prefixes are locked and never evicted.
    engine = Engine(model, num_slots=70, max_batch_size=3)
    prompts = [tokens(rng, 30) for _ in range(5)]
    out = engine.generate(prompts, max_tokens=4)
    assert out == [reference(model, p, 4) for p in prompts]
    assert engine.stats.token_evictions > 0
    assert_intact(engine)
    again = engine.generate(prompts[::-1], max_tokens=4)  # mixes hits with evicted prefixes
    assert again == out[::-1]
    assert_intact(engine)


def test_page_size_reuses_whole_pages(llama_model):
    rng = random.Random(6)
    engine = Engine(llama_model, num_slots=512, page_size=4)
    prefix = tokens(rng, 10)
    prompts = [prefix + tokens(rng, 3), prefix + tokens(rng, 5)]
    assert engine.generate(prompts, max_tokens=5) == [reference(llama_model, p, 5) for p in prompts]
    assert engine.stats.cached_tokens == 8  # two whole pages of the 10-token prefix
    assert engine.tree.total_size % 4 == 0
    assert_intact(engine)


def test_long_prompts_prefill_in_chunks(llama_model):
    """Prompts longer than prefill_step_size run alone, in chunks; short ones batch."""
    rng = random.Random(13)
    engine = Engine(llama_model, num_slots=512, prefill_step_size=8)
    prefix = tokens(rng, 19)
    prompts = [prefix + tokens(rng, 2), tokens(rng, 3), prefix + tokens(rng, 4), tokens(rng, 2)]
    assert engine.generate(prompts, max_tokens=4) == [reference(llama_model, p, 4) for p in prompts]
    s = engine.stats
    assert s.prompt_tokens == s.cached_tokens + s.prefill_tokens
    assert s.cached_tokens >= len(prefix) and 0 < s.hit_rate < 1
    assert s.decode_tokens == 3 * len(prompts) and s.decode_tok_s > 0
    assert len(s.ttft) == s.requests == len(prompts) and s.mean_ttft > 0
    assert s.effective_prefill_tok_s > s.prefill_tok_s > 0
    assert_intact(engine)


def test_shortest_uncached_first_and_prefill_first(llama_model):
    """Admission takes the fewest uncached tokens first and keeps prefilling while requests
    wait: with the prefix cached, three short follow-ups get their first tokens before a long
    cold prompt that arrived first, and every request's first token comes before any second
    token. Outputs stay mlx-lm's."""
    rng = random.Random(21)
    engine = Engine(llama_model, num_slots=512, prefill_batch_tokens=8)
    prefix = tokens(rng, 24)
    engine.generate([prefix], max_tokens=1)
    long_cold = tokens(rng, 40)
    prompts = [long_cold] + [prefix + tokens(rng, 2) for _ in range(3)]
    events = list(engine.stream(prompts, max_tokens=3))
    firsts = []
    for i, _ in events:
        if i not in firsts:
            firsts.append(i)
    assert firsts == [1, 2, 3, 0]  # the short ones (3 uncached tokens each) first, in order
    assert {i for i, _ in events[:4]} == {0, 1, 2, 3}  # no decode before every first token
    out = [[t for i, t in events if i == k] for k in range(4)]
    assert out == [reference(llama_model, p, 3) for p in prompts]
    assert_intact(engine)


def test_cpu_prefill_batches_are_sized_for_the_mean_ttft(llama_model, monkeypatch):
    """On MLX's CPU device (no cap given) a prefill batch takes round(sqrt(cost * N / mean
    uncached)) of the N waiting: many short suffixes in a few batches, cold prompts alone;
    an explicit ``prefill_batch_tokens`` is only a cap. Outputs stay mlx-lm's."""
    import mlxcache.engine as eng
    from mlxcache.engine._core import Core

    rng = random.Random(23)
    sizes: list[int] = []
    prefill = Core._prefill
    monkeypatch.setattr(Core, "_prefill",
                        lambda self, reqs: sizes.append(len(reqs)) or prefill(self, reqs))
    engine = Engine(llama_model, num_slots=1024)
    assert engine.core.admission.forward_cost == eng.CPU_FORWARD_COST_TOKENS == 28  # on CPU
    prefix = tokens(rng, 24)
    engine.generate([prefix], max_tokens=1)
    sizes.clear()
    short = [prefix + tokens(rng, 2) for _ in range(16)]  # 2 uncached tokens each
    assert engine.generate(short, max_tokens=2) == [reference(llama_model, p, 2) for p in short]
    assert sizes == [15, 1]  # round(sqrt(28 * 16 / 2)) = 15, then the one left
    sizes.clear()
    cold = [tokens(rng, 60) for _ in range(4)]
    engine.generate(cold, max_tokens=1)
    assert sizes == [1, 1, 1, 1]  # round(sqrt(28 * 4 / 60)) = 1
    sizes.clear()
    capped = Engine(llama_model, num_slots=1024, prefill_batch_tokens=128)
    capped.generate([prefix], max_tokens=1)
    sizes.clear()
    capped.generate(short, max_tokens=1)
    assert sizes == [16]  # a cap alone: all 16 fit 128 tokens
    assert_intact(engine)


def test_a_long_request_is_not_overtaken_forever(llama_model, monkeypatch):
    """A waiting request overtaken MAX_OVERTAKEN times by shorter ones goes next."""
    from mlxcache.engine import _admission as admission

    monkeypatch.setattr(admission, "MAX_OVERTAKEN", 2)
    rng = random.Random(22)
    engine = Engine(llama_model, num_slots=512, prefill_batch_tokens=1)
    prompts = [tokens(rng, 30)] + [tokens(rng, 2) for _ in range(6)]
    firsts = []
    for i, _ in engine.stream(prompts, max_tokens=1):
        firsts.append(i)
    assert firsts.index(0) == 2  # overtaken by two, then admitted
    assert_intact(engine)


# Shared-prefix workloads drawn as trees (common root, branches, duplicates, prompts that are
# prefixes of others, any arrival order). Lengths and branch points are multiples of 2: a page
# of 2 then holds whole prompts, and the model sees fewer distinct input shapes.
WORKLOADS = shared_prefix_batches(vocab_size=VOCAB, max_size=6, max_len=24, length_multiple=2)


@settings(max_examples=8)
@given(prompts=WORKLOADS, num_slots=st.sampled_from([28, 1024]), page_size=st.sampled_from([1, 2]))
def test_shared_prefix_workloads_match_mlx_lm(llama_model, prompts, num_slots, page_size):
    """Concurrent, with a pool small enough to evict and make requests wait (27 usable slots,
    3 running requests of up to 24 + 3 tokens; two thirds of such workloads evict) or large
    enough for none of that."""
    engine = Engine(llama_model, num_slots=num_slots, max_batch_size=3, page_size=page_size)
    out = engine.generate(prompts, max_tokens=3)
    assert out == [cached_reference(llama_model, p, 3) for p in prompts]
    s = engine.stats
    assert s.prompt_tokens == s.cached_tokens + s.prefill_tokens == sum(map(len, prompts))
    assert_intact(engine)


@settings(max_examples=6)
@given(prompts=WORKLOADS, page_size=st.sampled_from([1, 2]))
def test_each_prompt_reuses_its_longest_cached_prefix(llama_model, prompts, page_size):
    """One prompt at a time, nothing evicted: a prompt reuses exactly the longest prefix it
    shares with an earlier prompt or prompt + answer (whole pages; a full hit recomputes its
    last token, whose logits it needs)."""
    engine = Engine(llama_model, num_slots=1024, page_size=page_size)
    cached: list[list[int]] = []  # what the tree holds: prompts, and prompts + answers
    for p in prompts:
        before = engine.stats.cached_tokens
        (out,) = engine.generate([p], max_tokens=2)
        assert out == cached_reference(llama_model, p, 2)
        want = min(len(p) - 1, ref_longest_prefix(cached, p, page_size))
        assert engine.stats.cached_tokens - before == want
        cached += [p, p + out]  # the answer's last token ran in the step that emitted it
    assert engine.stats.token_evictions == 0
    assert_intact(engine)


def test_reuse_disabled_is_exact(llama_model):
    rng = random.Random(7)
    engine = Engine(llama_model, prefix_cache=False)
    prompts = [tokens(rng, n) for n in (5, 11, 2)]
    assert engine.generate(prompts, max_tokens=6) == [reference(llama_model, p, 6) for p in prompts]
    assert engine.tree is None and engine.stats.cached_tokens == 0


# ----------------------------------------------------------------- unsupported caches ----


def _qwen3_next():
    from mlxcache import zoo

    return zoo.make("qwen3_next")


def _mamba():
    return _build(
        mamba,
        model_type="mamba",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )


def _sliding_llama():
    return _build(
        llama, **LLAMA, layer_types=["sliding_attention", "full_attention"], sliding_window=8
    )


@pytest.mark.parametrize("build", [_qwen3_next, _sliding_llama], ids=["qwen3_next", "sliding"])
def test_hybrid_and_sliding_window_models_are_served_with_reuse(build):
    """(tests/mlxcache/test_mlx_hybrid.py covers these families scenario by scenario.)"""
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseDisabledWarning)
        engine = Engine(model, num_slots=256, snapshot_interval=4)
    assert engine.reuse and engine.batched
    rng = random.Random(8)
    prefix = tokens(rng, 12)  # longer than the sliding window
    prompts = [prefix + [5], prefix + [5], prefix + [9, 3]]
    assert engine.generate(prompts, max_tokens=5) == [reference(model, p, 5) for p in prompts]
    assert engine.stats.cached_tokens > 0


def _llama4():
    from mlxcache import zoo

    return zoo.make("llama4")


@pytest.mark.parametrize(
    "build, why",
    [(_mamba, "no attention layer"), (_llama4, r"\['ChunkedKVCache'\] cannot be restored")],
    ids=["mamba", "chunked"],
)
def test_models_the_cache_cannot_hold_are_named_and_served_without_reuse(build, why):
    model = build()
    with pytest.warns(ReuseDisabledWarning, match=why):
        engine = Engine(model, num_slots=256)
    assert not engine.reuse
    rng = random.Random(8)
    prefix = tokens(rng, 12)
    prompts = [prefix + [5], prefix + [5], prefix + [9, 3]]
    assert engine.generate(prompts, max_tokens=5) == [reference(model, p, 5) for p in prompts]
    assert engine.stats.cached_tokens == 0


def test_rope_without_array_offsets_serves_one_request_per_forward():
    """DynamicNTKScalingRoPE cannot take per-row offsets: detected, still exact, still reused."""
    model = _build(
        llama, **LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=64
    )
    with pytest.warns(ReuseDisabledWarning, match="one request per forward"):
        engine = Engine(model, num_slots=256)
    assert engine.reuse and not engine.batched
    rng = random.Random(9)
    prefix = tokens(rng, 8)
    prompts = [prefix + [1], prefix + [2, 3, 4], tokens(rng, 3)]
    assert engine.generate(prompts, max_tokens=6) == [reference(model, p, 6) for p in prompts]
    assert engine.stats.cached_tokens >= len(prefix)


# ---------------------------------------------------------------------------- sampling ----


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llama_model):
    rng = random.Random(10)
    engine = Engine(llama_model, num_slots=512)
    p, q = tokens(rng, 6), tokens(rng, 9)
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=20)
    alone = engine.generate([p], seed=7, **kw)[0]
    together = engine.generate([q, p], seed=[3, 7], **kw)[1]
    assert alone == together
    assert engine.generate([p], seed=8, **kw)[0] != alone
    # top_k=1 is greedy whatever the temperature
    greedy = engine.generate([p], max_tokens=12, temperature=2.0, top_k=1, seed=0)[0]
    assert greedy == reference(llama_model, p, 12)


def test_stop_tokens_end_a_request(llama_model):
    rng = random.Random(11)
    engine = Engine(llama_model, num_slots=512)
    p = tokens(rng, 7)
    ref = reference(llama_model, p, 10)
    stop = ref[3]
    out = engine.generate([p], max_tokens=10, stop_token_ids=[stop])[0]
    assert out == ref[: ref.index(stop) + 1]
    assert_intact(engine)


# -------------------------------------------------------------------------- bad input ----


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], [3, VOCAB]], {}, f"prompt 1: token 1 is {VOCAB}, outside the vocabulary"),
        ([[1, -1]], {}, "token 1 is -1"),
        ([[1, 2]], {"max_tokens": 0}, r"max_tokens=0 must be an int in \[1, "),
        ([[1, 2], [3]], {"max_tokens": [2, 2.0]}, r"prompt 1: max_tokens=2.0 must be an int"),
        ([[1, 2]], {"temperature": -1.0}, r"temperature=-1.0 must be >= 0"),
        ([[1, 2]], {"top_p": 0.0}, r"top_p=0.0 must be in"),
        ([[1, 2], [3]], {"top_k": [0, 2**63]}, "prompt 1: top_k=9223372036854775808"),
        ([[1, 2]], {"seed": -1}, r"seed=-1 must be an int in \[0, 2147483647\]"),
        ([[1, 2]], {"temperature": None}, "temperature=None must be a number"),
        ([[1, 2]], {"stop_token_ids": "2"}, "stop_token_ids must be a list of token ids"),
        ([[1, 2]], {"stop_token_ids": [VOCAB]}, f"token 0 is {VOCAB}, outside the vocabulary"),
        ([[1, 2]], {"temperature": [0.0, 0.5]}, "temperature has 2 entries for 1 prompts"),
        ([list(range(1, 40))], {}, "39 tokens but the KV pool holds at most 31"),
        (["some text"], {}, "no tokenizer"),
        ([[1.5]], {}, r"token 0 is 1.5 \(float\), not an int"),
        ([1, 2, 3], {}, "flat list of token ids .* wrap one prompt in a list"),
        (None, {}, "prompts must be a non-empty list of prompts, got None"),
        ([], {}, "got an empty one"),
    ],
)
def test_bad_input_is_a_clear_error_and_leaves_the_cache_intact(
    llama_model, prompts, kwargs, match
):
    engine = Engine(llama_model, num_slots=32)
    engine.generate([[1, 2, 3, 4]], max_tokens=3)
    tree, free = engine.tree.pretty(), engine.num_free_slots
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, **kwargs)
    assert engine.tree.pretty() == tree and engine.num_free_slots == free
    assert engine.generate([[1, 2, 3, 4]], max_tokens=3) == [
        reference(llama_model, [1, 2, 3, 4], 3)
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"page_size": 0}, r"page_size=0 must be an int in \[1, "),
        ({"num_slots": 1}, r"num_slots=1 must be an int in \[2, "),
        ({"num_slots": 64.0}, "num_slots=64.0"),
        ({"max_batch_size": 0}, "max_batch_size=0"),
        ({"prefill_step_size": True}, "prefill_step_size=True"),
        ({"prefill_batch_tokens": 0}, "prefill_batch_tokens=0"),
        ({"mem_fraction": 1.5}, r"mem_fraction=1.5 must be in \(0, 1\]"),
        ({"mem_fraction": float("nan")}, "mem_fraction=nan must be a finite number"),
        ({"prefix_cache": "no"}, "prefix_cache='no' must be True or False"),
    ],
)
def test_bad_engine_arguments_are_named(llama_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(llama_model, **kwargs)


def test_abandoned_stream_releases_its_requests(llama_model):
    rng = random.Random(12)
    engine = Engine(llama_model, num_slots=256)
    prefix = tokens(rng, 16)
    prompts = [prefix + tokens(rng, 4) for _ in range(3)]
    events = engine.stream(prompts, max_tokens=8)
    for _ in range(5):  # some prefilled, some decoding, some waiting
        next(events)
    events.close()
    assert_intact(engine)
    assert engine.generate(prompts, max_tokens=8) == [reference(llama_model, p, 8) for p in prompts]
    assert_intact(engine)


# --------------------------------------------------------------------------------- CLI ----


def test_cli_loads_a_saved_checkpoint(tmp_path, llama_model):
    tokenizers = pytest.importorskip("tokenizers")
    from mlx_lm import generate as mlx_generate
    from mlx_lm import load

    from mlxcache.generate import main

    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), dict(tree_flatten(llama_model.parameters()))
    )
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "eos_token": "</s>",
            }
        )
    )

    model, tokenizer = load(str(tmp_path))
    want = mlx_generate(model, tokenizer, "w5 w6 w7 w8", max_tokens=8)
    out = io.StringIO()
    with redirect_stdout(out):
        main(["--model", str(tmp_path), "--prompt", "w5 w6 w7 w8", "--max-tokens", "8",
              "--num-slots", "256"])  # fmt: skip
    assert out.getvalue().strip() == want.strip()
    assert want.strip()


def test_pool_is_sized_from_memory_when_not_given(llama_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(llama_model, mem_fraction=0.001)
    assert 2 <= engine.num_slots <= 1 << 20


def test_automatic_pool_size_honours_a_cgroup_memory_limit(tmp_path, monkeypatch, llama_model):
    """A 64 MiB container on a host with 512 GiB available sizes its pool from the 64 MiB:
    a budget of half of it, a quarter of which is kept for the decode buffers."""
    from mlxcache.engine import sizing
    from servecore import memory

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemAvailable: {512 << 20} kB\n")
    (proc / "self" / "cgroup").write_text("0::/app\n")
    (cgroup / "app").mkdir(parents=True)
    (cgroup / "app" / "memory.max").write_text(str(64 << 20))
    (cgroup / "app" / "memory.current").write_text("0")
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(sizing, "memory_budget",
                        lambda: memory.memory_budget(proc, cgroup))
    engine = Engine(llama_model, mem_fraction=0.5)
    per_slot = 2 * 2 * 4 * 16 * 4  # K and V, 2 layers, 4 kv heads, head_dim 16, float32
    assert engine.memory.budget_bytes == 32 << 20
    assert engine.num_slots == (32 << 20) * 3 // 4 // per_slot
