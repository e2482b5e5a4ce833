"""mlxcache under bad, unusual and concurrent use of its public API.

Each section is one class of defect found by randomized adversarial use, tested at its cause
rather than by the one example that showed it. The oracle is always a *fresh* ``Engine``
serving the same prompt alone (and, for greedy decoding, mlx-lm's own loop,
``tests.harness.mlx_greedy``): whatever else shares the engine, a request's tokens must be
exactly those.

The models are tiny random mlx-lm models with untied embeddings (a tied one mostly repeats its
last input token, which would hide a wrong position or a lost prefix). Hypothesis drives the
interleavings: random programs of ``stream`` (opened, advanced some steps, interleaved with
others), ``generate``, early closes, dropped streams and ``reset_cache`` calls against a pool
tight enough to evict, and the same programs with a fault injected at the n-th call of the
model or of one of the engine's host operations.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import mlx.nn as nn  # noqa: E402
from mlx_lm.models import llama, mamba  # noqa: E402

import mlxcache.engine._core as runner_module  # noqa: E402
import mlxcache.engine._store as store_module  # noqa: E402
from mlxcache import zoo  # noqa: E402
from mlxcache.cache import RaggedArraysCache, RaggedKVCache  # noqa: E402
from mlxcache.engine import Engine, UnusedOptionWarning  # noqa: E402
from mlxcache.pool import PoolExhausted, get_kv, init_pool, set_kv  # noqa: E402
from mlxcache.radix import RadixCache  # noqa: E402
from mlxcache.sampling import SamplingParams, _filter_top_p, sample  # noqa: E402
from tests.harness import mlx_greedy  # noqa: E402

pytestmark = pytest.mark.mlx

VOCAB = 64
LLAMA = dict(
    model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB,
    tie_word_embeddings=False,
)  # fmt: skip


def _build(module, **args):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(**args))
    mx.eval(model.parameters())
    return model


MODELS = {
    # batched decode with prefix reuse: the main path
    "llama": lambda: _build(llama, **LLAMA),
    # RoPE that rejects per-row offsets: reuse, one request per forward (a group each)
    "ntk": lambda: _build(
        llama, **LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0},
        max_position_embeddings=64,
    ),
    # hybrid: KV pool and state snapshots (zoo models: vocabulary 128, prompts use < 64)
    "hybrid": lambda: zoo.make("qwen3_next"),
    # hybrid whose SSM takes no lengths: prefill forwards cut so no row is padded part-way
    "nemotron": lambda: zoo.make("nemotron_h"),
    # sliding window (8) shorter than prompt + answer
    "sliding": lambda: zoo.make("gemma3_text"),
    # no attention layer: no reuse
    "mamba": lambda: _build(
        mamba, model_type="mamba", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
        state_size=4, num_hidden_layers=1, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=2, tie_word_embeddings=False,
    ),
}  # fmt: skip
_BUILT: dict[str, nn.Module] = {}


def model_named(name: str) -> nn.Module:
    if name not in _BUILT:
        _BUILT[name] = MODELS[name]()
    return _BUILT[name]


@pytest.fixture(scope="module")
def model():
    return model_named("llama")


def make_engine(model, **kwargs) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReuseDisabledWarning for the ntk / mamba models
        return Engine(model, **kwargs)


GREEDY: tuple = ()
HOT: tuple = (("temperature", 0.9), ("top_k", 8), ("top_p", 0.95), ("seed", 5))
_FRESH: dict[tuple, list[int]] = {}


def fresh(model, prompt, max_tokens: int, params: tuple = GREEDY) -> list[int]:
    """What a fresh engine gives this prompt alone (remembered: programs repeat prompts)."""
    key = (id(model), tuple(prompt), max_tokens, params)
    if key not in _FRESH:
        engine = make_engine(model, num_slots=256)
        _FRESH[key] = engine.generate([list(prompt)], max_tokens=max_tokens, **dict(params))[0]
    return _FRESH[key]


def free_slots(engine) -> list[int]:
    return engine.core.store.slots.free_ids.tolist()


def assert_consistent(engine) -> None:
    """Between calls, whatever is open: every slot is free or in the tree, exactly once."""
    if engine.tree is None:
        return
    tree, free = engine.tree.all_slots(), free_slots(engine)
    assert len(tree) == len(set(tree)) == engine.tree.total_size, "a slot twice in the tree"
    assert not set(tree) & set(free), "a slot both free and in the tree"
    assert len(free) == len(set(free)) and 0 not in free
    assert engine.num_free_slots + engine.tree.total_size == engine.num_slots - 1, "leaked"
    if engine.has_states:  # held by the tree, or by a running job (its latest page's state)
        held = [h for _, h in engine.tree.all_states()] + [
            j.page_state[1] for j in engine.core.jobs.values() if j.page_state is not None]
        free = engine.core.store.state_slots.free_ids
        assert len(held) == len(set(held)) and not set(held) & set(free.tolist())
        assert len(held) + len(free) == engine.num_snapshots - 1, "a snapshot slot leaked"


def assert_intact(engine) -> None:
    """Everything closed: consistent, and no lock left."""
    assert_consistent(engine)
    if engine.tree is not None:
        assert engine.tree.protected_size == 0, "a lock outlived its request"


def tokens_of(events, index: int = 0) -> list[int]:
    return [t for i, t in events if i == index]


# --------------------------------------------------------------- tokenizers' EOS forms ----


class _Tokenizer:
    """EOS ids in one of their forms, and the encode / decode every tokenizer has (the
    engine refuses one without them), unused: the prompts here are ids."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def encode(self, text, add_special_tokens=True):
        raise AssertionError("not called: ids only")

    def decode(self, ids):
        raise AssertionError("not called: ids only")


