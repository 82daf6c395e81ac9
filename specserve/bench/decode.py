"""Greedy decode throughput against transformers `generate` and this machine's memory-bandwidth roofline.

All figures come from one run on one machine, so the printed ratios are meaningful even when the machine
is shared and absolute numbers drift.
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import asdict, dataclass

import torch

from specserve.config import SamplingParams
from specserve.layers.linear import PackedLinear
from specserve.llm import LLM


@dataclass
class DecodeResult:
    engine: str
    batch_size: int
    prefill_s: float  # time to produce the first token for the whole batch
    total_s: float
    new_tokens: int  # per request

    @property
    def decode_tokens_per_s(self) -> float:
        """Aggregate tokens/s after the first token (prefill excluded)."""
        return self.batch_size * (self.new_tokens - 1) / (self.total_s - self.prefill_s)


def copy_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
    """Best-of-n read+write bandwidth of a large tensor copy (bytes read + bytes written per second)."""
    src = torch.ones(size_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every linear layer (the LM head included; a tied head
    reads the embedding matrix), not the embedding rows it only indexes."""
    total = 0
    has_head = False
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear | PackedLinear):
            total += module.in_features * module.out_features * 4
            has_head |= name.endswith("lm_head")
    if not has_head:
        total += model.model.embed_tokens.weight.numel() * 4
    return total


def make_prompts(tokenizer, batch_size: int, prompt_len: int) -> list[list[int]]:
    """Distinct prompts of exactly `prompt_len` tokens cut from the standard library's own source code."""
    source = inspect.getsource(json) + inspect.getsource(inspect)
    ids = tokenizer(source).input_ids
    stride = max(1, (len(ids) - prompt_len) // max(1, batch_size))
    return [ids[i * stride : i * stride + prompt_len] for i in range(batch_size)]


def time_specserve(llm: LLM, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - start
    first = max(o.metrics.first_token_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return DecodeResult("specserve", len(prompts), first, total, new_tokens)


def _time_transformers(model, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return DecodeResult("transformers", len(prompts), prefill, total, new_tokens)


def run_decode_benchmark(
    model: str, prompt_len: int, new_tokens: int, batch_sizes: list[int], compare_transformers: bool = True
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import resolve_model

    print(f"threads: {torch.get_num_threads()}, dtype: float32, prompt {prompt_len} tokens, {new_tokens} new")
    llm = LLM(model, max_model_len=prompt_len + new_tokens + 8, max_num_seqs=max(batch_sizes))
    reference = None
    if compare_transformers:
        reference = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()
    bandwidth = copy_bandwidth_gb_s()
    weights = weight_bytes_per_token(llm.engine.model)
    roofline = bandwidth * 1e9 / weights
    print(f"copy bandwidth {bandwidth:.1f} GB/s, weights read per token {weights / 1e9:.2f} GB")
    print(f"roofline at batch 1: {roofline:.2f} tokens/s")
    rows = []
    for bs in batch_sizes:
        prompts = make_prompts(llm.tokenizer, bs, prompt_len)
        ours = time_specserve(llm, prompts, new_tokens)
        row = {
            "batch_size": bs,
            "specserve": asdict(ours),
            "specserve_tokens_per_s": ours.decode_tokens_per_s,
        }
        line = f"batch {bs:3d}: specserve {ours.decode_tokens_per_s:7.2f} tok/s"
        if reference is not None:
            theirs = _time_transformers(reference, prompts, new_tokens)
            ratio = ours.decode_tokens_per_s / theirs.decode_tokens_per_s
            row.update(
                transformers=asdict(theirs), transformers_tokens_per_s=theirs.decode_tokens_per_s, ratio=ratio
            )
            line += f" | transformers {theirs.decode_tokens_per_s:7.2f} tok/s | ratio {ratio:.2f}x"
        if bs == 1:
            row["roofline_fraction"] = ours.decode_tokens_per_s / roofline
            line += f" | {100 * row['roofline_fraction']:.0f}% of roofline"
        print(line, flush=True)
        rows.append(row)
    print(json.dumps({"bandwidth_gb_s": bandwidth, "weight_bytes": weights, "rows": rows}))
    return rows
