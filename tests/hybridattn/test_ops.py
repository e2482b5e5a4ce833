"""hybridattn.ops against independent references (mlx-lm) and its own algebraic properties."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridattn import ops, testing
from hybridattn.ops import kda

H, DK, DV = 2, 16, 8


def make_inputs(seed, B, T, H=H, Dk=DK, Dv=DV, gate_scale=1.0, dtype=jnp.float32):
    """Random KDA inputs with the model's conventions: l2-normalised q/k, Kimi-style gates."""
    ks = jax.random.split(jax.random.key(seed), 8)
    q = ops.l2norm(jax.random.normal(ks[0], (B, T, H, Dk)))
    k = ops.l2norm(jax.random.normal(ks[1], (B, T, H, Dk)))
    v = jax.random.normal(ks[2], (B, T, H, Dv))
    A_log = jnp.log(jax.random.uniform(ks[3], (H,), minval=1.0, maxval=16.0) * gate_scale)
    a = jax.random.normal(ks[4], (B, T, H, Dk))
    dt_bias = 0.5 * jax.random.normal(ks[5], (H * Dk,))
    g = ops.kda_gate(a, A_log, dt_bias)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    s0 = 0.5 * jax.random.normal(ks[7], (B, H, Dk, Dv))
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), g, cast(beta), s0


recurrent = jax.jit(ops.kda_recurrent)
chunked = jax.jit(ops.kda_chunked, static_argnames=("chunk_size", "return_chunk_states"))
decode = jax.jit(ops.kda_decode)


def assert_close(a, b, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol,
                               rtol=rtol)


# ------------------------------------------------------------------------------------------
# independent oracle: mlx-lm
# ------------------------------------------------------------------------------------------


@pytest.mark.mlx
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_recurrent_matches_mlx_gated_delta(lower_bound):
    import mlx.core as mx
    from mlx_lm.models import gated_delta

    B, T = 2, 37
    ks = jax.random.split(jax.random.key(1), 8)
    q = ops.l2norm(jax.random.normal(ks[0], (B, T, H, DK)))
    k = ops.l2norm(jax.random.normal(ks[1], (B, T, H, DK)))
    v = jax.random.normal(ks[2], (B, T, H, DV))
    a = jax.random.normal(ks[3], (B, T, H, DK))
    b = jax.random.normal(ks[4], (B, T, H))
    A_log = jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0))
    dt_bias = 0.3 * jax.random.normal(ks[6], (H * DK,))
    s0 = jax.random.normal(ks[7], (B, H, DK, DV))

    g = ops.kda_gate(a, A_log, dt_bias, lower_bound=lower_bound)
    o, s = ops.kda_recurrent(q, k, v, g, jax.nn.sigmoid(b), initial_state=s0)

    m = lambda x: mx.array(np.asarray(x))
    scale = DK**-0.5
    o_ref, s_ref = gated_delta.gated_delta_update(
        m(q * scale), m(k), m(v), m(a), m(b),
        m(A_log.reshape(H, 1)), m(dt_bias.reshape(H, DK)),
        state=m(jnp.swapaxes(s0, -1, -2)),  # mlx-lm keeps the state as [B, H, Dv, Dk]
        use_kernel=False, lower_bound=lower_bound,
    )
    assert_close(o, np.array(o_ref))
    assert_close(s, np.swapaxes(np.array(s_ref), -1, -2))


@pytest.mark.mlx
def test_recurrent_matches_mlx_ops_with_model_normalisation():
    """q/k normalised the way mlx-lm's Kimi-Linear does (``normalize_qk``) equal our l2norm."""
    import mlx.core as mx
    from mlx_lm.models import gated_delta

    B, T = 1, 20
    ks = jax.random.split(jax.random.key(2), 3)
    q_raw = jax.random.normal(ks[0], (B, T, H, DK))
    k_raw = jax.random.normal(ks[1], (B, T, H, DK))
    scale = DK**-0.5
    qm, km = gated_delta.normalize_qk(
        mx.array(np.asarray(q_raw)), mx.array(np.asarray(k_raw)), inv_scale=scale, eps=1e-6
    )
    assert_close(ops.l2norm(q_raw) * scale, np.array(qm), atol=1e-6)
    assert_close(ops.l2norm(k_raw), np.array(km), atol=1e-6)


