"""Checkpoints of a DeepSpeedPolicyTrainer: trainer.checkpoint's layout and atomic rename, with
DeepSpeed's own checkpoint (module, optimizer and every rank's ZeRO partitions) inside:

    step_000040/
        deepspeed/    engine.save_checkpoint (tag "deepspeed"; a LoRA run leaves out the base)
        adapter/ or model/   the peft adapter / HF weights, as trainer.checkpoint exports them
        trainer.pt    DeepSpeedPolicyTrainer.state_dict(): kind, shuffling and RNG states
        state.json    {"step": ..., "extra": {...}}

Both functions are collective: every rank calls them (ranks share the file system); rank 0
writes everything but DeepSpeed's per-rank files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    TMP_PREFIX,
    CheckpointError,
    begin_checkpoint,
    publish_checkpoint,
    read_checkpoint_state,
    seal_checkpoint,
    step_dir_name,
    write_exports,
)
from trainer.deepspeed.policy import DeepSpeedPolicyTrainer

ENGINE_DIR = "deepspeed"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    run_dir: str | Path, step: int, trainer: DeepSpeedPolicyTrainer, extra: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint `step`, point `latest` at it, keep the `keep` newest; returns its dir.
    trainer.checkpoint's mechanics; every rank writes its ZeRO partitions, rank 0 the rest."""
    lead = trainer.rank == 0
    if lead:
        root, name, state = begin_checkpoint(run_dir, step, extra, keep)
        (root / f"{TMP_PREFIX}{name}").mkdir()
    else:
        root, name = Path(run_dir) / "checkpoints", step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{name}"
    _barrier()
    trainer.engine.save(tmp / ENGINE_DIR, client_state={}, frozen=not trainer.lora_config.enabled)
    tensors = trainer.rollout_tensors()  # collective under ZeRO-3
    _barrier()  # every rank's partitions are written
    if lead:
        write_exports(tmp, trainer, tensors)
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        (tmp / "state.json").write_text(state)
        seal_checkpoint(tmp)  # the manifest covers DeepSpeed's partitions too
        publish_checkpoint(root, name, keep)
    _barrier()
    return root / name


def load_checkpoint(path: str | Path, trainer: DeepSpeedPolicyTrainer) -> dict[str, Any]:
    """Restore `trainer` on every rank from a step dir or a run dir (its latest); returns
    read_checkpoint_state(path)."""
    state = read_checkpoint_state(path)
    step = state["path"]
    if not (step / ENGINE_DIR).is_dir():
        raise CheckpointError(f"{step}: no DeepSpeed checkpoint (written by trainer.backend megatron?)")
    try:
        trainer.load_state_dict(torch.load(step / "trainer.pt", map_location="cpu", weights_only=True))
        trainer.engine.load(step / ENGINE_DIR)
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        raise CheckpointError(f"{step}: checkpoint does not fit this trainer ({type(e).__name__}: {e})") from None
    return state
