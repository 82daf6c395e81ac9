"""`specserve bench spec` end to end on a tiny chat model: every row, tau and the ideal speedup's inputs."""

import json

import pytest

from specserve.bench.spec_decode import run_spec_benchmark
from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.kernel_agnostic


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_chat_model("qwen2", tmp_path_factory.mktemp("bench_spec")))


def test_spec_benchmark_rows(target, tmp_path):
    files = {"code": ("abc", "hello there", "never read"), "chat": ("xyz",)}
    for name, turns in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
    new_tokens = 9
    rows = run_spec_benchmark(
        target,
        [tmp_path / "code.jsonl", tmp_path / "chat.jsonl"],
        num_prompts=2,
        new_tokens=new_tokens,
        configs=[
            ("self k=4", {"method": "draft_model", "model": target, "num_speculative_tokens": 4}),
            ("ngram k=2", '{"method": "ngram", "num_speculative_tokens": 2}'),
        ],
        assistant=target,
    )
    names = [
        "specserve none",
        "self k=4",
        "ngram k=2",
        "transformers plain",
        "transformers assisted",
        "transformers prompt-lookup",
    ]
    # a row per prompt file and one over all of them, for every configuration
    prompts = {"code": 2, "chat": 1, "all": 3}
    assert [(r["name"], r["dataset"]) for r in rows] == [(n, d) for n in names for d in prompts]
    row = {(r["name"], r["dataset"]): r for r in rows}
    for dataset, count in prompts.items():
        assert all(row[n, dataset]["tokens_per_s"] > 0 for n in names)
        none = row["specserve none", dataset]
        assert none["tau"] is None and none["speedup"] == 1.0
        # The model drafting for itself greedily is always right: after the prefill's token, 8 more come
        # as one round of 4 drafts + bonus and one of 2 drafts + bonus (max_tokens leaves room for 3).
        self_row = row["self k=4", dataset]
        assert self_row["tau"] == pytest.approx(4.0)
        assert self_row["verified_per_round"] == (4 + 2) / 2
        assert self_row["plain_steps"] == 0 and self_row["rounds"] == 2 * count
        assert set(self_row["t_forward_ms"]) == {1, self_row["verified_per_round"] + 1}
        t1 = self_row["t_forward_ms"][1]
        tk = self_row["t_forward_ms"][self_row["verified_per_round"] + 1]
        # a draft every step: tokens T(1) / (rounds T(k+1) + drafting) = tau T(1) / (T_draft + T(k+1))
        assert self_row["ideal_speedup"] == pytest.approx(
            self_row["tau"] * t1 / (self_row["draft_ms_per_round"] + tk)
        )
        ngram = row["ngram k=2", dataset]  # random tokens rarely repeat: most steps find no n-gram
        assert ngram["plain_steps"] + ngram["rounds"] * (ngram["tau"] or 0) == count * (new_tokens - 1)
        assert row["transformers assisted", dataset]["tau"] is None
    # k is each row's own mean (rounded): the forwards are timed for every k the rows of a run have
    for r in rows:
        if r["verified_per_round"] is not None:
            assert {1, r["verified_per_round"] + 1} <= set(r["t_forward_ms"]), r


def test_comma_lists_are_checked_by_the_parser(capsys):
    from specserve.cli import build_parser

    assert build_parser().parse_args(["bench", "spec", "--prompts", "p.jsonl"]).ks == [3, 5, 8]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--prompts", "p.jsonl", "--ks", "3,a"])
    assert "expected comma-separated integers, got '3,a'" in capsys.readouterr().err


def test_quantization_applies_to_the_target_and_the_default_draft_model():
    from specserve.bench.spec_decode import default_configs
    from specserve.cli import build_parser

    args = build_parser().parse_args(["bench", "spec", "--prompts", "p.jsonl", "--quantization", "int4"])
    assert args.quantization == "int4" and args.llama
    assert default_configs("draft", [3], "int4") == [
        ("specserve ngram k=3", {"method": "ngram", "num_speculative_tokens": 3}),
        (
            "specserve draft_model k=3",
            {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft", "quantization": "int4"},
        ),
    ]
    assert "quantization" not in default_configs("draft", [3])[1][1]


def test_bench_flags_out_of_range_and_an_empty_prompt_file_are_refused_before_any_model_loads(
    tmp_path, capsys
):
    """The model does not exist: the flag's error coming first proves it is checked before the load (0
    prompts divided by zero, a 0 context or 0 repeats failed inside torch; a bad --drafter config failed
    only when its turn came, after the target's and the drafters' before it runs)."""
    from specserve.cli import main

    prompts, empty = tmp_path / "p.jsonl", tmp_path / "empty.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    empty.write_text("\n")
    spec = ["bench", "spec", "--model", "no-such-model", "--prompts"]
    for argv, says in (
        ([*spec, str(prompts), "--num-prompts", "0"], "--num-prompts"),
        ([*spec, str(prompts), "--new-tokens", "1"], "--new-tokens"),
        ([*spec, str(prompts), "--ks", "3,0"], "--ks"),
        ([*spec, str(empty), "--no-llama"], str(empty)),  # --no-llama: the GGUF lookup resolves the model
        (
            [*spec, str(prompts), "--drafter", 'x={"method": "ngram"}', "--drafter", 'y={"method": "bogus"}'],
            "error: --drafter y: unknown speculative method 'bogus'",
        ),
        (
            [*spec, str(prompts), "--drafter", "y={"],
            "error: --drafter y: speculative config is not valid JSON",
        ),
        (["bench", "drafter", "--model", "no-such-model", "--context", "0"], "--context"),
        (["bench", "drafter", "--model", "no-such-model", "--repeats", "0"], "--repeats"),
        (["bench", "drafter", "--model", "no-such-model", "--block-size", "0"], "--block-size"),
        (["bench", "drafter", "--model", "no-such-model", "--layers", "1,0"], "--layers"),
        (["bench", "drafter", "--model", "no-such-model", "--batch-sizes", "0"], "--batch-sizes"),
        (["bench", "decode", "--model", "no-such-model", "--prompt-len", "0"], "--prompt-len"),
        (["bench", "decode", "--model", "no-such-model", "--new-tokens", "1"], "--new-tokens"),
        (["bench", "decode", "--model", "no-such-model", "--batch-sizes", "-1"], "--batch-sizes"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error:") and says in err and "no-such-model" not in err, (argv, err)