@pytest.mark.parametrize("form", ["hf_int", "hf_list", "tf5_int", "mlx_set"])
def test_every_form_of_a_tokenizers_eos_ids_stops_generation(model, form):
    """Every form a tokenizer gives its EOS ids in (transformers 5 gives ``eos_token_ids``
    as an int) stops a generate without explicit stop ids at the first EOS."""
    prompt = [3, 14, 15, 9, 2]
    want = fresh(model, prompt, 8)
    eos = want[3]
    other = next(t for t in range(VOCAB) if t not in want)  # a second EOS id never sampled
    tokenizer = {
        "hf_int": _Tokenizer(eos_token_id=eos),
        "hf_list": _Tokenizer(eos_token_id=[other, eos]),
        "tf5_int": _Tokenizer(eos_token_ids=eos),
        "mlx_set": _Tokenizer(eos_token_ids={eos}),
    }[form]
    engine = Engine(model, tokenizer, num_slots=64)
    assert engine.generate([prompt], max_tokens=8) == [want[: want.index(eos) + 1]]
    assert engine.generate([prompt], max_tokens=8, stop_token_ids=[]) == [want]  # explicit
    one = want[1]  # one id, not a list
    assert engine.generate([prompt], max_tokens=8, stop_token_ids=one) == [
        want[: want.index(one) + 1]
    ]
    assert_intact(engine)


def test_a_tokenizer_whose_eos_ids_are_not_ids_is_refused_at_construction(model):
    with pytest.raises(ValueError, match=r"tokenizer.eos_token_ids='x'"):
        Engine(model, _Tokenizer(eos_token_ids="x"), num_slots=64)


# ------------------------------------------------------------------- reset_cache ----


@pytest.mark.parametrize("reset_after", [0, 1, 2, 3, 5])
def test_reset_while_a_stream_is_open_keeps_its_requests_exact(model, reset_after):
    """reset_cache under running requests keeps their locked nodes and their slots: the
    resumed stream gets a fresh engine's tokens and no slot is both free and in the tree."""
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 7, 6]]
    engine = Engine(model, num_slots=40, max_batch_size=2)
    engine.generate([[1, 2, 3, 4, 5, 6]], max_tokens=3)  # something cached to forget
    events = engine.stream(prompts, max_tokens=4)
    got = [next(events) for _ in range(reset_after)]
    engine.reset_cache()
    assert_consistent(engine)
    assert engine.tree.evictable_size == 0  # all that no running request holds is gone
    got += list(events)
    for i, p in enumerate(prompts):
        assert tokens_of(got, i) == fresh(model, p, 4) == mlx_greedy(model, p, 4)
    assert_intact(engine)
    assert engine.generate(prompts, max_tokens=4) == [fresh(model, p, 4) for p in prompts]


def test_reset_between_every_token_of_two_streams(model):
    engine = Engine(model, num_slots=24, max_batch_size=2)
    a, b = engine.stream([[5, 6, 7, 8]], max_tokens=5), engine.stream([[5, 6, 9]], max_tokens=5)
    got_a, got_b = [], []
    for _ in range(5):
        got_a.append(next(a)[1])
        engine.reset_cache()
        got_b.append(next(b)[1])
        engine.reset_cache()
        assert_consistent(engine)
    assert got_a == fresh(model, [5, 6, 7, 8], 5) and got_b == fresh(model, [5, 6, 9], 5)
    assert list(a) == list(b) == []
    engine.reset_cache()
    assert_intact(engine)
    assert engine.tree.total_size == 0 and engine.num_free_slots == 23


# ----------------------------------------------------------- the largest valid prompt ----


@pytest.mark.parametrize("page_size", [1, 3])
def test_the_largest_prompt_the_door_accepts_is_served_cold_and_cached(model, page_size):
    """A full hit allocates no slot for its last token (kept back for its logits) while the
    whole path is locked: ``num_slots - 1`` tokens are served cold, on a repeat and in a batch
    (every output kept)."""
    num_slots = 16
    big = [(7 * i) % (VOCAB - 1) + 1 for i in range(num_slots - 1)]
    twin = big[:-1] + [big[-1] % (VOCAB - 1) + 1]  # differs in the last token only
    want, want_twin = fresh(model, big, 3), fresh(model, twin, 3)
    assert want == mlx_greedy(model, big, 3)
    engine = Engine(model, num_slots=num_slots, page_size=page_size)
    assert engine.generate([big], max_tokens=3) == [want]  # cold
    before = engine.stats.cached_tokens
    assert engine.generate([big], max_tokens=3) == [want]  # full hit (or whole pages)
    assert engine.stats.cached_tokens - before == len(big) - 1  # 15 is whole pages of 3 too
    assert engine.generate([big, big], max_tokens=3) == [want, want]
    assert engine.generate([big, twin, big], max_tokens=3) == [want, want_twin, want]
    assert_intact(engine)


# -------------------------------------------------------------- sampling at the limits ----


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-30, 1e-7])
def test_tiny_temperatures_are_greedy(model, temperature):
    """Temperatures below ~1e-38 (where ``1 / temperature`` overflows float32) sample the
    greedy tokens."""
    engine = Engine(model, num_slots=64)
    for p in ([1, 2, 3], [9, 40, 2, 2]):
        assert engine.generate([p], max_tokens=6, temperature=temperature, seed=1) == [
            mlx_greedy(model, p, 6)
        ]


