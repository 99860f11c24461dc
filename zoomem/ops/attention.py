"""Scaled dot-product attention on CPU whose backward can itself be differentiated (for the sensitivity probe).

PyTorch's CPU flash-attention kernel (what ``F.scaled_dot_product_attention`` runs for timm's ViT, HF's ViT and
Llama on CPU) saves only ``q, k, v``, the output and the row log-sum-exp, but its backward has no derivative
formula: a double backward through it fails, so the sensitivity of the parameter gradient to each saved tensor
(:mod:`zoomem.compress.sensitivity`) could not be measured on those models. :class:`FlashAttentionCpu` runs the
same forward kernel and saves the same tensors in the same order as the stock autograd node (so the saved-tensor
store gives them the same keys), returns the stock backward kernel's gradients, and under ``create_graph`` gives
them the autograd history of the attention backward written with differentiable ops (``P = exp(S - lse)``,
``dS = P * (dO V^T - rowsum(dO * O))``). :func:`differentiable_attention` routes ``F.scaled_dot_product_attention``
calls that PyTorch would send to that kernel through it, for the duration of a ``with`` block.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .functional import _kernel_value

__all__ = ["FlashAttentionCpu", "differentiable_attention"]

_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION.value, what torch._fused_sdp_choice returns for it


class FlashAttentionCpu(torch.autograd.Function):
    """``(out, lse)`` of aten's ``_scaled_dot_product_flash_attention_for_cpu`` (dropout 0), saving, as the stock
    node does, ``[mask,] key, query, value, logsumexp, output``; twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        ctx.is_causal, ctx.scale, ctx.has_mask = is_causal, scale, mask is not None
        ctx.save_for_backward(*((mask,) if mask is not None else ()), k, q, v, lse, out)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        saved = ctx.saved_tensors
        mask, (k, q, v, lse, out) = (saved[0], saved[1:]) if ctx.has_mask else (None, saved)
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None
        if grad_lse is None:  # an ordinary backward: the stock kernel's gradients, bitwise
            with torch.no_grad():
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale)
            if not torch.is_grad_enabled():
                return gq, gk, gv, None, None, None
            # create_graph: the kernel's values, carrying the history of the same gradients in differentiable ops
            eq, ek, ev = _attention_grads(q, k, v, out, lse, mask, ctx.is_causal, ctx.scale, grad_out, None)
            return _kernel_value(gq, eq), _kernel_value(gk, ek), _kernel_value(gv, ev), None, None, None
        # a gradient reached the log-sum-exp too (a double backward through the saved lse)
        eq, ek, ev = _attention_grads(q, k, v, out, lse, mask, ctx.is_causal, ctx.scale, grad_out, grad_lse)
        return eq, ek, ev, None, None, None


def _attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                     grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """d(out, lse)/d(q, k, v) applied to ``(grad_out, grad_lse)``, with differentiable ops (the N x N scores)."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = (q @ k.transpose(-2, -1)) * s
    if mask is not None:
        scores = scores + mask
    if is_causal:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    ds = torch.zeros_like(p)
    gv = torch.zeros_like(v)
    if grad_out is not None:
        gv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    if grad_lse is not None:  # d lse / d scores = p
        ds = ds + p * grad_lse.unsqueeze(-1).to(p.dtype)
    return (ds @ k) * s, (ds.transpose(-2, -1) @ q) * s, gv


def _bool_to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention`` makes of a boolean mask before the kernel (``True``: attend)."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


class differentiable_attention(TorchFunctionMode):
    """Inside the block, ``F.scaled_dot_product_attention`` calls that PyTorch would run on the CPU flash kernel
    (CPU tensors needing a gradient, no dropout, no grouped-query expansion) run :class:`FlashAttentionCpu`:
    the same values and saved tensors, and a backward that a second backward can go through. Other calls run
    as they are.

    >>> with differentiable_attention():  # doctest: +SKIP
    ...     loss = model(x).sum()
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            routed = self._route(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)

    @staticmethod
    def _route(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        tensors = (query, key, value)
        if (enable_gqa or dropout_p != 0.0 or not all(isinstance(t, torch.Tensor) for t in tensors)
                or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)
                or any(t.device.type != "cpu" for t in tensors)
                or (attn_mask is not None and not isinstance(attn_mask, torch.Tensor))):
            return None
        if torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale) != _FLASH:
            return None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _bool_to_additive(attn_mask, query.dtype)
        out, _ = FlashAttentionCpu.apply(query, key, value, attn_mask, is_causal, scale)
        return out
