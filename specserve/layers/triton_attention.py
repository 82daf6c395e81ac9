"""Paged attention in one Triton kernel launch: what `sdpa_paged_attention` computes, for CUDA tensors (and,
under TRITON_INTERPRET=1, for CPU tensors: how the suite tests it).

One program attends a tile of one piece's consecutive query rows for one KV head, the query heads that
share that KV head stacked as the tile's matrix rows (GQA: K/V are read once per KV head). It walks its rows'
keys in tiles of BLOCK_N positions through the block table with an online (flash-attention) softmax, in fp32.
Every piece shape the engine schedules (prompt chunks with a cached prefix, decode rows, verification and
draft blocks) goes through the same launch: the grid is `tokens // tile rows + pieces` programs, each finding
its piece by a binary search over `query_start`, so it depends on the step's counts alone.

Batch invariance (greedy speculation must reproduce greedy decoding bitwise): a row's arithmetic depends on
its own keys only. Tile shapes come from the head shape alone (`kernel_constants`), never from the batch; key
tiles start at absolute positions that are multiples of BLOCK_N whatever the row's piece; a tile holding
none of a row's keys leaves its running max, total and sum exactly as they were (scores -inf, weights 0,
correction exp(0) = 1), so the tiles another row of the program needs change nothing for this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.attention import KVCache
from specserve.layers.metadata import ForwardMetadata, PieceIndex
from specserve.layers.triton_dots import INTERPRETED, dot

MAX_HEAD_DIM = 512  # Gemma 4's global layers
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _indices_by_device(meta: ForwardMetadata) -> dict[torch.device, PieceIndex]:
    return {}  # one forward's PieceIndex per device, filled by piece_index


def piece_index(meta: ForwardMetadata, device: torch.device) -> PieceIndex:
    """The forward's PieceIndex on `device`, shared by every layer of the forward: the one the metadata
    brings (a CUDA graph's, from its static buffers), or one built from the host's lists at the first call."""
    if meta.piece_index is not None and meta.piece_index.positions.device == device:
        return meta.piece_index
    indices = meta.derived(_indices_by_device)
    if device not in indices:
        int32 = {"dtype": torch.int32, "device": device}
        indices[device] = PieceIndex(
            query_start=torch.tensor(meta.query_start, **int32),
            context_lens=torch.tensor(meta.context_lens, **int32),
            tables=meta.tables.to(**int32),
            positions=meta.positions.to(**int32),
        )
    return indices[device]


def kernel_constants(
    head_dim: int,
    value_dim: int,
    group: int,
    sliding_window: int | None,
    logit_softcap: float | None,
    causal: bool,
) -> dict[str, int | bool]:
    """The kernel's compile-time parameters for a head shape and a kind of call. Tile shapes come from the
    head shape alone, never from the batch, so a row is computed alike in every call (batch invariance)."""
    dim, group_pad = triton.next_power_of_2(max(head_dim, value_dim)), triton.next_power_of_2(group)
    matrix_rows = 64 if dim <= 128 else 32 if dim <= 256 else 16  # tile rows x group: registers per program
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "TILE_ROWS": max(1, matrix_rows // group_pad),
        "BLOCK_N": 64 if dim <= 128 else 32,  # keys per tile
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),  # tl.dot takes no dimension under 16
        "VALUE_DIM": value_dim,
        "VALUE_DIM_PAD": max(16, triton.next_power_of_2(value_dim)),
        "CAUSAL": causal,
        "WINDOWED": sliding_window is not None,
        "SOFTCAPPED": logit_softcap is not None,
        "WIDEN_DOTS": INTERPRETED,
    }


def unsupported(q: torch.Tensor, cache: KVCache) -> str | None:
    """Why the kernel cannot attend q over this cache, or None when it can."""
    if not INTERPRETED and q.device.type != "cuda":
        return f"q is on {q.device}: the kernel runs on CUDA (CPU tensors only under TRITON_INTERPRET=1)"
    if not q.device == cache.k.device == cache.v.device:
        return "q and the cache are on different devices"
    if q.dtype not in DTYPES or not q.dtype == cache.k.dtype == cache.v.dtype:
        return f"dtypes {q.dtype}, {cache.k.dtype}, {cache.v.dtype}: one of {DTYPES} for q, K and V"
    if q.dim() != 3 or q.shape[1] % cache.k.shape[2]:
        return f"q {tuple(q.shape)} must be [tokens, heads, head_dim], heads a multiple of the KV heads"
    dims = q.shape[-1], cache.k.shape[-1], cache.v.shape[-1]
    if dims[0] != dims[1] or max(dims) > MAX_HEAD_DIM:
        return f"head dims (q, k, v) {dims}: q's and k's equal, none over {MAX_HEAD_DIM}"
    if any(t.stride(-1) != 1 for t in (q, cache.k, cache.v)):
        return "q, K and V must be contiguous along the head dim"
    return None


def fits(q: torch.Tensor, cache: KVCache) -> bool:
    """Whether `triton_paged_attention` takes q over this cache (any window, softcap, piece shapes)."""
    return unsupported(q, cache) is None


def triton_paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: ForwardMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """q [N, n_heads, d] against the cache (new K/V already written) -> [N, n_heads, d_v]."""
    reason = unsupported(q, cache)
    if reason is not None:
        raise ValueError(f"triton_paged_attention cannot take this call: {reason}")
    tokens, heads, head_dim = q.shape
    kv_heads, value_dim = cache.k.shape[2], cache.v.shape[-1]
    out = q.new_empty(tokens, heads, value_dim)
    if tokens == 0:
        return out
    index = piece_index(meta, q.device)
    constants = kernel_constants(
        head_dim, value_dim, heads // kv_heads, sliding_window, logit_softcap, meta.causal
    )
    _paged_attention_kernel[(tokens // constants["TILE_ROWS"] + meta.num_pieces, kv_heads)](
        q, cache.k, cache.v, out,
        index.query_start, index.context_lens, index.tables, index.positions,
        meta.num_pieces, index.tables.stride(0), meta.block_size,
        *q.stride()[:2], *cache.k.stride()[:3], *cache.v.stride()[:3], *out.stride()[:2],
        scale, logit_softcap or 0.0, sliding_window or 0,
        **constants,
    )  # fmt: skip
    return out


@triton.jit
def _piece_of(program, query_start, num_pieces, TILE_ROWS: tl.constexpr):
    """The piece whose rows `program` attends. Piece p's programs are query_start[p] // TILE_ROWS + p
    onward: at least one per tile of its rows (one spare at most, which finds no rows)."""
    low = program * 0
    high = low + num_pieces - 1
    while low < high:
        mid = (low + high + 1) // 2
        starts_by_program = tl.load(query_start + mid) // TILE_ROWS + mid <= program
        low = tl.where(starts_by_program, mid, low)
        high = tl.where(starts_by_program, high, mid - 1)
    return low


@triton.jit
def _tanh(x):
    # from exp: libdevice's tanh has no interpreter counterpart
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q, k_cache, v_cache, out,
    query_start, context_lens, tables, positions,
    num_pieces, table_stride, block_size,
    q_row_stride, q_head_stride,
    k_block_stride, k_slot_stride, k_head_stride,
    v_block_stride, v_slot_stride, v_head_stride,
    out_row_stride, out_head_stride,
    scale, softcap, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, VALUE_DIM: tl.constexpr, VALUE_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    piece = _piece_of(program, query_start, num_pieces, TILE_ROWS)
    piece_start = tl.load(query_start + piece)
    piece_end = tl.load(query_start + piece + 1)
    context_len = tl.load(context_lens + piece)
    first_row = piece_start + (program - piece_start // TILE_ROWS - piece) * TILE_ROWS

    # matrix row m: query head m % GROUP_PAD of the KV head's group, for query row first_row + m // GROUP_PAD
    m = tl.arange(0, TILE_ROWS * GROUP_PAD)
    row = first_row + m // GROUP_PAD
    head = kv_head * GROUP + m % GROUP_PAD
    live = (row < piece_end) & (m % GROUP_PAD < GROUP)
    position = tl.load(positions + row, mask=live, other=0)
    if CAUSAL:
        key_end = position + 1
    else:  # DSpark's draft blocks: every row sees all of its sequence's keys
        key_end = position * 0 + context_len
    if WINDOWED:
        key_first = tl.maximum(position + 1 - window, 0)
    else:
        key_first = position * 0

    d = tl.arange(0, HEAD_DIM_PAD)
    dv = tl.arange(0, VALUE_DIM_PAD)
    q_offsets = row[:, None] * q_row_stride + head[:, None] * q_head_stride + d[None, :]
    q_tile = tl.load(q + q_offsets, mask=live[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    table = tables + piece * table_stride

    # finite, so that a tile without keys for a row corrects by exp(0) = 1, not exp(-inf + inf) = NaN
    running_max = tl.full((TILE_ROWS * GROUP_PAD,), -1.0e30, tl.float32)
    total = tl.zeros((TILE_ROWS * GROUP_PAD,), tl.float32)
    acc = tl.zeros((TILE_ROWS * GROUP_PAD, VALUE_DIM_PAD), tl.float32)
    tiles_start = tl.min(tl.where(live, key_first, context_len), axis=0) // BLOCK_N * BLOCK_N
    tiles_end = tl.max(tl.where(live, key_end, 0), axis=0)
    for tile_start in range(tiles_start, tiles_end, BLOCK_N):
        key = tile_start + tl.arange(0, BLOCK_N)
        # keys past the sequence are not read: their cache slots may hold anything, NaN included
        in_sequence = key < context_len
        block = tl.load(table + key // block_size, mask=in_sequence, other=0).to(tl.int64)
        slot = key % block_size
        k_offsets = block * k_block_stride + slot * k_slot_stride + kv_head * k_head_stride
        k_tile = tl.load(
            k_cache + k_offsets[None, :] + d[:, None],
            mask=in_sequence[None, :] & (d[:, None] < HEAD_DIM),
            other=0.0,
        )
        scores = dot(q_tile, k_tile, None, WIDEN_DOTS)
        if SOFTCAPPED:
            scores = _tanh(scores * (scale / softcap)) * softcap
        else:
            scores = scores * scale
        visible = (key[None, :] >= key_first[:, None]) & (key[None, :] < key_end[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        total = total * correction + tl.sum(weights, axis=1)
        v_offsets = block * v_block_stride + slot * v_slot_stride + kv_head * v_head_stride
        v_tile = tl.load(
            v_cache + v_offsets[:, None] + dv[None, :],
            mask=in_sequence[:, None] & (dv[None, :] < VALUE_DIM),
            other=0.0,
        )
        acc = dot(weights.to(v_tile.dtype), v_tile, acc * correction[:, None], WIDEN_DOTS)
        running_max = new_max

    total = tl.where(live, total, 1.0)  # padding rows saw no key
    out_offsets = row[:, None] * out_row_stride + head[:, None] * out_head_stride + dv[None, :]
    out_mask = live[:, None] & (dv[None, :] < VALUE_DIM)
    tl.store(out + out_offsets, (acc / total[:, None]).to(out.dtype.element_ty), mask=out_mask)
