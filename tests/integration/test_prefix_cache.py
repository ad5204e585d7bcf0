"""Prefix caching on a parity engine, real vLLM: a warm cache changes no bit.

The same prompts sampled cold (empty cache), then warm (their full blocks cached), give the same
tokens and bitwise-equal log-probs, with hits counted; a weight sync empties the cache (0 hits on
the next call), and the trainer's scores of the warm completions equal the rollout's. Tiny Llama
(fp32) and Qwen3 (bf16); tiny kimi-mini (fp32, and bf16 with an FP8 MLA cache), whose hits also
restore the KDA layers' conv and recurrent states cached at the block boundary."""

from __future__ import annotations

import pytest
import torch

from parity.sampling import Sampling, processed_logprobs, request_key

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=20)
# Longer than vLLM's CPU block (128 tokens), no two sharing a prefix: every hit is across calls.
PROMPT_LENS = (130, 300, 17, 260)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _trainer_logprobs(model_dir: str, dtype: str, completions, kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model = load_model(model_dir, dtype, kv_cache_dtype=kv_cache_dtype).eval()
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


KIMI_PROMPT_LENS = (300, 140)  # GRPO-like: each prompt sampled SAMPLES times (batch 8)
SAMPLES = 4


# block: the hybrid's block in tokens, one for the MLA pages and the KDA state pages: vLLM takes
# the CPU's 128 tokens up to the first multiple whose MLA page holds a KDA state (20,992 bytes in
# tiny): 128 x 448 bytes in fp32, 256 x 120 bytes with the FP8 cache.
@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "block"), [("fp32", "auto", 128), ("bf16", "fp8", 256)])
def test_kimi_prefix_cache_restores_kda_states_bitwise(model_factory, megatron, dtype, kv_cache_dtype, block):
    """Cold: each request alone (batch 1) right after a weight sync, 0 hits. Warm: the 8 samples
    in one call (chunked prefill over 64-token steps), then again: every hit restores the MLA
    entries and the KDA states vLLM kept at the block boundary, and changes no bit. An adapter
    synced without emptying the cache gives other log-probs than a fresh compute under it, so
    the reset at every sync is what keeps the bits."""
    from rollout.engine import RolloutEngine
    from tests.integration.test_kimi_rollout import DTYPES, random_adapter

    model_dir = model_factory("kimi-mini", dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in KIMI_PROMPT_LENS]
    batch = [p for p in prompts for _ in range(SAMPLES)]
    keys = [request_key(0, 0, i, s) for i in range(len(prompts)) for s in range(SAMPLES)]
    adapter = random_adapter(model_dir, DTYPES[dtype])
    with RolloutEngine(model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=512, max_num_seqs=8,
                       max_num_batched_tokens=64) as engine:
        assert engine.prefix_caching  # on by default for a parity Kimi engine on the CPU
        cold = []
        for prompt, key in zip(batch, keys, strict=True):
            engine.clear_adapter()  # a weight sync (to the same base weights): the cache is emptied
            cold += engine.generate([prompt], 10, SAMPLING, keys=[key])
        warm = engine.generate(batch, 10, SAMPLING, keys=keys)
        hot = engine.generate(batch, 10, SAMPLING, keys=keys)
        hits = engine.prefix_hits
        # The adapter reaches the model but the cache keeps the base model's entries and states.
        engine._rpc("kimi_rl_set_adapter", engine._pack(adapter), 2.0)
        stale = engine.generate(batch, 10, SAMPLING, keys=keys)
        engine.set_adapter(adapter, 2.0)
        fresh = engine.generate(batch[::SAMPLES], 10, SAMPLING, keys=keys[::SAMPLES])
    assert [c.cached_tokens for c in cold] == [0] * len(batch)
    full_blocks = [(len(p) - 1) // block * block for p in batch]
    assert [c.cached_tokens for c in hot] == full_blocks
    assert 0 < sum(c.cached_tokens for c in warm) <= sum(full_blocks)
    assert hits == sum(c.cached_tokens for c in cold + warm + hot)
    for a, b, c in zip(cold, warm, hot, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert torch.equal(a.rollout_logprobs, c.rollout_logprobs)
    assert [c.cached_tokens for c in stale] == full_blocks
    assert [c.cached_tokens for c in fresh] == [0] * len(prompts)
    reused = [(s, f) for s, f in zip(stale[::SAMPLES], fresh, strict=True) if s.cached_tokens]
    assert reused and not any(torch.equal(s.rollout_logprobs, f.rollout_logprobs) for s, f in reused)
    distinct = hot[::SAMPLES]
    for c, t in zip(distinct, _trainer_logprobs(model_dir, dtype, distinct, kv_cache_dtype), strict=True):
        assert torch.equal(c.rollout_logprobs, t)
