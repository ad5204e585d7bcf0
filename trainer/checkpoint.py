"""Atomic training checkpoints of a PolicyTrainer.

Layout under `run_dir/checkpoints/`:

    step_000040/
        adapter/adapter_model.safetensors, adapter_config.json   (LoRA: peft format)
        model/model.safetensors + the base checkpoint's config and tokenizer files (full)
        trainer.pt    trainable fp32 masters, critic, optimizer, RNG states (what resume loads)
        state.json    {"step": ..., "extra": {...}} (the driver's own state: data cursor, ...)
    latest            the name of the newest complete step dir

A step dir is written under a temporary name in the same parent, fsynced, then renamed with
os.replace, so a crash leaves either the old or the new checkpoint, never half of one; the
adapter/model dirs are exports (peft, vLLM, transformers), trainer.pt is the resume state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trainer.lora import peft_config, save_peft
from trainer.policy import PolicyTrainer

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
# Files of an HF checkpoint dir that carry weights (replaced by the trained ones on export).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")



class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the trainer; the message names
    the path and what is wrong (rl/ shows it to the user as one line)."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def save_checkpoint(
    run_dir: str | Path, step: int, trainer: PolicyTrainer, extra: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint `step`, point `latest` at it, keep the `keep` newest; returns its dir."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    state = json.dumps({"step": step, "extra": extra}, indent=2) + "\n"  # fails before any write
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{TMP_PREFIX}*"):  # left behind by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    name = step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{name}"
    tmp.mkdir()
    _write_exports(tmp, trainer)
    torch.save(trainer.state_dict(), tmp / "trainer.pt")
    (tmp / "state.json").write_text(state)
    _fsync_tree(tmp)
    final = root / name
    if final.exists():  # saving a step again (e.g. after a resume): os.replace needs it gone
        old = root / f"{TMP_PREFIX}old-{name}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _write_atomic(root / "latest", name + "\n")
    _prune(root, keep, name)
    return final


def _write_exports(out: Path, trainer: PolicyTrainer) -> None:
    cfg = trainer.lora_config
    if cfg.enabled:
        config = peft_config(cfg.rank, cfg.alpha, list(cfg.target_modules), str(trainer.model_dir))
        save_peft(out / "adapter", trainer.rollout_tensors(), config)
        return
    model = out / "model"
    model.mkdir()
    for src in sorted(trainer.model_dir.iterdir()):
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, model / src.name)
    save_file(trainer.rollout_tensors(), str(model / "model.safetensors"), metadata={"format": "pt"})


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _step_of(path: Path) -> int | None:
    digits = path.name.removeprefix(STEP_PREFIX)
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted((s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None)
    for _, path in steps[:-keep]:
        if path.name != current:
            shutil.rmtree(path)


def resolve_checkpoint(path: str | Path) -> Path:
    """The step dir that `path` names: a step dir, a run dir or its checkpoints/ (via latest)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if (path / "state.json").exists() or (path / "trainer.pt").exists():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.is_file():
            name = latest.read_text().strip()
            step = root / name
            if not name or not step.is_dir():
                raise CheckpointError(f"{latest}: names {name!r}, which is not a checkpoint dir in {root}")
            return step
    raise CheckpointError(f"{path}: not a checkpoint (no state.json) and no checkpoints/latest under it")


def read_checkpoint_state(path: str | Path) -> dict[str, Any]:
    """state.json of the checkpoint `path` names (see resolve_checkpoint), plus "path": its
    step dir. Needs no trainer, so a driver can check a resume target before starting one."""
    step = resolve_checkpoint(path)
    try:
        state = json.loads((step / "state.json").read_text())
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("state.json has no step")
        if not (step / "trainer.pt").is_file():
            raise FileNotFoundError("no trainer.pt")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step}: corrupt or incomplete checkpoint ({type(e).__name__}: {e})") from None
    return {**state, "path": step}


def load_checkpoint(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore `trainer` from a step dir or a run dir (its latest); returns
    read_checkpoint_state(path)."""
    state = read_checkpoint_state(path)
    step = state["path"]
    try:
        trainer_state = torch.load(step / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file fails in many ways; all mean corrupt
        raise CheckpointError(f"{step}: corrupt or incomplete checkpoint ({type(e).__name__}: {e})") from None
    try:
        trainer.load_state_dict(trainer_state)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{step}: checkpoint does not fit this trainer ({type(e).__name__}: {e})") from None
    return state
