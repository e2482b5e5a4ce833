"""A token-level radix tree from token ids to KV slot ids, with recurrent-state snapshots,
two LRU orders and locks. One tree for both engines (pure Python: no JAX, no MLX).

SGLang-style prefix cache: each edge holds a run of token ids and the KV slots that hold their
keys and values. ``RadixCache.match_prefix`` finds the longest cached prefix of a request,
``RadixCache.insert`` adds a finished (or prefilled) sequence, ``RadixCache.lock`` pins a
running request's prefix, and ``RadixCache.evict`` frees the least recently used unlocked
leaves.

**States** (``RadixCache(states=True)``, for hybrid models). A linear-attention or SSM layer's
recurrent state is valid only at the exact depth where it was taken, so a node may also hold a
snapshot *handle* (the caller's id of a stored state, such as a snapshot slot): the state after
consuming every token from the root to the end of that node's key. ``add_state`` attaches one
(splitting an edge so a node ends exactly at its depth; a split leaves the state on the node
that still ends at the state's depth). ``match_prefix`` returns, beside the KV match, the
deepest node on the matched path that holds a state: the *usable* prefix is that node's depth
(the root stands for the empty prefix, whose state is the zero state). States and KV are
evicted separately, each in its own LRU order: ``evict_states`` drops states (an inner node
keeps its KV as a *tombstone*; a leaf goes, KV and all, with the tombstone leaves above it),
and ``evict`` drops whole leaves with their states (tombstone leaves left childless go too:
without a state below or at them their KV serves no match). Locks protect both.

The tree owns the slots and handles stored in it: they leave it only through ``evict`` and
``evict_states``, which return them (``Evicted``) to the caller to free.

``page_size > 1`` stores and matches whole pages only: sequences are truncated to a multiple of
``page_size`` and edges split only at page boundaries (states sit at page boundaries too).

``extra_key`` namespaces the tree (e.g. per LoRA adapter): sequences under different extra keys
never share a prefix. Each extra key has its own root.

Recency is a monotonic counter (one tick per ``match_prefix`` / ``insert`` / ``add_state``),
ties broken by node creation order, so eviction order is deterministic.

Tokens are checked at the door: a list (or tuple, range) of ints, or a 1-D integer array
(NumPy, MLX), each in the int32 range of token ids; a float, a bool or a nested list is a
ValueError naming it. (An ``mx.array`` scalar hashes by identity, so a tree keyed by them
would never match.) Slots are ints in the same range; an extra key is a hashable value that
is not an array; a state handle is any hashable value but ``None``.

Examples:
    >>> cache = RadixCache()
    >>> cache.insert([1, 2, 3], [10, 11, 12])
    0
    >>> cache.match_prefix([1, 2, 9]).slots
    [10, 11]
    >>> cache.evict(1).slots
    [12]

    With states: the usable prefix is the deepest state on the matched path.

    >>> tree = RadixCache(states=True)
    >>> tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    0
    >>> tree.add_state([1, 2], "s2"), tree.add_state([1, 2, 3, 4], "s4")
    (True, True)
    >>> m = tree.match_prefix([1, 2, 3, 9])
    >>> m.slots, m.state_node.state, m.state_node.depth  # KV for 3 tokens, a state at 2
    ([10, 11, 12], 's2', 2)
"""


from servecore.radix.nodes import Evicted, PrefixMatch, TreeNode, path_of
from servecore.radix.tree import RadixCache

__all__ = ["Evicted", "PrefixMatch", "RadixCache", "TreeNode", "path_of"]
