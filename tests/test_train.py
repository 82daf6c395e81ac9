"""Drafter training pieces: DSPARK.md §10's anchor / eval-mask vectors and loss weights, each loss term on
hand-checked tensors, and a few steps on a tiny target that lower the loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specserve.models.loader import load_model
from specserve.spec_decode.deepspec.checkpoint import (
    build_draft_model,
    init_draft_weights,
    init_from_target_layers,
)
from specserve.spec_decode.deepspec.config import new_draft_config
from specserve.train.anchors import make_blocks, position_weights, sample_anchors
from specserve.train.curves import moving_average
from specserve.train.forward import dspark_training_forward, target_features, target_logits
from specserve.train.losses import dspark_loss
from specserve.train.trainer import Sample, TrainConfig, Trainer, learning_rate
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.kernel_agnostic


def blank_sample(tokens: int, features: int, hidden: int) -> Sample:
    """A sample of zeros (every position in the loss) of the given widths: a cache's shape, not its values."""
    return Sample(
        torch.zeros(tokens, dtype=torch.long),
        torch.ones(tokens, dtype=torch.long),
        torch.zeros(tokens, features),
        torch.zeros(tokens, hidden),
    )


def test_anchor_and_eval_mask_vectors():
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1])
    anchors, keep = sample_anchors(loss_mask, 6)
    assert anchors.tolist() == [2, 3, 4, 7, 0, 0] and keep.tolist() == [1, 1, 1, 1, 0, 0]
    blocks = make_blocks(torch.arange(10, 19), loss_mask, anchors, keep, 3)
    expected = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert blocks.eval_mask.long().tolist() == expected
    assert blocks.labels[0].tolist() == [13, 14, 15]  # slot i of anchor 2 is labelled with position 3 + i
    assert blocks.prev_tokens[0].tolist() == [12, 13, 14]  # the anchor, then the previous slots' labels


def test_anchor_sampling_draws_distinct_sorted_candidates():
    loss_mask = torch.ones(100, dtype=torch.long)
    anchors, keep = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(0))
    assert keep.all() and len(set(anchors.tolist())) == 10 and anchors.tolist() == sorted(anchors.tolist())
    assert anchors.max() <= 98


def test_loss_weights():
    expected = [1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]
    assert position_weights(7).tolist() == pytest.approx(expected, abs=1e-4)


def test_each_loss_term_by_hand():
    # one block of 2 slots over a 2-token vocabulary
    draft = torch.log(torch.tensor([[[0.8, 0.2], [0.5, 0.5]]]))
    target = torch.log(torch.tensor([[[0.6, 0.4], [0.5, 0.5]]]))
    labels = torch.tensor([[0, 1]])
    mask = torch.tensor([[True, True]])
    w = torch.tensor([1.0, 0.5])
    conf = torch.tensor([[0.0, 2.0]])
    terms = dspark_loss(draft, target, labels, mask, w, conf)
    ce = (-math.log(0.8) * 1 + -math.log(0.5) * 0.5) / 1.5
    l1 = (0.4 * 1 + 0.0 * 0.5) / 1.5
    accept = [0.8, 1.0]
    bce = [
        -(a * math.log(s) + (1 - a) * math.log(1 - s)) for a, s in zip(accept, [0.5, 1 / (1 + math.exp(-2))])
    ]
    conf_loss = (bce[0] * 1 + bce[1] * 0.5) / 1.5
    assert terms.ce.item() == pytest.approx(ce, rel=1e-5)
    assert terms.l1.item() == pytest.approx(l1, rel=1e-5)
    assert terms.conf.item() == pytest.approx(conf_loss, rel=1e-5)
    assert terms.total.item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * conf_loss, rel=1e-5)
    assert terms.slot_acceptance.tolist() == pytest.approx(accept)
    masked = dspark_loss(draft, target, labels, torch.tensor([[True, False]]), w, conf)
    assert masked.ce.item() == pytest.approx(-math.log(0.8), rel=1e-5)


@pytest.mark.parametrize("heads", ["dspark", "dflash"])
def test_training_steps_lower_the_loss(heads, tiny_model_dir):
    target, target_config, _ = load_model(str(tiny_model_dir("qwen3")))
    extra = dict(markov_rank=16) if heads == "dspark" else dict(markov_rank=0, confidence_head=False)
    config = new_draft_config(target_config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, **extra)
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (48,), generator=g)
    features, last_hidden = target_features(target, ids.tolist(), config.target_layer_ids)
    loss_mask = (torch.arange(48) >= 8).long()
    trainable = [p for n, p in model.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))]
    for p in model.parameters():
        p.requires_grad_(any(p is t for t in trainable))
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    w = position_weights(4)
    losses = []
    for step in range(30):
        out = dspark_training_forward(
            model, ids, features, last_hidden, loss_mask, 16, torch.Generator().manual_seed(step)
        )
        terms = dspark_loss(
            out.draft_logits,
            out.target_logits,
            out.blocks.labels,
            out.blocks.eval_mask,
            w,
            out.confidence_logits,
        )
        optimizer.zero_grad()
        terms.total.backward()
        optimizer.step()
        losses.append(terms.total.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert model.embed_tokens.weight.grad is None  # the frozen target tensors are not trained


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_init_from_target_layers_reads_the_context_as_the_next_target_layer(arch, tiny_model_dir):
    target, target_config, _ = load_model(str(tiny_model_dir(arch)))
    config = new_draft_config(target_config, target_layer_ids=[0, 1], mask_token_id=VOCAB - 1, markov_rank=8)
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    init_from_target_layers(model, target)
    ids = torch.randint(0, VOCAB - 1, (12,), generator=torch.Generator().manual_seed(0))
    features, _ = target_features(target, ids.tolist(), config.target_layer_ids)
    next_layer = target.model.layers[2]
    with torch.no_grad():
        h1 = features[:, target_config.hidden_size :]  # layer 1's output, the last captured
        torch.testing.assert_close(model.project_context(features), next_layer.input_layernorm(h1))
        torch.testing.assert_close(model.norm(h1), target.model.norm(h1))
    if arch == "qwen3":  # same layer layout: every tensor is the target's
        twins = next_layer.state_dict()  # a packed linear's weight is in its state dict, not a parameter
        for name, param in model.layers[0].named_parameters():
            torch.testing.assert_close(param, twins[name], msg=name)


def test_target_logits_score_shared_positions_once_and_pad_past_the_end(tiny_model_dir):
    target, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=1, seq_len=20)
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    positions = torch.tensor([[3, 4, 5], [4, 5, 6], [18, 19, 20], [19, 20, 21]])  # overlapping blocks
    with torch.no_grad():
        every_row = model.compute_logits(samples[0].last_hidden)
    got = target_logits(model, samples[0].last_hidden, positions)
    assert got.shape == (4, 3, VOCAB)
    inside = positions < 20
    torch.testing.assert_close(got[inside], every_row[positions[inside]])
    assert not got[~inside].any()  # a uniform target past the end


