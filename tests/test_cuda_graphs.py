"""The static-buffer path of CUDA graphs (worker/cuda_graphs.py) on the CPU, eagerly: short-piece steps padded
to a bucket give the real rows bitwise the plain forward's logits, hidden states and cache writes; which
steps and models take it. The capture and replay themselves are in the GPU tier (the tests marked gpu here,
skipped without CUDA): replayed graphs against the eager forward, greedy generation with and without them."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.cli import build_parser
from specserve.cli_args import engine_kwargs
from specserve.models.loader import load_model
from specserve.platform import CPU, Platform, resolve_platform
from specserve.worker.cuda_graphs import GraphConfig, buckets, graph_config, graph_refusal, pad_step
from specserve.worker.model_runner import ModelRunner, PieceInput

pytestmark = pytest.mark.kernel_agnostic

BLOCK = 4
NUM_BLOCKS = 40
STATIC = GraphConfig(max_tokens=24, max_pieces=6, max_blocks=8, capture=False)
PROMPTS = [list(range(3 + i, 12 + 2 * i)) for i in range(5)]  # 9 to 17 tokens: prompt chunks, eager


def test_buckets_are_powers_of_two_cut_to_what_a_step_holds():
    assert buckets(4096) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(1) == [1]
    assert STATIC.largest_bucket == 24


def test_padding_rows_go_to_the_scratch_block_in_a_piece_of_their_own():
    step = pad_step(
        [[5], [6, 7, 8]], [9, 2], [[0, 1, 2], [3]], [0, 1, 2, 3], bucket=8, num_pieces=4, max_blocks=3,
        block_size=BLOCK, scratch_block=39,
    )  # fmt: skip
    tokens, positions, slots, logit_rows, rest = step.flat.split([8, 8, 8, 8, 4 * 3 + 5 + 4])
    assert tokens.tolist() == [5, 6, 7, 8, 0, 0, 0, 0]
    assert positions.tolist() == [9, 2, 3, 4, 0, 0, 0, 0]
    assert slots.tolist() == [2 * BLOCK + 1, 3 * BLOCK + 2, 3 * BLOCK + 3, 0, *[39 * BLOCK] * 4]
    assert logit_rows.tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    assert step.query_start == [0, 1, 4, 8, 8] and step.context_lens == [10, 5, 1, 0]
    assert step.block_tables == [[0, 1, 2], [3, 0, 0], [39, 0, 0], [0, 0, 0]]
    assert rest.tolist() == [0, 1, 4, 8, 8, 10, 5, 1, 0, 0, 1, 2, 3, 0, 0, 39, 0, 0, 0, 0, 0]
    assert (step.num_tokens, step.num_logits) == (4, 4)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b)


class Pair:
    """One model behind two runners, one plain and one through the static buffers (or graphs), fed the same
    steps; `same(graphs', plain's)` checks each output, `same_logits` the logits."""

    def __init__(
        self,
        model_dir,
        backend=None,
        graphs=STATIC,
        platform=CPU,
        same=bitwise,
        same_logits=None,
        quantization=None,
    ):
        dtype = torch.bfloat16 if platform.is_cuda else torch.float32
        loaded = load_model(str(model_dir), dtype=dtype, platform=platform, quantization=quantization)
        self.model = loaded[0]
        if backend is not None:
            for module in self.model.modules():
                if hasattr(module, "attention_backend"):
                    module.attention_backend = backend
        self.plain = ModelRunner(self.model, NUM_BLOCKS, BLOCK, dtype)
        self.static = ModelRunner(self.model, NUM_BLOCKS, BLOCK, dtype, graphs=graphs)
        self.same, self.same_logits = same, same_logits or same
        self.lens = [len(p) for p in PROMPTS]
        prompts = [PieceInput(p, 0, self.table(i)) for i, p in enumerate(PROMPTS)]
        self.check([(prompts, [sum(self.lens[: i + 1]) - 1 for i in range(len(PROMPTS))], None)])

    def table(self, seq: int) -> list[int]:
        return list(range(8 * seq, 8 * seq + 8))[: -(-(self.lens[seq] + 8) // BLOCK)]

    def step(self, seqs: list[int], rows: int, bucket: int | None, capture_layers=()) -> None:
        """`rows` new tokens for each of `seqs` (1: decode rows; more: verification blocks), all scored."""
        self.steps_in_a_row([(seqs, rows, bucket)], capture_layers)

    def steps_in_a_row(self, steps: list[tuple[list[int], int, int | None]], capture_layers=()) -> None:
        """Each runner takes the steps one after the other before the other runner starts (nothing of one
        forward, such as rotary's table, may carry over to the next through the static buffers)."""
        inputs = []
        for seqs, rows, bucket in steps:
            pieces = []
            for s in seqs:
                tokens = [(7 * s + self.lens[s] + j) % 90 + 3 for j in range(rows)]
                pieces.append(PieceInput(tokens, self.lens[s], self.table(s)))
            inputs.append((pieces, list(range(rows * len(seqs))), bucket))
            for s in seqs:
                self.lens[s] += 1  # the first row accepted, as after a verification
        self.check(inputs, capture_layers)

    def check(self, steps, capture_layers=()) -> None:
        outputs = []
        for pieces, logit_rows, bucket in steps:
            used = set(self.static.graphs._inputs)
            outputs.append(self.static.forward(pieces, logit_rows, capture_layers))
            assert set(self.static.graphs._inputs) - used == ({(bucket, 0)} - used - {(None, 0)})
        for (pieces, logit_rows, _), static in zip(steps, outputs, strict=True):
            plain = self.plain.forward(pieces, logit_rows, capture_layers)
            self.same_logits(static.logits, plain.logits)
            self.same(static.hidden, plain.hidden)
            assert static.captured.keys() == plain.captured.keys()
            for layer in plain.captured:
                self.same(static.captured[layer], plain.captured[layer])
        for a, b in zip(self.plain.kv_caches, self.static.kv_caches, strict=True):  # the scratch block aside
            self.same(b.k[:NUM_BLOCKS], a.k)
            self.same(b.v[:NUM_BLOCKS], a.v)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_short_steps_padded_to_a_bucket_equal_the_plain_forward_bitwise(tiny_model_dir, arch):
    """Decode batches of several sizes and verification blocks, each padded to its bucket (the padding rows
    writing to the scratch block only): the real rows' logits, hidden states, captured layers and cache
    writes are the plain forward's, bitwise (the CPU backend attends row by row)."""
    pair = Pair(tiny_model_dir(arch))
    pair.step([0], rows=1, bucket=1)
    pair.step([0, 1, 2], rows=1, bucket=4)
    pair.step([0, 1, 2, 3, 4], rows=1, bucket=8, capture_layers=(-1, 1))
    pair.step([1, 3], rows=4, bucket=8)  # two verification blocks, no padding
    pair.step([0, 2, 4], rows=5, bucket=16)
    pair.step([0, 1, 2, 3, 4], rows=5, bucket=None)  # 25 rows: over the largest bucket (24), eager
    pair.steps_in_a_row([([0, 1, 2], 1, 4), ([0, 3, 4], 1, 4), ([1, 2], 3, 8)])


def test_the_triton_kernel_reads_the_static_buffers_prebuilt_index(tiny_model_dir):
    """The Triton kernel (under the interpreter) over the static path: its grid is fixed by the bucket, the
    padding piece and the empty ones find their rows or none, and the real rows equal its plain forward."""
    triton_attention = pytest.importorskip("specserve.layers.triton_attention")
    pair = Pair(tiny_model_dir("qwen3"), backend=triton_attention.triton_paged_attention)
    pair.step([0, 1, 2], rows=1, bucket=4)
    pair.step([1, 3], rows=3, bucket=8)


def test_steps_with_long_pieces_restores_or_scoring_run_eagerly(tiny_model_dir):
    model, _, _ = load_model(str(tiny_model_dir("qwen3")))
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.float32, graphs=STATIC)
    graphs = runner.graphs
    assert graphs.bucket_for([[1] * 33], [[0] * 8]) is None  # a prompt chunk
    assert graphs.bucket_for([[1]] * 25, [[0]] * 25) is None  # over the largest bucket
    assert graphs.bucket_for([[1]], [[0] * 9]) is None  # a table wider than max_blocks
    assert graphs.bucket_for([[1]] * 7, [[0]] * 7) is None  # more pieces than max_pieces
    assert graphs.bucket_for([[1] * 5] * 3, [[0]] * 3) == 16 and graphs.pieces_of(16) == 7
    assert graphs.bucket_for([[1]] * 3, [[0]] * 3) == 4 and graphs.pieces_of(4) == 5


