"""Measurements behind :mod:`hybridattn.ops.mla`'s choices (a program, not a test; the library
never imports it).

``python -m hybridattn.bench mla forms``: absorbed vs decompressed extend over a 16k cached
prefix, for ``Q`` in {1, 64, 2048} new tokens of one request, on the tiny config and a
Kimi-like shape (H=32, dn=dv=128, dr=64, r=512), best of a few calls each.
``python -m hybridattn.bench mla blocks``: block sizes, decode (B=4) and extend (Q=64).
``python -m hybridattn.bench mla memory``: the compiled scratch (``memory_analysis()``) of one
extend step at width 64k, dense oracle vs blockwise.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.ops import mla

SHAPES = {  # name: (H, dn, dr, dv, r)
    "tiny": (4, 16, 8, 16, 32),
    "kimi": (32, 128, 64, 128, 512),
}


def _inputs(shape, B, Q, W, seed=0):
    H, dn, dr, dv, r = SHAPES[shape]
    T = B * Q
    rng = np.random.default_rng(seed)

    def rand(*s):
        return jnp.asarray(rng.normal(size=s), jnp.float32)

    pt = jnp.asarray(rng.permutation(B * W).reshape(B, W) + 1, jnp.int32)
    seq = jnp.full((B,), W, jnp.int32)
    ext = jnp.full((B,), Q, jnp.int32)
    qs = jnp.arange(B, dtype=jnp.int32) * Q
    return (rand(T, H, dn), rand(T, H, dr), rand(B * W + 1, r), rand(B * W + 1, dr),
            rand(H, dn, r) / np.sqrt(r), rand(H, dv, r) / np.sqrt(r), pt, seq, ext, qs)


def _best(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def forms(width=16384, block=512, query_block=512):
    print("| shape | Q | absorbed ms | decompressed ms | faster | rule says |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        H, dn, dr, dv, r = SHAPES[shape]
        for Q in (1, 64, 2048):
            args = _inputs(shape, 1, Q, width)
            t = {}
            for absorbed in (True, False):
                fn = jax.jit(functools.partial(
                    mla.mla_extend, max_extend_len=Q, scale=0.1, block_size=block,
                    query_block=query_block, absorbed=absorbed))
                t[absorbed] = _best(fn, args, 1 if Q == 2048 and shape == "kimi" else 3)
            rule = mla.prefers_absorbed(min(Q, query_block), qk_nope_head_dim=dn,
                                        qk_rope_head_dim=dr, v_head_dim=dv, kv_lora_rank=r)
            print(f"| {shape} | {Q} | {t[True] * 1e3:.1f} | {t[False] * 1e3:.1f} | "
                  f"{'absorbed' if t[True] < t[False] else 'decompressed'} | "
                  f"{'absorbed' if rule else 'decompressed'} |", flush=True)


def blocks(width=16384):
    print("| shape | step | " + " | ".join(f"bk={b}" for b in (128, 256, 512, 1024, 2048))
          + " | dense |")
    print("|---|---|" + "---|" * 6)
    for shape in SHAPES:
        for step, B, Q in (("decode B=4", 4, 1), ("extend Q=64", 1, 64)):
            args = _inputs(shape, B, Q, width)
            row = []
            for bk in (128, 256, 512, 1024, 2048):
                if step.startswith("decode"):
                    fn = jax.jit(functools.partial(mla.mla_decode, scale=0.1, block_size=bk))
                    a = args[:2] + args[2:8]
                else:
                    fn = jax.jit(functools.partial(mla.mla_extend, max_extend_len=Q, scale=0.1,
                                                   block_size=bk))
                    a = args
                row.append(_best(fn, a, 3))
            if step.startswith("decode"):
                dense = jax.jit(functools.partial(mla.ref_mla_decode, scale=0.1))
            else:
                dense = jax.jit(functools.partial(mla.ref_mla_extend, max_extend_len=Q,
                                                  scale=0.1))
            row.append(_best(dense, a, 3))
            print(f"| {shape} | {step} | " + " | ".join(f"{x * 1e3:.1f}" for x in row) + " |",
                  flush=True)


def memory(width=65536, B=2, Q=64):
    print("| shape | step | dense MiB | blockwise MiB |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        H, dn, dr, dv, r = SHAPES[shape]
        f32, i32 = jnp.float32, jnp.int32
        T, S = B * Q, 4099
        specs = [jax.ShapeDtypeStruct(s, d) for s, d in (
            ((T, H, dn), f32), ((T, H, dr), f32), ((S, r), f32), ((S, dr), f32),
            ((H, dn, r), f32), ((H, dv, r), f32), ((B, width), i32), ((B,), i32), ((B,), i32),
            ((B,), i32))]
        row = []
        for fn in (functools.partial(mla.ref_mla_extend, max_extend_len=Q, scale=0.1),
                   functools.partial(mla.mla_extend, max_extend_len=Q, scale=0.1)):
            mem = jax.jit(fn).lower(*specs).compile().memory_analysis()
            row.append(mem.temp_size_in_bytes / 2**20)
        print(f"| {shape} | extend B={B} Q={Q} W={width} | {row[0]:,.1f} | {row[1]:,.2f} |",
              flush=True)


MLA_TABLES = {"forms": forms, "blocks": blocks, "memory": memory}
"""``python -m hybridattn.bench mla TABLE``: each table's function (it prints the table)."""
