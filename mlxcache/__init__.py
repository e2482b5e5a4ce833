"""mlxcache: radix (prefix) caching and batched decode for unmodified mlx-lm models.

- ``mlxcache.pool``: the KV pool and slot allocator as data plus pure functions.
- ``mlxcache.radix``: a token-level radix tree with LRU eviction and locks (no MLX import).
- ``mlxcache.cache``: caches that speak mlx-lm's cache protocol, backed by the pool.
- ``mlxcache.engine``: ``Engine``, continuous batching with prefix reuse, behind the front
  door both engines share (``servecore.client.EngineClient``); ``EngineOptions`` documents
  every option.
- ``mlxcache.sampling``: per-request greedy / temperature / top-k / top-p sampling.
- ``mlxcache.testing``: hypothesis strategies for shared-prefix token sequences and
  brute-force references to test a prefix cache against (needs ``hypothesis``; no MLX).

``Engine``, ``EngineOptions`` and ``EngineStats`` are imported lazily, so ``import
mlxcache.radix`` never needs MLX. The public surface is these names and the modules above
(each with its ``__all__``); modules whose name starts with an underscore are internal.
"""

__all__ = ["Engine", "EngineOptions", "EngineStats", "RadixCache"]


def __getattr__(name):
    if name in ("Engine", "EngineOptions", "EngineStats"):
        from mlxcache import engine

        return getattr(engine, name)
    if name == "RadixCache":
        from mlxcache.radix import RadixCache

        return RadixCache
    raise AttributeError(f"module 'mlxcache' has no attribute {name!r}")
