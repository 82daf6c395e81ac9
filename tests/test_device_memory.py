"""What `gpu_memory_utilization`'s budget sets aside for the networks' forwards (worker/device_memory.py): on
the CPU, the measurement over a fake CUDA allocator, and the probes each network runs (for real, on the CPU)
with their measurement faked; the engine adds the drafter's share to the target's. On a GPU (marked gpu), a
drafter's probes measured for real."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.models.loader import load_model
from specserve.models.prepare import prepare_model
from specserve.platform import resolve_platform
from specserve.spec_decode.drafters import hidden_states
from specserve.spec_decode.drafters.draft_model import DraftModelDrafter
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.spec_decode.drafters.ngram import NgramDrafter
from specserve.worker import device_memory
from specserve.worker.cuda_graphs import GraphConfig
from specserve.worker.device_memory import GRAPH_POOL_FORWARDS, SAMPLER_LOGIT_COPIES, peak_bytes
from tests.test_drafter_graphs import static_drafter_forwards
from tests.test_dspark import fake_target, make_drafter_model, make_eagle3_model, targets  # noqa: F401
from tests.test_speculative import drafter_dirs, target_dir  # noqa: F401
from tests.tiny_models import VOCAB

BLOCK = 4
STEP = 24  # max_num_batched_tokens: the rows of a drafter's eager probe
GRAPHS = GraphConfig(max_tokens=16, max_pieces=4, max_blocks=16, capture=False)  # largest bucket 16


class FakeAllocator:
    """torch.cuda's memory counters over bytes the test allocates and frees by hand."""

    def __init__(self, monkeypatch):
        self.allocated = self.peak = 0
        self.emptied_with: list[int] = []  # what was allocated at each empty_cache
        for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.emptied_with.append(self.allocated))

    def synchronize(self, device=None):
        pass

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated

    def memory_allocated(self, device=None):
        return self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)


class Held:
    """What a probe's setup allocates (its caches): freed with the probe."""

    def __init__(self, memory: FakeAllocator, n: int):
        self.memory, self.n = memory, n
        memory.alloc(n)

    def __del__(self):
        self.memory.allocated -= self.n


def test_a_probe_is_measured_from_its_forward_alone_and_freed_before_the_cache_is_emptied(monkeypatch):
    memory = FakeAllocator(monkeypatch)
    memory.alloc(1000)  # the weights
    held = []

    def setup():
        caches = Held(memory, 300)  # before the measurement: the caches' own budget pays for theirs
        held.append(weakref.ref(caches))

        def forward():
            memory.alloc(500)  # activations, freed before the forward ends
            memory.alloc(-500)
            memory.alloc(20)  # its output, freed with it
            assert caches.n == 300
            return 7  # what its outputs take later on

        return forward

    assert peak_bytes(torch.device("cpu"), setup) == 500 + 7
    assert held[0]() is None and memory.emptied_with == [1020]  # the caches freed, then the cache emptied


class Probes:
    """The measurement faked: each probe's setup and forward run for real; a hidden-state drafter's probe
    (`watch`ed) measures 1000 x its query rows + its K/V-only rows, a causal LM's what its forward returns
    (its logits' sampler copies). `rows`: the drafter's probes' (query rows, K/V-only rows), in order."""

    def __init__(self, monkeypatch):
        self.rows: list[tuple[int, int]] = []
        monkeypatch.setattr(hidden_states, "peak_bytes", self.peak_bytes)
        monkeypatch.setattr(device_memory, "peak_bytes", self.peak_bytes)

    def watch(self, drafter) -> None:
        real = drafter.forward_rows

        def forward_rows(inputs, batch):
            out = real(inputs, batch)
            kv = 0 if inputs.kv_rows is None else inputs.kv_rows.shape[0]
            self.rows.append((inputs.token_ids.shape[0], kv))
            assert out.shape[0] == inputs.token_ids.shape[0] and torch.isfinite(out).all()
            return out

        drafter.forward_rows = forward_rows

    def peak_bytes(self, device, setup) -> int:
        before = len(self.rows)
        later = setup()()
        return later if len(self.rows) == before else 1000 * self.rows[-1][0] + self.rows[-1][1]


@pytest.mark.parametrize("graphs", [GRAPHS, None], ids=["graphs", "eager"])
def test_hidden_state_drafters_probe_their_largest_eager_step_and_graph_bucket(targets, monkeypatch, graphs):  # noqa: F811
    """A step's worth of query rows (and of K/V-only rows where the drafter reads them: DSpark's
    context), and the largest bucket's forward, twice, for the graphs' pool."""
    target = replace(fake_target(BLOCK), max_num_batched_tokens=STEP)
    for model, make, kv in (
        (make_drafter_model(targets), DSparkDrafter, STEP),
        (make_eagle3_model(targets), lambda model, target: Eagle3Drafter(model, target, 3), 0),
    ):
        prepare_model(model, None)
        drafter = make(model, target)
        drafter.graph_config = graphs
        probes = Probes(monkeypatch)
        probes.watch(drafter)
        total = drafter.activation_bytes(target)
        eager = 1000 * STEP + kv
        if graphs is None:
            assert probes.rows == [(STEP, kv)] and total == eager
        else:
            bucket, kv_bucket = 16, 16 * (kv > 0)
            assert probes.rows == [(STEP, kv), (bucket, kv_bucket)]
            assert total == eager + GRAPH_POOL_FORWARDS * (1000 * bucket + kv_bucket)


