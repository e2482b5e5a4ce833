"""Quantized K/V: what a token's keys and values become in the pool and the engine's caches
with ``Engine(kv_bits=...)``, exactly as mlx-lm's ``QuantizedKVCache`` stores them.

``mx.quantize`` cuts each head's vector (the last axis) into groups of ``group_size`` values
and stores each group as ``bits``-bit codes (packed into ``uint32``) with one scale and one
bias in the model's dtype: three arrays, the *parts*, ``(codes, scales, biases)``. A token's
parts depend on that token's vector alone, so a prefix's parts in the pool are exactly what a
request computing the prefix itself would write: a prefix hit needs no re-quantization and
attends to the same bytes as a miss. mlx-lm's attention (``scaled_dot_product_attention``)
takes the quantized path when the cache it is given has ``bits`` and ``group_size``.

Bytes per head vector of ``d`` values: ``d * bits / 8`` of codes and ``2 * d / group_size``
scales and biases: at 8 bits and groups of 64 in float16, 0.53x of float16; at 4 bits 0.28x
(groups of 32: 0.56x and 0.31x; of 128: 0.52x and 0.27x).

Examples:
    >>> import mlx.core as mx
    >>> q = KVQuant(bits=4, group_size=64)
    >>> codes, scales, biases = q.quantize(mx.ones((1, 2, 3, 128)))
    >>> codes.shape, scales.shape, codes.dtype
    ((1, 2, 3, 16), (1, 2, 3, 2), mlx.core.uint32)
    >>> q.bytes_per_vector(128, mx.float16), 128 * 2   # against float16
    (72, 256)
    >>> KVQuant(bits=3, group_size=64)
    Traceback (most recent call last):
    ...
    ValueError: kv_bits=3 must be one of (4, 8) (or None: full precision)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

__all__ = ["BITS", "GROUP_SIZES", "KVQuant", "parts"]

BITS = (4, 8)
"""The ``kv_bits`` the engine takes (mlx-lm's ``QuantizedKVCache`` is used with these)."""

GROUP_SIZES = (32, 64, 128)
"""The ``kv_group_size`` values the engine takes."""


@dataclass(frozen=True)
class KVQuant:
    """The quantization of one attention layer's K/V: ``bits`` and ``group_size``.

    >>> KVQuant(8, 64).fits(96), KVQuant(8, 64).fits(128)
    (False, True)
    """

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if not _int_in(self.bits, BITS):
            raise ValueError(f"kv_bits={self.bits!r} must be one of {BITS} (or None: full "
                             "precision)")
        if not _int_in(self.group_size, GROUP_SIZES):
            raise ValueError(f"kv_group_size={self.group_size!r} must be one of "
                             f"{GROUP_SIZES}")

    def fits(self, dim: int) -> bool:
        """Whether a head vector of ``dim`` values can be quantized (the group divides it)."""
        return dim % self.group_size == 0

    def shapes(self, dim: int, dtype: mx.Dtype) -> tuple[tuple[int, mx.Dtype], ...]:
        """``(width, dtype)`` of each part of a head vector of ``dim`` values.

        >>> KVQuant(8, 32).shapes(64, mx.float16)
        ((16, mlx.core.uint32), (2, mlx.core.float16), (2, mlx.core.float16))
        """
        groups = dim // self.group_size
        return (dim * self.bits // 32, mx.uint32), (groups, dtype), (groups, dtype)

    def bytes_per_vector(self, dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one head vector of ``dim`` values, all parts."""
        return sum(w * d.size for w, d in self.shapes(dim, dtype))

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``x``'s parts ``(codes, scales, biases)``, quantized along its last axis."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def dequantize(self, x: tuple[mx.array, ...]) -> mx.array:
        """The values the parts ``x`` stand for.

        >>> q = KVQuant(8, 32)
        >>> x = mx.arange(64, dtype=mx.float32).reshape(1, 64) / 64
        >>> bool(mx.abs(q.dequantize(q.quantize(x)) - x).max() < 0.01)
        True
        """
        return mx.dequantize(*x, group_size=self.group_size, bits=self.bits)


def _int_in(value: Any, allowed: tuple[int, ...]) -> bool:
    """``value`` is an int (never a float or a bool) among ``allowed``.

    >>> _int_in(8, BITS), _int_in(8.0, BITS), _int_in(True, (1,))
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value in allowed


def parts(x: Any) -> tuple[mx.array, ...]:
    """The arrays of one K or V entry: ``(x,)`` for a plain array, the parts of a quantized
    one.

    >>> len(parts(mx.zeros(2))), len(parts(KVQuant(4, 32).quantize(mx.zeros((1, 32)))))
    (1, 3)
    """
    return (x,) if isinstance(x, mx.array) else tuple(x)
