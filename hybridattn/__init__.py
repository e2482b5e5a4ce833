"""hybridattn: functional, JAX-first serving machinery for hybrid linear-attention models.

The public surface is what this module exports and the modules listed below (each with its
own ``__all__``); modules whose name starts with an underscore are internal.

All state lives in immutable pytrees updated by pure functions, so every piece composes
inside your own ``jax.jit``, ``lax.scan`` and ``while_loop``.

* ``hybridattn.ops``: the KDA (Kimi Delta Attention) kernels every KDA layer runs through.
* ``KimiLinearConfig``: the static model description (checkpoint / transformers formats).
* ``hybridattn.pools``: slot allocators, request pools, the MLA latent pool and the KDA
  recurrent-state pool.
* ``hybridattn.backends``: the MLA and KDA attention backends and the
  ``HybridLinearAttnBackend`` that dispatches each layer to one of them;
  ``hybridattn.backends.batch`` packs their ``ForwardBatch``.
* ``hybridattn.models.kimi_linear``: Kimi-Linear parameters (``init_params``, ``load``,
  ``save_pretrained``), the serving ``forward`` and the cache-free ``apply``.
* ``hybridattn.serving``: the pure serving ``step`` over a ``ServingState``:
  ``new_state, out = step(params, state, batch)``.
* ``hybridattn.mesh`` (the ``(data, tensor)`` mesh and its partition specs) and
  ``hybridattn.sharding`` (``ShardedStep``: the step on every device of a mesh).
* ``Engine``: continuous batching and prefix caching around ``step``, behind the front door
  both engines share (``servecore.client.EngineClient``): ``engine.generate(prompts, 16)``;
  ``EngineOptions`` documents every option; ``hybridattn.engine.scheduler`` is its
  plain-Python host logic.
* ``hybridattn.testing`` (imported on its own; needs hypothesis): strategies and reference
  implementations for property tests.

A tiny model, its serving pools and one step's batch (``jax.jit(hybridattn.step)`` runs it;
see ``help(hybridattn.step)``):

>>> import jax
>>> import hybridattn
>>> from hybridattn.models import kimi_linear
>>> cfg = hybridattn.KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
>>> cfg.layer_types  # layer 0 KDA, layer 1 MLA
('linear_attention', 'full_attention')
>>> params = kimi_linear.init_params(cfg, jax.random.key(0))
>>> state = hybridattn.ServingState.create(cfg, max_running_requests=2, max_context_len=16,
...                                        num_token_slots=33)
>>> batch = hybridattn.make_worker_batch([hybridattn.WorkItem(1, 0, [5, 6, 7])],
...                                      vocab_size=64, max_context_len=16)
>>> batch.input_ids.shape, batch.forward_mode
((3,), <ForwardMode.EXTEND: 1>)
"""

from hybridattn import ops, pools
from hybridattn.backends import (
    BatchRequest,
    ForwardBatch,
    ForwardMode,
    FullAttnMetadata,
    HybridLinearAttentionBackendMetadata,
    HybridLinearAttnBackend,
    KDAAttnBackend,
    LinearAttnMetadata,
    MLAAttnBackend,
    SnapshotSpec,
    attn_backend_wrapper,
    check_forward_batch,
    make_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine, EngineOptions, EngineStats
from hybridattn.ops import (
    kda_chunked,
    kda_decode,
    kda_gate,
    kda_recurrent,
    l2norm,
    short_conv,
)
from hybridattn.pools import (
    HybridReqToTokenPool,
    MLATokenPool,
    PoolExhausted,
    RecurrentStatePool,
    ReqToTokenPool,
    SlotAllocator,
)
from hybridattn.serving import (
    ModelWorkerBatch,
    SamplingParams,
    ServingState,
    StepOutput,
    WorkItem,
    borrow_prefix,
    decode_steps,
    make_worker_batch,
    release,
    step,
)

__all__ = [
    "EngineOptions",
    "ops",
    "pools",
    "BatchRequest",
    "Engine",
    "EngineStats",
    "ModelWorkerBatch",
    "SamplingParams",
    "ServingState",
    "StepOutput",
    "WorkItem",
    "borrow_prefix",
    "decode_steps",
    "make_worker_batch",
    "release",
    "step",
    "ForwardBatch",
    "ForwardMode",
    "FullAttnMetadata",
    "HybridLinearAttentionBackendMetadata",
    "HybridLinearAttnBackend",
    "HybridReqToTokenPool",
    "KDAAttnBackend",
    "KimiLinearConfig",
    "LinearAttnMetadata",
    "MLAAttnBackend",
    "MLATokenPool",
    "PoolExhausted",
    "RecurrentStatePool",
    "ReqToTokenPool",
    "SlotAllocator",
    "SnapshotSpec",
    "attn_backend_wrapper",
    "check_forward_batch",
    "kda_chunked",
    "kda_decode",
    "kda_gate",
    "kda_recurrent",
    "l2norm",
    "make_forward_batch",
    "short_conv",
]
