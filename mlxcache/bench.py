"""Benchmark: prefix reuse, batched decode and pool writes on tiny random mlx-lm models.

``python -m mlxcache.bench [--json] [--quick]`` builds three float32 models from mlx-lm's own
classes (random weights, fixed seeds): a llama (plain ``KVCache``), a qwen3_next (hybrid:
gated-delta ``ArraysCache`` layers and a full-attention layer) and a gemma3_text (sliding
window ``RotatingKVCache`` layers of 128 tokens and a global layer), and, in one run, measures

(a) *shared prefix* (every model): 16 requests = one 512-token prefix + 16 unique tokens each;
(b) *branching* (llama): one system prompt, three few-shot blocks, a unique question each;
(m) *multi-turn* (every model): 8 conversations x 4 turns, each turn the previous prompt, its
    16-token greedy answer and a 32-token message;
    for each, prefill throughput (all prompt tokens / prefill time, the time from each turn's
    start to its last first token) and mean TTFT for mlxcache, the same engine with reuse off
    (the base of every speedup), and mlx-lm's ``LRUPromptCache`` driven as ``mlx_lm.server``
    drives it (fetch nearest, prefill the rest, insert prompt + answer; its clock runs only
    while it prefills); for models whose caches mlx-lm cannot trim (``ArraysCache``, a
    ``RotatingKVCache`` past its window) also the server's system-segment checkpoint (the
    cache inserted at the end of the shared prefix, as ``mlx_lm.server`` does at the end of
    a chat template's system segment). Beside each speedup, two ideals: the token ratio
    (prompt tokens / uncached tokens) and the measured one (no-reuse prefill time of the whole
    prompts over that of only their uncached parts, batched as mlxcache batches them);
(c) *batched decode* tokens/s against mlx-lm's ``BatchGenerator``: llama at B = 1, 8, 32,
    qwen3_next and gemma3_text at B = 8; each system runs the same prompts to two lengths,
    and the rate is the extra tokens over the extra wall time, so prompt processing and
    start-up cancel out;
(d) the cost of one ``set_kv`` writing 16 tokens into pools of 16k and 256k slots, used
    linearly (must not grow with the pool) and, for contrast, with the old pool still held.

Every system sees the same model, weights and prompts, in one process. Each table runs one
untimed round of every system (warm-up), then ``REPEATS`` rounds that visit every system in
turn, so a busy spell on a shared machine slows all of them alike; times are medians over the
rounds and ratios are medians of the per-round ratios (paired). ``--quick`` shrinks the
workloads for a smoke run.

Example:
    $ python -m mlxcache.bench --quick
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache

from mlxcache import zoo
from mlxcache.engine import Engine
from mlxcache.pool import init_pool, set_kv
from mlxcache.zoo import make_model  # the llama

VOCAB = 1000  # every model's vocabulary, make_model's included
REPEATS = 5
WINDOW = 128
"""gemma3_text's sliding window: shorter than the 512-token shared prefix."""


def make_hybrid(seed: int = 0):
    """qwen3_next, hidden 128, 4 layers (3 gated delta + 1 full attention), MoE, f32."""
    return zoo.make(
        "qwen3_next", seed, hidden_size=128, num_hidden_layers=4, full_attention_interval=4,
        intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
        shared_expert_intermediate_size=128, moe_intermediate_size=64, vocab_size=VOCAB,
    )


def make_sliding(seed: int = 0):
    """gemma3_text, hidden 128, 4 layers (3 sliding of ``WINDOW`` tokens + 1 global), f32."""
    return zoo.make(
        "gemma3_text", seed, hidden_size=128, num_hidden_layers=4, sliding_window_pattern=4,
        sliding_window=WINDOW, intermediate_size=256, head_dim=32, query_pre_attn_scalar=32,
        vocab_size=VOCAB,
    )


MODELS: dict[str, tuple[Callable[[], object], str]] = {
    "llama": (make_model, "llama hidden=128 layers=2 heads=4 kv_heads=2 vocab=1000 float32"),
    "qwen3_next": (make_hybrid, "qwen3_next hidden=128 layers=4 (3 gated delta + 1 attention) "
                                "MoE 4 experts vocab=1000 float32"),
    "gemma3_text": (make_sliding, f"gemma3_text hidden=128 layers=4 (3 sliding window={WINDOW} "
                                  f"+ 1 global) vocab=1000 float32"),
}


# ---------------------------------------------------------------------------- workloads ----


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def shared_prefix(rng: random.Random, n_req: int, prefix: int, unique: int) -> list[list[int]]:
    head = _tokens(rng, prefix)
    return [head + _tokens(rng, unique) for _ in range(n_req)]


