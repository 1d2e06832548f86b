"""A safetensors file read by positioned reads (`os.preadv`), never memory-mapped.

Why not mmap: a mapped file's pages count in the process's resident set while they stay mapped, so
reading a whole checkpoint through one mapping holds the file (as RssFile) and the copies made from
it (as anonymous memory) at once: a peak of twice the weights, for a quantized model whose kernel
then keeps a third layout. Here every read is one copy from the page cache into a tensor the caller
owns; the file's pages stay in the page cache (reclaimable, not this process's RSS), so the peak is
the tensors the caller keeps.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data, offsets relative to its start, row-major. `TensorFile` checks every entry against the file
(dtype known, offsets inside the data and matching dtype x shape) when it opens it, and raises
`ValueError` naming the file and the entry otherwise.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["TensorFile", "TensorInfo"]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # the format's own limit on the header's size


class TensorInfo(NamedTuple):
    """One tensor's entry in the header: dtype, shape, and its bytes' position in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class TensorFile:
    """An open safetensors file (a context manager). `read(name)` returns a new tensor with the
    tensor's values; `read(name, (dim, start, stop))` only that slice of its rows (dim 0) or of a 2-D
    tensor's columns (dim 1), reading only its bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.infos = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{self.path} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{self.path} is not a safetensors file (header length {length}, file {size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.path} has an unreadable safetensors header: {exc}") from exc
        if not isinstance(header, dict):
            raise ValueError(f"{self.path} has a safetensors header that is not an object")
        start, data = 8 + length, size - 8 - length
        infos = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(v) for v in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{self.path}: tensor {name!r} has a bad header entry {entry!r}") from exc
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if not 0 <= begin <= end <= data or end - begin != nbytes or any(d < 0 for d in shape):
                raise ValueError(
                    f"{self.path}: tensor {name!r} ({entry['dtype']} {list(shape)}) has data offsets "
                    f"{[begin, end]} that do not fit its {nbytes} bytes inside the {data} bytes of data"
                )
            infos[name] = TensorInfo(dtype, shape, start + begin, nbytes)
        return infos

    def keys(self) -> list[str]:
        """The tensors' names, in the header's order."""
        return list(self.infos)

    def read(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (KeyError if the file has none), or its `(dim, start, stop)` slice (dim 0: of
        any tensor with dimensions; dim 1: of a 2-D tensor's columns), as a new contiguous CPU tensor."""
        info = self.infos[name]
        if part is None:
            out = torch.empty(info.shape, dtype=info.dtype)
            self._fill(out, info.offset)
            return out
        dim, begin, end = part
        shape = info.shape
        if not (dim == 0 < len(shape) or dim == 1 == len(shape) - 1) or not 0 <= begin <= end <= shape[dim]:
            raise ValueError(f"{self.path}: slice {part} of tensor {name!r} {list(shape)}")
        item = torch.empty((), dtype=info.dtype).element_size()
        if dim == 0:
            out = torch.empty(end - begin, *shape[1:], dtype=info.dtype)
            self._fill(out, info.offset + begin * math.prod(shape[1:]) * item)
            return out
        rows, cols = shape
        out = torch.empty(rows, end - begin, dtype=info.dtype)
        for r in range(rows):  # one read per row of the columns kept
            self._fill(out[r], info.offset + (r * cols + begin) * item)
        return out

    def _fill(self, out: torch.Tensor, offset: int) -> None:
        """Read `out.nbytes` bytes at `offset` into the contiguous tensor `out`."""
        view = out.reshape(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self.path} ended {len(view) - done} bytes early (truncated)")
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
