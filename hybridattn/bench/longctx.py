"""``python -m hybridattn.bench longctx``: one request at 4k..256k prompt tokens, each length
in a fresh process: prefill, decode against the bandwidth floor, peak memory and the MLA
attention's share of the step, judged against the benchmark's goals (see
:mod:`hybridattn.bench.cli`)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.backends import ForwardBatch, ForwardMode
from hybridattn.bench import anchors as A
from hybridattn.bench.common import interleaved_best, machine
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.engine.buckets import bucket
from hybridattn.models import kimi_linear as M
from hybridattn.serving import WorkItem, make_worker_batch

LONGCTX_LENGTHS = (4096, 16384, 65536, 262144)
"""Prompt lengths of ``bench longctx`` (``--quick``: up to 65536)."""


LONGCTX_TARGETS = dict(prefill_len=65536, prefill_peak_bytes=1.5e9, prefill_s=90.0,
                       completes_len=262144, decode_len=65536, decode_floor_ratio=3.0)
"""The long-context goals: a 64k prompt prefilled with a process peak of at most
1.5 GB in under 90 s; 256k completes; decode at 64k within 3x the bandwidth floor; peak memory
growing with the pools, not with chunk x context."""


def _mla_alone(mla, layer_ids, kv_pool, req_pool, rec_pool, rows, seq_lens, ext_lens, inputs,
               *, mode, kv_width, max_extend_len):
    """The MLA sub-backend alone, on the engine's pools and a batch's shapes: every MLA layer's
    ``forward_extend`` / ``forward_decode`` (new latents go to the sink, slot 0). Returns the
    outputs and the written pool (donate it, as the step does)."""
    T = inputs["q_nope"].shape[0]
    fb = ForwardBatch(input_ids=jnp.zeros((T,), jnp.int32), req_pool_indices=rows,
                      seq_lens=seq_lens, extend_seq_lens=ext_lens,
                      out_cache_loc=jnp.zeros((T,), jnp.int32), req_to_token_pool=req_pool,
                      token_to_kv_pool=kv_pool, recurrent_state_pool=rec_pool,
                      kv_width=kv_width, max_extend_len=max_extend_len, forward_mode=mode)
    backend = mla.with_forward_metadata(mla.get_forward_metadata(fb))
    outs = []
    for layer in layer_ids:
        out, fb = backend(layer, fb, **inputs)
        outs.append(out)
    return outs, fb.token_to_kv_pool


def _mla_runner(engine, row: int, seq_len: int, ext: int, kv_width: int,
                decode: bool) -> Callable[[], object]:
    """A call of the jitted MLA backend (all MLA layers) for one request of ``seq_len``
    tokens, ``ext`` of them new, attending over ``kv_width`` positions, that returns once its
    outputs are ready. It runs on a copy of the engine's latent pool (donated from call to
    call, so the engine's pool stays whole) and on the engine's tables as they are at each
    call, so it can run between the engine's steps."""
    cfg, st = engine.config, engine.state
    mla = st.backend.full_attn_backend
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    rng = np.random.default_rng(0)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)

    T = ext
    inputs = dict(q_nope=rnd(T, H, cfg.qk_nope_head_dim), q_pe=rnd(T, H, dr), c_kv=rnd(T, r),
                  k_pe=rnd(T, dr), w_kc=rnd(H, cfg.qk_nope_head_dim, r),
                  w_vc=rnd(H, cfg.v_head_dim, r))
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    fn = jax.jit(_mla_alone, static_argnums=(0, 1), donate_argnums=(2,),
                 static_argnames=("mode", "kv_width", "max_extend_len"))
    pool = [jax.tree.map(jnp.copy, st.token_to_kv_pool)]
    args = (jnp.asarray([row], jnp.int32), jnp.asarray([seq_len], jnp.int32),
            jnp.asarray([ext], jnp.int32))

    def run():
        st = engine.state
        outs, pool[0] = fn(mla, tuple(mla.layer_ids), pool[0], st.req_to_token_pool,
                           st.recurrent_state_pool, *args, inputs, mode=mode,
                           kv_width=kv_width, max_extend_len=ext)
        return jax.block_until_ready(outs)

    return run


def _time_mla(engine, row: int, seq_len: int, ext: int, kv_width: int, decode: bool,
              rounds: int = 3) -> float:
    """Best seconds of the jitted MLA backend call (all MLA layers) for one request of
    ``seq_len`` tokens, ``ext`` of them new, attending over ``kv_width`` positions."""
    run = _mla_runner(engine, row, seq_len, ext, kv_width, decode)
    return interleaved_best({"mla": run}, rounds, {"mla": lambda out: out})["mla"]


