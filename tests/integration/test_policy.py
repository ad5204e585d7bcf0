"""PolicyTrainer (trainer/megatron/policy.py, the step in trainer/step.py) and its checkpoints (trainer/checkpoint.py) on the tiny
Megatron llama: old log-probs are sequence_logprobs bitwise, the LoRA reference is the base,
GRPO / RLOO / PPO steps learn, runs are deterministic, a resume is bitwise the uninterrupted
run, and the saved adapter loads in HF transformers + peft."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rl.config import AlgorithmConfig, LoraConfig, TrainerConfig
from trainer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from trainer.megatron.logprobs import forward_logits, sequence_logprobs
from trainer.megatron.model import load_model
from trainer.megatron.policy import PolicyTrainer
from trainer.step import Batch

# Two prompts x two samples (group_size 2), ragged lengths.
_G = torch.Generator().manual_seed(0)
SEQS = [torch.randint(3, 400, (n,), generator=_G).tolist() for n in (20, 25, 18, 30)]
STARTS = [8, 10, 8, 12]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
STAT_KEYS = {"ppo/kl", "ppo/clipfrac", "ppo/entropy", "ppo/policy_loss", "ppo/grad_norm", "ref/kl"}


@pytest.fixture(scope="module")
def path(model_factory, megatron):
    return model_factory("llama", "fp32")


def make(path, name="grpo", lora=True, parity=True, lr=1e-3, seed=0, **algorithm) -> PolicyTrainer:
    return PolicyTrainer(
        path, "fp32", parity, LoraConfig(enabled=lora), TrainerConfig(lr=lr, micro_batch_size=2),
        AlgorithmConfig(name=name, **algorithm), seed=seed,
    )


def batch(trainer: PolicyTrainer, rewards: torch.Tensor = REWARDS) -> Batch:
    # With parity the rollout engine returns exactly the trainer's log-probs.
    return Batch(SEQS, STARTS, trainer.logprobs(SEQS, STARTS), rewards, group_size=2,
                 group_ids=[0, 0, 1, 1])


def trainable(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    state = trainer.state_dict()
    return {k: v.clone() for part in ("policy", "critic") for k, v in state[part].items()}


def base_weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora." not in n}


def assert_equal_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_logprobs_are_sequence_logprobs_and_fresh_lora_is_the_reference(path):
    trainer = make(path)
    plain = load_model(path, "fp32", parity=True)
    expected = sequence_logprobs(plain, SEQS, STARTS, batch_size=3)
    got, ref = trainer.logprobs(SEQS, STARTS), trainer.ref_logprobs(SEQS, STARTS)
    for e, g, r in zip(expected, got, ref, strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, e) and torch.equal(r, e)


def test_grpo_step_reinforces_rewarded_sequences_and_keeps_the_base(path):
    trainer = make(path)
    base = base_weights(trainer)
    before = trainer.logprobs(SEQS, STARTS)
    stats = trainer.train_step(batch(trainer))
    # One minibatch, one epoch: the training forward reproduces the old log-probs bitwise.
    assert stats["ppo/kl"] == 0.0 and stats["ppo/clipfrac"] == 0.0
    assert torch.equal(torch.cat(trainer.last_old_logprobs()), torch.cat(before))
    after = trainer.logprobs(SEQS, STARTS)
    gains = [(a - b).sum().item() for a, b in zip(after, before, strict=True)]
    assert gains[0] > 0 and gains[3] > 0 and gains[1] < 0 and gains[2] < 0, gains
    assert any(t.abs().sum() > 0 for k, t in trainer.rollout_tensors().items() if "lora_B" in k)
    assert_equal_state(base, base_weights(trainer))
    # The reference is still the untouched base.
    for r, b in zip(trainer.ref_logprobs(SEQS, STARTS), before, strict=True):
        assert torch.equal(r, b)


@pytest.mark.parametrize("name,extra", [
    ("grpo", dict(kl_coef=0.1, kl_mode="loss", entropy_coef=0.01)),
    ("rloo", dict(kl_coef=0.1, kl_mode="reward")),
    ("ppo", dict(kl_coef=0.1, kl_mode="reward", critic_lr=1e-2)),
])
def test_algorithms_step_and_report(path, name, extra):
    trainer = make(path, name, ppo_epochs=2, minibatches=2, **extra)
    start = trainable(trainer)
    b = batch(trainer)
    b.rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    stats = trainer.train_step(b)
    keys = STAT_KEYS | ({"critic/value_loss", "critic/vf_clipfrac"} if name == "ppo" else set())
    assert keys <= stats.keys() and all(math.isfinite(v) for v in stats.values())
    assert stats["train/optimizer_steps"] == 4.0 and stats["ref/kl"] == 0.0  # fresh adapter
    end = trainable(trainer)
    assert any(not torch.equal(start[k], end[k]) for k in start if "lora_B" in k)
    if name == "ppo":
        assert not torch.equal(start["value_head.weight"], end["value_head.weight"])
        values = trainer.values(SEQS, STARTS)
        assert [v.shape[0] for v in values] == [len(s) - st for s, st in zip(SEQS, STARTS, strict=True)]
        # The policy slot is what the rollout sees: the critic's adapter never leaks into it.
        assert not any("critic" in k for k in trainer.rollout_tensors())


def test_same_seed_same_bits(path):
    a, b = make(path, "ppo", minibatches=2), make(path, "ppo", minibatches=2)
    assert a.train_step(batch(a)) == b.train_step(batch(b))
    assert_equal_state(trainable(a), trainable(b))


def test_resume_is_bitwise_the_uninterrupted_run(path, tmp_path):
    run = make(path, "ppo", minibatches=2, ppo_epochs=2)
    run.train_step(batch(run))
    save_checkpoint(tmp_path, 1, run, extra={"cursor": 8})
    uninterrupted = run.train_step(batch(run, torch.tensor([0.0, 1.0, 1.0, 0.0])))

    resumed = make(path, "ppo", minibatches=2, ppo_epochs=2)
    state = load_checkpoint(tmp_path, resumed)
    assert state["step"] == 1 and state["extra"] == {"cursor": 8}
    assert resumed.train_step(batch(resumed, torch.tensor([0.0, 1.0, 1.0, 0.0]))) == uninterrupted
    assert_equal_state(trainable(run), trainable(resumed))
    for k, v in run.optimizer.state_dict()["state"].items():
        assert_equal_state(v, resumed.optimizer.state_dict()["state"][k])


def test_checkpoints_rotate_and_latest_is_atomic(path, tmp_path):
    trainer = make(path)
    for step in (1, 2, 3, 3):  # saving a step again replaces it
        save_checkpoint(tmp_path, step, trainer, extra={}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000003"
    assert load_checkpoint(root / "step_000002", trainer)["step"] == 2


def test_saved_adapter_loads_in_peft(path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = make(path, lr=1e-2)
    trainer.train_step(batch(trainer))
    step = save_checkpoint(tmp_path, 1, trainer, extra={})
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(step / "adapter")).eval()
    ids = torch.tensor([SEQS[3]])
    with torch.no_grad():
        ours = forward_logits(trainer.model, ids)
        theirs = peft(ids).logits
    print(f"peft vs Megatron max |logit diff| {(ours - theirs).abs().max():.2e}")
    assert (ours - theirs).abs().max() < 1e-4
    with peft.disable_adapter(), torch.no_grad():
        base = peft(ids).logits
    assert (ours - base).abs().max() > 1e-3  # the adapter is really in there


def test_full_fine_tune_trains_every_weight_and_exports_hf(path, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make(path, lora=False, lr=1e-3, kl_coef=0.1)
    before = trainer.logprobs(SEQS, STARTS)
    assert trainer.lora_scaling is None
    stats = trainer.train_step(batch(trainer))
    assert stats["ref/kl"] == 0.0  # measured before the update: the policy was the base
    # The reference is the frozen copy: still the base after the policy moved.
    for r, b in zip(trainer.ref_logprobs(SEQS, STARTS), before, strict=True):
        assert torch.equal(r, b)
    tensors = trainer.rollout_tensors()
    hf_weights = load_file(f"{path}/model.safetensors")
    assert tensors.keys() == hf_weights.keys()
    assert not torch.equal(tensors["model.layers.0.mlp.down_proj.weight"],
                           hf_weights["model.layers.0.mlp.down_proj.weight"])
    step = save_checkpoint(tmp_path, 1, trainer, extra={})
    hf = AutoModelForCausalLM.from_pretrained(step / "model", dtype=torch.float32).eval()
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        diff = (forward_logits(trainer.model, ids) - hf(ids).logits).abs().max()
    print(f"HF export vs Megatron max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    resumed = make(path, lora=False, lr=1e-3, kl_coef=0.1)
    load_checkpoint(step, resumed)
    for a, b in zip(resumed.logprobs(SEQS, STARTS), trainer.logprobs(SEQS, STARTS), strict=True):
        assert torch.equal(a, b)


def test_stock_megatron_with_truncated_importance_sampling(path):
    trainer = make(path, parity=False, is_correction="tis", is_cap=2.0)
    b = batch(trainer)
    b.rollout_logprobs = [lp + 0.01 for lp in b.rollout_logprobs]  # a mismatched rollout engine
    stats = trainer.train_step(b)
    assert stats["is/ratio_mean"] < 1.0 and stats["is/capped_frac"] == 0.0


def test_missing_and_corrupt_checkpoints_raise_checkpoint_errors(path, tmp_path):
    """(Manifest and fallback cases on disk: tests/unit/test_checkpoint.py.)"""
    trainer = make(path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope", trainer)
    with pytest.raises(CheckpointError, match="no step dirs"):
        load_checkpoint(tmp_path, trainer)
    step = save_checkpoint(tmp_path, 5, trainer, extra={})
    assert read_checkpoint_state(tmp_path) == {"step": 5, "extra": {}, "path": step, "skipped": []}
    (step / "trainer.pt").write_bytes((step / "trainer.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"trainer\.pt: 100 bytes, manifest\.json says"):
        load_checkpoint(tmp_path, trainer)
    other = save_checkpoint(tmp_path / "ppo", 1, make(path, "ppo"), extra={})
    with pytest.raises(CheckpointError, match="does not fit this trainer"):
        load_checkpoint(other, trainer)


def test_unavailable_optimizer_is_named(path):
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed: its CPU Adam is available")
    with pytest.raises(ValueError, match="trainer.optimizer.*deepspeed_cpu_adam"):
        PolicyTrainer(path, trainer=TrainerConfig(optimizer="deepspeed_cpu_adam"))


def test_bf16_full_fine_tune_steps_fp32_masters(model_factory, megatron):
    trainer = PolicyTrainer(model_factory("llama", "bf16"), "bf16", lora=LoraConfig(enabled=False),
                            trainer=TrainerConfig(lr=1e-3, micro_batch_size=2))
    start = {n: m.clone() for n, m in trainer.state_dict()["policy"].items()}
    trainer.train_step(batch(trainer))
    masters = trainer.state_dict()["policy"]
    assert all(m.dtype == torch.float32 for m in masters.values())
    assert any(not torch.equal(start[n], m) for n, m in masters.items())
    # The model computes with the masters rounded to bf16.
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, masters[name].to(torch.bfloat16)), name


def test_frozen_weights_are_packed_once_and_give_the_same_bits(path):
    """The LoRA base is packed once at construction (trainer.megatron.layers.pack_frozen_weights); the
    packs are exactly the per-call ones, the log-probs the same bits as an unpacked trainer's,
    and a trainable weight (full fine-tune) is never packed."""
    from parity import kernels
    from trainer.megatron.layers import _FrozenPack

    trainer = make(path)
    layers = [m for m in trainer.model.modules() if isinstance(m, _FrozenPack) and m._frozen_pack]
    assert layers, "no frozen weight was packed"
    for m in layers:
        weight, packed = m._frozen_pack
        assert weight is m.weight and torch.equal(packed, kernels.pack(m.weight))
    packed_logprobs = trainer.logprobs(SEQS, STARTS)
    for m in layers:
        m._frozen_pack = None
    for a, b in zip(packed_logprobs, trainer.logprobs(SEQS, STARTS), strict=True):
        assert torch.equal(a, b)
    full = make(path, lora=False)
    assert not any(m._frozen_pack for m in full.model.modules() if isinstance(m, _FrozenPack))
