"""``Engine``: serve an unmodified mlx-lm model with radix prefix reuse and continuous
batching. ``Support`` says what the model allows, ``Core`` is the core
(``servecore.engine.EngineCore``), and the front door both engines share
(``servecore.client.EngineClient``) gives every user the same calls.

Examples:
    >>> from mlxcache.zoo import make_model
    >>> Engine(make_model(), num_slots=32).generate([[1, 2, 3]], max_tokens=2)[0].__len__()
    2
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcache.engine._core import Core
from mlxcache.engine._disk import DISK_PAGE_TOKENS, salt_of
from mlxcache.engine.memory import MemoryReport
from mlxcache.engine.options import UnusedOptionWarning, check_options, unused_options
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import ReuseDisabledWarning, Support
from servecore.client import EngineClient
from servecore.diskcache import DiskStore
from servecore.engine import delegate
from servecore.errors import InvalidRequest
from servecore.prompts import check_tokenizer
from servecore.requests import GenerationRequest
from servecore.thread import OwnerThread, ThreadedCore
from servecore.validate import eos_token_ids

__all__ = ["Engine"]


def _vocab_size(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            return module.weight.shape[0]
    raise ValueError("cannot tell the model's vocabulary size (no args.vocab_size, no Embedding)")


class Engine(EngineClient):
    """Serve an unmodified mlx-lm model with radix prefix reuse and continuous batching.

    Args:
        model: an mlx-lm model (``model(inputs, cache=...)`` -> logits).
        tokenizer: optional (mlx-lm ``TokenizerWrapper`` or HF tokenizer); needed for text
            and chat prompts and for ``generate(..., text=True)``; its EOS ids are the
            default stop tokens.
        **options: any field of ``EngineOptions`` (each documented there: the pool's size
            and page, the batch, snapshots, the disk tier, quantized K/V, ...).

    The calls are ``servecore.client.EngineClient``'s. Scheduling, for time to first token: a
    round that admitted a prefill batch does not decode while admissible requests still wait
    (prefill first, as SGLang schedules), and admission takes the waiting request with the
    fewest uncached tokens first. Memory: the running requests decode in one batch per
    length bucket, whose buffers follow them, and a request waits while the buffers it could
    come to need would pass their part of the budget (``Engine.memory``).

    Models whose cache is not one the engine knows (``RotatingKVCache`` with keep,
    ``QuantizedKVCache``, ...) are served without reuse, one request per forward with mlx-lm's
    own caches, after a ``ReuseDisabledWarning``; so are models whose attention rejects
    per-row positions, or whose recurrent layers take padding into their state, minus the
    reuse restriction (``mlxcache.engine.support``).

    Threads: all MLX work (the support probe, every round) runs on one thread the engine
    owns (``servecore.thread.OwnerThread``), whichever thread calls; ``start_thread`` runs a
    loop there (the server's), so a round makes no hop between threads. That thread clears
    its MLX state when the engine is closed, dropped or left open at interpreter exit
    (``servecore.thread`` says why); callers' threads hold none. Unseeded sampling
    (``seed=None``) draws from the engine thread's generator.

    Examples:
        >>> from mlxcache.zoo import make_model     # a tiny random llama, or mlx_lm.load(path)
        >>> engine = Engine(make_model(), num_slots=128, max_batch_size=4)
        >>> engine.num_slots, engine.num_free_slots
        (128, 127)
        >>> events = list(engine.stream([[5, 6, 7], [8, 9]], max_tokens=2))
        >>> sorted(i for i, _ in events)                # (prompt index, token) pairs
        [0, 0, 1, 1]
        >>> engine.num_free_slots + engine.tree.total_size   # every slot is free or cached
        127

        With a tokenizer, prompts may be text or chats, and the answers text
        (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``):

        >>> from servecore.testing import word_tokenizer
        >>> engine = Engine(make_model(), word_tokenizer(1000), num_slots=64)
        >>> chat = [{"role": "user", "content": "w7 w8"}]
        >>> ids = engine.generate([[4, 7, 8, 5]], max_tokens=3)[0]
        >>> engine.generate([chat], max_tokens=3)[0] == ids  # <|user|> w7 w8 <|assistant|>
        True

        A ``with`` block closes the engine; then calls fail, naming it:

        >>> with Engine(make_model(), num_slots=32) as engine:
        ...     out = engine.generate([[1, 2]], max_tokens=2)
        >>> engine.closed, engine.num_slots
        (True, 0)
        >>> engine.generate([[1, 2]], max_tokens=2)
        Traceback (most recent call last):
        ...
        servecore.errors.EngineClosedError: mlxcache.Engine at 0x... is closed: build a new engine
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, **options: Any):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an mlx-lm model (an mlx.nn.Module, e.g. from "
                             f"mlx_lm.load), got {type(model).__name__}: {model!r:.60}")
        self.options = check_options(**options)
        # The tokenizer's EOS ids, whichever form it keeps them in (mlx-lm: a set; Hugging
        # Face: an int, a list or None; transformers 5 may give eos_token_ids as an int).
        eos = eos_token_ids(check_tokenizer(tokenizer))
        self.model = model
        self.stats = EngineStats()
        mx.eval(model.parameters())  # here: evaluated arrays any thread may read
        self.owner = owner = OwnerThread("mlxcache.Engine", on_exit=mx.clear_streams)
        try:  # the probe runs the model: on the engine's thread, as every round
            self.support = owner.call(Support.probe, model, self.options.prefix_cache,
                                      self.options.quant)
            self.core = owner.call(Core, model, self.support, self.options, self.stats)
            # dropped unclosed, or open at exit: the core still closes (spills to disk,
            # unlocks its directory) on its thread as the thread ends
            owner.at_close(self.core.close)
            if self.options.cache_dir is not None:
                _attach_disk(self, owner, tokenizer)
        except BaseException:
            owner.close()
            raise
        for note in self.support.notes:
            warnings.warn(f"mlxcache: {note}", ReuseDisabledWarning, stacklevel=2)
        s = self.support
        for line in unused_options(self.options, reuse=s.reuse, has_states=s.has_states,
                                   quantized=s.num_quantized):
            warnings.warn(f"mlxcache: {line}", UnusedOptionWarning, stacklevel=2)
        super().__init__(ThreadedCore(self.core, owner), vocab_size=_vocab_size(model),
                         tokenizer=tokenizer, eos_ids=eos, check=self._fits,
                         name=f"mlxcache.Engine at {id(self):#x}")
        # dropped without close(): end the thread (the pools go with the engine)
        weakref.finalize(self, owner.close)

    def _fits(self, name: str, request: GenerationRequest) -> None:
        _check_fits(name, request, self.num_slots if self.reuse else None, self.max_positions)

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config does not say): a
        prompt and its answer must fit it."""
        value = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    def room_for(self, prompt_len: int) -> int | None:
        """The largest ``max_tokens`` for a prompt of ``prompt_len`` tokens: the model's
        positions less the prompt, plus the last token (None: the model sets no limit)."""
        limit = self.max_positions
        return None if limit is None else max(0, limit - prompt_len + 1)

    # ------------------------------------------------------------------ the model ----

    page_size = delegate("options.page_size", "Radix tree page, tokens.")
    max_batch_size = delegate("options.max_batch_size", "Most requests decoded at once.")
    prefill_step_size = delegate("options.prefill_step_size",
                                 "Most tokens in one prefill forward.")
    snapshot_interval = delegate("options.snapshot_interval",
                                 "Hybrid models: the grid of snapshot depths.")
    supported = delegate("support.supported",
                         "Served with the engine's own caches (``Support.supported``).")
    reuse = delegate("support.reuse", "Prefix reuse (``Support.reuse``).")
    batched = delegate("support.batched", "Many requests per forward (``Support.batched``).")
    has_states = delegate("support.has_states",
                          "Recurrent layers, snapshotted (``Support.has_states``).")
    pads_exactly = delegate("support.pads_exactly", "A prefill row may be padded part-way.")
    prefill_batch_tokens = delegate("core.admission.prefill_batch_tokens",
                                    "Most uncached tokens admitted into one prefill batch.")
    layout = delegate("support.layout", "The model's caches (``mlxcache.layers.Layout``).")
    cache_kinds = delegate("support.layout.kinds", "Every cache kind the model uses, by name.")
    quantized = delegate("support.quantized", "Which attention layers hold quantized K/V.")

    @property
    def num_layers(self) -> int:
        """The model's layers (cache entries)."""
        return len(self.layout.entries)

    # ------------------------------------------------------------------- the cache ----
    # Without reuse there is no store: sizes are 0, the tree None.

    num_slots = delegate("core.store.num_slots", "Pool size in slots (0 without reuse).",
                         missing=0)
    num_free_slots = delegate(
        "core.store.num_free_slots",
        "Pool slots not held by the radix tree nor by a running request (0 without reuse).",
        missing=0)
    num_snapshots = delegate("core.store.states.num_slots",
                             "State pool size in snapshot slots (0 without states or reuse).",
                             missing=0)
    num_free_snapshots = delegate("core.store.state_slots.num_free",
                                  "Snapshot slots not held by the radix tree.", missing=0)
    snapshot_bytes = delegate(
        "core.store.states.bytes_per_slot",
        "Bytes of one snapshot: every recurrent layer's state arrays of one request.",
        missing=0)
    cache_bytes = delegate(
        "core.store.cache_bytes",
        "Bytes of the KV pool and the state pool together (fixed at construction).",
        missing=0)
    tree = delegate("core.store.tree",
                    "The radix tree (None without reuse). Read it; do not modify it.",
                    missing=None)

    @property
    def memory(self) -> MemoryReport:
        """What the engine holds for serving, part by part, against its budget
        (``mlxcache.engine.memory``): the KV pool, the snapshots, the decode buffers now and
        at their peak.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> m = Engine(make_model(), num_slots=64).memory
            >>> m.serving_bytes <= m.budget_bytes, m.working_bytes
            (True, 0)
        """
        with self._serialized():
            core = self.core
            return MemoryReport.of(core.store, core.path.groups, core.peak_working_bytes,
                                   core.working)

    def reset_cache(self) -> None:
        """Forget every cached prefix that no running request holds: evict all that is
        evictable and free its slots, and with a disk tier (``cache_dir``) remove this
        model's pages from the directory too and key later ones by the weights as they are
        now (after weights changed in place, call it with nothing running: nothing old is
        served from either, and nothing new is filed under the old weights). A running
        request's locked prefix stays until it finishes (then it and its answer are cached
        as usual). Not counted in ``stats.token_evictions``.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=64)
            >>> events = engine.stream([[1, 2, 3, 4]], max_tokens=4)
            >>> _ = next(events)                          # running: its prompt is locked
            >>> engine.reset_cache()
            >>> engine.tree.total_size, engine.tree.protected_size
            (4, 4)
            >>> _ = list(events)                          # finished: prompt + answer cached
            >>> engine.reset_cache()
            >>> engine.tree.total_size, engine.num_free_slots
            (0, 63)
        """
        with self._serialized():
            if self.core.store is not None:
                self.owner.call(self.core.store.reset)
            if self.core.disk is not None:  # the salt again: the weights may have changed
                salt_key = self.owner.call(salt_of, self.model, self.tokenizer, self.support,
                                           DISK_PAGE_TOKENS)
                self.owner.call(self.core.disk.forget, salt_key)

    def start_thread(self, target: Callable[[], Any], name: str) -> Any:
        """Run ``target`` on the engine's own thread (``OwnerThread.start``): a loop there
        makes its rounds' calls inline, and runs other threads' calls between its steps
        (``OwnerThread.serve_calls``)."""
        return self.owner.start(target, name)


