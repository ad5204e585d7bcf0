"""The PPO / GRPO / RLOO step that both trainer backends run, free of Ray and of any backend.

`PolicyStep` holds the settings, checks a batch, scores it (old-policy and reference log-probs,
critic values), computes the advantages and runs ppo_epochs x minibatches optimizer steps over
micro-batches, with the losses of trainer/ppo.py. A backend (trainer.megatron.policy,
trainer.deepspeed.policy) supplies the model: the forwards that score and train, the backward
and the optimizer step, the weights out and the state in and out (the abstract methods).

Sequences are token lists; `starts[i]` is the prompt length, and tokens seq[start:] (the
response) are scored. Token-level tensors are [N, T] over response tokens, padded with a mask.
A multi-turn trajectory's response holds tool / template tokens between the model's turns: its
`masks[i]` (1 on the model's tokens, 0 on those) is that mask, so the loss, the advantages
(broadcast over the model's tokens of every turn), KL and entropy cover the model's tokens only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from parity.autograd import ordered_backward
from parity.model_spec import KimiSpec, load_spec
from parity.sampling import Sampling
from parity.tp import check_ordered_vocab
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig
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
    # Optional, float [len - start] each: 1 on the tokens the policy generated, 0 on tokens it
    # did not (tool observations, template markers of a multi-turn trajectory); None: all 1.
    masks: list[Tensor] | None = None


@dataclass
class Micro:
    """A micro-batch as one forward takes it: right-padded rows ids [B, W], or (packed) every
    sequence end to end in one row ids [1, N] with `cu_seqlens`, no padding to compute."""

    rows: list[int]  # its rows in the batch
    ids: Tensor  # [B, W] or, packed, [1, N] token ids
    # [B, T]: where response token t of row b is scored, as an index into the forward's
    # per-position outputs flattened (positions 0..W-2 of each padded row, or 0..N-2 of the
    # packed one): position p's logits predict token p + 1. 0 on padding.
    index: Tensor
    lengths: list[int]  # response lengths
    cu_seqlens: Tensor | None = None  # packed: int32 [B + 1] sequence offsets in ids[0]

    def response(self, per_position: Tensor) -> Tensor:
        """The response tokens' entries [B, T, ...] of a forward's per-position output
        [B, W - 1, ...] (or [1, N - 1, ...] packed). Picks elements, so their bits are kept."""
        return per_position.flatten(0, 1)[self.index]


def micro_batch(sequences: list[list[int]], starts: list[int], rows: list[int], packed: bool = False) -> Micro:
    seqs = [sequences[r] for r in rows]
    lengths = [len(sequences[r]) - starts[r] for r in rows]
    index = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    if packed:
        offsets = [0]
        for seq in seqs:
            offsets.append(offsets[-1] + len(seq))
        ids = torch.tensor([tok for seq in seqs for tok in seq]).unsqueeze(0)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    else:
        ids = torch.zeros(len(rows), max(len(s) for s in seqs), dtype=torch.long)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)] = torch.tensor(seq)
        offsets = [j * (ids.shape[1] - 1) for j in range(len(rows))]
        cu_seqlens = None
    for j, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        # Response token t (at start + t) is scored at position start - 1 + t, as in
        # sequence_logprobs.
        index[j, :n] = torch.arange(offsets[j] + starts[r] - 1, offsets[j] + starts[r] - 1 + n)
    return Micro(rows, ids, index, lengths, cu_seqlens)


def chunks(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def ordered_sum(rows: Tensor) -> Tensor:
    """((rows[0] + rows[1]) + rows[2]) + ...: element-wise adds in row order only, so the bits
    depend on the rows and their order alone (as parity.tp.rank_ordered_sum, in rows' dtype)."""
    acc = rows[0].clone()
    for row in rows[1:]:
        acc += row
    return acc


def rank_share(rows: list[int], rank: int, size: int) -> list[int]:
    """Data-parallel rank `rank`'s contiguous share of `rows` (of `size` ranks), so the shares
    in rank order are `rows` in order; shares differ in length by at most one."""
    n = len(rows)
    return rows[rank * n // size : (rank + 1) * n // size]


def pad(rows: list[Tensor], width: int) -> Tensor:
    """Stack 1-D float tensors into [N, width], zero beyond each row's end."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


class PolicyStep(ABC):
    """Policy (+ critic) training on rollouts, the backend-neutral part (see the module
    docstring). Deterministic: the same seed and inputs give bitwise the same results, also
    across state_dict/load_state_dict."""

    value_head: torch.nn.Module | None  # the critic's value head (ppo), else None
    generator: torch.Generator  # minibatch shuffling only
    _last_old_logprobs: list[Tensor]

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
        if self.config.packed_sequences and (isinstance(self.spec, KimiSpec) or not parity
                                             or self.config.backend != "megatron"):
            raise ValueError("trainer.packed_sequences needs trainer.backend megatron, parity on and a "
                             f"dense model (the parity attention takes the packed layout); got "
                             f"{self.config.backend}, parity {parity}, {self.spec.arch}")
        tp_size = self.config.tensor_parallel_size
        if self.config.deterministic_layout and not isinstance(self.spec, KimiSpec):
            try:
                check_ordered_vocab(self.spec, tp_size)
            except ValueError as e:
                raise ValueError(f"trainer.deterministic_layout: {e}") from None

    def _check_configs(self) -> None:
        if self.config.tensor_parallel_size > 1 and not self.lora_config.enabled:
            raise ValueError(f"trainer.tensor_parallel_size {self.config.tensor_parallel_size} needs "
                            "lora.enabled: at TP > 1 the trainable parameters are the replicated "
                            "adapters (a full fine-tune would shard them)")
        dp = self.config.data_parallel_size
        if dp > 1 and not self.config.deterministic_layout:
            raise ValueError(f"trainer.data_parallel_size {dp} needs trainer.deterministic_layout: "
                             "true (the ordered gradient reduction is the only one built)")
        if self.config.deterministic_layout and self.config.backend != "megatron":
            raise ValueError(f"trainer.deterministic_layout needs trainer.backend megatron: "
                             f"{self.config.backend}'s reductions are not ordered by us")
        if self.algorithm.is_correction != "none" and self.parity:
            raise ValueError(f"algorithm.is_correction {self.algorithm.is_correction!r} needs "
                            "parity false (with parity there is no mismatch to correct)")

    @property
    def lora_scaling(self) -> float | None:
        """alpha / rank of the policy adapter, which the rollout model applies; None when full."""
        return self.lora_config.alpha / self.lora_config.rank if self.lora_config.enabled else None

    # --- scoring: the backend's forwards ---------------------------------------------------

    @abstractmethod
    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[Tensor]:
        """Current-policy log-probs of seq[start:], float32, of the sampled distribution
        (vLLM's processed log-probs), or of the raw softmax with `raw` (what vLLM's
        teacher-forced prompt log-probs are)."""

    @abstractmethod
    def ref_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """Reference-policy (the base, adapters off) log-probs of seq[start:], float32."""

    @abstractmethod
    def _policy_forward(self, mb: Micro) -> tuple[Tensor, Tensor]:
        """(log-probs [B, T] of the response tokens, logits [B, W - 1, V] (packed: [1, N - 1, V])
        of the sampled distribution), with grad."""

    @abstractmethod
    def _critic_forward(self, mb: Micro) -> Tensor:
        """Values [B, T] at the positions that score the response tokens."""

    @torch.no_grad()
    def values(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """Critic values V(seq[:start + t]) for each response token t, float32 [len - start]."""
        if self.value_head is None:
            raise ValueError("values() needs the critic, which only algorithm.name ppo has")
        return self._score_shares(self._values, sequences, starts)

    def _values(self, sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        out = []
        for rows in chunks(list(range(len(sequences))), self.config.micro_batch_size):
            mb = micro_batch(sequences, starts, rows, self.config.packed_sequences)
            v = self._critic_forward(mb)
            out += [v[j, :n].clone() for j, n in enumerate(mb.lengths)]
        return out

    def _score_shares(self, score: Callable[[list[list[int]], list[int]], list[Tensor]],
                      sequences: list[list[int]], starts: list[int]) -> list[Tensor]:
        """`score` over the data-parallel ranks: each scores its share of the sequences
        (rank_share) and the rows are gathered in rank order, a copy. With parity on, a row's
        scores do not depend on the rows beside it, so the bits are those of one rank scoring
        all of them."""
        rank, size = self._data_parallel()
        if size == 1:
            return score(sequences, starts)
        rows = list(range(len(sequences)))
        counts = [len(rank_share(rows, r, size)) for r in range(size)]
        mine = rank_share(rows, rank, size)
        local = score([sequences[i] for i in mine], [starts[i] for i in mine]) if mine else []
        lengths = [len(seq) - start for seq, start in zip(sequences, starts, strict=True)]
        gathered = self._gather_rows(pad(local, max(lengths)), counts)
        return [gathered[i, :n].clone() for i, n in enumerate(lengths)]

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
        masks = batch.masks if batch.masks is not None else [torch.ones(t.numel()) for t in old_list]
        mask = pad([m.float() for m in masks], width)
        old = pad(old_list, width)
        ref = pad(self.ref_logprobs(seqs, starts), width) if algo.kl_coef > 0 else None
        old_values = pad(self.values(seqs, starts), width) if self.value_head is not None else None
        with self._update_threads():
            return self._update(batch, old, ref, old_values, mask)

    def _update(self, batch: Batch, old: Tensor, ref: Tensor | None, old_values: Tensor | None,
                mask: Tensor) -> dict[str, float]:
        """train_step after the scoring: the advantages and the optimizer steps."""
        algo, width = self.algorithm, mask.shape[1]
        advantages, returns = self._advantages(batch, old, ref, old_values, mask)

        stats = {"ref/kl": 0.0}
        if ref is not None:
            stats["ref/kl"] = masked_mean(kl_estimate(old, ref, algo.kl_estimator), mask).item()
        is_weights = None
        if not self.parity and algo.is_correction != "none":
            rollout = pad([t.float() for t in batch.rollout_logprobs], width)
            is_weights, is_stats = importance_weights(old, rollout, mask, algo.is_correction, algo.is_cap)
            stats.update({f"is/{k.removeprefix('is_')}": v for k, v in is_stats.items()})
        tensors = dict(old=old, mask=mask, advantages=advantages, ref=ref, is_weights=is_weights,
                       old_values=old_values, returns=returns)

        totals: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(algo.ppo_epochs):
            perm = torch.randperm(len(batch.sequences), generator=self.generator)
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

    def _update_threads(self) -> contextlib.AbstractContextManager:
        """trainer.deterministic_layout on the CPU: the update runs on one thread. Its backward
        and its reductions (advantage whitening, gradient norms) are plain torch, whose CPU
        kernels split sums by the thread count, and a rank's share of the cores depends on the
        layout (the parity kernels' forwards are thread-invariant; scoring keeps every core)."""
        return one_thread() if self.config.deterministic_layout else contextlib.nullcontext()

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
        if batch.masks is not None:
            self._check_masks(batch)
        if n < self.algorithm.minibatches:
            raise ValueError(f"batch: {n} sequences do not split into "
                             f"{self.algorithm.minibatches} minibatches")
        dp, per_minibatch = self.config.data_parallel_size, n // self.algorithm.minibatches
        if self.config.deterministic_layout and per_minibatch < dp:
            raise ValueError(f"batch: a minibatch of {per_minibatch} sequences does not give each of "
                             f"trainer.data_parallel_size {dp} ranks one")
        g = batch.group_size
        if n % g:
            raise ValueError(f"batch: {n} sequences do not split into groups of {g}")
        if batch.group_ids is not None:
            blocks = [batch.group_ids[i : i + g] for i in range(0, n, g)]
            one_id_each = all(len(set(b)) == 1 for b in blocks)
            if len(batch.group_ids) != n or not one_id_each or len({b[0] for b in blocks}) != len(blocks):
                raise ValueError(f"batch: group_ids must come in consecutive blocks of {g}")

    @staticmethod
    def _check_masks(batch: Batch) -> None:
        if len(batch.masks) != len(batch.sequences):
            raise ValueError(f"batch: {len(batch.masks)} masks for {len(batch.sequences)} sequences")
        for i, (m, seq, start) in enumerate(zip(batch.masks, batch.sequences, batch.starts, strict=True)):
            if m.numel() != len(seq) - start:
                raise ValueError(f"batch: sequence {i} has {len(seq) - start} response tokens but a "
                                 f"mask of {m.numel()}")
            if not bool(((m == 0) | (m == 1)).all()) or not bool(m.any()):
                raise ValueError(f"batch: sequence {i}'s mask must hold 0s and 1s, at least one 1")

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
        if self.config.deterministic_layout:
            return self._ordered_minibatch_step(batch, rows, t)
        total_tokens = t["mask"][rows].sum().clamp_min(1.0)
        acc: dict[str, float] = defaultdict(float)
        micro_batches = self._micro_batches(rows)
        for i, micro_rows in enumerate(micro_batches):
            loss, parts, weight = self._micro_loss(batch, micro_rows, t, total_tokens)
            self._backward(loss * weight, last=i == len(micro_batches) - 1)
            for k, v in parts.items():
                acc[k] += float(v) * weight.item()
        acc.update(self._optimizer_step())
        return acc

    def _ordered_minibatch_step(self, batch: Batch, rows: list[int], t: dict[str, Tensor | None]) -> dict[str, float]:
        """trainer.deterministic_layout: one fixed token block per sequence. Each data-parallel
        rank takes its contiguous share of `rows` (rank_share) and computes every sequence's
        gradient alone (its own forward and backward, so no other row shares a GEMM with it);
        the per-sequence gradients and stats are gathered to every rank in rank order, which
        is the minibatch's row order, and summed in that order (ordered_sum).
        The loss is normalised by the minibatch's token count, known before the split. So
        the summed gradient, hence the optimizer step on it, has the same bits at any
        data_parallel_size and micro_batch_size; only per-sequence forwards are its cost. The
        backward runs under parity.autograd.ordered_backward, whose fixed-order input gradients
        give every tensor-parallel rank the TP = 1 gradient (trainer.megatron.layers), so the
        tensor_parallel_size does not change the bits either."""
        total_tokens = t["mask"][rows].sum().clamp_min(1.0)
        rank, size = self._data_parallel()
        counts = [len(rank_share(rows, r, size)) for r in range(size)]
        grads, stats, keys = [], [], []
        for row in rank_share(rows, rank, size):
            with ordered_backward():  # gradients that the tensor-parallel split cannot change
                loss, parts, weight = self._micro_loss(batch, [row], t, total_tokens)
                grads.append(self._sample_gradient(loss * weight))
            stats.append(torch.tensor([float(v) * weight.item() for v in parts.values()], dtype=torch.float64))
            keys = list(parts)
        self._install_gradient(ordered_sum(self._gather_rows(torch.stack(grads), counts)))
        summed = ordered_sum(self._gather_rows(torch.stack(stats), counts))
        acc = dict(zip(keys, summed.tolist(), strict=True))
        for r in range(size):  # each rank's trained tokens (layout-dependent, unlike the rest)
            acc[f"train/rank_tokens/{r}"] = t["mask"][rank_share(rows, r, size)].sum().item()
        acc.update(self._optimizer_step())
        return acc

    def _micro_loss(
        self, batch: Batch, micro_rows: list[int], t: dict[str, Tensor | None], total_tokens: Tensor
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """(loss, its parts as stats, weight) of one micro-batch: the loss is the micro-batch's
        token mean; times `weight`, its share of the minibatch's tokens, the gradients summed
        over a minibatch's micro-batches are those of the minibatch's token mean."""
        algo = self.algorithm
        mb = micro_batch(batch.sequences, batch.starts, micro_rows, self.config.packed_sequences)
        width = mb.index.shape[1]
        m = {k: None if v is None else v[micro_rows, :width] for k, v in t.items()}
        mask = m["mask"]
        weight = mask.sum() / total_tokens
        logp, logits = self._policy_forward(mb)
        loss, pg_stats = policy_loss(logp, m["old"], m["advantages"], mask, algo.clip_eps,
                                     m["is_weights"])
        parts = {"ppo/policy_loss": loss.detach(), "ppo/clipfrac": pg_stats["clipfrac"],
                 "ppo/kl": pg_stats["approx_kl"]}
        # Response positions only: the prompt's entropy is neither trained nor reported.
        response_logits = mb.response(logits)
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
        return loss, parts, weight

    def _micro_batches(self, rows: list[int]) -> list[list[int]]:
        """The micro-batches of a minibatch that this trainer runs (a data-parallel backend
        runs its rank's share)."""
        return chunks(rows, self.config.micro_batch_size)

    @abstractmethod
    def _backward(self, loss: Tensor, last: bool) -> None:
        """Accumulate one micro-batch's gradients; `last`: the minibatch's last micro-batch."""

    @abstractmethod
    def _optimizer_step(self) -> dict[str, float]:
        """One optimizer step on the accumulated gradients; returns the grad-norm stats."""

    # --- trainer.deterministic_layout: a backend that keeps it supplies these ---------------

    def _data_parallel(self) -> tuple[int, int]:
        """(this rank's index, the rank count) among the data-parallel ranks."""
        return 0, 1

    def _sample_gradient(self, loss: Tensor) -> Tensor:
        """Backward of one sequence's loss alone: every trainable tensor's gradient, flat in
        fp32 in a fixed order, with the parameters' .grad cleared again."""
        raise NotImplementedError(f"trainer.deterministic_layout: the {self.config.backend} backend does not keep it")

    def _gather_rows(self, local: Tensor, counts: list[int]) -> Tensor:
        """Every data-parallel rank's rows of `local` ([counts[rank], ...]), in rank order."""
        if self._data_parallel()[1] == 1:
            return local
        raise NotImplementedError(f"trainer.data_parallel_size: the {self.config.backend} backend has no ranks")

    def _install_gradient(self, flat: Tensor) -> None:
        """Set the trainable tensors' gradients to `flat` (_sample_gradient's layout)."""
        raise NotImplementedError(f"trainer.deterministic_layout: the {self.config.backend} backend does not keep it")

    # --- weights out, state in and out --------------------------------------------------

    @abstractmethod
    def rollout_tensors(self) -> dict[str, Tensor]:
        """What the rollout engine must load, as a snapshot: the policy adapter in peft names
        and the model dtype (LoRA), or every weight in HF names and the model dtype (full)."""

    def _kind(self) -> dict[str, Any]:
        lora = dataclasses.asdict(self.lora_config) if self.lora_config.enabled else None
        return {"lora": lora, "algorithm": self.algorithm.name, "dtype": self.dtype}

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What resuming needs beyond the exports (trainable state, optimizer, RNG states)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict() of a trainer of the same kind."""
