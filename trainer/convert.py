"""HF <-> Megatron-core state-dict conversion for Llama / Qwen3 (local-spec module names).

Layouts: Megatron's linear_qkv rows are grouped per KV head and linear_fc1 is [gate; up]
(parity/layouts.py). Both directions are pure re-arrangements, so a round trip is bitwise.
"""

from __future__ import annotations

import re

import torch

from parity.layouts import pack_gate_up, pack_qkv, unpack_gate_up, unpack_qkv
from parity.model_spec import ModelSpec


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = pack_qkv(
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
            hf[h + "self_attn.v_proj.weight"], spec.num_kv_heads,
        )
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        if spec.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = pack_gate_up(
            hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        )
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"]}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        q, k, v = unpack_qkv(
            mg[m + "self_attention.linear_qkv.weight"], spec.num_heads, spec.num_kv_heads,
            spec.head_dim,
        )
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        if spec.qk_norm:
            out[h + "self_attn.q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        gate, up = unpack_gate_up(mg[m + "mlp.linear_fc1.weight"])
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not spec.tie_word_embeddings:  # tied checkpoints store no lm_head (as HF saves them)
        out["lm_head.weight"] = mg["output_layer.weight"]
    return out


# Megatron names -> the rollout parity model's parameter names. Both sides hold the same fused
# tensors (QKV grouped per KV head, [gate; up]), so a full-weight sync needs no repacking.
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ROLLOUT_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def megatron_to_rollout(mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parity Megatron model's weights under the rollout parity model's parameter names."""
    out = {}
    for name, tensor in mg.items():
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output_layer.weight":
            out["lm_head.weight"] = tensor
        else:
            m = _LAYER.match(name)
            if m is None or m[2] not in _ROLLOUT_NAMES:
                raise ValueError(f"no rollout parameter for Megatron weight {name!r}")
            out[f"model.layers.{m[1]}.{_ROLLOUT_NAMES[m[2]]}"] = tensor
    return out
