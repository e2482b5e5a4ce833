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

from servecore.validate import check_int, check_real

__all__ = ["Options", "check_options"]


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


def check_options(*, num_slots: Any = None, page_size: Any = 1, mem_fraction: Any = 0.5,
                  max_batch_size: Any = 32, prefix_cache: Any = True,
                  prefill_step_size: Any = 2048, num_snapshots: Any = None,
                  snapshot_interval: Any = 256, prefill_batch_tokens: Any = None) -> Options:
    """``Options`` from the engine's arguments, each checked: ints in range (never a float or
    a bool), ``mem_fraction`` in (0, 1], ``prefix_cache`` a bool.

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
    )
    if not 0 < opts.mem_fraction <= 1:
        raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1]")
    if not isinstance(prefix_cache, bool | np.bool_):
        raise ValueError(f"prefix_cache={prefix_cache!r} must be True or False")
    return opts
