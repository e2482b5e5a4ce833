"""``python -m hybridattn.bench prefix``: the hybrid prefix cache on a shared-prefix and a
multi-turn workload, with and without it, beside two ideals (see :mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import jax
import numpy as np

from hybridattn.bench.common import machine
from hybridattn.demo import demo_config
from hybridattn.engine import Engine
from hybridattn.mesh import make_mesh
from hybridattn.models import kimi_linear as M
from servecore.progress import progress_bar


def _prefix_engine(config, params, cache: bool, ctx: int, mesh=None):
    """16 rows and 16 contexts of token slots (under a mesh of ``D`` data shards, each shard
    ``16 / D`` of them, its own sink and its share of the snapshots)."""
    R, D = 16, 1 if mesh is None else mesh.shape["data"]
    r = R // D
    return Engine(config, params, max_running_requests=R, max_context_len=ctx,
                  num_token_slots=D * (r * ctx + 1), chunked_prefill_size=256, chunk_size=64,
                  prefix_cache=cache, request_buckets=tuple(sorted({1, min(4, r), r})),
                  token_buckets=(64, 256 + r), kv_buckets=(ctx,), mesh=mesh,
                  **(dict(snapshot_interval=256, num_snapshot_slots=D * (128 // D + 1))
                     if cache else {}))  # (the snapshot options do nothing without a cache)


def _serve_rounds(engine, rounds: list[list[list[int]]], new_tokens: int) -> dict:
    """Serve each round's prompts together (the next round after the last finished); the
    prefill seconds, mean TTFT and the outputs (which the next round's prompts may use)."""
    engine.reset_stats()
    outs = []
    for prompts in rounds:
        outs.append(engine.generate(prompts, new_tokens))
    s = engine.stats
    return dict(prefill_s=s.prefill_seconds, ttft_s=s.mean_ttft, prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens, snapshots=s.snapshots_taken, outputs=outs,
                compiled=len(s.compiled_buckets))


def _conversations(rng, n: int, turns: int, vocab: int, first: int, msg: int,
                   answers: list[list[list[int]]] | None):
    """Each turn's prompts: turn 0 a ``first``-token opening; turn k the turn k-1 prompt + its
    answer + a ``msg``-token message (answers from a run that served the earlier turns)."""
    opens = [rng.integers(1, vocab, first).tolist() for _ in range(n)]
    msgs = [[rng.integers(1, vocab, msg).tolist() for _ in range(n)] for _ in range(turns)]
    rounds = [opens]
    for k in range(1, turns):
        if answers is None:
            break
        rounds.append([p + a + m for p, a, m in zip(rounds[-1], answers[k - 1], msgs[k],
                                                     strict=True)])
    return rounds


def bench_prefix(quick: bool = False, repeats: int = 3, progress: bool = False,
                 mesh: tuple[int, int] | None = None) -> dict:
    """The prefix-cache workloads (see :mod:`hybridattn.bench.cli`): per workload, the engine with
    and without the cache and the uncached parts served cold, timed in interleaved rounds.
    ``progress``: a bar of the workloads done. ``mesh``: ``(data, tensor)``, every engine on
    that mesh (the JAX CPU devices must be there: ``--mesh`` sets them)."""
    config = demo_config()
    params = M.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, config.vocab_size, 1024).tolist()
    shared = [[prefix + rng.integers(1, config.vocab_size, 32).tolist() for _ in range(16)]]
    # (a) what must be computed: the first prompt whole, then each one's 32 unique tokens
    shared_uncached = [[shared[0][0]] + [p[1024:] for p in shared[0][1:]]]
    res: dict = dict(machine=machine(), config=config.to_dict(), workloads={},
                     mesh=list(mesh) if mesh else None)
    grid = None if mesh is None else make_mesh(*mesh)
    repeats = 1 if quick else repeats
    ctx_a, ctx_b = 1088, 512
    engines = {name: _prefix_engine(config, params, cache, ctx, grid)
               for name, cache, ctx in (("a_cache", True, ctx_a), ("a_cold", False, ctx_a),
                                        ("b_cache", True, ctx_b), ("b_cold", False, ctx_b))}
    # (b) the conversations' prompts depend on the answers: take them from a cold run
    turns, new = 4, 32
    conv_rng = np.random.default_rng(1)
    first_run = _serve_rounds(engines["b_cold"], _conversations(
        np.random.default_rng(1), 8, turns, config.vocab_size, 230, 30, None), new)
    answers = list(first_run["outputs"])
    for k in range(1, turns):  # grow the conversation turn by turn (greedy: deterministic)
        rounds = _conversations(np.random.default_rng(1), 8, k + 1, config.vocab_size, 230, 30,
                                answers)
        answers.append(engines["b_cold"].generate(rounds[-1], new))
    convs = _conversations(conv_rng, 8, turns, config.vocab_size, 230, 30, answers)
    conv_uncached = [convs[0]] + [
        [p[len(q) + len(a) - 1:] for p, q, a in zip(convs[k], convs[k - 1], answers[k - 1],
                                                     strict=True)]
        for k in range(1, turns)]
    work = {
        "a": dict(rounds=shared, uncached=shared_uncached, new_tokens=1, ctx=ctx_a),
        "b": dict(rounds=convs, uncached=conv_uncached, new_tokens=new, ctx=ctx_b),
    }
    for key, w in progress_bar(work.items(), desc="bench prefix", unit="workload",
                               total=len(work), enabled=progress, leave=False):
        cache, cold = engines[f"{key}_cache"], engines[f"{key}_cold"]
        runs = {
            "cache": lambda w=w, e=cache: (e.reset_cache(), _serve_rounds(e, w["rounds"],
                                                                          w["new_tokens"]))[1],
            "cold": lambda w=w, e=cold: _serve_rounds(e, w["rounds"], w["new_tokens"]),
            "uncached_parts": lambda w=w, e=cold: _serve_rounds(e, w["uncached"],
                                                                w["new_tokens"]),
        }
        for fn in runs.values():  # warm-up: compile every bucket the workload meets
            fn()
        got: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                got[name].append(fn())
        med = {name: dict(prefill_s=float(np.median([g["prefill_s"] for g in gs])),
                          ttft_s=float(np.median([g["ttft_s"] for g in gs])),
                          prompt_tokens=gs[0]["prompt_tokens"],
                          cached_tokens=gs[0]["cached_tokens"], snapshots=gs[0]["snapshots"])
               for name, gs in got.items()}
        same = got["cache"][0]["outputs"] == got["cold"][0]["outputs"]
        computed = sum(len(p) for r in w["uncached"] for p in r)
        prompt_tokens = med["cold"]["prompt_tokens"]
        speedup = med["cold"]["prefill_s"] / med["cache"]["prefill_s"]
        ideal = med["cold"]["prefill_s"] / med["uncached_parts"]["prefill_s"]
        res["workloads"][key] = dict(
            with_cache=med["cache"], without_cache=med["cold"],
            uncached_parts=med["uncached_parts"], same_tokens=same,
            effective_prefill_tok_s=dict(
                with_cache=prompt_tokens / med["cache"]["prefill_s"],
                without_cache=prompt_tokens / med["cold"]["prefill_s"]),
            speedup=speedup, token_ratio_ideal=prompt_tokens / computed,
            measured_ideal=ideal, share_of_measured_ideal=speedup / ideal,
            hit_rate=med["cache"]["cached_tokens"] / max(prompt_tokens, 1))
    return res


