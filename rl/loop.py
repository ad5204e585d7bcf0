"""The training loop, top to bottom: `kimi-rl train config.yaml`.

    preflight      everything a user can get wrong is checked before Ray starts
    start          Ray, one placement group, N rollout workers (vLLM) and the trainer (Megatron)
    resume         trainer state, data cursor and step from the run's latest checkpoint
    sync           the trainer's adapter (or full weights) to every worker, through the hooks
    for each step:
      rollout      prompts x samples_per_prompt, split over the workers, sampled with the
                   rollout's temperature / top-p / top-k (both sides score that distribution)
      reward       completions scored; a reward function that raises is reported, scores 0
      train        the trainer re-scores the sampled tokens (old-policy log-probs), compares them
                   with the rollout log-probs bit for bit (parity/*), and takes the PPO/GRPO/RLOO
                   step on the LoRA adapter
      sync         the new adapter to every worker; hooks verify checksums and time it
      log          metrics.jsonl, wandb, console; a checkpoint every `checkpoint.every` steps
    finish         final checkpoint, curves.png, actors and Ray shut down
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parity.compare import compare_logprobs
from rl.config import Config, dump_config
from rl.errors import UserError, user_error
from rl.metrics import MetricsLog, Wandb, plot_curves


@dataclass
class Preflight:
    tokenizer: Any
    samples: list
    reward_fn: Any
    data_issues: list


def preflight(cfg: Config) -> Preflight:
    """Fail on bad input before any work starts: model, data, reward function, hooks."""
    from transformers import AutoTokenizer

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
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    return Preflight(tokenizer, samples, reward_fn, issues)


def rollout_seed(seed: int, step: int, worker: int) -> int:
    """The sampling seed of one worker at one step: a pure function, so resume is exact."""
    return (seed * 1_000_003 + step * 10_007 + worker) % (2**31 - 1)


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

    def __init__(self, cfg: Config) -> None:
        import ray

        from rl.cluster import start_ray

        self.cfg = cfg
        self.packed_adapter: tuple = (None, {})  # (object ref, its tensors) of the last adapter
        n = cfg.rollout.num_workers
        start_ray(cfg.ray, cfg.run_dir, num_cpus_needed=n + 1)
        try:
            self._start_actors(cfg, n)
        except BaseException:
            ray.shutdown()  # a failed start leaves no cluster behind
            raise

    def _start_actors(self, cfg: Config, n: int) -> None:
        import ray

        from rl.cluster import placement_group
        from rollout.worker import RolloutWorker
        from trainer.worker import trainer_worker

        self.pg = placement_group(n, use_gpus=False)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING",
                            # JIT-built C++ ops (deepspeed_cpu_adam) are cached in the run dir.
                            "TORCH_EXTENSIONS_DIR": str(Path(cfg.run_dir) / "torch_extensions")}}
        self.trainer = (
            ray.remote(trainer_worker(cfg.trainer.backend))
            .options(num_cpus=1, scheduling_strategy=strategy(self.pg, placement_group_bundle_index=n),
                     runtime_env=env)
            .remote(
                cfg.model.path, cfg.model.dtype, parity=cfg.parity, lora=cfg.lora,
                trainer=cfg.trainer, algorithm=cfg.algorithm, seed=cfg.seed,
                sampling=cfg.rollout.sampling(),
            )
        )
        max_len = self._max_model_len()
        self._make_worker = lambda i: (
            ray.remote(RolloutWorker)
            .options(num_cpus=1, scheduling_strategy=strategy(self.pg, placement_group_bundle_index=i),
                     runtime_env=env, name=f"kimi-rl-rollout-{i}")
            .remote(
                i, cfg.model.path, dtype=cfg.model.dtype, parity=cfg.parity, seed=cfg.seed,
                max_model_len=max_len, max_num_seqs=cfg.rollout.max_num_seqs,
                max_num_batched_tokens=cfg.rollout.max_num_batched_tokens,
            )
        )
        self.workers = [self._make_worker(i) for i in range(n)]
        ray.get(self.trainer.lora_scaling.remote())  # wait until the trainer is up (or raise)

    def _max_model_len(self) -> int:
        from parity.model_spec import load_spec

        return load_spec(self.cfg.model.path).max_position_embeddings

    def generate(self, prompts: list[list[int]], step: int) -> list[dict]:
        import ray

        r = self.cfg.rollout
        parts = split(prompts, len(self.workers))
        futures = [
            w.generate.remote(p, r.max_tokens, r.sampling(), rollout_seed(self.cfg.seed, step, i))
            for i, (w, p) in enumerate(zip(self.workers, parts, strict=True)) if p
        ]
        return [c for part in ray.get(futures) for c in part]

    def policy_tensors(self) -> tuple[str, dict[str, torch.Tensor], float]:
        """(kind, tensors, scaling) of what the workers must hold now. Parity on: the adapter
        itself, for the parity model. Parity off: stock vLLM gets full weights with the adapter
        merged in, the way other frameworks hand a LoRA policy to vLLM."""
        import ray

        from parity.wire import unpack_tensors

        cfg = self.cfg
        scaling = ray.get(self.trainer.lora_scaling.remote()) or 1.0
        if cfg.lora.enabled and cfg.parity:
            # Packed by the trainer: the workers read this very object from the store, unless
            # a hook replaces a tensor (see make_sync); the hooks see views of it.
            ref = self.trainer.rollout_packed.remote()
            tensors = unpack_tensors(*ray.get(ref))
            self.packed_adapter = (ref, tensors)
            return "adapter", tensors, scaling
        source = self.trainer.rollout_params if cfg.parity else self.trainer.merged_weights
        return "full", ray.get(source.remote()), scaling

    def resync_worker(self, index: int) -> None:
        import ray

        from parity.wire import pack_tensors

        kind, tensors, scaling = self.policy_tensors()
        worker, packed = self.workers[index], pack_tensors(tensors)
        call = worker.sync_adapter.remote(packed, scaling) if kind == "adapter" else worker.sync_weights.remote(packed)
        ray.get(call)

    def restart_worker(self, index: int) -> None:
        import ray

        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._make_worker(index)

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=60)
            except Exception:  # a dead worker has nothing left to close
                pass
        ray.shutdown()


def make_sync(run: Run, cfg: Config, probe: list[list[int]]):
    """The WeightSync of this run: hooks from the config, pushes to the Ray actors."""
    import ray

    from parity.wire import pack_tensors
    from rl.sync import ParityProbeHook, WeightSync, build_hooks

    def push_adapter(tensors, scaling, checksums):
        ref, sent = run.packed_adapter
        if ref is None or tensors.keys() != sent.keys() or any(tensors[k] is not v for k, v in sent.items()):
            ref = ray.put(pack_tensors(tensors))  # a hook changed the tensors: pack them again
        return ray.get([w.sync_adapter.remote(ref, scaling, checksums) for w in run.workers])

    def push_full(bucket, checksums):
        ref = ray.put(pack_tensors(bucket))
        return ray.get([w.sync_weights.remote(ref, checksums) for w in run.workers])

    def parity_probe():
        starts = [1] * len(probe)
        return ParityProbeHook(
            probe,
            score_rollout=lambda i, seqs: ray.get(run.workers[i].prompt_logprobs.remote(list(seqs))),
            # vLLM's teacher-forced prompt log-probs are raw (no sampling step): compare raw.
            score_trainer=lambda seqs: ray.get(run.trainer.logprobs.remote(list(seqs), starts, raw=True)),
        )

    names = list(cfg.sync.hooks)
    if not cfg.parity:
        # Stock vLLM repacks weights for its kernels, and its log-probs differ from the
        # trainer's by design: there is nothing bitwise to verify.
        names = [n for n in names if n not in ("checksum", "parity_probe")]
    hooks = build_hooks(names, parity_probe=parity_probe)
    return WeightSync(hooks, len(run.workers), push_adapter, push_full, cfg.sync.bucket_mb)


def train(cfg: Config, console=None) -> Path:
    """Run (or resume, with cfg.checkpoint.resume_from) a training run; returns the run dir."""
    import ray
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rl.data import PromptSource, format_prompt
    from rl.rewards import score_batch

    console = console or Console()
    pre = preflight(cfg)
    run_dir = Path(cfg.run_dir)
    resume_dir = Path(cfg.checkpoint.resume_from) if cfg.checkpoint.resume_from else None
    if resume_dir is not None:
        from trainer.checkpoint import CheckpointError, read_checkpoint_state

        try:
            resumed = read_checkpoint_state(resume_dir)  # checked now, not after Ray started
        except CheckpointError as e:
            raise user_error(e) from None
        run_dir = Path(resumed["path"]).parent.parent  # <run_dir>/checkpoints/step_N
    else:
        resumed = None
        if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
            raise UserError(f"run_dir: {run_dir} already holds a run; continue it with "
                            f"--resume {run_dir}, or choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
    for issue in pre.data_issues:
        console.print(f"[yellow]skipped data row[/] {issue}")

    source = PromptSource(pre.samples, cfg.data.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step = 0
    if resumed is not None:
        source.load_state_dict(resumed["extra"]["data"])
        start_step = resumed["step"]
    metrics = MetricsLog(run_dir, resume_step=start_step if resumed is not None else None)
    wandb = Wandb(cfg.logging.wandb, cfg.logging.project, run_dir, config={"run_dir": str(run_dir)})
    issues_log = open(run_dir / "issues.log", "a", encoding="utf-8")  # noqa: SIM115

    console.print(f"[bold]kimi-rl train[/] → {run_dir}  ({cfg.algorithm.name}, "
                  f"{'LoRA r=' + str(cfg.lora.rank) if cfg.lora.enabled else 'full weights'}, "
                  f"parity {'on' if cfg.parity else 'off'}, {cfg.rollout.num_workers} rollout worker(s))")
    run = Run(cfg)
    try:
        if resumed is not None:
            from trainer.checkpoint import CheckpointError

            try:
                ray.get(run.trainer.load_checkpoint.remote(str(resumed["path"])))
            except CheckpointError as e:
                raise user_error(e) from None
        probe = [format_prompt(s, pre.tokenizer, cfg.data.chat_template)
                 for s in pre.samples[: cfg.sync.parity_probe_prompts]]
        weight_sync = make_sync(run, cfg, probe)

        def sync(step: int) -> dict[str, float]:
            kind, tensors, scaling = run.policy_tensors()
            return weight_sync.sync(step, tensors, kind=kind, scaling=scaling)

        sync(start_step)
        columns = [TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        with Progress(*columns, console=console, disable=not cfg.logging.console) as progress:
            task = progress.add_task("train", total=cfg.total_steps, completed=start_step, info="")
            for step in range(start_step + 1, cfg.total_steps + 1):
                record = train_step(cfg, run, step, source, pre, sync, score_batch, issues_log, console)
                metrics.write(record)
                wandb.log(record)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.total_steps:
                    save(run, run_dir, step, source, cfg)
                progress.update(task, advance=1, info=(
                    f"reward {record['reward/mean']:.3f}  parity {record['parity/bitwise_equal_fraction']:.4f}"
                    f"  kl {record['ppo/kl']:.2e}"))
        if cfg.total_steps > start_step:
            save(run, run_dir, cfg.total_steps, source, cfg)
    finally:
        metrics.close()
        wandb.close()
        issues_log.close()
        run.close()
    if cfg.logging.plot:
        png = plot_curves(run_dir)
        if png:
            console.print(f"curves: {png}")
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")
    return run_dir


def save(run: Run, run_dir: Path, step: int, source, cfg: Config) -> None:
    import ray

    ray.get(run.trainer.save_checkpoint.remote(
        str(run_dir), step, {"data": source.state_dict()}, cfg.checkpoint.keep))


def train_step(cfg, run, step, source, pre, sync, score_batch, issues_log, console) -> dict[str, Any]:
    """One step: rollout, reward, train, sync. Returns the step's metrics record."""
    import ray

    from rl.data import format_prompt

    # rollout: each prompt samples_per_prompt times, consecutively (GRPO/RLOO groups)
    samples = source.next_batch()
    k = cfg.rollout.samples_per_prompt
    group_samples = [s for s in samples for _ in range(k)]
    prompts = [format_prompt(s, pre.tokenizer, cfg.data.chat_template) for s in group_samples]
    t0 = time.perf_counter()
    completions = generate_with_restart(run, prompts, step, console, issues_log)
    t_rollout = time.perf_counter() - t0

    # reward
    texts = [pre.tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in completions]
    rewards, reward_issues = score_batch(pre.reward_fn, texts, group_samples)
    for issue in reward_issues:
        issues_log.write(f"step {step}: reward: {issue}\n")
        console.print(f"[yellow]step {step}: reward function failed[/] {issue}")
    issues_log.flush()
    t_reward = time.perf_counter() - t0 - t_rollout

    # train: old-policy log-probs (compared bitwise with the rollout's), then the update
    batch = {
        "sequences": [c["prompt_ids"] + c["token_ids"] for c in completions],
        "starts": [len(c["prompt_ids"]) for c in completions],
        "rollout_logprobs": [c["rollout_logprobs"] for c in completions],
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "group_size": k,
    }
    t1 = time.perf_counter()
    result = ray.get(run.trainer.train_step.remote(batch))
    t_train = time.perf_counter() - t1
    stats, old_logprobs = result["stats"], result["old_logprobs"]
    parity = compare_logprobs(batch["rollout_logprobs"], old_logprobs)
    if cfg.parity and not parity.all_equal:
        console.print(f"[red]step {step}: rollout and trainer log-probs differ[/] "
                      f"(max |Δ| {parity.max_abs_diff:.3e}, {parity.tokens_compared - parity.tokens_equal} tokens)")

    # sync the updated policy to the rollout workers
    sync_metrics = sync(step)

    reward_t = batch["rewards"]
    lengths = torch.tensor([len(c["token_ids"]) for c in completions], dtype=torch.float32)
    return {
        "step": step,
        "reward/mean": float(reward_t.mean()),
        "reward/std": float(reward_t.std()) if len(reward_t) > 1 else 0.0,
        "reward/issues": len(reward_issues),
        "response/length_mean": float(lengths.mean()),
        **stats,
        "parity/tokens": parity.tokens_compared,
        "parity/bitwise_equal_fraction": parity.bitwise_equal_fraction,
        "parity/max_abs_diff": parity.max_abs_diff,
        "parity/kl_k1": parity.kl_k1,
        "parity/kl_k3": parity.kl_k3,
        **{"sync/checksum_ok": 0.0, **sync_metrics},
        "time/rollout": t_rollout,
        "time/reward": t_reward,
        "time/train": t_train,
    }


def generate_with_restart(run: Run, prompts: list[list[int]], step: int, console, issues_log) -> list[dict]:
    """A rollout worker that dies is reported, restarted once, re-synced, and the step's rollout
    re-run (its seed is a function of the step, so the retry samples the same tokens)."""
    import ray

    try:
        return run.generate(prompts, step)
    except ray.exceptions.RayActorError as e:
        dead = _dead_workers(run)
        if not dead:
            raise
        for i in dead:
            console.print(f"[red]step {step}: rollout worker {i} died[/] ({type(e).__name__}); restarting it")
            issues_log.write(f"step {step}: rollout worker {i} died ({type(e).__name__}); restarted\n")
            issues_log.flush()
            run.restart_worker(i)
            run.resync_worker(i)
        try:
            return run.generate(prompts, step)
        except ray.exceptions.RayActorError as e2:
            raise UserError(f"step {step}: a rollout worker died again after a restart: {e2}") from None


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
    train(cfg)
    return 0
