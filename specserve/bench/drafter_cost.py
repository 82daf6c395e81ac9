"""What a DSpark drafting round costs next to the target verification it feeds, on a real target.

A random-initialised drafter (its cost does not depend on its weights) of each depth drafts B tokens for
R requests at a given context length; the same run times one target forward over R pieces of B + 1 tokens
(the verification that round needs) and one plain decode step. Rounds are interleaved, medians reported.
Per round the drafter projects a few new context rows (the accepted tokens), runs its backbone over R x B
block rows, the LM head over them, and the Markov head + sampling B times.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.core.cache_coordinator import DrafterCaches
from specserve.engine.engine import LLMEngine
from specserve.layers.linear import pack_linears
from specserve.spec_decode.deepspec.checkpoint import build_draft_model, init_draft_weights
from specserve.spec_decode.deepspec.config import default_mask_token, new_draft_config
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.profiler import fake_requests, prime_drafter, seconds, time_draft_round
from specserve.worker.model_runner import PieceInput


@dataclass
class CostRow:
    layers: int
    requests: int
    draft_ms: float
    verify_ms: float
    decode_ms: float

    @property
    def draft_over_verify(self) -> float:
        return self.draft_ms / self.verify_ms


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def mask_token_or_last(engine: LLMEngine) -> int:
    """Any id will do for timing; prefer the real choice."""
    try:
        return default_mask_token(engine.tokenizer, engine.vocab_size)
    except SpecserveError:
        return engine.vocab_size - 1


def measure(
    model: str,
    layer_counts: list[int],
    request_counts: list[int],
    block_size: int,
    context: int,
    repeats: int,
) -> list[CostRow]:
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(request_counts), kv_cache_memory="3GiB"))
    rows = []
    for num_layers in layer_counts:
        config = new_draft_config(
            engine.model_config,
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_or_last(engine),
        )
        draft = build_draft_model(config)
        init_draft_weights(draft, engine.model)
        pack_linears(draft)
        drafter = DSparkDrafter(draft, engine.target_context)
        spec = drafter.cache_spec(engine.config.block_size)
        drafter.bind_caches(
            DrafterCaches.standalone(
                spec, engine.block_manager.num_blocks, engine.config.block_size, max(request_counts)
            )
        )
        for num_requests in request_counts:
            draft_ms, verify_ms, decode_ms = measure_round(engine, drafter, num_requests, context, repeats)
            rows.append(CostRow(num_layers, num_requests, draft_ms, verify_ms, decode_ms))
            print(format_row(rows[-1]), flush=True)
    return rows


@torch.inference_mode()
def measure_round(
    engine: LLMEngine, drafter: DSparkDrafter, num_requests: int, context: int, repeats: int
) -> tuple[float, float, float]:
    """Median ms of a drafting round, its verification forward, and a plain decode step."""
    block_size = drafter.block_size
    seqs = fake_requests(num_requests, context, engine.vocab_size)
    platform = engine.config.platform
    prime_drafter(drafter, seqs, block_size, platform)
    # Target pieces: each request its own blocks, its context "cached" (the values do not matter).
    per_request = -(-(context + block_size + 1) // engine.config.block_size)
    tables = [list(range(r * per_request, (r + 1) * per_request)) for r in range(num_requests)]
    verify = [PieceInput([5] * (block_size + 1), context, t) for t in tables]
    decode = [PieceInput([5], context, t) for t in tables]
    verify_rows = range(len(verify) * (block_size + 1))
    draft_s, verify_s, decode_s = [], [], []
    for _ in range(repeats):
        draft_s.append(time_draft_round(drafter, seqs, block_size, platform))
        verify_s.append(seconds(lambda: engine.runner.forward(verify, verify_rows), platform))
        decode_s.append(seconds(lambda: engine.runner.forward(decode, range(len(decode))), platform))
    for seq in seqs:
        drafter.group.free(seq.request_id)
    return _median_ms(draft_s), _median_ms(verify_s), _median_ms(decode_s)


HEADER = f"{'layers':>6} {'R':>4} {'draft ms':>9} {'verify ms':>10} {'decode ms':>10} {'draft/verify':>13}"


def format_row(row: CostRow) -> str:
    return (
        f"{row.layers:>6} {row.requests:>4} {row.draft_ms:>9.1f} {row.verify_ms:>10.1f} "
        f"{row.decode_ms:>10.1f} {row.draft_over_verify:>13.2f}"
    )
