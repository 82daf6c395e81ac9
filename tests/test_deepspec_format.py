"""config.json written by `save_draft_checkpoint` against what DeepSpec (commit afdfa7c, transformers 5.10.2)
needs to load it: every field its draft modeling, evaluators and transformers classes read or assert, with
values it accepts; specserve still loads what it writes and computes the same; `markov_head_type` is read
case-insensitively, as DeepSpec does."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import SpecserveError
from specserve.models.loader import load_model
from specserve.spec_decode.deepspec.checkpoint import (
    build_draft_model,
    init_draft_weights,
    load_draft_checkpoint,
    save_draft_checkpoint,
)
from specserve.spec_decode.deepspec.config import new_draft_config, new_eagle3_config, parse_drafter_config
from specserve.spec_decode.deepspec.dspark import DenseDraftBatch, dense_block_batch
from specserve.spec_decode.deepspec.heads import GatedMarkovHead, MarkovHead, RNNMarkovHead
from tests.tiny_models import VOCAB

# Our own list of the fields DeepSpec needs, grouped by the DeepSpec file that needs them.
# deepspec/modeling/dspark/qwen3/modeling.py, eagle3/qwen3/modeling.py (the draft layers) and transformers
# 5.10.2's Qwen3Config, Qwen3MLP and Qwen3RotaryEmbedding, which those layers are built from:
QWEN3_BACKBONE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "attention_bias",
    "attention_dropout", "hidden_act", "layer_types", "max_position_embeddings",
)  # fmt: skip
# deepspec/modeling/dspark/gemma4/config.py (the text fields its builder demands), gemma4/modeling.py
# (final_logit_softcapping) and transformers 5.10.2's Gemma4TextMLP / Gemma4TextRotaryEmbedding (layer_types):
GEMMA4_BACKBONE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_global_key_value_heads", "global_head_dim", "attention_bias", "attention_dropout",
    "attention_k_eq_v", "enable_moe_block", "head_dim", "hidden_activation", "hidden_size_per_layer_input",
    "initializer_range", "max_position_embeddings", "num_key_value_heads", "num_kv_shared_layers",
    "rms_norm_eps", "rope_parameters", "use_double_wide_mlp", "final_logit_softcapping", "layer_types",
)  # fmt: skip

pytestmark = pytest.mark.kernel_agnostic
# deepspec/modeling/dspark/{qwen3,gemma4}/config.py (build_draft_config) and the same packages' modeling.py
# (the fields Qwen3DSparkModel / Gemma4DSparkModel assert or read); DFlash is the same classes at rank 0:
DSPARK_FIELDS = (
    "architectures", "model_type", "num_target_layers", "block_size", "tie_word_embeddings", "mask_token_id",
    "target_layer_ids", "num_anchors", "enable_confidence_head", "markov_rank",
)  # fmt: skip
# deepspec/modeling/eagle3/{qwen3,gemma4}/config.py and modeling.py, deepspec/eval/eagle3/evaluator.py
# (draft_num_hidden_layers):
EAGLE3_FIELDS = (
    "architectures", "model_type", "num_target_layers", "target_layer_ids", "ttt_length", "step_loss_decay",
    "draft_num_hidden_layers", "tie_word_embeddings",
)  # fmt: skip
ARCHITECTURES = {
    ("qwen3", "dspark"): "Qwen3DSparkModel",
    ("gemma4", "dspark"): "Gemma4DSparkModel",
    ("qwen3", "eagle3"): "Qwen3Eagle3Model",
    ("gemma4", "eagle3"): "Gemma4Eagle3Model",
}
MODEL_TYPES = {"qwen3": "qwen3", "gemma4": "gemma4_text"}  # eval.py reads the draft with AutoConfig
FAMILY = {"qwen2": "qwen3", "qwen3": "qwen3", "gemma4": "gemma4"}
KINDS = {
    "dspark": dict(markov_rank=8, confidence_head=True),
    "dflash": dict(markov_rank=0, confidence_head=False),
    "eagle3": {},
}
CASES = [(arch, kind) for arch in ("qwen3", "gemma4", "qwen2") for kind in KINDS]


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def deepspec_problems(config: dict, family: str, kind: str, num_target_layers: int) -> list[str]:
    """Fields DeepSpec would miss or refuse in a drafter config.json (empty: it loads)."""
    eagle3 = kind == "eagle3"
    required = (GEMMA4_BACKBONE if family == "gemma4" else QWEN3_BACKBONE) + (
        EAGLE3_FIELDS if eagle3 else DSPARK_FIELDS
    )
    missing = [f"missing {key}" for key in required if key not in config]
    if missing:
        return missing
    n, layer_types = config["num_hidden_layers"], config["layer_types"]
    checks = {
        "architectures": config["architectures"] == [ARCHITECTURES[family, "eagle3" if eagle3 else "dspark"]],
        "model_type": config["model_type"] == MODEL_TYPES[family],
        "layer_types": layer_types == ["full_attention"] * n,
        "tie_word_embeddings": config["tie_word_embeddings"] is False,
        "num_target_layers": config["num_target_layers"] == num_target_layers,
        "target_layer_ids": all(is_int(i) for i in config["target_layer_ids"]),
        "num_attention_heads": config["num_attention_heads"] % config["num_key_value_heads"] == 0,
    }
    if family == "gemma4":
        kv_heads = config["num_global_key_value_heads"] if config["attention_k_eq_v"] else None
        softcap = config["final_logit_softcapping"]
        checks |= {
            "hidden_size_per_layer_input": config["hidden_size_per_layer_input"] == 0,  # asserted
            "enable_moe_block": config["enable_moe_block"] is False,  # asserted
            "num_global_key_value_heads": kv_heads is None or config["num_attention_heads"] % kv_heads == 0,
            "final_logit_softcapping": softcap is None or softcap > 0,
            "rope_parameters": "full_attention" in config["rope_parameters"],
            "global_head_dim": is_int(config["global_head_dim"]),
        }
    if eagle3:
        checks |= {
            "draft_num_hidden_layers": config["draft_num_hidden_layers"] == 1 == n,  # eval/eagle3 asserts 1
            "ttt_length": is_int(config["ttt_length"]) and config["ttt_length"] >= 1,
            "step_loss_decay": config["step_loss_decay"] > 0,
        }
        return [f"bad {key}: {config.get(key)!r}" for key, ok in checks.items() if not ok]
    rank, confidence = config["markov_rank"], config["enable_confidence_head"]
    checks |= {
        "num_anchors": is_int(config["num_anchors"]) and config["num_anchors"] >= 1,
        "block_size": is_int(config["block_size"]) and config["block_size"] >= 1,
        "mask_token_id": is_int(config["mask_token_id"])
        and 0 <= config["mask_token_id"] < config["vocab_size"],
        "markov_rank": is_int(rank) and rank >= 0,
        "enable_confidence_head": isinstance(confidence, bool),
    }
    if rank:  # markov_head.py lower-cases it; we write it as DeepSpec's configs do
        checks["markov_head_type"] = config.get("markov_head_type") in ("vanilla", "gated", "rnn")
    if confidence:  # with the Markov features only if there is a Markov head
        with_markov = config.get("confidence_head_with_markov")
        checks["confidence_head_with_markov"] = isinstance(with_markov, bool) and (
            rank > 0 or not with_markov
        )
    return [f"bad {key}: {config.get(key)!r}" for key, ok in checks.items() if not ok]


@pytest.fixture(scope="module")
def targets(tiny_model_dir):
    return {arch: load_model(str(tiny_model_dir(arch)))[:2] for arch in ("qwen3", "gemma4", "qwen2")}


def make_drafter(targets, arch: str, kind: str, **config):
    target, target_config = targets[arch]
    if kind == "eagle3":
        draft_config = new_eagle3_config(target_config, **config)
    else:
        fields = dict(num_layers=2, block_size=4, mask_token_id=VOCAB - 1) | KINDS[kind] | config
        draft_config = new_draft_config(target_config, **fields)
    model = build_draft_model(draft_config)
    init_draft_weights(model, target, seed=0, std=0.2)
    return model


@torch.no_grad()
def outputs(model) -> list[torch.Tensor]:
    """What the drafter computes on fixed inputs: logits of its draft rows (with the Markov bias and the
    confidence logits of a DSpark drafter)."""
    g = torch.Generator().manual_seed(0)
    n = 9
    features = torch.randn(n, len(model.config.target_layer_ids) * model.config.hidden_size, generator=g)
    tokens = torch.randint(0, VOCAB - 1, (n,), generator=g)
    context = model.project_context(features)
    if model.config.architecture.endswith("Eagle3Model"):
        pos = torch.arange(n)
        batch = DenseDraftBatch(block_pos=pos, kv_pos=pos, mask=pos[None, :] <= pos[:, None])
        return [model.compute_logits(model.final_hidden(model(tokens, context, batch)))]
    B, anchors = model.config.block_size, [4, 7]
    ids = torch.tensor([[int(tokens[a])] + [model.config.mask_token_id] * (B - 1) for a in anchors]).flatten()
    h = model.backbone(model.embed(ids), context, dense_block_batch([n], [anchors], B))
    out = [model.compute_logits(h)]
    if model.markov_head is not None:
        out.append(model.markov_head.block_bias(ids.view(len(anchors), B), h.view(len(anchors), B, -1)))
    confidence = model.confidence_logits(h, ids)
    return out + ([] if confidence is None else [confidence])


@pytest.mark.parametrize("arch,kind", CASES)
def test_written_config_has_what_deepspec_needs(arch, kind, targets, tmp_path):
    model = make_drafter(targets, arch, kind)
    directory = save_draft_checkpoint(model, tmp_path / "draft")
    config = json.loads((directory / "config.json").read_text())
    num_target_layers = targets[arch][1].num_hidden_layers
    assert deepspec_problems(config, FAMILY[arch], kind, num_target_layers) == []
    if kind == "dflash":  # DeepSpec's DFlash configs carry neither key
        assert "markov_head_type" not in config and "confidence_head_with_markov" not in config


@pytest.mark.parametrize("arch,kind", CASES)
def test_specserve_loads_what_it_writes_and_computes_the_same(arch, kind, targets, tmp_path):
    """Round trip; and the fields written for DeepSpec (num_anchors; Gemma's zero per-layer-input width)
    change nothing specserve computes: a config.json without them loads to the same outputs."""
    target, target_config = targets[arch]
    model = make_drafter(targets, arch, kind)
    directory = save_draft_checkpoint(model, tmp_path / "draft")
    written = json.loads((directory / "config.json").read_text())
    reloaded = load_draft_checkpoint(str(directory), target, target_config)
    assert json.loads(json.dumps(reloaded.config.to_dict())) == written
    expected = outputs(model)
    for a, b in zip(outputs(reloaded), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    older = {k: v for k, v in written.items() if k != "num_anchors"}
    if FAMILY[arch] == "gemma4":
        older["hidden_size_per_layer_input"] = 256  # what transformers defaults to without the key
    (directory / "config.json").write_text(json.dumps(older))
    for a, b in zip(
        outputs(load_draft_checkpoint(str(directory), target, target_config)), expected, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_num_anchors_is_written_and_read(targets):
    model = make_drafter(targets, "qwen3", "dspark", num_anchors=64)
    written = model.config.to_dict()
    assert written["num_anchors"] == 64
    assert parse_drafter_config(written).num_anchors == 64
    with pytest.raises(SpecserveError, match="num_anchors"):
        parse_drafter_config(written | {"num_anchors": 0})


HEADS = {"Gated": GatedMarkovHead, "RNN": RNNMarkovHead, "Vanilla": MarkovHead}


@pytest.mark.parametrize("given", list(HEADS))
def test_markov_head_type_is_case_insensitive(given, targets, tmp_path):
    """DeepSpec lower-cases markov_head_type when it builds the head; we accept the same spellings and
    write the canonical lower-case name back."""
    target, target_config = targets["qwen3"]
    model = make_drafter(targets, "qwen3", "dspark", markov_head_type=given.lower())
    directory = save_draft_checkpoint(model, tmp_path / "draft")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"markov_head_type": given}))
    reloaded = load_draft_checkpoint(str(directory), target, target_config)
    assert reloaded.config.markov_head_type == given.lower()
    assert type(reloaded.markov_head) is type(model.markov_head) is HEADS[given]
    assert reloaded.config.to_dict()["markov_head_type"] == given.lower()
    for a, b in zip(outputs(reloaded), outputs(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = make_drafter(targets, "qwen3", "dspark", markov_head_type=given)
    assert fresh.config.to_dict()["markov_head_type"] == given.lower()
    with pytest.raises(SpecserveError, match="markov_head_type 'lstm'"):
        parse_drafter_config(config | {"markov_head_type": "lstm"})
