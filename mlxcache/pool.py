"""The KV pool and its slot allocator, as data plus pure functions.

A ``KVPool`` holds, per layer, one key and one value array of shape
``[num_slots, n_kv_heads, head_dim]``; a token's KV lives at one *slot* (row) in every layer.
Slot 0 is the padding sink: the allocator never hands it out, and padded rows of a batch read
and write slot 0, so they never touch a live slot.

Every function returns a new value and leaves its inputs unchanged. MLX updates a buffer in
place only when nothing else holds the old array, so use a pool *linearly* (rebind the name and
drop the old pool) to make a write cost O(tokens written) rather than O(pool size)::

    pool = set_kv(pool, layer, slots, k, v)   # linear: the old pool is dropped, in place
    new = set_kv(pool, layer, slots, k, v)    # `pool` still held: the write copies the layer

The pool functions check shapes on the host and then use only pure MLX ops
(``put_along_axis``/``take``), so they also work under ``mx.compile``. Slots given on the host
(a list of ints or a NumPy int array) are checked to lie in ``[0, num_slots)``; a float or a
bool is an error, never rounded. Slots given as an ``mx.array`` must have an integer dtype, but
their *values* are not range-checked (that would need a device sync): the allocator guarantees
them.

The allocator (``SlotAllocator``) is a free stack in a read-only numpy array: ``alloc`` of
``n`` slots is O(n) (a view of the stack), ``free`` is O(num_slots) (vectorised numpy). When
too few slots are free, ``alloc`` says so (``ok`` is False) and the caller evicts or raises
``PoolExhausted``: ``servecore.PoolExhausted``, the class both engines raise, which names this
pool ``POOL_NAME``:

>>> str(PoolExhausted(requested=5, available=2, what=POOL_NAME))
'KV pool slots exhausted: requested 5, 2 available'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import numpy as np

from mlxcache.quant import KVQuant, parts
from servecore.errors import PoolExhausted
from servecore.validate import INT32_MAX, check_int, is_int, plain_ints

if TYPE_CHECKING:  # annotations only (they stay strings): no import cost at run time
    from jaxtyping import Float

__all__ = [
    "POOL_NAME",
    "KVPool",
    "STATE_POOL_NAME",
    "StatePool",
    "PoolExhausted",
    "SlotAllocator",
    "alloc",
    "bytes_per_token_slot",
    "checked_slots",
    "free",
    "get_kv",
    "get_states",
    "host_slots",
    "init_allocator",
    "init_pool",
    "init_state_pool",
    "set_kv",
    "set_kv_all_layers",
    "set_states",
]


# --------------------------------------------------------------------------------------------
# KV pool
# --------------------------------------------------------------------------------------------


class KVPool(NamedTuple):
    """Per-layer key and value arrays, each ``[num_slots, n_kv_heads, head_dim]``.

    A plain ``NamedTuple`` of two tuples of ``mx.array``, so it passes through
    ``mx.compile`` and ``mx.eval`` as a tree. Build one with ``init_pool``; change it
    only through ``set_kv`` / ``set_kv_all_layers``, which return a new pool.

    A quantized layer (``layer_quant(layer)`` a ``KVQuant``: ``Engine(kv_bits=...)``) holds its keys
    and its values as the three parts of ``mx.quantize`` (``mlxcache.quant``), each
    ``[num_slots, n_kv_heads, width]``: codes, scales, biases. The functions below take and
    give those tuples for it (or quantize a float array written to it).

    Attributes:
        keys: ``num_layers`` arrays ``[num_slots, n_kv_heads, head_dim]`` (or parts).
        values: ``num_layers`` arrays ``[num_slots, n_kv_heads, head_dim]`` (or parts).
        quant: per layer, its ``(bits, group_size)`` or None (empty: no layer is quantized;
            plain ints, so a pool passes through ``mx.compile``): ``layer_quant``.

    Examples:
        >>> pool = init_pool(num_layers=2, num_slots=8, n_kv_heads=4, head_dim=16)
        >>> pool.num_layers, pool.num_slots, pool.n_kv_heads, pool.head_dim, pool.dtype
        (2, 8, 4, 16, mlx.core.float16)
        >>> pool.bytes_per_slot, pool.nbytes
        (512, 4096)
        >>> q = init_pool(2, 8, 4, 64, quant=[KVQuant(8, 64), None])  # layer 0 at 8 bits
        >>> q.head_dim, [a.shape for a in q.keys[0]], q.bytes_per_slot, 4 * 64 * 2 * 2 * 2
        (64, [(8, 4, 16), (8, 4, 1), (8, 4, 1)], 1568, 2048)
    """

    keys: tuple[mx.array | tuple[mx.array, ...], ...]
    values: tuple[mx.array | tuple[mx.array, ...], ...]
    quant: tuple[tuple[int, int] | None, ...] = ()

    def layer_quant(self, layer: int) -> KVQuant | None:
        """``layer``'s quantization (None: full precision)."""
        q = self.quant[layer] if self.quant else None
        return None if q is None else KVQuant(*q)

    @property
    def num_layers(self) -> int:
        """Number of layers (key/value array pairs)."""
        return len(self.keys)

    @property
    def num_slots(self) -> int:
        """Token slots per layer, the padding sink (slot 0) included."""
        return parts(self.keys[0])[0].shape[0]

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads per token."""
        return parts(self.keys[0])[0].shape[1]

    def _dim(self, x: mx.array | tuple[mx.array, ...]) -> int:
        q = self.layer_quant(0)
        return x.shape[2] if q is None else x[1].shape[2] * q.group_size

    @property
    def head_dim(self) -> int:
        """Size of one head's key (and value) vector (before any quantization)."""
        return self._dim(self.keys[0])

    @property
    def v_head_dim(self) -> int:
        """Size of one head's value vector (``head_dim`` unless the model's differ, as MLA's
        keys and values do)."""
        return self._dim(self.values[0])

    @property
    def dtype(self) -> mx.Dtype:
        """Element type of the keys and values (of a quantized layer's scales and biases)."""
        return parts(self.keys[0])[-1].dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by all key and value arrays together."""
        return sum(a.nbytes for x in self.keys + self.values for a in parts(x))

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token slot takes across all layers, keys and values."""
        return bytes_per_token_slot(self.num_layers, self.n_kv_heads, self.head_dim, self.dtype,
                                    self.v_head_dim,
                                    [self.layer_quant(i) for i in range(self.num_layers)])


