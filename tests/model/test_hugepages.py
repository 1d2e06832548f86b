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


def _same_mapping(*tensors: torch.Tensor) -> bool:
    ranges = {(_mapping_of(t.data_ptr()) or {}).get("range") for t in tensors}
    return len(ranges) == 1 and None not in ranges


def test_a_packing_carves_small_tensors_one_after_another_from_one_advised_region() -> None:
    """Tensors under 2 MiB made inside a packing lie back to back, each on a cache line, in one mapping
    advised for huge pages; each is its own storage of its own bytes and keeps its values; they outlive the
    packing, and the region is unmapped with the last of them."""
    _require_huge_pages()
    shapes = [((3, 5), torch.float16), ((100, 64), torch.float32), ((7,), torch.uint8), ((33, 2), torch.int8)]
    with hugepages.packing():
        tensors = [hugepages.empty(shape, dtype) for shape, dtype in shapes]
    g = torch.Generator().manual_seed(1)
    values = [torch.randint(-100, 100, s, generator=g).to(d) for s, d in shapes]
    for t, v in zip(tensors, values):
        t.copy_(v)
    for (shape, dtype), t, v in zip(shapes, tensors, values):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and torch.equal(t, v)
        assert t.data_ptr() % 64 == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    for a, b in zip(tensors, tensors[1:]):
        assert b.data_ptr() == a.data_ptr() + -(-a.numel() * a.element_size() // 64) * 64
    assert tensors[0].data_ptr() % hugepages.HUGE_PAGE == 0 and _same_mapping(*tensors)
    mapping = _mapping_of(tensors[0].data_ptr())
    assert mapping is not None and mapping["THPeligible"] == "1"
    address = tensors[0].data_ptr()
    del tensors[:3], t, a, b
    gc.collect()
    assert _mapping_of(address) is not None  # the last tensor holds the region
    del tensors
    gc.collect()
    assert _mapping_of(address) is None


def test_a_packing_starts_a_new_region_for_a_tensor_the_current_one_has_no_room_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_huge_pages()
    monkeypatch.setattr(hugepages, "REGION", 4 << 20)
    with hugepages.packing():
        a, b, c = (hugepages.empty((3 << 19,), torch.uint8) for _ in range(3))  # 1.5 MiB each
        large = hugepages.empty((3 << 20,), torch.uint8)  # 3 MiB: a mapping of its own, as outside
    assert _same_mapping(a, b) and not _same_mapping(b, c) and c.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not _same_mapping(c, large) and large.data_ptr() % hugepages.HUGE_PAGE == 0
    for i, t in enumerate((a, b, c, large)):
        t.fill_(i)
    assert [int(t[0]) + int(t[-1]) for t in (a, b, c, large)] == [0, 2, 4, 6]


def test_no_mapping_is_made_for_a_small_tensor_outside_a_packing_nor_for_any_with_huge_pages_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(nbytes: int) -> None:
        raise AssertionError(f"a mapping of {nbytes} bytes was made")

    real = hugepages._advised
    monkeypatch.setattr(hugepages, "_advised", refuse)
    small = hugepages.empty((100, 64), torch.float32)  # outside a packing
    monkeypatch.setenv(hugepages.ENV, "off")
    with hugepages.packing():
        a, b = hugepages.empty((100,), torch.float32), hugepages.empty((4 << 20,), torch.uint8)
    assert small.shape == (100, 64) and a.shape == (100,) and b.shape == (4 << 20,)
    monkeypatch.setattr(hugepages, "_advised", real)
    monkeypatch.delenv(hugepages.ENV)
    if hugepages.enabled():  # and the same packing makes one where huge pages are lent
        with hugepages.packing():
            c = hugepages.empty((100,), torch.float32)
        mapping = _mapping_of(c.data_ptr())
        assert mapping is not None and mapping["THPeligible"] == "1"


def test_a_loaded_models_small_tiled_weights_and_scales_lie_on_advised_pages(tmp_path) -> None:
    """The loader packs: every tiled weight and scale of a quantized model (the tiny model's are all under
    2 MiB) lies in a mapping advised for huge pages, and the weights compute as before."""
    _require_huge_pages()
    from helexa.model.loader import load_model
    from helexa.model.quant.linear import QuantLinear
    from tests.support.models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama"), dtype="float32", quantization="int4")
    tiled = [t for m in model.modules() if isinstance(m, QuantLinear) for t in m.cpu_matmul.tiled or ()]
    assert tiled and all(t.numel() * t.element_size() < hugepages.HUGE_PAGE for t in tiled)
    for t in tiled:
        mapping = _mapping_of(t.data_ptr())
        assert mapping is not None and mapping["THPeligible"] == "1"
