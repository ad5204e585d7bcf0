"""The one interface between the driver (rl/) and a trainer backend: the loop and the parity
checker reach a backend only through here, by its name in `trainer.backend` (the config).

    backend = get_backend(cfg.trainer.backend)
    backend.worker_class()        the Ray actor class: train step, old-policy log-probs,
                                  weights / adapter out for the sync, checkpoints
                                  (its calls: TrainerWorker below)
    backend.score(setup, ...)     re-score token sequences into per-token log-probs
                                  (`kimi-rl parity check`; tensor-parallel ranks or ZeRO inside)
    backend.check_config(...)     what the config check must ask the backend itself
    new_rendezvous()              where one start's trainer ranks meet (a Ray actor)

`BACKENDS` names each backend's class as "module:attr", imported on first use, so importing
this module imports neither room (trainer/megatron/, trainer/deepspeed/) nor megatron-core nor
DeepSpeed; tests/unit/test_layering.py holds rl/ to this module, trainer.config and
trainer.checkpoint.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torch import Tensor

from parity.sampling import Sampling
from parity.wire import Packed
from trainer.config import TrainerConfig

# The trainer.backend names (trainer.config.TrainerConfig.backend) and where each one lives.
BACKENDS = {
    "megatron": "trainer.megatron.backend:MegatronBackend",
    "deepspeed": "trainer.deepspeed.backend:DeepSpeedBackend",
}

# A peft LoRA adapter as loaded from its directory: (tensors by peft name, rank, alpha, targets).
Adapter = tuple[dict[str, Tensor], int, float, list[str]]


@dataclass(frozen=True)
class ScoreSetup:
    """What a backend scores with: the checkpoint, its dtype and the sampling transform both
    sides score (parity.sampling), and how the backend runs (TP ranks, ZeRO stage)."""

    model_dir: Path
    dtype: str
    parity: bool = True
    seed: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    adapter: Adapter | None = None  # attached on every rank
    tensor_parallel_size: int = 1  # megatron: that many spawned ranks (gloo)
    zero_stage: int = 2  # deepspeed: the engine's ZeRO stage
    kv_cache_dtype: str = "auto"  # the rollout's cache format (megatron: Kimi's FP8 MLA entries)


class TrainerWorker(Protocol):
    """The calls the loop makes on the trainer's Ray actor (every backend's worker_class has
    them; a tensor-parallel group, rl.cluster.TrainerGroup, forwards them to every rank)."""

    def lora_scaling(self) -> float | None:
        """alpha / rank of the policy adapter (the rollout applies it); None for full weights."""

    def rollout_packed(self) -> tuple[Packed | None, float | None]:
        """(the policy adapter in the sync wire format, put in Ray's object store: a
        parity.wire.Packed whose data is the handle; lora_scaling), for the rollout workers.
        Under tensor parallelism rank 0 answers; the other ranks return (None, None)."""

    def rollout_params(self) -> dict[str, Tensor]:
        """Full weights under the rollout parity model's names (a full-weight sync)."""

    def merged_weights(self) -> dict[str, Tensor]:
        """HF weights with the adapter merged in, for stock vLLM (parity off: megatron only)."""

    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[Tensor]:
        """Current-policy log-probs of seq[start:] (raw: no sampling transform)."""

    def old_logprobs(self, batch: dict) -> list[Tensor]:
        """The batch's old-policy log-probs, before any update (compared with the rollout's)."""

    def train_step(self, batch: dict, old_logprobs: list[Tensor]) -> dict:
        """{"stats", "skipped"}: one PPO / GRPO / RLOO update (trainer.step.PolicyStep)."""

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, keep: int) -> str:
        """Write checkpoint `step` (trainer.checkpoint's layout); returns its directory."""

    def load_checkpoint(self, path: str) -> dict:
        """Restore the trainer state from a checkpoint; returns its state.json (+ "path")."""


class Backend(ABC):
    """One trainer backend: what the driver asks of it besides the calls on its actor."""

    name: str

    @abstractmethod
    def worker_class(self) -> type[TrainerWorker]:
        """The Ray actor class; the loop constructs it with (model_path, dtype, parity=, lora=,
        trainer=, algorithm=, seed=, sampling=[, rank=, rendezvous= (new_rendezvous()) at more
        than one rank])."""

    @abstractmethod
    def score(
        self, setup: ScoreSetup, sequences: list[list[int]], starts: list[int],
        progress: Callable[[int], None] | None = None,
    ) -> list[Tensor]:
        """For each sequence, log p(seq[i] | seq[:i]) for i in [start, len): float32
        [len - start], of the distribution `setup.sampling` gives, in groups of 8 sequences.
        `progress(n)`, when given, is told each time n more sequences are scored."""

    def check_config(self, trainer: TrainerConfig, dtype: str) -> None:
        """Raise ValueError for settings only the backend can judge (run when the config
        loads, before any work). By default the config's own checks are all there is."""
        return None


def get_backend(name: str) -> Backend:
    """The backend `trainer.backend: name` selects (its room imported now, not before)."""
    if name not in BACKENDS:
        raise ValueError(f"trainer.backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    module, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)()


def new_rendezvous():
    """A fresh trainer.distributed.Rendezvous actor (no CPU of its own) for the ranks of one
    start: torch.distributed's store over Ray, so the ranks may be on any nodes."""
    import ray

    from trainer.distributed import Rendezvous

    return ray.remote(Rendezvous).options(num_cpus=0).remote()
