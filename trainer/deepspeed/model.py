"""The HF transformers model (Llama / Qwen3) with its numerically relevant modules computing
through `parity.kernels`, in exactly the order the Megatron parity model and the vLLM parity
model run them, so its token log-probs are bitwise theirs.

HF's own module tree, parameter names and forward plumbing (decoder stack, residual adds,
`LlamaForCausalLM.forward`) stay; what changes is the arithmetic, by re-classing modules in
place (each keeps its parameters, so peft and DeepSpeed see an ordinary HF model):

    RMSNorm (every norm, Qwen3's q/k norm too)  -> kernels.rms_norm
    rotary embedding                            -> the parity RoPE table (kernels.rope_table)
    attention: q/k/v projections                -> one GEMM on the fused grouped QKV weight
               RoPE, causal GQA attention       -> kernels.apply_rope, kernels.attention
               o projection                     -> kernels.linear
    MLP: gate/up                                -> one GEMM on the fused [gate; up] weight
         SiLU-and-mul, down                     -> kernels.silu_and_mul, kernels.linear
    lm head                                     -> kernels.linear

Why fused GEMMs: both other engines multiply by the fused tensors of parity/layouts.py, and a
GEMM's blocking may depend on its output width, so three narrow GEMMs are not guaranteed to
give the wide one's bits on every CPU (on the machine this was written on they happen to).
The fused weights are re-packed from HF's q/k/v and gate/up parameters at every forward: a
copy of bytes, exact, and differentiable for a full fine-tune.

LoRA: a peft LoRA layer in place of a target linear (peft's `lora.Linear`, holding
`base_layer`, `lora_A`, `lora_B`) is read, not run: the fused linear adds
`parity.lora.fused_delta` of the active adapter, A and B cast to the model dtype, the trainer's
and the rollout's math (peft's own forward would compute the delta in the adapter's fp32).
`peft_model.disable_adapter()` switches the deltas off (the reference policy).

Scope: whole right-padded sequences from position 0 (teacher-forced scoring and training);
no KV cache, no generation (that runs in vLLM). The attention and MLP modules read their
children's weights without running them (`FUSED_READERS`): under DeepSpeed ZeRO-3 those weights
are registered as their external parameters (trainer.deepspeed.engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from parity import kernels, layouts, tp
from parity.lora import FUSED_PARTS, fused_delta, part_shapes
from parity.model_spec import KimiSpec, ModelSpec, load_spec
from parity.sampling import Sampling
from parity.scoring import batched_logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RopeInput(NamedTuple):
    """What the parity rotary embedding hands each layer in place of HF's (cos, sin)."""

    positions: torch.Tensor  # [S] positions of every sequence of the batch: 0 .. S-1
    table: tuple[torch.Tensor, torch.Tensor]  # kernels.rope_table


class ParityRotaryEmbedding(nn.Module):
    """Replaces HF's rotary embedding: the parity table, built once from the config (no
    registered buffer: DeepSpeed's dtype casts must not touch the fp32 table)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.table = kernels.rope_table(spec.head_dim, spec.rope_theta, spec.max_position_embeddings)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> RopeInput:
        s = x.shape[1]
        positions = torch.arange(s, device=position_ids.device)
        # The attention kernel finds a key by its index in the sequence, so positions must be
        # 0 .. S-1 (right padding, no KV cache), as in the Megatron parity model.
        if not bool((position_ids == positions).all()):
            raise ValueError("the parity model scores whole sequences: position_ids must be 0 .. S-1")
        return RopeInput(positions, self.table)


class ParityRMSNorm(nn.Module):
    """Re-class target for LlamaRMSNorm / Qwen3RMSNorm (`weight`, `variance_epsilon`)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.variance_epsilon)


