"""``EngineStats``: the counters of an ``mlxcache.Engine`` over its life.

Examples:
    >>> EngineStats(requests=1).requests
    1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servecore.stats import ServingStats

__all__ = ["EngineStats"]


@dataclass
class EngineStats(ServingStats):
    """Counters over an engine's life (see ``Engine.stats``): ``servecore.ServingStats``, the
    names and rates both engines share.

    Here ``cached_tokens`` are prompt tokens served from the radix tree and ``prefill_tokens``
    the ones run through the model (``prompt_tokens == cached_tokens + prefill_tokens``);
    ``token_evictions`` counts tokens the tree evicted to make room (``reset_cache`` is not
    counted); ``ttft`` holds each request's seconds from its arrival (the call that queued
    it: ``generate``, ``stream`` or ``add_request``) to its first token, the last
    ``servecore.stats.TTFT_WINDOW`` of them (``mean_ttft`` is over all).
    ``effective_prefill_tok_s`` counts cached prompt tokens too; ``prefill_tok_s`` only the
    computed ones.

    Examples:
        >>> stats = EngineStats(requests=2, prompt_tokens=40, cached_tokens=30,
        ...                     prefill_tokens=10, prefill_seconds=0.5, ttft=[0.2, 0.4])
        >>> stats.hit_rate, stats.prefill_tok_s, stats.effective_prefill_tok_s
        (0.75, 20.0, 80.0)
        >>> round(stats.mean_ttft, 6), EngineStats().hit_rate   # nothing yet: 0, not an error
        (0.3, 0.0)

    Hybrid models also count ``snapshots_taken`` (recurrent-state snapshots stored in the
    state pool) and ``state_evictions`` (snapshots evicted to make room). With a disk tier
    (``cache_dir``): ``disk_hits`` (requests whose prefix was read back from disk),
    ``disk_tokens_read``, and the store's own pages, tokens and bytes read and written
    (``disk``, a ``servecore.diskcache.DiskStats``). ``cached_tokens`` counts prefix tokens
    from either tier.
    """

    disk_hits: int = 0
    disk_tokens_read: int = 0
    disk: Any = None
