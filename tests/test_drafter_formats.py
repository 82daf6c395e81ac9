"""Published drafter formats (speculators, z-lab DFlash, Model-Optimizer DSpark) mapped onto specserve's
drafters: what each config.json means (layer-id offset, anchor convention, pruned vocabulary, layer
style), greedy speculation equal to plain greedy on dense, Gemma 4 and hybrid targets, the 1+N infill
convention pinned against a direct computation, and malformed checkpoints refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams, SpecserveError
from specserve.models.loader import load_model
from specserve.spec_decode.deepspec.config import DSparkConfig, Eagle3Config
from specserve.spec_decode.deepspec.dspark import dense_block_batch
from specserve.spec_decode.formats import parse_checkpoint_config
from tests.drafter_formats import speculators_config, write_drafter, zlab_config
from tests.test_speculative import repetitive_prompts

# z-lab's DFlash2 fields, with a logit multiplier and softcap as a Gemma-style draft head has.
ZLAB_DFLASH2 = {
    "conv_kernel_size": 3,
    "conv_group_size": 8,
    "selector_rank": 8,
    "selector_top_k": 5,
    "output_multiplier": 0.5,
    "final_logit_softcapping": 20.0,
}
KEPT = [0, 1, 2, *range(3, 256, 2)]  # a pruned draft vocabulary: the special ids and every other token


def _formats(target_config) -> dict[str, tuple[dict, dict]]:
    """name -> (config.json, write_drafter options)."""
    v = target_config.vocab_size
    return {
        "speculators_dflash": (
            speculators_config(target_config, "dflash", tokens=3),
            {"drop": ("embed_tokens.weight",)},
        ),
        "speculators_dspark_pruned": (
            speculators_config(target_config, "dspark", tokens=4, draft_vocab_size=len(KEPT)),
            {"drop": ("embed_tokens.weight",), "kept_ids": KEPT},
        ),
        "speculators_dspark_infill_rnn": (
            speculators_config(
                target_config, "dspark", tokens=3, sample_from_anchor=False, markov_head_type="rnn"
            ),
            {"drop": ("embed_tokens.weight", "lm_head.weight")},
        ),
        "speculators_eagle3_llama": (
            speculators_config(target_config, "eagle3", tokens=3, llama=True, norm_before_residual=True),
            {"drop": ("embed_tokens.weight",)},
        ),
        "speculators_eagle3_qwen3_pruned": (
            speculators_config(target_config, "eagle3", tokens=3, draft_vocab_size=len(KEPT)),
            {"kept_ids": KEPT},
        ),
        "zlab_dflash": (zlab_config(target_config), {"drop": ("embed_tokens.weight", "lm_head.weight")}),
        "modelopt_dspark_gated": (
            zlab_config(
                target_config,
                modelopt={"markov_rank": 8, "markov_head_type": "gated", "use_confidence_head": True},
            ),
            {"drop": ("embed_tokens.weight", "lm_head.weight")},
        ),
        "speculators_dflash2": (
            speculators_config(target_config, "dflash2", tokens=3),
            {"drop": ("embed_tokens.weight", "lm_head.weight")},
        ),
        "zlab_dflash2": (
            zlab_config(target_config, dflash2=ZLAB_DFLASH2),
            {"drop": ("embed_tokens.weight", "lm_head.weight")},
        ),
        "zlab_dflash_block_in_dflash_config": (
            {
                **{k: val for k, val in zlab_config(target_config).items() if k != "block_size"},
                "dflash_config": {"mask_token_id": v - 1, "target_layer_ids": [1], "block_size": 3},
            },
            {"drop": ("embed_tokens.weight", "lm_head.weight")},
        ),
    }


BROAD = ("speculators_dspark_pruned", "speculators_eagle3_llama", "zlab_dflash", "zlab_dflash2")
FORMATS = [
    "speculators_dflash",
    "speculators_dspark_pruned",
    "speculators_dspark_infill_rnn",
    "speculators_eagle3_llama",
    "speculators_eagle3_qwen3_pruned",
    "zlab_dflash",
    "modelopt_dspark_gated",
    "zlab_dflash_block_in_dflash_config",
    "speculators_dflash2",
    "zlab_dflash2",
]


def _method(name: str) -> str:
    return "eagle3" if "eagle3" in name else "dspark" if "dspark" in name else "dflash"  # DFlash2: dflash


@pytest.fixture(scope="module")
def format_dirs(tmp_path_factory, tiny_model_dir):
    made = {}

    def get(arch: str, name: str) -> str:
        if (arch, name) not in made:
            target_dir = tiny_model_dir(arch)
            _, target_config, _ = load_model(str(target_dir))
            raw, options = _formats(target_config)[name]
            made[arch, name] = str(write_drafter(target_dir, tmp_path_factory.mktemp(name), raw, **options))
        return made[arch, name]

    return get


def test_what_each_format_means(tiny_model_dir):
    _, target_config, _ = load_model(str(tiny_model_dir("qwen3")))
    configs = {
        name: parse_checkpoint_config(raw, target_config).config
        for name, (raw, _) in _formats(target_config).items()
    }
    # speculators' ids are vLLM capture ids, one more than DeepSpec's and z-lab's.
    assert configs["speculators_dflash"].target_layer_ids == [0, 1]
    assert configs["zlab_dflash"].target_layer_ids == [0, 1]
    assert configs["speculators_eagle3_llama"].target_layer_ids == [0, 1]
    dflash, infill, pruned = (
        configs[k]
        for k in ("speculators_dflash", "speculators_dspark_infill_rnn", "speculators_dspark_pruned")
    )
    assert isinstance(dflash, DSparkConfig) and not dflash.sample_from_anchor and dflash.max_drafts == 3
    assert not dflash.markov_rank and not dflash.confidence_head
    assert pruned.sample_from_anchor and pruned.max_drafts == 4 and pruned.draft_vocab_size == len(KEPT)
    assert infill.markov_head_type == "rnn" and infill.first_draft_slot == 1
    llama = configs["speculators_eagle3_llama"]
    assert isinstance(llama, Eagle3Config) and not llama.qk_norm and llama.norm_before_residual
    assert llama.ttt_length == 3
    assert configs["speculators_eagle3_qwen3_pruned"].qk_norm
    zlab = configs["zlab_dflash"]
    assert (
        zlab.block_size == 4 and zlab.max_drafts == 3 and zlab.mask_token_id == target_config.vocab_size - 1
    )
    modelopt = configs["modelopt_dspark_gated"]
    assert modelopt.sample_from_anchor and modelopt.markov_head_type == "gated"
    assert modelopt.confidence_head and modelopt.confidence_with_markov
    assert configs["zlab_dflash_block_in_dflash_config"].block_size == 3
    dflash2 = configs["zlab_dflash2"]
    assert (dflash2.conv_kernel_size, dflash2.conv_group_size, dflash2.selector_rank) == (3, 8, 8)
    assert dflash2.selector_top_k == 5 and dflash2.max_drafts == 3
    assert dflash2.logit_scale == 0.5 and dflash2.logit_softcap == 20.0
    assert (
        configs["speculators_dflash2"].selector_top_k == 6
        and not configs["speculators_dflash2"].sample_from_anchor
    )


# Every format on the dense Qwen3 target; on Gemma 4 and the hybrid Qwen3.5 one of each layout (the rest
# in the slow tier).
GREEDY_CASES = [
    pytest.param(arch, name, marks=[] if arch == "qwen3" or name in BROAD else [pytest.mark.slow])
    for arch in ("qwen3", "gemma4", "qwen3_5")
    for name in FORMATS
]


@pytest.mark.parametrize("arch, name", GREEDY_CASES)
def test_greedy_speculation_equals_greedy_decoding(arch, name, tiny_model_dir, format_dirs, plain_greedy):
    prompts, expected = plain_greedy(arch)
    llm = LLM(
        str(tiny_model_dir(arch)),
        max_model_len=128,
        speculative_config={"method": _method(name), "model": format_dirs(arch, name)},
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0


@pytest.fixture(scope="module")
def plain_greedy(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            prompts = repetitive_prompts(4, seed=2)
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            outs = LLM(str(tiny_model_dir(arch)), max_model_len=128).generate(prompts, params)
            cache[arch] = prompts, [o.outputs[0].token_ids for o in outs]
        return cache[arch]

    return get


def observed_drafter(directory: str, target_dir, tokens: list[int], num_context: int):
    """The engine's drafter for a checkpoint, handed random target features of positions < num_context."""
    from specserve.config import SpeculativeConfig
    from specserve.spec_decode.drafters import build_drafter
    from tests.test_dspark import bound, fake_target, sequence

    target, target_config, _ = load_model(str(target_dir))
    context = fake_target()
    context = type(context)(**{**context.__dict__, "model": target, "model_config": target_config})
    drafter = bound(build_drafter(SpeculativeConfig(method="dspark", model=directory), context))
    width = drafter.feature_width
    features = torch.randn(num_context, width, generator=torch.Generator().manual_seed(3))
    seq = sequence("r", tokens[: num_context + 1])
    drafter.observe(seq, 0, features)
    return drafter, seq, features