def bytes_per_token_slot(num_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                         v_head_dim: int | None = None,
                         quant: Sequence[KVQuant | None] | None = None) -> int:
    """Bytes one token slot takes: keys and values of every layer (values of ``v_head_dim``,
    by default ``head_dim``; a layer with a ``quant`` in its quantized form).

    Examples:
        >>> bytes_per_token_slot(num_layers=2, n_kv_heads=4, head_dim=16, dtype=mx.float16)
        512
        >>> bytes_per_token_slot(2, 4, 64, mx.float16, quant=[KVQuant(4, 64)] * 2)
        576
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    total = 0
    for q in quant or [None] * num_layers:
        if q is None:
            total += n_kv_heads * (head_dim + v_head_dim) * dtype.size
        else:
            total += n_kv_heads * (q.bytes_per_vector(head_dim, dtype)
                                   + q.bytes_per_vector(v_head_dim, dtype))
    return total


def init_pool(
    num_layers: int,
    num_slots: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype = mx.float16,
    v_head_dim: int | None = None,
    quant: Sequence[KVQuant | None] | None = None,
) -> KVPool:
    """A zeroed pool: ``num_layers`` key and value arrays of ``[num_slots, n_kv_heads, head_dim]``
    (values ``[num_slots, n_kv_heads, v_head_dim]`` when given); a layer whose ``quant`` entry
    is a ``KVQuant`` holds the parts of its quantized form instead.

    ``num_slots`` counts the padding sink (slot 0), so it must be at least 2.

    Examples:
        >>> pool = init_pool(num_layers=2, num_slots=8, n_kv_heads=4, head_dim=16)
        >>> pool.keys[0].shape
        (8, 4, 16)
        >>> init_pool(1, 8, 4, 16, quant=[KVQuant(8, 32)])
        Traceback (most recent call last):
        ...
        ValueError: quant[0]: kv_group_size=32 does not divide the head size 16
    """
    num_layers = check_int("num_layers", num_layers, 1)
    num_slots = _check_num_slots(num_slots)
    n_kv_heads = check_int("n_kv_heads", n_kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype={dtype!r} must be a floating mlx dtype (mx.float16, ...)")
    v_head_dim = head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1)
    quant = tuple(quant) if quant is not None else ()
    if quant and len(quant) != num_layers:
        raise ValueError(f"quant has {len(quant)} entries for {num_layers} layers")
    for i, q in enumerate(quant):
        for d in {head_dim, v_head_dim}:
            if q is not None and not q.fits(d):
                raise ValueError(f"quant[{i}]: kv_group_size={q.group_size} does not divide "
                                 f"the head size {d}")

    def zeros(q: KVQuant | None, dim: int) -> mx.array | tuple[mx.array, ...]:
        if q is None:
            return mx.zeros((num_slots, n_kv_heads, dim), dtype=dtype)
        return tuple(mx.zeros((num_slots, n_kv_heads, w), dtype=d) for w, d in q.shapes(dim, dtype))

    layers = quant or (None,) * num_layers
    return KVPool(keys=tuple(zeros(q, head_dim) for q in layers),
                  values=tuple(zeros(q, v_head_dim) for q in layers),
                  quant=(tuple(None if q is None else (q.bits, q.group_size) for q in quant)
                         if any(q is not None for q in quant) else ()))


def _check_num_slots(num_slots: int) -> int:
    # Slot ids travel as int32 on the device: the largest must fit.
    if not is_int(num_slots) or not 2 <= int(num_slots) <= INT32_MAX:
        raise ValueError(f"num_slots={num_slots!r} must be an int in [2, {INT32_MAX}] "
                         "(slot 0 is the padding sink)")
    return int(num_slots)


def _check_layer(pool: KVPool, layer: int) -> None:
    if not is_int(layer) or not 0 <= layer < pool.num_layers:
        raise ValueError(f"layer={layer!r} must be an int in [0, {pool.num_layers})")


def host_slots(name: str, slots: Sequence[int] | np.ndarray, num_slots: int) -> np.ndarray:
    """Slot ids given on the host (a sequence of ints, or a 1-D NumPy int array) as an int64
    array ``[T]``, each checked to lie in ``[0, num_slots)``; ValueError naming the bad one.

    Examples:
        >>> host_slots("slots", [0, 3], num_slots=4).tolist()
        [0, 3]
        >>> host_slots("slots", [1.9], num_slots=4)
        Traceback (most recent call last):
        ...
        ValueError: slots[0]=1.9 must be an int slot id in [0, 4)
    """
    if isinstance(slots, np.ndarray):
        if slots.ndim != 1 or (slots.size and not np.issubdtype(slots.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D integer array [T], got shape "
                             f"{slots.shape} dtype {slots.dtype}")
        arr = slots.astype(np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= num_slots))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}]={int(arr[i])} must be an int slot id in "
                             f"[0, {num_slots})")
        return arr
    if plain_ints(slots, num_slots):
        return np.asarray(slots, dtype=np.int64).reshape(-1)
    if isinstance(slots, str | bytes) or not isinstance(slots, Sequence):
        raise ValueError(f"{name} must be a list or 1-D integer array of slot ids, got "
                         f"{type(slots).__name__}")
    for i, s in enumerate(slots):
        if not is_int(s) or not 0 <= s < num_slots:
            raise ValueError(f"{name}[{i}]={s!r} must be an int slot id in [0, {num_slots})")
    return np.asarray(slots, dtype=np.int64).reshape(-1)


def _as_slots(pool: KVPool, slots: mx.array | np.ndarray | Sequence[int]) -> mx.array:
    """``slots`` as a 1-D integer ``mx.array`` ``[T]`` (host slots range-checked)."""
    if not isinstance(slots, mx.array):
        return mx.array(host_slots("slots", slots, pool.num_slots).astype(np.int32))
    if slots.ndim != 1 or not mx.issubdtype(slots.dtype, mx.integer):
        raise ValueError(
            f"slots must be a 1-D integer array [T], got shape {slots.shape} dtype {slots.dtype}"
        )
    return slots


def _as_rows(pool: KVPool, layer: int, name: str, x: Any, num_tokens: int) -> Any:
    """``x`` as ``layer``'s rows: ``[T, n_kv_heads, head_dim]`` in the pool's dtype, or for a
    quantized layer its parts, each ``[T, n_kv_heads, width]`` (a float ``x`` is quantized).

    Accepts ``[T, n_kv_heads, head_dim]`` or mlx-lm's ``[1, n_kv_heads, T, head_dim]`` (each
    part alike).
    """
    q = pool.layer_quant(layer)
    dst = (pool.values if name[0] == "v" else pool.keys)[layer]
    if q is not None and isinstance(x, mx.array):
        x = q.quantize(_tokens_first(x).astype(pool.dtype))  # as the model's own dtype would
    if isinstance(x, mx.array) != isinstance(dst, mx.array) or len(parts(x)) != len(parts(dst)):
        want = ("an array" if isinstance(dst, mx.array)
                else f"the {len(parts(dst))} parts of a quantized K/V")
        raise ValueError(f"{name} must be {want} for layer {layer}, got {type(x).__name__}")
    out = []
    for j, (a, d) in enumerate(zip(parts(x), parts(dst), strict=True)):
        a = _tokens_first(a)
        want = (num_tokens, *d.shape[1:])
        if tuple(a.shape) != want:
            what = name if isinstance(dst, mx.array) else f"{name} part {j}"
            raise ValueError(
                f"{what} must be [T, n_kv_heads, head_dim] = {list(want)} or "
                f"[1, n_kv_heads, T, head_dim] = {[1, want[1], want[0], want[2]]}, "
                f"got shape {list(a.shape)}"
            )
        out.append(a.astype(d.dtype))
    return out[0] if isinstance(dst, mx.array) else tuple(out)


def _tokens_first(x: mx.array) -> mx.array:
    """mlx-lm's ``[1, n_kv_heads, T, d]`` as ``[T, n_kv_heads, d]`` (else ``x``)."""
    return x[0].swapaxes(0, 1) if x.ndim == 4 and x.shape[0] == 1 else x


