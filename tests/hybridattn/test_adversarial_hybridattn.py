"""hybridattn under bad, unusual and concurrent use: re-entrancy, hand-built batches for the
pure step, threads, interrupts and exceptions inside a round, and checks at the door.

Oracles: a fresh engine serving each request alone (``alone``), for every token; the
reference pools (``hybridattn.testing.RefServingPools``) for what a hand-built batch may do
to the pools; ``hybridattn.testing.ref_*`` nowhere else. Each program and loop here is
bounded: a stream that would hang raises instead (``Stream`` refuses to spin), and every
drain loop has a step bound.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import signal
import threading

import jax
import jax.numpy as jnp
import pytest
from harness import CFG, ENGINE, PARAMS, STEP, decode_batch, engine, prefilled, prompts_of
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridattn import serving as S
from hybridattn import testing
from hybridattn.backends import ForwardMode
from hybridattn.engine import Engine
from hybridattn.engine import _runner as E
from hybridattn.engine.options import EngineOptions
from hybridattn.mesh import make_mesh
from hybridattn.models import kimi_linear as M
from servecore.sampling import default_seeds
from servecore.validate import INT32_MAX

# A fixed pool of requests the programs draw from: (prompt, max_tokens, sampling).
SPECS = [
    (prompts_of([9], seed=40)[0], 4, dict()),
    (prompts_of([40], seed=41)[0], 3, dict()),
    (prompts_of([3], seed=42)[0], 5, dict(temperature=0.8, seed=5)),
    (prompts_of([70], seed=43)[0], 2, dict()),
    (prompts_of([17], seed=44)[0], 6, dict(temperature=1.0, top_k=4, seed=6)),
    (prompts_of([1], seed=45)[0], 3, dict()),
]
STEP_BOUND = 400  # more rounds than any program here needs


@functools.cache
def alone(spec: int, n: int | None = None, seed: int | None = None) -> tuple[int, ...]:
    """The tokens of ``SPECS[spec]`` served alone by a fresh engine (``n`` and ``seed``
    override the spec's own; only sampled specs depend on the seed)."""
    prompt, own_n, kw = SPECS[spec]
    n = own_n if n is None else n
    if seed is not None and "seed" in kw:
        kw = kw | dict(seed=seed)
    eng = engine()
    rid = eng.add_request(prompt, n, **kw)
    out = []
    for _ in range(STEP_BOUND):
        if not eng.has_unfinished():
            return tuple(out)
        out += [t for r, t, _ in eng.step() if r == rid]
    raise AssertionError("a lone request did not finish")


def stream_kw(specs, seed=0):
    """``Engine.stream`` arguments for ``specs``: greedy specs only (a stream gives every
    prompt one seed, so sampled specs go through ``add_request``)."""
    assert all(not SPECS[i][2] for i in specs)
    return [SPECS[i][0] for i in specs], max(SPECS[i][1] for i in specs)


def assert_idle_and_whole(eng: Engine) -> None:
    """Nothing running or queued, every token slot, row, state slot and snapshot slot free
    once the prefix cache lets go of what it holds."""
    assert not eng.has_unfinished()
    assert eng.num_free_slots + eng.num_cached_slots == eng.capacity
    eng.reset_cache()
    if eng.tree is not None:
        assert eng.tree.total_size == eng.tree.num_states == 0
        slots = eng.scheduler.snapshot_slots
        assert slots.num_free == slots.capacity
    st_ = eng.state
    assert int(st_.token_allocator.num_free) == eng.capacity
    assert int(st_.req_to_token_pool.allocator.num_free) == (
        st_.req_to_token_pool.max_running_requests)
    assert int(st_.req_to_token_pool.state_allocator.num_free) == (
        st_.req_to_token_pool.state_allocator.capacity)
    assert not bool(st_.token_allocator.in_use.any())
    assert not eng._streams._owner


def alone_all(spec_ids, n) -> list[list[int]]:
    return [list(alone(i, n)) for i in spec_ids]


# --------------------------------------------------------------------------------------------
# re-entrancy: streams, generate, add_request / step and abort, interleaved in one thread
# --------------------------------------------------------------------------------------------


def test_abort_inside_a_stream_loop_ends_that_request_and_the_stream():
    eng = engine()
    prompts, n = stream_kw([0, 1, 3])
    stream = eng.stream(prompts, n)
    got = [[], [], []]
    for i, tok in stream:
        got[i].append(tok)
        if i == 1 and len(got[1]) == 1:
            assert eng.abort(stream.request_ids[1])  # one of its own requests, mid-loop
    assert got[0] == list(alone(0, n)) and got[2] == list(alone(3, n))
    assert got[1] == list(alone(1, n))[:1]
    assert_idle_and_whole(eng)


def test_generate_inside_a_stream_loop_and_two_streams_consumed_together():
    eng = engine()
    a = eng.stream(*stream_kw([0, 5]))
    b = eng.stream(*stream_kw([1]))
    got_a, got_b, inner = [[], []], [], None
    live = [a, b]
    while live:  # alternately, until both end
        for s in list(live):
            item = next(s, None)
            if item is None:
                live.remove(s)
            elif s is a:
                got_a[item[0]].append(item[1])
            else:
                got_b.append(item[1])
        if inner is None:
            inner = eng.generate([SPECS[3][0]], SPECS[3][1])[0]  # a generate mid-loop
    assert got_a == alone_all([0, 5], max(SPECS[0][1], SPECS[5][1]))
    assert got_b == list(alone(1)) and inner == list(alone(3))
    assert_idle_and_whole(eng)


def test_add_request_tokens_survive_a_generate_that_ran_them():
    eng = engine()
    rids = [eng.add_request(SPECS[i][0], SPECS[i][1], **SPECS[i][2]) for i in (2, 4)]
    assert eng.generate([SPECS[1][0]], 8)[0] == list(alone(1, 8))  # runs the queued ones too
    got = {r: [] for r in rids}
    for _ in range(STEP_BOUND):
        for r, tok, _ in eng.step():
            got[r].append(tok)
        if not eng.has_unfinished():
            break
    assert got == {rids[0]: list(alone(2)), rids[1]: list(alone(4))}
    assert_idle_and_whole(eng)


def test_generate_reads_an_iterable_of_prompts_once():
    eng = engine()
    outs = eng.generate((SPECS[i][0] for i in (0, 5)), 3)
    assert outs == alone_all([0, 5], 3)


def test_streams_closed_or_dropped_early_free_everything():
    eng = engine()
    s = eng.stream(*stream_kw([0, 1, 3]))
    next(s)
    s.close()
    assert list(s) == []  # a closed stream yields nothing more
    t = eng.stream(*stream_kw([1, 3]))
    next(t)
    del t  # dropped without close(): the garbage collector's finalizer aborts it
    gc.collect()
    for _ in eng.stream(*stream_kw([0, 5])):
        break
    assert_idle_and_whole(eng)
    assert eng.generate([SPECS[0][0]], 4)[0] == list(alone(0))


@dataclasses.dataclass
class _Tracked:
    spec: int
    n: int
    seed: int | None
    got: list
    cut: bool = False  # aborted or closed: its tokens must be a prefix


def _program_ops():
    spec = st.integers(0, len(SPECS) - 1)
    greedy = st.sampled_from([i for i, s in enumerate(SPECS) if not s[2]])
    return st.lists(st.one_of(
        st.tuples(st.just("add"), spec, st.sampled_from([None, 1, 2])),
        st.tuples(st.just("open"), st.lists(greedy, min_size=1, max_size=3)),
        st.tuples(st.just("next"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("generate"), st.lists(greedy, min_size=1, max_size=2)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("close"), st.integers(0, 3)),
        st.tuples(st.just("drop"), st.integers(0, 3)),
    ), max_size=10)


@settings(max_examples=12, deadline=None)
@given(_program_ops())
def test_random_programs_lose_no_token_leak_nothing_and_stay_exact(ops):
    """Random interleavings of stream / generate / add_request / step / abort / close / drop
    on one engine: every request's tokens reach its owner and equal serving it alone (a
    prefix when it was cut short); at the end nothing is leaked and a new request is exact."""
    eng = engine()
    tracked: dict[int, _Tracked] = {}  # rid -> what the program expects of it
    streams: list = []  # (stream, [rid of each prompt]) or None once dropped

    def take(stream, rids, k):
        for _ in range(k):
            try:
                i, tok = next(stream)
            except StopIteration:
                return
            tracked[rids[i]].got.append(tok)

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, i, seed = op
            prompt, n, kw = SPECS[i]
            kw = kw | (dict(seed=seed) if seed is not None and "seed" in kw else {})
            rid = eng.add_request(prompt, n, **kw)
            tracked[rid] = _Tracked(i, n, kw.get("seed"), [])
        elif kind == "open":
            prompts, n = stream_kw(op[1])
            s = eng.stream(prompts, n)
            for rid, i in zip(s.request_ids, op[1], strict=True):
                tracked[rid] = _Tracked(i, n, None, [])
            streams.append((s, s.request_ids))
        elif kind in ("next", "close", "drop") and streams:
            entry = streams[op[1] % len(streams)]
            if entry is None:
                continue
            s, rids = entry
            if kind == "next":
                take(s, rids, op[2])
            else:
                for rid in rids:
                    tracked[rid].cut = True
                if kind == "close":
                    s.close()
                else:
                    streams[streams.index(entry)] = None
                    del s, entry
                    gc.collect()
        elif kind == "generate":
            prompts, n = stream_kw(op[1])
            assert eng.generate(prompts, n) == alone_all(op[1], n)
        elif kind == "step":
            for rid, tok, _ in eng.step():
                tracked[rid].got.append(tok)
        elif kind == "abort" and tracked:
            rid = sorted(tracked)[op[1] % len(tracked)]
            if eng.abort(rid):
                tracked[rid].cut = True
    for entry in streams:  # drain what is left, boundedly
        if entry is not None:
            take(entry[0], entry[1], STEP_BOUND)
    for _ in range(STEP_BOUND):
        for rid, tok, _ in eng.step():
            tracked[rid].got.append(tok)
        if not eng.has_unfinished():
            break
    for rid, t in tracked.items():
        want = list(alone(t.spec, t.n, t.seed))
        if t.cut:
            assert t.got == want[: len(t.got)], f"request {rid}"
        else:
            assert t.got == want, f"request {rid}"
    streams.clear()
    gc.collect()
    assert_idle_and_whole(eng)
    assert eng.generate([SPECS[5][0]], 3)[0] == list(alone(5))


# --------------------------------------------------------------------------------------------
# threads, interrupts and exceptions inside a round
# --------------------------------------------------------------------------------------------


def test_two_threads_generating_on_one_engine_are_serialized_and_exact():
    eng = engine()
    results, errors = {}, []

    def serve(name, specs):
        try:
            results[name] = eng.generate([SPECS[i][0] for i in specs], 3)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(k, v)) for k, v in
               (("a", [0, 1]), ("b", [3, 5]), ("c", [1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == {"a": alone_all([0, 1], 3), "b": alone_all([3, 5], 3),
                       "c": alone_all([1], 3)}
    assert_idle_and_whole(eng)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test (an earlier test in this worker, a notebook
    kernel say, may have left another): what a user's process has."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_a_keyboard_interrupt_mid_round_is_held_until_the_round_commits(monkeypatch,
                                                                        python_sigint):
    eng = engine()
    real, fired = eng.core.runner.jit.step, []  # the engine's own jitted step

    def step_then_ctrl_c(*args):
        out = real(*args)
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # lands between the device step and commit
        return out

    rids = [eng.add_request(SPECS[i][0], SPECS[i][1], **SPECS[i][2]) for i in (0, 2)]
    got = {r: [] for r in rids}
    for r, tok, _ in eng.step():  # admission and the prompts, uninterrupted
        got[r].append(tok)
    monkeypatch.setattr(eng.core.runner.jit, "step", step_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    monkeypatch.setattr(eng.core.runner.jit, "step", real)
    for _ in range(STEP_BOUND):  # the interrupted round's tokens come with the next step
        for r, tok, _ in eng.step():
            got[r].append(tok)
        if not eng.has_unfinished():
            break
    assert got == {rids[0]: list(alone(0)), rids[1]: list(alone(2))}
    assert_idle_and_whole(eng)


@pytest.mark.parametrize("where", ["make_worker_batch", "_step", "_follow", "_release", "_admit",
                                   "_borrow"])
def test_an_exception_inside_a_round_leaves_the_engine_consistent(monkeypatch, where):
    eng = engine()
    # make_worker_batch is the module's; the jitted functions are the engine's own
    jit = eng.core.runner.jit
    owner, name = (E, where) if where == "make_worker_batch" else (jit, where[1:])
    real, raised = getattr(owner, name), []

    def fail_once(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise RuntimeError(f"injected failure in {where}")
        return real(*args, **kwargs)

    rids = [eng.add_request(SPECS[i][0], SPECS[i][1], **SPECS[i][2]) for i in (1, 4)]
    got, failures = {r: [] for r in rids}, 0
    if where == "_release":  # let the requests start, so the failure hits a real release
        for r, tok, _ in eng.step():
            got[r].append(tok)
    monkeypatch.setattr(owner, name, fail_once)
    for _ in range(STEP_BOUND):
        try:
            events = eng.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
            continue
        for r, tok, _ in events:
            got[r].append(tok)
        if not eng.has_unfinished():
            break
    assert failures == 1
    assert got == {rids[0]: list(alone(1)), rids[1]: list(alone(4))}
    assert_idle_and_whole(eng)


# --------------------------------------------------------------------------------------------
# the pure step with hand-built batches
# --------------------------------------------------------------------------------------------

DEFECTS = ["negative_row", "row_past_pool", "free_row", "repeated_row", "padding_row_tokens",
           "stale_seq_lens", "token_out_of_vocab", "negative_token", "ok"]


@functools.cache
def _base():
    return prefilled(2)


def _corrupt(defect, rows, lens, toks, pick):
    rows, lens, toks = list(rows), list(lens), list(toks)
    if defect == "negative_row":
        rows[pick] = -1
    elif defect == "row_past_pool":
        rows[pick] = 5 + pick * 7
    elif defect == "free_row":
        rows[pick] = 3 + pick  # rows 3 and 4 are not allocated
    elif defect == "repeated_row":
        rows[1 - pick] = rows[pick]
        lens[1 - pick] = lens[pick]
    elif defect == "padding_row_tokens":
        rows.append(0)
        lens.append(0)
        toks.append(5)
    elif defect == "stale_seq_lens":
        lens[pick] += (-1, 1, 3)[pick]
    elif defect == "token_out_of_vocab":
        toks[pick] = CFG.vocab_size + pick
    elif defect == "negative_token":
        toks[pick] = -1 - pick
    return rows, lens, toks


@settings(max_examples=16, deadline=None)
@given(st.sampled_from(DEFECTS), st.integers(0, 1))
def test_hand_built_batches_that_do_not_fit_fail_and_write_only_the_sinks(defect, pick):
    state, rows, lens, toks = _base()
    rows_, lens_, toks_ = _corrupt(defect, rows, lens, toks, pick)
    batch = decode_batch(rows_, lens_, toks_, order=range(len(rows_)))
    ref = testing.RefServingPools.from_state(state)
    new, out = STEP(PARAMS, state, batch)
    ref.step(batch, new, out.ok)  # ok exactly as the reference says; only sinks otherwise
    assert bool(out.ok) == (defect == "ok")
    if defect == "ok":  # the same batch again has stale seq_lens: refused
        again_ref = testing.RefServingPools.from_state(new)
        newer, out2 = STEP(PARAMS, new, batch)
        again_ref.step(batch, newer, out2.ok)
        assert not bool(out2.ok)
        assert int(newer.token_allocator.num_free) == int(new.token_allocator.num_free)


def test_make_worker_batch_checks_the_same_on_the_host():
    state, rows, lens, toks = _base()
    kw = dict(vocab_size=CFG.vocab_size, max_context_len=96, forward_mode=ForwardMode.DECODE,
              num_requests=4, kv_width=96, state=state)
    ok = S.make_worker_batch([S.WorkItem(r, n, [t]) for r, n, t in zip(rows, lens, toks,
                                                                        strict=True)], **kw)
    assert ok.batch_size == 4
    for items, match in [
        ([S.WorkItem(-1, 0, [1])], "req_index=-1"),
        ([S.WorkItem(0, 0, [1])], "req_index=0"),
        ([S.WorkItem(rows[0], lens[0], [1]), S.WorkItem(rows[0], lens[0], [2])], "twice"),
        ([S.WorkItem(3, 0, [1])], "row 3 is not allocated"),
        ([S.WorkItem(9, 0, [1])], "row 9 is not allocated"),
        ([S.WorkItem(rows[0], lens[0] - 1, [1])], "stale or repeated"),
        ([S.WorkItem(rows[0], lens[0], [CFG.vocab_size])], "outside the vocabulary"),
        ([S.WorkItem(rows[0], lens[0], [1.0])], "not an int"),
        ([S.WorkItem(rows[0], lens[0], [1], (0.5, 0, 1.0, 0))], "must be a SamplingParams"),
    ]:
        with pytest.raises(ValueError, match=match):
            S.make_worker_batch(items, **kw)


# --------------------------------------------------------------------------------------------
# checks at the door
# --------------------------------------------------------------------------------------------


# Where the suite's jaxtyping/beartype hook checks an annotation first it raises a TypeError
# that names the parameter; without the hook (a user's process) the door check's ValueError
# names the value. The patterns accept either; tests/servecore/test_servecore.py checks the
# messages.
@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=2**31), r"top_k=2147483648 must be an int in \[0, 2147483647\]"),
    (dict(seed=2**31), "seed=2147483648"),
    (dict(seed=-1), "seed=-1"),
    (dict(temperature=None), "temperature"),
    (dict(temperature=1e39), "float32 range"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids"),
    (dict(stop_token_ids="2"), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids: token 0 is True"),
    (dict(max_tokens=2.0), "max_tokens"),
])
def test_add_request_refuses_values_the_device_cannot_hold(kwargs, match):
    eng = engine()
    kw = dict(max_tokens=3) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        eng.add_request([1, 2], kw.pop("max_tokens"), **kw)
    assert not eng.has_unfinished()
    for bad, match in (([1, 2.5], "token 1 is 2.5|prompt"), (["a"], "token 0 is 'a'|prompt"),
                       ([[1, 2]], "token 0 is|prompt"), ([True], "token 0 is True")):
        with pytest.raises((ValueError, TypeError), match=match):
            eng.add_request(bad, 3)
    with pytest.raises((ValueError, TypeError), match="flat list of token ids|prompts"):
        eng.generate([1, 2, 3], 2)
    with pytest.raises((ValueError, TypeError), match="non-empty list of prompts|prompts"):
        eng.generate(None, 2)
    assert not eng.has_unfinished()


def test_tiny_temperatures_and_top_p_are_greedy_not_token_zero():
    eng = engine()
    prompt, n, _ = SPECS[1]
    want = list(alone(1))
    assert eng.generate([prompt], n, temperature=1e-40, seed=3)[0] == want
    assert eng.generate([prompt], n, temperature=0.9, top_p=1e-50, seed=3)[0] == want
    assert eng.generate([prompt], n, temperature=0.9, top_k=1, seed=3)[0] == want


@pytest.mark.parametrize("make, match", [
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(dtype=jnp.int32)), "floating dtype"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(dtype="nope")), "floating dtype"),
    (lambda: Engine(dataclasses.replace(CFG, num_hidden_layers=8, kda_layer_ids=(0, 1, 2, 4, 5,
                                                                                 6),
                                        full_attention_layer_ids=(3, 7)), PARAMS, **ENGINE),
     "params do not match the config"),
    (lambda: Engine(dataclasses.replace(CFG, hidden_act="gelu"), PARAMS, **ENGINE),
     "hidden_act='gelu'"),
    (lambda: Engine(dataclasses.replace(CFG, use_grouped_topk=False, num_expert_group=2,
                                        topk_group=1), PARAMS, **ENGINE),
     "use_grouped_topk=False"),
    (lambda: Engine(CFG, jax.tree.map(lambda x: x.astype(jnp.int32), PARAMS), **ENGINE),
     "expected a floating dtype"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(seed=-2)), "seed=-2"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(mem_fraction="0.5")), "mem_fraction"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(num_token_slots=2.5)), "num_token_slots"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(chunk_size=0)), "chunk_size=0"),
    (lambda: Engine(CFG, "path/to/params", **ENGINE),
     r"params must be the nested dict .* got str: 'path/to/params'|parameter 'params'"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(request_buckets=4)),
     "request_buckets=4 must be increasing positive ints|parameter 'request_buckets'"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(snapshot_buckets=4)),
     "snapshot_buckets=4|parameter 'snapshot_buckets'"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(dtype=None)), "dtype=None must be a floating"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(tokenizer="path/to/tokenizer")),
     r"tokenizer='path/to/tokenizer' \(str\) is not a tokenizer"),
    (lambda: Engine(CFG, PARAMS, **ENGINE | dict(tokenizer=object())),
     r"tokenizer=<object object at .*> \(object\) is not a tokenizer"),
])
def test_engine_refuses_configs_params_and_sizes_it_cannot_serve(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_params_of_a_smaller_model_are_named():
    small = dataclasses.replace(CFG, num_hidden_layers=2, kda_layer_ids=(0,),
                                full_attention_layer_ids=(1,))
    with pytest.raises(ValueError, match="params do not match the config"):
        M.check_params(PARAMS, small)


@pytest.mark.parametrize("bad", [48, 3, 96])
def test_a_chunk_size_that_is_not_a_power_of_two_is_refused_at_construction(bad):
    """The KDA kernel needs a power-of-two chunk: the engine says so when it is built, not in
    every step that follows."""
    with pytest.raises(ValueError, match=f"chunk_size={bad} must be a power of two"):
        engine(chunk_size=bad)


def _mesh():
    return make_mesh(2, 1)


@pytest.mark.parametrize("given, mode, named", [
    (dict(snapshot_interval=64), dict(prefix_cache=False), "snapshot_interval=64"),
    (dict(num_snapshot_slots=9), dict(prefix_cache=False), "num_snapshot_slots=9"),
    (dict(snapshot_buckets=(0, 64)), dict(prefix_cache=False), "snapshot_buckets=\\(0, 64\\)"),
    (dict(snapshot_interval=64), dict(mesh=_mesh, prefix_cache=False), "snapshot_interval=64"),
    (dict(overlap=True), dict(mesh=_mesh), "overlap=True"),
    (dict(decode_steps=4), dict(mesh=_mesh), "decode_steps=4"),
])
def test_an_option_that_would_do_nothing_in_the_mode_chosen_is_refused(given, mode, named):
    """An option the caller gave that the mode chosen ignores is a ``ValueError`` naming it
    and what chose the mode; the defaults alone never are."""
    mode = {k: v() if callable(v) else v for k, v in mode.items()}
    why = "prefix_cache=False" if "prefix_cache" in mode else "mesh"
    with pytest.raises(ValueError, match=f"{named} does nothing with .*{why}"):
        EngineOptions(**given, **mode).resolved(CFG)
    EngineOptions(**mode).resolved(CFG)  # the defaults are fine in either mode
    EngineOptions(**given).resolved(CFG)  # and so is the option in the default mode
    if "overlap" in given:  # what a mesh turns off by default is off, and the engine says so
        assert not EngineOptions(**mode).resolved(CFG).overlap


def test_unseeded_requests_past_the_last_int32_seed_wrap_and_any_seed_serves_two_prompts():
    """Seeds the engine derives (``seed=None``: the next of its own) stay int32 seeds: the one
    after ``INT32_MAX`` is 0, never a seed the caller did not pass, refused. The largest seed a
    caller may pass serves several prompts, greedy or sampled."""
    eng = engine()
    prompts = [[1, 2], [3, 4]]
    assert eng.generate(prompts, 2, seed=INT32_MAX) == eng.generate(prompts, 2)
    sampled = eng.generate(prompts, 2, temperature=1.0, seed=INT32_MAX)
    assert sampled == eng.generate(prompts, 2, temperature=1.0, seed=[INT32_MAX] * 2)
    eng.core._default_seeds = default_seeds(INT32_MAX)  # as after 2**31 unseeded requests
    wrapped = eng.generate(prompts, 2, temperature=1.0)
    assert wrapped == eng.generate(prompts, 2, temperature=1.0, seed=[INT32_MAX, 0])
