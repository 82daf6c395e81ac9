"""Hybrid Qwen models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): parity with transformers over the paged KV cache
and recurrent-state slots, and the properties speculative verification relies on (a verified token equals
the token decoded alone; a rolled-back state equals plain decoding's)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from specserve.config import SpecserveError
from specserve.layers import kernels
from specserve.layers.gated_deltanet import (
    RECURRENT_MAX_LEN,
    GatedDeltaNet,
    RecurrentLayout,
    RecurrentState,
    RecurrentStateSpec,
    l2norm,
    recurrent_delta_rule,
    replay_delta_rule,
)
from specserve.layers.linear import onednn_available, pack_linears
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints
from specserve.models.base import LayerCacheSpec
from specserve.models.loader import iter_checkpoint_tensors, load_model
from specserve.models.registry import build_model
from tests.paged_harness import PagedHarness
from tests.tiny_models import HYBRID_ARCHS, VOCAB, _hybrid_configs, build_reference

TOL = 1e-4
DIFFS: dict[tuple[str, str], float] = {}  # (arch, case) -> largest logit difference seen (for reports)
MTP = {"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)}


def randomise(hf, seed: int = 0):
    """Every weight random; zero-centred norms near scale 1 (w ~ 0), the gated norm's w near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return hf


def add_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    file = path / "model.safetensors"
    save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def fam(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = randomise(build_reference(request.param))
    hf.save_pretrained(path)
    add_tensors(path, MTP)  # released checkpoints ship an MTP layer: the target skips it
    model = build_model(AutoConfig.from_pretrained(path))
    model.load_weights(iter_checkpoint_tensors(path))
    return SimpleNamespace(name=request.param, hf=hf, model=model, path=path)


def random_seqs(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference(hf, seq: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
    return SimpleNamespace(logits=out.logits[0].float(), hidden=[h[0] for h in out.hidden_states])


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, key: tuple[str, str] | None = None):
    assert ours.shape == ref.shape, what
    diff = (ours - ref).abs().max().item()
    if key is not None:
        DIFFS[key] = max(DIFFS.get(key, 0.0), diff)
    assert diff <= TOL, f"{what}: max abs diff {diff:.2e}"


class Checker:
    """Drives the harness over known sequences and checks every logit row against HF. A piece with
    rejected drafts is checkpointed and rolled back to its real tokens after the step."""

    def __init__(self, fam, seqs: list[list[int]], case: str):
        self.harness = PagedHarness(fam.model)
        self.seqs, self.key = seqs, (fam.name, case)
        self.refs = [reference(fam.hf, s) for s in seqs]
        self.garbage = torch.Generator().manual_seed(123)

    def step(self, pieces: list[tuple[int, int, int]]) -> None:
        """pieces: (sequence, real tokens, rejected drafts)."""
        fed, starts = [], []
        for sid, n_real, n_fake in pieces:
            start = self.harness.lengths.get(sid, 0)
            fake = torch.randint(VOCAB, (n_fake,), generator=self.garbage).tolist()
            fed.append((sid, self.seqs[sid][start : start + n_real] + fake))
            starts.append(start)
        logits, _ = self.harness.step(fed, checkpoint=[sid for sid, _, n_fake in pieces if n_fake])
        for (sid, n_real, _), start, lg in zip(pieces, starts, logits, strict=True):
            ref = self.refs[sid].logits[start : start + n_real]
            assert_close(lg[:n_real], ref, f"seq {sid} positions {start}..{start + n_real - 1}", self.key)
            self.harness.rollback(sid, start + n_real)


def test_prefill(fam):
    # 70 and 40 tokens take the chunked form (two chunks, one), 20 and 1 the recurrent one, in one forward.
    seqs = random_seqs([70, 40, 20, 1], seed=1)
    Checker(fam, seqs, "prefill").step([(i, len(s), 0) for i, s in enumerate(seqs)])


def test_chunked_prefill(fam):
    # One prompt in four pieces (chunked, recurrent, chunked, recurrent), each from the slot's state.
    seqs = random_seqs([100, 12], seed=2)
    check = Checker(fam, seqs, "chunked prefill")
    check.step([(0, 40, 0), (1, 5, 0)])
    check.step([(0, 7, 0), (1, 7, 0)])
    check.step([(0, 45, 0)])
    check.step([(0, 8, 0)])


def test_batched_decode(fam):
    prompts = [5, 37, 1, 12]
    seqs = random_seqs([p + 4 for p in prompts], seed=3)
    check = Checker(fam, seqs, "batched decode")
    check.step([(i, p, 0) for i, p in enumerate(prompts)])
    for _ in range(4):
        check.step([(i, 1, 0) for i in range(4)])


def test_verification_mixed_with_decode_and_prefill(fam):
    # Verification blocks of k + 1 = 5 tokens (some drafts rejected, then rolled back) next to decode tokens
    # and a prefill chunk; the following steps continue from the rolled-back states.
    seqs = random_seqs([30, 20, 95, 25], seed=4)
    check = Checker(fam, seqs, "verify + decode + prefill")
    check.step([(0, 10, 0), (1, 8, 0), (3, 12, 0)])
    check.step([(0, 2, 3), (1, 1, 0), (2, 40, 0), (3, 5, 0)])  # seq 3 accepts all 4 drafts
    check.step([(0, 4, 1), (1, 3, 2), (2, 1, 4), (3, 1, 0)])
    check.step([(0, 1, 4), (1, 1, 0), (2, 49, 0), (3, 3, 2)])
    check.step([(0, 5, 0), (1, 2, 3), (2, 1, 0), (3, 1, 0)])


def test_capture_layers_match_hf_hidden_states(fam):
    layers = (-1, 0, 1)  # embedding, linear, full (HF normalises the last layer's output)
    seqs = random_seqs([45, 4], seed=5)
    harness = PagedHarness(fam.model)
    refs = [reference(fam.hf, s) for s in seqs]
    _, captured = harness.step([(0, seqs[0][:42]), (1, seqs[1][:3])], capture_layers=layers)
    _, decoded = harness.step([(0, seqs[0][42:]), (1, seqs[1][3:])], capture_layers=layers)
    for layer in layers:
        want = torch.cat([refs[0].hidden[layer + 1][:42], refs[1].hidden[layer + 1][:3]])
        assert_close(captured[layer], want, f"layer {layer} prefill")
        want = torch.cat([refs[0].hidden[layer + 1][42:], refs[1].hidden[layer + 1][3:]])
        assert_close(decoded[layer], want, f"layer {layer} decode")


def test_rollback_state_equals_plain_decoding(fam):
    seq = random_seqs([16], seed=6)[0]
    for j in range(5):
        verified, plain = PagedHarness(fam.model), PagedHarness(fam.model)
        verified.step([(0, seq[:9])])
        plain.step([(0, seq[:9])])
        verified.step([(0, seq[9:14])], checkpoint=[0])
        verified.rollback(0, 9 + j + 1)
        for t in range(j + 1):
            plain.step([(0, seq[9 + t : 10 + t])])
        for a, b in zip(verified.kv_caches, plain.kv_caches, strict=True):
            if isinstance(a, RecurrentState):
                assert (a.ssm[0] - b.ssm[0]).abs().max() <= 1e-5
                assert (a.conv[0] - b.conv[0]).abs().max() <= 1e-5
        with pytest.raises(ValueError, match="not checkpointed"):
            fam.model.rollback_states(verified.checkpoints, verified.kv_caches, {1: 1})
        (after_rollback,), _ = verified.step([(0, seq[10 + j : 11 + j])])
        (after_plain,), _ = plain.step([(0, seq[10 + j : 11 + j])])
        assert (after_rollback - after_plain).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_moe_loads_experts_fused_in_memory(arch):
    # transformers v5 holds experts fused (experts.gate_up_proj [E, 2I, H]); its state dict loads too.
    hf = randomise(build_reference(arch), seed=13)
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    model = build_model(hf.config)
    model.load_weights(state.items())
    seq = random_seqs([9], seed=12)[0]
    (logits,), _ = PagedHarness(model).step([(0, seq)])
    assert_close(logits, reference(hf, seq).logits, "fused experts")


# --- the recurrence itself: bitwise properties, on one linear layer with batch-invariant (packed) linears


def packed_linear_layer(fam) -> GatedDeltaNet:
    if not onednn_available():
        pytest.skip("oneDNN packed linears (the batch-invariant ones) are not available")
    layer = copy.deepcopy(fam.model.model.layers[0].linear_attn)
    assert pack_linears(layer) == 5
    return layer


def run_layer(layer, state, pieces: list[tuple[int, int, torch.Tensor]], checkpoints=None) -> torch.Tensor:
    """pieces: (slot, first position, inputs [L, hidden]) in one forward of the layer alone."""
    query_start = [0]
    for _, _, x in pieces:
        query_start.append(query_start[-1] + len(x))
    positions = torch.cat([torch.arange(start, start + len(x)) for _, start, x in pieces])
    meta = ForwardMetadata.build(
        query_start,
        [start + len(x) for _, start, x in pieces],
        [[0] for _ in pieces],
        positions,
        block_size=4096,
        state_slots=torch.tensor([slot for slot, _, _ in pieces]),
        checkpoints=checkpoints,
    )
    layout = RecurrentLayout.build(meta, layer.kernel_size)
    with torch.no_grad():
        return layer(torch.cat([x for _, _, x in pieces]), layout, state, checkpoints)


def layer_inputs(layer, lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, layer.in_proj_qkv.in_features, generator=gen) for n in lengths]


# compiled_kernels: the short pieces' recurrence on specserve's kernel, then on torch ops
def test_verified_tokens_equal_tokens_decoded_alone(fam, compiled_kernels):
    layer = packed_linear_layer(fam)
    prefix_a, verify_a, prefix_b, decode_b, prompt_c = layer_inputs(layer, [9, 5, 3, 1, 40], seed=7)
    state = layer.state_spec().allocate(4, torch.float32)
    run_layer(layer, state, [(0, 0, prefix_a), (1, 0, prefix_b)])
    plain = copy.deepcopy(state)
    out = run_layer(layer, state, [(0, 9, verify_a), (1, 3, decode_b), (2, 0, prompt_c)])
    alone = [run_layer(layer, plain, [(0, 9 + t, verify_a[t : t + 1])]) for t in range(5)]
    alone.append(run_layer(layer, plain, [(1, 3, decode_b)]))
    assert torch.equal(out[:6], torch.cat(alone))
    for slot in (0, 1):
        assert torch.equal(state.ssm[slot], plain.ssm[slot])
        assert torch.equal(state.conv[slot], plain.conv[slot])


def test_rollback_replays_bitwise(fam, compiled_kernels):
    layer = packed_linear_layer(fam)
    prefix_a, prefix_b, verify_a, verify_b = layer_inputs(layer, [9, 4, 5, 8], seed=8)
    base = layer.state_spec().allocate(2, torch.float32)
    run_layer(layer, base, [(0, 0, prefix_a), (1, 0, prefix_b)])
    verified, checkpoints = copy.deepcopy(base), StateCheckpoints([0, 1])
    run_layer(layer, verified, [(0, 9, verify_a), (1, 4, verify_b)], checkpoints)
    for j, kept_b in zip(range(5), (8, 1, 3, 7, 2), strict=True):
        rolled, plain = copy.deepcopy(verified), copy.deepcopy(base)
        layer.rollback(checkpoints, rolled, {0: j + 1, 1: kept_b})
        for t in range(j + 1):
            run_layer(layer, plain, [(0, 9 + t, verify_a[t : t + 1])])
        for t in range(kept_b):
            run_layer(layer, plain, [(1, 4 + t, verify_b[t : t + 1])])
        for slot in (0, 1):
            assert torch.equal(rolled.ssm[slot], plain.ssm[slot])
            assert torch.equal(rolled.conv[slot], plain.conv[slot])
    with pytest.raises(ValueError, match="keep must be in 1..5"):
        layer.rollback(checkpoints, copy.deepcopy(verified), {0: 0})
    long = layer_inputs(layer, [RECURRENT_MAX_LEN + 1], seed=9)[0]
    with pytest.raises(ValueError, match=f"at most {RECURRENT_MAX_LEN} tokens"):
        run_layer(layer, copy.deepcopy(base), [(0, 9, long)], StateCheckpoints([0]))


def test_the_compiled_conv_is_the_torch_ops_conv_bitwise():
    """Qwen3.6's conv width (8192 channels, kernel 4), short pieces of 1, 5 and 3 tokens from random states:
    the compiled call's outputs and moved-on states are bitwise the buffer path's."""
    if kernels.ops() is None:
        pytest.skip("specserve's kernels are not built here")
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    layer = GatedDeltaNet(config, 0)
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        layer.conv1d.weight.normal_(generator=gen)
    lengths, slots = [1, 5, 3], [2, 0, 3]
    query_start = [0, 1, 6, 9]
    positions = torch.cat([torch.arange(7, 7 + n) for n in lengths])
    meta = ForwardMetadata.build(
        query_start, [7 + n for n in lengths], [[0]] * 3, positions, block_size=4096,
        state_slots=torch.tensor(slots),
    )  # fmt: skip
    layout = RecurrentLayout.build(meta, layer.kernel_size)
    mixed = torch.randn(9, layer.conv_dim, generator=gen)
    pool = torch.randn(4, layer.conv_dim, layer.kernel_size - 1, generator=gen)
    compiled_pool, torch_pool = pool.clone(), pool.clone()
    with torch.no_grad():
        compiled = layer._conv(mixed, layout, compiled_pool)
        by_ops = layer._conv(mixed, dataclasses.replace(layout, compiled=None), torch_pool)
    assert torch.equal(compiled, by_ops)
    assert torch.equal(compiled_pool, torch_pool) and torch.equal(compiled_pool[1], pool[1])
    assert not torch.equal(compiled_pool[slots], pool[slots])


def test_recurrence_is_batch_invariant_at_real_shapes():
    # Qwen3.5's 16 heads of 128 x 128 (the matmul kernels differ from the tiny models')
    gen = torch.Generator().manual_seed(9)
    b, t, h, d = 3, 4, 16, 128
    q, k = (l2norm(torch.randn(b, t, h, d, generator=gen)) for _ in range(2))
    v, state = torch.randn(b, t, h, d, generator=gen), torch.randn(b, h, d, d, generator=gen)
    decay, beta = torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    valid = torch.arange(t)[None, :] < torch.tensor([[4], [1], [3]])
    s_all, o_all, deltas = recurrent_delta_rule(state, q, k, v, decay, beta, valid)
    for i, n in enumerate((4, 1, 3)):
        replayed = state[i].clone()
        replay_delta_rule(replayed, k[i, :n], deltas[i, :n], decay[i, :n])
        assert torch.equal(replayed, s_all[i])
        s = state[i : i + 1]
        for j in range(n):
            cut = (slice(i, i + 1), slice(j, j + 1))
            s, o, _ = recurrent_delta_rule(s, q[cut], k[cut], v[cut], decay[cut], beta[cut], valid[cut])
            assert torch.equal(o[0, 0], o_all[i, j])
        assert torch.equal(s[0], s_all[i])


# --- specs, loading, errors


def test_cache_specs(fam):
    specs = fam.model.cache_specs()
    assert [type(s) for s in specs] == [RecurrentStateSpec, LayerCacheSpec, RecurrentStateSpec]
    assert specs[0] == RecurrentStateSpec(
        conv_dim=128, kernel_size=4, num_heads=4, head_k_dim=16, head_v_dim=16
    )
    assert specs[1] == LayerCacheSpec(num_kv_heads=2, head_dim=32)
    state = specs[0].allocate(3, torch.bfloat16)
    assert state.conv.shape == (3, 128, 3) and state.conv.dtype == torch.bfloat16
    assert state.ssm.shape == (3, 4, 16, 16) and state.ssm.dtype == torch.float32
    assert specs[0].bytes_per_slot(torch.bfloat16) == 128 * 3 * 2 + 4 * 16 * 16 * 4
    assert fam.model.has_recurrent_state
    dense = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    assert not build_model(dense).has_recurrent_state


def test_qwen3_5_0_8b_state_bytes():
    # Qwen3.5-0.8B's text config (model card / config.json): 24 layers, 3 of 4 linear; 16 key and 16 value
    # heads of 128 in the linear layers, conv kernel 4.
    config = transformers.Qwen3_5TextConfig(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    with torch.device("meta"):
        spec = GatedDeltaNet(config, 0).state_spec()
    linear = config.layer_types.count("linear_attention")
    assert linear == 18 and spec.conv_dim == 6144
    assert spec.bytes_per_slot(torch.bfloat16) == 6144 * 3 * 2 + 16 * 128 * 128 * 4 == 1_085_440
    assert linear * spec.bytes_per_slot(torch.bfloat16) == 19_537_920  # 18.6 MiB per sequence


def test_multimodal_wrapper_loads_the_text_model(tmp_path, caplog):
    text = _hybrid_configs()["qwen3_5"].to_dict()
    text["tie_word_embeddings"] = True  # as Qwen3.5-0.8B
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    hf = randomise(transformers.Qwen3_5ForConditionalGeneration(config).eval(), seed=10)
    hf.save_pretrained(tmp_path)
    add_tensors(tmp_path, MTP)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    with caplog.at_level(logging.INFO, logger="specserve.models.qwen3_next"):
        model, loaded_config, _ = load_model(str(tmp_path))
    assert loaded_config.model_type == "qwen3_5"
    assert [r.getMessage() for r in caplog.records if "vision" in r.getMessage()] == [
        f"ignored {sum(n.startswith('model.visual.') for n in names)} vision-tower tensors: "
        "specserve serves the text model"
    ]
    seq = random_seqs([12], seed=11)[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq])).logits[0]
    (logits,), _ = PagedHarness(model).step([(0, seq)])
    assert_close(logits, want, "qwen3_5 wrapper prefill", ("qwen3_5 wrapper", "prefill"))


def test_unknown_model_type_is_a_clear_error(tmp_path):
    config = _hybrid_configs()["qwen3_5"]
    config.model_type = "qwen3_6_text"
    with pytest.raises(ValueError, match="'qwen3_6_text' is not supported; supported: .*qwen3_5_text"):
        build_model(config)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_6"}))
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(SpecserveError, match="'qwen3_6' is unknown to the installed transformers"):
        load_model(str(tmp_path))


def test_forward_needs_state_slots(fam):
    harness = PagedHarness(fam.model)
    meta = ForwardMetadata.build([0, 3], [3], [[0]], torch.arange(3), 4)
    with pytest.raises(ValueError, match="state_slots"), torch.no_grad():
        fam.model(torch.tensor([1, 2, 3]), torch.arange(3), meta, harness.kv_caches)


def test_short_pieces_cover_verification_blocks():
    assert RECURRENT_MAX_LEN >= 17  # anchor + 16 drafts must stay on the recurrent (batch-invariant) form
