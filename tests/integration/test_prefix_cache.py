"""Prefix caching on a parity engine, real vLLM: a warm cache changes no bit.

The same prompts sampled cold (empty cache), then warm (their full blocks cached), give the same
tokens and bitwise-equal log-probs, with hits counted; a weight sync empties the cache (0 hits on
the next call), and the trainer's scores of the warm completions equal the rollout's. Tiny Llama
(fp32) and Qwen3 (bf16)."""

from __future__ import annotations

import pytest
import torch

from parity.sampling import Sampling, processed_logprobs

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=20)
# Longer than vLLM's CPU block (128 tokens), no two sharing a prefix: every hit is across calls.
PROMPT_LENS = (130, 300, 17, 260)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _trainer_logprobs(model_dir: str, dtype: str, completions) -> list[torch.Tensor]:
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model = load_model(model_dir, dtype).eval()
    out = []
    with torch.no_grad():
        for c in completions:
            start, n = len(c.prompt_ids), len(c.token_ids)
            logits = forward_logits(model, torch.tensor([c.prompt_ids + c.token_ids]))[0, start - 1 : start - 1 + n]
            out.append(processed_logprobs(logits, SAMPLING).gather(1, torch.tensor(c.token_ids).view(-1, 1)).squeeze(1))
    return out


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "fp32"), ("qwen3", "bf16")])
def test_warm_prefix_cache_changes_no_bit(model_factory, megatron, arch, dtype):
    from rollout.engine import RolloutEngine

    model_dir = model_factory(arch, dtype)
    prompts = _prompts()
    with RolloutEngine(model_dir, dtype=dtype, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64) as engine:
        assert engine.prefix_caching  # on by default for a parity dense model
        cold = engine.generate(prompts, 10, SAMPLING)
        warm = engine.generate(prompts, 10, SAMPLING)
        engine.clear_adapter()  # a weight sync (to the same base weights): the cache is emptied
        synced = engine.generate(prompts, 10, SAMPLING)
        hits = engine.prefix_hits
    assert [c.cached_tokens for c in cold] == [0] * len(prompts)
    # Every full 128-token block of a prompt, but never the whole prompt (vLLM computes its last token).
    assert [c.cached_tokens for c in warm] == [(n - 1) // 128 * 128 for n in PROMPT_LENS]
    assert sum(c.cached_tokens for c in warm) > 0
    assert [c.cached_tokens for c in synced] == [0] * len(prompts)
    assert hits == sum(c.cached_tokens for c in cold + warm + synced)
    for a, b, c in zip(cold, warm, synced, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert torch.equal(a.rollout_logprobs, c.rollout_logprobs)
    for c, t in zip(warm, _trainer_logprobs(model_dir, dtype, warm), strict=True):
        assert torch.equal(c.rollout_logprobs, t)