@pytest.mark.mlx
def test_short_conv_matches_mlx_shortconv1d_with_carried_state():
    import mlx.core as mx
    from mlx_lm.models.kimi_linear import ShortConv1d

    B, T, Cch, K = 2, 11, 12, 4
    mx.random.seed(0)
    conv = ShortConv1d(Cch, K)
    w_mlx = np.array(conv.conv.weight)  # [C, K, 1]
    w_ckpt = jnp.asarray(np.moveaxis(w_mlx, 1, 2))  # checkpoint layout [C, 1, K]
    x = jax.random.normal(jax.random.key(3), (B, T, Cch))
    s0 = jax.random.normal(jax.random.key(4), (B, K - 1, Cch))

    # two segments with the state carried, on both sides
    y1, s1 = ops.short_conv(x[:, :7], w_ckpt, s0)
    y2, s2 = ops.short_conv(x[:, 7:], w_ckpt[:, 0, :], s1)
    r1, t1 = conv(mx.array(np.asarray(x[:, :7])), mx.array(np.asarray(s0)), None, None)
    r2, t2 = conv(mx.array(np.asarray(x[:, 7:])), t1, None, None)
    assert_close(y1, np.array(r1), atol=1e-6)
    assert_close(y2, np.array(r2), atol=1e-6)
    assert_close(s1, np.array(t1), atol=0)
    assert_close(s2, np.array(t2), atol=0)


# ------------------------------------------------------------------------------------------
# properties (f32)
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=3)
def window(x, start, length, bucket):
    """``x[:, start : start + length]`` zero-padded to ``bucket`` steps, with dynamic
    ``start``/``length`` so that one compiled function serves every window. Zero k, g and beta
    are neutral tokens: they leave the state unchanged, so references stay exact."""
    x = jnp.pad(x, [(0, 0), (0, bucket)] + [(0, 0)] * (x.ndim - 2))
    x = jax.lax.dynamic_slice_in_dim(x, start, bucket, axis=1)
    keep = jnp.arange(bucket) < length
    return jnp.where(keep.reshape((1, bucket) + (1,) * (x.ndim - 2)), x, 0)


packed_by_chunk = {
    C: jax.jit(functools.partial(ops.kda_chunked, chunk_size=C)) for C in (16, 32, 64)
}


@settings(max_examples=25)
@given(T=st.integers(1, 300), chunk_size=st.sampled_from([16, 32, 64]), seed=st.integers(0, 99))
def test_chunked_equals_recurrent(T, chunk_size, seed):
    """Every T in 1..300 through one compiled function per chunk size: the sequence is the
    first of two packed in a 300-token bucket."""
    *xs, s0 = make_inputs(seed, 1, 300)
    q, k, v, g, beta = (window(x, 0, T, 300) for x in xs)
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0)
    init = jnp.concatenate([s0, jnp.zeros_like(s0)])
    cu = jnp.array([0, T, 300], jnp.int32)
    o_c, s_c = packed_by_chunk[chunk_size](q, k, v, g, beta, initial_state=init, cu_seqlens=cu)
    assert_close(np.asarray(o_c)[:, :T], np.asarray(o_r)[:, :T], atol=2e-5, rtol=1e-4)
    assert_close(s_c[:1], s_r, atol=2e-5, rtol=1e-4)


@settings(max_examples=10)
@given(x=testing.kda_inputs(num_tokens=(300,), num_seqs=2, num_heads=H, head_k_dim=DK,
                            head_v_dim=DV, max_decay_rate=1000.0),
       chunk_size=st.sampled_from([16, 32, 64]))
