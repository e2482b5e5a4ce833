"""The errors both engines raise alike: ``PoolExhausted`` (a host-side allocation asked for
more slots than are free) and ``EngineClosedError`` (a call to an engine after its
``close()``).

One class each for both engines (``hybridattn.PoolExhausted`` and
``mlxcache.pool.PoolExhausted`` are this class), with the numbers as attributes.
"""

from __future__ import annotations

__all__ = ["EngineClosedError", "PoolExhausted"]


class PoolExhausted(RuntimeError):
    """More slots were requested than are free (after any eviction the caller tried).

    ``requested`` and ``available`` are the numbers; ``what`` names the pool and
    ``capacity``, when given, is its size.

    >>> e = PoolExhausted(requested=40, available=12, what="token slots", capacity=63)
    >>> str(e), e.requested, e.available
    ('token slots exhausted: requested 40, 12 available of 63', 40, 12)
    """

    def __init__(self, requested: int, available: int, what: str = "slots",
                 capacity: int | None = None):
        self.requested = int(requested)
        self.available = int(available)
        self.what = what
        self.capacity = capacity
        of = f" of {capacity}" if capacity is not None else ""
        super().__init__(f"{what} exhausted: requested {self.requested}, "
                         f"{self.available} available{of}")

    def __reduce__(self):  # picklable with its numbers (xdist, multiprocessing)
        return (type(self), (self.requested, self.available, self.what, self.capacity))


class EngineClosedError(RuntimeError):
    """A call to an engine after its ``close()`` (the message names the engine); also what
    a stream that was still unfinished when its engine closed raises, once its tokens made
    before the close are read."""
