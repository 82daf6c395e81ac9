"""What a JSON-schema constraint costs, measured in one run on one model:

- the grammar's own work per decode step (every row's bitmask, its application to the logits, and
  advancing each matcher by its token) for 1 and 16 constrained requests, replayed over a real
  constrained output, as a share of the model's decode step at the same batch size;
- decode tokens/s of json_schema requests against the same requests unconstrained, and with ngram
  speculation (same model, greedy), at batch 1 and 16.

    python -m specserve.bench.structured [--model qwen2.5-coder-1.5b] [--new-tokens 48]
        [--out benchmarks/results/structured-outputs]

Writes results.json, results.md and overhead.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.config import SamplingParams, StructuredOutputsParams
from specserve.llm import LLM
from specserve.structured.masks import mask_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
    },
    "required": ["name", "age", "languages", "address"],
}
TOPICS = ["a Python developer", "a chef in Lyon", "a retired pilot", "a student of mathematics"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as a JSON object."}]
        for i in range(n)
    ]


def decode_tokens_per_s(outputs) -> float:
    """Tokens after the first over the time after the first, all requests together."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    first = min(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.finish_time for o in outputs)
    return tokens / (last - first)


def run(llm: LLM, batch: int, params: SamplingParams) -> dict:
    outputs = llm.chat(prompts(batch), params)
    return {
        "tokens_per_s": decode_tokens_per_s(outputs),
        "tokens": [len(o.outputs[0].token_ids) for o in outputs],
        "outputs": outputs,
    }


def grammar_step_ms(llm: LLM, token_ids: list[int], batch: int, repeats: int) -> float:
    """Median ms of one decode step's grammar work for `batch` requests replaying `token_ids`."""
    engine = llm.engine
    constraint = StructuredOutputsParams(json=SCHEMA)
    times = []
    for _ in range(repeats):
        grammars = [engine.grammars.compile(constraint) for _ in range(batch)]
        logits = torch.randn(batch, engine.vocab_size)
        start = time.perf_counter()
        for token in token_ids:
            masks = torch.cat([g.masks([]) for g in grammars])
            mask_logits(logits, masks)
            for g in grammars:
                g.accept(token)
        times.append((time.perf_counter() - start) * 1e3 / len(token_ids))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5, help="replays of the grammar work (median)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured-outputs"))
    args = parser.parse_args(argv)

    plain = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, structured_outputs={"json": SCHEMA}
    )
    rows = []
    with tqdm(total=len(args.batches) * 3 + 1, desc="structured outputs") as bar:
        llm = LLM(
            model=args.model, max_model_len=1024, kv_cache_memory="1GiB", max_num_seqs=max(args.batches)
        )
        llm.chat(prompts(1), SamplingParams(max_tokens=2))  # warm-up: kernels, the tokenizer's grammar view
        bar.update()
        results = {}
        for batch in args.batches:
            results[batch] = {
                "unconstrained": run(llm, batch, plain),
                "json_schema": run(llm, batch, constrained),
            }
            bar.update(2)
        del llm
        spec_llm = LLM(
            model=args.model,
            max_model_len=1024,
            kv_cache_memory="1GiB",
            max_num_seqs=max(args.batches),
            speculative_config=NGRAM,
        )
        for batch in args.batches:
            results[batch]["json_schema_ngram"] = run(spec_llm, batch, constrained)
            bar.update()
        replay = results[args.batches[0]]["json_schema"]["outputs"][0].outputs[0].token_ids
        for batch in args.batches:
            step_ms = 1e3 * batch / results[batch]["unconstrained"]["tokens_per_s"]
            grammar_ms = grammar_step_ms(spec_llm, replay, batch, args.repeats)
            r = results[batch]
            rows.append(
                {
                    "batch": batch,
                    "decode_step_ms": step_ms,
                    "grammar_ms_per_step": grammar_ms,
                    "grammar_share_of_step": grammar_ms / step_ms,
                    **{f"{name}_tokens_per_s": r[name]["tokens_per_s"] for name in r},
                    "json_schema_over_unconstrained": r["json_schema"]["tokens_per_s"]
                    / r["unconstrained"]["tokens_per_s"],
                    "ngram_speedup_on_json_schema": r["json_schema_ngram"]["tokens_per_s"]
                    / r["json_schema"]["tokens_per_s"],
                    "json_outputs_valid": all(
                        _valid(o.outputs[0].text)
                        for name in ("json_schema", "json_schema_ngram")
                        for o in r[name]["outputs"]
                    ),
                    "ngram_equals_plain": [o.outputs[0].token_ids for o in r["json_schema_ngram"]["outputs"]]
                    == [o.outputs[0].token_ids for o in r["json_schema"]["outputs"]],
                }
            )
    write(args.out, args.model, args.new_tokens, rows)


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)


def write(out: Path, model: str, new_tokens: int, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"model": model, "new_tokens": new_tokens, "rows": rows}, indent=2)
    )
    lines = [
        f"# Structured outputs on {model} (greedy, up to {new_tokens} new tokens)",
        "",
        "| batch | decode step ms | grammar ms/step | share | unconstrained tok/s | json_schema tok/s "
        "| + ngram tok/s | ngram speed-up | valid JSON | ngram == plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['decode_step_ms']:.1f} | {r['grammar_ms_per_step']:.2f} "
            f"| {100 * r['grammar_share_of_step']:.2f}% | {r['unconstrained_tokens_per_s']:.2f} "
            f"| {r['json_schema_tokens_per_s']:.2f} | {r['json_schema_ngram_tokens_per_s']:.2f} "
            f"| {r['ngram_speedup_on_json_schema']:.2f}x | {r['json_outputs_valid']} "
            f"| {r['ngram_equals_plain']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["unconstrained", "json_schema", "json_schema_ngram"]
    width = 0.25
    for j, name in enumerate(names):
        ax.bar(
            [i + j * width for i in range(len(rows))],
            [r[f"{name}_tokens_per_s"] for r in rows],
            width,
            label=name.replace("_", " "),
        )
    ax.set_xticks([i + width for i in range(len(rows))], [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode tokens/s (all requests)")
    ax.set_title(f"JSON-schema requests on {model}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=120)


if __name__ == "__main__":
    main()