def test_chunked_and_recurrent_equal_the_float64_reference(x, chunk_size):
    """Two packed sequences of any lengths (0 included), real gate magnitudes (exp(A_log) up
    to 1000): the packed chunked form and the lax.scan recurrence against NumPy's float64
    recurrence, through the compiled functions of the tests above."""
    o_ref, s_ref = testing.ref_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
                                   cu_seqlens=x.cu_seqlens)
    o, s = packed_by_chunk[chunk_size](x.q, x.k, x.v, x.g, x.beta,
                                       initial_state=x.initial_state, cu_seqlens=x.cu_seqlens)
    assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    assert_close(s, s_ref, atol=2e-5, rtol=1e-4)
    n = int(x.cu_seqlens[1])  # the first sequence alone, zero-padded (neutral tokens)
    first = (window(y, 0, n, 300) for y in (x.q, x.k, x.v, x.g, x.beta))
    o_r, s_r = recurrent(*first, initial_state=x.initial_state[:1])
    assert_close(np.asarray(o_r)[:, :n], o_ref[:, :n], atol=2e-5, rtol=1e-4)
    assert_close(s_r[0], s_ref[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (17, 16), (64, 64), (129, 32), (300, 64)])
def test_chunked_equals_recurrent_unpacked(T, chunk_size):
    """The plain (unpacked) path, including T < chunk_size and a partial tail chunk."""
    q, k, v, g, beta, s0 = make_inputs(T, 2, T)
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
    assert_close(s_c, s_r, atol=2e-5, rtol=1e-4)


# One compiled function serves every split of 160 packed tokens into 4 sequences.
packed = jax.jit(functools.partial(ops.kda_chunked, chunk_size=32, return_chunk_states=True))


def prefix_state(q, k, v, g, beta, state, length, bucket):
    """Run the first ``length`` tokens (B == 1) through the packed path, padded to ``bucket``
    tokens so that every ``length`` shares one compiled function."""
    return _prefix_state(q, k, v, g, beta, state, length, bucket)


@functools.partial(jax.jit, static_argnums=7)
def _prefix_state(q, k, v, g, beta, state, length, bucket):
    q, k, v, g, beta = (window(x, 0, length, bucket) for x in (q, k, v, g, beta))
    cu = jnp.stack([0, length, bucket]).astype(jnp.int32)
    init = jnp.concatenate([state, jnp.zeros_like(state)])
    o, final, _ = packed(q, k, v, g, beta, initial_state=init, cu_seqlens=cu)
    return o, final[:1]


