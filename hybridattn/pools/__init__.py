"""Memory pools for serving: slot allocators, request tables, the MLA KV cache, KDA states.

Data flow. For a new request a request row is allocated (and, for a hybrid model, a
recurrent-state slot: :func:`alloc_reqs`) and, for every token it will run, a token slot from
a :class:`SlotAllocator` over the KV cache's slots (the token-to-KV allocator is just a
``SlotAllocator``; nothing else is needed). A host that owns the ids (``hybridattn.Engine``)
names them instead, and :func:`claim` / :func:`claim_reqs` check and record its choice.
Where each token lives is recorded with :func:`write_token_slots`
(``req_to_token[row, position] = slot``).
The attention backends then read :func:`get_token_slots` (MLA layers gather their latent KV
from :class:`MLATokenPool` at those slots, and write new tokens with :func:`set_mla_kv`) and
:func:`get_linear_recurrent_indices` (KDA layers read and write their conv / SSM states in
:class:`RecurrentStatePool` at those slots). Freeing a request row does not free its token
slots: whoever owns them (the scheduler, or a prefix cache) frees them explicitly.

Slot ownership. Every token slot has exactly one owner: the request row whose table records it
at a position at or past the row's ``borrowed`` length, or a prefix cache (positions below
``borrowed`` hold slots the row only borrows from a cache: ``serving.release`` never frees
them). Allocators keep an ``in_use`` bit per slot, and :func:`free` ignores a slot that is not
in use or is listed twice, so a double free is impossible: it cannot corrupt the free stack.

The slot-0 sink rule. Slot 0 of every pool (token slots, request rows, state slots) is a
reserved padding sink: no allocator ever hands it out, padded batch entries use index 0, and
their reads and writes land in the sink, so a fixed-shape batch needs no masking in the
kernels. Request row 0 is kept all zeros (writes to it are dropped), so a padded request sees
token slot 0 and state slot 0 only.

Everything here is an immutable pytree updated by pure functions, and jit-compiles: counts
are int32 arrays, sizes are static (shapes, ``max_count``, ``width``, layer ids). Inside jit,
running out of capacity is a returned ``ok`` flag, never an exception, and a failed
allocation returns its input unchanged. The ``*_or_raise`` helpers and the size properties
are for the host only.
"""

# Shape aliases (as in maxtext's page_manager):
#   N   allocator capacity: the slots it can hand out (= slots - 1, slot 0 is the sink)
#   M   slot ids passed to one free
#   R   request rows: max_running_requests + 1 (row 0 is the padding row)
#   L   max context length: columns of req_to_token
#   S   slots of a data pool, sink included: token slots (MLA) or state slots (KDA)
#   T   tokens in a batch (padding tokens use request row 0 / token slot 0)
#   B   requests in a batch (padding requests use row 0)
#   r   kv_lora_rank (MLA latent width); dr: qk_rope_head_dim (decoupled RoPE key width)
#   K   short-conv kernel size, C: conv channels; H, Dk, Dv: KDA heads and head dims


from hybridattn.pools.allocator import SlotAllocator, alloc, alloc_or_raise, claim, free
from hybridattn.pools.indexing import LayerRef
from hybridattn.pools.mla import MLATokenPool, get_mla_kv, get_mla_kv_flat, set_mla_kv
from hybridattn.pools.requests import (
    HybridReqToTokenPool,
    ReqToTokenPool,
    alloc_reqs,
    alloc_reqs_or_raise,
    claim_reqs,
    free_reqs,
    get_linear_recurrent_indices,
    get_token_slots,
    write_token_slots,
)
from hybridattn.pools.states import (
    RecurrentStatePool,
    copy_states,
    copy_states_to,
    get_states,
    set_states,
)
from servecore.errors import PoolExhausted

__all__ = [
    "HybridReqToTokenPool",
    "LayerRef",
    "MLATokenPool",
    "PoolExhausted",
    "RecurrentStatePool",
    "ReqToTokenPool",
    "SlotAllocator",
    "alloc",
    "alloc_or_raise",
    "alloc_reqs",
    "alloc_reqs_or_raise",
    "claim",
    "claim_reqs",
    "copy_states",
    "copy_states_to",
    "free",
    "free_reqs",
    "get_linear_recurrent_indices",
    "get_mla_kv",
    "get_mla_kv_flat",
    "get_states",
    "get_token_slots",
    "set_mla_kv",
    "set_states",
    "write_token_slots",
]
