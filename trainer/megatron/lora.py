"""LoRA on the Megatron trainer: adapter modules attached to the parity linears.

Only adapter parameters train (the base is frozen). Parameters are kept in fp32 (the
optimizer's master copy); the forward casts them to the model dtype, and `rollout_tensors`
hands out exactly those cast tensors, so the rollout model computes with the same bits. The
reference policy is the base model with adapters switched off (`adapters_disabled`), not a
second model copy. `peft_state_dict` / `save_peft` write peft's format, loadable by HF
transformers + peft and by vLLM's --enable-lora.

A linear can hold several named adapters ("slots", see trainer.megatron.layers) with one active at a
time: the policy ("policy", active by default) and e.g. a PPO critic ("critic") that shares
the frozen base. `adapter_active` switches slots for a forward.

qwen3-moe: the MLP targets attach to every expert's linear_fc1 / linear_fc2 of a sparse layer
(trainer.megatron.model.ExpertLinear, or stock Megatron's expert linears with the hook), one
adapter per expert, named by parity.lora.peft_key with the expert's index; the router takes none.

kimi-mini (a KimiSpec; trainer/kimi.py): adapters attach to each KimiLinear with a targeted
part (targets from parity.kimi.LORA_TARGETS) and carry peft names from parity.kimi.peft_name;
the functions here dispatch on the spec / model, the dense paths are unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from megatron.core.models.gpt import GPTModel

from parity.lora import FUSED_PARTS, fused_delta, part_shapes, peft_key
from parity.model_spec import KimiSpec, ModelSpec
from trainer.megatron import kimi as kimi_lib
from trainer.megatron.layers import POLICY_ADAPTER, with_lora_hook

# Megatron module (relative to a decoder layer) of each fused linear.
FUSED_MODULES = {
    "qkv": "self_attention.linear_qkv",
    "o": "self_attention.linear_proj",
    "gate_up": "mlp.linear_fc1",
    "down": "mlp.linear_fc2",
}


class LoRAAdapter(torch.nn.Module):
    """A/B pairs for the HF targets of one fused linear (`expert` e: of a qwen3-moe expert)."""

    def __init__(
        self, fused: str, targets: list[str], spec: ModelSpec, rank: int, alpha: float, expert: int | None = None,
    ):
        super().__init__()
        self.fused = fused
        self.expert = expert
        self.scaling = alpha / rank
        self.num_kv_heads = spec.num_kv_heads
        shapes = part_shapes(spec, expert is not None)
        self.out_features = {n: shapes[n][1] for n in FUSED_PARTS[fused]}
        self.names = [n for n in FUSED_PARTS[fused] if n in targets]
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for name in self.names:
            fan_in, fan_out = shapes[name]
            a = torch.empty(rank, fan_in)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's default init
            self.lora_A[name] = torch.nn.Parameter(a)
            self.lora_B[name] = torch.nn.Parameter(torch.zeros(fan_out, rank))

    def pairs(self, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {n: (self.lora_A[n].to(dtype), self.lora_B[n].to(dtype)) for n in self.names}

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        return fused_delta(
            self.fused, x, self.pairs(x.dtype), self.scaling, self.out_features, self.num_kv_heads
        )


def apply_lora(
    model: GPTModel, spec: ModelSpec | KimiSpec, rank: int, alpha: float, targets: list[str], seed: int = 0,
    name: str = POLICY_ADAPTER,
) -> None:
    """Freeze the base and attach adapters in slot `name` to every layer's fused linears
    (stock linears of a parity=False model get the hook first). The adapters' random init
    draws from `seed` alone."""
    for n, p in model.named_parameters():
        if ".lora." not in n:  # adapters already attached in other slots keep training
            p.requires_grad_(False)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    if isinstance(spec, KimiSpec):  # kimi-mini: every KimiLinear with a targeted part
        attach = [(linear, kimi_lib.KimiLoRAAdapter(linear, targets, rank, alpha))
                  for _, linear in kimi_lib.adaptable_linears(model, targets)]
    else:
        spec.check_lora_targets(targets)  # qwen3-moe: never the router
        attach = [
            (with_lora_hook(linear), LoRAAdapter(fused, targets, spec, rank, alpha, expert))
            for layer in model.decoder.layers
            for fused, expert, linear in _layer_linears(layer)
            if any(t in targets for t in FUSED_PARTS[fused])
        ]
    for linear, adapter in attach:
        if getattr(linear, "lora", None) is None:
            linear.lora = torch.nn.ModuleDict()
        # Drawn on the host (the same init on any device), then moved to the layer's device.
        linear.lora[name] = adapter.to(next(linear.parameters()).device)
    torch.random.set_rng_state(gen_state)


def _layer_linears(layer: torch.nn.Module) -> Iterator[tuple[str, int | None, torch.nn.Module]]:
    """(fused, expert, linear) of a decoder layer, in parity.lora.layer_linears order: the
    attention's, then the dense MLP's (expert None) or each expert's of a sparse block (the
    parity SparseMoE or stock Megatron's MoE: both hold `experts.local_experts`)."""
    yield "qkv", None, layer.get_submodule(FUSED_MODULES["qkv"])
    yield "o", None, layer.get_submodule(FUSED_MODULES["o"])
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        yield "gate_up", None, layer.get_submodule(FUSED_MODULES["gate_up"])
        yield "down", None, layer.get_submodule(FUSED_MODULES["down"])
        return
    for e, expert in enumerate(experts.local_experts):
        yield "gate_up", e, expert.linear_fc1
        yield "down", e, expert.linear_fc2


