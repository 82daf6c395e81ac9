"""The serving benchmark: metric arithmetic on synthetic timelines, /metrics deltas, Pareto readings,
prompts, and end to end against live servers on a tiny random model (a sweep, an unreachable server, one
that stops)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from specserve.bench.serve.benchmark import BenchSettings, benchmark_server
from specserve.bench.serve.client import ServerDied, chats
from specserve.bench.serve.datasets import Vocabulary, build_requests
from specserve.bench.serve.metrics import RequestRecord, Sla, summarize
from specserve.bench.serve.report import pareto_frontier, throughput_at, user_speed_at
from specserve.bench.serve.server_counters import ServerCounters, prefix_cache_summary, spec_summary
from specserve.bench.serve.sweep import load_sweep_config
from specserve.cli import main
from specserve.config import SpecserveError, SpeculativeConfig
from specserve.jsonl import read_jsonl
from specserve.local_port import free_local_port
from tests.server_harness import running_server, wait_until
from tests.tiny_models import SPECIAL_TOKENS, VOCAB, save_tiny_chat_model

pytestmark = pytest.mark.kernel_agnostic


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return save_tiny_chat_model("qwen2", tmp_path_factory.mktemp("bench_chat"))


# ---- metric arithmetic -------------------------------------------------------------------------------------
def test_request_timeline_metrics():
    # Sent at 10.0; chunks at +0.5 (first token), +0.6, +0.8, +1.0 (end); 6 tokens in all.
    record = RequestRecord(start=10.0, end=11.0, chunk_times=[10.5, 10.6, 10.8, 11.0], output_tokens=6)
    assert record.ttft == pytest.approx(0.5)
    assert record.e2e == pytest.approx(1.0)
    assert record.tpot == pytest.approx(0.5 / 5)  # (E2E - TTFT) / (tokens - 1)
    assert record.itls == pytest.approx([0.1, 0.2, 0.2])
    assert record.user_tokens_per_s == pytest.approx(10.0)
    one_token = RequestRecord(start=0.0, end=0.3, chunk_times=[0.3], output_tokens=1)
    assert one_token.tpot is None and one_token.user_tokens_per_s is None


def test_summary_throughput_goodput_and_percentiles():
    fast = RequestRecord(start=0.0, end=1.0, chunk_times=[0.2, 0.6, 1.0], prompt_tokens=10, output_tokens=5)
    slow_start = RequestRecord(start=0.0, end=1.9, chunk_times=[1.5, 1.9], prompt_tokens=10, output_tokens=5)
    failed = RequestRecord(start=0.5, end=0.7, error="HTTP 500: boom")
    summary = summarize([fast, slow_start, failed], duration_s=2.0, sla=Sla(ttft_s=1.0, tpot_s=0.25))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["errors"] == {"HTTP 500: boom": 1}
    assert summary["output_throughput"] == pytest.approx(10 / 2.0)
    assert summary["total_throughput"] == pytest.approx(30 / 2.0)
    assert summary["request_throughput"] == pytest.approx(1.0)
    # Only `fast` meets TTFT <= 1 s (TPOT 0.2 s passes for both).
    assert summary["goodput"] == pytest.approx(0.5)
    assert summary["goodput_output_throughput"] == pytest.approx(2.5)
    ttft = summary["ttft_ms"]  # 200 and 1500 ms; percentiles interpolate linearly
    assert ttft["mean"] == pytest.approx(850)
    assert ttft["p50"] == pytest.approx(850)
    assert ttft["p90"] == pytest.approx(200 + 0.9 * 1300)
    assert ttft["p99"] == pytest.approx(200 + 0.99 * 1300)
    assert summary["tpot_ms"]["p50"] == pytest.approx((200 + 100) / 2)  # 0.8/4 and 0.4/4 s
    assert summary["itl_ms"]["mean"] == pytest.approx(400)  # gaps 0.4, 0.4, 0.4
    assert summary["user_tokens_per_s"]["p50"] == pytest.approx((5 + 10) / 2)
    assert summarize([failed], 1.0, Sla())["ttft_ms"] is None


def test_sla_parse():
    assert Sla.parse("tpot:50,ttft:2000") == Sla(ttft_s=2.0, tpot_s=0.05)
    assert Sla.parse(None) == Sla()
    assert Sla(tpot_s=0.05).as_ms() == {"tpot_ms": 50.0}
    with pytest.raises(SpecserveError, match="ttft or tpot"):
        Sla.parse("e2e:100")
    with pytest.raises(SpecserveError, match="milliseconds"):
        Sla.parse("tpot:fast")


def _exposition(drafts, draft_tokens, accepted, per_position, queries=0, hits=0) -> str:
    lines = [
        f"specserve:prefix_cache_queries_total {queries}",
        f"specserve:prefix_cache_hits_total {hits}",
        f"specserve:spec_decode_num_drafts_total {drafts}",
        f"specserve:spec_decode_num_draft_tokens_total {draft_tokens}",
        f"specserve:spec_decode_num_accepted_tokens_total {accepted}",
    ]
    lines += [
        f'specserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}} {n}'
        for p, n in enumerate(per_position)
    ]
    return "\n".join(lines) + "\n"


def test_spec_and_prefix_cache_statistics_are_the_difference_of_two_scrapes():
    before = ServerCounters.parse(_exposition(10, 30, 12, [8, 4, 0], queries=100, hits=20))
    after = ServerCounters.parse(_exposition(30, 90, 42, [26, 12, 4], queries=300, hits=170))
    summary = spec_summary(before, after)
    assert summary["num_drafts"] == 20
    assert summary["tau"] == pytest.approx(1 + 30 / 20)
    assert summary["acceptance_rate"] == pytest.approx(30 / 60)
    assert summary["acceptance_per_position"] == pytest.approx([18 / 20, 8 / 20, 4 / 20])
    assert spec_summary(before, before) is None  # no drafts: no speculation in this run
    assert ServerCounters.parse("vllm:num_requests_running 3\n") is None
    assert prefix_cache_summary(before, after) == {"queried_tokens": 200, "hit_tokens": 150, "hit_rate": 0.75}
    assert prefix_cache_summary(before, before) is None  # nothing looked up: prefix caching off


# ---- Pareto readings ---------------------------------------------------------------------------------------
def test_pareto_frontier_and_readings():
    # (tokens/s per user, tokens/s per device); (1.5, 5) is beaten by (2, 8).
    frontier = pareto_frontier([(2, 8), (1, 10), (1.5, 5), (4, 3)])
    assert frontier == [(1, 10), (2, 8), (4, 3)]
    assert throughput_at(frontier, 3) == (pytest.approx(5.5), False)  # between (2, 8) and (4, 3)
    assert throughput_at(frontier, 2) == (8, False)
    assert throughput_at(frontier, 0.5) == (10, True)  # every point is faster: at least 10
    assert throughput_at(frontier, 5) is None  # no point is that fast
    assert user_speed_at(frontier, 9) == (pytest.approx(1.5), False)
    assert user_speed_at(frontier, 2) == (4, True)
    assert user_speed_at(frontier, 11) is None


# ---- prompts -----------------------------------------------------------------------------------------------
def test_random_prompts_have_exact_lengths_and_no_special_tokens(chat_model_dir):
    vocabulary = Vocabulary(str(chat_model_dir))
    requests = build_requests("random", 5, vocabulary, input_len=40, output_len=7, seed=3)
    assert [len(r.prompt_token_ids) for r in requests] == [40] * 5
    assert {r.output_len for r in requests} == {7}
    ids = {i for r in requests for i in r.prompt_token_ids}
    assert min(ids) >= len(SPECIAL_TOKENS) and max(ids) < VOCAB
    again = build_requests("random", 5, vocabulary, input_len=40, output_len=7, seed=3)
    assert again == requests  # seeded: every configuration of a sweep gets the same prompts


def test_file_datasets(chat_model_dir, tmp_path):
    vocabulary = Vocabulary(str(chat_model_dir))
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"turns": ["hi there", "and then?"]}) + "\n")
    (request,) = build_requests(f"eval:{eval_file}", 1, vocabulary, input_len=512, output_len=9)
    expected = vocabulary.tokenizer("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert request.prompt_token_ids == expected and request.output_len == 9
    lines = [{"prompt_token_ids": [7, 8, 9], "output_len": 3}, {"prompt": "abc"}]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = build_requests(f"jsonl:{jsonl}", 3, vocabulary, input_len=512, output_len=5)
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == [
        ([7, 8, 9], 3),
        (vocabulary.tokenizer("abc").input_ids, 5),
        ([7, 8, 9], 3),  # rows repeat when more prompts are asked for
    ]
    with pytest.raises(SpecserveError, match="random, eval:FILE, jsonl:FILE or multiturn"):
        build_requests("sharegpt", 1, vocabulary, 8, 8)
    with pytest.raises(SpecserveError, match="turns"):
        build_requests(f"eval:{jsonl}", 1, vocabulary, 8, 8)


def test_multiturn_chats_grow_turn_by_turn_and_go_to_one_worker_in_order(chat_model_dir):
    vocabulary = Vocabulary(str(chat_model_dir))
    requests = build_requests("multiturn:3", 5, vocabulary, input_len=20, output_len=6, seed=1)
    assert [(r.conversation, r.turn) for r in requests] == [(c, t) for c in range(2) for t in range(3)]
    system = requests[0].prompt_token_ids[:20]
    for r in requests:
        assert (
            r.prompt_token_ids[:20] == system
            and len(r.prompt_token_ids) == 20 + 64 * (r.turn + 1) + 6 * r.turn
        )
    for earlier, later in zip(requests, requests[1:]):
        if later.turn:  # a turn extends its chat: the previous prompt, a reply, a new user message
            assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
    assert [len(chat) for chat in chats(requests + build_requests("random", 2, vocabulary, 4, 4))] == [
        3,
        3,
        1,
        1,
    ]
    with pytest.raises(SpecserveError, match="TURNS >= 1"):
        build_requests("multiturn:0", 1, vocabulary, 8, 8)
    records = [
        RequestRecord(start=0.0, end=1.0, chunk_times=[ttft], output_tokens=1, turn=t)
        for t, ttft in ((0, 0.5), (1, 0.1), (0, 0.7))
    ]
    by_turn = summarize(records, 1.0, Sla())["ttft_ms_by_turn"]
    assert by_turn["0"]["p50"] == pytest.approx(600) and by_turn["1"]["p50"] == pytest.approx(100)
    assert summarize(records[:1], 1.0, Sla())["ttft_ms_by_turn"] is None


def test_presets_and_options():
    settings = BenchSettings.from_options("seed-8k1k", output_len=16)
    assert (settings.input_len, settings.output_len, settings.dataset) == (8192, 16, "random")
    assert BenchSettings.from_options("cpu-small").input_len == 512
    assert BenchSettings(concurrency=[1, 16]).prompts_at(16) == 64
    assert BenchSettings(concurrency=[1, 16], waves=2).prompts_at(16) == 32
    assert BenchSettings(concurrency=[1, 16], waves=2).prompts_at(1) == 8
    with pytest.raises(SpecserveError, match="unknown preset"):
        BenchSettings.from_options("huge")
    with pytest.raises(SpecserveError, match="concurrency"):
        BenchSettings(concurrency=[0])
    with pytest.raises(SpecserveError, match="waves"):
        BenchSettings(waves=0)


def test_sweep_config_errors_name_the_key(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "configurations": [{"name": "a", "spec": {}}]}))
    with pytest.raises(SpecserveError, match=r"configurations\[0\]: unknown keys \['spec'\]"):
        load_sweep_config(path)
    path.write_text(yaml.safe_dump({"model": "m", "configurations": [{"name": "a"}, {"name": "a"}]}))
    with pytest.raises(SpecserveError, match="distinct names"):
        load_sweep_config(path)
    path.write_text(yaml.safe_dump({"model": "m", "configurations": [{"name": "a"}], "benchmark": {"k": 1}}))
    with pytest.raises(SpecserveError, match="unknown benchmark settings"):
        load_sweep_config(path)


# ---- against live servers ----------------------------------------------------------------------------------
def test_sweep_end_to_end(chat_model_dir, tmp_path, capsys):
    """Two configurations at two concurrency levels, plus one whose server cannot start: the sweep goes on,
    and writes the JSON lines, the JSON, the tables and the plot for what it measured."""
    out = tmp_path / "sweep"
    config = {
        "model": str(chat_model_dir),
        "output_dir": str(out),
        "server_args": {"kv-cache-memory": "16MiB", "max-model-len": 256},
        "startup_timeout_s": 120,
        "benchmark": {"input_len": 16, "output_len": 8, "concurrency": [1, 2], "num_prompts": 4},
        "configurations": [
            {"name": "none"},
            {"name": "broken", "speculative_config": {"method": "telepathy"}},
            {"name": "ngram-k2", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        ],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))

    assert main(["bench", "sweep", "--config", str(path)]) == 2  # 'broken' did not finish
    err = capsys.readouterr().err
    assert "configuration broken: the server did not start" in err and "telepathy" in err

    runs = read_jsonl(out / "results.jsonl")
    assert [(r["label"], r["concurrency"]) for r in runs] == [
        ("none", 1),
        ("none", 2),
        ("ngram-k2", 1),
        ("ngram-k2", 2),
    ]
    for run in runs:
        assert (run["completed"], run["failed"], run["error"]) == (4, 0, None)
        assert run["total_output_tokens"] == 4 * 8 and run["total_input_tokens"] == 4 * 16
        assert run["output_throughput"] > 0 and run["user_tokens_per_s"]["p50"] > 0
    assert runs[0]["spec"] is None
    spec = runs[2]["spec"]
    assert spec["tau"] >= 1 and len(spec["acceptance_per_position"]) == 2
    assert runs[2]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert json.loads((out / "results.json").read_text()) == runs

    report = (out / "report.md").read_text()
    assert (
        "## Throughput at per-user speed anchors" in report
        and "## Per-user speed at matched throughput" in report
    )
    assert "| none |" in report and "| ngram-k2 |" in report and "broken" not in report
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (out / "report.md").unlink()  # the report can be redrawn from the JSON lines alone
    assert main(["bench", "sweep", "--config", str(path), "--report-only"]) == 0
    assert (out / "report.md").read_text() == report


def test_terminating_a_sweep_stops_its_server(chat_model_dir, tmp_path):
    out = tmp_path / "sweep"
    config = {
        "model": str(chat_model_dir),
        "output_dir": str(out),
        "server_args": {"kv-cache-memory": "16MiB", "max-model-len": 256},
        "benchmark": {"input_len": 16, "output_len": 64, "concurrency": [1], "num_prompts": 10_000},
        "configurations": [{"name": "none"}],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    sweep_log = tmp_path / "sweep.log"
    with open(sweep_log, "w") as sweep_output:
        sweep = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "bench", "sweep", "--config", str(path)],
            stdout=sweep_output,
            stderr=subprocess.STDOUT,
        )
    log = out / "server-none.log"
    pattern = r"completed: 16 prompt tokens"  # the benchmark is running against the server
    wait_until(lambda: log.exists() and re.search(pattern, log.read_text()), 120, "a completed request")
    port = int(re.search(r"127\.0\.0\.1:(\d+)", log.read_text())[1])
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(90) == 130, f"sweep:\n{sweep_log.read_text()}\nserver:\n{log.read_text()[-3000:]}"
    with socket.socket() as sock:  # the server went with the sweep
        assert sock.connect_ex(("127.0.0.1", port)) != 0, log.read_text()[-3000:]


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    port = free_local_port()  # a port nobody listens on
    output = tmp_path / "results.jsonl"
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--output", str(output)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: cannot reach a server at http://127.0.0.1:{port}" in err
    assert "Traceback" not in err and not output.exists()


def test_server_going_away_mid_run_keeps_the_partial_results(chat_model_dir, tmp_path):
    output = tmp_path / "results.jsonl"
    settings = BenchSettings(input_len=8, output_len=32, concurrency=[2], num_prompts=500)
    with running_server(chat_model_dir) as server:

        def stop_after_a_few() -> None:
            wait_until(lambda: server.metric("specserve:requests_total", outcome="completed") >= 4, 60)
            server.async_engine.begin_drain(0.0)  # aborts live requests, answers 503 from now on

        stopper = threading.Thread(target=stop_after_a_few)
        stopper.start()
        with pytest.raises(ServerDied, match="stopped answering during the run at concurrency 2") as died:
            asyncio.run(
                benchmark_server(server.url, settings, output, label="tiny", tokenizer=str(chat_model_dir))
            )
        stopper.join()
    assert str(output) in str(died.value)
    (partial,) = read_jsonl(output)
    assert partial["error"] and 3 <= partial["completed"] < 500
    assert partial["output_throughput"] > 0


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("benchmarks/*.yaml")), ids=str)
def test_shipped_sweep_configs_load(path):
    config = load_sweep_config(path)
    assert config.configurations
    for server in config.configurations:
        SpeculativeConfig.from_value(server.speculative_config)  # a typo fails here, not an hour into a sweep


def test_pareto_labels_each_crowd_of_one_concurrency_once():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specserve.bench.serve.report import _label_concurrency

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot([0, 10], [0, 10])
    # two configurations at c = 64 on (almost) the same spot, c = 16 apart, another c = 64 far away
    _label_concurrency(ax, [(64, (1.0, 9.0)), (64, (1.02, 9.01)), (16, (1.05, 9.0)), (64, (8.0, 2.0))])
    labels = sorted((t.get_text(), t.xy) for t in ax.texts)
    plt.close(fig)
    assert labels == [("16", (1.05, 9.0)), ("64", (1.02, 9.01)), ("64", (8.0, 2.0))]
