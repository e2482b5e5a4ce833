"""A pool-backed cache that speaks mlx-lm's cache protocol, for batched prefill and decode.

An unmodified mlx-lm model is called as ``model(inputs, cache=caches)`` with one cache per
layer. Each layer's attention reads ``cache.offset`` (RoPE position), calls
``cache.update_and_fetch(keys, values)`` with ``(B, n_kv_heads, L, head_dim)`` after RoPE and
attends to the full keys/values it returns, under the mask the model got from
``cache.make_mask(L)`` (asked of one layer's cache before the first layer runs).
``RaggedKVCache`` plays that part for ``B`` requests of different lengths at once; nothing
in the model is patched.

- *prefill*: ``RaggedKVCache.from_pool`` starts each row from that request's cached prefix,
  gathered from the pool by slot ids, so only the new (uncached) tokens run through the model.
  Several requests prefill in one forward: their new tokens are right-padded to the longest,
  each row writes at its own position, the mask hides padding, and
  ``truncate`` then drops the padded tail. The engine writes exactly the new
  tokens' K/V (``row``) into the pool at freshly allocated slots.
- *decode*: the running requests' rows advance one token per forward.

Design of the decode path, and why
----------------------------------
The obvious design gathers every request's whole history from the pool at each step
(``take`` over ``B * T`` slots, then attention). That re-reads and re-writes the whole context
once per step and layer, and a gather is several times dearer than the attention that follows
it: measured here (MLX CPU, B=32, 2 KV heads, head_dim 64, one layer) gather + attention costs
40 ms at T=600 and 290 ms at T=2100, against 14 ms and 41 ms for attention over a contiguous
buffer. So the decode path keeps a *per-batch contiguous buffer* per layer,
``(rows, n_kv_heads, capacity, head_dim)``:

- a request joins once, after its prefill: its full K/V (cached prefix + new tokens) is copied
  into a free row, right-padded (``add_row``);
- each step writes the B new tokens at each row's own position with one ``put_along_axis``
  (in place: only this cache holds the buffer, so the cost does not grow with capacity) and
  returns the slice ``[:B, :, :max_len]``; RoPE gets per-row positions (``offset`` is an
  ``mx.array`` of shape ``(B,)`` when the lengths differ) and the mask is a boolean
  ``(B, 1, L, T)`` that hides each row's padding;
- rows stay dense: when a request leaves, the last row moves into its place (one row copy),
  so the forward never computes dead rows;
- the decoded tokens' K/V reach the pool once, when the request finishes, so a follow-up turn
  that extends prompt + answer reuses them; a decode step does no pool traffic at all.

The price: while a request decodes, its prompt K/V exists twice (in the pool, where other
requests share it, and in its row). That copy is bounded by the running batch, not by the pool,
and buys decode steps as cheap as mlx-lm's own ``BatchKVCache``.

The buffers follow the batch, both ways: a row count is the next power of two (at least 1),
a token capacity is ``capacity(longest row)`` (a power of two from ``MIN_CAPACITY`` up to
``step``, then a multiple of ``step``); they grow on a join or a write that needs room, and
``fit`` shrinks them to what is left when a row leaves (to nothing when the last row goes).
One request of 960 tokens among seven of 8 still makes one buffer of 8 x 1024 token rows:
the engine keeps requests of very different lengths in different batches
(``mlxcache.engine._path_pooled``).

When every row has the same length, ``offset`` is a plain ``int`` and the mask is ``None`` (one
token) or ``"causal"``, exactly what ``KVCache`` gives, so a single request runs through the
same code as a plain mlx-lm cache, and models whose RoPE rejects array offsets still work one
request at a time (the engine detects them).

Examples:
    >>> import mlx.core as mx
    >>> c = RaggedKVCache()
    >>> c.add_row(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))   # a 3-token request
    0
    >>> c.add_row(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))   # a 5-token request
    1
    >>> c.offset.tolist(), c.make_mask(1).shape
    ([3, 5], (2, 1, 1, 6))
    >>> k, v = c.update_and_fetch(mx.ones((2, 2, 1, 4)), mx.ones((2, 2, 1, 4)))
    >>> k.shape, c.lengths
    ((2, 2, 6, 4), [4, 6])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache

from mlxcache.pool import KVPool, get_kv, host_slots
from mlxcache.quant import KVQuant, parts

if TYPE_CHECKING:  # annotations only (they stay strings): no import cost at run time
    from jaxtyping import Float

__all__ = ["MIN_CAPACITY", "QuantizedRaggedKVCache", "RaggedArraysCache", "RaggedKVCache",
           "capacity", "kv_concat", "kv_map"]

MIN_CAPACITY = 16
"""The smallest token capacity of a ``RaggedKVCache`` buffer."""


def capacity(tokens: int, step: int = 256) -> int:
    """The token capacity of a buffer that must hold ``tokens``: the next power of two (at
    least ``MIN_CAPACITY``) below ``step``, else the next multiple of ``step``; 0 for none.

    >>> [capacity(n) for n in (0, 1, 17, 200, 256, 257, 960)]
    [0, 16, 32, 256, 256, 512, 1024]
    """
    if tokens <= 0:
        return 0
    if tokens >= step:
        return step * -(-tokens // step)
    return max(MIN_CAPACITY, 1 << (tokens - 1).bit_length())


def kv_map(f: Any, *xs: Any) -> Any:
    """``f`` applied to K or V entries ``xs``: to the arrays, or part by part to the parts of
    quantized ones (``mlxcache.quant``), keeping the form.

    >>> kv_map(lambda a: a + 1, mx.zeros(2)).tolist()
    [1.0, 1.0]
    >>> [a.shape for a in kv_map(lambda a: a[:1], (mx.zeros((2, 4)), mx.zeros((2, 1))))]
    [(1, 4), (1, 1)]
    """
    if isinstance(xs[0], mx.array):
        return f(*xs)
    return tuple(f(*ps) for ps in zip(*xs, strict=True))


def kv_concat(xs: Sequence[Any], axis: int) -> Any:
    """K or V entries ``xs`` (arrays, or parts) joined along ``axis``, part by part.

    >>> [a.shape for a in kv_concat([(mx.zeros((1, 2)), mx.zeros((1, 1)))] * 3, axis=0)]
    [(3, 2), (3, 1)]
    """
    return kv_map(lambda *a: mx.concatenate(a, axis=axis), *xs)


def _put(dst: Any, index: tuple, src: Any) -> None:
    """``dst[index] = src``, part by part (into a buffer this cache owns)."""
    for d, x in zip(parts(dst), parts(src), strict=True):
        d[index] = x


def _pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _scatter_tokens(buf: mx.array, pos: mx.array, new: mx.array) -> mx.array:
    """``buf`` ``(R, H, T, D)`` with ``buf[r, :, pos[r, j]] = new[r, :, j]``.

    ``new`` is ``(B, H, N, D)`` with ``B <= R``; rows ``B..R`` are dead and get zeros at the
    positions ``pos`` names for them. ``pos`` is ``(R, N)``.
    """
    r_cap, b = buf.shape[0], new.shape[0]
    if b < r_cap:
        new = mx.concatenate([new, mx.zeros((r_cap - b, *new.shape[1:]), new.dtype)])
    idx = mx.broadcast_to(pos[:, None, :, None], new.shape)
    return mx.put_along_axis(buf, idx, new.astype(buf.dtype), axis=2)


class RaggedKVCache:
    """One layer's cache for a batch of requests of different lengths, one right-padded row each.

    Storage is ``(row_capacity, n_kv_heads, capacity, head_dim)`` keys and values; rows
    ``[0, B)`` are live and row ``i`` holds ``lengths[i]`` tokens. ``offset`` is an ``int`` when
    all lengths agree, else an ``mx.array`` ``(B,)``. A model takes one instance per layer: call
    the row operations (``add_row``, ``remove_row``, ``truncate``) on every layer's
    instance alike.

    Args:
        num_rows: start with this many empty rows (a batch prefill without cached prefixes).

    See the module docstring for the design.

    Examples:
        A batch prefill of two 3-token prompts, then one decode step with a third request
        (already 5 tokens long) joined:

        >>> import mlx.core as mx
        >>> c = RaggedKVCache(num_rows=2)
        >>> k, v = c.update_and_fetch(mx.ones((2, 2, 3, 4)), mx.ones((2, 2, 3, 4)))
        >>> k.shape, c.offset
        ((2, 2, 3, 4), 3)
        >>> c.add_row(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))
        2
        >>> c.offset.tolist(), c.make_mask(1).shape     # ragged: per-row offsets and a mask
        ([3, 3, 5], (3, 1, 1, 6))
        >>> k, v = c.update_and_fetch(mx.ones((3, 2, 1, 4)), mx.ones((3, 2, 1, 4)))
        >>> c.lengths, c.size()
        ([4, 4, 6], 6)
    """

    step = 256

    def __init__(self, num_rows: int = 0, window: int | None = None):
        self.keys: Any = None  # an array (R, H, T, D), or the parts of a quantized one
        self.values: Any = None
        self.lengths: list[int] = [0] * num_rows
        self.starts: list[int] = [0] * num_rows  # each row's first token's position
        self.window = window

    @classmethod
    def from_pool(
        cls, pool: KVPool, layer: int, prefixes: Sequence[Sequence[int]],
        window: int | None = None, reserve: int = 0,
    ) -> RaggedKVCache:
        """Row ``i`` holds ``layer``'s K/V at slots ``prefixes[i]`` of ``pool`` (lazy gather);
        with a ``window``, only its last ``window - 1`` tokens, all that the next query sees.
        ``reserve``: room for that many more tokens per row, so that the coming prefill
        writes into the buffer rather than growing (copying) it.

        Each prefix is a list of int slot ids (or a NumPy int array), checked like any host
        slots (``mlxcache.pool.host_slots``).

        The gather is one ``take`` over a ``(B, width)`` slot table padded with slot 0.
        It is an MLX graph node that reads ``pool``: evaluate the forward that uses this cache
        before writing to the pool, so that the write happens in place.

        Examples:
            >>> import mlx.core as mx
            >>> from mlxcache.pool import init_pool
            >>> pool = init_pool(num_layers=1, num_slots=8, n_kv_heads=2, head_dim=4)
            >>> c = RaggedKVCache.from_pool(pool, 0, [[5, 6], [], [7]])
            >>> c.offset.tolist(), c.row(0)[0].shape
            ([2, 0, 1], (1, 2, 2, 4))
        """
        return cls.from_pool_layers(pool, [layer], prefixes, [window], reserve)[0]

    @classmethod
    def from_pool_layers(
        cls, pool: KVPool, layers: Sequence[int], prefixes: Sequence[Sequence[int]],
        windows: Sequence[int | None], reserve: int = 0,
    ) -> list[RaggedKVCache]:
        """``from_pool`` for several layers at once (``windows[i]`` is ``layers[i]``'s): the
        prefixes are checked and the slot table built once for all layers of a window.

        Examples:
            >>> import mlx.core as mx
            >>> from mlxcache.pool import init_pool
            >>> pool = init_pool(num_layers=2, num_slots=8, n_kv_heads=2, head_dim=4)
            >>> a, b = RaggedKVCache.from_pool_layers(pool, [0, 1], [[5, 6], [7]], [None, 2])
            >>> a.offset.tolist(), b.offset.tolist(), b.lengths   # b keeps 1 token a row
            ([2, 1], [2, 1], [1, 1])
        """
        if isinstance(prefixes, str | bytes) or not isinstance(prefixes, Sequence):
            raise ValueError(f"prefixes must be a list of slot lists, got {prefixes!r:.60}")
        checked = [host_slots(f"prefixes[{i}]", p, pool.num_slots)
                   for i, p in enumerate(prefixes)]
        tables: dict[int | None, tuple] = {}
        out = []
        for layer, window in zip(layers, windows, strict=True):
            if window not in tables:
                tables[window] = _slot_table(checked, window, reserve, cls.step)
            starts, lengths, table = tables[window]
            cache = _new(pool.layer_quant(layer), len(checked), window)
            cache.starts = list(starts)
            if table is not None:
                width = table.shape[0] // len(checked)
                k, v = get_kv(pool, layer, table)
                b, h = len(checked), pool.n_kv_heads

                def rows(a: mx.array, b: int = b, width: int = width, h: int = h) -> mx.array:
                    return mx.contiguous(a.reshape(b, width, h, a.shape[-1]).swapaxes(1, 2))

                cache.keys, cache.values = kv_map(rows, k), kv_map(rows, v)
                cache.lengths = list(lengths)
            out.append(cache)
        return out

    # -------------------------------------------------------------- rows (host side) ----

    @property
    def batch_size(self) -> int:
        """Live rows ``B`` (requests in the batch)."""
        return len(self.lengths)

    def _caps(self) -> tuple[int, int]:
        """``(row_capacity, capacity)`` of the buffers."""
        return parts(self.keys)[0].shape[0], parts(self.keys)[0].shape[2]

    def _grow(self, rows: int, tokens: int, like_k: Any, like_v: Any) -> None:
        """Room for ``rows`` rows (a power of two) of ``tokens`` tokens (``capacity``)."""
        r_cap, t_cap = (0, 0) if self.keys is None else self._caps()
        if rows <= r_cap and tokens <= t_cap:
            return
        new_r = max(r_cap, _pow2(rows))
        new_t = max(t_cap, capacity(tokens, self.step))
        h = parts(like_k)[0].shape[1]

        def zeros(like: mx.array) -> mx.array:
            return mx.zeros((new_r, h, new_t, like.shape[3]), like.dtype)

        keys, values = kv_map(zeros, like_k), kv_map(zeros, like_v)
        if self.keys is not None and max(self.lengths, default=0) > 0:
            b, t = min(self.batch_size, r_cap), max(self.lengths)
            index = (slice(0, b), slice(None), slice(0, t))
            _put(keys, index, kv_map(lambda a: a[index], self.keys))
            _put(values, index, kv_map(lambda a: a[index], self.values))
        self.keys, self.values = keys, values

    def add_row(
        self,
        keys: Float[mx.array, "1 n_kv_heads T head_dim"],
        values: Float[mx.array, "1 n_kv_heads T head_dim"],
        start: int = 0,
    ) -> int:
        """Append a request whose K/V so far are ``(1, n_kv_heads, T, head_dim)``, the tokens
        at positions ``start .. start + T`` (a sliding layer's row need not hold its first
        tokens); its row.

        Examples:
            >>> c = RaggedKVCache()
            >>> c.add_row(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
            0
            >>> c.lengths
            [3]
        """
        keys, values = _as_arrays(self, self._form(keys)), _as_arrays(self, self._form(values))
        k0, v0 = parts(keys)[0], parts(values)[0]
        if k0.ndim != 4 or k0.shape[0] != 1 or v0.shape[:3] != k0.shape[:3]:
            raise ValueError(
                "add_row takes keys/values (1, n_kv_heads, T, head_dim), "
                f"got {tuple(k0.shape)} and {tuple(v0.shape)}"
            )
        t, row = k0.shape[2], self.batch_size
        self._grow(row + 1, t, keys, values)
        index = (slice(row, row + 1), slice(None), slice(0, t))
        _put(self.keys, index, keys)
        _put(self.values, index, values)
        self.lengths.append(t)
        self.starts.append(start)
        return row

    def remove_row(self, row: int) -> None:
        """Drop ``row``; the last row moves into its place (rows stay dense).

        Examples:
            >>> c = RaggedKVCache()
            >>> for t in (1, 2, 3):
            ...     _ = c.add_row(mx.zeros((1, 1, t, 2)), mx.zeros((1, 1, t, 2)))
            >>> c.remove_row(0)
            >>> c.lengths
            [3, 2]
        """
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row must be in [0, {self.batch_size}), got {row}")
        last = self.batch_size - 1
        if row != last:
            t = self.lengths[last]
            # Copy the moved row out first (and evaluate it) so the buffer is written in place.
            k = kv_map(lambda a: mx.contiguous(a[last : last + 1, :, :t]), self.keys)
            v = kv_map(lambda a: mx.contiguous(a[last : last + 1, :, :t]), self.values)
            mx.eval(k, v)
            index = (slice(row, row + 1), slice(None), slice(0, t))
            _put(self.keys, index, k)
            _put(self.values, index, v)
            self.lengths[row] = t
            self.starts[row] = self.starts[last]
        self.lengths.pop()
        self.starts.pop()

    def fit(self) -> None:
        """Shrink the buffers to what the rows need (rows: the next power of two; tokens:
        ``capacity`` of the longest; a copy), to nothing with no row left.

        >>> c = RaggedKVCache()
        >>> for t in (900, 8, 8):
        ...     _ = c.add_row(mx.zeros((1, 1, t, 2)), mx.zeros((1, 1, t, 2)))
        >>> c.keys.shape, c.remove_row(0), c.fit(), c.keys.shape   # the long row left
        ((4, 1, 1024, 2), None, None, (2, 1, 16, 2))
        """
        if self.keys is None or not self.lengths:
            self.keys = self.values = None
            return
        r_cap, t_cap = self._caps()
        new_r = min(r_cap, _pow2(self.batch_size))
        new_t = min(t_cap, capacity(max(self.lengths), self.step))
        if (new_r, new_t) == (r_cap, t_cap):
            return
        self.keys = kv_map(lambda a: mx.contiguous(a[:new_r, :, :new_t]), self.keys)
        self.values = kv_map(lambda a: mx.contiguous(a[:new_r, :, :new_t]), self.values)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Set each row's length to ``lengths[i]`` (at most its current one): after a padded
        batch prefill, this drops the padding tokens' K/V.

        Examples:
            >>> c = RaggedKVCache(num_rows=2)
            >>> _ = c.update_and_fetch(mx.ones((2, 1, 4, 2)), mx.ones((2, 1, 4, 2)))
            >>> c.truncate([4, 1])                  # row 1 had 1 real token and 3 of padding
            >>> c.offset.tolist()
            [4, 1]
        """
        if len(lengths) != self.batch_size or any(
            not 0 <= n <= m for n, m in zip(lengths, self.lengths, strict=True)
        ):
            raise ValueError(f"truncate to {list(lengths)} from lengths {self.lengths}")
        self.lengths = list(lengths)

    def end(self, row: int) -> int:
        """Row ``row``'s position after its last token (its request's length so far)."""
        return self.starts[row] + self.lengths[row]

    def row(self, row: int, start: int | None = None, end: int | None = None
            ) -> tuple[Any, Any]:
        """Row ``row``'s keys and values from position ``start`` on (default: all it holds,
        from ``starts[row]``) to ``end`` (default: all), ``(1, H, end - start, D)`` (a
        quantized cache's: its parts).

        Examples:
            >>> c = RaggedKVCache()
            >>> _ = c.add_row(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))
            >>> c.row(0, start=3)[0].shape
            (1, 2, 2, 4)
        """
        t = self.lengths[row] if end is None else end - self.starts[row]
        first = 0 if start is None else start - self.starts[row]
        if first < 0 or not first <= t <= self.lengths[row]:
            raise ValueError(f"row {row} holds positions [{self.starts[row]}, {self.end(row)}),"
                             f" not [{start}, {end})")
        index = (slice(row, row + 1), slice(None), slice(first, t))
        return kv_map(lambda a: a[index], self.keys), kv_map(lambda a: a[index], self.values)

    # ------------------------------------------------------------ mlx-lm protocol ----

    def _uniform(self) -> bool:
        return all(n == self.lengths[0] for n in self.lengths)

    @property
    def offset(self) -> int | mx.array:
        """Each row's position (``starts + lengths``): an ``int`` when all rows agree, else
        ``mx.array`` ``(B,)``. (Masks and writes work in buffer positions, ``lengths``.)"""
        ends = [s + n for s, n in zip(self.starts, self.lengths, strict=True)]
        if all(e == ends[0] for e in ends):
            return ends[0] if ends else 0
        return mx.array(ends, dtype=mx.int32)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """Mask for ``N`` new tokens per row: as ``KVCache`` gives when the rows agree, else a
        bool ``(B, 1, N, max_len + N)`` where query ``j`` of row ``i`` sees ``t <= len_i + j``.

        With a window (``window_size``, else the cache's own ``window``), a query at position
        ``q`` also sees only ``t > q - window``: what mlx-lm's ``RotatingKVCache`` of that
        window keeps (this cache keeps every row's whole history; the mask bounds what is
        read).

        Args:
            N: new tokens per row in the coming forward.
            return_array: with equal rows, an additive causal mask array instead of
                ``"causal"`` (as mlx-lm's ``KVCache``).
            window_size: the attention window of the layers this mask is for.

        Examples:
            >>> c = RaggedKVCache()
            >>> for t in (1, 2):
            ...     _ = c.add_row(mx.zeros((1, 1, t, 2)), mx.zeros((1, 1, t, 2)))
            >>> c.make_mask(1).tolist()       # row 0 holds 1 token: it sees slots 0 and 1
            [[[[True, True, False]]], [[[True, True, True]]]]
            >>> c.make_mask(1, window_size=2).tolist()   # and row 1 no longer sees slot 0
            [[[[True, True, False]]], [[[False, True, True]]]]
        """
        window = window_size or self.window
        if self._uniform():
            offset = self.lengths[0] if self.lengths else 0  # in buffer positions
            if window is None or offset + N <= window:
                if N == 1:
                    return None
                return create_causal_mask(N, offset) if return_array else "causal"
            return create_causal_mask(N, offset, window_size=window)
        lengths = mx.array(self.lengths, dtype=mx.int32)[:, None, None, None]
        q_pos = lengths + mx.arange(N)[None, None, :, None]
        t = mx.arange(max(self.lengths) + N)[None, None, None, :]
        mask = t <= q_pos
        return mask if window is None else mask & (t > q_pos - window)

    def update_and_fetch(
        self,
        keys: Float[mx.array, "B n_kv_heads N head_dim"],
        values: Float[mx.array, "B n_kv_heads N head_dim"],
    ) -> tuple[mx.array, mx.array]:
        """Append ``N`` tokens to every row; the batch's keys and values so far.

        mlx-lm's attention calls this once per forward with the new tokens' keys (after RoPE)
        and values. Row ``i`` writes at its own position ``lengths[i]``.

        Args:
            keys: ``[B, n_kv_heads, N, head_dim]``, ``B == batch_size``.
            values: ``[B, n_kv_heads, N, head_dim]``.

        Returns:
            ``(keys, values)``, each ``[B, n_kv_heads, max_len, head_dim]`` with
            ``max_len = max(lengths)`` after the update; a shorter row's tail is padding, which
            ``make_mask`` hides.

        Examples:
            >>> c = RaggedKVCache()
            >>> _ = c.add_row(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
            >>> k, v = c.update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
            >>> k.shape, c.offset
            ((1, 2, 5, 4), 5)
        """
        b, _, n, _ = keys.shape
        if b != self.batch_size:
            raise ValueError(f"the cache has {self.batch_size} rows, got keys for {b}")
        keys, values = self._stored(keys), self._stored(values)
        self._grow(b, max(self.lengths) + n, keys, values)
        if self._uniform():
            s = self.lengths[0]
            index = (slice(0, b), slice(None), slice(s, s + n))
            _put(self.keys, index, keys)
            _put(self.values, index, values)
        else:
            # One in-place scatter over the whole buffer; dead rows write at token 0.
            r_cap = self._caps()[0]
            pos = mx.array(self.lengths + [0] * (r_cap - b), dtype=mx.int32)
            pos = pos[:, None] + mx.arange(n)[None]
            self.keys = kv_map(lambda buf, new: _scatter_tokens(buf, pos, new), self.keys, keys)
            self.values = kv_map(lambda buf, new: _scatter_tokens(buf, pos, new), self.values,
                                 values)
        self.lengths = [t + n for t in self.lengths]
        t = max(self.lengths)
        return (kv_map(lambda a: a[:b, :, :t], self.keys),
                kv_map(lambda a: a[:b, :, :t], self.values))

    def _stored(self, x: mx.array) -> Any:
        """New keys or values as the buffers hold them (here: as they are)."""
        return x

    _form = _stored  # a row's keys or values (``_as_arrays`` checks their form)

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        """The whole buffers ``(keys, values)``, each ``(row_capacity, H, capacity, D)`` (None
        before the first write): what to ``mx.eval``."""
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        """False: mlx-lm's prompt-cache trimming does not apply to a ragged batch."""
        return False

    def trim(self, n: int) -> int:
        """Trims nothing (see ``is_trimmable``); returns 0, the tokens trimmed."""
        return 0

    def size(self) -> int:
        """Tokens of the longest row."""
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        """True until the first write allocates the buffers."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (their capacity, not just the live tokens)."""
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in parts(self.keys) + parts(self.values))


def _slot_table(rows: list[np.ndarray], window: int | None, reserve: int, step: int
                ) -> tuple[list[int], list[int], mx.array | None]:
    """``(starts, lengths, table)`` of rows of prefix slots: a sliding layer keeps only
    each row's last ``window - 1`` tokens, all that the next query sees; ``table`` is the
    flat ``[B * width]`` gather of the buffer, None if every row is empty.

    The gather fills the whole buffer, ``width = capacity(widest + reserve)`` with room for
    ``reserve`` more tokens (so the coming prefill writes in place, not into a grown
    copy); its tail is slot 0, the sink: padding, never read (lengths and masks bound
    every read), so no zeroed buffer is written twice."""
    starts = [0] * len(rows)
    if window is not None:
        starts = [max(0, len(r) - (window - 1)) for r in rows]
        rows = [r[s:] for r, s in zip(rows, starts, strict=True)]
    lengths = [len(r) for r in rows]
    widest = max(lengths, default=0)
    if widest == 0:
        return starts, lengths, None
    width = capacity(widest + max(reserve, 0), step)
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return starts, lengths, mx.array(table.reshape(-1))


class QuantizedRaggedKVCache(RaggedKVCache):
    """A ``RaggedKVCache`` whose buffers hold keys and values quantized as mlx-lm's
    ``QuantizedKVCache`` holds them (``mlxcache.quant``): ``bits`` and ``group_size`` tell
    mlx-lm's attention to take its quantized path, ``update_and_fetch`` quantizes the new
    tokens and returns the parts, and rows come and go as parts.

    Examples:
        >>> import mlx.core as mx
        >>> c = QuantizedRaggedKVCache(bits=8, group_size=32)
        >>> c.add_row(*(KVQuant(8, 32).quantize(mx.zeros((1, 2, 3, 64))),) * 2)
        0
        >>> k, v = c.update_and_fetch(mx.ones((1, 2, 1, 64)), mx.ones((1, 2, 1, 64)))
        >>> [a.shape for a in k], c.lengths, c.bits
        ([(1, 2, 4, 16), (1, 2, 4, 2), (1, 2, 4, 2)], [4], 8)
    """

    def __init__(self, num_rows: int = 0, window: int | None = None, *, bits: int,
                 group_size: int):
        super().__init__(num_rows, window)
        self.quant = KVQuant(bits, group_size)
        self.bits, self.group_size = bits, group_size

    def _stored(self, x: mx.array) -> Any:
        """New keys or values, quantized."""
        return self.quant.quantize(x)

    def _form(self, x: Any) -> Any:
        """A row's keys or values as parts (float ones are quantized)."""
        if isinstance(x, mx.array):
            return self.quant.quantize(x)
        if len(x) != 3:
            raise ValueError(f"quantized K/V are 3 parts (codes, scales, biases), got {len(x)}")
        return tuple(x)


def _as_arrays(cache: RaggedKVCache, x: Any) -> Any:
    """``x`` if it has the form ``cache`` holds (arrays, or the parts of quantized K/V), else
    ``ValueError`` naming both."""
    quantized = isinstance(cache, QuantizedRaggedKVCache)
    if isinstance(x, mx.array) == quantized:
        raise ValueError(f"{type(cache).__name__} holds K/V "
                         f"{'parts' if quantized else 'arrays'}, got {type(x).__name__}")
    return x


def _new(quant: KVQuant | None, num_rows: int, window: int | None) -> RaggedKVCache:
    """An empty ragged cache, quantized as ``quant`` says."""
    if quant is None:
        return RaggedKVCache(num_rows, window)
    return QuantizedRaggedKVCache(num_rows, window, bits=quant.bits, group_size=quant.group_size)


class RaggedArraysCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` (the conv and recurrent state of a linear-attention or SSM
    layer, one row per request) with the row operations the engine needs.

    mlx-lm's hybrid models already batch these: every state array is ``(B, ...)``, and
    ``prepare(lengths=...)`` tells a right-padded prefill how many of each row's tokens are
    real, so padding never reaches a row's state. This class adds building rows from
    snapshots, reading one row out (a snapshot), and joining and leaving a running batch, like
    ``RaggedKVCache``. It is an ``ArraysCache``, so models that check for one accept it.

    Args:
        size: state arrays per layer (as the model's own ``ArraysCache(size)``).
        like: ``(shape, dtype)`` of each state array of one row, None for an array the model
            never sets; a fresh row gets zeros of it when other rows hold a state.

    Examples:
        >>> import mlx.core as mx
        >>> c = RaggedArraysCache(2, like=[((3,), mx.float32), ((2, 2), mx.float32)])
        >>> c.add_row([mx.ones((1, 3)), mx.ones((1, 2, 2))]), c.add_row(None)  # a fresh row
        (0, 1)
        >>> c.batch_size, c[0].tolist()
        (2, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        >>> c.remove_row(0)
        >>> c.batch_size, c.row(0)[0].tolist()
        (1, [[0.0, 0.0, 0.0]])
    """

    def __init__(self, size: int, like: Sequence[tuple[tuple[int, ...], mx.Dtype] | None]):
        super().__init__(size)
        if len(like) != size:
            raise ValueError(f"like has {len(like)} entries for {size} state arrays")
        self.like = list(like)
        self.rows = 0

    @property
    def batch_size(self) -> int:
        """Live rows ``B``."""
        return self.rows

    @classmethod
    def from_rows(
        cls, size: int, like: Sequence[tuple[tuple[int, ...], mx.Dtype] | None],
        rows: Sequence[Sequence[mx.array | None] | None],
    ) -> RaggedArraysCache:
        """A batch whose row ``i`` starts from the state ``rows[i]`` (one ``(1, ...)`` array per
        state array, e.g. a snapshot), or from nothing (None). All rows fresh: the arrays stay
        None, so the model initializes them itself, exactly as with its own cache.

        Examples:
            >>> c = RaggedArraysCache.from_rows(1, [((2,), mx.float32)], [None, None])
            >>> c.batch_size, c[0] is None
            (2, True)
        """
        cache = cls(size, like)
        if all(r is None for r in rows):
            cache.rows = len(rows)
            return cache
        for r in rows:
            cache.add_row(r)
        return cache

    def _fresh(self, j: int) -> mx.array | None:
        like = self.like[j]
        return None if like is None else mx.zeros((1, *like[0]), like[1])

    def add_row(self, state: Sequence[mx.array | None] | None) -> int:
        """Append a request whose state arrays are ``state`` (each ``(1, ...)``; None: zeros,
        a fresh request); its row."""
        state = [None] * len(self.cache) if state is None else list(state)
        if len(state) != len(self.cache):
            raise ValueError(f"add_row takes {len(self.cache)} state arrays, got {len(state)}")
        for j, x in enumerate(state):
            have = self.cache[j]
            if x is None and have is None:
                continue
            if x is None:
                x = self._fresh(j)
            if have is None:
                fresh = self._fresh(j)
                have = (mx.zeros((self.rows, *x.shape[1:]), x.dtype) if fresh is None
                        else mx.repeat(fresh, self.rows, axis=0))
            self.cache[j] = mx.concatenate([have, x.astype(have.dtype)]) if self.rows else x
        self.rows += 1
        return self.rows - 1

    def remove_row(self, row: int) -> None:
        """Drop ``row``; the last row moves into its place (as in ``RaggedKVCache``)."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row must be in [0, {self.rows}), got {row}")
        order = list(range(self.rows))
        order[row] = order[-1]
        order.pop()
        index = mx.array(order, dtype=mx.int32)
        self.cache = [None if c is None else (c[index] if order else c[:0])
                      for c in self.cache]
        self.rows -= 1

    def row(self, row: int) -> list[mx.array | None]:
        """Row ``row``'s state arrays, each ``(1, ...)`` (None where the model set none)."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row must be in [0, {self.rows}), got {row}")
        return [None if c is None else c[row : row + 1] for c in self.cache]
