"""What each layer of an mlx-lm model keeps, and the engine's ragged caches for it.

An mlx-lm model makes its own caches (``make_prompt_cache(model)``): one per layer, each a
``KVCache`` (full attention), a ``RotatingKVCache`` (sliding-window attention), an
``ArraysCache`` (the conv and recurrent state of a linear-attention or SSM layer), a
``CacheList`` of several of those (a layer with both, as Falcon-H1's), or a kind this module
does not know (``ChunkedKVCache``, ``QuantizedKVCache``, ...). ``describe`` reads that list
into a ``Layout``; ``build`` makes the engine's caches of the same shape, one row per request:

==================  =================================  =====================================
the model's cache   the engine's                       what the prefix cache keeps of it
==================  =================================  =====================================
``KVCache``         ``RaggedKVCache``                  K/V per token, in the KV pool
``RotatingKVCache`` ``RaggedKVCache(window=max_size)`` K/V per token, in the KV pool (a
                                                       prefix of any length restores)
``ArraysCache``     ``RaggedArraysCache``              state snapshots at some depths, in
                                                       the state pool
``CacheList``       ``CacheList`` of the above         each member as above
==================  =================================  =====================================

With ``Engine(kv_bits=...)`` a ``KVCache`` layer's ragged cache is a ``QuantizedRaggedKVCache``
(its K/V as mlx-lm's ``QuantizedKVCache`` holds them, and so in the pool): ``Layout.quantized``
marks those leaves, and ``model_caches`` gives mlx-lm's own caches of the same layout, the
oracle a quantized engine is checked against.

Memory of a sliding-window layer, and how it is bounded: its K/V sit in the token pool per
token, like a full layer's (that is what lets a prefix of any length restore, past the window
too), so the pool's bound is its fixed size (``num_slots``, from the memory budget), shared
with every other layer; nothing grows past it. What a request holds beyond the pool is bounded
by the window: a restore gathers only the prefix's last ``window - 1`` tokens (all that its
next query sees), and a request joining the decode batch keeps only its last ``window - 1``
tokens (plus a page) and those it generates. Each row records the position of its first token
(``RaggedKVCache.starts``), and a per-row window mask gives attention exactly the keys the
model's own rotating cache would hold. A ``RotatingKVCache`` with ``keep``
(sink) tokens is not one of these: mlx-lm's own rotation of kept tokens is not expressible as a
window mask, so it is reported unsupported rather than served with different attention.

Examples:
    >>> from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache
    >>> layout = describe([KVCache(), RotatingKVCache(max_size=8),
    ...                    CacheList(ArraysCache(2), KVCache())])
    >>> layout.kinds
    ('ArraysCache', 'KVCache', 'RotatingKVCache(8)')
    >>> [leaf.kind for leaf in layout.leaves], layout.kv_leaves, layout.state_leaves
    (['kv', 'window', 'arrays', 'kv'], (0, 1, 3), (2,))
    >>> describe([KVCache(), RotatingKVCache(max_size=8, keep=4)]).unsupported
    ('RotatingKVCache(keep=4)',)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxcache.cache import QuantizedRaggedKVCache, RaggedArraysCache, RaggedKVCache
from mlxcache.quant import KVQuant

__all__ = ["Layout", "Leaf", "build", "describe", "leaves", "model_caches"]


@dataclass(frozen=True)
class Leaf:
    """One cache of one layer: ``kind`` is ``"kv"``, ``"window"`` (``window`` tokens) or
    ``"arrays"`` (``size`` state arrays); a ``"kv"`` leaf with a ``quant`` holds its K/V
    quantized (``Layout.quantized``).

    Examples:
        >>> from mlx_lm.models.cache import RotatingKVCache
        >>> describe([RotatingKVCache(max_size=16)]).leaves
        (Leaf(kind='window', window=16, size=0, quant=None),)
    """

    kind: str
    window: int | None = None
    size: int = 0
    quant: KVQuant | None = None


@dataclass(frozen=True)
class Layout:
    """The model's caches, read by ``describe``.

    Attributes:
        entries: per layer, a ``Leaf``, or a tuple of them (a ``CacheList``).
        unsupported: names of the caches this module does not know (empty: all known).
        kinds: every cache kind the model uses, by name, sorted.
        like: per state leaf (``state_leaves`` order), each state array's ``(shape, dtype)``
            for one row; filled in by the engine's probe (``with_states``).

    Examples:
        >>> from mlx_lm.models.cache import ArraysCache, KVCache
        >>> layout = describe([ArraysCache(2), KVCache()])
        >>> layout.kv_leaves, layout.state_leaves, layout.windows
        ((1,), (0,), ())
    """

    entries: tuple[Leaf | tuple[Leaf, ...], ...]
    unsupported: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    like: tuple[tuple[tuple[tuple[int, ...], mx.Dtype] | None, ...], ...] = field(default=())

    @property
    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf, layer by layer, ``CacheList`` members in order."""
        out: list[Leaf] = []
        for e in self.entries:
            out.extend(e if isinstance(e, tuple) else (e,))
        return tuple(out)

    @property
    def kv_leaves(self) -> tuple[int, ...]:
        """Indices (into ``leaves``) of the attention caches: the KV pool's layers."""
        return tuple(i for i, leaf in enumerate(self.leaves) if leaf.kind != "arrays")

    @property
    def state_leaves(self) -> tuple[int, ...]:
        """Indices (into ``leaves``) of the recurrent-state caches."""
        return tuple(i for i, leaf in enumerate(self.leaves) if leaf.kind == "arrays")

    @property
    def kv_quant(self) -> tuple[KVQuant | None, ...]:
        """Per attention cache (``kv_leaves`` order), its quantization (None: full
        precision): the KV pool's ``quant``."""
        flat = self.leaves
        return tuple(flat[i].quant for i in self.kv_leaves)

    def layer_of(self, leaf: int) -> int:
        """The layer (index into ``entries``) that leaf ``leaf`` belongs to."""
        n = 0
        for layer, e in enumerate(self.entries):
            n += len(e) if isinstance(e, tuple) else 1
            if leaf < n:
                return layer
        raise ValueError(f"leaf={leaf} must be in [0, {n})")

    def quantized(self, quant: KVQuant, dims: Sequence[int],
                  skip: Sequence[int] | Mapping[int, str] = ()
                  ) -> tuple[Layout, tuple[str, ...]]:
        """This layout with every full-attention cache quantized as ``quant`` (what mlx-lm's
        ``QuantizedKVCache`` can stand for), except leaves ``skip`` (with what their model
        raised, when a mapping); and a line for each attention layer left in full precision,
        and why. ``dims``: the head sizes of keys and values (the group must divide them).

        Examples:
            >>> from mlx_lm.models.cache import KVCache, RotatingKVCache
            >>> layout = describe([KVCache(), RotatingKVCache(max_size=8)])
            >>> q, kept = layout.quantized(KVQuant(8, 32), (64, 64))
            >>> q.kv_quant, kept
            ((KVQuant(bits=8, group_size=32), None), ('layer 1: sliding window (8 tokens)',))
            >>> layout.quantized(KVQuant(8, 32), (48, 48))[1]
            ('layer 0: head size 48 (kv_group_size=32 does not divide it)', \
'layer 1: sliding window (8 tokens)')
        """
        flat, kept = list(self.leaves), []
        for i in self.kv_leaves:
            leaf, layer = flat[i], self.layer_of(i)
            if leaf.kind == "window":
                kept.append(f"layer {layer}: sliding window ({leaf.window} tokens)")
            elif not all(quant.fits(d) for d in dims):
                kept.append(f"layer {layer}: head size {'/'.join(map(str, sorted(set(dims))))} "
                            f"(kv_group_size={quant.group_size} does not divide it)")
            elif i in skip:
                raised = f" ({skip[i]})" if isinstance(skip, Mapping) else ""
                kept.append(f"layer {layer}: its attention refuses quantized K/V{raised}")
            else:
                flat[i] = replace(leaf, quant=quant)
        it = iter(flat)
        entries = tuple(tuple(next(it) for _ in e) if isinstance(e, tuple) else next(it)
                        for e in self.entries)
        return replace(self, entries=entries), tuple(kept)

    @property
    def windows(self) -> tuple[int, ...]:
        """The sliding windows in use, sorted (empty: no sliding-window layer)."""
        return tuple(sorted({leaf.window for leaf in self.leaves if leaf.kind == "window"}))

    def with_states(self, like: Sequence[Sequence[tuple[tuple[int, ...], mx.Dtype] | None]]
                    ) -> Layout:
        """This layout with the state shapes ``like`` (one entry per state leaf)."""
        if len(like) != len(self.state_leaves):
            raise ValueError(f"{len(like)} state shapes for {len(self.state_leaves)} leaves")
        return Layout(self.entries, self.unsupported, self.kinds,
                      tuple(tuple(x) for x in like))