def branching(
    rng: random.Random, n_req: int, system: int, shots: int, shot_len: int, question: int
) -> list[list[int]]:
    sys_prompt = _tokens(rng, system)
    blocks = [_tokens(rng, shot_len) for _ in range(shots)]
    return [sys_prompt + blocks[i % shots] + _tokens(rng, question) for i in range(n_req)]


def multi_turn(
    rng: random.Random, engine: Engine, n_conv: int, turns: int, first: int, msg: int, new: int
) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """``(rounds, uncached)``: turn 0 opens each conversation with ``first`` tokens; turn k is
    the turn k-1 prompt + its ``new``-token greedy answer (from ``engine``, without reuse) +
    a ``msg``-token message. ``uncached`` is what a prefix cache cannot supply: turn 0 whole,
    then the answer's last token (it never ran) and the message."""
    rounds = [[_tokens(rng, first) for _ in range(n_conv)]]
    uncached = [rounds[0]]
    for _ in range(1, turns):
        answers = engine.generate(rounds[-1], max_tokens=new)
        msgs = [_tokens(rng, msg) for _ in range(n_conv)]
        rounds.append([p + a + m for p, a, m in zip(rounds[-1], answers, msgs, strict=True)])
        uncached.append([a[-1:] + m for a, m in zip(answers, msgs, strict=True)])
    return rounds, uncached


def unique_tokens(prompts: list[list[int]]) -> int:
    """Distinct prefixes over all prompts: what an ideal prefix cache computes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


# ------------------------------------------------------------------------------ systems ----


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
        prompts = [_tokens(rng, prompt_len) for _ in range(b)]

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


TITLES = {
    "shared_prefix": "(a) shared prefix",
    "branching": "(b) branching",
    "multi_turn": "(m) multi-turn",
}


def format_table(r: dict) -> str:
    lines = []
    for m in r["models"].values():
        snaps = (f"; {m['num_snapshots']} snapshot slots x {m['snapshot_bytes']} B"
                 if m["num_snapshots"] else "")
        lines.append(f"model: {m['model']}; caches {', '.join(m['caches'])}{snaps}")
        for key, title in TITLES.items():
            if key not in m:
                continue
            t = m[key]
            measured = (f", measured ideal {t['measured_ideal']:.2f}x"
                        if "measured_ideal" in t else "")
            lines.append(
                f"{title}: {t['prompt_tokens']} prompt tokens, {t['uncached_tokens']} uncached, "
                f"ideal speedup {t['ideal_speedup']:.2f}x{measured}; same tokens as no reuse: "
                f"{'yes' if t['same_tokens'] else 'NO'}"
                + ("" if t["lru_trims"] else "; mlx-lm cannot trim these caches")
            )
            lines.append(
                f"  {'system':<26}{'prefill tok/s':>14}{'mean TTFT ms':>14}{'speedup':>9}"
                f"{'of ideal':>10}{'of measured':>13}"
            )
            for s in t["systems"]:
                of_measured = (f"{s['of_measured_ideal']:>12.0%}" if "of_measured_ideal" in s
                               else f"{'-':>12}")
                lines.append(
                    f"  {s['system']:<26}{s['tokens_per_s']:>14.0f}{s['ttft_s'] * 1e3:>14.1f}"
                    f"{s['speedup']:>8.2f}x{s['of_ideal']:>9.0%} {of_measured}"
                )
            hits = []
            for s in t["systems"]:
                st = s.get("stats")
                if st and s["system"] != "no reuse":
                    hit = f"{s['system']} {st['cached_tokens'] / st['prompt_tokens']:.0%}"
                    if "snapshots_taken" in st and m["num_snapshots"]:
                        hit += (f" ({st['snapshots_taken']} snapshots taken, "
                                f"{st['state_evictions']} evicted)")
                    hits.append(hit)
            lines.append(f"  tokens reused: {', '.join(hits)}")
    lines.append("(c) batched decode tokens/s")
    lines.append(f"  {'model':<12}{'B':>4}{'mlxcache':>12}{'BatchGenerator':>16}{'ratio':>8}")
    for name, rows in r["decode"].items():
        for d in rows:
            lines.append(
                f"  {name:<12}{d['batch']:>4}{d['mlxcache_tok_s']:>12.0f}"
                f"{d['batch_generator_tok_s']:>16.0f}{d['ratio']:>7.2f}x"
            )
    lines.append("(d) one set_kv, 16 tokens, one layer")
    lines.append(f"  {'pool slots':>10}{'linear us':>12}{'old pool held us':>18}")
    for s in r["set_kv"]:
        lines.append(f"  {s['slots']:>10}{s['linear_us']:>12.1f}{s['held_us']:>18.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