def _scatter_rows(dst: Any, slots: mx.array, rows: Any) -> Any:
    """``dst`` with ``dst[slots[i]] = rows[i]`` (each part alike), as a pure op (no in-place
    assignment)."""
    if not isinstance(dst, mx.array):
        return tuple(_scatter_rows(d, slots, r) for d, r in zip(dst, rows, strict=True))
    index = mx.broadcast_to(slots[:, None, None], rows.shape)
    return mx.put_along_axis(dst, index, rows, axis=0)


def _slice_rows(dst: Any, start: mx.array, rows: Any) -> Any:
    """``dst`` with ``rows`` written from row ``start`` on (each part alike)."""
    if not isinstance(dst, mx.array):
        return tuple(_slice_rows(d, start, r) for d, r in zip(dst, rows, strict=True))
    return mx.slice_update(dst, rows, start, axes=(0,))


def _replace_at(xs: tuple[mx.array, ...], i: int, x: mx.array) -> tuple[mx.array, ...]:
    return xs[:i] + (x,) + xs[i + 1 :]


def set_kv(
    pool: KVPool,
    layer: int,
    slots: mx.array | np.ndarray | Sequence[int],
    k: Float[mx.array, "T n_kv_heads head_dim"] | Float[mx.array, "1 n_kv_heads T head_dim"],
    v: Float[mx.array, "T n_kv_heads head_dim"] | Float[mx.array, "1 n_kv_heads T head_dim"],
) -> KVPool:
    """A pool with ``k``/``v`` written at ``slots`` of ``layer``; ``pool`` is unchanged.

    Args:
        pool: the pool to write into.
        layer: layer index in ``[0, num_layers)``.
        slots: int ``[T]`` (an ``mx.array``, a NumPy int array or a list of ints); padded rows
            should point at slot 0.
        k: keys ``[T, n_kv_heads, head_dim]`` or mlx-lm's ``[1, n_kv_heads, T, head_dim]``;
            cast to the pool's dtype.
        v: values, shaped as ``k``.

    Returns:
        A new ``KVPool``; only ``layer``'s arrays differ from ``pool``'s.

    If two entries of ``slots`` coincide (e.g. several padded rows at slot 0), which of their
    rows lands is unspecified.

    Examples:
        >>> pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=2)
        >>> pool = set_kv(pool, 0, mx.array([2]), mx.ones((1, 1, 2)), mx.ones((1, 1, 2)))
        >>> get_kv(pool, 0, mx.array([2]))[0].tolist()
        [[[1.0, 1.0]]]
    """
    _check_layer(pool, layer)
    slots = _as_slots(pool, slots)
    t = slots.shape[0]
    k = _as_rows(pool, layer, "k", k, t)
    v = _as_rows(pool, layer, "v", v, t)
    return pool._replace(
        keys=_replace_at(pool.keys, layer, _scatter_rows(pool.keys[layer], slots, k)),
        values=_replace_at(pool.values, layer, _scatter_rows(pool.values[layer], slots, v)),
    )