def _leaf(cache: Any, bad: list[str], kinds: set[str]) -> Leaf | tuple[Leaf, ...]:
    kind = type(cache)
    if kind is CacheList:
        return tuple(_leaf(c, bad, kinds) for c in cache.caches)
    if kind is KVCache:  # exact types: a subclass may mean other semantics
        kinds.add("KVCache")
        return Leaf("kv")
    if kind is RotatingKVCache:
        if cache.keep:
            bad.append(f"RotatingKVCache(keep={cache.keep})")
        kinds.add(f"RotatingKVCache({cache.max_size})")
        return Leaf("window", window=int(cache.max_size))
    if kind is ArraysCache:
        kinds.add("ArraysCache")
        return Leaf("arrays", size=len(cache.cache))
    bad.append(kind.__name__)
    kinds.add(kind.__name__)
    return Leaf("unknown")


def describe(caches: Sequence[Any]) -> Layout:
    """The layout of a model's own caches (``make_prompt_cache(model)``).

    Examples:
        >>> from mlx_lm.models.cache import ChunkedKVCache, KVCache
        >>> describe([KVCache(), ChunkedKVCache(8)]).unsupported
        ('ChunkedKVCache',)
    """
    bad: list[str] = []
    kinds: set[str] = set()
    entries = tuple(_leaf(c, bad, kinds) for c in caches)
    if any(isinstance(e, tuple) and any(isinstance(m, tuple) for m in e) for e in entries):
        bad.append("nested CacheList")
    return Layout(entries, tuple(sorted(set(bad))), tuple(sorted(kinds)))


