"""`kimi-rl train` on a two-node Ray cluster it did not start (tests/netns.py: two network
namespaces joined by a veth pair, each with its own /tmp, /dev/shm and HOME). The cluster's
owner starts a head on host a and joins host b, with token auth and a custom resource per node;
the run connects with `ray.address` and the owner's token and places the rollout worker on
host b, the trainer on host a (`ray.placement`). Every step must be bitwise (parity 1.0, KL 0)
with the adapter synced across the link (checksums checked on host b), and a client without
the token must be refused. Skipped where namespaces cannot be made (not root, a sandbox).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.metrics import read_metrics
from tests.netns import (
    HOME,
    Host,
    Unavailable,
    join_ray_cluster,
    kill_namespace,
    namespace_pids,
    start_ray_cluster,
    two_hosts,
)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
STEPS = 3
SHRINK = ["logging.wandb=disabled", "logging.console=false", "logging.plot=false",
          "data.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens=8",
          "checkpoint.every=1", f"total_steps={STEPS}"]
PLACED = ["ray.placement.rollout=host_b", "ray.placement.trainer=host_a"]
# Keys whose values are wall-clock times: everything else must repeat exactly.
TIMING = ("time/", "sync/seconds")


@dataclass
class Cluster:
    a: Host
    b: Host
    address: str
    token: str
    model: str
    tmp: Path


@pytest.fixture(scope="module")
def cluster(model_factory, tmp_path_factory) -> Iterator[Cluster]:
    model = model_factory("llama")
    tmp = tmp_path_factory.mktemp("multinode")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # COLUMNS: rich would wrap the console lines checked here.
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", COLUMNS="400")
    with contextlib.ExitStack() as stack:
        try:
            # The model and the test's directory are "on a shared file system"; nothing else is.
            # So are this checkout and its interpreter when they live under /tmp (a fresh clone).
            code = [p for p in (ROOT, Path(sys.prefix)) if p.resolve().is_relative_to("/tmp")]
            code = [p for p in code if not any(p != q and p.is_relative_to(q) for q in code)]
            a, b = stack.enter_context(two_hosts([Path(model).parent, tmp, *code], env))
        except Unavailable as e:
            pytest.skip(f"two hosts need network and mount namespaces: {e}")
        token = secrets.token_hex(32)
        yield Cluster(a, b, start_ray_cluster(a, b, token), token, model, tmp)


def _python(host: Host, code: str, **env: str) -> subprocess.CompletedProcess:
    return host.run([sys.executable, "-c", code], check=False, timeout=180, **env)


def _start_train(cluster: Cluster, run_dir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """`kimi-rl train` from host a (the driver on the head's host), connected with the token."""
    log = cluster.tmp / f"{run_dir.name}-{len(list(cluster.tmp.glob('*.log')))}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cluster.a.command([sys.executable, "-m", "rl.cli", "train", str(QUICKSTART), f"model.path={cluster.model}",
                               f"run_dir={run_dir}", *SHRINK, f"ray.address={cluster.address}", *args]),
            cwd=ROOT, env=cluster.a.environment(RAY_AUTH_MODE="token"), stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _train(cluster: Cluster, run_dir: Path, *args: str) -> tuple[int, str]:
    proc, log = _start_train(cluster, run_dir, *args)
    try:
        return proc.wait(timeout=400), log.read_text()
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"timed out:\n{log.read_text()[-3000:]}") from None


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_metrics(run_dir)]


def _adapter(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def straight(cluster: Cluster) -> tuple[Path, str, int]:
    """The straight two-host run: (run dir, console output, bytes host b received meanwhile)."""
    run_dir = cluster.tmp / "run"
    rx_before = cluster.b.veth_bytes()[0]
    rc, output = _train(cluster, run_dir, *PLACED)
    assert rc == 0, output[-3000:]
    return run_dir, output, cluster.b.veth_bytes()[0] - rx_before


def test_train_rollout_on_host_b_trainer_on_host_a(cluster: Cluster, straight):
    a, b = cluster.a, cluster.b
    run_dir, _, rx = straight
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["parity/tokens"] > 0
        assert r["parity/bitwise_equal_fraction"] == 1.0, r
        assert r["parity/max_abs_diff"] == r["parity/kl_k1"] == r["parity/kl_k3"] == 0.0
        assert r["sync/checksum_ok"] == 1.0  # the rollout worker on host b holds the trainer's bytes
        assert isinstance(r["sync/seconds"], float) and r["sync/seconds"] > 0

    # Where Ray ran each actor (its own actor table, read by a client holding the token).
    placed = _python(a, f"""
import json, ray
ray.init(address={cluster.address!r}, logging_level="error")
print(json.dumps([(v["ActorClassName"], v["Address"]["IPAddress"]) for v in ray._private.state.actors().values()]))
""", RAY_AUTH_MODE="token")
    assert placed.returncode == 0, placed.stderr[-2000:]
    actors = json.loads(placed.stdout.strip().splitlines()[-1])
    rollout = {ip for name, ip in actors if name == "RolloutWorker"}
    trainer = {ip for name, ip in actors if name.endswith("Worker") and name != "RolloutWorker"}
    assert rollout == {b.address}, actors
    assert trainer == {a.address}, actors

    # The adapter crossed the link to host b at every sync (one before each step's rollout).
    adapter = _adapter(run_dir)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert rx >= adapter_bytes * STEPS, (rx, adapter_bytes)
    print(f"host b received {rx} bytes; adapter {adapter_bytes} bytes x {STEPS} steps; "
          f"sync seconds {[round(r['sync/seconds'], 4) for r in records]}")


_GCS_KEYS = """
from ray._raylet import GcsClient
GcsClient(address={address!r}).internal_kv_keys(b"", namespace=None, timeout=30)
print("ACCEPTED")
"""


def test_client_without_the_token_is_refused(cluster: Cluster):
    """Ray's own GCS client, from host b: accepted with the owner's token; refused by the GCS
    with no token file anywhere it can read (an empty HOME, no RAY_AUTH_* variables), and with
    a wrong token."""
    code = _GCS_KEYS.format(address=cluster.address)
    ok = _python(cluster.b, code, RAY_AUTH_MODE="token")
    assert "ACCEPTED" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    cluster.b.run(["mkdir", "-p", "/tmp/stranger"])
    for env in ({"HOME": "/tmp/stranger"},
                {"HOME": HOME, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}):
        refused = _python(cluster.b, code, **env)
        assert "ACCEPTED" not in refused.stdout, env
        assert "AuthenticationError" in refused.stderr and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]


