"""The Triton paged attention kernel against `sdpa_paged_attention`, every piece shape the engine schedules in
one call, and its batch invariance: a row bitwise as it is decoded alone. Compiled where CUDA is; elsewhere
on CPU tensors in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before anything imports triton:
an interpreted kernel cannot call tl.* helpers decorated for compiling when triton was imported)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")

from specserve.layers import triton_attention  # noqa: E402
from specserve.layers.attention import KVCache, sdpa_paged_attention  # noqa: E402
from specserve.layers.metadata import ForwardMetadata  # noqa: E402
from tests.h100_compile import H100_SHARED_MEMORY, run_uninterpreted, shared_memory_for_h100  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.kernel_agnostic] + (
    [pytest.mark.gpu] if DEVICE == "cuda" else []
)  # compiled on CUDA: the GPU tier
MAX_LEN = 192
NUM_SEQS = 6
SCALE = 0.125
# (sequence, first position, rows): a prompt chunk over a cached prefix (several query and key tiles), a
# decode row, a verification block, a sequence's first token, a first prompt chunk, a piece without rows
MIXED = [(0, 70, 45), (1, 150, 1), (2, 100, 17), (3, 0, 1), (4, 0, 30), (5, 50, 0)]


@dataclass
class Setup:
    """Random K/V and queries for NUM_SEQS sequences of MAX_LEN positions, blocks scattered in the cache."""

    keys: torch.Tensor  # [NUM_SEQS, MAX_LEN, kv_heads, head_dim]
    values: torch.Tensor
    queries: torch.Tensor  # [NUM_SEQS, MAX_LEN, heads, head_dim]
    tables: list[list[int]]
    block_size: int

    def call(self, pieces, sliding_window=None, logit_softcap=None, causal=True, backend=None):
        """pieces (sequence, first position, rows) in one call -> {(sequence, position): output row}."""
        query_start, positions, rows, context_lens = [0], [], [], []
        for seq, start, n in pieces:
            query_start.append(query_start[-1] + n)
            positions += range(start, start + n)
            rows += [(seq, pos) for pos in range(start, start + n)]
            context_lens.append(start + n)
        tables = [self.tables[seq] for seq, _, _ in pieces]
        positions = torch.tensor(positions)
        meta = ForwardMetadata.build(query_start, context_lens, tables, positions, self.block_size, causal)
        device = "cpu" if backend else DEVICE  # the reference runs on CPU
        cache = self._cache(pieces, device)
        q = torch.stack([self.queries[seq, pos] for seq, pos in rows]).to(device)
        out = (backend or triton_attention.triton_paged_attention)(
            q, cache, meta, SCALE, sliding_window, logit_softcap
        )
        return dict(zip(rows, out.cpu(), strict=True))

    def _cache(self, pieces, device) -> KVCache:
        """Only the pieces' sequences' keys [0, context length) are written; every other slot, the zero
        padding of the block tables included (block 0 is no sequence's), holds NaN."""
        num_blocks = NUM_SEQS * MAX_LEN // self.block_size + 1
        k, v = (
            torch.full((num_blocks, self.block_size, *x.shape[2:]), torch.nan)
            for x in (self.keys, self.values)
        )
        cache = KVCache(k, v)
        for seq, start, n in pieces:
            table, pos = torch.tensor(self.tables[seq]), torch.arange(start + n)
            slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
            cache.write(slots, self.keys[seq, : start + n], self.values[seq, : start + n])
        return KVCache(cache.k.to(device, self.keys.dtype), cache.v.to(device, self.keys.dtype))


def make_setup(head_dim, heads, kv_heads, dtype=torch.float32, block_size=16, value_dim=None) -> Setup:
    g = torch.Generator().manual_seed(head_dim + heads + kv_heads)
    blocks = torch.randperm(NUM_SEQS * MAX_LEN // block_size, generator=g) + 1
    value_dim = value_dim or head_dim
    return Setup(
        keys=torch.randn(NUM_SEQS, MAX_LEN, kv_heads, head_dim, generator=g).to(dtype),
        values=torch.randn(NUM_SEQS, MAX_LEN, kv_heads, value_dim, generator=g).to(dtype),
        queries=torch.randn(NUM_SEQS, MAX_LEN, heads, head_dim, generator=g).to(dtype),
        tables=blocks.view(NUM_SEQS, -1).tolist(),
        block_size=block_size,
    )


GQA3 = {"head_dim": 64, "heads": 6, "kv_heads": 2}  # query heads per KV head padded to 4 in a tile
BF16 = {"heads": 4, "kv_heads": 2, "dtype": torch.bfloat16}
# (make_setup's arguments, the call's)
CASES = {
    "mha": ({"head_dim": 32, "heads": 4, "kv_heads": 4}, {}),
    "gqa3-window": (GQA3, {"sliding_window": 40}),
    "mqa-d48-softcap": ({"head_dim": 48, "heads": 8, "kv_heads": 1}, {"logit_softcap": 5.0}),
    "draft-blocks-window-softcap": (GQA3, {"sliding_window": 40, "logit_softcap": 5.0, "causal": False}),
    "values-narrower-than-keys": ({**GQA3, "value_dim": 32}, {}),
    "bf16-d256-window": ({**BF16, "head_dim": 256}, {"sliding_window": 40}),  # Gemma's sliding layers
    "bf16-d512-block64": ({**BF16, "head_dim": 512, "block_size": 64}, {}),  # Gemma 4's global layers
    "fp16-gqa-softcap": ({**GQA3, "dtype": torch.float16}, {"logit_softcap": 5.0}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_piece_shape_matches_sdpa_in_one_call(case):
    setup_args, call_args = case
    setup = make_setup(**setup_args)
    got = setup.call(MIXED, **call_args)
    want = setup.call(MIXED, **call_args, backend=sdpa_paged_attention)
    dtype = setup.keys.dtype
    # 16-bit: each side rounds its output (one ulp: 2^-8 relative in bf16, 2^-11 in fp16) and the kernel
    # its softmax weights
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    assert all(out.dtype == dtype for out in got.values())
    rows = list(got)  # every (sequence, position) of the call, in the flat batch's order
    got, want = torch.stack([got[row] for row in rows]), torch.stack([want[row] for row in rows])
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", ["gqa3-window", "mqa-d48-softcap", "bf16-d256-window"])
def test_a_row_is_bitwise_the_same_alone_in_a_block_and_in_a_batch(case):
    """Decode rows, verification rows (the last one too) and prompt rows, among other pieces, each equal
    the row decoded alone: what makes greedy speculation reproduce greedy decoding."""
    setup_args, call_args = CASES[case]
    setup = make_setup(**setup_args)
    block = setup.call([(2, 96, 5)], **call_args)
    batch = setup.call(MIXED[:3], **call_args)
    checked = [
        (2, 100, block),
        (2, 97, block),
        (2, 100, batch),
        (2, 116, batch),
        (1, 150, batch),
        (0, 70, batch),
    ]
    for seq, pos, outs in checked:
        alone = setup.call([(seq, pos, 1)], **call_args)[seq, pos]
        assert torch.equal(outs[seq, pos], alone), f"sequence {seq} position {pos} differs from alone"


def test_fits_says_which_calls_the_kernel_takes():
    setup = make_setup(32, 4, 2)
    q = setup.queries[0, :3].to(DEVICE)
    cache = setup._cache([(0, 0, 3)], DEVICE)
    assert triton_attention.fits(q, cache)
    assert not triton_attention.fits(q.double(), cache)  # dtype
    assert not triton_attention.fits(q[:, :3], cache)  # 3 query heads over 2 KV heads
    assert not triton_attention.fits(q[..., :16], cache)  # q's head dim is not k's
    wide = KVCache(*(torch.zeros(2, 16, 2, 1024, device=DEVICE) for _ in "kv"))
    assert not triton_attention.fits(torch.zeros(3, 4, 1024, device=DEVICE), wide)
    meta = ForwardMetadata.build([0, 3], [3], [setup.tables[0]], torch.arange(3), 16)
    with pytest.raises(ValueError, match="dtypes"):
        triton_attention.triton_paged_attention(q.double(), cache, meta, SCALE)


# (dtype, head_dim, group, sliding_window, logit_softcap, causal): Qwen's GQA; Gemma 4's global layers with
# every option on (fp32, as slow to compile as both, is left to the GPU)
COMPILED = [
    ("bf16", 128, 8, None, None, True),
    ("bf16", 512, 8, 512, 30.0, False),
    ("fp16", 128, 8, None, None, True),
]


def print_shared_memory_compiled_for_h100() -> None:
    """The shared memory each COMPILED config needs on an H100, printed (tests/h100_compile.py)."""
    for dtype, head_dim, group, window, softcap, causal in COMPILED:
        constants = triton_attention.kernel_constants(head_dim, head_dim, group, window, softcap, causal)
        types = dict.fromkeys(["q", "k_cache", "v_cache", "out"], f"*{dtype}")
        types |= dict.fromkeys(["query_start", "context_lens", "tables", "positions"], "*i32")
        types |= {"scale": "fp32", "softcap": "fp32"}
        print(shared_memory_for_h100(triton_attention._paged_attention_kernel, types, constants))


@pytest.mark.skipif(DEVICE == "cuda", reason="the tests above compile it for this GPU")
def test_the_kernel_compiles_for_an_h100():
    shared = run_uninterpreted("tests.test_triton_attention:print_shared_memory_compiled_for_h100")
    assert len(shared) == len(COMPILED) and max(shared) <= H100_SHARED_MEMORY, shared
