"""The PPO / GRPO / RLOO step (trainer.step) on the deepspeed backend: the HF parity model
(trainer.deepspeed.model) with peft LoRA (trainer.deepspeed.lora) or every weight trainable, inside a
DeepSpeed engine (trainer.deepspeed.engine), on one of N data-parallel ranks.

The step itself (scoring, advantages, losses, minibatches) is trainer.step.PolicyStep's;
what differs from the Megatron backend (trainer.megatron.policy):
- Model: one nn.Module holds the policy, the frozen base (full fine-tune: reference and critic
  base) and the critic's value head, so that DeepSpeed owns every trainable tensor; its
  forward is called with a mode: policy logits, reference logits (adapters off / frozen copy),
  or critic values.
- Data parallel: every rank scores every sequence (identical old log-probs, advantages and,
  under ZeRO-3, the same collective gathers on every rank); each rank trains on its share of
  each minibatch's micro-batches, and DeepSpeed averages the gradients over the ranks (the loss
  is scaled by the rank count, so the sum over ranks is the minibatch's token mean). Step stats
  are summed over the ranks.
- Optimizer: DeepSpeed's step; gradient clipping is over every trainable tensor at once
  (policy and critic: Megatron's backend clips them separately), and the reported grad norm
  is that global norm. A bf16 model is trained in DeepSpeed's bf16 mode (fp32 masters in the
  optimizer; the adapters are cast to bf16 when the engine starts).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parity import kernels, weights
from parity.sampling import Sampling, processed_logits
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig
from trainer.deepspeed import lora as hf_lora
from trainer.deepspeed.engine import DeepSpeedModel, EngineSettings
from trainer.deepspeed.model import load_hf_model
from trainer.step import CRITIC_ADAPTER, Micro, PolicyStep, chunks

_STEP_KEYS = ("ppo/grad_norm",)  # stats that are the same on every rank (not summed)


class _Models(nn.Module):
    """Everything DeepSpeed trains or gathers, behind one forward (see the module docstring)."""

    def __init__(self, policy: nn.Module, frozen: nn.Module | None, value_head: nn.Linear | None) -> None:
        super().__init__()
        self.policy = policy
        if frozen is not None and frozen is not policy:
            self.frozen = frozen
        if value_head is not None:
            self.value_head = value_head

    def reference(self) -> nn.Module:
        return getattr(self, "frozen", self.policy)

    def forward(self, mode: str, input_ids: Tensor) -> Tensor:
        if mode == "policy":
            return self.policy(input_ids=input_ids).logits
        base = self.reference()
        if mode == "reference":
            with hf_lora.adapters_disabled(base):
                return base(input_ids=input_ids).logits
        if mode == "critic":
            with hf_lora.adapter_active(base, CRITIC_ADAPTER):
                # The decoder alone: final-norm hidden states, no lm head.
                hidden = _decoder(base)(input_ids=input_ids).last_hidden_state.float()
            head = self.value_head
            # kernels.linear: batch invariant, as the Megatron backend's value head.
            return kernels.linear(hidden, head.weight.float(), head.bias.float()).squeeze(-1)
        raise ValueError(f"unknown forward mode {mode!r}")


def _decoder(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


class DeepSpeedPolicyTrainer(PolicyStep):
    """The PPO step on the deepspeed backend (see the module docstring). torch.distributed
    must be up (trainer.deepspeed.engine.init_distributed) on every rank first."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "fp32",
        lora: LoraConfig | None = None,
        trainer: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        seed: int = 0,
        sampling: Sampling | None = None,
        extensions_dir: str | None = None,
    ):
        self._settings(model_dir, dtype, True, lora, trainer, algorithm, sampling)
        torch.manual_seed(seed)
        model = load_hf_model(model_dir, dtype)
        targets = list(self.lora_config.target_modules)
        rank, alpha = self.lora_config.rank, self.lora_config.alpha
        if self.lora_config.enabled:
            model = hf_lora.apply_lora(model, self.spec, rank, alpha, targets, seed)
            policy = [p for _, p in hf_lora.adapter_parameters(model, hf_lora.POLICY)]
            frozen = model
        else:
            policy = list(model.parameters())
            needs_base = self.algorithm.kl_coef > 0 or self.algorithm.name == "ppo"
            frozen = load_hf_model(model_dir, dtype).requires_grad_(False) if needs_base else None
        value_head, critic = None, []
        if self.algorithm.name == "ppo":
            frozen = hf_lora.apply_lora(frozen, self.spec, rank, alpha, targets, seed + 1, CRITIC_ADAPTER)
            if self.lora_config.enabled:
                model = frozen  # the same peft model, one slot more
            value_head = nn.Linear(self.spec.hidden_size, 1, dtype=torch.float32)
            nn.init.zeros_(value_head.weight)  # V = 0 until the critic learns (as the Megatron backend)
            nn.init.zeros_(value_head.bias)
            critic = [p for _, p in hf_lora.adapter_parameters(frozen, CRITIC_ADAPTER)]
            critic += list(value_head.parameters())
        self.frozen = frozen
        groups = [{"params": policy, "lr": self.config.lr}]
        if critic:
            groups.append({"params": critic, "lr": self.algorithm.critic_lr or self.config.lr})
        ds = self.config.deepspeed
        settings = EngineSettings(
            zero_stage=ds.zero_stage, config_path=ds.config, optimizer=self.config.optimizer,
            lr=self.config.lr, betas=self.config.betas, eps=self.config.eps,
            weight_decay=self.config.weight_decay, grad_clip=self.config.grad_clip,
            extensions_dir=extensions_dir,
        )
        self.engine = DeepSpeedModel(_Models(model, frozen, value_head), groups, settings, dtype)
        self.models: _Models = self.engine.module
        self.model = self.models.policy
        self.value_head = getattr(self.models, "value_head", None)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(seed)  # minibatch shuffling only
        self._last_old_logprobs: list[Tensor] = []

    # --- scoring (every rank scores every sequence) ----------------------------------------

    def _score(self, mode: str, sequences, starts, sampling: Sampling | None) -> list[Tensor]:
        from parity.scoring import batched_logprobs

        return batched_logprobs(lambda ids, _: self.engine(mode, ids), sequences, starts,
                                self.config.micro_batch_size, sampling)

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[Tensor]:
        return self._score("policy", sequences, starts, None if raw else self.sampling)

    @torch.no_grad()
    def ref_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        if self.frozen is None:
            raise ValueError("no reference policy: a full fine-tune keeps a frozen base copy "
                             "only when algorithm.kl_coef > 0 or algorithm.name is ppo")
        return self._score("reference", sequences, starts, Sampling(temperature=self.sampling.temperature))

    def _policy_forward(self, mb: Micro) -> tuple[Tensor, Tensor]:
        logits = processed_logits(self.engine("policy", mb.ids)[:, :-1], self.sampling)
        logp = mb.response(kernels.token_logprobs(logits, mb.ids[:, 1:]))
        return logp, logits

    def _critic_forward(self, mb: Micro) -> Tensor:
        return mb.response(self.engine("critic", mb.ids)[:, :-1])

    # --- training: this rank's share, DeepSpeed's step ---------------------------------------

    def _micro_batches(self, rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches: every rank gets as many, none empty (ZeRO reduces inside
        backward), and one rank alone runs exactly PolicyStep's micro-batches. When the
        rows cannot give every rank as many micro-batches of at most micro_batch_size (3 rows,
        size 1, 2 ranks), some get one row more."""
        parts = chunks(rows, self.config.micro_batch_size)
        n = self.world_size
        if len(parts) % n:
            # Rounded up to a multiple of the rank count, but no more micro-batches than rows
            # (the config check keeps ranks <= rows).
            count = min(-(-len(parts) // n) * n, len(rows) // n * n)
            size, extra = divmod(len(rows), count)
            bounds = [i * size + min(i, extra) for i in range(count + 1)]
            parts = [rows[bounds[i] : bounds[i + 1]] for i in range(count)]
        return parts[self.rank :: n]

    def _backward(self, loss: Tensor, last: bool) -> None:
        # DeepSpeed averages gradients over the ranks; the minibatch's loss is their sum.
        self.engine.backward(loss * self.world_size, boundary=last)

    def _minibatch_step(self, batch, rows, t) -> dict[str, float]:
        stats = super()._minibatch_step(batch, rows, t)
        if self.world_size == 1:
            return stats
        keys = sorted(k for k in stats if k not in _STEP_KEYS)
        summed = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(summed)
        return {**stats, **dict(zip(keys, summed.tolist(), strict=True))}

    def _optimizer_step(self) -> dict[str, float]:
        return {"ppo/grad_norm": self.engine.step()}

    # --- weights out, state in and out ------------------------------------------------------

    def _trainable(self) -> list[nn.Parameter]:
        if self.lora_config.enabled:
            return [p for _, p in hf_lora.adapter_parameters(self.model, hf_lora.POLICY)]
        return list(self.model.parameters())

    def rollout_tensors(self) -> dict[str, Tensor]:
        """The policy adapter (peft names, model dtype) or every weight (HF names), gathered
        under ZeRO-3 (collective: every rank calls it)."""
        with self.engine.gathered(self._trainable()):
            if self.lora_config.enabled:
                tensors = hf_lora.rollout_tensors(self.model)
            else:
                hf = self.model.state_dict()
                tensors = {n: hf[n] for w in weights.weight_map(self.spec) for n in w.hf}
            return {k: v.detach().clone().contiguous() for k, v in tensors.items()}

    def rollout_params(self) -> dict[str, Tensor]:
        """Full weights under the rollout parity model's names and fused layouts."""
        return weights.from_hf(self.rollout_tensors(), self.spec, "rollout")

    def _kind(self) -> dict[str, Any]:
        lora = dataclasses.asdict(self.lora_config) if self.lora_config.enabled else None
        return {"lora": lora, "algorithm": self.algorithm.name, "dtype": self.dtype,
                "backend": "deepspeed", "zero_stage": self.engine.zero_stage, "ranks": self.world_size}

    def state_dict(self) -> dict[str, Any]:
        """What DeepSpeed's checkpoint does not hold: the kind, the shuffling and RNG states."""
        return {"kind": self._kind(), "generator": self.generator.get_state(),
                "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self._kind():
            raise ValueError(f"state is for {state['kind']}, this trainer is {self._kind()}")
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
