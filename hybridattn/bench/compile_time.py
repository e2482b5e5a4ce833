"""``bench serve``'s compile-time rows: the step's trace, lower and XLA compile against the
layer count (unrolled and scanned), and against another checkout's step, each in a fresh
process (``--compile-baseline``; see :mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax

import hybridattn
from hybridattn.backends import ForwardMode
from hybridattn.bench.common import median
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.engine.buckets import bucket
from hybridattn.models import kimi_linear as M
from hybridattn.serving import WorkItem, make_worker_batch

COMPILE_LAYERS = (4, 12, 27)
"""Layer counts of ``bench serve``'s compile-time rows (``--quick``: 4 and 12)."""


def compile_vs_layers(layers) -> list[dict]:
    """For each layer count ``n``, ``KimiLinearConfig.tiny(num_hidden_layers=n)`` (the
    released 3 KDA : 1 MLA pattern): seconds to trace, lower and XLA-compile the engine's
    step for its smallest prefill bucket and its decode bucket (those ``Engine.warmup``
    compiles: one request, one token), with every layer unrolled (``scan_layers=False``,
    the step before layer scans) and with the repeated layers scanned (the default)."""
    rows = []
    for n in layers:
        cfg = KimiLinearConfig.tiny(num_hidden_layers=n)
        params = M.init_params(cfg, jax.random.key(0))
        start, period, reps = M.layer_plan(cfg)
        row: dict = dict(layers=n, kda_layers=cfg.num_kda_layers,
                         mla_layers=len(cfg.full_attention_layer_ids),
                         plan=[start, period, reps], group_plan=list(M.group_plan(cfg)),
                         folded_layers=M.folded_layers(cfg),
                         compiled_layers=M.compiled_layers(cfg))
        for variant, scan in (("unrolled", False), ("scanned", True)):
            e = Engine(cfg, params, max_running_requests=1, max_context_len=64,
                       num_token_slots=65, prefix_cache=False, scan_layers=scan)
            W = bucket(1, e.kv_buckets, "width")
            T = bucket(1, e.token_buckets, "tokens")
            v: dict = {}
            for kind, mode, first, tokens, Q in (("prefill", ForwardMode.EXTEND, 0, T, T),
                                                 ("decode", ForwardMode.DECODE, 1, 1, 1)):
                batch = make_worker_batch(
                    [WorkItem(1, first, [1], slots=[1])], vocab_size=cfg.vocab_size,
                    max_context_len=e.max_context_len, forward_mode=mode, num_requests=1,
                    num_tokens=tokens, kv_width=W, max_extend_len=Q,
                    snapshot_chunk=e.scheduler.chunk_size)
                t0 = time.perf_counter()
                traced = e.core.runner.jit.step.trace(e.params, e.state, batch)
                t1 = time.perf_counter()
                lowered = traced.lower()
                t2 = time.perf_counter()
                lowered.compile()
                t3 = time.perf_counter()
                v[kind] = dict(bucket=[1, tokens, W, Q], trace_s=t1 - t0, lower_s=t2 - t1,
                               compile_s=t3 - t2, s=t3 - t0)
            v["total_s"] = v["prefill"]["s"] + v["decode"]["s"]
            v["s_per_layer"] = v["total_s"] / n
            # what one more layer costs (the rest of the total does not grow with the layers)
            prev = rows[-1][variant] if rows else None
            v["added_s_per_layer"] = (None if prev is None or rows[-1]["layers"] == n else
                                      (v["total_s"] - prev["total_s"]) / (n - rows[-1]["layers"]))
            row[variant] = v
            del e
        row["scanned_over_unrolled"] = row["scanned"]["total_s"] / row["unrolled"]["total_s"]
        rows.append(row)
    return rows


_COMPILE_STEP = r"""
import json, sys, time
import jax
from hybridattn import engine as E
try:
    from hybridattn.backends import ForwardMode
except ImportError:  # a checkout before the backends package (2026-12-04)
    from hybridattn.backend import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M
try:
    from hybridattn.engine.buckets import bucket
except ImportError:  # a checkout before the engine package (2026-12-04)
    from hybridattn.scheduler import bucket
from hybridattn.serving import WorkItem, make_worker_batch

cfg = KimiLinearConfig.tiny(num_hidden_layers=int(sys.argv[1]))
e = E.Engine(cfg, M.init_params(cfg, jax.random.key(0)), max_running_requests=1,
             max_context_len=64, num_token_slots=65, prefix_cache=False)
step = (e.core.runner.jit.step if hasattr(e, "core")  # the engine package (2026-12-04)
        else e._jit.step if hasattr(e, "_jit") else E._step)  # module-level before 2026-12-02
W, T = bucket(1, e.kv_buckets, "width"), bucket(1, e.token_buckets, "tokens")
out = {}
for kind, mode, first, n, Q in (("prefill", ForwardMode.EXTEND, 0, T, T),
                                ("decode", ForwardMode.DECODE, 1, 1, 1)):
    batch = make_worker_batch(
        [WorkItem(1, first, [1])], vocab_size=cfg.vocab_size, max_context_len=e.max_context_len,
        forward_mode=mode, num_requests=1, num_tokens=n, kv_width=W, max_extend_len=Q,
        snapshot_chunk=e.scheduler.chunk_size)
    t0 = time.perf_counter()
    step.trace(e.params, e.state, batch).lower().compile()
    out[kind] = time.perf_counter() - t0
print(json.dumps(out))
"""
"""What ``--compile-baseline`` runs in a fresh process on either checkout: trace, lower and
XLA compile of the default engine's step for its smallest prefill and its decode bucket
(``compile_vs_layers``' buckets), on ``KimiLinearConfig.tiny(num_hidden_layers=argv[1])``."""


