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

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trainer.checkpoint import (
    _WEIGHT_SUFFIXES,
    MANIFEST,
    TMP_PREFIX,
    CheckpointError,
    _fsync_tree,
    _manifest,
    _prune,
    _write_atomic,
    read_checkpoint_state,
    step_dir_name,
)
from trainer.deepspeed_policy import DeepSpeedPolicyTrainer
from trainer.lora import peft_config, save_peft

ENGINE_DIR = "deepspeed"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    run_dir: str | Path, step: int, trainer: DeepSpeedPolicyTrainer, extra: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint `step`, point `latest` at it, keep the `keep` newest; returns its dir."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    state = json.dumps({"step": step, "extra": extra}, indent=2) + "\n"  # fails before any write
    root = Path(run_dir) / "checkpoints"
    name = step_dir_name(step)
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    lead = trainer.rank == 0
    if lead:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):  # left behind by a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    trainer.engine.save(tmp / ENGINE_DIR, client_state={}, frozen=not trainer.lora_config.enabled)
    tensors = trainer.rollout_tensors()  # collective under ZeRO-3
    _barrier()  # every rank's partitions are written
    if lead:
        _write_exports(tmp, trainer, tensors)
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        (tmp / "state.json").write_text(state)
        # Last, over every file (DeepSpeed's partitions too): resume verifies it (trainer.checkpoint).
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # saving a step again (e.g. after a resume): os.replace needs it gone
            old = root / f"{TMP_PREFIX}old-{name}"
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)
        _write_atomic(root / "latest", name + "\n")
        _prune(root, keep, name)
    _barrier()
    return final


def _write_exports(out: Path, trainer: DeepSpeedPolicyTrainer, tensors: dict[str, torch.Tensor]) -> None:
    cfg = trainer.lora_config
    if cfg.enabled:
        config = peft_config(cfg.rank, cfg.alpha, list(cfg.target_modules), str(trainer.model_dir))
        save_peft(out / "adapter", tensors, config)
        return
    model = out / "model"
    model.mkdir()
    for src in sorted(trainer.model_dir.iterdir()):
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, model / src.name)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


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
