"""A step's small tensors between the host and the device, one transfer each way a step.

The engine builds a step's indices (tokens, positions, cache slots, block tables) on the host and reads its
results (sampled tokens, logprobs) there. On a GPU each separate copy is a launch, and each device -> host
read a synchronization that stalls the host until the GPU is idle; so inputs travel in one pinned,
non-blocking copy and results come back through non-blocking copies and one wait. On the CPU both are no-ops.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host-built int64 tensors on `device`, viewed back into their shapes."""
    if device.type == "cpu":
        return list(tensors)
    staged = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        staged = staged.pin_memory()  # a non-blocking copy needs page-locked host memory
    staged = staged.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(staged.split([t.numel() for t in tensors]), tensors)]


def copy_into(buffer: torch.Tensor, host: torch.Tensor) -> None:
    """A host-built tensor into a buffer on the device (a CUDA graph's static inputs), in one copy."""
    if buffer.device.type == "cuda":
        host = host.pin_memory()
    buffer.copy_(host, non_blocking=True)


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors on the host (None and host tensors pass through), after one wait for their device."""
    devices = {t.device for t in tensors if t is not None and not t.is_cpu}
    copies = [t if t is None or t.is_cpu else t.to("cpu", non_blocking=True) for t in tensors]
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return copies
