"""``python -m mlxcache.bench quant [--quick] [--json PATH] [--repeats N]``: quantized K/V
(``Engine(kv_bits=...)``) at full precision, 8 and 4 bits, under one memory budget and in
batched decode, against mlx-lm's own quantized generation.

The model is ``zoo.make("llama", head_dim=64)`` (hidden 64, 2 layers, 4 query heads, 2 KV
heads of 64 values, vocabulary 128, random weights) with groups of 64, in **float32**: MLX's
CPU ``quantized_matmul`` (the quantized attention's two matmuls) is about 50x slower in
float16 than in float32 (63 against 1.3 ms for the scores of 8 queries over 1,024 quantized
keys, 13x in bfloat16; MLX 0.32 on a 2-core x86 CPU), so a float16 run would time that
kernel alone. Full precision is
therefore 32 bits here (2,048 bytes per token slot): 8 bits take 0.28x of it and 4 bits
0.16x, where against float16 they would take 0.53x and 0.28x (``mlxcache.quant``).

(a) *Under one memory budget*: one KV pool size in bytes for every setting (2 MiB; ``SHARED``),
    so ``num_slots = budget // bytes_per_slot`` (a probe engine's ``pool.bytes_per_slot``):
    at full precision the pool holds a quarter of the workload's distinct prefix tokens, at 8
    bits 89% of them, at 4 bits all (``SHARED``). 8 distinct prefixes of 512 tokens are served
    round-robin, one request at a time, each prefix 3 times, each request the prefix and 16
    fresh tokens, one generated token (its time is the prefill's). Round-robin is LRU's worst
    case: the prefix evicted to make room is the one asked for next, so a pool short of the
    whole set gets no hit at all, however little it lacks (8 bits here). Reported:
    pool bytes per token, tokens the pool holds, tokens cached at the end
    (``engine.tree.total_size``), the hit rate (cached / prompt tokens, ``stats.hit_rate`` over
    the run), tokens evicted, the prefill time, and the speedup over the same engine (same
    bits) with ``prefix_cache=False``.
(b) *Decode tokens/s at B = 8*: mlxcache decodes 8 requests together; mlx-lm's
    ``generate_step(kv_bits=..., kv_group_size=64, quantized_kv_start=0)`` (its single-request
    quantized generation; ``kv_bits=None`` at full precision) runs them one after another.
    Each runs the same 256-token prompts to 4 and to 132 tokens and the rate is the extra
    tokens over the extra time, so prompt processing cancels.
(c) *Agreement*: mlxcache's greedy tokens of (b) against mlx-lm's, per request. Two mlx-lm
    references: ``generate_step(kv_bits=...)`` as timed, which prefills the prompt (all but its
    last token, in chunks of ``prefill_step_size``) with a full-precision ``KVCache`` and
    quantizes it afterwards; and ``generate_step`` given a ``prompt_cache`` of
    ``QuantizedKVCache(64, bits)``, quantized from token 0, as mlxcache stores K/V (a prefix's
    bytes must not depend on how it was chunked). The first differs from the second wherever
    quantizing the prompt's own attention changes a greedy token, which at 4 bits it mostly
    does; with ``prefill_step_size=1`` (every prompt token attends to quantized K/V but the
    first's to itself) ``generate_step(kv_bits=4)`` agrees with mlxcache on all 8 requests
    (68 tokens each, checked once by hand).

Every variant lives in one process. Each table runs one untimed round of every system
(warm-up), then ``--repeats`` rounds that visit every system in turn; times are medians over
the rounds and ratios the medians of the per-round ratios (paired). ``--quick`` shrinks the
workloads (half the prefixes, shorter prompts, three rounds) to a smoke run of about 12 s.

Example:
    $ python -m mlxcache.bench quant --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from mlxcache import zoo
from mlxcache.engine import Engine

__all__ = ["BITS", "GROUP", "format_quant_table", "main", "run"]

BITS: tuple[int | None, ...] = (None, 8, 4)
"""The settings measured: full precision (``kv_bits=None``), 8 and 4 bits."""
GROUP = 64
BATCH = 8
DESCRIPTION = ("llama hidden=64 layers=2 heads=4 kv_heads=2 head_dim=64 vocab=128 float32, "
               f"groups of {GROUP}")

# (prefixes, prefix tokens, suffix tokens, visits per prefix, budget bytes), full and quick.
# Full: 8 x 512 = 4,096 prefix tokens; 2 MiB hold 1,024 float32 slots (a quarter of them),
# 3,640 at 8 bits, 6,553 at 4 bits. Quick: 4 x 256 = 1,024; 640 KiB hold 320, 1,137, 2,048.
SHARED = {False: (8, 512, 16, 3, 2 << 20), True: (4, 256, 16, 2, 640 << 10)}
QUICK_REPEATS = 3  # fewer and one outlier decides a quick decode rate
# (prompt tokens, the two lengths) of the decode table, full and quick.
DECODE = {False: (256, 4, 132), True: (64, 4, 36)}


def make_quant_model():
    """The benchmark's model (``DESCRIPTION``)."""
    return zoo.make("llama", head_dim=64)


