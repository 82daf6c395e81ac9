"""Batch-1 greedy speculative decoding on DeepSpec-format eval prompts: decode tokens/s (prefill excluded)
and tau per configuration, beside transformers' assisted and prompt-lookup generation, and the ideal
speedup the measured costs allow.

ideal = tokens T(1) / (rounds T(k + 1) + plain steps T(1) + drafting time): the speedup if the forwards and
the drafter were all that cost time. T(q) is one target forward over q tokens at the prompts' context
length, timed on each run's engine right after it; k the draft tokens verified per round; plain steps are
decode steps where the drafter proposed nothing (an n-gram without a match). With a draft every step this
is tau T(1) / (T_draft + T(k + 1)). All figures come from one run.

With `llama_gguf` (the GGUF the target was converted from) llama.cpp decodes the same prompts too, plain
and with its own speculation (llama-cpp-python's prompt lookup, `pip install 'specserve[bench]'`), with
the same thread count: the CPU baseline a user would otherwise pick.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import SamplingParams, SpeculativeConfig
from specserve.core.cache_groups import PagedEntry
from specserve.llm import LLM
from specserve.worker.model_runner import PieceInput


def load_eval_prompts(path: Path, limit: int) -> list[str]:
    """First user turn of the first `limit` rows of a DeepSpec eval file (`{"turns": [...]}` per line)."""
    from specserve.train.data import read_prompts

    return read_prompts(path)[:limit]


@dataclass
class RunResult:
    """One configuration's decode over some prompts (one, a dataset's, or all)."""

    name: str
    tokens: int  # decode tokens (the prefill's first token excluded)
    seconds: float
    rounds: int = 0  # verification rounds (steps that verified at least one draft)
    emitted: int = 0  # tokens those rounds committed; every other decode step commits one
    verified: int = 0  # draft tokens verified
    drafting_s: float = 0.0
    t_forward: dict[int, float] | None = None  # T(q) seconds for q = 1 and k + 1, on this run's engine

    @classmethod
    def total(cls, parts: Seq[RunResult]) -> RunResult:
        return cls(
            parts[0].name,
            sum(p.tokens for p in parts),
            sum(p.seconds for p in parts),
            sum(p.rounds for p in parts),
            sum(p.emitted for p in parts),
            sum(p.verified for p in parts),
            sum(p.drafting_s for p in parts),
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None

    @property
    def k(self) -> int | None:
        """Draft tokens verified per round (mean, rounded): a scheduled verify policy checks fewer than k."""
        return round(self.verified / self.rounds) if self.rounds else None

    @property
    def ideal_speedup(self) -> float | None:
        """The speedup if nothing but forwards and drafting cost time: tokens T(1) / (rounds T(k + 1) +
        plain steps T(1) + drafting time). Plain steps are those where the drafter proposed nothing (an
        n-gram without a match): they cost a normal decode step and commit one token."""
        if self.t_forward is None:
            return None
        t1, tk = self.t_forward[1], self.t_forward[self.k + 1]
        plain_steps = self.tokens - self.emitted
        return self.tokens * t1 / (self.rounds * tk + plain_steps * t1 + self.drafting_s)


class CachedContext:
    """`context` held in an engine's KV cache with room for `room` more tokens, to time one target forward
    over new tokens after it: T(q)."""

    def __init__(self, llm: LLM, context: list[int], room: int):
        self.engine = llm.engine
        self.context_len = len(context)
        self.scratch = PagedEntry()
        self.engine.block_manager.grow(self.scratch, len(context) + room)
        # State slot 0 for a hybrid target: an idle engine's, as its cost profile borrows it.
        first = PieceInput(list(context), 0, self.scratch.block_table, state_slot=0)
        self.engine.runner.forward([first], [len(context) - 1])

    def forward_seconds(self, tokens: list[int]) -> float:
        piece = PieceInput(
            tokens, self.context_len, self.scratch.block_table, state_slot=0, checkpoint=len(tokens) > 1
        )
        start = time.perf_counter()
        self.engine.runner.forward([piece], list(range(len(tokens))))
        return time.perf_counter() - start

    def release(self) -> None:
        self.engine.block_manager.free(self.scratch)


def forward_time(llm: LLM, context: int, q: int, repeats: int = 5) -> float:
    """Best-of-n seconds for one target forward over q new tokens after `context` cached tokens."""
    tokens = list(range(100, 100 + context + q))
    cached = CachedContext(llm, tokens[:context], q)
    try:
        return min(cached.forward_seconds(tokens[context:]) for _ in range(repeats))
    finally:
        cached.release()


def run_specserve(name: str, llm: LLM, prompt_ids: list[list[int]], new_tokens: int) -> list[RunResult]:
    """One result per prompt."""
    from tqdm import tqdm

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    stats = llm.engine.spec_stats
    results = []
    for ids in tqdm(prompt_ids, desc=name, leave=False):
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_emitted_tokens, stats.drafting_s)
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        # Decode only: the prefill costs the same with or without speculation.
        decode_s = out.metrics.finish_time - out.metrics.first_token_time
        result = RunResult(name, len(out.outputs[0].token_ids) - 1, decode_s)
        if llm.engine.speculator is not None:
            result.rounds = stats.num_drafts - before[0]
            result.verified = stats.num_draft_tokens - before[1]
            result.emitted = stats.num_emitted_tokens - before[2]
            result.drafting_s = stats.drafting_s - before[3]
        results.append(result)
    return results


class FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (its first `put` is the
    prompt), so that decode time excludes the prefill exactly as `finish - first_token_time` does ours."""

    def __init__(self):
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(
    name: str, model, prompt_ids: list[list[int]], new_tokens: int, **kwargs
) -> list[RunResult]:
    """One result per prompt."""
    from tqdm import tqdm

    results = []
    for ids in tqdm(prompt_ids, desc=name, leave=False):
        x = torch.tensor([ids])
        clock = FirstTokenClock()
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                streamer=clock,
                **kwargs,
            )
        seconds = time.perf_counter() - clock.first_token_time
        results.append(RunResult(name, out.shape[1] - len(ids) - 1, seconds))
    return results