def _compile_step_in(root: str, layers: int) -> dict:
    """``_COMPILE_STEP`` in a fresh Python with ``root``'s ``hybridattn`` first on the path:
    seconds per bucket."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", _COMPILE_STEP, str(layers)], env=env,
                         capture_output=True, text=True, cwd=root)
    if out.returncode:
        raise RuntimeError(f"compiling the step of {root} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_against(baseline: str, layers: int, rounds: int) -> dict:
    """The step's compile seconds on ``baseline`` (a checkout of another revision) and on this
    checkout, each in a fresh process, ``rounds`` rounds (which goes first alternates):
    medians, and the paired ratios ours / baseline (median, min, max)."""
    if rounds < 1:
        raise ValueError(f"compile rounds must be at least 1, got {rounds}")
    ours_root = os.path.dirname(os.path.dirname(os.path.abspath(hybridattn.__file__)))
    rev = subprocess.run(["git", "-C", baseline, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    runs: dict[str, list[dict]] = {"baseline": [], "ours": []}
    roots = {"baseline": os.path.abspath(baseline), "ours": ours_root}
    for r in range(rounds):
        for side in (("baseline", "ours") if r % 2 == 0 else ("ours", "baseline")):
            runs[side].append(_compile_step_in(roots[side], layers))
    total = {k: [sum(r.values()) for r in v] for k, v in runs.items()}
    ratios = [o / b for o, b in zip(total["ours"], total["baseline"], strict=True)]
    return dict(baseline=os.path.abspath(baseline),
                revision=rev.stdout.strip() if rev.returncode == 0 else None, layers=layers,
                rounds=rounds, baseline_s=median(total["baseline"]), ours_s=median(total["ours"]),
                runs=runs, ratio=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def print_compile_vs_layers(cl: list[dict]) -> None:
    """The table of :func:`compile_vs_layers`' rows, and the verdict at the largest model."""
    print()
    print("compile s against layer count: KimiLinearConfig.tiny(num_hidden_layers=n), the "
          "step's smallest\nprefill and its decode bucket (one request), trace + lower + "
          "XLA compile each; every layer\nunrolled (scan_layers=False, the step before "
          "layer scans) and the repeated layers scanned")
    hdr = (f"{'layers':>6} | {'KDA+MLA':>7} | {'compiled':>8} | {'unrolled s':>10} | "
           f"{'+s/layer':>8} | {'scanned s':>9} | {'+s/layer':>8} | {'scanned/unrolled':>16}")
    print(hdr)
    print("-" * len(hdr))

    def added(v):
        a = v.get("added_s_per_layer")
        return f"{'-':>8}" if a is None else f"{a:8.3f}"

    for r in cl:
        u, sc = r["unrolled"], r["scanned"]
        print(f"{r['layers']:>6} | {r['kda_layers']:>3}+{r['mla_layers']:<3} | "
              f"{r['compiled_layers']:>8} | {u['total_s']:10.2f} | {added(u)} | "
              f"{sc['total_s']:9.2f} | {added(sc)} | {r['scanned_over_unrolled']:16.2f}")
    big = cl[-1]
    print(f"compiled: layers in the step once what repeats is one scan "
          f"(kimi_linear.stack_layers); +s/layer:\nwhat each layer added since the row "
          f"above. At "
          f"{big['layers']} layers the scanned step compiles in "
          f"{big['scanned_over_unrolled']:.2f} of the unrolled time (target 1/3 or less: "
          f"{'holds' if big['scanned_over_unrolled'] <= 1 / 3 else 'MISSED'})")


def print_compile_baseline(cb: dict) -> None:
    """:func:`compile_against`'s result in one paragraph."""
    print(f"\ncompile s of the step against a baseline checkout ({cb['baseline']}, "
          f"{cb['revision'] or 'revision unknown'}), {cb['layers']} layers, the same two "
          f"buckets,\neach in a fresh process, {cb['rounds']} rounds, the first "
          f"alternating (medians): "
          f"baseline {cb['baseline_s']:.2f}, ours {cb['ours_s']:.2f}; ours / baseline "
          f"{cb['ratio']:.3f} (paired, {cb['ratio_min']:.3f}-{cb['ratio_max']:.3f}; "
          f"target 1/3 or less: {'holds' if cb['ratio_max'] <= 1 / 3 else 'MISSED'})")
