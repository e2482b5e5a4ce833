"""``hybridattn.Engine``: continuous batching around the pure ``hybridattn.step``, a facade.

The engine builds its core (``hybridattn.engine.core``: the scheduler, the device runner and
the stats over pools sized from its options) and serves it through the shared
``servecore.streams.Streams`` (request ids, per-request outboxes, ``generate`` / ``stream`` /
``add_request`` / ``step`` / ``abort``) with the shared ``servecore.requests.RequestBuilder``
(the argument names and checks, the finishing rule). What it adds: the model's own
properties (pools, stats, the prefix cache's tree), ``reset_cache``, ``reset_stats`` and
``warmup``.

Bad requests (an empty prompt, token ids that are not ints or lie outside the vocabulary,
``max_tokens < 1``, sampling settings the device cannot hold, a prompt that cannot fit the
context or the pool) raise ``ValueError`` before anything changes; running requests are
unaffected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from hybridattn.config import KimiLinearConfig
from hybridattn.engine.core import Core, build_core
from hybridattn.engine.options import EngineOptions
from hybridattn.engine.processes import ProcessGroupCore
from hybridattn.engine.scheduler import Scheduler, ShardedScheduler
from hybridattn.models import kimi_linear
from hybridattn.models.kimi_linear.params import _check_supported
from servecore.engine import delegate
from servecore.prompts import Prompt, check_tokenizer
from servecore.requests import RequestBuilder
from servecore.streams import Stream, Streams, _max_tokens
from servecore.validate import eos_token_ids

__all__ = ["Engine"]


class Engine:
    """Continuous-batching generation for a Kimi-Linear model.

    ``generate`` serves a list of prompts to completion, ``stream`` yields tokens as they
    come, and ``add_request`` / ``step`` drive the scheduler one round at a time. Requests
    are greedy unless given a ``temperature``; a request's samples depend on its prompt and
    seed, not on which other requests share its steps.

    The contract with callers is ``servecore.streams.Streams``'s, which the engine delegates
    ``generate``, ``stream``, ``add_request``, ``step``, ``abort`` and ``has_unfinished`` to
    (the arguments: ``servecore.requests``): users interleaved in one thread each get their
    own tokens; ``abort`` is safe outside a round; threads are serialized. A round is a
    transaction (``hybridattn.engine.core``): an exception in it leaves the pools and the
    bookkeeping in agreement and drops no request (a ``KeyboardInterrupt`` mid-round is held
    until the round has committed). ``close()`` (or leaving a ``with`` block) ends the engine
    from any thread, after the call under way: every request is dropped, the device buffers
    deleted (``Core.close``); an unfinished stream yields the tokens made before, then raises
    ``servecore.errors.EngineClosedError``, as every later call does. On a mesh of several
    processes every process builds the engine, process 0 serves, the others ``follow()``.

    Args:
        config: the model's config (``hybridattn.models.kimi_linear.load`` or
            ``KimiLinearConfig``).
        params: the model's parameters (``kimi_linear.load`` or ``kimi_linear.init_params``);
            checked against ``kimi_linear.param_shapes(config)``.
        max_running_requests: request rows (default ``default_max_running_requests``: 32,
            fewer above 256k of context, so the ``req_to_token`` table stays within 32 MiB);
            never more than the token slots hold at full context, and at least one.
        max_context_len: longest prompt + generation (default ``min(model_max_length, 4096)``);
            up to 1M tokens and beyond: only the ``req_to_token`` rows grow with it, the token
            pool is sized on its own (a pool smaller than one full context serves one request
            at a time, each prompt + generation within the pool).
        num_token_slots: MLA token slots; default: what ``mem_fraction`` of the available
            memory holds beside the parameters, tables, KDA states and step working memory
            (the largest step's, compiled first if pools fill half), at most every row full.
        mem_fraction: the share of ``available_memory_bytes()`` the default pool may use.
        chunked_prefill_size: prompt tokens per step (long prompts span several steps);
            default ``default_chunked_prefill_size(max_context_len)``: 256, or 2048 past
            4096 tokens of context.
        request_buckets: shape buckets of the padded batches' request count (default:
            powers of four up to ``max_running_requests``); the step compiles once per
            bucket tuple used.
        token_buckets: shape buckets of the tokens in a step (default: powers of four from
            16 up to ``chunked_prefill_size + max_running_requests``).
        kv_buckets: shape buckets of the attention width (default: powers of four from 64
            up to 4096, then powers of two up to ``max_context_len``: at long context a
            width pads by at most 2x, 12 buckets for 1M).
        snapshot_buckets: shape buckets of the state snapshots an extend step takes (default:
            0, then powers of four from 4 up to what a step can take: one per grid interval
            of a prefill chunk and three per request); one bucket means one variant.
        chunk_size: the KDA prefill chunk, a power of two.
        dtype: the pools' floating dtype (MLA latents and conv states; KDA states are float32).
        seed: the base sampling key (``ServingState.create``).
        prefix_cache: reuse cached prefixes (a radix tree over the token slots, with exact
            KDA state snapshots; see ``hybridattn.engine.prefix_cache``). False re-prefills every
            prompt from token 0. Default: on (under a ``mesh``, a tree per data shard, and
            requests routed to the shard holding their prefix: ``ShardedScheduler``).
        snapshot_interval: the snapshot grid along every prefill, a positive multiple of
            ``chunk_size`` (default: the multiple of it nearest 256, at least one chunk).
        num_snapshot_slots: snapshot slots (the sink included); default: one per grid
            interval of the token pool and four per request row, within a quarter of the
            memory budget left after the parameters and working states (the token pool's
            default gets the rest).
        tokenizer: optional, the checkpoint's tokenizer (``kimi_linear.load_tokenizer``, or
            any Hugging Face tokenizer): prompts may then be text or chats (rendered by its
            chat template), ``generate(..., text=True)`` returns text, and its EOS ids with
            ``config.eos_token_id`` (an int or a list) end requests unless
            ``stop_token_ids`` is given. Anything without ``encode`` and ``decode`` (a path,
            say) is a ``TypeError`` (``servecore.prompts.check_tokenizer``).
        decode_steps: decode steps per dispatch when a round would be a pure ``DECODE``
            step that nothing can join before it ends: no request waits, or none running can
            reach its ``max_tokens`` inside the run (so only a stop token could free a
            row for a waiting one). The steps run in one ``lax.while_loop`` on the device
            (``hybridattn.serving.decode_steps``), each request at most up to its
            ``max_tokens`` and the batch's attention-width bucket; a request that samples
            a stop token inside the run becomes padding from the next step on (no token slot,
            no state written), so the pools, the tokens and the stats are those of stepping
            one at a time. It saves the host's planning, packing, dispatch and read-back of
            every step but the first; a request finishing early in the run holds its row
            until the run ends. 1 (the default): one step per round; 8 cut the host time
            per decode step 5-9x in ``bench serve``. Each count compiles its own decode
            function per bucket, so a short-lived engine (or a test) pays a compile for it.
            Under a ``mesh`` the engine decodes one step per round (``ShardedStep`` wraps
            the single step only).
        overlap: overlapped scheduling (default: on with one device, off under a ``mesh``,
            where ``overlap=True`` is refused): a step stays on the
            device while its round ends, and the next round admits what fits, plans and
            dispatches the step that follows it before reading its tokens: that step takes
            each decoding request's last token from the device (one that sampled a stop
            token there becomes padding), and the host then commits the earlier step's
            tokens, finishes requests and releases them, all while the device computes.
            JAX dispatch is asynchronous, so the device does not wait for the host between
            steps. Each request's tokens are those of the synchronous engine
            (``overlap=False``; what the prefix cache holds may differ with admission
            timing); a step's tokens reach ``step`` / ``stream`` one round
            later, and a waiting request admitted into a row that a finish frees one round
            later too.
        scan_layers: run the layers that repeat as one ``lax.scan`` over stacked parameters
            and pools (``kimi_linear.stack_layers``, done here): the released 27 layers are
            layer 0 and seven groups of 2-3 KDA layers each ending in an MLA layer
            (``kimi_linear.group_plan``), layer 0 running in the first group's loop
            (``kimi_linear.folded_layers``), so each bucket compiles 2 layers instead of 27; a
            model that repeats a period of layers instead (``kimi_linear.layer_plan``)
            compiles one period. The engine
            then holds the stacked copy of ``params`` (under a ``mesh``, placed by
            ``kimi_linear.stacked_param_specs``). No effect on a model whose layers do not
            repeat. On one device the engine's copy is also in
            ``kimi_linear.serving_layout`` (routed down projections input-major, each KDA
            layer's input projections as one).
        mesh: a ``(data, tensor)`` mesh (``hybridattn.mesh.make_mesh``) to serve on
            (docs/sharding.md): the step runs sharded (``sharding.ShardedStep``, this engine's
            own), ``params`` are placed by ``kimi_linear.PARAM_RULES``, and the pools are split
            into ``data`` shards, each with ``max_running_requests / data`` rows and
            ``num_token_slots / data`` token slots (its own sink included; both must divide).
            Each request runs on one data shard: the least loaded one with a free row and
            the token slots for its whole life (admission is FIFO over all shards). Every
            step runs one work list per shard; the buckets (``request_buckets`` reaching a
            shard's rows, ``token_buckets`` a shard's prompt chunk and decodes) are per shard.
            Heads and MLP channels must divide by ``tensor``, routed experts by
            ``data * tensor``. No prefix cache.

    Attributes:
        state: the ``ServingState`` (pools) the steps update.
        stats: ``EngineStats``: throughput, TTFT, compilations and buckets.
        memory: ``MemoryReport``: pool sizes, the steps' working memory and bytes per token.
        max_running_requests: requests that run at once (rows, state slots and token slots
            permitting), over all data shards.
        capacity: token slots for requests (the sinks excluded), over all data shards.
        shard_capacity: token slots of one data shard (``capacity`` without a mesh): the
            most one request may use.
        num_data_shards: the mesh's data size (1 without a mesh).

    Raises:
        ValueError: a size, fraction, dtype, bucket list or parameter tree that cannot work,
            or a config value that is not implemented, naming it; an option that would do
            nothing in the mode chosen (prefix-cache options without the cache, ``overlap``
            or ``decode_steps > 1`` under a ``mesh``), naming both.

    Two greedy prompts on a tiny random model; the engine compiles one EXTEND and one
    DECODE step here (one per shape bucket used):

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = kimi_linear.init_params(cfg, jax.random.key(0))
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33)
    >>> prompts = [[1, 2, 3], [4, 5]]
    >>> outs = engine.generate(prompts, max_tokens=4)
    >>> [len(o) for o in outs], all(0 <= t < cfg.vocab_size for o in outs for t in o)
    ([4, 4], True)
    >>> sorted(mode for mode, *_ in engine.stats.buckets)  # ForwardMode.EXTEND, DECODE
    [1, 2]

    ``stream`` yields ``(prompt index, token)`` as steps finish; sampling is reproducible
    from the seed (one seed is every prompt's; give a list for one per prompt):

    >>> got = [[], []]
    >>> for i, token in engine.stream(prompts, max_tokens=4):
    ...     got[i].append(token)
    >>> got == outs
    True
    >>> a = engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    >>> a == engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    True
    >>> engine.num_running, engine.has_unfinished()  # finished requests are released
    (0, False)

    A request queued with ``add_request`` gets its tokens from ``step`` even when a
    ``generate`` advanced the engine in between:

    >>> rid = engine.add_request([7, 8], 2)
    >>> _ = engine.generate([[1]], 3)
    >>> [tok for r, tok, _ in engine.step() if r == rid] == engine.generate([[7, 8]], 2)[0]
    True

    With a tokenizer, a prompt may be text or a chat, and ``text=True`` decodes the answers
    (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``, and its chat
    template writes ``<|user|> ... <|assistant|>``, tokens 4 and 5; its EOS id, 1, ends a
    request by default):

    >>> from servecore.testing import word_tokenizer
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33, tokenizer=word_tokenizer(64))
    >>> chat = [{"role": "user", "content": "w7 w8"}]
    >>> engine.generate(["w7 w8", chat], 4) == engine.generate([[7, 8], [4, 7, 8, 5]], 4)
    True
    >>> engine.generate([chat], 4, text=True)[0] == engine.tokenizer.decode(
    ...     engine.generate([[4, 7, 8, 5]], 4)[0])
    True

    A ``with`` block closes the engine (``close``); then calls fail, naming it:

    >>> with Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...             num_token_slots=33) as engine:
    ...     _ = engine.generate([[1, 2]], 2)
    >>> engine.closed, engine.state is None
    (True, True)
    >>> engine.generate([[1, 2]], 2)
    Traceback (most recent call last):
    ...
    servecore.errors.EngineClosedError: hybridattn.Engine at 0x... is closed: build a new engine
    """

    def __init__(
        self,
        config: KimiLinearConfig,
        params,
        *,
        max_running_requests: int | None = None,
        max_context_len: int | None = None,
        num_token_slots: int | None = None,
        mem_fraction: float = 0.5,
        chunked_prefill_size: int | None = None,
        request_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        kv_buckets: Sequence[int] | None = None,
        snapshot_buckets: Sequence[int] | None = None,
        chunk_size: int = 32,
        dtype=jnp.float32,
        seed: int = 0,
        prefix_cache: bool | None = None,
        snapshot_interval: int | None = None,
        num_snapshot_slots: int | None = None,
        tokenizer: Any = None,
        decode_steps: int = 1,
        overlap: bool | None = None,
        scan_layers: bool = True,
        mesh: Any = None,  # a jax.sharding.Mesh; checked by EngineOptions (ValueError)
    ):
        if not isinstance(config, KimiLinearConfig):
            raise ValueError(f"config must be a KimiLinearConfig, got {type(config).__name__}")
        _check_supported(config)  # unimplemented config values, by name
        kimi_linear.check_params(params, config)
        opts = EngineOptions(
            max_running_requests=max_running_requests, max_context_len=max_context_len,
            num_token_slots=num_token_slots, mem_fraction=mem_fraction,
            chunked_prefill_size=chunked_prefill_size, request_buckets=request_buckets,
            token_buckets=token_buckets, kv_buckets=kv_buckets,
            snapshot_buckets=snapshot_buckets, chunk_size=chunk_size, dtype=dtype, seed=seed,
            prefix_cache=prefix_cache, snapshot_interval=snapshot_interval,
            num_snapshot_slots=num_snapshot_slots, decode_steps=decode_steps, overlap=overlap,
            scan_layers=scan_layers, mesh=mesh).resolved(config)
        eos = _default_stop_ids(config, check_tokenizer(tokenizer))
        self.config, self.tokenizer = config, tokenizer
        core = build_core(config, params, opts)
        if mesh is not None and jax.process_count() > 1:  # every process runs this engine
            core = ProcessGroupCore(core)  # (``hybridattn.engine.processes``)
        self.core: Core = core
        self.streams = Streams(core, RequestBuilder(vocab_size=config.vocab_size,
                                                    tokenizer=tokenizer, eos_ids=eos,
                                                    check=core.check),
                               name=f"hybridattn.Engine at {id(self):#x}")
        self.scheduler: Scheduler | ShardedScheduler = core.scheduler
        self.memory = core.memory
        self.mesh, self.num_data_shards = opts.mesh, opts.num_data_shards
        self.max_context_len = opts.max_context_len
        self.max_running_requests = core.runner.max_running_requests
        self.capacity, self.shard_capacity = core.capacity, core.shard_capacity
        self.chunked_prefill_size = opts.chunked_prefill_size
        self.decode_steps = opts.decode_steps
        self.prefix_cache, self.snapshot_interval = opts.prefix_cache, opts.snapshot_interval
        self.overlap, b = opts.overlap, core.buckets
        self.request_buckets, self.token_buckets = b.request, b.token
        self.kv_buckets, self.snapshot_buckets = b.kv, b.snapshot

    # ------------------------------------------------------------- the core's state ----

    state = delegate("core.runner.state", "The ``ServingState`` (pools) the steps update.")
    params = delegate("core.runner.params", "The parameters in the engine's layout.")
    stats = delegate("core.stats", "``EngineStats``: throughput, TTFT, compilations and buckets.")
    tree = delegate("scheduler.tree", "The prefix cache's radix tree (``servecore.radix."
                    "RadixCache``; under a mesh one per data shard; None without a cache).")
    num_running = delegate("scheduler.num_running", "Admitted requests (a row, slots).")
    num_waiting = delegate("scheduler.num_waiting", "Queued requests not admitted yet.")
    num_cached_slots = delegate("scheduler.cached_size",
                                "Token slots the prefix cache holds (0 without it).")

    @property
    def num_free_slots(self) -> int:
        """Token slots neither held by a request nor by the prefix cache (``Core``'s count)."""
        if self.streams.closed:
            raise self.streams.closed_error()
        return self.core.num_free_slots()

    # ---------------------------------------------------------------- the contract ----

    def add_request(self, prompt: Prompt, max_tokens: Any = None, *,
                    temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0,
                    seed: Any = None, stop_token_ids: Any = None,
                    max_new_tokens: Any = None) -> int:
        """Queue a request; returns its id. It is admitted by a later round once a row and
        the token slots for its whole life (prompt + ``max_tokens - 1``) are free; ``step``
        returns its tokens (``servecore.streams.Streams.add_request``)."""
        return self.streams.add_request(
            prompt, _max_tokens(max_tokens, max_new_tokens), temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids)

    def stream(self, prompts: Iterable[Prompt], max_tokens: Any = None,
               *, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
               stop_token_ids: Any = None, progress: bool = False,
               max_new_tokens: Any = None) -> Stream:
        """Serve ``prompts`` and yield ``(prompt index, token)`` as tokens are generated
        (``servecore.streams.Streams.stream``): all are checked and queued before this
        returns; iterating advances the engine; stopping early aborts what is left."""
        return self.streams.stream(
            prompts, _max_tokens(max_tokens, max_new_tokens), temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
            progress=progress)

    def generate(self, prompts: Iterable[Prompt], max_tokens: Any = None,
                 *, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                 stop_token_ids: Any = None, progress: bool = False,
                 text: bool = False, max_new_tokens: Any = None,
                 ) -> list[list[int]] | list[str]:
        """The new tokens of every prompt (a stop token, when hit, is the last), or with
        ``text=True`` their text (``servecore.streams.Streams.generate``); the arguments are
        ``stream``'s."""
        return self.streams.generate(
            prompts, _max_tokens(max_tokens, max_new_tokens), temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
            progress=progress, text=text)

    def step(self) -> list[tuple[int, int | None, bool]]:
        """One scheduling round; ``(request id, token, finished)`` of every token of the
        requests queued with ``add_request`` not returned yet (``Streams.step``). With
        ``overlap`` a step's tokens are committed by the round after it."""
        return self.streams.step()

    def abort(self, rid: int) -> bool:
        """End request ``rid`` (waiting or running; its slots are released at once); whether
        it was unfinished or had tokens not received yet (``Streams.abort``)."""
        return self.streams.abort(rid)

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.streams.has_unfinished()

    # ------------------------------------------------------------------- the engine ----

    def reset_cache(self) -> None:
        """Forget every cached prefix and snapshot that no running request holds (their token
        and snapshot slots are freed); what running requests hold stays until they finish.

        >>> from hybridattn.models import kimi_linear
        >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
        >>> engine = Engine(cfg, kimi_linear.init_params(cfg, jax.random.key(0)),
        ...                 max_running_requests=2, max_context_len=16, num_token_slots=33,
        ...                 snapshot_interval=32, num_snapshot_slots=9)
        >>> _ = engine.generate([[1, 2, 3]], 2)
        >>> engine.num_cached_slots, engine.tree.num_states, engine.reset_cache()
        (4, 2, None)
        >>> engine.num_cached_slots, engine.num_free_slots == engine.capacity
        (0, True)
        """
        with self.streams.serialized():
            self.core.reset_cache()

    def reset_stats(self) -> None:
        """Zero the throughput and cache counters and TTFTs; compilation counts and buckets
        stay."""
        with self.streams.serialized():
            self.core.reset_stats()

    def follow(self) -> None:
        """Processes other than 0 of a multi-process mesh: run process 0's rounds until it
        closes (``hybridattn.engine.processes``)."""
        self.core.follow()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.streams.closed

    def close(self) -> None:
        """End the engine, from any thread (the class docstring): after the call under way,
        drop every request and delete the pools' device buffers. Unfinished streams raise
        ``EngineClosedError`` once their tokens are read; later calls raise it. Idempotent
        (tests/hybridattn/test_engine_close.py)."""
        self.streams.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def warmup(self, progress: bool = False) -> None:
        """Compile the smallest buckets (one prefill step, one decode step) by serving a
        one-token request, then reset the throughput counters (compilations are kept). With
        one bucket per dimension that is every compilation the engine will need.
        ``progress`` shows the two steps as a tqdm bar on stderr when it is a terminal."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        # no stop ids: a first token that is the tokenizer's EOS must not skip the decode step
        with self.stream([[0]], 2, stop_token_ids=[], progress=progress) as stream:
            if stream._bar is not None:
                stream._bar.set_description("compiling the prefill and decode steps")
            for _ in stream:
                pass
        self.reset_stats()


def _default_stop_ids(config: KimiLinearConfig, tokenizer: Any) -> frozenset[int]:
    """With a tokenizer, a request ends by default where the checkpoint says text ends: the
    tokenizer's EOS ids and the config's ``eos_token_id`` (an int or a list, as config.json
    has it, and as transformers' generate and mlx_lm.load read it). Without one (ids in, ids
    out) only ``stop_token_ids`` end a request early."""
    if tokenizer is None:
        return frozenset()
    eos = eos_token_ids(tokenizer) | eos_token_ids(config)
    if any(t >= config.vocab_size for t in eos):
        raise ValueError(f"the EOS ids {sorted(eos)} of the tokenizer and config must lie "
                         f"in the model's vocabulary [0, {config.vocab_size})")
    return eos
