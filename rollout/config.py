"""The `rollout:` section of a run's config: how the vLLM rollout workers sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from parity.sampling import Sampling
from parity.settings import setting


@dataclass
class RolloutConfig:
    num_workers: int = setting(1, ge=1)
    samples_per_prompt: int = setting(4, ge=1)
    max_tokens: int = setting(32, ge=1)  # per model turn (the whole completion when single-turn)
    # Agentic rollouts (an `env:` is set): model turns per trajectory, and the tokens after the
    # prompt (model turns and tool observations together) one trajectory may hold.
    max_turns: int = setting(1, ge=1)
    max_trajectory_tokens: int = setting(512, ge=1)
    # The distribution tokens are sampled from (vLLM's SamplingParams fields): both sides report
    # the log-probs of exactly this distribution (parity.sampling). Greedy decoding has no
    # log-prob to train on.
    temperature: float = setting(1.0, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)  # 1 = off
    top_k: int = setting(0, ge=0)  # 0 = off
    max_num_seqs: int = setting(64, ge=1)
    max_num_batched_tokens: int | None = setting(None, ge=1)  # None keeps vLLM's default
    tensor_parallel_size: int = setting(1, ge=1)
    # false: vLLM's default mode (torch.compile, and CUDA graphs on a GPU). A LoRA adapter is
    # then reserved at start and every sync copies into it (rollout/sync.py, reserve_adapter).
    enforce_eager: bool = True
    # "fp8": the Kimi architectures keep their MLA cache entries (latent + RoPE key, index key)
    # in e4m3 with a per-token scale (parity/fp8.py), and the trainer rounds them the same way.
    # "auto": the model dtype.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # On a GPU: the share of the card's memory vLLM takes for weights and KV cache (vLLM's
    # gpu_memory_utilization); the rest is the trainer's when they share a card. None keeps
    # vLLM's default (0.9 of a card; on the CPU the same flag reserves host memory: leave it).
    gpu_memory_utilization: float | None = setting(None, gt=0, le=1)

    def sampling(self) -> Sampling:
        """The sampling parameters both sides use (ValueError for a temperature vLLM would
        treat as greedy)."""
        return Sampling(self.temperature, self.top_p, self.top_k)
