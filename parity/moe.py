"""MoE math shared by every MoE architecture and both engines: the stable top-k, the two
router kinds and the one expert dispatch.

- Kimi (parity/kimi.py `route`): sigmoid scores, an optional correction bias for the choice,
  grouped top-k, routed_scaling_factor.
- Qwen3-MoE (`softmax_route`): softmax over all experts, top-k, optional renormalisation
  (transformers' Qwen3MoeTopKRouter).

Both route with an fp32 router (`kernels.linear` on fp32 copies) and choose with a stable
descending sort (ties: lower expert first), so a token's choice depends on its own row only.
`dispatch` runs each expert on the rows routed to it through the tiled linear (a row's result
does not depend on how many rows share the call) and adds the chosen experts' outputs in slot
order in fp32: a token's output bits depend on its own row alone, at any batch size.

Experts passed in follow the checkpoint's HF module names with [gate; up] fused: each has
`gate_up_proj` and `down_proj` (callables), as both engines hold them.
"""

from __future__ import annotations

import torch

from parity import kernels
from parity.kernels import exp, row_sum


def swiglu(m, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP (an expert, a shared expert or a dense layer's MLP): down(silu(gate) * up)."""
    return m.down_proj(kernels.silu_and_mul(m.gate_up_proj(x)))


def top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, best first; ties: lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def router_logits(router_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[N, E] fp32 router logits: the router in fp32 whatever the model dtype."""
    return kernels.linear(h.float(), router_weight.float())


def softmax_route(
    router_weight: torch.Tensor, h: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64 in choice order, weights [N, k] fp32): Qwen3-MoE routing.

    softmax over all experts of the fp32 logits (max-shifted, our exp, the fixed-order row sum),
    the top k of the probabilities, renormalised to sum 1 when `renormalize` (norm_topk_prob)."""
    logits = router_logits(router_weight, h)
    shifted = exp(logits - logits.max(dim=-1, keepdim=True).values)
    probs = shifted / row_sum(shifted).unsqueeze(-1)
    experts = top(probs, k)
    weights = probs.gather(1, experts)
    if renormalize:
        weights = weights / row_sum(weights).unsqueeze(-1)
    return experts, weights


def dispatch(
    experts_of, num_experts: int, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    shared=None,
) -> torch.Tensor:
    """sum over slots of weights[:, slot] * expert(h) (+ the shared expert's output), [N, hidden]
    in h's dtype. `experts_of[e]`: expert e; experts / weights [N, k] from a router."""
    k = experts.shape[1]
    routed = h.new_zeros(h.shape[0], k, h.shape[-1])
    for e in range(num_experts):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            routed = routed.index_put((token, slot), swiglu(experts_of[e], h[token]))
    acc = swiglu(shared, h).float() if shared is not None else h.new_zeros(h.shape, dtype=torch.float32)
    for slot in range(k):
        acc = acc + routed[:, slot].float() * weights[:, slot : slot + 1]
    return acc.to(h.dtype)
