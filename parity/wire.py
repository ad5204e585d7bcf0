"""The wire format of a trainer -> rollout sync: every tensor's bytes in one flat buffer plus an
index. Ray moves one numpy buffer through its object store without pickling tensors one by one
(an adapter is hundreds of them), the receiver reads the tensors back as views, and a rollout
model that already holds an adapter in the same layout takes a whole sync as one copy.

The alignment gaps between tensors are zero, so a buffer's bytes are a function of its tensors
alone and one digest of the whole buffer (`digest`, XXH3-128) verifies a sync: the sender hashes
what it packed, each receiver what it holds, and only a mismatch needs per-tensor checksums (to
name the tensor). `digest_tensors` gives the same digest from tensors held apart (full weights
held as separate parameters)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

Index = tuple[tuple[str, str, tuple[int, ...], int, int], ...]  # name, dtype, shape, offset, nbytes
ALIGN = 64  # every tensor starts aligned, so views of any dtype need no copy


@dataclass(frozen=True)
class Packed:
    """A packed sync payload as its sender announces it. `data` is (flat, index) itself or a
    handle to it in a transport's store (a Ray ObjectRef): receivers resolve it, and a driver
    between the two forwards the handle without reading the bytes. `digest` is digest(flat),
    computed once by the sender; `nbytes` the tensors' bytes (gaps excluded)."""

    data: Any
    digest: str
    nbytes: int


def packed(tensors: dict[str, torch.Tensor], store: Callable[[Any], Any] = lambda data: data) -> Packed:
    """pack_tensors, with the digest and size of the result; `store` turns (flat, index) into
    the data a receiver resolves (ray.put: a handle to it in the object store)."""
    flat, index = pack_tensors(tensors)
    return Packed(store((flat, index)), digest(flat), payload_bytes(index))


_GAP = torch.zeros(ALIGN, dtype=torch.uint8)


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, Index]:
    index = _index((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    flat = torch.empty(_nbytes(index), dtype=torch.uint8)
    pieces = []
    for (_, _, _, _, nbytes), t in zip(index, tensors.values(), strict=True):
        pieces.append(t.detach().contiguous().view(-1).view(torch.uint8))
        pieces.append(_GAP[: _padded(nbytes) - nbytes])  # zeros, so digest() sees the tensors only
    if pieces:
        torch.cat(pieces, out=flat)  # one call: half the time of a slice assignment per tensor
    return flat.numpy(), index


def digest(flat: np.ndarray | torch.Tensor | bytes) -> str:
    """XXH3-128 (hex) of a packed buffer's bytes: what one sync verifies, in one pass over the
    buffer (it guards against corruption and stale buffers, not against an adversary)."""
    buf = as_bytes_tensor(flat)
    return xxhash.xxh3_128_hexdigest(buf.detach().cpu().contiguous().numpy())


def digest_tensors(tensors: Iterable[torch.Tensor]) -> str:
    """digest() of the buffer pack_tensors would make of these tensors (in this order),
    computed from the tensors where they are, without packing them."""
    h = xxhash.xxh3_128()
    for t in tensors:
        raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
        h.update(raw.numpy())
        h.update(bytes(_padded(raw.numel()) - raw.numel()))
    return h.hexdigest()


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
        offset += _padded(nbytes)
    return tuple(out)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(index: Index) -> int:
    if not index:
        return 0
    _, _, _, start, nbytes = index[-1]
    return start + _padded(nbytes)


def payload_bytes(index: Index) -> int:
    """The size of the tensors an index describes (their bytes, gaps excluded)."""
    return sum(entry[4] for entry in index)


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
