"""Ray for a training run: a local cluster on 127.0.0.1 (dashboard off, token auth on with
the token and temp files under the run directory), or an existing one at `ray.address`; and
the placement group that puts the rollout workers and the trainer on CPUs (or GPUs) of their
own."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from rl.config import PlacementConfig, RayConfig
from rl.errors import UserError
from rl.quiet import worker_runtime_env
from rl.ray_patches import bind_to_loopback

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


def write_auth_token(run_dir: str | Path) -> Path:
    """A fresh random token at <run_dir>/ray_auth_token, readable by the user only."""
    path = Path(run_dir).resolve() / "ray_auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    return path


def start_ray(cfg: RayConfig, run_dir: str | Path, num_cpus_needed: int) -> None:
    """Connect to `cfg.address`, or start a private local cluster for this run."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cfg.address:
        # The cluster's owner decides its auth; Ray reads RAY_AUTH_MODE / RAY_AUTH_TOKEN(_PATH).
        ray.init(address=cfg.address, log_to_driver=True, runtime_env=worker_runtime_env())
        return
    # Token auth (Ray 2.60: RAY_AUTH_MODE=token; every gRPC call between Ray's processes then
    # carries the token). Ray's default token file is ~/.ray/auth_token; RAY_AUTH_TOKEN_PATH,
    # read by Ray's C++ token loader in every process it starts, puts it under the run dir,
    # with a new token per run (a resume too).
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(write_auth_token(run_dir))
    _reload_ray_auth()
    bind_to_loopback()  # Ray would bind "::" and the machine's IP otherwise (see ray_patches)
    ray.init(
        num_cpus=max(cfg.num_cpus or os.cpu_count() or 1, num_cpus_needed),
        include_dashboard=cfg.dashboard,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        _temp_dir=ray_temp_dir(cfg, run_dir),
        log_to_driver=True,
        configure_logging=True,
        logging_level="warning",
        runtime_env=worker_runtime_env(),  # rl/quiet.py's filters in every worker
    )


def _reload_ray_auth() -> None:
    """Make this (driver) process see the auth settings just put in the environment. Ray 2.60
    caches both once per process: the mode in its C++ RayConfig (read when ray is imported)
    and the token in AuthenticationTokenLoader (read on first use), so a second run in the same
    process would otherwise present the first run's token (or none) to the new cluster. These
    are the calls Ray's own `_enable_token_auth` / `ensure_token_if_auth_enabled` make."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# How much of a ray.placement resource each bundle asks for: the resource marks a node
# (`--resources '{"host_b": 1}'`), it does not count slots, so any number of bundles must fit.
_PLACEMENT_SHARE = 0.001


def placement_group(num_rollout_workers: int, gpus_per_actor: float, trainer_ranks: int = 1,
                    placement: PlacementConfig | None = None):
    """One bundle per rollout worker, then one per trainer rank. Each asks for one logical
    CPU (the loop is synchronous: rollout, then training, so every actor may use all cores
    while it works; torch threads are set per actor, not by this bundle) and `gpus_per_actor`
    of a GPU. A role with a `ray.placement` resource gets bundles only on nodes that have it
    (trainer rank r on the r-th resource where the trainer has a list)."""
    import ray
    from ray.util.placement_group import placement_group as make

    placement = placement or PlacementConfig()
    trainer = placement.trainer if isinstance(placement.trainer, list) else [placement.trainer] * trainer_ranks
    names = {"rollout": [placement.rollout] * num_rollout_workers, "trainer": trainer}
    resources = ray.cluster_resources()
    for role, wanted in names.items():
        for name in wanted:
            if name is not None and name not in resources:
                address = ray.get_runtime_context().gcs_address
                raise UserError(f"ray.placement.{role}: the cluster at {address} has no node with the resource "
                                f"{name!r} (its custom resources: {', '.join(sorted(_custom(resources))) or 'none'})")

    def bundle(name: str | None) -> dict[str, float]:
        b = {"CPU": 1.0} | ({"GPU": gpus_per_actor} if gpus_per_actor else {})
        return b | ({name: _PLACEMENT_SHARE} if name else {})

    bundles = [bundle(name) for name in names["rollout"] + names["trainer"]]
    pg = make(bundles, strategy="PACK")
    ray.get(pg.ready())
    return pg


def _custom(resources: dict[str, float]) -> list[str]:
    return [k for k in resources if k not in ("CPU", "GPU", "memory", "object_store_memory")
            and not k.startswith("node:")]


class TrainerGroup:
    """The trainer's tensor-parallel ranks (Ray actors) as one: `group.method.remote(...)`
    calls the method on every rank, waits for all of them, and returns rank 0's ObjectRef (the
    ranks compute the same result: logits are all-gathered, adapters replicated). Waiting
    fails fast: the first rank to raise or die raises here, while the others may still sit in
    a collective that will never complete (the run then stops them all)."""

    def __init__(self, actors: list) -> None:
        self.actors = actors

    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("__") and not name.startswith("__ray_"):
            raise AttributeError(name)
        return _GroupMethod(self.actors, name)


class _GroupMethod:
    def __init__(self, actors: list, name: str) -> None:
        self.actors, self.name = actors, name

    def remote(self, *args, **kwargs):
        import ray

        refs = [getattr(actor, self.name).remote(*args, **kwargs) for actor in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return refs[0]
