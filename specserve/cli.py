"""Command line: `specserve generate | serve | calibrate | profile | data | train | eval | bench ...`."""

from __future__ import annotations

import argparse
import sys
import time

from specserve.config import QUANTIZATION_MODES, SamplingParams, SpecserveError

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


def _quantization_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_MODES, default=None, help="weight-only quantized linear layers"
    )


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="short name, local dir, .gguf file or hub id")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--seed", type=int, default=0)
    _quantization_arg(parser)
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def _llm_from(args: argparse.Namespace):
    """An LLM from the shared engine flags (`_engine_args`)."""
    from specserve.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        seed=args.seed,
    )


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    t_load = time.monotonic()
    llm = _llm_from(args)
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
        batch_sizes=args.batch_sizes,
        compare_transformers=not args.no_transformers,
    )
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.bench.spec_decode import default_configs, run_spec_benchmark

    run_spec_benchmark(
        target=args.model,
        prompt_files=[Path(p) for p in args.prompts.split(",")],
        num_prompts=args.num_prompts,
        new_tokens=args.new_tokens,
        configs=_named(args.drafter) or default_configs(args.draft_model, args.ks),
        assistant=None if args.no_transformers else args.draft_model,
    )
    return 0


def _bench_drafter(args: argparse.Namespace) -> int:
    from specserve.bench.drafter_cost import HEADER, measure

    print(
        f"DSpark drafter cost on {args.model}: B={args.block_size}, context {args.context}, "
        f"median of {args.repeats}"
    )
    print(HEADER)
    measure(
        args.model,
        args.layers,
        args.batch_sizes,
        args.block_size,
        args.context,
        args.repeats,
    )
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

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
    from pathlib import Path

    from specserve.bench.serve.sweep import load_sweep_config, run_sweep

    output_dir = Path(args.output_dir) if args.output_dir else None
    return run_sweep(load_sweep_config(Path(args.config), output_dir), report_only=args.report_only)


def _named(items: list[str], option: str = "--drafter", value: str = "JSON") -> list[tuple[str, str]]:
    """`option NAME=VALUE` values -> (name, value)."""
    pairs = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep:
            raise SpecserveError(f"{option} takes NAME={value}, got {item!r}")
        pairs.append((name, rest))
    return pairs


def _prompts_from(files: str, limit: int) -> list[str]:
    from pathlib import Path

    from specserve.bench.spec_decode import load_eval_prompts

    return [p for f in files.split(",") for p in load_eval_prompts(Path(f), limit)]


def _calibrate(args: argparse.Namespace) -> int:
    from specserve.spec_decode.calibrate import calibrate, format_report

    llm = _llm_from(args)
    prompts = [
        {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])}
        for p in _prompts_from(args.prompts, args.num_prompts)
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print(format_report(calibrate(llm, prompts, params, args.output_dir)))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from specserve.spec_decode.cost_model import cache_path, engine_key, profile_engine

    llm = _llm_from(args)
    engine = llm.engine
    if engine.drafter is None:
        raise SpecserveError("profile needs --speculative-config: the drafter's cost is part of the table")
    profile = profile_engine(engine, engine.config.max_num_batched_tokens)
    key = engine_key(engine)
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


def _serve(args: argparse.Namespace) -> int:
    from specserve.server import serve

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        speculative_config=args.speculative_config,
        max_waiting=args.max_waiting_requests,
        drain_timeout_s=args.shutdown_timeout,
        log_stats_interval_s=args.log_stats_interval,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        quantization=args.quantization,
        seed=args.seed,
    )


def _data_regenerate(args: argparse.Namespace) -> int:
    from specserve.train.data import code_prompts, read_prompts, regenerate

    if bool(args.prompts) == bool(args.code_prompts):
        raise SpecserveError("give one of --prompts FILE.jsonl or --code-prompts N")
    llm = _llm_from(args)
    prompts = read_prompts(args.prompts) if args.prompts else code_prompts(args.code_prompts, seed=args.seed)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    print(f"wrote {regenerate(llm, prompts, args.output, params, args.batch_size)}")
    return 0


