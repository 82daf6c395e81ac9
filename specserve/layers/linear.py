"""fp32 linear layers with oneDNN pre-packed weights: a faster drop-in for nn.Linear on CPU.

Small-M linears are bound by memory bandwidth. On this CPU (2 cores; it does have AVX-512, which oneDNN
uses) torch's default `F.linear` reads the weight at 15-22 GB/s at M = 1 and a third of that at M = 2..16,
where speculative verification runs. oneDNN with the weight reordered once into its blocked layout reads it
at 30-45 GB/s for M <= 4 and stays 1.5-5x faster than `F.linear` up to M = 64 (Qwen2.5-Coder-1.5B shapes;
`python -m specserve.bench.linear`). It is the kernel inductor's CPU weight-prepack pass uses for dynamic
batch sizes: `mkldnn._reorder_linear_weight` once, then `mkldnn._linear_pointwise` per call. (MKL's packed
GEMM, inductor's choice for static shapes, only works at the one M it was packed for.)

The batch-size hint of the reorder picks the layout: 1 keeps the plain [out, in] layout, anything larger the
blocked one, which is faster from M = 3 on. The blocked kernels are slow at M = 1, 2, so fewer than 4 rows
are zero-padded to 4: that costs nothing measurable while the weight read dominates, and beats both.

Batch invariance: a row's output is bitwise the same whatever other rows share the call, which is what
makes greedy speculation equal greedy decoding (a token verified among others must get the logits it gets
decoded alone). oneDNN's brgemm matmul, its kernel on AVX2 and on AVX-512, gives each output element its
own accumulator and sums K in blocks whose size depends on K alone (1024 on AVX2; 512 or 1024 on AVX-512);
M only decides how rows are grouped, and K is split across threads only for K >= 20000 with M, N <= 512
and fewer N blocks than threads (oneDNN 3.12, brgemm_matmul_utils.cpp), no linear of the models served.
torch's `F.linear` (MKL sgemm) is not invariant: a gemv at M = 1, and at M >= 2 a row's result depends on
M and on its position (up to 3e-5 apart at 8960 -> 1536). So `pack_linears` replaces every fp32 linear,
however small (a MoE router, a tiny model's head). Layers of at most SMALL_OUTPUTS outputs (MoE routers,
Gated DeltaNet's per-head gates, shared-expert gates, k / v projections of small models) go to specserve's
own kernel where it is built (`SmallLinear`, kernels/fp32_linear.cpp: one dot product per element, K in
order, so invariant too): oneDNN's packed call costs 70-190 us at M = 1 there (its threads split N, and
there is little of it) where reading the weight takes 10-40 us.
Without AVX2 oneDNN falls back to its jit GEMM, whose M = 1 path is a gemv as well: the padding to 4 rows
keeps it off it. The tests check rows of M = 2..16 and 64 against M = 1 on the machine they run on.

Memory: the packed copy has the dense weight's size. `pack_linears` drops the dense copy when nothing else
in the model shares it, so memory does not grow; reading `.weight` then unpacks a fresh dense tensor (slow,
for inspection only). A weight that another module shares (an lm_head tied to the embedding) stays
referenced, so its packed copy is extra memory (hidden x vocab x 4 bytes: 0.93 GB at 1536 x 151936); it is
packed anyway by default because the lm_head is read on every step (2.8x faster at M = 1 here). A dense
copy is released only if the caller holds no other reference to it either (drop state dicts before packing).

Threads: oneDNN runs every call on all torch threads. With libgomp's default spin-wait, any other busy
process on this 2-core machine makes each call wait out a scheduler slice (~7.7 ms per call, whatever its
size); `OMP_WAIT_POLICY=PASSIVE`, set before torch is imported, avoids that (see the benchmark's notes).

Set `SPECSERVE_LINEAR=torch` (or pass `enabled=False`) to keep plain nn.Linear, e.g. to compare: that gives
up batch invariance.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels

ENV_VAR = "SPECSERVE_LINEAR"
BACKENDS = ("onednn", "torch")


PACK_BATCH_HINT = 64  # any hint > 1 gives the blocked layout (AB16b64a here); 1 keeps the plain one
MIN_ROWS = 4  # blocked kernels at M = 1, 2 are slower than at M = 4: pad up to this (it also keeps
# oneDNN's jit GEMM, used without AVX2, off its M = 1 gemv path, which is not batch invariant)


def onednn_pack(weight: torch.Tensor, batch_size_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """Reorder a dense fp32 [out, in] weight into oneDNN's layout for that batch size (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T + bias with oneDNN; weight is packed (`onednn_pack`) or dense [out, in]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear_padded(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = MIN_ROWS
) -> torch.Tensor:
    """`onednn_linear`, with fewer than `min_rows` rows padded with zeros up to `min_rows`."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows == 0 or rows >= min_rows:
        return onednn_linear(x, weight, bias)
    padded = F.pad(x.reshape(rows, features), (0, 0, 0, min_rows - rows))
    out = onednn_linear(padded, weight, bias)[:rows]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def onednn_takes(x: torch.Tensor) -> bool:
    """Whether oneDNN's op can run input x: CPU fp32, and no gradient to keep. It has no autograd, so a
    backward through it (a drafter trained through a shared target head) would get wrong gradients."""
    needs_grad = x.requires_grad and torch.is_grad_enabled()
    return x.dtype == torch.float32 and x.device.type == "cpu" and not needs_grad


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a dense weight that no PackedLinear holds (a slice of a fused expert tensor): oneDNN
    on the weight as it is, as batch invariant as on a packed one but reordering it on every call (1.2-1.7x
    the packed call's time at Gemma 4 26B-A4B's expert shapes, M = 1..8). `F.linear` where oneDNN cannot
    run it or is switched off."""
    if linear_backend() == "onednn" and onednn_takes(x) and packable(weight):
        return onednn_linear_padded(x, weight, None)
    return F.linear(x, weight)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_backend(enabled: bool | None = None) -> str:
    """Kernel to use, "onednn" or "torch": `enabled` if given, else `$SPECSERVE_LINEAR` (default onednn)."""
    if enabled is not None:
        return "onednn" if enabled and onednn_available() else "torch"
    backend = os.environ.get(ENV_VAR, "onednn").strip().lower() or "onednn"
    if backend not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={backend!r}; expected one of {BACKENDS}")
    return backend if onednn_available() else "torch"


