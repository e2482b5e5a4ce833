"""The pure serving step: ``new_state, out = step(params, state, batch)``.

``ServingState`` holds everything a serving step reads and writes: the request table
(with each request's recurrent-state slot), the token-slot allocator, the MLA latent pool, the
KDA state pool, the attention backend (static configuration only) and the base RNG key.
``ModelWorkerBatch`` is one step's work, padded to shape buckets: extend requests (a whole
prompt, a chunk of one, or a chunk after a cached prefix) and decode requests (one token each)
mixed in one ``EXTEND`` batch, or a ``DECODE`` batch of one token per request.

One step, all inside one ``jax.jit``::

    allocate a token slot for every new token  (a failed allocation: ok=False, state unchanged)
    req_to_token[row, position] = slot
    ForwardBatch -> backend metadata -> model forward (MLA latents and KDA states written)
    last-token logits of every request -> per-request sampling -> next tokens

Sampling is per request (greedy when ``temperature == 0``, else temperature, top-k, top-p) and
reproducible: the key of a request's token at position ``p`` is derived from the state's base
key, the request's ``seed`` and ``p`` only, so a request samples the same tokens whichever
other requests share its batches (up to floating-point rounding: a step's shapes choose the
kernels, so logits agree to ~1e-6, and a near-tie may break either way). Requests with equal
seeds and prompts sample alike; give them different seeds for different samples.

The step composes: ``decode_steps`` runs up to N decode steps in a ``lax.while_loop`` (rows
that sample a stop token or reach their token budget turn into padding inside it), and users
may write their own loops around ``step`` the same way.

Request rows are allocated by the host (``hybridattn.pools.alloc_reqs_or_raise`` on
``state.req_to_token_pool``) and released with ``release``, which frees a request's token
slots, its row and its state slot together.
"""

from hybridattn.serving.decode import decode_steps
from hybridattn.serving.one_step import step
from hybridattn.serving.rows import borrow_prefix, release
from hybridattn.serving.sampling import request_keys, sample, token_logprobs
from hybridattn.serving.state import ServingState, StepOutput, create_state
from hybridattn.serving.worker_batch import ModelWorkerBatch, WorkItem, make_worker_batch
from servecore.sampling import SamplingParams

__all__ = [
    "create_state",
    "ModelWorkerBatch",
    "borrow_prefix",
    "SamplingParams",
    "ServingState",
    "StepOutput",
    "WorkItem",
    "decode_steps",
    "make_worker_batch",
    "release",
    "request_keys",
    "sample",
    "step",
    "token_logprobs",
]
