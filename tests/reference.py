"""Checks shared by the tests of a model format: distances from an independent reference
(transformers' model) for both engines' fp32 forwards, and a bitwise parity check with LoRA."""

from __future__ import annotations

from pathlib import Path

import torch

from rl.checker import CheckArgs, run_check
from tests.conftest import write_prompt_file


def trainer_logit_distances(mg, seqs: list[list[int]], expected: list[torch.Tensor]) -> list[float]:
    """Max |Δ| per sequence between a Megatron model's logits (one right-padded batch) and the
    reference's logits [len, vocab]."""
    from trainer.megatron.logprobs import forward_logits

    width = max(len(s) for s in seqs)
    padded = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        got = forward_logits(mg, padded).float()
    return [(got[i, : len(s)] - ref).abs().max().item() for i, (s, ref) in enumerate(zip(seqs, expected, strict=True))]


def rollout_logprob_distances(model_dir: str, seqs: list[list[int]], expected: list[torch.Tensor]) -> list[float]:
    """Max |Δ| per sequence (of two tokens or more) between the vLLM rollout's prompt log-probs,
    with chunked prefill, and the log-softmax of the reference's logits."""
    from rollout.engine import RolloutEngine

    engine = RolloutEngine(model_dir, dtype="fp32", multiprocess=False, max_model_len=512,
                           max_num_batched_tokens=64)  # chunked prefill, mixed steps
    try:
        got = engine.prompt_logprobs(seqs)
    finally:
        engine.close()
    out = []
    for s, lp, ref in zip(seqs, got, expected, strict=True):
        want = torch.log_softmax(ref, -1)[:-1].gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1)
        assert lp.shape == want.shape
        if len(s) > 1:
            out.append((lp - want).abs().max().item())
    return out


def assert_bitwise_with_adapter(model_dir: str, dtype: str, tmp_path: Path, adapter: str) -> None:
    """`kimi-rl parity check` with `adapter`, prompts of 1, 17 and 70 tokens (chunked prefill at
    64), batch 1 and 3: every sampled token's log-prob `torch.equal` on both sides."""
    args = CheckArgs(
        model=model_dir, dtype=dtype, prompts=write_prompt_file(tmp_path, (1, 17, 70)), num_prompts=3,
        max_tokens=4, batch_sizes=[1, 3], parity=True, seed=0, report=None, max_num_batched_tokens=64,
        adapter=adapter,
    )
    result = run_check(args)
    assert len(result.completions) == 6
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0 and report["kl_k1"] == 0.0