def _model(tiny_model_dir, arch):
    return load_model(str(tiny_model_dir(arch)))[0]


@pytest.mark.parametrize(("arch", "why"), [("qwen3_moe", "experts"), ("qwen3_5", "linear-attention")])
def test_hybrid_and_moe_targets_and_enforce_eager_fall_back_to_eager(tiny_model_dir, arch, why):
    cuda = Platform(torch.device("cuda"), "fla")  # a description: nothing is placed on it here
    dense = _model(tiny_model_dir, "qwen3")
    limits = dict(max_num_batched_tokens=2048, max_num_seqs=8, rows_per_piece=5, max_blocks=9)
    assert graph_config(cuda, False, dense, **limits) == GraphConfig(40, 8, 9, capture=True)
    assert graph_config(cuda, True, dense, **limits) is None
    assert graph_config(CPU, False, dense, **limits) is None
    assert graph_refusal(dense) is None and why in graph_refusal(_model(tiny_model_dir, arch))
    assert graph_config(cuda, False, _model(tiny_model_dir, arch), **limits) is None


def test_enforce_eager_is_an_engine_setting_and_a_flag(tiny_model_dir):
    args = build_parser().parse_args(["generate", "--model", "m", "--enforce-eager", "x"])
    assert engine_kwargs(args)["enforce_eager"] is True
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", enforce_eager=True, kv_cache_memory="8MiB")
    assert llm.engine.runner.graphs is None  # on the CPU steps are eager either way
    with pytest.raises(Exception, match="enforce_eager must be true or false"):
        LLM(str(tiny_model_dir("qwen3")), device="cpu", enforce_eager="yes")


