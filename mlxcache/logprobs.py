"""Log-probabilities of sampled tokens, for the rows of a batch whose requests ask for them.

A request with ``logprobs=k`` (``servecore.requests``) gets, with each token, a
``servecore.engine.TokenLogprobs``: the token's log-probability and the ``k`` most likely
tokens' (``(id, logprob)``, most likely first, ties to the lower id), all read from the
log-softmax of the model's logits at that position in float32, before temperature, top-k and
top-p: what mlx-lm's ``generate_step`` yields as ``logprobs`` (``logits - logsumexp``).

Two halves, so that the decode step's pipelining stays: ``logprob_arrays`` builds the device
arrays of one batch (only for the rows that ask: a batch where none asks costs nothing), to be
scheduled with the sampled tokens (``mx.async_eval(tokens, *batch.arrays())``);
``LogprobBatch.read`` turns a row into a ``TokenLogprobs`` on the host once they are computed
(the first read copies the whole batch's top-k, once).

The top-k come from ``mx.argpartition`` of one more than the largest ``k`` asked, sorted on the
host by (logprob descending, id ascending); where the ``k``-th and the next are tied, the
set itself is ambiguous, and that row's full log-softmax is sorted on the host instead, so
ties always go to the lower id.

Examples:
    >>> import mlx.core as mx
    >>> logits = mx.array([[0.0, 2.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    >>> batch = logprob_arrays(logits, mx.array([3, 0]), [2, None])
    >>> mx.eval(batch.arrays())
    >>> lp = batch.read(0)
    >>> [i for i, _ in lp.top], round(lp.logprob, 4), batch.read(1)
    ([1, 3], -0.9176, None)
    >>> logprob_arrays(logits, mx.array([3, 0]), [None, None]) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from servecore.engine import TokenLogprobs

if TYPE_CHECKING:  # annotations only (they stay strings): no import cost at run time
    from jaxtyping import Float, Int

__all__ = ["LogprobBatch", "logprob_arrays"]


class LogprobBatch:
    """One batch's log-probability arrays (``logprob_arrays``) and, once computed, their
    host copies: ``read(row)`` gives the ``TokenLogprobs`` of batch row ``row`` (None for a
    row that did not ask).

    >>> import mlx.core as mx
    >>> b = logprob_arrays(mx.array([[1.0, 1.0]]), mx.array([1]), [1])
    >>> mx.eval(b.arrays()); lp = b.read(0)
    >>> round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top]  # a tie: the lower id
    (-0.6931, [(0, -0.6931)])
    """

    def __init__(self, rows: list[int], ks: list[int], logits: tuple[mx.array, mx.array],
                 chosen: mx.array, top_ids: mx.array | None, top_values: mx.array | None):
        self.index = {row: i for i, row in enumerate(rows)}  # batch row -> row here
        self.ks = ks
        # (R, V) float32 logits and (R, 1) their logsumexp, for a tie at the k-th place
        self.logits, self.lse = logits
        self.chosen = chosen  # (R,) the sampled tokens' logprobs
        self.top_ids, self.top_values = top_ids, top_values  # (R, K+1), unordered
        self._host: list[TokenLogprobs] | None = None

    def arrays(self) -> list[mx.array]:
        """The device arrays, to schedule (``mx.async_eval``) with the sampled tokens.

        >>> import mlx.core as mx
        >>> len(logprob_arrays(mx.zeros((1, 4)), mx.array([0]), [0]).arrays())
        3
        """
        return [a for a in (self.logits, self.lse, self.chosen, self.top_ids, self.top_values)
                if a is not None]

    def read(self, row: int) -> TokenLogprobs | None:
        """Batch row ``row``'s ``TokenLogprobs`` (None if it did not ask); the arrays must be
        scheduled already (any thread may then read them).

        >>> import mlx.core as mx
        >>> b = logprob_arrays(mx.array([[0.0, 0.0], [0.0, 9.0]]), mx.array([0, 1]), [None, 0])
        >>> mx.eval(b.arrays()); b.read(0), b.read(1).top
        (None, ())
        """
        i = self.index.get(row)
        if i is None:
            return None
        if self._host is None:
            self._host = self._to_host()
        return self._host[i]

    def _to_host(self) -> list[TokenLogprobs]:
        chosen = self.chosen.tolist()
        if self.top_ids is None:
            return [TokenLogprobs(c) for c in chosen]
        ids, values = np.array(self.top_ids), np.array(self.top_values)
        out = []
        for i, (k, c) in enumerate(zip(self.ks, chosen, strict=True)):
            order = np.lexsort((ids[i], -values[i]))
            row_ids, row_values = ids[i][order], values[i][order]
            if 0 < k < len(order) and row_values[k - 1] == row_values[k]:  # a tie at the edge
                full = np.array(self.logits[i] - self.lse[i])
                order = np.lexsort((np.arange(len(full)), -full))[:k]
                row_ids, row_values = order, full[order]
            top = tuple((int(t), float(v)) for t, v in zip(row_ids[:k], row_values[:k],
                                                           strict=True))
            out.append(TokenLogprobs(c, top))
        return out


def logprob_arrays(logits: Float[mx.array, "B V"], tokens: Int[mx.array, " B"],
                   ks: Sequence[int | None]) -> LogprobBatch | None:
    """The log-probability arrays of the rows of ``logits`` whose ``ks`` entry is not None
    (that many top tokens each), at their sampled ``tokens``; None when no row asks.

    A ValueError names a mismatch between the rows of ``logits``, ``tokens`` and ``ks``.

    >>> import mlx.core as mx
    >>> b = logprob_arrays(mx.array([[0.0, 1.0, 2.0]]), mx.array([2]), [3])
    >>> mx.eval(b.arrays()); [t for t, _ in b.read(0).top]
    [2, 1, 0]
    """
    b = logits.shape[0] if logits.ndim == 2 else -1
    if b < 0 or tokens.shape != (b,) or len(ks) != b:
        raise ValueError(f"logits {logits.shape}, tokens {tokens.shape} and {len(ks)} ks: "
                         "give a (B, V) logits, B tokens and B ks")
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    asked = [int(ks[i]) for i in rows]
    x = logits if len(rows) == b else logits[mx.array(rows, dtype=mx.int32)]
    x = x.astype(mx.float32)
    # The log-softmax is x - lse; only the entries read are formed (no (R, V) array of it).
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    picked = tokens if len(rows) == b else tokens[mx.array(rows, dtype=mx.int32)]
    chosen = (mx.take_along_axis(x, picked.astype(mx.int32)[:, None], axis=-1) - lse)[:, 0]
    top_ids = top_values = None
    vocab = x.shape[-1]
    width = min(max(asked) + 1, vocab)  # one more than asked: ties at the k-th place
    if max(asked) > 0:
        top_ids = mx.argpartition(x, kth=vocab - width, axis=-1)[:, vocab - width :]
        top_values = mx.take_along_axis(x, top_ids, axis=-1) - lse
    return LogprobBatch(rows, asked, (x, lse), chosen, top_ids, top_values)
