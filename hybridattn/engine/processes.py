"""One ``hybridattn.Engine`` across several processes: JAX's multi-controller model, where every
process runs the same program on one global mesh (``jax.distributed``; ``hybridattn.launch``
starts local processes and joins them).

Every process builds the same engine (same config, parameters, options and mesh) and runs the
same rounds; the host scheduler is plain deterministic Python (``hybridattn.engine.scheduler``),
so from the same inputs every process makes the same decisions, and each step is one sharded
call on the global mesh. What must be the same everywhere:

* **Inputs.** Requests enter on process 0 (``generate``, ``stream``, ``add_request``,
  ``abort``, ``reset_cache`` there). ``ProcessGroupCore`` queues them and, at the start of
  each round, broadcasts that round's inputs from process 0 to all
  (``multihost_utils.broadcast_one_to_all`` of their pickled bytes); every process applies
  them, in order, before the round. The other processes run ``follow()``: one round per
  broadcast, until process 0 closes its engine.
* **Outputs.** Each step's sampled tokens are sharded over ``data``; every process reads all
  of them (``sharding.to_host``: ``process_allgather``), commits them alike, and process 0
  hands them to its caller.
* **Agreement, checked.** Each process digests its scheduler's state (waiting and running
  requests, rows, shards, positions, outputs, free slots) when a round's inputs are applied
  and when it ends, and its plan before the step is dispatched; the digests are compared
  across processes (``process_allgather``). Processes that diverged raise
  ``ProcessesDiverged`` before any device call of the diverged round (whose sharded
  programs would no longer match), never compute on silently.
* **Failure.** A process that dies leaves the others' next collective without a peer:
  JAX's coordination service notices its missing heartbeats (``hybridattn.launch``
  initializes with a short heartbeat timeout) and ends the others with an error naming the
  lost task, so nothing waits forever.

Example (two processes of 4 CPU devices on one machine: ``hybridattn.launch``)::

    from hybridattn import launch
    launch.initialize()                        # from the environment launch.start set
    engine = Engine(config, params, mesh=make_mesh(2, 4), num_token_slots=..., ...)
    if jax.process_index() == 0:
        print(engine.generate(prompts, 16))
        engine.close()                         # the followers' follow() returns
    else:
        engine.follow()
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from hybridattn.engine._core import Core
from servecore.engine import Event
from servecore.requests import GenerationRequest

__all__ = ["SAMPLE", "ProcessGroupCore", "ProcessesDiverged", "model_digest"]


class ProcessesDiverged(RuntimeError):
    """The engine's processes no longer hold the same scheduler state (a bug, or a process
    given other inputs): the round that found it raised; nothing was computed from it.

    >>> issubclass(ProcessesDiverged, RuntimeError)
    True
    """


class ProcessGroupCore:
    """``core`` run in step on every process of the JAX process group (see the module
    docstring): an ``EngineCore`` whose inputs enter on process 0 and are broadcast at the
    start of each round, whose rounds every process runs alike, checked to agree.

    Any attribute it does not define is ``core``'s (its scheduler, runner, stats, ...).

    >>> issubclass(ProcessesDiverged, Exception)
    True
    """

    def __init__(self, core: Core, model: bytes = b""):
        self.core = core
        self.leader = jax.process_index() == 0
        self.num_processes = jax.process_count()
        self._inbox: list[tuple] = []  # process 0: the inputs of the next round
        self._closed = False
        bad = _disagree(hashlib.blake2b(model, digest_size=16).digest())
        if bad:
            raise ValueError(f"processes {bad} of {self.num_processes} built the engine from "
                             "another model than process 0 (another config or other "
                             "parameters: model_digest differs): every process must load the "
                             "same checkpoint")
        geometry = repr((core.capacity, core.shard_capacity, core.runner.max_running_requests,
                         core.buckets, core.opts.max_context_len, core.opts.snapshot_interval,
                         core.opts.prefix_cache)).encode()
        if _disagree(hashlib.blake2b(geometry, digest_size=16).digest()):
            raise ValueError("the processes built engines of different sizes (an automatic "
                             "pool sizes itself from each host's free memory): give "
                             "num_token_slots and num_snapshot_slots, the same everywhere")
        core.on_plan = lambda plan: self._check(plan_digest(plan), "plan for this round")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    # ------------------------------------------------------------- on process 0 ----

    def _leading(self, what: str) -> None:
        if not self.leader:
            raise RuntimeError(f"{what} is process 0's: process {jax.process_index()} of "
                               f"{self.num_processes} follows it (call engine.follow())")

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """Queue ``request`` for the next round (on every process)."""
        self._leading("submitting a request")
        self._inbox.append(("submit", rid, request))

    def cancel(self, rid: int) -> bool:
        """End request ``rid`` at the next round; whether it is unfinished now."""
        self._leading("cancelling a request")
        queued = any(m[0] == "submit" and m[1] == rid for m in self._inbox)
        s = self.core.scheduler
        live = queued or any(r.rid == rid for r in [*s.waiting, *s.running])
        self._inbox.append(("cancel", rid))
        return live

    def reset_cache(self) -> None:
        """Forget the cached prefixes at the next round (on every process)."""
        self._leading("resetting the cache")
        self._inbox.append(("reset",))

    def has_work(self) -> bool:
        """Whether a request is queued, waiting, running or releasing (or an input waits)."""
        return bool(self._inbox) or self.core.has_work()

    def run_round(self, emit: Callable[[Event], None]) -> bool:
        """Broadcast this round's inputs, apply them, run the round on every process, check
        that the processes agree; whether a step ran or was committed."""
        self._leading("running a round")
        inputs, self._inbox = self._inbox, []
        return self._round(_broadcast(inputs), emit)

    def close(self) -> None:
        """Tell every process to stop following, then release this one's buffers.
        Idempotent."""
        if not self._closed:
            self._closed = True
            if self.leader:
                _broadcast([("close",)])
            self.core.close()

    # ------------------------------------------------------- on the other processes ----

    def follow(self) -> None:
        """Run process 0's rounds, one per broadcast, until it closes its engine."""
        if self.leader:
            raise RuntimeError("process 0 leads: serve with generate / stream / step there, "
                               "and call follow() on the other processes")
        while not self._closed:
            inputs = _broadcast(None)
            if inputs and inputs[-1] == ("close",):
                self._closed = True
                self.core.close()
                return
            self._round(inputs, _drop)

    # ------------------------------------------------------------------ common ----

    def _round(self, inputs: list[tuple], emit: Callable[[Event], None]) -> bool:
        core = self.core
        for msg in inputs:
            if msg[0] == "submit":
                core.submit(msg[1], msg[2])
            elif msg[0] == "cancel":
                core.cancel(msg[1])
            elif msg[0] == "reset":
                core.reset_cache()
        self._check(state_digest(core), "scheduler state at this round's start")
        ran = core.run_round(emit)
        self._check(state_digest(core), "scheduler state at this round's end")
        return ran

    def _check(self, digest: bytes, what: str) -> None:
        """Every process's ``digest`` equals process 0's (``ProcessesDiverged``)."""
        bad = _disagree(digest)
        if bad:
            raise ProcessesDiverged(f"processes {bad} of {self.num_processes} hold another "
                                    f"{what} than process 0")