def tiny_training_setup(tiny_model_dir, num_samples=3, seq_len=40):
    target, target_config, _ = load_model(str(tiny_model_dir("qwen3")))
    config = new_draft_config(
        target_config, num_layers=1, block_size=4, markov_rank=16, mask_token_id=VOCAB - 1
    )
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(num_samples):
        ids = torch.randint(0, VOCAB - 1, (seq_len,), generator=g)
        features, last_hidden = target_features(target, ids.tolist(), config.target_layer_ids)
        samples.append(Sample(ids, (torch.arange(seq_len) >= 6).long(), features, last_hidden))
    return target, target_config, config, samples


def supervised(samples) -> torch.Tensor:
    return torch.cat([s.input_ids[s.loss_mask.bool()] for s in samples]).unique()


def test_save_then_resume_continues_bit_identically(tiny_model_dir, tmp_path):
    target, target_config, config, samples = tiny_training_setup(tiny_model_dir)
    train_config = TrainConfig(total_steps=6, batch_size=2, lr=3e-3, num_anchors=8)

    def fresh():
        model = build_draft_model(config)
        init_draft_weights(model, target, seed=0)
        return Trainer(model, samples, train_config, vocab=supervised(samples))  # resumed with it too

    straight = fresh()
    logs = [straight.step() for _ in range(6)]
    assert logs[-1]["loss"] < logs[0]["loss"]
    interrupted = fresh()
    for _ in range(3):
        interrupted.step()
    resumed = Trainer.resume(interrupted.save(tmp_path / "ckpt"), target, target_config, samples)
    for _ in range(3):
        resumed.step()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
def test_a_training_vocabulary_scores_the_same_logits_on_fewer_rows(tiny_model_dir, markov_head_type):
    target, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=1, seq_len=40)
    config.markov_head_type = markov_head_type
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    s = samples[0]
    vocab = supervised(samples)
    assert len(vocab) < VOCAB

    def forward(vocab):
        return dspark_training_forward(
            model,
            s.input_ids,
            s.features,
            s.last_hidden,
            s.loss_mask,
            8,
            torch.Generator().manual_seed(3),
            vocab,
        )

    full, scored = forward(None), forward(vocab)
    assert scored.draft_logits.shape == (8, 4, len(vocab))
    torch.testing.assert_close(scored.draft_logits, full.draft_logits[..., vocab])
    torch.testing.assert_close(scored.target_logits, full.target_logits[..., vocab])
    torch.testing.assert_close(scored.confidence_logits, full.confidence_logits)
    mask = full.blocks.eval_mask
    assert mask.any() and torch.equal(vocab[scored.labels[mask]], full.labels[mask])


def test_learning_rate_schedule():
    config = TrainConfig(total_steps=100, lr=1.0, warmup_ratio=0.04)
    assert [learning_rate(s, config) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(52, config) == pytest.approx(0.5)  # half way through the cosine
    assert learning_rate(99, config) < 0.01


def test_target_cache_round_trip_and_manifest_check(tiny_model_dir, tmp_path):
    from specserve import SpecserveError
    from specserve.train.run import training_samples
    from specserve.train.target_cache import CacheInfo, TargetCache, bytes_per_token, write_target_cache

    _, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=3, seq_len=20)
    info = CacheInfo(config.target_layer_ids, config.hidden_size, "tiny-qwen3")
    # a small shard limit: the samples spread over several shards
    write_target_cache(tmp_path / "cache", samples, info, shard_bytes=2 * 20 * bytes_per_token(64, 2))
    cache = TargetCache(tmp_path / "cache")
    assert len(cache) == 3 and cache.manifest["num_shards"] == 2
    for original, stored in zip(samples, (cache[i] for i in range(3))):
        assert torch.equal(stored.input_ids, original.input_ids)
        assert torch.equal(stored.loss_mask, original.loss_mask)
        torch.testing.assert_close(stored.features, original.features.to(torch.bfloat16).float())
        torch.testing.assert_close(stored.last_hidden, original.last_hidden.to(torch.bfloat16).float())
    cache.check(config)
    other = new_draft_config(
        load_model(str(tiny_model_dir("qwen3")))[1],
        block_size=4,
        mask_token_id=VOCAB - 1,
        target_layer_ids=[0],
    )
    with pytest.raises(SpecserveError, match="target_layer_ids"):
        cache.check(other)
    cache.check_target("tiny-qwen3", load_model(str(tiny_model_dir("qwen3")))[1])
    with pytest.raises(SpecserveError, match="built for 'tiny-qwen3', not 'another'"):
        cache.check_target("another")
    assert torch.equal(cache.supervised_tokens(), supervised(samples))
    assert torch.equal(cache.supervised_tokens(2), supervised(samples[:2]))
    # a smaller data budget: the cache's first samples
    first_two = training_samples(cache, 2)
    assert len(first_two) == 2 and torch.equal(first_two[1].input_ids, samples[1].input_ids)
    assert training_samples(cache, None) is cache
    for bad in (0, 4):
        with pytest.raises(SpecserveError, match=r"--num-samples must be in 1\.\.3"):
            training_samples(cache, bad)


