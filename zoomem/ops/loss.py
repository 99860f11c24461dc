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
it is). The ``cross_entropy_logits`` implementation (:mod:`zoomem.ops.impls`, :func:`routed_forward`) routes the
calls an HF model's forward makes once its LM head has run: through HF's ``loss_function`` (GPT-2, Llama) or
``nn.CrossEntropyLoss`` in ``forward`` itself (``BertForMaskedLM``, RoBERTa, T5, BART).

Where the logits are the output of the model's output-embeddings ``nn.Linear`` (recorded by a forward hook that
the implementation installs, :func:`record_head`), the loss runs :class:`LinearCrossEntropy` instead: the
gradient goes straight to the head's input and weight, a slice of the vocabulary at a time (logits that are that
output plus a constant, as BART's ``final_logits_bias``, count as that output), so no logits-sized
gradient ever exists (GPT-2 at batch 2, sequence 512: 196 MiB less at the head's backward, and no 196 MiB of
log-probabilities in forward). Its loss and gradients differ from stock's in the last bits (~1e-7 relative).
Under bf16/fp16 autocast, or with bf16/fp16 weights, HF's loss first upcasts the head's logits to an fp32 copy
(twice their bytes) and the stock cross-entropy keeps fp32 log-probabilities; the fused loss reads the low-precision
logits themselves instead (recognising the copy by its autograd node), forms ``softmax - onehot`` in fp32 a slice
at a time and runs the products in the head's dtype, as autocast's backward does: neither the copy nor anything
fp32 of the logits' size is kept.

With :func:`set_skip_logits` (``zoomem.wrap(skip_logits=True)``) the fused loss saves no logits: its backward
makes each slice again from the head's input and weight (one more head-sized product per step), and the model's
forward returns its output with ``logits=None`` (:func:`routed_forward`), as Liger-Kernel's fused loss does in
training. In a forward with ``labels`` the head (an ``nn.Linear``) does not even make them: it returns a
:class:`~zoomem.ops.deferred.DeferredLogits` stand-in, and the loss makes the slices from the head's input in
forward too, so the ``batch x sequence x vocabulary`` tensor never exists; a constant row added to it (BART's
``final_logits_bias``) joins the head's bias in those products. Logits the head does not make by itself otherwise
(Gemma-2's soft-capped ones; BART's sum under autocast, fp32 over bf16 products) are made where the model reads
them, kept and returned as before.

A head tied to the input embedding (GPT-2, T5, tied Llamas) gets its weight's gradient twice: from the head, then
from the embedding, whose stock backward allocates a second vocabulary-sized tensor to add to the first (147 MiB
for GPT-2, at the end of backward, with every gradient alive). Where the embedding runs :func:`tied_embedding`
(the ``embedding_tied_grad`` implementation) and feeds the head's input, :class:`LinearCrossEntropy` hands its
weight gradient to that embedding's backward, which adds its rows into it in place and returns the sum: one
vocabulary-sized tensor instead of two. The hand-over is keyed by the backward pass (a pass that does not run the
embedding's backward never sees it) and off under ``create_graph``.
"""

from __future__ import annotations

import contextlib
import weakref
from types import MethodType
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from ..autograd_graph import autograd_nodes
from .deferred import DeferredLogits, defer, is_deferred, materialize, offsets, root
from .functional import _kernel_value
from .routing import RoutingMode

__all__ = [
    "CrossEntropy",
    "LinearCrossEntropy",
    "route_cross_entropy",
    "cross_entropy",
    "record_head",
    "routed_forward",
    "tied_embedding",
    "set_skip_logits",
    "skips_logits",
    "sensitivity_pass",
]

_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for ``[N, C]`` logits and ``[N]``
    class indices, saving the logits and the targets; twice differentiable."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):  # type: ignore[override]
        loss = F.nll_loss(torch.log_softmax(logits, 1), target, ignore_index=ignore_index, reduction=reduction)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        ctx.save_for_backward(logits, target)
        ctx.sensitivity_pass = _SENSITIVITY_PASS
        # the logits reach the gradient through exp(): rounding them is not a small perturbation (zoomem.runtime.probe)
        ctx.exact_reads = (0,)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, target = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        safe, scale = _row_scale(target, grad, ctx.ignore_index, ctx.reduction, logits.dtype)
        safe, scale = safe.unsqueeze(1), scale.unsqueeze(1)
        if torch.is_grad_enabled() and not _constant_in_sensitivity_pass(ctx, grad):
            # create_graph: out-of-place, differentiable in logits and grad
            onehot = torch.zeros_like(logits).scatter(1, safe, 1.0)
            return (torch.softmax(logits, 1) - onehot) * scale, None, None, None
        with torch.no_grad():  # (in a sensitivity pass, values without their graph)
            g = torch.softmax(logits, 1)
            g.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=g.dtype))
            return g.mul_(scale), None, None, None


def _row_scale(target: torch.Tensor, grad: torch.Tensor, ignore_index: int, reduction: str,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the class index to subtract one at (0 where ignored) and the factor of ``softmax - onehot``."""
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))
    if reduction == "none":
        step = grad
    else:
        step = grad / valid.sum().to(dtype) if reduction == "mean" else grad
    scale = torch.where(valid, step, torch.zeros((), dtype=step.dtype, device=step.device)).to(dtype)
    return safe, scale


