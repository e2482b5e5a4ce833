"""What every benchmark shares: interleaved best-of timing, the matmul peak, the machine."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def interleaved_best(runs: dict[str, Callable[[], object]], rounds: int,
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


def matmul_run() -> Callable[[], object]:
    """One ``PEAK_N x PEAK_N @ PEAK_N x PEAK_N`` f32 matmul under XLA."""
    x = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return lambda: f(x)


def median(xs) -> float | None:
    """The median of ``xs`` as a float, or None when there are none."""
    return float(np.median(xs)) if len(xs) else None


def machine() -> dict:
    """The platform, Python, JAX and its backend and device count, for a result's record."""
    return dict(platform=platform.platform(), python=platform.python_version(),
                jax=jax.__version__, backend=jax.default_backend(),
                devices=len(jax.devices()))
