"""Every command the README and the docs pages show, run as a user runs it: the installed
`kimi-rl` (and the scripts) as a subprocess, from a directory laid out like the repo root
(`.venv`, `configs/`).

A command is shrunk only by flags or `key=value` overrides appended to it — the CLI takes the
last value of a flag, so the code path is the README's — never by calling another function.
`test_every_readme_command_is_listed` fails when the README or a docs page gains a command that
is not listed here, so a new documented command cannot go untested. The commands run in the
order of DOCS (the README first), as a reader would type them (later ones use the models and
runs of earlier ones); a command shown on two pages runs once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The pages whose `bash` blocks are run, in reading order (the README's commands make the
# models the pages after it use).
DOCS = ["README.md", "docs/parity_check.md", "docs/tensor_parallel.md", "docs/kimi.md", "docs/qwen3_moe.md",
        "docs/train.md",
        "docs/hooks.md", "docs/agentic.md", "docs/deepspeed.md", "docs/development.md", "docs/design.md", "docs/benchmarks.md",
        "docs/fuzz.md", "docs/faults_and_security.md", "docs/gpu_summary.md", "docs/README.md",
        "docs/trainer_scale.md", "docs/cluster.md"]
TEXT = "\n".join((ROOT / page).read_text() for page in DOCS)
VENV = Path(sys.executable).parents[1]

SMALL_CHECK = " --num-prompts 2 --max-tokens 4 --batch-sizes 1,2"

# README command -> what the test appends to it.
SHRINK: dict[str, str] = {
    "bash scripts/setup.sh && bash scripts/demo.sh": " total_steps=2",
    ".venv/bin/kimi-rl model init --arch llama --preset tiny --seed 0 models/tiny-llama": "",
    ".venv/bin/kimi-rl parity check --model models/tiny-llama --dtype bf16 --batch-sizes 1,8,32 "
    "--num-prompts 8 --max-tokens 32 --report reports/tiny": SMALL_CHECK,
    ".venv/bin/kimi-rl model import-smollm2 models/smollm2 --dtype bf16": "",
    ".venv/bin/kimi-rl parity check --model models/smollm2 --dtype bf16 --num-prompts 8 "
    "--max-tokens 32 --batch-sizes 1,8 --report reports/smollm2-bf16": " --num-prompts 1 --max-tokens 4 --batch-sizes 1",
    ".venv/bin/kimi-rl parity check --model models/tiny-llama --dtype fp32 --rollout-tp 2 --trainer-tp 1 "
    "--num-prompts 8 --max-tokens 32 --batch-sizes 1,8": SMALL_CHECK,
    ".venv/bin/kimi-rl train configs/quickstart.yaml rollout.tensor_parallel_size=2 run_dir=runs/quickstart-tp2":
    " total_steps=2 data.prompts_per_step=2",
    ".venv/bin/kimi-rl train configs/quickstart.yaml trainer.tensor_parallel_size=2 "
    "run_dir=runs/quickstart-trainer-tp2": " total_steps=1 data.prompts_per_step=2 rollout.max_tokens=4",
    ".venv/bin/kimi-rl train configs/quickstart.yaml trainer.data_parallel_size=2 trainer.deterministic_layout=true "
    "run_dir=runs/quickstart-dp2": " total_steps=1 data.prompts_per_step=2 rollout.max_tokens=4",
    ".venv/bin/kimi-rl model init --arch kimi-mini --preset tiny --seed 0 --dtype bf16 models/kimi-tiny": "",
    ".venv/bin/kimi-rl train configs/quickstart.yaml model.path=models/kimi-tiny algorithm.name=ppo "
    "total_steps=3 run_dir=runs/kimi-ppo": " data.prompts_per_step=2 rollout.max_tokens=4",
    ".venv/bin/kimi-rl parity check --model models/kimi-tiny --dtype bf16 --batch-sizes 1,16 "
    "--num-prompts 6 --max-tokens 8 --max-num-batched-tokens 64 "
    "--adapter runs/kimi-ppo/checkpoints/step_000003/adapter": SMALL_CHECK,
    ".venv/bin/kimi-rl parity check --model models/kimi-tiny --dtype bf16 --batch-sizes 1,4 --num-prompts 4 "
    "--max-tokens 8 --max-num-batched-tokens 32 --kv-cache-dtype fp8": SMALL_CHECK,
    ".venv/bin/kimi-rl model init --arch kimi-linear --preset tiny --seed 0 --dtype bf16 models/kl-tiny": "",
    ".venv/bin/kimi-rl parity check --model models/kl-tiny --dtype bf16 --batch-sizes 1,3 --num-prompts 3 "
    "--max-tokens 4 --max-num-batched-tokens 64": SMALL_CHECK,
    ".venv/bin/kimi-rl model init --arch kimi-linear --preset tiny --seed 0 --dtype bf16 --set q_lora_rank=48 "
    "--set index_n_heads=4 --set index_head_dim=32 --set index_topk=16 --set mla_use_output_gate=true "
    "models/kl-idx": "",
    ".venv/bin/kimi-rl parity check --model models/kl-idx --dtype bf16 --batch-sizes 1,4 --num-prompts 4 "
    "--max-tokens 8 --max-num-batched-tokens 64 --kv-cache-dtype fp8": SMALL_CHECK,
    ".venv/bin/kimi-rl model init --arch qwen3-moe --preset tiny --seed 0 models/q3m-tiny": "",
    ".venv/bin/kimi-rl parity check --model models/q3m-tiny --dtype bf16 --batch-sizes 1,3 --num-prompts 3 "
    "--max-tokens 4 --max-num-batched-tokens 64": SMALL_CHECK,
    ".venv/bin/kimi-rl train configs/quickstart.yaml": " total_steps=2",
    ".venv/bin/kimi-rl train configs/quickstart.yaml --print-config": "",
    ".venv/bin/kimi-rl train configs/quickstart.yaml --resume runs/quickstart total_steps=30": " total_steps=3",
    ".venv/bin/kimi-rl train configs/agentic_calculator.yaml": " total_steps=2",
    ".venv/bin/kimi-rl train configs/agentic_calculator.yaml env.name=probe 'env.kwargs={}' "
    "run_dir=runs/agentic-probe": " total_steps=2",
    ".venv/bin/kimi-rl parity check --model models/tiny-llama --env probe --max-turns 3 --num-prompts 4 "
    "--max-tokens 8": " --num-prompts 2 --max-tokens 4",
    ".venv/bin/kimi-rl parity check --model models/smollm2 --dtype bf16 --env tools --env-kwargs "
    "'{\"example\": true}' --max-turns 3 --num-prompts 8 --max-tokens 48 --temperature 0.7":
    " --num-prompts 2 --max-turns 2 --max-tokens 16",
    ".venv/bin/kimi-rl train configs/quickstart.yaml trainer.backend=deepspeed trainer.deepspeed.ranks=2 "
    "run_dir=runs/deepspeed": " total_steps=2 data.prompts_per_step=2",
    ".venv/bin/kimi-rl parity check --model models/tiny-llama --trainer deepspeed --zero-stage 3": SMALL_CHECK,
    "PYTHONPATH=. .venv/bin/kimi-rl train configs/quickstart.yaml run_dir=runs/hooks "
    "'sync.hooks=[checksum, timing, myhooks:AdapterNorm]'": " total_steps=1",
}
NOT_RUN = {
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q": "the test suite itself",
    # A cluster of several machines: test_multinode.py runs these on two namespace hosts.
    "RAY_AUTH_MODE=token ray start --head --node-ip-address=10.0.0.1 --port=6379"
    " --resources='{\"trainer_node\": 1}'": "needs the head node's address",
    "RAY_AUTH_MODE=token ray start --address=10.0.0.1:6379 --node-ip-address=10.0.0.2"
    " --resources='{\"rollout_node\": 1}'": "needs a second machine",
    "RAY_AUTH_MODE=token kimi-rl train configs/quickstart.yaml ray.address=10.0.0.1:6379"
    " ray.placement.rollout=rollout_node ray.placement.trainer=trainer_node": "needs that cluster",
}


def readme_commands() -> list[str]:
    """The shell commands of the pages' bash blocks, continuation lines joined, comments cut,
    each once (first page first)."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(line.split("  #")[0].split())
            if command and command not in out:
                out.append(command)
    return out


