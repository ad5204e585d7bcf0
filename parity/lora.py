"""LoRA math shared by both engines, on the fused layouts of parity/layouts.py.

An adapter is a set of (A [r, in], B [out, r]) pairs named by the HF module they adapt
(q_proj ... down_proj). Both engines compute a fused linear's output as

    out = linear(x, W_fused) + pack(linear(linear(x, A_part), B_part) * scaling per part)

with the same kernels, in the same order, on tensors of the model dtype, so the rollout
model and the trainer agree bitwise with the adapter on. Parts an adapter does not cover
contribute exact zeros. A fresh adapter (B = 0) therefore leaves the base outputs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity import kernels
from parity.layouts import pack_qkv_activations

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Which HF targets feed each fused linear, in layout order.
FUSED_PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AdapterLayout:
    """A LoRA adapter's form, fixed for a whole run: rank, targets and scaling (alpha / rank).
    A rollout engine that captures CUDA graphs holds a zero adapter of this form from before
    the capture on, and every sync copies into it (rollout/sync.py): a captured graph replays
    the buffers and the scaling it saw at capture."""

    rank: int
    targets: tuple[str, ...]
    scaling: float

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if not self.targets or unknown:
            raise ValueError(f"adapter targets must be a non-empty subset of {TARGETS}, got {self.targets}")
        if not math.isfinite(self.scaling):
            raise ValueError(f"adapter scaling must be finite, got {self.scaling}")

    def as_dict(self) -> dict:
        return {"rank": self.rank, "targets": list(self.targets), "scaling": self.scaling}

    @classmethod
    def from_dict(cls, d: dict) -> AdapterLayout:
        return cls(int(d["rank"]), tuple(d["targets"]), float(d["scaling"]))


def adapter_shapes(spec, layout: AdapterLayout) -> dict[str, tuple[int, int]]:
    """{peft name: shape} of every tensor of a `layout` adapter on a Llama-family model, in the
    trainer's order (layer, fused linear, part, A before B: trainer.megatron.lora.peft_state_dict),
    so a sync's wire index (parity.wire) equals the reserved one."""
    shapes = part_shapes(spec)
    out = {}
    for layer in range(spec.num_layers):
        for parts in FUSED_PARTS.values():
            for target in (t for t in parts if t in layout.targets):
                fan_in, fan_out = shapes[target]
                out[peft_key(layer, target, "A")] = (layout.rank, fan_in)
                out[peft_key(layer, target, "B")] = (fan_out, layout.rank)
    return out


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return kernels.linear(kernels.linear(x, a), b) * scaling


def fused_delta(
    fused: str, x: torch.Tensor, pairs: dict[str, Pair], scaling: float,
    out_features: dict[str, int], num_kv_heads: int,
) -> torch.Tensor | None:
    """The LoRA delta for fused linear `fused` ("qkv" | "o" | "gate_up" | "down"), or None when
    the adapter covers none of its parts. out_features gives each part's output size (for the
    zero parts)."""
    names = FUSED_PARTS[fused]
    if not any(n in pairs for n in names):
        return None
    parts = [
        lora_delta(x, *pairs[n], scaling) if n in pairs
        else x.new_zeros(*x.shape[:-1], out_features[n])
        for n in names
    ]
    if fused == "qkv":
        return pack_qkv_activations(*parts, num_kv_heads)
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def peft_key(layer: int, target: str, which: str) -> str:
    """peft's state-dict name for a LoRA matrix (which: "A" | "B")."""
    block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def part_shapes(spec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each HF target for a parity.model_spec.ModelSpec."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }
