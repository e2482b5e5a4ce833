"""One process of the multi-process engine tests (``test_multiprocess.py``), started by
``hybridattn.launch.start``: ``python multiprocess_worker.py OUT MODE``. Every process builds
the same engine on a (2, 4) mesh over the group's 8 CPU devices; process 0 serves the
workload and writes its tokens to ``OUT`` (JSON); the others follow. ``MODE``: ``serve``:
an engine with the prefix cache, then one without, in the same processes (one launch);
``other_model``: process 1 builds its engine from other weights; ``die``: process 1 exits
abruptly after following two rounds; ``diverge``: process 1 queues a request of its own
before following (a bug the checks must catch)."""

from __future__ import annotations

import json
import os
import sys

from hybridattn import launch

assert launch.initialize(), "start this with hybridattn.launch.start"

import jax  # noqa: E402
from test_multiprocess import CFG, ENGINE, workload  # noqa: E402

from hybridattn.engine import Engine  # noqa: E402
from hybridattn.mesh import make_mesh  # noqa: E402
from hybridattn.models import kimi_linear  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
# ``other_model``: process 1 loads other weights (a checkpoint of another step, say)
seed = 1 if mode == "other_model" and jax.process_index() == 1 else 0
params = kimi_linear.init_params(CFG, jax.random.key(seed))


def serve(e: Engine, cache: bool) -> dict:
    """Process 0: the workload's tokens (the engine closed after)."""
    prompts, kw = workload()
    got = {"greedy": e.generate(prompts, 4),
           "seeded": e.generate(prompts[:3], 4, temperature=0.9, seed=[5, 6, 7]),
           "again": e.generate(prompts, 4)}
    if cache:
        got["hit_rates"] = e.stats.shard_hit_rates
    e.close()
    return got


runs = (("cache", True), ("nocache", False)) if mode == "serve" else (("cache", True),)
results = {}
for name, cache in runs:
    engine = Engine(CFG, params, mesh=make_mesh(2, 4), prefix_cache=cache, **ENGINE)
    if jax.process_index() == 0:
        results[name] = serve(engine, cache)
    elif mode == "diverge":
        from hybridattn.engine.plan import Request

        engine.core.core.scheduler.add(Request(999, [1, 2, 3], 2))  # behind process 0's back
        engine.follow()
    elif mode == "die":
        core = engine.core
        for _ in range(2):  # follow two rounds, then vanish without a word
            from hybridattn.engine.processes import _broadcast

            core._round(_broadcast(None), lambda ev: None)
        os._exit(3)
    else:
        engine.follow()
if jax.process_index() == 0:
    with open(out, "w") as f:
        json.dump(results, f)
