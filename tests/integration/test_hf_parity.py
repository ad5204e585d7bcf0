"""The HF transformers parity model (trainer.deepspeed.model, the DeepSpeed backend's model) scores
tokens bit for bit like the Megatron parity model (and so like vLLM), on tiny Llama (tied
embeddings) and Qwen3 (q/k norm), fp32 and bf16, with and without a peft LoRA adapter.

Teacher-forced scoring of random token sequences of 2..130 tokens, batched (grouped by length,
right-padded) and one at a time, compared with torch.equal. Real vLLM samples re-scored by this
model inside DeepSpeed: tests/integration/test_deepspeed.py (`parity check --trainer deepspeed`).
"""

from __future__ import annotations

import random

import pytest
import torch

from parity.lora import TARGETS
from parity.model_spec import load_spec

CASES = [("llama", "fp32"), ("llama", "bf16"), ("qwen3", "fp32"), ("qwen3", "bf16")]
IDS = [f"{a}-{d}" for a, d in CASES]
RANK, ALPHA, SEED = 8, 16.0, 3


def _sequences():
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 5, 9, 17, 33, 64, 70, 100, 130)]
    return seqs, [1 + (len(s) - 1) // 2 for s in seqs]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype == torch.float32 and torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def _trained_adapter(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A nonzero adapter (B too), as after training; fp32 masters."""
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in like.items()}


def _score_both(model_dir, dtype, targets):
    """(megatron, hf batched, hf one at a time) log-probs, and the two models."""
    from trainer.deepspeed import lora as hf_lora
    from trainer.deepspeed.model import load_hf_model
    from trainer.deepspeed.model import sequence_logprobs as hf_logprobs
    from trainer.megatron import lora as megatron_lora
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model

    seqs, starts = _sequences()
    mg = load_model(model_dir, dtype).eval()
    hf = load_hf_model(model_dir, dtype).eval()
    if targets:
        spec = load_spec(model_dir)
        megatron_lora.apply_lora(mg, spec, RANK, ALPHA, targets, seed=SEED)
        hf = hf_lora.apply_lora(hf, spec, RANK, ALPHA, targets, seed=SEED).eval()
        # Same seed, same initial adapter on both backends, bit for bit.
        init_mg, init_hf = megatron_lora.peft_state_dict(mg), hf_lora.peft_state_dict(hf)
        assert init_mg.keys() == init_hf.keys()
        assert all(torch.equal(init_mg[k], init_hf[k]) for k in init_mg)
        trained = _trained_adapter(init_mg)
        megatron_lora.load_peft_state_dict(mg, trained)
        hf_lora.load_peft_state_dict(hf, trained)
    with torch.no_grad():
        expected = sequence_logprobs(mg, seqs, starts)
        batched = hf_logprobs(hf, seqs, starts, batch_size=4)
        alone = [hf_logprobs(hf, [s], [t])[0] for s, t in zip(seqs, starts, strict=True)]
    return expected, batched, alone, mg, hf


@pytest.mark.parametrize("arch,dtype", CASES, ids=IDS)
def test_base_model_logprobs_equal_megatron(megatron, model_factory, arch, dtype):
    expected, batched, alone, _, _ = _score_both(model_factory(arch, dtype), dtype, None)
    assert _equal(expected, batched)
    assert _equal(expected, alone)


@pytest.mark.parametrize("arch,dtype", CASES, ids=IDS)
def test_lora_logprobs_equal_megatron(megatron, model_factory, arch, dtype):
    from trainer.deepspeed import lora as hf_lora
    from trainer.deepspeed.model import sequence_logprobs as hf_logprobs
    from trainer.megatron import lora as megatron_lora
    from trainer.megatron.logprobs import sequence_logprobs

    targets = list(TARGETS) if arch == "llama" else ["q_proj", "v_proj", "down_proj"]
    expected, batched, alone, mg, hf = _score_both(model_factory(arch, dtype), dtype, targets)
    assert _equal(expected, batched)
    assert _equal(expected, alone)
    seqs, starts = _sequences()
    with torch.no_grad():
        with megatron_lora.adapters_disabled(mg):
            ref_mg = sequence_logprobs(mg, seqs, starts)
        with hf_lora.adapters_disabled(hf):
            ref_hf = hf_logprobs(hf, seqs, starts)
        policy_after = hf_logprobs(hf, seqs, starts)
    assert _equal(ref_mg, ref_hf)  # the reference policy: adapter off
    assert not _equal(ref_hf, batched)  # the adapter changes the scores (the test can fail)
    assert _equal(policy_after, batched)  # and is back on after the context


def test_only_adapter_tensors_get_gradients(model_factory):
    from trainer.deepspeed import lora as hf_lora
    from trainer.deepspeed.model import forward_logits, load_hf_model

    model_dir = model_factory("qwen3", "fp32")
    hf = hf_lora.apply_lora(load_hf_model(model_dir), load_spec(model_dir), RANK, ALPHA, list(TARGETS))
    ids = torch.tensor([_sequences()[0][5]])
    forward_logits(hf, ids).float().logsumexp(-1).mean().backward()
    adapter = {id(p) for _, p in hf_lora.adapter_parameters(hf)}
    for name, p in hf.named_parameters():
        assert (p.grad is not None) == (id(p) in adapter), name
    # B = 0 at init, so A's gradient is 0 too; B's is not.
    assert all(p.grad.abs().sum() > 0 for n, p in hf_lora.adapter_parameters(hf) if ".lora_B." in n)