@settings(max_examples=30)
@given(
    temperature=st.floats(1e-6, 1e-3, allow_subnormal=False),
    top_p=st.one_of(st.just(2.0**-31), st.floats(1e-9, 1.0, allow_subnormal=False)),
    top_k=st.integers(0, 2**31 - 1),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_cold_sampled_row_picks_the_top_token_whatever_its_filters(
    temperature, top_p, top_k, seed
):
    """A non-greedy row never yields garbage: at a low temperature the top logit (by a
    margin of 0.5) wins over the noise, after any top-k and top-p filter."""
    logits = mx.array([[0.0, 1.0, 0.5, -3.0], [2.0, 0.0, 1.5, 0.0]])
    params = [SamplingParams(temperature, top_p, top_k, seed)] * 2
    assert not params[0].greedy or top_k == 1
    got = sample(logits, params, [mx.random.key(seed), mx.random.key(seed + 1)])
    assert got.tolist() == [1, 0]


def test_top_p_filter_keeps_the_top_token_when_top_p_rounds_to_zero():
    logits = mx.array([[0.0, 3.0, 1.0, 2.0]])
    for top_p in (0.0, 1e-46):  # 0 in float32: the kept count is still at least 1
        kept = _filter_top_p(logits, mx.array([top_p])).tolist()[0]
        assert kept == [-np.inf, 3.0, -np.inf, -np.inf]


def test_seeded_sampling_in_a_crowd_matches_a_fresh_engine(model):
    engine = Engine(model, num_slots=64, max_batch_size=4)
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3, 7]]
    hot = dict(HOT)
    got = engine.generate(prompts, max_tokens=6, **hot)
    assert got == [fresh(model, p, 6, HOT) for p in prompts]


# ------------------------------------------------------------------ values at the door ----


BAD_CALLS = [
    (dict(max_tokens=2**31), "max_tokens=2147483648"),
    (dict(max_tokens=1.0), "max_tokens=1.0"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(max_tokens=None), "max_tokens=None"),
    (dict(temperature=None), "temperature=None must be a number"),
    (dict(temperature="0.5"), "temperature='0.5'"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature=1e39), "temperature=1e\\+39"),
    (dict(temperature=-1e-9), "temperature=-1e-09"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(top_p=1.0000001), "top_p=1.0000001"),
    (dict(top_k=2**63), "top_k=9223372036854775808"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(top_k=1.5), "top_k=1.5"),
    (dict(seed=-1), "seed=-1"),
    (dict(seed=2**31), "seed=2147483648"),
    (dict(seed="1"), "seed='1'"),
    (dict(seed=[1, 2, 3]), "seed has 3 entries for 2 prompts"),
    (dict(stop_token_ids=2.0), "stop_token_ids must be a list of token ids, got 2.0"),
    (dict(stop_token_ids="2"), "got '2'"),
    (dict(stop_token_ids=[-1]), "token 0 is -1, outside"),
    (dict(stop_token_ids=[[1]]), "token 0 is \\[1\\] \\(list\\)"),
    (dict(prompts=[1, 2, 3]), "flat list of token ids"),
    (dict(prompts=np.array([1, 2, 3])), "1-D array"),
    (dict(prompts=None), "got None"),
    (dict(prompts=5), "got 5"),
    (dict(prompts=[]), "empty one"),
    (dict(prompts=[[1, 2], [True]]), "prompt 1: token 0 is True \\(bool\\)"),
    (dict(prompts=[[1, 2], np.array([1.5])]), "prompt 1 must be a 1-D array of int"),
    (dict(prompts=[[1, 2], mx.array([1.0])]), "prompt 1 must be a 1-D array of int"),
    (dict(prompts=[[1, 2], [[3]]]), "prompt 1: token 0 is \\[3\\]"),
    (dict(prompts=[[1, 2], b"ab"]), "prompt 1 must be a list of token ids"),
    (dict(prompts=[[1, 2], [VOCAB]]), f"prompt 1: token 0 is {VOCAB}, outside"),
    (dict(prompts=[[1, 2], "text"]), "prompt 1 is text but the engine has no tokenizer"),
]


@pytest.mark.parametrize("call, match", BAD_CALLS, ids=[m for _, m in BAD_CALLS])
@pytest.mark.parametrize("entry", ["generate", "stream"])
def test_a_bad_value_is_a_value_error_naming_it_and_changes_nothing(model, entry, call, match):
    """Never a bare TypeError, an OverflowError later on the device, or a silent coercion."""
    engine = Engine(model, num_slots=32)
    engine.generate([[1, 2, 3]], max_tokens=2)
    before = (engine.tree.pretty(), free_slots(engine), engine.stats.requests)
    kwargs = {"prompts": [[1, 2], [3, 4]], "max_tokens": 2, **call}
    with pytest.raises(ValueError, match=match):
        getattr(engine, entry)(**kwargs)  # stream checks at the call, before any next()
    assert (engine.tree.pretty(), free_slots(engine), engine.stats.requests) == before
    assert engine.generate([[1, 2, 3]], max_tokens=2) == [fresh(model, [1, 2, 3], 2)]


def test_numpy_and_mlx_values_are_accepted_where_they_are_exact(model):
    engine = Engine(model, num_slots=64)
    prompts = [np.array([1, 2, 3], dtype=np.int32), mx.array([4, 5]), (6, 7, 8), range(9, 12)]
    got = engine.generate(
        prompts, max_tokens=np.array([3, 2, 3, 2]), temperature=np.float32(0.0),
        top_k=np.int64(0), seed=np.int32(3), stop_token_ids=np.array([], dtype=np.int64),
    )  # fmt: skip
    lists = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11]]
    assert got == [fresh(model, p, n) for p, n in zip(lists, [3, 2, 3, 2], strict=True)]


