"""HF <-> Megatron-core state-dict conversion for Llama / Qwen3 (local-spec module names).

Layouts: Megatron's linear_qkv rows are grouped per KV head and linear_fc1 is [gate; up]
(parity/layouts.py). Both directions are pure re-arrangements, so a round trip is bitwise.
"""

from __future__ import annotations

import re

import torch

from parity.layouts import pack_gate_up, pack_qkv, unpack_gate_up, unpack_qkv
from parity.model_spec import KimiSpec, ModelSpec


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec) -> dict[str, torch.Tensor]:
    if isinstance(spec, KimiSpec):
        return _kimi_hf_to_megatron(hf, spec)
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


def megatron_to_hf(mg: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec) -> dict[str, torch.Tensor]:
    if isinstance(spec, KimiSpec):
        return _kimi_megatron_to_hf(mg, spec)
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


def megatron_to_rollout(
    mg: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec | None = None
) -> dict[str, torch.Tensor]:
    """The parity Megatron model's weights under the rollout parity model's parameter names
    (kimi-mini needs its spec: pass it; the dense layouts need none)."""
    if isinstance(spec, KimiSpec):
        return _kimi_megatron_to_rollout(mg, spec)
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


# --- kimi-mini (trainer/kimi.py module names) -----------------------------------------------------
# One-to-one tensors per layer: HF suffix -> Megatron suffix. The experts' gate / up are the only
# re-arrangement ([gate; up] into linear_fc1, parity.layouts.pack_gate_up), so round trips are
# bitwise here too.
_KIMI_COMMON = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_KIMI_MIXER = {
    "kda": {
        **{f"self_attn.{n}.weight": f"self_attention.linear_{n}.weight"
           for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj")},
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "self_attn.conv1d.weight": "self_attention.conv1d.weight",
        "self_attn.dt_bias": "self_attention.dt_bias",
        "self_attn.A_log": "self_attention.A_log",
        "self_attn.o_norm.weight": "self_attention.o_norm.weight",
    },
    "mla": {
        "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
        "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
        "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "self_attn.indexer.wq.weight": "self_attention.indexer.linear_wq.weight",
        "self_attn.indexer.wk.weight": "self_attention.indexer.linear_wk.weight",
        "self_attn.indexer.weights_proj.weight": "self_attention.indexer.linear_weights_proj.weight",
    },
}


def _kimi_names(spec: KimiSpec) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """({HF name: Megatron name} of the one-to-one tensors, [(HF prefix, Megatron prefix)] of
    the SwiGLU experts, routed and shared)."""
    names = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}
    if not spec.tie_word_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    ffns = []
    for i, kind in enumerate(spec.layer_types):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in {**_KIMI_COMMON, **_KIMI_MIXER[kind]}.items():
            names[h + hf_name] = m + mg_name
        ffns += [(f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}.") for e in range(spec.n_routed_experts)]
        ffns.append((f"{h}mlp.shared_experts.", f"{m}mlp.shared_experts."))
    return names, ffns


def _kimi_hf_to_megatron(hf: dict[str, torch.Tensor], spec: KimiSpec) -> dict[str, torch.Tensor]:
    names, ffns = _kimi_names(spec)
    out = {mg: hf[name] for name, mg in names.items()}
    for h, m in ffns:
        out[m + "linear_fc1.weight"] = pack_gate_up(hf[h + "gate_proj.weight"], hf[h + "up_proj.weight"])
        out[m + "linear_fc2.weight"] = hf[h + "down_proj.weight"]
    return out


def _kimi_megatron_to_hf(mg: dict[str, torch.Tensor], spec: KimiSpec) -> dict[str, torch.Tensor]:
    names, ffns = _kimi_names(spec)
    out = {name: mg[m] for name, m in names.items()}
    for h, m in ffns:
        out[h + "gate_proj.weight"], out[h + "up_proj.weight"] = unpack_gate_up(mg[m + "linear_fc1.weight"])
        out[h + "down_proj.weight"] = mg[m + "linear_fc2.weight"]
    return out


def _kimi_megatron_to_rollout(mg: dict[str, torch.Tensor], spec: KimiSpec) -> dict[str, torch.Tensor]:
    """The rollout kimi-mini model holds HF names, except that its experts keep [gate; up]
    fused as `gate_up_proj` (what Megatron's linear_fc1 holds): no repacking on a sync."""
    names, ffns = _kimi_names(spec)
    to_rollout = {m: name for name, m in names.items()}
    for h, m in ffns:
        to_rollout[m + "linear_fc1.weight"] = h + "gate_up_proj.weight"
        to_rollout[m + "linear_fc2.weight"] = h + "down_proj.weight"
    out = {}
    for name, tensor in mg.items():
        if name.endswith("_extra_state"):
            continue
        if name not in to_rollout:
            raise ValueError(f"no rollout parameter for Megatron weight {name!r}")
        out[to_rollout[name]] = tensor
    return out


def shard_megatron_state(
    mg: dict[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """A full Megatron state dict -> tensor-parallel rank `rank`'s shards (parity/tp.py layouts):
    QKV (whole KV groups), embedding and output layer (vocab rows) by rows, fc1 as
    [gate_r; up_r], proj/fc2 by columns; norms replicated."""
    from parity import tp

    if size == 1:
        return mg
    out = {}
    for name, tensor in mg.items():
        if name.endswith(("linear_qkv.weight", "word_embeddings.weight")) or name == "output_layer.weight":
            out[name] = tp.shard_rows(tensor, rank, size)
        elif name.endswith("linear_fc1.weight"):
            out[name] = tp.shard_gate_up(tensor, rank, size)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = tp.shard_cols(tensor, rank, size)
        else:
            out[name] = tensor
    return out
