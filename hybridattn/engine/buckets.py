"""The shape buckets of ``hybridattn.Engine``: the ladders a step's padded shape is drawn from.

A step compiles once per bucket tuple it meets, so the ladders are few and coarse: powers of
four for the request count, the tokens and short attention widths, powers of two for long
widths (where a step's cost grows with its width). Plain Python, no JAX.

>>> ladder(16, 200), bucket(17, (16, 64), "tokens in a step")
((16, 64, 200), 64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

__all__ = ["LOGPROB_BUCKETS", "STOP_BUCKETS", "StepBuckets", "bucket", "check_buckets",
           "kv_ladder", "ladder"]

STOP_BUCKETS = (4, 16, 64)
"""Widths of the per-row stop-token arrays of a multi-step decode (a request with more stop
ids than the last decodes one step per dispatch)."""

LOGPROB_BUCKETS = (20,)
"""How many most likely tokens a step that returns log-probabilities lists per row: the
largest ``logprobs`` of its requests (at least 1) rounded up to one of these (one compilation
each; ``servecore.requests.MAX_LOGPROBS`` is the last). One width: on CPU a step with top-1,
top-5 and top-20 cost the same (B = 8, 60 runs: 4.27 / 4.52 / 4.41 ms at a 32k vocabulary),
so more widths would only add compilations."""


def ladder(lo: int, hi: int, factor: int = 4) -> tuple[int, ...]:
    """``lo, lo * factor, ...`` below ``hi``, then ``hi``: the default shape buckets (few
    buckets, few compilations; padding wastes at most ``factor``x).

    >>> ladder(16, 200)
    (16, 64, 200)
    """
    out = []
    while lo < hi:
        out.append(lo)
        lo *= factor
    return (*out, hi)


def kv_ladder(hi: int, lo: int = 64, switch: int = 4096) -> tuple[int, ...]:
    """The default attention-width buckets: powers of four from ``lo`` up to ``switch``, then
    powers of two, then ``hi``. Short contexts keep few compilations; at long context, where a
    step's cost grows with its width, padding wastes at most 2x (12 buckets for 1M).

    >>> kv_ladder(96), kv_ladder(4096), len(kv_ladder(1 << 20))
    ((64, 96), (64, 256, 1024, 4096), 12)
    >>> kv_ladder(40000)
    (64, 256, 1024, 4096, 8192, 16384, 32768, 40000)
    """
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 4 if lo < switch else 2
    return (*out, hi)


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket that holds ``n``; ``ValueError`` naming ``what`` if none does.

    >>> bucket(17, (16, 64), "tokens in a step")
    64
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")


def check_buckets(name: str, given: Sequence[int] | None,
                  default: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets an option ``name`` gives (``default`` when None), checked: increasing
    positive ints.

    >>> check_buckets("kv_buckets", None, (64,)), check_buckets("kv_buckets", [8, 16], (64,))
    ((64,), (8, 16))
    >>> check_buckets("kv_buckets", [16, 8], (64,))
    Traceback (most recent call last):
    ...
    ValueError: kv_buckets=[16, 8] must be increasing positive ints
    """
    if given is None:
        return default
    bk = tuple(given) if isinstance(given, Iterable) else ()  # an int alone is no ladder
    if not bk or not all(isinstance(b, int) and not isinstance(b, bool) for b in bk) or (
            list(bk) != sorted(set(bk)) or bk[0] < 1):
        raise ValueError(f"{name}={given!r} must be increasing positive ints")
    return bk


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The four ladders of an engine's steps: requests ``B``, tokens ``T`` (and the longest
    extend ``Q``), attention width ``W``, snapshot entries ``M``.

    >>> b = StepBuckets.of(rows=4, chunked_prefill_size=64, max_context_len=512,
    ...                    snapshot_interval=256)
    >>> b.request, b.token, b.kv, b.snapshot
    ((1, 4), (16, 64, 68), (64, 256, 512), (0, 4, 12))
    """

    request: tuple[int, ...]
    token: tuple[int, ...]
    kv: tuple[int, ...]
    snapshot: tuple[int, ...]

    @classmethod
    def of(cls, *, rows: int, chunked_prefill_size: int, max_context_len: int,
           snapshot_interval: int, request: Sequence[int] | None = None,
           token: Sequence[int] | None = None, kv: Sequence[int] | None = None,
           snapshot: Sequence[int] | None = None, sharded: bool = False) -> StepBuckets:
        """The ladders given (``request_buckets`` ...; None: the default) for a step of up to
        ``rows`` requests (one data shard's), checked to reach what a step can hold."""
        R, L = rows, max_context_len
        max_t = chunked_prefill_size + R  # prompt chunks (of several requests) + decodes
        rb = check_buckets("request_buckets", request, ladder(1, R))
        tb = check_buckets("token_buckets", token, ladder(16, max_t))
        kb = check_buckets("kv_buckets", kv, kv_ladder(L))
        # snapshots one step may take: a grid point per interval of its prompt tokens and one
        # more per request (a chunk rarely starts on the grid), a branch point and the
        # last-but-one prompt token per request
        most = chunked_prefill_size // snapshot_interval + 3 * R
        sb = ((0, *ladder(4, max(4, most))) if snapshot is None
              else tuple(snapshot) if isinstance(snapshot, Iterable) else ())
        if (not sb or not all(isinstance(b, int) and not isinstance(b, bool) for b in sb)
                or list(sb) != sorted(set(sb)) or sb[0] < 0 or sb[-1] < most):
            raise ValueError(f"snapshot_buckets={snapshot!r} must be increasing ints >= 0 "
                             f"reaching {most}: a step may take a snapshot per grid interval of "
                             f"a prefill chunk and three per request")
        if kb[-1] > L:
            raise ValueError(f"kv_buckets={kb} must not exceed max_context_len={L}")
        if rb[-1] < R:
            raise ValueError(f"request_buckets={rb} must reach "
                             + (f"the {R} rows of a data shard" if sharded else
                                f"max_running_requests={R}"))
        if kb[-1] < L:
            raise ValueError(f"kv_buckets={kb} must reach max_context_len={L}")
        if tb[-1] < max_t:
            raise ValueError(f"token_buckets={tb} must reach {max_t}: a step takes up to "
                             f"chunked_prefill_size={chunked_prefill_size} prompt tokens and "
                             f"one token of each of {R} running requests")
        return cls(rb, tb, kb, sb)
