"""Sampling on the device: each request's next token from its logits, with keys that depend
on the request's seed and position only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key

__all__ = [
    "request_keys",
    "sample",
    "token_logprobs",
]

# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def token_logprobs(
    logits: Float[Array, "B V"], tokens: Int[Array, " B"], k: int
) -> tuple[Float[Array, " B"], Int[Array, "B K"], Float[Array, "B K"]]:
    """Each row's log-probability of ``tokens`` and its ``k`` most likely tokens (ids and
    log-probabilities, most likely first, ties to the lower id): the log-softmax of the
    ``logits`` in float32, before temperature, top-k or top-p. ``k`` is static (one
    compilation per value).

    >>> lp, ids, top = token_logprobs(jnp.array([[0.0, 2.0, 2.0]]), jnp.array([0]), 2)
    >>> ids.tolist(), round(float(lp[0] - top[0, 0]), 4)
    ([[1, 2]], -2.0)
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    own = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, k)  # (stable: equal values keep the lower index first)
    return own, ids.astype(jnp.int32), top


def sample(
    logits: Float[Array, "B V"],
    temperatures: Float[Array, " B"],
    top_ks: Int[Array, " B"],
    top_ps: Float[Array, " B"],
    keys: Key[Array, " B"],
) -> Int[Array, " B"]:
    """Per-row sampling: argmax where ``temperature == 0``; otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens (0: all)
    and to the smallest set of most likely tokens whose probability reaches ``top_p``.
    ``keys`` holds one typed PRNG key per row (``request_keys``). Row 0 below is greedy,
    row 1 samples from its top-1 token only:

    >>> logits = jnp.array([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> sample(logits, jnp.array([0.0, 1.0]), jnp.array([0, 1]), jnp.ones(2), keys).tolist()
    [1, 1]
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperatures > 0
    needs_sort = jnp.any(sampling & ((top_ks > 0) | (top_ps < 1)))
    temps = jnp.maximum(temperatures, 1e-6)[:, None]
    B, V = logits.shape

    def kept(_):  # top-k / top-p need the logits sorted
        order = jnp.argsort(-logits, axis=-1)
        scaled = jnp.take_along_axis(logits, order, axis=-1) / temps
        rank = jnp.arange(V)[None]
        keep = (top_ks[:, None] <= 0) | (rank < top_ks[:, None])
        probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
        # rank 0 always kept (even if top_p rounded to 0 in float32); top_p == 1 keeps
        # everything (the f32 running sum may round)
        keep &= (((jnp.cumsum(probs, axis=-1) - probs) < top_ps[:, None])
                 | (top_ps[:, None] >= 1) | (rank == 0))
        return jnp.zeros_like(keep).at[jnp.arange(B)[:, None], order].set(keep)  # vocab order

    def drawn(_):
        # jax.random.categorical(key, x) is argmax(gumbel(key) + x): one draw of the noise
        # serves the filtered rows and the others (a row without filters draws exactly as
        # with none), and the sort runs only when some row filters
        keep = jax.lax.cond(needs_sort, kept, lambda _: jnp.ones((B, V), bool), None)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        return jnp.argmax(noise + jnp.where(keep, logits / temps, -jnp.inf),
                          axis=-1).astype(jnp.int32)

    tokens = jax.lax.cond(jnp.any(sampling), drawn, lambda _: greedy, None)
    return jnp.where(sampling, tokens, greedy)


def request_keys(
    base: Key[Array, ""], seeds: Int[Array, " B"], positions: Int[Array, " B"]
) -> Key[Array, " B"]:
    """The sampling key of each request's token at ``positions``: a function of the base key,
    the request's seed and the position only (so not of the batch it runs in).

    >>> base = jax.random.key(0)
    >>> keys = request_keys(base, jnp.array([3, 3, 4]), jnp.array([10, 10, 10]))
    >>> keys.shape
    (3,)
    >>> [bool((jax.random.key_data(keys[0]) == jax.random.key_data(k)).all()) for k in keys]
    [True, True, False]
    """
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(
        seeds, positions
    )
