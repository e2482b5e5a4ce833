"""``hybridattn.Engine``: continuous batching around the pure ``hybridattn.step``.

The engine builds its core (``hybridattn.engine._core``: the scheduler, the device runner and
the stats over pools sized from its options) and serves it through the front door both
engines share (``servecore.client.EngineClient``: ``generate``, ``stream``, ``add_request`` /
``step`` / ``abort``, ``close``, one signature on both engines). What is its own: the
model's properties (pools, the prefix cache's tree), ``reset_cache``, ``reset_stats``,
``warmup`` and ``follow``.
"""

from __future__ import annotations

from typing import Any

import jax

from hybridattn.config import KimiLinearConfig
from hybridattn.engine._core import Core, build_core
from hybridattn.engine.options import EngineOptions
from hybridattn.engine.processes import ProcessGroupCore, model_digest
from hybridattn.engine.scheduler import Scheduler, ShardedScheduler
from hybridattn.models import kimi_linear
from servecore.client import EngineClient
from servecore.engine import delegate
from servecore.prompts import check_tokenizer
from servecore.validate import eos_token_ids, options_of

__all__ = ["Engine"]


class Engine(EngineClient):
    """Continuous-batching generation for a Kimi-Linear model.

    Args:
        config: the model's config (``hybridattn.models.kimi_linear.load`` or
            ``KimiLinearConfig``).
        params: the model's parameters (``kimi_linear.load`` or ``kimi_linear.init_params``),
            checked against ``kimi_linear.param_shapes(config)``.
        tokenizer: optional, the checkpoint's tokenizer (``kimi_linear.load_tokenizer``, or
            any Hugging Face tokenizer): prompts may then be text or chats, ``generate(...,
            text=True)`` returns text, and its EOS ids with ``config.eos_token_id`` end
            requests unless ``stop_token_ids`` is given.
        **options: any field of ``EngineOptions`` (each documented there: pool sizes, shape
            buckets, the prefix cache, ``decode_steps``, ``overlap``, ``mesh``, ...).

    The calls are ``servecore.client.EngineClient``'s. A round is a transaction
    (``hybridattn.engine._core``): an exception in it leaves the pools and the bookkeeping in
    agreement and drops no request (a ``KeyboardInterrupt`` mid-round is held until the round
    has committed). A request's samples depend on its prompt and seed, not on which other
    requests share its steps. Bad options raise ``ValueError`` naming them; a request that
    cannot fit raises ``servecore.errors.InvalidRequest`` before anything changes.

    Two greedy prompts on a tiny random model; the engine compiles one EXTEND and one
    DECODE step here (one per shape bucket used):

    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = kimi_linear.init_params(cfg, jax.random.key(0))
    >>> engine = Engine(cfg, params, max_running_requests=2, max_context_len=16,
    ...                 num_token_slots=33)
    >>> prompts = [[1, 2, 3], [4, 5]]
    >>> outs = engine.generate(prompts, max_tokens=4)
    >>> [len(o) for o in outs], sorted(mode for mode, *_ in engine.stats.buckets)
    ([4, 4], [1, 2])

    ``stream`` yields ``(prompt index, token)`` as steps finish; sampling is reproducible
    from the seed:

    >>> [t for _, t in engine.stream(prompts[:1], max_tokens=4)] == outs[0]
    True
    >>> a = engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    >>> a == engine.generate(prompts, 4, temperature=0.8, top_p=0.9, seed=7)
    True

    A request queued with ``add_request`` gets its tokens from ``step`` even when a
    ``generate`` advanced the engine in between:

    >>> rid = engine.add_request([7, 8], 2)
    >>> _ = engine.generate([[1]], 3)
    >>> [tok for r, tok, _ in engine.step() if r == rid] == engine.generate([[7, 8]], 2)[0]
    True

    A ``with`` block closes the engine; then calls fail, naming it:

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

    def __init__(self, config: KimiLinearConfig, params: Any, *, tokenizer: Any = None,
                 **options: Any):
        if not isinstance(config, KimiLinearConfig):
            raise ValueError(f"config must be a KimiLinearConfig, got {type(config).__name__}")
        kimi_linear.check_supported(config)  # unimplemented config values, by name
        kimi_linear.check_params(params, config)
        opts = options_of(EngineOptions, options, "hybridattn.Engine()").resolved(config)
        eos = _default_stop_ids(config, check_tokenizer(tokenizer))
        self.config, self.options = config, opts
        multi = opts.mesh is not None and jax.process_count() > 1  # every process runs it
        model = model_digest(config, params) if multi else b""  # (before params are placed)
        core = build_core(config, params, opts)
        if multi:
            core = ProcessGroupCore(core, model)  # (``hybridattn.engine.processes``)
        self.core: Core = core
        super().__init__(core, vocab_size=config.vocab_size, tokenizer=tokenizer, eos_ids=eos,
                         check=core.check, name=f"hybridattn.Engine at {id(self):#x}")
        self.scheduler: Scheduler | ShardedScheduler = core.scheduler
        self.max_running_requests = core.runner.max_running_requests
        self.capacity, self.shard_capacity = core.capacity, core.shard_capacity
        b = core.buckets
        self.request_buckets, self.token_buckets = b.request, b.token
        self.kv_buckets, self.snapshot_buckets = b.kv, b.snapshot

    # ------------------------------------------------------------- the core's state ----

    state = delegate("core.runner.state", "The ``ServingState`` (pools) the steps update.")
    params = delegate("core.runner.params", "The parameters in the engine's layout.")
    stats = delegate("core.stats", "``EngineStats``: throughput, TTFT, compilations and buckets.")
    memory = delegate("core.memory", "``MemoryReport``: pool sizes, the steps' working memory "
                      "and bytes per token.")
    tree = delegate("scheduler.tree", "The prefix cache's radix tree (``servecore.radix."
                    "RadixCache``; under a mesh one per data shard; None without a cache).")
    num_running = delegate("scheduler.num_running", "Admitted requests (a row, slots).")
    num_waiting = delegate("scheduler.num_waiting", "Queued requests not admitted yet.")
    num_cached_slots = delegate("scheduler.cached_size",
                                "Token slots the prefix cache holds (0 without it).")
    mesh = delegate("options.mesh", "The mesh served on (None: one device).")
    num_data_shards = delegate("options.num_data_shards", "The mesh's data size (1 without).")
    max_context_len = delegate("options.max_context_len", "Longest prompt + generation.")
    chunked_prefill_size = delegate("options.chunked_prefill_size", "Prompt tokens per step.")
    decode_steps = delegate("options.decode_steps", "Decode steps per dispatch.")
    prefix_cache = delegate("options.prefix_cache", "Whether cached prefixes are reused.")
    snapshot_interval = delegate("options.snapshot_interval", "The snapshot grid, tokens.")
    overlap = delegate("options.overlap", "Whether rounds overlap the device's step.")

    def room_for(self, prompt_len: int) -> int | None:
        """The largest ``max_tokens`` a prompt of ``prompt_len`` tokens may ask for: the
        context (``max_context_len``, and the token slots of one data shard) less the prompt,
        plus the last token, which is returned, never fed back (0: the prompt does not fit).

        >>> from hybridattn.models import kimi_linear
        >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
        >>> Engine(cfg, kimi_linear.init_params(cfg, jax.random.key(0)),
        ...        max_context_len=16, num_token_slots=33).room_for(10)
        7
        """
        return max(0, min(self.max_context_len, self.shard_capacity) - prompt_len + 1)

    @property
    def num_free_slots(self) -> int:
        """Token slots neither held by a request nor by the prefix cache (``Core``'s count)."""
        with self._serialized():
            return self.core.num_free_slots()

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
        with self._serialized():
            self.core.reset_cache()

    def reset_stats(self) -> None:
        """Zero the throughput and cache counters and TTFTs; compilation counts and buckets
        stay."""
        with self._serialized():
            self.core.reset_stats()

    def follow(self) -> None:
        """Processes other than 0 of a multi-process mesh: run process 0's rounds until it
        closes (``hybridattn.engine.processes``)."""
        self.core.follow()

    def warmup(self, progress: bool = False) -> None:
        """Compile the smallest buckets (one prefill step, one decode step) by serving a
        one-token request, then reset the throughput counters (compilations are kept). With
        one bucket per dimension that is every compilation the engine will need.
        ``progress`` shows the two steps as a tqdm bar on stderr when it is a terminal."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        # no stop ids: a first token that is the tokenizer's EOS must not skip the decode step
        with self.stream([[0]], 2, stop_token_ids=[], progress=progress) as stream:
            stream.describe("compiling the prefill and decode steps")
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
