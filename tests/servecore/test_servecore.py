"""servecore: the shared vocabulary (sampling settings, errors, stats, memory probe, checks).

Oracles: NumPy's float32 (what a value becomes on the device) for the range checks; fake
``/proc`` and cgroup trees for the memory probe; a subprocess for the import isolation.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servecore import MIN_TEMPERATURE, PoolExhausted, SamplingParams
from servecore.memory import cgroup_available_bytes, memory_budget
from servecore.validate import (
    eos_token_ids,
    is_int,
    plain_ints,
    prompt_list,
    stop_ids,
    token_ids,
)


def test_servecore_imports_neither_jax_nor_mlx():
    code = ("import sys, servecore, servecore.validate, servecore.memory; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'mlx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=None), "temperature=None must be a number"),
    (dict(temperature="0.5"), "temperature='0.5' must be a finite number"),
    (dict(temperature=1e39), "float32 range"),
    (dict(temperature=float("nan")), "finite"),
    (dict(temperature=-0.1), "must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(top_k=2**31), r"top_k=2147483648 must be an int in \[0, 2147483647\]"),
    (dict(top_k=2**63), "top_k=9223372036854775808"),
    (dict(top_k=3.0), "top_k=3.0 must be an int"),
    (dict(top_k=True), "top_k=True must be an int"),
    (dict(seed=-1), r"seed=-1 must be an int in \[0, 2147483647\]"),
    (dict(seed=2**31), "seed=2147483648"),
    (dict(seed=1.5), "seed=1.5"),
])
def test_sampling_params_refuse_what_the_device_cannot_hold(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@given(st.floats(min_value=0, max_value=3e38, allow_subnormal=True),
       st.floats(min_value=1e-300, max_value=1.0))
def test_tiny_temperatures_and_top_p_are_greedy_and_the_rest_fit_float32(t, p):
    sp = SamplingParams(temperature=t, top_p=p, seed=3)
    assert sp.greedy == (t < MIN_TEMPERATURE or p < 2.0**-31)
    if not sp.greedy:  # what reaches the device is a usable float32
        assert np.float32(sp.temperature) > 0 and np.float32(sp.top_p) > 0
        assert np.isfinite(np.float32(sp.temperature))


def test_sampling_params_keep_plain_python_values_and_one_field_order():
    sp = SamplingParams(np.float64(0.5), np.float32(0.9), np.int64(4), np.int32(7))
    assert (type(sp.temperature), type(sp.top_p), type(sp.top_k), type(sp.seed)) == (
        float, float, int, int)
    assert [f for f in SamplingParams.__dataclass_fields__] == [
        "temperature", "top_p", "top_k", "seed"]
    assert hash(sp) == hash(SamplingParams(0.5, float(np.float32(0.9)), 4, 7))


def test_pool_exhausted_carries_its_numbers_and_pickles():
    e = PoolExhausted(9, 4, what="KV pool slots")
    assert (e.requested, e.available) == (9, 4)
    assert str(e) == "KV pool slots exhausted: requested 9, 4 available"
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.requested == 9
    assert isinstance(e, RuntimeError)


def test_token_ids_stop_ids_and_prompt_lists_name_what_is_wrong():
    assert token_ids("p", np.array([1, 2]), vocab_size=4) == [1, 2]
    with pytest.raises(ValueError, match="p: token 1 is 4, outside the vocabulary"):
        token_ids("p", [1, 4], vocab_size=4)
    with pytest.raises(ValueError, match="p is empty"):
        token_ids("p", [], vocab_size=4)
    with pytest.raises(ValueError, match="1-D array of int"):
        token_ids("p", np.array([1.0, 2.0]), vocab_size=4)
    with pytest.raises(ValueError, match="token 0 is True"):
        token_ids("p", [True], vocab_size=4)
    assert stop_ids(None, 8) == frozenset() and stop_ids(np.int64(3), 8) == {3}
    for bad in (2.0, "2", [1.5], [9]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            stop_ids(bad, 8)
    assert prompt_list(iter([[1], "hi"])) == [[1], "hi"]
    for bad, match in ((None, "non-empty list"), ("text", "non-empty list"), ([], "empty one"),
                       ([1, 2], "flat list"), (np.array([1, 2]), "1-D array")):
        with pytest.raises(ValueError, match=match):
            prompt_list(bad)


_VALUES = st.one_of(st.integers(-3, 12), st.booleans(), st.floats(0, 10, allow_nan=False),
                    st.integers(0, 12).map(np.int64), st.just(2**31))


@given(st.one_of(st.lists(_VALUES, max_size=6), st.tuples(_VALUES, _VALUES)),
       st.integers(1, 2**31))
def test_the_fast_path_of_the_door_checks_accepts_only_plain_ints_in_range(values, hi):
    """``plain_ints`` lets lists of plain ints skip the per-element check: it may refuse more
    (NumPy scalars go the slow way, and still pass there), never accept what is not a token."""
    if plain_ints(values, hi):
        assert all(type(v) is int and 0 <= v < hi for v in values)
    elif all(is_int(v) and 0 <= v < hi for v in values) and values:
        assert token_ids("x", list(values), vocab_size=hi) == [int(v) for v in values]


def test_eos_ids_from_every_tokenizer_form():
    class HF5:  # transformers 5 may give the plural attribute as a bare int
        eos_token_ids = 2

    class Lists:
        eos_token_ids = None
        eos_token_id = [1, 2]

    class Bad:
        eos_token_id = "</s>"

    assert eos_token_ids(HF5()) == {2} and eos_token_ids(Lists()) == {1, 2}
    assert eos_token_ids(object()) == frozenset()
    with pytest.raises(ValueError, match="tokenizer.eos_token_id='</s>'"):
        eos_token_ids(Bad())


def _tree(tmp_path, cgroup_line, files):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 1000000 kB\nMemAvailable: 800000 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return proc, cg


def test_memory_probe_honours_cgroup_v2_limits_on_any_ancestor(tmp_path):
    gib = 1 << 30
    proc, cg = _tree(tmp_path, "0::/kube/pod/app", {
        "kube/memory.max": str(gib), "kube/memory.current": str(gib // 4),
        "kube/pod/memory.max": "max", "kube/pod/memory.current": "5",
        "kube/pod/app/memory.max": str(4 * gib), "kube/pod/app/memory.current": str(gib // 2),
    })
    assert cgroup_available_bytes(proc, cg) == gib - gib // 4  # the tighter ancestor wins
    assert memory_budget(proc, cg) == (gib - gib // 4, "cgroup memory limit")


def test_memory_probe_reads_cgroup_v1_and_ignores_unlimited_groups(tmp_path):
    proc, cg = _tree(tmp_path, "5:cpuacct,memory:/job", {
        "memory/job/memory.limit_in_bytes": str(300 * 1024 * 1024),
        "memory/job/memory.usage_in_bytes": str(100 * 1024 * 1024),
    })
    assert memory_budget(proc, cg) == (200 * 1024 * 1024, "cgroup memory limit")
    proc2, cg2 = _tree(tmp_path / "b", "0::/", {"memory.max": "max", "memory.current": "1"})
    assert memory_budget(proc2, cg2) == (800000 * 1024, "MemAvailable")
    proc3, cg3 = _tree(tmp_path / "c", "0::/big", {  # a limit above MemAvailable: the host wins
        "big/memory.max": str(1 << 40), "big/memory.current": "0"})
    assert memory_budget(proc3, cg3) == (800000 * 1024, "MemAvailable")
