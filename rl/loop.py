"""The training loop, top to bottom: `kimi-rl train config.yaml`.

    preflight      everything a user can get wrong is checked before Ray starts
    start          Ray, one placement group, N rollout workers (vLLM) and the trainer (Megatron;
                   tensor_parallel_size x data_parallel_size ranks, called as one:
                   rl.cluster.TrainerGroup)
    resume         trainer state, data cursor and step from the run's latest checkpoint
    sync           the trainer's adapter (or full weights) to every worker, through the hooks
    for each step:
      rollout      prompts x samples_per_prompt, split over the workers, sampled with the
                   rollout's temperature / top-p / top-k (both sides score that distribution);
                   with an `env:`, turn by turn (rl.env): each turn's unfinished trajectories
                   in one generate call, tool observations appended as token ids
      reward       completions scored; a reward function that raises is reported, scores 0
                   (an environment's trajectories carry their reward; one that raised likewise)
      train        the trainer re-scores the sampled tokens (old-policy log-probs); they are
                   compared with the rollout log-probs bit for bit (parity/*) BEFORE the update:
                   a mismatch stops the run (parity.on_mismatch fail; the sequences go to
                   mismatch/step_N.json) or is reported (warn); then the PPO/GRPO/RLOO step on
                   the LoRA adapter. NaN/inf rewards or loss: the step is skipped, the policy
                   unchanged (the trainer restores its state), and reported
      sync         the new adapter to every worker; hooks verify checksums and time it
      log          metrics.jsonl, wandb, console; a checkpoint every `checkpoint.every` steps
      stop?        after SIGINT / SIGTERM: a checkpoint at this step boundary, then exit
    finish         final checkpoint, curves.png, actors and Ray shut down
    faults         the trainer process dying ends the run (RunFailed, naming the last
                   checkpoint); a rollout worker dying is restarted once
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.markup import escape

from parity.compare import compare_logprobs
from parity.lora import AdapterLayout
from parity.wire import Packed
from rl.config import Config, dump_config, trainer_ranks
from rl.errors import UserError, user_error
from rl.metrics import MetricsLog, Wandb, plot_curves

if TYPE_CHECKING:
    from rollout.engine import Stop


@dataclass
class Preflight:
    tokenizer: Any
    samples: list
    reward_fn: Any
    data_issues: list
    env_cls: Any = None  # the environment class of env.name (rl.env), or None: single-turn


def preflight(cfg: Config) -> Preflight:
    """Fail on bad input before any work starts: model, data, reward function, hooks."""
    from transformers import AutoTokenizer

    from parity.hf_config import register_hf_config
    from rl.config import resolve_callable
    from rl.data import build_samples
    from rl.models import validate_model_dir
    from rl.rewards import get_reward_fn
    from rl.sync import build_hooks

    try:
        validate_model_dir(Path(cfg.model.path))
    except UserError as e:
        raise UserError(f"model.path: {e}") from None
    function = resolve_callable(cfg.reward.function) if cfg.reward.function else None
    reward_fn = get_reward_fn(cfg.reward.type, function=function, task=cfg.data.task)
    # Import user hooks now (the parity probe needs actors; it is built later).
    build_hooks([h for h in cfg.sync.hooks if h != "parity_probe"])
    samples, issues = build_samples(
        cfg.data.source, path=cfg.data.path, task=cfg.data.task, task_kwargs=cfg.data.task_kwargs,
        size=cfg.data.size, seed=cfg.seed,
    )
    register_hf_config()  # kimi-mini's config.json names a model type transformers lacks
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    return Preflight(tokenizer, samples, reward_fn, issues, _env_class(cfg, tokenizer, reward_fn))


def _env_class(cfg: Config, tokenizer: Any, reward_fn: Any) -> Any:
    """The class of env.name, with one instance made now: a constructor that fails on these
    kwargs fails before Ray starts."""
    from rl.config import resolve_env

    if cfg.env.name is None:
        return None
    cls = resolve_env(cfg.env.name)
    try:
        cls(tokenizer=tokenizer, reward_fn=reward_fn, **cfg.env.kwargs)
    except Exception as e:  # user code may raise anything
        raise UserError(f"env.name: {cfg.env.name}(**env.kwargs) failed: {type(e).__name__}: {e}") from None
    return cls


def rollout_seed(seed: int, step: int, worker: int, turn: int = 0) -> int:
    """The sampling seed of one worker at one step (and turn, for multi-turn rollouts): a pure
    function, so resume is exact."""
    return (seed * 1_000_003 + step * 10_007 + worker + turn * 7_919) % (2**31 - 1)


def _reserved_layout(cfg: Config) -> AdapterLayout | None:
    """The adapter a non-eager rollout engine holds from start (its graphs replay its buffers)."""
    if cfg.rollout.enforce_eager or not cfg.lora.enabled or not cfg.parity.enabled:
        return None
    return AdapterLayout(cfg.lora.rank, tuple(cfg.lora.target_modules), cfg.lora.alpha / cfg.lora.rank)


def sample_keys(seed: int, step: int, n: int, turn: int = 0) -> list[int]:
    """The parity sampler's request keys of a step's `n` prompts (parity.sampling.request_key),
    by each prompt's index in the whole step: a prompt samples the same tokens whichever
    rollout worker gets it, so the run does not depend on the number of workers. Under one
    worker they are the keys that worker's engine would make itself."""
    from parity.sampling import request_key

    worker_seed = rollout_seed(seed, step, 0, turn)
    return [request_key(worker_seed, 0, i, 0) for i in range(n)]


