"""Parity of our Gemma 3 / Gemma 4 text models with transformers, run over the paged KV cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    SiglipVisionConfig,
)

from specserve.layers.linear import onednn_available, pack_linears
from specserve.layers.moe import split_fused_experts
from specserve.models.gemma import GemmaForCausalLM
from specserve.models.loader import load_model
from specserve.models.registry import build_model
from tests.paged_harness import PagedHarness
from tests.test_linear import assert_batch_invariant
from tests.test_quant import assert_greedy_speculation_is_exact

TOL = 1e-4
VOCAB = 256
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
)
S, F = "sliding_attention", "full_attention"


def gemma3(**over):
    cfg = dict(
        SMALL,
        head_dim=16,
        num_hidden_layers=5,
        layer_types=[S, S, F, S, F],
        sliding_window=4,
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        rope_parameters={
            F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            S: {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    return Gemma3TextConfig(**{**cfg, **over})


def gemma4(**over):
    cfg = dict(
        SMALL,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        num_hidden_layers=5,
        layer_types=[S, F, S, S, F],
        sliding_window=5,
        final_logit_softcapping=10.0,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
    )
    return Gemma4TextConfig(**{**cfg, **over})


CONFIGS = {
    "gemma3": lambda: gemma3(),
    "gemma3_untied": lambda: gemma3(tie_word_embeddings=False, final_logit_softcapping=None),
    "gemma4": lambda: gemma4(),
    "gemma4_k_eq_v": lambda: gemma4(attention_k_eq_v=True),
    # Like the small released Gemma 4 models: KV-shared trailing layers, per-layer inputs, double-wide MLP.
    "gemma4_shared_ple": lambda: gemma4(
        num_hidden_layers=6,
        layer_types=[S, F, S, F, S, F],
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        use_double_wide_mlp=True,
    ),
    "gemma4_moe": lambda: gemma4(
        attention_k_eq_v=True, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
    ),
}


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere, so that ones/zeros-initialised norms and scalars cannot hide a bug."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)


def load_ours(path):
    model = build_model(AutoConfig.from_pretrained(path))
    model.load_weights(load_file(str(path / "model.safetensors")).items())
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, HF reference, full token sequences, HF logits and hidden states per sequence)."""
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    config._attn_implementation = "eager"
    hf_cls = Gemma4ForCausalLM if config.model_type == "gemma4_text" else Gemma3ForCausalLM
    hf = hf_cls(config).eval()
    perturb(hf, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_ours(path)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (24, 30, 64)]
    refs = []
    with torch.no_grad():
        for seq in seqs:
            out = hf(torch.tensor([seq]), output_hidden_states=True)
            refs.append((out.logits[0].float(), [h[0] for h in out.hidden_states]))
    return ours, hf, seqs, refs


def run(model, seqs, refs, schedule, capture_layers=()) -> list[dict]:
    """Feeds `schedule` (steps of (seq, n_tokens) pieces) and checks every piece's logits against HF."""
    harness = PagedHarness(model)
    done = [0] * len(seqs)
    captures = []
    for step in schedule:
        assert all(done[s] + n <= len(seqs[s]) for s, n in step), "schedule longer than the sequence"
        pieces = [(s, seqs[s][done[s] : done[s] + n]) for s, n in step]
        logits, captured = harness.step(pieces, capture_layers)
        for (s, n), got in zip(step, logits, strict=True):
            want = refs[s][0][done[s] : done[s] + n]
            err = (got - want).abs().max().item()
            assert err <= TOL, f"seq {s} tokens {done[s]}..{done[s] + n}: max abs diff {err:.2e}"
            done[s] += n
        captures.append(captured)
    return captures


def test_prefill_then_batched_decode(pair):
    ours, _, seqs, refs = pair
    # One step with three prompts of different lengths (the 40-token one gets its own SDPA group), then
    # decode steps of 1-token and 3/4-token (verification-sized) pieces of all sequences, past the window.
    schedule = [[(0, 3), (1, 9), (2, 40)]]
    schedule += [[(0, 1), (1, 3 if k % 2 else 1), (2, 4 if k % 3 == 0 else 1)] for k in range(8)]
    run(ours, seqs, refs, schedule)


def test_chunked_prefill_mixed_with_decode(pair):
    ours, _, seqs, refs = pair
    schedule = [[(0, 6)], [(0, 1), (1, 7)], [(1, 7), (0, 3)], [(2, 10), (1, 7), (0, 1)]]
    schedule += [[(0, 1), (2, 9), (1, 1)], [(2, 12), (0, 4), (1, 4)], [(2, 1), (0, 1), (1, 4)]]
    run(ours, seqs, refs, schedule)


