"""Sampling: the ``sampling_params`` strategy (per-request ``SamplingParams``) and its reference,
``ref_sample_probs`` (the distribution a sampling request draws from)."""

from __future__ import annotations

import functools

import numpy as np
from jaxtyping import ArrayLike, Float

from hybridattn.serving import (
    SamplingParams,
)
from hybridattn.testing.common import (
    SearchStrategy,
    checked_int,
    st,
)


def sampling_params(*, vocab_size: int = 64, greedy: bool | None = None,
                    ) -> SearchStrategy[SamplingParams]:
    """Valid per-request ``SamplingParams``: greedy (``temperature == 0``) or a temperature in
    ``[1/16, 2]``, with top-k off or in ``1 .. vocab_size``, top-p off or in ``[1/16, 1]`` and
    any seed. ``greedy``: True only greedy, False never, None either.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(sampling_params(vocab_size=8))
    ... def test_valid(sp):  # SamplingParams checks its values when it is built
    ...     assert 0 <= sp.top_k <= 8 and 0 < sp.top_p <= 1
    >>> test_valid()
    """
    checked_int("vocab_size", vocab_size, 1)
    floats = functools.partial(st.floats, allow_nan=False, allow_infinity=False,
                               allow_subnormal=False, width=32)
    temperature = (st.just(0.0) if greedy else floats(0.0625, 2.0)) if greedy is not None else (
        st.one_of(st.just(0.0), floats(0.0625, 2.0)))
    return st.builds(
        SamplingParams,
        temperature=temperature,
        top_k=st.one_of(st.just(0), st.integers(1, vocab_size)),
        top_p=st.one_of(st.just(1.0), floats(0.0625, 1.0)),
        seed=st.integers(0, 2**31 - 1),
    )


def ref_sample_probs(
    logits: Float[ArrayLike, " V"], temperature: float, top_k: int = 0, top_p: float = 1.0,
) -> Float[np.ndarray, " V"]:
    """The distribution one request samples its next token from, in float64.

    Greedy (``temperature == 0``): all mass on the first largest logit. Otherwise
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (0: all; ties
    keep the lower token id) and, of those, to the smallest run of most likely tokens whose
    probability reaches ``top_p`` (1: all), renormalised. A token ``step`` samples for a request
    must have non-zero probability here (up to float32 rounding at the ``top_p`` boundary).

    >>> ref_sample_probs(np.array([0.0, 3.0, 1.0]), 1.0, top_k=2).round(3).tolist()
    [0.0, 0.881, 0.119]
    >>> ref_sample_probs(np.array([0.0, 3.0, 1.0]), 0.0).tolist()
    [0.0, 1.0, 0.0]
    """
    x = np.asarray(logits, np.float64).reshape(-1)
    V = x.shape[0]
    if temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    order = np.argsort(-x, kind="stable")
    scaled = x[order] / max(float(temperature), 1e-6)
    keep = np.ones(V, bool) if top_k <= 0 else np.arange(V) < top_k
    p = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        keep &= (np.cumsum(p) - p) < top_p
    p = np.where(keep, p, 0.0)
    out = np.zeros(V)
    out[order] = p / p.sum()
    return out