def test_a_draft_model_is_probed_as_the_target_and_ngram_needs_nothing(tiny_model_dir, monkeypatch):
    """A step's tokens with a logit row per request (max_num_seqs: 4), and its largest bucket's forward
    with logits for each row; the fake measure is the logits' sampler copies (fp32)."""
    model = load_model(str(tiny_model_dir("qwen2")))[0]
    target = replace(fake_target(BLOCK), max_num_batched_tokens=STEP)
    drafter = DraftModelDrafter(model, target)
    drafter.graph_config = GRAPHS
    Probes(monkeypatch)
    copies = SAMPLER_LOGIT_COPIES * VOCAB * 4
    assert drafter.activation_bytes(target) == 4 * copies + GRAPH_POOL_FORWARDS * 16 * copies
    assert NgramDrafter.from_config(SpeculativeConfig(method="ngram"), target).activation_bytes(target) == 0


def test_the_engine_sets_the_drafters_share_aside_with_the_targets(
    target_dir,  # noqa: F811
    drafter_dirs,  # noqa: F811
    monkeypatch,
):
    """With the budget left to gpu_memory_utilization (on the CPU here: its measurement faked), the
    activations set aside are the target's probe (eager: the CPU captures no graphs), the DSpark
    drafter's (eager and its largest bucket's, as CUDA would configure it) and a round's draft
    distributions, with their sampler copies; the engine then serves. An n-gram drafter samples nothing."""
    static_drafter_forwards(monkeypatch)
    spec = {"method": "dspark", "model": drafter_dirs("qwen3", "vanilla")}  # (built before the fakes)
    measured = iter([1, 10, 100])  # the target's eager probe, the drafter's eager and graph probes

    def fake_peak(device, setup):
        setup()()
        return next(measured)

    monkeypatch.setattr(hidden_states, "peak_bytes", fake_peak)
    monkeypatch.setattr(device_memory, "peak_bytes", fake_peak)
    asked = []

    def budget(device, utilization, activations):
        asked.append(activations)
        return 64 * 2**20

    monkeypatch.setattr("specserve.engine.engine.device_cache_budget", budget)
    post_init = EngineConfig.__post_init__

    def as_on_a_gpu(config):
        post_init(config)
        config.kv_cache_bytes = None  # measured after loading

    monkeypatch.setattr(EngineConfig, "__post_init__", as_on_a_gpu)
    llm = LLM(target_dir, max_model_len=128, max_num_seqs=4, speculative_config=spec)
    k, vocab = llm.engine.speculator.num_draft_tokens, llm.engine.model_config.vocab_size
    q_rows = (1 + SAMPLER_LOGIT_COPIES) * 4 * k * vocab * 4
    assert asked == [1 + 10 + GRAPH_POOL_FORWARDS * 100 + q_rows]
    assert llm.engine.speculator.drafter.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7, 8, 9]], params)
    assert len(out.outputs[0].token_ids) == 8 and llm.engine.spec_stats.num_drafts > 0
    measured = iter([1])
    LLM(target_dir, max_model_len=128, max_num_seqs=4, speculative_config={"method": "ngram"})
    assert asked[-1] == 1
    # Split over two ranks, the probe sees its shard of the head: the gathered logits come on top
    measured = iter([1])
    llm = LLM(target_dir, max_model_len=128, max_num_seqs=4, tensor_parallel_size=2, dtype="float32")
    assert asked[-1] == 1 + 2 * 4 * vocab * 4  # a decode row per request, fp32
    llm.engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")
def test_a_drafters_probes_are_measured_on_cuda_and_freed(targets):  # noqa: F811
    """DSpark's share in bf16: its eager probe at least its output rows, its graphs' pool more again; the
    probes free their caches (what stays is rotary's table of the last forward's positions)."""
    cuda = resolve_platform("cuda")
    model = prepare_model(make_drafter_model(targets).to(torch.bfloat16), None, platform=cuda)
    target = replace(fake_target(BLOCK), platform=cuda, dtype="bfloat16", max_num_batched_tokens=256)
    drafter = DSparkDrafter(model, target)
    assert drafter.graph_config is not None
    before = torch.cuda.memory_allocated(cuda.device)
    with_graphs = drafter.activation_bytes(target)
    drafter.graph_config = None
    eager = drafter.activation_bytes(target)
    layout = drafter.layout
    caches = 2 * 256 * layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 2  # the eager probe's
    assert torch.cuda.memory_allocated(cuda.device) - before < caches
    assert eager >= 256 * model.config.hidden_size * 2 and with_graphs > eager
