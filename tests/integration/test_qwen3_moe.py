"""qwen3-moe (Qwen3MoeForCausalLM) on both engines against the independent reference,
transformers' Qwen3MoeForCausalLM:

- the Megatron trainer's fp32 logits and the vLLM rollout's fp32 prompt log-probs match
  transformers within 1e-4 on random prompts (the reference routes with torch's softmax / topk
  and sums the experts in its own order, so the match is close, not bitwise);
- `kimi-rl parity check` is bitwise (bf16, with a nonzero LoRA adapter on the attention
  projections);
- tensor parallelism and LoRA on the experts are refused with one line naming the arch.

The tiny preset has layer 0 dense (mlp_only_layers) and layers 1-3 sparse (8 experts, top 2),
so both feed-forward paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.reference import (
    assert_bitwise_with_adapter,
    rollout_logprob_distances,
    trainer_logit_distances,
)

LENGTHS = (1, 2, 9, 70, 130)
TOLERANCE = 1e-4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def write_attention_adapter(model_dir: str, out_dir, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """A peft adapter on every attention projection of a dense-family model, A and B nonzero."""
    from parity.lora import part_shapes, peft_key
    from parity.model_spec import ModelSpec
    from trainer.checkpoint import peft_config, save_peft

    spec = ModelSpec.from_dir(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for target in ATTENTION:
            fan_in, fan_out = part_shapes(spec)[target]
            tensors[peft_key(layer, target, "A")] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[peft_key(layer, target, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.1
    save_peft(out_dir, tensors, peft_config(rank, alpha, ATTENTION, model_dir))
    return out_dir


@pytest.fixture(scope="module")
def reference(model_factory):
    """(model dir, [logits [len, vocab] fp32 per sequence]) from transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = model_factory("qwen3-moe", "fp32")
    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        logits = [hf.eval()(torch.tensor([s])).logits[0].float() for s in _sequences()]
    return model_dir, logits


def test_trainer_logits_match_transformers(reference, megatron):
    from trainer.megatron.model import SparseMoE, load_model

    model_dir, expected = reference
    mg = load_model(model_dir, "fp32").eval()
    assert [isinstance(layer.mlp, SparseMoE) for layer in mg.decoder.layers] == [False, True, True, True]
    assert max(trainer_logit_distances(mg, _sequences(), expected)) < TOLERANCE


def test_rollout_prompt_logprobs_match_transformers(reference):
    model_dir, expected = reference
    assert max(rollout_logprob_distances(model_dir, _sequences(), expected)) < TOLERANCE


def test_parity_check_bitwise_with_lora(model_factory, tmp_path):
    # bf16 only, so the file stays under 3 minutes on 2 cores (fp32: docs/qwen3_moe.md).
    dtype = "bf16"
    model_dir = model_factory("qwen3-moe", dtype)
    assert_bitwise_with_adapter(model_dir, dtype, tmp_path, write_attention_adapter(model_dir, tmp_path / "adapter"))


def test_tp_and_expert_lora_refused(model_factory, megatron):
    from parity.model_spec import ModelSpec
    from trainer.megatron import lora
    from trainer.megatron.model import build_gpt, load_model

    model_dir = model_factory("qwen3-moe", "fp32")
    spec = ModelSpec.from_dir(model_dir)
    with pytest.raises(ValueError, match="^qwen3-moe runs without tensor parallelism: tensor_parallel_size must be 1, got 2$"):
        build_gpt(spec, torch.float32, True, tp_size=2)
    mg = load_model(model_dir, "fp32")
    with pytest.raises(ValueError, match=r"^qwen3-moe: LoRA adapts the attention projections only .*; got gate_proj$"):
        lora.apply_lora(mg, spec, 4, 8.0, ["q_proj", "gate_proj"])
