"""Memory-efficient autograd Functions: the same forward, a smaller set of saved tensors.

Each function here computes exactly the forward of its stock counterpart (the same aten kernels, so the output is
bitwise identical) and saves less for backward:

==========================  ===============================================  ==================================
function                    saves (instead of)                               gradients vs stock
==========================  ===============================================  ==================================
relu / hardtanh (relu6) /   1-bit packed mask (the float output or input)    bitwise
threshold / leaky_relu
dropout                     1-bit packed mask (a float noise tensor on CPU,  bitwise; same RNG draws
                            a bool mask on CUDA)
batch_norm_act              its output (identity/leaky act) or its pre-act   reassociated: ~1e-6 rel. in fp32
                            output (relu) + per-channel 1/std (the input)
layer_norm                  its output + per-row 1/std (input, mean)         reassociated: ~1e-6 rel. in fp32
rms_norm (HF Llama form)    its output + per-row 1/rms (fp32 input copy      reassociated: ~1e-6 rel. in fp32
                            + normalized copy)
max_pool2d                  uint8 window offsets (input + int64 indices)     bitwise
linear / conv2d             the same tensors, but backward computes the      bitwise
                            weight gradient first and frees the input
                            before the input gradient is allocated; an
                            input registered as rebuildable (BatchNorm's
                            output through these activations,
                            :mod:`.rebuild`) is not saved: the tensors its
                            recipe reads, saved anyway, are
recompute_pointwise         its input (2-4 intermediates of a multi-op       bitwise; one more evaluation
                            activation such as GPT-2's gelu_new)             in backward
==========================  ===============================================  ==================================

Two more live beside them: :class:`zoomem.ops.attention.MathAttention` (SDPA's math path keeping ``q, k, v`` and a
1-bit dropout mask instead of three N x N tensors; bitwise) and :class:`zoomem.ops.loss.CrossEntropy` (keeping the
logits instead of the log-probabilities; ~1e-7 relative).

"Output-activated" functions (batch_norm_act, layer_norm, rms_norm) recover the normalized input from the saved
output, ``xhat = (y - beta) / gamma``: this loses a few ulps when ``|beta|`` dominates ``|gamma * xhat|`` and is
impossible where ``gamma == 0``; for those calls (checked per call, one host sync on an accelerator) the function
falls back to saving the input like the stock op. Measured on CPU: 1e-7 to 3e-7 relative (norm-wise) in fp32; in
bf16 they are as close to an fp32 run as the stock bf16 op is. Their backward materialises ``xhat`` in fp32 (one
input-sized temporary the stock backward does not need). Their saved output must not be modified in place later in
the forward; autograd then raises at backward (with a zoomem message, see :func:`saves_output`):
``relu``/``hardtanh``/``leaky_relu``/``threshold`` asked to run in place on such an output run out of place instead.

Double backward (``create_graph=True``: gradient penalties, zoomem's sensitivity estimator) works through every
function, with respect to the inputs and to each tensor saved for backward: the backward passes are written with
differentiable ops (masks and indices are constants; max-pool, dropout, linear and conv call aten backward kernels
that have derivative formulas). Saved tensors that are neither an input nor the output (the batch or row
statistics, batch_norm_act's pre-activation output for relu) are extra outputs of the autograd Function, PyTorch's
rule for saved intermediates, which the public functions drop. batch_norm_act and layer_norm call aten backward
kernels that cannot be differentiated with respect to those statistics; under ``create_graph`` they return the
kernel's values (first-order gradients stay bitwise identical) carrying the graph of the same formula written with
differentiable ops, evaluated once more for it (rms_norm's backward is such a formula already). An ordinary
backward runs as before: the same kernels, no extra temporaries, the same saved tensors.

``retain_graph=True`` and non-reentrant checkpointing work (dropout draws the same RNG stream as the stock op, so a
recomputed mask matches). linear/conv2d call the weight- and input-gradient kernels separately: bitwise on CPU; on
CUDA cuDNN may pick other algorithms for the separate calls (last-bit differences).

Pointwise activations written as several ops (HF's ``gelu_new``, ``gelu_fast``, ``quick_gelu``, ...) save two to
four input-sized tensors under stock autograd; :func:`recompute_pointwise` saves only the input and runs the
activation again in backward (bitwise gradients: the same ops, differentiated by autograd). Single-op activations
(``F.gelu``, ``F.silu``) already save only their input.

>>> x = torch.randn(4, 8, requires_grad=True)
>>> y = relu(x)                       # saves 1 bit per element instead of the float output
>>> y.sum().backward()
>>> torch.equal(x.grad, (x > 0).float())
True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from .packbits import bool_planes, pack_bool, unpack_bool
from .rebuild import extend, rebuild_of
from .routing import RoutingMode

__all__ = [
    "relu",
    "relu6",
    "hardtanh",
    "threshold",
    "leaky_relu",
    "dropout",
    "batch_norm_act",
    "layer_norm",
    "rms_norm",
    "max_pool2d",
    "linear",
    "conv2d",
    "recompute_pointwise",
    "saves_output",
    "stores_lossily",
]

logger = logging.getLogger(__name__)

_BN_ACTS = ("identity", "relu", "leaky_relu")


# ----------------------------------------------------------------------------------------------------------------
# helpers


def saves_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output that one of this module's functions saved for backward (output-activated norm).

    Such a tensor must not be modified in place before backward; the activations here run out of place on it.
    """
    return bool(getattr(t.grad_fn, "_zoomem_saved_output", False))


def _saved(ctx: Any, what: str) -> tuple[torch.Tensor, ...]:
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        if "inplace operation" in str(e):
            raise RuntimeError(
                f"zoomem: {what} saves its output for backward, but that output was modified in place later in the "
                "forward (e.g. `x += shortcut` or an in-place activation outside zoomem). Do not install this "
                "implementation on that module (zoomem.ops.find_inplace_writers(model, batch) lists such modules), "
                "or make the later op out of place. Tip: torch.autograd.set_detect_anomaly(True) shows the op."
            ) from e
        raise


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device type, or None."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _cast(dtype: torch.dtype, *ts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """What autocast does to an op's arguments: floating tensors (not fp64) to ``dtype``."""
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in ts
    )


