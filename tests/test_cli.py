"""The command line answers at once: help, version and argument errors without torch; each subcommand's
usage on its own errors; no prefix matching of long flags; `serve` takes the model either way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specserve.cli import build_parser, parse_args

pytestmark = pytest.mark.kernel_agnostic

# Runs the CLI in a fresh interpreter and reports what it printed and which heavy modules it imported.
PROBE = """
import contextlib, io, json, sys
from specserve.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
heavy = [m for m in ("torch", "transformers", "numpy", "fastapi", "specserve.engine") if m in sys.modules]
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy}))
"""


def run_cli(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["serve", "--help"],
        ["bench", "spec", "--help"],
        ["bench", "sweep", "--help"],
        ["data", "target-cache", "--help"],
        ["train", "--help"],
        ["profile", "--help"],
    ],
    ids=" ".join,
)
def test_help_imports_no_torch(argv):
    result = run_cli(*argv)
    assert result["code"] == 0
    assert "usage: specserve" in result["out"]
    assert result["heavy"] == []


def test_version_without_torch():
    result = run_cli("--version")
    assert result["code"] == 0 and result["out"].startswith("specserve ")
    assert result["heavy"] == []


def test_unknown_flag_prints_the_subcommand_usage_without_torch():
    result = run_cli("generate", "--no-such-flag", "hello")
    assert result["code"] == 2
    assert result["err"].startswith("usage: specserve generate")
    assert "unrecognized arguments: --no-such-flag" in result["err"]
    assert result["heavy"] == []
    nested = run_cli("bench", "spec", "--prompts", "p.jsonl", "--bogus")
    assert nested["err"].startswith("usage: specserve bench spec") and "--bogus" in nested["err"]


def test_bad_value_errors_without_torch():
    result = run_cli("generate", "--speculative-config", '{"method": "ngramm"}', "hi")
    assert result["code"] == 2
    assert "unknown speculative method 'ngramm'" in result["err"]
    assert result["heavy"] == []


def test_long_flags_are_never_abbreviated():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parse_args(parser, ["generate", "--max-token", "3", "hello"])
    assert parse_args(parser, ["generate", "--max-tokens", "3", "hello"]).max_tokens == 3


def test_serve_takes_the_model_positionally_or_as_a_flag(capsys):
    parser = build_parser()
    assert parse_args(parser, ["serve", "qwen2.5-coder-0.5b"]).model == "qwen2.5-coder-0.5b"
    assert parse_args(parser, ["serve", "--model", "qwen2.5-coder-0.5b", "--port", "1"]).model == (
        "qwen2.5-coder-0.5b"
    )
    assert parse_args(parser, ["serve", "m", "--model", "m"]).model == "m"
    for argv, message in (
        (["serve"], "the model is missing"),
        (["serve", "a", "--model", "b"], "two models given"),
    ):
        with pytest.raises(SystemExit):
            parse_args(parser, argv)
        err = capsys.readouterr().err
        assert err.startswith("usage: specserve serve") and message in err


def test_switch_defaults_are_not_printed_as_values():
    spec_help = run_cli("bench", "spec", "--help")["out"]
    no_llama = spec_help[spec_help.index("--no-llama  ") :].split("\n  --")[0]
    assert "skip llama.cpp" in no_llama and "default: True" not in no_llama
    no_transformers = spec_help[spec_help.index("--no-transformers  ") :].split("\n  --")[0]
    assert "skip transformers" in no_transformers
    generate_help = run_cli("generate", "--help")["out"]
    assert "(default: 0.9)" in generate_help  # values still show theirs (--gpu-memory-utilization)
