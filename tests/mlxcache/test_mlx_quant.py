"""mlxcache with quantized K/V (``Engine(kv_bits=...)``): batched, with prefix reuse, exact.

The oracle is mlx-lm alone: its greedy decoding of one request at a time, no reuse, with
its own ``QuantizedKVCache(group_size, bits)`` from token 0 in place of every ``KVCache``
the model makes, and the model's own cache for the rest (a sliding window's
``RotatingKVCache``, a recurrent layer's ``ArraysCache``): built here from
``make_prompt_cache``, not from the engine's layout. Each model is a tiny random one of
mlx-lm's classes with heads of 64 values (a group must divide the head size).

Batches: a ragged batch pads rows to the longest, and a padded key is masked to the
smallest float before the softmax, so its weight is exactly 0; but the quantized matmul
then sums over a longer row than one request alone does, which may change the last bit of
a logit. The greedy tokens of the cases below equal the oracle's (their margins allow it).
"""

from __future__ import annotations

import random
import warnings

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import (  # noqa: E402
    CacheList,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from mlxcache import zoo  # noqa: E402
from mlxcache.engine import Engine, ReuseDisabledWarning  # noqa: E402

pytestmark = pytest.mark.mlx

FAMILIES = ["llama", "qwen3_next", "gemma3_text"]  # plain, hybrid, sliding window
MAX = 6
_MODELS: dict[str, object] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = zoo.make(family, head_dim=64)
    return _MODELS[family]


def engine(family: str, bits: int, **kw) -> Engine:
    opts = dict(num_slots=1024, num_snapshots=32, snapshot_interval=8, max_batch_size=8,
                kv_bits=bits, kv_group_size=32)
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseDisabledWarning)
        return Engine(model_of(family), **opts)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, zoo.VOCAB) for _ in range(n)]


def _quantized(cache, bits: int):
    """``cache`` with every ``KVCache`` in it quantized from token 0, those inside a
    ``CacheList`` (falcon_h1's attention beside its recurrent state) included."""
    if type(cache) is KVCache:
        return QuantizedKVCache(group_size=32, bits=bits)
    if type(cache) is CacheList:
        return CacheList(*[_quantized(c, bits) for c in cache.caches])
    return cache


def oracle(family: str, prompt: list[int], bits: int, max_tokens: int = MAX) -> list[int]:
    """mlx-lm's greedy tokens with ``QuantizedKVCache`` for every ``KVCache``, nested ones
    included."""
    model = model_of(family)
    cache = [_quantized(c, bits) for c in make_prompt_cache(model)]
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(max_tokens):
        out.append(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([out[-1:]]), cache=cache)
    return out


def test_the_oracle_quantizes_nested_caches_too():
    """falcon_h1 keeps its attention's K/V in a ``CacheList`` beside a recurrent state: the
    oracle quantizes that ``KVCache`` too, so the comparison below checks quantized K/V."""
    caches = [_quantized(c, 8) for c in make_prompt_cache(zoo.make("falcon_h1", head_dim=64))]
    inner = [x for c in caches if type(c) is CacheList for x in c.caches]
    assert inner and any(type(x) is QuantizedKVCache for x in inner)
    assert not any(type(x) is KVCache for x in inner)


@pytest.mark.parametrize("family", [*FAMILIES, "falcon_h1"])
def test_cold_full_hit_and_a_second_turn(family):
    e = engine(family, 8)
    assert e.batched and e.reuse and e.options.kv_bits == 8
    p = tokens(1, 29)
    want = oracle(family, p, 8)
    assert e.generate([p], max_tokens=MAX) == [want]
    assert e.generate([p], max_tokens=MAX) == [want]  # a full hit reads the quantized bytes
    assert e.stats.cached_tokens == len(p) - 1
    turn = p + want + tokens(2, 7)  # the next turn: prompt and answer are in the pool
    before = e.stats.cached_tokens
    assert e.generate([turn], max_tokens=MAX) == [oracle(family, turn, 8)]
    assert e.stats.cached_tokens - before == len(p) + MAX  # (every answer token ran)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_requests_of_different_lengths_sharing_a_prefix(family, bits):
    """Rows of different lengths in one batch, leaving it at different steps (each leave
    moves the last row into its place and shrinks the buffers)."""
    e = engine(family, bits)
    shared = tokens(3, 24)
    prompts = [shared + tokens(10 + i, 2 + 3 * i) for i in range(4)] + [tokens(20, 11)]
    most = [3, 9, 1, 12, 5]
    assert e.generate(prompts, max_tokens=most) == [oracle(family, p, bits, n)
                                                    for p, n in zip(prompts, most, strict=True)]
    assert e.stats.hit_rate > 0 and e.tree.protected_size == 0


@pytest.mark.parametrize("kw", [dict(page_size=4), dict(prefill_step_size=8),
                                dict(prefix_cache=False)])