def test_a_generator_of_prompts_is_read_once(model):
    engine = Engine(model, num_slots=64)
    reads = []

    def prompts():
        for p in ([1, 2, 3], [4, 5, 6]):
            reads.append(p)
            yield p

    assert engine.generate(prompts(), max_tokens=3) == [
        fresh(model, [1, 2, 3], 3), fresh(model, [4, 5, 6], 3)
    ]
    assert reads == [[1, 2, 3], [4, 5, 6]]
    assert [t for _, t in engine.stream((p for p in [[1, 2, 3]]), max_tokens=3)] == fresh(
        model, [1, 2, 3], 3
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_slots": 2**31}, "num_slots=2147483648"),
        ({"num_slots": np.float64(64)}, r"num_slots=np.float64\(64.0\) must be an int"),
        ({"page_size": -1}, "page_size=-1"),
        ({"max_batch_size": 2.5}, "max_batch_size=2.5"),
        ({"prefill_step_size": 0}, "prefill_step_size=0"),
        ({"mem_fraction": 0}, r"mem_fraction=0 must be in \(0, 1\]"),
        ({"mem_fraction": "0.5"}, "mem_fraction='0.5'"),
        ({"prefix_cache": 1}, "prefix_cache=1 must be True or False"),
        ({"page_size": 16, "num_slots": 16}, r"page_size=16 is larger than the longest prompt "
                                             r"the KV pool takes \(15 tokens: num_slots=16"),
        ({"page_size": 2**20}, r"page_size=1048576 is larger than the longest prompt"),
        # options of the pools, which prefix_cache=False has not
        ({"prefix_cache": False, "num_slots": 64}, "num_slots=64 does nothing with "
                                                   "prefix_cache=False"),
        ({"prefix_cache": False, "page_size": 4}, "page_size=4 does nothing with prefix_cache"),
        ({"prefix_cache": False, "num_snapshots": 8}, "num_snapshots=8 does nothing with"),
        ({"prefix_cache": False, "snapshot_interval": 8}, "snapshot_interval=8 does nothing"),
    ],
)
def test_bad_engine_options_are_named(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, **kwargs)


def test_the_defaults_build_with_the_prefix_cache_off_and_pages_that_fit(model):
    """Only options given are refused as inert: the defaults build in either mode, and a
    page as long as the longest prompt the pool takes is served, and cached."""
    assert Engine(model, prefix_cache=False).tree is None
    engine = Engine(model, num_slots=17, page_size=16)
    prompt = list(range(1, 17))
    assert engine.generate([prompt], max_tokens=1) == [mlx_greedy(model, prompt, 1)]
    assert engine.tree.total_size == 16


def test_an_option_the_model_ignores_is_a_warning_naming_it(model):
    """Snapshot options for a model without recurrent layers, or the pools' options for one
    served without reuse, do nothing: a warning names each (not an error: one set of options
    may serve many models); the defaults, and options a model uses, warn of nothing."""
    with pytest.warns(UnusedOptionWarning, match="snapshot_interval=8 does nothing: the model "
                                                 "has no recurrent layers"):
        Engine(model, num_slots=32, snapshot_interval=8)
    with pytest.warns(UnusedOptionWarning, match="num_slots=32 does nothing: the model is "
                                                 "served without prefix reuse"):
        Engine(model_named("mamba"), num_slots=32)  # its padding would change its state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(model, num_slots=32, page_size=2)
        Engine(model_named("hybrid"), num_slots=32, num_snapshots=4, snapshot_interval=8)


@pytest.mark.parametrize("tokenizer", ["path/to/tokenizer", object(), 3, {"encode": 1}])
def test_a_tokenizer_that_is_not_one_is_named_when_the_engine_is_built(model, tokenizer):
    """A path (or anything without encode and decode) is refused as the tokenizer when the
    engine is built, named in the error, not at the first text prompt."""
    with pytest.raises(TypeError, match=r"tokenizer=.* is not a tokenizer: give one with "
                                        r"encode and decode"):
        Engine(model, tokenizer, num_slots=32)


def test_a_model_that_is_not_a_model_is_named(model):
    with pytest.raises(ValueError, match="model must be an mlx-lm model .* got str: 'path/to"):
        Engine("path/to/model")


def test_radix_tree_takes_mlx_tokens_as_the_ints_they_hold():
    """mx.array tokens go in as the ints they hold (array scalars hash by identity and would
    never match)."""
    cache = RadixCache()
    assert cache.insert(mx.array([1, 2, 3]), mx.array([10, 11, 12])) == 0
    assert cache.match_prefix([1, 2, 3])[0] == [10, 11, 12]
    assert cache.match_prefix(mx.array([1, 2, 7], dtype=mx.uint32))[0] == [10, 11]
    with pytest.raises(ValueError, match="1-D array of int token ids.*float32"):
        cache.insert(mx.array([1.0, 2.0]), [1, 2])
    with pytest.raises(ValueError, match="not an array"):
        cache.match_prefix([1], extra_key=mx.array([1]))


