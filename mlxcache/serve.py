"""``python -m mlxcache.serve --model DIR``: an OpenAI- and Anthropic-compatible HTTP server
over ``mlxcache.Engine`` (``servecore.server``; needs the ``[server]`` extra) for a local
mlx-lm model directory, with its radix prefix cache (hybrid and sliding-window models
included)::

    python -m mlxcache.serve --model path/to/mlx-model --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "mlx-model", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import sys

from servecore.server import cli
from servecore.server.cli import add_server_args

__all__ = ["build_engine", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's flags: the model, the engine's sizing and cache, the server's."""
    p = argparse.ArgumentParser(prog="python -m mlxcache.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local mlx-lm model directory")
    e = p.add_argument_group("engine")
    e.add_argument("--num-slots", type=int, default=None,
                   help="KV pool token slots (default: sized from --mem-fraction)")
    e.add_argument("--mem-fraction", type=float, default=0.5)
    e.add_argument("--page-size", type=int, default=1)
    e.add_argument("--max-batch-size", type=int, default=32)
    e.add_argument("--prefill-step-size", type=int, default=2048)
    e.add_argument("--no-prefix-cache", action="store_true")
    e.add_argument("--num-snapshots", type=int, default=None)
    e.add_argument("--snapshot-interval", type=int, default=256)
    e.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="hold the attention layers' K/V quantized to 4 or 8 bits, batched and "
                   "with prefix reuse (default: full precision)")
    e.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128))
    e.add_argument("--cache-dir", default=None,
                   help="a directory for the prefix cache's disk tier: evicted prefixes "
                   "spill there, and a restarted server finds them (one server per directory)")
    e.add_argument("--disk-budget", type=float, default=8.0,
                   help="GiB the --cache-dir may hold (default 8)")
    add_server_args(p, default_name="mlx-model")
    return p


def build_engine(args: argparse.Namespace):
    """The engine the flags describe (the model loaded with ``mlx_lm.load``)."""
    import mlx_lm

    from mlxcache import Engine

    if not os.path.isdir(args.model):  # (mlx_lm.load would look for it on the hub)
        raise ValueError(f"--model {args.model!r} is not a directory: give a local mlx-lm "
                         "model directory (config.json, *.safetensors, tokenizer)")
    model, tokenizer = mlx_lm.load(args.model)
    return Engine(model, tokenizer, num_slots=args.num_slots, page_size=args.page_size,
                  mem_fraction=args.mem_fraction, max_batch_size=args.max_batch_size,
                  prefix_cache=not args.no_prefix_cache,
                  prefill_step_size=args.prefill_step_size,
                  num_snapshots=args.num_snapshots, snapshot_interval=args.snapshot_interval,
                  cache_dir=args.cache_dir, disk_budget=int(args.disk_budget * (1 << 30)),
                  kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve until interrupted (``servecore.server.cli.main``)."""
    return cli.main(parser(), build_engine, argv)


if __name__ == "__main__":
    sys.exit(main())
