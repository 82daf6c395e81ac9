"""The `specserve` command: parsing and dispatch. Each subsystem registers its own subcommands; `generate`,
the main job, is here.

Parsing imports nothing heavy (the subsystems' `commands.py` import torch and the engine inside the command
that needs them): `--help`, `--version` and a mistyped flag answer at once."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

from specserve.bench import commands as bench_commands
from specserve.cli_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from specserve.config import SpecserveError
from specserve.server import commands as server_commands
from specserve.train import commands as train_commands


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one worth saying (a value, not a switch's
    dest: `--no-llama` defaults to llama = True, which reads as the switch being on)."""

    def _format_action(self, action: argparse.Action) -> str:
        default = action.default
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if action.option_strings and not (
            switch or default is None or default is False or default == argparse.SUPPRESS
        ):
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """Subcommand parsers are made by their parent's class, so they all format help this way, and none
    takes a prefix of a long flag for the flag (`--max-token` is an error, not `--max-tokens`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM

    params = sampling_params(args)
    llm = LLM(**engine_kwargs(args))  # says on stderr what it loads, how long it took and what it chose
    if args.chat and not getattr(llm.tokenizer, "chat_template", None):
        raise SpecserveError(
            f"{args.model} has no chat template (a base model): drop --chat to complete the prompt as it is"
        )
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
    tau = f", tau {spec.mean_acceptance_length:.2f}" if llm.engine.speculator is not None else ""
    print(
        f"\n[{n} tokens, finish={final.outputs[0].finish_reason}, time to first token {ttft:.2f}s, "
        f"{decode_rate:.2f} tokens/s decode, {n / elapsed:.2f} tokens/s overall{tau}]",
        file=sys.stderr,
    )
    return 0


def _register_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate a completion, streaming it to stdout")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(gen, max_tokens=128, temperature=0.0)
    gen.set_defaults(func=_generate)


def build_parser() -> Parser:
    parser = Parser(
        prog="specserve",
        description="An LLM inference and serving engine built around DSpark speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"specserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in (
        _register_generate,
        server_commands.register,
        train_commands.register,
        bench_commands.register,
    ):
        register(sub)
    _remember_parsers(parser)
    return parser


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser sets `parser` to itself, so that errors found after parsing (a flag no
    subcommand knows) print the usage of the subcommand they were given to; the deepest one wins."""
    parser.set_defaults(parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _remember_parsers(child)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, with an unknown flag reported by the subcommand it was given to, and the
    subcommand's `after_parse` steps run (each may complete `args`, or return what is wrong)."""
    args, unknown = parser.parse_known_args(argv)
    leaf = args.parser
    if unknown:
        leaf.error(f"unrecognized arguments: {' '.join(unknown)}")
    for step in getattr(args, "after_parse", ()):
        problem = step(args)
        if problem:
            leaf.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("RANK", "0") != "0":
        from specserve.parallel import executor, worker

        if executor.launched_by_torchrun():  # a launcher started this command on every rank: rank 0 runs it
            return worker.main([])
    args = parse_args(build_parser(), argv)
    try:
        return args.func(args)
    except SpecserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
