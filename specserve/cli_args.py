"""Command-line pieces the subcommands share: the engine flags (one declaration for every command that
loads a model) and value types."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specserve.config import (
    LOAD_FORMATS,
    QUANTIZATION_MODES,
    SamplingParams,
    SpecserveError,
    SpeculativeConfig,
)

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


def speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config` JSON, validated while parsing: a typo fails before any model loads."""
    try:
        return SpeculativeConfig.from_value(text)
    except (SpecserveError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _one_model(args: argparse.Namespace) -> str | None:
    """The model given positionally or as `--model` (as vLLM's `serve` takes it), once."""
    if args.model and args.model_flag and args.model != args.model_flag:
        return f"two models given: {args.model!r} and --model {args.model_flag!r}; give one"
    args.model = args.model or args.model_flag
    return None if args.model else "the model is missing: give it as MODEL or --model MODEL"


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """The engine's flags; `model_positional`: the model is MODEL or `--model MODEL`, and has no default."""
    model_help = "short name, local dir, .gguf file or hub id"
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
        parser.add_argument("--model", dest="model_flag", default=None, help="the model, as a flag")
        parser.set_defaults(after_parse=[_one_model])
    else:
        parser.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when torch sees a GPU, else the CPU) | cpu | cuda | cuda:N (docs/cuda.md)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CUDA and on CPUs with native bf16, else fp32) | float32 | bfloat16 | float16",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context, capped at 8192"
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="every cache's budget, e.g. 512MiB or 2GiB (default: 2GiB on the CPU; on CUDA what "
        "--gpu-memory-utilization leaves after the weights and activations)",
    )
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: random weights, no checkpoint read (config.json is enough; for benchmarks), a draft "
        "model's too",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: the share of the GPU's memory the engine may use",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly, no CUDA graphs for decode and verification steps",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_MODES, default=None, help="weight-only quantized linear layers"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many processes (tensor parallelism; docs/tensor-parallel.md)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of prompt prefixes seen before",
    )
    parser.add_argument(
        "--state-checkpoint-interval",
        type=int,
        default=256,
        help="hybrid targets' prefix cache: keep the recurrent state every this many tokens",
    )
    parser.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(**engine_kwargs(args))` from the flags of `add_engine_args`."""
    return dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        state_checkpoint_interval=args.state_checkpoint_interval,
        speculative_config=args.speculative_config,
        seed=args.seed,
    )


def add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = -1
) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--top-k", type=int, default=top_k, help="-1: off")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """From the flags of `add_sampling_args` (and `--seed`)."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def named(items: list[str], option: str = "--drafter", value: str = "JSON") -> list[tuple[str, str]]:
    """`option NAME=VALUE` values -> (name, value)."""
    pairs = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep:
            raise SpecserveError(f"{option} takes NAME={value}, got {item!r}")
        pairs.append((name, rest))
    return pairs


def drafter_configs(items: list[str]) -> list[tuple[str, SpeculativeConfig]]:
    """`--drafter NAME=JSON` values, all parsed now: a bad one fails before any model loads, not once the
    drafters before it have run."""
    configs = []
    for name, text in named(items):
        try:
            configs.append((name, SpeculativeConfig.from_value(text)))
        except (SpecserveError, TypeError) as e:
            raise SpecserveError(f"--drafter {name}: {e}") from None
    return configs


def check_output(path: str | Path, directory: bool = False) -> None:
    """Refuses, before any work, an output that could only fail at the end of the run: a directory where a
    file goes or the reverse, or a place that cannot be written (the writers make missing parents)."""
    path = Path(path)
    kind = "directory" if directory else "file"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and path.is_dir() != directory:
        raise SpecserveError(f"output {path} exists and is not a {kind}: choose another")
    if existing != path and not existing.is_dir():
        raise SpecserveError(f"output {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise SpecserveError(f"output {path}: {existing} is not writable")
