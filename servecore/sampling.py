"""``SamplingParams``: how one request picks its tokens, the same in both engines.

Fields, in this order everywhere (``generate``, ``stream``, ``add_request``):
``temperature`` (0 = greedy), ``top_p`` (1 = off), ``top_k`` (0 = off), ``seed`` (``None``: the
engine's default stream). Every value is checked at construction for the range it has on the
device (float32 settings, int32 ``top_k`` and seed), so a ``SamplingParams`` that exists is
valid.

Two limits are treated exactly as the limit they approach, instead of overflowing float32:

* a temperature below ``MIN_TEMPERATURE`` is greedy (``logits / T`` would overflow for
  smaller ``T``; ``softmax(logits / T)`` tends to the argmax as ``T -> 0``);
* a ``top_p`` below ``MIN_TOP_P`` keeps the top token only (the top token alone holds at least
  ``1 / V`` of the mass, and no vocabulary has ``2**31`` tokens), which is greedy.

>>> SamplingParams()
SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None)
>>> SamplingParams(temperature=1e-40).greedy, SamplingParams(temperature=0.7, top_p=1e-50).greedy
(True, True)
>>> SamplingParams(top_k=2**31)
Traceback (most recent call last):
...
ValueError: top_k=2147483648 must be an int in [0, 2147483647] (0 = off)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from servecore.validate import INT32_MAX, check_int, check_real, is_int

__all__ = ["MIN_TEMPERATURE", "MIN_TOP_P", "SamplingParams", "default_seeds"]

MIN_TEMPERATURE = 1e-6
"""Temperatures below this sample as greedy."""

MIN_TOP_P = 2.0**-31
"""``top_p`` values below this keep the top token only (greedy)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (see the module docstring).

    ``temperature == 0`` (or below ``MIN_TEMPERATURE``) is greedy; ``top_p == 1`` and
    ``top_k == 0`` switch those filters off; ``seed`` makes sampling reproducible per
    request. A bad value is a ``ValueError`` naming it.

    >>> SamplingParams(temperature=0.8, top_p=0.9, seed=1).greedy
    False
    >>> SamplingParams(temperature=0.8, top_k=1).greedy     # one candidate: argmax
    True
    >>> SamplingParams(top_p=0.0)
    Traceback (most recent call last):
    ...
    ValueError: top_p=0.0 must be in (0, 1]
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _real("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= int(self.top_k) <= INT32_MAX:
            raise ValueError(f"top_k={self.top_k!r} must be an int in [0, {INT32_MAX}] (0 = off)")
        seed = None if self.seed is None else check_int("seed", self.seed, 0, INT32_MAX)
        set_ = object.__setattr__  # frozen: store the checked, plain-Python values
        set_(self, "temperature", t)
        set_(self, "top_p", p)
        set_(self, "top_k", int(self.top_k))
        set_(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax: ``temperature < MIN_TEMPERATURE``, ``top_k == 1``
        or ``top_p < MIN_TOP_P``. No noise is drawn and no key is consumed."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1 or self.top_p < MIN_TOP_P

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)


def _real(name: str, value: Any) -> float:
    if value is None:
        raise ValueError(f"{name}=None must be a number")
    return check_real(name, value)


def default_seeds(start: int = 0) -> Iterator[int]:
    """The seeds an engine gives requests that came without one: ``start``, ``start + 1``,
    ... wrapping from ``INT32_MAX`` to 0, so a derived seed is always one the device holds
    (a seed the engine makes up must never be refused as if the caller had passed it).

    >>> import itertools
    >>> list(itertools.islice(default_seeds(), 3))
    [0, 1, 2]
    >>> list(itertools.islice(default_seeds(INT32_MAX), 2))
    [2147483647, 0]
    """
    seed = check_int("start", start, 0, INT32_MAX)
    while True:
        yield seed
        seed = 0 if seed == INT32_MAX else seed + 1
