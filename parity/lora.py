"""LoRA math shared by both engines, on the fused layouts of parity/layouts.py.

An adapter is a set of (A [r, in], B [out, r]) pairs named by the HF module they adapt
(q_proj ... down_proj). On qwen3-moe the MLP targets adapt every expert of a sparse layer
(`mlp.experts.{e}.gate_proj` ..., the checkpoint's per-expert names; the router `mlp.gate`
takes no adapter) and the dense MLP of the other layers. Both engines compute a fused linear's
output (an expert's [gate; up] and down included) as

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


def layer_linears(spec, layer: int) -> list[tuple[str, int | None]]:
    """(fused, expert) of every linear of decoder layer `layer` that can hold an adapter, in the
    order both engines list them: qkv, o, then the dense MLP's gate_up, down (expert None) or, in
    a qwen3-moe sparse layer, each expert's gate_up, down (expert 0, 1, ...)."""
    out: list[tuple[str, int | None]] = [("qkv", None), ("o", None)]
    experts = range(spec.num_experts) if spec.is_moe_layer(layer) else (None,)
    return out + [(fused, e) for e in experts for fused in ("gate_up", "down")]


def adapter_shapes(spec, layout: AdapterLayout) -> dict[str, tuple[int, int]]:
    """{peft name: shape} of every tensor of a `layout` adapter on a Llama-family model, in the
    trainer's order (layer, fused linear of layer_linears, part, A before B:
    trainer.megatron.lora.peft_state_dict), so a sync's wire index (parity.wire) equals the
    reserved one."""
    out = {}
    for layer in range(spec.num_layers):
        for fused, expert in layer_linears(spec, layer):
            shapes = part_shapes(spec, expert=expert is not None)
            for target in (t for t in FUSED_PARTS[fused] if t in layout.targets):
                fan_in, fan_out = shapes[target]
                out[peft_key(layer, target, "A", expert)] = (layout.rank, fan_in)
                out[peft_key(layer, target, "B", expert)] = (fan_out, layout.rank)
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


def peft_key(layer: int, target: str, which: str, expert: int | None = None) -> str:
    """peft's state-dict name for a LoRA matrix (which: "A" | "B"); `expert` e names the MLP
    target of a sparse layer's expert e (`mlp.experts.{e}.gate_proj`, the checkpoint's module)."""
    block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    if expert is not None:
        block = f"mlp.experts.{expert}"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def part_shapes(spec, expert: bool = False) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each HF target for a parity.model_spec.ModelSpec; with
    `expert`, the MLP targets are a qwen3-moe expert's (moe_intermediate_size wide)."""
    h, i = spec.hidden_size, spec.moe_intermediate_size if expert else spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }
