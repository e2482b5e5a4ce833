"""Counters of ``hybridattn.Engine``: ``EngineStats``.

>>> EngineStats(decode_tokens=8, decode_seconds=0.5).decode_tok_s
16.0
"""

from __future__ import annotations

import dataclasses

from servecore.stats import ServingStats

__all__ = ["EngineStats"]


@dataclasses.dataclass
class EngineStats(ServingStats):
    """Counters since the engine was built (or ``Engine.reset_stats``): ``Engine.stats``.

    The core counters and rates are ``servecore.ServingStats``'s, named and defined as in
    ``mlxcache.EngineStats``. Steps that compiled are left out of the throughput figures.
    ``prefill_*``: steps that ran prompt tokens (decodes riding along in the same mixed step
    are not counted as tokens, but their time is here); ``decode_*``: pure decode steps.
    ``snapshots_taken`` / ``state_evictions`` count KDA state snapshots. Here: ``steps``
    (device steps: a multi-step decode dispatch counts each step it ran); ``decode_rounds``:
    the pure-decode dispatches (rounds) among them; ``num_compilations``: compilations this
    engine needed (its own count: the step, one per new shape bucket, plus row allocation
    and release; JAX may load one from its cache when another engine of the same geometry
    compiled it); ``buckets``: the
    ``(mode, B, T, W, Q)`` shape buckets the steps used, ``compiled_buckets`` those that were
    new to it, ``bucket_compile_seconds`` each of those to the wall time of the step that
    compiled it (tracing, lowering, compiling and its first run; ``compile_seconds`` is their
    sum). Under a mesh ``shard_prompt_tokens`` / ``shard_cached_tokens`` (and
    ``shard_hit_rates``) count each data shard's requests apart.

    Where a step's time goes (steps that compiled left out, as above): ``*_host_seconds``
    is the Python side of those steps' rounds outside the wait for their outputs (planning
    the step, packing the batch, the jitted call until it returns: argument flattening,
    transfers, dispatch; then committing the sampled tokens); ``*_wait_seconds`` the time
    then spent blocked on the outputs: the device's work that the host side did not
    overlap. Without overlapped scheduling, host + wait is each round from planning to
    commit; ``prefill_seconds`` / ``decode_seconds`` run from the packing to the outputs
    (from the previous run's outputs on, for a run dispatched before them), so they add up
    to the wall time of the steps (``hybridattn.bench serve`` times the step alone on the
    device apart). ``decode_exposed_seconds``: the part of ``decode_host_seconds`` the
    device did not hide, during which it had nothing queued (all of it without
    overlapping; with it, an upper bound: a stretch of host work counts whole when the
    device was found idle at its end).

    >>> stats = EngineStats(prefill_tokens=512, prefill_seconds=0.25, decode_tokens=64,
    ...                     decode_seconds=0.5, ttft=[0.1, 0.3])
    >>> stats.prefill_tok_s, stats.decode_tok_s, round(stats.mean_ttft, 6)
    (2048.0, 128.0, 0.2)
    """

    steps: int = 0
    decode_rounds: int = 0
    num_compilations: int = 0
    compile_seconds: float = 0.0
    buckets: set = dataclasses.field(default_factory=set)  # step shape buckets used
    compiled_buckets: list = dataclasses.field(default_factory=list)  # ... that compiled
    bucket_compile_seconds: dict = dataclasses.field(default_factory=dict)  # bucket -> s
    prefill_host_seconds: float = 0.0
    prefill_wait_seconds: float = 0.0
    decode_host_seconds: float = 0.0
    decode_wait_seconds: float = 0.0
    decode_exposed_seconds: float = 0.0
    # under a mesh, per data shard: its requests' prompt tokens and cached tokens
    shard_prompt_tokens: list = dataclasses.field(default_factory=list)
    shard_cached_tokens: list = dataclasses.field(default_factory=list)

    @property
    def shard_hit_rates(self) -> list[float]:
        """Under a mesh, each data shard's ``hit_rate`` (empty without a mesh).

        >>> EngineStats(shard_prompt_tokens=[10, 0], shard_cached_tokens=[5, 0]).shard_hit_rates
        [0.5, 0.0]
        """
        return [c / p if p else 0.0
                for p, c in zip(self.shard_prompt_tokens, self.shard_cached_tokens, strict=True)]
