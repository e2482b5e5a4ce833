"""The disk tier under the prefix store (``Engine(cache_dir=...)``): prefixes evicted from
memory spill to a ``servecore.diskcache.DiskStore``, and a request whose prompt reaches past
what memory holds waits while they are read back into the pool.

Pages. The disk holds whole pages of ``page`` tokens (``DISK_PAGE_TOKENS``, rounded up to a
multiple of the tree's page) from the start of a prompt: page ``i`` holds the K/V of every
attention layer for tokens ``[i * page, (i + 1) * page)`` as the pool holds them (a quantized
layer's parts: a reload re-quantizes nothing), under the key chained from the
salt through the tokens before it (``servecore.diskcache.keys``). A hybrid model's recurrent
state at a page's end, when the tree held one there, is its own entry below that page
(``state_key``): a reload stops at the deepest page with a state. A sliding-window layer's
pages are its K/V like any other (the pool keeps every token's).

Spill. The tree calls ``spill`` with each leaf it is about to evict (``RadixCache.on_evict``;
its ancestors still hold their slots): every whole page of its path not on disk yet is read
from the pool, materialised on the engine's thread and queued for the store's writer thread.
``flush_all`` spills every leaf (``Engine.close``: a planned restart keeps what memory held).

Reload. ``plan`` (each waiting request, once) counts the pages on disk past what memory
matches; if there are any, the request leaves the waiting queue while the store's reader
thread reads them, and the other requests go on. ``ready`` (each round) writes what was read
into the pool and the tree (and the state into the state pool) and hands the requests back to
admission, which then finds their prefix in memory as if it had never left. A reload that
cannot complete (pages gone meanwhile, the pool full of locked prefixes) is dropped: the
request is served from what memory holds, never from partial data.

The salt (``salt_of``) covers the weights (a digest of every parameter's bytes), the model's
config, the tokenizer, the pool's dtype, quantization and layout, the disk page, the format
and the versions of MLX and of mlx-lm (whose model code computes the K/V): another model,
dtype, tokenizer or mlx-lm on the same directory reads nothing. ``Engine.reset_cache``
forgets this model's pages on disk too (``forget``), as it forgets them in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten

from mlxcache.engine._job import Job
from mlxcache.engine._store import PrefixStore
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import Support
from mlxcache.pool import get_kv, get_states, set_kv_all_layers, set_states
from servecore.diskcache import DiskStore, Page, chain, digest_buffers, salt
from servecore.radix import TreeNode, path_of

log = logging.getLogger("mlxcache")

__all__ = ["DISK_PAGE_TOKENS", "DiskTier", "salt_of", "state_key"]

DISK_PAGE_TOKENS = 256
"""Tokens per page on disk. A prompt's partial last page is not written (it is recomputed
after a reload); a page's fixed costs (a file, a header, a digest, its arrays) are paid once
per page: with 64-token pages a 4,096-token reload of a tiny qwen3_next took 10-12 ms, with
256 6-8 ms (``python -m mlxcache.bench restart``). 256 is also the default
``snapshot_interval``, so a hybrid model's grid states end pages."""


def state_key(key: str) -> str:
    """The key of the recurrent state at the end of the page ``key``.

    >>> len(state_key("00" * 16)), state_key("00" * 16) == state_key("01" * 16)
    (32, False)
    """
    return hashlib.blake2b(bytes.fromhex(key), digest_size=16, person=b"state").hexdigest()


def _host(a: mx.array) -> np.ndarray:
    """``a`` as a NumPy array of its own bytes (bfloat16, which NumPy lacks, as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=True)


def _host_dtype(dtype: mx.Dtype) -> np.dtype:
    """The NumPy dtype ``_host`` gives an array of ``dtype``.

    >>> _host_dtype(mx.bfloat16), _host_dtype(mx.float16)
    (dtype('uint16'), dtype('float16'))
    """
    return np.dtype(np.uint16) if dtype == mx.bfloat16 else np.dtype(str(dtype).split(".")[-1])


def _flat(kv: Any) -> Iterator[tuple[str, mx.array]]:
    """The arrays of per-layer ``(keys, values)`` pairs by name: ``k{layer}`` and
    ``v{layer}``, or ``k{layer}.{part}`` for the parts of a quantized layer.

    >>> [name for name, _ in _flat([(mx.zeros(1), (mx.zeros(1), mx.zeros(1)))])]
    ['k0', 'v0.0', 'v0.1']
    """
    for layer, pair in enumerate(kv):
        for kind, x in zip("kv", pair, strict=True):
            if isinstance(x, mx.array):
                yield f"{kind}{layer}", x
            else:
                yield from ((f"{kind}{layer}.{j}", a) for j, a in enumerate(x))


def _device(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    x = mx.array(a)
    return x.view(dtype) if dtype == mx.bfloat16 else x


def salt_of(model: nn.Module, tokenizer: Any, support: Support, page: int) -> str:
    """The salt of ``model``'s pages (see the module docstring).

    >>> from mlxcache.zoo import make_model
    >>> model = make_model()
    >>> s = salt_of(model, None, Support.probe(model), 64)
    >>> s == salt_of(model, None, Support.probe(model), 64), s == salt_of(model, None,
    ...     Support.probe(model), 32)
    (True, False)
    """
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    weights = digest_buffers(
        x for name, a in params for x in (name.encode(), str(a.dtype).encode(),
                                          np.asarray(a.shape, np.int64), _host(a)))
    args = getattr(model, "args", None)
    config = (dataclasses.asdict(args) if dataclasses.is_dataclass(args)
              else vars(args) if args is not None else type(model).__name__)
    return salt({"weights": weights, "config": json.loads(json.dumps(config, default=_plain)),
                 "model": f"{type(model).__module__}.{type(model).__name__}",
                 "tokenizer": _tokenizer_digest(tokenizer), "kv": [str(x) for x in support.kv],
                 **({"quant": [None if q is None else [q.bits, q.group_size]
                               for q in support.layout.kv_quant]}
                    if any(support.layout.kv_quant) else {}),
                 "layout": [str(k) for k in support.layout.kinds],
                 "windows": [getattr(leaf, "window", None) for leaf in support.layout.leaves],
                 "page": page, "mlx": mx.__version__,
                 "mlx_lm": mlx_lm.__version__})  # its model code computes the K/V


def _plain(value: Any) -> Any:
    """A config value JSON cannot take, as something stable across processes (no address)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return vars(value) if hasattr(value, "__dict__") else type(value).__qualname__


