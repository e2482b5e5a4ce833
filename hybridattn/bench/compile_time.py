"""``bench serve``'s compile-time rows: the step's trace, lower and XLA compile against the
layer count, with every layer unrolled and with the repeated layers scanned (see
:mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import time

import jax

from hybridattn.backends import ForwardMode
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
    compiles: one request, one token), with every layer unrolled (``scan_layers=False``)
    and with the repeated layers scanned (the default)."""
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


def print_compile_vs_layers(cl: list[dict]) -> None:
    """The table of :func:`compile_vs_layers`' rows, and the verdict at the largest model."""
    print()
    print("compile s against layer count: KimiLinearConfig.tiny(num_hidden_layers=n), the "
          "step's smallest\nprefill and its decode bucket (one request), trace + lower + "
          "XLA compile each; every layer\nunrolled (scan_layers=False) and the repeated "
          "layers scanned")
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
