"""Batch-1 greedy speculative decoding on DeepSpec-format eval prompts: decode tokens/s (prefill excluded)
and tau per configuration, beside transformers' assisted and prompt-lookup generation, and the ideal
speedup the measured costs allow.

ideal = tau * T(1) / (T_draft + T(k + 1)), with T(q) one target forward over q tokens at the prompts' context
length and T_draft the measured drafting time per round. All figures come from one run.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import SamplingParams
from specserve.engine.model_runner import PieceInput
from specserve.engine.sequence import Sequence
from specserve.llm import LLM


def load_eval_prompts(path: Path, limit: int) -> list[str]:
    """First user turn of the first `limit` rows of a DeepSpec eval file (`{"turns": [...]}` per line)."""
    from specserve.train.data import read_prompts

    return read_prompts(path)[:limit]


@dataclass
class RunResult:
    name: str
    tokens: int
    seconds: float
    tau: float | None = None
    draft_s_per_round: float | None = None
    k: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def forward_time(llm: LLM, context: int, q: int, repeats: int = 5) -> float:
    """Best-of-n seconds for one target forward over q new tokens after `context` cached tokens."""
    engine = llm.engine
    seq = Sequence("forward-timer", [0] * (context + q), SamplingParams(), max_tokens=1)
    engine.block_manager.grow(seq, context + q)
    tokens = list(range(100, 100 + context + q))
    try:
        engine.runner.forward([PieceInput(tokens[:context], 0, seq.block_table)], [context - 1])
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            engine.runner.forward([PieceInput(tokens[context:], context, seq.block_table)], list(range(q)))
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        engine.block_manager.free(seq)


def run_specserve(
    name: str, llm: LLM, prompt_ids: list[list[int]], new_tokens: int, k: int | None
) -> RunResult:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    stats = llm.engine.spec_stats
    before = (stats.num_drafts, stats.num_accepted_tokens, stats.drafting_s)
    tokens, seconds = 0, 0.0
    for ids in prompt_ids:
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        # Decode only: the prefill costs the same with or without speculation.
        seconds += out.metrics.finish_time - out.metrics.first_token_time
        tokens += len(out.outputs[0].token_ids) - 1
    result = RunResult(name, tokens, seconds, k=k)
    rounds = stats.num_drafts - before[0]
    if llm.engine.drafter is not None and rounds:
        result.tau = 1 + (stats.num_accepted_tokens - before[1]) / rounds
        result.draft_s_per_round = (stats.drafting_s - before[2]) / rounds
    return result


def run_transformers(name: str, model, prompt_ids: list[list[int]], new_tokens: int, **kwargs) -> RunResult:
    tokens, seconds = 0, 0.0
    for ids in prompt_ids:
        x = torch.tensor([ids])
        timings = []
        for n in (1, new_tokens):  # the first call times the prefill, subtracted to leave decode only
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kwargs
                )
            timings.append(time.perf_counter() - start)
        seconds += timings[1] - timings[0]
        tokens += out.shape[1] - len(ids) - 1
    return RunResult(name, tokens, seconds)


def run_spec_benchmark(
    target: str,
    draft: str,
    prompt_files: list[Path],
    num_prompts: int,
    new_tokens: int,
    ks: list[int],
    compare_transformers: bool = True,
) -> list[dict]:
    base = LLM(target, max_model_len=4096)
    tok = base.tokenizer
    prompt_ids = [
        base.apply_chat_template([{"role": "user", "content": p}])
        for f in prompt_files
        for p in load_eval_prompts(f, num_prompts)
    ]
    context = sum(len(p) for p in prompt_ids) // len(prompt_ids) + new_tokens // 2
    t_fwd = {q: forward_time(base, context, q) for q in sorted({1} | {k + 1 for k in ks})}
    print(
        f"{len(prompt_ids)} prompts, {new_tokens} new tokens, context ~{context}; T(q) ms: "
        + ", ".join(f"{q}: {1e3 * t:.0f}" for q, t in t_fwd.items()),
        flush=True,
    )
    results = [run_specserve("specserve none", base, prompt_ids, new_tokens, None)]
    del base
    gc.collect()  # one 1.5B target in memory at a time
    for method in ("ngram", "draft_model"):
        for k in ks:
            spec = {"method": method, "num_speculative_tokens": k}
            if method == "draft_model":
                spec["model"] = draft
            llm = LLM(target, max_model_len=4096, speculative_config=spec)
            results.append(run_specserve(f"specserve {method} k={k}", llm, prompt_ids, new_tokens, k))
            print(_row(results[0], results[-1], t_fwd), flush=True)
            del llm
            gc.collect()
    if compare_transformers:
        from transformers import AutoModelForCausalLM

        from specserve.models.loader import resolve_model

        ref = AutoModelForCausalLM.from_pretrained(resolve_model(target), dtype=torch.float32).eval()
        assistant = AutoModelForCausalLM.from_pretrained(resolve_model(draft), dtype=torch.float32).eval()
        pad = {"pad_token_id": tok.pad_token_id or 0}
        results.append(run_transformers("transformers plain", ref, prompt_ids, new_tokens, **pad))
        results.append(
            run_transformers(
                "transformers assisted", ref, prompt_ids, new_tokens, assistant_model=assistant, **pad
            )
        )
        results.append(
            run_transformers(
                "transformers prompt-lookup", ref, prompt_ids, new_tokens, prompt_lookup_num_tokens=4, **pad
            )
        )
        for r in results[-3:]:
            print(_row(results[0], r, t_fwd), flush=True)
    rows = [
        {
            "name": r.name,
            "tokens_per_s": r.tokens_per_s,
            "speedup": r.tokens_per_s / results[0].tokens_per_s,
            "tau": r.tau,
            "ideal_speedup": _ideal(r, t_fwd),
        }
        for r in results
    ]
    print(json.dumps({"forward_s": t_fwd, "rows": rows}))
    return rows


def _ideal(r: RunResult, t_fwd: dict[int, float]) -> float | None:
    if r.tau is None or r.k is None:
        return None
    return r.tau * t_fwd[1] / (r.draft_s_per_round + t_fwd[r.k + 1])


def _row(base: RunResult, r: RunResult, t_fwd: dict[int, float]) -> str:
    line = f"{r.name:30s} {r.tokens_per_s:6.2f} tok/s  x{r.tokens_per_s / base.tokens_per_s:4.2f}"
    if r.tau is not None:
        ideal = _ideal(r, t_fwd)
        line += f"  tau {r.tau:4.2f}  draft {1e3 * r.draft_s_per_round:5.0f} ms/round  ideal x{ideal:4.2f}"
    return line