def _tokenizer_digest(tokenizer: Any) -> str | None:
    """What the tokenizer maps text to ids with (None: token ids only)."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        text = backend.to_str()
    elif hasattr(inner, "get_vocab"):
        text = json.dumps(sorted(inner.get_vocab().items()))
    else:  # (never a repr: an object's address would differ in every process)
        text = f"{type(inner).__module__}.{type(inner).__qualname__}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclasses.dataclass
class _Reload:
    job: Job
    keys: list[str]  # the pages asked for (and the state's key, for hybrid models)
    start: int  # the first page asked for
    arrays: dict[str, np.ndarray]  # the pages' K/V, joined: the reader reads into slices
    future: Future  # of the pages read


class DiskTier:
    """Spill and reload between ``store`` and ``disk`` (see the module docstring).

    >>> import tempfile
    >>> from mlxcache.engine import Engine
    >>> from mlxcache.zoo import make_model
    >>> with Engine(make_model(), num_slots=512, cache_dir=tempfile.mkdtemp()) as engine:
    ...     _ = engine.generate([list(range(2, 100)) * 3], max_tokens=1)
    ...     tier = engine.core.disk
    ...     tier.page, engine.stats.disk.pages_written   # nothing evicted yet
    (256, 0)
    >>> engine.stats.disk.pages_written   # close() spilled the prompt's one whole page
    1
    """

    def __init__(self, store: PrefixStore, disk: DiskStore, salt_key: str, stats: EngineStats,
                 page: int = DISK_PAGE_TOKENS):
        self.store, self.disk, self.salt, self.stats = store, disk, salt_key, stats
        self.page = math.lcm(page, store.page_size)
        self.pending: list[_Reload] = []
        self.spilling = True
        store.tree.on_evict = self._on_evict

    # ------------------------------------------------------------------ spill ----

    def _on_evict(self, leaf: TreeNode) -> None:
        if not self.spilling:
            return
        try:
            self.spill(leaf)
        except Exception:  # best effort: an eviction must not fail half-way because of it
            log.exception("mlxcache: spilling to the disk tier failed; spilling is off")
            self.spilling = False

    def spill(self, node: TreeNode) -> None:
        """Queue every whole page of ``node``'s path that the disk lacks (with the state at
        its end, for hybrid models, when the path holds one there)."""
        tokens, slots, states = path_of(node)
        P, store = self.page, self.store
        keys = chain(self.salt, tokens[: len(tokens) - len(tokens) % P], P)
        todo = [i for i in range(self.disk.depth(keys), len(keys))
                if self.disk.wanted(keys[i])]  # (a sibling's spill may have queued some)
        if not todo:
            return
        # one gather per layer and one evaluation for all the pages, then split on the host
        idx = mx.array([s for i in todo for s in slots[i * P:(i + 1) * P]], dtype=mx.int32)
        kv = [get_kv(store.pool, layer, idx) for layer in range(store.pool.num_layers)]
        handles = [states.get((i + 1) * P) if store.has_states else None for i in todo]
        held = [h for h in handles if h is not None]
        snaps = get_states(store.states, held) if held else ()
        mx.eval(kv, list(snaps))
        host = {name: _host(a) for name, a in _flat(kv)}
        snaps = [_host(x) for x in snaps]
        meta = {"dtype": str(store.pool.dtype)}
        row = 0  # the next snapshot's row in ``snaps``
        for n, (i, handle) in enumerate(zip(todo, handles, strict=True)):
            part = {name: a[n * P:(n + 1) * P] for name, a in host.items()}
            self.disk.put(keys[i], keys[i - 1] if i else self.salt, self.salt, P, part, meta)
            if handle is not None:
                self.disk.put(state_key(keys[i]), keys[i], self.salt, 0,
                              {f"s{j}": x[row:row + 1] for j, x in enumerate(snaps)},
                              {"dtypes": [str(x.dtype) for x in store.states.arrays]})
                row += 1

    def flush_all(self) -> None:
        """Spill every leaf of the tree and wait for the writes."""
        for leaf in self.store.tree.leaves():
            self.spill(leaf)
        self.disk.flush()

    # ----------------------------------------------------------------- reload ----

    def plan(self, job: Job) -> bool:
        """Start reading ``job``'s pages past what memory holds; True if it now waits."""
        P, store, tokens = self.page, self.store, job.tokens
        usable = len(tokens) - 1  # the last token always runs
        keys = chain(self.salt, tokens[: usable - usable % P], P)
        depth = self.disk.depth(keys)
        if store.has_states:  # the deepest page on disk with a state at its end
            while depth and not self.disk.has(state_key(keys[depth - 1])):
                depth -= 1
        if depth * P <= store.cached(tokens):
            return False
        start = 0 if store.has_states else store.tree.peek(tokens)[0] // P
        asked = keys[start:depth] + ([state_key(keys[depth - 1])] if store.has_states else [])
        # one array per layer and kind for all the pages, the reader thread reads each page
        # into its rows: no page buffers, no joining afterwards
        n, pool = depth - start, store.pool
        arrays = {name: np.empty((n * P, *x.shape[1:]), _host_dtype(x.dtype))
                  for name, x in _flat(zip(pool.keys, pool.values, strict=True))}
        into = [{name: a[j * P:(j + 1) * P] for name, a in arrays.items()} for j in range(n)]
        into += [None] * store.has_states
        self.pending.append(_Reload(job, asked, start, arrays, self.disk.load(asked, into)))
        job.state = "reloading"
        return True

    def drop(self, job: Job) -> None:
        """Forget ``job``'s reload (cancelled); what is read is discarded."""
        self.pending = [r for r in self.pending if r.job is not job]

    def ready(self) -> list[Job]:
        """The jobs whose reads ended, their pages now in the pool and the tree (or not, if
        the reload could not complete), ready for admission."""
        done = [r for r in self.pending if r.future.done()]
        for r in done:  # pending until every one is applied: a failure drops them all
            try:
                pages = r.future.result()
            except Exception:  # noqa: BLE001 - a read that failed is a miss
                pages = []
            self._apply(r, pages)
        self.pending = [r for r in self.pending if not any(r is d for d in done)]
        for r in done:
            r.job.state = "waiting"
        return [r.job for r in done]

    def _apply(self, r: _Reload, pages: list[Page]) -> None:
        P, store, tokens = self.page, self.store, r.job.tokens
        if store.has_states:
            if len(pages) != len(r.keys):  # no state, or a page short: recompute
                return
            state, pages = pages[-1], pages[:-1]
        if not pages:
            return
        head = r.start * P
        m = store.match(tokens[:head]) if head else None
        if m is not None and len(m.slots) < head:  # memory lost the pages before: a miss
            return
        end = head + len(pages) * P
        if m is not None:
            store.tree.lock(m.node)
        try:
            new = store.take_slots(end - head)
        finally:
            if m is not None:
                store.tree.unlock(m.node)
        if new is None:
            return
        rows, pool = len(pages) * P, store.pool

        def entry(name: str, like: Any) -> Any:  # the pool's form: an array, or parts
            if isinstance(like, mx.array):
                return _device(r.arrays[name][:rows], like.dtype)
            return tuple(_device(r.arrays[f"{name}.{j}"][:rows], a.dtype)
                         for j, a in enumerate(like))

        ks = [entry(f"k{i}", x) for i, x in enumerate(pool.keys)]
        vs = [entry(f"v{i}", x) for i, x in enumerate(pool.values)]
        store.pool = set_kv_all_layers(store.pool, new, ks, vs)  # (one run: a slice write)
        mx.eval(store.pool)
        store.insert(tokens[:end], (m.slots[:head] if m is not None else []) + new, head)
        if store.has_states:
            slot = store.take_snapshot()
            if slot is not None:
                dtypes = [getattr(mx, d.split(".")[-1]) for d in state.meta["dtypes"]]
                arrays = [_device(state.arrays[f"s{j}"], d) for j, d in enumerate(dtypes)]
                store.states = set_states(store.states, [slot], arrays)
                mx.eval(store.states.arrays)
                store.add_state(tokens[:end], slot)
        s = self.stats
        s.disk_hits += 1
        s.disk_tokens_read += end - head

    def forget(self, salt_key: str | None = None) -> int:
        """Remove every page of this model's salt from the directory (the others' stay), and
        key what is spilled from now on under ``salt_key`` (the model's salt taken again:
        weights changed in place since the engine was built get a salt of their own). A
        reload already under way still lands. How many pages went."""
        gone = self.disk.forget(self.salt)
        if salt_key is not None:
            self.salt = salt_key
        return gone

    def close(self, flush: bool) -> None:
        """Spill what memory holds (``flush``), then close the store."""
        try:
            if flush:
                self.flush_all()
        finally:
            self.spilling = False
            self.disk.close()
