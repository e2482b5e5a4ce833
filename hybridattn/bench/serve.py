"""``python -m hybridattn.bench serve``: our engine against mlx-lm (and transformers) on one
small Kimi-Linear, the step's time split into host, wait and device, the small prefill, and
the bandwidth, compute and products bounds (see :mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from hybridattn.backends import ForwardMode
from hybridattn.bench import anchors as A
from hybridattn.bench.common import PEAK_N, machine, median
from hybridattn.bench.compile_time import (
    COMPILE_LAYERS,
    compile_vs_layers,
    print_compile_vs_layers,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from servecore.progress import progress_bar


def serve_config():
    """The serve benchmark's model: 8 layers (6 KDA + 2 MLA), hidden 256, MoE 8 experts top-2
    with a shared expert after a dense first layer. Small, because MLX's Linux CPU wheel links a
    slow reference BLAS (ratios still hold)."""
    return KimiLinearConfig.tiny(
        num_hidden_layers=8, hidden_size=256, intermediate_size=512, vocab_size=2048,
        num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, linear_num_heads=4, linear_head_dim=64, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=128,
    )


STEP_KINDS = ("prefill", "decode")
"""The two kinds of step ``bench serve`` times apart (an ``EXTEND`` step that runs prompt
tokens, a ``DECODE`` step)."""


SMALL_PREFILL_TARGET = 25
"""The small prefill's goal: a 24-token prefill costs at most 1/25 of a 1024-token one."""


def _capture_steps(engine) -> dict:
    """Spy on ``engine``'s jitted calls: the returned dict gets, for the first prefill and
    the first decode step it runs, ``(fn, params, state, batch)`` with the state copied
    before the step donates it and the batch already on the device, for ``_step_alone``.
    ``del engine.core.runner.call`` ends the spying. The copies cost time: spy on an untimed run."""
    captured: dict = {}
    runner = engine.core.runner
    call = runner.call

    def spy(fn, *args, **kwargs):
        if fn is runner.jit.step:
            params, state, batch = args
            kind = "decode" if batch.forward_mode == ForwardMode.DECODE else "prefill"
            if kind not in captured:
                captured[kind] = (fn, params, jax.tree.map(lambda x: x.copy(), state),
                                  jax.device_put(batch), 1)
        elif fn in runner.jit._decode.values() and "decode" not in captured:
            # a multi-step decode: (batch, stop ids, limits); it runs max(limits) steps
            params, state, *rest = args
            captured["decode"] = (fn, params, jax.tree.map(lambda x: x.copy(), state),
                                  jax.device_put(tuple(rest)), int(np.max(rest[2])))
        return call(fn, *args, **kwargs)

    runner.call = spy
    return captured


def _step_alone(captured, rounds: int) -> list[float]:
    """Seconds of ``rounds`` runs of a captured step alone (after one untimed run), each on a
    fresh copy of its state: from the call, its arguments prepared on the device, to its
    outputs ready. That is the device's work plus the C++ dispatch of one call; a multi-step
    decode's time is divided by the steps it ran (per step, as the other columns)."""
    fn, params, state, args, steps = captured
    args = args if isinstance(args, tuple) else (args,)
    times = []
    for _ in range(rounds + 1):
        fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, fresh, *args))
        times.append((time.perf_counter() - t0) / steps)
    return times[1:]


def _serve_by_step(engine, prompts: list[list[int]], new_tokens: int):
    """Serve ``prompts`` one ``Engine.step`` at a time: the tokens, and for each round that
    did not compile, per step it ran (a multi-step decode round runs several: its times are
    divided by them; ``n`` says how many), its seconds (``step_s``: packing to outputs), the
    Python side of its round (``host_s``) and its wait for the outputs (``wait_s``), from
    ``EngineStats``."""
    rids = [engine.add_request(p, new_tokens) for p in prompts]
    out: dict[int, list[int]] = {r: [] for r in rids}
    steps: dict[str, list[dict]] = {k: [] for k in STEP_KINDS}
    fields = ("seconds", "host_seconds", "wait_seconds", "exposed_seconds")

    def sums():  # exposed host time is counted for decode steps; a prefill step's is its host time
        return {k: [getattr(engine.stats, f"{k}_{f}" if f != "exposed_seconds" or k == "decode"
                            else f"{k}_host_seconds") for f in fields] for k in STEP_KINDS}

    while engine.has_unfinished():
        before, ran = sums(), engine.stats.steps
        for rid, tok, _ in engine.step():
            out[rid].append(tok)
        n = max(engine.stats.steps - ran, 1)
        for k, after in sums().items():
            d = [a - b for a, b in zip(after, before[k], strict=True)]
            if d[0] > 0:
                steps[k].append(dict(step_s=d[0] / n, host_s=d[1] / n, wait_s=d[2] / n,
                                     exposed_s=d[3] / n, n=n))
    return [out[r] for r in rids], steps


