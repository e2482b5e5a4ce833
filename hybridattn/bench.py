"""Benchmarks: ours and an independent anchor side by side, in one run.

    python -m hybridattn.bench kda [--json] [--quick] [--plot DIR]
    python -m hybridattn.bench serve [--json] [--quick] [--batch-sizes 1 8 32]
                                     [--compile-layers 4 12 27] [--plot DIR]
                                     [--compile-baseline PATH [--compile-rounds 3]]
    python -m hybridattn.bench serve --mesh 2x4 [--json] [--quick]
    python -m hybridattn.bench prefix [--json] [--quick] [--plot DIR]
    python -m hybridattn.bench longctx [--json] [--quick] [--compare-chunk N] [--plot DIR]
    python -m hybridattn.bench WHAT --from-json FILE --plot DIR   # plot a saved --json run

``kda``: for ``B=1, H=4, Dk=Dv=128`` and ``T`` in ``{1024, 4096, 16384}``, tokens/s of
``kda_chunked`` (chunk sizes 32 and 64), ``kda_recurrent`` and mlx-lm's
``gated_delta_update(use_kernel=False)`` (its ops path, the one that runs on CPU) on the same
inputs (gates included on both sides); decode step time for ``B`` in ``{1, 32}``; compile
times apart; achieved GFLOP/s of the chunked form and its fraction of this machine's f32 matmul
peak, measured in the same run. With ``--devices N`` (default: 2 where the machine has 2 or
more cores) the chunked and recurrent kernels also run with the heads split over ``N`` CPU
devices under ``jax.shard_map`` (heads are independent): XLA:CPU runs one device's chain of
small matmuls on about one core, while the peak matmul uses them all. Those rows are compared
with the recurrent kernel split the same way.

``serve``: prefill and decode tokens/s of :class:`hybridattn.Engine` at batch 1, 8 and 32 on a
small Kimi-Linear (random weights, f32, CPU) against mlx-lm's ``kimi_linear`` on the same
weights with its own batched cache, and transformers' ``KimiLinearForCausalLM.generate`` when
torch is installed (``pip install -e '.[bench]'``); greedy tokens are compared, compile counts
and times reported, and our decode step time is set against the memory-bandwidth floor (bytes
of weights and state a step must read, over this machine's measured bandwidth) and the compute
floor (the products a step cannot skip, over this machine's f32 matmul peak), and beside them
the step's matrix products alone, timed on this backend
(``serve_anchors.products_step_seconds``: what those bounds become here, where skinny
products run far below the peak; the small prefill gets the same figure). Where our
step's time goes, per prefill and per decode step (medians over the timed rounds, each
divided by the steps it ran: our engine decodes ``decode_steps`` steps per dispatch, its
default or ``--decode-steps N``):

- **host**: the Python side of the step's scheduling round outside the wait for its outputs
  (planning, packing the batch, the jitted call until it returns: argument flattening,
  transfers and dispatch; then committing the tokens), from ``EngineStats.*_host_seconds``;
  **exposed**: the part of it the device did not hide (``decode_exposed_seconds``: our engine
  overlaps its rounds, ``Engine(overlap=True)``; a prefill's host time is all exposed);
  **wait**: the time then blocked on the outputs (``*_wait_seconds``). The same engine with
  synchronous rounds (``overlap=False``) runs beside it as ``ours_sync``;
- **device**: the step alone: its inputs are captured during the compiling run (the state
  copied before the step donates it, the batch put on the device), then the jitted step runs
  on a fresh copy of that state, timed from the call to its outputs ready; the median of
  several runs. It is the device's work plus the C++ dispatch of one call; host + device is
  what a step would cost if nothing overlapped, max(host, device) if all of it did.

Also: the compile time of each step bucket the engines compiled (``(mode, requests, tokens,
kv width, extend)`` to the wall time of the step that compiled it); the compile time of the
step (trace, lower, XLA compile) against the layer count, on
``KimiLinearConfig.tiny(num_hidden_layers=n)`` for ``--compile-layers`` (default 4 12 27;
``--quick`` 4 12), for its smallest prefill and its decode bucket; and a 24-token prefill
against a 1024-token one on one engine with the default bucket ladders, beside issue 20's
target (the small one at most 1/25 of the large). ``--compile-baseline PATH`` (a checkout of
another revision, e.g. ``git worktree add /tmp/base 64f4e51``, main when issue 20 was filed)
compiles the same two buckets of the largest ``--compile-layers`` model with that checkout's
step and with this one's, each in a fresh process, alternating, ``--compile-rounds`` times.

``serve --mesh DxT``: the serving step sharded over a ``(data, tensor)`` mesh of ``D*T`` CPU
devices (``hybridattn.sharding``; ``jax_num_cpu_devices`` is set before JAX starts) on the
same model: per-device bytes of parameters and pools against their totals, compile time of
the prefill and decode steps, step times, and whether each data shard's greedy tokens equal
the unsharded step's. CPU devices share this machine's cores: the times say nothing about
chips; the bytes and the compile times do.

``prefix``: the hybrid prefix cache on two workloads, served with and without it by the same
engine geometry: (a) 16 requests of a 1024-token shared prefix + 32 unique tokens, submitted
together; (b) 8 conversations x 4 turns (each turn: the last prompt + its 32-token answer + a
30-token message). Reported: mean TTFT and effective prefill tok/s (all prompt tokens over
prefill time) with and without the cache, the achieved speedup of prefill time, and two
ideals beside it: the token ratio (prompt tokens / tokens that must be computed) and the
measured one (cold prefill time of the whole prompts / cold prefill time of their uncached
parts served alone, with the same batching). Small steps cost more per token than large ones
on this machine, so the cache is judged against the measured ideal.

``longctx``: one request of 4k, 16k, 64k and 256k prompt tokens (``--quick``: up to 64k) + 8
new tokens on ``KimiLinearConfig.tiny()``, each length in a fresh process so that its peak
resident memory is its own: wall prefill time (compilations included) and steady prefill tok/s,
decode ms/step against the bandwidth floor (bytes of weights, KDA state and the request's
latents one step reads, over a bandwidth measured in the same run), the pools and parameters
the engine holds, and the MLA attention's share of the step (the jitted MLA backend call alone
on the same shapes, over the step; in decode one call after each step, the median call over
the median step). Judged against issue 18's targets: a 64k prompt prefilled
with a peak of at most 1.5 GB in under 90 s, 256k completes, decode at 64k within 3x the
floor, peak memory growing like the pools rather than like chunk x context.

Timings are the best of several rounds after a warm-up, each round visiting every contender in
turn, so a noisy neighbour slows all of them alike; read the ratios. A tqdm bar on stderr
follows the work when stderr is a terminal. ``--plot DIR`` also writes the result as a PNG
(``hybridattn.bench_plots``), from this run or, with ``--from-json FILE``, from a saved one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import ops
from servecore.progress import progress_bar


def _interleaved_best(runs: dict[str, Callable[[], object]], rounds: int,
                      sync: dict[str, Callable[[object], object]],
                      every: dict[str, int] | None = None) -> dict[str, float]:
    """Best wall time of each run over ``rounds`` rounds that visit every run in turn, so
    that a noisy neighbour slows all of them alike. A slow run can be timed in every
    ``every[name]``-th round only (rounds 0, k, 2k, ...), still spread over the same rounds."""
    every = every or {}
    for name, fn in runs.items():
        sync[name](fn())  # warm-up
    best = dict.fromkeys(runs, math.inf)
    for r in range(rounds):
        for name, fn in runs.items():
            if r % every.get(name, 1):
                continue
            t0 = time.perf_counter()
            sync[name](fn())
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


PEAK_N = 2048
"""Side of the square f32 matmul whose throughput is this machine's peak."""


def _matmul_run() -> Callable[[], object]:
    """One ``PEAK_N x PEAK_N @ PEAK_N x PEAK_N`` f32 matmul under XLA."""
    x = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return lambda: f(x)


