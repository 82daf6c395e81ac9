"""Sparse mixture-of-experts feed-forward: top-k routing and a flat-batch expert dispatch.

Tokens are grouped by expert (a stable sort, `dispatch`) and each token's weighted terms added back in the
order of its experts' ids (`combine`), each in one compiled call on specserve's kernels (moe.cpp; torch's
operators otherwise, bitwise alike). In between, on specserve's kernels (quantized experts,
`Experts.stack_experts`), every expert's rows go through each projection in one grouped kernel call, so a
verification block of k + 1 rows reads each routed expert once and pays one call a projection; otherwise
each expert that received rows runs once over them: one Python iteration per *active expert*, never per
token. Both give each row bitwise the same result (the kernels are row-invariant).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specserve.layers import kernels
from specserve.layers.fusion import Fusion
from specserve.layers.huge_pages import trim_heap
from specserve.layers.meta_device import on_meta
from specserve.layers.mlp import GatedMLP
from specserve.layers.quant import StackedLinears, stack_layers, stackable


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k: (weights [N, k] in the logits' dtype, ids [N, k])."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def dispatch(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """The tokens' rows sorted by expert, stably (a token's pairs come in the order of their experts' ids):
    (rows [N * k, H], counts [E] of rows per expert, slots [N, k]: where pair (token, j) sits in rows)."""
    if _compiled(x, ids):
        return torch.ops.specserve.moe_dispatch(x, ids.contiguous(), num_experts)
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    # counted by adding ones: bincount sizes its output from the ids' maximum, a host read on a GPU
    counts = flat_ids.new_zeros(num_experts).index_add_(0, flat_ids, torch.ones_like(flat_ids))
    return x.index_select(0, order // top_k), counts, order.argsort().view(-1, top_k)


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each token's terms y[slots] * weights, added from zero in the order of its experts' ids  [N, H]."""
    if _compiled(y, ids, weights):
        return torch.ops.specserve.moe_combine(y, weights, ids.contiguous(), slots)
    by_id = ids.argsort(dim=1)
    picked = slots.gather(1, by_id).flatten()
    terms = y.index_select(0, picked).view(*ids.shape, y.shape[-1]) * weights.gather(1, by_id)[..., None]
    # added in that order (index_add_ would add them in the same order, but runs as a serial scatter: 0.43 ms
    # a layer for 8 rows)
    out = torch.zeros_like(terms[:, 0])
    for j in range(ids.shape[1]):
        out += terms[:, j]
    return out


def grouped_mlp(
    rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activate
) -> torch.Tensor:
    """Gated MLPs of E experts over rows sorted by expert (counts[e] each), in two grouped matmuls
    (`torch._grouped_mm`: group sizes read on the device, so a GPU step is not held up by the host and can
    be captured in a graph). gate_up [E, 2I, H] (gate | up), down [E, H, I], as transformers v5 holds them."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(activate(gate, up).contiguous(), down.transpose(1, 2), offs=offsets)


def split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each fused 3-D expert tensor as `Experts` names them, one per expert:
    transformers v5 holds experts fused (`experts.gate_up_proj` [E, 2I, H], gate rows then up rows;
    `experts.down_proj` [E, H, I]), as Gemma 4's and Qwen3.5-MoE's checkpoints store them; older Qwen
    checkpoints store one tensor per expert, which pass as they are."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("experts") or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tensor
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


def _compiled(x: torch.Tensor, ids: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether moe.cpp takes the call: specserve's kernels, fp32 rows on the CPU, int64 ids."""
    return (
        x.dim() == 2
        and ids.dtype == torch.int64
        and kernels.ops() is not None
        and kernels.rows_take(x, *others)
    )