def set_kv_all_layers(
    pool: KVPool,
    slots: mx.array | np.ndarray | Sequence[int],
    ks: Sequence[mx.array],
    vs: Sequence[mx.array],
) -> KVPool:
    """A pool with ``ks[l]``/``vs[l]`` written at ``slots`` of every layer ``l``.

    Args:
        pool: the pool to write into.
        slots: int ``[T]`` (as for ``set_kv``).
        ks: ``num_layers`` key arrays, each ``[T, n_kv_heads, head_dim]`` or
            ``[1, n_kv_heads, T, head_dim]`` (as for ``set_kv``).
        vs: ``num_layers`` value arrays, shaped as ``ks``.

    Examples:
        >>> pool = init_pool(num_layers=2, num_slots=4, n_kv_heads=1, head_dim=2)
        >>> kv = [mx.ones((1, 1, 2))] * 2
        >>> pool = set_kv_all_layers(pool, mx.array([3]), kv, kv)
        >>> get_kv(pool, 1, mx.array([3]))[1].tolist()
        [[[1.0, 1.0]]]
    """
    if len(ks) != pool.num_layers or len(vs) != pool.num_layers:
        raise ValueError(
            f"need one k and one v per layer ({pool.num_layers}), got {len(ks)} ks and {len(vs)} vs"
        )
    if not isinstance(slots, mx.array):  # host slots: checked once, a run found on the host
        slots = host_slots("slots", slots, pool.num_slots)
    run = _run_start(slots)
    slots = _as_slots(pool, slots) if run is None else slots
    t = slots.shape[0]
    ks = [_as_rows(pool, i, f"ks[{i}]", k, t) for i, k in enumerate(ks)]
    vs = [_as_rows(pool, i, f"vs[{i}]", v, t) for i, v in enumerate(vs)]
    if run is not None:  # host slots in one ascending run: a slice write (3-4x a scatter's speed)
        start = mx.array([run])

        def write(dst: Any, rows: Any) -> Any:
            return _slice_rows(dst, start, rows)
    else:

        def write(dst: Any, rows: Any) -> Any:
            return _scatter_rows(dst, slots, rows)

    return pool._replace(
        keys=tuple(write(dst, k) for dst, k in zip(pool.keys, ks, strict=True)),
        values=tuple(write(dst, v) for dst, v in zip(pool.values, vs, strict=True)),
    )


