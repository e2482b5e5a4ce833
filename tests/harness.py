"""A tiny host scheduler over real pools and backends, shared by the serving tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import pools as P
from hybridattn import serving as S
from hybridattn.backends import (
    BatchRequest,
    ForwardBatch,
    ForwardMode,
    MLAAttnBackend,
    attn_backend_wrapper,
    make_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from hybridattn.pools import alloc_reqs_or_raise

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
MAX_NEW = 64  # the harness writes token slots in fixed-size, masked chunks (one compile)

_alloc_req = jax.jit(P.alloc_reqs, static_argnums=2)
_write_slots = jax.jit(P.write_token_slots)


def two_layer_config() -> KimiLinearConfig:
    """1 KDA + 1 MLA layer with dense MLPs, read back from the checkpoint's config.json form
    (``linear_attn_config`` with 1-indexed ``kda_layers`` / ``full_attn_layers``)."""
    d = KimiLinearConfig.tiny(
        num_hidden_layers=2, num_experts=0, kda_layer_ids=(0,), full_attention_layer_ids=(1,)
    ).to_dict()
    assert d["linear_attn_config"]["kda_layers"] == [1]
    assert d["linear_attn_config"]["full_attn_layers"] == [2]
    return KimiLinearConfig.from_dict(d)


class Harness:
    """Pools, a backend and a tiny host scheduler: enough to drive real batches."""

    def __init__(self, cfg: KimiLinearConfig, max_reqs=6, max_ctx=64, slots=256, chunk=16):
        self.cfg = cfg
        H, Dk = cfg.linear_num_heads, cfg.linear_head_dim
        self.req = P.HybridReqToTokenPool.create(max_reqs, max_ctx)
        self.tok = P.SlotAllocator.create(slots)
        self.kv = P.MLATokenPool.create(
            cfg.full_attention_layer_ids, slots, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        )
        self.st = P.RecurrentStatePool.create(
            cfg.kda_layer_ids, self.req.num_state_slots, 3 * H * Dk, cfg.linear_conv_kernel_dim,
            H, Dk, Dk,
        )
        self.backend = attn_backend_wrapper(
            cfg, MLAAttnBackend.from_config(cfg, slots),
            num_state_slots=self.req.num_state_slots, chunk_size=chunk,
        )
        self.rows: dict[str, int] = {}
        self.cached: dict[str, int] = {}

    def batch(self, items, mode=EXTEND, B=None, T=None, W=None, Q=None) -> ForwardBatch:
        """``items``: ``[(name, new_token_ids)]``; new names get a request row."""
        reqs = []
        for name, ids in items:
            if name not in self.rows:
                self.req, row, ok = _alloc_req(self.req, 1, 1)
                assert bool(ok)
                self.rows[name] = int(row[0])
                self.cached[name] = 0
            row, start = self.rows[name], self.cached[name]
            self.tok, slots = P.alloc_or_raise(self.tok, len(ids), what="token slots")
            n = len(ids)
            padded = np.zeros(MAX_NEW, np.int32)
            padded[:n] = slots
            self.req = _write_slots(
                self.req, jnp.full((MAX_NEW,), row, jnp.int32),
                jnp.arange(start, start + MAX_NEW, dtype=jnp.int32), jnp.asarray(padded),
                jnp.arange(MAX_NEW) < n,
            )
            reqs.append(BatchRequest(row, start, list(ids), list(slots)))
            self.cached[name] = start + len(ids)
        return make_forward_batch(
            reqs, req_to_token_pool=self.req, token_to_kv_pool=self.kv,
            recurrent_state_pool=self.st, forward_mode=mode, num_requests=B, num_tokens=T,
            kv_width=W, max_extend_len=Q,
        )

    def bind(self, fb: ForwardBatch):
        return self.backend.with_forward_metadata(self.backend.get_forward_metadata(fb))

    def absorb(self, fb: ForwardBatch) -> None:
        self.kv, self.st = fb.token_to_kv_pool, fb.recurrent_state_pool


# The engine geometry the serving tests share (tests/hybridattn/test_serving.py,
# tests/hybridattn/test_adversarial_hybridattn.py), so their compiled steps are shared too.
CFG = KimiLinearConfig.tiny()  # 3 KDA : 1 MLA, MoE with a shared expert, dense layer 0
# One pool geometry and one set of buckets for every engine here, so the compiled steps are
# shared between tests: 384 token slots of a 96-token context hold 4 full requests.
ENGINE = dict(max_running_requests=8, max_context_len=96, num_token_slots=385, chunk_size=32,
              chunked_prefill_size=64,
              request_buckets=(4,), token_buckets=(16, 80), kv_buckets=(96,))


def realistic_params(cfg: KimiLinearConfig, seed: int = 0):
    """Random weights with Kimi-like gate magnitudes: exp(A_log) up to 200."""
    params = M.init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    for i in cfg.kda_layer_ids:
        attn = params["model"]["layers"][i]["self_attn"]
        a = rng.uniform(1.0, 200.0, attn["A_log"].shape)
        a.flat[0] = 200.0
        attn["A_log"] = jnp.log(jnp.asarray(a, jnp.float32))
    return params


PARAMS = realistic_params(CFG)


def engine(**kw) -> Engine:
    return Engine(CFG, PARAMS, **{**ENGINE, **kw})


def assert_whole(eng: Engine) -> None:
    """Every token slot of ``eng`` is free or held by its prefix cache, and freeing the cache
    frees them all: nothing leaked."""
    assert eng.num_free_slots + eng.num_cached_slots == eng.capacity
    runner = eng.core.runner
    if runner.inflight is None:  # the host owns the ids: each shard's device agrees
        for ids, allocator in ((runner.slots, eng.state.token_allocator),
                               (runner.rows, eng.state.req_to_token_pool.allocator)):
            stacks = np.asarray(allocator.free_slots).reshape(len(ids), -1)
            counts = np.asarray(allocator.num_free).reshape(-1)
            used = np.asarray(allocator.in_use).reshape(len(ids), -1)
            for k, host in enumerate(ids):
                assert sorted(stacks[k, : counts[k]].tolist()) == sorted(host)
                assert set(np.flatnonzero(used[k]).tolist()).isdisjoint(host)
    if not eng.has_unfinished():
        eng.reset_cache()
        assert eng.num_free_slots == eng.capacity


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def state_with_rows(n, **kw):
    """A fresh serving state of the shared geometry with ``n`` request rows allocated."""
    geometry = dict(max_running_requests=4, max_context_len=96, num_token_slots=385) | kw
    state = S.ServingState.create(CFG, **geometry)
    pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, n)
    return state.replace(req_to_token_pool=pool), [int(r) for r in rows]


STEP = jax.jit(S.step)  # not donated: tests reuse their input states


def prefilled(n=2):
    """A state with ``n`` requests prefilled (prompts of 11, 30, ... tokens) and their next
    tokens."""
    state, rows = state_with_rows(n)
    prompts = prompts_of([11, 30, 7][:n], seed=9)
    wb = S.make_worker_batch([S.WorkItem(r, 0, p) for r, p in zip(rows, prompts, strict=True)],
                             vocab_size=CFG.vocab_size, max_context_len=96, num_requests=4,
                             num_tokens=80, kv_width=96, max_extend_len=80)
    state, out = STEP(PARAMS, state, wb)
    return state, rows, [len(p) for p in prompts], [int(t) for t in out.next_token_ids[:n]]


def decode_batch(rows, lens, toks, order):
    """DECODE batch with request ``i`` at batch row ``order[i]`` (others padding)."""
    B = 4
    ids, req, seq, ext = (np.zeros(B, np.int32) for _ in range(4))
    for i, b in enumerate(order):
        ids[b], req[b], seq[b], ext[b] = toks[i], rows[i], lens[i] + 1, 1
    return S.ModelWorkerBatch(
        input_ids=jnp.asarray(ids), req_pool_indices=jnp.asarray(req),
        seq_lens=jnp.asarray(seq), extend_seq_lens=jnp.asarray(ext),
        temperatures=jnp.zeros(B), top_ks=jnp.zeros(B, jnp.int32), top_ps=jnp.ones(B),
        seeds=jnp.zeros(B, jnp.int32), kv_width=96, max_extend_len=1,
        forward_mode=ForwardMode.DECODE)


def mlx_kimi(path, config: KimiLinearConfig):
    """mlx-lm's own Kimi-Linear with the weights of the checkpoint directory ``path`` (the
    independent oracle of the engines); skips the test where mlx-lm is not installed."""
    import pytest

    mx = pytest.importorskip("mlx.core")
    kimi = pytest.importorskip("mlx_lm.models.kimi_linear")
    model = kimi.Model(kimi.ModelArgs.from_dict(config.to_dict()))
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    return model


def mlx_greedy(model, prompt, n: int) -> list[int]:
    """``n`` greedy tokens of an mlx-lm model after ``prompt``, with its own fresh cache (the
    oracle the engine's generation is compared with)."""
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out
