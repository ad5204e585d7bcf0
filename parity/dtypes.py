"""The model dtypes kimi-rl runs, by the names users write (config `model.dtype`, `--dtype`):
one table for every package. Both engines compute in the same dtype."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a kimi-rl dtype name; ValueError names the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_string(name: str) -> str:
    """The HF / vLLM spelling ("float32", "bfloat16") of a kimi-rl dtype name."""
    return str(torch_dtype(name)).removeprefix("torch.")