def _make(leaf: Leaf, num_rows: int, like: Any) -> Any:
    if leaf.kind == "arrays":
        return RaggedArraysCache.from_rows(leaf.size, like, [None] * num_rows)
    if leaf.quant is not None:
        return QuantizedRaggedKVCache(num_rows, leaf.window, bits=leaf.quant.bits,
                                      group_size=leaf.quant.group_size)
    return RaggedKVCache(num_rows, leaf.window)


def model_caches(model: Any, layout: Layout) -> list[Any]:
    """The model's own mlx-lm caches (``make_prompt_cache``), with mlx-lm's
    ``QuantizedKVCache`` of the same bits and group size for each cache ``layout``
    quantizes: what one request computes with mlx-lm alone, the oracle of a quantized pool.

    Examples:
        >>> from mlxcache.zoo import make_model
        >>> model = make_model()
        >>> layout = describe(make_prompt_cache(model)).quantized(KVQuant(4, 32), (32, 32))[0]
        >>> [type(c).__name__ for c in model_caches(model, layout)][:2]
        ['QuantizedKVCache', 'QuantizedKVCache']
    """
    caches = make_prompt_cache(model)
    quant = iter(leaf.quant for leaf in layout.leaves)

    def swap(c: Any) -> Any:
        q = next(quant)
        return c if q is None else QuantizedKVCache(group_size=q.group_size, bits=q.bits)

    return [CacheList(*(swap(m) for m in c.caches)) if isinstance(c, CacheList) else swap(c)
            for c in caches]


def build(layout: Layout, num_rows: int = 0, leaf_caches: Sequence[Any] | None = None
          ) -> list[Any]:
    """The engine's caches for ``layout``, one per layer (``CacheList`` where the model has
    one): ``num_rows`` fresh rows, or the given ``leaf_caches`` (one per leaf, in ``leaves``
    order) put in place.

    Examples:
        >>> from mlx_lm.models.cache import KVCache, RotatingKVCache
        >>> caches = build(describe([KVCache(), RotatingKVCache(max_size=4)]), num_rows=2)
        >>> [type(c).__name__ for c in caches], caches[1].window, caches[0].batch_size
        (['RaggedKVCache', 'RaggedKVCache'], 4, 2)
    """
    if layout.unsupported:
        raise ValueError(f"caches {list(layout.unsupported)} have no ragged form")
    flat = list(layout.leaves)
    if leaf_caches is None:
        state_like = dict(zip(layout.state_leaves, layout.like, strict=False))
        leaf_caches = [_make(leaf, num_rows, state_like.get(i, [None] * leaf.size))
                       for i, leaf in enumerate(flat)]
    elif len(leaf_caches) != len(flat):
        raise ValueError(f"{len(leaf_caches)} caches for {len(flat)} leaves")
    it = iter(leaf_caches)
    return [CacheList(*(next(it) for _ in e)) if isinstance(e, tuple) else next(it)
            for e in layout.entries]


def leaves(caches: Sequence[Any]) -> list[Any]:
    """The leaf caches of ``caches`` (``CacheList`` members in order), as ``Layout.leaves``.

    Examples:
        >>> from mlx_lm.models.cache import ArraysCache, CacheList, KVCache
        >>> caches = build(describe([CacheList(ArraysCache(2), KVCache()), KVCache()]), 1)
        >>> [type(c).__name__ for c in leaves(caches)]
        ['RaggedArraysCache', 'RaggedKVCache', 'RaggedKVCache']
    """
    out: list[Any] = []
    for c in caches:
        out.extend(c.caches if isinstance(c, CacheList) else (c,))
    return out
