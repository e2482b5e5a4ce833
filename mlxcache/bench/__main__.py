"""``python -m mlxcache.bench [--json] [--quick]``: run the benchmark (see ``mlxcache.bench``);
``python -m mlxcache.bench server [--quick] [--json PATH]``: the HTTP servers' (see
``mlxcache.bench.server``); ``python -m mlxcache.bench restart [...]``: the first request
after a restart, with the disk tier and without (``mlxcache.bench.restart``);
``python -m mlxcache.bench quant [...]``: quantized K/V at full precision, 8 and 4 bits under
one memory budget and in batched decode, against mlx-lm's (``mlxcache.bench.quant``)."""

from __future__ import annotations

import argparse
import json
import sys

import mlxcache.bench
from mlxcache.bench import quant, restart, server
from mlxcache.bench.report import format_table
from mlxcache.bench.tables import run


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run every table, print them (or their JSON); ``server``,
    ``restart`` or ``quant`` first runs that benchmark instead (its own flags)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["server"]:
        server.main(argv[1:])
        return
    if argv[:1] == ["restart"]:
        restart.main(argv[1:])
        return
    if argv[:1] == ["quant"]:
        quant.main(argv[1:])
        return
    parser = argparse.ArgumentParser(description=mlxcache.bench.__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
