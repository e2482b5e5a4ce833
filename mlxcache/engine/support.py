"""What the engine can do with a model, found once by probing it: one frozen ``Support``.

A model is served in one of three modes (``Mode``):

* ``BATCHED``: the engine's own caches (``mlxcache.layers``), many requests per forward in
  ragged batches;
* ``SOLO``: the engine's own caches, one request per forward: ragged batches fail, or right
  padding would change a recurrent state (the model's recurrent layers take no lengths);
* ``PLAIN``: mlx-lm's own caches, one request per forward and no reuse: a cache kind the
  engine does not know (``RotatingKVCache`` with keep, ``QuantizedKVCache``, ...) cannot be
  restored from a prefix cache.

Beside the mode: ``reuse`` (prefix reuse from the pool and tree: asked for, and every
attention layer writes K/V of one shape), ``has_states`` (recurrent layers: their states are
snapshotted) and ``pads_exactly`` (a prefill row may be padded part-way; else forwards are cut
so that no row is). A ``PLAIN`` model has none of them: the value refuses the combination.
Each fact that turned something off is in ``notes``, the engine's ``ReuseDisabledWarning``.

Examples:
    >>> from mlxcache.zoo import make_model
    >>> s = Support.probe(make_model())
    >>> s.mode, s.reuse, s.has_states, s.pads_exactly, s.notes
    (<Mode.BATCHED: 'batched'>, True, False, True, ())
    >>> Support(Mode.PLAIN, s.layout, reuse=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a PLAIN model (mlx-lm's own caches) has no reuse, states or padding: ...
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.engine._forward import forward_padded, join_rows
from mlxcache.layers import Layout, build, describe, leaves, model_caches
from mlxcache.quant import KVQuant

__all__ = ["Mode", "ReuseDisabledWarning", "Support"]


class ReuseDisabledWarning(UserWarning):
    """The model is served, correctly, but without prefix reuse, or one request per forward."""


class Mode(enum.Enum):
    """How requests share forwards (see the module docstring).

    >>> Mode("solo")
    <Mode.SOLO: 'solo'>
    """

    BATCHED = "batched"
    SOLO = "solo"
    PLAIN = "plain"


@dataclass(frozen=True)
class Support:
    """The serving mode and the facts the engine branches on (see the module docstring).

    ``layout`` describes the model's caches (with each state array's shape once probed);
    ``kv`` is ``(n_kv_heads, head_dim, v_head_dim, dtype)`` of every attention layer's K/V
    (what the pool holds with reuse; the decode buffers are sized by it without), None when
    the layers disagree or the model's caches are not the engine's. ``quant`` is the K/V
    quantization asked for (``Engine(kv_bits=...)``): the layout's quantized leaves hold it,
    and ``kept`` names each attention layer left in full precision, and why.

    >>> Support(Mode.SOLO, None, reuse=True)
    Traceback (most recent call last):
    ...
    ValueError: reuse=True needs the pool's K/V shape (kv=None)
    """

    mode: Mode
    layout: Layout | None
    reuse: bool = False
    has_states: bool = False
    pads_exactly: bool = False
    kv: tuple | None = None
    notes: tuple[str, ...] = ()
    quant: KVQuant | None = None
    kept: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode is Mode.PLAIN and (self.reuse or self.has_states or self.pads_exactly):
            raise ValueError(f"a PLAIN model (mlx-lm's own caches) has no reuse, states or "
                             f"padding: got reuse={self.reuse}, has_states={self.has_states}, "
                             f"pads_exactly={self.pads_exactly}")
        if self.reuse and self.kv is None:
            raise ValueError("reuse=True needs the pool's K/V shape (kv=None)")

    @property
    def supported(self) -> bool:
        """Served with the engine's own caches (every cache kind known)."""
        return self.mode is not Mode.PLAIN

    @property
    def batched(self) -> bool:
        """Many requests per forward."""
        return self.mode is Mode.BATCHED

    @property
    def num_quantized(self) -> int | None:
        """Attention layers holding quantized K/V (None: ``kv_bits`` not asked for)."""
        if self.quant is None:
            return None
        return 0 if self.layout is None or not self.supported else sum(
            q is not None for q in self.layout.kv_quant)

    @property
    def quantized(self) -> str:
        """Which attention layers hold quantized K/V, in words (the engine's description).

        >>> from mlxcache.zoo import make_model
        >>> Support.probe(make_model()).quantized
        'none (kv_bits=None)'
        """
        if self.quant is None or self.layout is None:
            return "none (kv_bits=None)"
        if not self.supported:
            return "none: " + "; ".join(self.kept)
        q = self.quant
        n, of = sum(x is not None for x in self.layout.kv_quant), len(self.layout.kv_leaves)
        head = (f"{n} of {of} attention layer{'s' * (of != 1)} at {q.bits} bits, groups of "
                f"{q.group_size}")
        return head + "".join(f"; {line}" for line in self.kept)

    @classmethod
    def probe(cls, model: nn.Module, prefix_cache: bool = True,
              quant: KVQuant | None = None) -> Support:
        """Probe ``model`` (a few tiny forwards): its caches, whether the pool can hold its
        K/V, which attention layers can hold it quantized as ``quant``, whether padding and
        ragged batches are exact.

        >>> from mlxcache.zoo import make
        >>> Support.probe(make("llama"), prefix_cache=False).reuse
        False
        >>> Support.probe(make("gemma3_text", head_dim=64), quant=KVQuant(8, 64)).quantized
        '1 of 2 attention layers at 8 bits, groups of 64; layer 0: sliding window (8 tokens)'
        >>> Support.probe(make("llama"), quant=KVQuant(8, 64))
        Traceback (most recent call last):
        ...
        ValueError: kv_group_size=64 divides no attention layer's key and value head sizes \
(16 and 16)
        """
        layout = describe(make_prompt_cache(model))
        if layout.unsupported:
            return cls(Mode.PLAIN, layout, quant=quant, notes=(
                f"model caches {list(layout.kinds)}: {list(layout.unsupported)} cannot be "
                "restored from a prefix cache: no reuse, no batching",), kept=(
                ("mlx-lm's own caches serve this model",)
                if quant is not None else ()))
        layout, kv, why = _probe_layout(model, layout)
        notes, kept = [], ()
        if prefix_cache and kv is None:
            notes.append(f"{why}: the pool cannot hold this model's K/V, no reuse")
        if quant is not None:
            layout, kept = _quantize(model, layout, kv, why, quant)
        part, whole = _padding(model, layout)
        mode = Mode.BATCHED
        if not whole:
            mode = Mode.SOLO
            notes.append("right padding changes the recurrent state (the model's recurrent "
                         "layers take no lengths): serving one request per forward")
        else:
            why = _probe_ragged_batch(model, layout, part)
            if why is not None:
                mode = Mode.SOLO
                notes.append(f"ragged batches fail ({why}): serving one request per forward")
        reuse = prefix_cache and kv is not None
        return cls(mode, layout, reuse=reuse, has_states=bool(layout.state_leaves),
                   pads_exactly=part, kv=kv, notes=tuple(notes), quant=quant, kept=kept)


