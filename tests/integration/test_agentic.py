"""Agentic (multi-turn) rollouts on real vLLM and real Megatron.

Exact across turns (tiny Llama, Qwen3 and kimi-mini, fp32 and bf16): trajectories of 3 model
turns with a tool observation between turns (rl.env.ProbeEnv: the chat template's tool turn,
as ids) are sampled turn by turn by one vLLM engine (these trajectories are shorter than one
128-token cache block, so every turn's prefill is cold; warm turns are in test_agentic_turns.py),
whose every turn's input is the previous turn's ids plus the observation ids; then the
Megatron trainer scores each whole trajectory teacher-forced in one pass. Every model-generated
token of every turn has a rollout log-prob torch.equal to the trainer's; the observation tokens
are masked (asserted from the mask) and were never sampled. The trajectory's ids are exactly
what vLLM generated plus the observation ids (no re-tokenization anywhere).

A multi-turn training run (a user environment by module:attr, 2 turns, a reward at the end)
resumed from a checkpoint equals the straight run bit for bit: every turn is seeded by (seed,
step, worker, turn).

Training: a 0 in the mask takes a token out of the loss: masking a trajectory's trailing tokens
updates the policy as cutting them off does (GRPO, RLOO: bit for bit; PPO: to rounding).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.sampling import Sampling
from rl.checker import CheckArgs, env_samples, rescore
from rl.env import ProbeEnv, tool_turn_ids
from rl.env_check import run_env_check

CASES = [("llama", "fp32"), ("qwen3", "fp32"), ("llama", "bf16"), ("qwen3", "bf16"),
         ("kimi-mini", "fp32"), ("kimi-mini", "bf16")]
TURNS = 3


def _args(model_dir: str, dtype: str) -> CheckArgs:
    return CheckArgs(model=Path(model_dir), dtype=dtype, prompts=None, num_prompts=4, max_tokens=8,
                     batch_sizes=[4], parity=True, seed=0, report=None, max_num_batched_tokens=None,
                     sampling=Sampling(), env="probe", max_turns=TURNS)


@pytest.fixture(scope="module")
def checked(model_factory):
    """checked(arch, dtype) -> (args, EnvCheckResult), one vLLM + Megatron run per case."""
    cache = {}

    def run(arch: str, dtype: str):
        if (arch, dtype) not in cache:
            args = _args(model_factory(arch, dtype), dtype)
            cache[arch, dtype] = args, run_env_check(args, ProbeEnv, env_samples(args), rescore)
        return cache[arch, dtype]

    return run


@pytest.mark.parametrize("arch,dtype", CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_every_token_of_every_turn_is_bitwise(checked, arch, dtype):
    from transformers import AutoTokenizer

    from parity.hf_config import register_hf_config

    args, result = checked(arch, dtype)
    register_hf_config()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    assert len(result.engine_outputs) == TURNS
    for t, train in zip(result.trajectories, result.train_logprobs, strict=True):
        assert len(t.turns) == TURNS and t.error is None
        # The mask, turn by turn: the model's ids 1, the observation (tool turn) ids 0.
        c = t.completion()
        expected_mask = [m for gen, obs in t.turns for m in [1] * len(gen) + [0] * len(obs)]
        assert c["mask"].tolist() == expected_mask and 0 in expected_mask
        for gen, obs in t.turns[:-1]:
            assert obs == tool_turn_ids(tokenizer, gen, str(len(gen) ** 3))
        on = c["mask"].bool()
        assert train.dtype == c["rollout_logprobs"].dtype == torch.float32
        assert torch.equal(c["rollout_logprobs"][on], train[on]), (c["rollout_logprobs"][on] - train[on])
    report = result.report
    assert report["passed"] and report["tokens_compared"] == report["tokens_equal"] > 0
    assert report["observation_tokens"] > 0 and report["turns_mean"] == TURNS


@pytest.mark.parametrize("arch,dtype", CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_trajectory_ids_are_vllm_ids_plus_observation_ids(checked, arch, dtype):
    _, result = checked(arch, dtype)
    for turn, outputs in enumerate(result.engine_outputs):
        active = [t for t in result.trajectories if len(t.turns) > turn]
        assert len(active) == len(outputs)
        for t, out in zip(active, outputs, strict=True):
            before = [i for gen, obs in t.turns[:turn] for i in gen + obs]
            # The engine's input was the trajectory so far, as ids; what it generated is the
            # trajectory's next ids, byte for byte.
            assert out.prompt_ids == t.prompt_ids + before
            assert t.turns[turn][0] == out.token_ids
            assert torch.equal(t.completion()["rollout_logprobs"][len(before): len(before) + len(out.token_ids)],
                               out.rollout_logprobs)
    for t in result.trajectories:
        assert t.ids() == t.prompt_ids + [i for gen, obs in t.turns for i in gen + obs]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo"])
def test_masked_tokens_are_out_of_the_loss(model_factory, megatron, algorithm):
    from rl.config import AlgorithmConfig, LoraConfig, TrainerConfig
    from trainer.megatron.policy import PolicyTrainer
    from trainer.step import Batch

    path = model_factory("llama", "fp32")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (20, 25, 18, 30)]
    starts, cut = [8, 10, 8, 12], [4, 0, 6, 3]  # trailing tokens masked out, per sequence
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])

    def run(masked: bool) -> dict[str, torch.Tensor]:
        trainer = PolicyTrainer(path, "fp32", True, LoraConfig(enabled=True),
                                TrainerConfig(lr=1e-2, micro_batch_size=2),
                                AlgorithmConfig(name=algorithm, kl_coef=0.01), seed=0)
        if masked:
            batch_seqs = seqs
            masks = [torch.tensor([1.0] * (len(s) - st - k) + [0.0] * k) for s, st, k in zip(seqs, starts, cut, strict=True)]
        else:
            batch_seqs, masks = [s[: len(s) - k] for s, k in zip(seqs, cut, strict=True)], None
        lp = trainer.logprobs(batch_seqs, starts)
        stats = trainer.train_step(Batch(batch_seqs, starts, lp, rewards, group_size=2, masks=masks))
        state = trainer.state_dict()
        return stats, {k: v.clone() for part in ("policy", "critic") for k, v in state[part].items()}

    (stats_m, masked), (stats_c, cutoff) = run(True), run(False)
    assert stats_m["train/response_tokens"] == stats_c["train/response_tokens"] == sum(
        len(s) - st - k for s, st, k in zip(seqs, starts, cut, strict=True))
    assert masked.keys() == cutoff.keys()
    if algorithm == "ppo":
        # PPO whitens advantages over the whole [N, T] batch: a different padded width sums the
        # same values in another order, so the update agrees to rounding, not bit for bit.
        assert all(torch.allclose(masked[k], cutoff[k], rtol=0, atol=1e-5) for k in masked)
        return
    assert all(torch.equal(masked[k], cutoff[k]) for k in masked)
    assert stats_m["ppo/policy_loss"] == stats_c["ppo/policy_loss"]


class TwoTurns(ProbeEnv):
    """A user environment (env.name: tests.integration.test_agentic:TwoTurns): a tool message
    after the first turn, then the run's reward function on the second turn's text."""

    def reset(self, sample):
        self.sample = sample
        return super().reset(sample)

    def step(self, generated_ids):
        observation, _, _ = super().step(generated_ids)
        if self.tool_calls < 2:
            return observation, 0.0, False
        text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        return [], self.reward_fn(text, self.sample), True


def _train(model: str, run_dir: Path, *extra: str) -> list[dict]:
    root = Path(__file__).resolve().parents[2]
    overrides = [f"model.path={model}", f"run_dir={run_dir}", "env.name=tests.integration.test_agentic:TwoTurns", "env.kwargs={}",
                 "rollout.max_turns=2", "data.prompts_per_step=2", "checkpoint.every=1",
                 "logging.wandb=disabled", "logging.plot=false", "logging.console=false"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "rl.cli", "train", str(root / "configs/agentic_calculator.yaml"),
                           *overrides, *extra], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "sync/seconds"} for r in rows]


def test_multi_turn_run_resumes_bit_for_bit(model_factory, tmp_path):
    from safetensors.torch import load_file

    model = model_factory("llama", "fp32")
    straight = _train(model, tmp_path / "straight", "total_steps=3")
    _train(model, tmp_path / "split", "total_steps=1")
    split = _train(model, tmp_path / "split", "total_steps=3", "--resume", str(tmp_path / "split"))
    assert straight == split and len(straight) == 3
    assert all(r["env/turns_mean"] == 2.0 and r["parity/bitwise_equal_fraction"] == 1.0 for r in straight)
    assert len({r["reward/mean"] for r in straight}) > 1  # rewards vary: the steps train something
    adapter = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = load_file(str(tmp_path / "straight" / adapter)), load_file(str(tmp_path / "split" / adapter))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flags,message", [
    (["--env", "nosuch"], "--env: expected one of tools, probe or module:attr, got 'nosuch'"),
    (["--env", "no_such_module_xyz:Env"], "--env: cannot import 'no_such_module_xyz'"),
    (["--env", "probe", "--max-turns", "0"], "--max-turns must be >= 1, got 0"),
    (["--env", "probe", "--prompts", "{ids}"], "--env needs text prompts"),
    (["--env", "tools", "--env-kwargs", "[1]"], "--env-kwargs: expected a JSON object, got [1]"),
    (["--env", "tools", "--env-kwargs", '{"tools": ["calc"]}'], "--env-kwargs: unknown tool 'calc'"),
])
def test_env_flag_errors_are_one_line(model_factory, tmp_path, capsys, flags, message):
    from rl.cli import main

    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_ids": [5, 6, 7]}\n')
    flags = [f.replace("{ids}", str(ids)) for f in flags]
    code = main(["parity", "check", "--model", model_factory("llama"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