def chunked_flops(T: int, H: int, Dk: int, Dv: int, C: int) -> float:
    """Floating-point operations of :func:`hybridattn.ops.kda_chunked`'s matmuls.

    Per chunk and head: the hierarchical ``A_kk``/``A_qk`` blocks (``2 C^2 Dk``), the block
    inverse of ``I + L`` (``2/3 C^3``), ``U = Tb V`` (``2 C^2 Dv``), the intra-chunk output
    ``A_qk V'`` (``2 C^2 Dv``), and the state pass: ``Ke S`` and ``Qs S`` (``4 C Dk Dv``),
    ``Tb (Ke S)`` (``2 C^2 Dv``) and ``Kt^T V'`` (``2 C Dk Dv``). Triangular operands are
    counted as the dense products they run as.
    """
    n_chunks = math.ceil(T / C) * H
    per_chunk = (2 * C * C * Dk + 2 / 3 * C**3 + 3 * 2 * C * C * Dv + 6 * C * Dk * Dv)
    return n_chunks * per_chunk


def _inputs(B: int, T: int, H: int, D: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    return dict(
        q=unit(rng.standard_normal((B, T, H, D), np.float32)),
        k=unit(rng.standard_normal((B, T, H, D), np.float32)),
        v=rng.standard_normal((B, T, H, D), np.float32),
        a=rng.standard_normal((B, T, H, D), np.float32),
        b=rng.standard_normal((B, T, H), np.float32),
        A_log=np.log(rng.uniform(1.0, 16.0, (H,))).astype(np.float32),
        dt_bias=(0.1 * rng.standard_normal(H * D)).astype(np.float32),
    )


def _ours(x, chunk_size: int | None, mesh=None):
    """A jitted KDA over the raw gate inputs (gate + beta computed inside, like mlx-lm); with
    ``mesh`` (one axis ``"h"``), under ``shard_map`` with the heads split over its devices."""

    def f(q, k, v, a, b, A_log, dt_bias):
        g = ops.kda_gate(a, A_log, dt_bias)
        beta = jax.nn.sigmoid(b)
        if chunk_size is None:
            return ops.kda_recurrent(q, k, v, g, beta)
        return ops.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size)

    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        tok, head = P(None, None, "h"), P("h")  # dt_bias [H*D] is head-major: split it too
        specs = (tok, tok, tok, tok, tok, head, head)
        f = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(tok, P(None, "h")))
        args = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs,
                                                                             strict=True)]
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return (lambda: compiled(*args)), compile_s


def default_devices() -> int:
    """CPU devices for the split-heads rows: 2 on a machine with 2 or more cores, else 1."""
    import os

    return 2 if (os.cpu_count() or 1) >= 2 else 1


def _mlx(x, B: int, H: int, D: int):
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_update

    scale = D**-0.5
    m = {n: mx.array(x[n]) for n in x}
    q = m["q"] * scale  # mlx-lm folds the read-out scale into q
    A_log = m["A_log"].reshape(H, 1)
    dt_bias = m["dt_bias"].reshape(H, D)

    def run():
        out = gated_delta_update(q, m["k"], m["v"], m["a"], m["b"], A_log, dt_bias,
                                 use_kernel=False)
        mx.eval(*out)
        return out

    return run


def bench_kda(quick: bool = False, mlx_max_t: int = 4096,
              chunk_sizes: tuple[int, ...] = (32, 64), devices: int = 1,
              progress: bool = False) -> dict:
    """Run the KDA benchmark (see the module docstring); ``devices > 1`` needs that many JAX
    devices (``main`` sets ``jax_num_cpu_devices`` before JAX starts). ``progress``: a bar of
    the sequence lengths done."""
    B, H, D = 1, 4, 128
    mesh = None
    if devices > 1:
        if H % devices or len(jax.devices()) < devices:
            raise ValueError(f"devices={devices} must divide H={H} and be at most the "
                             f"{len(jax.devices())} JAX devices")
        mesh = jax.make_mesh((devices,), ("h",), devices=jax.devices()[:devices])
    Ts = [1024, 4096] if quick else [1024, 4096, 16384]
    rounds = 4 if quick else 12
    matmul = _matmul_run()
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401

        have_mlx = True
    except ImportError:
        have_mlx = False

    rows = []
    for T in progress_bar(Ts, desc="bench kda", unit="T", enabled=progress, leave=False):
        x = _inputs(B, T, H, D)
        runs, sync, compile_s = {}, {}, {}
        for C in chunk_sizes:
            runs[f"chunked{C}"], compile_s[f"chunked{C}"] = _ours(x, C)
        runs["recurrent"], compile_s["recurrent"] = _ours(x, None)
        if mesh is not None:
            for C in chunk_sizes:
                runs[f"split{C}"], compile_s[f"split{C}"] = _ours(x, C, mesh)
            runs["split_recurrent"], compile_s["split_recurrent"] = _ours(x, None, mesh)
        # The peak is measured in the same rounds, under the same load as the kernels.
        runs["matmul"] = matmul
        sync = dict.fromkeys(runs, jax.block_until_ready)
        if have_mlx and T <= mlx_max_t:
            runs["mlx_ops"] = _mlx(x, B, H, D)
            sync["mlx_ops"] = lambda o: o
        # mlx-lm's ops path takes seconds per call: it is timed in every fourth round only
        # (three of twelve, one with --quick), spread over the same rounds as ours so that
        # both see the same load, and its best round counts like everyone else's.
        n_rounds = rounds if T <= 4096 else 2
        best = _interleaved_best(runs, n_rounds, sync, every={"mlx_ops": 4})
        peak = 2 * PEAK_N**3 / best["matmul"] / 1e9
        row = dict(T=T, matmul_peak_gflops=peak, recurrent_tok_s=T / best["recurrent"],
                   recurrent_ms=best["recurrent"] * 1e3,
                   recurrent_compile_s=compile_s["recurrent"], chunked={})
        if "mlx_ops" in best:
            row["mlx_ops_tok_s"] = T / best["mlx_ops"]
            row["mlx_ops_ms"] = best["mlx_ops"] * 1e3
        if mesh is not None:
            row.update(split_recurrent_tok_s=T / best["split_recurrent"],
                       split_recurrent_ms=best["split_recurrent"] * 1e3,
                       split_recurrent_compile_s=compile_s["split_recurrent"], split={})

        def entry(name, C, recurrent):
            t = best[name]
            gflops = chunked_flops(T, H, D, D, C) / t / 1e9
            e = dict(tok_s=T / t, ms=t * 1e3, compile_s=compile_s[name], gflops=gflops,
                     peak_fraction=gflops / peak, vs_recurrent=best[recurrent] / t)
            if "mlx_ops" in best:
                e["vs_mlx_ops"] = best["mlx_ops"] / t
            return e

        for C in chunk_sizes:
            row["chunked"][C] = entry(f"chunked{C}", C, "recurrent")
            if mesh is not None:
                row["split"][C] = entry(f"split{C}", C, "split_recurrent")
        rows.append(row)

    decode = []
    for Bd in (1, 32):
        rng = np.random.default_rng(1)
        q, k = (ops.l2norm(jnp.asarray(rng.standard_normal((Bd, H, D), np.float32)))
                for _ in range(2))
        v = jnp.asarray(rng.standard_normal((Bd, H, D), np.float32))
        g = -jnp.asarray(rng.uniform(0, 1, (Bd, H, D)).astype(np.float32))
        beta = jnp.full((Bd, H), 0.5, jnp.float32)
        state = jnp.zeros((Bd, H, D, D), jnp.float32)
        t0 = time.perf_counter()
        compiled = jax.jit(ops.kda_decode).lower(q, k, v, g, beta, state).compile()
        comp = time.perf_counter() - t0
        runs = {"ours": lambda: compiled(q, k, v, g, beta, state)}
        sync = {"ours": jax.block_until_ready}
        if have_mlx:
            import mlx.core as mx
            from mlx_lm.models.gated_delta import gated_delta_update

            mq, mk, mv = (mx.array(np.asarray(z)) for z in (q[:, None], k[:, None], v[:, None]))
            ma = mx.array(rng.standard_normal((Bd, 1, H, D), np.float32))
            mb = mx.array(rng.standard_normal((Bd, 1, H), np.float32))
            mA, mdt = mx.zeros((H, 1)), mx.zeros((H, D))
            ms = mx.zeros((Bd, H, D, D))

            def run_m():
                out = gated_delta_update(mq, mk, mv, ma, mb, mA, mdt, ms, use_kernel=False)
                mx.eval(*out)
                return out

            runs["mlx_ops"], sync["mlx_ops"] = run_m, lambda o: o
        best = _interleaved_best(runs, 30, sync)
        entry = dict(B=Bd, ours_ms=best["ours"] * 1e3, ours_compile_s=comp)
        if "mlx_ops" in best:
            entry["mlx_ops_ms"] = best["mlx_ops"] * 1e3
        decode.append(entry)

    return dict(
        machine=dict(platform=platform.platform(), backend=jax.default_backend(),
                     jax=jax.__version__),
        shape=dict(B=B, H=H, Dk=D, Dv=D, chunk_sizes=list(chunk_sizes), devices=devices),
        prefill=rows,
        decode=decode,
    )


