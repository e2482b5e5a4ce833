"""KDA: the ``kda_inputs`` strategy (``q, k, v, g, beta`` with real gate magnitudes, packed or
not) and its reference, ``ref_kda`` (the recurrence step by step in float64)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from hybridattn.testing.common import (
    SearchStrategy,
    checked_int,
    composite,
    int_tuple,
    st,
)


class KDAInputs(NamedTuple):
    """Drawn inputs of the KDA kernels (the layouts of ``hybridattn.ops``): ``q, k [B, T, H,
    Dk]`` (L2-normalised), ``v [B, T, H, Dv]``, ``g [B, T, H, Dk]`` (float32, ``<= 0``), ``beta
    [B, T, H]``, ``initial_state [N, H, Dk, Dv]`` (float32; ``N = B``, or the number of packed
    sequences) and ``cu_seqlens [N + 1]`` (``None`` unless packed).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(kda_inputs(num_tokens=(16,), num_seqs=2))
    ... def test_fields(x):
    ...     assert np.allclose(np.linalg.norm(x.q, axis=-1), 1, atol=1e-3)
    ...     assert (x.g <= 0).all() and x.initial_state.shape[0] == 2
    ...     assert int(x.cu_seqlens[0]) == 0 and int(x.cu_seqlens[-1]) == 16
    >>> test_fields()
    """

    q: Float[Array, "B T H Dk"]
    k: Float[Array, "B T H Dk"]
    v: Float[Array, "B T H Dv"]
    g: Float[Array, "B T H Dk"]
    beta: Float[Array, "B T H"]
    initial_state: Float[Array, "N H Dk Dv"]
    cu_seqlens: Int[Array, " Np1"] | None


def kda_inputs(
    *,
    batch_size: int = 1,
    num_tokens: Sequence[int] = (16, 64),
    num_seqs: int | None = None,
    num_heads: int = 2,
    head_k_dim: int = 16,
    head_v_dim: int = 8,
    max_decay_rate: float = 200.0,
    dtype=jnp.float32,
) -> SearchStrategy[KDAInputs]:
    """Inputs of the KDA kernels as the model produces them, as ``KDAInputs``.

    ``q`` and ``k`` are L2-normalised, ``v`` standard normal, ``beta = sigmoid(normal)``; ``g``
    is Kimi-Linear's gate ``-exp(A_log) * softplus(a + dt_bias)`` with a per-head decay rate
    ``exp(A_log)`` drawn up to 1, 16 or ``max_decay_rate`` (real checkpoints reach the hundreds:
    per-token ``|g|`` in the hundreds and chunk sums far past ``exp``'s float32 range). The
    initial state is zeros or normal with std 0.5. Values come from a drawn seed (computed in
    NumPy, not with ``hybridattn.ops``); shapes from the arguments only.

    Args:
        batch_size: ``B`` (must be 1 with ``num_seqs``).
        num_tokens: the bucket of ``T``.
        num_seqs: pack this many sequences of drawn lengths (0 included) into the ``T``
            tokens of one row, with ``cu_seqlens``; None: ``B`` rows of ``T`` tokens.
        num_heads: ``H``.
        head_k_dim: ``Dk``.
        head_v_dim: ``Dv``.
        max_decay_rate: the largest ``exp(A_log)`` drawn.
        dtype: the dtype of ``q, k, v, beta`` (``g`` and the state are float32).

    >>> from hypothesis import given, settings
    >>> import jax
    >>> from hybridattn.ops import kda_recurrent
    >>> recurrent = jax.jit(kda_recurrent)
    >>> @settings(max_examples=3, deadline=None)
    ... @given(kda_inputs(batch_size=2, num_tokens=(12,)))
    ... def test_recurrent_matches_ref(x):
    ...     o, s = recurrent(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state)
    ...     o_ref, s_ref = ref_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state)
    ...     np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-4)
    >>> test_recurrent_matches_ref()

    Packed: ``kda_inputs(num_tokens=(64,), num_seqs=3)`` draws three sequences of any lengths (0
    included) summing to 64, for ``kda_chunked(..., cu_seqlens=x.cu_seqlens)`` and
    ``ref_kda(..., cu_seqlens=x.cu_seqlens)``.
    """
    B = checked_int("batch_size", batch_size, 1)
    Ts = int_tuple("num_tokens", num_tokens)
    if num_seqs is not None:
        checked_int("num_seqs", num_seqs, 1)
        if B != 1:
            raise ValueError(f"packed sequences (num_seqs) need batch_size=1, got {B}")
    if not max_decay_rate >= 1.0:
        raise ValueError(f"max_decay_rate must be >= 1, got {max_decay_rate!r}")
    dims = (checked_int("num_heads", num_heads, 1), checked_int("head_k_dim", head_k_dim, 1),
            checked_int("head_v_dim", head_v_dim, 1))
    return _kda_inputs(B, Ts, num_seqs, dims, float(max_decay_rate), dtype)


@composite
def _kda_inputs(draw, B, Ts, num_seqs, dims, max_decay_rate, dtype):
    H, Dk, Dv = dims
    T = draw(st.sampled_from(Ts), label="T")
    cu = None
    N = B
    if num_seqs is not None:
        cuts = draw(st.lists(st.integers(0, T), min_size=num_seqs - 1, max_size=num_seqs - 1),
                    label="cuts")
        cu = jnp.asarray([0, *sorted(cuts), T], jnp.int32)
        N = num_seqs
    rate = draw(st.sampled_from(sorted({1.0, min(16.0, max_decay_rate), max_decay_rate})),
                label="max decay rate")
    with_state = draw(st.booleans(), label="initial state")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = unit((B, T, H, Dk)), unit((B, T, H, Dk))
    v = rng.standard_normal((B, T, H, Dv))
    A = rng.uniform(1.0, rate, H)
    a = rng.standard_normal((B, T, H, Dk))
    dt_bias = 0.5 * rng.standard_normal((H, Dk))
    g = -A[:, None] * np.logaddexp(0.0, a + dt_bias)  # -exp(A_log) * softplus(a + dt_bias)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = 0.5 * rng.standard_normal((N, H, Dk, Dv)) if with_state else np.zeros((N, H, Dk, Dv))
    cast = lambda x: jnp.asarray(x.astype(np.float32), dtype)
    f32 = lambda x: jnp.asarray(x.astype(np.float32))
    return KDAInputs(cast(q), cast(k), cast(v), f32(g), cast(beta), f32(s0), cu)


def ref_kda(
    q: Float[ArrayLike, "B T H Dk"],
    k: Float[ArrayLike, "B T H Dk"],
    v: Float[ArrayLike, "B T H Dv"],
    g: Float[ArrayLike, "B T H Dk"],
    beta: Float[ArrayLike, "B T H"],
    scale: float | None = None,
    initial_state: Float[ArrayLike, "N H Dk Dv"] | None = None,
    cu_seqlens: Int[ArrayLike, " Np1"] | None = None,
) -> tuple[Float[np.ndarray, "B T H Dv"], Float[np.ndarray, "N H Dk Dv"]]:
    """The KDA recurrence, token by token, in NumPy float64: ``(o, final_state)``.

    Per head, with ``S`` the ``[Dk, Dv]`` state::

        S <- diag(exp(g_t)) S
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = scale * S^T q_t

    ``scale`` defaults to ``Dk ** -0.5``. With ``cu_seqlens`` (``B == 1``) the ``N`` packed
    sequences run separately, each from its own ``initial_state[n]`` (zeros if None), and the
    final states are per sequence. Slow and plain on purpose: an oracle for ``kda_recurrent``,
    ``kda_chunked`` and ``kda_decode``.

    >>> from hybridattn.ops import kda_recurrent
    >>> x = [jnp.full((1, 3, 1, 2), 0.5)] * 3 + [jnp.full((1, 3, 1, 2), -1.0),
    ...                                          jnp.full((1, 3, 1), 0.5)]
    >>> o, s = ref_kda(*x)
    >>> o.dtype, o.shape, s.shape
    (dtype('float64'), (1, 3, 1, 2), (1, 1, 2, 2))
    >>> bool(np.allclose(kda_recurrent(*x)[0], o, atol=1e-6))
    True
    """
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got B={B}")
        cu = np.asarray(cu_seqlens).astype(np.int64).tolist()
        if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
        spans = [(0, a, b) for a, b in zip(cu, cu[1:], strict=False)]
    N = len(spans)
    states = (np.zeros((N, H, Dk, Dv)) if initial_state is None
              else np.array(initial_state, np.float64))
    if states.shape != (N, H, Dk, Dv):
        raise ValueError(f"initial_state has shape {states.shape}, expected {(N, H, Dk, Dv)}")
    o = np.zeros((B, T, H, Dv))
    for n, (b, start, end) in enumerate(spans):
        S = states[n]
        for t in range(start, end):
            S = S * np.exp(g[b, t])[:, :, None]
            u = beta[b, t][:, None] * (v[b, t] - np.einsum("hk,hkv->hv", k[b, t], S))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = scale * np.einsum("hk,hkv->hv", q[b, t], S)
        states[n] = S
    return o, states