def _quantize(model: nn.Module, layout: Layout, kv: tuple | None, why: str | None,
              quant: KVQuant) -> tuple[Layout, tuple[str, ...]]:
    """``layout`` with its attention layers quantized as ``quant`` where they can be, and the
    lines naming those that cannot; ``ValueError`` if the group divides no head size. An
    attention that refuses quantized K/V (mlx-lm's quantized attention takes no sinks) is
    found by running the model: each such layer stays in full precision."""
    if kv is None:
        return layout, (f"kv_bits: {why}: no layer quantized",)
    dims = (kv[1], kv[2])
    full = [i for i in layout.kv_leaves if layout.leaves[i].kind == "kv"]
    if full and not all(quant.fits(d) for d in dims):  # (one pool: every layer's shape)
        raise ValueError(f"kv_group_size={quant.group_size} divides no attention layer's "
                         f"key and value head sizes ({dims[0]} and {dims[1]})")
    quantized, kept = layout.quantized(quant, dims)
    if _refusal(model, quantized) is None:
        return quantized, kept
    why = {i: _refusal(model, layout.quantized(quant, dims, skip=[j for j in full if j != i])[0])
           for i in full}  # each layer alone: those whose attention takes no quantized K/V
    return layout.quantized(quant, dims, skip={i: w for i, w in why.items() if w})


def _refusal(model: nn.Module, layout: Layout) -> str | None:
    """None if two tokens run through the model with the engine's caches for ``layout``,
    else what the model raised (mlx-lm: "Quantized SDPA does not support attention sinks.";
    an attention of the model's own, as MLA, takes no quantized tuples)."""
    try:
        mx.eval(model(mx.array([[0, 0]]), cache=build(layout, 1)))
    except Exception as e:  # noqa: BLE001 - named in the layer's line, never swallowed
        return f"{type(e).__name__}: {e}"
    return None


