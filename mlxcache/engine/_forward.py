"""Ragged forwards over the engine's caches: rows of different lengths in one forward, rows
moved between batches, and the arrays a cache keeps.

Each function works on the engine's own caches (``mlxcache.cache``'s ``RaggedKVCache`` and
``RaggedArraysCache``, built by ``mlxcache.layers.build``): the probes of
``mlxcache.engine.support`` and the pooled path call the same code.

Examples:
    >>> import mlx.core as mx
    >>> arrays_in([mx.array(1), None, (mx.array(2), [mx.array(3)])])
    [array(1, dtype=int32), array(2, dtype=int32), array(3, dtype=int32)]
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcache.cache import RaggedArraysCache
from mlxcache.layers import leaves

__all__ = ["arrays_in", "forward_padded", "join_rows"]


def join_rows(dst: list[Any], src: list[Any], row: int, slack: int = 0) -> None:
    """Append row ``row`` of the engine caches ``src`` to the engine caches ``dst``; a
    sliding layer keeps only its last ``window - 1 + slack`` tokens (what its next query sees,
    and ``slack`` more).

    Examples:
        >>> from mlx_lm.models.cache import KVCache
        >>> from mlxcache.layers import build, describe
        >>> layout = describe([KVCache()])
        >>> src, dst = build(layout, 1), build(layout, 0)
        >>> src[0].update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))[0].shape
        (1, 1, 3, 4)
        >>> join_rows(dst, src, 0); dst[0].lengths
        [3]
    """
    for d, c in zip(leaves(dst), leaves(src), strict=True):
        if isinstance(c, RaggedArraysCache):
            d.add_row(c.row(row))
            continue
        start, end = c.starts[row], c.end(row)
        if c.window is not None and end - start > c.window - 1 + slack:
            start = end - (c.window - 1 + slack)
        d.add_row(*c.row(row, start), start)


def forward_padded(model: nn.Module, caches: list[Any], rows: list[list[int]], width: int
                   ) -> mx.array | None:
    """Run ``rows`` (row ``i``'s next tokens, at most ``width``) right-padded to ``width``
    through the model: attention caches drop the padding after the forward, recurrent states
    never take it in (``prepare(lengths=...)``). Returns the logits, None if ``width`` is 0.

    Examples:
        >>> forward_padded(None, [], [[]], 0) is None
        True
    """
    if width == 0:
        return None
    n = [len(r) for r in rows]
    ragged = min(n) < width
    flat = leaves(caches)
    if ragged:
        for c in flat:
            if isinstance(c, RaggedArraysCache):
                c.prepare(lengths=n)
    before = [None if isinstance(c, RaggedArraysCache) else list(c.lengths) for c in flat]
    try:
        out = model(mx.array([r + [0] * (width - len(r)) for r in rows]), cache=caches)
    finally:
        for c in flat:
            if isinstance(c, RaggedArraysCache):
                c.finalize()
    if ragged:
        for c, was in zip(flat, before, strict=True):
            if was is not None:
                c.truncate([w + k for w, k in zip(was, n, strict=True)])
    return out


def arrays_in(tree: Any) -> list[mx.array]:
    """The ``mx.array`` leaves of nested lists and tuples (a cache's ``state`` may hold None).

    Examples:
        >>> arrays_in((None, [mx.array([1])]))
        [array([1], dtype=int32)]
    """
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, list | tuple):
        return [a for x in tree for a in arrays_in(x)]
    return []
