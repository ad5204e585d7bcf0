"""Atomic training checkpoints of a PolicyStep.

Layout under `run_dir/checkpoints/`:

    step_000040/
        adapter/adapter_model.safetensors, adapter_config.json   (LoRA: peft format)
        model/model.safetensors + the base checkpoint's config and tokenizer files (full)
        trainer.pt    trainable fp32 masters, critic, optimizer, RNG states (what resume loads)
        state.json    {"step": ..., "extra": {...}} (the driver's own state: data cursor, ...)
        manifest.json every other file's size and sha256, written last
    latest            the name of the newest complete step dir

A step dir is written under a temporary name in the same parent, fsynced, then renamed with
os.replace, so a crash leaves either the old or the new checkpoint, never half of one; the
adapter/model dirs are exports (peft, vLLM, transformers), trainer.pt is the resume state.
The manifest catches what atomic renames cannot: a file truncated, changed or deleted after
the save (a disk error, a partial copy, a user). `newest_valid_checkpoint` checks it and falls
back to an older step dir; a write that fails (no space, a file-size limit) removes its
temporary dir and leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:  # a backend is imported by whoever builds the trainer, not by a checkpoint reader
    from trainer.step import PolicyStep

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
# Files of an HF checkpoint dir that carry weights (replaced by the trained ones on export).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")



class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the trainer; the message names
    the path and what is wrong (rl/ shows it to the user as one line)."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def save_checkpoint(
    run_dir: str | Path, step: int, trainer: PolicyStep, extra: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint `step`, point `latest` at it, keep the `keep` newest; returns its dir."""
    root, name, state = begin_checkpoint(run_dir, step, extra, keep)
    tmp = root / f"{TMP_PREFIX}{name}"
    try:
        tmp.mkdir()
        write_exports(tmp, trainer, trainer.rollout_tensors())
        _torch_save(trainer.state_dict(), tmp / "trainer.pt")
        (tmp / "state.json").write_text(state)
        seal_checkpoint(tmp)
    except OSError as e:  # no space, a file-size limit, ...: the previous checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        previous = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
        kept = f"the previous checkpoint {root / previous} is intact" if previous else "no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {root / name} ({type(e).__name__}: {e}); "
                              f"{kept}") from None
    return publish_checkpoint(root, name, keep)


def begin_checkpoint(run_dir: str | Path, step: int, extra: dict[str, Any], keep: int) -> tuple[Path, str, str]:
    """(checkpoints root, step dir name, state.json text) of a save about to start, with the
    temp dirs of a save that crashed removed. Fails before anything is written."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    state = json.dumps({"step": step, "extra": extra}, indent=2) + "\n"
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return root, step_dir_name(step), state


def seal_checkpoint(tmp: Path) -> None:
    """The manifest over every file written (last), then everything flushed to disk."""
    (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1) + "\n")
    _fsync_tree(tmp)


def publish_checkpoint(root: Path, name: str, keep: int) -> Path:
    """Rename the sealed temp dir to its step dir, point `latest` at it, prune to `keep`."""
    final = root / name
    if final.exists():  # saving a step again (e.g. after a resume): os.replace needs it gone
        old = root / f"{TMP_PREFIX}old-{name}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(root / f"{TMP_PREFIX}{name}", final)
    _write_atomic(root / "latest", name + "\n")
    _prune(root, keep, name)
    return final


class _Writes:
    """A file torch.save writes through, keeping the OSError of a failed write: torch reports
    it as RuntimeError("[enforce fail at inline_container.cc] unexpected pos ..."), which does
    not say that the disk is full or the file too large."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        out = _Writes(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise


def write_exports(out: Path, trainer: Any, tensors: dict[str, torch.Tensor]) -> None:
    """What other tools load: the adapter in peft format (`tensors`: the trainer's
    rollout_tensors), or without LoRA an HF model dir (config and tokenizer copied)."""
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(step: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every file under `step` but the manifest."""
    files = sorted(p for p in step.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {str(p.relative_to(step)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def verify_checkpoint(step: Path) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or changed since
    the save wrote the manifest (a step dir without one is incomplete)."""
    try:
        expected = json.loads((step / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step}: no {MANIFEST} (incomplete checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step}/{MANIFEST}: unreadable ({type(e).__name__}: {e})") from None
    for rel, want in expected.items():
        path = step / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, {MANIFEST} says {want['bytes']} (truncated?)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (corrupt)")


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


def resolve_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """(the valid step dir that `path` names, why newer ones were skipped). `path` is a step dir
    (used as is, or refused if invalid) or a run dir / its checkpoints/: then the newest step
    dir whose manifest checks out, `latest` first, older ones after it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if _step_of(path) is not None or (path / "state.json").exists() or (path / MANIFEST).exists():
        verify_checkpoint(path)
        return path, []
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = sorted((s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None)
    if not candidates:
        raise CheckpointError(f"{path}: not a checkpoint (no state.json) and no step dirs under {root}")
    latest = root / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    order = [p for _, p in reversed(candidates)]
    order.sort(key=lambda p: p.name != name)  # `latest` first, then newest to oldest (stable)
    skipped = []
    for step in order:
        try:
            verify_checkpoint(step)
            return step, skipped
        except CheckpointError as e:
            skipped.append(str(e))
    raise CheckpointError(f"{root}: no valid checkpoint ({'; '.join(skipped)})")


def read_checkpoint_state(path: str | Path) -> dict[str, Any]:
    """state.json of the checkpoint `path` names (see resolve_checkpoint), plus "path": its
    step dir, and "skipped": why newer step dirs were passed over. Needs no trainer, so a
    driver can check a resume target before starting one."""
    step, skipped = resolve_checkpoint(path)
    try:
        state = json.loads((step / "state.json").read_text())
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("state.json has no step")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step}: corrupt or incomplete checkpoint ({type(e).__name__}: {e})") from None
    return {**state, "path": step, "skipped": skipped}


def load_checkpoint(path: str | Path, trainer: PolicyStep) -> dict[str, Any]:
    """Restore `trainer` from a step dir or a run dir (its newest valid one); returns
    read_checkpoint_state(path)."""
    state = read_checkpoint_state(path)
    step = state["path"]
    try:
        # weights_only: tensors and plain containers only, never arbitrary pickled objects.
        trainer_state = torch.load(step / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a foreign file fails in many ways; all mean corrupt
        raise CheckpointError(f"{step}: corrupt or incomplete checkpoint ({type(e).__name__}: {e})") from None
    try:
        trainer.load_state_dict(trainer_state)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{step}: checkpoint does not fit this trainer ({type(e).__name__}: {e})") from None
    return state


def peft_config(rank: int, alpha: float, targets: list[str], base_model: str) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
        "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
    }


def save_peft(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write adapter_model.safetensors + adapter_config.json (caller makes it atomic)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
