"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) over a flat batch of pieces, with slot-held state.

Per sequence and value head, a causal depthwise conv (kernel K; its state is the last K-1 inputs) mixes the
q/k/v projections, then the gated delta rule updates a [d_k, d_v] state S:
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,   a_t = exp(g_t) <= 1
with q, k L2-normalised (q also scaled by d_k^-0.5); o goes through a gated RMSNorm and out_proj.
transformers' `modeling_qwen3_next.py` defines the math; tests/test_hybrid.py pins it.

Pieces of at most RECURRENT_MAX_LEN tokens (decode tokens, verification blocks, short prompt chunks) run the
recurrence token by token, all of them advancing together; longer ones (prefill chunks) use the chunked
(WY) form, where a chunk's updates are one triangular solve and only the state passes between chunks.

Batch invariance: a token's output and state must not depend on the other pieces of the call, so that a
verified token equals the same token decoded alone. On the CPU with specserve's kernels built, the
recurrent path is one compiled call a layer (kernels/delta_rule.cpp: a head's state is read and written once
for all of a piece's tokens, each column's sums in index order, so every piece is computed alone); without
them it uses elementwise ops and per-piece [1, d_k] x [d_k, d_v] matmuls (one kernel call per piece and
head, whatever the batch; the tests check it at real shapes). The two agree to fp32 rounding, not bitwise;
a process uses one of them throughout. The per-head gates (beta, g, exp g) are computed in float64 because
fp32 sigmoid / softplus round differently in a kernel's SIMD body and its scalar tail, and an [N, heads]
tensor puts a row in either depending on N. (Rows of conv_dim and heads * d_v, multiples of 32 in every
released config, stay in the SIMD body.)

