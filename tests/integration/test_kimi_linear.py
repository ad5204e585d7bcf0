"""kimi-linear (the published Kimi Linear format) on both engines against the independent
reference, transformers' KimiLinearForCausalLM (pure-torch KDA path, on the CPU):

- the Megatron trainer's fp32 logits and the vLLM rollout's fp32 prompt log-probs match
  transformers within 1e-4 on random prompts (the reference's chunked KDA form, torch GEMMs and
  softmax sum in other orders, so the match is close, not bitwise);
- `kimi-rl parity check` is bitwise (fp32 and bf16, with a nonzero LoRA adapter on every
  target, peft names on the checkpoint's module names).

Prompts up to 130 tokens: longer than one 64-token attention block and than the reference's
64-token KDA chunk, so both walks cross a block boundary.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import (
    use_transformers_kimi_linear_config,
    write_random_adapter,
)
from tests.reference import (
    assert_bitwise_with_adapter,
    rollout_logprob_distances,
    trainer_logit_distances,
)

LENGTHS = (1, 2, 9, 70, 130)
TOLERANCE = 1e-4


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def _reference_model(model_dir: str):
    """transformers' KimiLinearForCausalLM on its pure-torch path (fla, if installed, would be
    picked first and needs a Triton GPU driver)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as mkl
    from transformers import AutoModelForCausalLM

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        fn = getattr(mkl, name)
        setattr(mkl, name, getattr(fn, "__wrapped__", fn))
    use_transformers_kimi_linear_config()
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


@pytest.fixture(scope="module")
def reference(model_factory):
    """(model dir, [logits [len, vocab] fp32 per sequence]) from transformers."""
    model_dir = model_factory("kimi-linear", "fp32")
    hf = _reference_model(model_dir)
    with torch.no_grad():
        logits = [hf(torch.tensor([s])).logits[0].float() for s in _sequences()]
    return model_dir, logits


def test_trainer_logits_match_transformers(reference, megatron):
    from trainer.megatron.model import load_model

    model_dir, expected = reference
    mg = load_model(model_dir, "fp32").eval()
    assert max(trainer_logit_distances(mg, _sequences(), expected)) < TOLERANCE


def test_rollout_prompt_logprobs_match_transformers(reference):
    model_dir, expected = reference
    assert max(rollout_logprob_distances(model_dir, _sequences(), expected)) < TOLERANCE


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parity_check_bitwise_with_lora(model_factory, tmp_path, dtype):
    model_dir = model_factory("kimi-linear", dtype)
    assert_bitwise_with_adapter(model_dir, dtype, tmp_path, write_random_adapter(model_dir, tmp_path / "adapter"))
