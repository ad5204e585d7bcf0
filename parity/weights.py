"""One name map per architecture: every tensor both engines hold, under its three names.

Like torchtitan's `state_dict_adapter.py`: `from_hf` builds the fused tensors from an HF
checkpoint, `to_hf` is its inverse, and both are derived from one table, `weight_map(spec)`.
Each entry is one tensor in the fused layout both sides hold (parity/layouts.py) with

- its Megatron-core state-dict name (the trainer, trainer/megatron/model.py and trainer/megatron/kimi.py),
- its name in the vLLM parity model (rollout/llama.py, rollout/kimi.py),
- the HF checkpoint tensors it is made of, in pack order, and how they are packed,
- how tensor parallelism shards it on each side (parity/tp.py; None = replicated).

The trainer's conversion (trainer/megatron/convert.py), the rollout model's weight loading and
full-weight sync, and the TP shard rules all read this table; nothing else spells a name.
Packing only moves bytes, so from_hf / to_hf round trips are bitwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from parity import kimi, layouts, tp
from parity.lora import FUSED_PARTS, part_shapes
from parity.model_spec import KimiSpec, ModelSpec

Side = Literal["megatron", "rollout"]
Pack = Literal["qkv", "gate_up", "conv"] | None
Shard = Literal["rows", "vocab", "cols", "gate_up"] | None


@dataclass(frozen=True)
class Weight:
    megatron: str
    rollout: str
    hf: tuple[str, ...]  # the HF tensors it is made of, in pack order
    pack: Pack = None  # None: the one HF tensor as it is
    megatron_shard: Shard = None
    rollout_shard: Shard = None

    def name(self, side: Side) -> str:
        return self.megatron if side == "megatron" else self.rollout

    def shard(self, side: Side) -> Shard:
        return self.megatron_shard if side == "megatron" else self.rollout_shard


def _dense(spec: ModelSpec) -> list[Weight]:
    # The embedding: Megatron's VocabParallelEmbedding shards vocabulary rows; the rollout
    # model replicates it (a lookup is exact whichever rank holds the row).
    out = [Weight("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                  ("model.embed_tokens.weight",), megatron_shard="vocab")]
    for i in range(spec.num_layers):
        m, r = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = r + "self_attn."
        out += [
            Weight(m + "input_layernorm.weight", r + "input_layernorm.weight", (r + "input_layernorm.weight",)),
            Weight(m + "self_attention.linear_qkv.weight", attn + "qkv_proj.weight",
                   (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                   "qkv", "rows", "rows"),
            Weight(m + "self_attention.linear_proj.weight", attn + "o_proj.weight",
                   (attn + "o_proj.weight",), None, "cols", "cols"),
        ]
        if spec.qk_norm:
            out += [
                Weight(m + "self_attention.q_layernorm.weight", attn + "q_norm.weight", (attn + "q_norm.weight",)),
                Weight(m + "self_attention.k_layernorm.weight", attn + "k_norm.weight", (attn + "k_norm.weight",)),
            ]
        out.append(Weight(m + "pre_mlp_layernorm.weight", r + "post_attention_layernorm.weight",
                          (r + "post_attention_layernorm.weight",)))
        if spec.is_moe_layer(i):
            out += _qwen3_moe_block(r + "mlp.", m + "mlp.", spec.num_experts)
            continue
        out += [
            Weight(m + "mlp.linear_fc1.weight", r + "mlp.gate_up_proj.weight",
                   (r + "mlp.gate_proj.weight", r + "mlp.up_proj.weight"), "gate_up", "gate_up", "gate_up"),
            Weight(m + "mlp.linear_fc2.weight", r + "mlp.down_proj.weight", (r + "mlp.down_proj.weight",),
                   None, "cols", "cols"),
        ]
    out.append(Weight("decoder.final_layernorm.weight", "model.norm.weight", ("model.norm.weight",)))
    if not spec.tie_word_embeddings:  # tied checkpoints store no lm_head (as HF saves them)
        out.append(Weight("output_layer.weight", "lm_head.weight", ("lm_head.weight",), None, "vocab", "vocab"))
    return out


def _qwen3_moe_block(hp: str, mp: str, num_experts: int) -> list[Weight]:
    """A Qwen3-MoE sparse block: the router and the experts, under Megatron's MoE names
    (router, experts.local_experts.{e}, as kimi-mini's), replicated under TP (qwen3-moe runs
    without it). Each expert's [gate; up] is fused as the dense MLP's."""
    out = [_same(hp + "gate.weight", mp + "router.weight")]
    for e in range(num_experts):
        out += _swiglu(f"{hp}experts.{e}.", f"{mp}experts.local_experts.{e}.")
    return out


def _same(hf: str, mg: str) -> Weight:
    """A weight both sides hold as one tensor, under its HF and its Megatron name."""
    return Weight(mg, hf, (hf,))


# Kimi Linear (published names; trainer/megatron/kimi.py's module names on the Megatron side):
# the KDA gate is low rank, the three depthwise convs are held stacked as one conv1d [3HD, K]
# ("conv" pack), the MoE lives under block_sparse_moe (router + e_score_correction_bias;
# experts w1/w3 fused as gate_up_proj, w2 held as down_proj) and the first
# first_k_dense_replace layers have a dense mlp. The rollout model holds these names with the
# fused ones renamed, as Megatron holds them. No TP.
_KIMI_LINEAR_KDA = {
    **{f"self_attn.{n}.weight": f"self_attention.linear_{n}.weight"
       for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj")},
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.dt_bias": "self_attention.dt_bias",
    "self_attn.A_log": "self_attention.A_log",
    "self_attn.o_norm.weight": "self_attention.o_norm.weight",
}


def _swiglu(hp: str, mp: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> list[Weight]:
    return [
        Weight(mp + "linear_fc1.weight", hp + "gate_up_proj.weight", (hp + gate + ".weight", hp + up + ".weight"),
               "gate_up"),
        Weight(mp + "linear_fc2.weight", hp + "down_proj.weight", (hp + down + ".weight",)),
    ]


def _kimi_linear_mla(spec: KimiSpec) -> dict[str, str]:
    """The MLA names (HF -> Megatron): the query full rank or, with q_lora_rank, low rank; the
    output gate with mla_use_output_gate; with index_topk the indexer of index_query_source."""
    out = {
        "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
        "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
        "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    }
    if not spec.q_lora_rank:
        out["self_attn.q_proj.weight"] = "self_attention.linear_q_proj.weight"
    else:
        out.update({
            "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
            "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
            "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
        })
    if spec.mla_output_gate:
        out["self_attn.g_proj.weight"] = "self_attention.linear_g_proj.weight"
    if spec.has_indexer and spec.index_query_source == "latent":
        out.update({
            "self_attn.indexer.wq_b.weight": "self_attention.indexer.linear_wq_b.weight",
            "self_attn.indexer.k_norm.weight": "self_attention.indexer.k_norm.weight",
            "self_attn.indexer.k_norm.bias": "self_attention.indexer.k_norm.bias",
        })
    elif spec.has_indexer:
        out["self_attn.indexer.wq.weight"] = "self_attention.indexer.linear_wq.weight"
    if spec.has_indexer:
        out.update({
            "self_attn.indexer.wk.weight": "self_attention.indexer.linear_wk.weight",
            "self_attn.indexer.weights_proj.weight": "self_attention.indexer.linear_weights_proj.weight",
        })
    return out


def _kimi_linear(spec: KimiSpec) -> list[Weight]:
    out = [_same("model.embed_tokens.weight", "embedding.word_embeddings.weight")]
    for i, kind in enumerate(spec.layer_types):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out += [_same(h + "input_layernorm.weight", m + "input_layernorm.weight"),
                _same(h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight")]
        if kind == "kda":
            out += [_same(h + hf, m + mg) for hf, mg in _KIMI_LINEAR_KDA.items()]
            out.append(Weight(m + "self_attention.conv1d.weight", h + "self_attn.conv1d.weight",
                              tuple(f"{h}self_attn.{c}.weight" for c in kimi.KIMI_LINEAR_CONVS), "conv"))
        else:
            out += [_same(h + hf, m + mg) for hf, mg in _kimi_linear_mla(spec).items()]
        if not spec.is_moe_layer(i):
            out += _swiglu(h + "mlp.", m + "mlp.")
            continue
        b = h + "block_sparse_moe."
        out += [_same(b + "gate.weight", m + "mlp.router.weight"),
                _same(b + "gate.e_score_correction_bias", m + "mlp.router.e_score_correction_bias")]
        for e in range(spec.n_routed_experts):
            out += _swiglu(f"{b}experts.{e}.", f"{m}mlp.experts.local_experts.{e}.", "w1", "w3", "w2")
        if spec.n_shared_experts:
            out += _swiglu(b + "shared_experts.", m + "mlp.shared_experts.")
    out.append(_same("model.norm.weight", "decoder.final_layernorm.weight"))
    if not spec.tie_word_embeddings:
        out.append(_same("lm_head.weight", "output_layer.weight"))
    return out


def weight_map(spec: ModelSpec | KimiSpec) -> list[Weight]:
    """Every tensor of the model, in checkpoint order."""
    if isinstance(spec, KimiSpec):
        return _kimi_linear(spec)
    return _dense(spec)


def pack(weight: Weight, parts: list[torch.Tensor], spec: ModelSpec | KimiSpec) -> torch.Tensor:
    """The fused tensor of `weight` from its HF parts (in `weight.hf` order)."""
    if weight.pack == "qkv":
        return layouts.pack_qkv(*parts, spec.num_kv_heads)
    if weight.pack == "gate_up":
        return layouts.pack_gate_up(*parts)
    if weight.pack == "conv":  # q/k/v depthwise [HD, 1, K] each -> [3HD, K]
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts])
    (tensor,) = parts
    return tensor


def unpack(weight: Weight, tensor: torch.Tensor, spec: ModelSpec | KimiSpec) -> tuple[torch.Tensor, ...]:
    """Inverse of pack: the HF parts of a fused tensor."""
    if weight.pack == "qkv":
        return layouts.unpack_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if weight.pack == "gate_up":
        return layouts.unpack_gate_up(tensor)
    if weight.pack == "conv":
        return tuple(p.unsqueeze(1).contiguous() for p in tensor.chunk(len(weight.hf)))
    return (tensor,)


def from_hf(hf: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec, side: Side) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> the fused tensors under `side`'s names."""
    return {w.name(side): pack(w, [hf[n] for n in w.hf], spec) for w in weight_map(spec)}


