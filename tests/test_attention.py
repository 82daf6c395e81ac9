"""Paged attention: every path against a float64 reference, and the batch invariance of short pieces' rows
(a row attended among others, bitwise as it is alone: what makes greedy speculation equal greedy decoding).
Every test runs twice: short rows on specserve's compiled kernel, and on torch's SDPA (the fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specserve.layers import attention, kernels
from specserve.layers.attention import BATCHED_PIECE_MAX_LEN, KVCache, plan_of, sdpa_paged_attention
from specserve.layers.metadata import ForwardMetadata

pytestmark = pytest.mark.kernel_agnostic

BLOCK = 16
MAX_LEN = 640
NUM_SEQS = 8
# (head_dim, query heads, KV heads): MHA, Qwen2.5-0.5B's GQA, MQA, and Gemma's widest heads
SHAPES = [(32, 4, 4), (64, 14, 2), (128, 8, 1), (256, 4, 2)]


@pytest.fixture(autouse=True, params=["kernel", "sdpa"])
def rows_backend(request, monkeypatch) -> str:
    if request.param == "kernel" and kernels.ops() is None:
        pytest.skip("specserve's kernels are not built here")
    if request.param == "sdpa":
        monkeypatch.setenv(kernels.ENV_VAR, "1")
    return request.param


@dataclass
class Setup:
    """A cache holding random K/V for NUM_SEQS sequences of MAX_LEN positions, and each row's query."""

    cache: KVCache
    tables: list[list[int]]
    queries: torch.Tensor  # [NUM_SEQS, MAX_LEN, heads, head_dim]: the query of each (sequence, position)

    def meta(self, pieces, causal=True, prompt_pieces=()) -> ForwardMetadata:
        """pieces: (sequence, first position, rows), in one forward; `prompt_pieces`: indices of the pieces
        that are prompt tokens only."""
        query_start, positions = [0], []
        for _, start, n in pieces:
            query_start.append(query_start[-1] + n)
            positions += range(start, start + n)
        return ForwardMetadata.build(
            query_start,
            [start + n for _, start, n in pieces],
            [self.tables[seq] for seq, _, _ in pieces],
            torch.tensor(positions),
            BLOCK,
            causal=causal,
            prompt_pieces=frozenset(prompt_pieces),
        )

    def attend(self, pieces, sliding_window=None, logit_softcap=None, causal=True, prompt_pieces=()):
        """The pieces attended in one call -> {(sequence, position): output row}."""
        meta = self.meta(pieces, causal, prompt_pieces)
        rows = [(seq, pos) for seq, start, n in pieces for pos in range(start, start + n)]
        q = torch.stack([self.queries[seq, pos] for seq, pos in rows]).to(self.cache.k.dtype)
        out = sdpa_paged_attention(q, self.cache, meta, 0.125, sliding_window, logit_softcap)
        return dict(zip(rows, out, strict=True))

    def alone(self, seq, pos, sliding_window=None, logit_softcap=None):
        """The row as greedy decoding computes it: a one-row piece, its position the last of the cache."""
        return self.attend([(seq, pos, 1)], sliding_window, logit_softcap)[seq, pos]

    def reference(self, seq, pos, key_end, sliding_window=None, logit_softcap=None):
        """float64 attention of one row over its keys [window start, key_end)."""
        first = 0 if sliding_window is None else max(0, pos + 1 - sliding_window)
        table = self.tables[seq]
        slots = torch.tensor([table[j // BLOCK] * BLOCK + j % BLOCK for j in range(first, key_end)])
        k, v = (c.flatten(0, 1)[slots].transpose(0, 1).double() for c in (self.cache.k, self.cache.v))
        q = self.queries[seq, pos].to(self.cache.k.dtype).double()
        rep = q.shape[0] // k.shape[0]
        scores = torch.einsum("hd,hld->hl", q, k.repeat_interleave(rep, 0)) * 0.125
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        return torch.einsum("hl,hld->hd", scores.softmax(-1), v.repeat_interleave(rep, 0))


def make_setup(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype = torch.float32) -> Setup:
    g = torch.Generator().manual_seed(head_dim + heads + kv_heads)
    blocks_per_seq = MAX_LEN // BLOCK
    shape = (NUM_SEQS * blocks_per_seq, BLOCK, kv_heads, head_dim)
    cache = KVCache(*(torch.randn(shape, generator=g).to(dtype) for _ in range(2)))
    # Scrambled blocks, so that a wrong block-table lookup cannot hide.
    order = torch.randperm(NUM_SEQS * blocks_per_seq, generator=g).view(NUM_SEQS, blocks_per_seq)
    queries = torch.randn(NUM_SEQS, MAX_LEN, heads, head_dim, generator=g)
    return Setup(cache, order.tolist(), queries)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}")
def setup(request) -> Setup:
    return make_setup(*request.param)


def assert_rows_as_alone(
    setup: Setup, pieces, sliding_window=None, logit_softcap=None, only=None, prompt_pieces=()
):
    """Every row of the call (or of the pieces of sequences `only`) is bitwise the row computed alone."""
    with torch.inference_mode():
        together = setup.attend(pieces, sliding_window, logit_softcap, prompt_pieces=prompt_pieces)
        for (seq, pos), row in together.items():
            if only is None or seq in only:
                alone = setup.alone(seq, pos, sliding_window, logit_softcap)
                diff = (row - alone).abs().max().item()
                assert torch.equal(row, alone), f"seq {seq} position {pos}: off by {diff:.2g} from alone"


# Decode rows: kv lengths from 1 to 600, two sequences at the same length (rows a shared call would batch).
DECODE = [(0, 0, 1), (1, 7, 1), (2, 63, 1), (3, 299, 1), (4, 299, 1), (5, 511, 1), (6, 512, 1), (7, 599, 1)]


def test_decode_rows_do_not_depend_on_the_batch(setup):
    assert_rows_as_alone(setup, DECODE)
    assert_rows_as_alone(setup, DECODE[3:5])


def test_verification_rows_equal_the_rows_decoded_alone(setup):
    """[anchor, d1..d4] blocks beside decode rows: each row gets what decoding gets at its position."""
    pieces = [(0, 10, 5), (1, 300, 1), (2, 295, 5), (3, 595, 5), (4, 0, 5)]
    assert_rows_as_alone(setup, pieces)
    assert_rows_as_alone(setup, [(5, 100, BATCHED_PIECE_MAX_LEN)])  # the longest piece attended row by row


def test_short_rows_beside_a_prompt_chunk(setup):
    """A prompt chunk (its own masked call) in the step changes nothing for the other pieces' rows."""
    chunk = (6, 200, BATCHED_PIECE_MAX_LEN + 8)
    assert_rows_as_alone(setup, [(0, 40, 5), chunk, (1, 300, 1), (2, 7, 3)], only={0, 1, 2})


@pytest.mark.parametrize("sliding_window, logit_softcap", [(8, None), (300, None), (None, 20.0), (8, 20.0)])
def test_window_and_softcap_rows_do_not_depend_on_the_batch(sliding_window, logit_softcap):
    setup = make_setup(64, 14, 2)
    chunk = (6, 100, BATCHED_PIECE_MAX_LEN + 8)
    pieces = [(0, 3, 5), (1, 299, 1), (2, 299, 5), (3, 595, 5), chunk, (4, 5, 1)]
    assert_rows_as_alone(setup, pieces, sliding_window, logit_softcap, only={0, 1, 2, 3, 4})


def test_short_prompt_pieces_take_one_call_on_sdpa_and_other_rows_stay_as_alone(setup):
    """Prompt pieces need no row invariance (speculation computes them alike): without the row kernel they
    take one call each, however short (on it, row by row is cheaper); the decode and verification rows beside
    them still get what they get alone."""
    pieces = [(0, 40, 5), (6, 200, 30), (1, 300, 1), (7, 0, 2), (2, 7, 3)]
    meta = setup.meta(pieces, prompt_pieces={1, 3})
    on_sdpa, on_kernel = plan_of(meta, rows_on_kernel=False), plan_of(meta, rows_on_kernel=True)
    assert [(p.start, p.end) for p in on_sdpa.long_pieces] == [(5, 35), (36, 38)]
    assert on_sdpa.short.rows.tolist() == [0, 1, 2, 3, 4, 35, 38, 39, 40]
    assert not on_kernel.long_pieces and on_kernel.short.rows.tolist() == list(range(41))
    assert_rows_as_alone(setup, pieces, only={0, 1, 2}, prompt_pieces={1, 3})


@pytest.mark.parametrize("sliding_window, logit_softcap", [(None, None), (8, None), (None, 20.0), (8, 20.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_every_path_matches_a_float64_reference(setup, sliding_window, logit_softcap, causal):
    """Short rows, a prompt chunk's causal mask and window (a long one, and a short one taken whole), and
    non-causal pieces (DSpark's draft blocks)."""
    pieces = [(0, 0, 3), (1, 20, BATCHED_PIECE_MAX_LEN + 5), (2, 299, 1), (3, 40, 5), (4, 10, 12)]
    with torch.inference_mode():
        out = setup.attend(pieces, sliding_window, logit_softcap, causal, prompt_pieces={4})
    for seq, start, n in pieces:
        for pos in range(start, start + n):
            key_end = pos + 1 if causal else start + n
            want = setup.reference(seq, pos, key_end, sliding_window, logit_softcap)
            err = (out[seq, pos].double() - want).abs().max().item()
            assert err < 1e-5, f"seq {seq} position {pos}: max abs error {err:.2g}"


def test_bf16_rows_match_the_reference_and_do_not_depend_on_the_batch():
    """A bf16 cache (dtype="auto" on a CPU with native bf16): fp32 arithmetic inside, one rounding out."""
    setup = make_setup(128, 12, 2, torch.bfloat16)
    pieces = [(0, 299, 1), (1, 40, 5), (2, 599, 1)]
    assert_rows_as_alone(setup, pieces)
    with torch.inference_mode():
        out = setup.attend(pieces)
    assert all(row.dtype == torch.bfloat16 for row in out.values())
    for (seq, pos), row in out.items():
        err = (row.double() - setup.reference(seq, pos, pos + 1)).abs().max().item()
        assert err < 1e-2, f"seq {seq} position {pos}: max abs error {err:.2g}"


def test_short_rows_take_the_kernel_where_it_is_built(rows_backend):
    setup = make_setup(64, 14, 2)
    q = setup.queries[0, 99:100]
    uses_kernel = attention._kernel_fits(q, setup.cache, kernels.ops())
    assert uses_kernel == (rows_backend == "kernel")
    assert not attention._kernel_fits(q.double(), setup.cache, kernels.ops())  # dtypes differ


def test_kernel_rejects_keys_outside_the_block_table():
    ops = kernels.ops()
    if ops is None:
        pytest.skip("specserve's kernels are not built here")
    setup = make_setup(32, 4, 4)
    q, tables, one = setup.queries[0, :1], torch.tensor([setup.tables[0]]), torch.zeros(1, dtype=torch.long)
    args = (q, setup.cache.k, setup.cache.v, one, tables, one)
    with pytest.raises(RuntimeError, match="outside its block table"):
        ops.paged_attention_rows(*args, torch.tensor([MAX_LEN]), torch.tensor([MAX_LEN + 1]), 0, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.paged_attention_rows(q.double(), *args[1:], one, one + 1, 0, 0.125)
