"""Test configuration: strictness lives here, not in library code.

- hypothesis: a ``dev`` profile (no deadline, JIT compiles are slow) and a ``ci`` profile
  (derandomised, fewer examples) that is loaded when ``CI`` is set, as it is in CI.
- jaxtyping + beartype runtime shape checks are switched on for ``hybridattn`` by the
  ``--jaxtyping-packages`` option in ``pyproject.toml``.
- tests marked ``mlx`` are skipped where mlx / mlx-lm are not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=20,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

HAVE_MLX = (
    importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
)


def pytest_collection_modifyitems(config, items):
    if HAVE_MLX:
        return
    skip = pytest.mark.skip(reason="mlx / mlx-lm not installed (pip install -e '.[mlx]')")
    for item in items:
        if "mlx" in item.keywords:
            item.add_marker(skip)
