"""The compiled kernels, built once per machine and cached: int4 / int8 linear layers (qlinear.cpp), the
attention of decode and verification rows from the paged KV cache (attention.cpp), the row-wise steps
between them (rows.cpp: RMSNorm, rotary embedding with the KV cache write, gated activations, Gated
DeltaNet's delta-rule inputs), Gated DeltaNet's recurrence and causal conv for short pieces, with the
rollback (delta_rule.cpp), fp32 linears with few outputs (fp32_linear.cpp: MoE routers, per-head gates),
and a mixture-of-experts layer's routing bookkeeping (moe.cpp).

The first use compiles the sources with torch's C++ extension tooling (gcc and ninja; ~15 s on 2 cores)
into the specserve cache directory, keyed by the sources, torch and Python versions; later processes load
the built library directly. Nothing is printed on success. Without a compiler, when the build fails or on
a CPU without AVX2, `ops()` returns None after one log line: the quantized layers keep torch's own int4
kernel (specserve/layers/quant.py) and attention torch's SDPA (specserve/layers/attention.py).
`SPECSERVE_NO_KERNELS=1` forces that fallback. `SPECSERVE_ISA=avx2` (or scalar, avx512_vnni, amx) caps the
paths every kernel may take, for the process: an AVX-512 machine then runs, and times, the AVX2 paths
(`ATEN_CPU_CAPABILITY=avx2` does the same for torch's own kernels).

The ops, as `torch.ops.specserve.*` (isa: -1 = the best this CPU has, 0 scalar, 1 AVX2, 2 AVX-512 VNNI,
3 AMX):
    int4_linear(x, codes, scales, mins, bias=None, isa=-1), int8_linear(x, codes, scales, bias=None, isa=-1)
    int4_grouped_linear(x, counts, codes, scales, supers, isa=-1), int8_grouped_linear(x, counts, codes,
        scales, isa=-1): buffers of E layers stacked [E, ...], x's rows sorted by layer, counts[e] for layer e
    quantize_rows(x, isa=-1) -> (codes, scales, sums), best_isa(), cap_isa(isa), parallel_threads()
    paged_attention_rows(q, k_cache, v_cache, rows, tables, pieces, positions, key_ends, window, scale)
    rms_norm(x, weight, eps, offset), add_rms_norm(x, residual, weight, eps, offset) -> (sum, normed)
    rotate_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots), gated_activation(gate, up, act)
    gdn_delta_rule_inputs(conv, a, b, A_log, dt_bias, key_heads, dk, eps) -> (q, k, v, g, decay, beta)
    delta_rule_recurrent(state0, pool, index, slots, starts, lengths, q, k, v, decay, beta, out, deltas, isa)
    delta_rule_replay(pool, slots, state0, k, decay, deltas, which, kept, isa)
    causal_conv_short(pool, slots, starts, lengths, x, weight, out)
    fp32_linear(x, weight, bias=None, isa=-1)
    moe_dispatch(x, ids, num_experts) -> (rows, counts, slots), moe_combine(y, weights, ids, slots)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from specserve.cache_dir import cache_root, file_lock

ENV_VAR = "SPECSERVE_NO_KERNELS"
ISA_ENV_VAR = "SPECSERVE_ISA"
SOURCES = [
    Path(__file__).with_name(name)
    for name in ("qlinear.cpp", "attention.cpp", "rows.cpp", "delta_rule.cpp", "fp32_linear.cpp", "moe.cpp")
]
HEADERS = [Path(__file__).with_name("vec.h")]
NAME = "specserve_qlinear"
# -ffp-contract=off: no fused multiply-adds but the written ones, so every path rounds alike. -fopenmp:
# without it ATen's parallel_for compiles to a serial loop here (the symbols resolve to torch's libgomp).
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
ISA_NAMES = ("scalar", "avx2", "avx512_vnni", "amx")

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "ops": torch.ops.specserve or None, once tried


def disabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def isa_cap() -> int:
    """The best path SPECSERVE_ISA lets the kernels take (an index into ISA_NAMES; all of them if unset)."""
    name = os.environ.get(ISA_ENV_VAR, "").strip().lower()
    if not name:
        return len(ISA_NAMES) - 1
    if name not in ISA_NAMES:
        raise ValueError(f"{ISA_ENV_VAR}={name!r}: expected one of {', '.join(ISA_NAMES)}")
    return ISA_NAMES.index(name)


def build_dir() -> Path:
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    key.update(f"{torch.__version__} {sys.version_info[:2]} {CFLAGS}".encode())
    return cache_root() / "kernels" / key.hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel's binary sits in the venv, which may not be on it."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _build_and_load() -> None:
    directory = build_dir()
    library = directory / f"{NAME}.so"
    with file_lock(directory.with_suffix(".lock")):
        if library.is_file():
            torch.ops.load_library(str(library))
            return
        from torch.utils import cpp_extension

        _ninja_on_path()
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            NAME,
            [str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def load_ops():
    """torch.ops.specserve with the kernels in it, or None (switched off, or it could not be built). The
    scalar path is there even on a CPU without AVX2 (tests compare the paths); `ops()` says what to use."""
    with _lock:
        if "ops" not in _loaded:
            # a bad SPECSERVE_ISA is the caller's mistake: raised on every call, never a fallback
            cap = None if disabled() else isa_cap()
            _loaded["ops"] = None
            if cap is not None:
                try:
                    _build_and_load()
                    torch.ops.specserve.cap_isa(cap)
                    _loaded["ops"] = torch.ops.specserve
                except Exception as exc:  # no compiler, no ninja, a failed build: fall back
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    logger.warning(
                        "specserve kernels unavailable (%s): using torch's int4 kernel", first[:200]
                    )
        return _loaded["ops"]


def ops():
    """The kernels to run quantized layers with, or None: not built, switched off, or no AVX2 here. Layers
    ask when they are built, so setting SPECSERVE_NO_KERNELS=1 later affects layers built from then on."""
    loaded = None if disabled() else load_ops()
    if loaded is None or loaded.best_isa() < 1:
        return None
    return loaded


def rows_take(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether rows.cpp's kernels take these tensors: fp32 on the CPU, x 2-D or 3-D with unit stride in its
    last dimension, and no autograd to record (a drafter in training takes torch's ops)."""
    if not (x.dim() in (2, 3) and x.stride(-1) == 1):
        return False
    grad = torch.is_grad_enabled()
    for t in (x, *others):  # a loop, not all() over a generator: asked ~200 times a decoded token
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad)):
            return False
    return True


def isa_name() -> str:
    """What the quantized layers run on: "amx" (calls of a few rows on AVX-512 VNNI), "avx512_vnni",
    "avx2", or "torch" (the fallback)."""
    loaded = ops()
    return "torch" if loaded is None else ISA_NAMES[loaded.best_isa()]
