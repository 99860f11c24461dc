"""Cross-entropy over a vocabulary that keeps the logits, not the log-probabilities, for backward.

``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``: autograd keeps the log-probabilities (as large as the
logits: 98 MiB for GPT-2's 50,257 tokens at 512 positions in fp32) until backward, which then materialises two
more tensors of that size (``nll_loss``'s dense gradient and ``log_softmax``'s). An LM's logits are the model's
output and usually alive anyway. :class:`CrossEntropy` keeps them (and the targets) instead and computes the
gradient in one tensor, ``(softmax(logits) - onehot(target)) * scale``, in place: one logits-sized tensor less
between forward and backward and two less at the loss's backward. The loss is bitwise ``F.cross_entropy``'s (the
same ``log_softmax`` and ``nll_loss`` kernels); the gradient differs in the last bits (``softmax`` against
``exp(log_softmax)``): about 1e-7 relative in fp32.

:func:`route_cross_entropy` sends ``F.cross_entropy`` calls inside a ``with`` block through it (class-index
targets, no class weights, no label smoothing, 2-D logits needing a gradient, no autocast; anything else runs as
it is). The ``cross_entropy_logits`` implementation (:mod:`zoomem.ops.impls`) puts it around an HF model's
``loss_function``, HF's own hook for the loss an LM head computes inside ``forward``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .routing import RoutingMode

__all__ = ["CrossEntropy", "route_cross_entropy", "cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for ``[N, C]`` logits and ``[N]``
    class indices, saving the logits and the targets; twice differentiable."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):  # type: ignore[override]
        loss = F.nll_loss(torch.log_softmax(logits, 1), target, ignore_index=ignore_index, reduction=reduction)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        ctx.save_for_backward(logits, target)
        # the logits reach the gradient through exp(): rounding them is not a small perturbation (zoomem.runtime.probe)
        ctx.exact_reads = (0,)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, target = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        valid = target != ctx.ignore_index
        safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device)).unsqueeze(1)
        if ctx.reduction == "none":
            scale = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)).unsqueeze(1)
        else:
            count = valid.sum().to(logits.dtype) if ctx.reduction == "mean" else None
            step = grad / count if count is not None else grad
            scale = torch.where(valid, step, torch.zeros((), dtype=step.dtype, device=step.device)).unsqueeze(1)
        scale = scale.to(logits.dtype)
        if torch.is_grad_enabled():  # create_graph: out-of-place, differentiable in logits and grad
            onehot = torch.zeros_like(logits).scatter(1, safe, 1.0)
            return (torch.softmax(logits, 1) - onehot) * scale, None, None, None
        g = torch.softmax(logits, 1)
        g.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=g.dtype))
        return g.mul_(scale), None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` keeping the logits instead of the log-probabilities (see the module docstring).

    >>> logits = torch.randn(6, 10, requires_grad=True)
    >>> cross_entropy(logits, torch.tensor([1, 2, -100, 4, 5, 6])).backward()
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    return CrossEntropy.apply(logits, target, int(ignore_index), reduction)


class route_cross_entropy(RoutingMode):
    """Inside the block, eligible ``F.cross_entropy`` calls run :func:`cross_entropy`; others run as they are."""

    target = staticmethod(F.cross_entropy)

    def route(self, input: Any, target: Any, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
              reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
        if (weight is not None or size_average is not None or reduce is not None or label_smoothing != 0.0
                or reduction not in _REDUCTIONS or not isinstance(input, torch.Tensor)
                or not isinstance(target, torch.Tensor) or input.dim() != 2 or target.dim() != 1
                or target.dtype != torch.long or input.dtype not in (torch.float32, torch.float64)
                or not input.requires_grad or not torch.is_grad_enabled()
                or torch.is_autocast_enabled(input.device.type)):
            return None
        return CrossEntropy.apply(input, target, int(ignore_index), reduction)


def routed_loss(module: Any, loss_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The ``cross_entropy_logits`` implementation: ``loss_function(*args, **kwargs)`` with its
    ``F.cross_entropy`` calls routed through :func:`cross_entropy`."""
    with route_cross_entropy():
        return loss_function(*args, **kwargs)
