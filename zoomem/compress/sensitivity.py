"""Sensitivity of the parameter gradient to the storage of each saved tensor, from one double backward.

Storing tensor s with b-bit stochastic rounding adds independent noise of variance ``step_g**2 * p(1 - p)`` to each
of its elements (``step_g`` its group's step, ``p`` the fractional part; ``step_g**2 / 6`` on average). The
parameter gradient ``g`` depends on the saved values through the backward formulas, to first order linearly, so
the gradient variance it adds is

    V_s(b) = sum_i step_g(i)**2 / 6 * ||d g / d s_i||**2 = C_s / (2**b - 1)**2,
    C_s    = sum over groups of range_g**2 / 6 * sum_{i in g} ||d g / d s_i||**2.

GACT measures C_s one tensor at a time with extra passes. Here every C_s comes from the same three passes:
forward, backward with ``create_graph=True``, and one backward of ``v . g`` for a random sign vector ``v``
(Hutchinson: ``E_v[(J_s^T v)_i**2] = ||J_s[:, i]||**2``). ``J_s^T v`` is the gradient reaching the saved value of s
*through its uses in the backward formulas* only: a pre-hook on the autograd node that produced s reads it there, and
every node of the forward graph stops what reaches it, so nothing flows on through the forward ops. Otherwise the
terms of tensors that are not hooked (the loss's own, exact ones) flowed into the nearest producer upstream: 4.1x
high on two linears under a squared loss, 1.07x now
(``tests/test_sensitivity.py::test_a_tensor_saved_through_several_views_counts_every_use``). A tensor saved through
several views (:func:`zoomem.runtime.probe._aliases`) sums what reaches each, element by element in its memory.

Known limit: first order. A saved value read through a comparison (a ReLU's mask from its output) has zero
derivative although rounding can flip the comparison, and one read through a reciprocal (a softmax denominator)
is far from linear at 2 bits; the probe (:mod:`zoomem.runtime.probe`) keeps such tensors exact. Second-order
terms of nonlinear backward formulas (LayerNorm's input) make the estimate conservative there.
"""

from __future__ import annotations


import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..autograd_graph import autograd_nodes
from .quantize import GROUP_SIZE, _grouped

logger = logging.getLogger(__name__)

__all__ = ["Sensitivity", "estimate_sensitivity", "empirical_variance", "perturbed_grads", "predicted_variance"]


@dataclass
class Sensitivity:
    """C_s per saved-tensor key, and the squared norm of the parameter gradient (to make variances relative)."""

    per_tensor: dict[str, float]
    grad_sq: float
    measured: bool = True  # False: a value-range proxy (the model has an op without a double backward)


def _range_proxy(saved: Mapping[str, torch.Tensor], range_sq: dict[str, torch.Tensor], grad_sq: float,
                 groups: Mapping[str, int]) -> dict[str, float]:
    """C_s as if every element's derivative norm were equal (scaled so the sum over elements is ||g||^2)."""
    numel = sum(t.numel() for t in saved.values()) or 1
    return {key: float(range_sq[key].sum()) * groups[key] / 6 * grad_sq / numel if key in range_sq else 0.0
            for key in saved}


def _group_range_sq(x: torch.Tensor, group_size: int) -> torch.Tensor:
    g, _ = _grouped(x.detach(), group_size)
    g = g.float()
    return (g.amax(dim=1) / 2 - g.amin(dim=1) / 2).square() * 4  # range**2 without overflow in hi - lo


