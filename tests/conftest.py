"""Test configuration: strictness lives here, not in library code.

- hypothesis: a ``dev`` profile (no deadline, JIT compiles are slow) and a ``ci`` profile
  (derandomised, fewer examples) that is loaded when ``CI`` is set, as it is in CI.
- jaxtyping + beartype runtime shape checks are switched on for ``hybridattn`` by the
  ``--jaxtyping-packages`` option in ``pyproject.toml``.
- tests marked ``mlx`` are skipped where mlx / mlx-lm are not installed.
- the longest tests (``SLOWEST``, the docs build first: it executes the notebooks) are
  collected first, so that neither worker ends the run with a long test alone.
- JAX sees 8 CPU devices (``jax_num_cpu_devices``), so sharding tests can build a 2x4 mesh.
- XLA compilations are cached on disk (``.jax_cache/``, git-ignored), so the xdist workers
  share what one of them compiled (the serving step takes seconds to compile) and a rerun
  compiles nothing. ``HYBRIDATTN_JAX_CACHE=0`` switches it off.
- XLA's CPU backend compiles at LLVM optimisation level 0 (``XLA_FLAGS``, appended to any
  the caller set; the processes the tests start inherit it): compiling is most of the
  suite's time and the tiny models run in milliseconds either way; the tests time nothing
  (the benchmarks do, with the default level). ``HYBRIDATTN_XLA_OPT=1`` keeps the default.
- After each test module its compiled programs are dropped (``jax.clear_caches()``): XLA:CPU
  keeps each executable's machine code in memory maps of its own (about 23 a program), and a
  worker that kept every module's programs passed 56,000 of the 65,530 maps Linux allows a
  process (``vm.max_map_count``) in a full run; past it, mmap fails inside XLA and the worker
  segfaults (in compile, or in serializing an executable for the cache).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import warnings

if os.environ.get("HYBRIDATTN_XLA_OPT", "0") != "1":  # before JAX starts its backend
    _flag = "--xla_backend_optimization_level=0"
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

if os.environ.get("HYBRIDATTN_JAX_CACHE", "1") != "0":
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

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


MAPS_WARN = 45_000
"""Memory maps a worker may hold at the end of a module before the suite warns (of 65,530)."""


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
    """Frees the module's executables (and their memory maps) once its fixtures are gone,
    warning first if the worker came near the limit (a module that compiles too much)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            held = sum(1 for _ in f)
    except OSError:  # not Linux
        held = 0
    if held > MAPS_WARN:
        warnings.warn(f"{request.module.__name__}: this worker holds {held} memory maps of the "
                      "65,530 Linux allows (vm.max_map_count); XLA:CPU segfaults past it",
                      stacklevel=1)
    jax.clear_caches()
    gc.collect()


SLOWEST = (  # the modules of the longest tests, longest first (a clean clone, 2 cores)
    "test_notebooks_and_docs.py",  # the docs build executes the notebooks: minutes
    "hybridattn/test_prefix_cache.py",
    "hybridattn/test_multiprocess.py",
    "hybridattn/test_longctx.py",
    "test_doctests.py",
    "hybridattn/test_scan_layers.py",
    "hybridattn/test_memory.py",
    "hybridattn/test_serving.py",
    "hybridattn/test_sharding.py",
)
"""Modules run first, in this order (each module's tests together, so its fixtures are made
once): under xdist each worker starts on a long test while the other takes the next, and no
long test starts last and runs alone at the end."""


def _rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return SLOWEST.index(path) if path in SLOWEST else len(SLOWEST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: (_rank(item), "docs_build" not in item.name))  # (stable)
    if HAVE_MLX:
        return
    skip = pytest.mark.skip(reason="mlx / mlx-lm not installed (pip install -e '.[mlx]')")
    for item in items:
        if "mlx" in item.keywords:
            item.add_marker(skip)
