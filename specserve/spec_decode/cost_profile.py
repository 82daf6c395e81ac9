"""The engine's cost table: seconds per target step by flat-batch token count B (SPS(B) = 1 / T(B)) and
seconds per drafting round by number of requests, interpolated; what a drafter's backlog costs per token (a
new prompt, or the tokens of steps that drafted nothing); its JSON file, its plot, and where the measured
table of an engine is cached (`profiler.py` measures it).

The verify planners read it to decide how many drafts are worth verifying: verification is nearly free
while T(B) is flat (memory-bound decode) and stops paying as T(B) grows.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specserve.cache_dir import cache_root
from specserve.spec_decode.context import TargetContext

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = 512  # tokens of context in a profiled step


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
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{digest}.json"


def profile_key(target: TargetContext, drafter_model: str | None, num_draft_tokens: int) -> dict:
    """What a profile depends on, the draft length included (a serial drafter's round grows with it)."""
    return {
        "model": target.model_name,
        "dtype": target.dtype,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "drafter": drafter_model,
        "draft_tokens": num_draft_tokens,
        "max_num_batched_tokens": target.max_num_batched_tokens,
        "context": DEFAULT_CONTEXT,
        "max_num_seqs": target.max_num_seqs,  # with the draft length, where the grid of B stops
        "schema": 3,  # 2: catch_up_s, warm-up, T(B) non-decreasing; 3: the capped, refined grid
        # only when split, so that single-process profiles cached before keep their keys
        **({"tensor_parallel_size": target.tensor_parallel_size} if target.tensor_parallel_size > 1 else {}),
    }


def cached_profile(key: dict) -> CostProfile | None:
    """The profile measured before for `key`, if any."""
    path = cache_path(key)
    return CostProfile.load(path) if path.is_file() else None


def save_cached_profile(key: dict, profile: CostProfile) -> Path:
    """Keep `profile` as the one measured for `key`, with its plot."""
    profile.meta.update(key)
    path = profile.save(cache_path(key))
    profile.plot(path.with_suffix(".png"))
    logger.info("cost profile cached in %s", path)
    return path