def _precompile_longctx(engine, prompt_len: int, new_tokens: int) -> None:
    """Compile every step shape one request of ``prompt_len`` + ``new_tokens`` meets (each
    prefill chunk's ``(B, T, W, Q)`` bucket, as ``Scheduler.plan`` picks it, and the decode
    buckets) by running the step on a batch that names a free row: it fails its fit check, so
    it runs as padding and writes only the sinks. The engine's own steps then compile nothing
    (``EngineStats.compiled_buckets`` tells)."""
    e, C, tb = engine, engine.chunked_prefill_size, engine.token_buckets
    row = 1  # free while the engine is idle
    shapes = set()
    for start in range(0, prompt_len, C):
        n = min(C, prompt_len - start)
        T = bucket(n, tb, "tokens")
        shapes.add((ForwardMode.EXTEND, 1, T, bucket(start + n, e.kv_buckets, "width"),
                    min(T, bucket(n, tb, "extend")), start, n))
    for seq in range(prompt_len + 1, prompt_len + new_tokens):
        shapes.add((ForwardMode.DECODE, 1, 1, bucket(seq, e.kv_buckets, "width"), 1, seq - 1, 1))
    done = set()
    for mode, B, T, W, Q, start, n in sorted(shapes):
        if (mode, B, T, W, Q) in done:
            continue
        done.add((mode, B, T, W, Q))
        batch = make_worker_batch(
            [WorkItem(row, start, [1] * n, slots=[1] * n)], vocab_size=e.config.vocab_size,
            max_context_len=e.max_context_len, forward_mode=mode, num_requests=B, num_tokens=T,
            kv_width=W, max_extend_len=Q, snapshot_chunk=e.scheduler.chunk_size)
        r = e.core.runner
        r.state, out = r.call(r.jit.step, r.params, r.state, batch)  # counted as its own
        assert not bool(out.ok), "the warm-up batch was meant to fail its fit check"


