"""Weights moved onto transparent huge pages (layers/huge_pages.py): every tensor lands on a madvised mapping
with its values, ties, views and fusions intact; a storage held outside the model stays where it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.layers import huge_pages
from specserve.layers.huge_pages import place_on_huge_pages
from specserve.layers.weight_storage import weight_tensors
from specserve.models.loader import load_model
from tests.paged_harness import PagedHarness
from tests.test_quant import prompts

pytestmark = [
    pytest.mark.kernel_agnostic,
    pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here"),
]


def moved(t: torch.Tensor) -> bool:
    return huge_pages._on_our_mapping(t.untyped_storage().data_ptr())


def thp_eligible(address: int) -> bool:
    """What the kernel says of the mapping holding `address` (/proc/self/smaps: THPeligible)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"{address:#x} is in no mapping")


def logits(model) -> torch.Tensor:
    return PagedHarness(model, num_blocks=32).step([(0, prompts(1)[0])])[0][0]


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_loaded_model_runs_the_same_from_huge_pages(quantization, tiny_model_dir, monkeypatch):
    directory = str(tiny_model_dir("qwen2"))
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    plain, _, _ = load_model(directory, quantization=quantization)
    monkeypatch.delenv(huge_pages.ENV_VAR)
    model, _, _ = load_model(directory, quantization=quantization)
    tensors = list(weight_tensors(model))
    assert not any(moved(t) for t in weight_tensors(plain))
    assert all(moved(t) for t in tensors if not t.is_mkldnn)
    assert thp_eligible(tensors[0].data_ptr())
    assert torch.equal(logits(model), logits(plain))
    # storage identity keeps its meaning: one storage per storage moved, ties and fused views still shared
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == len({t.untyped_storage().data_ptr() for t in weight_tensors(plain)})
    if quantization is None:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif (attn := model.model.layers[0].self_attn).q_proj.on_kernel:  # torch's int4 kernel fuses nothing
        fused = attn.q_proj.fusion.layer.packed
        assert attn.k_proj.packed.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert moved(fused)
    assert place_on_huge_pages(model) == 0  # already there: a drafter sharing target modules moves none


def test_a_storage_held_outside_the_model_stays():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    kept = model[0].weight.detach()[:4]  # a view the model does not know about
    values = [p.detach().clone() for p in model.parameters()]
    nbytes = place_on_huge_pages(model)
    assert nbytes == sum(p.numel() * 4 for p in model.parameters()) - model[0].weight.numel() * 4
    assert not moved(model[0].weight) and moved(model[0].bias) and moved(model[1].weight)
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))
    kept.fill_(1.0)  # still the model's memory
    assert torch.equal(model[0].weight[:4], torch.ones(4, 64))
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model[1](model[0](x))
        model[1].weight.mul_(2)  # the moved copy is the one the module computes with
        assert torch.allclose(model[1](model[0](x)), 2 * expected - model[1].bias)


def test_switched_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    model = nn.Linear(8, 8)
    assert place_on_huge_pages(model) == 0 and not moved(model.weight)


def test_a_storage_gives_its_old_pages_back_as_it_is_copied(monkeypatch):
    """A large storage is copied a chunk at a time, each copied chunk's whole pages of the old copy given
    back at once (no load peaks at its size twice); values intact. One over memory torch did not allocate
    (numpy's) gives nothing back: another storage could share it."""
    import numpy as np

    monkeypatch.setattr(huge_pages, "COPY_CHUNK", 3 * huge_pages.PAGE + 100)  # chunk ends inside pages
    released = []
    monkeypatch.setattr(huge_pages, "release_pages", lambda address, size: released.append((address, size)))
    model = nn.Module()
    model.big = nn.Parameter(torch.randn(10 * huge_pages.PAGE // 4 + 7), requires_grad=False)
    model.numpy = nn.Parameter(torch.from_numpy(np.ones(5 * huge_pages.PAGE, dtype=np.float32)), False)
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    start = model.big.untyped_storage().data_ptr()
    end = start + model.big.untyped_storage().nbytes()
    place_on_huge_pages(model)
    assert all(moved(p) and torch.equal(p, values[name]) for name, p in model.named_parameters())
    page = huge_pages.PAGE
    assert released and all(address % page == 0 and length % page == 0 for address, length in released)
    # consecutive ranges covering every whole page of the old copy: one after each of the three whole
    # chunks, and after the last (less than a page) where it ends a page
    assert [a + n for a, n in released[:-1]] == [a for a, _ in released[1:]] and len(released) in (3, 4)
    assert released[0][0] == -(-start // page) * page and sum(n for _, n in released) == (
        end // page * page - released[0][0]
    )
