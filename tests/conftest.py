import os

import pytest
import torch

from specserve.layers import kernels
from tests.tiny_models import save_tiny_model

torch.set_num_threads(2)
# dtype="auto" is bf16 on CPUs with native bf16; the suite's references are fp32 (servers it starts too).
os.environ.setdefault("SPECSERVE_AUTO_DTYPE", "float32")
# device="auto" would take a GPU where there is one; the suite's bitwise references are the CPU's (the GPU
# tier, `pytest -m gpu`, names its device).
os.environ.setdefault("SPECSERVE_AUTO_DEVICE", "cpu")
# Without CUDA, Triton kernels run on CPU tensors in Triton's interpreter. Triton reads TRITON_INTERPRET when
# @triton.jit decorates a function, its own tl.* helpers included, so when triton is first imported; test
# modules import it at collection (transformers -> torch._dynamo), so it is set here, before any of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Build (or load) the compiled kernels now, under the real cache directory: tests that point
# SPECSERVE_CACHE at a temporary one would otherwise build them there. SPECSERVE_NO_KERNELS=1 skips it.
kernels.load_ops()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> a saved random model directory (no tokenizer), built once per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture
def specserve_cache(tmp_path, monkeypatch):
    """A cache directory of the test's own (conversions of GGUF files go there)."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=["compiled", "fallback"])
def compiled_kernels(request, monkeypatch) -> bool:
    """Run the test with specserve's compiled kernels, then without them (SPECSERVE_NO_KERNELS=1, read
    when a layer or a forward asks for them); skipped where they are not built. Returns whether they run."""
    if request.param == "fallback":
        monkeypatch.setenv(kernels.ENV_VAR, "1")
    elif kernels.ops() is None:
        pytest.skip("specserve's kernels are not built here")
    return request.param == "compiled"
