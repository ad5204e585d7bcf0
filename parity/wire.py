"""The wire format of a trainer -> rollout sync: every tensor's bytes in one flat buffer plus an
index. Ray moves one numpy buffer through its object store without pickling tensors one by one
(an adapter is hundreds of them), the receiver reads the tensors back as views, and a rollout
model that already holds an adapter in the same layout takes a whole sync as one copy."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

Index = tuple[tuple[str, str, tuple[int, ...], int, int], ...]  # name, dtype, shape, offset, nbytes
ALIGN = 64  # every tensor starts aligned, so views of any dtype need no copy


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, Index]:
    index = _index((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    flat = torch.empty(_nbytes(index), dtype=torch.uint8)
    for (_, _, _, start, nbytes), t in zip(index, tensors.values(), strict=True):
        flat[start : start + nbytes] = t.detach().contiguous().view(-1).view(torch.uint8)
    return flat.numpy(), index


def index_for(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> Index:
    """The index pack_tensors gives tensors of these names and shapes (in this order) and dtype."""
    return _index((name, dtype, tuple(shape)) for name, shape in shapes.items())


def empty_buffer(index: Index, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed flat buffer for `index`, on `device`."""
    return torch.zeros(_nbytes(index), dtype=torch.uint8, device=device)


def _index(entries) -> Index:
    out, offset = [], 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((name, str(dtype).removeprefix("torch."), shape, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(out)


def _nbytes(index: Index) -> int:
    if not index:
        return 0
    _, _, _, start, nbytes = index[-1]
    return start + -(-nbytes // ALIGN) * ALIGN


def as_bytes_tensor(flat: np.ndarray | torch.Tensor | bytes) -> torch.Tensor:
    """The flat buffer as a uint8 tensor, without copying (object-store memory is read-only:
    callers only read from it)."""
    if isinstance(flat, torch.Tensor):
        return flat
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read
        if isinstance(flat, bytes | bytearray | memoryview):
            return torch.frombuffer(flat, dtype=torch.uint8)
        return torch.from_numpy(flat)


def unpack_tensors(flat: np.ndarray | torch.Tensor | bytes, index: Index) -> dict[str, torch.Tensor]:
    """Views into `flat`, by name."""
    buf = as_bytes_tensor(flat)
    return {
        name: buf[start : start + nbytes].view(getattr(torch, dtype)).view(shape)
        for name, dtype, shape, start, nbytes in index
    }
