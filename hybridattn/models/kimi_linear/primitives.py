"""The small pieces every layer is built of: RMS norm, a linear map in the checkpoint's
``[out, in]`` layout, and the ``Params`` alias (a nested dict).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = [
    "rms_norm",
]

Params = dict

# Shape aliases:
#   B, T  sequences and their tokens (``apply``); T is also the tokens of a serving batch
#   N     tokens, flattened (MLP / MoE inputs); D hidden size; V vocabulary
#   k     experts per token; H heads


def rms_norm(
    x: Float[Array, "*batch D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "*batch D"]:
    """``x / rms(x) * weight`` over the last axis, in f32, returned in ``x.dtype``.

    >>> x = jnp.array([[2.0, -2.0], [4.0, 4.0]])
    >>> rms_norm(x, jnp.array([1.0, 0.5]), eps=0.0).tolist()
    [[1.0, -0.5], [1.0, 0.5]]
    >>> rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), eps=1e-5).dtype
    dtype(bfloat16)
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def _linear(x, p):
    return x @ p["weight"].T.astype(x.dtype)
