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

from rl.checker import CheckArgs, run_check
from tests.conftest import (
    use_transformers_kimi_linear_config,
    write_prompt_file,
    write_random_adapter,
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
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model_dir, expected = reference
    mg = load_model(model_dir, "fp32").eval()
    seqs = _sequences()
    width = max(LENGTHS)
    padded = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # right padding, one batch
    with torch.no_grad():
        got = forward_logits(mg, padded).float()
    for i, (s, ref) in enumerate(zip(seqs, expected, strict=True)):
        diff = (got[i, : len(s)] - ref).abs().max().item()
        assert diff < TOLERANCE, (len(s), diff)


def test_rollout_prompt_logprobs_match_transformers(reference):
    from rollout.engine import RolloutEngine

    model_dir, expected = reference
    seqs = _sequences()
    engine = RolloutEngine(model_dir, dtype="fp32", multiprocess=False, max_model_len=512,
                           max_num_batched_tokens=64)  # chunked prefill, mixed steps
    try:
        got = engine.prompt_logprobs(seqs)
    finally:
        engine.close()
    for s, lp, ref in zip(seqs, got, expected, strict=True):
        want = torch.log_softmax(ref, -1)[:-1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1)
        assert lp.shape == want.shape
        if len(s) > 1:
            diff = (lp - want).abs().max().item()
            assert diff < TOLERANCE, (len(s), diff)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parity_check_bitwise_with_lora(model_factory, tmp_path, dtype):
    model_dir = model_factory("kimi-linear", dtype)
    prompts = write_prompt_file(tmp_path, (1, 17, 70))
    args = CheckArgs(
        model=model_dir, dtype=dtype, prompts=prompts, num_prompts=3, max_tokens=4, batch_sizes=[1, 3],
        parity=True, seed=0, report=None, max_num_batched_tokens=64,
        adapter=write_random_adapter(model_dir, tmp_path / "adapter"),
    )
    result = run_check(args)
    assert len(result.completions) == 6
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0 and report["kl_k1"] == 0.0