def estimate_sensitivity(
    loss: torch.Tensor,
    params: Sequence[torch.Tensor],
    saved: Mapping[str, torch.Tensor],
    *,
    samples: int = 1,
    generator: torch.Generator | None = None,
    group_size: int = GROUP_SIZE,
    group_sizes: Mapping[str, int] | None = None,
    aliases: Mapping[str, Sequence[torch.Tensor]] | None = None,
    second_order: bool = True,
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Sensitivity:
    """C_s for every tensor in ``saved`` (see the module docstring), from ``samples`` Hutchinson probes.

    Args:
        loss: the scalar of a forward that saved ``saved`` (its graph not yet freed).
        params: the parameters whose gradient counts.
        saved: key -> the saved tensor (as the forward saved it; it must be a non-leaf).
        samples: sign vectors to average over (each costs one backward).
        generator: source of the signs (zoomem's own, the user's RNG stream is untouched).
        group_size: elements per quantization group; ``group_sizes``: key -> its own, where not ``group_size``.
        aliases: key -> other tensor objects saved as views of that tensor's memory, each with its own autograd
            node (the 2-D views of one input that query, key and value projections each save; a tensor saved beside
            a view of it). The stored value is theirs too, so its ``J^T v`` is the sum over them, element by element.
        second_order: ``False``: no second backward (the measurement did not fit in memory), each tensor's value
            range stands in (as for a model with an op that has no double backward; ``measured`` False).
        mean_over_ranks: in a data-parallel step, the mean over ranks of one rank's gradient of a parameter (every
            rank calls it for every parameter, in order): ``||g||**2`` is then that of the gradient the step averages.

    Returns:
        key -> C_s (0.0 for tensors the parameter gradient does not depend on), and ``||g||**2``.
    """
    params = [p for p in params if p.requires_grad]
    out = {key: 0.0 for key in saved}
    if not params:  # nothing to train: no gradient for rounding to disturb
        return Sensitivity(out, 0.0)
    if not second_order:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grad_sq = _grad_sq(params, grads, mean_over_ranks)
        del grads
        sizes = {key: (group_sizes or {}).get(key, group_size) for key in saved}
        ranges = {key: _group_range_sq(t, sizes[key]) for key, t in saved.items() if t.grad_fn is not None}
        return Sensitivity(_range_proxy(saved, ranges, grad_sq, sizes), grad_sq, measured=False)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    grad_sq = _grad_sq(params, grads, mean_over_ranks)
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None and g.requires_grad]
    by_node: dict[torch.autograd.graph.Node, list[tuple[int, str, _Layout]]] = {}
    reads: dict[str, int] = {}  # key -> how many autograd edges carry its J^T v
    for key, t in saved.items():
        if t.grad_fn is None:
            continue
        edges: set[tuple[int, int]] = set()
        for obj in (t, *(aliases or {}).get(key, ())):
            layout = _layout(t, obj)
            if obj.grad_fn is None or layout is None:
                continue
            edge = torch.autograd.graph.get_gradient_edge(obj)
            if (id(edge.node), edge.output_nr) in edges:
                continue
            edges.add((id(edge.node), edge.output_nr))
            by_node.setdefault(edge.node, []).append((edge.output_nr, key, layout))
        reads[key] = len(edges)
    if not pairs or not by_node:
        return Sensitivity(out, grad_sq)
    forward_nodes = _forward_nodes(loss)
    groups = {key: (group_sizes or {}).get(key, group_size) for key in saved}
    range_sq = {key: _group_range_sq(saved[key], groups[key]) for _, keys in by_node.items() for _, key, _ in keys}
    for i in range(samples):
        # drawn in the gradients' dtype (int64 draws were twice an fp32 gradient's bytes, and its copy once more)
        probe = sum(_SignedSum.apply(g, torch.randint(0, 2, g.shape, dtype=g.dtype, device=g.device,
                                                      generator=generator).mul_(2).sub_(1)) for _, g in pairs)
        captured: dict[str, torch.Tensor] = {}
        partial: dict[str, list] = {}  # type: ignore[type-arg]  # key -> [J^T v over its memory so far, edges seen]

        def reduce(key: str, grad: torch.Tensor) -> None:
            per_group, _ = _grouped(grad.float().square(), groups[key])
            captured[key] = (range_sq[key] * per_group.sum(dim=1)).sum()

        def finish(key: str) -> None:
            total = partial.pop(key)[0]
            if total is not None:
                t = saved[key]
                reduce(key, total.as_strided(t.shape, t.stride()))

        def make_hook(entries: list[tuple[int, str, _Layout]]) -> Callable:  # type: ignore[type-arg]
            def hook(grad_outputs: tuple) -> tuple:  # type: ignore[type-arg]
                for nr, key, (shape, stride, offset) in entries:  # reduced at once: holding every J^T v would add
                    grad = grad_outputs[nr]                       # a copy of the activations
                    if reads[key] == 1:
                        if grad is not None:
                            reduce(key, grad.detach())
                        continue
                    # a tensor saved through several views: each view's J^T v added where its elements lie in the
                    # stored memory (the tensor's span, from its first element)
                    part = partial.setdefault(key, [None, 0])
                    if grad is not None:
                        if part[0] is None:
                            part[0] = grad.new_zeros(_span(saved[key]), dtype=torch.float32)
                        part[0].as_strided(shape, stride, offset).add_(grad.detach())
                    part[1] += 1
                    if part[1] == reads[key]:
                        finish(key)
                return _stop(grad_outputs)

            return hook

        handles = [node.register_prehook(make_hook(entries)) for node, entries in by_node.items()]
        handles += [node.register_prehook(_stop) for node in forward_nodes if node not in by_node]
        # what reaches the parameters is not wanted: each one's dropped as it is complete, not held to the end
        handles += [p.register_hook(_drop) for p, _ in pairs]
        try:
            if probe.requires_grad:
                torch.autograd.grad(probe, [p for p, _ in pairs], retain_graph=i < samples - 1, allow_unused=True)
        except RuntimeError as e:  # an op without a double-backward formula (CPU flash attention)
            if "derivative for" not in str(e) and "not implemented" not in str(e):
                raise
            logger.warning("zoomem: sensitivities cannot be measured on this model (%s); bits follow each "
                           "tensor's value range instead", str(e).splitlines()[0][:160])
            return Sensitivity(_range_proxy(saved, range_sq, grad_sq, groups), grad_sq, measured=False)
        finally:
            for h in handles:
                h.remove()
        for key in list(partial):  # edges the backward never reached
            finish(key)
        for key, total in captured.items():
            out[key] += float(total) / 6 / samples
    return Sensitivity(out, grad_sq)


