"""Old kimi-mini checkpoints (`KimiMiniForCausalLM`, model_type kimi_mini), read as kimi-linear.

kimi-mini is now a set of kimi-linear presets (one implementation, parity/kimi.py); directories
written before that still load: both engines pass the config.json and every checkpoint tensor
through the pure functions here, so nothing downstream knows the old names. The conversion keeps
the function bit for bit:

- KDA: the fused conv1d.weight [3HD, K] splits into q/k/v_conv1d [HD, 1, K]; A_log [H] becomes
  [1, 1, H, 1]; the full-rank output gate g_proj W becomes g_a_proj = W and g_b_proj = the
  identity (each output is x * 1 plus exact zeros, so the gate's bits are W x's).
- MoE: `mlp.` becomes `block_sparse_moe.`, routed experts' gate/up/down_proj become w1/w3/w2;
  e_score_correction_bias = zeros (x + 0 is x), one expert group, routed_scaling_factor 1,
  first_k_dense_replace 0 (every layer MoE).
- MLA: RoPE on (mla_use_nope false), full-rank q_proj (no q_lora_rank), kv_a_layernorm's eps
  the model's rms_norm_eps (kv_layernorm_eps), and kimi-mini's own indexer, which is not
  DeepSeek-V3.2's: index_query_source "hidden" (indexer.wq reads the hidden state; no k_norm,
  no RoPE, no weight scale), under the same tensor names.

Old kimi-mini LoRA adapters do not load: the rollout refuses one naming its first old module
(`linear_name` tells them: their routed experts' modules moved; kimi-mini never adapted g_proj
or its indexer).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

KIMI_MINI_ARCHITECTURE = "KimiMiniForCausalLM"
KIMI_LINEAR_ARCHITECTURE = "KimiLinearForCausalLM"
_LAYER_TYPES = ("kda", "mla")
# kimi-mini config keys that kimi-linear spells differently (kimi-mini -> kimi-linear); the KDA
# ones go under linear_attn_config.
_RENAMED = {
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts", "max_position_embeddings": "model_max_length",
}
_KDA_KEYS = {"kda_num_heads": "num_heads", "kda_head_dim": "head_dim", "kda_conv_size": "short_conv_kernel_size"}


def is_kimi_mini(config: dict[str, Any]) -> bool:
    """Whether a config.json dict is an old kimi-mini checkpoint's."""
    return (config.get("architectures") or [""])[0] == KIMI_MINI_ARCHITECTURE


def linear_attn_config(layer_types: list[str], num_heads: int, head_dim: int, conv_size: int) -> dict[str, Any]:
    """kimi-linear's linear_attn_config for a per-layer "kda" | "mla" pattern (1-based layer
    numbers, as published Kimi Linear configs count them); ValueError naming layer_types."""
    bad = [t for t in layer_types if t not in _LAYER_TYPES]
    if bad or not layer_types:
        raise ValueError(f"layer_types must list one of {_LAYER_TYPES} per layer, got {layer_types}")
    return dict(
        kda_layers=[i + 1 for i, t in enumerate(layer_types) if t == "kda"],
        full_attn_layers=[i + 1 for i, t in enumerate(layer_types) if t == "mla"],
        num_heads=num_heads, head_dim=head_dim, short_conv_kernel_size=conv_size,
    )


def linear_config(config: dict[str, Any]) -> dict[str, Any]:
    """An old kimi-mini config.json dict -> the kimi-linear config.json dict of the same function
    (other keys, the token ids and dtype among them, kept). ValueError naming a bad field."""
    layer_types = list(config["layer_types"])
    if len(layer_types) != config["num_hidden_layers"]:
        raise ValueError(f"layer_types must list {config['num_hidden_layers']} of {_LAYER_TYPES}, got {layer_types}")
    out = {k: v for k, v in config.items() if k not in _KDA_KEYS and k not in _RENAMED and k != "layer_types"}
    out.update({new: config[old] for old, new in _RENAMED.items()})
    out.update(
        architectures=[KIMI_LINEAR_ARCHITECTURE], model_type="kimi_linear",
        linear_attn_config=linear_attn_config(layer_types, *(config[k] for k in _KDA_KEYS)),
        num_key_value_heads=config["num_attention_heads"],
        max_position_embeddings=config["max_position_embeddings"],
        q_lora_rank=None, mla_use_nope=False, kv_layernorm_eps=config["rms_norm_eps"],
        kda_gate_rank=config["kda_num_heads"] * config["kda_head_dim"], index_query_source="hidden",
        first_k_dense_replace=0, moe_layer_freq=1, routed_scaling_factor=1.0, moe_renormalize=True,
        num_expert_group=1, topk_group=1, moe_router_activation_func="sigmoid",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )
    return out


_ROUTED = re.compile(r"^(.*\.layers\.\d+\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\b")
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SHARED_OR_GATE = re.compile(r"^(.*\.layers\.\d+\.)mlp\.(shared_experts\.|gate\.)")


def linear_name(name: str) -> str:
    """An old kimi-mini MoE name (tensor, module path or peft LoRA name) under kimi-linear's
    names; any other name unchanged (kimi-linear never has `mlp.experts` / `mlp.shared_experts` / `mlp.gate`)."""
    routed = _ROUTED.match(name)
    if routed:
        prefix, e, proj = routed.groups()
        return f"{prefix}block_sparse_moe.experts.{e}.{_EXPERT_NAMES[proj]}{name[routed.end():]}"
    return _SHARED_OR_GATE.sub(r"\1block_sparse_moe.\2", name)


def convert_tensor(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of an old kimi-mini checkpoint -> its kimi-linear tensors (exact: only moves
    bytes, adds the identity g_b_proj and a zero e_score_correction_bias). A name already in
    kimi-linear's form passes unchanged (a full export of a converted model keeps the old
    config.json next to kimi-linear tensors)."""
    if name.endswith("self_attn.conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        return [(f"{base}{c}_conv1d.weight", part.unsqueeze(1).contiguous())
                for c, part in zip("qkv", tensor.chunk(3), strict=True)]
    if name.endswith("self_attn.A_log") and tensor.dim() == 1:
        return [(name, tensor.reshape(1, 1, -1, 1))]
    if name.endswith("self_attn.g_proj.weight"):  # kimi-mini's only g_proj is KDA's output gate
        base = name[: -len("g_proj.weight")]
        eye = torch.eye(tensor.shape[0], dtype=tensor.dtype, device=tensor.device)
        return [(base + "g_a_proj.weight", tensor), (base + "g_b_proj.weight", eye)]
    new = linear_name(name)
    if ".mlp.shared_experts." in name and tensor.numel() == 0:
        return []  # n_shared_experts 0: kimi-mini stored a zero-width shared expert it never ran
    if name.endswith("mlp.gate.weight"):
        bias = torch.zeros(tensor.shape[0], dtype=tensor.dtype, device=tensor.device)
        return [(new, tensor), (new[: -len("weight")] + "e_score_correction_bias", bias)]
    return [(new, tensor)]


def linear_tensors(
    config: dict[str, Any], items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) items as kimi-linear ones: converted when `config` (its
    config.json dict) is an old kimi-mini's, else as they are."""
    if not is_kimi_mini(config):
        yield from items
        return
    for name, tensor in items:
        yield from convert_tensor(name, tensor)