def _run_start(slots: mx.array | np.ndarray | Sequence[int]) -> int | None:
    """The first of checked host ``slots`` (``host_slots``) that form one ascending run
    ``s, s+1, ...`` (else None; device slots are not read back to find out)."""
    if not isinstance(slots, np.ndarray) or slots.ndim != 1 or not slots.size:
        return None
    h = slots
    return int(h[0]) if h[-1] - h[0] == h.size - 1 and np.all(np.diff(h) == 1) else None


def get_kv(
    pool: KVPool, layer: int, slots: mx.array | np.ndarray | Sequence[int]
) -> tuple[Any, Any]:
    """Keys and values of ``layer`` at ``slots``, each ``[T, n_kv_heads, head_dim]`` (a
    quantized layer's: its parts, each ``[T, n_kv_heads, width]``).

    Args:
        pool: the pool to read.
        layer: layer index in ``[0, num_layers)``.
        slots: int ``[T]`` (as for ``set_kv``); slot 0 reads the padding sink.

    Examples:
        >>> pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=2, head_dim=8)
        >>> k, v = get_kv(pool, 0, mx.array([0, 3, 1]))
        >>> k.shape
        (3, 2, 8)
    """
    _check_layer(pool, layer)
    slots = _as_slots(pool, slots)

    def take(x: Any) -> Any:
        if isinstance(x, mx.array):
            return mx.take(x, slots, axis=0)
        return tuple(mx.take(a, slots, axis=0) for a in x)

    return take(pool.keys[layer]), take(pool.values[layer])