def _print_kda(res: dict) -> None:
    s = res["shape"]
    print(f"KDA prefill  B={s['B']} H={s['H']} Dk=Dv={s['Dk']}  backend="
          f"{res['machine']['backend']}  (% peak: of an f32 {PEAK_N}^2 matmul timed in the "
          f"same rounds)")
    if s["devices"] > 1:
        print(f"'/{s['devices']}': heads split over {s['devices']} CPU devices (shard_map); "
              f"its 'vs recurrent' is against the recurrent kernel split the same way")
    hdr = (f"{'T':>6} | {'kernel':>12} | {'tok/s':>8} | {'ms':>8} | {'vs recurrent':>12} | "
           f"{'vs mlx-lm':>9} | {'GFLOP/s':>7} | {'% peak':>6} | {'compile s':>9}")
    print(hdr)
    print("-" * len(hdr))
    def chunked_line(T, label, e):
        vs_mlx = f"{e['vs_mlx_ops']:8.1f}x" if "vs_mlx_ops" in e else f"{'-':>9}"
        print(f"{T:>6} | {label:>12} | {e['tok_s']:8.0f} | {e['ms']:8.1f} | "
              f"{e['vs_recurrent']:11.2f}x | {vs_mlx} | {e['gflops']:7.1f} | "
              f"{100 * e['peak_fraction']:5.1f}% | {e['compile_s']:9.2f}")

    def recurrent_line(T, label, tok_s, ms, compile_s):
        print(f"{T:>6} | {label:>12} | {tok_s:8.0f} | {ms:8.1f} | {'1.00x':>12} | {'':>9} | "
              f"{'':>7} | {'':>6} | {compile_s:9.2f}")

    n = s["devices"]
    for r in res["prefill"]:
        T = r["T"]
        for C, e in r["chunked"].items():
            chunked_line(T, f"chunked {C}", e)
        recurrent_line(T, "recurrent", r["recurrent_tok_s"], r["recurrent_ms"],
                       r["recurrent_compile_s"])
        for C, e in r.get("split", {}).items():
            chunked_line(T, f"chunked {C} /{n}", e)
        if "split_recurrent_tok_s" in r:
            recurrent_line(T, f"recurrent /{n}", r["split_recurrent_tok_s"],
                           r["split_recurrent_ms"], r["split_recurrent_compile_s"])
        if "mlx_ops_tok_s" in r:
            print(f"{r['T']:>6} | {'mlx-lm ops':>12} | {r['mlx_ops_tok_s']:8.0f} | "
                  f"{r['mlx_ops_ms']:8.1f} |")
        print(f"{r['T']:>6} | {'matmul peak':>12} | {'':>8} | {'':>8} | {'':>12} | {'':>9} | "
              f"{r['matmul_peak_gflops']:7.1f} |")
    print()
    print(f"KDA decode (one token per request)\n{'B':>4} | {'ours ms/step':>12} | "
          f"{'mlx-lm ops ms/step':>18} | {'ratio':>6} | compile s")
    for d in res["decode"]:
        if "mlx_ops_ms" in d:
            mlx_ms = f"{d['mlx_ops_ms']:18.3f} | {d['mlx_ops_ms'] / d['ours_ms']:5.1f}x"
        else:
            mlx_ms = f"{'-':>18} | {'':>6}"
        print(f"{d['B']:>4} | {d['ours_ms']:12.3f} | {mlx_ms} | {d['ours_compile_s']:.2f}")


# --------------------------------------------------------------------------------------------
# serve: the engine against mlx-lm (and transformers)
# --------------------------------------------------------------------------------------------


def serve_config():
    """The serve benchmark's model: 8 layers (6 KDA + 2 MLA), hidden 256, MoE 8 experts top-2
    with a shared expert after a dense first layer. Small, because MLX's Linux CPU wheel links a
    slow reference BLAS (ratios still hold)."""
    from hybridattn.config import KimiLinearConfig

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
"""Issue 20's target: a 24-token prefill costs at most 1/25 of a 1024-token one."""

COMPILE_LAYERS = (4, 12, 27)
"""Layer counts of ``bench serve``'s compile-time rows (``--quick``: 4 and 12)."""


def _median(xs) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def _capture_steps(engine) -> dict:
    """Spy on ``engine``'s jitted calls: the returned dict gets, for the first prefill and
    the first decode step it runs, ``(fn, params, state, batch)`` with the state copied
    before the step donates it and the batch already on the device, for ``_step_alone``.
    ``del engine._call`` ends the spying. The copies cost time: spy on an untimed run."""
    from hybridattn.backend import ForwardMode

    captured: dict = {}
    call = engine._call

    def spy(fn, *args, **kwargs):
        if fn is engine._jit.step:
            params, state, batch = args
            kind = "decode" if batch.forward_mode == ForwardMode.DECODE else "prefill"
            if kind not in captured:
                captured[kind] = (fn, params, jax.tree.map(lambda x: x.copy(), state),
                                  jax.device_put(batch), 1)
        elif fn in engine._jit._decode.values() and "decode" not in captured:
            # a multi-step decode: (batch, stop ids, limits); it runs max(limits) steps
            params, state, *rest = args
            captured["decode"] = (fn, params, jax.tree.map(lambda x: x.copy(), state),
                                  jax.device_put(tuple(rest)), int(np.max(rest[2])))
        return call(fn, *args, **kwargs)

    engine._call = spy
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
    from hybridattn.backend import ForwardMode

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
    from hybridattn.engine import Engine

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
    del engine._call  # the spy
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
                           **{f: _median([x[f] for x in samples[k]])
                              for f in ("step_s", "host_s", "wait_s", "exposed_s")},
                           device_s=_median(alone), device_runs=len(alone))
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
    products alone of ``small`` tokens (``serve_anchors.products_step_seconds``), the least
    the small prefill can cost on this backend."""
    from hybridattn import serve_anchors
    from hybridattn.engine import Engine

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
    small_s, large_s = _median(times[small]), _median(times[large])
    # the small prefill's matrix products alone, on exactly its tokens (no bucket padding)
    products_s = serve_anchors.products_step_seconds(config, small)
    return dict(small_tokens=small, large_tokens=large, rounds=rounds, small_s=small_s,
                large_s=large_s, small_fraction=small_s / large_s,
                small_products_s=products_s, large_over_small_products=large_s / products_s,
                large_over_small=large_s / small_s, token_ratio=large / small,
                target_large_over_small=SMALL_PREFILL_TARGET,
                holds=large_s / small_s >= SMALL_PREFILL_TARGET,
                token_buckets=list(engine.token_buckets), kv_buckets=list(engine.kv_buckets),
                bucket_compile_s=buckets)


def _compile_vs_layers(layers) -> list[dict]:
    """For each layer count ``n``, ``KimiLinearConfig.tiny(num_hidden_layers=n)`` (the
    released 3 KDA : 1 MLA pattern): seconds to trace, lower and XLA-compile the engine's
    step for its smallest prefill bucket and its decode bucket (those ``Engine.warmup``
    compiles: one request, one token), with every layer unrolled (``scan_layers=False``,
    the step before layer scans) and with the repeated layers scanned (the default)."""
    from hybridattn.backend import ForwardMode
    from hybridattn.config import KimiLinearConfig
    from hybridattn.engine import Engine
    from hybridattn.models import kimi_linear as M
    from hybridattn.scheduler import bucket
    from hybridattn.serving import WorkItem, make_worker_batch

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
                    [WorkItem(1, first, [1])], vocab_size=cfg.vocab_size,
                    max_context_len=e.max_context_len, forward_mode=mode, num_requests=1,
                    num_tokens=tokens, kv_width=W, max_extend_len=Q,
                    snapshot_chunk=e.scheduler.chunk_size)
                t0 = time.perf_counter()
                traced = e._jit.step.trace(e.params, e.state, batch)
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
from hybridattn.backend import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear as M
from hybridattn.scheduler import bucket
from hybridattn.serving import WorkItem, make_worker_batch

cfg = KimiLinearConfig.tiny(num_hidden_layers=int(sys.argv[1]))
e = E.Engine(cfg, M.init_params(cfg, jax.random.key(0)), max_running_requests=1,
             max_context_len=64, num_token_slots=65, prefix_cache=False)
step = e._jit.step if hasattr(e, "_jit") else E._step  # a module-level jit before 2026-12-02
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
(``_compile_vs_layers``' buckets), on ``KimiLinearConfig.tiny(num_hidden_layers=argv[1])``."""


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


