"""The trainer side of one PPO / GRPO / RLOO step on the Megatron model, free of Ray.

`PolicyTrainer` owns the policy, the reference policy, the PPO critic and the optimizer; the
Ray actor in rl/ wraps it. Everything goes in and out as token lists, tensors and floats.

- Policy: LoRA adapters (fp32 masters) on a frozen base, or every weight for a full fine-tune.
- Reference: with LoRA, the policy model with its adapters switched off (no second copy). A
  full fine-tune moves the base itself, so it loads a frozen copy of the checkpoint when it
  needs one: for the reference (kl_coef > 0) and as the critic's base (ppo).
- Critic (ppo): its own LoRA slot ("critic") on the frozen base plus an fp32 value head on the
  final-norm hidden states. The policy slot's forward math is untouched by it.
- Old log-probs are `trainer.logprobs.sequence_logprobs` of the current policy, so with parity
  on they are bitwise the rollout engine's. Every policy log-prob (old, new, the entropy) is of
  the distribution the rollout samples from (`sampling`: temperature, top-k, top-p, computed by
  parity.sampling as vLLM's sampler does); the reference's is temperature-scaled only (its
  top-p set is not the policy's, and a sampled token outside it would make the KL infinite). parity=False trains the stock Megatron model (its
  linears get the adapter hook) and may correct the mismatch with TIS / MIS weights.

Sequences are token lists; `starts[i]` is the prompt length, and tokens seq[start:] (the
response) are scored. Token-level tensors are [N, T] over response tokens, padded with a mask.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from parity import kernels
from parity.model_spec import load_spec
from parity.sampling import Sampling, processed_logits
from trainer import lora as lora_lib
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig
from trainer.convert import megatron_to_hf
from trainer.layers import POLICY_ADAPTER, pack_frozen_weights
from trainer.logprobs import forward_logits, forward_output, sequence_logprobs
from trainer.model import load_model
from trainer.ppo import (
    entropy_from_logits,
    gae,
    grpo_advantages,
    importance_weights,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    sequence_reward_to_tokens,
    value_loss,
)

CRITIC_ADAPTER = "critic"


@dataclass
class Batch:
    """One step's rollouts. The samples of a prompt are consecutive rows, `group_size` each."""

    sequences: list[list[int]]  # prompt + response token ids
    starts: list[int]  # prompt lengths (>= 1): tokens seq[start:] are scored
    rollout_logprobs: list[Tensor]  # float32 [len - start] each, from the rollout engine
    rewards: Tensor  # [N], one per sequence
    group_size: int = 1
    group_ids: list[int] | None = None  # optional; checked to come in blocks of group_size


@dataclass
class _Micro:
    """A right-padded micro-batch: what one forward pass needs."""

    rows: list[int]  # its rows in the batch
    ids: Tensor  # [B, W] token ids
    index: Tensor  # [B, T] logits position that scores response token t (0 on padding)
    lengths: list[int]  # response lengths


def _micro(sequences: list[list[int]], starts: list[int], rows: list[int]) -> _Micro:
    seqs = [sequences[r] for r in rows]
    lengths = [len(sequences[r]) - starts[r] for r in rows]
    ids = torch.zeros(len(rows), max(len(s) for s in seqs), dtype=torch.long)
    index = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for j, (r, seq, n) in enumerate(zip(rows, seqs, lengths, strict=True)):
        ids[j, : len(seq)] = torch.tensor(seq)
        # Position p's logits predict token p + 1, so response token t (at start + t) is
        # scored at start - 1 + t, as in sequence_logprobs.
        index[j, :n] = torch.arange(starts[r] - 1, starts[r] - 1 + n)
    return _Micro(rows, ids, index, lengths)