def to_hf(fused: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec, side: Side) -> dict[str, torch.Tensor]:
    """Inverse of from_hf."""
    out = {}
    for w in weight_map(spec):
        out.update(zip(w.hf, unpack(w, fused[w.name(side)], spec), strict=True))
    return out


def rename(
    tensors: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec, src: Side, dst: Side
) -> dict[str, torch.Tensor]:
    """The same fused tensors under the other side's names (no copy: both hold one layout).
    Megatron's `_extra_state` entries are not weights and are dropped."""
    names = {w.name(src): w.name(dst) for w in weight_map(spec)}
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_extra_state"):
            continue
        if name not in names:
            raise ValueError(f"no {dst} tensor for {src} weight {name!r}")
        out[names[name]] = tensor
    return out


def shard_kinds(spec: ModelSpec | KimiSpec, side: Side) -> dict[str, Shard]:
    """{name on `side`: how tensor parallelism shards it (None: replicated)}."""
    return {w.name(side): w.shard(side) for w in weight_map(spec)}


def shard_tensor(t: torch.Tensor, kind: Shard, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard of a full tensor (parity/tp.py layouts)."""
    if size == 1 or kind is None:
        return t
    if kind == "rows":
        return tp.shard_rows(t, rank, size)
    if kind == "vocab":
        return tp.shard_vocab(t, rank, size)
    if kind == "cols":
        return tp.shard_cols(t, rank, size)
    return tp.shard_gate_up(t, rank, size)


def unshard_tensor(shards: list[torch.Tensor], kind: Shard, vocab: int | None = None) -> torch.Tensor:
    """Inverse of shard_tensor over every rank's shard, in rank order (`vocab`: the unpadded
    row count of a "vocab" shard)."""
    if kind is None:
        return shards[0]
    if kind == "gate_up":
        return tp.unshard_gate_up(shards)
    if kind == "vocab":
        return torch.cat(shards, dim=0)[:vocab]
    return torch.cat(shards, dim=0 if kind == "rows" else 1)


def shard_state(
    tensors: dict[str, torch.Tensor], spec: ModelSpec | KimiSpec, side: Side, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """A full state dict (`side`'s names) -> rank `rank`'s shards."""
    kinds = shard_kinds(spec, side)
    return {n: shard_tensor(t, kinds.get(n), rank, size) for n, t in tensors.items()}


# Names a checkpoint may carry that are not weights (HF's non-persistent RoPE buffers).
IGNORED_HF = re.compile(r"rotary_emb\.inv_freq$|rotary_emb\.(cos|sin)_cached$")


def _dense_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, shapes = spec.hidden_size, part_shapes(spec)
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        base = f"model.layers.{i}."
        out[base + "input_layernorm.weight"] = (h,)
        out[base + "post_attention_layernorm.weight"] = (h,)
        moe = spec.is_moe_layer(i)
        for target, (fan_in, fan_out) in shapes.items():
            attention = target in FUSED_PARTS["qkv"] + FUSED_PARTS["o"]
            if attention or not moe:
                out[f"{base}{'self_attn' if attention else 'mlp'}.{target}.weight"] = (fan_out, fan_in)
        if moe:
            out[base + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                out.update(kimi._swiglu_shapes(f"{base}mlp.experts.{e}.", h, spec.moe_intermediate_size))
        if spec.qk_norm:
            out[base + "self_attn.q_norm.weight"] = (spec.head_dim,)
            out[base + "self_attn.k_norm.weight"] = (spec.head_dim,)
    return out


def hf_shapes(spec: ModelSpec | KimiSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a checkpoint may hold for `spec`, by HF name (lm_head too:
    a tied model skips it on load)."""
    return kimi.hf_weight_shapes(spec) if isinstance(spec, KimiSpec) else _dense_hf_shapes(spec)


def check_hf_weights(spec: ModelSpec | KimiSpec, named: dict[str, torch.Tensor]) -> None:
    """ValueError unless `named` is a set of known HF weights with the right shapes, whose fused
    groups (q/k/v, gate/up of a layer or an expert) are complete. Checked before an in-place
    reload starts: vLLM's reload moves the parameters to the meta device first, so a load that
    fails half-way would leave the model without weights."""
    shapes = hf_shapes(spec)
    fused_of = {n: w for w in weight_map(spec) if w.pack for n in w.hf}
    groups: dict[str, set[str]] = {}
    for name, tensor in named.items():
        if IGNORED_HF.search(name):
            continue
        if name not in shapes:
            raise ValueError(f"unexpected weight {name!r}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {shapes[name]}")
        if name in fused_of:
            groups.setdefault(fused_of[name].rollout, set()).add(name)
    for fused, parts in sorted(groups.items()):
        wanted = set(next(w.hf for w in weight_map(spec) if w.rollout == fused))
        if parts != wanted:
            raise ValueError(f"{fused}: {sorted(wanted - parts)} missing, fused with {sorted(parts)}")
