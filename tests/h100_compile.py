"""Compiling specserve's Triton kernels for an H100 (sm_90) without a GPU: what the interpreter never checks,
Triton's compile-time rules (a kernel it runs may not compile) and the shared memory of the tile shapes.
Compiling needs triton imported without TRITON_INTERPRET, so the tests run it in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

H100_SHARED_MEMORY = 227 * 1024  # per block


def shared_memory_for_h100(kernel, types: dict[str, str], constants: dict) -> int:
    """The shared memory `kernel` needs compiled for an H100 with `constants`; its other arguments are
    typed by `types` (pointers "*bf16", ...), i32 where not named."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    return compiled.metadata.shared


def run_uninterpreted(call: str) -> list[int]:
    """Run `call` (a function of a test module, which prints integers: "tests.x:f") in a fresh process
    where triton compiles; its printed integers."""
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no CUDA backend")
    module, _, function = call.partition(":")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = f"from {module} import {function} as f; f()"
    root = Path(__file__).parents[1]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return [int(line) for line in run.stdout.split()]
