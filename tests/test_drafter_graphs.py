"""The drafters' forwards through static buffers (spec_decode/drafters/graphs.py) on the CPU, eagerly: every
draft forward a bucket holds, padded to it (the padding rows on the draft cache's scratch block), gives
bitwise the plain forward's outputs, hence the same drafts, q rows and confidences, and the same cache
writes; in the engine, greedy speculation through them equals greedy decoding. The capture and replay
themselves are in the GPU tier (the tests marked gpu here, skipped without CUDA)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.cache_coordinator import DrafterCaches
from specserve.core.sequence import Sequence
from specserve.models.loader import load_model
from specserve.models.prepare import prepare_model
from specserve.platform import Platform, resolve_platform
from specserve.spec_decode.drafters import graphs as drafter_graphs
from specserve.spec_decode.drafters.draft_model import DraftModelDrafter
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.spec_decode.drafters.graphs import draft_graph_config
from specserve.worker.cuda_graphs import GraphConfig
from tests.test_cuda_graphs import bitwise, close_in_bf16
from tests.test_dspark import fake_target, make_drafter_model, make_eagle3_model, targets  # noqa: F401
from tests.test_speculative import drafter_dirs, repetitive_prompts, target_dir  # noqa: F401
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.kernel_agnostic

BLOCK = 4  # the draft caches' block size
NUM_BLOCKS = 64
STATIC = GraphConfig(max_tokens=16, max_pieces=4, max_blocks=16, capture=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LENGTH = 40  # tokens (and target features) of each request
# Rounds: request -> its anchor (the position of its newest token). The first round's contexts (21 rows)
# are more than the largest bucket (16) holds: eager; then pieces and context rows of several buckets.
ROUNDS = [
    {0: 12, 1: 9},
    {0: 14, 1: 10, 2: 5},
    {0: 15},
    {0: 18, 1: 13},
    {0: 19, 1: 14, 2: 7, 3: 3},
]


class DrafterPair:
    """Two drafters over one network, one plain and one through the static buffers (or graphs), fed the
    same rounds: each forward's outputs, the proposals and the draft cache are compared with `same`."""

    def __init__(self, make, graphs=STATIC, same=bitwise):
        self.plain, self.static = make(), make()
        self.plain.graph_config, self.static.graph_config = None, graphs
        self.same = same
        self.forwards = {}
        for name, drafter in (("plain", self.plain), ("static", self.static)):
            spec = drafter.cache_spec(BLOCK)
            drafter.bind_caches(DrafterCaches.standalone(spec, NUM_BLOCKS, BLOCK, max_num_seqs=4))
            self.forwards[name] = self._record(drafter)
        g = torch.Generator().manual_seed(0)
        self.tokens = [torch.randint(3, VOCAB - 1, (LENGTH,), generator=g).tolist() for _ in range(4)]
        self.features = None
        self.fed = [0] * 4

    def _record(self, drafter) -> list[torch.Tensor]:
        """Every draft forward's outputs, in order."""
        outputs = []
        if isinstance(drafter, DraftModelDrafter):
            runner, real = drafter.runner, drafter.runner.forward

            def forward(*args, **kwargs):
                out = real(*args, **kwargs)
                outputs.extend([out.logits, out.hidden])
                return out

            runner.forward = forward
        else:
            real = drafter.run_forward

            def run_forward(*args, **kwargs):
                outputs.append(real(*args, **kwargs))
                return outputs[-1]

            drafter.run_forward = run_forward
        return outputs

    @property
    def steps(self):
        """The static drafter's buffers: (the query rows' bucket, the K/V-only rows') used so far."""
        graphs = (
            self.static.runner.graphs if isinstance(self.static, DraftModelDrafter) else self.static.graphs
        )
        return graphs

    def round(self, anchors: dict[int, int], num_tokens: int, keys: set) -> None:
        """Each request of `anchors` proposes with its newest token at that position (after observing
        the target features of the positions before it); `keys`: the buffers' keys used afterwards."""
        seqs = []
        params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
        for r, a in anchors.items():
            tokens = self.tokens[r][: a + 1]
            seq = Sequence(f"r{r}", tokens[:1], params, 64, output_token_ids=tokens[1:])
            if self.features is not None:
                for drafter in (self.plain, self.static):
                    drafter.observe(seq, self.fed[r], self.features[r][self.fed[r] : a])
            self.fed[r] = a
            seqs.append(seq)
        static = self.static.propose(seqs, num_tokens)
        plain = self.plain.propose(seqs, num_tokens)
        if keys is not None:
            assert set(self.steps._inputs) == keys
        assert len(self.forwards["static"]) == len(self.forwards["plain"])
        for a, b in zip(self.forwards["static"], self.forwards["plain"]):
            self.same(a, b)
        for outputs in self.forwards.values():
            outputs.clear()
        for s, p in zip(static, plain, strict=True):
            if self.same is not bitwise:  # (drafts sampled from probabilities a little apart may part)
                break
            assert s.token_ids == p.token_ids
            self.same(s.probs, p.probs)
            self.same(s.confidences, p.confidences)
        self.same_caches()

    def same_caches(self) -> None:
        if isinstance(self.plain, DraftModelDrafter):
            pairs = zip(self.plain.runner.kv_caches, self.static.runner.kv_caches, strict=True)
        else:
            pairs = zip(self.plain.caches, self.static.caches, strict=True)
        for a, b in pairs:  # the scratch block aside
            self.same(b.k[: a.k.shape[0]], a.k)
            self.same(b.v[: a.v.shape[0]], a.v)