def _needs_fallback(weight: torch.Tensor | None) -> bool:
    """Output-activated norms cannot recover xhat where gamma == 0 (one host sync on an accelerator)."""
    return weight is not None and bool((weight == 0).any())


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector ``(C,)`` shaped to broadcast against ``(N, C, *)`` with ``ndim`` dims."""
    return t.view((1, -1) + (1,) * (ndim - 2))


class _KernelValue(torch.autograd.Function):
    """``value`` (an aten kernel's result, computed without autograd) carrying the autograd history of ``expr``
    (the same quantity written with differentiable ops). Under ``create_graph`` the norms' backward thus returns
    the very values of its ordinary backward (bitwise) while the double backward differentiates ``expr``."""

    @staticmethod
    def forward(ctx, value, expr):  # type: ignore[override]
        return value

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, grad


def _kernel_value(value: torch.Tensor | None, expr: torch.Tensor | None) -> torch.Tensor | None:
    if value is None or expr is None:
        return value
    return _KernelValue.apply(value, expr.to(value.dtype))


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """The precision the norms' backward computes in: fp64 for fp64, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _le(x: torch.Tensor, a: float) -> torch.Tensor:
    """``x <= a`` as aten's activation kernels compare: in fp32 opmath for bf16/fp16 (a Python scalar compared with
    a bf16 tensor would be rounded to bf16 first), exact and without an fp32 copy of ``x``."""
    if x.dtype in (torch.bfloat16, torch.float16):
        af = torch.tensor(a, dtype=torch.float32)
        v = af.to(x.dtype)
        return x < v.item() if v.float() > af else x <= v.item()
    return x <= a


def _ge(x: torch.Tensor, a: float) -> torch.Tensor:
    """``x >= a`` in aten's opmath, like :func:`_le`."""
    if x.dtype in (torch.bfloat16, torch.float16):
        af = torch.tensor(a, dtype=torch.float32)
        v = af.to(x.dtype)
        return x > v.item() if v.float() < af else x >= v.item()
    return x >= a


def _act_forward_mask(kind: str, x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Where the activation's backward passes the incoming gradient unchanged (NaN handled as in aten)."""
    if kind == "threshold":  # threshold_backward: x <= th ? 0 : grad
        return ~_le(x, a)
    if kind == "hardtanh":  # hardtanh_backward: (x <= min || x >= max) ? 0 : grad
        return ~(_le(x, a) | _ge(x, b))
    if kind == "leaky_relu":  # leaky_relu_backward: x > 0 ? grad : grad * slope
        return x > 0
    raise ValueError(f"Unknown activation kind {kind!r}; expected one of 'threshold', 'hardtanh', 'leaky_relu'.")


# ----------------------------------------------------------------------------------------------------------------
# activations with a 1-bit mask



_SEPARATE_MASKS: contextvars.ContextVar[bool] = contextvars.ContextVar("zoomem_separate_masks", default=False)


@contextlib.contextmanager
def separate_masks(on: bool = True) -> Iterator[None]:
    """Inside: functions that would read an activation mask from a saved float tensor (BatchNorm+ReLU's
    pre-activation) save the mask as its own 1-bit tensor, so that the float tensor can be stored lossily
    (rounding must not flip a mask). zoomem's saved-tensor store enters this around every forward it handles,
    and ``on=False`` inside a unit none of whose tensors it stores lossily."""
    token = _SEPARATE_MASKS.set(on)
    try:
        yield
    finally:
        _SEPARATE_MASKS.reset(token)


def stores_lossily() -> bool:
    """Whether the forward running now is under zoomem's saved-tensor store (:func:`separate_masks`), where saved
    floats may be rounded: functions then save tensors that rounding perturbs only a little."""
    return _SEPARATE_MASKS.get()


def _save_mask(ctx: Any, mask: torch.Tensor) -> None:
    """Save a boolean mask for backward as 1 bit per element."""
    packed, ctx.mask_shape = pack_bool(mask)
    ctx.save_for_backward(packed)


def _load_mask(ctx: Any) -> torch.Tensor:
    (packed,) = ctx.saved_tensors
    return unpack_bool(packed, ctx.mask_shape)


def _mask_grad(grad: torch.Tensor, keep: torch.Tensor, slope: float | None = None) -> torch.Tensor:
    """``grad`` where ``keep > 0``, else 0 (``slope`` None) or ``grad * slope``; ``keep``: 0 / 1 values, or the
    saved activation itself. aten's ``threshold_backward`` / ``leaky_relu_backward`` with ``keep`` as their input
    give bitwise ``masked_fill``'s and ``where``'s values (NaN included), differentiably; ``masked_fill`` and
    ``where`` with a bool mask ran 4-6x slower on one CPU thread (``scripts/bench.py quantizer``)."""
    if keep.dtype != grad.dtype:  # a rounding cast could turn a tiny positive value into 0: compare first
        keep = (keep > 0).to(grad.dtype)
    if slope is None:
        return torch.ops.aten.threshold_backward(grad, keep, 0)
    return torch.ops.aten.leaky_relu_backward(grad, keep, slope, False)


def _masked_grad(grad: torch.Tensor, packed: torch.Tensor, shape: torch.Size, slope: float | None = None) -> torch.Tensor:
    """:func:`_mask_grad` with the :func:`pack_bool` mask ``packed``, applied one plane (an eighth of the tensor) at
    a time: a whole 0 / 1 mask in ``grad``'s dtype would hold 4 bytes an element, where the bool mask and its
    negation that ``masked_fill`` read held 2. A double backward (``create_graph``) takes the whole mask, through
    differentiable ops."""
    if torch.is_grad_enabled():
        return _mask_grad(grad, unpack_bool(packed, shape, grad.dtype), slope)
    g = grad.reshape(-1)
    out = torch.empty_like(g)
    for start, keep in bool_planes(packed, g.numel(), grad.dtype):
        part, into = g[start:start + keep.numel()], out[start:start + keep.numel()]
        if slope is None:
            torch.ops.aten.threshold_backward.grad_input(part, keep, 0, grad_input=into)
        else:
            torch.ops.aten.leaky_relu_backward.grad_input(part, keep, slope, False, grad_input=into)
        del keep  # before the next plane is drawn
    return out.view(grad.shape)

class _BitmaskActivation(torch.autograd.Function):
    """relu / relu6 (hardtanh) / threshold / leaky_relu, saving only a 1-bit mask."""

    @staticmethod
    def forward(ctx, x, kind, a, b, inplace):  # type: ignore[override]
        # kind: "relu" (threshold 0, value 0, like aten.relu), "threshold" (a=threshold, b=value),
        # "hardtanh" (a=min, b=max), "leaky_relu" (a=slope)
        if kind == "relu":
            out = _act_value(kind, a, b, inplace, x)
            mask = ~(out <= 0)  # aten: threshold_backward(grad, result, 0)
        else:
            mask = _act_forward_mask(kind, x, a, b)
            out = _act_value(kind, a, b, inplace, x)
        if inplace:
            ctx.mark_dirty(x)
        _save_mask(ctx, mask)
        del mask
        ctx.kind, ctx.slope = kind, a
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        gi = _masked_grad(grad, packed, ctx.mask_shape, ctx.slope if ctx.kind == "leaky_relu" else None)
        return gi, None, None, None, None


def _bitmask_act(x: torch.Tensor, kind: str, a: float, b: float, inplace: bool) -> torch.Tensor:
    if inplace and saves_output(x):
        # x is saved by an output-activated norm: overwriting it would break that norm's backward
        inplace = False
    source = rebuild_of(x)  # before an in-place run changes its version
    out = _BitmaskActivation.apply(x, kind, a, b, inplace)
    if source is not None:  # the output is as rebuildable as the input: the same op, in place on the rebuilt input
        extend(source, out, functools.partial(_act_value, kind, a, b, True))
    return out


def _act_value(kind: str, a: float, b: float, inplace: bool, x: torch.Tensor) -> torch.Tensor:
    """The activation's output, the stock kernel (in place or not: the same values)."""
    if kind == "relu":
        return torch.relu_(x) if inplace else torch.relu(x)
    if kind == "threshold":
        return F.threshold(x, a, b, inplace=inplace)
    if kind == "hardtanh":
        return F.hardtanh(x, a, b, inplace=inplace)
    return F.leaky_relu(x, a, inplace=inplace)


def relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu`` saving a 1-bit mask; bitwise identical output and gradient.

    Unlike the stock in-place ReLU (which saves its output), the in-place variant here may be followed by other
    in-place ops on its output: backward needs only the mask.
    """
    return _bitmask_act(x, "relu", 0.0, 0.0, inplace)


def hardtanh(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> torch.Tensor:
    """``F.hardtanh`` saving a 1-bit mask; bitwise identical output and gradient."""
    return _bitmask_act(x, "hardtanh", float(min_val), float(max_val), inplace)


def relu6(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu6`` (= ``hardtanh(x, 0, 6)``) saving a 1-bit mask; bitwise identical output and gradient."""
    return hardtanh(x, 0.0, 6.0, inplace)


def threshold(x: torch.Tensor, threshold: float, value: float, inplace: bool = False) -> torch.Tensor:
    """``F.threshold`` saving a 1-bit mask; bitwise identical output and gradient."""
    return _bitmask_act(x, "threshold", float(threshold), float(value), inplace)


def leaky_relu(x: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False) -> torch.Tensor:
    """``F.leaky_relu`` saving a 1-bit mask of ``x > 0``; bitwise identical output and gradient (any slope)."""
    return _bitmask_act(x, "leaky_relu", float(negative_slope), 0.0, inplace)


# ----------------------------------------------------------------------------------------------------------------
# dropout


def _fused_dropout_device(x: torch.Tensor) -> bool:
    """Whether ``F.dropout`` uses aten's fused ``native_dropout`` for ``x`` (mirrors ``is_fused_kernel_acceptable``)."""
    dev = x.device.type
    return dev in ("cuda", "xpu", "lazy") or dev == torch._C._get_privateuse1_backend_name()


def _aten_dropout(x: torch.Tensor, p: float, fused: bool,
                  inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.dropout(x, p, training=True)`` as aten runs it on ``x``'s device (the same RNG draws, the same values),
    and its mask: ``native_dropout`` where ``fused``, else aten's ``_dropout_impl`` (noise = bernoulli(1-p) in
    ``x``'s dtype, / (1-p), ``x * noise``). Returns ``(out, keep)``."""
    if fused:
        out, keep = torch.native_dropout(x, p, True)
        return (x.copy_(out) if inplace else out), keep
    noise = torch.empty_like(x).bernoulli_(1 - p)
    keep = noise != 0
    noise.div_(1 - p)
    return (x.mul_(noise) if inplace else x * noise), keep


def _dropout_from_mask(x: torch.Tensor, keep: torch.Tensor, p: float, fused: bool) -> torch.Tensor:
    """``x`` times the multiplier of the :func:`_aten_dropout` draw whose mask is ``keep``: that draw's output again
    given its input, or its gradient given the output's (bitwise), without an ``x``-sized float noise tensor."""
    if fused:
        return torch.ops.aten.native_dropout_backward(x, keep, 1.0 / (1.0 - p))
    r = torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)  # the noise's one nonzero value, as aten divides
    return (x * r).masked_fill_(keep.logical_not(), 0)


class _BitmaskDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, inplace):  # type: ignore[override]
        fused = _fused_dropout_device(x)
        out, mask = _aten_dropout(x, p, fused, inplace)  # the bool mask is packed to bits
        if inplace:
            ctx.mark_dirty(x)
        _save_mask(ctx, mask)
        del mask
        ctx.p, ctx.fused = p, fused
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _dropout_from_mask(grad, _load_mask(ctx), ctx.p, ctx.fused), None, None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` saving a 1-bit mask.

    Draws the mask exactly as ``F.dropout`` does on the same device (``bernoulli_`` on a tensor of ``x``'s dtype on
    CPU, ``native_dropout`` on CUDA/XPU), so with the same RNG seed the output is bitwise identical and the RNG
    stream advances identically (checkpoint recomputation reproduces the mask). Gradients are bitwise identical.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0 or p == 1.0 or x.numel() == 0 or not torch.is_grad_enabled():
        return F.dropout(x, p, training, inplace)
    return _BitmaskDropout.apply(x, float(p), inplace)


# ----------------------------------------------------------------------------------------------------------------
# batch norm (+ activation), output-activated


def _bn_stats_forward(x, weight, bias, running_mean, running_var, momentum, eps):
    """The stock training-mode batch norm (the kernel F.batch_norm picks), returning (y, save_invstd, save_mean)."""
    out, save_mean, save_invstd, _reserve, _impl = torch._batch_norm_impl_index(
        x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled
    )
    return out, save_invstd, save_mean


def _bn_explicit(
    g: torch.Tensor, xhat: torch.Tensor, weight: torch.Tensor | None, invstd: torch.Tensor, ndim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode batch-norm gradients (d/dx, d/dgamma, d/dbeta) written with differentiable ops, in ``g``'s
    precision; ``g``: gradient w.r.t. the pre-activation output, ``xhat``: the normalized input."""
    dims = [0] + list(range(2, ndim))
    w_eff = invstd if weight is None else weight * invstd
    gx = _channel_view(w_eff, ndim) * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))
    return gx, (g * xhat).sum(dims), g.sum(dims)


def _bn_stat_grads(
    gx: torch.Tensor | None,
    xhat: torch.Tensor | None,
    invstd: torch.Tensor,
    g_mean: torch.Tensor | None,
    g_invstd: torch.Tensor | None,
    ndim: int,
) -> torch.Tensor | None:
    """``gx`` plus the gradient that reaches x through the returned batch mean and 1/std (only a double backward
    sends any): d mean/dx = 1/M, d invstd/dx = -invstd**2 * xhat / M per channel of M elements."""
    if gx is None or (g_mean is None and g_invstd is None):
        return gx
    assert xhat is not None
    work, m = xhat.dtype, xhat.numel() // xhat.shape[1]
    extra: Any = 0
    if g_mean is not None:
        extra = _channel_view(g_mean.to(work), ndim) / m
    if g_invstd is not None:
        s = invstd.to(work)
        extra = extra - _channel_view(g_invstd.to(work) * s * s, ndim) * xhat / m
    return gx + extra.to(gx.dtype)


class _BatchNormAct(torch.autograd.Function):
    """Returns ``(out, *stats)``: every saved tensor that is neither an input nor ``out`` (the batch mean and 1/std,
    the pre-activation output for relu) is an output too, so that a double backward differentiates through it
    (PyTorch's rule for saved intermediates). :func:`batch_norm_act` returns ``out`` alone."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, act, slope):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # the extra outputs get a gradient only in a double backward
        y, invstd, mean = _bn_stats_forward(x, weight, bias, running_mean, running_var, momentum, eps)
        ctx.act, ctx.slope, ctx.eps, ctx.ndim = act, slope, eps, x.dim()
        ctx.x_dtype = x.dtype
        ctx.normalized = _SEPARATE_MASKS.get()
        ctx.fallback = not ctx.normalized and _needs_fallback(weight)
        if ctx.normalized:
            # under zoomem's store (saved tensors may be lossy): save xhat, whose channels all have unit scale, and
            # the mask as 1 bit. Recovering xhat as (y - beta) / gamma would multiply a rounding error of y by
            # 1 / gamma (timm starts residual-branch gammas at 0: 2-bit ResNet-18 training diverged), and the
            # input x has per-channel scales that per-sample rounding groups mix.
            work = _work_dtype(x)
            xhat = (x.to(work) - _channel_view(mean.to(work), x.dim())).mul_(_channel_view(invstd.to(work), x.dim()))
            xhat = xhat.to(x.dtype)
            extra = ()
            if act in ("relu", "leaky_relu"):
                packed, ctx.mask_shape = pack_bool(y > 0)
                extra = (packed,)
                y = torch.relu_(y) if act == "relu" else F.leaky_relu_(y, slope)
            ctx.exact_reads = ()
            ctx.save_for_backward(xhat, weight, bias, invstd, *extra)
            return y, xhat, invstd
        if ctx.fallback:
            # gamma == 0 somewhere: xhat cannot be recovered from y there; save the input like the stock op
            if act == "identity":
                out = y
                packed, shape = None, None
            elif act == "relu":
                out = torch.relu_(y)
                packed, shape = pack_bool(~(out <= 0))
            else:
                packed, shape = pack_bool(y > 0)
                out = F.leaky_relu_(y, slope)
            ctx.shape = shape
            ctx.save_for_backward(x, weight, bias, mean, invstd, packed)
            return out, mean, invstd
        # the mask of relu / leaky_relu: read from the saved float tensor (``exact_reads``: it must stay exact), or
        # under separate_masks() saved as its own 1-bit tensor
        separate = act in ("relu", "leaky_relu") and _SEPARATE_MASKS.get()
        ctx.exact_reads = (0,) if act in ("relu", "leaky_relu") and not separate else ()
        extra: tuple[torch.Tensor, ...] = ()
        if separate:
            packed, ctx.mask_shape = pack_bool(y > 0)
            extra = (packed,)
        if act == "relu":
            out = torch.relu(y)  # y (pre-activation) is saved, so the activation cannot overwrite it
            ctx.save_for_backward(y, weight, bias, invstd, *extra)
            return out, y, invstd
        if act == "leaky_relu":
            y = F.leaky_relu_(y, slope)  # invertible for slope > 0: save the activated output itself
        ctx.save_for_backward(y, weight, bias, invstd, *extra)
        ctx._zoomem_saved_output = True
        return y, invstd

    @staticmethod
    def backward(ctx, grad, *stat_grads):  # type: ignore[override]
        act, ndim = ctx.act, ctx.ndim
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        diff = torch.is_grad_enabled()  # create_graph: the gradients must be differentiable themselves
        g_pre = g_mean = xhat = None
        if ctx.normalized:
            xhat, weight, bias, invstd, *mask = _saved(ctx, "batch_norm_act")
            g_xhat, g_invstd = stat_grads
            work = _work_dtype(xhat)
            if grad is None:
                grad = torch.zeros_like(xhat)
            if mask:
                grad = _masked_grad(grad, mask[0], ctx.mask_shape, None if act == "relu" else ctx.slope)
            return _BatchNormAct._from_xhat(ctx, grad.to(work), xhat.to(work), weight, bias, invstd, g_invstd, g_xhat)
        if ctx.fallback:
            x, weight, bias, mean, invstd, packed = _saved(ctx, "batch_norm_act")
            g_mean, g_invstd = stat_grads
            if grad is None:  # a double backward that reaches only the statistics
                grad = torch.zeros_like(x)
            if act in ("relu", "leaky_relu"):
                grad = _masked_grad(grad, packed, ctx.shape, None if act == "relu" else ctx.slope)
            with torch.no_grad():
                gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                    grad, x, weight, None, None, mean, invstd, True, ctx.eps, [need_x, need_w, need_b]
                )
            if diff or g_mean is not None or g_invstd is not None:
                work = _work_dtype(x)
                xhat = (x.to(work) - _channel_view(mean.to(work), ndim)) * _channel_view(invstd.to(work), ndim)
            if diff:
                wf = weight.to(work) if weight is not None else None
                ex, ew, eb = _bn_explicit(grad.to(work), xhat, wf, invstd.to(work), ndim)
                gx, gw, gb = _kernel_value(gx, ex), _kernel_value(gw, ew), _kernel_value(gb, eb)
            gx = _bn_stat_grads(gx, xhat, invstd, g_mean, g_invstd, ndim)
            return gx, gw, gb, None, None, None, None, None, None
        saved, weight, bias, invstd, *mask = _saved(ctx, "batch_norm_act")
        if act == "relu":
            g_pre, g_invstd = stat_grads
        else:
            (g_invstd,) = stat_grads
        if grad is None:
            grad = torch.zeros_like(saved)
        # 1. gradient w.r.t. the pre-activation output y, and y itself
        slope = None if act == "relu" else ctx.slope
        if act in ("relu", "leaky_relu"):  # the mask, or the saved activation: > 0 where the activation passes
            grad = _masked_grad(grad, mask[0], ctx.mask_shape, slope) if mask else _mask_grad(grad, saved, slope)
        y = saved
        if act == "leaky_relu":
            y = torch.where(unpack_bool(mask[0], ctx.mask_shape) if mask else saved > 0, saved, saved / ctx.slope)
        if g_pre is not None:  # a double backward through the returned pre-activation output
            grad = grad + g_pre
        # 2. xhat = (y - beta) / gamma in fp32, then the gradients from xhat
        work = _work_dtype(y)
        xhat = y.to(work)
        if bias is not None:
            xhat = xhat - _channel_view(bias.to(work), ndim)
        if weight is not None:
            xhat = xhat / _channel_view(weight.to(work), ndim)
        return _BatchNormAct._from_xhat(ctx, grad.to(work), xhat, weight, bias, invstd, g_invstd)

    @staticmethod
    def _from_xhat(ctx, g, xhat, weight, bias, invstd, g_invstd, g_xhat=None):  # type: ignore[no-untyped-def]
        """The gradients from xhat and the gradient ``g`` w.r.t. the pre-activation output (both in the work dtype):
        aten's batch-norm backward with mean 0, invstd 1 and weight gamma * invstd (d/dx = gamma*invstd*(g - mean(g)
        - xhat*mean(g*xhat)), d/dgamma = sum(g*xhat)), differentiable under create_graph; ``g_xhat``: a double
        backward's gradient w.r.t. a returned xhat."""
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        work, ndim, c = xhat.dtype, ctx.ndim, invstd.numel()
        wf = weight.to(work) if weight is not None else None
        with torch.no_grad():
            w_eff = wf * invstd.to(work) if wf is not None else invstd.to(work)
            zeros = torch.zeros(c, dtype=work, device=g.device)
            ones = torch.ones(c, dtype=work, device=g.device)
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                g, xhat, w_eff, None, None, zeros, ones, True, ctx.eps, [need_x, need_w and wf is not None, need_b]
            )
        if torch.is_grad_enabled():
            ex, ew, eb = _bn_explicit(g, xhat, wf, invstd.to(work), ndim)
            gx, gw, gb = _kernel_value(gx, ex), _kernel_value(gw, ew), _kernel_value(gb, eb)
        if g_xhat is not None and gx is not None:  # xhat = (x - mean) * invstd: batch norm's backward, gamma 1
            gx = gx + _bn_explicit(g_xhat.to(work), xhat, None, invstd.to(work), ndim)[0]
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        gw = gw.to(weight.dtype) if gw is not None and weight is not None else None
        gb = gb.to(bias.dtype) if gb is not None and bias is not None else None
        gx = _bn_stat_grads(gx, xhat, invstd, None, g_invstd, ndim)
        return gx, gw, gb, None, None, None, None, None, None


def batch_norm_act(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "identity",
    negative_slope: float = 0.01,
) -> torch.Tensor:
    """``F.batch_norm`` (+ an activation) with an output-activated backward in training mode.

    Saves the output (``act`` "identity", or "leaky_relu" with ``negative_slope > 0``, both invertible) or the
    pre-activation output (``act="relu"``), plus the per-channel ``1/std``; not the input. The forward is the stock
    kernel (bitwise identical output, running statistics updated in place exactly as ``F.batch_norm`` does, once).
    Gradients are reassociated: within ~1e-6 relative in fp32 (a few ulps of the output scaled by ``1/gamma``).
    Where some ``gamma == 0`` the call falls back to saving the input (gradients then as the stock formula).

    Args:
        act: "identity", "relu" or "leaky_relu".
    Shapes:
        x: ``(N, C, *)``; running stats, weight, bias: ``(C,)``.
    """
    if act not in _BN_ACTS:
        raise ValueError(f"act must be one of {_BN_ACTS}, got {act!r}.")
    if act == "leaky_relu" and not negative_slope > 0:
        raise ValueError(f"act='leaky_relu' needs negative_slope > 0 to be invertible, got {negative_slope}.")
    if not training or not torch.is_grad_enabled():
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        if act == "relu":
            return torch.relu(y)
        if act == "leaky_relu":
            return F.leaky_relu(y, negative_slope)
        return y
    F._verify_batch_size(x.size())
    return _BatchNormAct.apply(x, weight, bias, running_mean, running_var, momentum, eps, act, float(negative_slope))[0]


# ----------------------------------------------------------------------------------------------------------------
# layer norm, output-activated


def _ln_explicit(
    g: torch.Tensor, xhat: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer-norm gradients (d/dx, d/dgamma, d/dbeta) over the last ``k`` dims written with differentiable ops."""
    red, lead = tuple(range(-k, 0)), tuple(range(g.dim() - k))
    gh = g * weight if weight is not None else g
    gx = rstd * (gh - gh.mean(red, keepdim=True) - xhat * (gh * xhat).mean(red, keepdim=True))
    return gx, (g * xhat).sum(lead), g.sum(lead)


def _row_stat_grads(
    gx: torch.Tensor | None,
    xhat: torch.Tensor | None,
    rstd: torch.Tensor,
    g_mean: torch.Tensor | None,
    g_rstd: torch.Tensor | None,
    d: int,
) -> torch.Tensor | None:
    """``gx`` plus the gradient that reaches x through the returned per-row mean and 1/std (or 1/rms, with
    ``xhat`` = x/rms) over ``d`` elements: d mean/dx = 1/d, d rstd/dx = -rstd**2 * xhat / d."""
    if gx is None or (g_mean is None and g_rstd is None):
        return gx
    assert xhat is not None
    work = xhat.dtype
    extra: Any = 0
    if g_mean is not None:
        extra = g_mean.to(work) / d
    if g_rstd is not None:
        r = rstd.to(work)
        extra = extra - g_rstd.to(work) * r * r * xhat / d
    return gx + extra.to(gx.dtype)


class _LayerNorm(torch.autograd.Function):
    """Returns ``(y, *stats)``: the saved per-row statistics are outputs too, for the double backward (see
    :class:`_BatchNormAct`); :func:`layer_norm` returns ``y`` alone."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = list(normalized_shape)
        ctx.x_dtype = x.dtype
        ctx.fallback = _needs_fallback(weight)
        if ctx.fallback:
            ctx.save_for_backward(x, weight, bias, mean, rstd)
            # read in rows, each by its own spread: quantized in groups that follow them (zoomem.runtime.probe)
            ctx.norm_rows = ((0, math.prod(normalized_shape)),)
            return y, mean, rstd
        ctx.save_for_backward(y, weight, bias, rstd)
        ctx._zoomem_saved_output = True
        return y, rstd

    @staticmethod
    def backward(ctx, grad, *stat_grads):  # type: ignore[override]
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        diff = torch.is_grad_enabled()  # create_graph: the gradients must be differentiable themselves
        ns = ctx.normalized_shape
        d = math.prod(ns)
        g_mean = xhat = None
        if ctx.fallback:
            x, weight, bias, mean, rstd = _saved(ctx, "layer_norm")
            g_mean, g_rstd = stat_grads
            if grad is None:  # a double backward that reaches only the statistics
                grad = torch.zeros_like(x)
            with torch.no_grad():
                gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, ns, mean, rstd, weight, bias, mask)
            work = _work_dtype(x)
            if diff or g_mean is not None or g_rstd is not None:
                xhat = (x.to(work) - mean.to(work)) * rstd.to(work)
            if diff:
                wf = weight.to(work) if weight is not None else None
                ex, ew, eb = _ln_explicit(grad.to(work), xhat, wf, rstd.to(work), len(ns))
                gx, gw, gb = _kernel_value(gx, ex), _kernel_value(gw, ew), _kernel_value(gb, eb)
            return _row_stat_grads(gx, xhat, rstd, g_mean, g_rstd, d), None, gw, gb, None
        y, weight, bias, rstd = _saved(ctx, "layer_norm")
        (g_rstd,) = stat_grads
        if grad is None:
            grad = torch.zeros_like(y)
        work = _work_dtype(y)
        xhat = y.to(work)
        if bias is not None:
            xhat = xhat - bias.to(work)
        if weight is not None:
            xhat = xhat / weight.to(work)
        g = grad.to(work)
        # aten's layer-norm backward on xhat with mean 0, rstd 1 gives d/dxhat-projected; times rstd = d/dx
        with torch.no_grad():
            gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
                g,
                xhat,
                ns,
                torch.zeros_like(rstd, dtype=work),
                torch.ones_like(rstd, dtype=work),
                weight.to(work) if weight is not None else None,
                bias.to(work) if bias is not None else None,
                [mask[0], mask[1] and weight is not None, mask[2] and bias is not None],
            )
            if gx is not None:
                gx = gx * rstd.to(work)
        if diff:
            wf = weight.to(work) if weight is not None else None
            ex, ew, eb = _ln_explicit(g, xhat, wf, rstd.to(work), len(ns))
            gx, gw, gb = _kernel_value(gx, ex), _kernel_value(gw, ew), _kernel_value(gb, eb)
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(bias.dtype) if gb is not None else None
        return _row_stat_grads(gx, xhat, rstd, None, g_rstd, d), None, gw, gb, None


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` saving its output and per-row ``1/std`` instead of its input and mean.

    Forward output bitwise identical (the same ``native_layer_norm`` kernel); gradients reassociated, within ~1e-6
    relative in fp32. Falls back to saving the input where some ``gamma == 0``.
    """
    if not torch.is_grad_enabled():
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    if _autocast_dtype(x) is not None:
        dev = x.device.type
        if dev == "cpu":  # layer_norm is in no CPU autocast list: runs in its input dtype
            pass
        elif dev == "cuda":  # CUDA autocast runs layer_norm in fp32
            x, weight, bias = _cast(torch.float32, x, weight, bias)
            with torch.autocast(dev, enabled=False):
                return _LayerNorm.apply(x, tuple(normalized_shape), weight, bias, eps)[0]
        else:  # an autocast policy we have not checked: keep the stock op
            return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _LayerNorm.apply(x, tuple(normalized_shape), weight, bias, eps)[0]


class _LayerNormAtSavedStatistics(torch.autograd.Function):
    """The stock layer norm (aten's kernels; saving ``[bias,] input, [weight,] mean, rstd`` in the stock node's
    order, so the saved-tensor store names them alike) whose double backward holds the saved per-row mean and 1/std
    fixed. aten's own double backward differentiates them as functions of the input, but a backward that reads a
    rounded stored input uses them as saved: DistilBERT without compact forms, all 30 saved tensors at 8 bits,
    measure 0.15 of the predicted gradient variance by brute force with aten's double backward, 0.75 with this one
    (``python scripts/coverage.py --models hf:distilbert --per-tensor 8 --stock-forms [--aten-norms]``)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape, ctx.has_weight, ctx.has_bias = list(normalized_shape), weight is not None, \
            bias is not None
        ctx.save_for_backward(*(t for t in (bias, x, weight) if t is not None), mean, rstd)
        ctx.norm_rows = ((int(bias is not None), math.prod(normalized_shape)),)  # zoomem.runtime.probe
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None
        saved = list(ctx.saved_tensors)
        bias = saved.pop(0) if ctx.has_bias else None
        x = saved.pop(0)
        weight = saved.pop(0) if ctx.has_weight else None
        mean, rstd = saved
        ns = ctx.normalized_shape
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        with torch.no_grad():
            gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, ns, mean, rstd, weight, bias, mask)
        if torch.is_grad_enabled():  # create_graph: the kernel's values with the history of the same formula
            work = _work_dtype(x)
            xhat = (x.to(work) - mean.to(work)) * rstd.to(work)
            wf = weight.to(work) if weight is not None else None
            ex, ew, eb = _ln_explicit(grad.to(work), xhat, wf, rstd.to(work), len(ns))
            gx, gw, gb = _kernel_value(gx, ex), _kernel_value(gw, ew), _kernel_value(gb, eb)
        return gx, None, gw, gb, None