def test_pool_functions_refuse_float_slots_and_take_numpy_ones():
    pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=2, dtype=mx.float32)
    kv = mx.ones((1, 1, 2))
    with pytest.raises(ValueError, match=r"slots\[0\]=1.9 must be an int slot id"):
        set_kv(pool, 0, [1.9], kv, kv)
    pool = set_kv(pool, 0, np.array([2]), kv, kv)
    assert get_kv(pool, 0, np.array([2, 1]))[0].tolist() == [[[1.0, 1.0]], [[0.0, 0.0]]]
    with pytest.raises(ValueError, match=r"prefixes\[1\]\[0\]=2.0"):
        RaggedKVCache.from_pool(pool, 0, [[1], [2.0]])


# ------------------------------------------------------------------------------ CLI ----


def _cli(argv, monkeypatch):
    from mlxcache import generate

    def no_load(path):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate, "load", no_load)
    with pytest.raises(SystemExit) as exc:
        generate.main(argv)
    return str(exc.value.code)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temp", "-1"], "--temp=-1.0 must be >= 0"),
        (["--temp", "nan"], "--temp=nan must be a finite number"),
        (["--top-p", "0"], r"--top-p=0.0 must be in \(0, 1\]"),
        (["--top-k", str(2**63)], "--top-k=9223372036854775808 must be an int"),
        (["--seed", "-1"], "--seed=-1 must be an int in"),
        (["--max-tokens", "0"], "--max-tokens=0 must be an int in"),
        (["--num-slots", "1"], "--num-slots=1 must be an int in"),
        (["--page-size", "0"], "--page-size=0"),
        (["--mem-fraction", "2"], r"--mem-fraction=2.0 must be in \(0, 1\]"),
        ([], "--model '/nonexistent' is not a directory"),
    ],
)
def test_cli_checks_its_flags_before_loading_and_says_so_in_one_line(flags, message,
                                                                     monkeypatch):
    text = _cli(["--model", "/nonexistent", "--prompt", "hi", *flags], monkeypatch)
    assert text.startswith("python -m mlxcache.generate: error: ")
    assert "\n" not in text
    assert re.search(message, text), text


def test_cli_reports_a_directory_that_does_not_load_in_one_line_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcache.generate", "--model", str(tmp_path), "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m mlxcache.generate: error: cannot load --model {str(tmp_path)!r}: "
        f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path / 'config.json'}'"
    ]


# ---------------------------------------------------------------- the engine contract ----


def test_two_streams_read_alternately_get_what_each_gets_alone(model):
    engine = Engine(model, num_slots=40, max_batch_size=2)
    a = engine.stream([[1, 2, 3, 4], [1, 2, 5]], max_tokens=5)
    b = engine.stream([[1, 2, 3, 4, 6]], max_tokens=4)
    got: dict[str, list] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            event = next(live[name], None)
            if event is None:
                del live[name]
            else:
                got[name].append(event)
    assert tokens_of(got["a"], 0) == fresh(model, [1, 2, 3, 4], 5)
    assert tokens_of(got["a"], 1) == fresh(model, [1, 2, 5], 5)
    assert tokens_of(got["b"], 0) == fresh(model, [1, 2, 3, 4, 6], 4)
    assert_intact(engine)


def test_generate_inside_a_loop_over_a_stream_on_a_pool_the_stream_fills(model):
    """The stream's running requests lock most of the pool; the inner generate advances them
    (instead of waiting on a reader that is waiting on it) and gets its tokens."""
    engine = Engine(model, num_slots=24, max_batch_size=2)
    outer = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    inner = [[20, 21, 22, 23, 24, 25, 26, 27, 28]]
    got, inner_got = [], []
    for event in engine.stream(outer, max_tokens=4):
        got.append(event)
        inner_got.append(engine.generate(inner, max_tokens=3))
        assert_consistent(engine)
    assert [tokens_of(got, i) for i in range(2)] == [fresh(model, p, 4) for p in outer]
    assert inner_got == [[fresh(model, inner[0], 3)]] * len(got)
    assert_intact(engine)


@pytest.mark.parametrize("close_after", [0, 1, 2, 4, 7, 11])
def test_a_stream_closed_at_any_point_releases_everything(model, close_after):
    engine = Engine(model, num_slots=30, max_batch_size=2)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [8, 9]]
    events = engine.stream(prompts, max_tokens=4)
    got = [e for _, e in zip(range(close_after), events, strict=False)]
    events.close()
    for i, p in enumerate(prompts):
        assert tokens_of(got, i) == fresh(model, p, 4)[: len(tokens_of(got, i))]
    assert_intact(engine)
    assert engine.generate(prompts, max_tokens=4) == [fresh(model, p, 4) for p in prompts]


def test_a_dropped_stream_is_released_and_a_kept_unread_one_still_finishes(model):
    engine = Engine(model, num_slots=40, max_batch_size=4)
    dropped = engine.stream([[1, 2, 3]], max_tokens=6)
    next(dropped)
    del dropped
    gc.collect()
    kept = engine.stream([[4, 5, 6]], max_tokens=3)
    first = next(kept)
    assert engine.generate([[7, 8]], max_tokens=6) == [fresh(model, [7, 8], 6)]
    assert engine.tree.protected_size == 0  # kept's request finished meanwhile
    assert [first, *kept] == [(0, t) for t in fresh(model, [4, 5, 6], 3)]
    assert_intact(engine)