def hidden_state_pair(model, drafter_type, **kwargs) -> DrafterPair:
    """The drafter's network prepared as the engine loads it (`HiddenStateDrafter.load`: on the CPU, its
    linears packed)."""
    prepare_model(model, None)
    pair = DrafterPair(lambda: drafter_type(model, fake_target(BLOCK), **kwargs))
    g = torch.Generator().manual_seed(1)
    pair.features = [torch.randn(LENGTH, pair.plain.feature_width, generator=g) for _ in range(4)]
    return pair


@pytest.mark.parametrize(
    "config", [{}, {"markov_rank": 0, "confidence_head": False}], ids=["dspark", "dflash"]
)
def test_dspark_rounds_through_static_buffers_equal_the_plain_drafter_bitwise(targets, config):  # noqa: F811
    """A round's block rows (4 per request) are the query rows and its new context rows only write K/V:
    both padded, each to its own bucket."""
    pair = hidden_state_pair(make_drafter_model(targets, **config), DSparkDrafter)
    pair.round(ROUNDS[0], 3, set())  # 21 context rows: eager
    pair.round(ROUNDS[1], 3, {(16, 8)})  # 12 block rows, 2 + 1 + 5 context rows
    pair.round(ROUNDS[2], 2, {(16, 8), (4, 1)})
    pair.round(ROUNDS[3], 3, {(16, 8), (4, 1), (8, 8)})  # 3 + 3 context rows
    pair.round(ROUNDS[4], 3, {(16, 8), (4, 1), (8, 8)})  # 4 requests, 7 context rows: (16, 8) again


def test_eagle3_steps_through_static_buffers_equal_the_plain_drafter_bitwise(targets):  # noqa: F811
    """EAGLE-3's first forward (each request's pending rows) and its steps (a row per request)."""
    pair = hidden_state_pair(make_eagle3_model(targets), Eagle3Drafter, max_num_tokens=3)
    pair.round(ROUNDS[0], 3, {(2, 0)})  # the pending rows (21): eager; two steps of 2 rows
    pair.round(ROUNDS[1], 3, {(2, 0), (8, 0), (4, 0)})  # 2 + 1 + 5 pending rows, then 3 rows a step
    pair.round(ROUNDS[2], 2, {(2, 0), (8, 0), (4, 0), (1, 0)})
    pair.round(ROUNDS[4], 3, {(2, 0), (8, 0), (4, 0), (1, 0), (16, 0)})  # 5 + 4 + 2 + 3 pending: 14


def draft_model_pair(tiny_model_dir, **kwargs) -> DrafterPair:
    model, _, _ = load_model(str(tiny_model_dir("qwen2")), **kwargs)
    return DrafterPair(lambda: DraftModelDrafter(model, fake_target(BLOCK)))


def test_draft_model_steps_through_static_buffers_equal_the_plain_drafter_bitwise(tiny_model_dir):
    """The draft model's runner takes the target's static path: its first forward of a round feeds
    what it has not seen (a whole prompt: eager), then a row per request."""
    pair = draft_model_pair(tiny_model_dir)
    pair.round(ROUNDS[0], 3, {(2, 0)})  # prompts of 13 and 10 tokens: 23 rows, eager
    pair.round(ROUNDS[1], 3, {(2, 0), (16, 0), (4, 0)})  # 2 + 1 + 6 new tokens: 9 rows, then 3 a step
    pair.round(ROUNDS[3], 3, {(2, 0), (16, 0), (4, 0), (8, 0)})


