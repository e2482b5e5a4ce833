"""One engine across two processes (``hybridattn.engine.processes``): two processes of 4 CPU
devices each (gloo collectives on 127.0.0.1, ``hybridattn.launch``) serve on one (2, 4) mesh.
The oracles: the one-process engine on the same mesh of 8 devices (``conftest.py``) and the
unsharded engine, serving the same requests; greedy and seeded tokens must be equal, with
the prefix cache and without. A process that dies makes the other fail, in bounded time."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from hybridattn.config import KimiLinearConfig

HERE = pathlib.Path(__file__).parent
CFG = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64,
                            linear_num_heads=8, linear_head_dim=8, num_attention_heads=8,
                            num_experts=8, intermediate_size=64, moe_intermediate_size=16)
ENGINE = dict(max_context_len=32, max_running_requests=4, chunked_prefill_size=8,
              chunk_size=8, token_buckets=(12,), kv_buckets=(32,), request_buckets=(2,),
              num_token_slots=2 * 65)


def workload() -> tuple[list[list[int]], dict]:
    rng = np.random.default_rng(11)
    system = rng.integers(1, 64, 12).tolist()
    prompts = [system + rng.integers(1, 64, n).tolist() for n in (2, 5, 3, 7)]
    return prompts + [rng.integers(1, 64, 9).tolist()], {}


def _run(tmp_path: pathlib.Path, mode: str, timeout: float = 420) -> tuple[list, dict | None]:
    from hybridattn import launch

    out = tmp_path / f"{mode}.json"
    procs = launch.start([str(HERE / "multiprocess_worker.py"), str(out), mode], processes=2,
                         devices=4, heartbeat_seconds=5, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env={"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])},
                         cwd=HERE)
    end, logs = time.monotonic() + timeout, []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(end - time.monotonic(), 1))[0])
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    return list(zip(codes, logs, strict=True)), (json.loads(out.read_text())
                                                 if out.exists() else None)


@pytest.fixture(scope="module")
def want():
    """The tokens of the same engine in one process, on one device (a one-process mesh equals
    one device: tests/hybridattn/test_sharding.py, test_mesh_prefix_cache.py)."""
    import jax

    from hybridattn.engine import Engine
    from hybridattn.models import kimi_linear

    params = kimi_linear.init_params(CFG, jax.random.key(0))
    prompts, _ = workload()
    one = Engine(CFG, params, prefix_cache=False, **{**ENGINE, "request_buckets": (4,),
                                                      "num_token_slots": 129})
    return {"greedy": one.generate(prompts, 4),
            "seeded": one.generate(prompts[:3], 4, temperature=0.9, seed=[5, 6, 7])}


def test_two_processes_serve_as_one(tmp_path, want):
    """An engine with the prefix cache, then one without, in one launch of two processes."""
    ran, results = _run(tmp_path, "serve")
    assert all(code == 0 for code, _ in ran), ran
    for mode, got in results.items():
        assert got["greedy"] == want["greedy"] and got["again"] == want["greedy"], mode
        assert got["seeded"] == want["seeded"], mode
    assert all(rate > 0 for rate in results["cache"]["hit_rates"]), results["cache"]
    assert set(results) == {"cache", "nocache"}


def test_a_process_with_other_weights_is_refused_at_construction(tmp_path):
    """Process 1 loads other parameters: both processes refuse to build the engine, naming
    it, before any round (no mixed shards, no wrong tokens)."""
    ran, got = _run(tmp_path, "other_model", timeout=240)
    assert got is None and all(code != 0 for code, _ in ran), ran
    for _, log in ran:
        assert "processes [1] of 2 built the engine from another model" in log, log[-2000:]


def test_processes_that_diverge_raise_instead_of_computing(tmp_path):
    """Process 1 queues a request process 0 never sent: at the start of the first round the
    digests differ, and both processes raise ``ProcessesDiverged`` before any step."""
    ran, got = _run(tmp_path, "diverge", timeout=240)
    assert got is None and all(code != 0 for code, _ in ran), ran
    said = ("ProcessesDiverged: processes [1] of 2 hold another scheduler state at this "
            "round's start than process 0")
    for _, log in ran:
        assert said in log, log[-2000:]


def test_a_process_that_dies_ends_the_other_in_bounded_time(tmp_path):
    t = time.monotonic()
    ran, got = _run(tmp_path, "die", timeout=240)
    (code0, log0), (code1, _) = ran
    assert code1 == 3 and code0 != 0 and got is None, ran
    assert "Task 1 heartbeat timeout" in log0, log0[-2000:]  # JAX's error, naming the task
    assert time.monotonic() - t < 240


# one write each (atomic on a pipe): two processes' prints may interleave their parts
_SLEEPER = "import os, time; os.write(1, b'%d\\n' % os.getpid()); time.sleep(600)"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and waiting to be reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigterm_to_the_launcher_stops_its_processes():
    """``python -m hybridattn.launch`` stopped as a service manager stops it: the signal
    reaches every process it started, and the launcher exits after them (128 + SIGTERM)."""
    import select
    import signal

    pids: list[int] = []
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hybridattn.launch", "--processes", "2", "--devices", "1",
         "--", "-c", _SLEEPER], stdout=subprocess.PIPE)
    try:
        end, out = time.monotonic() + 60, b""
        while len(pids) < 2:  # (each child prints its pid; anything else printed is skipped)
            ready, _, _ = select.select([launcher.stdout], [], [],
                                        max(end - time.monotonic(), 0))
            assert ready, "the launcher's processes printed no pids within 60 s"
            chunk = os.read(launcher.stdout.fileno(), 4096)
            assert chunk, "the launcher's processes ended before printing their pids"
            out += chunk
            pids = [int(line) for line in out.split(b"\n")[:-1]]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        assert not any(_alive(pid) for pid in pids)
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