def split(items: list, parts: int) -> list[list]:
    """Contiguous, nearly equal parts (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


class Run:
    """The actors of one run and the calls the loop makes on them."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None) -> None:
        import ray

        from rl.cluster import start_ray

        self.cfg = cfg
        n = cfg.rollout.num_workers
        start_ray(cfg.ray, run_dir or cfg.run_dir, num_cpus_needed=n + trainer_ranks(cfg))
        try:
            self._start_actors(cfg, n)
        except BaseException:
            ray.shutdown()  # a failed start leaves no cluster behind
            raise

    def _start_actors(self, cfg: Config, n: int) -> None:
        import ray

        from rl.cluster import TrainerGroup, placement_group
        from rollout.worker import RolloutWorker
        from trainer.backend import get_backend, new_rendezvous

        world = trainer_ranks(cfg)
        gpus = cfg.ray.gpus_per_actor
        self.pg = placement_group(n, gpus, trainer_ranks=world, placement=cfg.ray.placement)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING",
                            # JIT-built C++ ops (deepspeed_cpu_adam) are cached in the run dir.
                            "TORCH_EXTENSIONS_DIR": str(Path(cfg.run_dir) / "torch_extensions")}}
        # Where the ranks' torch.distributed meets, on whichever nodes the ranks are placed.
        rendezvous = new_rendezvous() if world > 1 else None
        ranks = [
            ray.remote(get_backend(cfg.trainer.backend).worker_class())
            .options(num_cpus=1, num_gpus=gpus,
                     scheduling_strategy=strategy(self.pg, placement_group_bundle_index=n + r),
                     runtime_env=env)
            .remote(
                cfg.model.path, cfg.model.dtype, parity=cfg.parity.enabled, lora=cfg.lora,
                trainer=cfg.trainer, algorithm=cfg.algorithm, seed=cfg.seed,
                sampling=cfg.rollout.sampling(), kv_cache_dtype=cfg.rollout.kv_cache_dtype,
                **({"rank": r, "rendezvous": rendezvous} if world > 1 else {}),
            )
            for r in range(world)
        ]
        self.trainer = ranks[0] if world == 1 else TrainerGroup(ranks)
        max_len = self.max_model_len = self._max_model_len()
        self._make_worker = lambda i: (
            ray.remote(RolloutWorker)
            .options(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy(self.pg, placement_group_bundle_index=i),
                     runtime_env=env, name=f"kimi-rl-rollout-{i}")
            .remote(
                i, cfg.model.path, dtype=cfg.model.dtype, parity=cfg.parity.enabled, seed=cfg.seed,
                max_model_len=max_len, max_num_seqs=cfg.rollout.max_num_seqs,
                max_num_batched_tokens=cfg.rollout.max_num_batched_tokens,
                tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                enforce_eager=cfg.rollout.enforce_eager, adapter_layout=_reserved_layout(cfg),
                kv_cache_dtype=cfg.rollout.kv_cache_dtype,
                gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            )
        )
        self.workers = [self._make_worker(i) for i in range(n)]
        ray.get(self.trainer.lora_scaling.remote())  # wait until the trainer is up (or raise)
        self.worker_nodes = [_node_of(w) for w in self.workers]
        self.trainer_nodes = [_node_of(a) for a in ranks]

    def _max_model_len(self) -> int:
        from parity.model_spec import load_spec

        return load_spec(self.cfg.model.path).max_position_embeddings

    def generate(self, prompts: list[list[int]], step: int, turn: int = 0, stop: Stop | None = None) -> list[dict]:
        import ray

        r = self.cfg.rollout
        parts = split(prompts, len(self.workers))
        keys = split(sample_keys(self.cfg.seed, step, len(prompts), turn), len(self.workers))
        # The worker seed reseeds only stock vLLM's sampler (parity off); parity engines draw
        # from the keys alone.
        futures = [
            w.generate.remote(p, r.max_tokens, r.sampling(), rollout_seed(self.cfg.seed, step, i, turn), k, stop)
            for i, (w, p, k) in enumerate(zip(self.workers, parts, keys, strict=True)) if p
        ]
        return [c for part in ray.get(futures) for c in part]

    def policy_tensors(self) -> tuple[str, dict[str, torch.Tensor] | Packed, float]:
        """(kind, tensors, scaling) of what the workers must hold now. Parity on: the adapter
        itself, for the parity model, as the trainer packed it into the object store (a
        parity.wire.Packed: the driver holds its handle, the workers read the buffer). Parity
        off: stock vLLM gets full weights with the adapter merged in, the way other frameworks
        hand a LoRA policy to vLLM."""
        import ray

        cfg = self.cfg
        if cfg.lora.enabled and cfg.parity.enabled:
            adapter, scaling = ray.get(self.trainer.rollout_packed.remote())
            return "adapter", adapter, scaling or 1.0
        scaling = ray.get(self.trainer.lora_scaling.remote()) or 1.0
        source = self.trainer.rollout_params if cfg.parity.enabled else self.trainer.merged_weights
        return "full", ray.get(source.remote()), scaling

    def resync_worker(self, index: int) -> None:
        import ray

        from parity.wire import pack_tensors

        kind, tensors, scaling = self.policy_tensors()
        worker = self.workers[index]
        if kind == "adapter":
            ray.get(worker.sync_adapter.remote(tensors.data, scaling, False))
        else:
            ray.get(worker.sync_weights.remote(pack_tensors(tensors), False))

    def restart_worker(self, index: int) -> None:
        import ray

        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._make_worker(index)
        self.worker_nodes[index] = _node_of(self.workers[index])

    def lost_nodes(self, wait_s: float) -> list[str]:
        """"node <ip> (rollout worker i)" or "node <ip> (trainer rank r)" for each actor whose
        node has left the cluster. A killed node's raylet is declared dead by the GCS only
        after its health checks fail (seconds later), so this polls for up to wait_s while every
        node looks alive."""
        import ray

        placed = [(node, f"node {ip} (rollout worker {i})") for i, (node, ip) in enumerate(self.worker_nodes)]
        placed += [(node, f"node {ip} (trainer rank {r})") for r, (node, ip) in enumerate(self.trainer_nodes)]
        here = ray.get_runtime_context().get_node_id()
        if all(node == here for node, _ in placed):
            return []  # every actor is on the driver's node, which is alive: nothing to wait for
        end = time.monotonic() + wait_s
        while True:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            lost = [what for node, what in placed if node not in alive]
            if lost or time.monotonic() >= end:
                return lost
            time.sleep(1)

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=60)
            except Exception:  # a dead worker has nothing left to close
                pass
        ray.shutdown()


