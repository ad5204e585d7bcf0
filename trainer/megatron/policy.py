"""The Megatron backend's PolicyTrainer: trainer.step.PolicyStep (the PPO / GRPO / RLOO step both
backends run) on the Megatron model, free of Ray.

`PolicyTrainer` owns the policy, the reference policy, the PPO critic and the optimizer; the
Ray actor (trainer.megatron.worker) wraps it. Everything goes in and out as token lists,
tensors and floats.

- Policy: LoRA adapters (fp32 masters) on a frozen base, or every weight for a full fine-tune.
- Reference: with LoRA, the policy model with its adapters switched off (no second copy). A
  full fine-tune moves the base itself, so it loads a frozen copy of the checkpoint when it
  needs one: for the reference (kl_coef > 0) and as the critic's base (ppo).
- Critic (ppo): its own LoRA slot ("critic") on the frozen base plus an fp32 value head on the
  final-norm hidden states. The policy slot's forward math is untouched by it.
- Old log-probs are `trainer.megatron.logprobs.sequence_logprobs` of the current policy, so
  with parity on they are bitwise the rollout engine's. Every policy log-prob (old, new, the
  entropy) is of the distribution the rollout samples from (`sampling`: temperature, top-k,
  top-p, computed by parity.sampling as vLLM's sampler does); the reference's is
  temperature-scaled only (its top-p set is not the policy's, and a sampled token outside it
  would make the KL infinite). parity=False trains the stock Megatron model (its linears get
  the adapter hook) and may correct the mismatch with TIS / MIS weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from parity import kernels
from parity.sampling import Sampling, processed_logits
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig
from trainer.megatron import lora as lora_lib
from trainer.megatron.convert import megatron_to_hf
from trainer.megatron.layers import POLICY_ADAPTER, pack_frozen_weights
from trainer.megatron.logprobs import forward_logits, forward_output, sequence_logprobs
from trainer.megatron.model import load_model
from trainer.step import CRITIC_ADAPTER, Micro, PolicyStep


def final_hidden(model: GPTModel, input_ids: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """Final-norm hidden states [B, S, H] (forward_output's layouts). With post_process off,
    GPTModel returns the decoder output instead of logits; the decoder keeps its own flag, so
    the final norm still runs."""
    model.post_process = False
    try:
        return forward_output(model, input_ids, cu_seqlens).transpose(0, 1)
    finally:
        model.post_process = True


def _base_state(model: GPTModel) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def tp_partial_grad_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter parameters (every slot) whose gradient a tensor-parallel rank holds only its
    share of: those on column-parallel linears, where a rank keeps its output columns of the
    replicated adapter's delta (trainer.megatron.layers). An adapter on a row-parallel linear adds its
    full delta to the replicated output on every rank, so every rank already holds its full
    gradient."""
    from trainer.megatron.layers import ParityColumnParallelLinear

    return [p for m in model.modules() if isinstance(m, ParityColumnParallelLinear)
            for n, p in m.named_parameters() if n.startswith("lora.")]


def _fp32_master(p: torch.nn.Parameter) -> torch.nn.Parameter:
    # The optimizer steps fp32 weights; a bf16 model gets a master copy, cast back after a step.
    return p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())