def _chunks(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _pad(rows: list[Tensor], width: int) -> Tensor:
    """Stack 1-D float tensors into [N, width], zero beyond each row's end."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def final_hidden(model: GPTModel, input_ids: Tensor) -> Tensor:
    """Final-norm hidden states [B, S, H]. With post_process off, GPTModel returns the decoder
    output instead of logits; the decoder keeps its own flag, so the final norm still runs."""
    model.post_process = False
    try:
        return forward_output(model, input_ids).transpose(0, 1)
    finally:
        model.post_process = True


def _base_state(model: GPTModel) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def tp_partial_grad_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter parameters (every slot) whose gradient a tensor-parallel rank holds only its
    share of: those on column-parallel linears, where a rank keeps its output columns of the
    replicated adapter's delta (trainer.layers). An adapter on a row-parallel linear adds its
    full delta to the replicated output on every rank, so every rank already holds its full
    gradient."""
    from trainer.layers import ParityColumnParallelLinear

    return [p for m in model.modules() if isinstance(m, ParityColumnParallelLinear)
            for n, p in m.named_parameters() if n.startswith("lora.")]


def _fp32_master(p: torch.nn.Parameter) -> torch.nn.Parameter:
    # The optimizer steps fp32 weights; a bf16 model gets a master copy, cast back after a step.
    return p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())