def test_calls_from_four_threads_are_serialized_and_exact(model):
    """MLX ties an unscheduled array to the thread that built it: each call must hand the next
    one (maybe in another thread) only scheduled state. Four threads, each alternating
    generate and stream calls, one reading a stream opened in the main thread."""
    engine = Engine(model, num_slots=40, max_batch_size=3)
    jobs = [([1, 2, 3, 4], GREEDY), ([1, 2, 3, 9], HOT), ([5, 6], GREEDY), ([5, 6, 7, 8, 9], HOT)]
    opened = engine.stream([[1, 2, 3, 4, 5]], max_tokens=6)
    results: dict[tuple, Any] = {}

    def work(i):
        prompt, params = jobs[i]
        try:
            for round_ in range(3):
                if (i + round_) % 2:
                    got = engine.generate([prompt], max_tokens=5, **dict(params))[0]
                else:
                    got = [t for _, t in engine.stream([prompt], max_tokens=5, **dict(params))]
                results[i, round_] = got
            if i == 0:
                results["opened"] = [t for _, t in opened]
        except BaseException as e:  # noqa: BLE001 - compared below, with its message
            results[i, "error"] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    want = {(i, r): fresh(model, p, 5, params) for i, (p, params) in enumerate(jobs)
            for r in range(3)}
    want["opened"] = fresh(model, [1, 2, 3, 4, 5], 6)
    assert results == want
    assert_intact(engine)


def test_a_prefill_step_that_returns_early_leaves_its_arrays_scheduled(model):
    """Prefill first: a step that prefilled while a request still waits returns before it
    decodes. What it built must be scheduled too: the stream's reader got its first token
    from that step, in its thread, and the next call, in another thread, decodes on those
    arrays (unscheduled, MLX fails: "There is no Stream(cpu, N) in current thread")."""
    engine = Engine(model, num_slots=40, max_batch_size=3, prefill_batch_tokens=4)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    opened = engine.stream(prompts, max_tokens=3)  # two prefill batches of 4 tokens
    first: list = []
    reader = threading.Thread(target=lambda: first.append(next(opened)))
    reader.start()
    reader.join(timeout=120)
    assert first and first[0][0] == 0  # the first prompt's prefill ran; the second waits
    assert engine.generate([[9, 10]], max_tokens=3)[0] == fresh(model, [9, 10], 3)
    got: dict[int, list[int]] = {0: [], 1: []}
    for i, tok in first + list(opened):
        got[i].append(tok)
    assert got == {i: fresh(model, p, 3) for i, p in enumerate(prompts)}
    assert_intact(engine)


class _Reentrant(nn.Module):
    """A model that calls back into the engine from its forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.layers, self.args = inner, inner.layers, inner.args
        if hasattr(inner, "make_cache"):  # the model's own caches (hybrid, sliding window)
            self.make_cache = inner.make_cache
        self.engine = None

    def __call__(self, inputs, cache=None):
        if self.engine is not None:
            self.engine.generate([[1, 2]], max_tokens=1)
        return self.inner(inputs, cache=cache)


def test_a_call_from_inside_a_step_is_refused_and_leaves_the_engine_exact(model):
    wrapper = _Reentrant(model)
    engine = Engine(wrapper, num_slots=32)
    wrapper.engine = engine
    with pytest.raises(RuntimeError, match="called from inside one of its own steps"):
        engine.generate([[3, 4, 5]], max_tokens=3)
    wrapper.engine = None
    assert_intact(engine)
    assert engine.generate([[3, 4, 5]], max_tokens=3) == [fresh(model, [3, 4, 5], 3)]


# ------------------------------------------------------------ random programs ----------


PROMPTS = [
    [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3], [1, 2, 3, 4, 5, 6, 8, 9, 10],
    [1, 2, 11, 12, 13], [1, 2, 11, 12, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26], [20, 21],
    [30],
]  # fmt: skip
"""Two families of shared prefixes, prompts that are prefixes of others, a one-token prompt; at
most 9 tokens, so that 3 requests of prompt + answer overflow the tight pools (11-23 usable
slots) and force eviction and waiting."""

_request = st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 4), st.sampled_from(
    [GREEDY, GREEDY, HOT]))
_requests = st.lists(_request, min_size=1, max_size=3)
_op = st.one_of(
    st.tuples(st.just("open"), _requests),
    st.tuples(st.just("next"), st.integers(0, 7), st.integers(1, 4)),
    st.tuples(st.just("next"), st.integers(0, 7), st.just(99)),  # read it to its end
    st.tuples(st.just("close"), st.integers(0, 7)),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("generate"), _requests),
    st.tuples(st.just("reset"),),
)
PROGRAMS = st.lists(_op, min_size=3, max_size=16)
HYBRID_SETUP = dict(model="hybrid", num_slots=20, max_batch_size=3, page_size=1,
                    prefill_step_size=8, num_snapshots=6, snapshot_interval=2)
SETUPS = st.sampled_from([
    dict(model="llama", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=8),
    dict(model="llama", num_slots=24, max_batch_size=2, page_size=2, prefill_step_size=64),
    dict(model="llama", num_slots=12, max_batch_size=3, page_size=1, prefill_step_size=4),
    dict(model="ntk", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=64),
    dict(model="mamba", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=64),
    HYBRID_SETUP,
    dict(HYBRID_SETUP, page_size=2, num_snapshots=8),  # states kept on page boundaries
    dict(model="nemotron", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=8,
         num_snapshots=5, snapshot_interval=3),
    dict(model="sliding", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=8),
])  # fmt: skip


def _call(engine, requests, entry):
    """``generate`` or ``stream`` over ``requests`` [(prompt index, max_tokens, params)]:
    sampling settings go per prompt, so one call mixes greedy and seeded rows."""
    ps = [dict(p) for _, _, p in requests]
    return getattr(engine, entry)(
        [PROMPTS[i] for i, _, _ in requests],
        max_tokens=[m for _, m, _ in requests],
        temperature=[p.get("temperature", 0.0) for p in ps],
        top_p=[p.get("top_p", 1.0) for p in ps],
        top_k=[p.get("top_k", 0) for p in ps],
        seed=[p.get("seed") for p in ps],
    )


class _Program:
    """Runs a program against one engine, recording what every call got, with a bound on
    the engine's steps: each step serves some request (a prefill, or one decode step), and a
    request needs at most 1 + max_tokens of them, so a hang fails an assert instead."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.streams: list[dict] = []  # requests, iterator, events, state
        self.generated: list[tuple[list, list]] = []
        self.budget = 0
        self.steps = 0
        real = engine.core.run_round

        def step(emit):
            self.steps += 1
            assert self.steps <= self.budget, f"{self.steps} steps for a budget of {self.budget}"
            return real(emit)

        engine.core.run_round = step

    def charge(self, requests):
        self.budget += sum(1 + m for _, m, _ in requests)

    def run(self, op, on_error=None) -> None:
        kind, *args = op
        if kind == "open":
            self.charge(args[0])
            self.streams.append(dict(reqs=args[0], it=_call(self.engine, args[0], "stream"),
                                     events=[], state="open"))
        elif kind == "generate":
            self.charge(args[0])
            out = self._guard(lambda: _call(self.engine, args[0], "generate"), on_error)
            if out is not None:
                self.generated.append((args[0], out))
        elif kind == "reset":
            self.engine.reset_cache()
        elif self.streams:
            s = self.streams[args[0] % len(self.streams)]
            if s["state"] != "open":
                return
            if kind == "next":
                for _ in range(args[1]):
                    event = self._guard(lambda s=s: next(s["it"], None), on_error, s)
                    if event is None:
                        if s["state"] == "open":
                            s["state"] = "done"
                        break
                    s["events"].append(event)
            elif kind == "close":
                self._guard(s["it"].close, on_error)
                s["state"] = "closed"
            else:  # drop: the last reference goes, the GC finalizes the generator
                s["it"], s["state"] = None, "closed"
                gc.collect()

    @staticmethod
    def _guard(call, on_error, stream=None):
        if on_error is None:
            return call()
        try:
            return call()
        except BaseException as e:  # noqa: BLE001 - the fault tests inspect what was raised
            on_error(e)
            if stream is not None:
                stream["state"] = "failed"
            return None

    def drain(self, on_error=None) -> None:
        """Read every open stream to its end, in the order they were opened."""
        for i in range(len(self.streams)):
            self.run(("next", i, 10**6), on_error)

    def finish(self, on_error=None) -> None:
        for s in self.streams:
            if s["it"] is not None:
                self._guard(s["it"].close, on_error)

    def check(self, model) -> None:
        """Completed calls got exactly a fresh engine's tokens; cut-short ones a prefix."""
        for requests, out in self.generated:
            assert out == [fresh(model, PROMPTS[i], m, p) for i, m, p in requests]
        for s in self.streams:
            for row, (i, m, p) in enumerate(s["reqs"]):
                got, want = tokens_of(s["events"], row), fresh(model, PROMPTS[i], m, p)
                assert got == (want if s["state"] == "done" else want[: len(got)]), s["state"]


