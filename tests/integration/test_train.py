"""`kimi-rl train` end to end: real Ray, real vLLM rollout workers, the real Megatron trainer.

Every step must report parity/bitwise_equal_fraction == 1.0 — the driver compares the rollout
log-probs with the trainer's old-policy log-probs of the same tokens with torch.equal — with
the LoRA adapter on and changing, and every rollout worker must hold the trainer's adapter
bytes (the checksum hook raises otherwise). Bad configs fail before Ray starts, with exit code 2.
(Resume reproducing an uninterrupted run bit for bit — after SIGTERM, a killed trainer and a
truncated checkpoint — is tests/integration/test_faults.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.cli import main
from rl.config import load_config
from rl.loop import train
from rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# Keys whose values are wall-clock times: everything else must repeat exactly.
TIMING = ("time/", "sync/seconds")


def _config(model_dir: str, run_dir: Path, *overrides: str):
    return load_config(QUICKSTART, [
        f"model.path={model_dir}", f"run_dir={run_dir}", "logging.wandb=disabled",
        "logging.console=false", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.max_tokens=8", *overrides,
    ])


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))


def _assert_every_step_bitwise(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["parity/tokens"] > 0
        assert r["parity/bitwise_equal_fraction"] == 1.0, r
        assert r["parity/max_abs_diff"] == r["parity/kl_k1"] == r["parity/kl_k3"] == 0.0
        assert r["sync/checksum_ok"] == 1.0
        for key in ("reward/mean", "reward/std", "response/length_mean", "ppo/kl", "ppo/clipfrac",
                    "ppo/entropy", "ref/kl", "sync/seconds", "time/rollout", "time/score", "time/train"):
            assert isinstance(r[key], float), key


@pytest.fixture(scope="module")
def ppo_run(model_factory, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    cfg = _config(model_factory("llama"), run_dir, "algorithm.name=ppo", "total_steps=3",
                  "rollout.num_workers=2", "algorithm.kl_coef=0.01", "sync.hooks=[checksum,timing,parity_probe]")
    train(cfg)
    return cfg, run_dir


def test_ppo_with_lora_two_workers(ppo_run):
    cfg, run_dir = ppo_run
    records = read_metrics(run_dir)
    _assert_every_step_bitwise(records, 3)
    for r in records:
        assert r["sync/probe_equal"] == 1.0
        assert "critic/value_loss" in r
    adapter = _adapter(run_dir)
    b = [t for k, t in adapter.items() if "lora_B" in k]
    assert b and any(t.abs().max() > 0 for t in b), "the adapter did not change (B is still 0)"
    assert (run_dir / "curves.png").stat().st_size > 0
    assert json.loads((run_dir / "checkpoints" / "step_000003" / "adapter" / "adapter_config.json")
                      .read_text())["r"] == cfg.lora.rank


def test_one_worker_samples_what_two_workers_sample(ppo_run, model_factory, tmp_path):
    """Sampling keys follow a prompt's index in the step, not its worker (rl.loop.sample_keys):
    the same run on one rollout worker samples the same tokens, so every step's metrics and
    the trained adapter are bitwise those of the two-worker run."""
    _, run_dir = ppo_run
    one = tmp_path / "one"
    train(_config(model_factory("llama"), one, "algorithm.name=ppo", "total_steps=3",
                  "rollout.num_workers=1", "algorithm.kl_coef=0.01", "sync.hooks=[checksum,timing,parity_probe]"))
    keys = ("reward/mean", "response/length_mean", "ppo/kl", "ppo/entropy", "ref/kl")
    assert [[r[k] for k in keys] for r in read_metrics(one)] == [[r[k] for k in keys] for r in read_metrics(run_dir)]
    two, single = _adapter(run_dir), _adapter(one)
    assert two.keys() == single.keys() and all(torch.equal(two[k], single[k]) for k in two)


def test_compiled_rollout_with_a_reserved_adapter(model_factory, tmp_path):
    """`rollout.enforce_eager: false` (vLLM's default mode: torch.compile, CUDA graphs on a GPU):
    the engine holds the adapter from start and each sync copies into it; every step bitwise."""
    run_dir = tmp_path / "compiled"
    train(_config(model_factory("qwen3"), run_dir, "total_steps=2", "rollout.enforce_eager=false"))
    _assert_every_step_bitwise(read_metrics(run_dir), 2)


def test_checkpoint_adapter_loads_in_stock_vllm(ppo_run, model_factory):
    """The peft adapter of a checkpoint serves in stock vLLM (--enable-lora): its log-probs
    follow the trained adapter (close to the parity trainer's, not bitwise: stock kernels)."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    cfg, run_dir = ppo_run
    adapter_dir = run_dir / "checkpoints" / "step_000003" / "adapter"
    seq = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]
    llm = LLM(model=model_factory("llama"), dtype="float32", enable_lora=True, max_lora_rank=cfg.lora.rank,
              max_loras=1, enforce_eager=True, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)

        def score(lora):
            out = llm.generate([TokensPrompt(prompt_token_ids=seq)], params, lora_request=lora, use_tqdm=False)
            return torch.tensor([out[0].prompt_logprobs[i][t].logprob for i, t in enumerate(seq) if i])

        base, tuned = score(None), score(LoRARequest("policy", 1, str(adapter_dir)))
    finally:
        llm.llm_engine.engine_core.shutdown()
    from parity.model_spec import ModelSpec
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.lora import adapters_disabled, apply_lora, load_peft_state_dict
    from trainer.megatron.model import load_model
    from trainer.megatron.patches import init_megatron

    init_megatron()
    model = load_model(model_factory("llama"), "fp32", parity=True).eval()
    apply_lora(model, ModelSpec.from_dir(model_factory("llama")), cfg.lora.rank, cfg.lora.alpha,
               list(cfg.lora.target_modules))
    load_peft_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    with torch.no_grad():
        (ours,) = sequence_logprobs(model, [seq], [1])
        with adapters_disabled(model):
            (ours_base,) = sequence_logprobs(model, [seq], [1])
    assert (tuned - base).abs().max() > 1e-4  # the adapter was applied
    assert (tuned - ours).abs().max() < 1e-4 and (base - ours_base).abs().max() < 1e-4


def test_parity_off_shows_a_mismatch(model_factory, tmp_path):
    run_dir = tmp_path / "off"
    train(_config(model_factory("llama"), run_dir, "parity.enabled=false", "total_steps=1"))
    (r,) = read_metrics(run_dir)
    assert r["parity/bitwise_equal_fraction"] < 1.0
    assert r["parity/max_abs_diff"] > 0.0


@pytest.mark.parametrize("override,words", [
    ("rollout.max_tokenz=3", ["rollout.max_tokenz", "unknown"]),
    ("rollout.max_tokens=lots", ["rollout.max_tokens"]),
    ("model.path=/no/such/model", ["model.path", "/no/such/model"]),
    ("reward.function=no_such_module:score", ["reward.function", "no_such_module"]),
])
def test_bad_config_fails_before_ray(model_factory, tmp_path, capsys, override, words):
    import ray

    args = ["train", str(QUICKSTART), f"model.path={model_factory('llama')}", f"run_dir={tmp_path / 'r'}"]
    if override.startswith("reward."):
        args.append("reward.type=function")
    assert main([*args, override]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err
    assert not ray.is_initialized()
    assert not (tmp_path / "r").exists()  # nothing written either


def test_kimi_lora_refuses_a_compiled_rollout(model_factory, tmp_path, capsys):
    """kimi-mini cannot reserve its adapter before vLLM compiles: refused up front, in one line."""
    args = ["train", str(QUICKSTART), f"model.path={model_factory('kimi-mini')}", f"run_dir={tmp_path / 'r'}"]
    assert main([*args, "rollout.enforce_eager=false"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "rollout.enforce_eager" in err
    assert not (tmp_path / "r").exists()


def test_bad_config_in_the_file_names_the_line(model_factory, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\ntotal_steps: 2\nmodel:\n  path: {model_factory('llama')}\n"
                   "algorithm:\n  name: ppo\n  clip_eps: -1\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}:7" in err and "algorithm.clip_eps" in err


def test_print_config(model_factory, capsys):
    assert main(["train", str(QUICKSTART), f"model.path={model_factory('llama')}",
                 "algorithm.kl_coef=0.01", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "kl_coef: 0.01" in out and "total_steps: 20" in out


def flaky_reward(completion: str, sample) -> float:
    """A user reward function that raises for some samples."""
    if sample.metadata["index"] % 2:
        raise RuntimeError("flaky reward")
    return float(len(completion) > 0)


class KillRolloutWorkerOnce:
    """A sync hook that kills rollout worker 0 after the sync of step 1 (a worker dying
    between steps, as an OOM kill would)."""

    killed = False

    def before_sync(self, event):
        pass

    def after_sync(self, event):
        import ray

        if event.step == 1 and not KillRolloutWorkerOnce.killed:
            KillRolloutWorkerOnce.killed = True
            ray.kill(ray.get_actor("kimi-rl-rollout-0"), no_restart=True)


def test_full_weights_flaky_reward_and_a_dying_worker(model_factory, tmp_path):
    """Without LoRA the full weights go through the same sync API, bucketed; a reward function
    that raises is reported, not a crash; a rollout worker that dies is restarted and re-synced."""
    run_dir = tmp_path / "full"
    train(_config(model_factory("llama"), run_dir, "lora.enabled=false", "total_steps=3",
                  "trainer.lr=1e-4", "reward.type=function", "reward.function=tests.integration.test_train:flaky_reward",
                  "sync.bucket_mb=1", "sync.hooks=[checksum,timing,tests.integration.test_train:KillRolloutWorkerOnce]"))
    records = read_metrics(run_dir)
    _assert_every_step_bitwise(records, 3)
    assert all(r["reward/issues"] > 0 for r in records)
    issues = (run_dir / "issues.log").read_text()
    assert "RuntimeError: flaky reward" in issues
    assert "step 2: rollout worker 0 died" in issues
    ckpt = run_dir / "checkpoints" / "step_000003" / "model"
    assert any(ckpt.glob("*.safetensors"))


def test_ray_temp_dir_stays_short_enough_for_unix_sockets(tmp_path):
    """Ray's socket paths live ~64 bytes below its temp dir and Linux caps them at 107 bytes:
    a deep run_dir gets a short temp dir instead."""
    from rl.cluster import ray_temp_dir
    from rl.config import RayConfig

    deep = tmp_path / ("d" * 60) / "runs" / "quickstart-20261203-082813"
    path = ray_temp_dir(RayConfig(), deep)
    assert len(path) + 64 <= 107 and Path(path).is_dir()