Rollback: a verification piece whose drafts are rejected must leave its slot at the state after the accepted
prefix. When asked (`StateCheckpoints`), each layer keeps the piece's pre-piece state (the fp32 [heads, d_k,
d_v] one dominates: 1 MiB at Qwen3.5-0.8B shapes), its conv inputs and, per token, the key, decay and delta
of the state's rank-1 update; `GatedDeltaNet.rollback` replays the kept prefix's updates (no matmul; the
compiled kernel's replay reads the state once and writes it once), with the arithmetic of the forward that
recorded them, which gives bitwise the state the forward held there.

Backends: the delta-rule core (the recurrence, its chunked form, the rollback replay) is the one part that
differs by device, so each layer holds a `DeltaRule` the platform chooses (`delta_rules.py`): "torch" (this
module's, every device, the CPU's default) or "fla" (flash-linear-attention's Triton kernels, `gdn_fla.py`,
for CUDA). Projections, conv, gates, norm and the conv state's rollback are shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels
from specserve.layers.fusion import project
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints
from specserve.layers.mlp import activation
from specserve.layers.norm import GatedRMSNorm

# Pieces up to this length take the recurrent form. It must cover every verification block (anchor + k
# drafts; DSpark's default k is 7, DFlash's 16) for verification to equal plain decoding bitwise. Speed alone
# would pick ~16: at Qwen3.5-0.8B shapes (16 heads, 128 x 128) on 2 CPU threads the recurrent form costs
# ~1 ms a token a piece, the chunked one ~11 ms a piece up to 64 tokens.
RECURRENT_MAX_LEN = 32
CHUNK = 64  # chunk length of the chunked form (transformers' and FLA's)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One linear-attention layer's per-sequence state shape."""

    conv_dim: int
    kernel_size: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int

    def allocate(
        self, num_slots: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> RecurrentState:
        """A pool of zeroed slots; the conv state in the model dtype, the delta-rule state in fp32."""
        ssm_shape = (num_slots, self.num_heads, self.head_k_dim, self.head_v_dim)
        return RecurrentState(
            conv=torch.zeros(num_slots, self.conv_dim, self.kernel_size - 1, dtype=dtype, device=device),
            ssm=torch.zeros(ssm_shape, dtype=torch.float32, device=device),
        )

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.kernel_size - 1) * torch.empty((), dtype=dtype).element_size()
        return conv + self.num_heads * self.head_k_dim * self.head_v_dim * 4


@dataclass
class RecurrentState:
    """One layer's pool of slots; a sequence keeps one slot index in every layer."""

    conv: torch.Tensor  # [num_slots, conv_dim, kernel_size - 1] (model dtype)
    ssm: torch.Tensor  # [num_slots, num_heads, head_k_dim, head_v_dim] float32


@dataclass
class StateRecord:
    """What one layer kept of the checkpointed pieces of a forward (padded to the longest, [C, T, ...])."""

    slots: torch.Tensor  # [C]
    lengths: list[int]
    conv: torch.Tensor  # [C, conv_dim, K - 1] conv state before the piece
    ssm: torch.Tensor  # [C, heads, d_k, d_v] delta-rule state before the piece
    mixed: torch.Tensor  # [C, T, conv_dim] conv inputs (the qkv projection)
    updates: Any  # what the layer's DeltaRule keeps to replay the pieces' tokens


@dataclass
class RankOneUpdates:
    """TorchDeltaRule's record of the checkpointed pieces' tokens ([C, T, ...], padded)."""

    k: torch.Tensor  # [C, T, heads, d_k] post-conv, normalised (the compiled path: key heads only)
    decay: torch.Tensor  # [C, T, heads] exp(g)
    deltas: torch.Tensor  # [C, T, heads, d_v] the recurrence's rank-1 updates
    compiled: Any  # the kernels that computed them (torch.ops.specserve), or None: torch ops did


@dataclass
class PieceRows:
    """Some pieces laid out [G, T]: the flat row of each piece's t-th token (0 past its end)."""

    pieces: torch.Tensor  # [G]
    rows: torch.Tensor  # [G, T]
    valid: torch.Tensor  # [G, T]
    starts: list[int]  # each piece's first flat row
    lengths: list[int]
    flat: torch.Tensor  # [sum of lengths] the same rows back to back, unpadded (varlen kernels)
    cu_seqlens: torch.Tensor  # [G + 1] where each piece starts in `flat`
    cu_seqlens_host: torch.Tensor  # the same on the CPU (a kernel that plans chunks reads it there)

    @classmethod
    def build(
        cls, pieces: list[int], query_start: list[int], device: torch.device, pad_to: int = 1
    ) -> PieceRows | None:
        if not pieces:
            return None
        starts = torch.tensor([query_start[p] for p in pieces])
        lengths = torch.tensor([query_start[p + 1] - query_start[p] for p in pieces])
        width = -(-int(lengths.max()) // pad_to) * pad_to
        offsets = torch.arange(width)
        valid = offsets[None, :] < lengths[:, None]
        rows = torch.where(valid, starts[:, None] + offsets, 0)
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
        return cls(
            pieces=torch.tensor(pieces, device=device),
            rows=rows.to(device),
            valid=valid.to(device),
            starts=starts.tolist(),
            lengths=lengths.tolist(),
            flat=rows[valid].to(device),
            cu_seqlens=cu_seqlens.to(device),
            cu_seqlens_host=cu_seqlens,
        )


@dataclass
class RecurrentLayout:
    """Index tensors every linear-attention layer of one forward shares (built once per forward, on the
    device of the forward's tensors).

    The conv runs over a buffer holding, per piece, its K-1 state rows then its tokens: the taps of a token
    are the K buffer rows ending at its own.
    """

    slots: torch.Tensor  # [P] each piece's state slot
    fresh: torch.Tensor  # [P] bool: the piece starts at position 0, from a zero state
    any_fresh: bool  # (read once a forward, not once a layer)
    buffer_len: int
    token_rows: torch.Tensor  # [N] buffer row of each token
    state_rows: torch.Tensor  # [P, K-1] buffer rows of the state before the piece
    end_rows: torch.Tensor  # [P, K-1] buffer rows of the state after it
    short: PieceRows | None  # recurrent form
    long: PieceRows | None  # chunked form, padded to whole chunks
    checkpointed: PieceRows | None
    compiled: Any  # specserve's kernels for the recurrent form (torch.ops.specserve), or None

    @classmethod
    def build(cls, meta: ForwardMetadata, kernel_size: int) -> RecurrentLayout:
        if meta.state_slots is None:
            raise ValueError("a model with linear-attention layers needs ForwardMetadata.state_slots")
        qs, device = meta.query_start, meta.positions.device
        num_pieces, w = len(qs) - 1, kernel_size - 1
        lengths = [qs[p + 1] - qs[p] for p in range(num_pieces)]
        starts, ends = torch.tensor(qs[:-1]), torch.tensor(qs[1:])
        shift = torch.arange(num_pieces) * w
        piece_of_token = torch.repeat_interleave(torch.arange(num_pieces), torch.tensor(lengths))
        short = [p for p in range(num_pieces) if lengths[p] <= RECURRENT_MAX_LEN]
        long = [p for p in range(num_pieces) if lengths[p] > RECURRENT_MAX_LEN]
        checkpointed = meta.checkpoints.pieces if meta.checkpoints is not None else []
        if any(lengths[p] > RECURRENT_MAX_LEN for p in checkpointed):
            raise ValueError(f"a piece whose state may be rolled back has at most {RECURRENT_MAX_LEN} tokens")
        fresh = meta.positions[starts.to(device)] == 0
        return cls(
            slots=meta.state_slots.long().to(device),
            fresh=fresh,
            any_fresh=bool(fresh.any()),
            buffer_len=qs[-1] + num_pieces * w,
            token_rows=(torch.arange(qs[-1]) + (piece_of_token + 1) * w).to(device),
            state_rows=((starts + shift)[:, None] + torch.arange(w)).to(device),
            end_rows=((ends + shift)[:, None] + torch.arange(w)).to(device),
            short=PieceRows.build(short, qs, device),
            long=PieceRows.build(long, qs, device, pad_to=CHUNK),
            checkpointed=PieceRows.build(checkpointed, qs, device),
            compiled=kernels.ops() if device.type == "cpu" else None,
        )


L2_EPS = 1e-6  # q's and k's L2 norms (transformers')


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token by token. state [B, H, dk, dv]; q, k [B, T, H, dk]; v [B, T, H, dv]; decay, beta [B, T, H];
    valid [B, T] (a piece's state stops at its last token). Returns (state, out [B, T, H, dv], the
    rank-1 updates' deltas [B, T, H, dv]: with k and decay they are all `replay_delta_rule` needs).

    The state is updated in place on one private copy (a fresh 1 MiB tensor per op is what bounded it):
    a token past a piece's end gets decay 1 and beta 0, which leaves the state bitwise as it was."""
    state = state.clone()
    decay = torch.where(valid[..., None], decay, 1.0)
    beta = torch.where(valid[..., None], beta, 0.0)
    outs, deltas = [], []
    for t in range(k.shape[1]):
        k_t = k[:, t, :, None, :]  # [B, H, 1, dk]
        state.mul_(decay[:, t, :, None, None])
        delta = (v[:, t] - (k_t @ state)[:, :, 0]) * beta[:, t, :, None]
        state.addcmul_(k_t.transpose(-1, -2), delta[:, :, None, :])
        deltas.append(delta)
        outs.append((q[:, t, :, None, :] @ state)[:, :, 0])
    return state, torch.stack(outs, 1), torch.stack(deltas, 1)


def replay_delta_rule(
    state: torch.Tensor, k: torch.Tensor, deltas: torch.Tensor, decay: torch.Tensor
) -> None:
    """Redo, in place on one piece's state [H, dk, dv], the updates `recurrent_delta_rule` made with keys
    k [T, H, dk], deltas [T, H, dv] and decays [T, H]: the same two elementwise ops a token, without the
    matmuls, so the state is bitwise the one the forward held after those T tokens."""
    for t in range(k.shape[0]):
        state.mul_(decay[t, :, None, None])
        state.addcmul_(k[t, :, :, None], deltas[t, :, None, :])


def chunked_delta_rule(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk by chunk; shapes as `recurrent_delta_rule`, T a multiple of CHUNK. Padding tokens must have
    k = v = g = beta = 0: they then leave the state alone."""
    b, t, h, dk = k.shape
    n, c = t // CHUNK, CHUNK
    q, k, v = (x.transpose(1, 2).reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(b, h, n, c) for x in (g, beta))
    cum = g.cumsum(-1)  # log decay from the chunk start through each token
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    # decay[i, j]: what token j's write has decayed by at token i (i >= j); masked before exp (overflow)
    decay = torch.where(lower, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()
    k_beta = k * beta[..., None]
    # WY form: (I + L) [U | W] = [v beta | k beta exp(cum)], L the strictly lower part of (k_beta k^T) * decay
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(c)
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), -1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], dk], -1
    )
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from each token to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ state + within[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    return state, out.reshape(b, h, t, -1).transpose(1, 2)


def rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index], index ascending; x itself when it is all of x's rows (a copy saved)."""
    return x if len(index) == len(x) else x[index]


def _zero_past_end(valid: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    return [torch.where(valid.view(*valid.shape, *([1] * (x.dim() - 2))), x, 0) for x in xs]


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key heads [N, key heads, d] to `heads` value heads: each serves heads / key heads consecutive ones."""
    r = heads // x.shape[-2]
    return x.repeat_interleave(r, dim=-2) if r > 1 else x


@dataclass
class DeltaRuleInputs:
    """One forward's per-token inputs of the delta rule, fp32, in flat batch order."""

    q: torch.Tensor  # [N, key heads, d_k] L2-normalised, scaled by d_k^-0.5
    k: torch.Tensor  # [N, key heads, d_k] L2-normalised
    v: torch.Tensor  # [N, heads, d_v]
    g: torch.Tensor  # [N, heads] log decay (<= 0)
    decay: torch.Tensor  # [N, heads] exp(g)
    beta: torch.Tensor  # [N, heads] write strength (post-sigmoid)


class DeltaRule(Protocol):
    """The delta-rule core of a GatedDeltaNet layer: the part that has a backend per device."""

    def forward(
        self, x: DeltaRuleInputs, layout: RecurrentLayout, pool: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, Any]:
        """Every piece from the state in its slot of `pool` [slots, heads, d_k, d_v], which it overwrites
        with the state after the piece: returns the output [N, heads, d_v] and, with `keep`, what `replay`
        needs of layout.checkpointed's tokens."""
        ...

    def replay(self, pool: torch.Tensor, record: StateRecord, keeps: dict[int, int]) -> None:
        """Set the slot of each record piece i in `keeps` to its state after its first keeps[i] tokens."""
        ...


class TorchDeltaRule:
    """The delta rule in torch ops (runs anywhere; the CPU's): short pieces token by token (on the compiled
    kernel where the layout has one), long ones in the chunked form, a rollback by replaying the kept rank-1
    updates (the module docstring says why)."""

    def forward(
        self, x: DeltaRuleInputs, layout: RecurrentLayout, pool: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, RankOneUpdates | None]:
        heads = x.v.shape[1]
        out, updates = x.v.new_empty(x.v.shape), None
        compiled = layout.compiled if not (torch.is_grad_enabled() and x.v.requires_grad) else None
        if layout.long is not None or (layout.short is not None and compiled is None):
            q, k = repeat_heads(x.q, heads), repeat_heads(x.k, heads)  # the compiled call reads key heads
        if layout.short is not None and compiled is not None:
            updates = self._compiled_short(compiled, x, layout, pool, out, keep)
        elif layout.short is not None:
            rows, valid, slots = layout.short.rows, layout.short.valid, layout.slots[layout.short.pieces]
            s, o, deltas = recurrent_delta_rule(
                pool[slots], q[rows], k[rows], x.v[rows], x.decay[rows], x.beta[rows], valid
            )
            out[rows[valid]] = o[valid]
            pool.index_copy_(0, slots, s)
            if keep:
                updates = self._updates(layout, k, x.decay, deltas)
        if layout.long is not None:
            rows, valid, slots = layout.long.rows, layout.long.valid, layout.slots[layout.long.pieces]
            ks, vs, gs, bs = _zero_past_end(valid, k[rows], x.v[rows], x.g[rows], x.beta[rows])
            s, o = chunked_delta_rule(pool[slots], q[rows], ks, vs, gs, bs)
            out[rows[valid]] = o[valid]
            pool.index_copy_(0, slots, s)
        return out, updates

    @staticmethod
    def _compiled_short(compiled, x, layout, pool, out, keep) -> RankOneUpdates | None:
        """The short pieces in one call of the compiled recurrence (kernels/delta_rule.cpp), which reads
        the key heads as they are and updates each piece's state in its slot, in place; with `keep`, the
        checkpointed pieces' keys, decays and deltas."""
        short = layout.short
        deltas = torch.empty_like(out) if keep else None
        slots = layout.slots[short.pieces]
        compiled.delta_rule_recurrent(
            pool, pool, slots, slots, short.starts, short.lengths,
            x.q, x.k.contiguous(), x.v.contiguous(), x.decay, x.beta, out, deltas,
        )  # fmt: skip
        if not keep:
            return None
        kept = layout.checkpointed.rows
        return RankOneUpdates(k=x.k[kept], decay=x.decay[kept], deltas=deltas[kept], compiled=compiled)

    @staticmethod
    def _updates(layout, k, decay, deltas) -> RankOneUpdates:
        """The checkpointed pieces' keys, decays and deltas (all of them are short pieces)."""
        kept = layout.checkpointed
        short_index = {p: i for i, p in enumerate(layout.short.pieces.tolist())}
        which = torch.tensor([short_index[p] for p in kept.pieces.tolist()], device=deltas.device)
        return RankOneUpdates(
            k=k[kept.rows], decay=decay[kept.rows], deltas=deltas[which, : kept.rows.shape[1]], compiled=None
        )

    def replay(self, pool: torch.Tensor, record: StateRecord, keeps: dict[int, int]) -> None:
        u = record.updates
        if u.compiled is not None:
            which = list(keeps)
            u.compiled.delta_rule_replay(
                pool, record.slots, record.ssm, u.k, u.decay, u.deltas, which, [keeps[i] for i in which]
            )
            return
        for i, kept in keeps.items():
            ssm = pool[int(record.slots[i])]
            ssm.copy_(record.ssm[i])
            replay_delta_rule(ssm, u.k[i, :kept], u.deltas[i, :kept], u.decay[i, :kept])


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer; parameter names are its checkpoint's (`linear_attn.*`)."""

    FUSED_PROJECTIONS = (("in_proj_qkv", "in_proj_z"),)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # the key of this layer's StateRecord
        self.delta_rule: DeltaRule = TorchDeltaRule()  # the platform may choose another (delta_rules.py)
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # Held for its weight [conv_dim, 1, K] only: the conv runs over the pieces' buffer (`_conv`).
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.act = activation(config.hidden_act)
        # q | k | v blocks, each split across tensor-parallel ranks on its own (models/sharding.py)
        qkv = (self.key_dim, self.key_dim, value_dim)
        self.tp_segments = {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv}

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            self.conv_dim, self.kernel_size, self.num_v_heads, self.head_k_dim, self.head_v_dim
        )

    def forward(
        self,
        x: torch.Tensor,
        layout: RecurrentLayout,
        state: RecurrentState,
        checkpoints: StateCheckpoints | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        mixed, z = project(x, self.in_proj_qkv, self.in_proj_z)
        # Each piece's conv inputs and delta-rule state are updated in its slot; a fresh one starts at zero.
        if layout.any_fresh:
            fresh = layout.slots[layout.fresh]
            state.conv[fresh], state.ssm[fresh] = 0, 0
        keep = layout.checkpointed is not None and checkpoints is not None
        if keep:  # the states a rollback starts from, before this forward rewrites them
            kept = layout.checkpointed
            kept_slots = layout.slots[kept.pieces]
            conv0, ssm0 = state.conv.index_select(0, kept_slots), state.ssm.index_select(0, kept_slots)
        inputs = self._delta_rule_inputs(self._conv(mixed, layout, state.conv), x, layout.compiled)
        out, updates = self.delta_rule.forward(inputs, layout, state.ssm, keep)
        if keep:
            checkpoints.layers[self.layer_idx] = StateRecord(
                kept_slots, kept.lengths, conv0, ssm0, mixed[kept.rows], updates
            )

        z = z.view(n, self.num_v_heads, -1)
        return self.out_proj(self.norm(out.to(x.dtype), z).reshape(n, -1))

    def _conv(self, mixed: torch.Tensor, layout: RecurrentLayout, pool: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv of every token over its piece's state then tokens (fp32, before the
        activation), each piece's state in `pool` moved on to its last K-1 inputs: in one compiled call
        where every piece is short and fp32, else a tap at a time over a buffer of all the windows. Either
        way a product per tap added in tap order (elementwise: exact per row, and the same bits)."""
        weight = self.conv1d.weight[:, 0].float()  # [conv_dim, K]
        fp32 = mixed.dtype == pool.dtype == torch.float32
        learning = torch.is_grad_enabled() and (mixed.requires_grad or weight.requires_grad)  # autograd's
        if layout.compiled is not None and layout.long is None and fp32 and not learning:
            acc, short, ops = torch.empty_like(mixed), layout.short, layout.compiled
            x, w = mixed.contiguous(), weight.contiguous()  # (no copy for the layers' own outputs)
            ops.causal_conv_short(pool, layout.slots, short.starts, short.lengths, x, w, acc)
            return acc
        buffer = mixed.new_empty(layout.buffer_len, self.conv_dim)
        buffer[layout.token_rows] = mixed
        states = pool.index_select(0, layout.slots)
        buffer[layout.state_rows.flatten()] = states.transpose(1, 2).reshape(-1, self.conv_dim)
        pool[layout.slots] = buffer[layout.end_rows].transpose(1, 2)
        first = layout.token_rows - (self.kernel_size - 1)
        acc = buffer[first].float() * weight[:, 0]
        for j in range(1, self.kernel_size):
            acc = acc + buffer[first + j].float() * weight[:, j]
        return acc

    def _delta_rule_inputs(self, conv: torch.Tensor, x: torch.Tensor, compiled) -> DeltaRuleInputs:
        """The conv's output activated and split into q, k (L2-normalised, q also scaled) and v, with the
        gates (g, exp(g), beta) [N, heads], computed in fp64 (see the module docstring): in one compiled
        call on the CPU (rows.cpp; a few ulp from torch's ops, every row alike), else in torch ops."""
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        if (
            compiled is not None
            and self.act is F.silu
            and kernels.rows_take(conv, a, b, self.A_log, self.dt_bias)
        ):
            return DeltaRuleInputs(
                *compiled.gdn_delta_rule_inputs(
                    conv, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim, L2_EPS
                )
            )
        n = x.shape[0]
        q, k, v = self.act(conv).to(x.dtype).split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = l2norm(q.reshape(n, self.num_k_heads, -1).float()) * self.head_k_dim**-0.5
        k = l2norm(k.reshape(n, self.num_k_heads, -1).float())
        v = v.reshape(n, self.num_v_heads, -1).float()
        g = -self.A_log.double().exp() * F.softplus(a.double() + self.dt_bias.double())
        return DeltaRuleInputs(q, k, v, g.float(), g.exp().float(), b.double().sigmoid().float())

    def rollback(self, checkpoints: StateCheckpoints, state: RecurrentState, keep: dict[int, int]) -> None:
        """Rewrite each checkpointed piece's slot to the state after its first keep[p] tokens."""
        record = checkpoints.layers.get(self.layer_idx)
        if record is None:
            return
        keeps = []
        for p, length in zip(checkpoints.pieces, record.lengths, strict=True):
            kept = keep.get(p, length)
            if not 1 <= kept <= length:
                raise ValueError(f"piece {p}: keep must be in 1..{length}, got {kept}")
            keeps.append(kept)
        rolled = {i: kept for i, kept in enumerate(keeps) if kept < record.lengths[i]}
        for i, kept in rolled.items():
            # conv: the last K-1 inputs of [state before the piece, kept tokens]
            inputs = torch.cat((record.conv[i].T, record.mixed[i, :kept]))
            state.conv[int(record.slots[i])] = inputs[kept:].T
        if rolled:
            self.delta_rule.replay(state.ssm, record, rolled)
