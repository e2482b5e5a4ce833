"""A tiny host scheduler over real pools and backends, shared by the serving tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import pools as P
from hybridattn.backend import ForwardBatch, ForwardMode, MLAAttnBackend, attn_backend_wrapper
from hybridattn.batch import BatchRequest, make_forward_batch
from hybridattn.config import KimiLinearConfig

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
