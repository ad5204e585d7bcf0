"""Faults with real processes: `kimi-rl train` runs as a subprocess, and the tests send real
signals to real PIDs (the driver's, and the trainer actor's from <run_dir>/pids.json).

- SIGTERM to the driver -> a checkpoint at the step boundary, exit 143; SIGKILL of the trainer
  actor mid-step -> the run stops with a one-line error naming the last checkpoint, exit 1; the
  newest checkpoint then truncated (a half-written safetensors) -> resume falls back to the one
  before it, with a message; the run finished that way equals a straight run bit for bit
  (metrics and adapter). While the straight run runs, every listening socket of its process
  tree must be on loopback, and its GCS must refuse a client with another token than the one
  under the run dir (not in $HOME/.ray).
- A parity mismatch made real (a sync hook perturbs the adapter the rollout workers get, so
  the two sides hold different weights): on_mismatch fail stops before the update and writes
  the sequences; warn trains on. A NaN reward then skips a step, the adapter unchanged.
- A NaN loss inside the trainer (an inf reward given to the trainer directly) restores the
  trainer's state: the step is skipped with nothing changed.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from rl.sync import SyncHook

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TIMING = ("time/", "sync/seconds")
STEPS = 4
# 2 prompts x 4 samples, 8 tokens: the smallest batch GRPO groups and the checks need.
SHRINK = ["logging.wandb=disabled", "logging.console=false", "logging.plot=false",
          "data.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens=8",
          "checkpoint.every=1", "checkpoint.keep=2"]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


class PerturbAdapter(SyncHook):
    """From the sync after step 1 on, the rollout workers get lora_B + 1e-3 (the trainer keeps
    its own): the two sides really differ, as a buggy sync or kernel would make them."""

    def before_sync(self, event):
        if event.step >= 1:
            event.tensors = {k: v + 1e-3 if "lora_B" in k else v for k, v in event.tensors.items()}


_calls = {"n": 0}


def nan_from_step_3(completion, sample) -> float:
    """A reward function that breaks after two steps' worth of samples (8 per step)."""
    _calls["n"] += 1
    return math.nan if _calls["n"] > 16 else float(len(completion) % 3)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # COLUMNS: rich wraps console lines at the width, which would split the paths checked here.
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), COLUMNS="400")
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