def _setup(setup):
    setup = dict(setup)
    model = model_named(setup.pop("model"))
    return model, make_engine(model, **setup)


@settings(max_examples=20)
@given(setup=SETUPS, program=PROGRAMS, drain=st.booleans())
def test_random_interleavings_lose_no_token_leak_no_slot_and_never_hang(setup, program, drain):
    model, engine = _setup(setup)
    run = _Program(engine)
    for op in program:
        run.run(op)
        assert_consistent(engine)
    if drain:  # then every stream still open is checked whole, not as a prefix
        run.drain()
        assert_consistent(engine)
    run.finish()
    assert_intact(engine)
    run.check(model)
    later = [(0, 3, GREEDY), (6, 2, HOT), (4, 3, GREEDY)]
    run.charge(later)
    assert _call(engine, later, "generate") == [fresh(model, PROMPTS[i], m, p)
                                                for i, m, p in later]
    assert_intact(engine)


# ------------------------------------------------------------------- faults in a step ----


class _Fault:
    """Raises ``error`` at the ``at``-th call of whatever it wraps, while armed."""

    def __init__(self, at: int, error: type[BaseException]):
        self.at, self.error, self.calls, self.armed, self.fired = at, error, 0, True, False

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            if self.armed:
                self.calls += 1
                if self.calls == self.at:
                    self.fired = True
                    raise self.error(f"injected fault at call {self.at}")
            return fn(*args, **kwargs)

        return wrapped


class _FlakyModel(nn.Module):
    def __init__(self, inner, fault):
        super().__init__()
        self.inner, self.layers, self.args = inner, inner.layers, inner.args
        if hasattr(inner, "make_cache"):  # the model's own caches (hybrid, sliding window)
            self.make_cache = inner.make_cache
        self.forward = fault.wrap(lambda inputs, cache: inner(inputs, cache=cache))

    def __call__(self, inputs, cache=None):
        return self.forward(inputs, cache)


# Where a step can fail: the model's forward, and the host operations between forwards
# (sampling, the pool write, slot allocation, tree insertion, publishing an answer, and the
# decode caches' row moves).
TARGETS = ["model", "sample", "set_kv_all_layers", "take_slots", "insert", "publish_answer",
           "add_row", "remove_row", "set_states", "take_snapshot", "add_state"]  # fmt: skip
STATE_TARGETS = {"set_states", "take_snapshot", "add_state"}  # served on the hybrid model