def close_in_bf16(graphs: torch.Tensor, eager: torch.Tensor) -> None:
    """bf16 on both sides, but cuBLAS picks its GEMM by the row count, which padding changes."""
    scale = eager.float().abs().max().clamp(min=1e-6)
    assert (graphs.float() - eager.float()).abs().max() <= 0.02 * scale


def same_top1_in_bf16(graphs: torch.Tensor, eager: torch.Tensor) -> None:
    """Logits: close, and the same top-1 wherever the eager top two are not within that error."""
    close_in_bf16(graphs, eager)
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * eager.abs().max()
    assert torch.equal(graphs.argmax(-1)[clear], eager.argmax(-1)[clear])


@pytest.mark.parametrize(
    "arch, quantization",
    [("qwen3", None), ("gemma3", None), ("qwen3", "int4"), ("qwen3_moe", "int8")],  # stacked experts
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")
def test_replayed_graphs_match_the_eager_forward_on_cuda(tiny_model_dir, arch, quantization):
    """Each bucket captured at its first step and replayed (a second step of a bucket replays with new
    inputs): logits, hidden states, captured layers and cache writes close to the eager forward's."""
    cuda = resolve_platform("cuda")
    graphs = GraphConfig(max_tokens=24, max_pieces=6, max_blocks=8, capture=True)
    pair = Pair(
        tiny_model_dir(arch),
        graphs=graphs,
        platform=cuda,
        same=close_in_bf16,
        same_logits=same_top1_in_bf16,
        quantization=quantization,
    )
    pair.step([0, 1, 2], rows=1, bucket=4)
    pair.step([0, 1, 2, 3, 4], rows=1, bucket=8, capture_layers=(-1, 1))
    pair.steps_in_a_row([([1, 3, 4], 1, 4), ([0, 2, 3], 1, 4)])  # bucket 4 replayed over new inputs
    pair.step([1, 3], rows=4, bucket=8)
    pair.step([0, 2, 4], rows=5, bucket=16)
    assert len(pair.static.graphs.captures.graphs) == 4  # (4, ()), (8, (-1, 1)), (8, ()), (16, ())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")
def test_greedy_generation_with_graphs_equals_it_without_on_cuda(tiny_model_dir):
    """In fp32: cuBLAS may pick another GEMM for a padded row count, which moves the last bits only; in bf16
    two logits of a tiny model often round alike, and such a tie may break either way."""
    model = str(tiny_model_dir("qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(6)]
    outputs, limits = {}, dict(kv_cache_memory="256MiB", max_num_seqs=8)
    for eager in (False, True):
        llm = LLM(model, device="cuda", dtype="float32", enforce_eager=eager, **limits)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (llm.engine.runner.graphs is None) == eager
        if not eager:
            assert llm.engine.runner.graphs.captures.graphs  # decode steps replayed graphs
        del llm
    assert outputs[False] == outputs[True]


def test_the_static_path_keeps_every_tensor_on_the_models_device(tiny_model_dir):
    """On torch's meta device, as tests/test_platform.py checks the plain forward: a host tensor mixed into
    the padded forward raises."""
    from tests.test_platform import _meta_attention

    model, _, _ = load_model(str(tiny_model_dir("qwen3")))
    model.to("meta")
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = _meta_attention
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.float32, graphs=STATIC)
    out = runner.forward(
        [PieceInput([1, 2, 3], 5, [0, 1]), PieceInput([4], 17, [2, 3, 4, 5, 6])], [0, 1, 2, 3]
    )
    assert out.logits.device.type == "meta" and tuple(out.logits.shape) == (4, model.config.vocab_size)
    assert set(runner.graphs._inputs) == {(4, 0)}
