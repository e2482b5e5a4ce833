"""Backends: the seed's test plan TP-1..TP-6, and real-backend correctness.

References: MLA against dense causal attention on K/V decompressed from the same latents (numpy);
KDA against per-request ``short_conv`` + ``kda_recurrent`` over the whole sequence; mixed and
padded batches against each request run alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import Harness, two_layer_config

from hybridattn.backends import (
    BatchRequest,
    ForwardMode,
    FullAttnMetadata,
    HybridLinearAttentionBackendMetadata,
    HybridLinearAttnBackend,
    KDAAttnBackend,
    LinearAttnMetadata,
    MLAAttnBackend,
    attn_backend_wrapper,
    check_forward_batch,
    make_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M
from hybridattn.ops import kda_recurrent, l2norm, short_conv

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
# ---------------------------------------------------------------------------------------------
# TP-1 .. TP-6: the hybrid backend's contracts
# ---------------------------------------------------------------------------------------------


def test_tp1_metadata_aggregates_sub_backends():
    h = Harness(KimiLinearConfig.tiny())
    fb = h.batch([("a", [1, 2, 3]), ("b", [4, 5])], B=4, T=8)
    md = h.backend.get_forward_metadata(fb)
    assert isinstance(md, HybridLinearAttentionBackendMetadata)
    assert isinstance(md.full_attn_metadata, FullAttnMetadata)
    assert isinstance(md.linear_attn_metadata, LinearAttnMetadata)
    want_full = h.backend.full_attn_backend.get_forward_metadata(fb)
    want_lin = h.backend.linear_attn_backend.get_forward_metadata(fb)
    for got, want in ((md.full_attn_metadata, want_full), (md.linear_attn_metadata, want_lin)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    # and the values are what the batch says
    np.testing.assert_array_equal(md.full_attn_metadata.query_start_loc, [0, 3, 5, 5, 5])
    np.testing.assert_array_equal(md.linear_attn_metadata.cu_seqlens, [0, 3, 5, 5, 5, 8])
    np.testing.assert_array_equal(md.linear_attn_metadata.state_indices[2:], [0, 0])


def test_tp2_with_forward_metadata_splits_by_field():
    h = Harness(KimiLinearConfig.tiny())
    fb = h.batch([("a", [1, 2, 3])])
    md = h.backend.get_forward_metadata(fb)
    bound = h.backend.with_forward_metadata(md)
    assert bound.full_attn_backend.forward_metadata is md.full_attn_metadata
    assert bound.linear_attn_backend.forward_metadata is md.linear_attn_metadata
    assert bound.forward_metadata.full_attn_metadata is md.full_attn_metadata
    assert bound.forward_metadata.linear_attn_metadata is md.linear_attn_metadata
    # functional: the original is untouched
    assert h.backend.full_attn_backend.forward_metadata is None
    assert h.backend.linear_attn_backend.forward_metadata is None
    with pytest.raises(TypeError, match="HybridLinearAttentionBackendMetadata"):
        h.backend.with_forward_metadata(md.full_attn_metadata)


class Recorder:
    """A stand-in sub-backend that records calls (and optionally delegates to a real one)."""

    def __init__(self, name, log, inner=None, max_requests=7):
        self.name, self.log, self.inner, self.max_requests = name, log, inner, max_requests
        self.forward_metadata = None

    def get_forward_metadata(self, batch):
        return self.inner.get_forward_metadata(batch) if self.inner else f"{self.name}-md"

    def with_forward_metadata(self, md):
        new = Recorder(self.name, self.log, self.inner, self.max_requests)
        new.forward_metadata = md
        if self.inner is not None:
            new.inner = self.inner.with_forward_metadata(md)
        return new

    def _call(self, kind, layer, batch, **inputs):
        self.log.append((self.name, kind, getattr(layer, "layer_id", layer)))
        if self.inner is None:
            return kind, batch
        return getattr(self.inner, kind)(layer, batch, **inputs)

    def forward_extend(self, layer, batch, **inputs):
        return self._call("forward_extend", layer, batch, **inputs)

    def forward_decode(self, layer, batch, **inputs):
        return self._call("forward_decode", layer, batch, **inputs)

    def get_max_running_requests(self, max_context_len, page_size):
        return self.max_requests


class Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


@pytest.mark.parametrize("mode", [EXTEND, DECODE])
def test_tp3_dispatch_on_layer_id(mode):
    log = []
    hy = HybridLinearAttnBackend(Recorder("full", log), Recorder("linear", log), (3, 7))
    fake = type("B", (), {"forward_mode": mode})()
    kind = "forward_decode" if mode == DECODE else "forward_extend"
    for i in range(9):
        out, _ = hy(Layer(i), fake)
        assert out == kind
    assert [e[0] for e in log] == ["full" if i in (3, 7) else "linear" for i in range(9)]
    assert sum(e[0] == "full" for e in log) == 2 and sum(e[0] == "linear" for e in log) == 7
    assert {e[1] for e in log} == {kind}
    hy(5, fake)  # a bare int layer id works too
    assert log[-1] == ("linear", kind, 5)


def test_tp4_max_running_requests_is_the_min():
    log = []
    for a, b in ((3, 9), (9, 3), (4, 4)):
        hy = HybridLinearAttnBackend(
            Recorder("full", log, max_requests=a), Recorder("linear", log, max_requests=b), (1,)
        )
        assert hy.get_max_running_requests(1024, 1) == min(a, b)
    # real sub-backends: 1023 usable token slots / 256 context = 3, 5 usable state slots
    cfg = KimiLinearConfig.tiny()
    real = attn_backend_wrapper(cfg, MLAAttnBackend.from_config(cfg, 1024), num_state_slots=6)
    assert real.full_attn_backend.get_max_running_requests(256, 1) == 3
    assert real.linear_attn_backend.get_max_running_requests(256, 1) == 5
    assert real.get_max_running_requests(256, 1) == 3
    assert real.get_max_running_requests(100, 16) == 5  # 1008 // 100 = 10 > 5


def test_tp5_wrapper_builds_the_hybrid_from_config():
    cfg = two_layer_config()
    assert cfg.full_attention_layer_ids == (1,) and cfg.is_kda_layer(0)
    full = MLAAttnBackend.from_config(cfg, 64)
    hy = attn_backend_wrapper(cfg, full, num_state_slots=4)
    assert isinstance(hy, HybridLinearAttnBackend)
    assert isinstance(hy.full_attn_backend, MLAAttnBackend)
    assert isinstance(hy.linear_attn_backend, KDAAttnBackend)
    assert hy.full_attn_layers == cfg.full_attention_layer_ids == (1,)
    assert hy.linear_attn_backend.layer_ids == (0,)
    # a model without KDA layers keeps its full-attention backend
    all_mla = KimiLinearConfig.tiny(num_hidden_layers=1, full_attention_layer_ids=(0,),
                                    kda_layer_ids=())
    assert attn_backend_wrapper(all_mla, full) is full
    with pytest.raises(ValueError, match="num_state_slots"):
        attn_backend_wrapper(cfg, full)


def test_tp6_two_layer_forward_calls_each_sub_backend_once_in_order():
    cfg = two_layer_config()
    h = Harness(cfg)
    log = []
    real = h.backend
    h.backend = HybridLinearAttnBackend(
        Recorder("full", log, real.full_attn_backend),
        Recorder("linear", log, real.linear_attn_backend),
        real.full_attn_layers,
    )
    params = M.init_params(cfg, jax.random.key(0))
    fb = h.batch([("a", [5, 6, 7, 8]), ("b", [9, 10])])
    bound = h.bind(fb)  # the recorders are Python objects: close over them and trace once
    hidden, fb = jax.jit(lambda p, fb: M.forward(p, cfg, bound, fb))(params, fb)
    assert log == [("linear", "forward_extend", 0), ("full", "forward_extend", 1)]
    assert hidden.shape == (6, cfg.hidden_size) and bool(jnp.isfinite(hidden).all())


# ---------------------------------------------------------------------------------------------
# real backends against references
# ---------------------------------------------------------------------------------------------


def _mla_inputs(cfg, key, n):
    H, dn, dr, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                    cfg.kv_lora_rank)
    ks = jax.random.split(key, 4)
    return dict(
        q_nope=jax.random.normal(ks[0], (n, H, dn)), q_pe=jax.random.normal(ks[1], (n, H, dr)),
        c_kv=jax.random.normal(ks[2], (n, r)), k_pe=jax.random.normal(ks[3], (n, dr)),
    )


def _dense_mla(x, w_kc, w_vc, scale):
    """Causal attention over K/V decompressed from the latents, in numpy float64."""
    x = {k: np.asarray(v, np.float64) for k, v in x.items()}
    w_kc, w_vc = np.asarray(w_kc, np.float64), np.asarray(w_vc, np.float64)
    k_nope = np.einsum("nr,hdr->nhd", x["c_kv"], w_kc)
    v = np.einsum("nr,hdr->nhd", x["c_kv"], w_vc)
    s = np.einsum("qhd,khd->hqk", x["q_nope"], k_nope) + np.einsum(
        "qhd,kd->hqk", x["q_pe"], x["k_pe"])
    s = s * scale + np.triu(np.full(s.shape[1:], -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def test_mla_extend_with_prefix_and_decode_equal_dense_attention():
    cfg = KimiLinearConfig.tiny()
    h = Harness(cfg)
    L = cfg.full_attention_layer_ids[0]
    mla = h.backend.full_attn_backend
    H, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kw, kv_ = jax.random.split(jax.random.key(1))
    w_kc = 0.3 * jax.random.normal(kw, (H, dn, r))
    w_vc = 0.3 * jax.random.normal(kv_, (H, dv, r))
    total = {"a": 14, "b": 9, "c": 5}
    data = {n: _mla_inputs(cfg, jax.random.key(10 + i), t)
            for i, (n, t) in enumerate(total.items())}
    got = {n: [] for n in total}
    # step 1: ragged extend (a: 6, b: 9) padded; step 2: a continues (prefix 6) + c fresh;
    # steps 3-4: decode a and c.
    plan = [
        (EXTEND, [("a", 0, 6), ("b", 0, 9)], dict(B=4, T=20, W=32, Q=12)),
        (EXTEND, [("a", 6, 12), ("c", 0, 4)], dict(B=4, T=20, W=32, Q=12)),
        (DECODE, [("a", 12, 13), ("c", 4, 5)], dict(B=3, T=3, W=32)),
        (DECODE, [("a", 13, 14)], dict(B=3, T=3, W=32)),
    ]
    jcall = jax.jit(lambda be, fb, x: be(L, fb, **x, w_kc=w_kc, w_vc=w_vc))
    for mode, items, kw in plan:
        fb = h.batch([(n, list(range(lo, hi))) for n, lo, hi in items], mode=mode, **kw)
        T = fb.num_tokens
        x = {k: jnp.concatenate([data[n][k][lo:hi] for n, lo, hi in items]
                                + [jnp.zeros((T - sum(hi - lo for _, lo, hi in items),)
                                             + data["a"][k].shape[1:])])
             for k in data["a"]}
        out, fb = jcall(h.bind(fb), fb, x)
        assert bool(jnp.isfinite(out).all())
        off = 0
        for n, lo, hi in items:
            got[n].append(out[off: off + hi - lo])
            off += hi - lo
        h.absorb(fb)
    for n in ("a", "c"):
        want = _dense_mla(data[n], w_kc, w_vc, mla.scale)
        np.testing.assert_allclose(np.concatenate(got[n]), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got["b"][0], _dense_mla(data["b"], w_kc, w_vc, mla.scale),
                               rtol=2e-5, atol=2e-5)


def _kda_inputs(cfg, key, n):
    H, Dk = cfg.linear_num_heads, cfg.linear_head_dim
    ks = jax.random.split(key, 5)
    return dict(
        q=jax.random.normal(ks[0], (n, H * Dk)), k=jax.random.normal(ks[1], (n, H * Dk)),
        v=jax.random.normal(ks[2], (n, H * Dk)),
        g=-jnp.exp(jax.random.normal(ks[3], (n, H, Dk)) - 1.0),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (n, H))),
    )


@jax.jit
def _kda_reference_padded(x, conv):
    mixed = jnp.concatenate([x["q"], x["k"], x["v"]], -1)[None]
    weight = jnp.concatenate([c[:, 0, :] for c in conv], 0)
    y, _ = short_conv(mixed, weight)
    n, H, Dk = x["g"].shape
    q, k, v = (t.reshape(1, n, H, Dk) for t in jnp.split(y[0], 3, -1))
    o, _ = kda_recurrent(l2norm(q), l2norm(k), v, x["g"][None], x["beta"][None])
    return o[0]


def _kda_reference(x, conv, pad_to=32):
    """One request's whole sequence: conv from zero state, l2norm, recurrent KDA (causal, so
    padding the tail to a fixed length leaves the first ``n`` outputs alone)."""
    n = x["q"].shape[0]
    padded = {k: jnp.pad(v, [(0, pad_to - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in x.items()}
    return np.asarray(_kda_reference_padded(padded, conv)[:n])


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_kda_ragged_batch_with_prefix_state_equals_per_request_recurrent(form, monkeypatch):
    """Both forms of the extend: ``kda_chunked`` over the packed requests, and on a CPU for
    short extends (``RECURRENT_MAX_EXTEND``) ``kda_recurrent`` over them side by side."""
    from hybridattn.backends import kda as B

    monkeypatch.setattr(B, "RECURRENT_MAX_EXTEND", 0 if form == "chunked" else 64)
    cfg = KimiLinearConfig.tiny()
    h = Harness(cfg, chunk=8)
    L = cfg.kda_layer_ids[1]
    H, Dk, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    conv = [0.5 * jax.random.normal(jax.random.key(i), (H * Dk, 1, K)) for i in range(3)]
    cw = dict(q_conv=conv[0], k_conv=conv[1], v_conv=conv[2])
    total = {"a": 30, "b": 11, "c": 19, "d": 3}
    data = {n: _kda_inputs(cfg, jax.random.key(20 + i), t)
            for i, (n, t) in enumerate(total.items())}
    got = {n: [] for n in total}
    plan = [
        # a and b start; padded rows and tokens
        (EXTEND, [("a", 0, 13), ("b", 0, 11)], dict(B=4, T=32)),
        # a continues from its cached state, c and d are fresh (mixed prefix / no prefix)
        (EXTEND, [("c", 0, 19), ("a", 13, 29), ("d", 0, 2)], dict(B=5, T=48)),
        (DECODE, [("a", 29, 30), ("d", 2, 3)], dict(B=3, T=3)),
    ]
    jcall = jax.jit(lambda be, fb, x: be(L, fb, **x, **cw))
    for mode, items, kw in plan:
        fb = h.batch([(n, list(range(lo, hi))) for n, lo, hi in items], mode=mode, **kw)
        T = fb.num_tokens
        pad = T - sum(hi - lo for _, lo, hi in items)
        x = {k: jnp.concatenate([data[n][k][lo:hi] for n, lo, hi in items]
                                + [jnp.ones((pad,) + data["a"][k].shape[1:])])
             for k in data["a"]}
        live = sorted({h.req.req_to_state[h.rows[n]].item() for n in h.rows} - {0})
        other = [s for s in live if s not in {h.req.req_to_state[h.rows[n]].item()
                                              for n, _, _ in items}]
        before = [np.asarray(a[jnp.asarray(other, jnp.int32)]) for a in
                  (h.st.ssm[0], h.st.conv[0], h.st.ssm[1], h.st.conv[1])] if other else None
        out, fb = jcall(h.bind(fb), fb, x)
        assert bool(jnp.isfinite(out).all())  # padded rows included
        off = 0
        for n, lo, hi in items:
            got[n].append(out[off: off + hi - lo])
            off += hi - lo
        h.absorb(fb)
        if before is not None:  # requests not in this batch keep their states bit for bit
            after = [np.asarray(a[jnp.asarray(other, jnp.int32)]) for a in
                     (h.st.ssm[0], h.st.conv[0], h.st.ssm[1], h.st.conv[1])]
            for b_, a_ in zip(before, after, strict=True):
                np.testing.assert_array_equal(b_, a_)
    for n in total:
        want = _kda_reference(data[n], conv)
        np.testing.assert_allclose(np.concatenate(got[n]), want, rtol=1e-4, atol=1e-4,
                                   err_msg=f"request {n}")


# ---------------------------------------------------------------------------------------------
# the whole hybrid forward
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    cfg = KimiLinearConfig.tiny()
    return cfg, M.init_params(cfg, jax.random.key(3))


TRACES = []  # one entry per trace of _run
EXT = dict(B=4, T=16, W=32, Q=16)  # the shape buckets these tests share (compiled once)
DEC = dict(B=4, T=4, W=32)


@jax.jit
def _run(params, backend, fb):
    TRACES.append(1)
    backend = backend.with_forward_metadata(backend.get_forward_metadata(fb))
    return M.forward(params, KimiLinearConfig.tiny(), backend, fb)


def test_mixed_extend_and_decode_batch_equals_each_request_alone(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(0)
    prompt_a = rng.integers(1, cfg.vocab_size, 9).tolist()
    prompt_b = rng.integers(1, cfg.vocab_size, 6).tolist()
    nxt = [17]

    # alone: a's prompt, then a's decode step; b's prompt
    alone = Harness(cfg)
    _, fb = _run(params, alone.backend, alone.batch([("a", prompt_a)], **EXT))
    alone.absorb(fb)
    h_a_dec, fb = _run(params, alone.backend, alone.batch([("a", nxt)], mode=DECODE, **DEC))
    solo_b = Harness(cfg)
    h_b, _ = _run(params, solo_b.backend, solo_b.batch([("b", prompt_b)], **EXT))

    # mixed: a's prompt alone, then [a decodes one token, b prefills] in one EXTEND batch
    mixed = Harness(cfg)
    _, fb = _run(params, mixed.backend, mixed.batch([("a", prompt_a)], **EXT))
    mixed.absorb(fb)
    h_mix, fb = _run(params, mixed.backend, mixed.batch([("a", nxt), ("b", prompt_b)], **EXT))
    np.testing.assert_allclose(h_mix[0], h_a_dec[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(h_mix[1:7], h_b[:6], rtol=1e-4, atol=1e-4)
    assert bool(jnp.isfinite(h_mix).all())


def test_jit_layer_and_forward_do_not_retrace_for_new_metadata_values(tiny):
    cfg, params = tiny
    h = Harness(cfg)
    seen = []
    for items in ([("a", [1, 2, 3])], [("b", [4, 5, 6, 7, 8]), ("c", [9])],
                  [("a", [3, 3]), ("c", [1, 2, 3, 4, 5, 6, 7, 8])]):
        _, fb = _run(params, h.backend, h.batch(items, **EXT))
        h.absorb(fb)
        seen.append(len(TRACES))
    assert seen[0] == seen[1] == seen[2]  # traced at most once (maybe by an earlier test)

    layer_traces = []
    L = cfg.full_attention_layer_ids[0]
    p = params["model"]["layers"][L]["self_attn"]

    @jax.jit
    def layer_call(backend, fb, x):
        layer_traces.append(1)
        return M.mla_attention(p, cfg, L, x, backend, fb)

    x = jnp.ones((16, cfg.hidden_size))
    for items in ([("d", [1, 2])], [("d", [3]), ("e", [4, 5, 6])]):
        fb = h.batch(items, **EXT)
        _, fb = layer_call(h.bind(fb), fb, x)
        h.absorb(fb)
    assert len(layer_traces) == 1


def test_padded_rows_do_not_leak_into_live_requests(tiny):
    cfg, params = tiny
    ids = [11, 12, 13, 14, 15]
    tight, loose = Harness(cfg), Harness(cfg)
    fb = tight.batch([("a", ids)], B=1, T=5, W=8, Q=5)
    h1, _ = jax.jit(lambda p, fb: M.forward(p, cfg, tight.bind(fb), fb))(params, fb)
    h2, fb = _run(params, loose.backend, loose.batch([("a", ids)], **EXT))
    np.testing.assert_allclose(h2[:5], h1, rtol=1e-5, atol=1e-5)
    assert bool(jnp.isfinite(h2).all())


# ---------------------------------------------------------------------------------------------
# bad input at the host boundary
# ---------------------------------------------------------------------------------------------


def test_bad_batch_shapes_and_layer_ids_give_clear_errors(tiny):
    cfg, params = tiny
    h = Harness(cfg)
    fb = h.batch([("a", [1, 2, 3])], B=2, T=4)
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\), expected \(2,\)"):
        check_forward_batch(fb.replace(seq_lens=jnp.zeros(3, jnp.int32)))
    with pytest.raises(ValueError, match="out_cache_loc has shape"):
        check_forward_batch(fb.replace(out_cache_loc=jnp.zeros(5, jnp.int32)))
    with pytest.raises(ValueError, match="kv_width=0"):
        check_forward_batch(fb.replace(kv_width=0))
    with pytest.raises(ValueError, match="one token per request"):
        check_forward_batch(fb.replace(forward_mode=DECODE))
    with pytest.raises(ValueError, match="num_tokens=2 < 3"):
        h.batch([("b", [1, 2, 3])], T=2)

    be = h.bind(fb)
    L = cfg.kda_layer_ids[0]
    T, HD = 4, cfg.linear_num_heads * cfg.linear_head_dim
    p = params["model"]["layers"][L]["self_attn"]
    good = dict(q=jnp.zeros((T, HD)), k=jnp.zeros((T, HD)), v=jnp.zeros((T, HD)),
                g=jnp.zeros((T, cfg.linear_num_heads, cfg.linear_head_dim)),
                beta=jnp.zeros((T, cfg.linear_num_heads)),
                q_conv=p["q_conv1d"]["weight"], k_conv=p["k_conv1d"]["weight"],
                v_conv=p["v_conv1d"]["weight"])
    with pytest.raises(ValueError, match=r"layer 99 is not a KDA layer"):
        be(99, fb, **good)
    with pytest.raises(ValueError, match="layer id must be >= 0"):
        be(-1, fb, **good)
    with pytest.raises(ValueError, match=r"KDA layer 0: beta has shape \(4, 3\)"):
        be(0, fb, **dict(good, beta=jnp.zeros((4, 3))))
    mla_in = dict(_mla_inputs(cfg, jax.random.key(0), 4),
                  w_kc=jnp.zeros((cfg.num_attention_heads, cfg.qk_nope_head_dim, 7)),
                  w_vc=jnp.zeros((cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank)))
    with pytest.raises(ValueError, match=r"MLA layer 3: w_kc has shape"):
        be(cfg.full_attention_layer_ids[0], fb, **mla_in)
    with pytest.raises(ValueError, match="no forward metadata"):
        h.backend(cfg.full_attention_layer_ids[0], fb, **mla_in)


def test_make_forward_batch_rejects_rows_and_slots_that_would_corrupt_other_requests():
    cfg = KimiLinearConfig.tiny()
    h = Harness(cfg, max_reqs=4, max_ctx=16, slots=32)
    pools = dict(req_to_token_pool=h.req, token_to_kv_pool=h.kv, recurrent_state_pool=h.st)

    def build(*reqs, **kw):
        return make_forward_batch([BatchRequest(*r) for r in reqs], **pools, **kw)

    build((1, 0, [5, 6], [3, 4]))  # fine
    for reqs, match in [
        (((1, 0, [5], [0]),), r"token slot 0 must be in 1\.\.31"),
        (((1, 0, [5], [-3]),), r"token slot -3 must be in 1\.\.31"),
        (((1, 0, [5], [32]),), r"token slot 32 must be in 1\.\.31"),
        (((5, 0, [5], [3]),), r"req_index=5 must be in 1\.\.4"),
        (((0, 0, [5], [3]),), "row 0 is the padding row"),
        (((1, 0, [5], [3]), (1, 0, [6], [4])), "row 1 is also request 0"),
        (((1, 0, [5], [3]), (2, 0, [6], [3])), "token slot 3 is also used by request 0"),
        (((1, 15, [5, 6], [3, 4]),), "17 tokens exceed max_context_len=16"),
        (((1, 0, [5, 6], [3]),), "2 tokens but 1 slots"),
    ]:
        with pytest.raises(ValueError, match=match):
            build(*reqs)
    with pytest.raises(ValueError, match="DECODE batch takes one token"):
        build((1, 3, [5, 6], [3, 4]), forward_mode=DECODE)
    with pytest.raises(ValueError, match=r"extend_seq_lens > max_extend_len=1"):
        build((1, 0, [5, 6], [3, 4]), max_extend_len=1)
    with pytest.raises(ValueError, match=r"seq_lens > kv_width=4"):
        build((1, 3, [5, 6], [3, 4]), kv_width=4)


def test_backends_check_their_pools_and_batches_at_the_boundary():
    cfg = KimiLinearConfig.tiny()
    h = Harness(cfg)
    fb = h.batch([("a", [1, 2, 3])], B=2, T=4)
    with pytest.raises(ValueError, match=r"request 0 of the batch: extend_seq_lens > seq_lens"):
        h.backend.get_forward_metadata(fb.replace(extend_seq_lens=jnp.array([4, 0], jnp.int32)))
    with pytest.raises(ValueError, match="5 new tokens but T=4"):
        h.backend.get_forward_metadata(
            fb.replace(seq_lens=jnp.array([3, 2], jnp.int32),
                       extend_seq_lens=jnp.array([3, 2], jnp.int32)))
    wrong_mla = attn_backend_wrapper(cfg, MLAAttnBackend.from_config(cfg, 99),
                                     num_state_slots=h.req.num_state_slots)
    with pytest.raises(ValueError, match="num_token_slots=99 but the MLA pool has 256 slots"):
        wrong_mla.get_forward_metadata(fb)
    wrong_kda = attn_backend_wrapper(cfg, MLAAttnBackend.from_config(cfg, 256), num_state_slots=3)
    with pytest.raises(ValueError, match="num_state_slots=3 but the recurrent-state pool has 7"):
        wrong_kda.get_forward_metadata(fb)
