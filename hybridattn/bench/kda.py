"""``python -m hybridattn.bench kda``: the KDA kernels, chunked vs recurrent vs mlx-lm's ops
path, and the chunked form's share of this machine's f32 matmul peak (see
:mod:`hybridattn.bench.cli`). mlx and mlx-lm are optional: imported where they run."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridattn import ops
from hybridattn.bench.common import PEAK_N, interleaved_best, matmul_run
from servecore.progress import progress_bar


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


def _split_mesh(devices: int, H: int):
    """A one-axis ``"h"`` mesh of ``devices`` JAX devices for the split-heads rows, or None
    for ``devices <= 1``."""
    if devices <= 1:
        return None
    if H % devices or len(jax.devices()) < devices:
        raise ValueError(f"devices={devices} must divide H={H} and be at most the "
                         f"{len(jax.devices())} JAX devices")
    return jax.make_mesh((devices,), ("h",), devices=jax.devices()[:devices])


def _have_mlx() -> bool:
    """Whether mlx and mlx-lm (the optional anchor) import here."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401

        return True
    except ImportError:
        return False


def _prefill_row(T: int, B: int, H: int, D: int, chunk_sizes: tuple[int, ...], mesh,
                 matmul: Callable[[], object], rounds: int, with_mlx: bool) -> dict:
    """One ``T`` of the prefill table: every kernel (and the matmul peak, and mlx-lm's ops
    path when ``with_mlx``) timed in the same interleaved rounds."""
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
    if with_mlx:
        runs["mlx_ops"] = _mlx(x, B, H, D)
        sync["mlx_ops"] = lambda o: o
    # mlx-lm's ops path takes seconds per call: it is timed in every fourth round only
    # (three of twelve, one with --quick), spread over the same rounds as ours so that
    # both see the same load, and its best round counts like everyone else's.
    n_rounds = rounds if T <= 4096 else 2
    best = interleaved_best(runs, n_rounds, sync, every={"mlx_ops": 4})
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
    return row


def _mlx_decode(rng, q, k, v, Bd: int, H: int, D: int) -> Callable[[], object]:
    """mlx-lm's ops-path decode step on the same ``q, k, v`` (its gates drawn from ``rng``)."""
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

    return run_m


def _decode_row(Bd: int, H: int, D: int, with_mlx: bool) -> dict:
    """One batch size of the decode table: our ``kda_decode`` step (and mlx-lm's)."""
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
    if with_mlx:
        runs["mlx_ops"], sync["mlx_ops"] = _mlx_decode(rng, q, k, v, Bd, H, D), lambda o: o
    best = interleaved_best(runs, 30, sync)
    entry = dict(B=Bd, ours_ms=best["ours"] * 1e3, ours_compile_s=comp)
    if "mlx_ops" in best:
        entry["mlx_ops_ms"] = best["mlx_ops"] * 1e3
    return entry


def bench_kda(quick: bool = False, mlx_max_t: int = 4096,
              chunk_sizes: tuple[int, ...] = (32, 64), devices: int = 1,
              progress: bool = False) -> dict:
    """Run the KDA benchmark (see :mod:`hybridattn.bench.cli`); ``devices > 1`` needs that
    many JAX devices (``main`` sets ``jax_num_cpu_devices`` before JAX starts). ``progress``:
    a bar of the sequence lengths done."""
    B, H, D = 1, 4, 128
    mesh = _split_mesh(devices, H)
    Ts = [1024, 4096] if quick else [1024, 4096, 16384]
    rounds = 4 if quick else 12
    matmul = matmul_run()
    have_mlx = _have_mlx()
    rows = [_prefill_row(T, B, H, D, chunk_sizes, mesh, matmul, rounds,
                         have_mlx and T <= mlx_max_t)
            for T in progress_bar(Ts, desc="bench kda", unit="T", enabled=progress,
                                  leave=False)]
    decode = [_decode_row(Bd, H, D, have_mlx) for Bd in (1, 32)]
    return dict(
        machine=dict(platform=platform.platform(), backend=jax.default_backend(),
                     jax=jax.__version__),
        shape=dict(B=B, H=H, Dk=D, Dv=D, chunk_sizes=list(chunk_sizes), devices=devices),
        prefill=rows,
        decode=decode,
    )



def print_kda(res: dict) -> None:
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
