"""The config sections the trainer owns: `trainer:` (backend, optimizer, batching, TP,
`trainer.deepspeed:`), `lora:`, `algorithm:` (the PPO / GRPO / RLOO step, trainer/ppo.py) and
`checkpoint:`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from parity.kimi import LORA_TARGETS as KIMI_LORA_TARGETS
from parity.lora import TARGETS as DENSE_LORA_TARGETS
from parity.settings import setting

# Every module name `lora.target_modules` may list: the dense models' seven projections, plus
# the ones only the Kimi architectures' layers have.
LORA_MODULES = DENSE_LORA_TARGETS + tuple(t for t in KIMI_LORA_TARGETS if t not in DENSE_LORA_TARGETS)
KIMI_ONLY_LORA_MODULES = tuple(t for t in LORA_MODULES if t not in DENSE_LORA_TARGETS)


@dataclass
class DeepSpeedConfig:
    """The deepspeed backend (trainer.deepspeed.engine): the HF parity model under ZeRO."""

    zero_stage: int = setting(2, ge=0, le=3)
    # A user's DeepSpeed JSON (ZeRO / offload / communication sections); its
    # zero_optimization.stage wins over zero_stage. Checked when the config loads.
    config: str | None = setting(None, path=True)
    ranks: int = setting(1, ge=1)  # data-parallel trainer ranks (processes; gloo on the CPU)


@dataclass
class TrainerConfig:
    # megatron: Megatron-core GPTModel (trainer.megatron.policy); deepspeed: the HF transformers model
    # under DeepSpeed ZeRO (trainer.deepspeed.policy). Both compute through the parity kernels.
    backend: Literal["megatron", "deepspeed"] = "megatron"
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    tensor_parallel_size: int = setting(1, ge=1)
    # megatron: data-parallel ranks, each training its share of every minibatch's rows (ranks =
    # data_parallel_size x tensor_parallel_size). Needs deterministic_layout (its reduction).
    data_parallel_size: int = setting(1, ge=1)
    # megatron: the gradient of every trainable tensor is computed per sequence and summed in
    # the minibatch's row order on every rank (trainer.step), so the bits after a step do not
    # depend on data_parallel_size or micro_batch_size. DeepSpeed's ZeRO reduces in its own
    # buckets, so it refuses this.
    deterministic_layout: bool = False
    optimizer: Literal["adamw", "deepspeed_cpu_adam"] = "adamw"
    lr: float = setting(1e-4, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    betas: tuple[float, float] = setting((0.9, 0.999), ge=0, lt=1)
    eps: float = setting(1e-8, gt=0)
    grad_clip: float = setting(1.0, ge=0)  # max gradient norm; 0 disables clipping
    micro_batch_size: int = setting(8, ge=1)
    # megatron, parity on, dense models: a micro-batch's sequences run end to end in one row
    # (Megatron's THD layout) instead of right-padded rows, so padding costs nothing. The
    # parity kernels give every token the bits the padded forward gives it.
    packed_sequences: bool = False


@dataclass
class LoraConfig:
    enabled: bool = True
    rank: int = setting(8, ge=1)
    alpha: float = setting(16.0, gt=0)
    # Default: every projection of the dense models (on the Kimi models: those of KDA, MLA's
    # q / o, the shared experts' and dense MLPs' FFNs); add kv_a_proj_with_mqa / kv_b_proj for
    # MLA, q_a_proj / q_b_proj for a low-rank query, w1 / w2 / w3 for the routed experts.
    # No dropout setting: dropout would make the rollout and the trainer compute different
    # functions, so their log-probs could not match.
    target_modules: list[str] = field(default_factory=lambda: list(DENSE_LORA_TARGETS))


@dataclass
class AlgorithmConfig:
    name: Literal["ppo", "grpo", "rloo"] = "grpo"
    gamma: float = setting(1.0, ge=0, le=1)  # gamma and lam: GAE, used by ppo only
    lam: float = setting(0.95, ge=0, le=1)
    clip_eps: float = setting(0.2, gt=0)
    value_clip_eps: float = setting(0.2, gt=0)
    vf_coef: float = setting(0.5, ge=0)
    ppo_epochs: int = setting(1, ge=1)
    minibatches: int = setting(1, ge=1)
    kl_coef: float = setting(0.0, ge=0)  # 0 turns the KL penalty (and the reference model) off
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["reward", "loss"] = "loss"
    entropy_coef: float = setting(0.0, ge=0)
    # Importance-sampling correction for rollout/trainer log-prob mismatch; parity: false only.
    is_correction: Literal["none", "tis", "mis"] = "none"
    is_cap: float = setting(2.0, ge=1)  # a cap below 1 would truncate or mask on-policy tokens
    critic_lr: float | None = setting(None, gt=0)  # None: the critic uses trainer.lr


@dataclass
class CheckpointConfig:
    every: int = setting(0, ge=0)  # in steps; 0 saves only at the end
    keep: int = setting(2, ge=1)
    resume_from: str | None = setting(None, path=True)