def make_sync(run: Run, cfg: Config, probe: list[list[int]]):
    """The WeightSync of this run: hooks from the config, pushes to the Ray actors. A packed
    adapter's data is an object-store handle: passed on as is, each worker reads the buffer."""
    import ray

    from rl.sync import ParityProbeHook, WeightSync, build_hooks

    def push_adapter(packed, scaling, digest):
        data = packed.data if isinstance(packed.data, ray.ObjectRef) else ray.put(packed.data)
        return ray.get([w.sync_adapter.remote(data, scaling, digest) for w in run.workers])

    def push_full(packed, digest):
        ref = ray.put(packed.data)
        return ray.get([w.sync_weights.remote(ref, digest) for w in run.workers])

    def held_checksums(kind, names):
        if kind == "adapter":
            return ray.get([w.adapter_checksums.remote() for w in run.workers])
        return ray.get([w.param_checksums.remote(names) for w in run.workers])

    def fetch(data):
        return ray.get(data) if isinstance(data, ray.ObjectRef) else data

    def parity_probe():
        starts = [1] * len(probe)
        return ParityProbeHook(
            probe,
            score_rollout=lambda i, seqs: ray.get(run.workers[i].prompt_logprobs.remote(list(seqs))),
            # vLLM's teacher-forced prompt log-probs are raw (no sampling step): compare raw.
            score_trainer=lambda seqs: ray.get(run.trainer.logprobs.remote(list(seqs), starts, raw=True)),
        )

    names = list(cfg.sync.hooks)
    if not cfg.parity.enabled:
        # Stock vLLM repacks weights for its kernels, and its log-probs differ from the
        # trainer's by design: there is nothing bitwise to verify.
        names = [n for n in names if n not in ("checksum", "parity_probe")]
    hooks = build_hooks(names, parity_probe=parity_probe)
    return WeightSync(hooks, len(run.workers), push_adapter, push_full, held_checksums, cfg.sync.bucket_mb, fetch)


class RunFailed(Exception):
    """A step could not complete — a parity mismatch with on_mismatch fail, the trainer
    process gone, a checkpoint that could not be written. Nothing of that step was applied;
    the one-line message names the step and how to continue (the CLI exits 1)."""