def label(bits: int | None) -> str:
    return "float32" if bits is None else f"{bits}-bit"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, zoo.VOCAB) for _ in range(n)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a[i] / b[i]``."""
    return _median([x / y for x, y in zip(a, b, strict=True)])


def _interleaved(systems: dict, repeats: int) -> dict:
    """One untimed round of every system, then ``repeats`` rounds visiting each in turn."""
    for run in systems.values():
        run()
    runs: dict = {name: [] for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            runs[name].append(run())
    return runs


# ---------------------------------------------------------------------- (a) the budget ----


def bytes_per_slot(model, bits: int | None) -> int:
    """Bytes of one KV pool slot at ``bits`` (a probe engine's pool).

    >>> model = make_quant_model()
    >>> [bytes_per_slot(model, bits) for bits in BITS]   # 2 layers x 2 heads x K and V
    [2048, 576, 320]
    """
    with Engine(model, num_slots=16, kv_bits=bits, kv_group_size=GROUP) as probe:
        return probe.core.store.pool.bytes_per_slot


def _serve_round_robin(engine: Engine, prompts: list[list[int]]) -> dict:
    """The prompts one at a time from an empty cache, one token each: the time and what the
    engine counted over the run."""
    engine.reset_cache()
    names = ("prompt_tokens", "cached_tokens", "token_evictions")
    before = {k: getattr(engine.stats, k) for k in names}
    tic = time.perf_counter()
    out = [engine.generate([p], max_tokens=1)[0] for p in prompts]
    took = time.perf_counter() - tic
    stats = {k: getattr(engine.stats, k) - v for k, v in before.items()}
    held = engine.tree.total_size if engine.tree is not None else 0
    return {"seconds": took, "tokens": out, "held": held, **stats}


def budget_table(model, quick: bool, repeats: int) -> dict:
    """(a): every setting's pool under one budget, the round-robin shared-prefix workload,
    with reuse and without, in interleaved rounds."""
    n_prefix, prefix_len, suffix_len, visits, budget = SHARED[quick]
    rng = random.Random(0)
    heads = [_tokens(rng, prefix_len) for _ in range(n_prefix)]
    prompts = [heads[i % n_prefix] + _tokens(rng, suffix_len)
               for i in range(n_prefix * visits)]
    per_slot = {b: bytes_per_slot(model, b) for b in BITS}
    engines = {b: (Engine(model, num_slots=budget // per_slot[b], kv_bits=b,
                          kv_group_size=GROUP),
                   Engine(model, prefix_cache=False, kv_bits=b, kv_group_size=GROUP))
               for b in BITS}
    systems: dict[tuple[int | None, bool], Callable[[], dict]] = {}
    for b, (reuse, plain) in engines.items():
        systems[b, True] = lambda e=reuse: _serve_round_robin(e, prompts)
        systems[b, False] = lambda e=plain: _serve_round_robin(e, prompts)
    runs = _interleaved(systems, repeats)
    rows = []
    for b, (reuse, plain) in engines.items():
        mine, base = runs[b, True], runs[b, False]
        last = mine[-1]
        rows.append({
            "bits": b, "label": label(b), "bytes_per_token": per_slot[b],
            "num_slots": reuse.num_slots, "pool_tokens": reuse.num_slots - 1,
            "pool_bytes": reuse.num_slots * per_slot[b],
            "cached_tokens_end": last["held"],
            "hit_rate": last["cached_tokens"] / last["prompt_tokens"],
            "evicted_tokens": last["token_evictions"],
            "prefill_s": _median([r["seconds"] for r in mine]),
            "no_reuse_prefill_s": _median([r["seconds"] for r in base]),
            "speedup": _paired([r["seconds"] for r in base], [r["seconds"] for r in mine]),
            "same_tokens_as_no_reuse": last["tokens"] == base[-1]["tokens"],
        })
        reuse.close()
        plain.close()
    full = rows[0]
    for row in rows:
        row["tokens_vs_full"] = row["num_slots"] / full["num_slots"]
        row["prefill_vs_full"] = _paired([r["seconds"] for r in runs[None, True]],
                                         [r["seconds"] for r in runs[row["bits"], True]])
    return {"prefixes": n_prefix, "prefix_tokens": prefix_len, "suffix_tokens": suffix_len,
            "requests": len(prompts), "budget_bytes": budget,
            "distinct_prefix_tokens": n_prefix * prefix_len,
            "prompt_tokens": sum(map(len, prompts)), "rows": rows}


# ------------------------------------------------------------------------- (b) decode ----


def mlx_lm_tokens(model, prompt: list[int], n: int, bits: int | None,
                  from_token_0: bool = False) -> list[int]:
    """mlx-lm's greedy ``n`` tokens of one request: ``generate_step(kv_bits=bits, ...,
    quantized_kv_start=0)``, or (``from_token_0``) given a ``QuantizedKVCache`` per layer."""
    if from_token_0:
        cache = [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.layers]
        steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
    else:
        steps = generate_step(mx.array(prompt), model, max_tokens=n, kv_bits=bits,
                              kv_group_size=GROUP, quantized_kv_start=0)
    return [token for token, _ in steps]


def _agree(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def decode_table(model, quick: bool, repeats: int) -> dict:
    """(b) and (c): decode rates at B = ``BATCH``, mlxcache batched against mlx-lm one
    request after another, every setting, interleaved; then the tokens compared."""
    prompt_len, short, long = DECODE[quick]
    rng = random.Random(1)
    prompts = [_tokens(rng, prompt_len) for _ in range(BATCH)]
    engines = {b: Engine(model, prefix_cache=False, kv_bits=b, kv_group_size=GROUP,
                         max_batch_size=BATCH) for b in BITS}
    outputs: dict = {}

    def timed(key: tuple, run: Callable[[int], list[list[int]]]) -> Callable[[], float]:
        def rate() -> float:  # extra tokens over extra time between the two lengths
            walls = []
            for n in (short, long):
                tic = time.perf_counter()
                outputs[key] = run(n)
                walls.append(time.perf_counter() - tic)
            return BATCH * (long - short) / max(walls[1] - walls[0], 1e-9)
        return rate

    systems = {}
    for b, engine in engines.items():
        systems["mlxcache", b] = timed(("mlxcache", b),
                                       lambda n, e=engine: e.generate(prompts, max_tokens=n))
        systems["mlx-lm", b] = timed(("mlx-lm", b), lambda n, b=b: [
            mlx_lm_tokens(model, p, n, b) for p in prompts])
    rates = _interleaved(systems, repeats)
    rows = []
    for b, engine in engines.items():
        ours, theirs = rates["mlxcache", b], rates["mlx-lm", b]
        exact = outputs["mlx-lm", b] if b is None else [
            mlx_lm_tokens(model, p, long, b, from_token_0=True) for p in prompts]
        rows.append({
            "bits": b, "label": label(b), "quantized": engine.quantized,
            "mlxcache_tok_s": _median(ours), "mlx_lm_tok_s": _median(theirs),
            "ratio": _paired(ours, theirs),
            "mlxcache_vs_full": _paired(ours, rates["mlxcache", None]),
            "mlx_lm_vs_full": _paired(theirs, rates["mlx-lm", None]),
            "requests": BATCH,
            "agree_kv_bits": _agree(outputs["mlxcache", b], outputs["mlx-lm", b]),
            "agree_from_token_0": _agree(outputs["mlxcache", b], exact),
        })
        engine.close()
    return {"batch": BATCH, "prompt_tokens": prompt_len, "short": short, "long": long,
            "rows": rows}


# --------------------------------------------------------------------------- the run ----


def run(quick: bool = False, repeats: int = 5) -> dict:
    """Both tables (``quick``: the small workloads, ``QUICK_REPEATS`` rounds)."""
    repeats = min(repeats, QUICK_REPEATS) if quick else repeats
    model = make_quant_model()
    return {"quick": quick, "repeats": repeats, "model": DESCRIPTION, "group_size": GROUP,
            "budget": budget_table(model, quick, repeats),
            "decode": decode_table(model, quick, repeats)}


def format_quant_table(r: dict) -> str:
    """Both tables, a line per setting."""
    a, d = r["budget"], r["decode"]
    n = r["repeats"]
    lines = [
        f"quantized K/V benchmark{' (--quick)' if r['quick'] else ''}: {r['model']}; "
        f"medians of {n} round{'s' * (n != 1)}",
        f"(a) one KV pool budget of {a['budget_bytes'] / 2**20:.2f} MiB; {a['prefixes']} "
        f"prefixes x {a['prefix_tokens']} tokens served round-robin, {a['requests']} requests "
        f"of prefix + {a['suffix_tokens']} tokens",
        f"  {'K/V':<9}{'B/token':>8}{'pool tokens':>12}{'x':>6}{'cached end':>11}{'hit rate':>9}"
        f"{'evicted':>9}{'prefill s':>10}{'vs full':>8}{'no reuse s':>11}{'speedup':>8}  same",
    ]
    for x in a["rows"]:
        lines.append(
            f"  {x['label']:<9}{x['bytes_per_token']:>8}{x['pool_tokens']:>12}"
            f"{x['tokens_vs_full']:>5.2f}x{x['cached_tokens_end']:>11}"
            f"{100 * x['hit_rate']:>8.1f}%{x['evicted_tokens']:>9}{x['prefill_s']:>10.3f}"
            f"{x['prefill_vs_full']:>7.2f}x{x['no_reuse_prefill_s']:>11.3f}{x['speedup']:>7.2f}x"
            f"  {x['same_tokens_as_no_reuse']}")
    lines += [
        "  x: pool tokens over full precision's; vs full: full precision's prefill time over "
        "this one's;\n  speedup: the same bits without reuse over with; same: the greedy "
        "tokens equal the no-reuse engine's",
        f"(b) decode tokens/s at B = {d['batch']}: {d['prompt_tokens']}-token prompts, "
        f"tokens {d['short']} to {d['long']}; mlx-lm: generate_step, one request after another",
        f"  {'K/V':<9}{'mlxcache':>10}{'vs full':>8}{'mlx-lm':>9}{'vs full':>8}{'ratio':>8}"
        f"{'agree kv_bits':>15}{'agree token 0':>15}",
    ]
    for x in d["rows"]:
        lines.append(
            f"  {x['label']:<9}{x['mlxcache_tok_s']:>10.0f}{x['mlxcache_vs_full']:>7.2f}x"
            f"{x['mlx_lm_tok_s']:>9.0f}{x['mlx_lm_vs_full']:>7.2f}x{x['ratio']:>7.2f}x"
            f"{x['agree_kv_bits']:>12}/{x['requests']}{x['agree_from_token_0']:>12}/"
            f"{x['requests']}")
    lines.append(
        "  ratio: mlxcache / mlx-lm, same bits; agree kv_bits: requests whose greedy tokens "
        "equal generate_step(kv_bits=...)'s\n  (prompt prefilled in full precision, then "
        "quantized); agree token 0: equal generate_step's with a QuantizedKVCache from token 0")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run, print the table (and write ``--json PATH``)."""
    p = argparse.ArgumentParser(prog="python -m mlxcache.bench quant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"smaller workloads, at most {QUICK_REPEATS} rounds")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be at least 1")
    result = run(args.quick, args.repeats)
    print(format_quant_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result
