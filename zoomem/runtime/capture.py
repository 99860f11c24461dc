"""The gradient a training step's own loss sends the model's outputs, held to measure sensitivities against.

Where the loss lies outside the forward (timm's and PyG's loops, an HF model called without ``labels``), planning
cannot see it, and the sensitivity measurement differentiates a stand-in (:func:`~.probe.sampled_loss`). A
refresh can do better: a step before it, hooks on the wrapped model's outputs catch what the user's ``backward``
sends them, and the refresh differentiates ``sum(output * grad)`` on that step's batch, whose parameter gradient is
the step's own (the forward is what rounding never moves; :func:`output_grad_loss`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from ..batch import Batch

__all__ = ["HOLD_FORWARDS", "OUTPUT_GRAD_SHARE", "HeldOutputGrads", "output_leaves", "output_grad_loss"]

HOLD_FORWARDS = 4
"""Training forwards a held step waits for its backward (models run twice or more before one backward: two views
of a contrastive step, multi-crop) before its refresh falls back to the sampled loss."""

OUTPUT_GRAD_SHARE = 0.02
"""The largest share of a plan's predicted peak the outputs may take for their gradient to be held (from the
step's backward to the refresh, on top of what the plan predicts); larger outputs (an LM's logits) keep the
sampled loss."""


def output_leaves(output: Any) -> list[torch.Tensor]:
    """The floating tensors of a model's output that backward reaches, in a fixed order (pytree's)."""
    return [t for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def output_grad_loss(output: Any, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``sum(output * grad)`` over the output's floating tensors: a loss whose gradient is the one a step's own
    loss sent them (``grads``, :class:`HeldOutputGrads`); ``None`` where the outputs do not match them. On a sub-batch
    (its first rows, :meth:`~zoomem.batch.Batch.take`) each gradient's first rows are taken."""
    leaves = output_leaves(output)
    if len(leaves) != len(grads) or all(g is None for g in grads):
        return None
    total: torch.Tensor | None = None
    for out, grad in zip(leaves, grads):
        if grad is None:
            continue
        if grad.shape != out.shape:
            if not (out.dim() and grad.dim() == out.dim() and grad.shape[1:] == out.shape[1:]
                    and out.shape[0] < grad.shape[0]):
                return None
            grad = grad[: out.shape[0]]
        part = (out.float() * grad.to(out.device, torch.float32)).sum()
        total = part if total is None else total + part
    return total


@dataclass
class HeldOutputGrads:
    """One training step's batch and the gradient its loss sent the outputs, caught by hooks on them: a refresh
    due at that step runs at the next training step (of any input signature), on this batch."""

    step: int
    batch: Batch
    grads: list[torch.Tensor | None] = field(default_factory=list)
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    grad_versions: list[int] = field(default_factory=list)
    declined: str | None = None

    @classmethod
    def hold(cls, step: int, batch: Batch, output: Any, peak_bytes: int) -> "HeldOutputGrads":
        """The step's batch, and hooks on ``output``'s floating tensors unless they hold more than
        :data:`OUTPUT_GRAD_SHARE` of the plan's predicted ``peak_bytes`` (declined: the batch alone is held, for a
        refresh against a sampled loss)."""
        leaves = output_leaves(output)
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        inputs = batch.inputs()
        held = cls(step, batch, [None] * len(leaves), [(t, t._version) for t in inputs], [0] * len(leaves))
        if not leaves:
            held.declined = "the output holds no floating tensor that backward reaches"
        elif nbytes > OUTPUT_GRAD_SHARE * peak_bytes:
            held.declined = (f"the outputs ({nbytes / 2**20:.1f} MiB) are more than {OUTPUT_GRAD_SHARE:.0%} of the "
                             f"plan's predicted peak")
        else:
            for i, t in enumerate(leaves):
                t.register_hook(functools.partial(held._caught, i))
        return held

    def _caught(self, i: int, grad: torch.Tensor) -> None:
        grad = grad.detach()
        if self.grads[i] is not None:  # a second backward through the same outputs (retain_graph): their sum
            grad = self.grads[i] + grad  # type: ignore[operator]
        self.grads[i], self.grad_versions[i] = grad, grad._version

    def waits(self, step: int) -> bool:
        """Whether a refresh due before training step ``step`` waits on: no backward has reached the outputs yet,
        and ``step`` is at most the :data:`HOLD_FORWARDS`-th forward after the held one."""
        return self.declined is None and all(g is None for g in self.grads) and step - self.step <= HOLD_FORWARDS

    def unusable(self) -> str | None:
        """Why the held gradient cannot be measured against (``None``: it can)."""
        if self.declined is not None:
            return self.declined
        if all(g is None for g in self.grads):
            return "no backward reached the outputs"
        if any(t._version != v for t, v in self.versions) or any(
                g is not None and g._version != v for g, v in zip(self.grads, self.grad_versions)):
            return "the batch or the gradient was changed in place since"
        if not all(bool(torch.isfinite(g).all()) for g in self.grads if g is not None):
            return "the gradient is not finite (a loss-scaling step that overflowed)"
        return None