def test_an_interrupted_target_cache_resumes_after_its_last_whole_sample(tiny_model_dir, tmp_path):
    from specserve import SpecserveError
    from specserve.train.target_cache import CacheInfo, TargetCacheWriter, bytes_per_token, write_target_cache

    _, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=3, seq_len=20)
    info = CacheInfo(config.target_layer_ids, config.hidden_size, "tiny-qwen3")
    shard_bytes = 2 * 20 * bytes_per_token(64, 2)  # two samples a shard
    whole = write_target_cache(tmp_path / "whole", samples, info, shard_bytes, inputs="a")

    def interrupted():
        yield from samples[:2]
        raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        write_target_cache(resumed, interrupted(), info, shard_bytes, inputs="a")
    # killed while writing the third sample: arrays cut off in a shard, part of its record
    with open(resumed / "shard-00000.bin", "ab") as shard:
        shard.write(b"\x01" * 50)
    (resumed / "shard-00001.bin").write_bytes(b"\x01" * 100)
    with open(resumed / "samples.idx", "ab") as index:
        index.write(b"\x02" * 30)
    with pytest.raises(SpecserveError, match="other inputs or settings"):
        TargetCacheWriter(resumed, info, shard_bytes, inputs="b")
    with TargetCacheWriter(resumed, info, shard_bytes, inputs="a") as writer:
        assert writer.num_written == 2
        writer.add(samples[2])
        writer.finish()
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in resumed.iterdir()) and "partial.json" not in files
    for name in files:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    with pytest.raises(SpecserveError, match="is a complete target cache"):
        write_target_cache(resumed, samples, info, shard_bytes, inputs="a")


def _ddp_worker(rank: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    try:
        trainer = _one_step_trainer(model_dir)
        logs = trainer.step()
        torch.save({"params": trainer.model.state_dict(), "loss": logs["loss"]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _one_step_trainer(model_dir: str) -> Trainer:
    class Dirs:
        def __call__(self, arch):
            return model_dir

    target, _, config, samples = tiny_training_setup(Dirs(), num_samples=4, seq_len=24)
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    return Trainer(model, samples, TrainConfig(total_steps=10, batch_size=4, lr=1e-2, num_anchors=6))


def test_two_process_gloo_step_equals_one_process(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    model_dir = str(tiny_model_dir("qwen3"))
    mp.spawn(_ddp_worker, args=(model_dir, str(tmp_path)), nprocs=2, join=True)
    single = _one_step_trainer(model_dir)
    logs = single.step()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["loss"] == pytest.approx(logs["loss"], rel=1e-5)
        # The ranks compute their target features in processes of their own, where a few last bits can
        # differ (MKL rounds by buffer alignment); after one Adam step at lr 1e-2 that leaves ~1e-6 of
        # noise in a few weights, while a rank that trained on its half of the batch alone would be ~lr off.
        for name, value in single.model.state_dict().items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-5)


def test_conversation_loss_mask_covers_assistant_turns_only(tmp_path):
    from transformers import AutoTokenizer

    from specserve.train.data import tokenize_conversation
    from tests.tiny_models import save_byte_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(save_byte_tokenizer(tmp_path)))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "sure"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    # each assistant turn including its end marker; the default system prompt was added, untrained
    assert trained == "yo<|im_end|>\nsure<|im_end|>\n"
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    short_ids, short_mask = tokenize_conversation(tokenizer, messages, max_length=20)
    assert len(short_ids) == len(short_mask) == 20


def test_code_prompts_come_from_local_functions_and_are_reproducible(tmp_path):
    from specserve.train.data import code_prompts

    (tmp_path / "mod.py").write_text(
        "def add(a, b):\n    '''Sum.'''\n    c = a + b\n    return c\n\n\ndef tiny():\n    return 1\n"
    )
    prompts = code_prompts(3, seed=1, roots=[tmp_path])
    assert len(prompts) == 1 and "def add(a, b):" in prompts[0]  # `tiny` is too short to ask about
    stdlib = code_prompts(5, seed=3)
    assert len(stdlib) == 5 and stdlib == code_prompts(5, seed=3)


def test_regenerate_writes_deepspec_rows_and_resumes(tmp_path):
    import json

    from specserve import LLM, SamplingParams
    from specserve.train.data import read_prompts, regenerate
    from tests.tiny_models import save_tiny_chat_model

    llm = LLM(str(save_tiny_chat_model("qwen3", tmp_path / "m")), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = tmp_path / "data.jsonl"
    regenerate(llm, ["first", "second"], out, params, batch_size=1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1] and all(r["status"] == "success" for r in rows)
    assert rows[0]["conversations"][0] == {"role": "user", "content": "first"}
    assert rows[0]["conversations"][1]["role"] == "assistant"
    regenerate(llm, ["first", "second", "third"], out, params)  # resumes: only the new prompt runs
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2]
    assert read_prompts(out) == ["first", "second", "third"]
    # Two in flight, each finished place refilled at once: every row still holds its own prompt's answer.
    prompts = ["a", "a much longer prompt", "b", "and a third one", "c"]
    batched = tmp_path / "batched.jsonl"
    regenerate(llm, prompts, batched, params, batch_size=2)
    rows = [json.loads(line) for line in batched.read_text().splitlines()]
    expected = llm.chat([[{"role": "user", "content": t}] for t in prompts], params)
    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))
    for r in rows:
        assert r["conversations"][0]["content"] == prompts[r["id"]]
        assert r["conversations"][1]["content"] == expected[r["id"]].outputs[0].text


