"""The radix tree of ``mlxcache``: ``servecore.radix``, the one tree both engines share.

``RadixCache`` maps token ids to KV slot ids with LRU eviction and locks (and, with
``states=True``, recurrent-state snapshots for hybrid models); it imports neither MLX nor JAX.
See ``servecore.radix`` for the whole contract.

Examples:
    >>> cache = RadixCache()
    >>> cache.insert([1, 2, 3], [10, 11, 12])
    0
    >>> cache.match_prefix([1, 2, 9]).slots
    [10, 11]
    >>> cache.evict(1).slots
    [12]
"""

from servecore.radix import Evicted, PrefixMatch, RadixCache, TreeNode

__all__ = ["Evicted", "PrefixMatch", "RadixCache", "TreeNode"]
