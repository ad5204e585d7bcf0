"""vLLM general plugin (entry point `vllm.general_plugins` -> `kimi_rl`).

vLLM calls `register()` in every process it starts (the caller, EngineCore, workers). It only
registers the parity architectures, lazily by qualified name, so nothing heavy is imported until
vLLM actually builds a parity model. Stock architectures are untouched: a parity model is chosen
per engine with `hf_overrides={"architectures": [parity_architecture(arch)]}`.
"""

from __future__ import annotations

from parity.hf_config import register_hf_config
from parity.model_spec import ARCHITECTURES, KIMI_MINI_ARCHITECTURE, parity_architecture
from rollout.vllm_patches import register_attention_backend, register_mamba_backend

ATTENTION_BACKEND = "KIMI_RL_PARITY"
KDA_BACKEND = "KIMI_RL_KDA"

_KIMI_CLASS = "rollout.kimi:ParityKimiLinearForCausalLM"
# The vLLM model class of each HF architecture: those of the registry
# (parity.model_spec.ARCHITECTURES; kimi-mini writes kimi-linear), and old kimi-mini
# directories' as an alias of the one Kimi class (its load_weights converts their tensors).
_MODEL_CLASSES = {
    ARCHITECTURES["llama"]: "rollout.llama:ParityLlamaForCausalLM",
    ARCHITECTURES["qwen3"]: "rollout.qwen3:ParityQwen3ForCausalLM",
    ARCHITECTURES["qwen3-moe"]: "rollout.qwen3_moe:ParityQwen3MoeForCausalLM",
    ARCHITECTURES["kimi-linear"]: _KIMI_CLASS,
    KIMI_MINI_ARCHITECTURE: _KIMI_CLASS,
}


def register() -> None:
    """Register the parity models with vLLM's ModelRegistry (idempotent)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for hf_arch, qualname in _MODEL_CLASSES.items():
        arch = parity_architecture(hf_arch)
        if arch not in supported:
            ModelRegistry.register_model(arch, qualname)
    # The backends' enum members, by qualified name (nothing imported): vLLM resolves a layer's
    # backend by member before it builds the model. Never raises (rollout/vllm_patches.py).
    register_attention_backend(ATTENTION_BACKEND, "rollout.attention.ParityAttentionBackend")
    register_mamba_backend(KDA_BACKEND, "rollout.kimi.ParityKdaBackend")
    # An old kimi-mini directory's model_type is unknown to transformers; vLLM loads configs
    # through AutoConfig (in the caller's process, before any EngineCore unpickles the config).
    register_hf_config()
