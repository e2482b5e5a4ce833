"""Progress bars for long work, the way the ecosystem draws them: ``tqdm`` on stderr.

One rule for every bar in both halves (the demo, warmup compilation, checkpoint loading,
``Engine.stream(progress=True)`` and the benchmarks): a bar is drawn only when asked for
*and* stderr is a terminal (tqdm's ``disable=None``), so a log file, a pipe, CI or a
notebook's captured stderr gets no carriage-return noise. ``--json`` output goes to stdout and
is never touched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

__all__ = ["progress_bar"]


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A ``tqdm`` bar on stderr, drawn only when ``enabled`` and stderr is a terminal.

    ``kwargs`` go to ``tqdm`` (``total``, ``desc``, ``unit``, ``leave``...). A disabled bar
    is still a ``tqdm``: iterate it, ``update`` and ``close`` it as usual; it draws nothing
    (and counts nothing: read progress from your own counters, not from ``bar.n``). A file
    that is not a terminal (a log, a pipe, this ``StringIO``) gets nothing:

    >>> import io
    >>> log = io.StringIO()
    >>> bar = progress_bar(range(3), desc="reading", file=log)
    >>> list(bar), bar.disable, log.getvalue()
    ([0, 1, 2], True, '')
    >>> with progress_bar(total=4, unit="tok", enabled=False) as bar:
    ...     bar.update(4)
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"progress={enabled!r} must be True or False")
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, disable=None if enabled else True, **kwargs)