class norms_at_saved_statistics(RoutingMode):
    """Inside the block, ``F.layer_norm`` calls that need a gradient run :class:`_LayerNormAtSavedStatistics`: the
    stock values, saved tensors and first-order gradients, and a double backward that differentiates the saved
    input alone, as the sensitivity probe (:mod:`zoomem.runtime.probe`) needs. Under autocast they run as they are.
    """

    target = staticmethod(F.layer_norm)

    def route(self, input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
              eps: float = 1e-5) -> Any:
        tensors = [t for t in (input, weight, bias) if t is not None]
        if not all(isinstance(t, torch.Tensor) for t in tensors) or not torch.is_grad_enabled() \
                or not any(t.requires_grad for t in tensors) or torch.is_autocast_enabled(input.device.type):
            return None
        return _LayerNormAtSavedStatistics.apply(input, tuple(normalized_shape), weight, bias, eps)


class _Hardsigmoid(torch.autograd.Function):
    """``F.hardsigmoid`` saving its input as the stock node does, with a backward a second backward can go through
    (aten's ``hardsigmoid_backward`` has no derivative): ``grad / 6`` where ``-3 < x < 3``."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.exact_reads = (0,)  # read through a comparison, as the stock node's (zoomem.runtime.probe)
        return torch.ops.aten.hardsigmoid(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            inside = (x > -3) & (x < 3)
        return torch.where(inside, grad * _ONE_SIXTH, 0.0)


_ONE_SIXTH = 0.1666666716337204
"""1/6 rounded to fp32, the factor aten's hardsigmoid_backward multiplies by in every dtype (fp64 too)."""


