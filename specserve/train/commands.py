"""`specserve data regenerate | data target-cache | train | train-curves | calibrate`: building, training
and calibrating drafters."""

from __future__ import annotations

import argparse

from specserve.cli_args import (
    DEFAULT_MODEL,
    add_engine_args,
    add_sampling_args,
    check_output,
    engine_kwargs,
    int_list,
    named,
    sampling_params,
)
from specserve.config import SamplingParams, SpecserveError, check

# `train`'s training flags left out: a new run's values (a resumed run keeps its own).
TRAIN_DEFAULTS = dict(batch_size=4, lr=6e-4, num_anchors=128, seed=42)


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="drafter training data: regenerate answers, build the target cache")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="{regenerate,target-cache}")
    regen = data_sub.add_parser("regenerate", help="the target answers prompts (DeepSpec JSONL, resumable)")
    add_engine_args(regen)
    regen.add_argument("--prompts", default=None, help="JSONL with 'turns' or 'conversations' rows")
    regen.add_argument("--code-prompts", type=int, default=0, help="N prompts about local Python functions")
    regen.add_argument("--output", required=True)
    add_sampling_args(regen, max_tokens=512, temperature=0.7, top_p=0.8, top_k=20)
    regen.add_argument("--batch-size", type=int, default=16)
    regen.set_defaults(func=_data_regenerate)
    tcache = data_sub.add_parser("target-cache", help="tokens, loss masks and target features, in shards")
    tcache.add_argument("--model", default=DEFAULT_MODEL)
    tcache.add_argument("--data", required=True, help="JSONL of conversations (from regenerate)")
    tcache.add_argument("--output", required=True)
    tcache.add_argument(
        "--target-layer-ids", type=int_list, default=None, help="comma-separated; default: DFlash's rule"
    )
    tcache.add_argument("--max-length", type=int, default=4096)
    tcache.add_argument("--min-loss-tokens", type=int, default=14)
    tcache.set_defaults(func=_data_target_cache)

    train = sub.add_parser("train", help="train a DSpark, DFlash or EAGLE-3 drafter from a target cache")
    train.add_argument("--model", default=DEFAULT_MODEL, help="the target")
    train.add_argument("--cache", required=True, help="directory from `specserve data target-cache`")
    train.add_argument("--output", required=True, help="drafter directory (resumes if it holds a state)")
    # The drafter flags default to None: given, each must fit the method and, resuming, the checkpoint.
    train.add_argument(
        "--method", choices=("dspark", "dflash", "eagle3"), default=None, help="default: dspark"
    )
    train.add_argument("--layers", type=int, default=None, help="DSpark / DFlash: draft layers (default: 1)")
    train.add_argument("--block-size", type=int, default=None, help="DSpark / DFlash: slots (default: 7)")
    train.add_argument("--markov-rank", type=int, default=None, help="DSpark's Markov head (default: 256)")
    train.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="DSpark / DFlash: the draft layers' MLP width (default: the target's)",
    )
    train.add_argument(
        "--mask-token-id", type=int, default=None, help="DSpark / DFlash (default: the tokenizer's)"
    )
    train.add_argument("--steps", type=int, required=True)
    # None too: not given, so TRAIN_DEFAULTS or a resumed run's value.
    train.add_argument("--batch-size", type=int, default=None, help="default: 4")
    train.add_argument("--lr", type=float, default=None, help="default: 6e-4")
    train.add_argument(
        "--num-anchors", type=int, default=None, help="per sequence: blocks / EAGLE-3 chains (default: 128)"
    )
    train.add_argument(
        "--ttt-length", type=int, default=None, help="EAGLE-3: training-time test steps (default: 7)"
    )
    train.add_argument("--num-samples", type=int, default=None, help="train on the cache's first N samples")
    train.add_argument(
        "--full-vocabulary",
        action="store_true",
        help="score every token in the losses (default: only those the data supervises, ~20x cheaper)",
    )
    train.add_argument(
        "--init",
        choices=("random", "target"),
        default=None,
        help="DSpark / DFlash draft layers: N(0, 0.02) (random, the default), or copies of the target layers "
        "after the deepest captured one (the context projection then passes that layer's input through)",
    )
    train.add_argument("--checkpoint-every", type=int, default=200)
    train.add_argument("--seed", type=int, default=None, help="default: 42")
    train.set_defaults(func=_train)

    curves = sub.add_parser("train-curves", help="training runs' CE and tau against step, as one PNG")
    curves.add_argument("--run", action="append", required=True, help="NAME=DIRECTORY of a run (repeat)")
    curves.add_argument("--window", type=int, default=50, help="steps each point averages over")
    curves.add_argument("--output", default="training-curves.png")
    curves.set_defaults(func=_train_curves)

    cal = sub.add_parser("calibrate", help="fit STS temperatures for a DSpark drafter's confidence head")
    add_engine_args(cal)
    cal.add_argument("--prompts", required=True, help="comma-separated JSONL files ({'turns': [...]} rows)")
    cal.add_argument("--num-prompts", type=int, default=20, help="per file")
    cal.add_argument("--max-tokens", type=int, default=256)
    cal.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the requests' sampling temperature: calibrate at the one served (0: greedy, where a draft is "
        "accepted only if it is the target's top token)",
    )
    cal.add_argument("--output-dir", default=None, help="default: the drafter's checkpoint directory")
    cal.set_defaults(func=_calibrate)