class PolicyTrainer(PolicyStep):
    """Policy (+ critic) training on rollouts; see the module docstring.

    Call trainer.megatron.patches.init_megatron() first (once per process). Deterministic: the
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
        kv_cache_dtype: str = "auto",  # the rollout's cache format, whose rounding the model repeats
    ):
        self._settings(model_dir, dtype, parity, lora, trainer, algorithm, sampling)
        tp_size = self.config.tensor_parallel_size
        if self.config.deterministic_layout and tp_size > 1 and torch.cuda.is_available():
            raise ValueError(f"trainer.deterministic_layout at trainer.tensor_parallel_size {tp_size} runs on "
                             "the CPU only: its ordered backward is the compiled CPU kernels'")
        self._dp = _data_parallel_rank(self.config.data_parallel_size)
        self.model = load_model(model_dir, dtype, parity, tp_size=self.config.tensor_parallel_size,
                                kv_cache_dtype=kv_cache_dtype)
        targets = list(self.lora_config.target_modules)
        rank, alpha = self.lora_config.rank, self.lora_config.alpha
        if self.lora_config.enabled:
            lora_lib.apply_lora(self.model, self.spec, rank, alpha, targets, seed)
            policy = lora_lib.adapter_parameters(self.model, POLICY_ADAPTER)
            self.frozen: GPTModel | None = self.model
        else:
            policy = list(self.model.named_parameters())
            needs_base = self.algorithm.kl_coef > 0 or self.algorithm.name == "ppo"
            self.frozen = (load_model(model_dir, dtype, parity, kv_cache_dtype=kv_cache_dtype).requires_grad_(False)
                           if needs_base else None)
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
        # The ordered step (deterministic_layout) computes every adapter gradient whole on
        # every rank (trainer.megatron.layers): nothing is left to sum across the TP ranks.
        sharded = tp_size > 1 and not self.config.deterministic_layout
        self._partial_grads = tp_partial_grad_params(self.model) if sharded else []
        # Frozen weights (the LoRA base, a full fine-tune's reference copy) are never written
        # again: the compiled GEMM's packs of them are made once, here, not on every forward.
        for model in {id(m): m for m in (self.model, self.frozen) if m is not None}.values():
            pack_frozen_weights(model)
        self.optimizer = self._build_optimizer()
        self.generator = torch.Generator().manual_seed(seed)  # minibatch shuffling only
        self._last_old_logprobs: list[Tensor] = []

    # --- setup ----------------------------------------------------------------------------

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

    # --- scoring --------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[Tensor]:
        """Current-policy log-probs of seq[start:], float32: exactly sequence_logprobs, of the
        sampled distribution (vLLM's processed log-probs), or of the raw softmax with `raw`
        (what vLLM's teacher-forced prompt log-probs are)."""
        sampling = None if raw else self.sampling
        return self._score_shares(
            lambda seqs, st: sequence_logprobs(self.model, seqs, st, self.config.micro_batch_size, sampling,
                                               self.config.packed_sequences),
            sequences, starts)

    @torch.no_grad()
    def ref_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """Reference-policy (the base, adapters off) log-probs of seq[start:], float32."""
        if self.frozen is None:
            raise ValueError("no reference policy: a full fine-tune keeps a frozen base copy "
                             "only when algorithm.kl_coef > 0 or algorithm.name is ppo")
        tempered = Sampling(temperature=self.sampling.temperature)

        def score(seqs: list[list[int]], st: list[int]) -> list[Tensor]:
            with lora_lib.adapters_disabled(self.frozen):
                return sequence_logprobs(self.frozen, seqs, st, self.config.micro_batch_size, tempered,
                                         self.config.packed_sequences)

        return self._score_shares(score, sequences, starts)

    def _policy_forward(self, mb: Micro) -> tuple[Tensor, Tensor]:
        """(log-probs [B, T] of the response tokens, logits [B, W - 1, V] (packed: [1, N - 1, V])
        of the sampled distribution), with grad."""
        # On a CUDA model, processed_logits returns a host copy (parity.sampling): the loss is
        # computed next to the batch's tensors and its gradient flows back to the device.
        logits = processed_logits(forward_logits(self.model, mb.ids, mb.cu_seqlens)[:, :-1], self.sampling)
        # The same ops as sequence_logprobs (gather picks the same elements it slices), so at
        # the first minibatch the new log-probs equal the old ones bitwise: ratio exactly 1.
        logp = mb.response(kernels.token_logprobs(logits, mb.ids[:, 1:]))
        return logp, logits

    def _critic_forward(self, mb: Micro) -> Tensor:
        """Values [B, T] at the positions that score the response tokens."""
        with lora_lib.adapter_active(self.frozen, CRITIC_ADAPTER):
            hidden = final_hidden(self.frozen, mb.ids, mb.cu_seqlens).float()
        # kernels.linear: batch invariant, so a row's value does not depend on its micro-batch.
        values = kernels.linear(hidden, self.value_head.weight, self.value_head.bias)
        return mb.response(values.squeeze(-1)[:, :-1])

    # --- training: backward and optimizer step ------------------------------------------

    def _backward(self, loss: Tensor, last: bool) -> None:
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
        """TP > 1 (the plain step): sum the adapter gradients that each rank holds only a share
        of (see tp_partial_grad_params), so every rank steps its replica of the adapters with the
        full gradient and the replicas stay identical (an all-reduce hands every rank the same
        sum). The ordered step has none to sum."""
        if not self._partial_grads:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        for p in self._partial_grads:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)

    # --- trainer.deterministic_layout: per-sequence gradients, summed in row order ----------

    def _trainables(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(the parameter the backward fills, the one the optimizer steps), policy then critic."""
        return [(p, m) for _, p, m in self._policy] + [(p, p) for _, p in self._critic]

    def _data_parallel(self) -> tuple[int, int]:
        return self._dp

    def _sample_gradient(self, loss: Tensor) -> Tensor:
        loss.backward()  # on one thread (PolicyStep._update_threads)
        flat = []
        for p, _ in self._trainables():
            flat.append(torch.zeros(p.numel()) if p.grad is None else p.grad.float().reshape(-1))
            p.grad = None
        return torch.cat(flat)

    def _gather_rows(self, local: Tensor, counts: list[int]) -> Tensor:
        """all_gather over the data-parallel group (rows padded to the longest share): it only
        moves tensors, so unlike an all_reduce it leaves the summation order to us."""
        if self._dp[1] == 1:
            return local
        import torch.distributed as dist
        from megatron.core import parallel_state

        padded = local.new_zeros((max(counts),) + local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=parallel_state.get_data_parallel_group())
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    def _install_gradient(self, flat: Tensor) -> None:
        offset = 0
        for _, master in self._trainables():
            n = master.numel()
            master.grad = flat[offset : offset + n].view_as(master).to(master.dtype)
            offset += n

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
        return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}  # the wire is host memory

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


def _data_parallel_rank(size: int) -> tuple[int, int]:
    """(this rank's data-parallel index, `size`), checked against Megatron's parallel state."""
    from megatron.core import parallel_state

    world = parallel_state.get_data_parallel_world_size()
    if world != size:
        raise ValueError(f"trainer.data_parallel_size is {size}, but the process group holds "
                         f"{world} data-parallel ranks")
    return parallel_state.get_data_parallel_rank(), size


def _copy_named(dst: dict[str, Tensor], src: dict[str, Tensor]) -> None:
    if dst.keys() != src.keys():
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        raise ValueError(f"parameter names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in dst.items():
        if tensor.shape != src[name].shape:
            raise ValueError(f"{name}: shape {tuple(src[name].shape)}, expected {tuple(tensor.shape)}")
        tensor.copy_(src[name])