# --------------------------------------------------------------------------------------------
# Slot allocator
# --------------------------------------------------------------------------------------------

POOL_NAME = "KV pool slots"
"""What ``PoolExhausted`` calls this pool (see the module docstring)."""


class SlotAllocator(NamedTuple):
    """A free stack of slot ids in ``[1, num_slots)``; slot 0 (the padding sink) is never free.

    ``free_slots`` is a read-only int64 array ``[num_free]``; ``alloc`` pops from its end.
    Like the pool it is a value: ``alloc`` and ``free`` return a new allocator.

    Examples:
        >>> a = init_allocator(4)
        >>> a.num_free, a.free_slots.tolist()
        (3, [3, 2, 1])
    """

    free_slots: np.ndarray
    num_slots: int

    @property
    def num_free(self) -> int:
        """Slots that ``alloc`` can still hand out."""
        return int(self.free_slots.shape[0])


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def init_allocator(num_slots: int) -> SlotAllocator:
    """An allocator with slots ``1 .. num_slots - 1`` free, handed out in increasing order.

    Examples:
        >>> alloc(init_allocator(8), 3)[1]
        [1, 2, 3]
    """
    num_slots = _check_num_slots(num_slots)
    return SlotAllocator(
        free_slots=_frozen(np.arange(num_slots - 1, 0, -1, dtype=np.int64)), num_slots=num_slots
    )


def alloc(a: SlotAllocator, n: int) -> tuple[SlotAllocator, list[int] | None, bool]:
    """Take ``n`` free slots: ``(new_allocator, slots, True)``.

    If fewer than ``n`` are free, returns ``(a, None, False)`` with ``a`` itself unchanged, so the
    caller can evict and retry (or raise ``PoolExhausted``).

    Examples:
        >>> a = init_allocator(4)
        >>> a, slots, ok = alloc(a, 2)
        >>> slots, ok, a.num_free
        ([1, 2], True, 1)
        >>> alloc(a, 2)[1:]
        (None, False)
    """
    n = check_int("n", n, 0)
    if n > a.num_free:
        return a, None, False
    if n == 0:
        return a, [], True
    stack = a.free_slots
    return a._replace(free_slots=stack[:-n]), stack[-n:][::-1].tolist(), True


