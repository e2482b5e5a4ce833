"""Benchmarks: ours and an independent anchor side by side, in one run.

    python -m hybridattn.bench kda [--json] [--quick]

``kda``: for ``B=1, H=4, Dk=Dv=128`` and ``T`` in ``{1024, 4096, 16384}``, tokens/s of
``kda_chunked``, ``kda_recurrent`` and mlx-lm's ``gated_delta_update(use_kernel=False)`` (its
ops path, the one that runs on CPU) on the same inputs (gates included on both sides); decode
step time for ``B`` in ``{1, 32}``; compile times apart; achieved GFLOP/s of the chunked form and
its fraction of this machine's f32 matmul peak, measured in the same run.

Timings are the best of several runs after a warm-up; shared machines are noisy, so read the
ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import ops


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[object], object]) -> float:
    """Best wall time in seconds of ``repeats`` calls (after one warm-up call)."""
    sync(fn())
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """f32 ``n x n @ n x n`` throughput of XLA on this machine, in GFLOP/s."""
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    t = _best(lambda: f(x), repeats, jax.block_until_ready)
    return 2 * n**3 / t / 1e9


def chunked_flops(T: int, H: int, Dk: int, Dv: int, C: int) -> float:
    """Floating-point operations of :func:`hybridattn.ops.kda_chunked`'s matmuls.

    Per chunk and head: the hierarchical ``A_kk``/``A_qk`` blocks (``2 C^2 Dk``), the block
    inverse of ``I + L`` (``2/3 C^3``), ``[W, U] = T_inv [.]`` and ``A_qk [W, U]``
    (``4 C^2 (Dk + Dv)``), and the state pass ``W S``, ``Kt^T V'``, ``Qh S`` (``6 C Dk Dv``).
    """
    n_chunks = math.ceil(T / C) * H
    per_chunk = 2 * C * C * Dk + 2 / 3 * C**3 + 4 * C * C * (Dk + Dv) + 6 * C * Dk * Dv
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


def _ours(x, chunk_size: int | None):
    """A jitted KDA over the raw gate inputs (gate + beta computed inside, like mlx-lm)."""

    def f(q, k, v, a, b, A_log, dt_bias):
        g = ops.kda_gate(a, A_log, dt_bias)
        beta = jax.nn.sigmoid(b)
        if chunk_size is None:
            return ops.kda_recurrent(q, k, v, g, beta)
        return ops.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size)

    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return (lambda: compiled(*args)), compile_s


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


def bench_kda(quick: bool = False, mlx_max_t: int = 4096, chunk_size: int = 64) -> dict:
    B, H, D = 1, 4, 128
    Ts = [1024, 4096] if quick else [1024, 4096, 16384]
    repeats = 2 if quick else 3
    peak = matmul_peak_gflops()
    have_mlx = True
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError:
        have_mlx = False

    rows = []
    for T in Ts:
        x = _inputs(B, T, H, D)
        run_c, comp_c = _ours(x, chunk_size)
        t_c = _best(run_c, repeats, jax.block_until_ready)
        run_r, comp_r = _ours(x, None)
        t_r = _best(run_r, max(1, repeats - 1), jax.block_until_ready)
        row = dict(
            T=T,
            chunked_tok_s=T / t_c,
            recurrent_tok_s=T / t_r,
            chunked_ms=t_c * 1e3,
            recurrent_ms=t_r * 1e3,
            chunked_compile_s=comp_c,
            recurrent_compile_s=comp_r,
            chunked_gflops=chunked_flops(T, H, D, D, chunk_size) / t_c / 1e9,
        )
        row["chunked_peak_fraction"] = row["chunked_gflops"] / peak
        row["chunked_vs_recurrent"] = t_r / t_c
        if have_mlx and T <= mlx_max_t:
            run_m = _mlx(x, B, H, D)
            t_m = _best(run_m, 1, lambda o: o)
            row["mlx_ops_tok_s"] = T / t_m
            row["mlx_ops_ms"] = t_m * 1e3
            row["chunked_vs_mlx_ops"] = t_m / t_c
        rows.append(row)

    decode = []
    for Bd in (1, 32):
        rng = np.random.default_rng(1)
        q, k = (jnp.asarray(ops.l2norm(jnp.asarray(rng.standard_normal((Bd, H, D),
                                                                        np.float32))))
                for _ in range(2))
        v = jnp.asarray(rng.standard_normal((Bd, H, D), np.float32))
        g = -jnp.asarray(rng.uniform(0, 1, (Bd, H, D)).astype(np.float32))
        beta = jnp.full((Bd, H), 0.5, jnp.float32)
        state = jnp.zeros((Bd, H, D, D), jnp.float32)
        step = jax.jit(ops.kda_decode, donate_argnums=())
        t0 = time.perf_counter()
        compiled = step.lower(q, k, v, g, beta, state).compile()
        comp = time.perf_counter() - t0
        t = _best(lambda: compiled(q, k, v, g, beta, state), 20, jax.block_until_ready)
        entry = dict(B=Bd, ours_ms=t * 1e3, ours_compile_s=comp)
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

            entry["mlx_ops_ms"] = _best(run_m, 20, lambda o: o) * 1e3
        decode.append(entry)

    return dict(
        machine=dict(platform=platform.platform(), cpu_count=jax.local_device_count(),
                     backend=jax.default_backend(), jax=jax.__version__),
        shape=dict(B=B, H=H, Dk=D, Dv=D, chunk_size=chunk_size),
        matmul_peak_gflops=peak,
        prefill=rows,
        decode=decode,
    )


def _print_kda(res: dict) -> None:
    s = res["shape"]
    print(f"KDA  B={s['B']} H={s['H']} Dk=Dv={s['Dk']} chunk={s['chunk_size']}  "
          f"backend={res['machine']['backend']}  f32 matmul peak "
          f"{res['matmul_peak_gflops']:.1f} GFLOP/s (measured in this run)")
    hdr = (f"{'T':>6} | {'chunked tok/s':>13} | {'recurrent tok/s':>15} | {'mlx-lm ops tok/s':>16} "
           f"| {'vs rec':>6} | {'vs mlx':>7} | {'GFLOP/s':>7} | {'% peak':>6} | compile c/r (s)")
    print(hdr)
    print("-" * len(hdr))
    for r in res["prefill"]:
        mlx_tok = f"{r['mlx_ops_tok_s']:16.0f}" if "mlx_ops_tok_s" in r else f"{'-':>16}"
        vs_mlx = f"{r['chunked_vs_mlx_ops']:6.1f}x" if "chunked_vs_mlx_ops" in r else f"{'-':>7}"
        print(f"{r['T']:>6} | {r['chunked_tok_s']:13.0f} | {r['recurrent_tok_s']:15.0f} | "
              f"{mlx_tok} | {r['chunked_vs_recurrent']:5.2f}x | {vs_mlx} | "
              f"{r['chunked_gflops']:7.1f} | {100 * r['chunked_peak_fraction']:5.1f}% | "
              f"{r['chunked_compile_s']:.2f} / {r['recurrent_compile_s']:.2f}")
    print()
    print(f"{'decode B':>8} | {'ours ms/step':>12} | {'mlx-lm ops ms/step':>18} | compile (s)")
    for d in res["decode"]:
        mlx_ms = f"{d['mlx_ops_ms']:18.3f}" if "mlx_ops_ms" in d else f"{'-':>18}"
        print(f"{d['B']:>8} | {d['ours_ms']:12.3f} | {mlx_ms} | {d['ours_compile_s']:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kda", help="KDA kernels: chunked vs recurrent vs mlx-lm")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.add_argument("--quick", action="store_true", help="T in {1024, 4096} only, fewer repeats")
    k.add_argument("--chunk-size", type=int, default=64)
    k.add_argument("--mlx-max-t", type=int, default=4096,
                   help="longest T to run mlx-lm's ops path on (it is slow)")
    args = p.parse_args(argv)
    if args.what == "kda":
        res = bench_kda(quick=args.quick, mlx_max_t=args.mlx_max_t, chunk_size=args.chunk_size)
        if args.json:
            json.dump(res, sys.stdout, indent=2)
            print()
        else:
            _print_kda(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
