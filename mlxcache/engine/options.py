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

from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcache.quant import KVQuant
from servecore.validate import check_int, check_real

__all__ = ["Options", "UnusedOptionWarning", "check_options", "check_page_size", "unused_options"]


class UnusedOptionWarning(UserWarning):
    """An option was given that does nothing for the model being served (``unused_options``):
    a warning, not an error, since one set of options may serve many models."""


@dataclass(frozen=True)
class Options:
    """Checked options (``Engine``'s arguments of the same names; see its docstring).

    >>> Options().max_batch_size
    32
    """

    num_slots: int | None = None
    page_size: int = 1
    mem_fraction: float = 0.5
    max_batch_size: int = 32
    prefix_cache: bool = True
    prefill_step_size: int = 2048
    num_snapshots: int | None = None
    snapshot_interval: int = 256
    prefill_batch_tokens: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64

    @property
    def quant(self) -> KVQuant | None:
        """The K/V quantization asked for (``kv_bits``; None: full precision)."""
        return None if self.kv_bits is None else KVQuant(self.kv_bits, self.kv_group_size)


def check_options(*, num_slots: Any = None, page_size: Any = 1, mem_fraction: Any = 0.5,
                  max_batch_size: Any = 32, prefix_cache: Any = True,
                  prefill_step_size: Any = 2048, num_snapshots: Any = None,
                  snapshot_interval: Any = 256, prefill_batch_tokens: Any = None,
                  kv_bits: Any = None, kv_group_size: Any = 64) -> Options:
    """``Options`` from the engine's arguments, each checked: ints in range (never a float or
    a bool), ``mem_fraction`` in (0, 1], ``prefix_cache`` a bool, a ``page_size`` that fits
    ``num_slots`` (``check_page_size``); and with ``prefix_cache=False``, none of the pools'
    options (``num_slots``, ``page_size``, ``num_snapshots``, ``snapshot_interval``) given
    other than its default, as it would do nothing. ``kv_bits`` is None, 4 or 8 and
    ``kv_group_size`` 32, 64 or 128 (``mlxcache.quant``).

    >>> check_options(kv_bits=3)
    Traceback (most recent call last):
    ...
    ValueError: kv_bits=3 must be one of (4, 8) (or None: full precision)
    >>> check_options(prefix_cache="no")
    Traceback (most recent call last):
    ...
    ValueError: prefix_cache='no' must be True or False
    """
    opts = Options(  # checked in this order: the first bad one is named
        num_slots=None if num_slots is None else check_int("num_slots", num_slots, 2),
        page_size=check_int("page_size", page_size, 1),
        max_batch_size=check_int("max_batch_size", max_batch_size, 1),
        prefill_step_size=check_int("prefill_step_size", prefill_step_size, 1),
        mem_fraction=check_real("mem_fraction", mem_fraction),
        num_snapshots=(None if num_snapshots is None
                       else check_int("num_snapshots", num_snapshots, 2)),
        snapshot_interval=check_int("snapshot_interval", snapshot_interval, 1),
        prefill_batch_tokens=(None if prefill_batch_tokens is None
                              else check_int("prefill_batch_tokens", prefill_batch_tokens, 1)),
        prefix_cache=bool(prefix_cache),
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
    KVQuant(8 if kv_bits is None else kv_bits, kv_group_size)  # each checked, by name
    if not 0 < opts.mem_fraction <= 1:
        raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1]")
    if not isinstance(prefix_cache, bool | np.bool_):
        raise ValueError(f"prefix_cache={prefix_cache!r} must be True or False")
    if not opts.prefix_cache:  # the pools' options do nothing without them
        defaults = Options()
        for name in ("num_slots", "page_size", "num_snapshots", "snapshot_interval"):
            if getattr(opts, name) != getattr(defaults, name):
                raise ValueError(f"{name}={getattr(opts, name)!r} does nothing with "
                                 f"prefix_cache=False (no pool, no tree): leave {name} unset, "
                                 "or turn the prefix cache on")
    if opts.num_slots is not None:
        check_page_size(opts.page_size, opts.num_slots)
    return opts


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


def unused_options(opts: Options, *, reuse: bool, has_states: bool,
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
    defaults, out = Options(), []
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
