"""The `rollout:` section of a run's config: how the vLLM rollout workers sample."""

from __future__ import annotations

from dataclasses import dataclass

from parity.settings import setting


@dataclass
class RolloutConfig:
    num_workers: int = setting(1, ge=1)
    samples_per_prompt: int = setting(4, ge=1)
    max_tokens: int = setting(32, ge=1)
    temperature: float = setting(1.0, gt=0)  # greedy decoding has no log-prob to train on
    max_num_seqs: int = setting(64, ge=1)
    max_num_batched_tokens: int | None = setting(None, ge=1)  # None keeps vLLM's default
    tensor_parallel_size: int = setting(1, ge=1)
