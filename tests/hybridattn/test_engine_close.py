"""``hybridattn.Engine.close()``: idempotent, a context manager, from any thread; the pools'
device buffers deleted; an open stream ended with ``EngineClosedError`` after the tokens made
before the close; every later call refused, naming the engine. The oracle for the tokens
made: the same prompts served to completion by an engine that is not closed.
"""

from __future__ import annotations

import threading

import jax
import pytest
from harness import engine, prompts_of

from servecore.errors import EngineClosedError

PROMPTS = prompts_of([9, 5], seed=3)
N = 12


@pytest.fixture(scope="module")
def want():
    with engine() as eng:
        return eng.generate(PROMPTS, N)


def test_close_is_idempotent_deletes_the_pools_and_refuses_later_calls(want):
    eng = engine()
    assert eng.generate(PROMPTS, N) == want
    pools = jax.tree.leaves(eng.state)
    rid = eng.add_request(PROMPTS[0], 2)
    eng.close()
    eng.close()
    assert eng.closed and eng.state is None and eng.params is None
    assert all(a.is_deleted() for a in pools)
    name = f"hybridattn.Engine at {id(eng):#x} is closed"
    calls = [lambda: eng.generate(PROMPTS, 2), lambda: eng.stream(PROMPTS, 2),
             lambda: eng.add_request(PROMPTS[0], 2), eng.step, lambda: eng.abort(rid),
             eng.has_unfinished, eng.reset_cache, eng.reset_stats, eng.warmup,
             lambda: eng.num_free_slots]
    for call in calls:
        with pytest.raises(EngineClosedError, match=name):
            call()


def test_a_with_block_closes_the_engine_with_a_step_in_flight(want):
    with engine() as eng:  # overlap: the last round leaves a step on the device
        events = eng.stream(PROMPTS, N)
        got = [next(events) for _ in range(3)]
        assert eng.core.runner.inflight is not None
    assert eng.closed and eng.core.runner.inflight is None
    with pytest.raises(EngineClosedError, match=r"request\(s\) \[0, 1\] of this stream"):
        got += list(events)  # the tokens buffered before the close, then the error
    assert list(events) == []
    for k in (0, 1):
        mine = [t for i, t in got if i == k]
        assert mine == want[k][: len(mine)] and len(mine) < N


def test_close_from_another_thread_ends_a_stream_read_here(want):
    eng = engine()
    events = eng.stream(PROMPTS, N)
    got = {0: [], 1: []}
    for _ in range(4):
        i, token = next(events)
        got[i].append(token)
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(timeout=120)
    assert not closer.is_alive() and eng.closed
    with pytest.raises(EngineClosedError):
        for i, token in events:
            got[i].append(token)
    assert all(got[i] == want[i][: len(got[i])] for i in got)
