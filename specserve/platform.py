"""The device the engine runs on and what runs there, decided in one place.

`resolve_platform(device)` turns the user's `device` ("auto": CUDA when torch sees a GPU, else the CPU;
"cpu"; "cuda" or "cuda:N") into a `Platform` that the rest of the engine asks instead of testing the
device itself: where tensors live, the dtype "auto" stands for, which kernels attend over the paged cache
and run the Gated DeltaNet recurrence (models/prepare.py's `place` puts them into a model's layers), what
does not run there yet (`refusals`), whether steps may replay CUDA graphs (`captures_graphs`), and where
each rank of a tensor-parallel model runs and how the ranks exchange tensors (`of_rank`,
`collective_backend`).

On the CPU everything is as it always was: specserve's compiled kernels where they build (or torch's
fallbacks). On CUDA, attention and the int4 / int8 linears are specserve's Triton kernels
(`layers/triton_attention.py`, `layers/triton_qlinear.py`) and the recurrence flash-linear-attention's
(`layers/gdn_fla.py`), all tested on the CPU under Triton's interpreter; the rest is device-generic torch
(docs/cuda.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from specserve.errors import SpecserveError

AUTO_DEVICE_ENV = "SPECSERVE_AUTO_DEVICE"
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def local_rank(rank: int) -> int:
    """Tensor-parallel rank `rank`'s index among its node's ranks: a launcher such as torchrun says
    (LOCAL_RANK: several nodes each run some of the ranks); the engine's own workers all run on its node."""
    return int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(world_size: int) -> int:
    """How many of `world_size` ranks run on this node (LOCAL_WORLD_SIZE, as `local_rank`)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def check_device(device: str) -> str:
    """`device` normalised ("CUDA:0" -> "cuda:0"), or a SpecserveError naming the accepted forms."""
    text = str(device).strip().lower()
    if not DEVICE_PATTERN.fullmatch(text):
        raise SpecserveError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return text


@dataclass(frozen=True)
class Platform:
    device: torch.device
    delta_rule: str  # "torch" (layers/gated_deltanet.py); "fla": flash-linear-attention's Triton kernels

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def captures_graphs(self) -> bool:
        """Whether decode and verification steps may replay captured CUDA graphs (worker/cuda_graphs.py)."""
        return self.is_cuda

    @property
    def collective_backend(self) -> str:
        """torch.distributed's backend for the tensors a tensor-parallel forward exchanges (parallel/)."""
        return "nccl" if self.is_cuda else "gloo"

    def of_rank(self, local_rank: int) -> Platform:
        """The platform of tensor-parallel rank `local_rank` of this node, this one being rank 0's (the device
        asked for). On CUDA every rank has a GPU of its own, counting from that one (`device="cuda:1"`, two
        ranks: cuda:1 and cuda:2; `refusals` checks that torch sees them); the CPU's cores are shared."""
        if not self.is_cuda:
            return self
        return replace(self, device=torch.device("cuda", self.device.index + local_rank))

    def synchronize(self) -> None:
        """Wait for the work queued on the device: a GPU runs kernels after their launch returns, so a
        timing without it measures the launches."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def make_current(self) -> None:
        """Make this GPU the process's current device: NCCL's communicators and Triton's launches use it."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def auto_dtype(self, quantization: str | None) -> tuple[str, str]:
        """(the dtype "auto" stands for here, why)."""
        if self.is_cuda:
            return "bfloat16", "CUDA computes in bf16"
        from specserve.auto_dtype import auto_dtype

        return auto_dtype(quantization)

    def groups_on_device(self, dtype: torch.dtype) -> bool:
        """Whether `torch._grouped_mm` reads its group sizes on the device here (its CUTLASS path: bf16 on
        compute capability 9.x / 10.x); elsewhere it loops over the groups from the host, which a graph
        cannot replay, and a mixture-of-experts layer keeps its own loop (layers/moe.py)."""
        capable = self.is_cuda and torch.cuda.get_device_capability(self.device)[0] in (9, 10)
        return capable and dtype == torch.bfloat16

    @property
    def quantized_layout(self) -> bool | None:
        """`use_kernel` for the int4 / int8 layers built for this device (layers/quant.py): True on CUDA,
        whose Triton kernel reads specserve's kernel layout only; None on the CPU: that layout wherever
        its compiled kernels are built, torch's own int4 form elsewhere."""
        return True if self.is_cuda else None

    def refusals(self, tensor_parallel_size: int) -> list[str]:
        """What the engine was asked for that does not run on this device (empty: all of it runs)."""
        if not self.is_cuda:
            return []
        refused = []
        first, count = self.device.index, torch.cuda.device_count()
        last = first + local_world_size(tensor_parallel_size) - 1  # a GPU a rank of this node (`of_rank`)
        if tensor_parallel_size > 1 and last >= count:
            refused.append(f"tensor parallelism over cuda:{first} to cuda:{last} (torch sees {count} GPU(s))")
        return refused


CPU = Platform(torch.device("cpu"), "torch")


def resolve_platform(device: str = "auto") -> Platform:
    """The platform of `device` (see `check_device`); a clear error when CUDA is asked for and absent.
    SPECSERVE_AUTO_DEVICE names what "auto" means instead (the CPU suite pins "cpu" with it, so that its
    bitwise references hold on a machine with a GPU too)."""
    text = check_device(device)
    if text == "auto":
        text = check_device(os.environ.get(AUTO_DEVICE_ENV, "auto"))
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return CPU
    if not torch.cuda.is_available():
        why = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        if torch.version.cuda is None:
            why = f"torch {torch.__version__} is a build without CUDA"
        raise SpecserveError(f"device {device!r}: torch sees no CUDA device ({why})")
    index = int(text.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise SpecserveError(
            f"device {device!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return Platform(torch.device("cuda", index), "fla")
