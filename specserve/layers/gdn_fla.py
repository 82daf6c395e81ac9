"""Gated DeltaNet's delta rule on flash-linear-attention's Triton kernels (`fla-core`): the CUDA backend.

The contract is `gated_deltanet.DeltaRule`'s; the layer around it (projections, conv, gates, norm, the conv
state's rollback) is shared with the torch backend. Per forward and layer, two varlen kernel calls over
the flat batch, each piece starting from its slot's state and its final state written back to the slot:
- short pieces (decode tokens, verification blocks, short prompt chunks): fla's fused recurrent kernel,
  token by token. One program per (piece, value head, value block) whatever else is in the batch, so a
  verified token's output and state equal the same token decoded alone;
- long pieces (prefill chunks): fla's chunked kernel (its dots run in TF32 on the GPU).

Conventions, checked against fla 0.6: its state is [pieces, heads, d_k, d_v] fp32 (ours, so slots go in
and out as they are); g is the natural-log decay and beta the post-sigmoid write strength (ours); q and k
come L2-normalised and q already scaled (so scale=1.0 and no in-kernel norm: both backends take the same
inputs); key heads are not repeated, fla maps value head h to key head h // (heads / key heads), as
`repeat_heads` does.

Rollback: the forward keeps each checkpointed piece's k, v, g and beta (the record also holds its state
before the piece); `replay` runs the accepted prefixes through the same recurrent kernel from those
states, in one call per layer. The kernel's arithmetic for a token does not depend on how many follow, so
the state after the kept tokens is bitwise the one the forward held there. The other exact way, having
the kernel write every token's state during verification, costs k + 1 state copies per verified piece and
layer (1 MiB each at Qwen3.5-0.8B shapes) whether or not a draft is rejected, and fla's kernel has no such
output; the replay costs one recurrent step per kept token, only where a draft was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch

from specserve.errors import SpecserveError
from specserve.layers.gated_deltanet import DeltaRuleInputs, PieceRows, RecurrentLayout, StateRecord, rows_of


@dataclass
class TokenInputs:
    """FlaDeltaRule's record of the checkpointed pieces' tokens, back to back ([sum of lengths, ...])."""

    k: torch.Tensor  # [T, key heads, d_k]
    v: torch.Tensor  # [T, heads, d_v]
    g: torch.Tensor  # [T, heads]
    beta: torch.Tensor  # [T, heads]


class FlaDeltaRule:
    """The delta rule on fla's fused recurrent and chunked kernels (see the module docstring)."""

    def __init__(self):
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError as err:
            raise SpecserveError(
                "the 'fla' Gated DeltaNet backend needs flash-linear-attention: pip install fla-core triton"
            ) from err
        # Bound here, not at import: importing fla decorates its kernels, for the compiler or for Triton's
        # interpreter as TRITON_INTERPRET says at that moment.
        self.recurrent, self.chunked = fused_recurrent_gated_delta_rule, chunk_gated_delta_rule

    def forward(
        self, x: DeltaRuleInputs, layout: RecurrentLayout, pool: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, TokenInputs | None]:
        out = x.v.new_empty(x.v.shape)
        if layout.short is not None:
            self._run(self.recurrent, x, layout.short, out, pool, layout.slots)
        if layout.long is not None:
            # The chunked kernel plans its chunks on the host: the host offsets spare it a device sync.
            chunked = partial(self.chunked, cu_seqlens_cpu=layout.long.cu_seqlens_host)
            self._run(chunked, x, layout.long, out, pool, layout.slots)
        if not keep:
            return out, None
        rows = layout.checkpointed.flat
        return out, TokenInputs(k=x.k[rows], v=x.v[rows], g=x.g[rows], beta=x.beta[rows])

    @staticmethod
    def _run(kernel, x: DeltaRuleInputs, pieces: PieceRows, out, pool, slots) -> None:
        q, k, v, g, beta = (rows_of(t, pieces.flat)[None] for t in (x.q, x.k, x.v, x.g, x.beta))
        slots = slots[pieces.pieces]
        o, states = kernel(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=1.0,
            initial_state=pool[slots],
            output_final_state=True,
            cu_seqlens=pieces.cu_seqlens,
        )
        out.index_copy_(0, pieces.flat, o[0])
        pool.index_copy_(0, slots, states)

    def replay(self, pool: torch.Tensor, record: StateRecord, keeps: dict[int, int]) -> None:
        device, u = pool.device, record.updates
        starts = [0, *accumulate(record.lengths)]  # of each piece in the record
        which = list(keeps)
        rows = torch.tensor([starts[i] + t for i in which for t in range(keeps[i])], device=device)
        cu_seqlens = torch.tensor([0, *accumulate(keeps[i] for i in which)], device=device)
        index = torch.tensor(which, device=device)
        k = u.k[rows][None]
        # The kernel wants a query: the keys stand in, the outputs are not read.
        _, states = self.recurrent(
            q=k,
            k=k,
            v=u.v[rows][None],
            g=u.g[rows][None],
            beta=u.beta[rows][None],
            scale=1.0,
            initial_state=record.ssm[index],
            output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        pool.index_copy_(0, record.slots[index], states)