class RunStopped(Exception):
    """SIGINT / SIGTERM: the run stopped at a step boundary after writing a checkpoint there
    (the CLI exits 128 + the signal's number)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to stop after the current step (with a checkpoint); a
    second one stops at once (KeyboardInterrupt: the run's processes are still shut down, the
    last checkpoint is the one to resume from). Installed after ray.init, which sets its own
    SIGTERM handler in the driver (sys.exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        # Python delivers signals to the main thread only: elsewhere (train() called from a
        # thread), the caller's own handling stays.
        main = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS} if main else {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def write_pids(run: Run, run_dir: Path) -> None:
    """<run_dir>/pids.json: the driver's and each actor's process id (to watch or stop them)."""
    import json

    import ray

    def pid(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))

    pids = {"driver": os.getpid(), "trainer": pid(run.trainer), "rollout": [pid(w) for w in run.workers]}
    if hasattr(run.trainer, "actors"):  # tensor-parallel ranks (rl.cluster.TrainerGroup)
        pids["trainer_ranks"] = [pid(a) for a in run.trainer.actors]
    (run_dir / "pids.json").write_text(json.dumps(pids) + "\n")


@dataclass
class Logs:
    """Where a run reports: metrics.jsonl, wandb, issues.log and the console."""

    metrics: MetricsLog
    wandb: Wandb
    issues: Any  # issues.log, open for appending
    console: Any

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, console, resume_step: int | None) -> Logs:
        return cls(
            MetricsLog(run_dir, resume_step=resume_step),
            Wandb(cfg.logging.wandb, cfg.logging.project, run_dir, config={"run_dir": str(run_dir)}),
            open(run_dir / "issues.log", "a", encoding="utf-8"),  # noqa: SIM115 (closed by close())
            console,
        )

    def record(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self.wandb.log(record)

    def issue(self, line: str) -> None:
        self.issues.write(line + "\n")
        self.issues.flush()

    def close(self) -> None:
        self.metrics.close()
        self.wandb.close()
        self.issues.close()


@dataclass
class Loop:
    """What every step uses: the config, the actors, the data, the weight sync and the logs."""

    cfg: Config
    run: Run
    pre: Preflight
    source: Any  # rl.data.PromptSource
    logs: Logs
    run_dir: Path
    step: int  # the step in progress (for messages)
    sync: Any = None  # step -> sync metrics: the current policy to every rollout worker


def train(cfg: Config, console=None) -> Path:
    """Run (or resume, with cfg.checkpoint.resume_from) a training run; returns the run dir.
    Raises RunFailed (a step could not complete) or RunStopped (SIGINT / SIGTERM)."""
    import ray
    from rich.console import Console

    console = console or Console()
    pre = preflight(cfg)
    run_dir, resumed = prepare_run_dir(cfg, console)
    for issue in pre.data_issues:
        console.print(f"[yellow]skipped data row[/] {issue}")
    source, start_step = prompt_source(cfg, pre, resumed)
    logs = Logs.open(cfg, run_dir, console, resume_step=start_step if resumed is not None else None)
    console.print(_banner(cfg, run_dir))
    loop = Loop(cfg, Run(cfg, run_dir), pre, source, logs, run_dir, step=start_step + 1)
    stop = StopOnSignal()
    try:
        write_pids(loop.run, run_dir)
        if resumed is not None:
            load_resumed(loop.run, resumed)
        loop.sync = start_sync(loop)
        loop.sync(start_step)
        run_steps(loop, start_step, stop)
        if cfg.total_steps > start_step:
            save(loop.run, run_dir, cfg.total_steps, source, cfg)
    except ray.exceptions.RayActorError as e:
        trainer_alive = _alive(loop.run.trainer)
        try:
            # A trainer that died with its node shows as a dead actor before the GCS declares
            # the node dead: wait for that verdict then.
            check_nodes(loop.run, e, patient=not trainer_alive)
        except NodeLost as lost:
            raise _node_lost(loop, lost) from None
        if not trainer_alive:
            raise _step_failed(loop, f"the trainer process died ({type(e).__name__})") from None
        raise
    except NodeLost as lost:  # found by generate_with_restart
        raise _node_lost(loop, lost) from None
    finally:
        stop.restore()
        logs.close()
        loop.run.close()
    if cfg.logging.plot:
        png = plot_curves(run_dir)
        if png:
            console.print(f"curves: {png}")
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")
    return run_dir


def prepare_run_dir(cfg: Config, console) -> tuple[Path, dict | None]:
    """(run dir, the resumed checkpoint's state or None), the run dir created with the
    resolved config in it. A resume target is checked now, before Ray starts; a fresh run
    refuses a run dir that already holds a run."""
    run_dir = Path(cfg.run_dir)
    resumed = None
    if cfg.checkpoint.resume_from:
        from trainer.checkpoint import CheckpointError, read_checkpoint_state

        try:
            resumed = read_checkpoint_state(Path(cfg.checkpoint.resume_from))
        except CheckpointError as e:
            raise user_error(e) from None
        run_dir = Path(resumed["path"]).parent.parent  # <run_dir>/checkpoints/step_N
        for reason in resumed["skipped"]:
            console.print(f"[yellow]skipped invalid checkpoint[/] {escape(reason)}")
        console.print(f"resuming from {escape(str(resumed['path']))} (step {resumed['step']})")
    elif (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise UserError(f"run_dir: {run_dir} already holds a run; continue it with "
                        f"--resume {run_dir}, or choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    # A resume runs in the checkpoint's run dir, whatever run_dir the config file names
    written = dataclasses.replace(cfg, run_dir=str(run_dir))
    (run_dir / "config.yaml").write_text(dump_config(written), encoding="utf-8")
    return run_dir, resumed


def prompt_source(cfg: Config, pre: Preflight, resumed: dict | None):
    """(the prompt source, the last completed step): from the start, or where the resumed
    checkpoint left the data cursor."""
    from rl.data import PromptSource

    source = PromptSource(pre.samples, cfg.data.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    if resumed is None:
        return source, 0
    source.load_state_dict(resumed["extra"]["data"])
    return source, resumed["step"]


def _banner(cfg: Config, run_dir: Path) -> str:
    return (f"[bold]kimi-rl train[/] → {run_dir}  ({cfg.algorithm.name}, "
            f"{'LoRA r=' + str(cfg.lora.rank) if cfg.lora.enabled else 'full weights'}, "
            f"parity {'on, on_mismatch ' + cfg.parity.on_mismatch if cfg.parity.enabled else 'off'}, "
            f"{cfg.rollout.num_workers} rollout worker(s))")


def load_resumed(run: Run, resumed: dict) -> None:
    import ray

    from trainer.checkpoint import CheckpointError

    try:
        ray.get(run.trainer.load_checkpoint.remote(str(resumed["path"])))
    except CheckpointError as e:
        raise user_error(e) from None


def start_sync(loop: Loop):
    """step -> sync metrics: the trainer's current policy to every rollout worker, through the
    configured hooks (the parity probe scores the first data prompts)."""
    from rl.data import format_prompt

    cfg, run = loop.cfg, loop.run
    probe = [format_prompt(s, loop.pre.tokenizer, cfg.data.chat_template)
             for s in loop.pre.samples[: cfg.sync.parity_probe_prompts]]
    weight_sync = make_sync(run, cfg, probe)

    def sync(step: int) -> dict[str, float]:
        kind, tensors, scaling = run.policy_tensors()
        return weight_sync.sync(step, tensors, kind=kind, scaling=scaling)

    return sync


def run_steps(loop: Loop, start_step: int, stop: StopOnSignal) -> None:
    """Steps start_step + 1 .. total_steps, each logged, with a checkpoint every
    `checkpoint.every` steps; after a signal, a checkpoint at this step boundary and RunStopped."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg, run_dir = loop.cfg, loop.run_dir
    columns = [TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    with Progress(*columns, console=loop.logs.console, disable=not cfg.logging.console) as progress:
        task = progress.add_task("train", total=cfg.total_steps, completed=start_step, info="")
        for step in range(start_step + 1, cfg.total_steps + 1):
            loop.step = step
            record = train_step(loop, step)
            loop.logs.record(record)
            saved = cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.total_steps
            if saved:
                save(loop.run, run_dir, step, loop.source, cfg)
            progress.update(task, advance=1, info="skipped" if record["step/skipped"] else (
                f"reward {record['reward/mean']:.3f}  parity {record['parity/bitwise_equal_fraction']:.4f}"
                f"  kl {record['ppo/kl']:.2e}"))
            if stop.signum is not None and step < cfg.total_steps:
                if not saved:
                    save(loop.run, run_dir, step, loop.source, cfg)
                name = signal.Signals(stop.signum).name
                raise RunStopped(f"{name}: stopped after step {step}, checkpoint "
                                 f"{run_dir / 'checkpoints' / _step_name(step)}; continue with "
                                 f"--resume {run_dir}", stop.signum)


def _step_name(step: int) -> str:
    from trainer.checkpoint import step_dir_name

    return step_dir_name(step)


def _alive(actor) -> bool:
    """Whether the actor (every rank of a TrainerGroup) answers within 30 s."""
    import ray

    actors = getattr(actor, "actors", [actor])
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=30)
        return True
    except Exception:  # dead, or not answering: either way it cannot go on
        return False


def _node_lost(loop: Loop, lost: NodeLost) -> RunFailed:
    return _step_failed(loop, str(lost))


def _step_failed(loop: Loop, what: str) -> RunFailed:
    """RunFailed for step loop.step cut short by `what`, naming the checkpoint to resume from.
    A failure while the step's own checkpoint was being finished (it is already the newest valid
    one) comes after the step was applied: the message says so rather than "not applied"."""
    from trainer.checkpoint import CheckpointError, resolve_checkpoint

    try:
        last, _ = resolve_checkpoint(loop.run_dir)
    except CheckpointError:
        return RunFailed(f"step {loop.step}: {what}; the step was not applied; "
                         f"no checkpoint yet under {loop.run_dir}: start again")
    applied = "its checkpoint was written" if last.name == _step_name(loop.step) else "the step was not applied"
    return RunFailed(f"step {loop.step}: {what}; {applied}; the last checkpoint is {last}: "
                     f"continue with --resume {loop.run_dir}")


def save(run: Run, run_dir: Path, step: int, source, cfg: Config) -> None:
    import ray

    from trainer.checkpoint import CheckpointError

    try:
        ray.get(run.trainer.save_checkpoint.remote(
            str(run_dir), step, {"data": source.state_dict()}, cfg.checkpoint.keep))
    except CheckpointError as e:  # Ray re-raises the trainer's exception as a subclass of it
        raise RunFailed(f"step {step}: {user_error(e)}") from None


def write_mismatch(run_dir: Path, step: int, completions: list[dict], old_logprobs: list[torch.Tensor]) -> tuple[Path, dict]:
    """<run_dir>/mismatch/step_N.json: every sequence whose rollout and trainer log-probs are
    not torch.equal (prompt ids, sampled token ids, both log-prob vectors, as exact floats),
    and the first differing token; returns (path, that first token)."""
    import json

    rows, first = [], None
    for i, (c, trainer_lp) in enumerate(zip(completions, old_logprobs, strict=True)):
        rollout_lp = c["rollout_logprobs"]
        if torch.equal(rollout_lp, trainer_lp):
            continue
        t = int((rollout_lp != trainer_lp).nonzero()[0, 0])
        if first is None:
            first = {"sequence": i, "token_index": t, "token_id": c["token_ids"][t],
                     "rollout": float(rollout_lp[t]), "trainer": float(trainer_lp[t])}
        rows.append({"sequence": i, "prompt_ids": c["prompt_ids"], "token_ids": c["token_ids"],
                     "rollout_logprobs": rollout_lp.tolist(), "trainer_logprobs": trainer_lp.tolist()})
    path = run_dir / "mismatch" / f"{_step_name(step)}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"step": step, "first": first, "sequences": rows}) + "\n")
    return path, first


def train_step(loop: Loop, step: int) -> dict[str, Any]:
    """One step: rollout, reward, parity check, train, sync. Returns the step's metrics record
    (`step/skipped` 1 when the step was not applied: non-finite rewards or loss)."""
    import ray

    t0 = time.perf_counter()
    group_samples, completions, rollout_record = rollout_step(loop, step)
    times = {"time/rollout": time.perf_counter() - t0, "time/reward": 0.0, "time/score": 0.0, "time/train": 0.0}
    t0 = time.perf_counter()
    rewards, issues, record = reward_step(loop, step, group_samples, completions)
    record.update(rollout_record)
    times["time/reward"] = time.perf_counter() - t0
    non_finite = [i for i in issues if i.non_finite]
    if non_finite:
        return _skip(loop, step, record, f"{len(non_finite)} non-finite reward(s) ({non_finite[0]})", times)

    # train: old-policy log-probs, compared bitwise with the rollout's BEFORE the update
    batch = {
        "sequences": [c["prompt_ids"] + c["token_ids"] for c in completions],
        "starts": [len(c["prompt_ids"]) for c in completions],
        "rollout_logprobs": [c["rollout_logprobs"] for c in completions],
        "rewards": rewards,
        "group_size": loop.cfg.rollout.samples_per_prompt,
    }
    if loop.pre.env_cls is not None:  # trajectories: train on the model's tokens only
        batch["masks"] = [c["mask"] for c in completions]
    t0 = time.perf_counter()
    old_logprobs = ray.get(loop.run.trainer.old_logprobs.remote(batch))
    times["time/score"] = time.perf_counter() - t0  # the forward and log-prob tail, within time/train
    record.update(check_parity(loop, step, completions, old_logprobs))
    result = ray.get(loop.run.trainer.train_step.remote(batch, old_logprobs))
    times["time/train"] = time.perf_counter() - t0
    if result["skipped"]:  # the trainer restored its state: nothing changed, nothing to sync
        return _skip(loop, step, record, result["skipped"], times)

    # sync the updated policy to the rollout workers
    sync_metrics = loop.sync(step)
    return {**record, **result["stats"], **{"sync/checksum_ok": 0.0, **sync_metrics}, **times}


def rollout_step(loop: Loop, step: int) -> tuple[list, list[dict], dict[str, float]]:
    """(samples, completions, rollout/* and env/* metrics): each prompt of the step sampled
    samples_per_prompt times, consecutively (GRPO / RLOO groups); with an environment, as
    multi-turn trajectories (env_rollout)."""
    from rl.data import format_prompt

    cfg = loop.cfg
    samples = loop.source.next_batch()
    group_samples = [s for s in samples for _ in range(cfg.rollout.samples_per_prompt)]
    if loop.pre.env_cls is not None:
        return group_samples, *env_rollout(loop, step, group_samples)
    prompts = [format_prompt(s, loop.pre.tokenizer, cfg.data.chat_template) for s in group_samples]
    completions = generate_with_restart(loop.run, prompts, step, loop.logs)
    return group_samples, completions, {"rollout/prefix_cache_hit_tokens": sum(c["cached_tokens"] for c in completions)}


def env_rollout(loop: Loop, step: int, group_samples: list) -> tuple[list[dict], dict[str, float]]:
    """(completions, env/* and rollout/* metrics): one environment per sample, run turn by turn (rl.env);
    each completion also holds its mask, its trajectory's reward and the environment's error."""
    from rl.env import Budget, env_metrics, run_trajectories

    cfg, r = loop.cfg, loop.cfg.rollout
    envs = [loop.pre.env_cls(tokenizer=loop.pre.tokenizer, reward_fn=loop.pre.reward_fn, **cfg.env.kwargs)
            for _ in group_samples]
    budget = Budget(r.max_turns, r.max_tokens, r.max_trajectory_tokens, loop.run.max_model_len)

    hits = 0  # prompt tokens of every turn taken from the prefix cache (earlier turns' KV)

    def generate(prompts: list[list[int]], turn: int, stop: Stop | None) -> list[dict]:
        nonlocal hits
        done = generate_with_restart(loop.run, prompts, step, loop.logs, turn, stop)
        hits += sum(c["cached_tokens"] for c in done)
        return done

    try:
        trajectories = run_trajectories(envs, group_samples, budget, generate)
    except ValueError as e:  # an environment's reset failed: no trajectory to train on
        raise UserError(f"step {step}: env.name {cfg.env.name}: {e}") from None
    completions = [{**t.completion(), "reward": t.reward, "env_error": t.error} for t in trajectories]
    return completions, {**env_metrics(envs, trajectories), "rollout/prefix_cache_hit_tokens": hits}


def reward_step(loop: Loop, step: int, group_samples: list, completions: list[dict]) -> tuple[torch.Tensor, list, dict[str, Any]]:
    """(rewards, reward issues, the step's record so far): the completions scored; a reward
    function that raises is reported and scores 0."""
    from rl.rewards import score_batch

    if loop.pre.env_cls is not None:
        rewards, issues = env_rewards(completions, group_samples)
    else:
        texts = [loop.pre.tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in completions]
        rewards, issues = score_batch(loop.pre.reward_fn, texts, group_samples)
    for issue in issues:
        loop.logs.issue(f"step {step}: reward: {issue}")
        loop.logs.console.print(f"[yellow]step {step}: reward function failed[/] {issue}")
    reward_t = torch.tensor(rewards, dtype=torch.float32)
    lengths = torch.tensor([len(c["token_ids"]) for c in completions], dtype=torch.float32)
    record: dict[str, Any] = {
        "step": step,
        "step/skipped": 0.0,
        "reward/mean": float(reward_t.mean()),
        "reward/std": float(reward_t.std()) if len(reward_t) > 1 else 0.0,
        "reward/issues": len(issues),
        "response/length_mean": float(lengths.mean()),
    }
    return reward_t, issues, record


def env_rewards(completions: list[dict], samples: list) -> tuple[list[float], list]:
    """The trajectories' rewards, checked as reward functions' are (rl.rewards): an environment
    that raised, or a reward that is not a finite number, scores 0 and is reported."""
    from rl.rewards import NON_FINITE, RewardIssue, as_reward, excerpt

    rewards, issues = [], []
    for i, (c, sample) in enumerate(zip(completions, samples, strict=True)):
        value, error = (0.0, f"env: {c['env_error']}") if c["env_error"] else as_reward(c["reward"])
        rewards.append(value)
        if error is not None:
            issues.append(RewardIssue(i, excerpt(sample.prompt), error, error.startswith(NON_FINITE)))
    return rewards, issues


def model_tokens(completions: list[dict], logprobs: list[torch.Tensor]) -> tuple[list[dict], list[torch.Tensor]]:
    """The completions and the trainer's log-probs cut to the model's own tokens (mask 1): a
    trajectory's observation tokens were never sampled, so they have no rollout log-prob."""
    if not completions or "mask" not in completions[0]:
        return completions, logprobs
    views, kept = [], []
    for c, lp in zip(completions, logprobs, strict=True):
        on = c["mask"].bool()
        views.append({"prompt_ids": c["prompt_ids"], "rollout_logprobs": c["rollout_logprobs"][on],
                      "token_ids": [t for t, m in zip(c["token_ids"], on.tolist(), strict=True) if m]})
        kept.append(lp[on])
    return views, kept


def check_parity(loop: Loop, step: int, completions: list[dict], old_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """The trainer's old-policy log-probs against the rollout's, bit for bit: a mismatch (with
    parity on) is written to mismatch/step_N.json and stops the run (on_mismatch fail) or is
    reported (warn). Returns the parity/* metrics."""
    cfg = loop.cfg
    completions, old_logprobs = model_tokens(completions, old_logprobs)
    parity = compare_logprobs([c["rollout_logprobs"] for c in completions], old_logprobs)
    if cfg.parity.enabled and not parity.all_equal:
        path, first = write_mismatch(loop.run_dir, step, completions, old_logprobs)
        message = (f"step {step}: rollout and trainer log-probs differ in "
                   f"{parity.sequences - parity.sequences_equal} sequence(s), "
                   f"{parity.tokens_compared - parity.tokens_equal} token(s); first at sequence "
                   f"{first['sequence']} token {first['token_index']} (id {first['token_id']}): rollout "
                   f"{first['rollout']!r}, trainer {first['trainer']!r}; sequences in {path}")
        loop.logs.issue(message)
        if cfg.parity.on_mismatch == "fail":
            raise RunFailed(f"{message}; the update was not applied (parity.on_mismatch: fail)")
        loop.logs.console.print(f"[red]{escape(message)}[/] (parity.on_mismatch: warn: training on)")
    return {
        "parity/tokens": parity.tokens_compared,
        "parity/bitwise_equal_fraction": parity.bitwise_equal_fraction,
        "parity/max_abs_diff": parity.max_abs_diff,
        "parity/kl_k1": parity.kl_k1,
        "parity/kl_k3": parity.kl_k3,
    }


def _skip(loop: Loop, step: int, record: dict, reason: str, times: dict[str, float]) -> dict[str, Any]:
    loop.logs.console.print(f"[yellow]step {step} skipped[/] (policy unchanged): {escape(reason)}")
    loop.logs.issue(f"step {step}: skipped (policy unchanged): {reason}")
    return {**record, "step/skipped": 1.0, **times}


def generate_with_restart(run: Run, prompts: list[list[int]], step: int, logs: Logs, turn: int = 0,
                          stop: Stop | None = None) -> list[dict]:
    """A rollout worker that dies is reported, restarted once, re-synced, and the step's rollout
    re-run (its seed is a function of the step, so the retry samples the same tokens)."""
    import ray

    try:
        return run.generate(prompts, step, turn, stop)
    except ray.exceptions.RayActorError as e:
        check_nodes(run, e)
        dead = _dead_workers(run)
        if not dead:
            raise
        for i in dead:
            logs.console.print(f"[red]step {step}: rollout worker {i} died[/] ({type(e).__name__}); restarting it")
            logs.issue(f"step {step}: rollout worker {i} died ({type(e).__name__}); restarted")
            run.restart_worker(i)
            run.resync_worker(i)
        try:
            return run.generate(prompts, step, turn, stop)
        except ray.exceptions.RayActorError as e2:
            raise UserError(f"step {step}: a rollout worker died again after a restart: {e2}") from None


class NodeLost(Exception):
    """A node that runs rollout workers or trainer ranks left the Ray cluster: no restart can
    place them again (their bundles wait for a node with the resource), so the run stops."""


def _node_of(actor) -> tuple[str, str]:
    """(node id, node IP) of the node running the actor."""
    import ray

    return ray.get(actor.__ray_call__.remote(
        lambda _: (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())))


def check_nodes(run: Run, error: Exception, patient: bool = False) -> None:
    """Raise NodeLost if a rollout worker's or a trainer rank's node is gone.
    ActorUnavailableError (the actor's connection closed without a death notice) is how a
    node's loss shows first: wait for the GCS's verdict then, or when `patient`."""
    import ray

    wait = 60.0 if patient or isinstance(error, ray.exceptions.ActorUnavailableError) else 0.0
    lost = run.lost_nodes(wait)
    if lost:
        raise NodeLost(f"{', '.join(lost)} left the Ray cluster ({type(error).__name__})")


def _dead_workers(run: Run) -> list[int]:
    import ray

    dead = []
    for i, w in enumerate(run.workers):
        try:
            ray.get(w.__ray_ready__.remote(), timeout=30)
        except Exception:
            dead.append(i)
    return dead


def add_train_commands(subparsers) -> None:
    p = subparsers.add_parser("train", help="PPO / GRPO / RLOO with LoRA: vLLM rollout, Megatron trainer")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.kl_coef=0.01")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.set_defaults(func=run_train_command)


def run_train_command(ns) -> int:
    from rl.config import load_config

    overrides = list(ns.overrides)
    if ns.resume:
        overrides.append(f"checkpoint.resume_from={ns.resume}")
    cfg = load_config(ns.config, overrides)
    if ns.print_config:
        print(dump_config(cfg), end="")
        return 0
    try:
        train(cfg)
    except RunStopped as e:
        sys.stderr.write(f"kimi-rl: {e}\n")
        return 128 + e.signum
    except RunFailed as e:
        sys.stderr.write(f"kimi-rl: error: {e}\n")
        return 1
    return 0
