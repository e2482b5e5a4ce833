"""Attention backends for hybrid models: MLA over a latent pool, KDA over a state pool, and the
:class:`HybridLinearAttnBackend` that dispatches each layer to one of them.

Data flow of one forward (all of it runs inside one ``jax.jit``)::

    ForwardBatch (tokens, request rows, lengths, output slots, the pools)
      -> backend.get_forward_metadata(batch)        # HybridLinearAttentionBackendMetadata
      -> backend = backend.with_forward_metadata(md) # split into the two sub-backends
      -> each layer: out, batch = backend(layer_id, batch, **inputs)
         MLA layers write c_kv / k_pe into batch.token_to_kv_pool and attend over it;
         KDA layers read and write conv + recurrent state in batch.recurrent_state_pool.

Backends hold static configuration (treedef) and the per-forward metadata (arrays); they hold no
memory. The pools travel in the :class:`ForwardBatch` and come back updated, like SGLang's
``ForwardBatch.token_to_kv_pool``, but functionally. Padded rows and tokens point at slot 0 of
every pool (the padding sink), so they never touch a live slot.

Batch layouts (static ``forward_mode``):

* ``EXTEND``: ``T`` packed new tokens of ``B`` requests (request ``b`` owns tokens
  ``[query_start[b], query_start[b] + extend_seq_lens[b])``; padding tokens at the tail).
  A request may have a cached prefix (``seq_lens[b] - extend_seq_lens[b] > 0``). A decode
  request inside an extend batch is simply a request with one new token: a mixed batch.
* ``DECODE``: one token per request, ``T == B``.
"""

from hybridattn.backends.base import (
    AttnBackend,
    ForwardBatch,
    ForwardMode,
    FullAttnMetadata,
    HybridLinearAttentionBackendMetadata,
    LinearAttnMetadata,
    SnapshotSpec,
    check_forward_batch,
)
from hybridattn.backends.batch import BatchRequest, make_forward_batch
from hybridattn.backends.hybrid import HybridLinearAttnBackend, attn_backend_wrapper
from hybridattn.backends.kda import KDAAttnBackend
from hybridattn.backends.mla import MLAAttnBackend

__all__ = [
    "AttnBackend",
    "BatchRequest",
    "make_forward_batch",
    "SnapshotSpec",
    "ForwardBatch",
    "ForwardMode",
    "FullAttnMetadata",
    "HybridLinearAttentionBackendMetadata",
    "HybridLinearAttnBackend",
    "KDAAttnBackend",
    "LinearAttnMetadata",
    "MLAAttnBackend",
    "attn_backend_wrapper",
    "check_forward_batch",
]