def test_training_goes_through_a_packed_target_head(tiny_model_dir):
    """An inference-only (oneDNN) LM head would silently stop gradients; the trainer swaps in a plain one."""
    from specserve.layers.linear import PackedLinear

    target, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=1, seq_len=20)
    model = build_draft_model(config)
    init_draft_weights(model, target, seed=0)
    weight = model.lm_head.weight.detach().clone()
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        dense.weight.copy_(weight)
    model.lm_head = PackedLinear(dense)
    trainer = Trainer(model, samples, TrainConfig(total_steps=2, num_anchors=4))
    assert type(model.lm_head) is torch.nn.Linear and torch.equal(model.lm_head.weight, weight)
    trainer.step()
    assert model.norm.weight.grad is not None and model.norm.weight.grad.abs().sum() > 0


def test_data_cache_train_pipeline_gives_a_drafter_the_engine_serves(tmp_path):
    """regenerate -> target-cache -> train (through the CLI), then greedy speculation with the result."""
    import json

    from specserve import LLM, SamplingParams
    from specserve.cli import main
    from tests.tiny_models import save_tiny_chat_model

    model = str(save_tiny_chat_model("qwen3", tmp_path / "target"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ("hello there", "write code", "why?")))
    data, cache, drafter = tmp_path / "data.jsonl", tmp_path / "cache", tmp_path / "drafter"
    common = ["--model", model]
    argv = [
        "data",
        "regenerate",
        *common,
        "--prompts",
        str(prompts),
        "--output",
        str(data),
        "--max-tokens",
        "24",
    ]
    assert main(argv) == 0
    assert (
        main(
            [
                "data",
                "target-cache",
                *common,
                "--data",
                str(data),
                "--output",
                str(cache),
                "--min-loss-tokens",
                "4",
            ]
        )
        == 0
    )
    argv = [
        "train",
        *common,
        "--cache",
        str(cache),
        "--output",
        str(drafter),
        "--steps",
        "3",
        "--block-size",
        "3",
        "--intermediate-size",
        "32",
        "--init",
        "target",
    ]
    assert main([*argv, "--mask-token-id", "3", "--num-anchors", "8", "--markov-rank", "8"]) == 0
    log = drafter / "metrics.jsonl"
    assert [json.loads(row)["step"] for row in log.read_text().splitlines()] == [1, 2, 3]
    with open(log, "a") as f:  # a step logged after the last checkpoint, then interrupted
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    assert main([*argv, "--mask-token-id", "3", "--num-anchors", "8", "--markov-rank", "8"]) == 0  # resumes
    assert [json.loads(row)["step"] for row in log.read_text().splitlines()] == [1, 2, 3]
    assert json.loads((drafter / "config.json").read_text())["intermediate_size"] == 32  # a narrower MLP
    assert (drafter / "metrics.png").is_file()  # the run's curves, redrawn at each checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(model, max_model_len=128).generate(["abc"], params)[0].outputs[0].token_ids
    llm = LLM(model, max_model_len=128, speculative_config={"method": "dspark", "model": str(drafter)})
    assert llm.generate(["abc"], params)[0].outputs[0].token_ids == plain
    assert llm.engine.spec_stats.num_drafts > 0


def test_eval_reports_tau_survival_and_calibration_per_dataset(tmp_path):
    import json

    from specserve.cli import main
    from tests.tiny_models import save_tiny_chat_model, save_tiny_drafter

    model = save_tiny_chat_model("qwen3", tmp_path / "target")
    drafter = save_tiny_drafter(model, tmp_path / "drafter", std=0.2)
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.jsonl").write_text(
            "\n".join(json.dumps({"turns": [f"{name} {i}"]}) for i in range(3))
        )
    datasets = ",".join(str(tmp_path / f"{n}.jsonl") for n in ("alpha", "beta"))
    dspark = json.dumps({"method": "dspark", "model": str(drafter)})
    ngram = json.dumps({"method": "ngram", "prompt_lookup_min": 1})
    argv = ["eval", "--model", str(model), "--drafter", f"dspark={dspark}", "--drafter", f"ngram={ngram}"]
    assert main([*argv, "--datasets", datasets, "--max-tokens", "24", "--output", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "acceptance.json").read_text())
    assert [(r["drafter"], r["dataset"]) for r in results] == [
        ("dspark", "alpha"), ("dspark", "beta"), ("ngram", "alpha"), ("ngram", "beta")
    ]  # fmt: skip
    for r in results:
        assert r["tau"] >= 1 and all(0 <= s <= 1 for s in r["prefix_survival"])
    assert len(results[0]["ece"]) == 4 and results[2]["ece"] == []  # only DSpark has a confidence head
    assert (tmp_path / "out" / "acceptance.png").is_file()


def test_moving_average_of_a_window_of_steps():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0, 4.0], 3) == [1.0, 1.5, 2.0, 3.0]
    assert moving_average([5.0, 1.0], 1) == [5.0, 1.0]


