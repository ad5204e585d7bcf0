"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step, flushed and fsynced
line by line, so a crash never leaves a torn record), wandb (offline unless asked), the
console, and a PNG of the main curves at the end."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CURVES = (
    ("reward/mean", "reward"),
    ("response/length_mean", "response length"),
    ("ppo/entropy", "policy entropy (nats/token)"),
    ("parity/bitwise_equal_fraction", "rollout = trainer (fraction of tokens, bitwise)"),
)


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write null rather than an unparsable line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def _truncate_after(self, step: int) -> None:
        """A resumed run continues after `step`: drop records of steps the checkpoint does not
        cover (they would be written again), and any torn last line."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class Wandb:
    """wandb with `mode` offline (default: no network), online, or disabled (no-op)."""

    def __init__(self, mode: str, project: str, run_dir: Path, config: dict) -> None:
        self.run = None
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(
            project=project, dir=str(run_dir), mode=mode, config=config,
            name=run_dir.name, reinit="finish_previous",
        )

    def log(self, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def plot_curves(run_dir: Path) -> Path | None:
    """run_dir/curves.png: reward, response length, entropy, parity per step."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    steps = [r["step"] for r in records]
    for ax, (key, title) in zip(axes, CURVES, strict=True):
        ax.plot(steps, [r.get(key) for r in records], marker="o", markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "curves.png"
    tmp = run_dir / ".curves.png.tmp"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, out)
    return out
