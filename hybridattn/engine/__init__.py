"""The host side of ``hybridattn``: ``Engine`` and the layers it is made of.

One request's path, file by file: ``engine`` (the ``Engine`` facade over
``servecore.streams.Streams``) -> ``core`` (``servecore.engine.EngineCore``: one round) ->
``scheduler`` (admission, chunking, reservations, finishing; plain Python) with
``prefix_cache`` (the prefix policy over ``servecore.radix``) deciding ``plan`` data ->
``runner`` (the jitted calls: pack, dispatch, device ops) -> ``commit`` (the run's output
read, checked and recorded) -> ``stats``. ``options`` checks the constructor's options,
``sizing`` turns them into pool sizes, ``buckets`` into shape ladders.
"""

from hybridattn.engine.engine import Engine
from hybridattn.engine.options import (
    REQ_TABLE_POSITIONS,
    default_chunked_prefill_size,
    default_max_running_requests,
)
from hybridattn.engine.sizing import MemoryReport, available_memory_bytes
from hybridattn.engine.stats import EngineStats

__all__ = ["REQ_TABLE_POSITIONS", "Engine", "EngineStats", "MemoryReport",
           "available_memory_bytes", "default_chunked_prefill_size",
           "default_max_running_requests"]