class PolicyTrainer:
    """Policy (+ critic) training on rollouts; see the module docstring.

    Call trainer.megatron_patches.init_megatron() first (once per process). Deterministic: the
    same seed and inputs give bitwise the same results, also across state_dict/load_state_dict.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "fp32",
        parity: bool = True,
        lora: LoraConfig | None = None,
        trainer: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        seed: int = 0,
        sampling: Sampling | None = None,
    ):
        self._settings(model_dir, dtype, parity, lora, trainer, algorithm, sampling)
        self.model = load_model(model_dir, dtype, parity, tp_size=self.config.tensor_parallel_size)
        targets = list(self.lora_config.target_modules)
        rank, alpha = self.lora_config.rank, self.lora_config.alpha
        if self.lora_config.enabled:
            lora_lib.apply_lora(self.model, self.spec, rank, alpha, targets, seed)
            policy = lora_lib.adapter_parameters(self.model, POLICY_ADAPTER)
            self.frozen: GPTModel | None = self.model
        else:
            policy = list(self.model.named_parameters())
            needs_base = self.algorithm.kl_coef > 0 or self.algorithm.name == "ppo"
            self.frozen = load_model(model_dir, dtype, parity).requires_grad_(False) if needs_base else None
        self._policy = [(n, p, _fp32_master(p)) for n, p in policy]

        self.value_head: torch.nn.Linear | None = None
        self._critic: list[tuple[str, torch.nn.Parameter]] = []
        if self.algorithm.name == "ppo":
            # The critic reuses the LoRA shape settings, also for a full fine-tune's policy.
            lora_lib.apply_lora(self.frozen, self.spec, rank, alpha, targets, seed + 1, CRITIC_ADAPTER)
            self.value_head = torch.nn.Linear(self.spec.hidden_size, 1, dtype=torch.float32)
            # Zero init: V = 0 until the critic learns (no RNG draw, and a neutral baseline).
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self._critic = lora_lib.adapter_parameters(self.frozen, CRITIC_ADAPTER) + [
                (f"value_head.{n}", p) for n, p in self.value_head.named_parameters()
            ]
        self._partial_grads = tp_partial_grad_params(self.model) if self.config.tensor_parallel_size > 1 else []
        # Frozen weights (the LoRA base, a full fine-tune's reference copy) are never written
        # again: the compiled GEMM's packs of them are made once, here, not on every forward.
        for model in {id(m): m for m in (self.model, self.frozen) if m is not None}.values():
            pack_frozen_weights(model)
        self.optimizer = self._build_optimizer()
        self.generator = torch.Generator().manual_seed(seed)  # minibatch shuffling only
        self._last_old_logprobs: list[Tensor] = []

    # --- setup ----------------------------------------------------------------------------

    def _settings(self, model_dir, dtype: str, parity: bool, lora: LoraConfig | None,
                  trainer: TrainerConfig | None, algorithm: AlgorithmConfig | None,
                  sampling: Sampling | None) -> None:
        """The settings every trainer backend holds (defaults filled in, checked) and the spec."""
        self.model_dir = Path(model_dir)
        self.sampling = sampling or Sampling()
        self.dtype, self.parity = dtype, parity
        self.lora_config = lora or LoraConfig()
        self.config = trainer or TrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self._check_configs()
        self.spec = load_spec(model_dir)  # dense ModelSpec or KimiSpec (kimi-mini)

    def _check_configs(self) -> None:
        if self.config.tensor_parallel_size > 1 and not self.lora_config.enabled:
            raise ValueError(f"trainer.tensor_parallel_size {self.config.tensor_parallel_size} needs "
                            "lora.enabled: at TP > 1 the trainable parameters are the replicated "
                            "adapters (a full fine-tune would shard them)")
        if self.algorithm.is_correction != "none" and self.parity:
            raise ValueError(f"algorithm.is_correction {self.algorithm.is_correction!r} needs "
                            "parity false (with parity there is no mismatch to correct)")

    def _build_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        groups = [{"params": [m for _, _, m in self._policy], "lr": cfg.lr}]
        if self._critic:
            groups.append({"params": [p for _, p in self._critic],
                           "lr": self.algorithm.critic_lr or cfg.lr})
        kwargs = dict(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "adamw":
            return torch.optim.AdamW(groups, **kwargs)
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as e:
            raise ValueError(f"trainer.optimizer: {cfg.optimizer!r} needs DeepSpeed, which is not "
                            f"installed ({e}); use trainer.optimizer: adamw") from None
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)

    @property
    def lora_scaling(self) -> float | None:
        """alpha / rank of the policy adapter, which the rollout model applies; None when full."""
        return self.lora_config.alpha / self.lora_config.rank if self.lora_config.enabled else None

    # --- scoring --------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[Tensor]:
        """Current-policy log-probs of seq[start:], float32: exactly sequence_logprobs, of the
        sampled distribution (vLLM's processed log-probs), or of the raw softmax with `raw`
        (what vLLM's teacher-forced prompt log-probs are)."""
        sampling = None if raw else self.sampling
        return sequence_logprobs(self.model, sequences, starts, self.config.micro_batch_size, sampling)

    @torch.no_grad()
    def ref_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """Reference-policy (the base, adapters off) log-probs of seq[start:], float32."""
        if self.frozen is None:
            raise ValueError("no reference policy: a full fine-tune keeps a frozen base copy "
                             "only when algorithm.kl_coef > 0 or algorithm.name is ppo")
        tempered = Sampling(temperature=self.sampling.temperature)
        with lora_lib.adapters_disabled(self.frozen):
            return sequence_logprobs(self.frozen, sequences, starts, self.config.micro_batch_size, tempered)

    @torch.no_grad()
    def values(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """Critic values V(seq[:start + t]) for each response token t, float32 [len - start]."""
        if self.value_head is None:
            raise ValueError("values() needs the critic, which only algorithm.name ppo has")
        out = []
        for rows in _chunks(list(range(len(sequences))), self.config.micro_batch_size):
            mb = _micro(sequences, starts, rows)
            v = self._critic_forward(mb)
            out += [v[j, :n].clone() for j, n in enumerate(mb.lengths)]
        return out

    def _policy_forward(self, mb: _Micro) -> tuple[Tensor, Tensor]:
        """(log-probs [B, T] of the response tokens, logits [B, W - 1, V] of the sampled
        distribution), with grad."""
        logits = processed_logits(forward_logits(self.model, mb.ids)[:, :-1], self.sampling)
        # The same ops as sequence_logprobs (gather picks the same elements it slices), so at
        # the first minibatch the new log-probs equal the old ones bitwise: ratio exactly 1.
        logp = kernels.token_logprobs(logits, mb.ids[:, 1:]).gather(1, mb.index)
        return logp, logits

    def _critic_forward(self, mb: _Micro) -> Tensor:
        """Values [B, T] at the positions that score the response tokens."""
        with lora_lib.adapter_active(self.frozen, CRITIC_ADAPTER):
            hidden = final_hidden(self.frozen, mb.ids).float()
        # kernels.linear: batch invariant, so a row's value does not depend on its micro-batch.
        values = kernels.linear(hidden, self.value_head.weight, self.value_head.bias)
        return values.squeeze(-1).gather(1, mb.index)

    # --- training -------------------------------------------------------------------------

    def train_step(self, batch: Batch | dict[str, Any], old_logprobs: list[Tensor] | None = None) -> dict[str, float]:
        """Score the batch, compute advantages, and run ppo_epochs x minibatches optimizer
        steps (micro-batches of trainer.micro_batch_size, gradients accumulated).

        Stats are each minibatch's token mean, averaged over the step's minibatches, except
        `ppo/kl` (k3 KL(old || new) on the last minibatch). The old log-probs it computes are
        kept for `last_old_logprobs()`, to compare with the rollout's without scoring twice;
        `old_logprobs`, when given, are those of an earlier `logprobs(sequences, starts)` call
        (the caller compared them before deciding to update) and are not computed again.
        """
        batch = batch if isinstance(batch, Batch) else Batch(**batch)
        self._check_batch(batch)
        algo = self.algorithm
        seqs, starts = batch.sequences, batch.starts
        old_list = self.logprobs(seqs, starts) if old_logprobs is None else old_logprobs
        self._last_old_logprobs = old_list
        width = max(t.numel() for t in old_list)
        mask = _pad([torch.ones(t.numel()) for t in old_list], width)
        old = _pad(old_list, width)
        ref = _pad(self.ref_logprobs(seqs, starts), width) if algo.kl_coef > 0 else None
        old_values = _pad(self.values(seqs, starts), width) if self.value_head is not None else None
        advantages, returns = self._advantages(batch, old, ref, old_values, mask)

        stats = {"ref/kl": 0.0}
        if ref is not None:
            stats["ref/kl"] = masked_mean(kl_estimate(old, ref, algo.kl_estimator), mask).item()
        is_weights = None
        if not self.parity and algo.is_correction != "none":
            rollout = _pad([t.float() for t in batch.rollout_logprobs], width)
            is_weights, is_stats = importance_weights(old, rollout, mask, algo.is_correction, algo.is_cap)
            stats.update({f"is/{k.removeprefix('is_')}": v for k, v in is_stats.items()})
        tensors = dict(old=old, mask=mask, advantages=advantages, ref=ref, is_weights=is_weights,
                       old_values=old_values, returns=returns)

        totals: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(algo.ppo_epochs):
            perm = torch.randperm(len(seqs), generator=self.generator)
            for rows in perm.tensor_split(algo.minibatches):
                last = self._minibatch_step(batch, rows.tolist(), tensors)
                for k, v in last.items():
                    totals[k] += v
                steps += 1
        stats.update({k: v / steps for k, v in totals.items()})
        stats["ppo/kl"] = last["ppo/kl"]
        stats["train/optimizer_steps"] = float(steps)
        stats["train/response_tokens"] = mask.sum().item()
        return stats

    def last_old_logprobs(self) -> list[Tensor]:
        """The old-policy log-probs the last train_step computed (compare with the rollout's)."""
        return self._last_old_logprobs

    def _check_batch(self, batch: Batch) -> None:
        n = len(batch.sequences)
        if not (len(batch.starts) == len(batch.rollout_logprobs) == batch.rewards.numel() == n):
            raise ValueError("batch: sequences, starts, rollout_logprobs and rewards differ in length")
        rows = zip(batch.sequences, batch.starts, batch.rollout_logprobs, strict=True)
        for i, (seq, start, lp) in enumerate(rows):
            if not 1 <= start < len(seq):
                raise ValueError(f"batch: sequence {i} has start {start} outside [1, {len(seq)})")
            if lp.numel() != len(seq) - start:
                raise ValueError(f"batch: sequence {i} has {len(seq) - start} response tokens but "
                                 f"{lp.numel()} rollout log-probs")
        if n < self.algorithm.minibatches:
            raise ValueError(f"batch: {n} sequences do not split into "
                             f"{self.algorithm.minibatches} minibatches")
        g = batch.group_size
        if n % g:
            raise ValueError(f"batch: {n} sequences do not split into groups of {g}")
        if batch.group_ids is not None:
            blocks = [batch.group_ids[i : i + g] for i in range(0, n, g)]
            one_id_each = all(len(set(b)) == 1 for b in blocks)
            if len(batch.group_ids) != n or not one_id_each or len({b[0] for b in blocks}) != len(blocks):
                raise ValueError(f"batch: group_ids must come in consecutive blocks of {g}")

    def _advantages(
        self, batch: Batch, old: Tensor, ref: Tensor | None, values: Tensor | None, mask: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """(advantages [N, T], returns [N, T] for ppo else None)."""
        algo = self.algorithm
        rewards = batch.rewards.float()
        # kl_mode "reward": the KL to the reference is a per-token cost (ppo), or its sum over
        # the response a per-sequence cost (grpo / rloo, whose baselines work on sequences).
        kl = kl_estimate(old, ref, algo.kl_estimator) if ref is not None and algo.kl_mode == "reward" else None
        if algo.name == "ppo":
            token_rewards = sequence_reward_to_tokens(rewards, mask)
            if kl is not None:
                token_rewards = token_rewards - algo.kl_coef * kl
            advantages, returns = gae(token_rewards, values, mask, algo.gamma, algo.lam)
            # Whitened over the batch, as usual for PPO on LLMs: the step size then does not
            # depend on the reward scale.
            return masked_whiten(advantages, mask), returns
        if kl is not None:
            rewards = rewards - algo.kl_coef * masked_sum(kl, mask, dim=1)
        fn = grpo_advantages if algo.name == "grpo" else rloo_advantages
        seq_adv = fn(rewards, batch.group_size)
        return torch.where(mask > 0, seq_adv[:, None], torch.zeros(())), None

    def _minibatch_step(self, batch: Batch, rows: list[int], t: dict[str, Tensor | None]) -> dict[str, float]:
        """Accumulate gradients over the micro-batches of `rows`, then one optimizer step."""
        algo = self.algorithm
        total_tokens = t["mask"][rows].sum().clamp_min(1.0)
        acc: dict[str, float] = defaultdict(float)
        micro_batches = self._micro_batches(rows)
        for i, micro_rows in enumerate(micro_batches):
            mb = _micro(batch.sequences, batch.starts, micro_rows)
            width = mb.index.shape[1]
            m = {k: None if v is None else v[micro_rows, :width] for k, v in t.items()}
            mask = m["mask"]
            # Each micro-batch's token mean, weighted by its share of the minibatch's tokens:
            # the accumulated gradient is that of the minibatch's token mean.
            weight = mask.sum() / total_tokens
            logp, logits = self._policy_forward(mb)
            loss, pg_stats = policy_loss(logp, m["old"], m["advantages"], mask, algo.clip_eps,
                                         m["is_weights"])
            parts = {"ppo/policy_loss": loss.detach(), "ppo/clipfrac": pg_stats["clipfrac"],
                     "ppo/kl": pg_stats["approx_kl"]}
            # Response positions only: the prompt's entropy is neither trained nor reported.
            vocab = logits.shape[-1]
            response_logits = logits.gather(1, mb.index.unsqueeze(-1).expand(-1, -1, vocab))
            if algo.entropy_coef == 0:
                response_logits = response_logits.detach()  # a statistic only: keep no graph
            entropy = masked_mean(entropy_from_logits(response_logits), mask)
            loss = loss - algo.entropy_coef * entropy
            parts["ppo/entropy"] = entropy.detach()
            if algo.kl_coef > 0 and algo.kl_mode == "loss":
                kl = masked_mean(kl_estimate(logp, m["ref"], algo.kl_estimator), mask)
                loss = loss + algo.kl_coef * kl
                parts["ppo/kl_loss"] = kl.detach()
            if self.value_head is not None:
                vloss, v_stats = value_loss(self._critic_forward(mb), m["old_values"],
                                            m["returns"], mask, algo.value_clip_eps)
                loss = loss + algo.vf_coef * vloss
                parts["critic/value_loss"] = vloss.detach()
                parts["critic/vf_clipfrac"] = v_stats["vf_clipfrac"]
            self._backward(loss * weight, last=i == len(micro_batches) - 1)
            for k, v in parts.items():
                acc[k] += float(v) * weight.item()
        acc.update(self._optimizer_step())
        return acc

    def _micro_batches(self, rows: list[int]) -> list[list[int]]:
        """The micro-batches of a minibatch that this trainer runs (a data-parallel backend
        runs its rank's share)."""
        return _chunks(rows, self.config.micro_batch_size)

    def _backward(self, loss: Tensor, last: bool) -> None:
        """Accumulate one micro-batch's gradients; `last`: the minibatch's last micro-batch."""
        loss.backward()
        self._accumulate_master_grads()

    def _accumulate_master_grads(self) -> None:
        # A bf16 model's gradients move to the fp32 masters after every micro-batch, so that
        # the accumulation over micro-batches runs in fp32.
        for _, p, master in self._policy:
            if master is not p and p.grad is not None:
                g = p.grad.float()
                master.grad = g if master.grad is None else master.grad.add_(g)
                p.grad = None

    def _optimizer_step(self) -> dict[str, float]:
        self._reduce_tp_grads()
        # Policy and critic are clipped separately: their gradient scales differ, and the
        # critic's early, large gradients must not shrink the policy's step.
        stats = {"ppo/grad_norm": self._clip([m for _, _, m in self._policy])}
        if self._critic:
            stats["critic/grad_norm"] = self._clip([p for _, p in self._critic])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_masters()
        return stats

    def _reduce_tp_grads(self) -> None:
        """TP > 1: sum the adapter gradients that each rank holds only a share of (see
        tp_partial_grad_params), so every rank steps its replica of the adapters with the full
        gradient and the replicas stay identical (an all-reduce hands every rank the same sum)."""
        if not self._partial_grads:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        for p in self._partial_grads:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)

    def _clip(self, params: list[torch.nn.Parameter]) -> float:
        """The gradients' total norm before clipping; clips to trainer.grad_clip unless 0."""
        if self.config.grad_clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip).item()
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).item()

    @torch.no_grad()
    def _sync_masters(self) -> None:
        for _, p, master in self._policy:
            if master is not p:
                p.copy_(master)

    # --- weights out, state in and out --------------------------------------------------

    def rollout_tensors(self) -> dict[str, Tensor]:
        """What the rollout engine must load, as a snapshot: the policy adapter in peft names
        and the model dtype (LoRA), or every weight in HF names and the model dtype (full)."""
        if self.lora_config.enabled:
            tensors = lora_lib.rollout_tensors(self.model)
        else:
            tensors = megatron_to_hf(_base_state(self.model), self.spec)
        return {k: v.detach().clone() for k, v in tensors.items()}

    def _kind(self) -> dict[str, Any]:
        lora = dataclasses.asdict(self.lora_config) if self.lora_config.enabled else None
        return {"lora": lora, "algorithm": self.algorithm.name, "dtype": self.dtype}

    def state_dict(self) -> dict[str, Any]:
        """Trainable params (fp32 masters), critic, optimizer and RNG states. Like torch's
        state_dict it references live tensors: save it before the next train_step."""
        return {
            "kind": self._kind(),
            "policy": {n: m.detach() for n, _, m in self._policy},
            "critic": {n: p.detach() for n, p in self._critic},
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            # Not drawn from here; restored so the process's default stream resumes as well.
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self._kind():
            raise ValueError(f"state is for {state['kind']}, this trainer is {self._kind()}")
        with torch.no_grad():
            _copy_named(dict((n, m) for n, _, m in self._policy), state["policy"])
            _copy_named(dict(self._critic), state["critic"])
        self._sync_masters()
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])


def _copy_named(dst: dict[str, Tensor], src: dict[str, Tensor]) -> None:
    if dst.keys() != src.keys():
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        raise ValueError(f"parameter names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in dst.items():
        if tensor.shape != src[name].shape:
            raise ValueError(f"{name}: shape {tuple(src[name].shape)}, expected {tuple(tensor.shape)}")
        tensor.copy_(src[name])
