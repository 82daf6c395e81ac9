"""The engine's cost table: seconds per target step by flat-batch token count B (SPS(B) = 1 / T(B)) and
seconds per drafting round by number of requests, measured on this machine, interpolated, cached on disk;
and what a drafter's backlog costs per token (a new prompt, or the tokens of steps that drafted nothing).

The verify planners read it to decide how many drafts are worth verifying: verification is nearly free
while T(B) is flat (memory-bound decode) and stops paying as T(B) grows. Measurements run at a realistic
context length, with the batch split into verification-sized pieces of several requests.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_CONTEXT = 512
PIECE_LEN = 8  # tokens per request in a profiled step (an anchor and 7 drafts)


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear in x; linear extrapolation past either end from the nearest segment."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


@dataclass
class CostProfile:
    batch_tokens: list[int]  # B grid, increasing
    step_s: list[float]  # target forward seconds at each B
    draft_requests: list[int] = field(default_factory=lambda: [1])
    draft_s: list[float] = field(default_factory=lambda: [0.0])  # drafting round seconds at each R
    catch_up_s: float = 0.0  # drafter seconds per backlog token (fed beyond a round's usual few)
    meta: dict = field(default_factory=dict)  # what it was measured on

    def step_time(self, num_tokens: float) -> float:
        return _interpolate(self.batch_tokens, self.step_s, num_tokens)

    def sps(self, num_tokens: float) -> float:
        """Target steps per second at B tokens in the flat batch."""
        return 1.0 / self.step_time(num_tokens)

    def draft_time(self, num_requests: int) -> float:
        return _interpolate(self.draft_requests, self.draft_s, num_requests) if num_requests else 0.0

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        data = json.loads(Path(path).read_text())
        profile = cls(**data)
        if profile.batch_tokens != sorted(set(profile.batch_tokens)) or len(profile.step_s) != len(
            profile.batch_tokens
        ):
            raise ValueError(f"{path}: batch_tokens must be increasing, one step_s each")
        return profile

    def plot(self, path: str | Path) -> Path:
        """SPS(B) and target tokens/s B * SPS(B) against B (PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        sps = [1 / t for t in self.step_s]
        left.plot(self.batch_tokens, sps, marker="o")
        left.set(xscale="log", xlabel="tokens in the flat batch B", ylabel="target steps / s", title="SPS(B)")
        right.plot(self.batch_tokens, [b * s for b, s in zip(self.batch_tokens, sps)], marker="o")
        right.set(xscale="log", xlabel="B", ylabel="tokens / s", title="B x SPS(B)")
        fig.suptitle(self.meta.get("model", ""))
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return Path(path)


def default_grid(max_tokens: int) -> list[int]:
    grid, b = [], 1
    while b < max_tokens:
        grid.append(b)
        b *= 2
    return [*grid, max_tokens]


def cache_path(key: dict) -> Path:
    """Where a profile for this (model, dtype, device, threads, drafter, ...) lives."""
    root = Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "profiles" / f"{digest}.json"


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


def engine_key(engine) -> dict:
    """What a profile depends on, the draft length included (a serial drafter's round grows with it)."""
    return {
        "model": str(engine.config.model),
        "dtype": engine.config.dtype,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "drafter": engine.spec_config.model,
        "draft_tokens": engine.num_draft_tokens,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "context": DEFAULT_CONTEXT,
        "schema": 2,  # 2: catch_up_s, warm-up, T(B) non-decreasing
    }


ACCEPTED_PER_ROUND = 4  # new context rows per request and round when timing a drafter (anchor + 3)


def fake_requests(num_requests: int, context: int, vocab_size: int) -> list:
    from specserve.config import SamplingParams
    from specserve.engine.sequence import Sequence

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
            drafter.observe(seq, 0, torch.randn(seq.num_tokens - 1, drafter.model.fc.in_features))
    begin = time.perf_counter()
    drafter.propose(seqs, num_tokens)
    return time.perf_counter() - begin


def time_draft_round(drafter, seqs: list, num_tokens: int) -> float:
    """Seconds of one drafting round after each request gained ACCEPTED_PER_ROUND tokens (hidden-state
    drafters get random target features for them: their cost does not depend on the values)."""
    width = drafter.model.fc.in_features if drafter.capture_layers else 0
    for seq in seqs:
        start = seq.num_tokens - 1
        seq.output_token_ids += [7] * ACCEPTED_PER_ROUND
        if width:
            drafter.observe(seq, start, torch.randn(ACCEPTED_PER_ROUND, width))
    begin = time.perf_counter()
    drafter.propose(seqs, num_tokens)
    return time.perf_counter() - begin


@torch.inference_mode()
def profile_engine(engine, num_tokens: int, repeats: int = 3) -> CostProfile:
    """Measure T(B) on the engine's target (before it serves anything) and its drafter's round time."""
    from tqdm import tqdm

    from specserve.engine.model_runner import PieceInput

    context = min(DEFAULT_CONTEXT, engine.max_model_len - PIECE_LEN - 1)
    scratch = fake_requests(1, context + PIECE_LEN, engine.vocab_size)[0]
    engine.block_manager.grow(scratch, context + PIECE_LEN)  # every piece reads the same blocks: timing only

    def forward(b: int, _context: int) -> None:
        sizes = [PIECE_LEN] * (b // PIECE_LEN) + ([b % PIECE_LEN] if b % PIECE_LEN else [])
        pieces = [PieceInput([5] * n, context, scratch.block_table) for n in sizes]
        engine.runner.forward(pieces, range(b))  # logits at every row, as verification needs

    grid = default_grid(engine.config.max_num_batched_tokens)
    request_grid = default_grid(engine.config.max_num_seqs)
    with tqdm(total=len(grid) + len(request_grid), desc="profiling SPS(B)", leave=False) as bar:
        try:
            step_s = measure_target(forward, grid, repeats, bar)
        finally:
            engine.block_manager.free(scratch)
        draft_s, catch_up_s = [], []
        for r in request_grid:
            seqs = fake_requests(r, context, engine.vocab_size)
            drafter = engine.drafter
            k = engine.num_draft_tokens
            primed_s = prime_drafter(drafter, seqs, k)
            draft_s.append(sorted(time_draft_round(drafter, seqs, k) for _ in range(repeats))[repeats // 2])
            # The first round fed whole prompts where the timed ones feed ACCEPTED_PER_ROUND tokens each.
            catch_up_s.append((primed_s - draft_s[-1]) / (r * (context - ACCEPTED_PER_ROUND)))
            for seq in seqs:
                drafter.release(seq)
            bar.update(1)
    catch_up = max(sorted(catch_up_s)[len(catch_up_s) // 2], 0.0)
    return CostProfile(grid, step_s, request_grid, draft_s, catch_up, meta={"context": context})
