"""``python -m hybridattn.bench serve --mesh DxT --processes P``: the engine on a ``D x T`` mesh
in one process of ``D * T`` CPU devices, and the same engine across ``P`` processes of
``D * T / P`` devices each (``hybridattn.launch``: gloo collectives on 127.0.0.1, one mesh;
``hybridattn.engine.processes``), serving the same requests.

Each run builds the engine (``serve_config``'s model, random weights, ``requests`` prompts of
``prompt_len`` tokens, ``new_tokens`` each, the prefix cache on), serves a warm-up batch of
other prompts (it compiles every step bucket the timed batch meets: ``compile_s`` is the
engine's ``stats.compile_seconds`` then), then times one ``generate`` of the batch on process
0 (``wall_s``; ``tok_s`` = generated tokens / wall; the stats' prefill and decode rates).
The greedy tokens of the two runs must be equal.

Example:
    $ python -m hybridattn.bench serve --mesh 2x4 --processes 2 --quick
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

__all__ = ["bench_processes", "engine_run", "print_processes"]


def engine_run(data: int, tensor: int, prompt_len: int, new_tokens: int,
               requests: int) -> dict | None:
    """One run (see the module docstring) on this process group's devices; the result on
    process 0, None on the others (which follow process 0's rounds)."""
    import jax

    from hybridattn.bench.serve import serve_config
    from hybridattn.engine import Engine
    from hybridattn.mesh import make_mesh
    from hybridattn.models import kimi_linear

    config = serve_config()
    params = kimi_linear.init_params(config, jax.random.key(0))
    L = prompt_len + new_tokens
    rows = requests // data
    engine = Engine(config, params, mesh=make_mesh(data, tensor), max_running_requests=requests,
                    max_context_len=L, num_token_slots=data * (2 * rows * L + 1),
                    num_snapshot_slots=data * (4 * rows + 1), chunked_prefill_size=rows * L,
                    request_buckets=(rows,))
    if jax.process_index() != 0:
        engine.follow()
        return None
    rng = np.random.default_rng(0)
    warm, prompts = (rng.integers(1, config.vocab_size, (requests, prompt_len)).tolist()
                     for _ in range(2))
    engine.generate(warm, new_tokens)
    compile_s, compilations = engine.stats.compile_seconds, engine.stats.num_compilations
    engine.reset_stats()
    t = time.perf_counter()
    out = engine.generate(prompts, new_tokens)
    wall = time.perf_counter() - t
    s = engine.stats
    engine.close()
    return dict(processes=jax.process_count(), devices=jax.device_count(), tokens=out,
                wall_s=wall, tok_s=requests * new_tokens / wall, prefill_tok_s=s.prefill_tok_s,
                decode_tok_s=s.decode_tok_s, compile_s=compile_s, compilations=compilations)


def bench_processes(data: int, tensor: int, processes: int, prompt_len: int = 32,
                    new_tokens: int = 8, requests: int = 8) -> dict:
    """Both runs: this process's (its JAX must have ``data * tensor`` CPU devices) and
    ``processes`` launched ones."""
    devices = data * tensor
    if processes < 2 or devices % processes:
        raise ValueError(f"--processes {processes} must be at least 2 and divide the mesh's "
                         f"{devices} devices")
    one = engine_run(data, tensor, prompt_len, new_tokens, requests)
    from hybridattn import launch

    with tempfile.TemporaryDirectory(prefix="hybridattn-bench-processes-") as tmp:
        out = pathlib.Path(tmp) / "result.json"
        procs = launch.start(["-m", "hybridattn.bench.processes", str(out), str(data),
                              str(tensor), str(prompt_len), str(new_tokens), str(requests)],
                             processes=processes, devices=devices // processes,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={"PYTHONPATH": os.pathsep.join(sys.path)})
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            raise RuntimeError("a benchmark process failed:\n" + "\n".join(
                log[-3000:] for log in logs))
        many = json.loads(out.read_text())
    return {"mesh": [data, tensor], "processes": processes, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "requests": requests, "one_process": one,
            "multi_process": many, "tokens_equal": one["tokens"] == many["tokens"]}


def print_processes(res: dict) -> None:
    """The two runs side by side."""
    d, t = res["mesh"]
    print(f"serve --mesh {d}x{t} --processes {res['processes']}: the engine, "
          f"{res['requests']} requests x {res['prompt_len']} tokens, {res['new_tokens']} new")
    print(f"  {'run':<24}{'tok/s':>8}{'prefill tok/s':>15}{'decode tok/s':>14}"
          f"{'wall s':>8}{'compile s':>11}{'compiles':>10}")
    for name, key in (("1 process", "one_process"),
                      (f"{res['processes']} processes", "multi_process")):
        r = res[key]
        print(f"  {name + ' x ' + str(r['devices'] // r['processes']) + ' devices':<24}"
              f"{r['tok_s']:>8.1f}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}"
              f"{r['wall_s']:>8.2f}{r['compile_s']:>11.1f}{r['compilations']:>10}")
    one, many = res["one_process"], res["multi_process"]
    print(f"  {res['processes']} processes / 1: tok/s {many['tok_s'] / one['tok_s']:.2f}x, "
          f"compile {many['compile_s'] / max(one['compile_s'], 1e-9):.2f}x; greedy tokens "
          f"equal: {res['tokens_equal']}")


if __name__ == "__main__":  # one launched process (``bench_processes``)
    from hybridattn import launch

    launch.initialize()
    target, *nums = sys.argv[1:]
    result = engine_run(*(int(n) for n in nums))
    if result is not None:
        pathlib.Path(target).write_text(json.dumps(result))