class ParityLinear(nn.Linear):
    """Re-class target for the lm head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


def _base_linear(module: nn.Module) -> nn.Linear:
    return getattr(module, "base_layer", module)  # a peft LoRA layer wraps the original


def _active_pairs(
    modules: dict[str, nn.Module], dtype: torch.dtype
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """(pairs of the active peft adapter by HF target, its scaling) over a fused linear's
    parts; ({}, 0.0) without one. trainer.deepspeed.lora checks adapters when it attaches them
    (plain LoRA, no dropout, one scaling)."""
    pairs, scaling = {}, 0.0
    for name, m in modules.items():
        if not hasattr(m, "lora_A") or m.disable_adapters:
            continue
        if m.merged:
            raise ValueError(f"{name}: a merged peft adapter changes the base weights; unmerge it")
        active = [a for a in m.active_adapters if a in m.lora_A]
        if len(active) > 1:
            raise ValueError(f"{name}: the parity model runs one active adapter, got {active}")
        if active:
            a = active[0]
            pairs[name] = (m.lora_A[a].weight.to(dtype), m.lora_B[a].weight.to(dtype))
            scaling = m.scaling[a]
    return pairs, scaling


def fused_linear(fused: str, x: torch.Tensor, owner: nn.Module, spec: ModelSpec) -> torch.Tensor:
    """linear(x, W_fused) (+ the active adapter's fused delta) for fused linear `fused` of
    parity.lora.FUSED_PARTS, whose HF target modules are attributes of `owner`."""
    modules = {n: getattr(owner, n) for n in FUSED_PARTS[fused]}
    weights = [_base_linear(m).weight for m in modules.values()]
    if fused == "qkv":
        weight = layouts.pack_qkv(*weights, spec.num_kv_heads)
    elif fused == "gate_up":
        weight = layouts.pack_gate_up(*weights)
    else:
        weight = weights[0]
    # The row-parallel layers' K-order, as every engine at every TP size computes them.
    out = kernels.linear(x, weight, k_splits=tp.fused_k_splits(spec, fused))
    pairs, scaling = _active_pairs(modules, x.dtype)
    if not pairs:
        return out
    out_features = {n: o for n, (_, o) in part_shapes(spec).items()}
    return out + fused_delta(fused, x, pairs, scaling, out_features, spec.num_kv_heads)


class ParityAttention(nn.Module):
    """Re-class target for LlamaAttention / Qwen3Attention (q/k/v/o_proj, Qwen3: q/k_norm);
    `parity_spec` is set when re-classed. The Megatron parity model's order: fused QKV (+ LoRA),
    split per KV group, (Qwen3) q/k RMSNorm, RoPE, attention, o-proj (+ LoRA)."""

    parity_spec: ModelSpec

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: RopeInput,
        attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs,
    ) -> tuple[torch.Tensor, None]:
        # attention_mask is not needed: sequences are right-padded and attention is causal, so
        # padding never reaches a scored position (as in the Megatron parity model).
        if past_key_values is not None:
            raise ValueError("the parity model has no KV cache: generation runs in vLLM")
        spec = self.parity_spec
        b, s, _ = hidden_states.shape
        nh, ng, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        mixed = fused_linear("qkv", hidden_states, self, spec)
        q, k, v = layouts.split_qkv(mixed, nh, ng, d)  # [B, S, heads, D]
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions, table = position_embeddings
        positions = positions.repeat(b)
        q = kernels.apply_rope(q.reshape(b * s, nh, d), positions, table)
        k = kernels.apply_rope(k.reshape(b * s, ng, d), positions, table).view(b, s, ng, d)
        seq = torch.arange(b, device=positions.device).repeat_interleave(s)
        out = kernels.attention(q, k, v, seq, positions, kernels.attention_scale(d))
        return fused_linear("o", out.view(b, s, nh * d), self, spec), None


class ParityMLP(nn.Module):
    """Re-class target for LlamaMLP / Qwen3MLP: fused [gate; up] (+ LoRA), SiLU-and-mul,
    down (+ LoRA)."""

    parity_spec: ModelSpec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.parity_spec
        h = kernels.silu_and_mul(fused_linear("gate_up", x, self, spec))
        return fused_linear("down", h, self, spec)


# Modules that read their children's weights instead of running them (DeepSpeed ZeRO-3 must
# gather those weights for them: trainer.deepspeed.engine.register_external_weights), and the
# children they do run as modules (which gather their own).
FUSED_READERS = (ParityAttention, ParityMLP)
FUSED_RUN_AS_MODULES = (ParityRMSNorm,)


def to_parity(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Re-class an HF LlamaForCausalLM / Qwen3ForCausalLM in place (see module docstring)."""
    decoder = model.model
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, n) for n in FUSED_PARTS["qkv"] + FUSED_PARTS["o"]]
        linears += [getattr(mlp, n) for n in FUSED_PARTS["gate_up"] + FUSED_PARTS["down"]]
        if any(_base_linear(m).bias is not None for m in linears):
            raise ValueError("the parity model has no linear biases (attention_bias / mlp_bias)")
        attn.__class__, attn.parity_spec = ParityAttention, spec
        mlp.__class__, mlp.parity_spec = ParityMLP, spec
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.__class__ = ParityRMSNorm
    decoder.rotary_emb = ParityRotaryEmbedding(spec)
    model.lm_head.__class__ = ParityLinear
    # Megatron's embedding has no padding row: the pad token's embedding trains like any other.
    decoder.embed_tokens.padding_idx = None
    model.config.use_cache = False  # no KV cache (see ParityAttention)
    return model


def load_hf_model(model_dir: str | Path, dtype: str = "fp32") -> nn.Module:
    """The checkpoint as an HF transformers model computing through the parity kernels."""
    from transformers import AutoModelForCausalLM

    spec = load_spec(model_dir)
    if isinstance(spec, KimiSpec):
        raise ValueError("kimi-mini has no HF transformers model: use the Megatron trainer backend")
    if spec.num_experts:  # to_parity re-classes dense MLPs; a sparse MoE block has none
        raise ValueError("qwen3-moe has no HF parity model (DeepSpeed backend): use the Megatron trainer backend")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    return to_parity(model, spec)


def forward_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] for right-padded input_ids [B, S] (an HF model, its peft wrapper or a
    DeepSpeed engine around either)."""
    device = next(model.parameters()).device
    return model(input_ids=input_ids.to(device)).logits


def sequence_logprobs(
    model: nn.Module, sequences: list[list[int]], starts: list[int], batch_size: int = 8,
    sampling: Sampling | None = None,
) -> list[torch.Tensor]:
    """log p(seq[i] | seq[:i]) for i in [start, len) per sequence, float32, of the distribution
    `sampling` samples from (raw softmax: None); parity.scoring."""
    return batched_logprobs(lambda ids, _: forward_logits(model, ids), sequences, starts, batch_size, sampling)