class Experts(nn.ModuleList):
    """Expert MLPs, named `{e}.gate_proj.weight` etc. as in HF checkpoints (fused 3-D checkpoint tensors
    are split by `split_fused_experts`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__(GatedMLP(hidden_size, intermediate_size, act) for _ in range(num_experts))
        self.stacks: tuple[StackedLinears, StackedLinears] | None = None  # gate|up, down (`stack_experts`)
        self.gate_up_sizes: list[int] = []
        self.shared_stacked = False  # a shared expert is stacked after the routed ones, as expert E
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None  # [E, 2I, H], [E, H, I]: `use_grouped_mm`

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: tuple[GatedMLP, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [N, H]; weights, ids [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x)  [N, H]. `shared`:
        (an expert every token takes, its weights [N, 1]), whose term is added last; stacked with the
        routed ones (`stack_experts`), it is routed as expert E and runs in their grouped calls."""
        grouped = self.stacks is not None and self.stacks[0].takes(x)
        takes_shared = grouped and self.shared_stacked  # the stack ends with the shared expert
        num_experts = len(self) + takes_shared  # the stack's layers
        if shared is not None and takes_shared:
            ids = torch.cat([ids, ids.new_full((len(ids), 1), len(self))], dim=1)  # the last id: added last
            weights = torch.cat([weights, shared[1]], dim=1)
            shared = None
        rows, counts, slots = dispatch(x, ids, num_experts)
        if grouped:
            y = self._grouped(rows, counts)
        elif self.dense is not None:
            y = grouped_mlp(rows, counts, *self.dense, self[0].activate)
        else:
            y = self._looped(rows, counts.tolist())
        # fp32 routing weights (Gemma 4's) give fp32 terms, summed in fp32
        out = combine(y.to(x.dtype), weights, ids, slots).to(x.dtype)
        if shared is not None:
            expert, gate = shared
            out = out + gate * expert(x)
        return out

    def _looped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert over its rows, one call each."""
        parts = [expert(part) for expert, part in zip(self, rows.split(counts), strict=True) if len(part)]
        return torch.cat(parts) if parts else rows

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All experts over their rows, one grouped kernel call a projection."""
        gate_up, down = self.stacks
        gate, up = gate_up(rows, counts).split_with_sizes(self.gate_up_sizes, dim=-1)
        return down(self[0].activate(gate, up), counts)

    @property
    def reads_host(self) -> bool:
        """Whether a forward waits for the host (the loop over experts reads their row counts)."""
        return self.stacks is None and self.dense is None

    @property
    def weight_dtype(self) -> torch.dtype:
        return self[0].down_proj.weight.dtype

    def use_grouped_mm(self) -> None:
        """Run the (unquantized) experts in two grouped matmuls (`grouped_mlp`): their gate, up and down
        weights stacked, each expert's layers made nn.Linear over its views (no memory is kept twice). The
        GPU's path (models/prepare.py's `place`); not batch-invariant, so the CPU keeps its loop."""
        if self.stacks is not None or self.dense is not None:
            return
        size = self[0].up_proj.out_features
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self])
        down = torch.stack([e.down_proj.weight for e in self])
        for e, expert in enumerate(self):
            expert.gate_proj = _linear_over(gate_up[e, :size])
            expert.up_proj = _linear_over(gate_up[e, size:])
            expert.down_proj = _linear_over(down[e])
        self.dense = (gate_up, down)

    def stack_experts(self, shared: GatedMLP | None = None) -> bool:
        """Stack the experts' projections for grouped calls (`quant.stack_layers`; no memory is added) once
        they are quantized on specserve's kernel with gate and up fused, as `quant.fuse_projections` leaves
        them; else they keep running one by one. A `shared` expert of the same shape and activation is
        stacked after them. Returns whether they are stacked. The stacked buffers are registered (not saved
        with the model) so that moving the weights (layers/huge_pages.py) finds them."""
        if self.stacks is not None:
            return True
        routed = list(self)
        with_shared = shared is not None and shared.act is self[0].act and _stackable([*routed, shared])
        members = [*routed, shared] if with_shared else routed
        if not _stackable(members):
            return False
        fusions = [expert.gate_proj.fusion for expert in members]
        self.stacks = (stack_layers(fusions), stack_layers([expert.down_proj for expert in members]))
        self.gate_up_sizes = fusions[0].sizes
        self.shared_stacked = with_shared
        for which, stacked in zip(("gate_up", "down"), self.stacks, strict=True):
            for name, tensor in zip(stacked.names, stacked.buffers, strict=True):
                self.register_buffer(f"stacked_{which}_{name}", tensor, persistent=False)
        trim_heap()  # a layer's experts at a time: the pieces freed for the stack would double a load's peak
        return True


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear (no bias) whose weight is `weight` itself (a view of the experts' stack)."""
    with on_meta():
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _stackable(experts: list[GatedMLP]) -> bool:
    """Whether these experts' fused gate|up layers, and their down layers, stack (`quant.stackable`)."""
    fusions = [getattr(expert.gate_proj, "fusion", None) for expert in experts]
    fused = all(
        isinstance(f, Fusion) and f.members == (e.gate_proj, e.up_proj) for f, e in zip(fusions, experts)
    )
    return fused and stackable(fusions) and stackable([expert.down_proj for expert in experts])
