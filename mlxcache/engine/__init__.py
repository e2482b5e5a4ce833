"""Continuous-batching generation with radix prefix reuse for unmodified mlx-lm models.

``Engine`` serves many prompts at once. Its host side is plain Python (a waiting queue,
admission, finishing); its device side is the model called as ``model(inputs, cache=caches)``
with ``RaggedKVCache`` caches. Nothing in the model is patched.

The package, one concept a module, imports pointing down. Public: ``support`` (``Support``,
what the engine can do with a model, found once by probing it; ``ReuseDisabledWarning``),
``options`` (``EngineOptions``: every option documented on its field, checked in one place;
``UnusedOptionWarning``: one a model ignores), ``stats`` (``EngineStats``), ``sizing`` (the
pools' sizes from free memory), ``memory`` (``MemoryReport``) and ``engine`` (``Engine``, the
front door ``servecore.client.EngineClient`` over the core). Internal:

* ``_forward``: ragged forwards over the engine's caches; ``_job``: a request while it is
  served and a decode group.
* ``_store``: the prefix store (pools, free lists, radix tree, snapshots) with the shared
  prefix policy of ``servecore.prefix``; ``_disk``: the disk tier under it (``cache_dir``).
* ``_admission``: which waiting requests go into the next prefill batch.
* ``_core``: the core (``servecore.engine.EngineCore``): rounds, prefill, decode, finishing,
  failures; over ``_path_pooled`` (the engine's caches, batched or one request per forward)
  or ``_path_plain`` (mlx-lm's caches, for models the pool cannot serve).

Examples:
    A tiny random llama (mlx-lm's own class; any ``mlx_lm.load``-ed model serves the same way),
    two prompts that share a prefix, then a follow-up turn that reuses prompt and answer:

    >>> from mlxcache.zoo import make_model
    >>> engine = Engine(make_model(), num_slots=256)
    >>> first, second = engine.generate([[5, 6, 7, 8], [5, 6, 7, 9]], max_tokens=3)
    >>> len(first), len(second), engine.stats.cached_tokens   # [5, 6, 7] was reused
    (3, 3, 3)
    >>> follow_up = [5, 6, 7, 8, *first, 10]
    >>> _ = engine.generate([follow_up], max_tokens=2)
    >>> engine.stats.cached_tokens - 3          # the first prompt and its whole answer
    7
    >>> engine.stats.cached_tokens, engine.stats.prompt_tokens, engine.stats.hit_rate
    (10, 16, 0.625)
    >>> print(engine.tree.pretty())                             # doctest: +ELLIPSIS
    RadixCache(page_size=1, total=..., evictable=..., protected=0)
    root extra_key=None
    └── [5, 6, 7] slots=[...] lock=0
    ...
"""

from mlxcache.engine._admission import CPU_FORWARD_COST_TOKENS, CPU_PREFILL_BATCH_TOKENS
from mlxcache.engine.engine import Engine
from mlxcache.engine.memory import MemoryReport
from mlxcache.engine.options import EngineOptions, UnusedOptionWarning, check_options
from mlxcache.engine.sizing import MAX_AUTO_SLOTS, auto_num_slots
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import Mode, ReuseDisabledWarning, Support

__all__ = ["CPU_FORWARD_COST_TOKENS", "CPU_PREFILL_BATCH_TOKENS", "MAX_AUTO_SLOTS", "Engine",
           "EngineStats", "MemoryReport", "Mode", "EngineOptions", "ReuseDisabledWarning",
           "Support", "UnusedOptionWarning",
           "auto_num_slots", "check_options"]
