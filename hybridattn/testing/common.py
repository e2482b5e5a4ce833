"""What the strategies and references share: hypothesis (imported here, with the message that
names the test extra when it is missing), a ``composite`` that leaves Python's global
``random`` as it found it, argument checks, host copies, the references' failure, and the
pool functions jitted once for every strategy."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

try:
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise ImportError(
        "hybridattn.testing needs hypothesis: pip install 'hybridattn[test]'") from e

import jax
import numpy as np

from hybridattn import pools
from hybridattn.pools import SlotAllocator
from hybridattn.serving import release


def composite(fn: Callable[..., Any]) -> Callable[..., SearchStrategy]:
    """``st.composite`` whose draws leave Python's global ``random`` as they found it (see the
    ``hybridattn.testing`` docstring: runtime type checkers consume it, hypothesis forbids
    that)."""

    @functools.wraps(fn)
    def body(draw, *args, **kwargs):
        saved = random.getstate()
        try:
            return fn(draw, *args, **kwargs)
        finally:
            random.setstate(saved)

    return st.composite(body)


def int_tuple(name: str, values, minimum: int = 1) -> tuple[int, ...]:
    """``values`` (one int or a non-empty sequence) as a tuple of ints ``>= minimum``."""
    values = (values,) if isinstance(values, int) else tuple(values)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < minimum
                         for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints >= {minimum}, "
                         f"got {values!r}")
    return values


def checked_int(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def host(x) -> np.ndarray:
    return np.asarray(x)


def free_stack(allocator: SlotAllocator) -> list[int]:
    """The allocator's free slots, bottom of the stack first (the next to be handed out is last)."""
    return host(allocator.free_slots)[: int(allocator.num_free)].tolist()


def fail(message: str) -> None:
    raise AssertionError(message)


# The pool functions the strategies run, jitted once for all of them.
jit_alloc = jax.jit(pools.alloc, static_argnames="max_count")
jit_free = jax.jit(pools.free)
jit_alloc_reqs = jax.jit(pools.alloc_reqs, static_argnames="max_count")
jit_free_reqs = jax.jit(pools.free_reqs)
jit_write = jax.jit(pools.write_token_slots)
jit_release = jax.jit(release)
