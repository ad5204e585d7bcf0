"""kimi-linear with DeepSeek-V3.2's sparse indexer on its MLA layer (`model init --set
q_lora_rank=48 --set index_n_heads=4 --set index_head_dim=32 --set index_topk=16`) on real
vLLM and Megatron: `kimi-rl parity check` is bitwise with a nonzero LoRA adapter on every
target (q_a_proj / q_b_proj included), in fp32 with the model-dtype cache and in bf16 with an
FP8 cache (the index key e4m3 under its own per-token scale) and Kimi K3's MLA output gate. Prompts of 1-130 tokens, so the
indexer keeps 16 of up to 137 keys, and a 64-token step budget (chunked prefill, mixed steps).
The scores and the selection against transformers' DeepseekV32Indexer: tests/unit/test_kimi_indexer.py.

The low-rank query (q_lora_rank, which the indexer needs) against the independent reference:
the trainer's fp32 logits match transformers' KimiLinearForCausalLM within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from rl.checker import CheckArgs, run_check
from tests.conftest import write_prompt_file, write_random_adapter
from tests.integration.test_kimi_linear import TOLERANCE, _reference_model, _sequences
from tests.reference import trainer_logit_distances

PROMPT_LENS = (1, 17, 40, 130)
INDEXER = dict(q_lora_rank=48, index_n_heads=4, index_head_dim=32, index_topk=16)


@pytest.mark.parametrize("dtype,kv_cache_dtype,gate", [("fp32", "auto", False), ("bf16", "fp8", True)])
def test_parity_check_bitwise_with_the_indexer(tmp_path, dtype, kv_cache_dtype, gate):
    from rl.models import init_model

    overrides = {**INDEXER, "mla_use_output_gate": gate}
    model_dir = str(init_model("kimi-linear", "tiny", 0, tmp_path / "model", dtype, overrides=overrides))
    args = CheckArgs(
        model=model_dir, dtype=dtype, prompts=write_prompt_file(tmp_path, PROMPT_LENS),
        num_prompts=len(PROMPT_LENS), max_tokens=8, batch_sizes=[1, 4], parity=True, seed=0, report=None,
        max_num_batched_tokens=64, adapter=write_random_adapter(model_dir, tmp_path / "adapter"),
        kv_cache_dtype=kv_cache_dtype,
    )
    result = run_check(args)
    assert len(result.completions) == 2 * len(PROMPT_LENS)
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0 and report["kl_k1"] == 0.0
    assert report["kv_cache_dtype"] == kv_cache_dtype


def test_trainer_logits_with_a_low_rank_query_match_transformers(tmp_path, megatron):
    from rl.models import init_model
    from trainer.megatron.model import load_model

    model_dir = str(init_model("kimi-linear", "tiny", 0, tmp_path / "model", "fp32", overrides={"q_lora_rank": 48}))
    hf = _reference_model(model_dir)
    seqs = _sequences()
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0].float() for s in seqs]
    mg = load_model(model_dir, "fp32").eval()
    assert max(trainer_logit_distances(mg, seqs, expected)) < TOLERANCE