def free(a: SlotAllocator, slots: Iterable[int] | np.ndarray | mx.array) -> SlotAllocator:
    """Return ``slots`` to the allocator: a new allocator; ``a`` is unchanged.

    Raises ValueError (naming the slots) for slot 0, slots outside ``[1, num_slots)``, repeats
    within ``slots`` (``checked_slots``), or slots that are already free (a double free).
    Costs a pass over every slot (a linear owner keeps a free mask instead:
    ``servecore.ids.IdPool``).

    Examples:
        >>> a, slots, _ = alloc(init_allocator(4), 2)
        >>> free(a, slots).num_free
        3
    """
    arr = checked_slots(slots, a.num_slots)
    if arr.size == 0:
        return a
    is_free = np.zeros(a.num_slots, dtype=bool)
    is_free[a.free_slots] = True
    double = arr[is_free[arr]]
    if double.size:
        raise ValueError(f"double free: slots already free: {double[:8].tolist()}")
    return a._replace(free_slots=_frozen(np.concatenate([a.free_slots, arr[::-1]])))


def checked_slots(slots: Iterable[int] | np.ndarray | mx.array, num_slots: int) -> np.ndarray:
    """``slots`` to give back to a pool of ``num_slots``, as int64 ``[n]``: ValueError (naming
    them) for non-integers, slot 0 (the sink), slots outside ``[1, num_slots)`` or repeats.

    Examples:
        >>> checked_slots([3, 1], 4).tolist()
        [3, 1]
        >>> checked_slots([2, 2], 4)
        Traceback (most recent call last):
        ...
        ValueError: slots repeated in one free: [2]
    """
    if isinstance(slots, np.ndarray | mx.array):
        arr = np.asarray(slots).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"slots must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    else:
        items = list(slots)
        bad = [s for s in items if not is_int(s)]
        if bad:
            raise ValueError(f"slots must be integers, got {bad[:8]}")
        arr = np.asarray(items, dtype=np.int64)
    if arr.size == 0:
        return arr
    if np.any(arr == 0):
        raise ValueError("cannot free slot 0: it is the padding sink and never allocated")
    out = arr[(arr < 1) | (arr >= num_slots)]
    if out.size:
        raise ValueError(f"slots out of range [1, {num_slots}): {out[:8].tolist()}")
    uniq, counts = np.unique(arr, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"slots repeated in one free: {uniq[counts > 1][:8].tolist()}")
    return arr


# --------------------------------------------------------------------------------------------
# State pool (recurrent layers of hybrid models)
# --------------------------------------------------------------------------------------------

STATE_POOL_NAME = "state snapshot slots"
"""What ``PoolExhausted`` calls the state pool."""


class StatePool(NamedTuple):
    """Snapshots of recurrent layer states (the arrays of mlx-lm ``ArraysCache`` layers): one
    array ``[num_slots, *shape]`` per state array of the model, in the model's cache order.

    A snapshot slot holds one request's state of every recurrent layer at one depth (a conv
    window and a recurrent state per layer, say), in the dtype the live state has, so a
    restore is exact. Slot 0 is the sink, as in ``KVPool``. Change it only through
    ``set_states``, which returns a new pool; use it linearly, as a ``KVPool``.

    Examples:
        >>> pool = init_state_pool([((3, 4), mx.float32), ((2,), mx.float16)], num_slots=5)
        >>> pool.num_slots, [a.shape for a in pool.arrays], pool.bytes_per_slot
        (5, [(5, 3, 4), (5, 2)], 52)
    """

    arrays: tuple[mx.array, ...]

    @property
    def num_slots(self) -> int:
        """Snapshot slots, the sink (slot 0) included."""
        return self.arrays[0].shape[0] if self.arrays else 0

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one snapshot: every recurrent state array of one request."""
        return sum(a.nbytes // a.shape[0] for a in self.arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole pool."""
        return sum(a.nbytes for a in self.arrays)


