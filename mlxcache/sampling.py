"""Per-request sampling for a batch of logits: greedy, temperature, top-k, top-p, seeded.

Every row has its own ``SamplingParams``. A row is sampled with the Gumbel-max trick
(``argmax(logits / T + g)``, ``g`` standard Gumbel noise), after top-k and top-p filtering. A
seeded row draws its noise from its own key chain (``next_key``), so its tokens depend only
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # annotations only (they stay strings): no import cost at run time
    from jaxtyping import Float, Int, UInt32

__all__ = ["SamplingParams", "next_key", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (argmax); ``top_k == 0`` and ``top_p == 1`` switch those
    filters off; ``seed`` makes sampling reproducible per request. Bad values are a ValueError
    naming them.

    Examples:
        >>> SamplingParams(temperature=0.8, top_p=0.9, seed=1).greedy
        False
        >>> SamplingParams(temperature=0.8, top_k=1).greedy     # one candidate: argmax
        True
        >>> SamplingParams(top_p=0.0)
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1], got 0.0
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax (``temperature == 0`` or ``top_k == 1``): no noise
        is drawn and no key is consumed."""
        return self.temperature == 0 or self.top_k == 1


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
    kept = mx.sum(before < top_p[:, None], axis=-1)  # >= 1: the top token always stays
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

    Examples:
        A seeded row draws the same token whatever shares its batch:

        >>> logits = mx.array([[0.0, 1.0, 0.5, 0.2], [2.0, 0.0, 0.0, 0.0]])
        >>> hot = SamplingParams(temperature=1.0, seed=3)
        >>> alone = sample(logits[1:], [hot], [mx.random.key(3)])
        >>> batched = sample(logits, [SamplingParams(), hot], [None, mx.random.key(3)])
        >>> batched[0].item(), batched[1].item() == alone[0].item()
        (1, True)
    """
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
    out = greedy
    out[rows] = picked
    return out