def run_llama_cpp(
    name: str, gguf: Path, prompt_ids: list[list[int]], new_tokens: int, lookup_tokens: int = 0
) -> list[RunResult]:
    """llama.cpp's greedy decode of the same prompts, timed as ours (from the first token to the last),
    with prompt-lookup speculation of up to `lookup_tokens` tokens a round when > 0. One result per
    prompt."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from tqdm import tqdm

    threads = torch.get_num_threads()
    llm = Llama(
        model_path=str(gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=max(len(p) for p in prompt_ids) + new_tokens + 16,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None,
        verbose=False,
    )
    results = []
    for ids in tqdm(prompt_ids, desc=name, leave=False):
        generated, first = 0, 0.0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # never stops at EOS by itself
            generated += 1
            if generated == 1:
                first = time.perf_counter()
            if generated == new_tokens:
                break
        results.append(RunResult(name, generated - 1, time.perf_counter() - first))
    return results


def default_configs(draft: str, ks: list[int], quantization: str | None = None) -> list[tuple[str, dict]]:
    """ngram and draft_model at each k: what works without a trained drafter. `quantization` applies to
    the draft model's weights as to the target's."""
    draft_model = {"model": draft, **({"quantization": quantization} if quantization else {})}
    return [
        (f"specserve {method} k={k}", {"method": method, "num_speculative_tokens": k, **extra})
        for method, extra in (("ngram", {}), ("draft_model", draft_model))
        for k in ks
    ]


def run_spec_benchmark(
    target: str,
    prompt_files: list[Path],
    num_prompts: int,
    new_tokens: int,
    configs: list[tuple[str, dict | str | SpeculativeConfig]],
    assistant: str | None = None,
    quantization: str | None = None,
    llama_gguf: Path | None = None,
    llama_lookup_ks: Seq[int] = (),
) -> list[dict]:
    """No speculation, then each (name, speculative config), then transformers plain, assisted by
    `assistant` and prompt-lookup (when `assistant` is given), then llama.cpp on `llama_gguf` (when given)
    plain and with prompt lookup of each k in `llama_lookup_ks`. Our engines load the target with
    `quantization`. Each configuration gets a row per prompt file (its `dataset`, the file's stem) and,
    with several files, one over all of them ("all"); speedups are against no speculation on the same
    prompts. Each row's T(1) and T(k + 1) are timed on its own engine right after its run."""
    texts = {f.stem: load_eval_prompts(f, num_prompts) for f in prompt_files}  # a bad file fails first
    base = LLM(target, quantization=quantization)
    tok = base.tokenizer
    datasets = {
        name: [base.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        for name, prompts in texts.items()
    }
    prompt_ids = [ids for prompts in datasets.values() for ids in prompts]
    context = sum(len(p) for p in prompt_ids) // len(prompt_ids) + new_tokens // 2
    print(f"{len(prompt_ids)} prompts, {new_tokens} new tokens, context ~{context}", flush=True)
    runs: list[dict[str, RunResult]] = []  # per configuration: dataset -> its prompts' total

    def record(per_prompt: list[RunResult], llm: LLM | None = None) -> None:
        """Sum the prompts per dataset; on `llm`, time T(1) and T(k + 1) for every row's k."""
        by_dataset, start = {}, 0
        for name, prompts in datasets.items():
            by_dataset[name] = RunResult.total(per_prompt[start : start + len(prompts)])
            start += len(prompts)
        if len(datasets) > 1:
            by_dataset["all"] = RunResult.total(per_prompt)
        ks = {r.k for r in by_dataset.values() if r.k is not None}
        if llm is not None and ks:
            t_forward = {q: forward_time(llm, context, q) for q in sorted({1, *(k + 1 for k in ks)})}
            for r in by_dataset.values():
                r.t_forward = t_forward if r.k is not None else None
        runs.append(by_dataset)
        for dataset, r in by_dataset.items():
            print(_row(runs[0][dataset], r, dataset), flush=True)

    record(run_specserve("specserve none", base, prompt_ids, new_tokens))
    del base
    gc.collect()  # one target in memory at a time
    for name, spec in configs:
        llm = LLM(target, quantization=quantization, speculative_config=spec)
        record(run_specserve(name, llm, prompt_ids, new_tokens), llm)
        del llm
        gc.collect()
    if assistant is not None:
        from transformers import AutoModelForCausalLM

        from specserve.models.loader import resolve_model

        ref = AutoModelForCausalLM.from_pretrained(resolve_model(target), dtype=torch.float32).eval()
        helper = AutoModelForCausalLM.from_pretrained(resolve_model(assistant), dtype=torch.float32).eval()
        pad = {"pad_token_id": tok.pad_token_id or 0}
        for name, kwargs in (
            ("transformers plain", {}),
            ("transformers assisted", {"assistant_model": helper}),
            ("transformers prompt-lookup", {"prompt_lookup_num_tokens": 4}),
        ):
            record(run_transformers(name, ref, prompt_ids, new_tokens, **kwargs, **pad))
        del ref, helper
        gc.collect()
    if llama_gguf is not None:
        for k in (0, *llama_lookup_ks):
            name = f"llama.cpp prompt-lookup k={k}" if k else "llama.cpp plain"
            record(run_llama_cpp(name, llama_gguf, prompt_ids, new_tokens, lookup_tokens=k))
    rows = [
        {
            "name": r.name,
            "dataset": dataset,
            "tokens_per_s": r.tokens_per_s,
            "speedup": r.tokens_per_s / runs[0][dataset].tokens_per_s,
            "tau": r.tau,
            "verified_per_round": r.k,
            "rounds": r.rounds,
            "plain_steps": r.tokens - r.emitted if r.rounds else None,
            "draft_ms_per_round": 1e3 * r.drafting_s / r.rounds if r.rounds else None,
            "t_forward_ms": {q: 1e3 * t for q, t in (r.t_forward or {}).items()},
            "ideal_speedup": r.ideal_speedup,
        }
        for by_dataset in runs
        for dataset, r in by_dataset.items()
    ]
    print(json.dumps({"context": context, "rows": rows}))
    return rows


def _row(base: RunResult, r: RunResult, dataset: str) -> str:
    speedup = r.tokens_per_s / base.tokens_per_s
    line = f"{r.name:30s} {dataset:10s} {r.tokens_per_s:6.2f} tok/s  x{speedup:4.2f}"
    if r.ideal_speedup is not None:
        t1, tk = (1e3 * r.t_forward[q] for q in (1, r.k + 1))
        line += (
            f"  tau {r.tau:4.2f}  k {r.k}  plain steps {r.tokens - r.emitted}"
            f"  draft {1e3 * r.drafting_s / r.rounds:5.0f} ms/round"
            f"  T(1) {t1:4.0f} ms  T(k+1) {tk:4.0f} ms  ideal x{r.ideal_speedup:4.2f}"
        )
    return line