def test_every_docs_page_is_read():
    """A new docs page with commands is read here too (gpu.md's commands run on a GPU machine)."""
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")} - {"docs/gpu.md"}
    assert pages <= set(DOCS)


def test_every_readme_command_is_listed():
    listed = set(SHRINK) | set(NOT_RUN)
    commands = readme_commands()
    assert [c for c in commands if c not in listed] == []
    assert [c for c in listed if c not in commands] == []


def _python_block(marker: str) -> str:
    return next(b for b in re.findall(r"```python\n(.*?)```", TEXT, flags=re.S) if marker in b)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A directory laid out like the repo root, where a user types the README's commands."""
    if not (VENV / "bin" / "kimi-rl").exists():
        pytest.skip("kimi-rl is not installed in this Python's environment")
    d = tmp_path_factory.mktemp("readme")
    (d / ".venv").symlink_to(VENV)
    (d / "configs").symlink_to(ROOT / "configs")
    (d / "myhooks.py").write_text(_python_block("# myhooks.py"))
    return d


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, steps: int) -> None:
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["parity/bitwise_equal_fraction"] == 1.0 for r in rows)


RUNS = [c for c in readme_commands() if c in SHRINK]


@pytest.mark.parametrize("command", RUNS, ids=[f"{i:02d}" for i in range(len(RUNS))])
def test_readme_command(command, user_dir):
    # The set-up + demo line runs in the repo itself, as the README says (scripts/ cd there).
    cwd = ROOT if command.startswith("bash scripts/") else user_dir
    # A user's shell: none of the process-group variables this test process may have set
    # (an in-process Megatron of an earlier test holds its MASTER_PORT).
    drop = {"PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # The tree under test first, whichever tree the venv's editable install points at (a
    # command's own `PYTHONPATH=.` still wins).
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(command + SHRINK[command], shell=True, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if " parity check " in command:
        assert "PASS: all" in done.stdout + done.stderr
    if "--report reports/" in command:
        report = json.loads((user_dir / command.split("--report ")[1].split()[0] / "report.json").read_text())
        assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    if "scripts/demo.sh" in command:
        newest = max((ROOT / "runs").glob("quickstart-*"), key=lambda p: p.stat().st_mtime)
        _check_run(newest, 2)
    if command.endswith("train configs/quickstart.yaml"):
        _check_run(user_dir / "runs/quickstart", 2)
    if "--resume runs/quickstart" in command:
        _check_run(user_dir / "runs/quickstart", 3)
    if "--print-config" in command:
        assert "total_steps: 20" in done.stdout
    if "run_dir=runs/kimi-ppo" in command:
        _check_run(user_dir / "runs/kimi-ppo", 3)
    if "run_dir=runs/quickstart-tp2" in command:
        _check_run(user_dir / "runs/quickstart-tp2", 2)
    if "run_dir=runs/quickstart-trainer-tp2" in command:
        _check_run(user_dir / "runs/quickstart-trainer-tp2", 1)
    if "run_dir=runs/quickstart-dp2" in command:
        _check_run(user_dir / "runs/quickstart-dp2", 1)
        assert all(r["train/rank_tokens/0"] > 0 and r["train/rank_tokens/1"] > 0
                   for r in _metrics(user_dir / "runs/quickstart-dp2"))
    if "run_dir=runs/deepspeed" in command:
        _check_run(user_dir / "runs/deepspeed", 2)
    if command.endswith("train configs/agentic_calculator.yaml"):
        _check_run(user_dir / "runs/agentic_calculator", 2)
        rows = _metrics(user_dir / "runs/agentic_calculator")
        assert all(r["env/turns_mean"] >= 1.0 and r["env/errors"] == 0 for r in rows)
        # A prompt's samples share its system message's blocks: hits in every step's rollout.
        assert all(r["rollout/prefix_cache_hit_tokens"] > 0 for r in rows), rows
    if "run_dir=runs/agentic-probe" in command:
        # Every trajectory is 3 turns; only the model's tokens are trained and compared.
        _check_run(user_dir / "runs/agentic-probe", 2)
        rows = _metrics(user_dir / "runs/agentic-probe")
        assert all(r["env/turns_mean"] == 3.0 and r["train/response_tokens"] == r["parity/tokens"] for r in rows)
        assert all(r["response/length_mean"] * 16 > r["parity/tokens"] for r in rows)  # observations too
    if "myhooks:AdapterNorm" in command:
        _check_run(user_dir / "runs/hooks", 1)
        assert _metrics(user_dir / "runs/hooks")[0]["sync/adapter_norm"] > 0
