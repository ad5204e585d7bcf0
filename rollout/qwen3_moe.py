"""`ParityQwen3MoeForCausalLM`: the parity Qwen3 (q/k RMSNorm, rollout.llama's attention) with
the sparse MoE block of rollout.llama.ParitySparseMoe in every layer `ModelSpec.is_moe_layer`
names (parity/moe.py: fp32 softmax router, stable top-k, each expert on its rows). TP 1 only
(parity.tp.check_tp refuses more). LoRA on the attention projections, the dense MLPs and every
expert's gate_proj / up_proj / down_proj (not the router)."""

from __future__ import annotations

from parity.model_spec import ModelSpec
from rollout.llama import ParityLlamaForCausalLM


class ParityQwen3MoeForCausalLM(ParityLlamaForCausalLM):
    """vLLM model class registered as `KimiRLParityQwen3MoeForCausalLM`."""

    hf_architecture = "Qwen3MoeForCausalLM"

    def _check_spec(self, spec: ModelSpec) -> None:
        if spec.arch != "qwen3-moe":
            raise ValueError(f"{type(self).__name__} computes Qwen3-MoE; got a {spec.arch} config")
