"""The deepspeed backend as trainer.backend sees it: its Ray actor (trainer.deepspeed.worker),
its scoring (the HF parity model inside a DeepSpeed engine, one rank) and the check of a
user's DeepSpeed JSON. DeepSpeed is imported when a call needs it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.backend import Backend, ScoreSetup, TrainerWorker
from trainer.config import TrainerConfig

GROUP = 8  # sequences per scoring forward, the Megatron backend's grouping


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def worker_class(self) -> type[TrainerWorker]:
        from trainer.deepspeed.worker import DeepSpeedTrainerWorker

        return DeepSpeedTrainerWorker

    def score(
        self, setup: ScoreSetup, sequences: list[list[int]], starts: list[int],
        progress: Callable[[int], None] | None = None,
    ) -> list[Tensor]:
        """One rank (gloo; DeepSpeed adopts a process group that is already up), the HF parity
        model under ZeRO stage setup.zero_stage. `progress` is told once, at the end."""
        if not setup.parity or setup.tensor_parallel_size > 1 or setup.kv_cache_dtype != "auto":
            raise ValueError("the deepspeed backend scores with the HF parity model: it needs "
                             "parity on, tensor-parallel size 1 and the model dtype's cache")
        from trainer.deepspeed.engine import init_distributed, scoring_model
        from trainer.deepspeed.model import sequence_logprobs
        from trainer.distributed import free_port

        init_distributed(0, 1, free_port())
        model = scoring_model(setup.model_dir, setup.dtype, setup.zero_stage, setup.adapter)
        with torch.no_grad():
            out = sequence_logprobs(model.engine, sequences, starts, GROUP, setup.sampling)
        if progress is not None:
            progress(len(sequences))
        return out

    def check_config(self, trainer: TrainerConfig, dtype: str) -> None:
        """The DeepSpeed config kimi-rl would run (the user's JSON read and checked)."""
        from trainer.deepspeed.engine import EngineSettings, deepspeed_config

        ds = trainer.deepspeed
        deepspeed_config(EngineSettings(zero_stage=ds.zero_stage, config_path=ds.config,
                                        optimizer=trainer.optimizer), dtype)
