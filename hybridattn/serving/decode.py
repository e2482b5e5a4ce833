"""Many decode steps in one ``lax.while_loop`` (:func:`decode_steps`), with per-request stop
tokens and limits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from hybridattn.backends import (
    ForwardMode,
)
from hybridattn.serving.one_step import step
from hybridattn.serving.state import ServingState
from hybridattn.serving.worker_batch import ModelWorkerBatch
from servecore.validate import check_int

__all__ = [
    "decode_steps",
]

def padding_unless(batch: ModelWorkerBatch, keep: Bool[Array, " B"]) -> ModelWorkerBatch:
    """``batch`` with the rows where ``keep`` is False turned into padding (row 0, no new
    token): they allocate no token slot and write only the slot-0 sinks."""
    zero = jnp.zeros_like(batch.req_pool_indices)
    return batch.replace(
        input_ids=jnp.where(keep, batch.input_ids, 0).astype(jnp.int32),
        req_pool_indices=jnp.where(keep, batch.req_pool_indices, zero),
        seq_lens=jnp.where(keep, batch.seq_lens, 0).astype(jnp.int32),
        extend_seq_lens=jnp.where(keep, batch.extend_seq_lens, 0).astype(jnp.int32),
    )


def _decode_limits(batch: ModelWorkerBatch, num_steps: int, stop_token_ids, max_tokens):
    """:func:`decode_steps`'s checked ``(stop_token_ids [B, S], limits [B])`` (the steps each
    row may run), with their defaults (no stop token; ``num_steps``)."""
    if batch.forward_mode != ForwardMode.DECODE:
        raise ValueError(f"decode_steps starts from a DECODE batch, got forward_mode="
                         f"{batch.forward_mode.name} (run the prompt with step, then "
                         "next_decode)")
    B = batch.batch_size
    if stop_token_ids is None:
        stop_token_ids = jnp.full((B, 1), -1, jnp.int32)
    if stop_token_ids.ndim != 2 or stop_token_ids.shape[0] != B:
        raise ValueError(f"stop_token_ids has shape {stop_token_ids.shape}, expected "
                         f"[B={B}, S]")
    limits = (jnp.full((B,), num_steps, jnp.int32) if max_tokens is None
              else jnp.minimum(max_tokens, num_steps).astype(jnp.int32))
    if limits.shape != (B,):
        raise ValueError(f"max_tokens has shape {limits.shape}, expected [B={B}]")
    return stop_token_ids, limits


def _named_slots(batch: ModelWorkerBatch, num_steps: int, slots):
    """:func:`decode_steps`'s checked host ``slots`` and its first batch (which carries the
    ``out_cache_loc`` field from the start, as every step of the loop does)."""
    if slots is None:
        return None, batch
    B = batch.batch_size
    if slots.shape != (num_steps, B):
        raise ValueError(f"slots has shape {slots.shape}, expected [num_steps={num_steps}, "
                         f"B={B}]")
    return slots, batch.replace(out_cache_loc=slots[0])


def decode_steps(
    params,
    state: ServingState,
    batch: ModelWorkerBatch,
    num_steps: int,
    stop_token_ids: Int[Array, "B S"] | None = None,
    max_tokens: Int[Array, " B"] | None = None,
    return_slots: bool = False,
    slots: Int[Array, "N B"] | None = None,
) -> (tuple[ServingState, Int[Array, "N B"], Bool[Array, ""]]
      | tuple[ServingState, Int[Array, "N B"], Bool[Array, ""], Int[Array, "N B"]]):
    """Up to ``num_steps`` greedy-or-sampled decode steps in one ``lax.while_loop``,
    starting from a DECODE ``batch`` whose ``input_ids`` are each request's next token and
    whose ``kv_width`` has room for the tokens each request may run. Returns ``(state,
    tokens [num_steps, B], ok)``: ``tokens[i, b]`` is what row ``b`` sampled at step ``i``,
    or -1 where the row ran no step ``i`` (padding, a finished row, a failed step); ``ok``
    is False if a step ran out of slots (that step and the later ones changed nothing). With
    ``return_slots``, also the ``[num_steps, B]`` slots each step wrote (0: none). ``slots``
    (``[num_steps, B]``): the host's token slots (``out_cache_loc``; None: steps allocate).

    A request finishes inside the run when it samples one of its ``stop_token_ids[b]``
    (padded with -1; default: none) or has run ``max_tokens[b]`` steps (default:
    ``num_steps``; 0: it runs none). From the next step on its row is padding (no token slot,
    nothing written): the pools end as if it had been stepped alone up to its finish. The loop
    ends early once every row has finished. Sampling keys depend on the request and position
    only, so the tokens are those of ``step`` called step by step.

    Jit it with ``num_steps`` static: ``jax.jit(decode_steps, static_argnums=3,
    donate_argnums=1)``; it compiles once per batch bucket, ``num_steps`` and stop-set width
    ``S``. Here only its shapes (``jax.eval_shape`` compiles nothing), for rows 1 and 2 with
    3 and 2 tokens in the pools; row 2 stops on token 7 or after 4 tokens:

    >>> from hybridattn.config import KimiLinearConfig
    >>> from hybridattn.serving import WorkItem, make_worker_batch
    >>> from hybridattn.models import kimi_linear
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=2, max_context_len=16,
    ...                             num_token_slots=33)
    >>> batch = make_worker_batch([WorkItem(1, 3, [11]), WorkItem(2, 2, [12])],
    ...                           vocab_size=64, max_context_len=16,
    ...                           forward_mode=ForwardMode.DECODE, kv_width=16)
    >>> stops, limits = jnp.array([[-1], [7]]), jnp.array([8, 4])
    >>> _, tokens, ok = jax.eval_shape(lambda p, s, b: decode_steps(p, s, b, 8, stops, limits),
    ...                                kimi_linear.param_shapes(cfg), state, batch)
    >>> tokens.shape, tokens.dtype, ok.shape  # [num_steps, B]
    ((8, 2), dtype('int32'), ())
    """
    check_int("num_steps", num_steps, 1)
    stop_token_ids, limits = _decode_limits(batch, num_steps, stop_token_ids, max_tokens)
    B = batch.batch_size
    alive = (batch.req_pool_indices > 0) & (batch.extend_seq_lens > 0) & (limits > 0)
    tokens = jnp.full((num_steps, B), -1, jnp.int32)
    given, batch = _named_slots(batch, num_steps, slots)
    slots = jnp.zeros((num_steps, B), jnp.int32)

    def cond(carry):
        i, _, _, alive, _, _, _, _ = carry
        return (i < num_steps) & jnp.any(alive)

    def body(carry):
        i, state, batch, alive, ran, ok, tokens, slots = carry
        if given is not None:
            batch = batch.replace(out_cache_loc=given[i])
        state, out = step(params, state, batch)
        ok &= out.ok
        stepped = alive & out.ok  # a failed step ran every row as padding
        tok = out.next_token_ids
        tokens = tokens.at[i].set(jnp.where(stepped, tok, -1))
        slots = slots.at[i].set(jnp.where(stepped, out.token_slots, 0))
        ran += stepped
        hit = jnp.any(tok[:, None] == stop_token_ids, axis=1)
        alive = stepped & ~hit & (ran < limits)
        # finished rows run as padding from here on (next_decode keeps padding as padding)
        batch = padding_unless(batch.next_decode(tok), alive)
        return i + 1, state, batch, alive, ran, ok, tokens, slots

    carry = (jnp.int32(0), state, padding_unless(batch, alive), alive,
             jnp.zeros(B, jnp.int32), jnp.bool_(True), tokens, slots)
    _, state, _, _, _, ok, tokens, slots = jax.lax.while_loop(cond, body, carry)
    return (state, tokens, ok, slots) if return_slots else (state, tokens, ok)
