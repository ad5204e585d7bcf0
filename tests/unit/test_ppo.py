"""rl/ppo.py against hand-computed cases and reference loops; every function also gets a
"garbage in masked-out entries changes nothing" check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.ppo import (
    entropy_from_logits,
    gae,
    grpo_advantages,
    importance_weights,
    kl_estimate,
    masked_mean,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    sequence_reward_to_tokens,
    value_loss,
)

T = torch.tensor
NAN = float("nan")


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol)


def garbage_like(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """x with every masked-out entry replaced by `value`."""
    return torch.where(mask > 0, x, torch.full_like(x, value))


# A ragged mask: prompt tokens in front, padding behind, one row with a gap, one empty row.
MASK = T([[0, 1, 1, 1, 0, 0],
          [0, 0, 1, 1, 1, 1],
          [1, 0, 1, 0, 1, 0],
          [0, 0, 0, 0, 0, 0]], dtype=torch.float32)


# --- KL ---------------------------------------------------------------------------------------


def test_kl_hand_values():
    logp, ref = T([0.0]), T([math.log(0.5)])  # log r = ln 0.5
    lr = math.log(0.5)
    assert close(kl_estimate(logp, ref, "k1"), [-lr])
    assert close(kl_estimate(logp, ref, "k2"), [0.5 * lr * lr])
    assert close(kl_estimate(logp, ref, "k3"), [0.5 - 1 - lr])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_zero_when_equal(kind):
    x = torch.randn(3, 5)
    assert torch.equal(kl_estimate(x, x.clone(), kind), torch.zeros(3, 5))


def test_kl_bad_kind():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(T([0.0]), T([0.0]), "k4")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=20))
def test_k3_and_k2_nonnegative(pairs):
    logp, ref = T([p for p, _ in pairs]), T([r for _, r in pairs])
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()


def test_k3_nonnegative_for_tiny_differences():
    # Where exp(x) - 1 - x would cancel to a negative number.
    logp = T([1e-8, -1e-8, 3e-7, -2e-6, 1e-12])
    assert (kl_estimate(logp, torch.zeros(5), "k3") >= 0).all()


# --- masked statistics ------------------------------------------------------------------------


def test_masked_mean_and_garbage():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = T([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert close(masked_mean(x, m), (1 + 2 + 6) / 3)
    assert close(masked_mean(x, m, dim=1), [1.5, 6.0])
    assert close(masked_mean(garbage_like(x, m, NAN), m), (1 + 2 + 6) / 3)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0  # empty mask: 0, not NaN


def test_masked_whiten():
    x = torch.randn(4, 6) * 3 + 5
    w = masked_whiten(x, MASK)
    on = MASK > 0
    assert close(w[on].mean(), 0.0, 1e-5)
    assert close(w[on].var(correction=0), 1.0, 1e-4)
    assert (w[~on] == 0).all()
    assert torch.equal(masked_whiten(garbage_like(x, MASK, float("inf")), MASK), w)
    # shift_mean=False only rescales: the masked mean survives.
    mean = x[on].mean()
    assert close(masked_whiten(x, MASK, shift_mean=False)[on].mean(), mean, 1e-4)


# --- GAE --------------------------------------------------------------------------------------


def test_gae_hand_case():
    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.5, 0.5]]), torch.ones(1, 3)
    adv, ret = gae(r, v, m, gamma=0.5, lam=1.0)
    # delta2 = 1 - .5 = .5;  delta1 = .5*.5 - .5 = -.25 -> A1 = -.25 + .5*.5 = 0;  A0 = -.25
    assert close(adv, [[-0.25, 0.0, 0.5]])
    assert close(ret, [[0.25, 0.5, 1.0]])  # discounted returns 0.25*1, 0.5*1, 1


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    r, v = torch.randn(4, 6), torch.randn(4, 6)
    adv, ret = gae(r, v, MASK, gamma=1.0, lam=1.0)
    for b in range(4):
        idx = MASK[b].nonzero().flatten().tolist()
        for k, t in enumerate(idx):
            to_go = sum(r[b, s].item() for s in idx[k:])
            assert close(ret[b, t], to_go, 1e-5)
            assert close(adv[b, t], to_go - v[b, t].item(), 1e-5)
    assert (adv[MASK == 0] == 0).all() and (ret[MASK == 0] == 0).all()


def reference_gae(r, v, mask, gamma, lam):
    """Plain scalar GAE on each row's masked tokens, compacted."""
    adv = torch.zeros_like(r)
    for b in range(r.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v[b, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            delta = r[b, t].item() + gamma * next_v - v[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, torch.where(mask > 0, adv + v, torch.zeros_like(v))


def test_gae_matches_reference_loop_on_ragged_mask():
    torch.manual_seed(1)
    r, v = torch.randn(4, 6), torch.randn(4, 6)
    adv, ret = gae(r, v, MASK, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = reference_gae(r, v, MASK, 0.9, 0.8)
    assert close(adv, ref_adv, 1e-5) and close(ret, ref_ret, 1e-5)
    # Garbage in padding / prompt positions changes nothing.
    adv2, ret2 = gae(garbage_like(r, MASK, NAN), garbage_like(v, MASK, 1e9), MASK, 0.9, 0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_sequence_reward_to_tokens():
    out = sequence_reward_to_tokens(T([1.0, 2.0, 3.0, 4.0]), MASK)
    expect = torch.zeros(4, 6)
    expect[0, 3], expect[1, 5], expect[2, 4] = 1.0, 2.0, 3.0  # row 3 has no token: no reward
    assert torch.equal(out, expect)


# --- group baselines --------------------------------------------------------------------------


def test_grpo_hand_and_constant_group():
    adv = grpo_advantages(T([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0]), group_size=4)
    std = math.sqrt(0.75 * 0.25)  # population std of {1, 0, 0, 0}
    assert close(adv[:4], [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], 1e-4)
    assert torch.equal(adv[4:], torch.zeros(4))  # constant group: exactly 0
    assert torch.equal(grpo_advantages(T([3.0, -1.0]), group_size=1), torch.zeros(2))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.zeros(6), 1)


def test_rloo_hand():
    assert close(rloo_advantages(T([1.0, 0.0, 0.0]), 3), [1.0, -0.5, -0.5])


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.integers(1, 4), st.randoms(use_true_random=False))
def test_rloo_sums_to_zero_per_group(g, n_groups, rnd):
    r = T([rnd.uniform(-5, 5) for _ in range(g * n_groups)], dtype=torch.float64)
    adv = rloo_advantages(r, g).view(n_groups, g)
    assert close(adv.sum(-1), torch.zeros(n_groups), 1e-9)
    # Equivalent form: G / (G - 1) * (r - group mean).
    gm = r.view(n_groups, g)
    assert close(adv, g / (g - 1) * (gm - gm.mean(-1, keepdim=True)), 1e-9)


# --- policy loss ------------------------------------------------------------------------------


def _loss_and_grad(ratio: float, adv: float, eps: float = 0.2):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    loss, stats = policy_loss(logp, old, T([adv]), torch.ones(1, 1), eps)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_policy_loss_unclipped_value():
    loss, grad, stats = _loss_and_grad(1.0, 2.0)
    assert close(loss, -2.0) and close(grad, -2.0)  # d(-A r)/dlogp = -A r
    assert stats == {"clipfrac": 0.0, "approx_kl": 0.0}


@pytest.mark.parametrize("adv,inside,outside", [(1.0, 1.2 - 1e-4, 1.2 + 1e-4),
                                                (-1.0, 0.8 + 1e-4, 0.8 - 1e-4)])
def test_clipping_kicks_in_at_one_plus_minus_eps(adv, inside, outside):
    _, grad_in, st_in = _loss_and_grad(inside, adv)
    _, grad_out, st_out = _loss_and_grad(outside, adv)
    assert grad_in != 0 and st_in["clipfrac"] == 0.0
    assert grad_out == 0 and st_out["clipfrac"] == 1.0
    # Moving the other way is never clipped (the pessimistic bound keeps the gradient).
    _, grad_other, st_other = _loss_and_grad(2.0 - outside, adv)
    assert grad_other != 0 and st_other["clipfrac"] == 0.0


def test_clip_exactly_at_boundary_is_not_clipped():
    # eps = 0 puts the boundary exactly at ratio = exp(0) = 1: both terms are equal.
    _, grad, stats = _loss_and_grad(1.0, 1.0, eps=0.0)
    assert stats["clipfrac"] == 0.0 and close(grad, -1.0)


def test_clipfrac_counts_and_ignores_masked():
    ratios = T([[1.5, 1.0, 0.5, 1.1, 9.0]])
    adv = T([[1.0, 1.0, -1.0, 1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the 9.0 would be clipped but is masked
    _, stats = policy_loss(ratios.log(), torch.zeros(1, 5), adv, mask, 0.2)
    assert stats["clipfrac"] == 0.5  # 1.5 with A > 0 and 0.5 with A < 0
    k3 = [r - 1 - math.log(r) for r in (1.5, 1.0, 0.5, 1.1)]
    assert close(stats["approx_kl"], sum(k3) / 4, 1e-6)


def test_policy_loss_broadcast_and_is_weights():
    torch.manual_seed(2)
    logp, old = torch.randn(4, 6), torch.randn(4, 6)
    adv = torch.randn(4)
    a, _ = policy_loss(logp, old, adv, MASK, 0.2)
    b, _ = policy_loss(logp, old, adv[:, None].expand(4, 6), MASK, 0.2)
    assert torch.equal(a, b)
    half, _ = policy_loss(logp, old, adv, MASK, 0.2, is_weights=torch.full((4, 6), 0.5))
    assert close(half, 0.5 * a)


def test_policy_loss_ignores_masked_garbage():
    torch.manual_seed(3)
    logp, old, adv = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    w = torch.rand(4, 6)

    def run(logp, old, adv, w):
        logp = logp.clone().requires_grad_(True)
        loss, stats = policy_loss(logp, old, adv, MASK, 0.2, is_weights=w)
        loss.backward()
        return loss, stats, logp.grad

    l1, s1, g1 = run(logp, old, adv, w)
    l2, s2, g2 = run(*(garbage_like(x, MASK, NAN) for x in (logp, old, adv, w)))
    assert torch.equal(l1, l2) and s1 == s2 and torch.equal(g1, g2)
    assert (g1[MASK == 0] == 0).all()


# --- value loss -------------------------------------------------------------------------------


def test_value_loss_hand():
    old, ret, m = T([[1.0, 1.0]]), T([[2.0, 2.0]]), torch.ones(1, 2)
    # 1.5 moves 0.5 > eps from old: clipped to 1.2, (1.2 - 2)^2 = .64 > (1.5 - 2)^2 = .25.
    # 1.1 stays within eps: both terms are (1.1 - 2)^2 = .81.
    loss, stats = value_loss(T([[1.5, 1.1]]), old, ret, m, 0.2)
    assert close(loss, 0.5 * (0.64 + 0.81) / 2)
    assert stats["vf_clipfrac"] == 0.5
    # Masked garbage changes nothing.
    m2 = T([[1.0, 0.0]])
    a, _ = value_loss(T([[1.5, 1.1]]), old, ret, m2, 0.2)
    b, _ = value_loss(T([[1.5, NAN]]), T([[1.0, NAN]]), T([[2.0, NAN]]), m2, 0.2)
    assert close(a, 0.32) and torch.equal(a, b)


# --- entropy ----------------------------------------------------------------------------------


def test_entropy():
    assert close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    peaked = T([[0.0, float("-inf"), float("-inf")]])
    assert entropy_from_logits(peaked).item() == 0.0  # -inf logits: 0, not NaN
    logits = torch.randn(5, 11)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert close(entropy_from_logits(logits), ref, 1e-5)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_entropy_gradient_with_masked_tokens():
    """Top-k / top-p leave -inf logits: the entropy over the kept tokens, and a finite gradient
    (0 for the masked ones), as for the kept tokens alone."""
    x = torch.randn(3, 6, requires_grad=True)
    keep = torch.tensor([True, False, True, True, False, True])
    masked = x.masked_fill(~keep, float("-inf"))
    entropy_from_logits(masked).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, ~keep] == 0).all()
    y = x.detach()[:, keep].requires_grad_()
    entropy_from_logits(y).sum().backward()
    assert close(x.grad[:, keep], y.grad, 1e-6)
    assert close(entropy_from_logits(masked), entropy_from_logits(y), 1e-6)


# --- importance weights -----------------------------------------------------------------------


def test_tis_caps_and_mis_zeroes():
    rollout = torch.zeros(1, 4)
    train = T([[0.5, 1.0, 3.0, 50.0]]).log()
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    w, stats = importance_weights(train, rollout, mask, "tis", cap=2.0)
    assert close(w, [[0.5, 1.0, 2.0, 0.0]])
    assert close(stats["is_capped_frac"], 1 / 3) and close(stats["is_ratio_max"], 3.0, 1e-5)
    assert close(stats["is_ratio_mean"], 4.5 / 3, 1e-6)
    w, _ = importance_weights(train, rollout, mask, "mis", cap=2.0)
    assert close(w, [[0.5, 1.0, 0.0, 0.0]])
    # A ratio exactly at the cap (exp(0) = 1 = cap) is kept by MIS.
    w, _ = importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "mis", 1.0)
    assert w.item() == 1.0


def test_is_weights_are_one_under_parity_and_ignore_garbage():
    logp = torch.randn(4, 6)
    for mode in ("tis", "mis"):
        w, stats = importance_weights(logp, logp.clone(), MASK, mode, cap=2.0)
        assert torch.equal(w, MASK) and stats["is_capped_frac"] == 0.0
        w2, _ = importance_weights(garbage_like(logp, MASK, NAN), logp, MASK, mode, cap=2.0)
        assert torch.equal(w2, w)
    with pytest.raises(ValueError, match="tis"):
        importance_weights(logp, logp, MASK, "bogus", cap=2.0)  # type: ignore[arg-type]
