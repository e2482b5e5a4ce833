"""One process of the multi-process engine tests (``test_multiprocess.py``), started by
``hybridattn.launch.start``: ``python multiprocess_worker.py OUT MODE``. Every process builds
the same engine on a (2, 4) mesh over the group's 8 CPU devices; process 0 serves the
workload and writes its tokens to ``OUT`` (JSON); the others follow. ``MODE``: ``cache`` or
``nocache``; ``die``: process 1 exits abruptly after following two rounds; ``diverge``:
process 1 queues a request of its own before following (a bug the checks must catch)."""

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
params = kimi_linear.init_params(CFG, jax.random.key(0))
engine = Engine(CFG, params, mesh=make_mesh(2, 4), prefix_cache=mode != "nocache", **ENGINE)
if jax.process_index() == 0:
    prompts, kw = workload()
    got = {"greedy": engine.generate(prompts, 4),
           "seeded": engine.generate(prompts[:3], 4, temperature=0.9, seed=[5, 6, 7]),
           "again": engine.generate(prompts, 4)}
    if mode != "nocache":
        got["hit_rates"] = engine.stats.shard_hit_rates
    engine.close()
    with open(out, "w") as f:
        json.dump(got, f)
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
