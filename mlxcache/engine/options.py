"""The engine's constructor options, checked in one place (a ``ValueError`` names the bad
one). The command line (``mlxcache.generate``) checks its flags with ``check_options`` before
it loads a model.

Examples:
    >>> opts = check_options(num_slots=64)
    >>> opts.num_slots, opts.page_size, opts.prefix_cache
    (64, 1, True)
    >>> check_options(mem_fraction=1.5)
    Traceback (most recent call last):
    ...
    ValueError: mem_fraction=1.5 must be in (0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mlxcache.quant import KVQuant
from servecore.validate import check_int, check_real, options_of

__all__ = ["EngineOptions", "UnusedOptionWarning", "check_options", "check_page_size",
           "unused_options"]


class UnusedOptionWarning(UserWarning):
    """An option was given that does nothing for the model being served (``unused_options``):
    a warning, not an error, since one set of options may serve many models."""


@dataclass(frozen=True)
class EngineOptions:
    """``mlxcache.Engine``'s options, each field's meaning beside it: ``Engine(model,
    tokenizer, **options)`` takes any of them by name; ``checked()`` checks them.

    >>> EngineOptions().max_batch_size
    32
    """

    num_slots: int | None = None
    """KV pool size in token slots (slot 0 is padding); None sizes it from free memory times
    ``mem_fraction`` (Metal's working set on Apple silicon, else ``servecore.memory_budget``:
    ``MemAvailable`` capped by any cgroup limit), at most ``MAX_AUTO_SLOTS``, a quarter of
    that budget kept for the decode buffers (``mlxcache.engine.sizing``; a budget too small
    for a useful cache is a ``ValueError``). Given, the decode buffers may hold as many bytes
    as the pool; requests wait for room beyond that (``Engine.memory``)."""

    page_size: int = 1
    """Radix tree granularity in tokens: the tree caches whole pages, so at most ``num_slots -
    1``. A hybrid model's snapshots sit on page boundaries, so the next turn of a chat
    resumes from the last whole page of prompt + answer, as an attention-only model does."""

    mem_fraction: float = 0.5
    """The share of free memory the automatic pool may take."""

    max_batch_size: int = 32
    """Most requests decoded at once."""

    prefix_cache: bool = True
    """False serves the same way without a pool or tree (no reuse); then the pools' options
    (``num_slots``, ``page_size``, ``num_snapshots``, ``snapshot_interval``) would do nothing,
    and one given is a ``ValueError``."""

    prefill_step_size: int = 2048
    """Most tokens (padding included) in one prefill forward; a longer prompt runs alone, in
    chunks of this many tokens."""

    num_snapshots: int | None = None
    """Hybrid models: the state pool's size in snapshots (None: a quarter of the cache
    memory, ``mlxcache.engine.sizing``)."""

    snapshot_interval: int = 256
    """Hybrid models: the grid of snapshot depths, in tokens. (This or ``num_snapshots``
    given for a model without recurrent layers, or the pools' options for a model served
    without reuse, do nothing: an ``UnusedOptionWarning`` says so.)"""

    prefill_batch_tokens: int | None = None
    """Most uncached tokens admitted into one prefill batch (a request alone may have more).
    None: ``CPU_PREFILL_BATCH_TOKENS`` on MLX's CPU device, where the batch is also sized for
    the mean TTFT (``CPU_FORWARD_COST_TOKENS``); ``prefill_step_size`` on a GPU
    (``mlxcache.engine._admission``)."""

    kv_bits: int | None = None
    """4 or 8: the pool and the decode buffers hold the attention layers' K/V quantized as
    mlx-lm's ``QuantizedKVCache`` of these bits and ``kv_group_size`` (``mlxcache.quant``),
    mlx-lm's attention runs its quantized path, batched, and a prefix hit reads the bytes a
    miss writes. Sliding-window layers and attentions refusing quantized K/V (sinks) stay in
    full precision (``Engine.quantized``)."""

    kv_group_size: int = 64
    """The quantization group along the head dimension: 32, 64 or 128."""

    cache_dir: Any = None
    """A directory for the disk tier (``mlxcache.engine._disk``): evicted prefixes spill there
    and reload on a match, ``close`` spills what memory holds, and a new engine on the
    directory finds them. One engine owns a directory at a time."""

    disk_budget: int = 8 << 30
    """The most bytes the disk tier keeps."""

    disk_min_free: int = 1 << 30
    """Bytes the disk tier leaves free on its disk."""

    @property
    def quant(self) -> KVQuant | None:
        """The K/V quantization asked for (``kv_bits``; None: full precision)."""
        return None if self.kv_bits is None else KVQuant(self.kv_bits, self.kv_group_size)

    def checked(self) -> EngineOptions:
        """These options, each checked (see ``check_options``)."""
        opts = replace(  # checked in this order: the first bad one is named
            self,
            num_slots=_maybe_int("num_slots", self.num_slots, 2),
            page_size=check_int("page_size", self.page_size, 1),
            max_batch_size=check_int("max_batch_size", self.max_batch_size, 1),
            prefill_step_size=check_int("prefill_step_size", self.prefill_step_size, 1),
            mem_fraction=check_real("mem_fraction", self.mem_fraction),
            num_snapshots=_maybe_int("num_snapshots", self.num_snapshots, 2),
            snapshot_interval=check_int("snapshot_interval", self.snapshot_interval, 1),
            prefill_batch_tokens=_maybe_int("prefill_batch_tokens", self.prefill_batch_tokens,
                                            1),
            prefix_cache=bool(self.prefix_cache),
            disk_budget=check_int("disk_budget", self.disk_budget, 0, 1 << 62),
            disk_min_free=check_int("disk_min_free", self.disk_min_free, 0, 1 << 62),
        )
        KVQuant(8 if self.kv_bits is None else self.kv_bits, self.kv_group_size)  # by name
        if not 0 < opts.mem_fraction <= 1:
            raise ValueError(f"mem_fraction={self.mem_fraction!r} must be in (0, 1]")
        if not isinstance(self.prefix_cache, bool | np.bool_):
            raise ValueError(f"prefix_cache={self.prefix_cache!r} must be True or False")
        if not opts.prefix_cache:  # the pools' options do nothing without them
            defaults = EngineOptions()
            for name in ("num_slots", "page_size", "num_snapshots", "snapshot_interval"):
                if getattr(opts, name) != getattr(defaults, name):
                    raise ValueError(f"{name}={getattr(opts, name)!r} does nothing with "
                                     f"prefix_cache=False (no pool, no tree): leave {name} "
                                     "unset, or turn the prefix cache on")
        if opts.num_slots is not None:
            check_page_size(opts.page_size, opts.num_slots)
        return opts


def check_options(**options: Any) -> EngineOptions:
    """``EngineOptions`` from the engine's keyword options, each checked: ints in range
    (never a float or a bool), ``mem_fraction`` in (0, 1], ``prefix_cache`` a bool, a
    ``page_size`` that fits ``num_slots`` (``check_page_size``); and with
    ``prefix_cache=False``, none of the pools' options (``num_slots``, ``page_size``,
    ``num_snapshots``, ``snapshot_interval``) given other than its default, as it would do
    nothing. ``kv_bits`` is None, 4 or 8 and ``kv_group_size`` 32, 64 or 128
    (``mlxcache.quant``). A name that is no option is a ``TypeError`` listing them.

    >>> check_options(kv_bits=3)
    Traceback (most recent call last):
    ...
    ValueError: kv_bits=3 must be one of (4, 8) (or None: full precision)
    >>> check_options(prefix_cache="no")
    Traceback (most recent call last):
    ...
    ValueError: prefix_cache='no' must be True or False
    """
    return options_of(EngineOptions, options, "mlxcache.Engine()").checked()


def _maybe_int(name: str, value: Any, lo: int) -> int | None:
    return None if value is None else check_int(name, value, lo)


def check_page_size(page_size: int, num_slots: int) -> None:
    """A page must fit the longest prompt the KV pool takes (``num_slots - 1`` tokens, slot 0
    being the sink): the tree caches whole pages only, so a larger page would cache nothing.
    ``ValueError`` naming both otherwise (checked when ``num_slots`` is known: given, or
    sized from memory).

    >>> check_page_size(16, num_slots=17)
    >>> check_page_size(16, num_slots=16)
    Traceback (most recent call last):
    ...
    ValueError: page_size=16 is larger than the longest prompt the KV pool takes (15 tokens: \
num_slots=16 less the sink), so nothing would ever be cached: give a smaller page_size or \
more num_slots
    """
    if page_size > num_slots - 1:
        raise ValueError(f"page_size={page_size} is larger than the longest prompt the KV pool "
                         f"takes ({num_slots - 1} tokens: num_slots={num_slots} less the sink), "
                         "so nothing would ever be cached: give a smaller page_size or more "
                         "num_slots")


def unused_options(opts: EngineOptions, *, reuse: bool, has_states: bool,
                   quantized: int | None = None) -> list[str]:
    """What ``opts`` gives (other than its default) that does nothing for a model that the
    engine serves with or without prefix ``reuse`` and with or without recurrent layers
    (``has_states``), one line each: the snapshot options without recurrent layers, and the
    pools' options without reuse (a model served one request per forward with mlx-lm's own
    caches). The engine warns of each (``UnusedOptionWarning``); with ``prefix_cache=False``
    they are refused (``check_options``), as the caller chose that mode. ``kv_bits`` when
    ``quantized`` (the layers it quantized) is 0, and ``kv_group_size`` without ``kv_bits``,
    do nothing either.

    >>> opts = check_options(num_slots=64, snapshot_interval=8)
    >>> unused_options(opts, reuse=True, has_states=True)
    []
    >>> unused_options(opts, reuse=True, has_states=False)
    ['snapshot_interval=8 does nothing: the model has no recurrent layers to snapshot']
    >>> unused_options(opts, reuse=False, has_states=False)[0]
    'num_slots=64 does nothing: the model is served without prefix reuse'
    """
    defaults, out = EngineOptions(), []
    names = (("num_slots", "page_size") if not reuse else ()) + (
        ("num_snapshots", "snapshot_interval") if not (reuse and has_states) else ())
    for name in names:
        value = getattr(opts, name)
        if value != getattr(defaults, name):
            why = ("the model is served without prefix reuse" if not reuse
                   else "the model has no recurrent layers to snapshot")
            out.append(f"{name}={value!r} does nothing: {why}")
    if opts.kv_bits is None and opts.kv_group_size != defaults.kv_group_size:
        out.append(f"kv_group_size={opts.kv_group_size!r} does nothing without kv_bits")
    if opts.kv_bits is not None and quantized == 0:
        out.append(f"kv_bits={opts.kv_bits!r} does nothing: no attention layer of the model "
                   "can hold quantized K/V (Engine.quantized says why)")
    return out
