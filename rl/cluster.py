"""Ray for a training run: a local cluster on 127.0.0.1 (dashboard off, temp and auth files
under the run directory), or an existing one at `ray.address`; and the placement group that
puts the rollout workers and the trainer on CPUs (or GPUs) of their own."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rl.config import RayConfig

# Ray puts unix sockets at <temp_dir>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store
# (~64 more bytes); Linux caps socket paths at 107 bytes, so a deep run_dir is swapped for a
# short directory under the system temp dir.
_MAX_TEMP_DIR = 36


def ray_temp_dir(cfg: RayConfig, run_dir: str | Path) -> str:
    path = Path(cfg.temp_dir) if cfg.temp_dir else Path(run_dir) / "ray"
    path = path.resolve()
    if len(str(path)) > _MAX_TEMP_DIR:
        path = Path(tempfile.mkdtemp(prefix="kimi-rl-ray-"))
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def start_ray(cfg: RayConfig, run_dir: str | Path, num_cpus_needed: int) -> None:
    """Connect to `cfg.address`, or start a private local cluster for this run."""
    import ray

    # Token auth (new in Ray 2.60) would write ~/.ray/auth_token; a private local cluster
    # bound to 127.0.0.1 needs none, and the user's home stays untouched.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=True)
        return
    ray.init(
        num_cpus=max(cfg.num_cpus or os.cpu_count() or 1, num_cpus_needed),
        include_dashboard=cfg.dashboard,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        _temp_dir=ray_temp_dir(cfg, run_dir),
        log_to_driver=True,
        configure_logging=True,
        logging_level="warning",
    )


def placement_group(num_rollout_workers: int, use_gpus: bool):
    """One bundle per rollout worker, then one for the trainer. CPU bundles ask for one
    logical CPU each: the loop is synchronous (rollout, then training), so every actor may use
    all cores while it works; torch threads are set per actor, not by this bundle."""
    import ray
    from ray.util.placement_group import placement_group as make

    resource = {"GPU": 1} if use_gpus else {"CPU": 1}
    pg = make([dict(resource) for _ in range(num_rollout_workers + 1)], strategy="PACK")
    ray.get(pg.ready())
    return pg
