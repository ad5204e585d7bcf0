"""FP8 MLA caches (`--kv-cache-dtype fp8`, rollout.kv_cache_dtype, parity/fp8.py) on real vLLM
and Megatron: the rollout stores each MLA entry (latent + RoPE key, index key) as e4m3 codes
with a per-token scale per part, the trainer rounds the same entries the same way, and every
sampled token's log-prob stays bitwise equal; the rounding really acts (a trainer without it
sees other log-probs), and at a fixed cache space the cache holds more tokens.

Prompts run from 1 to 130 tokens (kimi-mini's indexer keeps 16 keys), with a 64-token step
budget (chunked prefill mixed with decode).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rl.checker import CheckArgs, load_adapter, rescore, run_check
from tests.conftest import write_prompt_file, write_random_adapter

PROMPT_LENS = (1, 17, 40, 130)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _args(model_dir: str, dtype: str, prompt_file, adapter=None) -> CheckArgs:
    return CheckArgs(model=model_dir, dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
                     max_tokens=8, batch_sizes=[1, 4], parity=True, seed=0, report=None,
                     max_num_batched_tokens=64, adapter=adapter, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def kimi_mini_fp8(model_factory, prompt_file, tmp_path_factory):
    """A bf16 kimi-mini check with a LoRA adapter on every target and an FP8 cache."""
    model_dir = model_factory("kimi-mini", "bf16")
    adapter = write_random_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "adapter")
    args = _args(model_dir, "bf16", prompt_file, adapter)
    return args, run_check(args)


def _assert_bitwise(result) -> None:
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    assert result.report["passed"] and result.report["kl_k1"] == 0.0
    assert result.report["kv_cache_dtype"] == "fp8"


def test_kimi_mini_bf16_with_lora_bitwise_with_an_fp8_cache(kimi_mini_fp8):
    _assert_bitwise(kimi_mini_fp8[1])


def test_kimi_linear_fp32_bitwise_with_an_fp8_cache(model_factory, prompt_file):
    _assert_bitwise(run_check(_args(model_factory("kimi-linear", "fp32"), "fp32", prompt_file)))


def test_the_rounding_acts_and_a_trainer_without_it_sees_other_logprobs(kimi_mini_fp8):
    args, result = kimi_mini_fp8
    seqs = [c.prompt_ids + c.token_ids for c in result.completions]
    starts = [len(c.prompt_ids) for c in result.completions]
    unrounded = rescore(dataclasses.replace(args, kv_cache_dtype="auto"), seqs, starts, load_adapter(args.adapter))
    diffs = [(c.rollout_logprobs - lp).abs().max().item() for c, lp in zip(result.completions, unrounded, strict=True)]
    assert max(diffs) > 0, "the FP8 rounding changed no log-prob"


# Two MLA layers and no KDA layer, in each format.
MLA_ONLY = {"kimi-mini": {"layer_types": ["mla", "mla"]},
            "kimi-linear": {"linear_attn_config": {"kda_layers": [], "full_attn_layers": [1, 2], "num_heads": 4,
                                                   "head_dim": 32, "short_conv_kernel_size": 4}}}


@pytest.mark.parametrize("arch", list(MLA_ONLY))
def test_an_fp8_cache_holds_more_tokens_in_the_same_space(tmp_path, arch):
    """MLA layers only (a KDA state block takes the same pages in both formats): vLLM's block
    count x block size, at the same VLLM_CPU_KVCACHE_SPACE, in bf16 and in FP8."""
    from rl.models import init_model
    from rollout.engine import RolloutEngine

    model_dir = init_model(arch=arch, preset="tiny", seed=0, out_dir=tmp_path / "mla", dtype="bf16",
                           overrides=MLA_ONLY[arch])
    tokens = {}
    for kv in ("auto", "fp8"):
        with RolloutEngine(str(model_dir), dtype="bf16", multiprocess=False, max_model_len=256,
                           kv_cache_dtype=kv) as engine:
            cache = engine.llm.llm_engine.vllm_config.cache_config
            tokens[kv] = cache.num_gpu_blocks * cache.block_size
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"]  # the same space for both (the engine's default)
    assert tokens["fp8"] >= 1.8 * tokens["auto"], tokens