def init_state_pool(
    shapes: Sequence[tuple[Sequence[int], mx.Dtype]], num_slots: int
) -> StatePool:
    """A zeroed state pool: one ``[num_slots, *shape]`` array per ``(shape, dtype)``.

    Examples:
        >>> init_state_pool([((2, 2), mx.float32)], num_slots=3).arrays[0].shape
        (3, 2, 2)
    """
    num_slots = _check_num_slots(num_slots)
    if not shapes:
        raise ValueError("a state pool needs at least one state array (shape, dtype)")
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        if not isinstance(dtype, mx.Dtype):
            raise ValueError(f"shapes[{i}] dtype={dtype!r} must be an mlx dtype")
        out.append(mx.zeros((num_slots, *(check_int(f"shapes[{i}]", d, 1) for d in shape)),
                            dtype=dtype))
    return StatePool(tuple(out))


def _state_slots(pool: StatePool, slots: Sequence[int] | np.ndarray | mx.array) -> mx.array:
    if isinstance(slots, mx.array):
        if slots.ndim != 1 or not mx.issubdtype(slots.dtype, mx.integer):
            raise ValueError(f"slots must be a 1-D integer array, got shape {slots.shape} "
                             f"dtype {slots.dtype}")
        return slots
    return mx.array(host_slots("slots", slots, pool.num_slots).astype(np.int32))


def set_states(
    pool: StatePool, slots: Sequence[int] | np.ndarray | mx.array, states: Sequence[mx.array]
) -> StatePool:
    """A pool with ``states[j][i]`` stored at snapshot slot ``slots[i]`` of array ``j``;
    ``pool`` is unchanged. ``states`` has one ``[n, *shape]`` array per pool array, in the
    pool's dtype (a snapshot is exact: another dtype is an error, never a cast).

    Examples:
        >>> pool = init_state_pool([((2,), mx.float32)], num_slots=4)
        >>> pool = set_states(pool, [3], [mx.array([[1.0, 2.0]])])
        >>> get_states(pool, [3, 0])[0].tolist()
        [[1.0, 2.0], [0.0, 0.0]]
    """
    idx = _state_slots(pool, slots)
    n = idx.shape[0]
    if len(states) != len(pool.arrays):
        raise ValueError(f"need one state array per pool array ({len(pool.arrays)}), got "
                         f"{len(states)}")
    out = []
    for j, (dst, x) in enumerate(zip(pool.arrays, states, strict=True)):
        if tuple(x.shape) != (n, *dst.shape[1:]) or x.dtype != dst.dtype:
            raise ValueError(f"states[{j}] must be {[n, *dst.shape[1:]]} {dst.dtype}, got "
                             f"{list(x.shape)} {x.dtype}")
        index = mx.broadcast_to(idx.reshape(n, *([1] * (x.ndim - 1))), x.shape)
        out.append(mx.put_along_axis(dst, index, x, axis=0))
    return StatePool(tuple(out))


def get_states(
    pool: StatePool, slots: Sequence[int] | np.ndarray | mx.array
) -> tuple[mx.array, ...]:
    """The snapshots at ``slots``: one ``[n, *shape]`` array per pool array (a copy: the pool
    keeps its own).

    Examples:
        >>> pool = init_state_pool([((2,), mx.float32)], num_slots=4)
        >>> get_states(pool, [1, 2])[0].shape
        (2, 2)
    """
    idx = _state_slots(pool, slots)
    return tuple(mx.take(a, idx, axis=0) for a in pool.arrays)