SAMPLE = 1 << 16
"""Elements of each parameter a model digest reads besides its sum: a strided sample."""


def model_digest(config: Any, params: Any) -> bytes:
    """A digest of ``config`` (its ``to_dict()``) and ``params`` (each leaf's path, shape and
    dtype, its sum in float64 and a strided sample of ``SAMPLE`` elements): what every
    process of an engine must agree on before its first round. Reads each leaf once.

    >>> import jax.numpy as jnp
    >>> a = {"w": jnp.ones((4, 4))}
    >>> model_digest({"n": 1}, a) == model_digest({"n": 1}, {"w": jnp.ones((4, 4))})
    True
    >>> model_digest({"n": 1}, a) == model_digest({"n": 1}, {"w": jnp.ones((4, 4)).at[3, 3].set(2)})
    False
    """
    h = hashlib.blake2b(digest_size=16)
    cfg = config.to_dict() if hasattr(config, "to_dict") else config
    h.update(repr(sorted(cfg.items()) if isinstance(cfg, dict) else cfg).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.asarray(jax.device_get(leaf))
        flat = x.reshape(-1)
        h.update(f"{jax.tree_util.keystr(path)} {x.shape} {x.dtype}".encode())
        h.update(np.float64(np.sum(flat, dtype=np.float64)).tobytes())  # (no float64 copy)
        h.update(np.ascontiguousarray(flat[:: max(1, flat.size // SAMPLE)]).tobytes())
    return h.digest()


def state_digest(core: Any) -> bytes:
    """16 bytes that change with any scheduling decision or sampled token: the waiting,
    running and releasing requests (id, shard, row, position, output) and the free ids of
    ``core`` (a ``Core``).

    >>> import types
    >>> sched = types.SimpleNamespace(waiting=[], running=[], releasing=[])
    >>> fake = types.SimpleNamespace(scheduler=sched, runner=types.SimpleNamespace(slots=[[]]))
    >>> len(state_digest(fake))
    16
    """
    s = core.scheduler
    h = hashlib.blake2b(digest_size=16)
    for group in (s.waiting, s.running, s.releasing):
        h.update(repr([(r.rid, getattr(r, "shard", 0), r.row, r.computed, r.output)
                       for r in group]).encode())
        h.update(b"|")
    h.update(repr([sorted(ids) for ids in core.runner.slots]).encode())
    return h.digest()


def plan_digest(plan: Any) -> bytes:
    """16 bytes that change with anything a step's plan (a ``ShardedPlan`` or None) names:
    its mode, buckets and each shard's work (request, row, position, tokens).

    >>> plan_digest(None) == plan_digest(None), len(plan_digest(None))
    (True, 16)
    """
    h = hashlib.blake2b(digest_size=16)
    if plan is not None:
        h.update(repr((int(plan.mode), plan.buckets, plan.num_snapshots)).encode())
        for p in plan.plans:
            h.update(repr(None if p is None else [(r.rid, r.row, r.computed, list(t))
                                                   for r, t in p.work]).encode())
    return h.digest()


def _disagree(digest: bytes) -> list[int]:
    """The processes whose ``digest`` differs from process 0's (every process calls it)."""
    got = np.asarray(multihost_utils.process_allgather(np.frombuffer(digest, np.uint32)))
    return [k for k in range(len(got)) if not (got[k] == got[0]).all()]


def _drop(event: Event) -> None:
    """Events on a process that follows: process 0 hands the tokens to its callers."""


def _broadcast(inputs: list[tuple] | None) -> list[tuple]:
    """Process 0's ``inputs`` on every process (the others pass None): their pickled bytes,
    their length first, padded to a power of two (a compile per size class)."""
    data = pickle.dumps(inputs) if inputs is not None else b""
    size = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
    width = 1 << max(size - 1, 0).bit_length()
    buf = np.zeros(width, np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf))[:size]
    return pickle.loads(got.tobytes())