def test_a_resource_no_node_has_is_a_one_line_error(cluster: Cluster):
    rc, output = _train(cluster, cluster.tmp / "nowhere", "ray.placement.rollout=host_c")
    assert rc == 2, output[-3000:]
    assert ("kimi-rl: error: ray.placement.rollout: the cluster at 10.77.0.1:6379 has no node with "
            "the resource 'host_c' (its custom resources: host_a, host_b)") in output, output[-3000:]


def test_trainer_ranks_on_two_hosts(cluster: Cluster):
    """Data-parallel trainer ranks on both hosts (`ray.placement.trainer` one resource per rank):
    they meet through the run's Rendezvous actor, not a file on one host, and gloo's sockets sit
    on each host's own address; every step stays bitwise and both ranks train."""
    run_dir = cluster.tmp / "ranks-on-two-hosts"
    rc, output = _train(cluster, run_dir, "ray.placement.rollout=host_b", "ray.placement.trainer=[host_a, host_b]",
                        "trainer.data_parallel_size=2", "trainer.deterministic_layout=true")
    assert rc == 0, output[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["parity/bitwise_equal_fraction"] == 1.0 and r["parity/kl_k1"] == 0.0, r
        assert r["train/rank_tokens/0"] > 0 and r["train/rank_tokens/1"] > 0, r
    placed = _python(cluster.a, f"""
import json, ray
ray.init(address={cluster.address!r}, logging_level="error")
print(json.dumps([(v["ActorClassName"], v["Address"]["IPAddress"]) for v in ray._private.state.actors().values()]))
""", RAY_AUTH_MODE="token")
    assert placed.returncode == 0, placed.stderr[-2000:]
    actors = json.loads(placed.stdout.strip().splitlines()[-1])
    # Earlier runs of this module put their trainer on host a only: host b's is this run's.
    assert {ip for name, ip in actors if name == "TrainerWorker"} == {cluster.a.address, cluster.b.address}, actors


def _kill_host_b_after_a_checkpoint(cluster: Cluster, run_dir: Path, *args: str) -> str:
    """Start a run, kill host b's raylet (by pid) once step 1's checkpoint exists, and return
    the console output of the run, which must exit 1."""
    proc, log = _start_train(cluster, run_dir, *args)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    raylets = [pid for pid in namespace_pids(cluster.b.name) if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet"]
    assert len(raylets) == 1, raylets
    os.kill(raylets[0], signal.SIGKILL)
    assert proc.wait(timeout=240) == 1, log.read_text()[-3000:]
    return log.read_text()


def _stop_line(run_dir: Path, who: str) -> str:
    here = re.escape(str(run_dir))
    return (rf"kimi-rl: error: step [23]: node 10\.77\.0\.2 \({who}\) left the Ray cluster "
            rf"\(\w+\); (the step was not applied|its checkpoint was written); the last checkpoint is {here}/checkpoints/step_00000[12]: "
            rf"continue with --resume {here}\n")


def _rejoin_host_b(cluster: Cluster) -> None:
    kill_namespace(cluster.b.name, keep=cluster.b.holder.pid)  # what was left of the node
    join_ray_cluster(cluster.b, cluster.address)


def test_trainer_node_killed_stops_the_run_naming_the_node(cluster: Cluster, straight):
    """The trainer on host b, the rollout on host a: host b's raylet killed after step 1's
    checkpoint stops the run with a line naming the node and the trainer rank; the checkpoint
    it names loads. Host b joins again for the next test."""
    run_dir = cluster.tmp / "trainer-killed"
    output = _kill_host_b_after_a_checkpoint(cluster, run_dir, "ray.placement.rollout=host_a",
                                             "ray.placement.trainer=host_b")
    assert re.search(_stop_line(run_dir, "trainer rank 0"), output), output[-3000:]
    assert _adapter(run_dir)  # the checkpoint the line names is whole
    _rejoin_host_b(cluster)


def test_rollout_node_killed_then_resume_on_a_rejoined_node(cluster: Cluster, straight):
    """Host b's raylet killed (by pid) once step 1's checkpoint exists: the run stops with a
    line naming the node and the checkpoint to resume from; host b joins again and
    `--resume` ends with the straight run's metrics and adapter, bitwise. Runs last: it
    leaves host b re-joined under a new node id."""
    run_dir = cluster.tmp / "killed"
    output = _kill_host_b_after_a_checkpoint(cluster, run_dir, *PLACED)
    assert re.search(_stop_line(run_dir, "rollout worker 0"), output), output[-3000:]

    _rejoin_host_b(cluster)
    rc, output = _train(cluster, run_dir, *PLACED, "--resume", str(run_dir))
    assert rc == 0, output[-3000:]
    straight_dir = straight[0]
    assert _metrics(run_dir) == _metrics(straight_dir)
    a, b = _adapter(run_dir), _adapter(straight_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