_Layout = tuple[tuple[int, ...], tuple[int, ...], int]


def _span(t: torch.Tensor) -> int:
    """Elements of memory from ``t``'s first to its last (``t`` with non-negative strides)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def _layout(t: torch.Tensor, obj: torch.Tensor) -> _Layout | None:
    """(shape, strides, offset) of ``obj``'s elements in ``t``'s span: where ``obj`` (a view of ``t``'s memory, or
    ``t``) holds the values rounding ``t`` moves; ``None`` where it is not such a view, or it or ``t`` repeats
    elements (a stride of 0): their gradients could not be added in place."""
    if obj is t:
        return tuple(t.shape), tuple(t.stride()), 0
    if t.layout != torch.strided or obj.layout != torch.strided or obj.dtype != t.dtype \
            or obj.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return None
    offset = obj.storage_offset() - t.storage_offset()
    if any(s < 0 for s in (*t.stride(), *obj.stride())) or offset < 0 or offset + _span(obj) > _span(t) \
            or any(s == 0 and n > 1 for x in (t, obj) for n, s in zip(x.shape, x.stride())):
        return None
    return tuple(obj.shape), tuple(obj.stride()), offset


def _forward_nodes(loss: torch.Tensor) -> list[torch.autograd.graph.Node]:
    """The autograd nodes of the forward that made ``loss`` (parameters' accumulators left out)."""
    return [n for n in autograd_nodes(loss.grad_fn) if type(n).__name__ != "AccumulateGrad"]


class _SignedSum(torch.autograd.Function):
    """``v . g`` for a gradient ``g`` and a sign vector ``v``. Its backward hands ``v`` itself on as ``g``'s gradient
    and lets it go: no product of ``v`` and ``g`` is made, and each ``v`` lives until the second backward has used it
    (held to its end, the signs are as large as the parameters)."""

    @staticmethod
    def forward(ctx, g, v):  # type: ignore[override]
        ctx.v = v
        return torch.dot(g.reshape(-1), v.reshape(-1))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        v, ctx.v = ctx.v, None
        return v.mul_(grad), None


def _square_norm(t: torch.Tensor) -> float:
    """``||t||**2`` in fp64, a million elements at a time (an fp64 copy of an embedding's gradient is twice its
    bytes)."""
    return sum(float(c.double().square().sum()) for c in t.detach().reshape(-1).split(1 << 20))


def _grad_sq(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None) -> float:
    """``||g||**2`` of the parameters' gradient, or of its mean over ranks (a parameter one rank did not use counts
    its zeros there, so that every rank takes part in every collective)."""
    if mean_over_ranks is None:
        return sum(_square_norm(g) for g in grads if g is not None)
    return sum(_square_norm(mean_over_ranks(torch.zeros_like(p) if g is None else g.detach()))
               for p, g in zip(params, grads))


def _drop(grad: torch.Tensor) -> torch.Tensor:
    """A parameter's hook in the sensitivity pass: its gradient there is not used; what the pass returns for it is
    a zero that holds no memory."""
    return grad.new_zeros(()).expand(grad.shape)


def _stop(grad_outputs: tuple) -> tuple:  # type: ignore[type-arg]
    """A forward node's pre-hook in the sensitivity pass: nothing flows on through the forward graph."""
    return tuple(None if g is None else torch.zeros_like(g) for g in grad_outputs)


def predicted_variance(sensitivity: float, bits: int) -> float:
    """The gradient variance (sum over parameters) of storing a tensor with sensitivity C_s in ``bits``."""
    return sensitivity / ((1 << bits) - 1) ** 2


def perturbed_grads(store: Any, loss: torch.Tensor, params: Sequence[torch.Tensor]
                    ) -> Callable[[Mapping[str, int]], list[torch.Tensor]]:
    """``grads_with`` for :func:`empirical_variance`: the parameter gradients of the step recorded under ``store``
    (a ``SavedTensorStore`` with ``record=True``) whose ``loss`` is given, with the tensors in ``perturb`` rounded
    (key -> bits) as the store unpacks them; a parameter the loss does not reach gets zeros."""

    def grads_with(perturb: Mapping[str, int]) -> list[torch.Tensor]:
        store.perturb = dict(perturb)
        gs = torch.autograd.grad(loss, list(params), retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)]

    return grads_with


def empirical_variance(
    grads_with: Callable[[Mapping[str, int]], Sequence[torch.Tensor]],
    key: str,
    bits: int,
    trials: int = 16,
) -> float:
    """Brute force, for checking the estimator: ``E||g(s quantized) - g||**2`` over ``trials`` roundings.

    ``grads_with(perturb)`` returns the parameter gradients of the same step with the tensors in ``perturb``
    (key -> bits) quantized and every other tensor exact.
    """
    exact = [g.detach().clone() for g in grads_with({})]
    total = 0.0
    for _ in range(trials):
        noisy = grads_with({key: bits})
        total += sum(float((a - b).double().square().sum()) for a, b in zip(noisy, exact))
    return total / trials



