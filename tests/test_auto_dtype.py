"""dtype="auto": bf16 exactly where the CPU has native bf16, fp32 elsewhere, and said why."""

from __future__ import annotations

import pytest

from specserve import auto_dtype as auto
from specserve.config import EngineConfig, SpecserveError

pytestmark = pytest.mark.kernel_agnostic

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 fma {extra}
bogomips\t: 4800.00
"""


@pytest.mark.parametrize(
    "extra, native",
    [("", False), ("avx512f avx512_vnni", False), ("avx512f avx512_bf16", True), ("amx_bf16", True)],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, extra, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(extra=extra))
    flags = auto.cpu_flags(str(cpuinfo))
    assert "avx2" in flags and "bogomips" not in flags
    assert auto.native_bf16(flags) is native
    assert auto.cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize("native, dtype", [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_the_cpu_unless_pinned(monkeypatch, native, dtype):
    monkeypatch.delenv("SPECSERVE_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(auto, "native_bf16", lambda: native)
    config = EngineConfig(model="m")
    assert (config.dtype, config.dtype_reason) == (dtype, f"auto: {auto.auto_dtype()[1]}")
    assert EngineConfig(model="m", dtype="fp32").dtype_reason == "asked for"
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "BF16")
    assert EngineConfig(model="m").dtype == "bfloat16"
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "int3")
    with pytest.raises(SpecserveError, match="SPECSERVE_AUTO_DTYPE: unknown dtype 'int3'"):
        EngineConfig(model="m")


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_auto_is_fp32_for_quantized_weights(monkeypatch, quantization):
    """The int4 / int8 kernels take and give fp32: bf16 activations would only add conversions."""
    monkeypatch.delenv("SPECSERVE_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(auto, "native_bf16", lambda: True)
    config = EngineConfig(model="m", quantization=quantization)
    assert (config.dtype, config.dtype_reason) == ("float32", f"auto: {quantization} kernels compute in fp32")
    assert EngineConfig(model="m", quantization=quantization, dtype="bf16").dtype == "bfloat16"
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "bfloat16")
    assert EngineConfig(model="m", quantization=quantization).dtype == "bfloat16"
