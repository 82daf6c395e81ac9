"""`specserve bench spec` end to end on a tiny chat model: every row, tau and the ideal speedup's inputs."""

import json

import pytest

from specserve.bench.spec_decode import run_spec_benchmark
from tests.tiny_models import save_tiny_chat_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_chat_model("qwen2", tmp_path_factory.mktemp("bench_spec")))


def test_spec_benchmark_rows(target, tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("abc", "hello there", "xyz")))
    new_tokens = 9
    rows = run_spec_benchmark(
        target,
        [prompts],
        num_prompts=2,
        new_tokens=new_tokens,
        configs=[
            ("self k=4", {"method": "draft_model", "model": target, "num_speculative_tokens": 4}),
            ("ngram k=2", '{"method": "ngram", "num_speculative_tokens": 2}'),
        ],
        assistant=target,
    )
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == [
        "specserve none",
        "self k=4",
        "ngram k=2",
        "transformers plain",
        "transformers assisted",
        "transformers prompt-lookup",
    ]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert by_name["specserve none"]["tau"] is None and by_name["specserve none"]["speedup"] == 1.0
    # The model drafting for itself greedily is always right: after the prefill's token, 8 more come as
    # one round of 4 drafts + bonus and one of 2 drafts + bonus (max_tokens leaves room for 3): tau = 8 / 2.
    self_row = by_name["self k=4"]
    assert self_row["tau"] == pytest.approx(4.0)
    assert self_row["verified_per_round"] == (4 + 2) / 2
    assert set(self_row["t_forward_ms"]) == {1, self_row["verified_per_round"] + 1}
    t1 = self_row["t_forward_ms"][1]
    tk = self_row["t_forward_ms"][self_row["verified_per_round"] + 1]
    # a draft every step: tokens T(1) / (rounds T(k+1) + drafting) = tau T(1) / (T_draft + T(k+1))
    assert self_row["plain_steps"] == 0 and self_row["rounds"] == 4
    assert self_row["ideal_speedup"] == pytest.approx(
        self_row["tau"] * t1 / (self_row["draft_ms_per_round"] + tk)
    )
    ngram = by_name["ngram k=2"]  # random tokens rarely repeat: most steps find no n-gram
    assert ngram["plain_steps"] + ngram["rounds"] * ngram["tau"] == 2 * (new_tokens - 1)
    assert by_name["transformers assisted"]["tau"] is None


def test_comma_lists_are_checked_by_the_parser(capsys):
    from specserve.cli import build_parser

    assert build_parser().parse_args(["bench", "spec", "--prompts", "p.jsonl"]).ks == [3, 5, 8]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--prompts", "p.jsonl", "--ks", "3,a"])
    assert "expected comma-separated integers, got '3,a'" in capsys.readouterr().err