def test_rejected_tokens_leave_no_trace(pair):
    """Speculative rollback: KV of rejected tokens is overwritten, never read (also by KV-shared layers)."""
    ours, _, seqs, refs = pair
    harness = PagedHarness(ours)
    harness.step([(0, seqs[0][:7]), (1, seqs[1][:5])])
    harness.step([(0, [1, 2, 3, 4]), (1, seqs[1][5:8])])  # seq 0 gets 4 wrong drafts
    harness.rollback(0, 7)
    logits, _ = harness.step([(0, seqs[0][7:10]), (1, seqs[1][8:9])])
    assert (logits[0] - refs[0][0][7:10]).abs().max().item() <= TOL
    assert (logits[1] - refs[1][0][8:9]).abs().max().item() <= TOL


def test_capture_layers_match_hf_hidden_states(pair):
    ours, _, seqs, refs = pair
    layers = list(range(-1, ours.config.num_hidden_layers - 1))  # HF's last entry is post-norm
    captures = run(ours, seqs, refs, [[(0, 5), (2, 11)], [(2, 3), (0, 1)]], capture_layers=layers)
    assert sorted(captures[0]) == layers

    # The residual stream grows with depth, so the bound scales with it (HF's own eager and SDPA backends
    # differ by ~1e-5 relative here).
    def close(layer, got, want):
        err = (got - want).abs().max().item()
        assert err <= TOL * max(1.0, want.abs().max().item()), f"layer {layer}: max abs diff {err:.2e}"

    for layer in layers:
        first, second = captures[0][layer], captures[1][layer]
        h0, h2 = refs[0][1][layer + 1], refs[2][1][layer + 1]
        close(layer, first[:5], h0[:5])
        close(layer, first[5:], h2[:11])
        close(layer, second[:3], h2[11:14])
        close(layer, second[3:], h0[5:6])


def test_cache_specs(pair):
    ours, hf, _, _ = pair
    config, specs = ours.config, ours.cache_specs()
    assert len(specs) == config.num_hidden_layers
    for i, spec in enumerate(specs):
        sliding = config.layer_types[i] == S
        assert spec.sliding_window == (config.sliding_window if sliding else None)
        attn = hf.model.layers[i].self_attn
        assert spec.head_dim == attn.head_dim
        if getattr(attn, "is_kv_shared_layer", False):
            assert (
                spec.shared_with is not None and config.layer_types[spec.shared_with] == config.layer_types[i]
            )
        else:
            assert spec.shared_with is None
            assert spec.num_kv_heads * spec.head_dim == attn.k_proj.out_features


def test_window_is_really_exercised(pair):
    """A model whose sliding layers see everything must disagree with HF (else the tests prove nothing)."""
    ours, _, seqs, refs = pair
    layers = [layer.self_attn for layer in ours.model.layers if layer.self_attn.sliding_window is not None]
    saved = [a.sliding_window for a in layers]
    try:
        for a in layers:
            a.sliding_window = a.sliding_window + 1
        logits, _ = PagedHarness(ours).step([(2, seqs[2][:30])])
        assert (logits[0] - refs[2][0][:30]).abs().max().item() > 1e-3
    finally:
        for a, w in zip(layers, saved, strict=True):
            a.sliding_window = w


def test_multimodal_gemma3_checkpoint_loads_text_part(tmp_path):
    torch.manual_seed(0)
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    # (HF's multimodal head ignores final_logit_softcapping; released Gemma 3 configs leave it unset.)
    text = gemma3(final_logit_softcapping=None).to_dict()
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    config.text_config._attn_implementation = "eager"
    hf = Gemma3ForConditionalGeneration(config).eval()
    perturb(hf, seed=3)
    hf.save_pretrained(tmp_path)
    # transformers writes the legacy layout (language_model.model.*, vision_tower.*); in-memory HF models
    # use model.language_model.*. Both must load.
    legacy = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("language_model.model.layers.") for k in legacy)
    assert any("vision_tower." in k for k in legacy)
    current = {
        "model." + k.replace("language_model.model.", "language_model.", 1): v for k, v in legacy.items()
    }
    ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    for ckpt in (legacy, current):
        ours = build_model(AutoConfig.from_pretrained(tmp_path))
        ours.load_weights(ckpt.items())
        logits, _ = PagedHarness(ours).step([(0, ids)])
        assert (logits[0] - want).abs().max().item() <= TOL


@pytest.mark.parametrize("make", [gemma3, gemma4])
def test_embedding_scale_is_rounded_to_weight_dtype(make, tmp_path):
    """sqrt(72) = 8.485 is 8.5 in bf16; HF scales by the rounded value and so must we."""
    hf = (Gemma4ForCausalLM if make is gemma4 else Gemma3ForCausalLM)(make(hidden_size=72)).eval()
    perturb(hf, seed=5)
    hf.save_pretrained(tmp_path)
    ours = build_model(AutoConfig.from_pretrained(tmp_path), dtype=torch.bfloat16)
    ours.load_weights(load_file(str(tmp_path / "model.safetensors")).items())
    ids = list(range(0, VOCAB, 17))
    _, captured = PagedHarness(ours, dtype=torch.bfloat16).step([(0, ids)], capture_layers=[-1])
    want = hf.to(torch.bfloat16).model.embed_tokens(torch.tensor(ids))
    assert captured[-1].dtype == torch.bfloat16
    assert torch.equal(captured[-1], want)


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="batch invariance needs oneDNN's linears")