def test_train_curves_plots_runs_side_by_side_and_refuses_what_is_not_a_log(tmp_path, capsys):
    import json

    from specserve.cli import main

    for name, taus in (("short", [1.0, 1.2]), ("long", [1.0, 1.2, 1.4, 1.6])):
        (tmp_path / name).mkdir()
        rows = [{"step": i + 1, "ce": 5.0 - i, "tau": t} for i, t in enumerate(taus)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    png = tmp_path / "curves.png"
    runs = ["--run", f"short={tmp_path / 'short'}", "--run", f"long={tmp_path / 'long' / 'metrics.jsonl'}"]
    assert main(["train-curves", *runs, "--window", "2", "--output", str(png)]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert png.is_file()
    # step, CE and tau of the last window of 2 steps (the rows were logged out of order)
    assert lines["short"] == ["2", "4.500", "1.100"] and lines["long"] == ["4", "2.500", "1.500"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    for bad in ([f"x={tmp_path / 'bad'}"], [f"x={tmp_path / 'missing'}"], ["no-name"]):
        assert main(["train-curves", "--run", bad[0], "--output", str(png)]) == 2
        assert "error:" in capsys.readouterr().err


def _refused(capsys, argv: list[str]) -> str:
    """`argv`'s one-line error (exit status 2, no traceback)."""
    from specserve.cli import main

    assert main(argv) == 2
    return capsys.readouterr().err


def test_commands_refuse_an_output_they_could_not_write_before_any_model_loads(tmp_path, capsys):
    """The model does not exist: the output's error coming first proves it is checked before the load
    (eval, calibrate and profile would otherwise fail after their whole run)."""
    a_file = tmp_path / "a.txt"
    a_file.write_text("x")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    model, spec = ["--model", "no-such-model"], '{"method": "dspark", "model": "d"}'
    for argv, output in (
        (
            ["eval", *model, "--drafter", 'x={"method": "ngram"}', "--datasets", str(prompts), "--output"],
            a_file,
        ),
        (
            ["calibrate", *model, "--speculative-config", spec, "--prompts", str(prompts), "--output-dir"],
            a_file,
        ),
        (["profile", *model, "--speculative-config", spec, "--output"], tmp_path),
        (["data", "regenerate", *model, "--code-prompts", "2", "--output"], a_file / "rows.jsonl"),
        (["data", "target-cache", *model, "--data", str(prompts), "--output"], a_file),
        (["train", *model, "--cache", str(tmp_path), "--steps", "1", "--output"], a_file / "drafter"),
        (["train-curves", "--run", f"x={tmp_path}", "--output"], tmp_path),
    ):
        err = _refused(capsys, [*argv, str(output)])
        assert err.startswith("error:") and str(output) in err and "no-such-model" not in err, (argv, err)


def test_prompt_files_are_checked_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"id": 1}\n')
    (tmp_path / "text.jsonl").write_text("not json\n")
    spec = '{"method": "dspark", "model": "d"}'
    for bad in (tmp_path / "missing.jsonl", tmp_path, tmp_path / "text.jsonl", tmp_path / "rows.jsonl"):
        for argv in (
            ["eval", "--drafter", 'x={"method": "ngram"}', "--datasets", str(bad)],
            ["calibrate", "--speculative-config", spec, "--prompts", str(bad)],
            ["data", "regenerate", "--prompts", str(bad), "--output", str(tmp_path / "out.jsonl")],
            ["data", "target-cache", "--data", str(bad), "--output", str(tmp_path / "cache")],
        ):
            err = _refused(capsys, [*argv, "--model", "no-such-model"])
            assert err.startswith("error:") and str(bad) in err and "no-such-model" not in err, (argv, err)


def test_eval_and_calibrate_refuse_a_bad_prompt_count_or_drafter_config_before_loading(tmp_path, capsys):
    """--num-prompts 0 gave no prompts (calibrate failed after the load) and -2 dropped each file's last two;
    a bad second --drafter failed only after the first drafter's whole eval; calibrate refused a verify
    policy other than 'fixed' only once loaded."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    ngram, spec = 'x={"method": "ngram"}', '{"method": "dspark", "model": "d"}'
    ev = ["eval", "--output", str(tmp_path / "ev"), "--datasets", str(prompts), "--drafter", ngram]
    cal = ["calibrate", "--speculative-config", spec, "--prompts", str(prompts)]
    for argv, says in (
        ([*ev, "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        ([*ev, "--num-prompts", "-2"], "--num-prompts must be >= 1, got -2"),
        ([*cal, "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        ([*ev, "--drafter", 'y={"method": "bogus"}'], "--drafter y: unknown speculative method 'bogus'"),
        ([*ev, "--drafter", "y={"], "--drafter y: speculative config is not valid JSON"),
        ([*cal, "--speculative-config", spec[:-1] + ', "verify_policy": "dspark"}'], "got 'dspark'"),
    ):
        err = _refused(capsys, [*argv, "--model", "no-such-model"])
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "ev").exists()


def test_train_refuses_out_of_range_settings_and_a_file_as_cache_before_loading(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    base = ["train", "--model", "no-such-model", "--output", str(tmp_path / "d")]
    cache = ["--cache", str(tmp_path / "a.txt")]
    for flags, says in (
        ([*cache, "--steps", "1"], "not a target cache"),
        (["--cache", str(tmp_path), "--steps", "0"], "steps"),
        (["--cache", str(tmp_path), "--steps", "2", "--batch-size", "0"], "batch_size"),
        (["--cache", str(tmp_path), "--steps", "2", "--lr", "-1"], "lr"),
        (["--cache", str(tmp_path), "--steps", "2", "--lr", "inf"], "lr must be finite"),
        (["--cache", str(tmp_path), "--steps", "2", "--checkpoint-every", "0"], "checkpoint_every"),
    ):
        err = _refused(capsys, [*base, *flags])
        assert err.startswith("error:") and says in err and "no-such-model" not in err, (flags, err)


def tiny_cache(tiny_model_dir, directory, seq_len: int = 40) -> tuple[str, str]:
    """(the tiny qwen3 target, a target cache of 2 samples of `seq_len` tokens for it)."""
    from specserve.train.target_cache import CacheInfo, write_target_cache

    model = str(tiny_model_dir("qwen3"))
    _, _, config, samples = tiny_training_setup(tiny_model_dir, num_samples=2, seq_len=seq_len)
    write_target_cache(directory, samples, CacheInfo(config.target_layer_ids, config.hidden_size, model))
    return model, str(directory)


def test_train_refuses_bad_drafter_flags_before_loading(tiny_model_dir, tmp_path, capsys):
    """The drafter's shape was checked only once the target had loaded; a flag its method does not take
    (an EAGLE-3 drafter has one layer, DFlash no Markov head) was silently ignored."""
    _, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    capsys.readouterr()  # the tiny target's save
    base = ["train", "--model", "no-such-model", "--cache", cache, "--output", str(tmp_path / "d")]
    base += ["--steps", "1", "--num-anchors", "8"]  # of the 39 the samples hold
    for flags, says in (
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["--markov-rank", "-1"], "--markov-rank must be >= 0, got -1"),
        (["--intermediate-size", "0"], "--intermediate-size must be >= 1, got 0"),
        (["--mask-token-id", "-1"], "--mask-token-id must be >= 0, got -1"),
        (["--method", "eagle3", "--ttt-length", "0"], "--ttt-length must be >= 1, got 0"),
        (["--method", "eagle3", "--layers", "2"], "--layers does not apply to eagle3 drafters"),
        (["--method", "eagle3", "--init", "target"], "--init does not apply to eagle3 drafters"),
        (["--method", "dflash", "--markov-rank", "8"], "--markov-rank does not apply to dflash drafters"),
        (["--ttt-length", "3"], "--ttt-length does not apply to dspark drafters"),
    ):
        err = _refused(capsys, [*base, *flags])
        assert err == f"error: {says}\n", (flags, err)
    assert not (tmp_path / "d").exists()


def test_train_refuses_more_anchors_than_a_sample_holds_or_an_empty_cache_before_loading(
    tiny_model_dir, tmp_path, capsys
):
    """Anchors are positions whose next token is in the sample too: a huge --num-anchors failed in an
    allocation once the target had loaded, and an empty cache crashed there too. So did a huge --block-size,
    and a huge --ttt-length ran its test steps for hours: slots past the longest sample have no label."""
    from specserve.train.target_cache import CacheInfo, write_target_cache

    _, cache = tiny_cache(tiny_model_dir, tmp_path / "cache", seq_len=40)
    empty = write_target_cache(tmp_path / "empty", [], CacheInfo([0], 64, "x"))
    capsys.readouterr()
    base = ["train", "--model", "no-such-model", "--output", str(tmp_path / "d"), "--steps", "1"]
    bound = "--num-anchors must be in 1..39: the cache's longest sample has 40 tokens"
    for flags, says in (
        (["--cache", cache, "--num-anchors", "40"], bound),
        (["--cache", cache, "--num-anchors", str(10**12)], bound),
        (["--cache", str(empty)], f"{empty} holds no samples"),
        (["--cache", cache, "--num-anchors", "39"], "no-such-model"),  # the most: on to the load
        (
            ["--cache", cache, "--block-size", "40"],
            "--block-size must be in 1..39: the cache's longest sample",
        ),
        (["--cache", cache, "--block-size", str(10**6)], "has 40 tokens, so a position has at most 39"),
        (["--cache", cache, "--method", "eagle3", "--ttt-length", "40"], "--ttt-length must be in 1..39: "),
        (["--cache", cache, "--block-size", "39"], "no-such-model"),
        (["--cache", cache, "--method", "eagle3", "--ttt-length", "39"], "no-such-model"),
    ):
        err = _refused(capsys, [*base, *flags])
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, (flags, err)


def test_train_refuses_a_cache_of_another_target_before_loading(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """The cache's target (its name, and its hidden size and layers against the target's config.json) was
    compared only once the target had loaded."""
    from specserve.train.target_cache import CacheInfo, write_target_cache

    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    other = str(tiny_model_dir("qwen2"))
    # a sample of a target of hidden size 32 and 6+ layers, named as the 3 layers of 64 of `model`
    sample = blank_sample(10, features=64, hidden=32)
    odd = write_target_cache(tmp_path / "odd", [sample], CacheInfo([0, 5], 32, model))
    capsys.readouterr()

    def load_model(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr("specserve.train.run.load_model", load_model)
    base = ["train", "--output", str(tmp_path / "d"), "--steps", "1"]
    # The cache names its target as the build was told it: the same directory written another way is it.
    monkeypatch.chdir(Path(model).parent)
    for same in (f"./{Path(model).name}", f"{model}/", f"{model}/../{Path(model).name}"):
        with pytest.raises(AssertionError, match="the target loaded"):
            _refused(capsys, [*base, "--model", same, "--cache", cache])
    for flags, says in (
        (["--model", other, "--cache", cache], f"it was built for {model!r}, not {other!r}"),
        (
            ["--model", f"./{Path(other).name}", "--cache", cache],  # a relative path to another directory
            f"it was built for {model!r}, not './{Path(other).name}'",
        ),
        (
            ["--model", model, "--cache", str(odd)],
            "hidden_size 32 != the target's 64; target_layer_ids [0, 5] past the target's 3 layers",
        ),
    ):
        err = _refused(capsys, [*base, *flags])
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, (flags, err)
        assert "specserve data target-cache --model" in err
    assert not (tmp_path / "d").exists()


def test_train_refuses_a_mask_token_past_the_vocabulary_before_loading(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """The target's vocabulary size is in its config.json: a --mask-token-id past it failed once loaded."""
    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    capsys.readouterr()

    def load_model(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr("specserve.train.run.load_model", load_model)
    argv = ["train", "--model", model, "--cache", cache, "--output", str(tmp_path / "d"), "--steps", "1"]
    for bad in (VOCAB, 10**9):
        err = _refused(capsys, [*argv, "--mask-token-id", str(bad)])
        assert err == f"error: --mask-token-id must be < {VOCAB} (the target's vocabulary size), got {bad}\n"
    with pytest.raises(AssertionError, match="the target loaded"):  # the last id: on to the load
        _refused(capsys, [*argv, "--mask-token-id", str(VOCAB - 1)])


def test_train_refuses_a_drafter_too_big_to_train_before_loading(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """A huge --layers, --markov-rank or --intermediate-size (a typo) failed in an allocation once the target
    had loaded; the drafter's size comes from its shape alone, so it is refused first."""
    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    capsys.readouterr()

    def load_model(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr("specserve.train.run.load_model", load_model)
    monkeypatch.setattr("specserve.preflight.host_memory_bytes", lambda: 2**29)
    argv = ["train", "--model", model, "--cache", cache, "--output", str(tmp_path / "d"), "--steps", "1"]
    memory = "more than this machine's memory (0.5 GiB of RAM and swap); give smaller values\n"
    for flags, says in (
        (["--layers", "1000"], "a dspark drafter of this target with --layers 1000 has 37,163,713 trainable"),
        (
            ["--markov-rank", str(10**7)],
            "a dspark drafter of this target with --markov-rank 10000000 has 5,",
        ),
        (["--method", "dflash", "--intermediate-size", str(10**8)], "a dflash drafter of this target with "),
    ):
        err = _refused(capsys, [*argv, *flags])
        assert err.startswith(f"error: {says}") and err.endswith(memory), (flags, err)
        assert err.count("\n") == 1
    for fits in ([], ["--layers", "2", "--markov-rank", "64"], ["--method", "eagle3"]):  # on to the load
        with pytest.raises(AssertionError, match="the target loaded"):
            _refused(capsys, [*argv, *fits])
    assert not (tmp_path / "d").exists()


def test_resuming_refuses_flags_the_run_contradicts(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A resumed run took the checkpoint's drafter and training settings and silently ignored changed flags
    (more --steps trained at learning rate 0: the saved schedule had ended). Flags not given (the defaults:
    7 slots, rank 256, lr 6e-4) resume it, and a refusal leaves the run's files as they were. A cache of
    other target layers than the drafter reads was refused only once the target had loaded."""
    import json

    from specserve.cli import main
    from specserve.train.target_cache import CacheInfo, write_target_cache

    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    out = tmp_path / "d"
    base = ["train", "--model", model, "--cache", cache, "--output", str(out), "--num-anchors", "4"]
    shape = ["--mask-token-id", str(VOCAB - 1), "--block-size", "3", "--markov-rank", "8", "--lr", "1e-3"]
    assert main([*base, *shape, "--steps", "2"]) == 0
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    capsys.readouterr()
    for flags, says in (
        (
            ["--layers", "2"],
            "--layers 2 conflicts with the run in {}, which has 1: resume it with --layers 1",
        ),
        (["--method", "eagle3"], "--method eagle3 conflicts with the run in {}, which has dspark"),
        (["--block-size", "4"], "--block-size 4 conflicts with the run in {}, which has 3"),
        (["--markov-rank", "16"], "--markov-rank 16 conflicts with the run in {}, which has 8"),
        (["--ttt-length", "3"], "--ttt-length does not apply to dspark drafters"),
        (["--steps", "3"], "--steps 3 conflicts with the run in {}, which has 2: resume it with --steps 2"),
        (["--lr", "0.01"], "--lr 0.01 conflicts with the run in {}, which has 0.001"),
        (["--num-anchors", "8"], "--num-anchors 8 conflicts with the run in {}, which has 4"),
    ):
        err = _refused(capsys, [*base, "--steps", "2", *flags])
        assert err.startswith(f"error: {says.format(out)}") and err.count("\n") == 1, (flags, err)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files
    sample = blank_sample(10, features=128, hidden=64)  # the target's layers 0 and 2 (the drafter reads 0, 1)
    other = write_target_cache(tmp_path / "other", [sample], CacheInfo([0, 2], 64, model))
    with monkeypatch.context() as patch:
        patch.setattr("specserve.train.run.load_model", lambda *a, **k: pytest.fail("the target loaded"))
        err = _refused(capsys, [*base[:4], str(other), *base[5:], "--steps", "2"])
    assert err == f"error: {other} does not match the drafter: target_layer_ids [0, 2] != [0, 1]\n"
    assert main([*base, "--steps", "2", "--init", "target"]) == 0  # --init: how a new drafter starts
    assert [json.loads(row)["step"] for row in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "config.json").read_text())["block_size"] == 3


def test_resuming_a_run_without_its_drafter_files_is_refused(tiny_model_dir, tmp_path, capsys):
    """A training state beside no config.json, or a cut one (a crashed or hand-edited run), crashed with a
    traceback."""
    from specserve.cli import main

    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    out = tmp_path / "d"
    argv = ["train", "--model", model, "--cache", cache, "--output", str(out), "--steps", "1"]
    assert main([*argv, "--num-anchors", "4", "--mask-token-id", str(VOCAB - 1)]) == 0
    capsys.readouterr()
    (out / "config.json").write_text('{"architectures": ')
    err = _refused(capsys, argv)
    assert err.startswith(
        f"error: {out / 'config.json'} is not valid JSON (Expecting value: line 1 column 19"
    )
    assert err.endswith(
        "), so the run cannot resume: train into another --output, or remove training_state.pt to start anew "
        "there\n"
    )
    for name, missing in (
        ("config.json", "config.json"),
        ("model.safetensors", "config.json or model.safetensors"),
    ):
        (out / name).unlink()
        err = _refused(capsys, argv)
        assert err == (
            f"error: {out} holds a training state (training_state.pt) but not the drafter's {missing}, so "
            "the run cannot resume: train into another --output, or remove training_state.pt to start anew "
            "there\n"
        )


def test_resuming_a_damaged_training_state_or_drafter_config_is_refused(tiny_model_dir, tmp_path, capsys):
    """A cut, overwritten or edited training_state.pt, or a config.json that is JSON but not an object,
    crashed with a traceback (torch.load's, a KeyError, an AttributeError); each is one line naming the file
    and the way out, and leaves the run's files as they were."""
    import os

    from specserve.cli import main

    model, cache = tiny_cache(tiny_model_dir, tmp_path / "cache")
    out = tmp_path / "d"
    argv = ["train", "--model", model, "--cache", cache, "--output", str(out), "--steps", "1"]
    assert main([*argv, "--num-anchors", "4", "--mask-token-id", str(VOCAB - 1)]) == 0
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    state = torch.load(out / "training_state.pt", weights_only=True)
    capsys.readouterr()
    saved = {"step": 1, "optimizer": {}, "config": state["config"]}
    unreadable = "is damaged: torch cannot read it"
    not_a_state = "is damaged: not a dict of step, optimizer, config and vocab"
    for name, damage, says in (
        ("training_state.pt", files["training_state.pt"][:100], unreadable),  # cut short
        ("training_state.pt", b"", unreadable),
        ("training_state.pt", os.urandom(256), unreadable),
        ("training_state.pt", [1, 2], not_a_state),
        ("training_state.pt", {"step": 1}, not_a_state),
        ("training_state.pt", {**state, "step": "1"}, not_a_state),
        (
            "training_state.pt",
            {**saved, "config": {**state["config"], "momentum": 0.9}},
            "is damaged: its config is not a training config (TrainConfig.__init__() got an unexpected "
            "keyword argument 'momentum')",
        ),
        (
            "training_state.pt",
            {**saved, "config": {**state["config"], "total_steps": 0}},
            "is damaged: its config is not a training config (steps must be >= 1, got 0)",
        ),
        (
            "training_state.pt",
            saved,  # read once the target has loaded: the optimizer's state is the drafter's
            "is damaged: its optimizer state does not fit the drafter (",
        ),
        ("config.json", "[]", "is not a JSON object but []"),
        ("config.json", '"x"', "is not a JSON object but 'x'"),
        ("config.json", "null", "is not a JSON object but None"),
        ("config.json", b"\xff\xfe", "is not valid JSON ('utf-8' codec can't decode byte 0xff"),
    ):
        if isinstance(damage, str):
            (out / name).write_text(damage)
        elif isinstance(damage, bytes):
            (out / name).write_bytes(damage)
        else:
            torch.save(damage, out / name)
        err = _refused(capsys, argv)
        assert err.startswith(f"error: {out / name} {says}") and err.count("\n") == 1, (damage, err)
        assert err.endswith("or remove training_state.pt to start anew there\n"), (damage, err)
        (out / name).write_bytes(files[name])
        assert {f.name: f.read_bytes() for f in out.iterdir()} == files


def test_target_cache_refuses_bad_lengths_and_layers_before_loading(tmp_path, capsys, monkeypatch):
    """The target's layer count is in its config.json: a --target-layer-ids past it failed once loaded."""
    from tests.tiny_models import save_tiny_chat_model

    model = str(save_tiny_chat_model("qwen3", tmp_path / "target"))
    capsys.readouterr()  # the save's progress

    def load_model(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr("specserve.models.loader.load_model", load_model)
    data = tmp_path / "data.jsonl"
    data.write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n')
    base = ["data", "target-cache", "--model", model, "--data", str(data), "--output", str(tmp_path / "c")]
    for flags, says in (
        (["--max-length", "0"], "max_length must be >= 1, got 0"),
        (["--target-layer-ids", "1,3"], f"target layer ids must be in 0..2 ({model}), got [1, 3]"),
    ):
        assert _refused(capsys, [*base, *flags]) == f"error: {says}\n", flags
    with pytest.raises(AssertionError, match="the target loaded"):  # the last layer: on to the load
        _refused(capsys, [*base, "--target-layer-ids", "0,2"])
    assert not (tmp_path / "c").exists()


def test_regenerate_refuses_a_bad_prompt_count_batch_or_an_empty_prompt_file_before_loading(tmp_path, capsys):
    """-3 code prompts raised ValueError from random.sample; an empty prompt file or a batch of 0 wrote an
    empty output and exited 0; a bad --temperature or --max-tokens was refused only once the model loaded."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    base = ["data", "regenerate", "--model", "no-such-model", "--output", str(tmp_path / "out.jsonl")]
    for flags, says in (
        (["--code-prompts", "-3"], "-3"),
        (["--prompts", str(empty)], str(empty)),
        (["--code-prompts", "2", "--batch-size", "0"], "--batch-size"),
        (["--code-prompts", "2", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--code-prompts", "2", "--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    ):
        err = _refused(capsys, [*base, *flags])
        assert err.startswith("error:") and says in err and "no-such-model" not in err, (flags, err)
    assert not (tmp_path / "out.jsonl").exists()


def test_target_cache_refuses_data_that_would_give_no_sample(tmp_path, capsys):
    """An empty data file is refused before the load; samples all under --min-loss-tokens as soon as they
    are tokenized, before a 0-sample cache is written (train failed on it only later)."""
    import json

    from tests.tiny_models import save_tiny_chat_model

    empty, data, cache = tmp_path / "empty.jsonl", tmp_path / "data.jsonl", tmp_path / "c"
    empty.write_text("")
    base = ["data", "target-cache", "--output", str(cache), "--data"]
    err = _refused(capsys, [*base, str(empty), "--model", "no-such-model"])
    assert err.startswith("error:") and str(empty) in err and "no-such-model" not in err, err
    model = str(save_tiny_chat_model("qwen3", tmp_path / "target"))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    data.write_text(json.dumps({"conversations": turns}) + "\n")
    capsys.readouterr()
    err = _refused(capsys, [*base, str(data), "--model", model, "--min-loss-tokens", "1000"])
    assert err.startswith("error:") and "--min-loss-tokens" in err, err
    assert not cache.exists()


def test_train_curves_refuses_a_log_with_no_steps(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    err = _refused(capsys, ["train-curves", "--run", f"x={tmp_path}", "--output", str(tmp_path / "c.png")])
    assert err.startswith("error:") and "no steps" in err, err
    assert not (tmp_path / "c.png").exists()


def test_new_drafters_refuse_a_zero_width_mlp_and_say_why_a_block_is_too_small(tiny_model_dir):
    """A 0-wide MLP trained and was written, then crashed the engine (SIGFPE); block size 1 is a real
    drafter (the anchor's slot drafts one token), 0 is not."""
    from specserve.config import SpecserveError

    _, target_config, _ = load_model(str(tiny_model_dir("qwen3")))
    make = dict(num_layers=1, mask_token_id=VOCAB - 1)
    with pytest.raises(SpecserveError, match="intermediate_size 0"):
        new_draft_config(target_config, intermediate_size=0, **make)
    with pytest.raises(SpecserveError, match="block_size 0: .*at least 1"):
        new_draft_config(target_config, block_size=0, **make)
    assert new_draft_config(target_config, block_size=1, **make).max_drafts == 1
