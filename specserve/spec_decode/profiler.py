"""Measuring an engine's cost table (`CostProfile`) before it serves: target steps of B tokens over the
target's own runner and KV cache, at a realistic context length with the batch split into
verification-sized pieces of several requests, and the drafter's rounds on fake requests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from specserve.config import SamplingParams
from specserve.core.block_manager import BlockManager
from specserve.core.sequence import Sequence
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.cost_profile import DEFAULT_CONTEXT, CostProfile, default_grid
from specserve.spec_decode.drafters import Drafter
from specserve.worker.model_runner import ModelRunner, PieceInput

PIECE_LEN = 8  # tokens per request in a profiled step (an anchor and 7 drafts)
ACCEPTED_PER_ROUND = 4  # new context rows per request and round when timing a drafter (anchor + 3)


def measure_target(
    forward: Callable[[int, int], None], grid: list[int], repeats: int = 3, progress=None
) -> list[float]:
    """Median seconds of `forward(num_tokens, context)` at each B of the grid (progress: a tqdm or None),
    after an untimed forward (the first ones page the weights in and warm the allocator). Each B's time
    is capped at every larger B's: a larger batch never takes less time, and what makes a small B look
    slower is disturbance (measured once: T(1) 0.42 s against T(4) 0.32 s, which made verifying extra
    drafts look better than free)."""
    forward(grid[0], DEFAULT_CONTEXT)
    times = []
    for b in grid:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward(b, DEFAULT_CONTEXT)
            samples.append(time.perf_counter() - start)
        times.append(sorted(samples)[len(samples) // 2])
        if progress is not None:
            progress.update(1)
    return list(reversed(list(itertools.accumulate(reversed(times), min))))


def fake_requests(num_requests: int, context: int, vocab_size: int) -> list[Sequence]:
    prompt = [(100 + i) % vocab_size for i in range(context)]
    return [
        Sequence(f"profile-{r}", list(prompt), SamplingParams(temperature=1.0), 1 << 20)
        for r in range(num_requests)
    ]


def prime_drafter(drafter, seqs: list, num_tokens: int) -> float:
    """Hand a drafter its requests' prompts (random target features for hidden-state drafters) and run
    the first round, which also processes those prompts; its seconds."""
    if drafter.capture_layers:
        for seq in seqs:
            drafter.observe(seq, 0, torch.randn(seq.num_tokens - 1, drafter.feature_width))
    begin = time.perf_counter()
    drafter.propose(seqs, num_tokens)
    return time.perf_counter() - begin


def time_draft_round(drafter, seqs: list, num_tokens: int) -> float:
    """Seconds of one drafting round after each request gained ACCEPTED_PER_ROUND tokens (hidden-state
    drafters get random target features for them: their cost does not depend on the values)."""
    width = drafter.feature_width if drafter.capture_layers else 0
    for seq in seqs:
        start = seq.num_tokens - 1
        seq.output_token_ids += [7] * ACCEPTED_PER_ROUND
        if width:
            drafter.observe(seq, start, torch.randn(ACCEPTED_PER_ROUND, width))
    begin = time.perf_counter()
    drafter.propose(seqs, num_tokens)
    return time.perf_counter() - begin


@torch.inference_mode()
def profile_costs(
    target: TargetContext,
    runner: ModelRunner,
    block_manager: BlockManager,
    drafter: Drafter,
    num_draft_tokens: int,
    repeats: int = 3,
) -> CostProfile:
    """Measure T(B) on the target's runner (before it serves anything: the step borrows free KV blocks) and
    the drafter's round time by number of requests."""
    context = min(DEFAULT_CONTEXT, target.max_model_len - PIECE_LEN - 1)
    scratch = fake_requests(1, context + PIECE_LEN, target.vocab_size)[0]
    block_manager.grow(scratch, context + PIECE_LEN)  # every piece reads the same blocks: timing only

    def forward(b: int, _context: int) -> None:
        sizes = [PIECE_LEN] * (b // PIECE_LEN) + ([b % PIECE_LEN] if b % PIECE_LEN else [])
        # Slot 0 for every piece (hybrid models): timing only, and prefills start from a zero state.
        pieces = [PieceInput([5] * n, context, scratch.block_table, state_slot=0) for n in sizes]
        runner.forward(pieces, range(b))  # logits at every row, as verification needs

    grid = default_grid(target.max_num_batched_tokens)
    request_grid = default_grid(target.max_num_seqs)
    with tqdm(total=len(grid) + len(request_grid), desc="profiling SPS(B)", leave=False) as bar:
        try:
            step_s = measure_target(forward, grid, repeats, bar)
        finally:
            block_manager.free(scratch)
        draft_s, catch_up_s = [], []
        for r in request_grid:
            seqs = fake_requests(r, context, target.vocab_size)
            primed_s = prime_drafter(drafter, seqs, num_draft_tokens)
            rounds = sorted(time_draft_round(drafter, seqs, num_draft_tokens) for _ in range(repeats))
            draft_s.append(rounds[repeats // 2])
            # The first round fed whole prompts where the timed ones feed ACCEPTED_PER_ROUND tokens each.
            catch_up_s.append((primed_s - draft_s[-1]) / (r * (context - ACCEPTED_PER_ROUND)))
            for seq in seqs:
                drafter.release(seq)
            bar.update(1)
    catch_up = max(sorted(catch_up_s)[len(catch_up_s) // 2], 0.0)
    return CostProfile(grid, step_s, request_grid, draft_s, catch_up, meta={"context": context})