@pytest.mark.parametrize("name", ["zlab_dflash", "speculators_dspark_pruned", "zlab_dflash2"])
def test_drafts_come_from_the_slots_the_convention_says(name, tiny_model_dir, format_dirs):
    """1+N infill (z-lab): draft i is slot i's argmax (slot 0 holds the anchor); anchor-first (DeepSpec,
    speculators' DSpark): draft i is slot i-1's. A pruned vocabulary maps draft ids to target ids."""
    target_dir = tiny_model_dir("qwen3")
    tokens = torch.randint(3, 255, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    drafter, seq, features = observed_drafter(format_dirs("qwen3", name), target_dir, tokens, 9)
    model, a, block = drafter.model, 9, drafter.block_size
    with torch.no_grad():
        (proposal,) = drafter.propose([seq], drafter.max_drafts)
        batch = dense_block_batch([a], [[a]], block)
        ids = torch.tensor([tokens[a]] + [model.config.mask_token_id] * (block - 1))
        h = model.backbone(model.embed(ids), model.project_context(features), batch)
        slots = h[drafter.first_slot :]
        if model.candidate_selector is not None:  # DFlash2: a greedy walk over each slot's top-k
            logits, prev = [], torch.tensor([tokens[a]])
            for row in slots:
                unary = model.compute_logits(row[None])
                candidates = unary.topk(model.config.selector_top_k).indices
                scores = model.candidate_selector.candidate_scores(unary, row[None], prev, candidates)
                step = torch.full_like(unary, float("-inf")).scatter(-1, candidates, scores)
                prev = step.argmax(-1)
                logits.append(step[0])
            logits = torch.stack(logits)
        elif model.markov_head is None:
            logits = model.compute_logits(slots)
        else:  # greedy through the Markov head, the previous token first the anchor
            logits, prev = [], torch.tensor([tokens[a]])
            for row in slots:
                step = model.compute_logits(row[None]) + model.markov_head.step(prev, row[None], None)[0]
                prev = (
                    model.d2t[step.argmax(-1)] + step.argmax(-1) if model.d2t is not None else step.argmax(-1)
                )
                logits.append(step[0])
            logits = torch.stack(logits)
    expected = logits.argmax(-1)
    if model.d2t is not None:
        expected = expected + model.d2t[expected]
        assert set(proposal.token_ids) <= set(KEPT)
    assert drafter.first_slot == (0 if name == "speculators_dspark_pruned" else 1)
    assert proposal.token_ids == expected.tolist()
    assert len(proposal.token_ids) == block - drafter.first_slot


def _broken(raw: dict, change: dict) -> dict:
    out = json.loads(json.dumps(raw))
    for key, value in change.items():
        where, _, leaf = key.rpartition(".")
        node = out[where] if where else out
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


MALFORMED = {
    "unknown speculators type": (
        "speculators_dflash",
        {"speculators_model_type": "medusa9"},
        "speculators_model_type",
    ),
    "peagle": ("speculators_dflash", {"speculators_model_type": "peagle"}, "speculators_model_type 'peagle'"),
    "no mask token": ("speculators_dflash", {"mask_token_id": None}, "mask_token_id"),
    "no aux layers": (
        "speculators_dflash",
        {"aux_hidden_state_layer_ids": None},
        "aux_hidden_state_layer_ids",
    ),
    "hidden size": ("speculators_dflash", {"transformer_layer_config.hidden_size": 32}, "hidden_size is 32"),
    "vocab size": ("speculators_dflash", {"transformer_layer_config.vocab_size": 300}, "vocab_size is 300"),
    "target hidden size": ("speculators_dflash", {"target_hidden_size": 128}, "target_hidden_size"),
    "draft vocab too big": ("speculators_dflash", {"draft_vocab_size": 9999}, "draft_vocab_size"),
    "causal sliding": (
        "speculators_dflash",
        {
            "transformer_layer_config.layer_types": ["sliding_attention"],
            "transformer_layer_config.sliding_window": 8,
        },
        "sliding_window_non_causal",
    ),
    "eagle3 layers": (
        "speculators_eagle3_llama",
        {"transformer_layer_config.num_hidden_layers": 2},
        "num_hidden_layers",
    ),
    "eagle3 fc norm": ("speculators_eagle3_llama", {"fc_norm": True}, "fc_norm"),
    "layer out of range": ("speculators_dflash", {"aux_hidden_state_layer_ids": [1, 3]}, "target_layer_ids"),
    "projector": ("zlab_dflash", {"dflash_config.projector_type": "domino"}, "dflash_config.projector_type"),
    "zlab no block size": ("zlab_dflash", {"block_size": None}, "block_size"),
    "zlab mask": ("zlab_dflash", {"dflash_config.mask_token_id": None}, "dflash_config.mask_token_id"),
    "zlab target layers": ("zlab_dflash", {"num_target_layers": 7}, "num_target_layers is 7"),
    "modelopt rank": ("modelopt_dspark_gated", {"dflash_config.markov_rank": 0}, "dflash_config.markov_rank"),
    "dflash2 fields": (
        "zlab_dflash",
        {"architectures": ["DFlash2DraftModel"]},
        "dflash_config.conv_kernel_size",
    ),
    "dflash2 taps": ("zlab_dflash2", {"dflash_config.conv_kernel_size": 9}, "conv_kernel_size 9"),
    "dflash2 groups": ("speculators_dflash2", {"conv_group_size": 7}, "conv_group_size 7"),
    "dflash2 top k": ("speculators_dflash2", {"selector_top_k": 999}, "selector_top_k 999"),
    "dflash2 pruned": ("speculators_dflash2", {"draft_vocab_size": 100}, "full vocabulary"),
    "neither": (
        "zlab_dflash",
        {"dflash_config": None, "architectures": ["LlamaForCausalLM"]},
        "not a drafter",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoints_are_refused_naming_the_field(case, tiny_model_dir, format_dirs, tmp_path):
    name, change, match = MALFORMED[case]
    good = format_dirs("qwen3", name)
    raw = _broken(json.loads((Path(good) / "config.json").read_text()), change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(f"{good}/model.safetensors")
    with pytest.raises(SpecserveError, match=match):
        LLM(
            str(tiny_model_dir("qwen3")),
            max_model_len=64,
            speculative_config={"method": _method(name), "model": str(tmp_path)},
        )


@pytest.mark.parametrize(
    "name, tensors, match",
    [
        ("speculators_dspark_pruned", {"fc.weight": None}, "missing tensors: fc.weight"),
        ("speculators_dspark_pruned", {"lm_head.weight": None}, "missing tensors: lm_head.weight"),
        ("speculators_dspark_pruned", {"d2t": lambda t: t.flip(0)}, "d2t and t2d disagree"),
        ("zlab_dflash", {"layers.0.mlp.up_proj.weight": lambda t: t[:-1]}, "layers.0.mlp.up_proj.weight"),
        ("zlab_dflash", {"extra.weight": lambda t: torch.zeros(2)}, "unexpected tensor 'extra.weight'"),
    ],
)
def test_bad_tensors_are_refused(name, tensors, match, tiny_model_dir, format_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    good = format_dirs("qwen3", name)
    state = load_file(f"{good}/model.safetensors")
    for key, change in tensors.items():
        if change is None:
            state.pop(key)
        else:
            state[key] = change(state.get(key, torch.zeros(1))).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(good) / "config.json").read_text())
    with pytest.raises(SpecserveError, match=match):
        LLM(
            str(tiny_model_dir("qwen3")),
            max_model_len=64,
            speculative_config={"method": _method(name), "model": str(tmp_path)},
        )


def _speculators_reference(kind: str, raw: dict, directory: Path, target):
    """The speculators package's own model class for `raw`, random, saved by its save_pretrained (which
    leaves out the verifier's embedding and LM head: they are set to the target's, as its
    load_verifier_weights does); the test is skipped where the package cannot be imported."""
    core = pytest.importorskip(f"speculators.models.{kind}.core")
    from speculators import SpeculatorModelConfig

    raw = json.loads(json.dumps(raw))
    raw["speculators_config"]["verifier"]["name_or_path"] = None
    raw["transformer_layer_config"]["_attn_implementation"] = "eager"
    config = SpeculatorModelConfig.from_dict(raw)
    model_class = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3", "dflash2": "DFlash2"}[kind]
    model = getattr(core, model_class + "DraftModel")(config).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            scale = 0.3 if param.dim() == 1 else 0.2
            param.copy_(
                torch.randn(param.shape, generator=generator) * scale + (1.0 if param.dim() == 1 else 0)
            )
        model.embed_tokens.weight.copy_(target.input_embedding().weight)
        model.lm_head.weight.copy_(target.output_layer().weight)
    model.save_pretrained(directory)
    return model


def _blocks_against_reference(reference, ours, monkeypatch, seed: int):
    """Both drafters' backbones over blocks at fixed anchors of one random 14-token packed sequence: its
    ids, the anchors, the reference's hidden states and logits, and ours' hidden states."""
    seq_len, anchors = 14, [2, 5, 9]
    dflash_core = __import__("speculators.models.dflash.core", fromlist=["x"])
    fixed = (torch.tensor(anchors), torch.ones(len(anchors), dtype=torch.bool))
    monkeypatch.setattr(dflash_core, "select_anchors", lambda *args: fixed)
    g = torch.Generator().manual_seed(seed)
    width = len(ours.config.target_layer_ids) * ours.config.hidden_size
    features = torch.randn(1, seq_len, width, generator=g)
    ids = torch.randint(3, 250, (1, seq_len), generator=g)
    with torch.no_grad():
        hidden, logits, *_ = reference._backbone_forward(
            features,
            ids,
            torch.ones(1, seq_len),
            torch.randn(1, seq_len, ours.config.hidden_size),
            torch.zeros(1, seq_len, dtype=torch.long),
            max_anchors=len(anchors),
        )
        block = ours.config.block_size
        batch = dense_block_batch([seq_len], [anchors], block)
        block_ids = torch.tensor(
            [[ids[0, a].item()] + [ours.config.mask_token_id] * (block - 1) for a in anchors]
        )
        h = ours.backbone(ours.embed(block_ids.flatten()), ours.project_context(features[0]), batch)
    return ids, anchors, hidden, logits, h


@pytest.mark.parametrize("kind, sample_from_anchor", [("dspark", True), ("dspark", False), ("dflash", False)])
def test_block_drafter_logits_match_the_speculators_package(
    kind, sample_from_anchor, tiny_model_dir, tmp_path, monkeypatch
):
    """Reference check (runs where the `speculators` package imports): speculators' own DFlash / DSpark
    classes, saved by its save_pretrained, load in specserve and give the same draft logits (<= 1e-4),
    Markov bias included, over blocks at fixed anchors of a packed sequence."""
    target_dir = tiny_model_dir("qwen3")
    target, target_config, _ = load_model(str(target_dir))
    raw = speculators_config(
        target_config, kind, tokens=4 if sample_from_anchor else 3, sample_from_anchor=sample_from_anchor
    )
    if kind == "dspark":
        raw["markov_head_type"] = "rnn"
    reference = _speculators_reference(kind, raw, tmp_path, target)
    from specserve.spec_decode.deepspec.checkpoint import load_draft_checkpoint

    ours = load_draft_checkpoint(str(tmp_path), target, target_config)
    core = __import__(f"speculators.models.{kind}.core", fromlist=["x"])
    ids, anchors, hidden, logits, h = _blocks_against_reference(reference, ours, monkeypatch, seed=6)
    block = ours.config.block_size
    with torch.no_grad():
        mine = ours.compute_logits(h)
        torch.testing.assert_close(mine, logits[0].float(), atol=1e-4, rtol=1e-4)
        if kind == "dspark":
            tokens = ids[0, torch.tensor(anchors)[:, None] + torch.arange(block)]
            prev = tokens if sample_from_anchor else torch.cat([tokens[:, :1], tokens[:, :-1]], 1)
            expected = reference.markov_head.block_bias(
                prev_token_ids=prev, hidden_states=hidden.view(len(anchors), block, -1)
            )
            torch.testing.assert_close(
                ours.markov_head.block_bias(prev, h.view(len(anchors), block, -1)),
                expected,
                atol=1e-4,
                rtol=1e-4,
            )
    assert core is not None


def test_eagle3_logits_match_the_speculators_package(tiny_model_dir, tmp_path):
    """Reference check: speculators' Llama-layer EAGLE-3 (norm_before_residual) against specserve's, one
    TTT step over a sequence: logits <= 1e-4."""
    target_dir = tiny_model_dir("qwen3")
    target, target_config, _ = load_model(str(target_dir))
    raw = speculators_config(target_config, "eagle3", tokens=3, llama=True, norm_before_residual=True)
    reference = _speculators_reference("eagle3", raw, tmp_path, target)
    from specserve.spec_decode.deepspec.checkpoint import load_draft_checkpoint
    from tests.test_dspark import causal_batch

    ours = load_draft_checkpoint(str(tmp_path), target, target_config)
    g = torch.Generator().manual_seed(7)
    seq_len = 10
    width = len(ours.config.target_layer_ids) * ours.config.hidden_size
    features = torch.randn(1, seq_len, width, generator=g)
    ids = torch.randint(3, 250, (1, seq_len), generator=g)
    captured = []
    reference.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        reference(features, ids, torch.zeros(1, seq_len, dtype=torch.long), ttt_steps=1)
        out = ours(ids[0], ours.project_context(features[0]), causal_batch(torch.arange(seq_len)))
        mine = ours.compute_logits(ours.final_hidden(out))
    torch.testing.assert_close(mine, captured[0][0].float(), atol=1e-4, rtol=1e-4)


def test_the_dflash2_selector_walks_from_the_anchor(tiny_model_dir, format_dirs):
    """Each slot's q is the selector's softmax over its unary top-k (0 elsewhere), scored against the
    token drafted at the slot before: the anchor for the first draft."""
    target_dir = tiny_model_dir("qwen3")
    tokens = torch.randint(3, 255, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    drafter, seq, features = observed_drafter(format_dirs("qwen3", "zlab_dflash2"), target_dir, tokens, 9)
    seq.params.temperature = 1.0
    model = drafter.model
    with torch.no_grad():
        (proposal,) = drafter.propose([seq], 3)
        batch = dense_block_batch([9], [[9]], drafter.block_size)
        ids = torch.tensor([tokens[9]] + [model.config.mask_token_id] * (drafter.block_size - 1))
        h = model.backbone(model.embed(ids), model.project_context(features), batch)[1:]
        prev = [tokens[9], *proposal.token_ids[:-1]]
        for i in range(3):
            unary = model.compute_logits(h[i : i + 1])
            candidates = unary.topk(5).indices[0]
            q = proposal.probs[i]
            assert set(q.nonzero().flatten().tolist()) == set(candidates.tolist())
            scores = model.candidate_selector.candidate_scores(
                unary, h[i : i + 1], torch.tensor([prev[i]]), candidates[None]
            )
            torch.testing.assert_close(q[candidates], scores[0].softmax(-1), atol=1e-5, rtol=1e-4)


def test_dflash2_logits_match_the_speculators_package(tiny_model_dir, tmp_path, monkeypatch):
    """Reference check: speculators' DFlash2 class (convolutions, selector), saved by its save_pretrained,
    gives the same unary logits and candidate scores in specserve (<= 1e-4)."""
    target_dir = tiny_model_dir("qwen3")
    target, target_config, _ = load_model(str(target_dir))
    raw = speculators_config(target_config, "dflash2", tokens=3)
    reference = _speculators_reference("dflash2", raw, tmp_path, target)
    from specserve.spec_decode.deepspec.checkpoint import load_draft_checkpoint

    ours = load_draft_checkpoint(str(tmp_path), target, target_config)
    ids, anchors, hidden, logits, h = _blocks_against_reference(reference, ours, monkeypatch, seed=9)
    block = ours.config.block_size
    with torch.no_grad():
        unary = ours.compute_logits(h)
        torch.testing.assert_close(unary, logits[0].float(), atol=1e-4, rtol=1e-4)
        prev = ids[0, torch.tensor(anchors)[:, None] + torch.arange(block)]
        prev = torch.cat([prev[:, :1], prev[:, :-1]], 1).flatten()
        candidates = unary.topk(ours.config.selector_top_k).indices
        expected = reference.candidate_selector.score_candidates(logits[0], hidden[0], prev, candidates)
        mine = ours.candidate_selector.candidate_scores(unary, h, prev, candidates)
        torch.testing.assert_close(mine, expected.float(), atol=1e-4, rtol=1e-4)


def test_a_grammar_that_allows_none_of_a_narrowed_support_leaves_q_a_distribution():
    """A drafter that can propose only tokens 3 and 4 under a grammar that allows only 5: q stays the
    drafter's own distribution (its draft will be rejected), never a row of NaNs."""
    from types import SimpleNamespace

    from specserve.core.sequence import Sequence
    from specserve.spec_decode.drafters.base import sample_drafts

    allow_5 = torch.zeros(1, 8, dtype=torch.int32)
    allow_5[0, 0] = 1 << 5
    seq = Sequence("r", [1, 2], SamplingParams(temperature=1.0), 64)
    seq.grammar = SimpleNamespace(mask_after=lambda tokens: allow_5[0])
    logits = torch.full((1, 256), float("-inf"))
    logits[0, 3], logits[0, 4] = 1.0, 2.0
    q, tokens, _ = sample_drafts(logits, [seq], [[]], 256, torch.Generator().manual_seed(0))
    assert torch.isfinite(q).all() and abs(float(q.sum()) - 1.0) < 1e-6
    assert tokens[0] in (3, 4) and set(q[0].nonzero().flatten().tolist()) == {3, 4}
