"""``python -m mlxcache.bench server --quick`` on llama, run as users run it: both servers
start as subprocesses, the table has both columns, the greedy answers agree everywhere, and
our server reports prompt tokens it did not compute (its prefix cache at work)."""

from __future__ import annotations

import doctest
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from mlxcache.bench.report import format_server_table  # noqa: E402
from mlxcache.bench.server import ANCHOR, OURS, summarize  # noqa: E402

pytestmark = pytest.mark.mlx

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["mlxcache.bench.chat_workloads", "mlxcache.bench.processes",
                                  "mlxcache.bench.server", "mlxcache.bench.quant"])
def test_the_server_bench_modules_examples_run(name):
    # the bench is a program, not in tests/test_api_docs' API lists: its examples run here
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and (result.attempted > 0 or name.endswith("server")), result


def test_the_quick_server_bench_runs_both_servers_and_their_answers_agree(tmp_path):
    out = tmp_path / "server.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcache.bench", "server", "--quick", "--families", "llama",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "mlxcache.serve" in table and "mlx_lm.server" in table, table
    assert "error" not in table, table
    result = json.loads(out.read_text())
    workloads = result["models"]["llama"]["workloads"]
    assert set(workloads) == {"shared_system", "multi_turn", "regen_edit"}
    for key, w in workloads.items():
        assert w["agree"] == w["total"] == w["requests"], (key, w)
        ours, anchor = w["servers"]["mlxcache.serve"], w["servers"]["mlx_lm.server"]
        assert ours["prompt_tokens"] == anchor["prompt_tokens"], key
        assert f"{w['agree']}/{w['total']}" in table
    shared = workloads["shared_system"]["servers"]["mlxcache.serve"]
    assert 0 < shared["computed_tokens"] < shared["prompt_tokens"], shared


def test_a_server_that_fails_or_reports_no_cached_count_is_shown_not_guessed():
    ok = {"wall_s": 1.0, "ttft_mean_s": 0.1, "ttft_p90_s": 0.2, "decode_s_per_token": 0.003,
          "prompt_tokens": 100, "computed_tokens": 40, "answers": ["w7"]}
    failed = summarize({OURS: [ok], ANCHOR: [{"error": "RuntimeError: it did not start"}]})
    uncounted = summarize({OURS: [ok], ANCHOR: [dict(ok, computed_tokens=None)]})
    assert "agree" not in failed and uncounted["agree"] == uncounted["total"] == 1
    assert "computed_tokens" not in uncounted["ratios"]
    table = format_server_table({
        "quick": True, "repeats": 1, "servers": [OURS, ANCHOR],
        "models": {"llama": {"caches": ["KVCache"], "workloads": {
            "a": {"title": "(a) failed", "requests": 1, **failed},
            "b": {"title": "(b) uncounted", "requests": 1, **uncounted}}}}})
    assert "mlx_lm.server error: RuntimeError: it did not start" in table
    computed = [line for line in table.splitlines() if "prompt tokens computed" in line]
    assert computed[0].split()[-2:] == ["40", "error"]
    assert computed[1].split()[-2:] == ["40", "n/a"]


def test_the_quick_restart_bench_reads_the_prefix_back_and_agrees(tmp_path):
    """``python -m mlxcache.bench restart --quick --families llama``: a writer process, then
    cold, disk and warm processes; the disk one reads the whole 1,024-token prefix, every
    process's greedy token agrees, and the table and JSON come out."""
    out = tmp_path / "restart.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "mlxcache.bench", "restart", "--quick",
                           "--families", "llama", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart benchmark (--quick)" in proc.stdout and "llama" in proc.stdout
    m = json.loads(out.read_text())["models"]["llama"]
    assert m["agree"] and m["disk_cached_tokens"] == 1024 and m["bytes_per_token"] > 0


def test_the_quick_quant_bench_holds_more_tokens_at_fewer_bits_and_agrees(tmp_path):
    """``python -m mlxcache.bench quant --quick``: under one pool budget 8 and 4 bits hold more
    tokens than full precision and hit where it cannot; mlxcache's greedy tokens equal
    mlx-lm's ``generate_step`` with a ``QuantizedKVCache`` from token 0 at every setting, and
    ``generate_step(kv_bits=...)``'s at full precision (quantized, it prefills in full
    precision first: counted, not required)."""
    out = tmp_path / "quant.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "mlxcache.bench", "quant", "--quick",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quantized K/V benchmark (--quick)" in proc.stdout, proc.stdout
    r = json.loads(out.read_text())
    budget = {row["bits"]: row for row in r["budget"]["rows"]}
    decode = {row["bits"]: row for row in r["decode"]["rows"]}
    assert set(budget) == set(decode) == {None, 8, 4}
    full = budget[None]
    assert full["pool_bytes"] <= r["budget"]["budget_bytes"] < 2 * full["pool_bytes"]
    assert full["pool_tokens"] < r["budget"]["distinct_prefix_tokens"]
    for bits in (8, 4):
        row = budget[bits]
        assert row["bytes_per_token"] < full["bytes_per_token"], row
        assert row["pool_tokens"] > full["pool_tokens"], row
        assert row["pool_bytes"] <= r["budget"]["budget_bytes"], row
        assert row["hit_rate"] > full["hit_rate"] and row["speedup"] > 0, row
        assert "attention layers at" in decode[bits]["quantized"], decode[bits]
    for bits, row in decode.items():
        assert row["agree_from_token_0"] == row["requests"] == r["decode"]["batch"], row
        assert 0 <= row["agree_kv_bits"] <= row["requests"], row
        assert row["mlxcache_tok_s"] > 0 and row["mlx_lm_tok_s"] > 0, row
        assert budget[bits]["same_tokens_as_no_reuse"], budget[bits]
    assert decode[None]["agree_kv_bits"] == decode[None]["requests"]
