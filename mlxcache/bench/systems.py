"""The systems measured: ``Engine`` served one round at a time, and mlx-lm's
``LRUPromptCache`` driven as ``mlx_lm.server`` drives it."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from mlxcache.engine import Engine


@dataclass
class Served:
    """One system's run of a workload: ``prefill_s`` sums, over the rounds (turns), the time
    from the round's start to its last first token; ``ttft_s`` is the mean over requests of
    the time from their round's start to their first token."""

    prefill_s: float
    ttft_s: float
    outputs: list[list[list[int]]]
    stats: dict | None = None


def serve_engine(engine: Engine, rounds: list[list[list[int]]], new: int) -> Served:
    """Each round one ``stream`` of its prompts, ``new`` tokens each, from an empty cache."""
    engine.reset_cache()
    before = {k: getattr(engine.stats, k) for k in
              ("prompt_tokens", "cached_tokens", "snapshots_taken", "state_evictions")}
    prefill, ttfts, outputs = 0.0, [], []
    for prompts in rounds:
        first: dict[int, float] = {}
        out: list[list[int]] = [[] for _ in prompts]
        tic = time.perf_counter()
        for i, token in engine.stream(prompts, max_tokens=new):
            if i not in first:
                first[i] = time.perf_counter() - tic
            out[i].append(token)
        prefill += max(first.values())
        ttfts += first.values()
        outputs.append(out)
    stats = {k: getattr(engine.stats, k) - v for k, v in before.items()}
    return Served(prefill, sum(ttfts) / len(ttfts), outputs, stats)


def serve_lru(model, rounds: list[list[list[int]]], new: int, segment: int = 0) -> Served:
    """mlx-lm's prompt cache as its server uses it: nearest cache, prefill the rest, decode,
    insert prompt + answer (the tokens that ran). The clock runs only while a request
    prefills, as if its decode ran elsewhere: TTFT and prefill time are prefill alone.

    The prefill is ``generate_step``'s (all but the last token with only the caches evaluated,
    then the last token). With ``segment``, a prompt longer than it also inserts its cache at
    ``segment`` tokens (a copy, as the server's ``extract_cache`` at a segment's end).
    """
    lru = LRUPromptCache()
    prefill, ttfts, outputs = 0.0, [], []
    stats = {"prompt_tokens": 0, "cached_tokens": 0}
    for prompts in rounds:
        clock = 0.0
        out = []
        for prompt in prompts:
            tic = time.perf_counter()
            cache, rest = lru.fetch_nearest_cache("model", prompt)
            if cache is None:
                cache = make_prompt_cache(model)
            done = len(prompt) - len(rest)
            stats["prompt_tokens"] += len(prompt)
            stats["cached_tokens"] += done
            if done < segment < len(prompt) - 1:
                model(mx.array(prompt[done:segment])[None], cache=cache)
                mx.eval([c.state for c in cache])
                lru.insert_cache("model", prompt[:segment], copy.deepcopy(cache),
                                 cache_type="system")
                rest = prompt[segment:]
            if len(rest) > 1:  # as generate_step: all but the last token, caches only
                model(mx.array(rest[:-1])[None], cache=cache)
                mx.eval([c.state for c in cache])
            token = mx.argmax(model(mx.array(rest[-1:])[None], cache=cache)[0, -1])
            answer = [token.item()]
            clock += time.perf_counter() - tic
            ttfts.append(clock)
            for _ in range(new - 1):  # decode, off the clock
                token = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
                answer.append(token.item())
            lru.insert_cache("model", prompt + answer[:-1], cache)
            out.append(answer)
        prefill += clock
        outputs.append(out)
    return Served(prefill, sum(ttfts) / len(ttfts), outputs, stats)
