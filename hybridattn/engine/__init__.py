"""The host side of ``hybridattn``: ``Engine`` and the layers it is made of.

Public: ``Engine`` (the front door, ``servecore.client.EngineClient``), ``EngineOptions``
(``options``: every option documented on its field, checked in one place), ``EngineStats``,
``MemoryReport`` and ``sizing`` (pool sizes, a pure function of the options), ``buckets``
(shape ladders), the scheduler as a functional core (``scheduler``, its decisions as
``plan`` data, no JAX) and ``processes`` (one engine across processes).

Internal, one request's path file by file: ``engine`` -> ``_core``
(``servecore.engine.EngineCore``: one round) -> ``scheduler`` with ``_prefix_cache`` (the
prefix policy over ``servecore.radix``) deciding ``plan`` data -> ``_runner`` (the jitted
calls: pack, dispatch, device ops) -> ``_commit`` (the run's output read, checked and
recorded) -> ``stats``.
"""

from hybridattn.engine.engine import Engine
from hybridattn.engine.options import (
    REQ_TABLE_POSITIONS,
    EngineOptions,
    default_chunked_prefill_size,
    default_max_running_requests,
)
from hybridattn.engine.sizing import MemoryReport, available_memory_bytes
from hybridattn.engine.stats import EngineStats

__all__ = ["REQ_TABLE_POSITIONS", "Engine", "EngineOptions", "EngineStats", "MemoryReport",
           "available_memory_bytes", "default_chunked_prefill_size",
           "default_max_running_requests"]