class differentiable_hardsigmoid(RoutingMode):
    """Inside the block, out-of-place ``F.hardsigmoid`` calls that need a gradient (MobileNetV3's and GhostNet's
    squeeze-excite gates) run :class:`_Hardsigmoid`: the same values, saved tensor and gradients, twice
    differentiable, so the sensitivity probe can measure such models instead of falling back to value ranges."""

    target = staticmethod(F.hardsigmoid)

    def route(self, input: Any, inplace: bool = False) -> Any:
        if inplace or not isinstance(input, torch.Tensor) or not input.requires_grad or not torch.is_grad_enabled():
            return None
        return _Hardsigmoid.apply(input)


# ----------------------------------------------------------------------------------------------------------------
# RMS norm (HF Llama form), output-activated


def _rms_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """HF ``LlamaRMSNorm.forward``, op for op (so the output is bitwise identical); also returns 1/rms."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    r = torch.rsqrt(variance + eps)
    h = h * r
    n = h.to(input_dtype)
    return (weight * n if weight is not None else n), r


class _RMSNorm(torch.autograd.Function):
    """Returns ``(y, 1/rms)``: the saved per-row statistic is an output too, for the double backward (see
    :class:`_BatchNormAct`); :func:`rms_norm` returns ``y`` alone. The backward is written with differentiable
    ops throughout, so a ``create_graph`` backward computes the very same values."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        y, r = _rms_forward(x, weight, eps)
        ctx.fallback = _needs_fallback(weight)
        ctx.x_dtype = x.dtype
        if ctx.fallback:
            ctx.save_for_backward(x, weight, r)
            ctx.norm_rows = ((0, x.shape[-1]),)  # as in _LayerNorm
        else:
            ctx.save_for_backward(y, weight, r)
            ctx._zoomem_saved_output = True
        return y, r

    @staticmethod
    def backward(ctx, grad, g_r):  # type: ignore[override]
        saved, weight, r = _saved(ctx, "rms_norm")
        if grad is None:  # a double backward that reaches only 1/rms
            grad = torch.zeros_like(saved)
        if ctx.fallback:
            n_f = saved.to(torch.float32) * r
            n_d = n_f.to(ctx.x_dtype)
        else:
            # n = y / w: the normalized activations (in the output dtype), up to one rounding of the product
            n_d = saved / weight if weight is not None else saved
            n_f = n_d.to(torch.float32)
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            lead = tuple(range(grad.dim() - weight.dim()))
            gw = (grad * n_d).sum(lead).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gn = (grad * weight if weight is not None else grad).to(torch.float32)
            # d/dx of n = x * rsqrt(mean(x^2) + eps):  r * (gn - n * mean(gn * n))
            gx_f = r * (gn - n_f * (gn * n_f).mean(-1, keepdim=True))
            gx = _row_stat_grads(gx_f, n_f, r, None, g_r, n_f.shape[-1]).to(ctx.x_dtype)  # type: ignore[union-attr]
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm`` (fp32 statistics, ``weight * normed.to(input_dtype)``) saving its output and ``1/rms``.

    The stock graph saves an fp32 copy of the input and the normalized tensor; this saves only the output (which the
    next linear layer saves anyway) and one fp32 value per row. Forward bitwise identical; gradients reassociated
    (within ~1e-6 relative in fp32). Falls back to saving the input where some ``weight == 0``.
    """
    if not torch.is_grad_enabled():
        return _rms_forward(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)[0]


# ----------------------------------------------------------------------------------------------------------------
# max pool with compact indices


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _window_origins(out_hw, stride, padding, device):
    oh = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    ow = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return oh.view(-1, 1), ow.view(1, -1)


class _MaxPool2dCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):  # type: ignore[override]
        out, idx = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        width = x.shape[-1]
        oh0, ow0 = _window_origins(out.shape[-2:], stride, padding, x.device)
        h = torch.div(idx, width, rounding_mode="floor")
        w = idx - h * width
        del idx
        # offset inside the window: row kh, column kw of the (dilated) kernel
        local = torch.div(h.sub_(oh0), dilation[0], rounding_mode="floor").mul_(kernel[1])
        local += torch.div(w.sub_(ow0), dilation[1], rounding_mode="floor")
        del h, w
        area = kernel[0] * kernel[1]
        local = local.to(torch.uint8 if area <= 256 else torch.int16 if area <= 32767 else torch.int32)
        ctx.save_for_backward(local)
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        ctx.in_shape, ctx.in_dtype = x.shape, x.dtype
        ctx.channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last
        )
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.args
        height, width = ctx.in_shape[-2:]
        oh0, ow0 = _window_origins(local.shape[-2:], stride, padding, local.device)
        local = local.long()
        kh = torch.div(local, kernel[1], rounding_mode="floor")
        kw = local - kh * kernel[1]
        del local
        idx = kh.mul_(dilation[0]).add_(oh0).mul_(width)
        idx += kw.mul_(dilation[1]).add_(ow0)
        del kw
        if ctx.channels_last:
            # the kernel takes the layout of its `input` argument (never read): give it a channels-last one
            dummy = torch.empty(ctx.in_shape, dtype=grad.dtype, device=grad.device, memory_format=torch.channels_last)
        else:
            dummy = grad.new_empty(()).expand(ctx.in_shape)  # shape only, no memory
        gi = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, dummy, kernel, stride, padding, dilation, ceil_mode, idx
        )
        return gi, None, None, None, None, None


def max_pool2d(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    ceil_mode: bool = False,
) -> torch.Tensor:
    """``F.max_pool2d`` saving the argmax offset inside each window as ``uint8`` (kernel area <= 256).

    Saves one byte per output element instead of the input and int64 flat indices. Output and gradient are
    bitwise identical (the same aten forward and backward kernels; indices are rebuilt exactly in backward).

    Shapes:
        x: ``(N, C, H, W)`` or ``(C, H, W)``.
    """
    kernel = _pair(kernel_size)
    stride_ = _pair(stride) if stride is not None and (not isinstance(stride, (list, tuple)) or len(stride)) else kernel
    if not torch.is_grad_enabled():
        return F.max_pool2d(x, kernel, stride_, padding, dilation, ceil_mode)
    return _MaxPool2dCompact.apply(x, kernel, stride_, _pair(padding), _pair(dilation), ceil_mode)


# ----------------------------------------------------------------------------------------------------------------
# linear / conv2d with a split backward


class _LinearInputGrad(torch.autograd.Function):
    """Computes the forward on the 2-D folded input; its backward (which runs last) computes only grad_input."""

    @staticmethod
    def forward(ctx, x2, weight, bias, fused_bias):  # type: ignore[override]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(weight)
        if bias is None or fused_bias:
            return F.linear(x2, weight, bias)  # addmm / mm, as aten.linear runs it
        return x2.mm(weight.t()).add_(bias)  # aten.linear's matmul + bias path (inputs it does not fold to addmm)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (weight,) = ctx.saved_tensors
        return grad.mm(weight), None, None, None


class _LinearWeightGrad(torch.autograd.Function):
    """Passes the output through; its backward (which runs first) computes grad_weight/grad_bias from the saved
    input, which autograd frees right after, before grad_input is allocated."""

    @staticmethod
    def forward(ctx, y2, x2, weight, bias, rebuild, *sources):  # type: ignore[override]
        ctx.mark_dirty(y2)  # no alias/view: y2 keeps its storage and is simply re-owned by this node
        _save_input(ctx, x2 if ctx.needs_input_grad[2] else None, rebuild, sources)
        ctx.has_bias = bias is not None
        return y2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, _ = _saved_input(ctx)
        gw = grad.t().mm(x2) if x2 is not None else None
        del x2  # a rebuilt input goes now
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return (grad, None, gw, gb, None) + (None,) * ctx.sources


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a split backward: grad_weight first, then the input is freed, then grad_input.

    The stock backward holds the saved input ``x``, the incoming gradient ``g`` and the new ``grad_input`` (the size
    of ``x``) at once: peak ``|g| + 2|x|`` (+ grad_weight). Here the backward is two autograd nodes: the first
    computes grad_weight and grad_bias from ``x`` and ``g`` and is released by autograd, which drops ``x``; the
    second computes ``grad_input = g @ W`` from ``g`` and the weight only: peak ``|g| + |x|``. The saving is real
    when ``x`` is held by this layer alone (e.g. the input of an MLP's second linear, the GELU output); the order
    that lowers the peak is weight-gradient-first, because grad_input is the only large new allocation. Saved
    tensors are the same as the stock op's; output and gradients are bitwise identical.
    """
    if not torch.is_grad_enabled() or x.dim() < 2:
        return F.linear(x, weight, bias)
    amp = _autocast_dtype(x)
    if amp is not None:  # linear is a lower-precision autocast op on every device: cast as autocast would
        x, weight, bias = _cast(amp, x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            return linear(x, weight, bias)
    # fold to 2-D like aten.linear: addmm for 2-D inputs and contiguous 3-D ones, else mm + bias
    fused_bias = x.dim() == 2 or (x.dim() == 3 and x.is_contiguous())
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    y2 = _LinearInputGrad.apply(x2, weight, bias, fused_bias)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        y2 = _LinearWeightGrad.apply(y2, x2, weight, bias, *_rebuild_args(x2, weight))
    return y2 if x.dim() == 2 else y2.view(*x.shape[:-1], weight.shape[0])


class _Conv2dInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, handoff):  # type: ignore[override]
        ctx.args = (list(stride), list(padding), list(dilation), groups)
        ctx.in_shape = x.shape
        ctx.channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last
        )
        ctx.input = weakref.ref(x)  # alive in backward only where another node still holds it
        ctx.handoff = handoff
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(weight)
            handoff.append(None)  # the weight gradient's backward, which runs first, hands its input over here
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        (weight,) = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        alive = ctx.handoff[0] if ctx.handoff and ctx.handoff[0] is not None else ctx.input()
        if ctx.handoff:
            ctx.handoff[0] = None
        if alive is not None and alive.shape == ctx.in_shape:
            # the input as the weight gradient read it (a recomputed unit's new one, a rebuilt one) or still held
            # elsewhere: the stock call, which reads only its shape; a stand-in would be copied to a contiguous
            # input-sized tensor by the kernel, |input| more where the input is alive anyway
            dummy = alive
        elif ctx.channels_last:
            dummy = torch.empty(ctx.in_shape, dtype=grad.dtype, device=grad.device, memory_format=torch.channels_last)
        else:
            dummy = grad.new_empty(()).expand(ctx.in_shape)  # shape only, like torch.nn.grad.conv2d_input
        gx, _, _ = torch.ops.aten.convolution_backward(
            grad, dummy, weight, None, stride, padding, dilation, False, [0, 0], groups, [True, False, False]
        )
        return gx, None, None, None, None, None, None, None


