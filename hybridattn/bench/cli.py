"""Benchmarks: ours and an independent anchor side by side, in one run.

    python -m hybridattn.bench kda [--json] [--quick] [--plot DIR]
    python -m hybridattn.bench serve [--json] [--quick] [--batch-sizes 1 8 32]
                                     [--compile-layers 4 12 27] [--plot DIR]
    python -m hybridattn.bench serve --mesh 2x4 [--processes 2] [--json] [--quick]
    python -m hybridattn.bench prefix [--json] [--quick] [--plot DIR] [--mesh DxT]
    python -m hybridattn.bench longctx [--json] [--quick] [--compare-chunk N] [--plot DIR]
    python -m hybridattn.bench WHAT --from-json FILE --plot DIR   # plot a saved --json run
    python -m hybridattn.bench mla {forms,blocks,memory}

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
(``anchors.products_step_seconds``: what those bounds become here, where skinny
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
against a 1024-token one on one engine with the default bucket ladders, beside the
benchmark's goal (the small one at most 1/25 of the large).

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
the median step). Judged against the benchmark's goals: a 64k prompt prefilled
with a peak of at most 1.5 GB in under 90 s, 256k completes, decode at 64k within 3x the
floor, peak memory growing like the pools rather than like chunk x context.

Timings are the best of several rounds after a warm-up, each round visiting every contender in
turn, so a noisy neighbour slows all of them alike; read the ratios. A tqdm bar on stderr
follows the work when stderr is a terminal. ``--plot DIR`` also writes the result as a PNG
(``hybridattn.bench.plots``), from this run or, with ``--from-json FILE``, from a saved one.

``mla``: the measurements behind :mod:`hybridattn.ops.mla`'s choices, printed as Markdown tables
(``hybridattn.bench.mla``): ``forms``, absorbed vs decompressed extend over a 16k cached
prefix; ``blocks``, block sizes; ``memory``, the compiled scratch of one extend step at width
64k, dense oracle vs blockwise.
"""


from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import jax

from hybridattn.bench.compile_time import COMPILE_LAYERS
from hybridattn.bench.kda import bench_kda, default_devices, print_kda
from hybridattn.bench.longctx import LONGCTX_LENGTHS, bench_longctx, longctx_one, print_longctx
from hybridattn.bench.mesh import bench_serve_mesh, print_serve_mesh
from hybridattn.bench.mla import MLA_TABLES
from hybridattn.bench.plots import PLOTS
from hybridattn.bench.prefix import bench_prefix, print_prefix
from hybridattn.bench.serve import bench_serve, print_serve


def _add_kda(sub) -> argparse.ArgumentParser:
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
    return k


def _add_serve(sub) -> argparse.ArgumentParser:
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
    sv.add_argument("--processes", type=int, default=1, metavar="P",
                    help="with --mesh: the engine in one process against P processes "
                    "(gloo on 127.0.0.1) of the same mesh")
    sv.add_argument("--no-transformers", action="store_true",
                    help="skip transformers even when torch is installed")
    sv.add_argument("--compile-layers", type=int, nargs="*", default=None, metavar="N",
                    help="layer counts to time the step's compilation at (default: 4 12 27; "
                         "--quick: 4 12; none given: skip)")
    return sv


def _add_longctx(sub) -> argparse.ArgumentParser:
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
    return lc