def _check_fits(name: str, request: GenerationRequest, num_slots: int | None,
                limit: int | None) -> None:
    """``InvalidRequest`` unless the prompt fits the KV pool of ``num_slots`` (None: no
    pool), inserted whole, and prompt and answer fit ``limit`` positions (None: no limit)."""
    n = len(request.tokens)
    if num_slots is not None and n > num_slots - 1:
        raise InvalidRequest(f"{name} has {n} tokens but the KV pool holds at most "
                             f"{num_slots - 1} (num_slots={num_slots}); raise num_slots",
                             field="prompt", value=n)
    if limit is not None and request.context_len > limit:
        field, value = ("prompt", n) if n > limit else ("max_tokens", request.max_tokens)
        raise InvalidRequest(f"{name} of {n} tokens + max_tokens={request.max_tokens} needs "
                             f"{request.context_len} positions, more than the model's "
                             f"max_position_embeddings={limit}", field=field, value=value)


def _attach_disk(engine: Engine, owner: OwnerThread, tokenizer: Any) -> None:
    """The disk tier of ``Engine(cache_dir=...)`` under the engine's store."""
    opts = engine.options
    if engine.core.store is None:
        raise ValueError(f"cache_dir={str(opts.cache_dir)!r} needs the prefix cache: it is off "
                         "(prefix_cache=False, or a model served without reuse)")
    page = math.lcm(DISK_PAGE_TOKENS, opts.page_size)  # a disk page (``DiskTier.page``)
    if engine.has_states and page % opts.snapshot_interval:
        raise ValueError(
            f"snapshot_interval={opts.snapshot_interval} does not divide the disk tier's page "
            f"of {page} tokens: a page is read back only with the recurrent state at its end, "
            f"which that grid never takes, so cache_dir would write pages it never reads; give "
            f"a snapshot_interval that divides {page} (the default, 256, does)")
    disk = DiskStore(opts.cache_dir, budget_bytes=opts.disk_budget,
                     min_free_bytes=opts.disk_min_free)
    try:
        salt_key = salt_of(engine.model, tokenizer, engine.support, DISK_PAGE_TOKENS)
        owner.call(engine.core.attach_disk, disk, salt_key)
    except BaseException:
        disk.close()
        raise
