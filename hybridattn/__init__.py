"""hybridattn: functional, JAX-first serving machinery for hybrid linear-attention models.

All state lives in immutable pytrees updated by pure functions. The first layer is
:mod:`hybridattn.ops`: the KDA (Kimi Delta Attention) kernels every KDA layer runs through.
"""

from hybridattn import ops
from hybridattn.ops import (
    kda_chunked,
    kda_decode,
    kda_gate,
    kda_recurrent,
    l2norm,
    short_conv,
)

__all__ = [
    "ops",
    "kda_chunked",
    "kda_decode",
    "kda_gate",
    "kda_recurrent",
    "l2norm",
    "short_conv",
]
