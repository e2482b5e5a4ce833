"""hybridattn: functional, JAX-first serving machinery for hybrid linear-attention models.

All state lives in immutable pytrees updated by pure functions.

* :mod:`hybridattn.ops`: the KDA (Kimi Delta Attention) kernels every KDA layer runs through.
* :class:`KimiLinearConfig`: the static model description (checkpoint / transformers formats).
* :mod:`hybridattn.pools`: slot allocators, request pools, the MLA latent pool and the KDA
  recurrent-state pool.
* :mod:`hybridattn.backend`: the MLA and KDA attention backends and the
  :class:`HybridLinearAttnBackend` that dispatches each layer to one of them.
* :mod:`hybridattn.models.kimi_linear`: Kimi-Linear parameters (``init_params``, ``load``),
  the serving forward and the cache-free ``apply``.
* :mod:`hybridattn.serving`: the pure serving ``step`` over a :class:`ServingState`.
* :class:`Engine`: continuous batching around ``step``.
"""

from hybridattn import ops, pools
from hybridattn.backend import (
    ForwardBatch,
    ForwardMode,
    FullAttnMetadata,
    HybridLinearAttentionBackendMetadata,
    HybridLinearAttnBackend,
    KDAAttnBackend,
    LinearAttnMetadata,
    MLAAttnBackend,
    attn_backend_wrapper,
    check_forward_batch,
)
from hybridattn.batch import BatchRequest, make_forward_batch
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine, EngineStats
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
    decode_steps,
    make_worker_batch,
    release,
    step,
)

__all__ = [
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
