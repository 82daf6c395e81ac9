"""What specserve's Triton kernels share: a matrix product and a rounding to 16-bit floats that give the same
results compiled for a GPU and interpreted on CPU tensors (TRITON_INTERPRET=1, how the suite tests them)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def dot(a, b, acc, WIDEN: tl.constexpr):
    # Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns, so it gets 16-bit operands
    # in fp32: the same products (a bf16 or fp16 product is exact in fp32), summed in fp32 as the tensor
    # cores do.
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee": fp32 operands keep fp32 products (the default rounds them to TF32); 16-bit ones ignore it
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x in `dtype`, rounded to nearest even as the GPU rounds; Triton's interpreter truncates to bf16
    (so it is rounded here first, to a value the truncation keeps)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# Whether the kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1 when triton was imported):
# their dots must then widen 16-bit operands (`dot`'s WIDEN).
INTERPRETED = not isinstance(dot, JITFunction)