def _data_target_cache(args: argparse.Namespace) -> int:
    import json

    from specserve.models.loader import load_model
    from specserve.models.registry import text_config_of
    from specserve.spec_decode.deepspec.config import default_target_layer_ids
    from specserve.train.target_cache import build_target_cache

    target, hf_config, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise SpecserveError(f"{args.model} has no tokenizer: the chat template gives the loss masks")
    num_layers = text_config_of(hf_config).num_hidden_layers
    layer_ids = args.target_layer_ids or default_target_layer_ids(num_layers)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    conversations = [r["conversations"] for r in rows if r.get("status", "success") == "success"]
    out = build_target_cache(
        target,
        tokenizer,
        conversations,
        layer_ids,
        args.output,
        args.model,
        args.max_length,
        args.min_loss_tokens,
    )
    print(f"wrote {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import json

    from specserve.train.run import train_drafter
    from specserve.train.trainer import TrainConfig

    config = TrainConfig(
        total_steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        num_anchors=args.num_anchors,
        seed=args.seed,
    )
    out = train_drafter(
        args.model,
        args.cache,
        args.output,
        args.method,
        config,
        num_layers=args.layers,
        block_size=args.block_size,
        markov_rank=args.markov_rank,
        mask_token_id=args.mask_token_id,
        checkpoint_every=args.checkpoint_every,
        ttt_length=args.ttt_length,
        num_samples=args.num_samples,
        full_vocabulary=args.full_vocabulary,
        init=args.init,
        intermediate_size=args.intermediate_size,
    )
    spec = json.dumps({"method": args.method, "model": str(out)})
    print(f"drafter in {out}; use it with --speculative-config '{spec}'")
    return 0


def _train_curves(args: argparse.Namespace) -> int:
    from specserve.train.curves import plot_curves, read_curve, summary

    runs = [read_curve(name, run, args.window) for name, run in _named(args.run, "--run", "DIRECTORY")]
    print(summary(runs))
    print(f"wrote {plot_curves(runs, args.output, args.window)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import gc
    from pathlib import Path

    from specserve.bench.acceptance import evaluate, format_table, save_results
    from specserve.llm import LLM

    drafters = _named(args.drafter)
    files = [Path(f) for f in args.datasets.split(",")]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    results = []
    for name, config in drafters:
        llm = LLM(args.model, max_model_len=args.max_model_len, speculative_config=config, seed=args.seed)
        for path in files:
            prompts = _prompts_from(str(path), args.num_prompts)
            results.append(evaluate(llm, name, path.stem, prompts, params))
            print(f"{name} {path.stem}: tau {results[-1].tau:.2f}", flush=True)
        del llm
        gc.collect()
    print(format_table(results))
    print(f"wrote {save_results(results, args.output)}")
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

    cal = sub.add_parser("calibrate", help="fit STS temperatures for a DSpark drafter's confidence head")
    _engine_args(cal)
    cal.add_argument("--prompts", required=True, help="comma-separated JSONL files ({'turns': [...]} rows)")
    cal.add_argument("--num-prompts", type=int, default=20, help="per file")
    cal.add_argument("--max-tokens", type=int, default=256)
    cal.add_argument("--temperature", type=float, default=1.0)
    cal.add_argument("--output-dir", default=None, help="default: the drafter's checkpoint directory")
    cal.set_defaults(func=_calibrate)

    prof = sub.add_parser("profile", help="measure and cache the SPS(B) cost table of target + drafter")
    _engine_args(prof)
    prof.add_argument("--output", default=None, help="JSON path (default: the engine's cache)")
    prof.set_defaults(func=_profile)

    srv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    srv.add_argument("model", help="short name, local dir, .gguf file or hub id")
    srv.add_argument("--speculative-config", default=None, help="JSON, as for generate")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    srv.add_argument("--dtype", default="float32")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--kv-cache-memory", default="2GiB")
    srv.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch")
    _quantization_arg(srv)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument(
        "--max-waiting-requests", type=int, default=256, help="beyond the running batch; more get 429"
    )
    srv.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM"
    )
    srv.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between engine stats")
    srv.set_defaults(func=_serve)

    data = sub.add_parser("data", help="drafter training data: regenerate answers, build the target cache")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    regen = data_sub.add_parser("regenerate", help="the target answers prompts (DeepSpec JSONL, resumable)")
    _engine_args(regen)
    regen.add_argument("--prompts", default=None, help="JSONL with 'turns' or 'conversations' rows")
    regen.add_argument("--code-prompts", type=int, default=0, help="N prompts about local Python functions")
    regen.add_argument("--output", required=True)
    regen.add_argument("--max-tokens", type=int, default=512)
    regen.add_argument("--temperature", type=float, default=0.7)
    regen.add_argument("--top-p", type=float, default=0.8)
    regen.add_argument("--top-k", type=int, default=20)
    regen.add_argument("--batch-size", type=int, default=16)
    regen.set_defaults(func=_data_regenerate)
    tcache = data_sub.add_parser("target-cache", help="tokens, loss masks and target features, in shards")
    tcache.add_argument("--model", default=DEFAULT_MODEL)
    tcache.add_argument("--data", required=True, help="JSONL of conversations (from regenerate)")
    tcache.add_argument("--output", required=True)
    tcache.add_argument(
        "--target-layer-ids", type=_int_list, default=None, help="comma-separated; default: DFlash's rule"
    )
    tcache.add_argument("--max-length", type=int, default=4096)
    tcache.add_argument("--min-loss-tokens", type=int, default=14)
    tcache.set_defaults(func=_data_target_cache)

    train = sub.add_parser("train", help="train a DSpark, DFlash or EAGLE-3 drafter from a target cache")
    train.add_argument("--model", default=DEFAULT_MODEL, help="the target")
    train.add_argument("--cache", required=True, help="directory from `specserve data target-cache`")
    train.add_argument("--output", required=True, help="drafter directory (resumes if it holds a state)")
    train.add_argument("--method", choices=("dspark", "dflash", "eagle3"), default="dspark")
    train.add_argument("--layers", type=int, default=1)
    train.add_argument("--block-size", type=int, default=7)
    train.add_argument("--markov-rank", type=int, default=256)
    train.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="DSpark / DFlash: the draft layers' MLP width (default: the target's)",
    )
    train.add_argument("--mask-token-id", type=int, default=None)
    train.add_argument("--steps", type=int, required=True)
    train.add_argument("--batch-size", type=int, default=4)
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--num-anchors", type=int, default=128, help="per sequence: blocks / EAGLE-3 chains")
    train.add_argument("--ttt-length", type=int, default=7, help="EAGLE-3: training-time test steps")
    train.add_argument("--num-samples", type=int, default=None, help="train on the cache's first N samples")
    train.add_argument(
        "--full-vocabulary",
        action="store_true",
        help="score every token in the losses (default: only those the data supervises, ~20x cheaper)",
    )
    train.add_argument(
        "--init",
        choices=("random", "target"),
        default="random",
        help="DSpark / DFlash draft layers: N(0, 0.02), or copies of the target layers after the deepest "
        "captured one (the context projection then passes that layer's input through)",
    )
    train.add_argument("--checkpoint-every", type=int, default=200)
    train.add_argument("--seed", type=int, default=42)
    train.set_defaults(func=_train)

    curves = sub.add_parser("train-curves", help="training runs' CE and tau against step, as one PNG")
    curves.add_argument("--run", action="append", required=True, help="NAME=DIRECTORY of a run (repeat)")
    curves.add_argument("--window", type=int, default=50, help="steps each point averages over")
    curves.add_argument("--output", default="training-curves.png")
    curves.set_defaults(func=_train_curves)

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
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    dec = bench_sub.add_parser("decode", help="greedy decode tokens/s against transformers and the roofline")
    dec.add_argument("--model", default=DEFAULT_MODEL)
    dec.add_argument("--prompt-len", type=int, default=200)
    dec.add_argument("--new-tokens", type=int, default=128)
    dec.add_argument("--batch-sizes", type=_int_list, default="1,8,32")
    dec.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    dec.set_defaults(func=_bench_decode)
    spec = bench_sub.add_parser("spec", help="batch-1 speculative decoding: tokens/s, tau, ideal speedup")
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    spec.add_argument("--prompts", required=True, help="comma-separated DeepSpec eval .jsonl files")
    spec.add_argument("--num-prompts", type=int, default=10, help="per file")
    spec.add_argument("--new-tokens", type=int, default=128)
    spec.add_argument("--ks", type=_int_list, default="3,5,8", help="num_speculative_tokens values")
    spec.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="NAME=JSON speculative config (repeat); replaces the ngram and draft_model grid over --ks",
    )
    spec.add_argument("--no-transformers", action="store_true")
    spec.set_defaults(func=_bench_spec)
    cost = bench_sub.add_parser("drafter", help="DSpark drafting round cost against target verification")
    cost.add_argument("--model", default=DEFAULT_MODEL)
    cost.add_argument(
        "--layers", type=_int_list, default="1,2", help="draft depths (random-initialised drafters)"
    )
    cost.add_argument(
        "--batch-sizes", type=_int_list, default="1,16", help="requests drafted and verified together"
    )
    cost.add_argument("--block-size", type=int, default=7)
    cost.add_argument("--context", type=int, default=512)
    cost.add_argument("--repeats", type=int, default=7)
    cost.set_defaults(func=_bench_drafter)
    bsrv = bench_sub.add_parser(
        "serve", help="serving benchmark against a running server: fixed concurrency, TTFT/TPOT/ITL, goodput"
    )
    bsrv.add_argument("--base-url", default="http://127.0.0.1:8000")
    bsrv.add_argument(
        "--preset",
        default=None,
        help="seed-8k1k: 8192 random input / 1024 output tokens; cpu-small: 512 / 64",
    )
    bsrv.add_argument("--dataset", default=None, help="random (default), eval:FILE or jsonl:FILE")
    bsrv.add_argument("--input-len", type=int, default=None, help="random prompts (default 512)")
    bsrv.add_argument("--output-len", type=int, default=None, help="default 64")
    bsrv.add_argument(
        "--num-prompts", type=int, default=None, help="per level (default max(8, waves x concurrency))"
    )
    bsrv.add_argument("--waves", type=int, default=None, help="full batches per level (default 4)")
    bsrv.add_argument("--concurrency", type=_int_list, default=[1], help="comma-separated, e.g. 1,2,4,8")
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
        "sweep", help="start servers from a YAML config, sweep concurrency, plot the Pareto frontier"
    )
    swp.add_argument("--config", required=True, help="e.g. benchmarks/sweep-cpu-small.yaml")
    swp.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
    swp.add_argument("--report-only", action="store_true", help="redraw the report from results.jsonl")
    swp.set_defaults(func=_bench_sweep)
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
