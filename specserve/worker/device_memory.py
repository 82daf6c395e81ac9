"""How much of a GPU the caches get (`gpu_memory_utilization`, vLLM's rule): the engine may use that share
of the device's memory; the weights (target and drafter, loaded before this is asked) and the activations
of the networks' forwards come first, the caches get the rest. The activations are measured, not
estimated (`peak_bytes`): for each network, the target and a drafter's, a probe forward of its largest
eager step and, where it replays CUDA graphs, one of its largest graph bucket, on caches of their own
that are freed afterwards (`lm_activation_bytes` for a causal LM, the target or a draft model;
`HiddenStateDrafter.activation_bytes` for a drafter's paged network)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.worker.model_runner import ModelRunner, PieceInput

# The sampler's copies of a step's logits (processed, probabilities, draws, their reductions): what the
# probe forward's own logits are multiplied by.
SAMPLER_LOGIT_COPIES = 4
# A network's CUDA graphs share one memory pool: it holds the largest bucket's forward, and the outputs
# every bucket keeps (less than as much again), so it is set aside as this many of that forward's peaks.
GRAPH_POOL_FORWARDS = 2


def peak_bytes(device: torch.device, setup: Callable[[], Callable[[], int]]) -> int:
    """Device memory a probe forward takes at its peak beyond what is allocated before it. `setup` allocates
    what the forward runs on (caches of its own) and returns it; the forward returns the bytes its outputs
    take later on (0 for none), which are added. Everything the probe holds is freed afterwards."""
    forward = setup()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    later = forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base + later
    del forward
    torch.cuda.empty_cache()
    return peak


def activation_peak_bytes(
    model, num_tokens: int, logit_rows: int, block_size: int, dtype: torch.dtype
) -> int:
    """Device memory a forward of `num_tokens` prompt tokens with logits for the last `logit_rows` takes,
    the sampler's copies of those logits included."""

    def setup() -> Callable[[], int]:
        table = list(range(-(-num_tokens // block_size)))
        runner = ModelRunner(model, len(table), block_size, dtype, num_state_slots=1)
        piece = PieceInput([0] * num_tokens, 0, table, 0 if model.has_recurrent_state else None)
        rows = list(range(num_tokens - logit_rows, num_tokens))

        def forward() -> int:
            return SAMPLER_LOGIT_COPIES * runner.forward([piece], rows).logits.nbytes

        return forward

    return peak_bytes(next(model.parameters()).device, setup)


def lm_activation_bytes(
    model, num_tokens: int, logit_rows: int, block_size: int, dtype: torch.dtype, graph_tokens: int = 0
) -> int:
    """What a causal LM's forwards set aside: steps of up to `num_tokens` tokens and `logit_rows` sampled
    rows and, with `graph_tokens` (the largest CUDA graph bucket, worker/cuda_graphs.py), its graphs' pool:
    of forwards of that many rows with logits for each."""
    peak = activation_peak_bytes(model, num_tokens, min(logit_rows, num_tokens), block_size, dtype)
    if graph_tokens:
        peak += GRAPH_POOL_FORWARDS * activation_peak_bytes(
            model, graph_tokens, graph_tokens, block_size, dtype
        )
    return peak


def cache_budget_bytes(total: int, utilization: float, allocated: int, activation_peak: int) -> int:
    """The caches' share: `utilization` of the device's `total`, less what is `allocated` (the weights)
    and the activation peak; 0 when nothing is left."""
    return max(0, int(total * utilization) - allocated - activation_peak)


def device_cache_budget(device: torch.device, utilization: float, activations: int) -> int:
    """The caches' budget on the GPU `device`, once every network is loaded there and `activations` (their
    forwards', measured as above) are set aside."""
    total = torch.cuda.get_device_properties(device).total_memory
    return cache_budget_bytes(total, utilization, torch.cuda.memory_allocated(device), activations)
