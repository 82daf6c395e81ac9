"""What `dtype="auto"` means on this machine: bf16 where the CPU multiplies bf16 natively (AVX-512 BF16 or
AMX: there a bf16 linear reads half the bytes and beats fp32, see docs/quantization.md), fp32 elsewhere
(AVX2 alone emulates bf16 and is slower than fp32). Quantized weights get fp32 activations (and KV cache,
and the layers left unquantized): specserve's int4 / int8 kernels take and give fp32, so bf16 would only
add conversions around every linear layer (int4 1.5B on Sapphire Rapids: one forward over 1 / 8 tokens
48.5 / 81.5 ms in fp32, 50.8 / 95.6 in bf16).
SPECSERVE_AUTO_DTYPE names another answer (the test suite pins float32 with it, so that its references
hold on every machine)."""

from __future__ import annotations

import os

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty where the file does not exist: not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def auto_dtype(quantization: str | None = None) -> tuple[str, str]:
    """(the dtype "auto" stands for, why), for weights quantized to `quantization` (None: not)."""
    pinned = os.environ.get("SPECSERVE_AUTO_DTYPE")
    if pinned:
        return pinned, "SPECSERVE_AUTO_DTYPE"
    if quantization:
        return "float32", f"{quantization} kernels compute in fp32"
    if native_bf16():
        return "bfloat16", "the CPU has native bf16"
    return "float32", "the CPU has no native bf16"
