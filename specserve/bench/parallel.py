"""Tensor parallelism measured: greedy decode at each TP size, what crosses ranks per step, and whether the
tokens equal TP=1's.

    python -m specserve.bench.parallel --model qwen2.5-coder-0.5b --tp 1 2 --batch-sizes 1 8

Per (TP size, batch size): decode tokens/s after the first token; per decode step, and per prompt token
of the prefill, the command bytes the driver broadcast (the step's metadata) and the bytes rank 0 entered
into collectives (an all-reduce of each block's [tokens, hidden] output, the embedding's, the gathered
logits rows). The figures come from the group's counters, not from a formula. On one node the ranks
share its cores (each takes cores / TP threads), so on a machine whose decode is bound by memory bandwidth
TP cannot be faster than one process: this measures its overhead.
Writes `tensor-parallel.json` and `tensor-parallel.md` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

from specserve.bench.decode import make_prompts, time_specserve
from specserve.config import SamplingParams
from specserve.llm import LLM


def measure(model: str, tp: int, batch_sizes: list[int], prompt_len: int, new_tokens: int) -> list[dict]:
    # No prefix caching: the prefill-only pass below and the timed run must read the same tokens.
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        max_model_len=prompt_len + new_tokens + 16,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    rows = []
    try:
        group = llm.engine.parallel.group if llm.engine.parallel is not None else None
        for batch_size in batch_sizes:
            prompts = make_prompts(llm.tokenizer, batch_size, prompt_len)
            time_specserve(llm, prompts[:1], 4)  # warm-up
            _, prefill = _counted(group, partial(time_specserve, llm, prompts, 1))
            result, run = _counted(group, partial(time_specserve, llm, prompts, new_tokens))
            greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            row = {
                "tp": tp,
                "batch_size": batch_size,
                "threads_per_rank": torch.get_num_threads(),
                "decode_tokens_per_s": result.decode_tokens_per_s,
                "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)],
            }
            if group is not None:  # one prefill step, then one step per further token
                row["prefill_bytes_per_prompt_token"] = [b / (batch_size * prompt_len) for b in prefill]
                row["decode_bytes_per_step"] = [(r - p) / (new_tokens - 1) for r, p in zip(run, prefill)]
            rows.append(row)
            print(f"tp={tp} batch={batch_size}: {result.decode_tokens_per_s:.2f} tok/s", flush=True)
    finally:
        llm.engine.close()  # gives the process its threads back
    return rows


def _counted(group, run):
    """run()'s result, and the (command, collective) bytes rank 0 counted while it ran."""
    if group is None:
        return run(), (0, 0)
    before = group.command_bytes, group.collective_bytes
    result = run()
    return result, (group.command_bytes - before[0], group.collective_bytes - before[1])


def report(rows: list[dict]) -> str:
    single = {r["batch_size"]: r for r in rows if r["tp"] == 1}
    lines = [
        "| TP | batch | threads/rank | decode tok/s | vs TP=1 | decode step: command B | collective B "
        "| prefill, per token: command B | collective B | tokens = TP=1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        base = single.get(r["batch_size"])
        ratio = f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if base else "-"
        same = "-" if base is None or r["tp"] == 1 else _agreement(r["tokens"], base["tokens"])
        moved = [*r.get("decode_bytes_per_step", ()), *r.get("prefill_bytes_per_prompt_token", ())]
        cells = " | ".join(f"{b:,.0f}" for b in moved) if moved else "- | - | - | -"
        lines.append(
            f"| {r['tp']} | {r['batch_size']} | {r['threads_per_rank']} | {r['decode_tokens_per_s']:.2f} "
            f"| {ratio} | {cells} | {same} |"
        )
    return "\n".join(lines)


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    return f"{same}/{len(reference)} requests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tensor-parallel"))
    args = parser.parse_args(argv)
    rows = [
        row
        for tp in args.tp
        for row in measure(args.model, tp, args.batch_sizes, args.prompt_len, args.new_tokens)
    ]
    table = report(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensor-parallel.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    command = " ".join(["python -m specserve.bench.parallel", *(sys.argv[1:] if argv is None else argv)])
    (args.out / "tensor-parallel.md").write_text(f"{args.model}, `{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
