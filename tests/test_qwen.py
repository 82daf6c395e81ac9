"""Parity of our Qwen2 / Qwen3 / Qwen3-MoE against transformers, run over the paged cache in flat batches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from specserve.models.loader import iter_checkpoint_tensors
from specserve.models.registry import build_model
from tests.paged_harness import PagedHarness

TOL = 1e-4
VOCAB = 192
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # head_dim 32 != hidden / heads: q_proj is wider than the residual stream, as in real Qwen3.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
}


def make_hf(family: str, seed: int = 0, **overrides):
    """A tiny HF model with every weight random (norms around 1, biases non-zero) so that no term can hide."""
    config_cls, model_cls, extra = CONFIGS[family]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**{**SMALL, **extra, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    return hf


def load_ours(hf, path: Path):
    hf.save_pretrained(path)
    model = build_model(AutoConfig.from_pretrained(path))
    model.load_weights(iter_checkpoint_tensors(path))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def fam(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param)
    return SimpleNamespace(name=request.param, hf=hf, model=load_ours(hf, path), path=path)


def random_seqs(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference(hf, seq: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
    return SimpleNamespace(logits=out.logits[0].float(), hidden=[h[0] for h in out.hidden_states])


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, what
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.2e}"


class Checker:
    """Drives the harness over known token sequences and checks every returned logit row against HF."""

    def __init__(self, model, hf, seqs: list[list[int]]):
        self.harness = PagedHarness(model)
        self.seqs = seqs
        self.refs = [reference(hf, s) for s in seqs]
        self.garbage = torch.Generator().manual_seed(123)

    def step(self, pieces: list[tuple[int, int, int]], capture_layers=()) -> dict:
        """pieces: (sequence, real tokens, rejected drafts). Rejected drafts are fed, then rolled back."""
        fed, starts = [], []
        for sid, n_real, n_fake in pieces:
            start = self.harness.lengths.get(sid, 0)
            fake = torch.randint(VOCAB, (n_fake,), generator=self.garbage).tolist()
            fed.append((sid, self.seqs[sid][start : start + n_real] + fake))
            starts.append(start)
        logits, captured = self.harness.step(fed, capture_layers)
        for (sid, n_real, _), start, lg in zip(pieces, starts, logits, strict=True):
            ref = self.refs[sid].logits[start : start + n_real]
            assert_close(lg[:n_real], ref, f"seq {sid} positions {start}..{start + n_real - 1}")
            self.harness.rollback(sid, start + n_real)
        return captured


def test_prefill_then_batched_decode_and_verify(fam):
    # 37 > BATCHED_PIECE_MAX_LEN: that prompt takes attention's masked per-piece path, the others row by row.
    prompts = [5, 37, 1, 12]
    decode = [[1, 1, 1, 1], [3, 4, 1, 3], [4, 3, 4, 4], [1, 1, 3, 1], [3, 3, 3, 3]]
    seqs = random_seqs([p + sum(s[i] for s in decode) for i, p in enumerate(prompts)], seed=1)
    check = Checker(fam.model, fam.hf, seqs)
    check.step([(i, p, 0) for i, p in enumerate(prompts)])
    for step, sizes in enumerate(decode):
        # Every other step verifies a block with rejected drafts: their KV must never be read again.
        rejected = [2, 0, 3, 1] if step % 2 else [0, 0, 0, 0]
        check.step([(i, n, rejected[i]) for i, n in enumerate(sizes)])
    assert [check.harness.lengths[i] for i in range(4)] == [len(s) for s in seqs]


def test_chunked_prefill_mixed_with_decode(fam):
    seqs = random_seqs([50 + 4, 6 + 10], seed=2)
    check = Checker(fam.model, fam.hf, seqs)
    check.step([(1, 6, 0), (0, 33, 0)])  # long chunk (own attention call) next to a short prompt
    check.step([(0, 10, 0), (1, 1, 0)])
    check.step([(1, 3, 1), (0, 7, 0)])
    check.step([(0, 1, 0), (1, 4, 0)])
    check.step([(0, 3, 2), (1, 2, 0)])


def test_capture_layers_match_hf_hidden_states(fam):
    last = fam.hf.config.num_hidden_layers - 1
    layers = (-1, 0, last - 1)
    seqs = random_seqs([9, 4], seed=3)
    harness = PagedHarness(fam.model)
    refs = [reference(fam.hf, s) for s in seqs]
    _, captured = harness.step([(0, seqs[0][:7]), (1, seqs[1][:3])], capture_layers=layers)
    _, captured_decode = harness.step([(0, seqs[0][7:]), (1, seqs[1][3:])], capture_layers=layers)
    assert set(captured) == set(layers) == set(captured_decode)
    for layer in layers:
        rows = [refs[0].hidden[layer + 1][:7], refs[1].hidden[layer + 1][:3]]
        assert_close(captured[layer], torch.cat(rows), f"layer {layer} prefill")
        rows = [refs[0].hidden[layer + 1][7:], refs[1].hidden[layer + 1][3:]]
        assert_close(captured_decode[layer], torch.cat(rows), f"layer {layer} decode")


def test_load_errors_name_the_tensor(fam):
    weights = dict(iter_checkpoint_tensors(fam.path))
    victim = "model.layers.1.self_attn.k_proj.weight"
    if fam.name == "qwen3_moe":
        victim = "model.layers.0.mlp.experts.5.up_proj.weight"
    model = build_model(fam.hf.config)
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        model.load_weights((k, v) for k, v in weights.items() if k != victim)
    bad = {**weights, victim: weights[victim][:-1]}
    with pytest.raises(ValueError, match=victim.replace(".", r"\.") + ".*shape"):
        model.load_weights(bad.items())
    with pytest.raises(ValueError, match="model.layers.9.mlp"):
        model.load_weights([*weights.items(), ("model.layers.9.mlp.gate_proj.weight", torch.zeros(1))])


def test_tied_embeddings(tmp_path):
    hf = make_hf("qwen2", seed=4, tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    model = load_ours(hf, tmp_path)
    assert "lm_head.weight" not in dict(iter_checkpoint_tensors(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seqs = random_seqs([8, 3], seed=5)
    check = Checker(model, hf, seqs)
    check.step([(0, 6, 0), (1, 2, 0)])
    check.step([(0, 2, 1), (1, 1, 0)])


def test_sliding_window_layers(tmp_path):
    hf = make_hf("qwen2", seed=6, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    model = load_ours(hf, tmp_path)
    assert [s.sliding_window for s in model.cache_specs()] == [None, 5, 5]
    seqs = random_seqs([20, 14], seed=7)
    check = Checker(model, hf, seqs)
    check.step([(0, 13, 0), (1, 4, 0)])
    check.step([(0, 3, 1), (1, 6, 0)])
    check.step([(0, 4, 0), (1, 4, 2)])


def test_moe_routes_to_distinct_experts(tmp_path):
    hf = make_hf("qwen3_moe", seed=0)
    model = load_ours(hf, tmp_path)
    experts = model.model.layers[0].mlp.experts
    assert len(experts) == 8 and not hasattr(model.model.layers[1].mlp, "experts")  # mlp_only_layers=[1]
    assert not torch.equal(experts[0].gate_proj.weight, experts[1].gate_proj.weight)
    routed = []
    hook = experts.register_forward_hook(lambda mod, args, out: routed.append(args[2]))
    seq = random_seqs([24], seed=8)[0]
    harness = PagedHarness(model)
    (logits,), _ = harness.step([(0, seq)])
    hook.remove()
    ids = routed[0]
    assert ids.shape == (24, 2) and len(ids.unique()) >= 6 and (ids[:, 0] != ids[:, 1]).all()
    # The busiest expert matters beyond the parity tolerance: silencing it moves the logits.
    busiest = ids.flatten().bincount().argmax().item()
    saved = experts[busiest].down_proj.weight.detach().clone()
    with torch.no_grad():
        experts[busiest].down_proj.weight.zero_()
    (silenced,), _ = PagedHarness(model).step([(0, seq)])
    with torch.no_grad():
        experts[busiest].down_proj.weight.copy_(saved)
    assert (silenced - logits).abs().max() > 100 * TOL


def test_moe_loads_fused_experts_and_unnormalised_topk():
    # transformers v5 keeps experts fused in memory (experts.gate_up_proj / experts.down_proj).
    hf = make_hf("qwen3_moe", seed=9, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    model = build_model(hf.config)
    model.load_weights(state.items())
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [False, True, False]
    seqs = random_seqs([11, 5], seed=10)
    check = Checker(model, hf, seqs)
    check.step([(0, 8, 0), (1, 5, 0)])
    check.step([(0, 3, 2)])
