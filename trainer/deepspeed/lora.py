"""peft LoRA on the HF parity model (trainer.deepspeed.model): the DeepSpeed backend's adapters.

peft injects its LoRA layers and owns their parameters, names and save format; the parity
model's fused linears compute the deltas (trainer.deepspeed.model.fused_linear). Only adapter tensors
train. Adapters are fp32 (the optimizer's master copy; peft keeps them fp32 on a bf16 base) and
are cast to the model dtype in the forward, so `rollout_tensors` hands the rollout model the
very bits the trainer computes with, as trainer.megatron.lora does for Megatron.

The initial A matrices are drawn exactly as trainer.megatron.lora draws them (same seed, same order,
same shapes), so both trainer backends start from the same adapter bit for bit.

Slots: peft adapter names. The policy is peft's "default"; a PPO critic adds "critic" on the
same frozen base. Switching is by the layers' flags only (`_active`): peft's own
set_adapter / disable_adapter also flip requires_grad, which would freeze the slot that is
not in use (and DeepSpeed has hooked its parameters as trainable).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from parity.lora import FUSED_PARTS, part_shapes, peft_key
from parity.model_spec import ModelSpec

POLICY = "default"  # peft's default adapter name
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def lora_layers(model: nn.Module) -> Iterator[tuple[int, str, nn.Module]]:
    """(decoder layer index, HF target, peft LoRA layer) for every adapted linear, in layer
    order and, within a layer, parity.lora.FUSED_PARTS order (Megatron's init order)."""
    found = {}
    for name, module in model.named_modules():
        m = _LAYER_RE.search(name)
        if m is not None and hasattr(module, "lora_A"):
            found[(int(m[1]), m[2])] = module
    order = [t for parts in FUSED_PARTS.values() for t in parts]
    for layer, target in sorted(found, key=lambda k: (k[0], order.index(k[1]))):
        yield layer, target, found[(layer, target)]


def apply_lora(
    model: nn.Module, spec: ModelSpec, rank: int, alpha: float, targets: list[str], seed: int = 0,
    name: str = POLICY,
) -> nn.Module:
    """Freeze the base and add adapter `name` (peft LoRA, no dropout, B = 0) on `targets` of
    every layer; A is drawn from `seed` as trainer.megatron.lora.apply_lora draws it. Returns the peft
    model (the first call wraps `model`; later calls add a slot to the peft model given)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=sorted(targets), lora_dropout=0.0, bias="none",
        init_lora_weights=True, use_rslora=False, use_dora=False,
    )
    state = torch.random.get_rng_state()  # peft's own init draws from the global stream
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
    else:
        model = get_peft_model(model, config, adapter_name=name)
    torch.random.set_rng_state(state)
    for p in model.parameters():
        p.requires_grad_(False)
    _init_like_megatron(model, spec, name, rank, targets, seed)
    for _, p in adapter_parameters(model):  # every slot trains (peft froze the inactive ones)
        p.requires_grad_(True)
    return model


def _init_like_megatron(
    model: nn.Module, spec: ModelSpec, name: str, rank: int, targets: list[str], seed: int
) -> None:
    shapes = part_shapes(spec)
    layers = {(i, t): m for i, t, m in lora_layers(model) if name in m.lora_A}
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        for i in range(spec.num_layers):
            for target in (t for parts in FUSED_PARTS.values() for t in parts if t in targets):
                a = torch.empty(rank, shapes[target][0])
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # trainer.megatron.lora.LoRAAdapter's draw
                layer = layers[(i, target)]
                layer.lora_A[name].weight.copy_(a)
                layer.lora_B[name].weight.zero_()
    torch.random.set_rng_state(gen_state)


def adapter_parameters(model: nn.Module, name: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """(peft name, parameter) of slot `name` (every slot: None), in lora_layers order."""
    out = []
    for i, target, layer in lora_layers(model):
        for slot in layer.lora_A if name is None else [name]:
            if slot in layer.lora_A:
                for which in "AB":
                    param = getattr(layer, f"lora_{which}")[slot].weight
                    out.append((_slot_key(i, target, which, slot), param))
    return out


def _slot_key(layer: int, target: str, which: str, slot: str) -> str:
    key = peft_key(layer, target, which)
    return key if slot == POLICY else key.replace(f".lora_{which}.", f".lora_{which}.{slot}.")


def peft_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The policy adapter under peft's names (parity.lora.peft_key); dtype=None: fp32 masters."""
    return {
        k: p.detach() if dtype is None else p.detach().to(dtype)
        for k, p in adapter_parameters(model, POLICY)
    }


def rollout_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the rollout model must hold: the policy adapter in the model dtype, contiguous."""
    dtype = model.get_input_embeddings().weight.dtype
    return {k: v.contiguous() for k, v in peft_state_dict(model, dtype).items()}


def load_peft_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a policy adapter (peft names, every tensor of the slot) into the model."""
    params = dict(adapter_parameters(model, POLICY))
    if params.keys() != tensors.keys():
        missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
        raise ValueError(f"adapter names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k])


@contextlib.contextmanager
def _active(model: nn.Module, name: str | None):
    layers = [layer for _, _, layer in lora_layers(model)]
    previous = [(layer._active_adapter, layer._disable_adapters) for layer in layers]
    for layer in layers:
        layer._active_adapter, layer._disable_adapters = (name or POLICY), name is None
    try:
        yield
    finally:
        for layer, (active, disabled) in zip(layers, previous, strict=True):
            layer._active_adapter, layer._disable_adapters = active, disabled


def adapters_disabled(model: nn.Module):
    """The reference policy: the same model with every adapter off."""
    return _active(model, None)


def adapter_active(model: nn.Module, name: str):
    """Forward through slot `name` instead of the policy (layers without it run the base)."""
    return _active(model, name)