def _data_regenerate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.train.data import code_prompts, read_prompts, regenerate

    if bool(args.prompts) == bool(args.code_prompts):
        raise SpecserveError("give one of --prompts FILE.jsonl or --code-prompts N")
    check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    check_output(args.output)
    prompts = read_prompts(args.prompts) if args.prompts else code_prompts(args.code_prompts, seed=args.seed)
    params = sampling_params(args)  # a bad --temperature or --max-tokens fails before the load
    llm = LLM(**engine_kwargs(args))
    print(f"wrote {regenerate(llm, prompts, args.output, params, args.batch_size)}")
    return 0


def _target_layer_ids(args: argparse.Namespace, text_config) -> list[int]:
    """`--target-layer-ids`, or DFlash's rule's, checked against the target's layers."""
    from specserve.spec_decode.deepspec.config import default_target_layer_ids

    num_layers = text_config.num_hidden_layers
    ids = args.target_layer_ids or default_target_layer_ids(num_layers)
    check(
        all(0 <= i < num_layers for i in ids),
        f"target layer ids must be in 0..{num_layers - 1} ({args.model}), got {ids}",
    )
    return ids


def _data_target_cache(args: argparse.Namespace) -> int:
    from specserve.models.loader import load_model
    from specserve.models.registry import text_config_of
    from specserve.train.data import read_conversations
    from specserve.train.run import target_text_config
    from specserve.train.target_cache import build_target_cache

    if args.max_length < 1:
        raise SpecserveError(f"max_length must be >= 1, got {args.max_length}")
    check_output(args.output, directory=True)
    conversations = read_conversations(args.data)
    known = target_text_config(args.model)  # None: a hub model not downloaded yet, checked once loaded
    if known is not None:
        _target_layer_ids(args, known)
    target, hf_config, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise SpecserveError(f"{args.model} has no tokenizer: the chat template gives the loss masks")
    out = build_target_cache(
        target,
        tokenizer,
        conversations,
        _target_layer_ids(args, text_config_of(hf_config)),
        args.output,
        args.model,
        args.max_length,
        args.min_loss_tokens,
    )
    print(f"wrote {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import json

    from specserve.train.run import DrafterArgs, train_drafter
    from specserve.train.trainer import TrainConfig

    check_output(args.output, directory=True)
    flags = dict(
        total_steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        num_anchors=args.num_anchors,
        seed=args.seed,
    )
    given = {name: value for name, value in flags.items() if value is not None}
    config = TrainConfig(**{**TRAIN_DEFAULTS, **given})
    drafter = DrafterArgs(
        method=args.method,
        num_layers=args.layers,
        block_size=args.block_size,
        markov_rank=args.markov_rank,
        intermediate_size=args.intermediate_size,
        mask_token_id=args.mask_token_id,
        ttt_length=args.ttt_length,
        init=args.init,
    )
    out, method = train_drafter(
        args.model,
        args.cache,
        args.output,
        drafter,
        config,
        checkpoint_every=args.checkpoint_every,
        num_samples=args.num_samples,
        full_vocabulary=args.full_vocabulary,
        given=tuple(given),
    )
    spec = json.dumps({"method": method, "model": str(out)})
    print(f"drafter in {out}; use it with --speculative-config '{spec}'")
    return 0


def _train_curves(args: argparse.Namespace) -> int:
    from specserve.train.curves import plot_curves, read_curve, summary

    check_output(args.output)
    runs = [read_curve(name, run, args.window) for name, run in named(args.run, "--run", "DIRECTORY")]
    print(summary(runs))
    print(f"wrote {plot_curves(runs, args.output, args.window)}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.train.calibrate import calibrate, format_report
    from specserve.train.data import read_prompts

    spec = args.speculative_config
    if spec is None or spec.method != "dspark":
        raise SpecserveError(
            "calibrate needs --speculative-config with method 'dspark' (its confidence head)"
        )
    check(
        spec.verify_policy == "fixed",
        f"calibrate with verify_policy 'fixed': every draft must be verified, got {spec.verify_policy!r}",
    )
    check(args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.output_dir is not None:
        check_output(args.output_dir, directory=True)
    texts = [p for path in args.prompts.split(",") for p in read_prompts(path)[: args.num_prompts]]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(**engine_kwargs(args))
    prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])} for p in texts]
    print(format_report(calibrate(llm, prompts, params, args.output_dir)))
    return 0