_CHUNK_ELEMENTS = 1 << 20
"""The smallest slice of logits :class:`LinearCrossEntropy` works on at once (4 MiB in fp32)."""


def _slices(total: int, rows: int, cols_of_row: int) -> int:
    """How many of ``total`` columns (or rows) to take at once so a slice holds about as many elements as the
    head's input (``rows x cols_of_row``), at least :data:`_CHUNK_ELEMENTS` (GPT-2 at 2 x 512 tokens: 50 slices of
    1,024 of its 50,257 columns)."""
    return max(1, min(total, max(_CHUNK_ELEMENTS, rows * cols_of_row) // max(1, rows)))


class LinearCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` for an LM head whose ``[N, V]`` logits already exist
    (the model's output): the loss comes from the given logits, the gradient goes to ``hidden``, ``weight`` and
    ``bias`` directly, a slice of ``V`` at a time, never through a logits-sized gradient. Saves the logits, their
    per-row log-sum-exp, ``hidden`` and the targets (the logits and ``hidden`` are alive anyway: the output, and
    what the head's own ``Linear`` keeps). Twice differentiable (``create_graph`` recomputes the logits)."""

    @staticmethod
    def forward(ctx, logits, hidden, weight, bias, target, ignore_index, reduction,  # type: ignore[override]
                matmul_dtype=None, keep_logits=True):
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))
        if logits is None:  # a deferred head (zoomem.ops.deferred): its products made here, a slice at a time
            cdt = torch.promote_types(matmul_dtype, torch.float32)
            lse, picked = _head_lse(hidden.reshape(-1, hidden.shape[-1]), weight, bias, safe, valid, matmul_dtype,
                                    cdt)
        else:
            cdt = _compute_dtype(logits)
            rows = _slices(logits.shape[0], logits.shape[1], 1)
            lse = torch.empty(logits.shape[0], dtype=cdt, device=logits.device)
            for r in range(0, logits.shape[0], rows):  # logsumexp's exp(x - max): a temporary of its input's size
                torch.logsumexp(logits[r:r + rows].to(cdt), 1, out=lse[r:r + rows])
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1).to(cdt)
        nll = torch.where(valid, lse - picked, torch.zeros((), dtype=cdt, device=lse.device))
        if reduction == "mean":
            loss = nll.sum() / valid.sum().to(cdt)
        else:
            loss = nll.sum() if reduction == "sum" else nll
        ctx.ignore_index, ctx.reduction, ctx.has_bias = ignore_index, reduction, bias is not None
        ctx.matmul_dtype, ctx.sensitivity_pass = matmul_dtype, _SENSITIVITY_PASS
        ctx.embedding = _tied_embedding_node(hidden, weight) if weight.requires_grad else None
        # without the logits (skip_logits): backward makes each slice again from hidden and the weight
        ctx.save_for_backward(logits if keep_logits else None, lse, hidden, weight, bias, target)
        # they reach the gradient through exp() (zoomem.runtime.probe): the logits, or the hidden states they are
        # made again from, and the log-sum-exp
        ctx.exact_reads = (0, 1) if keep_logits else (1, 2)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, lse, hidden, weight, bias, target = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        need_b = need_b and ctx.has_bias
        safe, scale = _row_scale(target, grad, ctx.ignore_index, ctx.reduction, lse.dtype)
        h = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            grad_h, grad_w, grad_b = _sliced_grads(logits, lse, h, weight, safe, scale, need_h, need_w, need_b,
                                                   ctx.matmul_dtype, bias)
            grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
            grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        if torch.is_grad_enabled() and _constant_in_sensitivity_pass(ctx, grad):
            # rounding the stored hidden states (where the logits are kept: else they stay exact) moves only the
            # weight's gradient g^T h; g comes from the exact logits
            if grad_w is not None and logits is not None and hidden.requires_grad:
                grad_w = _WeightGradOfHidden.apply(grad_w, h, logits, lse, safe, scale, ctx.matmul_dtype)
        elif torch.is_grad_enabled():  # create_graph: these values, carrying the graph of the logits recomputed
            hc, wc = h.to(lse.dtype), weight.to(lse.dtype)
            z = F.linear(hc, wc, bias.to(lse.dtype) if bias is not None else None)
            # the saved logits' values (a constant added after the head, BART's final_logits_bias, included),
            # the recomputed ones' graph
            g = torch.softmax(z if logits is None else logits.to(lse.dtype) + (z - z.detach()), 1)
            g = (g - torch.zeros_like(g).scatter(1, safe.unsqueeze(1), 1.0)) * scale.unsqueeze(1)
            grad_h = _kernel_value(grad_h, g @ wc if need_h else None)
            grad_w = _kernel_value(grad_w, g.t() @ hc if need_w else None)
            grad_b = _kernel_value(grad_b, g.sum(0) if need_b else None)
        elif grad_w is not None and ctx.embedding is not None:  # the tied embedding's backward adds to it, returns it
            ctx.embedding.pending = (torch._C._current_graph_task_id(), grad_w)
            grad_w = None
        return (None, grad_h.view(hidden.shape) if grad_h is not None else None, grad_w, grad_b, None, None, None,
                None, None)


_SENSITIVITY_PASS = False


@contextlib.contextmanager
def sensitivity_pass() -> Iterator[None]:
    """Inside the block, the losses made here (:class:`CrossEntropy`, :class:`LinearCrossEntropy`) keep from a
    ``create_graph`` backward only the graph a sensitivity pass (:func:`zoomem.compress.estimate_sensitivity`)
    follows: how their gradients move when a saved tensor that may be stored lossily is rounded. Their logits, and
    without the logits the hidden states and log-sum-exp, stay exact (``exact_reads``), so their input gradients are
    constants there, and the head's weight gradient ``g^T h`` depends on the stored ``h`` alone
    (:class:`_WeightGradOfHidden`).

    Why: the full second derivative recomputes the logits and holds three ``[N, V]`` tensors for the second backward
    (their softmax, ``softmax - onehot`` and the logits themselves): GPT-2 at 8 x 512 tokens, 3 x 785 MiB. Not for
    users' own double backward (gradient penalties): that needs the full derivative, which the losses give outside
    the block."""
    global _SENSITIVITY_PASS
    previous, _SENSITIVITY_PASS = _SENSITIVITY_PASS, True
    try:
        yield
    finally:
        _SENSITIVITY_PASS = previous


def _constant_in_sensitivity_pass(ctx: Any, grad: torch.Tensor) -> bool:
    """Whether a loss made under :func:`sensitivity_pass` gives its backward's values without their graph: the
    incoming gradient is a constant there (the loss is the output; a gradient that itself carries a graph, a loss
    inside a larger expression of saved tensors, gets the full derivative)."""
    return getattr(ctx, "sensitivity_pass", False) and not grad.requires_grad


class _WeightGradOfHidden(torch.autograd.Function):
    """The head's weight gradient ``g^T h`` (given: ``grad_w``) as a function of ``h`` alone, ``g`` the constant
    ``(softmax(logits) - onehot) * scale``: the gradient reaching ``h`` is ``g @ v``, made a slice of the vocabulary
    at a time from the saved logits (:func:`_sliced_grads` with ``v`` for the weight), never ``[N, V]`` at once."""

    @staticmethod
    def forward(ctx, grad_w, h, logits, lse, safe, scale, matmul_dtype):  # type: ignore[override]
        ctx.save_for_backward(h, logits, lse, safe, scale)
        ctx.matmul_dtype = matmul_dtype
        return grad_w

    @staticmethod
    def backward(ctx, v):  # type: ignore[override]
        h, logits, lse, safe, scale = ctx.saved_tensors
        with torch.no_grad():
            grad_h, _, _ = _sliced_grads(logits, lse, h, v, safe, scale, True, False, False, ctx.matmul_dtype)
        return None, grad_h.to(h.dtype), None, None, None, None, None


def _sliced_grads(logits: torch.Tensor | None, lse: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                  safe: torch.Tensor, scale: torch.Tensor, need_h: bool, need_w: bool, need_b: bool,
                  matmul_dtype: torch.dtype | None = None,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """The gradients of :class:`LinearCrossEntropy`'s inputs, ``(softmax - onehot) * scale`` formed a slice of
    the vocabulary at a time: ``grad_h += g @ W[slice]``, ``grad_w[slice] = g^T @ h``, ``grad_b[slice] = sum g``.

    ``g`` is formed in the loss's precision (fp32 for bf16/fp16 logits); the products run in the head's matmul
    dtype (``matmul_dtype``, else the logits' dtype; bf16 under autocast: ``g``, ``h`` and the weight's slice cast
    to it, as autocast's backward does), ``grad_h`` summed over slices in the loss's precision. ``grad_h`` and
    ``grad_b`` come back in that precision, ``grad_w`` in the weight's dtype. Rows without a gradient (ignored targets) are left out of
    every product: masked-LM batches label about 15% of their tokens, so the head's two backward matmuls shrink
    by as much. Without ``logits`` (``skip_logits``) each slice is made again, ``h @ W[slice]^T + bias[slice]``
    in the matmul dtype (the head's forward, a slice at a time: one more head-sized product per step)."""
    mdt, cdt = matmul_dtype or (logits.dtype if logits is not None else h.dtype), lse.dtype
    same = mdt == cdt == weight.dtype == h.dtype
    grad_b = torch.empty(weight.shape[0], dtype=cdt, device=weight.device) if need_b else None
    grad_w = torch.empty_like(weight) if need_w else None
    rows = (scale != 0).nonzero().squeeze(1)  # rows with a gradient: an MLM batch labels ~15% of its tokens
    if rows.numel() == h.shape[0]:
        rows = None
    else:  # the others' rows of g are zero: skip them in every product (their grad_h rows stay exactly zero)
        full_h = torch.zeros(h.shape, dtype=cdt, device=h.device) if need_h else None
        h, lse, safe, scale = h.index_select(0, rows), lse[rows], safe[rows], scale[rows]
    grad_h = torch.zeros(h.shape, dtype=cdt, device=h.device) if need_h else None
    hm = h if same else h.to(mdt)
    vocab = weight.shape[0]
    cols = _slices(vocab, h.shape[0], h.shape[1])
    row_ids = torch.arange(h.shape[0], device=h.device)
    for v in range(0, vocab, cols):
        if logits is None:
            part = _head_slice(hm, weight, bias, mdt, v, cols)
        else:
            part = logits[:, v:v + cols] if rows is None else logits[:, v:v + cols].index_select(0, rows)
        g = torch.sub(part.to(cdt), lse.unsqueeze(1)).exp_()
        hit = (safe >= v) & (safe < v + g.shape[1])
        g.index_put_((row_ids[hit], safe[hit] - v), g.new_full((), -1.0), accumulate=True)
        g.mul_(scale.unsqueeze(1))
        if grad_b is not None:
            torch.sum(g, 0, out=grad_b[v:v + cols])
        if same:
            if grad_h is not None:
                grad_h.addmm_(g, weight[v:v + cols])
            if grad_w is not None:
                torch.mm(g.t(), h, out=grad_w[v:v + cols])
            continue
        g = g.to(mdt)
        if grad_h is not None:
            grad_h.add_(torch.mm(g, weight[v:v + cols].to(mdt)))
        if grad_w is not None:
            grad_w[v:v + cols].copy_(torch.mm(g.t(), hm))
    if rows is not None and grad_h is not None:
        grad_h = full_h.index_copy_(0, rows, grad_h)
    return grad_h, grad_w, grad_b


def _head_slice(hm: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mdt: torch.dtype, v: int,
                cols: int) -> torch.Tensor:
    """The head's product for vocabulary columns ``v:v + cols`` in ``mdt``: the one way both the forward without
    logits (:func:`_head_lse`) and the backward making them again (:func:`_sliced_grads`) make a slice, so the two
    agree bitwise where their rows and slices do."""
    return F.linear(hm, weight[v:v + cols].to(mdt), None if bias is None else bias[v:v + cols].to(mdt))


def _head_lse(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, safe: torch.Tensor,
              valid: torch.Tensor, mdt: torch.dtype, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``h``: the log-sum-exp of ``h @ W^T + b`` and its value at the target, made a slice of the
    vocabulary at a time (as :func:`_sliced_grads` makes them again in backward: the same rows, slices, dtypes and
    products) and merged with ``logaddexp``; rows whose target is ignored are left out (zeros), as backward leaves
    them out, so a masked-LM batch runs about 15% of the head's product."""
    lse = torch.zeros(h.shape[0], dtype=cdt, device=h.device)
    picked = torch.zeros(h.shape[0], dtype=cdt, device=h.device)
    rows = valid.nonzero().squeeze(1)
    if rows.numel() == 0:
        return lse, picked
    if rows.numel() == h.shape[0]:
        rows = None
    else:
        h, safe = h.index_select(0, rows), safe[rows]
    hm = h if h.dtype == mdt else h.to(mdt)
    acc = torch.full((h.shape[0],), float("-inf"), dtype=cdt, device=h.device)
    got = torch.zeros(h.shape[0], dtype=cdt, device=h.device)
    row_ids = torch.arange(h.shape[0], device=h.device)
    vocab = weight.shape[0]
    cols = _slices(vocab, h.shape[0], h.shape[1])
    with torch.autocast(h.device.type, enabled=False):  # the products in mdt, as the head's forward ran them
        for v in range(0, vocab, cols):
            part = _head_slice(hm, weight, bias, mdt, v, cols)
            z = part.to(cdt)
            torch.logaddexp(acc, torch.logsumexp(z, 1), out=acc)
            hit = (safe >= v) & (safe < v + z.shape[1])
            got[hit] = z[row_ids[hit], safe[hit] - v]
    if rows is None:
        return acc, got
    return lse.index_copy_(0, rows, acc), picked.index_copy_(0, rows, got)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """The loss's precision: fp32 for bf16/fp16 logits (HF upcasts them before its cross-entropy), else theirs."""
    return torch.promote_types(logits.dtype, torch.float32)


class _TiedEmbedding(torch.autograd.Function):
    """``torch.embedding`` whose backward adds its rows in place into a weight gradient handed over by a tied LM
    head in the same backward pass, else runs aten's dense embedding backward (bitwise stock)."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx):  # type: ignore[override]
        ctx.padding_idx, ctx.num_weights, ctx.pending = padding_idx, weight.shape[0], None
        ctx.weight = weakref.ref(weight)  # which weight: the head looks for its own
        _EMBEDDED[id(weight)] = weight
        ctx.save_for_backward(indices)
        return torch.embedding(weight, indices, padding_idx)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        pending, ctx.pending = ctx.pending, None
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if pending is not None and pending[0] == torch._C._current_graph_task_id() and not torch.is_grad_enabled():
            grad_w, rows, values = pending[1], indices.reshape(-1), grad.reshape(-1, grad.shape[-1])
            if ctx.padding_idx >= 0:
                keep = rows != ctx.padding_idx
                rows, values = rows[keep], values[keep]
            return grad_w.index_add_(0, rows, values.to(grad_w.dtype)), None, None
        return torch.ops.aten.embedding_dense_backward(grad, indices, ctx.num_weights, ctx.padding_idx, False), \
            None, None


def tied_embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(indices, weight, padding_idx)`` that can take a tied LM head's weight gradient and add its own
    rows into it in place (see the module docstring); otherwise exactly the stock op."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return F.embedding(indices, weight, padding_idx)
    pad = -1 if padding_idx is None else (padding_idx if padding_idx >= 0 else weight.shape[0] + padding_idx)
    return _TiedEmbedding.apply(weight, indices, pad)


_WALK_LIMIT = 1 << 16
"""Autograd nodes :func:`_tied_embedding_node` visits at most looking for the embedding (GPT-2: about 40 per layer)."""


_EMBEDDED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""id -> weight, for every weight a :func:`tied_embedding` has looked up: an untied head's weight is not in it, so
its loss never walks the graph (1.5 ms a step on a 12-layer GPT-2 on this CPU)."""


def _tied_embedding_node(hidden: torch.Tensor, weight: torch.Tensor) -> Any:
    """The backward node of a :func:`tied_embedding` of ``weight`` that ``hidden`` was computed from, or None."""
    if _EMBEDDED.get(id(weight)) is not weight:
        return None
    for number, node in enumerate(autograd_nodes(hidden.grad_fn)):
        if number >= _WALK_LIMIT:
            break
        if isinstance(node, _TiedEmbedding._backward_cls) and node.weight() is weight:
            return node
    return None


_HEAD_IO: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any, int, Any]]" = weakref.WeakKeyDictionary()
"""Output-embeddings module -> (weak output, weak input, output version, the head's dtype where the output is an
fp32 sum of its bf16/fp16 result and a constant, else ``None``) of its last training forward."""


def _head_ran(module: nn.Module, args: tuple, output: Any) -> None:
    if isinstance(output, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and output.requires_grad:
        _HEAD_IO[module] = (weakref.ref(output), weakref.ref(args[0]), output._version, None)
    window = _WINDOWS.get(module)
    if window is not None:
        if args and isinstance(args[0], torch.Tensor):
            window.head_input = args[0]
        if not window.open:  # the loss comes after the head: route from here on
            window.mode.__enter__()
            window.open = True


class _Window:
    """The stretch of one model forward from its LM head's forward to the forward's end, during which
    ``F.cross_entropy`` calls are routed (the mode is entered by the head's hook, left by :func:`routed_forward`)."""

    def __init__(self, head: nn.Module, skip_logits: bool = False) -> None:
        self.mode = route_cross_entropy(head, skip_logits)
        self.open = False
        self.deferred: list[weakref.ref] = []  # type: ignore[type-arg]  (the head outputs it stood in for)
        # the head's input, held to the forward's end: the fused loss needs it, and where the head's Linear stores
        # it lossily (a compression level) nothing else may (BertForMaskedLM's head reassigns its variable); the
        # plan's forward, recording, held it, so its loss was fused and a training forward's must be too
        self.head_input: torch.Tensor | None = None

    def close(self) -> None:
        self.head_input = None
        if not self.open:
            return
        self.open = False
        depth = torch._C._len_torch_function_stack()
        if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not self.mode:
            raise RuntimeError(
                "zoomem: a torch function mode entered inside the model's forward after its LM head ran is still "
                "active when the forward returns; zoomem cannot leave its loss routing without corrupting the mode "
                "stack. Leave such a mode before the forward returns, or unwrap the model.")
        self.mode.__exit__(None, None, None)


_WINDOWS: "weakref.WeakKeyDictionary[nn.Module, _Window]" = weakref.WeakKeyDictionary()
"""LM head -> the routing window of the model forward running now (set by :func:`routed_forward`)."""


def record_head(model: nn.Module) -> Callable[[], None]:
    """Setup of the ``cross_entropy_logits`` implementation: a forward hook on ``model``'s output embeddings
    noting, weakly, its last output and input (so the loss can tell whether the logits it gets are that output,
    and then run :class:`LinearCrossEntropy`), and opening the routing window of :func:`routed_forward`. Returns
    the undo (the hook removed)."""
    head = _output_embeddings(model)
    if head is None:
        return lambda: None
    handle = head.register_forward_hook(_head_ran)

    def undo() -> None:
        handle.remove()
        _HEAD_IO.pop(head, None)

    return undo


def _root(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DeferredLogits):
        return root(t)
    return t._base if t._base is not None else t


def _head_of(logits: torch.Tensor, head: nn.Module | None) -> tuple[torch.Tensor, nn.Linear, torch.Tensor, Any] | None:
    """``(hidden, head, rows, matmul dtype)`` when the 2-D ``logits`` are, unchanged, the rows of ``head``'s last
    output, or their upcast copy (``.float()`` of bf16/fp16 logits, as HF's losses make): ``rows`` is the output
    itself, viewed ``[N, V]``; the products of the backward run in the matmul dtype (``None``: the rows')."""
    record = _HEAD_IO.get(head) if head is not None else None
    if record is None:
        return None
    out, hidden, head_dtype = record[0](), record[1](), record[3]
    if (out is None or hidden is None or not isinstance(head, nn.Linear) or out._version != record[2]
            or not out.is_contiguous() or logits.shape != (out.numel() // out.shape[-1], out.shape[-1])
            or hidden.shape[:-1] != out.shape[:-1] or head.weight.shape != (out.shape[-1], hidden.shape[-1])):
        return None
    root = _root(logits)
    if root is _root(out) and logits.data_ptr() == out.data_ptr():
        same = True
    else:  # HF's `logits.float()`: a copy whose autograd node reads the head's output
        node = root.grad_fn
        same = False
        if (node is None or node.name() != "ToCopyBackward0" or node.next_functions[0][0] is not out.grad_fn
                or root.shape != out.shape or not root.is_contiguous() or logits.data_ptr() != root.data_ptr()
                or out.dtype not in (torch.bfloat16, torch.float16) or root.dtype != torch.float32):
            return None
    if torch.is_autocast_enabled(out.device.type):  # the head ran in autocast's dtype, whatever its operands'
        if (head_dtype or out.dtype) != torch.get_autocast_dtype(out.device.type):
            return None
    elif (head_dtype is not None or hidden.dtype != out.dtype or head.weight.dtype != out.dtype
          or not out.is_floating_point()):
        return None
    if same and out.dtype not in (torch.float32, torch.float64):
        return None  # a loss over bf16 logits as they are: stock's precision, not this one's
    return hidden, head, out.view(logits.shape), head_dtype


_OFFSET: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""id -> head outputs plus a constant (:func:`_note_constant_added`) standing for the head's output."""


_ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})


def _note_constant_added(head: nn.Module, result: Any, args: tuple, kwargs: dict) -> Any:
    """After ``head``'s output ``+ c`` with a ``c`` that needs no gradient (BART, mBART, Marian and Pegasus add
    their ``final_logits_bias`` buffer to the LM head's output), the sum stands for the head's output: its gradient
    is the output's, so the fused loss may read the sum as its logits (the output itself is then freed)."""
    record = _HEAD_IO.get(head)
    out = record[0]() if record is not None else None
    if (out is None or len(args) != 2 or kwargs.get("alpha", 1) != 1 or set(kwargs) - {"alpha"}
            or not isinstance(result, torch.Tensor) or out._version != record[2]):
        return result
    other = args[1] if args[0] is out else args[0] if args[1] is out else None
    if (other is None or (isinstance(other, torch.Tensor) and other.requires_grad) or result.shape != out.shape
            or record[3] is not None):
        return result
    if result.dtype == out.dtype:
        head_dtype = None
    elif out.dtype in (torch.bfloat16, torch.float16) and result.dtype == torch.float32:
        head_dtype = out.dtype  # bf16 logits (autocast) plus an fp32 buffer: an fp32 sum, the head's products bf16
    else:
        return result
    _HEAD_IO[head] = (weakref.ref(result), record[1], result._version, head_dtype)
    _OFFSET[id(result)] = result  # not the head's product itself: skip_logits could not make it again from the head
    return result


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

    def __init__(self, head: nn.Module | None = None, skip_logits: bool = False) -> None:
        super().__init__()
        self.head = head  # the model's output embeddings: logits that are its output go through LinearCrossEntropy
        self.skip_logits = skip_logits
        self.unsaved: list[weakref.ref] = []  # type: ignore[type-arg]  (logits a fused loss left unsaved)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _ADDS and self.head is not None:  # the head's output plus a constant stands for the output
            kwargs = kwargs or {}
            return _note_constant_added(self.head, func(*args, **kwargs), args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def route(self, input: Any, target: Any, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
              reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
        if (weight is not None or size_average is not None or reduce is not None or label_smoothing != 0.0
                or reduction not in _REDUCTIONS or not isinstance(input, torch.Tensor)
                or not isinstance(target, torch.Tensor) or input.dim() != 2 or target.dim() != 1
                or target.dtype != torch.long or not input.requires_grad or not torch.is_grad_enabled()):
            return None
        if isinstance(input, DeferredLogits):
            call, added = input._zm_call, offsets(input)
            if (not is_deferred(input) or call.owner is not self.head
                    or input.dtype not in (torch.float32, torch.float64)
                    or input.shape[0] != call.hidden.numel() // call.hidden.shape[-1]
                    or (added and call.matmul_dtype != input.dtype)):  # (a constant on autocast's output: made)
                return None  # runs as it is, on the head's output made now
            self.unsaved.append(weakref.ref(root(input)))
            bias = self.head.bias
            for c in added:  # the head's product plus its bias plus the constants: one bias
                bias = c.reshape(-1) if bias is None else bias + c.reshape(-1)
            return LinearCrossEntropy.apply(None, call.hidden, self.head.weight, bias, target,
                                            int(ignore_index), reduction, call.matmul_dtype, False)
        fused = _head_of(input, self.head)
        if fused is not None:  # the logits as the head made them (bf16 under autocast), not HF's fp32 copy
            hidden, head, logits, matmul_dtype = fused
            keep = not self.skip_logits or _OFFSET.get(id(_root(logits))) is _root(logits)
            if not keep:  # the model's output logits, and HF's fp32 copy of them, need not outlive the forward
                self.unsaved += [weakref.ref(_root(logits)), weakref.ref(_root(input))]
            return LinearCrossEntropy.apply(logits.detach(), hidden, head.weight, head.bias, target,
                                            int(ignore_index), reduction, matmul_dtype, keep)
        if input.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled(input.device.type):
            return None
        return CrossEntropy.apply(input, target, int(ignore_index), reduction)


def routed_forward(model: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The ``cross_entropy_logits`` implementation: ``model``'s forward, with the ``F.cross_entropy`` calls made
    after its LM head (output embeddings) has run routed through :func:`cross_entropy` or
    :class:`LinearCrossEntropy`, whether HF's ``loss_function`` makes them (GPT-2, Llama) or the forward itself
    (``BertForMaskedLM``, T5, RoBERTa). The routing starts at the head, not with the forward: a
    ``TorchFunctionMode`` costs every torch call it sees (about 10% of GPT-2's forward on CPU), and nothing
    before the head is a loss over the vocabulary; nor is anything there recomputed by a unit, which runs
    without the routing in backward."""
    head = _output_embeddings(model)
    if head is None:
        return original(*args, **kwargs)
    skip = skips_logits(model)
    forward, to_fp32 = _inside_fp32_outputs(original) if skip else (original, None)
    previous = _WINDOWS.get(head)
    window = _WINDOWS[head] = _Window(head, skip)
    undefer = (_defer_head(head, window) if skip and kwargs.get("labels") is not None and type(head) is nn.Linear
               and torch.is_grad_enabled() else None)
    try:
        output = _without_unsaved_logits(forward(*args, **kwargs), window.mode.unsaved)
        if any(ref() is not None for ref in window.deferred):
            output = _made_now(output, window.deferred)
        return output if to_fp32 is None else to_fp32(output)
    finally:
        try:
            window.close()
        finally:
            if undefer is not None:
                undefer()
            if previous is not None:
                _WINDOWS[head] = previous
            else:
                _WINDOWS.pop(head, None)


def _made_now(output: Any, deferred: list[weakref.ref]) -> Any:  # type: ignore[type-arg]
    """``output`` with the head outputs it holds made and in place of their stand-ins (a tuple output with
    ``return_dict=False``), and every other stand-in still held elsewhere (a hook's) made too: after the forward
    nothing may stand for logits, whose values would depend on weights an optimizer step changes."""
    output = pytree.tree_map_only(DeferredLogits, materialize, output)
    for ref in deferred:
        held = ref()
        if held is not None:
            materialize(held)
    return output


def _defer_head(head: nn.Linear, window: _Window) -> Callable[[], None]:
    """Make ``head`` (an ``nn.Linear``) return a :class:`~zoomem.ops.deferred.DeferredLogits` for this forward
    where :func:`_head_dtype` allows, so that with ``skip_logits`` the fused loss computes from its input and the
    ``batch x sequence x vocabulary`` output never exists; returns the undo (its forward as it was)."""
    previous = head.__dict__.get("forward")
    inner = previous if previous is not None else head.forward

    def forward(input: torch.Tensor) -> torch.Tensor:
        dtype = _head_dtype(head, input) if _WINDOWS.get(head) is window else None
        if dtype is None:
            return inner(input)
        stand_in = defer(head, inner, input, head.weight, dtype)
        window.deferred.append(weakref.ref(stand_in))
        return stand_in

    head.forward = forward

    def undo() -> None:
        if previous is None:
            head.__dict__.pop("forward", None)
        else:
            head.forward = previous

    return undo


_HEAD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _head_dtype(head: nn.Linear, input: Any) -> torch.dtype | None:
    """The dtype ``head(input)`` would run its product in (autocast's where on), or ``None`` where its output is
    not one :class:`LinearCrossEntropy` can compute from ``input`` (not a plain strided tensor, no gradient, mixed
    dtypes or devices)."""
    w, b = head.weight, head.bias
    if (type(input) is not torch.Tensor or not isinstance(w, torch.Tensor) or type(w.data) is not torch.Tensor
            or not torch.is_grad_enabled() or not (input.requires_grad or w.requires_grad)
            or input.dim() < 2 or input.shape[-1] != w.shape[1] or input.device != w.device
            or input.layout != torch.strided or w.layout != torch.strided or (b is not None and b.device != w.device)):
        return None
    dtypes = {input.dtype, w.dtype} | ({b.dtype} if b is not None else set())
    if not dtypes <= set(_HEAD_DTYPES):
        return None
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type) if torch.float64 not in dtypes else None
    return w.dtype if len(dtypes) == 1 else None


_SKIP_LOGITS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Models whose training forward, where the fused loss runs, returns no logits (:func:`set_skip_logits`)."""


def set_skip_logits(model: nn.Module, skip: bool) -> None:
    """Whether ``model``'s forward, where ``cross_entropy_logits`` fuses its loss with the LM head, returns its
    output without the logits (``logits=None``, as Liger-Kernel's fused loss does in training): the loss saves no
    logits then, its backward makes each slice of them again from the head's input and weight (one more head-sized
    product per step), and nothing holds the ``batch x sequence x vocabulary`` tensor past the forward. A PEFT
    wrapper's setting is its ``PreTrainedModel``'s too: that is the module whose forward runs the fused loss."""
    from ..adapters.transformers import hf_core

    for m in {model, hf_core(model) or model}:
        if skip:
            _SKIP_LOGITS.add(m)
        else:
            _SKIP_LOGITS.discard(m)


def skips_logits(model: nn.Module) -> bool:
    """Whether :func:`set_skip_logits` is on for ``model``."""
    return model in _SKIP_LOGITS


def _without_unsaved_logits(output: Any, unsaved: list[weakref.ref]) -> Any:  # type: ignore[type-arg]
    """``output`` (an HF ``ModelOutput``) again with ``logits=None`` when they are what a fused loss of this forward
    left unsaved; anything else as it is."""
    logits = getattr(output, "logits", None)
    if not unsaved or not isinstance(logits, torch.Tensor) or not hasattr(output, "keys"):
        return output
    if not any(ref() is _root(logits) for ref in unsaved):
        return output
    fields = {key: value for key, value in output.items() if key != "logits"}
    return type(output)(**fields)


def _inside_fp32_outputs(forward: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[[Any], Any] | None]:
    """``forward`` without Accelerate's mixed-precision wrapper that turns its half-precision outputs into float32
    copies, and that conversion, to apply after the unsaved logits are dropped; else ``(forward, None)``.

    ``zoomem.accelerate.prepare`` wraps after ``accelerator.prepare``, so the model forward zoomem calls is
    Accelerate's: under ``mixed_precision`` its output conversion would copy the bf16 logits to float32 at the end
    of the forward (twice their bytes, beside them) and return the copy, which this module does not know as the
    logits its loss left unsaved."""
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    inner = getattr(converter, "model_forward", None)
    if inner is None or type(converter).__name__ != "ConvertOutputsToFp32":
        return forward, None
    from accelerate.utils.operations import convert_to_fp32

    owner = getattr(forward, "__self__", None)
    return (inner if owner is None else MethodType(inner, owner)), convert_to_fp32


def _output_embeddings(model: Any) -> nn.Module | None:
    try:
        return model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - no accessor, no head to fuse with
        return None