def _compile_against(baseline: str, layers: int, rounds: int) -> dict:
    """The step's compile seconds on ``baseline`` (a checkout of another revision) and on this
    checkout, each in a fresh process, ``rounds`` rounds (which goes first alternates):
    medians, and the paired ratios ours / baseline (median, min, max)."""
    import hybridattn

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
                rounds=rounds, baseline_s=_median(total["baseline"]), ours_s=_median(total["ours"]),
                runs=runs, ratio=_median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def bench_serve(batch_sizes=(1, 8, 32), prompt_len: int = 64, new_tokens: int = 16,
                repeats: int = 2, transformers: bool = True, config=None,
                progress: bool = False, compile_layers=COMPILE_LAYERS,
                small_prefill: tuple[int, int] | None = (24, 1024),
                device_rounds: int = 20, decode_steps: int | None = None,
                compile_baseline: str | None = None, compile_rounds: int = 3) -> dict:
    """Run the serve benchmark (see the module docstring). ``decode_steps``: our engine's
    decode steps per dispatch (None: its default). ``compile_layers``: the layer
    counts of the compile-time rows (empty: none); ``small_prefill``: the (small, large)
    prompt lengths whose prefill steps are compared (None: not measured);
    ``device_rounds``: runs of the decode step alone (a quarter of them, at least 3, for
    the prefill step); ``compile_baseline``: a checkout whose step's compile time the largest
    of ``compile_layers`` is compared with (``_compile_against``, ``compile_rounds``
    rounds)."""
    from hybridattn import serve_anchors as A
    from hybridattn.models import kimi_linear as M

    config = config or serve_config()
    params = M.init_params(config, jax.random.key(0))
    bandwidth, peak = A.memory_bandwidth_gbs(), A.peak_gflops(PEAK_N)
    res: dict = dict(machine=_machine(), config=config.to_dict(), prompt_len=prompt_len,
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
        res["compile_vs_layers"] = _compile_vs_layers(compile_layers)
    if compile_baseline:
        res["compile_baseline"] = _compile_against(compile_baseline,
                                                   max(compile_layers or COMPILE_LAYERS),
                                                   compile_rounds)
    return res


# --------------------------------------------------------------------------------------------
# prefix: the hybrid prefix cache
# --------------------------------------------------------------------------------------------


def _prefix_engine(config, params, cache: bool, ctx: int):
    from hybridattn.engine import Engine

    R = 16
    return Engine(config, params, max_running_requests=R, max_context_len=ctx,
                  num_token_slots=R * ctx + 1, chunked_prefill_size=256, chunk_size=64,
                  prefix_cache=cache, snapshot_interval=256, num_snapshot_slots=129,
                  request_buckets=(1, 4, R), token_buckets=(64, 256 + R),
                  kv_buckets=(ctx,))


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


def bench_serve_mesh(data: int, tensor: int, batch: int = 2, prompt_len: int = 32,
                     new_tokens: int = 4) -> dict:
    """``serve --mesh``: the sharded step on a ``data x tensor`` mesh, ``batch`` requests of
    ``prompt_len`` tokens per data shard, one prefill and ``new_tokens - 1`` decodes."""
    from hybridattn import sharding
    from hybridattn.backend import ForwardMode
    from hybridattn.models import kimi_linear
    from hybridattn.pools import alloc_reqs_or_raise
    from hybridattn.serving import ServingState, WorkItem, make_worker_batch, step

    config = serve_config()
    mesh = sharding.make_mesh(data, tensor)
    params = kimi_linear.init_params(config, jax.random.key(0))
    L = prompt_len + new_tokens
    slots = batch * L + 1
    sp = sharding.shard_params(params, config, mesh)
    state = ServingState.create(config, max_running_requests=batch * data, max_context_len=L,
                                num_token_slots=slots * data, mesh=mesh)
    run = sharding.ShardedStep(config, mesh)
    state, rows = run.alloc_rows(state, [batch] * data)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (data, batch, prompt_len)).tolist()
    pre = dict(vocab_size=config.vocab_size, max_context_len=L, num_requests=batch,
               num_tokens=batch * prompt_len, kv_width=L, max_extend_len=prompt_len)
    dec = dict(pre, num_tokens=batch, max_extend_len=1, forward_mode=ForwardMode.DECODE)
    dev = mesh.devices.flat[0]

    def per_device(tree):
        leaves = jax.tree.leaves(tree)
        return (sum(x.nbytes for x in leaves),
                sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards
                    if sh.device == dev))

    res: dict = {"mesh": [data, tensor], "devices": data * tensor, "batch_per_shard": batch,
                 "prompt_len": prompt_len, "new_tokens": new_tokens}
    for name, tree in (("params", sp), ("pools", state.replace(rng=None))):
        total, per = per_device(tree)
        res[f"{name}_bytes"], res[f"{name}_bytes_per_device"] = total, per
        res[f"{name}_fraction_per_device"] = per / total
    b = run.make_batch([[WorkItem(r, 0, p) for r, p in zip(rows[k], prompts[k], strict=False)]
                        for k in range(data)], **pre)
    tokens, compiled, compile_s, step_s = [], {}, {}, {"prefill": [], "decode": []}
    for i in range(new_tokens):
        kind = "prefill" if i == 0 else "decode"
        if kind not in compiled:
            t0 = time.perf_counter()
            compiled[kind] = run.lower(sp, state, b).compile()
            compile_s[kind] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, out = compiled[kind](sp, state, b)
        nxt = np.asarray(out.next_token_ids)
        step_s[kind].append(time.perf_counter() - t0)
        tokens.append(nxt)
        b = run.make_batch([[WorkItem(r, prompt_len + i, [int(nxt[k, j])])
                             for j, r in enumerate(rows[k])] for k in range(data)], **dec)
    res["compile_s"] = compile_s
    res["step_s"] = {k: min(v) for k, v in step_s.items() if v}
    # the unsharded step on data shard 0's requests: same greedy tokens?
    ref = ServingState.create(config, max_running_requests=batch, max_context_len=L,
                              num_token_slots=slots)
    pool, _ = alloc_reqs_or_raise(ref.req_to_token_pool, batch)
    ref, one = ref.replace(req_to_token_pool=pool), jax.jit(step, donate_argnums=1)
    rb = make_worker_batch([WorkItem(r, 0, p)
                            for r, p in zip(rows[0], prompts[0], strict=True)], **pre)
    same = True
    for i in range(new_tokens):
        ref, out = one(params, ref, rb)
        got = np.asarray(out.next_token_ids)
        same &= got.tolist() == tokens[i][0].tolist()
        rb = make_worker_batch([WorkItem(r, prompt_len + i, [int(t)])
                                for r, t in zip(rows[0], got, strict=False)], **dec)
    res["greedy_tokens_equal_unsharded"] = bool(same)
    return res


