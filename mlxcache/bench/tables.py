"""The measurements: prefill tables (paired, interleaved rounds), batched decode rates, the
cost of one ``set_kv``; ``run`` makes them all."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from mlxcache import zoo
from mlxcache.bench.systems import Served, serve_engine, serve_lru
from mlxcache.bench.workloads import (
    MODELS,
    REPEATS,
    branching,
    make_hybrid,
    make_sliding,
    multi_turn,
    random_tokens,
    shared_prefix,
    unique_tokens,
)
from mlxcache.engine import Engine
from mlxcache.pool import init_pool, set_kv
from mlxcache.zoo import make_model  # the llama


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _interleaved(systems: dict[str, Callable[[], Served]], repeats: int
                 ) -> dict[str, list[Served]]:
    """One untimed round of every system, then ``repeats`` rounds visiting each in turn."""
    for run in systems.values():
        run()
    runs: dict[str, list[Served]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            runs[name].append(run())
    return runs


def prefill_table(model, reuse: Engine, plain: Engine, rounds: list[list[list[int]]],
                  new: int = 1, uncached: list[list[list[int]]] | None = None,
                  segment: int = 0, repeats: int = REPEATS) -> dict:
    """Every system on ``rounds`` (each round one batch of concurrent requests), in
    interleaved rounds; speedups over ``plain`` (no reuse) as paired medians.

    ``uncached``: the parts of the prompts a prefix cache cannot supply, served by ``plain``
    for the measured ideal. ``segment``: also run the LRU with a system-segment checkpoint
    there (only where mlx-lm cannot trim the model's caches).
    """
    cache = make_prompt_cache(model)  # trimmable after a prompt? (a window may have rolled)
    mx.eval(model(mx.array(rounds[0][0])[None], cache=cache))
    trimmable = can_trim_prompt_cache(cache)
    systems: dict[str, Callable[[], Served]] = {
        "mlxcache": lambda: serve_engine(reuse, rounds, new),
        "no reuse": lambda: serve_engine(plain, rounds, new),
        "mlx-lm LRUPromptCache": lambda: serve_lru(model, rounds, new),
    }
    if segment and not trimmable:
        systems["LRUPromptCache + segment"] = lambda: serve_lru(model, rounds, new, segment)
    if uncached is not None:
        systems["uncached parts"] = lambda: serve_engine(plain, uncached, new)
    runs = _interleaved(systems, repeats)
    base = [r.prefill_s for r in runs["no reuse"]]
    prompts = [p for r in rounds for p in r]
    total = sum(map(len, prompts))
    computed = (sum(len(p) for r in uncached for p in r) if uncached is not None
                else unique_tokens(prompts))
    out: dict = {
        "prompt_tokens": total,
        "uncached_tokens": computed,
        "ideal_speedup": total / computed,
        "lru_trims": trimmable,
        "same_tokens": runs["mlxcache"][0].outputs == runs["no reuse"][0].outputs,
    }
    if uncached is not None:
        ideal = [b / u.prefill_s for b, u in zip(base, runs["uncached parts"], strict=True)]
        out["measured_ideal"] = _median(ideal)
    rows = []
    for name, served in runs.items():
        if name == "uncached parts":
            continue
        row = {
            "system": name,
            "prefill_s": _median([s.prefill_s for s in served]),
            "ttft_s": _median([s.ttft_s for s in served]),
            "speedup": _median([b / s.prefill_s for b, s in zip(base, served, strict=True)]),
        }
        row["tokens_per_s"] = total / row["prefill_s"]
        row["of_ideal"] = row["speedup"] / out["ideal_speedup"]
        if uncached is not None:  # paired: the uncached parts' time over this system's
            row["of_measured_ideal"] = _median([
                u.prefill_s / s.prefill_s
                for u, s in zip(runs["uncached parts"], served, strict=True)])
        if served[-1].stats is not None:
            row["stats"] = served[-1].stats
        rows.append(row)
    out["systems"] = rows
    return out


# ------------------------------------------------------------------------------- decode ----


def _wall(run: Callable[[int], None], n: int) -> float:
    tic = time.perf_counter()
    run(n)
    return time.perf_counter() - tic


def decode_rates(systems: list[Callable[[int], None]], short: int, long: int, batch: int,
                 repeats: int = REPEATS) -> tuple[list[float], list[float]]:
    """Tokens/s of decode alone per system (extra tokens over extra wall time between two
    lengths), the median over ``repeats`` interleaved rounds; and each system's rate over the
    first's, the median of the per-round ratios."""
    for run in systems:
        run(short)  # warm-up
    rates: list[list[float]] = [[] for _ in systems]
    for _ in range(repeats):
        for i, run in enumerate(systems):
            walls = [_wall(run, n) for n in (short, long)]
            rates[i].append(batch * (long - short) / max(walls[1] - walls[0], 1e-9))
    ratios = [_median([a / b for a, b in zip(rates[0], r, strict=True)]) for r in rates]
    return [_median(r) for r in rates], ratios


def decode_table(model, sizes: list[int], prompt_len: int, short: int, long: int) -> list[dict]:
    rng = random.Random(1)
    engine = Engine(model, prefix_cache=False)
    rows = []
    for b in sizes:
        prompts = [random_tokens(rng, prompt_len) for _ in range(b)]

        def ours(n: int, prompts=prompts) -> None:
            engine.generate(prompts, max_tokens=n)

        def theirs(n: int, prompts=prompts, b=b) -> None:
            gen = BatchGenerator(model, max_tokens=n, completion_batch_size=b)
            gen.insert(prompts, max_tokens=[n] * b)
            done = 0
            while done < b:
                done += sum(r.finish_reason is not None for r in gen.next_generated())
            gen.close()

        (mine, generator), (_, ratio) = decode_rates([ours, theirs], short, long, b)
        rows.append({"batch": b, "mlxcache_tok_s": mine, "batch_generator_tok_s": generator,
                     "ratio": ratio})
    return rows


# ------------------------------------------------------------------------------- set_kv ----


def set_kv_cost(sizes: list[int], repeats: int = 50) -> list[dict]:
    rows = []
    k = mx.ones((16, 2, 64), mx.float16)
    for n in sizes:
        pool = init_pool(num_layers=2, num_slots=n, n_kv_heads=2, head_dim=64)
        mx.eval(pool)
        slots = mx.arange(1, 17, dtype=mx.int32)
        for _ in range(3):
            pool = set_kv(pool, 0, slots, k, k)
            mx.eval(pool)
        tic = time.perf_counter()
        for _ in range(repeats):
            pool = set_kv(pool, 0, slots, k, k)
            mx.eval(pool)
        linear = (time.perf_counter() - tic) / repeats
        held = []
        tic = time.perf_counter()
        for _ in range(5):
            new = set_kv(pool, 0, slots, k, k)
            mx.eval(new)
            held.append(new)  # the old pool stays alive: the write must copy
        copied = (time.perf_counter() - tic) / 5
        rows.append({"slots": n, "linear_us": linear * 1e6, "held_us": copied * 1e6})
        del pool, held, new
    return rows


# --------------------------------------------------------------------------------- main ----


def model_tables(name: str, quick: bool) -> dict:
    """Shared prefix and multi-turn (and, for llama, branching) on one model."""
    build, description = MODELS[name]
    model = build()
    kinds = zoo.cache_kinds(model)
    scale = 4 if quick else 1
    repeats = 2 if quick else REPEATS
    reuse = Engine(model, num_slots=1 << 14, num_snapshots=256, snapshot_interval=256 // scale)
    plain = Engine(model, prefix_cache=False)
    rng = random.Random(0)
    n_req, prefix = 16 // scale, 512 // scale
    prompts = shared_prefix(rng, n_req, prefix, 16)
    # What a prefix cache cannot supply, batched as mlxcache batches the prompts: the first
    # alone, then the others' unique tokens together.
    parts = [[prompts[0]], [p[prefix:] for p in prompts[1:]]]
    out = {
        "model": description,
        "caches": list(kinds),
        "num_snapshots": reuse.num_snapshots,
        "snapshot_bytes": reuse.snapshot_bytes,
        "cache_bytes": reuse.cache_bytes,
        "shared_prefix": prefill_table(model, reuse, plain, [prompts], 1, parts, prefix,
                                       repeats),
    }
    if name == "llama":
        b_args = (24 // scale, 256 // scale, 3, 128 // scale, 32)
        out["branching"] = prefill_table(model, reuse, plain, [branching(rng, *b_args)],
                                         repeats=repeats)
    new = 16
    rounds, uncached = multi_turn(rng, plain, 8 // (2 if quick else 1), 2 if quick else 4,
                                  256 // scale, 32, new)
    out["multi_turn"] = prefill_table(model, reuse, plain, rounds, new, uncached,
                                      repeats=repeats)
    return out


def run(quick: bool) -> dict:
    out: dict = {"models": {name: model_tables(name, quick) for name in MODELS}}
    long = 20 if quick else 52
    out["decode"] = {
        "llama": decode_table(make_model(), [1, 8] if quick else [1, 8, 32], 32, 4, long),
        "qwen3_next": decode_table(make_hybrid(), [8], 32, 4, long),
        "gemma3_text": decode_table(make_sliding(), [8], 32, 4, long),
    }
    out["set_kv"] = set_kv_cost([1 << 14, 1 << 18])
    return out