def _peak_rss(reset: bool = False) -> int:
    """This process's peak resident bytes (Linux ``VmHWM``; ``reset`` first sets the peak to
    the current size through ``/proc/self/clear_refs``); elsewhere ``ru_maxrss``."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    """Peak resident bytes of this process so far (Linux ``ru_maxrss``: KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mla_prefill_seconds(engine, prompt_len: int, row: int, mla_rounds: int) -> float:
    """The MLA backend alone on the prefill's chunks: per width bucket, one chunk's call at
    the mean length of that bucket's chunks (a blockwise form skips the blocks past a
    request's length, so the bucket's widest chunk would overstate it) times its chunks."""
    C = engine.chunked_prefill_size
    widths: dict[int, list[int]] = {}
    for end in range(C, prompt_len + C, C):
        end = min(end, prompt_len)
        widths.setdefault(bucket(end, engine.kv_buckets, "width"), []).append(end)
    mla_prefill = 0.0
    for W, ends in widths.items():
        seq = max(round(sum(ends) / len(ends)), min(C, prompt_len))
        mla_prefill += len(ends) * _time_mla(engine, row, seq, min(C, seq), W, False,
                                             mla_rounds)
    return mla_prefill


def _decode_beside_mla(engine, stream, tokens: list[int], row: int, ctx: int,
                       mla_rounds: int) -> tuple[list[float], float]:
    """Decode the rest of ``stream`` (its tokens appended to ``tokens``): after each step (one
    request: one token, one step) one call of the MLA backend alone on the decode shapes, so
    a noisy neighbour slows both alike. The steps' seconds, and the median MLA call.

    The MLA share is the median call over the median step. (The best of five calls after the
    decode, over the steps' mean, left a part outside the MLA call that seemed to grow by ~2 ms
    from 4k to 64k; a profile of the step shows no op outside the MLA call that grows with the
    width.)"""
    W_dec = bucket(ctx, engine.kv_buckets, "width")
    mla_run = _mla_runner(engine, row, ctx, 1, W_dec, True)
    mla_run()  # warm-up
    steps, mla_calls, last = [], [], engine.stats.decode_seconds
    for _, t in stream:
        tokens.append(t)
        steps.append(engine.stats.decode_seconds - last)
        last = engine.stats.decode_seconds
        t0 = time.perf_counter()
        mla_run()
        mla_calls.append(time.perf_counter() - t0)
    if not mla_calls:  # no decode step: the call alone (the row is free, the latents stay)
        mla_calls = [_time_mla(engine, row, ctx, 1, W_dec, True, max(mla_rounds, 5))]
    return steps, float(np.median(mla_calls))


def longctx_one(prompt_len: int, new_tokens: int, chunked_prefill_size: int | None,
                mla_rounds: int = 3) -> dict:
    """One request of ``prompt_len`` tokens + ``new_tokens`` on the tiny config, in this
    process (``bench_longctx`` runs each length in a fresh one): wall and steady prefill,
    decode step, peaks of this process's resident memory, and the MLA backend's share."""
    config = KimiLinearConfig.tiny()
    params = M.init_params(config, jax.random.key(0))
    ctx = prompt_len + new_tokens
    kw = {} if chunked_prefill_size is None else dict(chunked_prefill_size=chunked_prefill_size)
    # Synchronous rounds: a decode step and the MLA call timed after it alternate, and an
    # overlapped engine would have its next step on the device during that call.
    engine = Engine(config, params, max_running_requests=1, max_context_len=ctx,
                    num_token_slots=ctx + 1, prefix_cache=False, overlap=False, **kw)
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, prompt_len).tolist()
    t0 = time.perf_counter()
    _precompile_longctx(engine, prompt_len, new_tokens)
    compile_s = time.perf_counter() - t0
    compile_peak = _rss()
    base = _peak_rss(reset=True)
    t0 = time.perf_counter()
    stream = engine.stream([prompt], new_tokens)
    tokens = [next(stream)[1]]
    wall_prefill = time.perf_counter() - t0
    peak_prefill, peak_prefill_alone = _rss(), _peak_rss()
    s = engine.stats
    prefill = dict(steady_s=s.prefill_seconds, steady_tokens=s.prefill_tokens,
                   compile_s=s.compile_seconds, compiled=len(s.compiled_buckets))
    row = engine.scheduler.running[0].row
    mla_prefill = _mla_prefill_seconds(engine, prompt_len, row, mla_rounds)
    steps, mla_decode = _decode_beside_mla(engine, stream, tokens, row, ctx, mla_rounds)
    s = engine.stats
    decode_steps = s.decode_tokens
    decode_s = s.decode_seconds / max(decode_steps, 1)
    decode_median = float(np.median(steps)) if decode_steps else None
    return dict(
        prompt_len=prompt_len, new_tokens=new_tokens,
        chunked_prefill_size=engine.chunked_prefill_size,
        kv_buckets=list(engine.kv_buckets), tokens=tokens, wall_prefill_s=wall_prefill,
        prefill_tok_s=prompt_len / wall_prefill,
        prefill_steady_s=prefill["steady_s"], prefill_steady_tokens=prefill["steady_tokens"],
        compile_s=compile_s, prefill_compiled=prefill["compiled"],
        prefill_compile_s=prefill["compile_s"],
        mla_prefill_s=mla_prefill, mla_prefill_share=mla_prefill / wall_prefill,
        decode_step_s=decode_s if decode_steps else None, decode_steps=decode_steps,
        decode_step_median_s=decode_median, mla_decode_s=mla_decode,
        mla_decode_share=mla_decode / decode_median if decode_steps else None,
        compile_peak_rss_bytes=compile_peak, base_rss_bytes=base,
        peak_prefill_rss_bytes=peak_prefill, prefill_alone_peak_rss_bytes=peak_prefill_alone,
        peak_rss_bytes=_rss(),
        pool_bytes=engine.memory.pool_bytes, param_bytes=engine.memory.param_bytes,
        req_to_token_bytes=engine.memory.req_to_token_bytes,
        pool_bytes_per_token=engine.memory.mla_bytes_per_token,
    )