class Train:
    """`kimi-rl train` in a subprocess (python -m rl.cli, this checkout), output to a file."""

    def __init__(self, tmp_path: Path, model: str, run_dir: Path, *args: str) -> None:
        self.run_dir, self.log = run_dir, tmp_path / f"{run_dir.name}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "rl.cli", "train", str(QUICKSTART), f"model.path={model}",
               f"run_dir={run_dir}", *SHRINK, *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"timed out:\n{self.output()[-3000:]}") from None

    def until(self, condition, timeout: float = 400, poll=None) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if poll:
                poll()
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} early:\n{self.output()[-3000:]}")
            if time.monotonic() > end:
                self.proc.kill()
                raise AssertionError(f"timed out:\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        steps = []
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError):
                pass  # a line being written
        return max(steps, default=0)

    def pids(self) -> dict | None:
        try:
            pids = json.loads((self.run_dir / "pids.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return pids if pids["driver"] == self.proc.pid else None  # this run's, not a previous one's


def _listening(pid: int) -> set[tuple[str, str, int]]:
    """(process name, ip, port) of every listening TCP socket of pid and its descendants."""
    out = set()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((p.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            pass  # exited meanwhile
    return out


def _gcs_accepts(port: int, token: str, tmp_path: Path) -> tuple[bool, str]:
    """Whether the run's GCS answers a client holding `token` (Ray's own GCS client, in a
    process of its own; a rejected token fails at once with AuthenticationError)."""
    env = _env(tmp_path)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    code = (f"from ray._raylet import GcsClient; GcsClient(address='127.0.0.1:{port}')"
            ".internal_kv_keys(b'', namespace=None, timeout=30); print('ACCEPTED')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return "ACCEPTED" in proc.stdout, proc.stdout + proc.stderr


def _metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _adapter(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir / "adapter" / "adapter_model.safetensors"))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_sigkill_corruption_and_resume_match_a_straight_run(model_factory, tmp_path):
    model = model_factory("llama")
    straight = Train(tmp_path, model, tmp_path / "straight", f"total_steps={STEPS}")
    sockets: set = set()
    probes: dict = {}

    def poll() -> None:
        sockets.update(_listening(straight.proc.pid))
        gcs = [port for name, _, port in sockets if name == "gcs_server"]
        if gcs and not probes and (token := straight.run_dir / "ray_auth_token").exists():
            probes["wrong"] = _gcs_accepts(gcs[0], "0" * 64, tmp_path)
            probes["run's"] = _gcs_accepts(gcs[0], token.read_text(), tmp_path)

    straight.until(lambda: straight.steps_done() >= 2 and probes, poll=poll)
    assert straight.wait() == 0, straight.output()[-3000:]
    # Token auth is enforced: the run's token opens the GCS, another one is refused.
    assert not probes["wrong"][0] and "InvalidAuthToken" in probes["wrong"][1], probes["wrong"][1][-2000:]
    assert probes["run's"][0], probes["run's"][1][-2000:]
    # Security, seen on the straight run: Ray (GCS, raylet, workers), vLLM and torch.distributed
    # listen on loopback only; the token is the run's, private, and not in the home directory.
    assert {name for name, _, _ in sockets} >= {"gcs_server", "raylet"}, sockets
    assert not [s for s in sockets if s[1] not in LOOPBACK], sockets
    token = straight.run_dir / "ray_auth_token"
    assert len(token.read_text()) == 64 and token.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "home" / ".ray").exists()  # Ray's default token place

    # SIGTERM to the driver after step 1: it finishes the step in progress, checkpoints there.
    split = tmp_path / "split"
    run = Train(tmp_path, model, split, f"total_steps={STEPS}")
    run.until(lambda: run.steps_done() >= 1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.output()[-3000:]
    stopped = run.steps_done()
    assert 1 <= stopped < STEPS - 1
    assert f"SIGTERM: stopped after step {stopped}" in run.output()
    assert (split / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"

    # Resume; SIGKILL the trainer actor once step stopped+1 is checkpointed (mid-step after).
    run = Train(tmp_path, model, split, f"total_steps={STEPS}", "--resume", str(split))
    latest = split / "checkpoints" / "latest"
    run.until(lambda: run.pids() is not None and latest.read_text().strip() == f"step_{stopped + 1:06d}")
    os.kill(run.pids()["trainer"], signal.SIGKILL)
    assert run.wait() == 1, run.output()[-3000:]
    died = re.search(r"step (\d+): the trainer process died \(\w+\); (the step was not applied|its "
                     r"checkpoint was written); the last checkpoint is (\S+): continue with --resume (\S+)",
                     run.output())
    assert died, run.output()[-3000:]
    # Mid-step stopped+2 (or later): that step is not applied. The kill can also land while the
    # driver still waits on step stopped+1's checkpoint call, after `latest` was written.
    killed_at, last, last_step = int(died[1]), Path(died[3]), int(Path(died[3]).name[len("step_"):])
    written = died[2] == "its checkpoint was written"
    assert last_step == (killed_at if written else killed_at - 1) >= stopped + 1 and Path(died[4]) == split
    assert last == split / "checkpoints" / f"step_{last_step:06d}"
    from trainer.checkpoint import verify_checkpoint

    verify_checkpoint(last)  # intact

    # Truncate the newest checkpoint's adapter (a half-written file): resume falls back.
    f = last / "adapter" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    run = Train(tmp_path, model, split, f"total_steps={STEPS}", "--resume", str(split))
    assert run.wait() == 0, run.output()[-3000:]
    out = run.output()
    assert "skipped invalid checkpoint" in out and "adapter_model.safetensors" in out and "truncated" in out
    assert f"resuming from {split / 'checkpoints' / f'step_{last_step - 1:06d}'}" in " ".join(out.split())

    # Bit for bit the straight run: every step's metrics (times aside) and the final adapter.
    a, b = _metrics(straight.run_dir), _metrics(split)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert a == b
    assert all(r["parity/bitwise_equal_fraction"] == 1.0 and r["step/skipped"] == 0.0 for r in a)
    assert len({r["reward/mean"] for r in a}) > 1  # the steps really differ
    final = f"step_{STEPS:06d}"
    assert _equal(_adapter(straight.run_dir / "checkpoints" / final), _adapter(split / "checkpoints" / final))


def test_parity_mismatch_fails_before_the_update_or_warns(model_factory, tmp_path):
    model = model_factory("llama")
    hook = f"sync.hooks=[checksum,timing,{__name__}:PerturbAdapter]"
    run = Train(tmp_path, model, tmp_path / "fail", "total_steps=3", hook)
    assert run.wait() == 1, run.output()[-3000:]
    dump = json.loads((run.run_dir / "mismatch" / "step_000002.json").read_text())
    first = dump["first"]
    message = " ".join(run.output().split())
    assert ("step 2: rollout and trainer log-probs differ" in message
            and f"first at sequence {first['sequence']} token {first['token_index']} (id {first['token_id']})"
            in message and "the update was not applied (parity.on_mismatch: fail)" in message), message
    assert dump["step"] == 2 and dump["sequences"]
    for seq in dump["sequences"]:
        assert len(seq["token_ids"]) == len(seq["rollout_logprobs"]) == len(seq["trainer_logprobs"])
        assert seq["rollout_logprobs"] != seq["trainer_logprobs"] and seq["prompt_ids"]
    row = next(s for s in dump["sequences"] if s["sequence"] == first["sequence"])
    t = first["token_index"]
    assert row["rollout_logprobs"][:t] == row["trainer_logprobs"][:t]
    assert (row["rollout_logprobs"][t], row["trainer_logprobs"][t]) == (first["rollout"], first["trainer"])
    assert [r["step"] for r in _metrics(run.run_dir)] == [1]  # step 2 was not applied
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"

    # warn: step 2 trains on the mismatched batch; step 3's rewards are NaN: skipped.
    run = Train(tmp_path, model, tmp_path / "warn", "total_steps=3", hook, "parity.on_mismatch=warn",
                "checkpoint.keep=3", "reward.type=function", f"reward.function={__name__}:nan_from_step_3")
    assert run.wait() == 0, run.output()[-3000:]
    r1, r2, r3 = _metrics(run.run_dir)
    assert r1["parity/bitwise_equal_fraction"] == 1.0 and r2["parity/bitwise_equal_fraction"] < 1.0
    assert r2["step/skipped"] == 0.0 and "ppo/kl" in r2
    assert r3["step/skipped"] == 1.0 and "ppo/kl" not in r3
    assert "step 3 skipped (policy unchanged): 8 non-finite reward(s)" in " ".join(run.output().split())
    ckpt = run.run_dir / "checkpoints"
    assert not _equal(_adapter(ckpt / "step_000001"), _adapter(ckpt / "step_000002"))  # step 2 trained
    assert _equal(_adapter(ckpt / "step_000002"), _adapter(ckpt / "step_000003"))  # step 3 did not


def test_nan_loss_restores_the_trainer(model_factory, megatron):
    """An inf reward reaches the trainer (the driver would have skipped it: this is the
    trainer's own guard): GRPO's advantages, the loss and the gradients become NaN, and
    guarded_train_step puts back the trainable weights, optimizer and RNG state."""
    from trainer.config import AlgorithmConfig, LoraConfig
    from trainer.megatron.policy import PolicyTrainer
    from trainer.megatron.worker import guarded_train_step

    trainer = PolicyTrainer(model_factory("llama"), lora=LoraConfig(enabled=True, rank=4, alpha=8),
                            algorithm=AlgorithmConfig(name="grpo"), seed=0)
    seqs = [[5, 17, 42, 99, 7, 250], [5, 17, 42, 3, 64], [9, 8, 7, 6, 5, 4], [9, 8, 7, 11, 12]]
    starts = [3, 3, 3, 3]
    batch = {"sequences": seqs, "starts": starts, "rollout_logprobs": trainer.logprobs(seqs, starts),
             "group_size": 2}
    before = {k: v.clone() for k, v in trainer.state_dict()["policy"].items()}
    result = guarded_train_step(trainer, {**batch, "rewards": torch.tensor([1.0, math.inf, 0.0, 1.0])})
    assert result["skipped"] and "ppo/policy_loss" in result["skipped"]
    after = trainer.state_dict()
    assert _equal(before, after["policy"]) and after["optimizer"]["state"] == {}
    result = guarded_train_step(trainer, {**batch, "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0])})
    assert result["skipped"] is None
    assert not _equal(before, trainer.state_dict()["policy"])  # a finite step does train