def test_which_drafters_may_capture(tiny_model_dir, targets):  # noqa: F811
    """graph_config's policy: the platform, enforce_eager, and a network with no host loop."""
    cuda = Platform(torch.device("cuda"), "fla")  # a description: nothing is placed on it here
    dspark = make_drafter_model(targets)
    on_cuda = replace(fake_target(BLOCK), platform=cuda)
    config = draft_graph_config(on_cuda, dspark)
    assert config == GraphConfig(max_tokens=128, max_pieces=4, max_blocks=136, capture=True)
    assert draft_graph_config(replace(on_cuda, enforce_eager=True), dspark) is None
    assert draft_graph_config(fake_target(BLOCK), dspark) is None
    moe = load_model(str(tiny_model_dir("qwen3_moe")))[0]
    assert draft_graph_config(on_cuda, moe) is None  # its experts loop on the host


def static_drafter_forwards(monkeypatch) -> None:
    """Drafters built by the engine take the static path on the CPU, eagerly: the config CUDA would give
    them, without capture. The target's steps stay as they are."""
    real, cuda = drafter_graphs.graph_config, Platform(torch.device("cuda"), "fla")

    def static(platform, enforce_eager, model, *limits):
        config = real(cuda, enforce_eager, model, *limits)
        return config and replace(config, capture=False)

    monkeypatch.setattr(drafter_graphs, "graph_config", static)


@pytest.fixture(scope="module")
def greedy(target_dir):  # noqa: F811
    """Prompts and the target's plain greedy outputs for them."""
    prompts = repetitive_prompts(4, seed=1)
    outs = LLM(target_dir, max_model_len=128).generate(prompts, GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["dspark", "eagle3", "draft_model"])
def test_greedy_speculation_through_static_drafter_buffers_equals_greedy_decoding(
    method,
    greedy,
    target_dir,  # noqa: F811
    drafter_dirs,  # noqa: F811
    monkeypatch,
):
    prompts, expected = greedy
    # The vanilla DSpark drafter (a planted bigram) and the target as its own draft model get drafts
    # accepted, so that rounds feed several rows; the random EAGLE-3 drafter's are rejected.
    spec = {
        "dspark": {"method": "dspark", "model": drafter_dirs("qwen3", "vanilla")},
        "eagle3": {"method": "eagle3", "model": drafter_dirs("qwen3", "eagle3")},
        "draft_model": {"method": "draft_model", "model": target_dir, "num_speculative_tokens": 3},
    }[method]
    static_drafter_forwards(monkeypatch)
    llm = LLM(target_dir, max_model_len=128, max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.runner.graphs is None  # the target's steps: eager, as on the CPU
    drafter = llm.engine.speculator.drafter
    steps = drafter.runner.graphs if method == "draft_model" else drafter.graphs
    assert steps._inputs  # the drafter's forwards took the static path
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and (stats.num_accepted_tokens > 0) == (method != "eagle3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")
def test_replayed_drafter_graphs_match_the_eager_drafter_on_cuda(targets):  # noqa: F811
    """DSpark's forward captured at each bucket's first round and replayed (a later round of a bucket over
    new inputs) against the eager drafter: hidden states and cache writes close in bf16 (the drafts may
    part where two probabilities round alike; a round's forward does not read them)."""
    cuda = resolve_platform("cuda")
    model = prepare_model(make_drafter_model(targets).to(torch.bfloat16), None, platform=cuda)
    target = replace(fake_target(BLOCK), platform=cuda, dtype="bfloat16")
    target = replace(target, generator=torch.Generator(cuda.device).manual_seed(0))
    pair = DrafterPair(lambda: DSparkDrafter(model, target), graphs=replace(STATIC, capture=True))
    pair.same = close_in_bf16
    g = torch.Generator().manual_seed(1)
    width = pair.plain.feature_width
    pair.features = [torch.randn(LENGTH, width, generator=g).to(cuda.device) for _ in range(4)]
    for anchors in ROUNDS:
        pair.round(anchors, 3, keys=None)
    assert set(pair.static.graphs.captures.graphs) == {(16, 8), (4, 1), (8, 8)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")
def test_greedy_speculation_with_drafter_graphs_equals_it_without_on_cuda(target_dir, drafter_dirs):  # noqa: F811
    """In fp32, as the target's graphs are checked: the drafter's captured forwards (and the target's) give
    the same greedy output as every forward eager."""
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "dspark", "model": drafter_dirs("qwen3", "vanilla")}
    outputs, limits = {}, dict(kv_cache_memory="256MiB", max_num_seqs=8, speculative_config=spec)
    for eager in (False, True):
        llm = LLM(target_dir, device="cuda", dtype="float32", enforce_eager=eager, **limits)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        drafter = llm.engine.speculator.drafter
        assert (drafter.graphs is None) == eager
        if not eager:
            assert drafter.graphs.captures.graphs  # the drafter's forwards replayed graphs
        del llm
    assert outputs[False] == outputs[True]
