"""The DSpark / DFlash / EAGLE-3 draft networks against DSPARK.md §10 and §8.3: training form vs
incremental form, the anchor off-by-one, Markov bias orientation, Gemma softcap order, draft-cache
bookkeeping, and the checkpoint format (exact key set and shapes, round trip, errors that name the key)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import SamplingParams, SpecserveError
from specserve.core.cache_coordinator import DrafterCaches
from specserve.core.sequence import Sequence
from specserve.models.loader import load_model
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.checkpoint import (
    build_draft_model,
    init_draft_weights,
    load_draft_checkpoint,
    save_draft_checkpoint,
)
from specserve.spec_decode.deepspec.config import (
    DSparkConfig,
    Eagle3Config,
    default_mask_token,
    default_target_layer_ids,
    new_draft_config,
    new_eagle3_config,
)
from specserve.spec_decode.deepspec.dspark import DenseDraftBatch, dense_block_batch
from specserve.spec_decode.drafters import dspark as dspark_drafter
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from tests.tiny_models import VOCAB

B = 4


@pytest.fixture(scope="module")
def targets(tiny_model_dir):
    """arch -> (target model, its config)."""
    return {arch: load_model(str(tiny_model_dir(arch)))[:2] for arch in ("qwen3", "gemma4")}


def make_drafter_model(targets, arch="qwen3", seed=0, std=0.2, k_eq_v=False, **config):
    target, target_config = targets[arch]
    defaults = dict(num_layers=2, block_size=B, markov_rank=8, mask_token_id=VOCAB - 1)
    draft_config = new_draft_config(target_config, **{**defaults, **config})
    if k_eq_v:
        raw = draft_config.to_dict() | {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
        draft_config = DSparkConfig.from_dict(raw)
    model = build_draft_model(draft_config)
    init_draft_weights(model, target, seed=seed, std=std)
    return model


def fake_target(block_size=4, greedy_generator_seed=0) -> TargetContext:
    """What the hidden-state drafters know of their engine (no model: they are built from their own)."""
    return TargetContext(
        model=None,
        model_config=SimpleNamespace(vocab_size=VOCAB),
        tokenizer=None,
        model_name="unused",
        model_dir="unused",
        dtype="float32",
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        max_model_len=512,
        eos_token_ids=frozenset({2}),
        generator=torch.Generator().manual_seed(greedy_generator_seed),
    )


def bound(drafter, block_size: int = 4):
    """`drafter` with its caches, sized as an engine with fake_target's 64 KV blocks would size them."""
    spec = drafter.cache_spec(block_size)
    drafter.bind_caches(DrafterCaches.standalone(spec, 64, block_size, max_num_seqs=4))
    return drafter


def sequence(request_id: str, tokens: list[int]) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    return Sequence(request_id, tokens[:1], params, 64, output_token_ids=list(tokens[1:]))


