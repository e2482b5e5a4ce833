"""``Engine``: serve an unmodified mlx-lm model with radix prefix reuse and continuous
batching. A thin facade: ``Support`` says what the model allows, ``Runner`` is the core
(``servecore.engine.EngineCore``), ``servecore.streams.Streams`` gives every user the
contract both engines share.

Examples:
    >>> from mlxcache.zoo import make_model
    >>> Engine(make_model(), num_slots=32).generate([[1, 2, 3]], max_tokens=2)[0].__len__()
    2
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcache.engine.disk import DISK_PAGE_TOKENS, salt_of
from mlxcache.engine.memory import MemoryReport
from mlxcache.engine.options import UnusedOptionWarning, check_options, unused_options
from mlxcache.engine.runner import Runner
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import ReuseDisabledWarning, Support
from servecore.diskcache import DiskStore
from servecore.engine import delegate
from servecore.prompts import Prompt, check_tokenizer
from servecore.requests import GenerationRequest, RequestBuilder
from servecore.streams import Stream, Streams
from servecore.thread import OwnerThread, ThreadedCore
from servecore.validate import check_int, eos_token_ids

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


class Engine:
    """Serve an unmodified mlx-lm model with radix prefix reuse and continuous batching.

    Args:
        model: an mlx-lm model (``model(inputs, cache=...)`` -> logits).
        tokenizer: optional (mlx-lm ``TokenizerWrapper`` or HF tokenizer); needed for text
            and chat prompts and for ``generate(..., text=True)``; its EOS ids are the
            default stop tokens. Anything without ``encode`` and ``decode`` (a path, say) is
            a ``TypeError`` (``servecore.prompts.check_tokenizer``).
        num_slots: KV pool size in token slots (slot 0 is padding); None sizes it from free
            memory times ``mem_fraction`` (Metal working set on Apple silicon, else
            ``servecore.memory_budget``: ``MemAvailable`` capped by any cgroup memory limit),
            capped at ``MAX_AUTO_SLOTS``, a quarter of that budget kept for the decode buffers
            (``mlxcache.engine.sizing``; a budget too small for a useful cache is a
            ``ValueError``). Given, the decode buffers may hold as many bytes as the pool;
            requests wait for room beyond that (``Engine.memory``).
        page_size: radix tree granularity in tokens: the tree caches whole pages, so at most
            ``num_slots - 1`` (the longest prompt the pool takes; a larger page is a
            ``ValueError``). A hybrid model's snapshots sit on page boundaries (a planned
            point moves down to the boundary at or below it; a running answer keeps its
            state at its latest boundary), so the next turn of a chat resumes from the last
            whole page of prompt + answer, as an attention-only model does.
        mem_fraction: share of free memory the automatic pool may take.
        max_batch_size: most requests decoded at once.
        prefix_cache: False serves the same way without a pool or tree (no reuse); then the
            pools' options (``num_slots``, ``page_size``, ``num_snapshots``,
            ``snapshot_interval``) would do nothing, and one given is a ``ValueError``.
        prefill_step_size: most tokens (padding included) in one prefill forward; a longer
            prompt runs alone, in chunks of this many tokens.
        num_snapshots: hybrid models: the state pool's size in snapshots (None: a quarter of
            the cache memory, ``mlxcache.engine.sizing``).
        snapshot_interval: hybrid models: the grid of snapshot depths, in tokens.
            (``num_snapshots`` or ``snapshot_interval`` given for a model without recurrent
            layers, or the pools' options for one served without reuse, do nothing: an
            ``UnusedOptionWarning`` says so.)
        prefill_batch_tokens: most uncached tokens admitted into one prefill batch (a request
            alone may have more). None: ``CPU_PREFILL_BATCH_TOKENS`` on MLX's CPU device, and
            there the batch is also sized for the mean TTFT (``CPU_FORWARD_COST_TOKENS``);
            ``prefill_step_size`` on a GPU (``mlxcache.engine.admission``).
        cache_dir: a directory for the disk tier (``mlxcache.engine.disk``): evicted prefixes
            spill there and reload on a match, ``close`` spills what memory holds, and a new
            engine on the directory finds them; ``disk_budget`` bytes at most, leaving
            ``disk_min_free`` free on the disk. One engine owns a directory at a time.
        kv_bits: 4 or 8: the pool and the decode buffers hold the attention layers' K/V
            quantized as mlx-lm's ``QuantizedKVCache`` of these bits and ``kv_group_size``
            (``mlxcache.quant``), mlx-lm's attention runs its quantized path, batched, and
            a prefix hit reads the bytes a miss writes. Sliding-window layers and attentions
            refusing quantized K/V (sinks) stay in full precision (``Engine.quantized``).

    Scheduling, for time to first token: a round that admitted a prefill batch does not
    decode while admissible requests still wait (prefill first, as SGLang schedules), and
    admission takes the waiting request with the fewest uncached tokens first. Memory: the
    running requests decode in one batch per length bucket, whose buffers follow them, and a
    request waits while the buffers it could come to need would pass their part of the
    budget (``Engine.memory``, ``mlxcache.engine.memory``).

    Models whose cache is not one the engine knows (``RotatingKVCache`` with keep,
    ``QuantizedKVCache``, ...) are served without reuse, one request per forward with mlx-lm's
    own caches, after a ``ReuseDisabledWarning``; so are models whose attention rejects
    per-row positions, or whose recurrent layers take padding into their state, minus the
    reuse restriction (``mlxcache.engine.support``).

    One engine, many users: ``generate``, ``stream``, ``add_request`` / ``step`` / ``abort``
    keep the contract of ``servecore.streams`` (interleaved streams, threads serialized by one
    lock, a round at a time, failures mid-round dropping only what the round served); tested
    with four threads.

    Threads: all MLX work (the support probe, every round) runs on one thread the engine
    owns, whichever thread calls; ``start_thread`` runs a loop there (the server's). That
    thread clears its MLX state when the engine is closed (``servecore.thread`` says why: a
    thread ending with it may abort the process at exit); callers' threads hold none. The
    parameters are evaluated in the constructor's thread; unseeded sampling (``seed=None``)
    draws from the engine thread's generator (``mx.random.seed`` here does not reach it).

    ``close()`` (or leaving a ``with Engine(...) as engine:`` block) ends the engine from any
    thread, at once after the call under way: every request is dropped, the pools and decode
    caches are released, the engine's thread ends. A stream still unfinished yields the tokens
    made before and then raises ``servecore.errors.EngineClosedError``; so does every later
    call, naming the engine. An engine never closed is closed when it is garbage-collected
    or at interpreter exit, so a process exits cleanly either way.

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

        Two streams read alternately, with a ``generate`` between reads: each gets what the
        same prompts get served together.

        >>> want = engine.generate([[5, 6, 7], [8, 9]], max_tokens=3)
        >>> a, b = engine.stream([[5, 6, 7]], max_tokens=3), engine.stream([[8, 9]], max_tokens=3)
        >>> got_a, got_b = [next(a)[1]], [next(b)[1]]
        >>> got_a.append(next(a)[1])
        >>> engine.generate([[8, 9]], max_tokens=3) == [want[1]]
        True
        >>> got_b += [t for _, t in b]                 # b to its end while a is still open
        >>> got_a += [t for _, t in a]
        >>> [got_a, got_b] == want, engine.tree.protected_size   # nothing left locked
        (True, 0)

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

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, num_slots: int | None = None,
                 page_size: int = 1, mem_fraction: float = 0.5, max_batch_size: int = 32,
                 prefix_cache: bool = True, prefill_step_size: int = 2048,
                 num_snapshots: int | None = None, snapshot_interval: int = 256,
                 prefill_batch_tokens: int | None = None, cache_dir: Any = None,
                 disk_budget: int = 8 << 30, disk_min_free: int = 1 << 30,
                 kv_bits: int | None = None, kv_group_size: int = 64):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an mlx-lm model (an mlx.nn.Module, e.g. from "
                             f"mlx_lm.load), got {type(model).__name__}: {model!r:.60}")
        self.options = check_options(
            num_slots=num_slots, page_size=page_size, mem_fraction=mem_fraction,
            max_batch_size=max_batch_size, prefix_cache=prefix_cache,
            prefill_step_size=prefill_step_size, num_snapshots=num_snapshots,
            snapshot_interval=snapshot_interval, prefill_batch_tokens=prefill_batch_tokens,
            kv_bits=kv_bits, kv_group_size=kv_group_size)
        # The tokenizer's EOS ids, whichever form it keeps them in (mlx-lm: a set; Hugging
        # Face: an int, a list or None; transformers 5 may give eos_token_ids as an int).
        eos = eos_token_ids(check_tokenizer(tokenizer))
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = _vocab_size(model)
        self.stats = EngineStats()
        mx.eval(model.parameters())  # here: evaluated arrays any thread may read
        owner = OwnerThread("mlxcache.Engine", on_exit=mx.clear_streams)
        try:  # the probe runs the model: on the engine's thread, as every round
            self.support = owner.call(Support.probe, model, self.options.prefix_cache,
                                      self.options.quant)
            self.core = owner.call(Runner, model, self.support, self.options, self.stats)
            if cache_dir is not None:
                _attach_disk(self, owner, cache_dir, disk_budget, disk_min_free)
        except BaseException:
            owner.close()
            raise
        for note in self.support.notes:
            warnings.warn(f"mlxcache: {note}", ReuseDisabledWarning, stacklevel=2)
        s = self.support
        for line in unused_options(self.options, reuse=s.reuse, has_states=s.has_states,
                                   quantized=s.num_quantized):
            warnings.warn(f"mlxcache: {line}", UnusedOptionWarning, stacklevel=2)
        self.streams = Streams(
            ThreadedCore(self.core, owner),
            RequestBuilder(vocab_size=self.vocab_size, tokenizer=tokenizer, eos_ids=eos,
                           check=self._fits),
            name=f"mlxcache.Engine at {id(self):#x}")
        # dropped without close(): end the thread (the pools go with the engine)
        weakref.finalize(self, owner.close)

    def _fits(self, name: str, request: GenerationRequest) -> None:
        """A prompt must fit the KV pool (with reuse): it is inserted whole."""
        n = len(request.tokens)
        if self.reuse and n > self.num_slots - 1:
            raise ValueError(f"{name} has {n} tokens but the KV pool holds at most "
                             f"{self.num_slots - 1} (num_slots={self.num_slots}); raise "
                             "num_slots")

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
            >>> engine = Engine(make_model(), num_slots=64)
            >>> m = engine.memory
            >>> m.serving_bytes <= m.budget_bytes, m.working_bytes
            (True, 0)
        """
        with self.streams.serialized():
            core = self.core
            return MemoryReport.of(core.store, core.path.groups, core.peak_working_bytes,
                                   core.working)

    def reset_cache(self) -> None:
        """Forget every cached prefix that no running request holds: evict all that is
        evictable and free its slots.

        Safe at any point, streams open or not: a running request's locked prefix stays until
        the request finishes (then it and its answer are cached as usual); requests that have
        not started hold nothing. With nothing running, the tree ends empty and every slot is
        free. Not counted in ``stats.token_evictions``.

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
        with self.streams.serialized():
            if self.core.store is not None:
                self.streams.core.owner.call(self.core.store.reset)

    # -------------------------------------------------------------------- closing ----

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.streams.closed

    def close(self) -> None:
        """End the engine, from any thread (the class docstring): after the call under way,
        drop every request, release the pools and the decode caches, end the engine's thread
        (clearing its MLX state). Unfinished streams raise ``EngineClosedError`` once their
        tokens are read; later calls raise it. Idempotent.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=32)
            >>> events = engine.stream([[1, 2, 3]], max_tokens=8)
            >>> next(events)[0]
            0
            >>> engine.close(); engine.close()
            >>> engine.core.store is None, engine.streams.core.owner.closed
            (True, True)
            >>> next(events)
            Traceback (most recent call last):
            ...
            servecore.errors.EngineClosedError: mlxcache.Engine at 0x... was closed before ...
        """
        self.streams.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- API ----

    def generate(self, prompts: Sequence[Prompt], max_tokens: int | Sequence[int] = 256,
                 temperature: float | Sequence[float] = 0.0, top_p: float | Sequence[float] = 1.0,
                 top_k: int | Sequence[int] = 0, seed: int | None | Sequence[int | None] = None,
                 stop_token_ids: Sequence[int] | None = None, *, text: bool = False,
                 progress: bool = False) -> list[list[int]] | list[str]:
        """Generated token ids per prompt (a stop token, when hit, is the last one), or with
        ``text=True`` their text (``servecore.prompts.decode``: the tokenizer's decoding,
        without the stop token that ended the request). The arguments are ``stream``'s.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=64)
            >>> outs = engine.generate([[1, 2, 3], [4, 5]], max_tokens=[2, 3],
            ...                        temperature=[0.0, 0.8], seed=[None, 7])
            >>> [len(o) for o in outs]
            [2, 3]

            With a tokenizer, prompts may be text or chats, and the answers text
            (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``):

            >>> from servecore.testing import word_tokenizer
            >>> engine = Engine(make_model(), word_tokenizer(1000), num_slots=64)
            >>> chat = [{"role": "user", "content": "w7 w8"}]
            >>> ids = engine.generate([[4, 7, 8, 5]], max_tokens=3)[0]
            >>> engine.generate([chat], max_tokens=3)[0] == ids  # <|user|> w7 w8 <|assistant|>
            True
            >>> engine.generate([chat], max_tokens=3, text=True)[0] == engine.tokenizer.decode(ids)
            True
        """
        return self.streams.generate(
            prompts, _given(max_tokens), temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop_token_ids=stop_token_ids, progress=progress, text=text)

    def stream(self, prompts: Sequence[Prompt], max_tokens: int | Sequence[int] = 256,
               temperature: float | Sequence[float] = 0.0, top_p: float | Sequence[float] = 1.0,
               top_k: int | Sequence[int] = 0, seed: int | None | Sequence[int | None] = None,
               stop_token_ids: Sequence[int] | None = None, *, progress: bool = False
               ) -> Stream:
        """``(prompt_index, token)`` as tokens are produced, all prompts concurrently.

        Args:
            prompts: a list (or any iterable, read once) of prompts, each a list or 1-D int
                array of token ids, a string, or a chat (a list of ``{"role": ..., "content":
                ...}`` dicts, rendered by the tokenizer's chat template); text and chats need
                a tokenizer. One prompt alone is ``[prompt]`` (``servecore.prompts`` has the
                rule).
            max_tokens: >= 1 tokens per request.
            temperature: 0 is greedy.
            top_p: nucleus filter mass (1.0 = off).
            top_k: top-k filter (0 = off).
            seed: per-request reproducible sampling (None: MLX's global generator).
            stop_token_ids: finish a request on any of these: one id or a list (default: the
                tokenizer's EOS ids).
            progress: a tqdm bar of the tokens on stderr when it is a terminal.

        Every sampling argument and ``max_tokens`` is one value for all prompts or a list (or
        1-D NumPy array) with one per prompt. All inputs are checked before anything is
        queued (``servecore.requests``): a ValueError names the bad value; nothing is rounded
        or coerced. The requests are queued at once; the returned ``servecore.streams.Stream``
        advances the engine as it is read, and closing it (``close()``, leaving a ``with``
        block, dropping it) releases those not finished.
        """
        return self.streams.stream(
            prompts, _given(max_tokens), temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop_token_ids=stop_token_ids, progress=progress)

    def add_request(self, prompt: Prompt, max_tokens: int = 256, **sampling: Any) -> int:
        """Queue one request (``servecore.streams.Streams.add_request``); its id.

        Examples:
            >>> from mlxcache.zoo import make_model
            >>> engine = Engine(make_model(), num_slots=32)
            >>> rid = engine.add_request([1, 2, 3], 2)
            >>> while engine.has_unfinished():
            ...     done = [f for _, _, f in engine.step()]
            >>> done
            [True]
        """
        return self.streams.add_request(prompt, _given(max_tokens), **sampling)

    def step(self) -> list[tuple[int, int | None, bool]]:
        """One round: ``(request id, token, finished)`` of ``add_request``'s requests."""
        return self.streams.step()

    def abort(self, rid: int) -> bool:
        """End request ``rid`` at once (``servecore.streams.Streams.abort``)."""
        return self.streams.abort(rid)

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or has tokens in flight."""
        return self.streams.has_unfinished()

    start_thread = delegate("streams.core.owner.start", "OwnerThread.start: a loop on its thread.")


def _attach_disk(engine: Engine, owner: OwnerThread, cache_dir: Any, budget: int,
                 min_free: int) -> None:
    """The disk tier of ``Engine(cache_dir=...)`` under the engine's store."""
    if engine.core.store is None:
        raise ValueError(f"cache_dir={str(cache_dir)!r} needs the prefix cache: it is off "
                         "(prefix_cache=False, or a model served without reuse)")
    disk = DiskStore(cache_dir, budget_bytes=check_int("disk_budget", budget, 0, 1 << 62),
                     min_free_bytes=check_int("disk_min_free", min_free, 0, 1 << 62))
    try:
        salt_key = salt_of(engine.model, engine.tokenizer, engine.support, DISK_PAGE_TOKENS)
        owner.call(engine.core.attach_disk, disk, salt_key)
    except BaseException:
        disk.close()
        raise


def _given(max_tokens: Any) -> Any:
    """``max_tokens`` as given: None is no default here, but a bad value (named)."""
    if max_tokens is None:
        check_int("max_tokens", max_tokens, 1)
    return max_tokens