def _longctx_child(n: int, new_tokens: int, chunked_prefill_size: int | None,
                   mla_rounds: int, timeout_s: float) -> dict:
    """:func:`longctx_one` in a fresh process (``python -m hybridattn.bench longctx --one N``):
    its row, or ``{"prompt_len": n, "failed": why}``."""
    cmd = [sys.executable, "-m", "hybridattn.bench", "longctx", "--one", str(n),
           "--new-tokens", str(new_tokens), "--mla-rounds", str(mla_rounds)]
    if chunked_prefill_size is not None:
        cmd += ["--chunked-prefill", str(chunked_prefill_size)]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return dict(prompt_len=n, failed=f"ran past {timeout_s:.0f} s")
    if out.returncode != 0:
        why = (f"exit {out.returncode}" if out.returncode > 0 else
               f"killed by signal {-out.returncode}" + (" (out of memory?)"
                                                        if out.returncode == -9 else ""))
        tail = out.stderr.strip().splitlines()[-1:] or [""]
        return dict(prompt_len=n, failed=f"{why}: {tail[0][:200]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def bench_longctx(lengths=LONGCTX_LENGTHS, new_tokens: int = 8,
                  chunked_prefill_size: int | None = None, timeout_s: float = 3600.0,
                  mla_rounds: int = 3, compare_chunk: int | None = None) -> dict:
    """Run ``bench longctx`` (see :mod:`hybridattn.bench.cli`): each length in a fresh Python
    process (``python -m hybridattn.bench longctx --one N``), so its peak resident memory is its
    own; one that fails or runs past ``timeout_s`` is reported with its reason.
    ``compare_chunk``: also run each length with that ``chunked_prefill_size`` (other query
    tiles and blocks) and report whether its greedy tokens are the same."""
    config = KimiLinearConfig.tiny()
    bandwidth = A.memory_bandwidth_gbs()
    res: dict = dict(machine=machine(), config=config.to_dict(), new_tokens=new_tokens,
                     bandwidth_gbs=bandwidth, targets=LONGCTX_TARGETS, rows=[])
    for n in lengths:
        row = _longctx_child(n, new_tokens, chunked_prefill_size, mla_rounds, timeout_s)
        if "failed" in row:
            res["rows"].append(row)
            continue
        floor = A.decode_bytes_per_step(config, 1, n + new_tokens // 2)
        row["decode_floor_bytes"] = floor["total"]
        row["decode_floor_s"] = floor["total"] / (bandwidth * 1e9)
        if row["decode_step_s"]:
            row["decode_floor_ratio"] = row["decode_step_s"] / row["decode_floor_s"]
        if compare_chunk is not None:  # the same request with another blocking
            other = _longctx_child(n, new_tokens, compare_chunk, 1, timeout_s)
            row["compare_chunk"] = dict(chunked_prefill_size=compare_chunk,
                                        failed=other.get("failed"),
                                        same_tokens=other.get("tokens") == row["tokens"])
        res["rows"].append(row)
    res["verdict"] = _longctx_verdict(res)
    return res


def _longctx_verdict(res: dict) -> dict:
    """Each target: measured figure and whether it holds (None: its length did not run)."""
    t = res["targets"]
    by = {r["prompt_len"]: r for r in res["rows"]}
    ok = [r for r in res["rows"] if "failed" not in r]
    out: dict = {}
    r = by.get(t["prefill_len"])
    if r is not None and "failed" not in r:
        out["prefill_64k_peak"] = dict(bytes=r["peak_prefill_rss_bytes"],
                                       holds=r["peak_prefill_rss_bytes"]
                                       <= t["prefill_peak_bytes"])
        out["prefill_64k_time"] = dict(s=r["wall_prefill_s"],
                                       holds=r["wall_prefill_s"] < t["prefill_s"])
    elif r is not None:
        out["prefill_64k_peak"] = out["prefill_64k_time"] = dict(failed=r["failed"], holds=False)
    r = by.get(t["completes_len"])
    if r is not None:
        out["completes_256k"] = dict(holds="failed" not in r, failed=r.get("failed"))
    r = by.get(t["decode_len"])
    if r is not None and r.get("decode_floor_ratio") is not None:
        out["decode_64k_floor"] = dict(ratio=r["decode_floor_ratio"],
                                       holds=r["decode_floor_ratio"] <= t["decode_floor_ratio"])
    if len(ok) >= 2:
        a, b = ok[-2], ok[-1]
        slope = ((b["prefill_alone_peak_rss_bytes"] - a["prefill_alone_peak_rss_bytes"])
                 / (b["prompt_len"] - a["prompt_len"]))
        pool = (b["pool_bytes"] - a["pool_bytes"]) / (b["prompt_len"] - a["prompt_len"])
        cfg = res["config"]
        # materialised scores of one chunk against every key: chunk x heads x 4 B per key
        scores = a["chunked_prefill_size"] * cfg["num_attention_heads"] * 4
        out["peak_linear_in_pools"] = dict(
            peak_bytes_per_token=slope, pool_bytes_per_token=pool,
            chunk_scores_bytes_per_token=scores, between=[a["prompt_len"], b["prompt_len"]],
            holds=slope < scores)
    return out


def print_longctx(res: dict) -> None:
    mb = 1e6
    cfg = res["config"]
    print(f"longctx: one request, KimiLinearConfig.tiny() ({cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, f32), {res['new_tokens']} new tokens; bandwidth "
          f"{res['bandwidth_gbs']:.1f} GB/s; each length in a fresh process")
    hdr = (f"{'prompt':>7} | {'prefill s':>9} | {'compile s':>9} | {'tok/s':>7} | "
           f"{'MLA share':>9} | {'peak MB':>7} | {'+prefill':>8} | {'pools MB':>8} | "
           f"{'params MB':>9} | {'decode ms':>9} | {'floor ms':>8} | {'x floor':>7} | "
           f"{'MLA share':>9}")
    print(f"{'':>7} | {'prefill':^51} | {'memory':^41} | {'decode step':^41}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        if "failed" in r:
            print(f"{r['prompt_len']:>7} | failed: {r['failed']}")
            continue
        dec = r["decode_step_s"]
        print(f"{r['prompt_len']:>7} | {r['wall_prefill_s']:9.1f} | "
              f"{r['compile_s']:9.1f} | {r['prefill_tok_s']:7.0f} | "
              f"{r['mla_prefill_share']:8.0%} | {r['peak_prefill_rss_bytes'] / mb:7.0f} | "
              f"{(r['prefill_alone_peak_rss_bytes'] - r['base_rss_bytes']) / mb:8.0f} | "
              f"{r['pool_bytes'] / mb:8.1f} | {r['param_bytes'] / mb:9.2f} | "
              f"{1e3 * (dec or 0):9.2f} | {1e3 * r['decode_floor_s']:8.3f} | "
              f"{r.get('decode_floor_ratio', 0):6.1f}x | {r['mla_decode_share'] or 0:8.0%}")
    print("prefill s: wall time to the first token, every step shape compiled beforehand "
          "(compile s);\nMLA share: the jitted MLA backend call alone on the same shapes, "
          "over the step(s)\n(decode: the median call, one after each step, over the median "
          "step);\npeak: the process's peak RSS up to the first token (compilation "
          "included); +prefill: how far\nthe peak rose during the prefill itself; floor: bytes "
          "of weights, KDA state and the request's\nlatents one decode step reads, over the "
          "bandwidth")
    v = res.get("verdict", {})
    t = res["targets"]

    def mark(e):
        return "n/a" if e is None else ("holds" if e.get("holds") else "MISSED")

    e = v.get("prefill_64k_peak")
    print(f"target 64k prefill peak <= {t['prefill_peak_bytes'] / 1e9:.1f} GB: {mark(e)}"
          + (f" ({e['bytes'] / 1e9:.2f} GB)" if e and "bytes" in e else ""))
    e = v.get("prefill_64k_time")
    print(f"target 64k prefill < {t['prefill_s']:.0f} s: {mark(e)}"
          + (f" ({e['s']:.1f} s)" if e and "s" in e else ""))
    e = v.get("completes_256k")
    print(f"target 256k completes: {mark(e)}" + (f" ({e['failed']})" if e and e.get("failed")
                                                  else ""))
    e = v.get("decode_64k_floor")
    print(f"target 64k decode <= {t['decode_floor_ratio']:.0f}x floor: {mark(e)}"
          + (f" ({e['ratio']:.1f}x)" if e else ""))
    for r in res["rows"]:
        c = r.get("compare_chunk")
        if c:
            print(f"{r['prompt_len']} tokens, chunked_prefill_size {r['chunked_prefill_size']} "
                  f"vs {c['chunked_prefill_size']}: "
                  + (f"failed ({c['failed']})" if c["failed"] else
                     "same greedy tokens" if c["same_tokens"] else "DIFFERENT tokens"))
    e = v.get("peak_linear_in_pools")
    if e:
        print(f"target peak linear in the pools: {mark(e)} (peak grows "
              f"{e['peak_bytes_per_token']:.0f} B/token between {e['between'][0]} and "
              f"{e['between'][1]}; pools {e['pool_bytes_per_token']:.0f} B/token; one chunk's "
              f"scores would be {e['chunk_scores_bytes_per_token']} B/token)")
