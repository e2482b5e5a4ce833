"""``python -m mlxcache.bench [--json] [--quick]``: run the benchmark (see ``mlxcache.bench``)."""

from __future__ import annotations

import argparse
import json

import mlxcache.bench
from mlxcache.bench.report import format_table
from mlxcache.bench.tables import run


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run every table, print them (or their JSON)."""
    parser = argparse.ArgumentParser(description=mlxcache.bench.__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