def _lora_linears(model: GPTModel):
    if kimi_lib.is_kimi(model):
        yield from kimi_lib.lora_linears_of(model)
        return
    for i, layer in enumerate(model.decoder.layers):
        for _, _, linear in _layer_linears(layer):
            if getattr(linear, "lora", None) is not None:
                yield i, linear


def adapters(model: GPTModel, name: str = POLICY_ADAPTER):
    """(layer index, adapter) for every adapter in slot `name`."""
    for i, linear in _lora_linears(model):
        if name in linear.lora:
            yield i, linear.lora[name]


def adapter_parameters(model: GPTModel, name: str = POLICY_ADAPTER) -> list[tuple[str, torch.nn.Parameter]]:
    """The (model-qualified name, parameter) pairs of slot `name`, in a fixed order."""
    return [(n, p) for n, p in model.named_parameters() if f".lora.{name}." in n]


@contextlib.contextmanager
def _active(model: GPTModel, name: str | None):
    linears = [linear for _, linear in _lora_linears(model)]
    previous = [linear.lora_active for linear in linears]
    for linear in linears:
        linear.lora_active = name
    try:
        yield
    finally:
        for linear, active in zip(linears, previous, strict=True):
            linear.lora_active = active


def adapters_disabled(model: GPTModel):
    """The reference policy: the same model with every adapter switched off."""
    return _active(model, None)


def adapter_active(model: GPTModel, name: str):
    """Forward through slot `name` instead of the policy (linears without it run the base)."""
    return _active(model, name)


def peft_state_dict(model: GPTModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The policy adapter's tensors under peft's names; dtype=None keeps the fp32 master copy."""
    out = {}
    for i, adapter in adapters(model):
        for name in adapter.names:
            a, b = adapter.lora_A[name].detach(), adapter.lora_B[name].detach()
            out[_peft_key(i, adapter, name, "A")] = a if dtype is None else a.to(dtype)
            out[_peft_key(i, adapter, name, "B")] = b if dtype is None else b.to(dtype)
    return out


def _peft_key(layer: int, adapter: torch.nn.Module, name: str, which: str) -> str:
    # kimi-mini adapters know their HF module paths (experts, MLA vs KDA projections).
    if isinstance(adapter, kimi_lib.KimiLoRAAdapter):
        return adapter.peft_key(name, which)
    return peft_key(layer, name, which, adapter.expert)


def rollout_tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """What the rollout model must hold: the adapter cast to the model dtype, contiguous."""
    dtype = model.embedding.word_embeddings.weight.dtype
    return {k: v.contiguous() for k, v in peft_state_dict(model, dtype).items()}


def load_peft_state_dict(model: GPTModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a peft adapter (peft names) into the attached adapters. ValueError, before any copy,
    unless the adapter holds exactly the pairs attached (an adapter of another model, or of
    other target modules, would otherwise be half loaded)."""
    slots = {_peft_key(i, adapter, name, which): (adapter, name, which)
             for i, adapter in adapters(model) for name in adapter.names for which in "AB"}
    missing, unexpected = sorted(slots.keys() - tensors.keys()), sorted(tensors.keys() - slots.keys())
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit this model's LoRA targets: {len(missing)} missing "
                         f"(first: {missing[:1]}), {len(unexpected)} unexpected (first: {unexpected[:1]})")
    with torch.no_grad():
        for key, (adapter, name, which) in slots.items():
            (adapter.lora_A if which == "A" else adapter.lora_B)[name].copy_(tensors[key])
