"""`kimi-rl parity check --env NAME`: parity across the turns of multi-turn trajectories.

One vLLM engine runs the environments turn by turn (rl.env: the trajectory is token ids, each
turn's input is the previous ids plus the observation ids, nothing re-tokenized); then the
trainer backend scores every whole trajectory teacher-forced in one pass, and the log-prob of
every model-generated token of every turn is compared with torch.equal. Observation / template
tokens (mask 0) were never sampled: they are not compared, and the report counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parity.compare import compare_logprobs


@dataclass
class EnvCheckResult:
    report: dict[str, Any]
    trajectories: list  # rl.env.Trajectory
    engine_outputs: list[list]  # per turn: the rollout.engine.Completion of each active trajectory
    train_logprobs: list[torch.Tensor]  # the trainer's scores of every token after each prompt
    diffs: list[torch.Tensor]  # |rollout - trainer| over each trajectory's model tokens


def engine_processes(rollout_tp: int, rollout_isa: str | None = None) -> bool:
    """Whether a check's vLLM engine runs in processes of its own. On the CPU at TP 1 it runs in
    this one (closed before the trainer re-scores): two fewer Python processes to start, each
    importing torch and vLLM (~15 s on 2 cores). TP > 1 and --rollout-isa need the engine's own
    processes (the ISA is read when they start); on CUDA they keep vLLM's reservation of GPU
    memory out of the process the trainer then scores in."""
    return rollout_tp > 1 or rollout_isa is not None or torch.cuda.is_available()


def sample_trajectories(args: Any, env_cls: Any, samples: list) -> tuple[list, list[list], list]:
    """(trajectories, the engine's raw completions per turn, the environments), from one vLLM
    engine."""
    from transformers import AutoTokenizer

    from parity.hf_config import register_hf_config
    from parity.model_spec import load_spec
    from rl.env import Budget, run_trajectories
    from rollout.engine import RolloutEngine, Stop

    register_hf_config()  # kimi-mini's config.json names a model type transformers lacks
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    envs = [env_cls(tokenizer=tokenizer, reward_fn=lambda text, sample: 0.0, **args.env_kwargs)
            for _ in samples]
    context = load_spec(args.model).max_position_embeddings
    budget = Budget(args.max_turns, args.max_tokens, context, context)
    outputs: list[list] = []
    with RolloutEngine(str(args.model), dtype=args.dtype, parity=args.parity, seed=args.seed,
                       max_model_len=context, max_num_seqs=max(len(samples), 1),
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       tensor_parallel_size=args.rollout_tp, multiprocess=engine_processes(args.rollout_tp),
                       prefix_caching=getattr(args, "prefix_caching", None),
                       kv_cache_dtype=args.kv_cache_dtype) as engine:

        def generate(prompts: list[list[int]], turn: int, stop: Stop | None) -> list[dict]:
            done = engine.generate(prompts, max_tokens=args.max_tokens, sampling=args.sampling, stop=stop)
            outputs.append(done)
            return [{"token_ids": c.token_ids, "rollout_logprobs": c.rollout_logprobs} for c in done]

        trajectories = run_trajectories(envs, samples, budget, generate)
    return trajectories, outputs, envs


def run_env_check(args: Any, env_cls: Any, samples: list, rescore: Callable[..., list[torch.Tensor]]) -> EnvCheckResult:
    """Sample trajectories, close vLLM, score them with `rescore(args, sequences, starts)` (the
    trainer backend; rl.checker.rescore), compare the model's tokens."""
    from rl.env import env_metrics

    trajectories, outputs, envs = sample_trajectories(args, env_cls, samples)
    train = rescore(args, [t.ids() for t in trajectories], [len(t.prompt_ids) for t in trajectories])
    rollout, trainer = [], []
    for t, lp in zip(trajectories, train, strict=True):
        c = t.completion()
        on = c["mask"].bool()
        rollout.append(c["rollout_logprobs"][on])
        trainer.append(lp[on])
    stats = compare_logprobs(rollout, trainer)
    masks = [t.completion()["mask"] for t in trajectories]
    report = {
        "model": str(args.model), "dtype": args.dtype, "parity": "on" if args.parity else "off",
        "env": args.env, "max_turns": args.max_turns, "max_tokens": args.max_tokens,
        "trajectories": len(trajectories),
        "turns_mean": sum(len(t.turns) for t in trajectories) / len(trajectories),
        "observation_tokens": int(sum((m == 0).sum() for m in masks)),
        "tool_calls": int(env_metrics(envs, trajectories)["env/tool_calls"]),
        "tool_errors": int(env_metrics(envs, trajectories)["env/tool_errors"]),
        # Prompt tokens each turn's prefill took from vLLM's prefix cache (earlier turns' blocks).
        "prefix_hits_per_turn": [sum(c.cached_tokens for c in turn) for turn in outputs],
        **stats.to_dict(), "passed": stats.all_equal,
        "per_batch_size": {str(len(trajectories)): stats.to_dict()},
    }
    diffs = [(r - t).abs() for r, t in zip(rollout, trainer, strict=True)]
    return EnvCheckResult(report, trajectories, outputs, train, diffs)
