"""Measuring an engine's cost table (`CostProfile`): target steps of B tokens over the target's own runner
and KV cache, at a realistic context length with the batch split into verification-sized pieces of
several requests, and the drafter's rounds on fake requests.

Only the points the planner reads, and quickly. B goes no further than a step can hold (`max_num_seqs`
requests verifying `k` drafts each, within `max_num_batched_tokens`): a coarse grid four times apart from
1, each gap probed in its geometric middle and probed again where the probe left the straight line between
its neighbours by more than `BEND` (where T(B) bends from flat to linear). Drafting rounds are timed at a
grid four times apart in requests, on short prompts (a round's cost hardly depends on the context); what a
backlog token costs the drafter, once, on one longer prompt.

`CostProfiler` measures one point per `advance()`: between engine steps while the engine serves with a fixed
k (`Speculator`), or all at once (`measure`, for `specserve profile`, with a progress bar). Timing borrows
free capacity from the cache coordinator, as a request would, and waits while there is none: the target's
steps hold KV blocks and a hybrid target's state slot until the last target point; a drafter point's fake
requests hold room in the drafter's caches only within the `advance` that times them, so that nothing of
theirs is left when the engine's requests grow.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from specserve.config import SamplingParams
from specserve.core.cache_coordinator import CacheCoordinator
from specserve.core.cache_groups import PagedEntry, StateGroup
from specserve.core.sequence import Sequence
from specserve.platform import Platform
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.cost_profile import DEFAULT_CONTEXT, CostProfile
from specserve.spec_decode.drafters import Drafter
from specserve.worker.model_runner import ModelRunner, PieceInput

PIECE_LEN = 8  # tokens per request in a profiled step (an anchor and 7 drafts)
ACCEPTED_PER_ROUND = 4  # new context rows per request and round when timing a drafter (anchor + 3)
GRID_STEP = 4  # between coarse points, in tokens and in requests
BEND = 0.1  # a probe this far (relative) from the line through its neighbours is probed around again
MAX_TARGET_POINTS = 14
DRAFT_PROMPT = 32  # tokens of each fake request's prompt when timing drafting rounds
CATCH_UP_PROMPT = 256  # tokens of the one prompt whose feed prices a backlog token
REPEATS = 3
TIMING = "cost-profile"  # the request id the target's timed steps hold their state slot under


def coarse_grid(cap: int) -> list[int]:
    """1, 4, 16, ... below `cap`, and `cap`."""
    grid = [b for b in itertools.takewhile(lambda b: b < cap, (GRID_STEP**i for i in itertools.count()))]
    return [*grid, cap]


def seconds(run: Callable[[], object], platform: Platform) -> float:
    """Seconds of `run()` until the device has done its work too (`Platform.synchronize`: on a GPU a step
    returns once it is launched)."""
    platform.synchronize()
    start = time.perf_counter()
    run()
    platform.synchronize()
    return time.perf_counter() - start


def median_seconds(run: Callable[[], object], platform: Platform, repeats: int = REPEATS) -> float:
    return sorted(seconds(run, platform) for _ in range(repeats))[repeats // 2]


def fake_requests(num_requests: int, context: int, vocab_size: int) -> list[Sequence]:
    prompt = [(100 + i) % vocab_size for i in range(context)]
    return [
        Sequence(f"profile-{r}", list(prompt), SamplingParams(temperature=1.0), 1 << 20)
        for r in range(num_requests)
    ]


def prime_drafter(drafter, seqs: list, num_tokens: int, platform: Platform) -> float:
    """Hand a drafter its requests' prompts (random target features for hidden-state drafters) and run
    the first round, which also processes those prompts; its seconds."""
    if drafter.capture_layers:
        for seq in seqs:
            drafter.observe(seq, 0, torch.randn(seq.num_tokens - 1, drafter.feature_width))
    return seconds(lambda: drafter.propose(seqs, num_tokens), platform)


def time_draft_round(drafter, seqs: list, num_tokens: int, platform: Platform) -> float:
    """Seconds of one drafting round after each request gained ACCEPTED_PER_ROUND tokens (hidden-state
    drafters get random target features for them: their cost does not depend on the values)."""
    width = drafter.feature_width if drafter.capture_layers else 0
    for seq in seqs:
        start = seq.num_tokens - 1
        seq.output_token_ids += [7] * ACCEPTED_PER_ROUND
        if width:
            drafter.observe(seq, start, torch.randn(ACCEPTED_PER_ROUND, width))
    return seconds(lambda: drafter.propose(seqs, num_tokens), platform)


class CostProfiler:
    """Measures an engine's `CostProfile` one point at a time (module docstring)."""

    timing_states: StateGroup | None = None  # a hybrid target's slots, one of which the timed steps hold

    def __init__(
        self,
        target: TargetContext,
        runner: ModelRunner,
        caches: CacheCoordinator,
        drafter: Drafter,
        num_draft_tokens: int,
    ):
        self.target, self.runner, self.caches, self.blocks = target, runner, caches, caches.kv.blocks
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.context = min(DEFAULT_CONTEXT, target.max_model_len - PIECE_LEN - 1)
        schedulable = target.max_num_seqs * (num_draft_tokens + 1)
        self.max_tokens = max(1, min(target.max_num_batched_tokens, schedulable))
        self.steps: dict[int, float] = {}  # B -> seconds of a target step
        self.pending = coarse_grid(self.max_tokens)  # B values still to measure, in order
        self.last_probes: list[int] | None = None  # the latest round of probes (None: none yet)
        self.draft_points = coarse_grid(target.max_num_seqs)
        self.draft_s: dict[int, float] = {}
        self.catch_up_s: float | None = None
        self.scratch: PagedEntry | None = None  # the KV blocks the target's timed steps read
        self.bar: tqdm | None = None

    # ---- progress -----------------------------------------------------------------------------------------
    def announce(self, while_serving: bool) -> None:
        """Say what is measured and why; all at once (`while_serving` False) with a progress bar."""
        meanwhile = (
            ", between the engine's steps; until it is done every request verifies all its drafts "
            "(verify_policy 'fixed')"
            if while_serving
            else ""
        )
        tqdm.write(
            "[specserve] measuring the cost profile the load-aware verify policy needs (once, then cached): "
            f"drafting rounds at {len(self.draft_points)} request counts, target steps at ~"
            f"{len(self.pending) * 2 - 1} batch sizes up to {self.max_tokens} tokens{meanwhile}"
        )
        if not while_serving:
            total = len(self.draft_points) + 1 + len(self.pending)
            self.bar = tqdm(total=total, desc="cost profile", unit="point")

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _tick(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    @property
    def done(self) -> bool:
        return self.drafter_done and not self.pending

    @property
    def drafter_done(self) -> bool:
        return len(self.draft_s) == len(self.draft_points) and self.catch_up_s is not None

    # ---- measuring ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def advance(self) -> bool:
        """Measure the next point (the drafter's first); False when it must wait for room in the caches.
        Call while `not done`."""
        # The target's room is taken first, while there is some (the engine's first step): a hybrid target's
        # state slots go to requests as soon as they run, and stay theirs until they finish.
        if self.scratch is None and self.pending:
            self._take_scratch()
        if not self.drafter_done:
            return self._measure_drafter_point()
        if self.scratch is None:
            return False
        b = self.pending.pop(0)
        self.steps[b] = self._time_target(b)
        self._tick(f"T({b}) {self.steps[b] * 1e3:.0f} ms")
        if not self.pending:
            self.pending = self._probes()
        if not self.pending:
            self.blocks.free(self.scratch)
            if self.timing_states is not None:
                self.timing_states.free(TIMING)
                self.timing_states = None
            self.scratch = None
            self.close_progress()
        return True

    def measure(self) -> CostProfile:
        """Every point now (before the engine serves anything)."""
        while not self.done:
            if not self.advance():
                raise RuntimeError("the caches have no room to profile with")
        return self.profile()

    def profile(self) -> CostProfile:
        batch = sorted(self.steps)
        times = [self.steps[b] for b in batch]
        # A larger batch never takes less time: what makes a small B look slower is disturbance (measured
        # once: T(1) 0.42 s against T(4) 0.32 s, which made verifying extra drafts look better than free).
        times = list(reversed(list(itertools.accumulate(reversed(times), min))))
        requests = sorted(self.draft_s)
        return CostProfile(
            batch,
            times,
            requests,
            [self.draft_s[r] for r in requests],
            self.catch_up_s or 0.0,
            meta={"context": self.context},
        )

    def _take_scratch(self) -> bool:
        needed, states = self.context + PIECE_LEN, self.caches.states
        scratch = PagedEntry()
        if not self.blocks.can_grow(scratch, needed) or (states is not None and not states.free_slots):
            return False
        self.blocks.grow(scratch, needed)  # every piece reads the same blocks: timing only
        if states is not None:  # hybrid targets: a slot of their own, which no request reads meanwhile
            states.take(TIMING)
            self.timing_states = states
        self.scratch = scratch
        # untimed: the first forward pages the weights in and warms the allocator
        self._forward(1)
        return True

    def _forward(self, b: int) -> None:
        sizes = [PIECE_LEN] * (b // PIECE_LEN) + ([b % PIECE_LEN] if b % PIECE_LEN else [])
        table, slot = self.scratch.block_table, self.caches.state_slot(TIMING)
        pieces = [PieceInput([5] * n, self.context, table, state_slot=slot) for n in sizes]
        self.runner.forward(pieces, range(b))  # logits at every row, as verification needs

    def _time_target(self, b: int) -> float:
        return median_seconds(lambda: self._forward(b), self.target.platform)

    def _probes(self) -> list[int]:
        """The next B values: after the coarse grid, every gap's geometric middle; after a round of probes,
        the middles of the gaps beside each probe that left the line through its neighbours by more than
        BEND. At most MAX_TARGET_POINTS in all."""
        measured = sorted(self.steps)
        if self.last_probes is None:
            gaps = list(zip(measured, measured[1:]))
        else:
            gaps = []
            for m in self.last_probes:
                a, b = measured[measured.index(m) - 1], measured[measured.index(m) + 1]
                line = self.steps[a] + (self.steps[b] - self.steps[a]) * (m - a) / (b - a)
                if abs(self.steps[m] - line) > BEND * self.steps[m]:
                    gaps += [(a, m), (m, b)]
        middles = {round(math.sqrt(lo * hi)) for lo, hi in gaps} - set(measured)
        self.last_probes = sorted(middles)[: max(0, MAX_TARGET_POINTS - len(measured))]
        if self.bar is not None:
            self.bar.total = self.bar.n + len(self.last_probes)
        return list(self.last_probes)

    def _measure_drafter_point(self) -> bool:
        """The next drafter point, if the drafter's caches have room for its fake requests now."""
        catch_up = self.catch_up_s is None  # what a backlog token costs: one long prompt against a round
        r, prompt = (1, CATCH_UP_PROMPT) if catch_up else (self.draft_points[len(self.draft_s)], DRAFT_PROMPT)
        rows = prompt + (REPEATS + 1) * ACCEPTED_PER_ROUND + self.num_draft_tokens
        if not self.caches.drafter.has_room(r, rows):
            return False
        seqs = fake_requests(r, prompt, self.target.vocab_size)
        try:
            platform = self.target.platform
            primed = prime_drafter(self.drafter, seqs, self.num_draft_tokens, platform)
            rounds = [
                time_draft_round(self.drafter, seqs, self.num_draft_tokens, platform)
                for _ in range(1 if catch_up else REPEATS)
            ]
        finally:
            for seq in seqs:
                self.caches.drafter.free(seq.request_id)
        if catch_up:
            self.catch_up_s = max(primed - rounds[0], 0.0) / (CATCH_UP_PROMPT - ACCEPTED_PER_ROUND)
            self._tick(f"catch-up {self.catch_up_s * 1e3:.2f} ms/token")
        else:
            self.draft_s[r] = sorted(rounds)[len(rounds) // 2]
            self._tick(f"drafting {r} requests {self.draft_s[r] * 1e3:.0f} ms")
        return True
