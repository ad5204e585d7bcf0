"""Autograd Functions shared by the CPU kernels (parity/kernels.py) and the CUDA kernels
(parity/cuda.py): an invariant forward, plain (correct, not bit-stable) gradients. In a module
of their own so that neither kernel module imports the other for them.

`ordered_backward()` switches the gradients that a tensor-parallel split would change to a
fixed order (the trainer's `deterministic_layout`): a linear's input gradient through a
caller's fixed-order product (`InvariantLinear`'s `input_grad_fn`), its weight gradient
through one over the tokens in order (`weight_grad_fn`), attention's through compiled
per-head products (`RecomputeAttention`'s `ordered_fn`), so that none depends on how many
heads or output features a rank holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ordered = False


@contextlib.contextmanager
def ordered_backward() -> Iterator[None]:
    """Inside: forwards record that their backward must not depend on the tensor-parallel split
    (see the module docstring)."""
    global _ordered
    previous, _ordered = _ordered, True
    try:
        yield
    finally:
        _ordered = previous


def ordered() -> bool:
    """Whether a forward runs inside ordered_backward()."""
    return _ordered


class InvariantLinear(torch.autograd.Function):
    """A linear whose forward is an invariant kernel (`forward_fn(x, weight)`) and whose
    gradients are plain GEMMs (they need only be correct), or the caller's fixed-order
    products: `input_grad_fn(grad_out, weight)` for the input, `weight_grad_fn(grad_out, x)`
    for the weight. Shared by the compiled CPU GEMM (parity/kernels.py) and the CUDA kernel in
    parity/cuda.py."""

    @staticmethod
    def forward(ctx, x, weight, forward_fn, input_grad_fn=None, weight_grad_fn=None):
        ctx.save_for_backward(x, weight)
        ctx.input_grad_fn, ctx.weight_grad_fn = input_grad_fn, weight_grad_fn
        return forward_fn(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight if ctx.input_grad_fn is None else ctx.input_grad_fn(grad_out, weight)
        grad_w = None
        if ctx.needs_input_grad[1] and ctx.weight_grad_fn is not None:
            grad_w = ctx.weight_grad_fn(grad_out, x)
        elif ctx.needs_input_grad[1]:
            grad_w = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)  # flatten: K may be 0
        return grad_x, grad_w, None, None, None


class RecomputeAttention(torch.autograd.Function):
    """Attention whose forward is an invariant kernel and whose gradients come from a dense
    differentiable reference, recomputed in backward (gradients need only be correct), or,
    inside ordered_backward, from `ordered_fn` (a fixed-order backward; None: the reference).
    Shared by the CPU kernel here and the CUDA kernel in parity/cuda.py."""

    @staticmethod
    def forward(ctx, q, k, v, q_seq, q_pos, scale, forward_fn, reference_fn, ordered_fn):
        ctx.save_for_backward(q, k, v, q_seq, q_pos)
        ctx.scale, ctx.reference_fn = scale, reference_fn
        ctx.ordered_fn = ordered_fn if _ordered else None
        with torch.no_grad():
            return forward_fn(q, k, v, q_seq, q_pos, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_seq, q_pos = ctx.saved_tensors
        if ctx.ordered_fn is not None:
            grads = ctx.ordered_fn(q, k, v, q_seq, q_pos, ctx.scale, grad_out)
            return (*(g if t.requires_grad else None for g, t in zip(grads, (q, k, v), strict=True)), *([None] * 6))
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = ctx.reference_fn(*inputs, q_seq, q_pos, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), *([None] * 6))


class RecomputeGrad(torch.autograd.Function):
    """`forward_fn(x)` (an invariant kernel) with the gradient of `reference_fn(x)` (the plain
    torch op with the same math), recomputed in backward (gradients need only be correct), or,
    given `derivative_fn`, grad_out * derivative_fn(x)."""

    @staticmethod
    def forward(ctx, x, forward_fn, reference_fn, derivative_fn=None):
        ctx.save_for_backward(x)
        ctx.reference_fn, ctx.derivative_fn = reference_fn, derivative_fn
        return forward_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        if ctx.derivative_fn is not None:
            return grad_out * ctx.derivative_fn(x), None, None, None
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(ctx.reference_fn(xd), xd, grad_out)
        return grad, None, None, None


class InvariantBmm(torch.autograd.Function):
    """Batched products a [..., M, K] @ b [..., K, N] whose forward is an invariant kernel
    (`forward_fn(a, b)`) and whose gradients are plain batched matmuls."""

    @staticmethod
    def forward(ctx, a, b, forward_fn):
        ctx.save_for_backward(a, b)
        return forward_fn(a, b)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        grad_a = (grad_out @ b.mT.to(grad_out.dtype)).to(a.dtype) if ctx.needs_input_grad[0] else None
        grad_b = (a.mT.to(grad_out.dtype) @ grad_out).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None