def _bucket_rows(bucket_seconds: dict) -> list[dict]:
    """``EngineStats.bucket_compile_seconds`` as JSON rows: mode, the bucket's sizes, s."""
    rows = []
    for key, sec in bucket_seconds.items():
        mode, B, T, W, Q, *extra = key
        row = dict(mode=ForwardMode(mode).name.lower(), requests=B, tokens=T, kv_width=W,
                   max_extend_len=Q, s=sec)
        if extra and mode == ForwardMode.DECODE:  # a multi-step decode
            row["decode_steps"] = extra[0]
        elif extra:
            row["snapshots"] = extra[0]
        rows.append(row)
    return rows


def _ours_serve(config, params, prompts: np.ndarray, new_tokens: int, repeats: int,
                device_rounds: int = 20, decode_steps: int | None = None,
                overlap: bool = True) -> dict:
    """Our engine on ``prompts [B, P]``: all prompts in one prefill step, then
    ``new_tokens - 1`` decode steps (``decode_steps`` per dispatch; None: the engine's
    default); best of ``repeats`` runs after a compiling run, and per step (medians over the
    repeats' rounds, each divided by its steps) the engine's host and wait seconds, and the
    step alone on its captured inputs (``device_rounds`` runs, ``_step_alone``)."""
    B, P = prompts.shape
    ctx = -(-(P + new_tokens) // 64) * 64
    # No prefix cache: the timed repeats serve the same prompts, which would all be hits
    # (``bench prefix`` measures the cache).
    engine = Engine(config, params, max_running_requests=B, max_context_len=ctx,
                    num_token_slots=B * ctx + 1, chunked_prefill_size=B * P,
                    request_buckets=(B,), token_buckets=(B * P + B,), kv_buckets=(ctx,),
                    prefix_cache=False, overlap=overlap,
                    **({} if decode_steps is None else dict(decode_steps=decode_steps)))
    captured = _capture_steps(engine)
    t0 = time.perf_counter()
    tokens = engine.generate(prompts.tolist(), new_tokens)  # compiles
    first_run_s = time.perf_counter() - t0
    del engine.core.runner.call  # the spy
    compiles, compile_s = engine.stats.num_compilations, engine.stats.compile_seconds
    buckets = _bucket_rows(engine.stats.bucket_compile_seconds)
    best_prefill = best_step = math.inf
    samples: dict[str, list[dict]] = {k: [] for k in STEP_KINDS}
    for _ in range(repeats):
        engine.reset_stats()
        again, steps = _serve_by_step(engine, prompts.tolist(), new_tokens)
        assert again == tokens, "the engine is not deterministic"
        s = engine.stats
        best_prefill = min(best_prefill, s.prefill_seconds)
        if s.decode_tokens:
            best_step = min(best_step, s.decode_seconds / (s.decode_tokens / B))
        for k in STEP_KINDS:
            samples[k] += steps[k]
    per_step = {}
    for k in STEP_KINDS:
        if k not in captured:
            continue
        alone = _step_alone(captured[k], device_rounds if k == "decode"
                            else max(3, device_rounds // 4))
        per_step[k] = dict(steps=sum(x["n"] for x in samples[k]), rounds=len(samples[k]),
                           **{f: median([x[f] for x in samples[k]])
                              for f in ("step_s", "host_s", "wait_s", "exposed_s")},
                           device_s=median(alone), device_runs=len(alone))
    captured.clear()  # the state copies
    out = dict(engine="ours", batch_size=B, prompt_len=P, new_tokens=new_tokens,
               decode_steps=engine.decode_steps, overlap=overlap,
               prefill_s=best_prefill, prefill_tok_s=B * P / best_prefill,
               decode_step_s=best_step if new_tokens > 1 else None,
               decode_tok_s=B / best_step if new_tokens > 1 else None,
               compilations=compiles, compile_s=compile_s, first_run_s=first_run_s,
               per_step=per_step, bucket_compile_s=buckets, tokens=tokens)
    return out


def _small_prefill(config, params, small: int = 24, large: int = 1024,
                   rounds: int = 3) -> dict:
    """One prompt of ``small`` and one of ``large`` tokens, each prefilled in one step of an
    engine with the default bucket ladders (``chunked_prefill_size=large``, one request
    row): median seconds of each prefill step over ``rounds`` interleaved rounds after a
    compiling one, and how many times the small one fits in the large one; and the matrix
    products alone of ``small`` tokens (``anchors.products_step_seconds``), the least
    the small prefill can cost on this backend."""
    engine = Engine(config, params, max_running_requests=1, max_context_len=large,
                    num_token_slots=large + 1, chunked_prefill_size=large, prefix_cache=False)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(1, config.vocab_size, n).tolist() for n in (small, large)}
    for p in prompts.values():  # compiles
        engine.generate([p], 1)
    buckets = _bucket_rows(engine.stats.bucket_compile_seconds)
    times: dict[int, list[float]] = {n: [] for n in prompts}
    for _ in range(rounds):
        for n, p in prompts.items():
            engine.reset_stats()
            engine.generate([p], 1)
            times[n].append(engine.stats.prefill_seconds)
    small_s, large_s = median(times[small]), median(times[large])
    # the small prefill's matrix products alone, on exactly its tokens (no bucket padding)
    products_s = A.products_step_seconds(config, small)
    return dict(small_tokens=small, large_tokens=large, rounds=rounds, small_s=small_s,
                large_s=large_s, small_fraction=small_s / large_s,
                small_products_s=products_s, large_over_small_products=large_s / products_s,
                large_over_small=large_s / small_s, token_ratio=large / small,
                target_large_over_small=SMALL_PREFILL_TARGET,
                holds=large_s / small_s >= SMALL_PREFILL_TARGET,
                token_buckets=list(engine.token_buckets), kv_buckets=list(engine.kv_buckets),
                bucket_compile_s=buckets)


def bench_serve(batch_sizes=(1, 8, 32), prompt_len: int = 64, new_tokens: int = 16,
                repeats: int = 2, transformers: bool = True, config=None,
                progress: bool = False, compile_layers=COMPILE_LAYERS,
                small_prefill: tuple[int, int] | None = (24, 1024),
                device_rounds: int = 20, decode_steps: int | None = None) -> dict:
    """Run the serve benchmark (see :mod:`hybridattn.bench.cli`). ``decode_steps``: our engine's
    decode steps per dispatch (None: its default). ``compile_layers``: the layer
    counts of the compile-time rows (empty: none); ``small_prefill``: the (small, large)
    prompt lengths whose prefill steps are compared (None: not measured);
    ``device_rounds``: runs of the decode step alone (a quarter of them, at least 3, for
    the prefill step)."""
    config = config or serve_config()
    params = M.init_params(config, jax.random.key(0))
    bandwidth, peak = A.memory_bandwidth_gbs(), A.peak_gflops(PEAK_N)
    res: dict = dict(machine=machine(), config=config.to_dict(), prompt_len=prompt_len,
                     new_tokens=new_tokens, bandwidth_gbs=bandwidth, peak_gflops=peak, rows=[],
                     compilation_cache_dir=jax.config.jax_compilation_cache_dir)
    mlx_model = A.mlx_lm_model(config, params)
    reason = A.transformers_unavailable() if transformers else "not requested"
    tf_model = A.transformers_model(config, params) if reason is None else None
    res["transformers"] = reason or "ok"
    for B in progress_bar(batch_sizes, desc="bench serve", unit="batch size",
                          enabled=progress, leave=False):
        prompts = np.random.default_rng(B).integers(1, config.vocab_size, (B, prompt_len))
        row: dict = dict(batch_size=B)
        row["ours"] = _ours_serve(config, params, prompts, new_tokens, repeats, device_rounds,
                                  decode_steps)
        # the same engine with synchronous rounds (overlap=False): what overlapping buys
        row["ours_sync"] = _ours_serve(config, params, prompts, new_tokens, repeats,
                                       device_rounds, decode_steps, overlap=False)
        row["mlx_lm"] = A.mlx_lm_serve(config, params, prompts=prompts.tolist(),
                                       new_tokens=new_tokens, repeats=repeats, model=mlx_model)
        if tf_model is not None:
            row["transformers"] = A.transformers_serve(
                config, params, prompts=prompts.tolist(), new_tokens=new_tokens,
                repeats=1, model=tf_model)
        ours_tokens = row["ours"]["tokens"]
        for name in ("mlx_lm", "transformers"):
            if name in row and row[name].get("tokens") is not None:
                theirs = [list(map(int, t)) for t in row[name]["tokens"]]
                row[name]["tokens_equal_ours"] = theirs == ours_tokens
        floor = A.decode_bytes_per_step(config, B, prompt_len + new_tokens // 2)
        row["decode_floor_s"] = floor["total"] / (bandwidth * 1e9)
        row["decode_floor_bytes"] = floor["total"]
        flops = A.decode_flops_per_step(config, B, prompt_len + new_tokens // 2)
        row["decode_flops"] = flops["total"]
        row["decode_compute_floor_s"] = flops["total"] / (peak * 1e9)
        row["decode_products_s"] = A.products_step_seconds(config, B)
        row["ours_sync"]["tokens_equal_ours"] = row["ours_sync"]["tokens"] == ours_tokens
        for r in (row["ours"], row["ours_sync"], row["mlx_lm"], row.get("transformers", {})):
            r.pop("tokens", None)
            r.pop("prompts", None)
        res["rows"].append(row)
    if small_prefill is not None:
        res["small_prefill"] = _small_prefill(config, params, *small_prefill,
                                              rounds=max(3, 2 * repeats + 1))
    if compile_layers:
        res["compile_vs_layers"] = compile_vs_layers(compile_layers)
    return res


def print_serve(res: dict) -> None:
    peak = f"; f32 matmul peak {res['peak_gflops']:.0f} GFLOP/s" if "peak_gflops" in res else ""
    print(f"serve: Kimi-Linear {res['config']['num_hidden_layers']} layers, hidden "
          f"{res['config']['hidden_size']}, f32, prompts of {res['prompt_len']} tokens, "
          f"{res['new_tokens']} new tokens each (greedy); bandwidth {res['bandwidth_gbs']:.1f} "
          f"GB/s{peak}; transformers: {res['transformers']}")
    print(f"{'B':>3} | {'engine':>12} | {'prefill tok/s':>13} | {'decode tok/s':>12} | "
          f"{'ms/step':>8} | {'ours: prefill':>13} | {'decode':>7} | same tokens")
    for row in res["rows"]:
        ours = row["ours"]
        for name in ("ours", "ours_sync", "mlx_lm", "transformers"):
            r = row.get(name)
            if not r or r.get("skipped"):
                continue
            step = r.get("decode_step_s")
            if name == "ours":
                ratio = f"{'':>13} | {'':>7} | "
            else:
                ratio = (f"{ours['prefill_tok_s'] / r['prefill_tok_s']:12.2f}x | "
                         f"{ours['decode_tok_s'] / r['decode_tok_s']:6.2f}x | "
                         f"{'yes' if r.get('tokens_equal_ours') else 'NO'}")
            print(f"{row['batch_size']:>3} | {name:>12} | {r['prefill_tok_s']:13.0f} | "
                  f"{r['decode_tok_s'] or 0:12.0f} | {1e3 * (step or 0):8.2f} | {ratio}")
        print(f"{row['batch_size']:>3} | {'floor':>12} | {'':>13} | "
              f"{row['batch_size'] / row['decode_floor_s']:12.0f} | "
              f"{1e3 * row['decode_floor_s']:8.2f} | ours at "
              f"{row['decode_floor_s'] / ours['decode_step_s']:.0%} of the bandwidth bound "
              f"({row['decode_floor_bytes'] / 1e6:.1f} MB/step)")
        if row.get("decode_compute_floor_s") is not None:  # JSON of older runs lack it
            cf = row["decode_compute_floor_s"]
            print(f"{row['batch_size']:>3} | {'compute':>12} | {'':>13} | "
                  f"{row['batch_size'] / cf:12.0f} | {1e3 * cf:8.2f} | ours at "
                  f"{cf / ours['decode_step_s']:.0%} of the compute bound "
                  f"({row['decode_flops'] / 1e6:.0f} MFLOP/step at the peak rate)")
        if row.get("decode_products_s") is not None:  # JSON of older runs lack it
            ps = row["decode_products_s"]
            print(f"{row['batch_size']:>3} | {'products':>12} | {'':>13} | "
                  f"{row['batch_size'] / ps:12.0f} | {1e3 * ps:8.2f} | the step's matrix "
                  f"products alone: at {row['decode_floor_s'] / ps:.0%} of the bandwidth bound")
        print(f"{row['batch_size']:>3} | ours compiled {ours['compilations']} times in "
              f"{ours['compile_s']:.1f} s")
    print("note: MLX's Linux CPU wheel links a slow reference BLAS, so mlx-lm's matmuls are slow "
          "here;\nthe 'floor' rows (bytes of weights + state one decode step must read, over the "
          "measured\nbandwidth) are the hardware bound to read our decode step against; the "
          "'compute' rows\n(the products a step cannot skip, over the measured peak of a large "
          "f32 matmul) are the\nother bound: the step is compute-bound where they exceed the "
          "floor; the 'products' rows (the\nstep's matrix products alone, timed on this "
          "backend: bench.anchors.products_step) are\nthe least a step that runs them can "
          "take here.")
    _print_serve_steps(res)


def _ms(x) -> str:
    return f"{'-':>6}" if x is None else f"{1e3 * x:6.2f}"


def _print_per_step(rows: list[dict]) -> None:
    """Where our step's time goes (host, exposed, wait, device per step), and the compile
    time of each step bucket."""
    print()
    print("ours per step, ms (medians): step = packing to outputs (a run dispatched before "
          "the last one's\noutputs: from those outputs); host = the Python side of the "
          "round outside the wait (plan,\npack, dispatch, commit); exposed = the part of "
          "host the device did not hide (overlapped\nrounds, 'ours'; all of it in "
          "'ours_sync'); wait = blocked on the outputs; device = the step alone\non its "
          "captured inputs, prepared on the device")
    hdr = (f"{'B':>3} | {'engine':>9} | {'kind':>7} | {'steps':>5} | {'step':>6} | "
           f"{'host':>6} | {'exposed':>7} | {'wait':>6} | {'device':>6}")
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        for name in ("ours", "ours_sync"):
            for kind, e in row.get(name, {}).get("per_step", {}).items():
                print(f"{row['batch_size']:>3} | {name:>9} | {kind:>7} | {e['steps']:>5} | "
                      f"{_ms(e['step_s'])} | {_ms(e['host_s'])} | "
                      f" {_ms(e.get('exposed_s'))} | {_ms(e['wait_s'])} | "
                      f"{_ms(e['device_s'])}")
    print()
    print("compile s per step bucket (mode requests x tokens x kv width x extend): the "
          "step's first run")
    for row in rows:
        print(f"{row['batch_size']:>3} | " + ", ".join(
            f"{b['mode']} {b['requests']}x{b['tokens']}x{b['kv_width']}x"
            f"{b['max_extend_len']}"
            + (f" ({b['decode_steps']} steps)" if b.get("decode_steps") else "")
            + f" {b['s']:.1f}" for b in row["ours"]["bucket_compile_s"]))


def _print_small_prefill(sp: dict) -> None:
    """The small prefill against the large one, beside the goal of 1/25."""
    print()
    print(f"small prefill (one request, default bucket ladders: tokens "
          f"{tuple(sp['token_buckets'])}, width {tuple(sp['kv_buckets'])}): "
          f"{sp['small_tokens']} tokens {1e3 * sp['small_s']:.1f} ms, {sp['large_tokens']} "
          f"tokens {1e3 * sp['large_s']:.1f} ms:\n  the small one costs 1/"
          f"{sp['large_over_small']:.1f} of the large (tokens: 1/{sp['token_ratio']:.0f}); "
          f"target 1/{sp['target_large_over_small']} or less: "
          f"{'holds' if sp['holds'] else 'MISSED'}; compiled "
          + ", ".join(f"{b['tokens']}x{b['kv_width']} {b['s']:.1f} s"
                      for b in sp["bucket_compile_s"]))
    if sp.get("small_products_s") is not None:  # a result saved without it
        print(f"  the matrix products alone of {sp['small_tokens']} tokens (no padding) take "
              f"{1e3 * sp['small_products_s']:.1f} ms, 1/"
              f"{sp['large_over_small_products']:.1f} of the large prefill")


def _print_serve_steps(res: dict) -> None:
    """The columns of where our step's time goes (where the result has them)."""
    rows = [r for r in res["rows"] if "per_step" in r["ours"]]
    if rows:
        _print_per_step(rows)
    if res.get("small_prefill"):
        _print_small_prefill(res["small_prefill"])
    if res.get("compile_vs_layers"):
        print_compile_vs_layers(res["compile_vs_layers"])
    if res.get("compilation_cache_dir"):
        print(f"note: JAX's compilation cache is on ({res['compilation_cache_dir']}): compile "
              "times may be cache loads")
