"""``python -m hybridattn.bench WHAT ...``: see :mod:`hybridattn.bench.cli`."""

from hybridattn.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
