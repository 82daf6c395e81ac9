"""EAGLE-3's training-time test (DSPARK.md §8.3): the TTT forward against the inference drafter, the step
masks, the loss on hand-checked tensors, and training through the trainer and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specserve import SamplingParams
from specserve.core.sequence import Sequence
from specserve.models.loader import load_model
from specserve.spec_decode.deepspec.checkpoint import build_draft_model, init_draft_weights
from specserve.spec_decode.deepspec.config import new_eagle3_config
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.train.eagle3 import eagle3_training_forward
from specserve.train.forward import target_features
from specserve.train.losses import eagle3_loss
from specserve.train.trainer import Sample, TrainConfig, Trainer
from tests.test_dspark import bound, fake_target
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.kernel_agnostic


def make_model(tiny_model_dir, arch="qwen3", ttt_length=4, std=0.2):
    target, target_config, _ = load_model(str(tiny_model_dir(arch)))
    model = build_draft_model(new_eagle3_config(target_config, ttt_length=ttt_length))
    init_draft_weights(model, target, seed=0, std=std)
    return target, target_config, model


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_ttt_steps_equal_the_inference_drafter(arch, tiny_model_dir):
    """Row t, step k of TTT is draft step k of the engine's drafter anchored at a = t + 1 (its context rows
    cached, drafting from its own hidden states) when the drafted tokens are the sequence's next tokens."""
    K = 4
    _, _, model = make_model(tiny_model_dir, arch, ttt_length=K)
    g = torch.Generator().manual_seed(0)
    width = len(model.config.target_layer_ids) * model.config.hidden_size
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    for a in (1, 6, 11):
        tokens = torch.randint(0, VOCAB - 1, (a + 1,), generator=g).tolist()
        features = torch.randn(a + K + 3, width, generator=g)  # rows >= a: later context TTT must not read
        drafter = bound(Eagle3Drafter(model, fake_target(), max_num_tokens=K))
        seq = Sequence("r", tokens[:1], params, 64, output_token_ids=tokens[1:])
        drafter.observe(seq, 0, features[:a])
        (proposal,) = drafter.propose([seq], K)
        ids = torch.tensor(tokens + proposal.token_ids + [0, 0])  # the drafts, then anything
        with torch.no_grad():
            out = eagle3_training_forward(
                model, ids, features, torch.randn(len(ids), model.config.hidden_size), torch.ones(len(ids)), K
            )
        row = out.rows.tolist().index(a - 1)
        torch.testing.assert_close(out.draft_logits[row].softmax(-1), proposal.probs, atol=1e-5, rtol=1e-4)


def test_step_masks_targets_past_the_end_and_sampled_rows(tiny_model_dir):
    """mask_0 = loss mask without the last token, mask_k[t] = mask_0[t + k]; row t, step k is scored
    against the target at t + k + 1, uniform (zero logits) past the end, where it is always masked.
    Rows without a supervised step are not unrolled; a sample of rows gives exactly those rows' terms."""
    _, _, model = make_model(tiny_model_dir, ttt_length=3)
    S = 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (S,), generator=g)
    features = torch.randn(S, model.fc.in_features, generator=g)
    last_hidden = torch.randn(S, model.config.hidden_size, generator=g)
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    with torch.no_grad():
        out = eagle3_training_forward(model, ids, features, last_hidden, loss_mask, 3)
    assert out.rows.tolist() == list(range(7)) and out.normaliser == S  # row 7 has no supervised step
    assert out.mask.T.long().tolist() == [
        [0, 0, 1, 1, 1, 0, 1],
        [0, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1, 0, 0],
    ]
    reference = model.compute_logits(last_hidden)
    for t in range(7):
        for k in range(3):
            expected = reference[t + k + 1] if t + k + 1 < S else torch.zeros(VOCAB)
            torch.testing.assert_close(out.target_logits[t, k], expected)
    past_end = torch.arange(7)[:, None] + torch.arange(1, 4) >= S
    assert past_end.any() and not (out.mask & past_end).any()
    noisy = out.target_logits + 5 * torch.randn(out.target_logits.shape) * past_end[..., None]
    before = eagle3_loss(out.draft_logits, out.target_logits, out.mask, S)
    after = eagle3_loss(out.draft_logits, noisy, out.mask, S)
    assert after.total.item() == before.total.item()
    assert torch.equal(after.slot_acceptance, before.slot_acceptance)
    with torch.no_grad():
        sampled = eagle3_training_forward(
            model,
            ids,
            features,
            last_hidden,
            loss_mask,
            3,
            max_rows=3,
            generator=torch.Generator().manual_seed(0),
        )
    assert len(sampled.rows) == 3 and sampled.normaliser == S * 3 / 7
    torch.testing.assert_close(sampled.draft_logits, out.draft_logits[sampled.rows])
    assert torch.equal(sampled.mask, out.mask[sampled.rows])


