"""The model zoo: every family builds, uses the caches it should, and decodes greedily without
degenerating, and the oracle is mlx-lm's own decoding, chunked or not.

``mlxcache.zoo`` is not (yet) in ``tests/test_api_docs.MLXCACHE_API``, so its docstring
examples and documentation check run here.
"""

from __future__ import annotations

import doctest
import importlib
import random

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from mlxcache import zoo  # noqa: E402

pytestmark = pytest.mark.mlx

# The cache kind each family must show (beside, for most, KVCache).
EXPECTED_KIND = {
    "llama": "KVCache",
    "qwen3_next": "ArraysCache",
    "qwen3_5": "ArraysCache",
    "nemotron_h": "ArraysCache",
    "lfm2": "ArraysCache",
    "kimi_linear": "ArraysCache",
    "falcon_h1": "ArraysCache",
    "granitemoehybrid": "ArraysCache",
    "jamba": "ArraysCache",
    "gemma3_text": "RotatingKVCache",
    "gpt_oss": "RotatingKVCache",
    "llama4": "ChunkedKVCache",
}


def _prompt(n: int = 30, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, zoo.VOCAB) for _ in range(n)]


def test_every_family_has_an_expected_cache_kind():
    assert set(EXPECTED_KIND) == set(zoo.FAMILIES)


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_family_uses_its_cache_kinds_next_to_full_attention(family):
    kinds = zoo.cache_kinds(zoo.make(family))
    assert EXPECTED_KIND[family] in kinds
    assert "KVCache" in kinds, f"{family}: no full-attention layer in {kinds}"
    assert "CacheList" not in kinds  # flattened into its members


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_family_is_float32_and_deterministic_in_its_seed(family):
    a, b, c = zoo.make(family, seed=3), zoo.make(family, seed=3), zoo.make(family, seed=4)
    pa, pb, pc = (dict(tree_flatten(m.parameters())) for m in (a, b, c))
    assert {p.dtype for p in pa.values()} == {mx.float32}
    assert all(mx.array_equal(pa[k], pb[k]).item() for k in pa)
    assert not all(mx.array_equal(pa[k], pc[k]).item() for k in pa)


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_greedy_tokens_vary_and_chunked_prefill_gives_the_same_tokens(family):
    model = zoo.make(family)
    prompt = _prompt()
    tokens = zoo.reference_generate(model, prompt, max_tokens=8)
    assert len(tokens) == 8 and all(0 <= t < zoo.VOCAB for t in tokens)
    assert len(set(tokens)) > 1, f"{family}: degenerate greedy decoding {tokens}"
    for chunk in (1, 7, 64):  # one token at a time; mlx-lm-style; one chunk for all
        chunked = zoo.reference_generate_chunked(model, prompt, 8, chunk=chunk)
        assert chunked == tokens, f"{family}: {chunk=} gives {chunked}, one pass {tokens}"


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_reference_is_mlx_lm_generate_step(family):
    model = zoo.make(family)
    prompt = _prompt(seed=1)
    steps = generate_step(mx.array(prompt), model, max_tokens=6, prefill_step_size=7)
    ours = zoo.reference_generate_chunked(model, prompt, 6, chunk=7)
    assert [int(t) for t, _ in steps] == ours


WINDOWED = [
    ("gemma3_text", "sliding_window"),
    ("gpt_oss", "sliding_window"),
    ("llama4", "attention_chunk_size"),
]


@pytest.mark.parametrize(("family", "field"), WINDOWED)
def test_the_window_is_shorter_than_the_prompt_and_matters(family, field):
    prompt = _prompt(40)
    narrow = zoo.reference_generate(zoo.make(family), prompt, 8)
    wide = zoo.reference_generate(zoo.make(family, **{field: 64}), prompt, 8)
    assert narrow != wide


def test_overrides_reach_the_args_and_the_text_config_of_wrappers():
    assert len(zoo.make("llama", num_hidden_layers=3).layers) == 3
    assert len(zoo.make("qwen3_5", num_hidden_layers=4).layers) == 4
    assert zoo.make("llama4", attention_chunk_size=16).args.text_config.attention_chunk_size == 16
    assert "num_hidden_layers" not in zoo.FAMILIES["llama4"]  # the table is not mutated


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(KeyError, match="family='nope' is not in FAMILIES"):
        zoo.make("nope")
    model = zoo.make("llama")
    with pytest.raises(ValueError, match="prompt is empty"):
        zoo.reference_generate(model, [], 2)
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        zoo.reference_generate_chunked(model, [1, 2], 2, chunk=0)


def test_zoo_doctests_run_and_public_names_are_documented():
    module = importlib.import_module("mlxcache.zoo")
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    assert doctest.testmod(module, optionflags=flags).failed == 0
    from tests.test_api_docs import _problems

    assert _problems("mlxcache.zoo") == []