class _Conv2dWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, weight, bias, stride, padding, dilation, groups, handoff, rebuild, *sources):  # type: ignore[override]
        ctx.mark_dirty(y)
        ctx.args = (list(stride), list(padding), list(dilation), groups)
        ctx.handoff = handoff
        ctx.bias_sizes = [bias.shape[0]] if bias is not None else None
        ctx.in_shape = x.shape
        _save_input(ctx, x if ctx.needs_input_grad[2] else None, rebuild, sources, weight)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, (weight,) = _saved_input(ctx)
        stride, padding, dilation, groups = ctx.args
        need_w = x is not None
        need_b = ctx.bias_sizes is not None and ctx.needs_input_grad[3]
        gw = gb = None
        if need_w or need_b:
            if x is None:
                x = grad.new_empty(()).expand(ctx.in_shape)  # never read: only the bias gradient is asked for
            _, gw, gb = torch.ops.aten.convolution_backward(
                grad, x, weight, ctx.bias_sizes, stride, padding, dilation, False, [0, 0], groups,
                [False, need_w, need_b],
            )
        if need_w and ctx.handoff:
            # held until the input gradient's backward, next: the stock conv holds its input as long, and the
            # input gradient needs an input-shaped tensor (a recomputed unit's first forward's input is gone)
            ctx.handoff[0] = x
        return (grad, None, gw, gb, None, None, None, None, None, None) + (None,) * ctx.sources


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> torch.Tensor:
    """``F.conv2d`` (numeric padding) with the split backward of :func:`linear`: weight gradient first, input freed,
    then the input gradient. Same saved tensors as the stock op; output and gradients bitwise identical on CPU."""
    if not torch.is_grad_enabled() or isinstance(padding, str) or x.dim() != 4:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    amp = _autocast_dtype(x)
    if amp is not None:  # conv2d is a lower-precision autocast op on every device
        x, weight, bias = _cast(amp, x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            return conv2d(x, weight, bias, stride, padding, dilation, groups)
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    handoff: list = []  # type: ignore[type-arg]
    y = _Conv2dInputGrad.apply(x, weight, bias, s, p, d, groups, handoff)
    if not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return y
    return _Conv2dWeightGrad.apply(y, x, weight, bias, s, p, d, groups, handoff, *_rebuild_args(x, weight))


def _rebuild_args(x: torch.Tensor, weight: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    """The weight-gradient Function's last arguments: the recipe rebuilding ``x`` (or None) and the tensors it reads
    (:mod:`.rebuild`), when the weight gradient will read ``x``."""
    rebuild = rebuild_of(x) if weight.requires_grad else None
    return (None,) if rebuild is None else (rebuild.fn, *rebuild.inputs)


def _save_input(ctx: Any, x: torch.Tensor | None, rebuild: Any, sources: tuple, *more: torch.Tensor) -> None:
    """Save the weight gradient's input ``x`` and ``more``, or, where ``x`` is rebuildable (:mod:`.rebuild`), the
    recipe's ``sources`` in its place (saved anyway by the layers that produced ``x``)."""
    ctx.rebuild = rebuild if x is not None else None
    ctx.sources = len(sources)  # Function inputs, each with a None gradient
    ctx.save_for_backward(*((x,) if ctx.rebuild is None else sources), *more)
    ctx.more = len(more)


def _saved_input(ctx: Any) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """What :func:`_save_input` saved: the input (rebuilt if need be) and the rest."""
    saved = ctx.saved_tensors
    head, more = saved[: len(saved) - ctx.more], saved[len(saved) - ctx.more:]
    return (head[0] if ctx.rebuild is None else ctx.rebuild(*head)), more


# ----------------------------------------------------------------------------------------------------------------
# pointwise functions kept as their input, recomputed in backward


class _RecomputedPointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):  # type: ignore[override]
        ctx.fn = fn
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        create = torch.is_grad_enabled()
        xi = x if create else x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(xi)
        (gx,) = torch.autograd.grad(y, xi, grad, create_graph=create)
        return gx, None


def recompute_pointwise(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` saving only ``x``: backward runs ``fn`` once more on ``x`` and differentiates it.

    For elementwise functions written as several ops (``0.5 * x * (1 + tanh(...))`` saves ``x``, ``x ** 3``'s
    input, the tanh output and more); ``fn`` must be deterministic and must not modify ``x``. The output is
    bitwise ``fn(x)`` and the gradient bitwise autograd's, at the price of one more evaluation of ``fn``.

    >>> x = torch.randn(4, requires_grad=True)
    >>> y = recompute_pointwise(lambda t: t * torch.sigmoid(1.702 * t), x)
    """
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fn(x)
    return _RecomputedPointwise.apply(x, fn)
