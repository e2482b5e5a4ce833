"""The engine on a worker thread, and ``close()``.

A process that uses the engine from a worker thread exits cleanly. A thread that ran an
``mx.compile``d function (mlx-lm compiles its activations) holds MLX state (the compile cache,
holding Python objects); destroyed after Python has joined the thread, sometimes while the
interpreter is finalizing, it aborts the process with SIGABRT ("terminate called without an
active exception"). The engine does all its MLX work on a thread it owns and clears that state
there when it closes (``servecore.thread``), so no such state outlives its thread. Six runs
here, two per way of using the engine.

The exit status is only observable from outside: each run is a fresh ``python`` process, and
the tokens it prints are compared with mlx-lm's own greedy generation on the main thread
(``mlxcache.zoo.reference_generate``, run in that same process before the worker starts).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx  # noqa: E402

from mlxcache import Engine  # noqa: E402
from mlxcache.zoo import make_model, reference_generate  # noqa: E402
from servecore.errors import EngineClosedError  # noqa: E402

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parents[2]

# One run: the oracle on the main thread, then the engine built and used on a worker thread
# in one of three ways; the process then exits without any cleanup of its own.
SCRIPT = r"""
import json, sys, threading
from mlxcache import Engine
from mlxcache.zoo import make_model, reference_generate

mode = sys.argv[1]
model = make_model()
prompts = [[1, 2, 3, 4], [5, 6, 7]]
want = [reference_generate(model, p, 6) for p in prompts]
got = []

def work():
    if mode == "forgotten":  # never closed: the engine's finalizer ends its thread
        engine = Engine(model, num_slots=64)
        got.extend(engine.generate(prompts, max_tokens=6))
    elif mode == "closed":
        with Engine(model, num_slots=64) as engine:
            got.extend(engine.generate(prompts, max_tokens=6))
    else:  # "kept": the engine outlives the thread; closed at interpreter exit
        global kept
        kept = Engine(model, num_slots=64)
        outs = [[], []]
        for i, token in kept.stream(prompts, max_tokens=6):
            outs[i].append(token)
        got.extend(outs)

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps({"want": want, "got": got}))
"""

MODES = ("forgotten", "closed", "kept")
RUNS = 6


def test_an_engine_on_a_worker_thread_exits_cleanly_every_run():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for run in range(RUNS):
        mode = MODES[run % len(MODES)]
        proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, (
            f"run {run} ({mode}) exited with {proc.returncode}: {proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["got"] == out["want"], f"run {run} ({mode})"


# ------------------------------------------------------------------------ close() ----

@pytest.fixture(scope="module")
def model():
    return make_model()


def test_close_is_idempotent_and_releases_the_pools_and_the_thread(model):
    engine = Engine(model, num_slots=256)
    assert engine.generate([[1, 2, 3]], max_tokens=3) == [reference_generate(model, [1, 2, 3], 3)]
    owner = engine.owner
    mx.synchronize()
    before = mx.get_active_memory()
    engine.close()
    engine.close()
    gc.collect()
    assert engine.closed and owner.closed and not owner.thread.is_alive()
    assert engine.core.store is None and engine.core.path is None
    assert engine.num_slots == 0 and engine.tree is None
    # the KV pool (256 slots x 2 layers x K and V) is gone from MLX's active memory
    assert before - mx.get_active_memory() >= engine.options.num_slots * 2 * 2 * 2 * 32 * 4


def test_every_call_after_close_raises_naming_the_engine(model):
    engine = Engine(model, num_slots=64)
    rid = engine.add_request([1, 2], 2)
    engine.close()
    name = f"mlxcache.Engine at {id(engine):#x} is closed"
    calls = [lambda: engine.generate([[1, 2]], max_tokens=2),
             lambda: engine.stream([[1, 2]], max_tokens=2),
             lambda: engine.add_request([1, 2], 2), engine.step, lambda: engine.abort(rid),
             engine.has_unfinished, engine.reset_cache]
    for call in calls:
        with pytest.raises(EngineClosedError, match=name):
            call()


def test_a_with_block_closes_the_engine_even_when_it_raises(model):
    with pytest.raises(KeyError), Engine(model, num_slots=64) as engine:
        engine.generate([[1, 2]], max_tokens=2)
        raise KeyError("the user's own error")
    assert engine.closed


def test_an_open_stream_yields_what_was_made_then_raises(model):
    engine = Engine(model, num_slots=64)
    want = reference_generate(model, [3, 4, 5], 8)
    done = engine.stream([[9, 8]], max_tokens=1)
    events = engine.stream([[3, 4, 5], [6, 7]], max_tokens=8)
    got = [next(events), next(events)]  # the first tokens of both (one prefill)
    engine.close()
    with pytest.raises(EngineClosedError, match=r"request\(s\) \[0, 1\] of this stream"):
        next(events)
    assert sorted(got) == [(0, want[0]), (1, reference_generate(model, [6, 7], 1)[0])]
    with pytest.raises(StopIteration):  # ended: no second error
        next(events)
    assert list(done) == [(0, reference_generate(model, [9, 8], 1)[0])]  # it had finished
    events.close()  # closing a stream of a closed engine is a no-op


def test_close_from_another_thread_ends_a_stream_read_here(model):
    engine = Engine(model, num_slots=64, max_batch_size=2)
    want = reference_generate(model, [1, 2, 3], 40)
    events = engine.stream([[1, 2, 3]], max_tokens=40)
    got = [t for _, t in (next(events), next(events))]
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive() and engine.closed
    with pytest.raises(EngineClosedError):
        got += [t for _, t in events]
    assert got == want[: len(got)]


def test_close_while_another_thread_reads_a_stream(model):
    """The reader's calls and the close are serialized: the reader gets a prefix of the
    right tokens, then ``EngineClosedError``; nothing hangs."""
    engine = Engine(model, num_slots=64)
    want = reference_generate(model, [4, 5, 6], 200)
    got: list[int] = []
    ended: list[BaseException] = []
    started = threading.Event()

    def read():
        try:
            for _, token in engine.stream([[4, 5, 6]], max_tokens=200):
                got.append(token)
                started.set()
        except BaseException as e:  # noqa: BLE001 - checked below
            ended.append(e)
        started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(timeout=60)
    engine.close()
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert got == want[: len(got)]
    assert len(got) == 200 or isinstance(ended[0], EngineClosedError)


def test_a_dropped_engine_ends_its_thread(model):
    engine = Engine(model, num_slots=64)
    engine.generate([[1, 2]], max_tokens=2)
    owner = engine.owner
    del engine
    gc.collect()
    assert owner.closed and not owner.thread.is_alive()


def test_a_model_calling_back_from_the_engine_thread_is_refused_not_deadlocked(model):
    """The round runs on the engine's thread while the caller holds the engine's lock: a
    callback there must fail at once rather than wait for that lock."""

    class Calls(type(model)):
        engine = None

        def __call__(self, inputs, cache=None):
            if self.engine is not None:
                self.engine.has_unfinished()
            return super().__call__(inputs, cache=cache)

    wrapper = Calls(model.args)
    wrapper.update(model.parameters())
    engine = Engine(wrapper, num_slots=64)
    wrapper.engine = engine
    with pytest.raises(RuntimeError, match="called from inside one of its own steps"):
        engine.generate([[1, 2, 3]], max_tokens=2)
    wrapper.engine = None
    assert engine.generate([[1, 2, 3]], max_tokens=2) == [reference_generate(model, [1, 2, 3], 2)]
    engine.close()