def print_prefix(res: dict) -> None:
    cfg = res["config"]
    mesh = res.get("mesh")
    print(f"prefix: Kimi-Linear {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"f32; snapshot grid 256 tokens"
          + (f"; a {mesh[0]}x{mesh[1]} mesh (a prefix cache per data shard)" if mesh else ""))
    names = {"a": "(a) 16 x (1024 shared + 32)", "b": "(b) 8 conversations x 4 turns"}
    print(f"{'workload':<30} | {'TTFT cold':>9} | {'TTFT hit':>8} | {'eff. tok/s cold':>15} | "
          f"{'eff. tok/s hit':>14} | {'speedup':>7} | {'token ideal':>11} | "
          f"{'measured ideal':>14} | {'of ideal':>8} | hit rate | same tokens")
    for key, w in res["workloads"].items():
        e = w["effective_prefill_tok_s"]
        print(f"{names[key]:<30} | {w['without_cache']['ttft_s'] * 1e3:7.0f}ms | "
              f"{w['with_cache']['ttft_s'] * 1e3:6.0f}ms | {e['without_cache']:15.0f} | "
              f"{e['with_cache']:14.0f} | {w['speedup']:6.2f}x | {w['token_ratio_ideal']:10.2f}x | "
              f"{w['measured_ideal']:13.2f}x | {w['share_of_measured_ideal']:7.0%} | "
              f"{w['hit_rate']:7.0%} | {'yes' if w['same_tokens'] else 'NO'}")
