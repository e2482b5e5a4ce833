"""Blockwise MLA attention (``hybridattn.ops.mla``) equals its dense oracle, never holds the width.

References: ``ref_mla_extend`` / ``ref_mla_decode`` (the dense form, kept as the oracle).
Examples are drawn into two fixed shape buckets so they reuse compilations; the block sizes and
query tiles come from short lists for the same reason. The memory claim is checked on the
compiled forward of a 64k-wide page table, which a dense form would fail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridattn.backends import (
    BatchRequest,
    ForwardBatch,
    ForwardMode,
    FullAttnMetadata,
    MLAAttnBackend,
    make_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.ops import mla
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    RecurrentStatePool,
    alloc_reqs_or_raise,
    write_token_slots,
)

H, DN, DR, DV, R = 2, 4, 2, 4, 8  # heads and head dims of every drawn example
S = 64  # token slots of the drawn pools
BUCKETS = {  # name: (B requests, T tokens, W width, Q max extend)
    "ragged": (3, 16, 24, 8),
    "one_block": (2, 8, 8, 8),  # drawn with block 8: a width of exactly one block
}

extend = jax.jit(mla.mla_extend, static_argnames=("max_extend_len", "scale", "block_size",
                                                   "query_block", "absorbed"))
decode = jax.jit(mla.mla_decode, static_argnames=("scale", "block_size"))
ref_extend = jax.jit(mla.ref_mla_extend, static_argnames=("max_extend_len", "scale"))
ref_decode = jax.jit(mla.ref_mla_decode, static_argnames=("scale",))


@st.composite
def ragged_batches(draw, bucket: str):
    """Lengths of a ragged batch in ``bucket``: per request a prefix (0..W - ext) and an extend
    (0..Q, 0 = a padding row), packed from token 0, padding tokens at the tail; a page table of
    random slots (stale ones past each ``seq_len``, the sink among them)."""
    B, T, W, Q = BUCKETS[bucket]
    ext, seq, used = [], [], 0
    for _ in range(B):
        e = draw(st.integers(0, min(Q, T - used)), label="extend")
        p = draw(st.integers(0, W - e), label="prefix") if e else 0
        ext.append(e), seq.append(p + e)
        used += e
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    page_table = rng.integers(0, S, size=(B, W))
    query_start = np.concatenate([[0], np.cumsum(ext)[:-1]])
    return dict(page_table=jnp.asarray(page_table, jnp.int32),
                seq_lens=jnp.asarray(seq, jnp.int32), extend_lens=jnp.asarray(ext, jnp.int32),
                query_start=jnp.asarray(query_start, jnp.int32), T=T, Q=Q, seed=seed)


def _tensors(seed, T, *, logit_scale=1.0, integers=False):
    """Queries, pool and weights. ``integers``: small integers, ``q_pe`` / ``k_pe`` times 64,
    so every score is exact in float32 (both forms round alike) and logits reach ~1e4."""
    rng = np.random.default_rng(seed + 1)

    def draw(*shape, big=1.0):
        x = rng.integers(-3, 4, size=shape) * big if integers else rng.normal(size=shape)
        return jnp.asarray(x, jnp.float32)

    big = 64.0 if integers else 1.0
    return dict(q_nope=draw(T, H, DN) * (1.0 if integers else logit_scale),
                q_pe=draw(T, H, DR, big=big), c_kv=draw(S, R), k_pe=draw(S, DR, big=big),
                w_kc=draw(H, DN, R), w_vc=draw(H, DV, R))


def _args(x, b):
    return (x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["w_kc"], x["w_vc"],
            b["page_table"], b["seq_lens"], b["extend_lens"], b["query_start"])


def _close(got, want, rtol=1e-5):
    scale = max(1.0, float(jnp.max(jnp.abs(want))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=rtol * scale)


# (block_size, query_block, absorbed) run on every drawn batch: each compiles once per bucket.
# Blocks of 1 (every key its own block), 5 (a last block that overlaps the one before), 8 (the
# one_block bucket's width exactly) and 32 (more than any width: capped at W).
FORMS = [(1, 3, True), (5, 8, False), (8, 3, False), (32, 8, True)]


@given(st.sampled_from(sorted(BUCKETS)).flatmap(
           lambda name: st.tuples(st.just(name), ragged_batches(name))),
       st.floats(0.1, 3.0, allow_subnormal=False))
def test_blockwise_extend_equals_the_dense_reference_on_ragged_batches(drawn, logit_scale):
    _, b = drawn
    x = _tensors(b["seed"], b["T"], logit_scale=logit_scale)
    want = ref_extend(*_args(x, b), max_extend_len=b["Q"], scale=0.4)
    dead = np.arange(b["T"]) >= int(b["extend_lens"].sum())
    for block, query_block, absorbed in FORMS:
        got = extend(*_args(x, b), max_extend_len=b["Q"], scale=0.4, block_size=block,
                     query_block=query_block, absorbed=absorbed)
        _close(got, want)
        assert not np.asarray(got)[dead].any(), "a padding token got a non-zero output"


@given(st.sampled_from(sorted(BUCKETS)).flatmap(
           lambda name: st.tuples(st.just(name), ragged_batches(name))),
       st.floats(0.1, 3.0, allow_subnormal=False))
def test_blockwise_decode_equals_the_dense_reference_with_padding_rows(drawn, logit_scale):
    _, b = drawn
    B = b["seq_lens"].shape[0]
    x = _tensors(b["seed"], B, logit_scale=logit_scale)
    seq = jnp.where(b["extend_lens"] > 0, b["seq_lens"], 0)  # extend 0: a padding row
    args = (*_args(x, b)[:7], seq)
    want = ref_decode(*args, scale=0.4)
    for block in (1, 5, 8):
        got = decode(*args, scale=0.4, block_size=block)
        _close(got, want)
        assert not np.asarray(got)[np.asarray(seq) == 0].any()


@given(ragged_batches("ragged"))
def test_stale_slots_never_reach_the_output(b):
    """Pool slots no request reads (the sink, freed slots) may hold anything: with them set to
    NaN and inf, every form gives what it gives on a clean pool."""
    x = _tensors(b["seed"], b["T"])
    args = _args(x, b)
    c_kv, k_pe, page_table, seq_lens = args[2], args[3], args[6], args[7]
    read = np.zeros(c_kv.shape[0], bool)
    for row, n in zip(np.asarray(page_table), np.asarray(seq_lens), strict=True):
        read[row[:n]] = True
    bad = jnp.asarray(~read)[:, None]
    dirty = list(args)
    dirty[2] = jnp.where(bad, jnp.nan, c_kv)
    dirty[3] = jnp.where(bad, jnp.inf, k_pe)
    want = ref_extend(*args, max_extend_len=b["Q"], scale=0.4)
    for block, query_block, absorbed in FORMS:
        got = extend(*dirty, max_extend_len=b["Q"], scale=0.4, block_size=block,
                     query_block=query_block, absorbed=absorbed)
        _close(got, want)
    seq = jnp.where(b["extend_lens"] > 0, seq_lens, 0)
    x = _tensors(b["seed"], seq.shape[0])  # one query per request
    d_args = (*_args(x, b)[:2], c_kv, k_pe, *_args(x, b)[4:7], seq)
    d_dirty = (*d_args[:2], dirty[2], dirty[3], *d_args[4:])
    _close(decode(*d_dirty, scale=0.4, block_size=5), ref_decode(*d_args, scale=0.4))


@given(ragged_batches("ragged"))
def test_logits_near_1e4_neither_overflow_nor_drift(b):
    x = _tensors(b["seed"], b["T"], integers=True)
    want = ref_extend(*_args(x, b), max_extend_len=b["Q"], scale=0.25)
    for absorbed in (True, False):
        got = extend(*_args(x, b), max_extend_len=b["Q"], scale=0.25, block_size=5,
                     query_block=8, absorbed=absorbed)
        assert np.isfinite(np.asarray(got)).all()
        _close(got, want)
    B = b["seq_lens"].shape[0]
    seq = jnp.where(b["extend_lens"] > 0, b["seq_lens"], 0)
    args = (*_args(_tensors(b["seed"], B, integers=True), b)[:7], seq)
    _close(decode(*args, scale=0.25, block_size=5), ref_decode(*args, scale=0.25))


def test_the_logits_of_the_extreme_test_do_reach_1e4():
    x = _tensors(0, 16, integers=True)
    logits = 0.25 * jnp.einsum("thd,sd->ths", x["q_pe"], x["k_pe"])
    assert float(jnp.abs(logits).max()) > 1e4


def test_a_batch_of_padding_only_visits_no_block_and_gives_zeros():
    b = dict(page_table=jnp.zeros((2, 8), jnp.int32), seq_lens=jnp.zeros(2, jnp.int32),
             extend_lens=jnp.zeros(2, jnp.int32), query_start=jnp.zeros(2, jnp.int32))
    x = _tensors(0, 4)
    n, ends = mla._work_list(b["seq_lens"], b["extend_lens"], query_tile=4, num_tiles=1,
                             block=4)
    assert int(ends[-1]) == 0
    got = extend(*_args(x, b), max_extend_len=4, scale=0.4, block_size=4, query_block=4,
                 absorbed=True)
    assert got.shape == (4, H, DV) and not np.asarray(got).any()


def test_cost_follows_each_requests_own_length_not_the_batch_maximum():
    # One request of 4096 keys and seven of 8, one query each, blocks of 512: 8 + 7 items,
    # where a loop over the batch maximum would visit 8 x 8.
    seq = jnp.array([4096] + [8] * 7, jnp.int32)
    ext = jnp.ones(8, jnp.int32)
    n, ends = mla._work_list(seq, ext, query_tile=1, num_tiles=1, block=512)
    assert n.tolist() == [8] + [1] * 7 and int(ends[-1]) == 15
    # A 2048-token prefill in tiles of 512 skips the blocks above the causal diagonal.
    n, _ = mla._work_list(jnp.array([2048]), jnp.array([2048]), query_tile=512, num_tiles=4,
                          block=512)
    assert n.tolist() == [1, 2, 3, 4]


def test_the_rule_picks_absorbed_for_few_queries_and_decompressed_for_wide_tiles():
    kimi = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    assert mla.prefers_absorbed(1, **kimi) and mla.prefers_absorbed(64, **kimi)
    assert not mla.prefers_absorbed(2048, **kimi)
    tiny = dict(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)
    assert mla.prefers_absorbed(2048, **tiny)  # narrow heads: absorbed, measured


# --------------------------------------------------------------------------------------------
# through the backend: the dense and blockwise forms agree, and the width is never materialised
# --------------------------------------------------------------------------------------------


def _served_batch(cfg):
    """Two requests (5 cached + 3 new, and 4 new) and a padding row, through the backend."""
    req, rows = alloc_reqs_or_raise(HybridReqToTokenPool.create(3, 16), 2)
    slots = [list(range(1, 9)), list(range(9, 13))]
    r_idx = [rows[0]] * 8 + [rows[1]] * 4
    pos = list(range(8)) + list(range(4))
    req = write_token_slots(req, jnp.array(r_idx), jnp.array(pos), jnp.array(sum(slots, [])))
    rng = np.random.default_rng(3)
    pool = MLATokenPool.create(cfg.full_attention_layer_ids, 32, cfg.kv_lora_rank,
                               cfg.qk_rope_head_dim)
    layer = cfg.full_attention_layer_ids[0]
    pool = pool.replace(c_kv=jnp.asarray(rng.normal(size=(1, 32, cfg.kv_lora_rank)),
                                         jnp.float32),
                        k_pe=jnp.asarray(rng.normal(size=(1, 32, cfg.qk_rope_head_dim)),
                                         jnp.float32))
    batch = make_forward_batch(
        [BatchRequest(rows[0], 5, [1, 2, 3], slots[0][5:]), BatchRequest(rows[1], 0,
                                                                         [4, 5, 6, 7], slots[1])],
        req_to_token_pool=req, num_requests=3, num_tokens=8, token_to_kv_pool=pool,
        recurrent_state_pool=RecurrentStatePool.create((0,), 4, 12, 4, 1, 4, 4))
    return layer, batch


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_backend_blockwise_extend_and_decode_equal_the_dense_backend(form):
    cfg = KimiLinearConfig.tiny()
    Hh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
    rng = np.random.default_rng(4)

    def rand(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    layer, batch = _served_batch(cfg)
    inputs = dict(q_nope=rand(8, Hh, dn), q_pe=rand(8, Hh, dr), c_kv=rand(8, r),
                  k_pe=rand(8, dr), w_kc=rand(Hh, dn, r), w_vc=rand(Hh, dv, r))
    outs = {}
    for impl in ("dense", "blockwise"):
        be = MLAAttnBackend.from_config(cfg, 32, impl=impl, block_size=3, query_block=2,
                                        extend_form=form)
        be = be.with_forward_metadata(be.get_forward_metadata(batch))
        out, after = jax.jit(functools.partial(be.forward_extend, layer))(batch, **inputs)
        outs[impl] = out
    _close(outs["blockwise"], outs["dense"])
    dec = batch.replace(input_ids=batch.input_ids[:3], out_cache_loc=jnp.array([13, 14, 0]),
                        seq_lens=jnp.array([9, 5, 0]), extend_seq_lens=jnp.array([1, 1, 0]),
                        max_extend_len=1, kv_width=9, forward_mode=ForwardMode.DECODE)
    dec = dec.replace(req_to_token_pool=write_token_slots(
        after.req_to_token_pool, dec.req_pool_indices[:2], jnp.array([8, 4]), jnp.array([13, 14])),
        token_to_kv_pool=after.token_to_kv_pool)
    d_in = {k: (v[:3] if k in ("q_nope", "q_pe", "c_kv", "k_pe") else v)
            for k, v in inputs.items()}
    for impl in ("dense", "blockwise"):
        be = MLAAttnBackend.from_config(cfg, 32, impl=impl, decode_block_size=4)
        be = be.with_forward_metadata(be.get_forward_metadata(dec))
        outs[impl], _ = jax.jit(functools.partial(be.forward_decode, layer))(dec, **d_in)
    _close(outs["blockwise"], outs["dense"])


WIDE = 65536


def _wide_forward(impl, mode="extend"):
    """``forward_extend`` (or ``forward_decode``) of the tiny config's MLA layer over a
    64k-wide page table, as a function of abstract inputs: 2 requests, 64 new tokens each."""
    cfg = KimiLinearConfig.tiny()
    layer = cfg.full_attention_layer_ids[0]
    Hh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
    B, Q = 2, (64 if mode == "extend" else 1)
    T = B * Q
    slots = 4099  # the pool: not the width, so their dims are told apart
    be = MLAAttnBackend.from_config(cfg, slots, impl=impl)

    def forward(page_table, seq_lens, extend_lens, c_kv_pool, k_pe_pool, q_nope, q_pe, c_kv,
                k_pe, w_kc, w_vc):
        md = FullAttnMetadata(seq_lens=seq_lens, prefix_lens=seq_lens - extend_lens,
                              extend_lens=extend_lens,
                              query_start_loc=jnp.arange(B + 1, dtype=jnp.int32) * Q,
                              page_table=page_table, out_cache_loc=jnp.arange(T) + 1,
                              max_extend_len=Q)
        pool = MLATokenPool(c_kv=c_kv_pool[None], k_pe=k_pe_pool[None], layer_ids=(layer,))
        batch = ForwardBatch(
            input_ids=jnp.zeros(T, jnp.int32), req_pool_indices=jnp.arange(B) + 1,
            seq_lens=seq_lens, extend_seq_lens=extend_lens, out_cache_loc=md.out_cache_loc,
            req_to_token_pool=HybridReqToTokenPool.create(B, 8), token_to_kv_pool=pool,
            recurrent_state_pool=RecurrentStatePool.create((0,), B + 1, 12, 4, 1, 4, 4),
            kv_width=WIDE, max_extend_len=Q)
        bound = be.with_forward_metadata(md)
        fn = bound.forward_extend if mode == "extend" else bound.forward_decode
        return fn(layer, batch, q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_kc=w_kc,
                  w_vc=w_vc)[0]

    f32, i32 = jnp.float32, jnp.int32
    shapes = [((B, WIDE), i32), ((B,), i32), ((B,), i32), ((slots, r), f32), ((slots, dr), f32),
              ((T, Hh, dn), f32), ((T, Hh, dr), f32), ((T, r), f32), ((T, dr), f32),
              ((Hh, dn, r), f32), ((Hh, dv, r), f32)]
    return forward, [jax.ShapeDtypeStruct(s, d) for s, d in shapes]


def _avals(jaxpr):
    """Every intermediate's shape in ``jaxpr`` and the jaxprs nested in it (loop bodies)."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield eqn.primitive.name, getattr(v.aval, "shape", ())
        for p in eqn.params.values():
            for sub in (p if isinstance(p, tuple | list) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


@functools.cache
def _compiled_temp_bytes(impl, mode):
    forward, specs = _wide_forward(impl, mode)
    return jax.jit(forward).lower(*specs).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_a_64k_wide_forward_holds_no_buffer_with_the_width(mode):
    forward, specs = _wide_forward("blockwise", mode)
    jaxpr = jax.make_jaxpr(forward)(*specs).jaxpr
    wide = [(name, shape) for name, shape in _avals(jaxpr) if any(d >= WIDE for d in shape)]
    assert not wide, f"intermediates with the page-table width: {wide[:5]}"
    # The compiled forward's scratch: a few MiB, where the dense form needs hundreds.
    assert _compiled_temp_bytes("blockwise", mode) < 8 * 2**20


def test_the_dense_forward_of_the_same_shape_would_fail_the_bound():
    # The check above tells the forms apart: the oracle's scratch grows with the width.
    assert _compiled_temp_bytes("dense", "extend") > 64 * 2**20