def test_loss_by_hand():
    # two rows, two TTT steps, a 3-token vocabulary; row 1 at step 1 is masked
    q = torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]], [[1 / 3, 1 / 3, 1 / 3], [0.1, 0.1, 0.8]]])
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.2, 0.6, 0.2]], [[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]]])
    mask = torch.tensor([[True, True], [True, False]])
    terms = eagle3_loss(q.log(), p.log(), mask, normaliser=2)

    def soft_ce(p, q):
        return -sum(pi * math.log(qi) for pi, qi in zip(p, q))

    ce = [[soft_ce(p[t, k].tolist(), q[t, k].tolist()) for k in range(2)] for t in range(2)]
    expected = (ce[0][0] + ce[1][0] + 0.8 * ce[0][1]) / 2  # divided by the 2 rows, not the 3 masked
    assert terms.total.item() == pytest.approx(expected, rel=1e-5)
    # acceptance 1 - TV: step 0 rows (1 - 0.2) and (1 - 1/6), step 1 row 0 only: identical, 1
    assert terms.slot_acceptance.tolist() == pytest.approx([(0.8 + 5 / 6) / 2, 1.0], rel=1e-5)
    assert terms.l1.item() == pytest.approx((0.4 + 1 / 3 + 0.8 * 0) / 2.8, rel=1e-5)


def eagle3_samples(target, model, num_samples=3, seq_len=32):
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(num_samples):
        ids = torch.randint(0, VOCAB - 1, (seq_len,), generator=g)
        features, last_hidden = target_features(target, ids.tolist(), model.config.target_layer_ids)
        samples.append(Sample(ids, (torch.arange(seq_len) >= 6).long(), features, last_hidden))
    return samples


def test_training_lowers_the_loss_and_resumes_bit_identically(tiny_model_dir, tmp_path):
    """Six steps over 12 sampled chains of 31 per sequence (drawn afresh each step, and identically after
    a resume) shrink the full objective's excess over the target's entropy, the KL that soft-CE trains."""
    target, target_config, model = make_model(tiny_model_dir, ttt_length=3, std=0.02)
    samples = eagle3_samples(target, model, num_samples=2)

    @torch.no_grad()
    def full_losses(model):
        """(loss, its floor: the target's own entropy) over every row of the samples."""
        loss = floor = 0.0
        for s in samples:
            out = eagle3_training_forward(model, s.input_ids, s.features, s.last_hidden, s.loss_mask, 3)
            loss += eagle3_loss(out.draft_logits, out.target_logits, out.mask, out.normaliser).total.item()
            floor += eagle3_loss(out.target_logits, out.target_logits, out.mask, out.normaliser).total.item()
        return loss, floor

    before, floor = full_losses(model)
    config = TrainConfig(total_steps=6, batch_size=2, lr=5e-3, warmup_ratio=0.0, num_anchors=12)
    trainer = Trainer(model, samples, config)
    logs = [trainer.step() for _ in range(3)]
    resumed = Trainer.resume(trainer.save(tmp_path / "ckpt"), target, target_config, samples)
    assert resumed.model.config.ttt_length == 3
    logs += [trainer.step() for _ in range(3)]
    for _ in range(3):
        resumed.step()
    for (name, a), b in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    after, _ = full_losses(model)
    assert after - floor < 0.7 * (before - floor)
    assert len(logs[0]["acceptance"]) == 3 and logs[-1]["tau"] > logs[0]["tau"]


def test_cli_trains_an_eagle3_drafter(tiny_model_dir, tmp_path):
    from specserve.cli import main
    from specserve.train.target_cache import CacheInfo, write_target_cache

    model_dir = str(tiny_model_dir("qwen3"))
    target, _, model = make_model(tiny_model_dir)
    info = CacheInfo(model.config.target_layer_ids, model.config.hidden_size, model_dir)
    write_target_cache(tmp_path / "cache", eagle3_samples(target, model, num_samples=2, seq_len=16), info)
    argv = [
        "train",
        "--model",
        model_dir,
        "--cache",
        str(tmp_path / "cache"),
        "--output",
        str(tmp_path / "d"),
    ]
    argv += ["--method", "eagle3", "--ttt-length", "3", "--steps", "2", "--batch-size", "1"]
    assert main(argv) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"] and config["ttt_length"] == 3
    metrics = [json.loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and len(metrics[0]["acceptance"]) == 3
