"""Per-request sampling for a batch of logits: greedy, temperature, top-k, top-p, seeded.

Every row has its own ``SamplingParams``: ``servecore.SamplingParams``, the class both engines
take (checked at construction; ``.greedy`` also holds for temperatures and top-p values too
small for float32). A greedy row is the argmax of its logits; any other row is sampled with the
Gumbel-max trick (``argmax(logits / T + g)``, ``g`` standard Gumbel noise) after top-k and top-p
filtering, and both filters keep at least the top token, so a row never samples from nothing.
A seeded row draws its noise from its own key chain (``next_key``), so its tokens depend only
on its seed and logits, never on which other requests share the batch; unseeded rows use MLX's
global generator.

Examples:
    >>> import mlx.core as mx
    >>> logits = mx.array([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    >>> params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=1)]
    >>> sample(logits, params, [None, mx.random.key(0)]).tolist()
    [1, 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from servecore.sampling import SamplingParams

if TYPE_CHECKING:  # annotations only (they stay strings): no import cost at run time
    from jaxtyping import Float, Int, UInt32

__all__ = ["SamplingParams", "next_key", "sample"]


def next_key(key: UInt32[mx.array, "2"]) -> tuple[mx.array, mx.array]:
    """Split a request's key: ``(key for the next step, key for this step's noise)``.

    Args:
        key: an MLX PRNG key, uint32 ``[2]`` (``mx.random.key(seed)``).

    Returns:
        Two keys, uint32 ``[2]`` each.

    Examples:
        >>> key = mx.random.key(0)
        >>> key, use = next_key(key)
        >>> use.shape, use.dtype
        ((2,), mlx.core.uint32)
    """
    if not isinstance(key, mx.array) or key.shape != (2,) or key.dtype != mx.uint32:
        what = f"shape {key.shape} dtype {key.dtype}" if isinstance(key, mx.array) else repr(key)
        raise ValueError(f"key must be a uint32 [2] array (mx.random.key(seed)), got {what}")
    nxt, use = mx.random.split(key)
    return nxt, use


def _filter_top_k(logits: mx.array, top_k: mx.array) -> mx.array:
    """Keep each row's ``top_k`` largest logits (``top_k`` ``(B,)``, 0 = all)."""
    vocab = logits.shape[-1]
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab)
    ordered = -mx.sort(-logits, axis=-1)
    kth = mx.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    return mx.where(logits >= kth, logits, -mx.inf)


def _filter_top_p(logits: mx.array, top_p: mx.array) -> mx.array:
    """Keep each row's smallest set of top tokens whose probability reaches ``top_p``."""
    probs = mx.softmax(logits, axis=-1)
    ordered = -mx.sort(-probs, axis=-1)
    before = mx.cumsum(ordered, axis=-1) - ordered  # mass strictly above each token
    # The top token's mass above it is 0, so it stays whenever top_p > 0; the floor keeps it
    # also where top_p rounds to 0 in float32 (kept - 1 would then index the last token).
    kept = mx.maximum(mx.sum(before < top_p[:, None], axis=-1), 1)
    threshold = mx.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)
    return mx.where(probs >= threshold, logits, -mx.inf)


def sample(
    logits: Float[mx.array, "B V"],
    params: Sequence[SamplingParams],
    keys: Sequence[mx.array | None],
) -> Int[mx.array, " B"]:
    """One token per row of ``logits`` ``(B, V)``: int32 ``(B,)``.

    Args:
        logits: ``(B, V)`` next-token logits.
        params: one ``SamplingParams`` per row.
        keys: one noise key per row (uint32 ``[2]``, from ``next_key``), or None for the
            global generator; ignored for greedy rows.

    A ValueError names a mismatch between the rows of ``logits``, ``params`` and ``keys``.

    Examples:
        A seeded row draws the same token whatever shares its batch:

        >>> logits = mx.array([[0.0, 1.0, 0.5, 0.2], [2.0, 0.0, 0.0, 0.0]])
        >>> hot = SamplingParams(temperature=1.0, seed=3)
        >>> alone = sample(logits[1:], [hot], [mx.random.key(3)])
        >>> batched = sample(logits, [SamplingParams(), hot], [None, mx.random.key(3)])
        >>> batched[0].item(), batched[1].item() == alone[0].item()
        (1, True)
    """
    if not isinstance(logits, mx.array) or logits.ndim != 2:
        raise ValueError(f"logits must be a (B, V) array, got {getattr(logits, 'shape', logits)!r}")
    b = logits.shape[0]
    if len(params) != b or len(keys) != b:
        raise ValueError(f"logits has {b} rows but params has {len(params)} and keys "
                         f"{len(keys)} entries: give one of each per row")
    bad = [p for p in params if not isinstance(p, SamplingParams)]
    if bad:
        raise ValueError(f"params must be SamplingParams, got {bad[0]!r}")
    logits = logits.astype(mx.float32)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    rows = mx.array(sampled_rows, dtype=mx.int32)
    sub = logits[rows]
    temp = mx.array([params[i].temperature for i in sampled_rows])[:, None]
    sub = sub / temp
    if any(params[i].top_k for i in sampled_rows):
        sub = _filter_top_k(sub, mx.array([params[i].top_k for i in sampled_rows]))
    if any(params[i].top_p < 1 for i in sampled_rows):
        sub = _filter_top_p(sub, mx.array([params[i].top_p for i in sampled_rows]))
    vocab = logits.shape[-1]
    noise = mx.stack(
        [
            mx.random.gumbel((vocab,), key=keys[i])
            if keys[i] is not None
            else mx.random.gumbel((vocab,))
            for i in sampled_rows
        ]
    )
    picked = mx.argmax(sub + noise, axis=-1).astype(mx.int32)
    return mx.put_along_axis(greedy, rows, picked, axis=0)
