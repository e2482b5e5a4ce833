"""Hypothesis strategies for hybridattn's inputs, and plain reference models to test against.

Opt-in: ``import hybridattn`` does not import this package (nor hypothesis, a test extra:
``pip install 'hybridattn[test]'``). Every strategy draws *valid* values, built through the
library's own constructors and host validation (``KimiLinearConfig``, the pool functions,
``make_worker_batch``, ``make_forward_batch``), so a property test starts from states the
library itself could have produced:

- ``kimi_linear_configs``: tiny ``KimiLinearConfig`` s (layer patterns, head sizes, MoE);
- ``slot_allocator_states``: a ``SlotAllocator`` after a random alloc / free history;
- ``req_to_token_pools``: a request table after a random alloc / free / write history;
- ``mla_token_pools``, ``recurrent_state_pools``: data pools with random contents;
- ``sampling_params``: per-request ``SamplingParams``;
- ``worker_batches``: a ``ServingState`` and a ``ModelWorkerBatch`` that ``step`` runs on it;
- ``forward_batches``: a ``ForwardBatch`` (slots allocated on the host) for the backends;
- ``kda_inputs``: ``q, k, v, g, beta`` with real gate magnitudes, packed or not.

The references are plain Python / NumPy, independent of the code they check:
``ref_kda`` (the KDA recurrence step by step in float64), ``ref_sample_probs`` (the
distribution a sampling request draws from), and the bookkeeping models
``RefSlotAllocator``, ``RefReqToTokenPool`` and ``RefServingPools`` (sets and
dicts), which take a real call's result, assert that it is a correct answer and record it.

A property test of your own around ``step``, say, then reads::

    from hypothesis import given
    from hybridattn import testing

    step_jit = jax.jit(hybridattn.step)

    @given(testing.worker_batches(config, max_running_requests=4, max_context_len=64))
    def test_step_keeps_the_pool_contract(ex):
        ref = testing.RefServingPools.from_state(ex.state)
        new_state, out = step_jit(params, ex.state, ex.batch)
        ref.step(ex.batch, new_state, out.ok)  # ok, slots, and nothing else written

Compile time. Everything a strategy draws has its shapes from small fixed buckets (the
arguments say which), and array *values* come from a drawn seed, so examples share compiled
programs: a test jits its function once per bucket, not once per example. A config is a
static argument, though: every distinct ``kimi_linear_configs`` draw compiles its own
model. Narrow its buckets (``num_layers=(2,)``, ``moe=False``, one size each) to bound that.

Hypothesis forbids strategies from consuming Python's global ``random``; the runtime type
checkers some test suites install (beartype) do, to spot-check containers. The strategies here
restore the global ``random`` state after every draw, so they work under such checkers.

One module per concept, every public name re-exported here: ``configs``, ``pool_states``,
``batches``, ``sampling`` and ``kda`` (strategies, and beside the last two their references),
``ref_pools`` and ``ref_serving`` (the bookkeeping references); ``common`` holds what they
share (hypothesis is imported there).
"""


from hybridattn.testing.batches import (
    ForwardBatchExample,
    WorkerBatchExample,
    forward_batches,
    worker_batches,
)
from hybridattn.testing.configs import kimi_linear_configs
from hybridattn.testing.kda import KDAInputs, kda_inputs, ref_kda
from hybridattn.testing.pool_states import (
    AllocatorState,
    ReqPoolState,
    mla_token_pools,
    recurrent_state_pools,
    req_to_token_pools,
    slot_allocator_states,
)
from hybridattn.testing.ref_pools import RefReqToTokenPool, RefSlotAllocator
from hybridattn.testing.ref_serving import RefServingPools
from hybridattn.testing.sampling import ref_sample_probs, sampling_params

__all__ = [
    "AllocatorState",
    "ForwardBatchExample",
    "KDAInputs",
    "RefReqToTokenPool",
    "RefServingPools",
    "RefSlotAllocator",
    "ReqPoolState",
    "WorkerBatchExample",
    "forward_batches",
    "kda_inputs",
    "kimi_linear_configs",
    "mla_token_pools",
    "recurrent_state_pools",
    "ref_kda",
    "ref_sample_probs",
    "req_to_token_pools",
    "sampling_params",
    "slot_allocator_states",
    "worker_batches",
]