def packable(w: torch.Tensor) -> bool:
    """Only CPU fp32 weights: other devices have their own kernels, and bf16/fp16 are far slower here."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and not w.is_mkldnn


SMALL_OUTPUTS = 512  # a Qwen3-Next router (512 experts) still; oneDNN catches up from ~1024 outputs


class SmallLinear(nn.Linear):
    """Inference-only fp32 nn.Linear with few outputs on specserve's compiled kernel (the module docstring
    says why); the same parameters and state dict as the nn.Linear it replaces. An input the kernel does not
    take (one that requires grad while grad is enabled, not fp32) goes through `F.linear`."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (onednn_takes(x) and self.weight.is_contiguous()):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.specserve.fp32_linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """Inference-only nn.Linear whose weight lives in oneDNN's packed layout.

    `weight` reads as the dense [out, in] weight: the shared Parameter when `keep_weight` (a tied weight),
    else a fresh unpacked copy on every read (the dense copy is not kept). `bias` is the original
    Parameter. The state dict holds the dense `weight`/`bias`, as nn.Linear's does; loading one repacks.
    An input that requires grad (while grad is enabled) takes `F.linear` on `weight`, so gradients are right.
    In-place edits of the shared Parameter do not reach the packed copy: pack after loading.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        if not packable(linear.weight):
            raise ValueError(
                f"PackedLinear needs a CPU fp32 weight, got {linear.weight.dtype} on {linear.weight.device}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # plain attributes, not a buffer/parameter: .to() and deepcopy cannot handle mkldnn tensors, and a
        # tied weight is already registered by the module it is shared with
        self._packed = onednn_pack(linear.weight)
        self._dense = linear.weight if keep_weight else None
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        return self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not onednn_takes(x):
            bias = None if self.bias is None else self.bias.to(x)
            return F.linear(x, self.weight.to(x), bias)
        return onednn_linear_padded(x, self._packed, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight if keep_vars else self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self, state_dict: Mapping, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        if key in state_dict:
            weight = state_dict[key]
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"size mismatch for {key}: {tuple(weight.shape)}")
            else:
                with torch.no_grad():
                    if self._dense is not None:
                        self._dense.copy_(weight)
                    self._packed = onednn_pack(weight.to(torch.float32))
        elif strict:
            missing_keys.append(key)
        # the bias is a registered parameter: let nn.Module load it (it ignores our weight key)
        state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        tied = ", shared weight" if self._dense is not None else ""
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}{tied}"


def pack_linears(
    model: nn.Module, min_features: int = 1, pack_tied: bool = True, enabled: bool | None = None
) -> int:
    """Replace, in place, every CPU fp32 nn.Linear in `model` by a PackedLinear, or by a SmallLinear where
    it has at most SMALL_OUTPUTS outputs and specserve's kernels are built; returns how many.

    Call after the weights are loaded and tied. Small layers (a MoE router, a tiny model's head) are replaced
    too, for batch invariance (`F.linear` is not invariant; see the module docstring); layers with fewer than
    `min_features` inputs or outputs stay nn.Linear.
    A weight shared with another parameter of the model (tied lm_head) stays referenced and gets a packed
    copy too (extra memory) unless `pack_tied=False`. `enabled=None` reads `$SPECSERVE_LINEAR`.
    """
    if linear_backend(enabled) != "onednn":
        return 0
    uses: dict[int, int] = {}  # storage -> how many (module, name) slots hold a parameter on it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            key = p.untyped_storage().data_ptr()
            uses[key] = uses.get(key, 0) + 1
    # Names only, grouped per module (one nn.Linear may be registered twice): holding the modules themselves
    # would keep every dense weight alive until the end, doubling peak memory while packing.
    names_of: dict[int, list[str]] = {}
    for qualname, module in model.named_modules(remove_duplicate=False):
        if qualname and type(module) is nn.Linear and packable(module.weight):
            if min(module.in_features, module.out_features) >= min_features:
                names_of.setdefault(id(module), []).append(qualname)
    count, small = 0, kernels.ops() is not None
    for names in names_of.values():
        linear = model.get_submodule(names[0])
        shared = uses[linear.weight.untyped_storage().data_ptr()] > 1
        if shared and not pack_tied:
            continue
        if small and linear.out_features <= SMALL_OUTPUTS:
            packed = SmallLinear(linear)
        else:
            packed = PackedLinear(linear, keep_weight=shared)
        del linear
        for qualname in names:
            parent_name, _, name = qualname.rpartition(".")
            setattr(model.get_submodule(parent_name), name, packed)
        count += 1
    return count