def incremental_rounds(model, seqs_tokens, features, anchors, cache_block=4):
    """Run the engine drafter's backbone round by round; block hidden states per (sequence, anchor)."""
    drafter = bound(DSparkDrafter(model, fake_target(cache_block)), cache_block)
    out = {}
    fed = [0] * len(seqs_tokens)
    for round_ in range(len(anchors[0])):
        seqs = []
        for s, tokens in enumerate(seqs_tokens):
            a = anchors[s][round_]
            seq = sequence(f"r{s}", tokens[: a + 1])  # the anchor is the newest, uncomputed token
            drafter.observe(seq, fed[s], features[s][fed[s] : a])
            fed[s] = a
            seqs.append(seq)
        h = drafter._backbone(seqs)
        for s, seq in enumerate(seqs):
            state = drafter.states[seq.request_id]
            # Pitfall 6: after every draft forward the draft cache holds exactly the context rows < a.
            assert state.num_cached == anchors[s][round_] and state.num_pending == 0
            assert len(state.block_table) == -(-state.num_cached // cache_block)
            out[s, anchors[s][round_]] = h[s]
    return out


def dense_blocks(model, seqs_tokens, features, anchors, shift=0):
    """The training form: full context, DeepSpec's block mask; `shift` moves the context boundary."""
    lens = [len(f) for f in features]
    batch = dense_block_batch(lens, [[a + shift for a in seq] for seq in anchors], B)
    # The block positions must stay those of the real anchors even when the mask is shifted.
    batch.block_pos = batch.block_pos - shift
    batch.kv_pos = torch.cat([batch.kv_pos[: sum(lens)], batch.block_pos])
    block_ids = []
    for tokens, seq_anchors in zip(seqs_tokens, anchors):
        for a in seq_anchors:
            block_ids += [tokens[a]] + [model.config.mask_token_id] * (B - 1)
    context = model.project_context(torch.cat(features))
    h = model.backbone(model.embed(torch.tensor(block_ids)), context, batch)
    out, row = {}, 0
    for s, seq_anchors in enumerate(anchors):
        for a in seq_anchors:
            out[s, a] = h[row : row + B]
            row += B
    return out


CASES = {
    "qwen3": dict(arch="qwen3"),
    "gemma4": dict(arch="gemma4"),
    "gemma4_k_eq_v": dict(arch="gemma4", k_eq_v=True),
}


def case_inputs(model, lengths=(15, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = len(model.config.target_layer_ids) * model.config.hidden_size
    tokens = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    features = [torch.randn(n, width, generator=g) for n in lengths]
    return tokens, features


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_rounds_equal_the_training_form(case, targets):
    model = make_drafter_model(targets, **CASES[case])
    tokens, features = case_inputs(model)
    anchors = [[3, 6, 7, 12], [2, 5, 9, 10]]  # rounds with 2, 3, 0... accepted drafts
    with torch.no_grad():
        incremental = incremental_rounds(model, tokens, features, anchors)
        dense = dense_blocks(model, tokens, features, anchors)
    for key in dense:
        torch.testing.assert_close(incremental[key], dense[key], atol=2e-5, rtol=1e-4)


def test_the_anchor_row_is_not_context(targets):
    """Pitfall 1: a block sees target features of positions < a only. Changing row a must leave block a
    unchanged and change block a+1; a mask that lets the anchor's own row in gives other outputs."""
    model = make_drafter_model(targets)
    tokens, features = case_inputs(model, lengths=(12,))
    a = 6
    with torch.no_grad():
        before = dense_blocks(model, tokens, features, [[a, a + 1]])
        changed = [features[0].clone()]
        changed[0][a] += 1.0
        after = dense_blocks(model, tokens, changed, [[a, a + 1]])
        leaky = dense_blocks(model, tokens, features, [[a, a + 1]], shift=1)
        incremental = incremental_rounds(model, tokens, changed, [[a, a + 1]])
    torch.testing.assert_close(after[0, a], before[0, a])
    assert (after[0, a + 1] - before[0, a + 1]).abs().max() > 1e-3
    assert (leaky[0, a] - before[0, a]).abs().max() > 1e-3
    torch.testing.assert_close(incremental[0, a], before[0, a], atol=2e-5, rtol=1e-4)


def permutation_markov(model, mapping: torch.Tensor, strength: float = 1000.0) -> None:
    """A vanilla head whose bias puts `strength` on mapping[prev]: W1 = identity, W2[mapping[p], p] = s."""
    head = model.markov_head
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.eye(VOCAB))
        head.markov_w2.weight.zero_()
        head.markov_w2.weight[mapping, torch.arange(VOCAB)] = strength


def test_markov_bias_orientation_and_the_anchor_as_first_prev(targets):
    """bias(p) = markov_w2.weight @ W1[p]; slot 0 conditions on the anchor, slot i on draft i."""
    model = make_drafter_model(targets, markov_rank=VOCAB)
    g = torch.Generator().manual_seed(1)
    mapping = torch.randperm(VOCAB, generator=g)
    permutation_markov(model, mapping)
    head = model.markov_head
    prev = torch.tensor([3, 17])
    bias, _ = head.step(prev, torch.zeros(2, model.config.hidden_size), None)
    torch.testing.assert_close(bias, (head.markov_w2.weight @ head.markov_w1.weight[prev].T).T)
    drafter = bound(DSparkDrafter(model, fake_target()))
    h = torch.zeros(1, B, model.config.hidden_size)
    (proposal,) = drafter._sample(h, torch.tensor([5]), [sequence("r", [1, 5])])
    chain, token = [], 5
    for _ in range(B):
        token = int(mapping[token])
        chain.append(token)
    assert proposal.token_ids == chain  # the transposed W2 would follow the inverse permutation


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_block_bias_unrolls_the_same_steps(kind, targets):
    """Teacher-forced block bias (training) equals the step-by-step bias (inference); the RNN state
    starts at zero in every block and carries across its slots."""
    model = make_drafter_model(targets, markov_head_type=kind)
    head = model.markov_head
    g = torch.Generator().manual_seed(2)
    prev = torch.randint(0, VOCAB, (3, B), generator=g)
    h = torch.randn(3, B, model.config.hidden_size, generator=g)
    with torch.no_grad():
        block = head.block_bias(prev, h)
        state = head.initial_state(3, h)
        for i in range(B):
            bias, state = head.step(prev[:, i], h[:, i], state)
            torch.testing.assert_close(block[:, i], bias)
        if kind == "rnn":
            first, _ = head.step(prev[:, 1], h[:, 1], head.initial_state(3, h))
            assert (first - block[:, 1]).abs().max() > 1e-4  # slot 1 depends on slot 0's state


def test_gemma_softcap_then_markov_bias(targets, monkeypatch):
    """Pitfall 11: base logits are softcapped (|U| <= 30); the Markov bias is added afterwards."""
    model = make_drafter_model(targets, arch="gemma4", markov_rank=VOCAB, std=2.0)
    assert model.softcap == 30.0
    mapping = torch.roll(torch.arange(VOCAB), 1)
    permutation_markov(model, mapping, strength=50.0)
    seen = []
    real = dspark_drafter.sample_drafts
    monkeypatch.setattr(
        dspark_drafter, "sample_drafts", lambda logits, *a: seen.append(logits) or real(logits, *a)
    )
    drafter = bound(DSparkDrafter(model, fake_target()))
    h = torch.randn(1, B, model.config.hidden_size) * 200
    with torch.no_grad():
        (proposal,) = drafter._sample(h, torch.tensor([7]), [sequence("r", [1, 7])])
        base = model.compute_logits(h[0])
    assert base.abs().max() <= 30.0 and base.abs().max() > 29.0  # saturated: the cap is applied
    prev = [7] + proposal.token_ids[:-1]
    for i, logits in enumerate(seen):
        expected = base[i].clone()
        expected[mapping[prev[i]]] += 50.0
        torch.testing.assert_close(logits[0], expected)
    assert max(float(x.max()) for x in seen) > 30.0


def test_confidence_uses_the_previous_token(targets):
    """Pitfall 13: c_i = sigmoid(w [h_i; W1[prev_i]] + b) with prev_0 = the anchor."""
    model = make_drafter_model(targets)
    drafter = bound(DSparkDrafter(model, fake_target()))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, B, model.config.hidden_size, generator=g)
    with torch.no_grad():
        (proposal,) = drafter._sample(h, torch.tensor([9]), [sequence("r", [1, 9])])
        prev = torch.tensor([9] + proposal.token_ids[:-1])
        features = torch.cat([h[0], model.markov_head.markov_w1(prev)], dim=-1)
        expected = torch.sigmoid(model.confidence_head.proj(features).squeeze(-1))
    torch.testing.assert_close(proposal.confidences, expected)


def expected_qwen3_keys(config, layers: int, rank: int, confidence: bool) -> dict[str, tuple[int, ...]]:
    """DSPARK.md §3.4, written out independently of the model code."""
    H, V, d = config.hidden_size, config.vocab_size, config.head_dim
    n_h, n_kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    n_f = len(default_target_layer_ids(config.num_hidden_layers))
    keys = {"embed_tokens.weight": (V, H), "norm.weight": (H,), "fc.weight": (H, n_f * H)}
    keys |= {"hidden_norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(layers):
        p = f"layers.{i}."
        keys |= {
            p + "self_attn.q_proj.weight": (n_h * d, H),
            p + "self_attn.k_proj.weight": (n_kv * d, H),
            p + "self_attn.v_proj.weight": (n_kv * d, H),
            p + "self_attn.o_proj.weight": (H, n_h * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
    if rank:
        keys |= {"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)}
    if confidence:
        keys |= {"confidence_head.proj.weight": (1, H + rank), "confidence_head.proj.bias": (1,)}
    return keys


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_checkpoint_round_trip_with_deepspec_keys(kind, targets, tmp_path):
    target, target_config = targets["qwen3"]
    heads = (
        dict(markov_rank=8, confidence_head=True)
        if kind == "dspark"
        else dict(markov_rank=0, confidence_head=False)
    )
    model = make_drafter_model(targets, **heads)
    directory = save_draft_checkpoint(model, tmp_path / "draft")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(directory / "model.safetensors")
    expected = expected_qwen3_keys(target_config, 2, heads["markov_rank"], heads["confidence_head"])
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["tie_word_embeddings"] is False
    assert config["block_size"] == B and config["target_layer_ids"] == model.config.target_layer_ids
    if kind == "dflash":  # DeepSpec's DFlash configs carry neither key
        assert "markov_head_type" not in config and "confidence_head_with_markov" not in config
    reloaded = load_draft_checkpoint(str(directory), target, target_config)
    # The frozen embedding and head equal the target's, so they are the target's modules, not copies.
    assert reloaded.embed_tokens is target.input_embedding()
    tokens, features = case_inputs(model, lengths=(9,))
    with torch.no_grad():
        a = dense_blocks(model, tokens, features, [[4, 6]])
        b = dense_blocks(reloaded, tokens, features, [[4, 6]])
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def test_gemma4_checkpoint_keys(targets, tmp_path):
    """§3.5: no v_proj with k_eq_v, four layer norms, layer_scalar stored; embed/head still stored."""
    model = make_drafter_model(targets, arch="gemma4", k_eq_v=True, num_layers=1)
    tensors = load_file(save_draft_checkpoint(model, tmp_path / "g") / "model.safetensors")
    layer = {k.removeprefix("layers.0.") for k in tensors if k.startswith("layers.0.")}
    assert "self_attn.v_proj.weight" not in layer and "layer_scalar" in layer
    norms = {
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    }
    assert {n + ".weight" for n in norms} <= layer
    d = model.config.to_dict()["global_head_dim"]
    assert tuple(tensors["layers.0.self_attn.k_proj.weight"].shape) == (d, model.config.hidden_size)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(tensors)


def test_loading_errors_name_the_key(targets, tmp_path):
    target, target_config = targets["qwen3"]
    directory = save_draft_checkpoint(make_drafter_model(targets), tmp_path / "ok")
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())

    def variant(name, tensors=tensors, config=config):
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    missing = {k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(SpecserveError, match="missing tensors: layers.1.mlp.up_proj.weight"):
        load_draft_checkpoint(variant("missing", tensors=missing), target, target_config)
    wrong = dict(tensors, **{"fc.weight": tensors["fc.weight"][:, :-1].contiguous()})
    with pytest.raises(SpecserveError, match="'fc.weight' has shape"):
        load_draft_checkpoint(variant("shape", tensors=wrong), target, target_config)
    extra = dict(tensors, **{"layers.1.self_attn.v_norm.weight": torch.ones(16)})
    with pytest.raises(SpecserveError, match="unexpected tensor 'layers.1.self_attn.v_norm.weight'"):
        load_draft_checkpoint(variant("extra", tensors=extra), target, target_config)
    for name, change, match in [
        ("hidden", {"hidden_size": 32}, "hidden_size is 32"),
        ("layers", {"target_layer_ids": [0, 2]}, r"target_layer_ids \[2\] out of range"),
        ("mask", {"mask_token_id": VOCAB}, "mask_token_id"),
        ("arch", {"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ("required", {"block_size": None}, "missing block_size"),
    ]:
        bad = {k: v for k, v in (config | change).items() if v is not None or k not in change}
        with pytest.raises(SpecserveError, match=match):
            load_draft_checkpoint(variant(name, config=bad), target, target_config)
    gemma_target, gemma_config = targets["gemma4"]
    with pytest.raises(SpecserveError, match="cannot serve a 'gemma4_text' target"):
        load_draft_checkpoint(str(directory), gemma_target, gemma_config)


def make_eagle3_model(targets, arch="qwen3", seed=0, std=0.2):
    target, target_config = targets[arch]
    model = build_draft_model(new_eagle3_config(target_config, ttt_length=3))
    init_draft_weights(model, target, seed=seed, std=std)
    return model


def causal_batch(positions: torch.Tensor) -> DenseDraftBatch:
    mask = positions[None, :] <= positions[:, None]
    return DenseDraftBatch(block_pos=positions, kv_pos=positions, mask=mask)


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_eagle3_incremental_rounds_equal_the_full_sequence(arch, targets):
    """Row t = (features t, token t+1) at position t; causal. Drafting rounds (cache, feed-back, roll back)
    give the q rows a single causal pass over the same rows computes."""
    model = make_eagle3_model(targets, arch)
    tokens, features = case_inputs(model, lengths=(14,))
    tokens, features = tokens[0], features[0]
    drafter = bound(Eagle3Drafter(model, fake_target(), max_num_tokens=2))
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    fed = 0
    for a in (5, 6, 11):
        seq = Sequence("r", tokens[:1], params, 64, output_token_ids=tokens[1 : a + 1])
        drafter.observe(seq, fed, features[fed:a])
        fed = a
        (proposal,) = drafter.propose([seq], 2)
        assert drafter.states["r"].num_cached == a  # drafted rows rolled back
        with torch.no_grad():
            pos = torch.arange(a)
            hidden_in = model.project_context(features[:a])
            out = model(torch.tensor(tokens[1 : a + 1]), hidden_in, causal_batch(pos))
            q1 = model.compute_logits(model.final_hidden(out[-1:])).softmax(-1)
            d1 = proposal.token_ids[0]
            rows = torch.cat([hidden_in, out[-1:]])
            out2 = model(torch.tensor(tokens[1 : a + 1] + [d1]), rows, causal_batch(torch.arange(a + 1)))
            q2 = model.compute_logits(model.final_hidden(out2[-1:])).softmax(-1)
        torch.testing.assert_close(proposal.probs, torch.cat([q1, q2]), atol=1e-5, rtol=1e-4)


def test_eagle3_checkpoint_keys(targets, tmp_path):
    """DSPARK.md §8.3: one layer whose q/k/v read 2H, hidden_norm inside the layer, fc [H, n_f H]."""
    target, target_config = targets["qwen3"]
    model = make_eagle3_model(targets)
    directory = save_draft_checkpoint(model, tmp_path / "e")
    tensors = load_file(directory / "model.safetensors")
    H, V, d = target_config.hidden_size, target_config.vocab_size, target_config.head_dim
    n_h, n_kv, inter = target_config.num_attention_heads, target_config.num_key_value_heads, 128
    n_f = len(model.config.target_layer_ids)
    p = "layers.0."
    expected = {
        "embed_tokens.weight": (V, H), "fc.weight": (H, n_f * H),
        "norm.weight": (H,), "lm_head.weight": (V, H),
        p + "self_attn.q_proj.weight": (n_h * d, 2 * H), p + "self_attn.k_proj.weight": (n_kv * d, 2 * H),
        p + "self_attn.v_proj.weight": (n_kv * d, 2 * H), p + "self_attn.o_proj.weight": (H, n_h * d),
        p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
        p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
        p + "mlp.down_proj.weight": (H, inter), p + "hidden_norm.weight": (H,),
        p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
    }  # fmt: skip
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"] and config["ttt_length"] == 3
    reloaded = load_draft_checkpoint(str(directory), target, target_config)
    assert isinstance(reloaded.config, Eagle3Config)


def test_drafter_cost_benchmark_runs(tiny_model_dir):
    from specserve.bench.drafter_cost import measure

    rows = measure(str(tiny_model_dir("qwen3")), [1], [1, 2], block_size=3, context=8, repeats=1)
    assert [(r.layers, r.requests) for r in rows] == [(1, 1), (1, 2)]
    assert all(r.draft_ms > 0 and r.verify_ms > 0 and r.decode_ms > 0 for r in rows)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_default_mask_token_is_the_first_padding_row():
    real = {f"t{i}": i for i in range(5)}
    assert default_mask_token(FakeTokenizer(real), vocab_size=8) == 5  # hub tokenizer: rows 5-7 unnamed
    gguf_style = {**real, **{f"[PAD{i}]": i for i in range(5, 8)}}  # a GGUF vocabulary names them
    assert default_mask_token(FakeTokenizer(gguf_style), vocab_size=8) == 5
    with pytest.raises(SpecserveError, match="give mask_token_id"):
        default_mask_token(FakeTokenizer({**real, "x": 5, "y": 6, "z": 7}), vocab_size=8)
