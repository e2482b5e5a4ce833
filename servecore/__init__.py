"""servecore: the framework-free pieces both engines share (plain Python and NumPy only).

``hybridattn`` (JAX) and ``mlxcache`` (MLX) serve different models on different frameworks,
but many of their concepts are the same, and a user moving between them should meet one
vocabulary. This package holds those concepts once, and imports neither JAX nor MLX:

* ``servecore.client``: ``EngineClient``, the one front door both engines subclass: every
  call a user or the server makes, one signature each.
* ``servecore.sampling``: ``SamplingParams`` (one field order, one set of range checks,
  tiny temperatures and top-p values treated as greedy).
* ``servecore.errors``: ``InvalidRequest`` (field, value, reason),
  ``PoolExhausted(requested, available)``, ``EngineClosedError``.
* ``servecore.ids``: ``IdPool``, the host's free list of ids (slots, rows).
* ``servecore.stats``: ``ServingStats``, the counters and the throughput definitions.
* ``servecore.memory``: the memory probe (``MemAvailable`` and any cgroup limit).
* ``servecore.validate``: checks at the door (ints in device ranges, token ids, prompt lists,
  stop ids, a tokenizer's EOS ids) that name the bad value.
* ``servecore.prefix``: the prefix policy over the radix tree (what a request takes, how
  the tree makes room) behind a small slot-store protocol.
* ``servecore.prompts``: what a prompt is (token ids, text or a chat) and how it becomes token
  ids, for both engines; text back out; a checkpoint directory's tokenizer.
* ``servecore.progress``: the tqdm bar of long work, quiet when stderr is not a terminal.
* ``servecore.requests``: one request builder (argument names, checks, the finishing rule).
* ``servecore.engine``: the protocol an engine's core implements (``EngineCore``, ``Event``).
* ``servecore.streams``: ``Streams``, the multi-user contract (``generate``, ``stream``,
  ``add_request`` / ``step`` / ``abort``, ``close``) written once over any ``EngineCore``.
* ``servecore.thread``: ``OwnerThread``, ``ThreadedCore``: a core whose every call runs on
  one thread the engine owns (mlxcache: MLX's per-thread state, a clean exit).
* ``servecore.testing``: a real Hugging Face tokenizer small enough to reason about.

>>> import servecore
>>> servecore.SamplingParams(temperature=0.7, top_p=0.9, seed=1)
SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=1)
>>> str(servecore.PoolExhausted(requested=5, available=2, what="token slots"))
'token slots exhausted: requested 5, 2 available'
"""

from servecore.errors import PoolExhausted
from servecore.memory import available_memory_bytes, memory_budget
from servecore.sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams
from servecore.stats import ServingStats

__all__ = [
    "MIN_TEMPERATURE",
    "MIN_TOP_P",
    "PoolExhausted",
    "SamplingParams",
    "ServingStats",
    "available_memory_bytes",
    "memory_budget",
]
