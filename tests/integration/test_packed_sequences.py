"""`trainer.packed_sequences` on the Megatron backend: a micro-batch's sequences end to end in
one row (Megatron's THD layout) give every token the bits the right-padded forward gives it.

Scoring (old and reference log-probs, critic values) is bitwise the padded scoring, and so is
every forward statistic of a PPO step (policy loss, clip fraction, KL, entropy, value loss).
The update after it is not: the backward is plain torch, whose weight-gradient sums take the
padded rows' zeros in another order (as a different micro_batch_size does; with
trainer.deterministic_layout each sequence's gradient is its own, and
test_trainer_dp.py shows packed equal to padded there, bitwise).
"""

from __future__ import annotations

import pytest
import torch

from rl.config import AlgorithmConfig, LoraConfig, TrainerConfig

pytestmark = pytest.mark.integration

# Ragged: lengths 3..70 (the padded batch of a micro-batch is mostly padding), prompts 1..9.
_G = torch.Generator().manual_seed(1)
LENGTHS = (70, 3, 41, 12, 66, 5, 28, 9)
SEQS = [torch.randint(3, 400, (n,), generator=_G).tolist() for n in LENGTHS]
STARTS = [min(n - 1, 1 + i) for i, n in enumerate(LENGTHS)]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
FORWARD_STATS = ("ppo/policy_loss", "ppo/clipfrac", "ppo/kl", "ppo/entropy", "ppo/kl_loss", "critic/value_loss",
                 "critic/vf_clipfrac", "ref/kl")


def _trainer(path: str, dtype: str, packed: bool):
    from trainer.megatron.policy import PolicyTrainer

    return PolicyTrainer(
        path, dtype, True, LoraConfig(enabled=True), TrainerConfig(micro_batch_size=4, packed_sequences=packed),
        AlgorithmConfig(name="ppo", minibatches=1, kl_coef=0.05, kl_mode="loss", entropy_coef=0.01), seed=0)


def _run(path: str, dtype: str, packed: bool) -> dict:
    from trainer.step import Batch

    trainer = _trainer(path, dtype, packed)
    old = trainer.logprobs(SEQS, STARTS)
    scores = {"old": old, "ref": trainer.ref_logprobs(SEQS, STARTS), "values": trainer.values(SEQS, STARTS)}
    stats = trainer.train_step(Batch(SEQS, STARTS, old, REWARDS, group_size=2), old_logprobs=old)
    return {"scores": scores, "stats": stats}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
def test_packed_forward_is_the_padded_forward(model_factory, megatron, arch, dtype):
    path = model_factory(arch, dtype)
    padded, packed = _run(path, dtype, False), _run(path, dtype, True)
    for kind, rows in padded["scores"].items():
        for i, (a, b) in enumerate(zip(rows, packed["scores"][kind], strict=True)):
            assert a.shape == (LENGTHS[i] - STARTS[i],) and torch.equal(a, b), (kind, i)
    for k in FORWARD_STATS:
        assert packed["stats"][k] == padded["stats"][k], k
    # The same gradient up to the backward's summation order (Adam's first step, about
    # lr * sign(g), would magnify a near-zero element's rounding into a sign).
    for k in ("ppo/grad_norm", "critic/grad_norm"):
        assert packed["stats"][k] > 0 and packed["stats"][k] == pytest.approx(padded["stats"][k], rel=1e-3), k
