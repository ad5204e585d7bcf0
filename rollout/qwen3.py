"""`ParityQwen3ForCausalLM`: the parity Llama plus Qwen3's per-head q/k RMSNorm before RoPE
(`ModelSpec.qk_norm`, read from the config; the layers in rollout.llama apply it)."""

from __future__ import annotations

from parity.model_spec import ModelSpec
from rollout.llama import ParityLlamaForCausalLM


class ParityQwen3ForCausalLM(ParityLlamaForCausalLM):
    """vLLM model class registered as `KimiRLParityQwen3ForCausalLM`."""

    hf_architecture = "Qwen3ForCausalLM"

    def _check_spec(self, spec: ModelSpec) -> None:
        if not spec.qk_norm:
            raise ValueError(f"{type(self).__name__} computes Qwen3; got a {spec.arch} config")
