"""The Megatron backend as trainer.backend sees it: its Ray actor (trainer.megatron.worker)
and its scoring, in this process at TP 1 or in spawned tensor-parallel ranks. megatron-core is
imported when a call needs it, so the driver that only starts actors never imports it."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from trainer.backend import Backend, ScoreSetup, TrainerWorker

GROUP = 8  # sequences per scoring forward, at every TP size (the checker's grouping)


class MegatronBackend(Backend):
    name = "megatron"

    def worker_class(self) -> type[TrainerWorker]:
        from trainer.megatron.worker import TrainerWorker as MegatronWorker

        return MegatronWorker

    def score(
        self, setup: ScoreSetup, sequences: list[list[int]], starts: list[int],
        progress: Callable[[int], None] | None = None,
    ) -> list[Tensor]:
        if setup.tensor_parallel_size > 1:
            return score_tensor_parallel(setup, sequences, starts)
        from trainer.megatron.patches import init_megatron

        init_megatron(seed=setup.seed)
        return _score(_scoring_model(setup), setup, sequences, starts, progress)


def _scoring_model(setup: ScoreSetup, tp_size: int = 1) -> torch.nn.Module:
    """The Megatron model of `setup` in eval mode, with its adapter attached (replicated)."""
    from parity.model_spec import load_spec
    from trainer.megatron.lora import apply_lora, load_peft_state_dict
    from trainer.megatron.model import load_model

    model = load_model(setup.model_dir, setup.dtype, parity=setup.parity, tp_size=tp_size,
                       kv_cache_dtype=setup.kv_cache_dtype).eval()
    if setup.adapter is not None:
        tensors, lora_rank, alpha, targets = setup.adapter
        apply_lora(model, load_spec(setup.model_dir), lora_rank, alpha, list(targets))
        load_peft_state_dict(model, tensors)
    return model


def _score(
    model: torch.nn.Module, setup: ScoreSetup, sequences: list[list[int]], starts: list[int],
    progress: Callable[[int], None] | None = None,
) -> list[Tensor]:
    from trainer.megatron.logprobs import sequence_logprobs

    out: list[Tensor] = []
    with torch.no_grad():
        for i in range(0, len(sequences), GROUP):
            out += sequence_logprobs(model, sequences[i : i + GROUP], starts[i : i + GROUP],
                                     sampling=setup.sampling)
            if progress is not None:
                progress(len(sequences[i : i + GROUP]))
    return out


def _score_rank(
    rank: int, size: int, port: int, setup: ScoreSetup, sequences: list[list[int]],
    starts: list[int], out_path: str,
) -> None:
    """One tensor-parallel rank of score_tensor_parallel (a spawned process)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    # One share of the cores per rank, as vLLM binds its TP workers (rollout.engine).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    import torch.distributed as dist

    from trainer.megatron.patches import init_megatron

    init_megatron(tp_size=size, seed=setup.seed)
    out = _score(_scoring_model(setup, tp_size=size), setup, sequences, starts)
    if rank == 0:
        torch.save(out, out_path)
    dist.barrier()
    dist.destroy_process_group()


def score_tensor_parallel(setup: ScoreSetup, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
    """Score at TP = setup.tensor_parallel_size: that many processes (gloo,
    torch.multiprocessing), every rank scoring every sequence; rank 0's log-probs come back
    (the logits are all-gathered, so every rank holds the same)."""
    import tempfile

    import torch.multiprocessing as mp

    from trainer.distributed import free_port

    size = setup.tensor_parallel_size
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "logprobs.pt")
        mp.spawn(_score_rank, nprocs=size, join=True,
                 args=(size, free_port(), setup, sequences, starts, out_path))
        return torch.load(out_path, weights_only=True)  # tensors only, never pickled objects
