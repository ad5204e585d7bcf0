"""Two "hosts" on one machine, for multi-node Ray tests: two network namespaces joined by a
veth pair (10.77.0.1/24 and 10.77.0.2/24, loopback up), each with a mount namespace of its own
in which /tmp and /dev/shm are fresh tmpfs mounts and HOME is /tmp/home, so nothing crosses
between the hosts except over the veth link. Paths named in `shared` (the test's model and run
directories, which a real cluster would have on a shared file system) are bind-mounted into
both hosts at the same place.

Each host's namespaces are held by a `sleep` process started with `ip netns exec NS unshare -m`;
commands enter both namespaces with `nsenter -t PID -m -n`. Needs root (CAP_SYS_ADMIN);
`two_hosts` raises `Unavailable` with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
HOME = "/tmp/home"  # inside each host's private /tmp
VENV_BIN = Path(sys.executable).parent
RAY_PORT = 6379
# The GCS declares a silent node dead after about 3 s instead of Ray's default ~15-30 s: the
# node-loss tests wait for that verdict.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                      "RAY_health_check_failure_threshold": "3"}


class Unavailable(RuntimeError):
    """Network or mount namespaces cannot be made here (not root, no `ip`, a sandbox)."""


@dataclass
class Host:
    name: str  # the network namespace
    address: str
    holder: subprocess.Popen  # the process that keeps the namespaces alive
    env: dict[str, str] = field(default_factory=dict)

    def command(self, args: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *args]

    def environment(self, **extra: str) -> dict[str, str]:
        return {**self.env, **extra}

    def run(self, args: list[str], timeout: float = 120, check: bool = True, **extra_env: str):
        proc = subprocess.run(self.command(args), env=self.environment(**extra_env), capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc

    def popen(self, args: list[str], stdout, **extra_env: str) -> subprocess.Popen:
        return subprocess.Popen(self.command(args), env=self.environment(**extra_env), stdout=stdout,
                                stderr=subprocess.STDOUT)

    def write(self, path: str, text: str, mode: str = "600") -> None:
        """A file in this host's private file system (written from inside it)."""
        proc = subprocess.run(self.command(["sh", "-c", f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode} "$1"',
                                            "sh", path]), input=text, text=True, capture_output=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name}: writing {path}: {proc.stderr}")

    def listening(self) -> list[tuple[str, str]]:
        """(local address, process) of every listening TCP socket in this host's namespace."""
        out = self.run(["ss", "-ltnpH"]).stdout
        rows = []
        for line in out.splitlines():
            cols = line.split()
            rows.append((cols[3], " ".join(cols[5:])))
        return rows

    def veth_bytes(self) -> tuple[int, int]:
        """(rx, tx) bytes of this host's end of the veth pair."""
        stats = json.loads(self.run(["ip", "-s", "-j", "link", "show", "dev", "veth0"]).stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise Unavailable(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")


# Inside `ip netns exec NS unshare -m --propagation private`: move the shared paths aside, lay
# fresh tmpfs mounts over /tmp and /dev/shm, put the shared paths back, then hold the namespaces.
_HOLD = """set -e
i=0
for p in "$@"; do mkdir -p "$KEEP/$i"; mount --bind "$p" "$KEEP/$i"; i=$((i+1)); done
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
i=0
for p in "$@"; do mkdir -p "$p"; mount --move "$KEEP/$i" "$p"; i=$((i+1)); done
mkdir -p "$HOME_DIR"
echo ready
exec sleep infinity
"""


def namespace_pids(name: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    return [int(p) for p in proc.stdout.split()]


def kill_namespace(name: str, keep: int | None = None) -> None:
    """SIGKILL every process in network namespace `name` but `keep`, until none is left (Ray's
    processes start others while they go)."""
    for _ in range(50):
        pids = [p for p in namespace_pids(name) if p != keep]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


@contextlib.contextmanager
def two_hosts(shared: list[Path], env: dict[str, str]) -> Iterator[tuple[Host, Host]]:
    """Hosts a (SUBNET.1) and b (SUBNET.2), torn down on exit whatever happened inside."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    for tool in ("ip", "nsenter", "unshare", "ss"):
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` is not installed")
    tag = uuid.uuid4().hex[:8]
    names = [f"kimi-rl-{tag}-a", f"kimi-rl-{tag}-b"]
    keep = Path(f"/run/kimi-rl-netns-{tag}")
    holders: list[subprocess.Popen] = []
    made: list[str] = []
    try:
        for name in names:
            _run("ip", "netns", "add", name)
            made.append(name)
        _run("ip", "link", "add", "veth0", "netns", names[0], "type", "veth", "peer", "name", "veth0",
             "netns", names[1])
        hosts = []
        for i, name in enumerate(names):
            address = f"{SUBNET}.{i + 1}"
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "veth0")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", "veth0", "up")
            host_keep = keep / name
            host_keep.mkdir(parents=True)
            holder = subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "-m", "--propagation", "private",
                 "sh", "-c", _HOLD, "hold", *map(str, shared)],
                env={"PATH": os.environ["PATH"], "KEEP": str(host_keep), "HOME_DIR": HOME},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            holders.append(holder)
            if holder.stdout.readline().strip() != "ready":
                raise Unavailable(f"cannot make a mount namespace: {holder.stderr.read().strip()}")
            host_env = {**env, "HOME": HOME, "TMPDIR": "/tmp",
                        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', os.environ['PATH'])}"}
            hosts.append(Host(name, address, holder, host_env))
        yield hosts[0], hosts[1]
    finally:
        # Every process in a host's network namespace was started by this test (Ray's, the
        # driver's, the holder): kill exactly those. (`ray stop` would look for Ray processes
        # by name across the whole machine, other users' clusters included.)
        for name in made:
            kill_namespace(name)
        for holder in holders:
            holder.kill()
            holder.wait()
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        shutil.rmtree(keep, ignore_errors=True)


def start_ray_cluster(head: Host, worker: Host, token: str, num_cpus: int = 2) -> str:
    """A Ray head on `head` and a node joined from `worker`, each with token auth (the token at
    Ray's default place, ~/.ray/auth_token, in each host's private HOME) and one custom
    resource named after its host ("host_a", "host_b"). Returns the head's GCS address."""
    address = f"{head.address}:{RAY_PORT}"
    for host in (head, worker):
        host.write(f"{HOME}/.ray/auth_token", token)
    _ray_start(head, ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"], num_cpus)
    join_ray_cluster(worker, address, num_cpus)
    return address


def join_ray_cluster(host: Host, address: str, num_cpus: int = 2) -> None:
    """`ray start --address` from `host` (again, after its node was killed)."""
    _ray_start(host, [f"--address={address}"], num_cpus)


def _ray_start(host: Host, args: list[str], num_cpus: int) -> None:
    resource = "host_" + host.name[-1]
    host.run(["ray", "start", *args, f"--node-ip-address={host.address}", f"--num-cpus={num_cpus}",
              f"--resources={json.dumps({resource: 1})}", "--disable-usage-stats"],
             timeout=180, RAY_AUTH_MODE="token", **FAST_HEALTH_CHECKS)