@settings(max_examples=10)
@given(cuts=st.lists(st.integers(1, 95), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_split_and_carry_equals_one_shot(cuts, seed):
    T = 96
    q, k, v, g, beta, s0 = make_inputs(seed, 1, T)
    o_full, s_full = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=32)
    bounds = [0, *sorted(set(cuts)), T]
    state, outs = s0, []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        seg = lambda x: window(x, a, b - a, T)
        o, state = prefix_state(seg(q), seg(k), seg(v), seg(g), seg(beta), state, b - a, T)
        outs.append(np.asarray(o)[:, : b - a])
    assert_close(np.concatenate(outs, axis=1), o_full, atol=2e-5, rtol=1e-4)
    assert_close(state, s_full, atol=2e-5, rtol=1e-4)


@settings(max_examples=10)
@given(T=st.integers(1, 130), seed=st.integers(0, 99))
def test_prefill_then_decode_equals_longer_prefill(T, seed):
    q, k, v, g, beta, s0 = make_inputs(seed, 1, 160)
    o_long, s_long = prefix_state(q, k, v, g, beta, s0, T + 1, 160)
    _, s_T = prefix_state(q, k, v, g, beta, s0, T, 160)
    at_T = lambda x: jax.lax.dynamic_index_in_dim(x, T, axis=1, keepdims=False)
    o_1, s_1 = decode(at_T(q), at_T(k), at_T(v), at_T(g), at_T(beta), s_T)
    assert_close(o_1, at_T(o_long), atol=2e-5, rtol=1e-4)
    assert_close(s_1, s_long, atol=2e-5, rtol=1e-4)


@settings(max_examples=15)
@given(lens=st.lists(st.integers(0, 70), min_size=4, max_size=4).filter(lambda x: sum(x) <= 160),
       seed=st.integers(0, 99))
def test_packed_varlen_equals_per_sequence(lens, seed):
    T = 160
    q, k, v, g, beta, _ = make_inputs(seed, 1, T)
    init = 0.5 * jax.random.normal(jax.random.key(seed), (4, H, DK, DV))
    cu = np.concatenate([[0], np.cumsum(lens)])
    cu_full = jnp.asarray(np.append(cu[:-1], T) if cu[-1] < T else cu, jnp.int32)
    # tokens after the last sequence belong to it; make lens match cu_full
    lens = np.diff(np.asarray(cu_full))
    o, final, cs = packed(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_full)
    o, final, init = np.asarray(o), np.asarray(final), np.asarray(init)
    states, seq_ids, num_tokens = (np.asarray(x) for x in cs)

    def reference(a, t, n):
        """The recurrence over tokens [a, a + t) of the packed row, from ``init[n]``."""
        xs = (window(x, a, t, T) for x in (q, k, v, g, beta))
        o_r, s_r = recurrent(*xs, initial_state=jnp.asarray(init[n : n + 1]))
        return np.asarray(o_r)[:, :t], np.asarray(s_r)[0]

    for n in range(4):
        a, b = int(cu_full[n]), int(cu_full[n + 1])
        if a == b:
            assert_close(final[n], init[n], atol=0)
            continue
        o_r, s_r = reference(a, b - a, n)
        assert_close(o[:, a:b], o_r, atol=2e-5, rtol=1e-4)
        assert_close(final[n], s_r, atol=2e-5, rtol=1e-4)
        # chunk-boundary states of this sequence equal the recurrence stopped there
        owned = np.flatnonzero(seq_ids[0] == n)
        assert len(owned) == -(-int(lens[n]) // 32)
        for c in owned:
            assert_close(states[0, c], reference(a, int(num_tokens[0, c]), n)[1],
                         atol=2e-5, rtol=1e-4)


def test_chunk_states_without_cu_seqlens():
    q, k, v, g, beta, s0 = make_inputs(5, 2, 70)
    _, final, cs = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=32,
                           return_chunk_states=True)
    assert cs.states.shape == (2, 3, H, DK, DV)
    assert cs.num_tokens[0].tolist() == [32, 64, 70]
    _, s_32 = recurrent(q[:, :32], k[:, :32], v[:, :32], g[:, :32], beta[:, :32],
                        initial_state=s0)
    assert_close(cs.states[:, 0], s_32, atol=2e-5, rtol=1e-4)
    assert_close(cs.states[:, -1], final, atol=0)


@pytest.mark.parametrize("T", [1, 5, 64, 100])
def test_padded_rows_are_finite_and_neutral(T):
    """Rows of a padded batch (zeros everywhere) give finite output and keep their state."""
    q, k, v, g, beta, s0 = make_inputs(6, 2, T)
    zero = lambda x: x.at[1].set(0.0)
    o, s = chunked(zero(q), zero(k), zero(v), zero(g), zero(beta), initial_state=s0,
                   chunk_size=64)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert_close(s[1], s0[1], atol=0)
    # and garbage in a padded row does not leak into the live row
    o2, s2 = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert_close(o2[0], o[0], atol=0)
    assert_close(s2[0], s[0], atol=0)


def _loss(fn, w, q, k, v, g, beta, s0):
    o, s = fn(q, k, v, g, beta, initial_state=s0)
    return jnp.sum(o * w) + jnp.sum(s**2)


grad_chunked = jax.jit(jax.grad(functools.partial(
    _loss, functools.partial(ops.kda_chunked, chunk_size=16)), argnums=range(1, 7)))
grad_recurrent = jax.jit(jax.grad(functools.partial(_loss, ops.kda_recurrent),
                                  argnums=range(1, 7)))


@settings(max_examples=4)
@given(T=st.sampled_from([7, 40]), seed=st.integers(0, 99))
def test_grad_chunked_equals_grad_recurrent(T, seed):
    q, k, v, g, beta, s0 = make_inputs(seed, 1, T)
    w = jax.random.normal(jax.random.key(seed + 1), (1, T, H, DV))
    gc = grad_chunked(w, q, k, v, g, beta, s0)
    gr = grad_recurrent(w, q, k, v, g, beta, s0)
    for a, b in zip(gc, gr, strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------------------
# overflow with real gate magnitudes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_overflow_large_gates_finite_and_exact(chunk_size):
    B, T = 1, 200
    ks = jax.random.split(jax.random.key(7), 2)
    q, k, v, _, beta, s0 = make_inputs(8, B, T)
    A_log = jnp.log(jnp.array([1000.0, 3.0]))  # exp(A_log) up to 1000
    a = 3.0 * jax.random.normal(ks[0], (B, T, H, DK))
    g = ops.kda_gate(a, A_log, jnp.zeros(H * DK))
    g = jnp.maximum(g, -3000.0)
    assert float(g.min()) < -1000  # per-token |g| in the thousands
    cum = (-np.asarray(g[0, :chunk_size])).sum(0).max()
    assert cum > 1e4  # cumulative decay across one chunk far beyond exp's f32 range
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    assert np.isfinite(np.asarray(o_c)).all() and np.isfinite(np.asarray(s_c)).all()
    assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
    assert_close(s_c, s_r, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# dtypes, jit, errors
# ------------------------------------------------------------------------------------------


def test_bf16_inputs_f32_state():
    q, k, v, g, beta, s0 = make_inputs(9, 1, 50, dtype=jnp.bfloat16)
    o, s = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0)
    assert o_r.dtype == jnp.bfloat16 and s_r.dtype == jnp.float32
    assert_close(o, o_r, atol=2e-2, rtol=2e-2)
    assert_close(s, s_r, atol=1e-4, rtol=1e-3)


def test_kda_gate_formulas():
    a = jnp.array([[[-2.0, 0.0, 3.0]]])  # [1, H=1, Dk=3]
    A_log = jnp.log(jnp.array([[[[2.0]]]]))  # checkpoint shape [1, 1, H, 1]
    dt_bias = jnp.array([0.5, 0.5, 0.5])
    g = ops.kda_gate(a, A_log, dt_bias)
    assert_close(g[0, 0], -2.0 * np.log1p(np.exp(np.array([-1.5, 0.5, 3.5]))), atol=1e-6)
    g_lb = ops.kda_gate(a, A_log, dt_bias, lower_bound=-5.0)
    assert_close(g_lb[0, 0], -5.0 / (1 + np.exp(-2.0 * np.array([-1.5, 0.5, 3.5]))), atol=1e-6)
    with pytest.raises(ValueError, match="A_log"):
        ops.kda_gate(a, jnp.zeros(2), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        ops.kda_gate(a, jnp.zeros(1), jnp.zeros(4))


def test_l2norm():
    x = jnp.array([[3.0, 4.0], [0.0, 0.0]])
    assert_close(ops.l2norm(x, eps=0.0)[0], [0.6, 0.8])
    assert np.isfinite(np.asarray(ops.l2norm(x)[1])).all()


def test_short_conv_packed_equals_per_sequence():
    K, Cch = 4, 6
    w = jax.random.normal(jax.random.key(10), (Cch, K))
    x = jax.random.normal(jax.random.key(11), (1, 12, Cch))
    cu = jnp.array([0, 2, 2, 9, 12])
    s0 = jax.random.normal(jax.random.key(12), (4, K - 1, Cch))
    y, s = jax.jit(ops.short_conv)(x, w, s0, cu)
    for n in range(4):
        a, b = int(cu[n]), int(cu[n + 1])
        y_n, s_n = ops.short_conv(x[:, a:b], w, s0[n : n + 1])
        assert_close(y[:, a:b], y_n, atol=1e-6)
        assert_close(s[n], s_n[0], atol=1e-6)


def test_clear_errors():
    q, k, v, g, beta, s0 = make_inputs(0, 1, 10)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.kda_chunked(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="initial_state"):
        ops.kda_chunked(q, k, v, g, beta, initial_state=jnp.concatenate([s0, s0]))
    with pytest.raises(ValueError, match="one state per sequence"):
        ops.kda_chunked(q, k, v, g, beta, initial_state=s0, cu_seqlens=jnp.array([0, 4, 10]))
    with pytest.raises(ValueError, match="B == 1"):
        ops.kda_chunked(jnp.concatenate([q, q]), jnp.concatenate([k, k]),
                        jnp.concatenate([v, v]), jnp.concatenate([g, g]),
                        jnp.concatenate([beta, beta]), cu_seqlens=jnp.array([0, 10]))
    with pytest.raises(ValueError, match="conv weight"):
        ops.short_conv(jnp.zeros((1, 3, 4)), jnp.zeros((5, 4)))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "cu_seqlens"])
def test_kernels_compose_with_shard_map_over_heads(packed):
    """Heads are independent: each kernel runs under ``jax.shard_map`` with heads split over
    two CPU devices (the scan carries must vary over the mesh axis like the inputs) and equals
    the unsharded kernel, initial state given or not."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("h",))
    B, T = (1, 40) if packed else (2, 40)
    q, k, v, g, beta, s0 = make_inputs(3, B, T)
    cu = jnp.array([0, 7, 7, 40]) if packed else None
    if packed:
        s0 = jnp.concatenate([s0, s0, s0])[:3]
    tok, state = P(None, None, "h"), P(None, "h")
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = [put(x, tok) for x in (q, k, v, g, beta)]

    def sharded(fn, with_state):
        body = lambda q, k, v, g, b, s: fn(q, k, v, g, b, initial_state=s if with_state else None)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 5 + (state,),
                                     out_specs=(tok, state)))

    kernels = {"chunked": functools.partial(ops.kda_chunked, chunk_size=16, cu_seqlens=cu)}
    if not packed:
        kernels["recurrent"] = ops.kda_recurrent
    for name, fn in kernels.items():
        for with_state in (False, True):
            o, s = sharded(fn, with_state)(*args, put(s0, state))
            o_ref, s_ref = fn(q, k, v, g, beta, initial_state=s0 if with_state else None)
            assert_close(o, o_ref, atol=1e-5), (name, with_state)
            assert_close(s, s_ref, atol=1e-5), (name, with_state)


# ------------------------------------------------------------------------------------------
# the benchmark's FLOP count
# ------------------------------------------------------------------------------------------


def _dot_flops(jaxpr) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of every ``dot_general`` in a jaxpr, through
    nested jaxprs, with a scan's body counted ``length`` times."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[d] for d in contract]))
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)  # a ClosedJaxpr or a Jaxpr
            if hasattr(sub, "eqns"):
                total += times * _dot_flops(sub)
    return total


@pytest.mark.parametrize(("T", "C", "Dv"), [(256, 64, 128), (128, 32, 64), (512, 128, 128)])
def test_bench_flop_count_matches_the_kernels_matmuls(T, C, Dv):
    """``bench kda`` reports a share of the matmul peak from ``chunked_flops``: it must count
    the matmuls that ``kda_chunked`` actually runs (read from its program, scan trip counts
    included). The few s x s products of the smallest blocks run as multiply-reduce and the
    formula's closed forms round the block sums, so the two agree to within 1%."""
    from hybridattn.bench.kda import chunked_flops

    Hb, Dk = 4, 128
    q, k, v, g, beta, _ = make_inputs(0, 1, T, H=Hb, Dk=Dk, Dv=Dv)
    jaxpr = jax.make_jaxpr(functools.partial(ops.kda_chunked, chunk_size=C))(q, k, v, g, beta)
    counted = _dot_flops(jaxpr.jaxpr)
    assert counted == pytest.approx(chunked_flops(T, Hb, Dk, Dv, C), rel=0.01)


@pytest.mark.parametrize("steps", [0, 3, 7])
def test_recurrence_stopped_after_the_last_live_token_equals_the_whole_recurrence(steps):
    """``ops.kda.recurrent_steps`` (the CPU short-extend path of ``KDAAttnBackend``) over the
    first ``steps`` tokens, the rest neutral (``q = k = v = g = beta = 0``): the state and the
    outputs are ``kda_recurrent``'s over all of them (bit for bit on a CPU; to rounding
    elsewhere)."""
    q, k, v, g, beta, s0 = make_inputs(5, 2, 7)
    live = (jnp.arange(7) < steps)[None, :, None]
    q, k, v, g = (jnp.where(live[..., None], x, 0) for x in (q, k, v, g))
    beta = jnp.where(live, beta, 0)
    want_o, want_s = ops.kda_recurrent(q, k, v, g, beta, initial_state=s0)
    t_major = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    o, s = jax.jit(kda.recurrent_steps)(*map(t_major, (q, k, v, g, beta)), s0, steps)
    np.testing.assert_allclose(np.asarray(jnp.moveaxis(o, 0, 1)), np.asarray(want_o), atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), atol=1e-6)