def _probe_layout(model: nn.Module, layout: Layout) -> tuple[Layout, tuple | None, str | None]:
    """Run two tokens through the model with the engine's caches: the layout with each state
    array's shape, and ``((n_kv_heads, head_dim, v_head_dim, dtype), None)`` when every
    attention cache wrote keys and values of one shape (what one KV pool holds), else
    ``(None, reason)``."""
    caches = build(layout, 1)
    mx.eval(model(mx.array([[0, 0]]), cache=caches))
    flat = leaves(caches)
    like = [[None if x is None else (tuple(x.shape[1:]), x.dtype) for x in flat[i].cache]
            for i in layout.state_leaves]
    layout = layout.with_states(like)
    shapes = set()
    for i in layout.kv_leaves:
        c = flat[i]
        if c.keys is None:
            return layout, None, f"cache {i} never wrote its keys"
        shapes.add((c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))
    if not shapes:
        return layout, None, "the model has no attention layer (nothing for a KV pool)"
    if len(shapes) != 1:
        return layout, None, f"layers disagree on K/V shapes {sorted(map(str, shapes))}"
    ((heads, dk, dv, dtype),) = shapes
    return layout, (heads, dk, dv, dtype), None


def _probe_ragged_batch(model: nn.Module, layout: Layout, pads: bool) -> str | None:
    """None if a ragged batch (per-row positions, masks and states, right padding where
    ``pads``) computes what the model's own caches compute request by request, for a
    prefill and a decode step; else why not."""
    prefixes, new = [[0], [0, 0, 0]], [[1, 2, 6], [3, 4]] if pads else [[1, 6], [3, 4]]
    solo = []
    for p, n in zip(prefixes, new, strict=True):
        caches = model_caches(model, layout)
        model(mx.array([p]), cache=caches)
        prefill = model(mx.array([n]), cache=caches)[:, -1]
        solo.append((prefill, model(mx.array([[5]]), cache=caches)[:, -1]))
    batch = build(layout, 0)
    for p in prefixes:
        caches = build(layout, 1)
        model(mx.array([p]), cache=caches)
        join_rows(batch, caches, 0)
    try:
        width = max(map(len, new))
        last = forward_padded(model, batch, [n[:-1] for n in new], width - 1)
        prefill = model(mx.array([n[-1:] for n in new]), cache=batch)[:, -1]
        decode = model(mx.array([[5], [5]]), cache=batch)[:, -1]
        mx.eval(prefill, decode, last)
    except Exception as e:  # any model that cannot take per-row offsets / masks
        return f"{type(e).__name__}: {e}"
    for got, want in ((prefill, [a for a, _ in solo]), (decode, [b for _, b in solo])):
        want = mx.concatenate(want)
        scale = max(1.0, mx.abs(want).max().item())
        if not mx.allclose(got, want, rtol=1e-2, atol=1e-2 * scale).item():
            return "batched logits differ from per-request logits"
    return None


def _padding(model: nn.Module, layout: Layout) -> tuple[bool, bool]:
    """Does right padding leave a row's state as it should? ``(part, whole)``: a row padded
    part-way (2 real tokens in a 3-token forward), and a row that is all padding in a forward.
    Some models' recurrent layers mask padding out of their outputs but not out of the state
    they carry (mlx-lm's Mamba2 SSM under a mask and no ``lengths`` loses the real tokens'
    contribution; a conv state without ``lengths`` shifts the padding in): a model that pads
    whole forwards exactly is served with forwards cut so that no row is padded part-way; one
    that does not is served one request per forward."""
    if not layout.state_leaves:
        return True, True
    outs = []
    for empty, width in ((0, 2), (0, 3), (2, 2)):
        caches = build(layout, 1)
        model(mx.array([[0, 1, 2]]), cache=caches)
        if empty:
            forward_padded(model, caches, [[]], empty)
        forward_padded(model, caches, [[3, 4]], width)
        outs.append(model(mx.array([[5]]), cache=caches)[:, -1])
    mx.eval(outs)
    scale = max(1.0, mx.abs(outs[0]).max().item())
    return tuple(mx.allclose(outs[0], x, rtol=1e-3, atol=1e-3 * scale).item()
                 for x in outs[1:])
