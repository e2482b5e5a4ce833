"""``python -m hybridattn.bench serve --mesh DxT``: the serving step sharded over a
``(data, tensor)`` mesh of CPU devices: bytes per device, compile and step times, and whether
each data shard's greedy tokens equal the unsharded step's (see :mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import time

import jax
import numpy as np

from hybridattn import sharding
from hybridattn.backends import ForwardMode
from hybridattn.bench.serve import serve_config
from hybridattn.mesh import make_mesh
from hybridattn.models import kimi_linear
from hybridattn.pools import alloc_reqs_or_raise
from hybridattn.serving import ServingState, WorkItem, make_worker_batch, step


def bench_serve_mesh(data: int, tensor: int, batch: int = 2, prompt_len: int = 32,
                     new_tokens: int = 4) -> dict:
    """``serve --mesh``: the sharded step on a ``data x tensor`` mesh, ``batch`` requests of
    ``prompt_len`` tokens per data shard, one prefill and ``new_tokens - 1`` decodes."""
    config = serve_config()
    mesh = make_mesh(data, tensor)
    params = kimi_linear.init_params(config, jax.random.key(0))
    L = prompt_len + new_tokens
    slots = batch * L + 1
    sp = sharding.shard_params(params, config, mesh)
    state = ServingState.create(config, max_running_requests=batch * data, max_context_len=L,
                                num_token_slots=slots * data, mesh=mesh)
    run = sharding.ShardedStep(config, mesh)
    state, rows = run.alloc_rows(state, [batch] * data)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (data, batch, prompt_len)).tolist()
    pre = dict(vocab_size=config.vocab_size, max_context_len=L, num_requests=batch,
               num_tokens=batch * prompt_len, kv_width=L, max_extend_len=prompt_len)
    dec = dict(pre, num_tokens=batch, max_extend_len=1, forward_mode=ForwardMode.DECODE)
    dev = mesh.devices.flat[0]

    def per_device(tree):
        leaves = jax.tree.leaves(tree)
        return (sum(x.nbytes for x in leaves),
                sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards
                    if sh.device == dev))

    res: dict = {"mesh": [data, tensor], "devices": data * tensor, "batch_per_shard": batch,
                 "prompt_len": prompt_len, "new_tokens": new_tokens}
    for name, tree in (("params", sp), ("pools", state.replace(rng=None))):
        total, per = per_device(tree)
        res[f"{name}_bytes"], res[f"{name}_bytes_per_device"] = total, per
        res[f"{name}_fraction_per_device"] = per / total
    b = run.make_batch([[WorkItem(r, 0, p) for r, p in zip(rows[k], prompts[k], strict=False)]
                        for k in range(data)], **pre)
    tokens, compiled, compile_s, step_s = [], {}, {}, {"prefill": [], "decode": []}
    for i in range(new_tokens):
        kind = "prefill" if i == 0 else "decode"
        if kind not in compiled:
            t0 = time.perf_counter()
            compiled[kind] = run.lower(sp, state, b).compile()
            compile_s[kind] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, out = compiled[kind](sp, state, b)
        nxt = np.asarray(out.next_token_ids)
        step_s[kind].append(time.perf_counter() - t0)
        tokens.append(nxt)
        b = run.make_batch([[WorkItem(r, prompt_len + i, [int(nxt[k, j])])
                             for j, r in enumerate(rows[k])] for k in range(data)], **dec)
    res["compile_s"] = compile_s
    res["step_s"] = {k: min(v) for k, v in step_s.items() if v}
    # the unsharded step on data shard 0's requests: same greedy tokens?
    ref = ServingState.create(config, max_running_requests=batch, max_context_len=L,
                              num_token_slots=slots)
    pool, _ = alloc_reqs_or_raise(ref.req_to_token_pool, batch)
    ref, one = ref.replace(req_to_token_pool=pool), jax.jit(step, donate_argnums=1)
    rb = make_worker_batch([WorkItem(r, 0, p)
                            for r, p in zip(rows[0], prompts[0], strict=True)], **pre)
    same = True
    for i in range(new_tokens):
        ref, out = one(params, ref, rb)
        got = np.asarray(out.next_token_ids)
        same &= got.tolist() == tokens[i][0].tolist()
        rb = make_worker_batch([WorkItem(r, prompt_len + i, [int(t)])
                                for r, t in zip(rows[0], got, strict=False)], **dec)
    res["greedy_tokens_equal_unsharded"] = bool(same)
    return res


def print_serve_mesh(res: dict) -> None:
    d, t = res["mesh"]
    print(f"serve --mesh {d}x{t} ({res['devices']} CPU devices), {res['batch_per_shard']} "
          f"requests x {res['prompt_len']} tokens per data shard, {res['new_tokens']} new")
    for name in ("params", "pools"):
        print(f"  {name:6s} {res[f'{name}_bytes'] / 2**20:8.2f} MiB total, "
              f"{res[f'{name}_bytes_per_device'] / 2**20:8.2f} MiB per device "
              f"({res[f'{name}_fraction_per_device']:.3f} of total; 1/{res['devices']} = "
              f"{1 / res['devices']:.3f})")
    c, s = res["compile_s"], res["step_s"]
    print("  compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in c.items())
          + "; step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s.items()))
    print(f"  greedy tokens equal the unsharded step's: {res['greedy_tokens_equal_unsharded']}")
