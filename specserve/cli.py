"""Command line: `specserve generate | bench ...`."""

from __future__ import annotations

import argparse
import sys
import time

from specserve.config import QUANTIZATION_MODES, SamplingParams, SpecserveError

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="short name, local dir, .gguf file or hub id")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_MODES, default=None, help="weight-only quantized linear layers"
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def _generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    t_load = time.monotonic()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
    )
    print(f"[loaded {args.model} in {time.monotonic() - t_load:.1f}s]", file=sys.stderr)
    prompt = (
        {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": args.prompt}])}
        if args.chat
        else args.prompt
    )
    start = time.monotonic()
    final = None
    for update in llm.stream(prompt, params):
        sys.stdout.write(update.outputs[0].delta_text)
        sys.stdout.flush()
        final = update
    elapsed = time.monotonic() - start
    n = len(final.outputs[0].token_ids)
    ttft = final.metrics.time_to_first_token or 0.0
    decode_rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    spec = llm.engine.spec_stats
    tau = f", tau {spec.mean_acceptance_length:.2f}" if llm.engine.drafter is not None else ""
    print(
        f"\n[{n} tokens, finish={final.outputs[0].finish_reason}, time to first token {ttft:.2f}s, "
        f"{decode_rate:.2f} tokens/s decode, {n / elapsed:.2f} tokens/s overall{tau}]",
        file=sys.stderr,
    )
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    from specserve.bench.decode import run_decode_benchmark

    run_decode_benchmark(
        model=args.model,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        compare_transformers=not args.no_transformers,
    )
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.bench.spec_decode import run_spec_benchmark

    run_spec_benchmark(
        target=args.model,
        draft=args.draft_model,
        prompt_files=[Path(p) for p in args.prompts.split(",")],
        num_prompts=args.num_prompts,
        new_tokens=args.new_tokens,
        ks=[int(k) for k in args.ks.split(",")],
        compare_transformers=not args.no_transformers,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion, streaming it to stdout")
    _engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    dec = bench_sub.add_parser("decode", help="greedy decode tokens/s against transformers and the roofline")
    dec.add_argument("--model", default=DEFAULT_MODEL)
    dec.add_argument("--prompt-len", type=int, default=200)
    dec.add_argument("--new-tokens", type=int, default=128)
    dec.add_argument("--batch-sizes", default="1,8,32")
    dec.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    dec.set_defaults(func=_bench_decode)
    spec = bench_sub.add_parser("spec", help="batch-1 speculative decoding: tokens/s, tau, ideal speedup")
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    spec.add_argument("--prompts", required=True, help="comma-separated DeepSpec eval .jsonl files")
    spec.add_argument("--num-prompts", type=int, default=10, help="per file")
    spec.add_argument("--new-tokens", type=int, default=128)
    spec.add_argument("--ks", default="3,5,8", help="num_speculative_tokens values")
    spec.add_argument("--no-transformers", action="store_true")
    spec.set_defaults(func=_bench_spec)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