@needs_onednn
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_tied_head_is_batch_invariant(arch, tiny_model_dir):
    """The tied head is a linear on the embedding, packed like every other (F.linear is not invariant)."""
    model, _, _ = load_model(str(tiny_model_dir(arch)))
    assert_batch_invariant(model.compute_logits, model.config.hidden_size)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_onednn
def test_moe_experts_are_batch_invariant():
    """An expert's row count changes with the batch: each row must come out the same at any count."""
    config = gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    experts = GemmaForCausalLM(config).model.layers[0].experts  # the model's own, fp32: one call per expert
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(6))
    assert pack_linears(experts) == 3 * config.num_experts  # as a load places them

    def layer(x):  # a routing of each row by its own values, so that it is the same alone and in a batch
        top = x[:, : config.num_experts].topk(config.top_k_experts)
        return experts(x, top.values.softmax(-1), top.indices)

    assert_batch_invariant(layer, config.hidden_size)


@needs_onednn
@pytest.mark.parametrize("mode", [None, "int4"])
def test_greedy_speculation_equals_greedy_decoding(mode, tmp_path):
    """Gemma 4 with sliding windows, a MoE block and a tied head whose rows pair up 2^-22 apart (relative),
    so that logits tie to within rounding: ngram speculation must emit the tokens decoding does; int4 too,
    its experts in grouped kernel calls."""
    config = CONFIGS["gemma4_moe"]()
    hf = Gemma4ForCausalLM(config).eval()
    perturb(hf, seed=7)
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        noise = torch.randn(embed[0::2].shape, generator=torch.Generator().manual_seed(0))
        embed[1::2] = embed[0::2] * (1 + 2**-22 * noise)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    assert_greedy_speculation_is_exact(str(tmp_path), mode)


# Layouts of released models (dims as published, vocab cut) checked on the meta device: names and shapes of
# every tensor HF saves, and which layer's cache each KV-shared layer reads.
_TYPES_4_1 = ([S] * 4 + [F]) * 7
RELEASED = {
    "gemma3_1b": lambda: Gemma3TextConfig(
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        vocab_size=1024,
    ),
    "gemma4_e2b": lambda: Gemma4TextConfig(
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=35,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=_TYPES_4_1,
        vocab_size=1024,
        vocab_size_per_layer_input=1024,
        hidden_size_per_layer_input=256,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    ),
    "gemma4_dense_k_eq_v": lambda: Gemma4TextConfig(
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        vocab_size=1024,
        final_logit_softcapping=30.0,
    ),
    "gemma4_moe": lambda: Gemma4TextConfig(
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        vocab_size=1024,
    ),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_layouts_match_hf_tensors(name):
    config = RELEASED[name]()
    hf_cls = Gemma4ForCausalLM if config.model_type == "gemma4_text" else Gemma3ForCausalLM
    with torch.device("meta"):
        hf, ours = hf_cls(config), GemmaForCausalLM(config)
    saved = ((k, v) for k, v in hf.state_dict().items() if k != "lm_head.weight")  # tied: not saved
    want = {k: v.shape for k, v in split_fused_experts(saved)}  # the experts as the loader hands them over
    assert {k: v.shape for k, v in ours.state_dict().items()} == want
    # The attention modules' flags, not config.kv_sharing_modes: transformers 5.10 has no such property.
    attns = [layer.self_attn for layer in hf.model.layers]
    for i, spec in enumerate(ours.cache_specs()):
        assert (spec.shared_with is not None) == getattr(attns[i], "is_kv_shared_layer", False)
        if spec.shared_with is not None:
            assert attns[spec.shared_with].store_full_length_kv
            assert config.layer_types[spec.shared_with] == config.layer_types[i]


@pytest.mark.parametrize(
    "config, field",
    [
        (lambda: gemma3(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (lambda: gemma4(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (lambda: gemma4(num_kv_shared_layers=5), "num_kv_shared_layers"),
    ],
)
def test_unsupported_configs_are_refused(config, field):
    with pytest.raises(NotImplementedError, match=field):
        build_model(config())


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers():
    """The shipped Gemma 3 270M weights, 600 tokens (past its 512-token window), chunked over the cache."""
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import load_model, resolve_model

    try:
        ours, _, tokenizer = load_model("gemma-3-270m")
    except Exception as exc:  # the local-models extra is not installed
        pytest.skip(f"local model unavailable: {exc}")
    ref = AutoModelForCausalLM.from_pretrained(resolve_model("gemma-3-270m"), dtype=torch.float32).eval()
    ids = (tokenizer("The capital of France is Paris. The capital of Italy is").input_ids * 60)[:600]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    harness = PagedHarness(ours, num_blocks=64, block_size=16)
    got = torch.cat([harness.step([(0, ids[i : i + n])])[0][0] for i, n in ((0, 300), (300, 250), (550, 50))])
    assert (got - want).abs().max().item() <= 5e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
