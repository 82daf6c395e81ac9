"""How much of a GPU the caches get (`gpu_memory_utilization`, vLLM's rule): the engine may use that share
of the device's memory; the weights (target and drafter, loaded before this is asked) and the activation
peak of the largest forward a step can run come first, the caches get the rest. The peak is measured, not
estimated: one forward of `max_num_batched_tokens` prompt tokens, with logits for as many rows as a full
decode batch samples, on caches of its own that are freed afterwards."""

from __future__ import annotations

import torch

from specserve.worker.model_runner import ModelRunner, PieceInput

# The sampler's copies of a step's logits (processed, probabilities, draws, their reductions): what the
# probe forward's own logits are multiplied by.
SAMPLER_LOGIT_COPIES = 4


def activation_peak_bytes(
    model, num_tokens: int, logit_rows: int, block_size: int, dtype: torch.dtype
) -> int:
    """Device memory a forward of `num_tokens` prompt tokens takes beyond what is allocated before it."""
    device = next(model.parameters()).device
    table = list(range(-(-num_tokens // block_size)))
    runner = ModelRunner(model, len(table), block_size, dtype, num_state_slots=1)
    slot = 0 if model.has_recurrent_state else None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    rows = list(range(num_tokens - logit_rows, num_tokens))
    logits = runner.forward([PieceInput([0] * num_tokens, 0, table, slot)], rows).logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base + SAMPLER_LOGIT_COPIES * logits.nbytes
    del runner, logits
    torch.cuda.empty_cache()
    return peak


def cache_budget_bytes(total: int, utilization: float, allocated: int, activation_peak: int) -> int:
    """The caches' share: `utilization` of the device's `total`, less what is `allocated` (the weights)
    and the activation peak; 0 when nothing is left."""
    return max(0, int(total * utilization) - allocated - activation_peak)


def device_cache_budget(
    model,
    utilization: float,
    num_tokens: int,
    logit_rows: int,
    block_size: int,
    dtype: torch.dtype,
    graph_tokens: int = 0,
) -> int:
    """The caches' budget on `model`'s GPU, for steps of up to `num_tokens` tokens and `logit_rows` sampled
    rows (a full decode batch: every request's verification rows). `graph_tokens`: the largest CUDA graph
    bucket (worker/cuda_graphs.py), whose graphs keep a memory pool of their own: a forward of that many rows
    with logits for each, and the outputs every bucket keeps (less than as much again)."""
    device = next(model.parameters()).device
    peak = activation_peak_bytes(model, num_tokens, min(logit_rows, num_tokens), block_size, dtype)
    if graph_tokens:
        peak += 2 * activation_peak_bytes(model, graph_tokens, graph_tokens, block_size, dtype)
    total = torch.cuda.get_device_properties(device).total_memory
    return cache_budget_bytes(total, utilization, torch.cuda.memory_allocated(device), peak)