def test_pages_chunks_and_no_reuse(kw):
    """Pages of several tokens, a prompt prefilled in chunks, no prefix cache at all: the
    same tokens as mlx-lm's."""
    opts = dict(kv_bits=8, kv_group_size=32, max_batch_size=4, **kw)
    if kw.get("prefix_cache") is not False:
        opts["num_slots"] = 512
    e = Engine(model_of("qwen3_next"), **opts)
    shared = tokens(30, 21)
    prompts = [shared + tokens(31 + i, 3 + i) for i in range(3)]
    for _ in range(2):  # the second round hits what the first cached
        assert e.generate(prompts, max_tokens=MAX) == [oracle("qwen3_next", p, 8)
                                                       for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_after_evictions(family):
    e = engine(family, 4, num_slots=128, num_snapshots=16)
    prompts = [tokens(40 + i % 3, 18) + tokens(50 + i, 9) for i in range(8)]
    for p in prompts:
        assert e.generate([p], max_tokens=MAX) == [oracle(family, p, 4)]
    assert e.stats.token_evictions > 0 and e.stats.hit_rate > 0
    assert e.num_free_slots + e.tree.total_size == e.num_slots - 1  # nothing leaked


def test_which_layers_are_quantized_is_said():
    """Sliding-window layers stay in full precision and are named; gpt-oss's attention
    takes sinks, which mlx-lm's quantized attention refuses: every layer stays in full
    precision, each named, and the model is served exactly as without ``kv_bits``."""
    assert engine("llama", 8).quantized == "2 of 2 attention layers at 8 bits, groups of 32"
    assert engine("gemma3_text", 4).quantized == (
        "1 of 2 attention layers at 4 bits, groups of 32; layer 0: sliding window (8 tokens)")
    e = engine("gpt_oss", 8)
    assert e.quantized.startswith("0 of 2 attention layers"), e.quantized
    assert "layer 1: its attention refuses quantized K/V (ValueError: Quantized SDPA does " \
        "not support attention sinks.)" in e.quantized
    p = tokens(5, 20)
    assert e.generate([p], max_tokens=MAX) == [zoo.reference_generate(model_of("gpt_oss"), p,
                                                                      MAX)]


@pytest.mark.parametrize("bits, most", [(8, 0.55), (4, 0.3)])
def test_pool_bytes_per_token_against_float16(bits, most):
    """Heads of 64 values, groups of 64: 8 bits take 0.53x of a float16 pool, 4 bits 0.28x,
    and an automatic pool of the same budget holds that many more tokens."""
    model = zoo.make("llama", head_dim=64)
    model.set_dtype(mx.float16)
    full = Engine(model, num_slots=256)
    quant = Engine(model, num_slots=256, kv_bits=bits, kv_group_size=64)
    ratio = quant.core.store.pool.bytes_per_slot / full.core.store.pool.bytes_per_slot
    assert ratio <= most, ratio
    assert quant.core.store.pool.nbytes <= most * full.core.store.pool.nbytes


def test_an_automatic_pool_holds_more_tokens_in_the_same_memory(monkeypatch):
    """The automatic sizer counts the quantized bytes: under one budget, 8 bits hold
    1.9x the float16 pool's tokens and 4 bits 3.6x (groups of 64, heads of 64)."""
    from mlxcache.engine import sizing

    monkeypatch.setattr(sizing, "_memory_budget", lambda: (64 << 20, "test memory"))
    model = zoo.make("llama", head_dim=64)
    model.set_dtype(mx.float16)
    slots = {bits: Engine(model, kv_bits=bits, kv_group_size=64).num_slots
             for bits in (None, 8, 4)}
    assert 1.8 < slots[8] / slots[None] < 2.0 and 3.4 < slots[4] / slots[None] < 3.7, slots


def test_a_quantized_pool_passes_through_mx_compile():
    from mlxcache.pool import get_kv, init_pool, set_kv
    from mlxcache.quant import KVQuant

    pool = init_pool(1, 8, 2, 64, mx.float16, quant=[KVQuant(8, 64)])
    k = mx.random.normal((3, 2, 64)).astype(mx.float16)
    slots = mx.array([1, 2, 3])
    write = mx.compile(lambda p, k: set_kv(p, 0, slots, k, k))
    got, want = get_kv(write(pool, k), 0, slots)[0], KVQuant(8, 64).quantize(k)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


def test_kv_bits_that_quantize_nothing_say_so():
    with pytest.warns(UserWarning, match="kv_bits=8 does nothing: no attention layer"):
        Engine(zoo.make("gpt_oss", head_dim=64), num_slots=64, kv_bits=8)
    with pytest.warns(UserWarning, match="kv_group_size=32 does nothing without kv_bits"):
        Engine(model_of("llama"), num_slots=64, kv_group_size=32)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_bits=3 must be one of"):
        Engine(model_of("llama"), num_slots=64, kv_bits=3)
    with pytest.raises(ValueError, match=r"kv_bits=8.0 must be one of"):
        Engine(model_of("llama"), num_slots=64, kv_bits=8.0)
    with pytest.raises(ValueError, match="kv_group_size=48 must be one of"):
        Engine(model_of("llama"), num_slots=64, kv_bits=8, kv_group_size=48)
    with pytest.raises(ValueError, match=r"kv_group_size=32 divides no attention layer's "
                                         r"key and value head sizes \(16 and 16\)"):
        Engine(zoo.make("llama"), num_slots=64, kv_bits=8, kv_group_size=32)


def test_pages_go_to_disk_quantized_and_come_back(tmp_path):
    """The disk tier writes the pool's quantized parts and reads them back as they were (no
    re-quantization); other bits on the same directory read nothing."""
    p = tokens(9, 300)
    with engine("llama", 8, cache_dir=tmp_path) as e:
        e.generate([p], max_tokens=1)
    with engine("llama", 8, cache_dir=tmp_path) as e:
        assert e.generate([p], max_tokens=MAX) == [oracle("llama", p, 8)]
        assert e.stats.disk_hits == 1 and e.stats.cached_tokens == 256
    with engine("llama", 4, cache_dir=tmp_path) as e:
        assert e.generate([p], max_tokens=MAX) == [oracle("llama", p, 4)]
        assert e.stats.disk_hits == 0 and e.stats.cached_tokens == 0
