"""The deepspeed backend's trainer as a Ray actor: rank 0 of `trainer.deepspeed.ranks`
data-parallel ranks (a DeepSpeedPolicyTrainer each, gloo on the CPU, NCCL on GPUs).

Rank 0 is the actor the driver calls; it launches ranks 1..N-1 as processes of its own
(torch.multiprocessing, spawn) that follow it: each call the driver makes is broadcast to
them (torch.distributed.broadcast_object_list) and every rank runs it, since training,
ZeRO-3 gathers and checkpoints are collective; rank 0's result goes back. The actor's
interface is trainer.backend.TrainerWorker, so the loop drives either backend.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parity.sampling import Sampling
from parity.wire import Packed, packed
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig


class _Rank:
    """One rank: torch.distributed, then the DeepSpeed trainer."""

    def __init__(self, rank: int, world_size: int, port: int, kwargs: dict[str, Any]) -> None:
        from trainer.deepspeed.engine import init_distributed
        from trainer.deepspeed.policy import DeepSpeedPolicyTrainer

        threads = max(1, (os.cpu_count() or 1) // world_size)  # one share of the cores each
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        init_distributed(rank, world_size, port)
        self.policy = DeepSpeedPolicyTrainer(**kwargs)

    def logprobs(self, sequences, starts, raw):
        return self.policy.logprobs(sequences, starts, raw)

    def train_step(self, batch: dict, old_logprobs: list[torch.Tensor]) -> dict:
        stats = self.policy.train_step(batch, old_logprobs=old_logprobs)
        bad = sorted(k for k, v in stats.items() if not math.isfinite(v))
        if bad:
            # The Megatron backend snapshots and restores its trainable state; ZeRO keeps the
            # optimizer and (stage 3) the weights partitioned across ranks, so here the step
            # cannot be undone: stop, and let the run continue from its last checkpoint.
            raise FloatingPointError(
                f"non-finite {', '.join(bad)}: the deepspeed backend cannot undo a ZeRO step; "
                "continue from the last checkpoint with --resume"
            )
        return {"stats": stats, "skipped": None}

    def rollout_tensors(self):
        return self.policy.rollout_tensors()

    def rollout_params(self):
        return self.policy.rollout_params()

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, keep: int) -> str:
        from trainer.deepspeed.checkpoint import save_checkpoint

        return str(save_checkpoint(Path(run_dir), step, self.policy, extra, keep=keep))

    def load_checkpoint(self, path: str) -> dict:
        from trainer.deepspeed.checkpoint import load_checkpoint

        return load_checkpoint(Path(path), self.policy)


def _follow(rank: int, world_size: int, port: int, kwargs: dict[str, Any]) -> None:
    """Ranks 1..N-1: run every call rank 0 broadcasts, until rank 0 is gone."""
    worker = _Rank(rank, world_size, port, kwargs)
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError:  # rank 0 is gone (the run ended and Ray stopped its actor)
            return
        name, args = box[0]
        getattr(worker, name)(*args)


class DeepSpeedTrainerWorker:
    def __init__(
        self, model_path: str, dtype: str, *, parity: bool, lora: LoraConfig,
        trainer: TrainerConfig, algorithm: AlgorithmConfig, seed: int,
        sampling: Sampling | None = None, kv_cache_dtype: str = "auto",
    ) -> None:
        import torch.multiprocessing as mp

        from trainer.distributed import free_port

        if not parity:
            raise ValueError("trainer.backend deepspeed trains the HF parity model: parity must be on")
        if kv_cache_dtype != "auto":
            raise ValueError(f"trainer.backend deepspeed: kv_cache_dtype {kv_cache_dtype} is for the Kimi "
                             "architectures, which train on megatron")
        self.lora = lora
        kwargs = dict(model_dir=model_path, dtype=dtype, lora=lora, trainer=trainer,
                      algorithm=algorithm, seed=seed, sampling=sampling,
                      extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"))
        n, port = trainer.deepspeed.ranks, free_port()
        context = mp.get_context("spawn")
        self.followers = [context.Process(target=_follow, args=(r, n, port, kwargs), daemon=True)
                          for r in range(1, n)]
        for p in self.followers:
            p.start()
        self.rank = _Rank(0, n, port, kwargs)

    def _all(self, name: str, *args):
        """Run `name` on every rank; rank 0's result."""
        if self.followers:
            dist.broadcast_object_list([(name, args)], src=0)
        return getattr(self.rank, name)(*args)

    def lora_scaling(self) -> float | None:
        return self.rank.policy.lora_scaling

    def rollout_tensors(self) -> dict[str, torch.Tensor]:
        return self._all("rollout_tensors")

    def rollout_packed(self) -> tuple[Packed, float | None]:
        """rollout_tensors packed and put in the object store here, with the scaling (see TrainerWorker)."""
        import ray

        return packed(self._all("rollout_tensors"), store=ray.put), self.lora_scaling()

    def rollout_params(self) -> dict[str, torch.Tensor]:
        return self._all("rollout_params")

    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[torch.Tensor]:
        return self._all("logprobs", sequences, starts, raw)

    def old_logprobs(self, batch: dict) -> list[torch.Tensor]:
        """The old-policy log-probs of the batch's sampled tokens, before any update (see
        TrainerWorker.old_logprobs)."""
        return self._all("logprobs", batch["sequences"], batch["starts"], False)

    def train_step(self, batch: dict, old_logprobs: list[torch.Tensor]) -> dict:
        return self._all("train_step", batch, old_logprobs)

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, keep: int) -> str:
        return self._all("save_checkpoint", run_dir, step, extra, keep)

    def load_checkpoint(self, path: str) -> dict:
        return self._all("load_checkpoint", path)
