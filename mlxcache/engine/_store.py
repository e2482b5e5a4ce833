"""The prefix store: the KV pool, the state pool, their slot allocators and the radix tree,
kept consistent, with the prefix policy of ``servecore.prefix``.

The tree owns the slots (and snapshot slots) stored in it; a running request owns the slots
it allocated until its prompt is inserted (``Job.pending``); every other slot is free. The
store's methods keep that true: ``reserve`` locks a request's matched prefix and allocates the
rest (``servecore.prefix.make_room``: evict exactly the shortfall, or nothing and wait),
``publish_prompts`` / ``publish_answer`` write the new K/V to the pool and insert them,
``snapshot`` stores recurrent states (``take_states``), ``reconcile`` rebuilds the allocators
from the tree after a failure.

Examples:
    >>> from mlxcache.engine.options import check_options
    >>> from mlxcache.engine.stats import EngineStats
    >>> from mlxcache.engine.support import Support
    >>> from mlxcache.zoo import make_model
    >>> store = PrefixStore.build(Support.probe(make_model()), check_options(num_slots=16),
    ...                           EngineStats())
    >>> store.num_slots, store.num_free_slots, store.match([1, 2]).cached
    (16, 15, 0)
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.cache import RaggedArraysCache, RaggedKVCache, kv_concat
from mlxcache.engine._forward import arrays_in
from mlxcache.engine._job import Job
from mlxcache.engine.options import EngineOptions, check_page_size
from mlxcache.engine.sizing import PoolSizes, pool_sizes
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import Support
from mlxcache.layers import build, leaves
from mlxcache.pool import (
    bytes_per_token_slot,
    get_states,
    init_pool,
    init_state_pool,
    set_kv_all_layers,
    set_states,
)
from servecore.engine import delegate
from servecore.ids import IdPool
from servecore.prefix import (
    Match,
    cached_len,
    give_back,
    keep_state,
    make_room,
    match,
    take_states,
)
from servecore.radix import Evicted, RadixCache, TreeNode
from servecore.snapshots import snapshot_points

__all__ = ["PrefixStore"]

log = logging.getLogger("mlxcache")


class PrefixStore:
    """The pools, allocators and tree of an engine with prefix reuse (see the module
    docstring). ``build`` sizes and allocates them.

    >>> from mlxcache.engine import Engine
    >>> from mlxcache.zoo import make_model
    >>> store = Engine(make_model(), num_slots=32).core.store
    >>> store.cache_bytes == store.num_slots * store.pool.bytes_per_slot
    True
    """

    def __init__(self, support: Support, opts: EngineOptions, stats: EngineStats, num_slots: int,
                 num_snapshots: int):
        self.layout = support.layout
        self.has_states = support.has_states
        self.page_size = opts.page_size
        self.snapshot_interval = opts.snapshot_interval
        self.stats = stats
        heads, head_dim, v_head_dim, dtype = support.kv
        self.pool = init_pool(len(self.layout.kv_leaves), num_slots, heads, head_dim, dtype,
                              v_head_dim, self.layout.kv_quant)
        self.slots = IdPool(num_slots, "KV slot")
        self.tree = RadixCache(opts.page_size, states=self.has_states)
        self.states = self.state_slots = None
        if self.has_states:
            self.states = init_state_pool(
                [x for leaf in self.layout.like for x in leaf if x is not None], num_snapshots)
            self.state_slots = IdPool(num_snapshots, "snapshot slot")
        # The budget of given sizes (``mlxcache.engine.sizing``); ``build`` sets its own.
        self.sizes = PoolSizes(num_slots, num_snapshots, "given",
                               self.cache_bytes + self.pool.nbytes, self.pool.nbytes)
        mx.eval(self.arrays())

    @classmethod
    def build(cls, support: Support, opts: EngineOptions, stats: EngineStats) -> PrefixStore:
        """A store sized by ``opts`` (``mlxcache.engine.sizing``) for ``support``'s model."""
        layout = support.layout
        heads, head_dim, v_head_dim, dtype = support.kv
        n_kv = len(layout.kv_leaves)
        per_slot = bytes_per_token_slot(n_kv, heads, head_dim, dtype, v_head_dim,
                                        layout.kv_quant)
        per_snapshot = sum(math.prod(x[0]) * x[1].size for leaf in layout.like
                           for x in leaf if x is not None)
        sizes = pool_sizes(per_slot=per_slot, per_snapshot=per_snapshot,
                           num_slots=opts.num_slots, num_snapshots=opts.num_snapshots,
                           mem_fraction=opts.mem_fraction, has_states=support.has_states)
        check_page_size(opts.page_size, sizes.num_slots)  # an automatic pool is known here
        store = cls(support, opts, stats, sizes.num_slots, sizes.num_snapshots)
        store.sizes = sizes
        log.info(
            "mlxcache: KV pool %d slots x %d B = %.2f GiB (%s); %d attention layers, %d kv "
            "heads, head_dim %d, %s, page_size %d; state pool %d snapshots x %d B; decode "
            "buffers up to %.2f GiB",
            sizes.num_slots, per_slot, sizes.num_slots * per_slot / 2**30, sizes.origin, n_kv,
            heads, head_dim, dtype, opts.page_size, sizes.num_snapshots, per_snapshot,
            sizes.working_bytes / 2**30,
        )  # fmt: skip
        return store

    # ------------------------------------------------------------------ sizes ----

    num_slots = delegate("pool.num_slots", "KV pool size in slots.")
    num_free_slots = delegate("slots.num_free",
                              "Slots held by neither the tree nor a running request.")

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV pool and the state pool together."""
        return sum(x.nbytes for x in (self.pool, self.states) if x is not None)

    def arrays(self) -> list[mx.array]:
        """The pools' arrays (to schedule or evaluate)."""
        return arrays_in([self.pool, self.states and self.states.arrays])

    # ----------------------------------------------------------------- policy ----

    def match(self, tokens: list[int]) -> Match:
        """What ``tokens`` may take from the tree (``servecore.prefix.match``)."""
        return match(self.tree, tokens)

    def cached(self, tokens: list[int]) -> int:
        """The tokens ``match`` would let a request skip, read-only."""
        return cached_len(self.tree, tokens)

    def free(self, evicted: Evicted) -> None:
        """Give what the tree evicted back to the allocators."""
        give_back(evicted, self.slots, self.state_slots)

    def reset(self) -> None:
        """Evict everything evictable (``Engine.reset_cache``; not counted as evictions, and
        not spilled to a disk tier: a reset drops the cache)."""
        spill, self.tree.on_evict = self.tree.on_evict, None
        try:
            self.free(self.tree.evict(self.tree.evictable_size))
            if self.has_states:
                self.free(self.tree.evict_states(self.tree.num_states))
        finally:
            self.tree.on_evict = spill

    def take_slots(self, n: int) -> list[int] | None:
        """``n`` free slots, evicting exactly the shortfall or nothing (then None)."""
        slots, evicted = make_room(self.tree, self.slots, n, self.state_slots)
        self.stats.token_evictions += len(evicted.slots)
        self.stats.state_evictions += len(evicted.states)
        return slots

    def take_snapshot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used unlocked state if none is
        free; None if none can be had (the snapshot is skipped: the cache is only less
        useful)."""
        got, evicted = take_states(self.tree, self.state_slots, 1, self.slots)
        self.stats.state_evictions += len(evicted.states)
        self.stats.token_evictions += len(evicted.slots)
        return got[0] if got else None

    def reserve(self, job: Job, m: Match) -> bool:
        """Lock the matched prefix and allocate slots for the tokens the tree lacks; False to
        wait. A full hit needs none: the token it recomputes is in the tree already. Hybrid
        models also plan where the prefill takes snapshots (``servecore.snapshots``)."""
        self.tree.lock(m.node)
        new = self.take_slots(len(job.tokens) - len(m.slots))
        if new is None:
            self.tree.unlock(m.node)
            return False
        job.node, job.tree_slots, job.cached, job.pending = m.node, m.slots, m.cached, new
        job.restore = m.restore
        if self.has_states:
            job.points = self.page_points(
                snapshot_points(len(job.tokens), len(m.slots), m.cached, self.snapshot_interval),
                m.cached)
        return True

    def page_points(self, points: list[int], cached: int) -> list[int]:
        """Snapshot ``points`` moved down each to the page boundary at or below it (the tree
        holds whole pages, so a match, page-granular, finds a state only there), those past
        ``cached`` (the state restored), each once.

        >>> from mlxcache.engine.options import check_options
        >>> from mlxcache.engine.stats import EngineStats
        >>> from mlxcache.zoo import make
        >>> model = make("qwen3_next")
        >>> store = PrefixStore.build(Support.probe(model), check_options(num_slots=64,
        ...                           page_size=16), EngineStats())
        >>> store.page_points([8, 16, 21, 99], cached=0), store.page_points([21, 40], 16)
        ([16, 96], [32])
        """
        page = self.page_size
        return sorted({d - d % page for d in points if d - d % page > cached})

    def page_state(self, job: Job, caches: list[Any], row: int) -> None:
        """Hybrid models with pages of several tokens, in a decode step: when row ``row`` of
        ``caches`` (``job``'s) ends on a page boundary, keep its state there (the job holds
        one such snapshot, the latest): the answer is cached up to its last whole page, and
        ``publish_answer`` hangs this state at that depth, for the next turn to resume from.
        (With one-token pages the state where the request ends is that depth.)"""
        depth = leaves(caches)[self.layout.kv_leaves[0]].end(row)
        if depth % self.page_size:
            return
        self.drop_page_state(job)
        for _, _, slot in self.snapshot(caches, [row], [depth]):
            job.page_state = (depth, slot)
            mx.async_eval(arrays_in([self.states.arrays]))  # scheduled: any thread may go on

    def drop_page_state(self, job: Job) -> None:
        """Give back the snapshot ``page_state`` kept for ``job``, if any."""
        if job.page_state is not None:
            self.state_slots.give([job.page_state[1]])
            job.page_state = None

    # ------------------------------------------------------------- the caches ----

    def prefix_caches(self, jobs: list[Job]) -> list[Any]:
        """The engine's caches for a prefill batch: each row starts from its cached prefix,
        the attention layers' K/V gathered from the pool, the recurrent layers' state copied
        from its snapshot (copy-on-write: the snapshot stays as it was)."""
        layout = self.layout
        prefixes = [j.tree_slots[: j.cached] for j in jobs]
        widest = max(len(j.tokens) - j.cached for j in jobs)  # the prefill's widest row
        flat = list(layout.leaves)
        out: list[Any] = [None] * len(flat)
        kv = RaggedKVCache.from_pool_layers(
            self.pool, range(len(layout.kv_leaves)), prefixes,
            [flat[i].window for i in layout.kv_leaves], reserve=widest)
        for i, cache in zip(layout.kv_leaves, kv, strict=True):
            out[i] = cache
        if self.has_states:
            restoring = [k for k, j in enumerate(jobs) if j.restore is not None]
            got = (get_states(self.states, [jobs[k].restore for k in restoring])
                   if restoring else ())
            at = {k: n for n, k in enumerate(restoring)}
            arrays = itertools.count()
            for leaf, like in zip(layout.state_leaves, layout.like, strict=True):
                which = [None if x is None else next(arrays) for x in like]
                rows = [None if k not in at else
                        [None if w is None else got[w][at[k] : at[k] + 1] for w in which]
                        for k in range(len(jobs))]
                out[leaf] = RaggedArraysCache.from_rows(flat[leaf].size, like, rows)
        return build(layout, leaf_caches=out)

    def snapshot(self, caches: list[Any], rows: list[int], depths: list[int]
                 ) -> list[tuple[int, int, int]]:
        """Store the recurrent states of ``rows`` of ``caches`` in the state pool (one slot
        each, while slots can be had); ``(row, depth, slot)`` of those stored."""
        taken = []
        for row, depth in zip(rows, depths, strict=True):
            slot = self.take_snapshot()
            if slot is None:
                break
            taken.append((row, depth, slot))
        if taken:
            flat = leaves(caches)
            states = [mx.concatenate([flat[i].row(row)[j] for row, _, _ in taken])
                      for i, like in zip(self.layout.state_leaves, self.layout.like, strict=True)
                      for j, x in enumerate(like) if x is not None]
            self.states = set_states(self.states, [slot for _, _, slot in taken], states)
            self.stats.snapshots_taken += len(taken)
        return taken

    def publish_prompts(self, jobs: list[Job], caches: list[Any],
                        snaps: list[tuple[int, int, int]]) -> None:
        """Write the new K/V to the pool, insert the prompts (and hang the snapshots taken
        along them on the tree), move each lock onto its prompt."""
        new = [(i, j) for i, j in enumerate(jobs) if j.pending]  # a full hit writes nothing
        if new:
            flat = leaves(caches)
            kv = [flat[i] for i in self.layout.kv_leaves]
            rows = [[c.row(i, len(j.tree_slots)) for i, j in new] for c in kv]
            self.pool = set_kv_all_layers(
                self.pool,
                mx.array([s for _, j in new for s in j.pending], dtype=mx.int32),
                [kv_concat([k for k, _ in layer], axis=2) for layer in rows],
                [kv_concat([v for _, v in layer], axis=2) for layer in rows],
            )
            mx.async_eval(self.pool)  # scheduled (in place); the tree work below overlaps it
        for job in jobs:
            self.insert(job.tokens, job.tree_slots + job.pending, len(job.tree_slots))
            job.pending = []
        for row, depth, slot in snaps:
            self.add_state(jobs[row].tokens[:depth], slot)
        for job in jobs:
            slots, node, _ = self.tree.match_prefix(job.tokens)
            self.tree.lock(node)
            self.tree.unlock(job.node)
            job.node, job.tree_slots = node, slots

    def publish_answer(self, job: Job, caches: list[Any], row: int) -> None:
        """Write the K/V of the generated tokens that ran (all of them: a request finishes in
        the step that fed its last token) to the pool and insert prompt + answer; hybrid
        models also snapshot the state there, for the next turn of a conversation."""
        flat = leaves(caches)
        kv = [flat[i] for i in self.layout.kv_leaves]
        ran = kv[0].end(row)
        seq = (job.tokens + job.output)[:ran]
        total = len(seq) - len(seq) % self.page_size
        start = len(job.tree_slots)
        kept, job.page_state = job.page_state, None  # (depth, slot): see page_state
        if kept is not None and kept[0] != total:  # not the last whole page (none past it)
            self.state_slots.give([kept[1]])
            kept = None
        if total > start:
            new = self.take_slots(total - start)
            if new is None:  # the pool is full of locked prefixes: skip caching this answer
                if kept is not None:
                    self.state_slots.give([kept[1]])
                return
            rows = [c.row(row, start, total) for c in kv]
            self.pool = set_kv_all_layers(
                self.pool, np.asarray(new, dtype=np.int32), [k for k, _ in rows],
                [v for _, v in rows])
            mx.eval(self.pool)
            self.insert(seq[:total], job.tree_slots + new, start)
            if self.has_states and kept is None and total == ran:
                kept = next(((d, s) for _, d, s in self.snapshot(caches, [row], [ran])), None)
        if kept is not None:  # the state where the cached answer ends (or its prompt)
            mx.eval(self.states)
            self.add_state(seq[: kept[0]], kept[1])

    def add_state(self, tokens: list[int], slot: int) -> None:
        """Hang snapshot ``slot`` on the tree at ``tokens``' end; give it back if the tree
        has a state there already (or lacks the tokens: their K/V were not kept)."""
        keep_state(self.tree, tokens, slot, self.state_slots)

    def insert(self, tokens: list[int], slots: list[int], owned: int) -> None:
        """Insert ``tokens``; ``slots[:owned]`` are the tree's already, the rest are ours.

        Ours that the tree does not keep (it had those tokens already, or they are past the
        last whole page) are freed.
        """
        kept_until = len(tokens) - len(tokens) % self.page_size
        cached = self.tree.insert(tokens, slots)
        drop = slots[owned : max(owned, cached)] + slots[max(owned, kept_until) :]
        if drop:
            self.slots.give(drop)

    # ---------------------------------------------------------------- failure ----

    def reconcile(self, running: list[Job]) -> bool:
        """Rebuild the locks from the ``running`` jobs and the allocators from the tree (the
        only holders left after a failure). False if a running job's node was lost from the
        tree: then no lock is held and the caller drops every running job."""
        mx.async_eval(self.arrays())  # the fault may have struck between a write and its eval
        self.tree.release_locks()
        ok = True
        try:
            for job in running:
                self.tree.lock(job.node)
        except ValueError:  # a node lost from the tree
            self.tree.release_locks()
            ok = False
        self.slots.rebuild(self.tree.all_slots())
        if self.has_states:
            self.state_slots.rebuild([h for _, h in self.tree.all_states()]
                                     + [j.page_state[1] for j in running if j.page_state])
        return ok

    def unlock(self, node: TreeNode | None) -> None:
        """Release a job's lock (None: it holds none)."""
        if node is not None:
            self.tree.unlock(node)