def _print_serve_mesh(res: dict) -> None:
    d, t = res["mesh"]
    print(f"serve --mesh {d}x{t} ({res['devices']} CPU devices), {res['batch_per_shard']} "
          f"requests x {res['prompt_len']} tokens per data shard, {res['new_tokens']} new")
    for name in ("params", "pools"):
        print(f"  {name:6s} {res[f'{name}_bytes'] / 2**20:8.2f} MiB total, "
              f"{res[f'{name}_bytes_per_device'] / 2**20:8.2f} MiB per device "
              f"({res[f'{name}_fraction_per_device']:.3f} of total; 1/{res['devices']} = "
              f"{1 / res['devices']:.3f})")
    c, s = res["compile_s"], res["step_s"]
    print("  compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in c.items())
          + "; step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s.items()))
    print(f"  greedy tokens equal the unsharded step's: {res['greedy_tokens_equal_unsharded']}")


def bench_prefix(quick: bool = False, repeats: int = 3, progress: bool = False) -> dict:
    """The prefix-cache workloads (see the module docstring): per workload, the engine with
    and without the cache and the uncached parts served cold, timed in interleaved rounds.
    ``progress``: a bar of the workloads done."""
    from hybridattn.demo import demo_config
    from hybridattn.models import kimi_linear as M

    config = demo_config()
    params = M.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, config.vocab_size, 1024).tolist()
    shared = [[prefix + rng.integers(1, config.vocab_size, 32).tolist() for _ in range(16)]]
    # (a) what must be computed: the first prompt whole, then each one's 32 unique tokens
    shared_uncached = [[shared[0][0]] + [p[1024:] for p in shared[0][1:]]]
    res: dict = dict(machine=_machine(), config=config.to_dict(), workloads={})
    repeats = 1 if quick else repeats
    ctx_a, ctx_b = 1088, 512
    engines = {name: _prefix_engine(config, params, cache, ctx)
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


def _print_prefix(res: dict) -> None:
    cfg = res["config"]
    print(f"prefix: Kimi-Linear {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"f32; snapshot grid 256 tokens")
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


# --------------------------------------------------------------------------------------------
# longctx: one request at long context
# --------------------------------------------------------------------------------------------

LONGCTX_LENGTHS = (4096, 16384, 65536, 262144)
"""Prompt lengths of ``bench longctx`` (``--quick``: up to 65536)."""

LONGCTX_TARGETS = dict(prefill_len=65536, prefill_peak_bytes=1.5e9, prefill_s=90.0,
                       completes_len=262144, decode_len=65536, decode_floor_ratio=3.0)
"""The long-context targets (issue 18): a 64k prompt prefilled with a process peak of at most
1.5 GB in under 90 s; 256k completes; decode at 64k within 3x the bandwidth floor; peak memory
growing with the pools, not with chunk x context."""


def _mla_alone(mla, layer_ids, kv_pool, req_pool, rec_pool, rows, seq_lens, ext_lens, inputs,
               *, mode, kv_width, max_extend_len):
    """The MLA sub-backend alone, on the engine's pools and a batch's shapes: every MLA layer's
    ``forward_extend`` / ``forward_decode`` (new latents go to the sink, slot 0). Returns the
    outputs and the written pool (donate it, as the step does)."""
    from hybridattn.backend import ForwardBatch

    T = inputs["q_nope"].shape[0]
    fb = ForwardBatch(input_ids=jnp.zeros((T,), jnp.int32), req_pool_indices=rows,
                      seq_lens=seq_lens, extend_seq_lens=ext_lens,
                      out_cache_loc=jnp.zeros((T,), jnp.int32), req_to_token_pool=req_pool,
                      token_to_kv_pool=kv_pool, recurrent_state_pool=rec_pool,
                      kv_width=kv_width, max_extend_len=max_extend_len, forward_mode=mode)
    backend = mla.with_forward_metadata(mla.get_forward_metadata(fb))
    outs = []
    for layer in layer_ids:
        out, fb = backend(layer, fb, **inputs)
        outs.append(out)
    return outs, fb.token_to_kv_pool


def _mla_runner(engine, row: int, seq_len: int, ext: int, kv_width: int,
                decode: bool) -> Callable[[], object]:
    """A call of the jitted MLA backend (all MLA layers) for one request of ``seq_len``
    tokens, ``ext`` of them new, attending over ``kv_width`` positions, that returns once its
    outputs are ready. It runs on a copy of the engine's latent pool (donated from call to
    call, so the engine's pool stays whole) and on the engine's tables as they are at each
    call, so it can run between the engine's steps."""
    from hybridattn.backend import ForwardMode

    cfg, st = engine.config, engine.state
    mla = st.backend.full_attn_backend
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    rng = np.random.default_rng(0)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)

    T = ext
    inputs = dict(q_nope=rnd(T, H, cfg.qk_nope_head_dim), q_pe=rnd(T, H, dr), c_kv=rnd(T, r),
                  k_pe=rnd(T, dr), w_kc=rnd(H, cfg.qk_nope_head_dim, r),
                  w_vc=rnd(H, cfg.v_head_dim, r))
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    fn = jax.jit(_mla_alone, static_argnums=(0, 1), donate_argnums=(2,),
                 static_argnames=("mode", "kv_width", "max_extend_len"))
    pool = [jax.tree.map(jnp.copy, st.token_to_kv_pool)]
    args = (jnp.asarray([row], jnp.int32), jnp.asarray([seq_len], jnp.int32),
            jnp.asarray([ext], jnp.int32))

    def run():
        st = engine.state
        outs, pool[0] = fn(mla, tuple(mla.layer_ids), pool[0], st.req_to_token_pool,
                           st.recurrent_state_pool, *args, inputs, mode=mode,
                           kv_width=kv_width, max_extend_len=ext)
        return jax.block_until_ready(outs)

    return run


def _time_mla(engine, row: int, seq_len: int, ext: int, kv_width: int, decode: bool,
              rounds: int = 3) -> float:
    """Best seconds of the jitted MLA backend call (all MLA layers) for one request of
    ``seq_len`` tokens, ``ext`` of them new, attending over ``kv_width`` positions."""
    run = _mla_runner(engine, row, seq_len, ext, kv_width, decode)
    return _interleaved_best({"mla": run}, rounds, {"mla": lambda out: out})["mla"]


def _precompile_longctx(engine, prompt_len: int, new_tokens: int) -> None:
    """Compile every step shape one request of ``prompt_len`` + ``new_tokens`` meets (each
    prefill chunk's ``(B, T, W, Q)`` bucket, as ``Scheduler.plan`` picks it, and the decode
    buckets) by running the step on a batch that names a free row: it fails its fit check, so
    it runs as padding and writes only the sinks. The engine's own steps then compile nothing
    (``EngineStats.compiled_buckets`` tells)."""
    from hybridattn.backend import ForwardMode
    from hybridattn.scheduler import bucket
    from hybridattn.serving import WorkItem, make_worker_batch

    e, C, tb = engine, engine.chunked_prefill_size, engine.token_buckets
    row = 1  # free while the engine is idle
    shapes = set()
    for start in range(0, prompt_len, C):
        n = min(C, prompt_len - start)
        T = bucket(n, tb, "tokens")
        shapes.add((ForwardMode.EXTEND, 1, T, bucket(start + n, e.kv_buckets, "width"),
                    min(T, bucket(n, tb, "extend")), start, n))
    for seq in range(prompt_len + 1, prompt_len + new_tokens):
        shapes.add((ForwardMode.DECODE, 1, 1, bucket(seq, e.kv_buckets, "width"), 1, seq - 1, 1))
    done = set()
    for mode, B, T, W, Q, start, n in sorted(shapes):
        if (mode, B, T, W, Q) in done:
            continue
        done.add((mode, B, T, W, Q))
        batch = make_worker_batch(
            [WorkItem(row, start, [1] * n)], vocab_size=e.config.vocab_size,
            max_context_len=e.max_context_len, forward_mode=mode, num_requests=B, num_tokens=T,
            kv_width=W, max_extend_len=Q, snapshot_chunk=e.scheduler.chunk_size)
        e.state, out = e._call(e._jit.step, e.params, e.state, batch)  # counted as its own
        assert not bool(out.ok), "the warm-up batch was meant to fail its fit check"


def _peak_rss(reset: bool = False) -> int:
    """This process's peak resident bytes (Linux ``VmHWM``; ``reset`` first sets the peak to
    the current size through ``/proc/self/clear_refs``); elsewhere ``ru_maxrss``."""
    import resource

    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _longctx_one(prompt_len: int, new_tokens: int, chunked_prefill_size: int | None,
                 mla_rounds: int = 3) -> dict:
    """One request of ``prompt_len`` tokens + ``new_tokens`` on the tiny config, in this
    process (``bench_longctx`` runs each length in a fresh one): wall and steady prefill,
    decode step, peaks of this process's resident memory, and the MLA backend's share."""
    import resource

    from hybridattn.config import KimiLinearConfig
    from hybridattn.engine import Engine
    from hybridattn.models import kimi_linear as M
    from hybridattn.scheduler import bucket

    def rss() -> int:  # peak resident bytes of this process so far (Linux: KiB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    config = KimiLinearConfig.tiny()
    params = M.init_params(config, jax.random.key(0))
    ctx = prompt_len + new_tokens
    kw = {} if chunked_prefill_size is None else dict(chunked_prefill_size=chunked_prefill_size)
    # Synchronous rounds: a decode step and the MLA call timed after it alternate, and an
    # overlapped engine would have its next step on the device during that call.
    engine = Engine(config, params, max_running_requests=1, max_context_len=ctx,
                    num_token_slots=ctx + 1, prefix_cache=False, overlap=False, **kw)
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, prompt_len).tolist()
    t0 = time.perf_counter()
    _precompile_longctx(engine, prompt_len, new_tokens)
    compile_s = time.perf_counter() - t0
    compile_peak = rss()
    base = _peak_rss(reset=True)
    t0 = time.perf_counter()
    stream = engine.stream([prompt], new_tokens)
    tokens = [next(stream)[1]]
    wall_prefill = time.perf_counter() - t0
    peak_prefill, peak_prefill_alone = rss(), _peak_rss()
    s = engine.stats
    prefill = dict(steady_s=s.prefill_seconds, steady_tokens=s.prefill_tokens,
                   compile_s=s.compile_seconds, compiled=len(s.compiled_buckets))
    # The MLA backend alone on the prefill's chunks: per width bucket, one chunk's call at
    # the mean length of that bucket's chunks (a blockwise form skips the blocks past a
    # request's length, so the bucket's widest chunk would overstate it) times its chunks.
    C = engine.chunked_prefill_size
    row = engine.scheduler.running[0].row
    widths: dict[int, list[int]] = {}
    for end in range(C, prompt_len + C, C):
        end = min(end, prompt_len)
        widths.setdefault(bucket(end, engine.kv_buckets, "width"), []).append(end)
    mla_prefill = 0.0
    for W, ends in widths.items():
        seq = max(round(sum(ends) / len(ends)), min(C, prompt_len))
        mla_prefill += len(ends) * _time_mla(engine, row, seq, min(C, seq), W, False,
                                             mla_rounds)
    # Decode: after each step (one request: one token, one step) one call of the MLA backend
    # alone on the decode shapes, so a noisy neighbour slows both alike; the MLA share is the
    # median call over the median step. (The best of five calls after the decode, over the
    # steps' mean, left a part outside the MLA call that seemed to grow by ~2 ms from 4k to
    # 64k; a profile of the step shows no op outside the MLA call that grows with the width.)
    W_dec = bucket(ctx, engine.kv_buckets, "width")
    mla_run = _mla_runner(engine, row, ctx, 1, W_dec, True)
    mla_run()  # warm-up
    steps, mla_calls, last = [], [], engine.stats.decode_seconds
    for _, t in stream:
        tokens.append(t)
        steps.append(engine.stats.decode_seconds - last)
        last = engine.stats.decode_seconds
        t0 = time.perf_counter()
        mla_run()
        mla_calls.append(time.perf_counter() - t0)
    s = engine.stats
    decode_steps = s.decode_tokens
    decode_s = s.decode_seconds / max(decode_steps, 1)
    decode_median = float(np.median(steps)) if decode_steps else None
    if not mla_calls:  # no decode step: the call alone (the row is free, the latents stay)
        mla_calls = [_time_mla(engine, row, ctx, 1, W_dec, True, max(mla_rounds, 5))]
    mla_decode = float(np.median(mla_calls))
    return dict(
        prompt_len=prompt_len, new_tokens=new_tokens, chunked_prefill_size=C,
        kv_buckets=list(engine.kv_buckets), tokens=tokens, wall_prefill_s=wall_prefill,
        prefill_tok_s=prompt_len / wall_prefill,
        prefill_steady_s=prefill["steady_s"], prefill_steady_tokens=prefill["steady_tokens"],
        compile_s=compile_s, prefill_compiled=prefill["compiled"],
        prefill_compile_s=prefill["compile_s"],
        mla_prefill_s=mla_prefill, mla_prefill_share=mla_prefill / wall_prefill,
        decode_step_s=decode_s if decode_steps else None, decode_steps=decode_steps,
        decode_step_median_s=decode_median, mla_decode_s=mla_decode,
        mla_decode_share=mla_decode / decode_median if decode_steps else None,
        compile_peak_rss_bytes=compile_peak, base_rss_bytes=base,
        peak_prefill_rss_bytes=peak_prefill, prefill_alone_peak_rss_bytes=peak_prefill_alone,
        peak_rss_bytes=rss(),
        pool_bytes=engine.memory.pool_bytes, param_bytes=engine.memory.param_bytes,
        req_to_token_bytes=engine.memory.req_to_token_bytes,
        pool_bytes_per_token=engine.memory.mla_bytes_per_token,
    )