def _parser() -> argparse.ArgumentParser:
    """``python -m hybridattn.bench``'s arguments: one subcommand per benchmark."""
    p = argparse.ArgumentParser(prog="python -m hybridattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    k, sv = _add_kda(sub), _add_serve(sub)
    px = sub.add_parser("prefix", help="the hybrid prefix cache: with vs without, and ideals")
    px.add_argument("--json", action="store_true", help="print JSON instead of a table")
    px.add_argument("--quick", action="store_true", help="one timed round")
    px.add_argument("--mesh", metavar="DxT", default=None,
                    help="serve on a DATAxTENSOR mesh of CPU devices (a prefix cache per "
                    "data shard), e.g. 2x4")
    lc = _add_longctx(sub)
    for sp in (k, sv, px, lc):
        sp.add_argument("--plot", metavar="DIR",
                        help="also write the result as a PNG into DIR (matplotlib)")
        sp.add_argument("--from-json", metavar="FILE",
                        help="measure nothing: show (table, --json, --plot) a result this "
                             "command printed with --json")
    ml = sub.add_parser("mla", help="the MLA attention's forms, block sizes and scratch memory")
    ml.add_argument("table", choices=sorted(MLA_TABLES), help="which measurement to print")
    return p


def _run_longctx(args) -> int:
    if args.one is not None:  # one length, in this process: JSON on the last line
        print(json.dumps(longctx_one(args.one, args.new_tokens, args.chunked_prefill,
                                     args.mla_rounds)))
        return 0
    lengths = args.lengths or [n for n in LONGCTX_LENGTHS if not args.quick or n <= 65536]
    res = bench_longctx(lengths, new_tokens=args.new_tokens,
                        chunked_prefill_size=args.chunked_prefill, timeout_s=args.timeout,
                        mla_rounds=args.mla_rounds, compare_chunk=args.compare_chunk)
    return _emit(res, args.json, print_longctx, args.what, args.plot)


def _run_serve_mesh(p: argparse.ArgumentParser, args) -> int:
    if args.plot:
        p.error("--plot draws the unsharded serve table, not --mesh")
    data, tensor = _mesh_shape(args.mesh)
    jax.config.update("jax_num_cpu_devices", data * tensor)  # before JAX starts
    if args.processes > 1:
        from hybridattn.bench.processes import bench_processes, print_processes

        res = bench_processes(data, tensor, args.processes,
                              new_tokens=4 if args.quick else 16)
        return _emit(res, args.json, print_processes, args.what, None)
    res = bench_serve_mesh(data, tensor, prompt_len=16 if args.quick else args.prompt_len,
                           new_tokens=3 if args.quick else 4)
    return _emit(res, args.json, print_serve_mesh, args.what, None)


def _mesh_shape(text: str) -> tuple[int, int]:
    """``--mesh DxT`` as ``(data, tensor)``; SystemExit naming the flag otherwise."""
    try:
        data, tensor = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: expected DATAxTENSOR, e.g. 2x4") from None
    return data, tensor


def _run_serve(p: argparse.ArgumentParser, args) -> int:
    layers = args.compile_layers
    if layers is None:
        layers = COMPILE_LAYERS[:2] if args.quick else COMPILE_LAYERS
    if any(n < 2 for n in layers):
        p.error(f"--compile-layers {' '.join(map(str, layers))}: each must be at least 2 "
                "(a hybrid model has a KDA and an MLA layer)")
    return _emit(bench_serve(batch_sizes=(1, 8) if args.quick else tuple(args.batch_sizes),
                             prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                             repeats=1 if args.quick else 2,
                             transformers=not args.no_transformers, progress=True,
                             compile_layers=tuple(layers),
                             device_rounds=10 if args.quick else 30,
                             decode_steps=args.decode_steps),
                 args.json, print_serve, args.what, args.plot)


def _run_kda(args) -> int:
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
                 args.json, print_kda, args.what, args.plot)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run or show one benchmark."""
    p = _parser()
    args = p.parse_args(argv)
    if args.what == "mla":
        MLA_TABLES[args.table]()
        return 0
    if args.from_json:
        table = {"kda": print_kda, "serve": print_serve, "prefix": print_prefix,
                 "longctx": print_longctx}[args.what]
        try:
            with open(args.from_json) as fh:
                res = json.load(fh)
        except (OSError, ValueError) as e:
            p.error(f"--from-json {args.from_json!r}: {e}")
        return _emit(res, args.json, table, args.what, args.plot)
    if args.what == "longctx":
        return _run_longctx(args)
    if args.what == "prefix":
        mesh = None
        if args.mesh:
            mesh = _mesh_shape(args.mesh)
            jax.config.update("jax_num_cpu_devices", mesh[0] * mesh[1])  # before JAX starts
        return _emit(bench_prefix(quick=args.quick, progress=True, mesh=mesh), args.json,
                     print_prefix, args.what, args.plot)
    if args.what == "serve" and args.mesh:
        return _run_serve_mesh(p, args)
    if args.what == "serve":
        return _run_serve(p, args)
    if args.what == "kda":
        return _run_kda(args)
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
        print(f"wrote {PLOTS[what](res, plot_dir)}", file=sys.stderr)
    return 0
