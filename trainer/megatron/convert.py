"""HF <-> Megatron-core state dicts, and Megatron -> the rollout model's names: the trainer's
view of the one name map in parity/weights.py (dense Llama / Qwen3 and kimi-mini alike).
Pure re-arrangements: round trips are bitwise."""

from __future__ import annotations

import torch

from parity import weights
from parity.model_spec import KimiSpec, ModelSpec

Spec = ModelSpec | KimiSpec


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: Spec) -> dict[str, torch.Tensor]:
    return weights.from_hf(hf, spec, "megatron")


def megatron_to_hf(mg: dict[str, torch.Tensor], spec: Spec) -> dict[str, torch.Tensor]:
    return weights.to_hf(mg, spec, "megatron")


def megatron_to_rollout(mg: dict[str, torch.Tensor], spec: Spec) -> dict[str, torch.Tensor]:
    """The parity Megatron model's weights under the rollout parity model's parameter names:
    both hold the same fused tensors, so a full-weight sync needs no repacking."""
    return weights.rename(mg, spec, "megatron", "rollout")


def shard_megatron_state(mg: dict[str, torch.Tensor], spec: Spec, rank: int, size: int) -> dict[str, torch.Tensor]:
    """A full Megatron state dict -> tensor-parallel rank `rank`'s shards (parity/tp.py)."""
    return weights.shard_state(mg, spec, "megatron", rank, size)
