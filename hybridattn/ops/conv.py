"""The short depthwise causal convolution every KDA layer runs on q, k and v before
the recurrence (with its state: the last ``K - 1`` inputs of each sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybridattn.ops.kda import _packed_positions

__all__ = [
    "short_conv",
]

# --------------------------------------------------------------------------------------------
# short convolution
# --------------------------------------------------------------------------------------------


def _conv_weight(weight, C):
    w = weight
    if w.ndim == 3:  # checkpoint layout [C, 1, K]
        if w.shape[1] != 1:
            raise ValueError(f"conv weight of shape {weight.shape}: expected [C, 1, K] or [C, K]")
        w = w[:, 0, :]
    if w.ndim != 2 or w.shape[0] != C:
        raise ValueError(f"conv weight of shape {weight.shape} does not match C={C}")
    if w.shape[1] < 2:
        raise ValueError(f"conv kernel size must be >= 2, got weight shape {weight.shape}")
    return w.astype(jnp.float32)


def short_conv(
    x: Float[Array, "B T C"],
    weight: Float[Array, "..."],
    state: Float[Array, "N Km1 C"] | None = None,
    cu_seqlens: Int[Array, " Np1"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "N Km1 C"]]:
    """Depthwise causal convolution of kernel ``K`` followed by SiLU.

    ``weight`` is ``[C, K]`` (or the checkpoint's ``[C, 1, K]``); ``y_t = silu(sum_j w[:, j]
    * x_{t-K+1+j})`` where inputs before the start come from ``state`` (the last ``K - 1``
    inputs, ``[B, K-1, C]``, zeros if ``None``). Returns ``(y, new_state)``. With
    ``cu_seqlens`` (``B == 1``, ``N`` packed sequences) ``state`` and ``new_state`` are
    ``[N, K-1, C]`` and no sequence sees another's inputs.

    >>> y, s = short_conv(jnp.ones((1, 5, 3)), jnp.ones((3, 4)))
    >>> y.shape, s.shape
    ((1, 5, 3), (1, 3, 3))
    """
    B, T, C = x.shape
    w = _conv_weight(weight, C)
    K = w.shape[1]
    xf = x.astype(jnp.float32)
    if cu_seqlens is None:
        if state is None:
            state = jnp.zeros((B, K - 1, C), x.dtype)
        if state.shape != (B, K - 1, C):
            raise ValueError(f"conv state has shape {state.shape}, expected {(B, K - 1, C)}")
        full = jnp.concatenate([state.astype(jnp.float32), xf], axis=1)  # [B, K-1+T, C]
        y = sum(full[:, j : j + T] * w[:, j] for j in range(K))
        new_state = full[:, T:].astype(x.dtype)
        return jax.nn.silu(y).astype(x.dtype), new_state

    cu, seq, local = _packed_positions(cu_seqlens, B, T)
    N = cu.shape[0] - 1
    if state is None:
        state = jnp.zeros((N, K - 1, C), x.dtype)
    if state.shape != (N, K - 1, C):
        raise ValueError(f"conv state has shape {state.shape}, expected {(N, K - 1, C)}")
    st = state.astype(jnp.float32)
    tok = jnp.arange(T, dtype=jnp.int32)

    def lookback(s):
        """Input ``s`` steps before each token (``s >= 1``), from x or from the state."""
        from_x = xf[0, jnp.clip(tok - s, 0, T - 1)]
        from_state = st[seq, jnp.clip(K - 1 + local - s, 0, K - 2)]
        return jnp.where((local - s >= 0)[:, None], from_x, from_state)

    y = xf[0] * w[:, K - 1]
    for s in range(1, K):
        y = y + lookback(s) * w[:, K - 1 - s]
    # New state: the last K-1 inputs of [state, x_seq] for every sequence.
    lens = cu[1:] - cu[:-1]
    m = jnp.arange(K - 1, dtype=jnp.int32)
    pos = lens[:, None] - (K - 1) + m[None, :]  # local positions, may be negative
    from_x = xf[0, jnp.clip(cu[:-1, None] + pos, 0, T - 1)]
    from_state = st[jnp.arange(N)[:, None], jnp.clip(K - 1 + pos, 0, K - 2)]
    new_state = jnp.where((pos >= 0)[..., None], from_x, from_state).astype(x.dtype)
    return jax.nn.silu(y)[None].astype(x.dtype), new_state
