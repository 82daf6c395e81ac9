"""`specserve bench decode | spec | drafter | serve | sweep`, `specserve eval` (drafters' acceptance on
eval sets) and `specserve profile` (the engine's cost table)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.cli_args import (
    DEFAULT_MODEL,
    add_engine_args,
    check_output,
    drafter_configs,
    engine_kwargs,
    int_list,
)
from specserve.config import QUANTIZATION_MODES, SamplingParams, SpecserveError, check


def register(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="measure and cache the SPS(B) cost table of target + drafter")
    add_engine_args(prof)
    prof.add_argument("--output", default=None, help="JSON path (default: the engine's cache)")
    prof.set_defaults(func=_profile)

    ev = sub.add_parser("eval", help="acceptance (tau, per position, calibration) of drafters on eval sets")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="the target")
    ev.add_argument("--drafter", action="append", required=True, help="NAME=JSON speculative config (repeat)")
    ev.add_argument("--datasets", required=True, help="comma-separated DeepSpec eval .jsonl files")
    ev.add_argument("--num-prompts", type=int, default=20, help="per dataset")
    ev.add_argument("--max-tokens", type=int, default=256)
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--max-model-len", type=int, default=None)
    ev.add_argument("--seed", type=int, default=980406)
    ev.add_argument("--output", default="eval-results")
    ev.set_defaults(func=_eval)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{decode,spec,drafter,serve,sweep}"
    )
    dec = bench_sub.add_parser("decode", help="greedy decode tokens/s against transformers and the roofline")
    dec.add_argument("--model", default=DEFAULT_MODEL)
    dec.add_argument("--prompt-len", type=int, default=200)
    dec.add_argument("--new-tokens", type=int, default=128)
    dec.add_argument("--batch-sizes", type=int_list, default="1,8,32")
    dec.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    dec.set_defaults(func=_bench_decode)
    spec = bench_sub.add_parser("spec", help="batch-1 speculative decoding: tokens/s, tau, ideal speedup")
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    spec.add_argument("--prompts", required=True, help="comma-separated DeepSpec eval .jsonl files")
    spec.add_argument("--num-prompts", type=int, default=10, help="per file")
    spec.add_argument("--new-tokens", type=int, default=128)
    spec.add_argument("--ks", type=int_list, default="3,5,8", help="num_speculative_tokens values")
    spec.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="NAME=JSON speculative config (repeat); replaces the ngram and draft_model grid over --ks",
    )
    spec.add_argument(
        "--quantization",
        choices=QUANTIZATION_MODES,
        help="weight-only quantization of the target (and of the default draft model)",
    )
    spec.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' plain and assisted generation"
    )
    spec.add_argument(
        "--no-llama",
        dest="llama",
        action="store_false",
        help="skip llama.cpp (run by default when the target comes from a GGUF and llama-cpp-python is "
        "installed: plain and prompt lookup at each of --ks)",
    )
    spec.set_defaults(func=_bench_spec)
    cost = bench_sub.add_parser("drafter", help="DSpark drafting round cost against target verification")
    cost.add_argument("--model", default=DEFAULT_MODEL)
    cost.add_argument(
        "--layers", type=int_list, default="1,2", help="draft depths (random-initialised drafters)"
    )
    cost.add_argument(
        "--batch-sizes", type=int_list, default="1,16", help="requests drafted and verified together"
    )
    cost.add_argument("--block-size", type=int, default=7)
    cost.add_argument("--context", type=int, default=512)
    cost.add_argument("--repeats", type=int, default=7)
    cost.set_defaults(func=_bench_drafter)
    bsrv = bench_sub.add_parser(
        "serve",
        help="serving benchmark against a running server: fixed concurrency, TTFT/TPOT/ITL, goodput",
    )
    bsrv.add_argument("--base-url", default="http://127.0.0.1:8000")
    bsrv.add_argument(
        "--preset",
        default=None,
        help="seed-8k1k: 8192 random input / 1024 output tokens; cpu-small: 512 / 64",
    )
    bsrv.add_argument(
        "--dataset", default=None, help="random (default), eval:FILE, jsonl:FILE or multiturn[:TURNS]"
    )
    bsrv.add_argument("--input-len", type=int, default=None, help="random prompts (default 512)")
    bsrv.add_argument("--output-len", type=int, default=None, help="default 64")
    bsrv.add_argument(
        "--num-prompts", type=int, default=None, help="per level (default max(8, waves x concurrency))"
    )
    bsrv.add_argument("--waves", type=int, default=None, help="full batches per level (default 4)")
    bsrv.add_argument("--concurrency", type=int_list, default=[1], help="comma-separated, e.g. 1,2,4,8")
    bsrv.add_argument("--sla", default=None, help="goodput bounds in ms, e.g. tpot:100,ttft:2000")
    bsrv.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    bsrv.add_argument("--seed", type=int, default=None, help="random prompts' seed")
    bsrv.add_argument("--tokenizer", default=None, help="model name or dir (default: the served model)")
    bsrv.add_argument("--api-key", default=None)
    bsrv.add_argument("--label", default=None, help="the results' name (default: the base URL)")
    bsrv.add_argument("--request-timeout", type=float, default=None, help="longest silence of a stream, s")
    bsrv.add_argument("--output", default="bench-serve.jsonl", help="JSON lines, appended per level")
    bsrv.set_defaults(func=_bench_serve)
    swp = bench_sub.add_parser(
        "sweep",
        help="start servers from a YAML config, sweep concurrency, plot the Pareto frontier",
    )
    swp.add_argument("--config", required=True, help="e.g. benchmarks/sweep-cpu-small.yaml")
    swp.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
    swp.add_argument("--report-only", action="store_true", help="redraw the report from results.jsonl")
    swp.set_defaults(func=_bench_sweep)


def _profile(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.spec_decode.cost_profile import cache_path

    if args.output is not None:
        check_output(args.output)
    engine = LLM(**engine_kwargs(args)).engine
    speculator = engine.speculator
    if speculator is None:
        raise SpecserveError("profile needs --speculative-config: the drafter's cost is part of the table")
    profile = speculator.measure_profile(engine.runner, engine.caches)
    key = speculator.profile_key()
    profile.meta.update(key)
    path = profile.save(args.output or cache_path(key))
    profile.plot(path.with_suffix(".png"))
    print(f"{'B':>6} {'step ms':>9} {'SPS':>8} {'tokens/s':>9}")
    for b, t in zip(profile.batch_tokens, profile.step_s):
        print(f"{b:>6} {t * 1e3:>9.1f} {1 / t:>8.2f} {b / t:>9.1f}")
    print(
        "drafting round ms by requests: "
        + ", ".join(f"{r}: {t * 1e3:.1f}" for r, t in zip(profile.draft_requests, profile.draft_s))
    )
    print(f"saved {path} and {path.with_suffix('.png')}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import gc

    from specserve.bench.acceptance import evaluate, format_table, save_results
    from specserve.bench.spec_decode import load_eval_prompts
    from specserve.llm import LLM

    check(args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}")
    drafters = drafter_configs(args.drafter)
    check_output(args.output, directory=True)
    datasets = {Path(f): load_eval_prompts(Path(f), args.num_prompts) for f in args.datasets.split(",")}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    results = []
    for name, config in drafters:
        llm = LLM(args.model, max_model_len=args.max_model_len, speculative_config=config, seed=args.seed)
        for path, prompts in datasets.items():
            results.append(evaluate(llm, name, path.stem, prompts, params))
            print(f"{name} {path.stem}: tau {results[-1].tau:.2f}", flush=True)
        del llm
        gc.collect()
    print(format_table(results))
    print(f"wrote {save_results(results, args.output)}")
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    from specserve.bench.decode import run_decode_benchmark

    check(args.prompt_len >= 1, f"--prompt-len must be >= 1, got {args.prompt_len}")
    # decode tokens/s counts the tokens after the first (the prefill's)
    check(args.new_tokens >= 2, f"--new-tokens must be >= 2, got {args.new_tokens}")
    check(min(args.batch_sizes) >= 1, f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    run_decode_benchmark(
        model=args.model,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        batch_sizes=args.batch_sizes,
        compare_transformers=not args.no_transformers,
    )
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from specserve.bench.spec_decode import default_configs, run_spec_benchmark

    check(args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}")
    # decode tokens/s counts the tokens after the first (the prefill's)
    check(args.new_tokens >= 2, f"--new-tokens must be >= 2, got {args.new_tokens}")
    check(min(args.ks) >= 1, f"--ks must be >= 1, got {args.ks}")
    drafters = drafter_configs(args.drafter)
    gguf = _llama_gguf(args.model) if args.llama else None
    run_spec_benchmark(
        target=args.model,
        prompt_files=[Path(p) for p in args.prompts.split(",")],
        num_prompts=args.num_prompts,
        new_tokens=args.new_tokens,
        configs=drafters or default_configs(args.draft_model, args.ks, args.quantization),
        assistant=None if args.no_transformers else args.draft_model,
        quantization=args.quantization,
        llama_gguf=gguf,
        llama_lookup_ks=args.ks,
    )
    return 0


def _llama_gguf(model: str) -> Path | None:
    """The GGUF `model` was converted from, when llama.cpp can run it here; else None, said why."""
    import importlib.util

    from specserve.models.gguf import gguf_source
    from specserve.models.loader import resolve_model

    gguf = gguf_source(resolve_model(model, need_weights=False))
    if gguf is None:
        print(f"llama.cpp skipped: {model} was not converted from a GGUF")
    elif importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp skipped: llama-cpp-python is not installed (pip install 'specserve[bench]')")
        gguf = None
    return gguf


def _bench_drafter(args: argparse.Namespace) -> int:
    from specserve.bench.drafter_cost import HEADER, measure

    check(min(args.layers) >= 1, f"--layers must be >= 1, got {args.layers}")
    check(min(args.batch_sizes) >= 1, f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    check(args.block_size >= 1, f"--block-size must be >= 1, got {args.block_size}")
    check(args.context >= 1, f"--context must be >= 1, got {args.context}")
    check(args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}")
    print(
        f"DSpark drafter cost on {args.model}: B={args.block_size}, context {args.context}, "
        f"median of {args.repeats}"
    )
    print(HEADER)
    measure(args.model, args.layers, args.batch_sizes, args.block_size, args.context, args.repeats)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from specserve.bench.serve.benchmark import BenchSettings, benchmark_server
    from specserve.bench.serve.metrics import Sla

    settings = BenchSettings.from_options(
        args.preset,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        waves=args.waves,
        concurrency=args.concurrency,
        sla=Sla.parse(args.sla),
        temperature=args.temperature,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
    )
    asyncio.run(
        benchmark_server(
            args.base_url,
            settings,
            Path(args.output),
            label=args.label or args.base_url,
            api_key=args.api_key,
            tokenizer=args.tokenizer,
        )
    )
    print(f"results appended to {args.output}")
    return 0


def _bench_sweep(args: argparse.Namespace) -> int:
    from specserve.bench.serve.sweep import load_sweep_config, run_sweep

    output_dir = Path(args.output_dir) if args.output_dir else None
    return run_sweep(load_sweep_config(Path(args.config), output_dir), report_only=args.report_only)
