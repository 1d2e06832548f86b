"""`helexa.model.quant.hugepages`: tensors for the streamed weights on 2 MiB pages, their memory their own
and returned with them."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from helexa.model.quant import hugepages, native, quantize_int4, quantize_int8


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping holding `address` (with its `range`), or None."""
    fields: dict[str, str] | None = None
    for line in open("/proc/self/smaps"):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if fields is not None:
                return fields
            start, end = int(head[1], 16), int(head[2], 16)
            if start <= address < end:
                fields = {"range": f"{start}-{end}"}
        elif fields is not None and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def _require_huge_pages() -> None:
    if not hugepages.enabled():
        pytest.skip("this Linux lends no transparent huge pages (mode never), or HELEXA_HUGEPAGES=off")


def test_a_large_tensor_lies_on_huge_pages_of_its_own_and_returns_them_when_freed() -> None:
    _require_huge_pages()
    t = hugepages.empty((1000, 3000, 4), torch.int8)  # 12 MB: 5 whole 2 MiB pages and a partial one
    assert t.shape == (1000, 3000, 4) and t.dtype == torch.int8 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == t.numel()  # resident accounting sees the tensor's bytes alone
    t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
    mapping = _mapping_of(t.data_ptr())
    assert mapping is not None and mapping["THPeligible"] == "1"  # advised: the kernel may fault in 2 MiB
    view = t.view(-1)[5:10]
    del t
    gc.collect()
    assert _mapping_of(view.data_ptr() - 5) is not None  # a view keeps the memory
    address = view.data_ptr()
    del view
    gc.collect()
    assert _mapping_of(address) is None  # unmapped with the last tensor on it


def test_small_tensors_and_huge_pages_turned_off_use_torchs_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hugepages.empty((100, 64), torch.float32)
    assert small.shape == (100, 64) and small.untyped_storage().nbytes() == 100 * 64 * 4
    monkeypatch.setenv(hugepages.ENV, "off")
    assert not hugepages.enabled()
    big = hugepages.empty((4 << 20,), torch.uint8)
    big.fill_(7)
    assert big.shape == (4 << 20,) and int(big[-1]) == 7


def test_the_kernels_weights_are_tiled_onto_huge_pages() -> None:
    """Both tiled layouts of a weight over 2 MiB lie on huge pages, and give back the weight exactly."""
    _require_huge_pages()
    g = torch.Generator().manual_seed(0)
    int4 = quantize_int4(torch.randn(2048, 2048, generator=g), group_size=32)
    int8 = quantize_int8(torch.randn(1024, 4096, generator=g))
    for weight, tiled in (
        (int4, native.tile_int4(int4.qweight, int4.scales, int4.zeros)),
        (int8, native.tile_int8(int8.qweight, int8.scales)),
    ):
        mapping = _mapping_of(tiled[0].data_ptr())
        assert tiled[0].data_ptr() % hugepages.HUGE_PAGE == 0 and mapping is not None
        assert mapping["THPeligible"] == "1"
        assert torch.equal(native.untile(tiled).qweight, weight.qweight)
