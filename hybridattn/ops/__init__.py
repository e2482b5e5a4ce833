"""The kernels every layer of a hybrid model runs through, in plain JAX.

* :mod:`hybridattn.ops.kda`: KDA (Kimi Delta Attention): ``kda_chunked``, ``kda_recurrent``,
  ``kda_decode``, ``kda_gate``, ``l2norm``.
* :mod:`hybridattn.ops.conv`: the short causal convolution before the KDA recurrence.
* :mod:`hybridattn.ops.mla`: MLA (multi-head latent attention) over a paged latent pool.

All of them are pure, jit-compatible and differentiable.
"""

from hybridattn.ops.conv import short_conv
from hybridattn.ops.kda import ChunkStates, kda_chunked, kda_decode, kda_gate, kda_recurrent, l2norm
from hybridattn.ops.mla import (
    mla_decode,
    mla_extend,
    prefers_absorbed,
    ref_mla_decode,
    ref_mla_extend,
)

__all__ = [
    "ChunkStates",
    "kda_chunked",
    "kda_decode",
    "kda_gate",
    "kda_recurrent",
    "l2norm",
    "short_conv",
    "mla_decode",
    "mla_extend",
    "prefers_absorbed",
    "ref_mla_decode",
    "ref_mla_extend",
]
