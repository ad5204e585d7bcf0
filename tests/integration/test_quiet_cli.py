"""Quiet by default, through the real CLI: a short `kimi-rl train` (Ray, vLLM in a rollout
actor, Megatron in the trainer actor) prints none of rl/quiet.py's listed lines; with
KIMI_RL_VERBOSE=1 they come back; a bad config still prints its one-line error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rl import quiet

ROOT = Path(__file__).resolve().parents[2]


def _train(model: str, run_dir: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    drop = {"PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "KIMI_RL_VERBOSE",
            "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    command = [sys.executable, "-m", "rl.cli", "train", str(ROOT / "configs/quickstart.yaml"),
               f"model.path={model}", f"run_dir={run_dir}", "total_steps=1", "data.prompts_per_step=2",
               "rollout.max_tokens=4", *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**clean, "PYTHONPATH": str(ROOT), **env})


def _noisy_lines(output: str) -> list[str]:
    patterns = [p.lstrip("^") for _, p in quiet.LOG_NOISE] + [re.escape(m) for _, m in quiet.WARNING_NOISE]
    return [line for line in output.splitlines() if any(re.search(p, line) for p in patterns)]


def test_train_is_quiet_verbose_is_not_and_errors_show(model_factory, tmp_path):
    model = model_factory("llama", "fp32")
    done = _train(model, tmp_path / "quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _noisy_lines(done.stdout + done.stderr) == []
    assert "step 1/1" in done.stdout

    loud = _train(model, tmp_path / "loud", KIMI_RL_VERBOSE="1")
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert len(_noisy_lines(loud.stdout + loud.stderr)) >= 1

    bad = _train(model, tmp_path / "bad", "algorithm.clip_eps=-1")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "kimi-rl: error: override 'algorithm.clip_eps=-1': algorithm.clip_eps: must be > 0, got -1.0"]
