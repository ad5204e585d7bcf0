"""trainer/checkpoint.py on disk: the manifest (sizes and sha256 of every file, written last)
catches a truncated, changed or missing file; resume falls back to the newest valid step dir;
a write that fails for lack of space (RLIMIT_FSIZE in a real child process) leaves the previous
checkpoint and `latest` as they were; trainer.pt is never unpickled beyond tensors.

The trainer here is a stand-in that only hands over tensors: what is under test is the files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
    verify_checkpoint,
)
from trainer.config import LoraConfig

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Tensors:
    """What save_checkpoint asks of a trainer, filled with seeded tensors."""

    seed: int = 0
    model_dir: Path = Path("base-model")
    lora_config: LoraConfig = field(default_factory=lambda: LoraConfig(enabled=True, rank=4, alpha=8))
    loaded: dict | None = None

    def rollout_tensors(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
        return {key.format("A"): torch.randn(4, 64, generator=g), key.format("B"): torch.randn(64, 4, generator=g)}

    def state_dict(self) -> dict:
        return {"policy": self.rollout_tensors(), "step_seed": torch.tensor(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _save(run_dir: Path, *steps: int) -> list[Path]:
    return [save_checkpoint(run_dir, s, Tensors(seed=s), extra={"data": {"cursor": s}}, keep=3) for s in steps]


def test_manifest_lists_every_file_and_verifies(tmp_path):
    (step,) = _save(tmp_path, 1)
    manifest = json.loads((step / "manifest.json").read_text())
    files = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest) == files
    assert {"trainer.pt", "state.json", "adapter/adapter_model.safetensors"} <= set(files)
    verify_checkpoint(step)
    assert read_checkpoint_state(tmp_path)["skipped"] == []


@pytest.mark.parametrize(("damage", "phrase"), [
    ("truncate_adapter", r"adapter_model\.safetensors: 1152 bytes, manifest\.json says 2304 \(truncated\?\)"),
    ("delete_adapter_config", "adapter_config.json: missing"),
    ("flip_trainer_pt", "trainer.pt: sha256 differs"),
    ("no_manifest", "no manifest.json"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, phrase):
    first, second = _save(tmp_path, 1, 2)
    if damage == "truncate_adapter":  # a half-written safetensors
        f = second / "adapter" / "adapter_model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "delete_adapter_config":
        (second / "adapter" / "adapter_config.json").unlink()
    elif damage == "flip_trainer_pt":  # same size, one byte changed
        data = bytearray((second / "trainer.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (second / "trainer.pt").write_bytes(bytes(data))
    else:
        (second / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=phrase):
        verify_checkpoint(second)
    # Resume from the run dir: `latest` names step 2, which is damaged; step 1 is used.
    state = read_checkpoint_state(tmp_path)
    assert state["path"] == first and state["step"] == 1
    assert len(state["skipped"]) == 1 and "step_000002" in state["skipped"][0]
    trainer = Tensors()
    load_checkpoint(tmp_path, trainer)
    assert torch.equal(trainer.loaded["policy"][next(iter(trainer.loaded["policy"]))],
                       next(iter(Tensors(seed=1).rollout_tensors().values())))
    # A step dir named explicitly is not swapped for another one.
    with pytest.raises(CheckpointError, match=phrase):
        read_checkpoint_state(second)


def test_no_valid_checkpoint_names_each_reason(tmp_path):
    (step,) = _save(tmp_path, 1)
    (step / "trainer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no valid checkpoint .*trainer\.pt: missing"):
        read_checkpoint_state(tmp_path)


class Payload:
    """Unpickling this would run code; weights_only refuses to build it."""

    def __reduce__(self):
        return (print, ("unpickled!",))


def test_trainer_pt_is_never_unpickled_beyond_tensors(tmp_path):
    """A trainer.pt with a matching manifest but a pickled object (a corrupt or hostile file):
    refused with a one-line CheckpointError, nothing executed."""
    (step,) = _save(tmp_path, 1)
    torch.save({"policy": Payload()}, step / "trainer.pt")
    manifest = json.loads((step / "manifest.json").read_text())
    from trainer.checkpoint import _manifest

    manifest.update(_manifest(step))
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step_000001: corrupt or incomplete checkpoint \(UnpicklingError"):
        load_checkpoint(step, Tensors())


def test_a_write_that_runs_out_of_space_keeps_the_previous_checkpoint(tmp_path):
    """Step 1 is saved; then, in a real child process limited by RLIMIT_FSIZE to 64 KiB per
    file, step 2's trainer.pt cannot be written: a clear error, no temp dir left, step 1 and
    `latest` untouched."""
    (first,) = _save(tmp_path, 1)
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(ROOT / "tests" / "unit")!r})
        from test_checkpoint import Tensors
        from trainer.checkpoint import CheckpointError, save_checkpoint
        big = Tensors(seed=2)
        big.state_dict = lambda: {{"policy": torch.zeros(1 << 16)}}  # 256 KiB > the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            save_checkpoint({str(tmp_path)!r}, 2, big, extra={{}}, keep=3)
        except CheckpointError as e:
            print(e)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    message = proc.stdout.strip()
    assert "could not write checkpoint" in message and "step_000002" in message
    assert "File too large" in message and f"{first} is intact" in message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text().strip() == "step_000001"
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    verify_checkpoint(first)
