"""The RL math of kimi-rl, as pure tensor functions with no engine in sight: KL estimators,
masked statistics, GAE, the group baselines of GRPO and RLOO, the PPO clipped policy and value
losses, entropy, and the rollout-vs-trainer importance weights (TIS / MIS). Token-level tensors
are [B, T] with a float `mask` [B, T] that is 1 on response tokens and 0 elsewhere (prompt,
padding); every function here reads masked-out entries only through `torch.where`, so whatever
they hold (even NaN or inf) never reaches a result. Sequence-level tensors are [B] (or [N] for
grouped rollouts, where the G samples of one prompt are contiguous rows)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLKind = Literal["k1", "k2", "k3"]
ISMode = Literal["tis", "mis"]


# --- masked statistics ----------------------------------------------------------------------


def _where_mask(x: Tensor, mask: Tensor) -> Tensor:
    # `x * mask` is not enough: NaN * 0 = NaN, so garbage in padding would leak into every sum.
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x * mask over `dim` (all dims when None); masked-out entries are never read."""
    y = _where_mask(x, mask) * mask
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over the entries where mask > 0 (weighted by mask); 0 where the mask is empty."""
    # clamp: an all-masked batch (e.g. every response empty) gives 0, not NaN.
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp_min(1e-8)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of x over the masked entries (a scalar)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with mean and std over the masked entries only; masked-out entries -> 0.

    shift_mean=False keeps the mean (only rescales), the usual choice for rewards, where the
    sign of the mean carries information."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    y = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return _where_mask(y, mask)


# --- KL -------------------------------------------------------------------------------------


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled from the policy.

    With log r = ref_logp - logp (Schulman, "Approximating KL divergence"):
      k1 = -log r                  unbiased, high variance, can be negative
      k2 = 0.5 (log r)^2           biased, low variance, >= 0
      k3 = exp(log r) - 1 - log r  unbiased, low variance, >= 0
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        # expm1 instead of exp(.) - 1: for |log r| ~ 1e-8 the latter cancels to a tiny negative
        # number, and k3 must stay >= 0.
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


# --- advantages -----------------------------------------------------------------------------


def sequence_reward_to_tokens(seq_rewards: Tensor, mask: Tensor) -> Tensor:
    """[B] rewards -> [B, T] token rewards: each sequence's reward on its last masked token.

    Rows with an empty mask get no reward anywhere (there is no token to carry it)."""
    B, T = mask.shape
    on = mask > 0
    # Index of the last True per row: flip, argmax finds the first True of the flipped row.
    last = (T - 1) - on.flip(-1).int().argmax(-1)
    out = torch.zeros(B, T, dtype=seq_rewards.dtype, device=seq_rewards.device)
    out.scatter_(1, last[:, None], seq_rewards[:, None])
    return torch.where(on.any(-1, keepdim=True), out, torch.zeros_like(out))


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the masked tokens of each row.

    rewards, values, mask: [B, T]. The "next" token of a response token is the next *masked*
    position in its row (not t + 1), so a ragged or gappy mask is handled; after the last
    response token the bootstrap value is 0 (the episode ended). Returns (advantages, returns),
    both [B, T] and 0 where mask == 0, with returns = advantages + values.

      delta_t = r_t + gamma * V_next - V_t
      A_t     = delta_t + gamma * lam * A_next
    """
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    # T is a few hundred at most, so a plain backward loop is fast enough and easy to check.
    for t in reversed(range(T)):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(on, adv, torch.zeros_like(adv))
        # Off-mask positions pass the carry through untouched: they are not part of the episode.
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv, next_adv)
    returns = _where_mask(advantages + values, mask)
    return advantages, returns


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps), per group of `group_size` contiguous rows.

    The std is the population std (divide by G): with G = 1, or a group whose samples all got
    the same reward, the advantage is exactly 0 instead of NaN, so such groups simply carry no
    signal. Returns [N]; broadcast over tokens with `adv[:, None]`."""
    g = _groups(rewards, group_size)
    adv = (g - g.mean(-1, keepdim=True)) / (g.std(-1, correction=0, keepdim=True) + eps)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: r_i minus the mean reward of the other G - 1 samples of its group. Returns [N].

    The leave-one-out baseline does not depend on r_i, so the estimator stays unbiased; the
    advantages of a group sum to 0."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2 (the baseline is the mean of the others)")
    g = _groups(rewards, group_size)
    others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return (g - others).reshape(-1)


# --- losses ---------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, averaged over the masked tokens.

    logp: [B, T] log-probs of the sampled tokens under the policy being trained (with grad);
    old_logp: [B, T] the same under the policy that the advantages were computed for;
    advantages: [B, T], or [B] for sequence-level advantages (GRPO / RLOO), broadcast over T.
    is_weights: optional detached [B, T] per-token weights (TIS / MIS, see importance_weights)
    that multiply the per-token loss.

      ratio = exp(logp - old_logp)
      loss  = mean_t max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))

    stats: clipfrac (share of masked tokens where the clipped term is the active one, i.e. the
    gradient is zero) and approx_kl (mean k3 estimate of KL(old || new)), as floats."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.detach()
    old_logp = old_logp.detach()
    log_ratio = _where_mask(logp - old_logp, mask)  # 0 on padding: no exp overflow there
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        # Strictly greater: at ratio == 1 +- eps both terms are equal and nothing is clipped yet.
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = masked_mean(kl_estimate(old_logp, logp.detach(), "k3"), mask)
    return loss, {"clipfrac": clipfrac.item(), "approx_kl": approx_kl.item()}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * mean_t max((V - R)^2, (V_clip - R)^2), where V_clip keeps V
    within clip_eps of the value at rollout time, so one update cannot move it far.

    stats: vf_clipfrac (share of masked tokens where the clipped term is the active one)."""
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    unclipped = (values - returns).square()
    clipped = (v_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        vf_clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, {"vf_clipfrac": vf_clipfrac.item()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...], computed in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    # p log p -> 0 as p -> 0. -inf logits (tokens outside a top-k / top-p set) have p = 0 and
    # log p = -inf: zero their log p before the product, so neither the value (0 * -inf) nor
    # the gradient (d(p log p)/dp = log p) is NaN.
    finite = logp.masked_fill(torch.isneginf(logp), 0.0)
    return -(logp.exp() * finite).sum(-1)


# --- rollout / trainer mismatch ---------------------------------------------------------------


@torch.no_grad()
def importance_weights(
    train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: ISMode, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights correcting for tokens sampled by the rollout engine but trained on by
    the trainer, whose log-probs can differ (kernels, reduction order, precision).

    ratio = exp(train_logp - rollout_logp); token-level
      tis (truncated IS): w = min(ratio, cap)
      mis (masked IS):    w = ratio if ratio <= cap else 0 (the token is dropped)
    Weights are detached and 0 where mask == 0. stats: is_ratio_mean, is_ratio_max and
    is_capped_frac (share of masked tokens with ratio > cap).

    Only needed when log-prob parity is off: with parity on, the rollout engine returns log-probs
    bit-identical to the trainer's, so the ratio is exactly exp(0) = 1, every weight is 1, and
    the correction would be a no-op that costs a pass over the batch."""
    ratio = torch.exp(_where_mask(train_logp - rollout_logp, mask))
    over = ratio > cap
    if mode == "tis":
        w = ratio.clamp(max=cap)
    elif mode == "mis":
        w = torch.where(over, torch.zeros_like(ratio), ratio)
    else:
        raise ValueError(f"unknown importance-weight mode {mode!r}; expected 'tis' or 'mis'")
    stats = {
        "is_ratio_mean": masked_mean(ratio, mask).item(),
        "is_ratio_max": (_where_mask(ratio, mask).max().item() if mask.numel() else 0.0),
        "is_capped_frac": masked_mean(over.float(), mask).item(),
    }
    return _where_mask(w, mask), stats