def _longctx_child(n: int, new_tokens: int, chunked_prefill_size: int | None,
                   mla_rounds: int, timeout_s: float) -> dict:
    """``_longctx_one`` in a fresh process (``python -m hybridattn.bench longctx --one N``):
    its row, or ``{"prompt_len": n, "failed": why}``."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "hybridattn.bench", "longctx", "--one", str(n),
           "--new-tokens", str(new_tokens), "--mla-rounds", str(mla_rounds)]
    if chunked_prefill_size is not None:
        cmd += ["--chunked-prefill", str(chunked_prefill_size)]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return dict(prompt_len=n, failed=f"ran past {timeout_s:.0f} s")
    if out.returncode != 0:
        why = (f"exit {out.returncode}" if out.returncode > 0 else
               f"killed by signal {-out.returncode}" + (" (out of memory?)"
                                                        if out.returncode == -9 else ""))
        tail = out.stderr.strip().splitlines()[-1:] or [""]
        return dict(prompt_len=n, failed=f"{why}: {tail[0][:200]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def bench_longctx(lengths=LONGCTX_LENGTHS, new_tokens: int = 8,
                  chunked_prefill_size: int | None = None, timeout_s: float = 3600.0,
                  mla_rounds: int = 3, compare_chunk: int | None = None) -> dict:
    """Run ``bench longctx`` (see the module docstring): each length in a fresh Python process
    (``python -m hybridattn.bench longctx --one N``), so its peak resident memory is its own;
    one that fails or runs past ``timeout_s`` is reported with its reason. ``compare_chunk``:
    also run each length with that ``chunked_prefill_size`` (other query tiles and blocks)
    and report whether its greedy tokens are the same."""
    from hybridattn import serve_anchors as A
    from hybridattn.config import KimiLinearConfig

    config = KimiLinearConfig.tiny()
    bandwidth = A.memory_bandwidth_gbs()
    res: dict = dict(machine=_machine(), config=config.to_dict(), new_tokens=new_tokens,
                     bandwidth_gbs=bandwidth, targets=LONGCTX_TARGETS, rows=[])
    for n in lengths:
        row = _longctx_child(n, new_tokens, chunked_prefill_size, mla_rounds, timeout_s)
        if "failed" in row:
            res["rows"].append(row)
            continue
        floor = A.decode_bytes_per_step(config, 1, n + new_tokens // 2)
        row["decode_floor_bytes"] = floor["total"]
        row["decode_floor_s"] = floor["total"] / (bandwidth * 1e9)
        if row["decode_step_s"]:
            row["decode_floor_ratio"] = row["decode_step_s"] / row["decode_floor_s"]
        if compare_chunk is not None:  # the same request with another blocking
            other = _longctx_child(n, new_tokens, compare_chunk, 1, timeout_s)
            row["compare_chunk"] = dict(chunked_prefill_size=compare_chunk,
                                        failed=other.get("failed"),
                                        same_tokens=other.get("tokens") == row["tokens"])
        res["rows"].append(row)
    res["verdict"] = _longctx_verdict(res)
    return res


def _longctx_verdict(res: dict) -> dict:
    """Each target: measured figure and whether it holds (None: its length did not run)."""
    t = res["targets"]
    by = {r["prompt_len"]: r for r in res["rows"]}
    ok = [r for r in res["rows"] if "failed" not in r]
    out: dict = {}
    r = by.get(t["prefill_len"])
    if r is not None and "failed" not in r:
        out["prefill_64k_peak"] = dict(bytes=r["peak_prefill_rss_bytes"],
                                       holds=r["peak_prefill_rss_bytes"]
                                       <= t["prefill_peak_bytes"])
        out["prefill_64k_time"] = dict(s=r["wall_prefill_s"],
                                       holds=r["wall_prefill_s"] < t["prefill_s"])
    elif r is not None:
        out["prefill_64k_peak"] = out["prefill_64k_time"] = dict(failed=r["failed"], holds=False)
    r = by.get(t["completes_len"])
    if r is not None:
        out["completes_256k"] = dict(holds="failed" not in r, failed=r.get("failed"))
    r = by.get(t["decode_len"])
    if r is not None and r.get("decode_floor_ratio") is not None:
        out["decode_64k_floor"] = dict(ratio=r["decode_floor_ratio"],
                                       holds=r["decode_floor_ratio"] <= t["decode_floor_ratio"])
    if len(ok) >= 2:
        a, b = ok[-2], ok[-1]
        slope = ((b["prefill_alone_peak_rss_bytes"] - a["prefill_alone_peak_rss_bytes"])
                 / (b["prompt_len"] - a["prompt_len"]))
        pool = (b["pool_bytes"] - a["pool_bytes"]) / (b["prompt_len"] - a["prompt_len"])
        cfg = res["config"]
        # materialised scores of one chunk against every key: chunk x heads x 4 B per key
        scores = a["chunked_prefill_size"] * cfg["num_attention_heads"] * 4
        out["peak_linear_in_pools"] = dict(
            peak_bytes_per_token=slope, pool_bytes_per_token=pool,
            chunk_scores_bytes_per_token=scores, between=[a["prompt_len"], b["prompt_len"]],
            holds=slope < scores)
    return out


def _print_longctx(res: dict) -> None:
    mb = 1e6
    cfg = res["config"]
    print(f"longctx: one request, KimiLinearConfig.tiny() ({cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, f32), {res['new_tokens']} new tokens; bandwidth "
          f"{res['bandwidth_gbs']:.1f} GB/s; each length in a fresh process")
    hdr = (f"{'prompt':>7} | {'prefill s':>9} | {'compile s':>9} | {'tok/s':>7} | "
           f"{'MLA share':>9} | {'peak MB':>7} | {'+prefill':>8} | {'pools MB':>8} | "
           f"{'params MB':>9} | {'decode ms':>9} | {'floor ms':>8} | {'x floor':>7} | "
           f"{'MLA share':>9}")
    print(f"{'':>7} | {'prefill':^51} | {'memory':^41} | {'decode step':^41}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        if "failed" in r:
            print(f"{r['prompt_len']:>7} | failed: {r['failed']}")
            continue
        dec = r["decode_step_s"]
        print(f"{r['prompt_len']:>7} | {r['wall_prefill_s']:9.1f} | "
              f"{r['compile_s']:9.1f} | {r['prefill_tok_s']:7.0f} | "
              f"{r['mla_prefill_share']:8.0%} | {r['peak_prefill_rss_bytes'] / mb:7.0f} | "
              f"{(r['prefill_alone_peak_rss_bytes'] - r['base_rss_bytes']) / mb:8.0f} | "
              f"{r['pool_bytes'] / mb:8.1f} | {r['param_bytes'] / mb:9.2f} | "
              f"{1e3 * (dec or 0):9.2f} | {1e3 * r['decode_floor_s']:8.3f} | "
              f"{r.get('decode_floor_ratio', 0):6.1f}x | {r['mla_decode_share'] or 0:8.0%}")
    print("prefill s: wall time to the first token, every step shape compiled beforehand "
          "(compile s);\nMLA share: the jitted MLA backend call alone on the same shapes, "
          "over the step(s)\n(decode: the median call, one after each step, over the median "
          "step);\npeak: the process's peak RSS up to the first token (compilation "
          "included); +prefill: how far\nthe peak rose during the prefill itself; floor: bytes "
          "of weights, KDA state and the request's\nlatents one decode step reads, over the "
          "bandwidth")
    v = res.get("verdict", {})
    t = res["targets"]

    def mark(e):
        return "n/a" if e is None else ("holds" if e.get("holds") else "MISSED")

    e = v.get("prefill_64k_peak")
    print(f"target 64k prefill peak <= {t['prefill_peak_bytes'] / 1e9:.1f} GB: {mark(e)}"
          + (f" ({e['bytes'] / 1e9:.2f} GB)" if e and "bytes" in e else ""))
    e = v.get("prefill_64k_time")
    print(f"target 64k prefill < {t['prefill_s']:.0f} s: {mark(e)}"
          + (f" ({e['s']:.1f} s)" if e and "s" in e else ""))
    e = v.get("completes_256k")
    print(f"target 256k completes: {mark(e)}" + (f" ({e['failed']})" if e and e.get("failed")
                                                  else ""))
    e = v.get("decode_64k_floor")
    print(f"target 64k decode <= {t['decode_floor_ratio']:.0f}x floor: {mark(e)}"
          + (f" ({e['ratio']:.1f}x)" if e else ""))
    for r in res["rows"]:
        c = r.get("compare_chunk")
        if c:
            print(f"{r['prompt_len']} tokens, chunked_prefill_size {r['chunked_prefill_size']} "
                  f"vs {c['chunked_prefill_size']}: "
                  + (f"failed ({c['failed']})" if c["failed"] else
                     "same greedy tokens" if c["same_tokens"] else "DIFFERENT tokens"))
    e = v.get("peak_linear_in_pools")
    if e:
        print(f"target peak linear in the pools: {mark(e)} (peak grows "
              f"{e['peak_bytes_per_token']:.0f} B/token between {e['between'][0]} and "
              f"{e['between'][1]}; pools {e['pool_bytes_per_token']:.0f} B/token; one chunk's "
              f"scores would be {e['chunk_scores_bytes_per_token']} B/token)")


def _machine() -> dict:
    return dict(platform=platform.platform(), python=platform.python_version(),
                jax=jax.__version__, backend=jax.default_backend(),
                devices=len(jax.devices()))


def _print_serve(res: dict) -> None:
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
          "backend: serve_anchors.products_step) are\nthe least a step that runs them can "
          "take here.")
    _print_serve_steps(res)


def _ms(x) -> str:
    return f"{'-':>6}" if x is None else f"{1e3 * x:6.2f}"


def _print_serve_steps(res: dict) -> None:
    """The columns of where our step's time goes (absent from results saved before them)."""
    rows = [r for r in res["rows"] if "per_step" in r["ours"]]
    if rows:
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
    sp = res.get("small_prefill")
    if sp:
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
        if sp.get("small_products_s") is not None:  # JSON of older runs lack it
            print(f"  the matrix products alone of {sp['small_tokens']} tokens (no padding) take "
                  f"{1e3 * sp['small_products_s']:.1f} ms, 1/"
                  f"{sp['large_over_small_products']:.1f} of the large prefill")
    cl = res.get("compile_vs_layers")
    if cl:
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
    cb = res.get("compile_baseline")
    if cb:
        print(f"\ncompile s of the step against a baseline checkout ({cb['baseline']}, "
              f"{cb['revision'] or 'revision unknown'}), {cb['layers']} layers, the same two "
              f"buckets,\neach in a fresh process, {cb['rounds']} rounds, the first "
              f"alternating (medians): "
              f"baseline {cb['baseline_s']:.2f}, ours {cb['ours_s']:.2f}; ours / baseline "
              f"{cb['ratio']:.3f} (paired, {cb['ratio_min']:.3f}-{cb['ratio_max']:.3f}; "
              f"target 1/3 or less: {'holds' if cb['ratio_max'] <= 1 / 3 else 'MISSED'})")
    if res.get("compilation_cache_dir"):
        print(f"note: JAX's compilation cache is on ({res['compilation_cache_dir']}): compile "
              "times may be cache loads")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kda", help="KDA kernels: chunked vs recurrent vs mlx-lm")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.add_argument("--quick", action="store_true", help="T in {1024, 4096} only, fewer repeats")
    k.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64],
                   help="chunk sizes of kda_chunked to measure")
    k.add_argument("--mlx-max-t", type=int, default=4096,
                   help="longest T to run mlx-lm's ops path on (it is slow)")
    k.add_argument("--devices", type=int, default=None,
                   help="also run with the heads split over this many CPU devices "
                        "(default: 2 on a machine with 2 or more cores; 1 = off)")
    sv = sub.add_parser("serve", help="the serving engine vs mlx-lm (and transformers)")
    sv.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sv.add_argument("--quick", action="store_true", help="batch sizes 1 and 8, one repeat")
    sv.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    sv.add_argument("--prompt-len", type=int, default=64)
    sv.add_argument("--new-tokens", type=int, default=16)
    sv.add_argument("--decode-steps", type=int, default=None, metavar="N",
                    help="our engine's decode steps per dispatch (default: the engine's)")
    sv.add_argument("--mesh", default=None, metavar="DxT",
                    help="run the sharded step on a data x tensor mesh of CPU devices instead")
    sv.add_argument("--no-transformers", action="store_true",
                    help="skip transformers even when torch is installed")
    sv.add_argument("--compile-layers", type=int, nargs="*", default=None, metavar="N",
                    help="layer counts to time the step's compilation at (default: 4 12 27; "
                         "--quick: 4 12; none given: skip)")
    sv.add_argument("--compile-baseline", default=None, metavar="PATH",
                    help="a checkout of another revision: compile its step and ours for the "
                         "largest --compile-layers, each in a fresh process, and compare")
    sv.add_argument("--compile-rounds", type=int, default=3, metavar="N",
                    help="alternating rounds of --compile-baseline (default 3)")
    px = sub.add_parser("prefix", help="the hybrid prefix cache: with vs without, and ideals")
    px.add_argument("--json", action="store_true", help="print JSON instead of a table")
    px.add_argument("--quick", action="store_true", help="one timed round")
    lc = sub.add_parser("longctx", help="one request at 4k..256k: prefill, decode, peak memory")
    lc.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lc.add_argument("--quick", action="store_true", help="prompts up to 64k only")
    lc.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="prompt lengths (default: 4096 16384 65536 262144)")
    lc.add_argument("--new-tokens", type=int, default=8)
    lc.add_argument("--chunked-prefill", type=int, default=None,
                    help="the engine's chunked_prefill_size (default: the engine's)")
    lc.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds one length may take before it counts as not completed")
    lc.add_argument("--compare-chunk", type=int, default=None,
                    help="also run each length with this chunked_prefill_size and compare "
                         "the greedy tokens")
    lc.add_argument("--mla-rounds", type=int, default=3, help=argparse.SUPPRESS)
    lc.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child run
    for sp in (k, sv, px, lc):
        sp.add_argument("--plot", metavar="DIR",
                        help="also write the result as a PNG into DIR (matplotlib)")
        sp.add_argument("--from-json", metavar="FILE",
                        help="measure nothing: show (table, --json, --plot) a result this "
                             "command printed with --json")
    args = p.parse_args(argv)
    table = {"kda": _print_kda, "serve": _print_serve, "prefix": _print_prefix,
             "longctx": _print_longctx}[args.what]
    if args.from_json:
        try:
            with open(args.from_json) as fh:
                res = json.load(fh)
        except (OSError, ValueError) as e:
            p.error(f"--from-json {args.from_json!r}: {e}")
        return _emit(res, args.json, table, args.what, args.plot)
    if args.what == "longctx":
        if args.one is not None:  # one length, in this process: JSON on the last line
            print(json.dumps(_longctx_one(args.one, args.new_tokens, args.chunked_prefill,
                                          args.mla_rounds)))
            return 0
        lengths = args.lengths or [n for n in LONGCTX_LENGTHS if not args.quick or n <= 65536]
        res = bench_longctx(lengths, new_tokens=args.new_tokens,
                            chunked_prefill_size=args.chunked_prefill, timeout_s=args.timeout,
                            mla_rounds=args.mla_rounds, compare_chunk=args.compare_chunk)
        return _emit(res, args.json, table, args.what, args.plot)
    if args.what == "prefix":
        return _emit(bench_prefix(quick=args.quick, progress=True), args.json, table,
                     args.what, args.plot)
    if args.what == "serve" and args.mesh:
        if args.plot:
            p.error("--plot draws the unsharded serve table, not --mesh")
        try:
            data, tensor = (int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--mesh {args.mesh!r}: expected DATAxTENSOR, e.g. 2x4") from None
        jax.config.update("jax_num_cpu_devices", data * tensor)  # before JAX starts
        res = bench_serve_mesh(data, tensor, prompt_len=16 if args.quick else args.prompt_len,
                               new_tokens=3 if args.quick else 4)
        return _emit(res, args.json, _print_serve_mesh, args.what, None)
    if args.what == "serve":
        layers = args.compile_layers
        if layers is None:
            layers = COMPILE_LAYERS[:2] if args.quick else COMPILE_LAYERS
        if any(n < 2 for n in layers):
            p.error(f"--compile-layers {' '.join(map(str, layers))}: each must be at least 2 "
                    "(a hybrid model has a KDA and an MLA layer)")
        if args.compile_rounds < 1:
            p.error(f"--compile-rounds {args.compile_rounds}: must be at least 1")
        return _emit(bench_serve(batch_sizes=(1, 8) if args.quick else tuple(args.batch_sizes),
                                 prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                 repeats=1 if args.quick else 2,
                                 transformers=not args.no_transformers, progress=True,
                                 compile_layers=tuple(layers),
                                 device_rounds=10 if args.quick else 30,
                                 decode_steps=args.decode_steps,
                                 compile_baseline=args.compile_baseline,
                                 compile_rounds=args.compile_rounds),
                     args.json, table, args.what, args.plot)
    if args.what == "kda":
        devices = default_devices() if args.devices is None else args.devices
        if devices > 1:
            jax.config.update("jax_num_cpu_devices", devices)  # before JAX starts
            if jax.default_backend() != "cpu":  # the split rows are about CPU cores
                if args.devices is not None:
                    raise SystemExit("--devices splits heads over CPU devices: run with "
                                     "JAX_PLATFORMS=cpu")
                devices = 1
        return _emit(bench_kda(quick=args.quick, mlx_max_t=args.mlx_max_t,
                               chunk_sizes=tuple(args.chunk_sizes), devices=devices,
                               progress=True),
                     args.json, table, args.what, args.plot)
    return 0


def _emit(res: dict, as_json: bool, table: Callable[[dict], None], what: str,
          plot_dir: str | None) -> int:
    """Print a bench result as JSON or as its table; with ``plot_dir``, also write its plot
    there (the path goes to stderr, so ``--json`` stays parseable)."""
    if as_json:
        json.dump(res, sys.stdout, indent=2)
        print()
    else:
        table(res)
    if plot_dir:
        from hybridattn.bench_plots import PLOTS

        print(f"wrote {PLOTS[what](res, plot_dir)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
