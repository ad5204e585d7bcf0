"""vLLM general plugin (entry point `vllm.general_plugins` -> `kimi_rl`).

vLLM calls `register()` in every process it starts (the caller, EngineCore, workers). It only
registers the parity architectures, lazily by qualified name, so nothing heavy is imported until
vLLM actually builds a parity model. Stock architectures are untouched: a parity model is chosen
per engine with `hf_overrides={"architectures": [PARITY_ARCHITECTURES[arch]]}`.
"""

from __future__ import annotations

# HF architecture -> the parity architecture name registered with vLLM.
PARITY_ARCHITECTURES = {
    "LlamaForCausalLM": "KimiRLParityLlamaForCausalLM",
    "Qwen3ForCausalLM": "KimiRLParityQwen3ForCausalLM",
    "KimiMiniForCausalLM": "KimiRLParityKimiMiniForCausalLM",
}

_MODEL_CLASSES = {
    "KimiRLParityLlamaForCausalLM": "rollout.llama:ParityLlamaForCausalLM",
    "KimiRLParityQwen3ForCausalLM": "rollout.qwen3:ParityQwen3ForCausalLM",
    "KimiRLParityKimiMiniForCausalLM": "rollout.kimi:ParityKimiMiniForCausalLM",
}


def register() -> None:
    """Register the parity models with vLLM's ModelRegistry (idempotent)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, qualname in _MODEL_CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, qualname)
    # kimi-mini's model_type is unknown to transformers; vLLM loads configs through AutoConfig
    # (in the caller's process, before any EngineCore unpickles the config).
    from rollout.kimi import register_config

    register_config()
