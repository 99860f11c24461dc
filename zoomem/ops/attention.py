"""Scaled dot-product attention: a math path that keeps less for backward, and a CPU flash path whose backward can
itself be differentiated (for the sensitivity probe).

:class:`MathAttention` is PyTorch's math path (what ``F.scaled_dot_product_attention`` runs on CPU whenever
attention dropout is on) keeping ``q, k, v`` and a 1-bit dropout mask instead of three N x N tensors, with
bitwise the stock gradients; :class:`recompute_attention` routes SDPA calls through it inside a ``with`` block,
and the ``attention_recompute`` implementation (:mod:`zoomem.ops.impls`) puts that around attention layers.

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

from .functional import _aten_dropout, _dropout_from_mask, _fused_dropout_device, _kernel_value, stores_lossily
from .packbits import pack_bool, unpack_bool
from .routing import RoutingMode

__all__ = ["FlashAttentionCpu", "MathAttention", "attention_logsumexp", "differentiable_attention",
           "recompute_attention"]

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
        # the backward's probabilities are exp(q @ k.T * scale + mask - lse): the mask stays exact, and the
        # log-sum-exp comes back recomputed from q and k where either is stored lossily (zoomem.runtime.probe)
        m = int(mask is not None)
        ctx.exact_reads = (0, 4) if mask is not None else (3,)
        ctx.lse_of = (m + 1, m, 0 if mask is not None else None, m + 3)  # query, key, mask, lse in saved_tensors
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
    """d(out, lse)/d(q, k, v) applied to ``(grad_out, grad_lse)``, with differentiable ops (the N x N scores). The
    probabilities are those of the scores, normalised afresh (the log-sum-exp recomputed from ``q`` and ``k``, as
    a lossy store brings it back: :func:`attention_logsumexp`), so the derivatives the sensitivity probe takes with
    respect to the saved ``q`` and ``k`` include the normalisation's."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    heads, kv_heads = q.size(-3), k.size(-3)
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    scores = _masked_scores(q, k, mask, is_causal, s)
    fresh = torch.logsumexp(scores, -1)
    lse = torch.where(torch.isfinite(fresh), fresh, lse.to(fresh.dtype))  # fully masked rows: the kernel's value
    p = torch.exp(scores - lse.unsqueeze(-1))
    ds = torch.zeros_like(p)
    gv = torch.zeros_like(v)
    if grad_out is not None:
        gv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    if grad_lse is not None:  # d lse / d scores = p
        ds = ds + p * grad_lse.unsqueeze(-1).to(p.dtype)
    gk = (ds.transpose(-2, -1) @ q) * s
    if kv_heads != heads:  # summed over the query heads each key and value head served
        gk, gv = (g.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3) for g in (gk, gv))
    return (ds @ k) * s, gk, gv


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's key or value heads, each repeated for the query heads it serves."""
    return t if t.dim() < 3 or t.size(-3) == heads else t.repeat_interleave(heads // t.size(-3), -3)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                   scale: float, first_row: int = 0) -> torch.Tensor:
    """``q @ k.T * scale + mask`` as the fused kernels see them (``is_causal``: -inf above the diagonal);
    ``first_row``: ``q`` and ``mask`` are the rows from there on."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores + (_bool_to_additive(mask, scores.dtype) if mask.dtype == torch.bool else mask.to(scores.dtype))
    if is_causal:
        n, m = scores.shape[-2:]
        above = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1 + first_row)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def attention_logsumexp(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                        scale: float | None, like: torch.Tensor) -> torch.Tensor:
    """The row log-sum-exp of ``q @ k.T * scale + mask`` that a fused attention kernel saved as ``like``, computed
    again from (rounded) ``q`` and ``k``: with it the kernel's backward rebuilds probabilities that sum to one
    (a softmax of slightly moved scores), where the log-sum-exp of the exact ones would scale each row by
    ``exp`` of its error. Rows the mask removes entirely keep ``like``'s value. In fp32, a block of query rows at
    a time (scores of a quarter of ``q``'s size, at most ``2**22``: backward holds the dequantized q and k then)."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    q, k = q.float(), _expand_heads(k.float(), q.size(-3) if q.dim() >= 3 else 1)
    n, m = q.size(-2), k.size(-2)
    rows = max(1, min(1 << 22, q.numel() // 4) // max(1, m * math.prod(q.shape[:-2])))
    full = None if mask is None else mask.expand(*mask.shape[:-2], n, m)
    parts = [torch.logsumexp(_masked_scores(q[..., i:i + rows, :], k, None if full is None
                                            else full[..., i:i + rows, :], is_causal, s, i), -1)
             for i in range(0, n, rows)]
    fresh = torch.cat(parts, -1)
    return torch.where(torch.isfinite(fresh), fresh, like.float()).to(like.dtype)


def _bool_to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention`` makes of a boolean mask before the kernel (``True``: attend)."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


class differentiable_attention(RoutingMode):
    """Inside the block, ``F.scaled_dot_product_attention`` calls that PyTorch would run on the CPU flash kernel
    (CPU tensors needing a gradient, no dropout, no mask that needs a gradient; grouped-query attention too) run
    :class:`FlashAttentionCpu`:
    the same values and saved tensors, and a backward that a second backward can go through. Other calls run
    as they are.

    >>> with differentiable_attention():  # doctest: +SKIP
    ...     loss = model(x).sum()
    """

    target = staticmethod(F.scaled_dot_product_attention)

    def route(self, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        tensors = (query, key, value)
        if (dropout_p != 0.0 or not all(isinstance(t, torch.Tensor) for t in tensors)
                or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)
                or any(t.device.type != "cpu" for t in tensors)
                or (attn_mask is not None and not isinstance(attn_mask, torch.Tensor))
                or (attn_mask is not None and attn_mask.requires_grad)):  # a learned bias: its gradient is aten's
            return None
        if torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                   enable_gqa=enable_gqa) != _FLASH:
            return None
        if query.dim() < 3 or (key.size(-3) != query.size(-3) and not enable_gqa):
            return None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _bool_to_additive(attn_mask, query.dtype)
        out, _ = FlashAttentionCpu.apply(query, key, value, attn_mask, is_causal, scale)
        return out


# ----------------------------------------------------------------------------------------------------------------
# SDPA's math path keeping q, k, v and a 1-bit dropout mask, recomputing the N x N tensors in backward

_MATH = 0  # torch.nn.attention.SDPBackend.MATH.value
_EXACT_DTYPES = (torch.float32, torch.float64)
"""Where :func:`_math_attention` is aten's path op for op; in fp16/bf16 aten's CPU math path upcasts to fp32."""


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                    dropout_p: float, scale: float | None, fused: bool,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``_scaled_dot_product_attention_math`` as aten composes it (the same ops in the same order, so values and
    autograd's gradients are bitwise those of the stock path). A boolean ``mask`` or ``is_causal`` become the same
    additive 0 / -inf mask as there. Dropout draws its mask as aten does on this device, or, given ``keep`` (the
    mask of an earlier draw), rebuilds the very same multiplier from it. Returns ``(out, keep, softmax)``."""
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = _bool_to_additive(mask, q.dtype)
    scores = _scores(q, k, scale)
    if mask is not None:
        scores = scores + mask
    p = torch._safe_softmax(scores, -1)
    pd, keep = _dropout(p, dropout_p, fused, keep)
    return torch.matmul(pd, v), keep, p


def _scale_root(q: torch.Tensor, scale: float | None) -> float:
    """aten scales q and k each by the root of the softmax scale (``1 / sqrt(E)`` unless given)."""
    return math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    sf = _scale_root(q, scale)
    return torch.matmul(q * sf, k.transpose(-2, -1) * sf)


def _dropout(p: torch.Tensor, dropout_p: float, fused: bool,
             keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dropout_p <= 0.0:
        return p, keep
    if keep is None:
        return _aten_dropout(p, dropout_p, fused)
    return _dropout_from_mask(p, keep, dropout_p, fused), keep


class MathAttention(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` on its math path, returning ``(out, softmax)`` and saving less than the
    stock path (the scaled ``q`` and ``k``, the softmax, the dropout noise in the input's dtype on CPU and the
    dropped-out probabilities: three N x N tensors).

    - ``keep_softmax=False`` (exact storage): saves ``q, k, v`` (what the projections produced, usually held anyway)
      and a 1-bit dropout mask; backward runs the same forward ops again from them and differentiates them (one
      more ``q k^T`` and softmax).
    - ``keep_softmax=True`` (under zoomem's store, where saved tensors may be rounded): saves the softmax too, as
      the stock path does, so that every saved float is one the gradient reads linearly or through the softmax's
      own backward (``q`` and ``k`` reach it through ``exp(q k^T)`` in the other mode: rounding them would bias
      it); the dropout noise and the dropped-out probabilities are still not kept.

    Gradients are bitwise the stock path's (the same ops, differentiated by autograd); twice differentiable (the
    backward runs on the saved tensors' history under ``create_graph``)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, dropout_p, scale, keep_softmax):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        fused = _fused_dropout_device(q)
        out, keep, p = _math_attention(q, k, v, mask, is_causal, dropout_p, scale, fused)
        saved = [q, k, v]
        ctx.has_mask, ctx.keep_shape, ctx.keep_softmax = False, None, keep_softmax
        if keep_softmax:
            saved.append(p)
        elif mask is not None:
            ctx.has_mask = True
            saved.append(mask)
        if keep is not None:
            packed, ctx.keep_shape = pack_bool(keep)
            saved.append(packed)
        ctx.save_for_backward(*saved)
        ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.fused = is_causal, dropout_p, scale, fused
        # recomputing, q and k reach the gradient through exp(q k^T): rounding them is not a small perturbation of
        # the gradient (it biases the softmax), so a lossy store keeps them exact (zoomem.runtime.probe)
        ctx.exact_reads = () if keep_softmax else (0, 1)
        return out, p

    @staticmethod
    def backward(ctx, grad, grad_p):  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        q, k, v = saved[:3]
        keep = unpack_bool(saved[-1], ctx.keep_shape) if ctx.keep_shape is not None else None
        create = torch.is_grad_enabled()
        need = ctx.needs_input_grad
        result: list[torch.Tensor | None] = [None] * 8
        if grad is None and grad_p is None:
            return tuple(result)
        if not create and grad_p is None and not need[3]:  # an ordinary backward: stock's kernels, in place
            if ctx.keep_softmax:
                p = saved[3]
            else:
                mask = saved[3] if ctx.has_mask else None
                with torch.no_grad():
                    _, _, p = _math_attention(q, k, v, mask, ctx.is_causal, 0.0, ctx.scale, ctx.fused)
            del saved
            gq, gk, gv = _attention_backward(q, k, v, p, keep, grad, ctx.dropout_p, ctx.scale, ctx.fused, need[:3])
            return gq, gk, gv, None, None, None, None, None

        def leaf(t: torch.Tensor, needed: bool) -> torch.Tensor:  # the recomputation's graph dies with this call
            return t if create else t.detach().requires_grad_(needed and t.is_floating_point())

        if ctx.keep_softmax:
            p = saved[3]
            qi, ki, vi, pi = leaf(q, need[0]), leaf(k, need[1]), leaf(v, need[2]), leaf(p, True)
            with torch.enable_grad():
                out, _ = _dropout(pi, ctx.dropout_p, ctx.fused, keep)
                out = torch.matmul(out, vi)
            wanted = [pi] + ([vi] if need[2] else [])
            grads = torch.autograd.grad(out, wanted, grad, create_graph=create, allow_unused=True) \
                if grad is not None else (None, None)
            gp = grads[0] if grad_p is None else grad_p if grads[0] is None else grads[0] + grad_p
            if need[2]:
                result[2] = grads[1]
            if gp is not None and (need[0] or need[1]):
                gs = torch._softmax_backward_data(gp, p, -1, p.dtype)
                with torch.enable_grad():
                    scores = _scores(qi, ki, ctx.scale)
                inputs = [t for t, n in ((qi, need[0]), (ki, need[1])) if n]
                gqk = list(torch.autograd.grad(scores, inputs, gs, create_graph=create, allow_unused=True))
                if need[0]:
                    result[0] = gqk.pop(0)
                if need[1]:
                    result[1] = gqk.pop(0)
            return tuple(result)
        mask = saved[3] if ctx.has_mask else None
        args = [leaf(t, n) if t is not None else None for t, n in zip((q, k, v, mask), need[:4])]
        wanted = [i for i, t in enumerate(args) if t is not None and need[i]]
        if not wanted:
            return tuple(result)
        with torch.enable_grad():
            out, _, p = _math_attention(*args, ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.fused, keep)
        outs, grads_in = zip(*[(o, g) for o, g in ((out, grad), (p, grad_p)) if g is not None])
        grads = torch.autograd.grad(outs, [args[i] for i in wanted], grads_in, create_graph=create,
                                    allow_unused=True)
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)


def _attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                        keep: torch.Tensor | None, grad: torch.Tensor, dropout_p: float, scale: float | None,
                        fused: bool, need: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """The gradients autograd computes through :func:`_math_attention` given its softmax ``p``, with its kernels
    on the same operands (bitwise), holding at most three N x N tensors at a time (autograd's graph of the
    recomputation would hold the dropout noise and the dropped-out probabilities beside them)."""
    pd, _ = _dropout(p, dropout_p, fused, keep)
    gv = torch.matmul(pd.transpose(-2, -1), grad) if need[2] else None
    del pd
    gq = gk = None
    if need[0] or need[1]:
        gp = torch.matmul(grad, v.transpose(-2, -1))
        gp, _ = _dropout(gp, dropout_p, fused, keep)
        gs = torch._softmax_backward_data(gp, p, -1, p.dtype)
        del gp
        # matmul(q * sf, k^T * sf)'s backward as autograd runs it: bmm on the 3-D operands matmul made
        sf = _scale_root(q, scale)
        gs3 = gs.reshape(-1, *gs.shape[-2:])
        if need[0]:
            ks = k.transpose(-2, -1) * sf
            gq = gs3.bmm(ks.reshape(-1, *ks.shape[-2:]).transpose(1, 2)).view(q.shape) * sf
        if need[1]:
            qs = q * sf
            gk = (qs.reshape(-1, *qs.shape[-2:]).transpose(1, 2).bmm(gs3).view(k.transpose(-2, -1).shape)
                  * sf).transpose(-2, -1)
    return gq, gk, gv


class recompute_attention(RoutingMode):
    """Inside the block, ``F.scaled_dot_product_attention`` calls that PyTorch would run on its math path (on CPU:
    whenever attention dropout is on, as in training BERT or GPT-2) run :class:`MathAttention`: the same values
    and gradients, without keeping the three N x N tensors between forward and backward. Calls that go to a
    fused kernel (flash / memory-efficient attention, which keep only ``q, k, v``, the output and the row
    log-sum-exp already), in half precision, under autocast, with grouped-query expansion, with a mask that needs a
    gradient (a learned bias) or without a gradient run as they are."""

    target = staticmethod(F.scaled_dot_product_attention)

    def route(self, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        tensors = (query, key, value)
        if (enable_gqa or not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in tensors)
                or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)
                or (attn_mask is not None and not isinstance(attn_mask, torch.Tensor))
                or (attn_mask is not None and attn_mask.requires_grad)  # a learned bias (Swin's relative positions)
                or (attn_mask is not None and is_causal) or query.dim() < 3
                or not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]  # no broadcast batch dimensions
                or any(t.dtype not in _EXACT_DTYPES for t in tensors)
                or torch.is_autocast_enabled(query.device.type)):
            return None
        if torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale) != _MATH:
            return None
        out, _ = MathAttention.apply(query, key, value, attn_mask, bool(is_causal), float(dropout_p), scale,
                                     stores_lossily())
        return out


def attention_forward(module: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``attention_recompute`` implementation: the module's own forward, its SDPA calls routed by
    :class:`recompute_attention`."""
    with recompute_attention():
        return original(*args, **kwargs)


def attention_applies(module: Any) -> bool:
    """A layer registered as ``kind="attention"`` (HF ``*Attention`` classes, timm's ``Attention``) that holds no
    other such layer (BERT's ``BertAttention`` wraps ``BertSelfAttention``, which gets the switch)."""
    from ..adapters.registry import layer_spec  # the layer registry is the one home of "which classes attend"

    def attends(m: Any) -> bool:
        spec = layer_spec(m)
        return spec is not None and spec.kind == "attention"

    return attends(module) and not any(attends(m) for m in module.modules() if m is not module)