def _arm(target, fault, model, engine_kwargs, patch):
    if target == "model":
        flaky = _FlakyModel(model, fault)
        fault.armed = False  # the engine's start-up probes run unfaulted
        engine = make_engine(flaky, **engine_kwargs)
        fault.armed = True
        return engine
    engine = make_engine(model, **engine_kwargs)
    if target == "sample":
        patch.setattr(runner_module, target, fault.wrap(getattr(runner_module, target)))
    elif target in ("set_kv_all_layers", "set_states"):
        patch.setattr(store_module, target, fault.wrap(getattr(store_module, target)))
    elif target in ("add_row", "remove_row"):
        for cls in (RaggedKVCache, RaggedArraysCache):
            patch.setattr(cls, target, fault.wrap(getattr(cls, target)))
    else:  # the prefix store's methods
        store = engine.core.store
        setattr(store, target, fault.wrap(getattr(store, target)))
    return engine


FAULT_SETUPS = [
    dict(model="llama", num_slots=20, max_batch_size=3, page_size=1, prefill_step_size=8),
    dict(model="llama", num_slots=12, max_batch_size=3, page_size=1, prefill_step_size=4),
    HYBRID_SETUP,
    dict(HYBRID_SETUP, page_size=2, num_snapshots=8),  # states kept on page boundaries
]


# Calls per program: the model, sampling, pool writes and row joins happen every step or so;
# the others a few times.
FREQUENT = {"model", "sample", "set_kv_all_layers", "add_row"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # GC finalizer
@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=5)
@given(
    data=st.data(),
    error=st.sampled_from([RuntimeError, KeyboardInterrupt, MemoryError]),
    setup=st.sampled_from(FAULT_SETUPS),
    program=PROGRAMS,
)
def test_a_fault_anywhere_in_a_step_leaves_the_engine_consistent_and_exact(
    target, data, error, setup, program
):
    at = data.draw(st.integers(1, 12 if target in FREQUENT else 3), label="at")
    if target in STATE_TARGETS and setup["model"] != "hybrid":
        setup = HYBRID_SETUP
    setup = dict(setup)
    model = model_named(setup.pop("model"))
    fault = _Fault(at, error)
    raised: list[BaseException] = []
    with pytest.MonkeyPatch.context() as patch:
        engine = _arm(target, fault, model, setup, patch)
        run = _Program(engine)
        program = [("open", [(0, 4, GREEDY), (6, 3, HOT)]), ("next", 0, 2),
                   ("open", [(3, 4, GREEDY)]), ("next", 1, 1), *program, ("next", 0, 8),
                   ("next", 1, 8)]  # fmt: skip
        for op in program:
            run.run(op, on_error=raised.append)
            assert_consistent(engine)
        run.finish(on_error=raised.append)
        fault.armed = False
    assert_intact(engine)
    for e in raised:  # the fault itself, or a stream told its request was dropped by it
        assert isinstance(e, error) or isinstance(e, RuntimeError) and (
            isinstance(e.__cause__, error)), repr(e)
    assert fault.fired or not raised  # (a fault in a GC finalizer is only printed)
    run.check(model)  # whatever completed is exact, faults or not
    later = [(3, 4, GREEDY), (1, 3, HOT)]
    run.charge(later)
    assert _call(engine, later, "generate") == [fresh(model, PROMPTS[i], m, p)
                                                for i, m, p in later]
    assert_intact(engine)


def test_a_model_that_raises_in_prefill_drops_only_that_batch(model):
    """A prefill failure spares the running batch: the other stream goes on, exact."""
    fault = _Fault(at=10**9, error=RuntimeError)
    engine = make_engine(_FlakyModel(model, fault), num_slots=40, max_batch_size=4)
    running = engine.stream([[1, 2, 3, 4]], max_tokens=6)
    got = [next(running), next(running)]
    fault.at = fault.calls + 1  # the next forward: the new request's prefill
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate([[9, 8, 7]], max_tokens=3)
    assert_consistent(engine)
    got += list(running)
    assert tokens_of(got) == fresh(model, [1, 2, 3, 4], 6)
    assert_intact(engine)
    assert engine.generate([[9, 8, 7]], max_tokens=3) == [fresh(model, [9, 8, 7], 3)]


def test_a_decode_failure_tells_every_stream_that_lost_a_request(model):
    fault = _Fault(at=10**9, error=KeyboardInterrupt)
    engine = make_engine(_FlakyModel(model, fault), num_slots=40, max_batch_size=4)
    a, b = engine.stream([[1, 2, 3]], max_tokens=6), engine.stream([[4, 5]], max_tokens=6)
    next(a), next(b), next(a)
    fault.at = fault.calls + 1  # the next forward: a decode step of both
    with pytest.raises(KeyboardInterrupt):
        next(a)
    with pytest.raises(RuntimeError, match=r"request\(s\) \[0\] of this stream were dropped"):
        list(b)  # b's queued tokens first, then the news
    assert_intact(engine)
    assert engine.generate([[1, 2, 3], [4, 5]], max_tokens=6) == [
        fresh(model, [1, 2, 3], 6), fresh(model, [4, 5], 6)
    ]


def test_pool_exhausted_is_servecores_and_is_never_raised_for_a_prompt_that_fits(model):
    import servecore

    assert PoolExhausted is servecore.PoolExhausted
    engine = Engine(model, num_slots=10, max_batch_size=8)
    prompts = [[i + 1] * 9 for i in range(6)]  # each fills the pool alone
    assert engine.generate(prompts, max_tokens=3) == [fresh(model, p, 3) for p in prompts]
    assert_intact(engine)
