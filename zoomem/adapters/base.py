"""What an adapter knows about a model zoo, as one small base class.

An adapter recognises its zoo's models, names their units (the checkpointable blocks, in forward order),
builds an example batch from the model's own config, computes a loss for planning, and flips the zoo's
native checkpointing switch (for the baselines). Everything else in zoomem is zoo-agnostic.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..batch import Batch

__all__ = ["Adapter", "Unit", "default_loss"]


@dataclass(frozen=True)
class Unit:
    """A checkpointable region: one module, named by its path in the model."""

    name: str
    module: nn.Module

    @property
    def cls(self) -> str:
        """The class of the module its forward runs (a shared layer's, for one of its calls)."""
        from ..runtime.calls import shared_module

        return type(shared_module(self.module)).__name__


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model's output holds (``output.loss`` or ``output["loss"]``, as HF models given ``labels`` return
    it), else ``None``."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    """A loss for planning when the zoo gives none.

    Uses ``output.loss`` when the model computed one; cross-entropy against integer targets; otherwise the
    mean of every floating output tensor, so that every output takes part in backward.
    """
    loss = output_loss(output)
    if loss is not None:
        return loss
    logits = output
    if not isinstance(logits, torch.Tensor):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            logits = output[0]
    if isinstance(target, torch.Tensor) and isinstance(logits, torch.Tensor) and not target.is_floating_point():
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    from torch.utils import _pytree as pytree

    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError(
            f"Cannot derive a planning loss from a model output of type {type(output).__name__}: it holds no "
            "floating tensor. Pass `loss_fn=` (a callable (output, batch) -> scalar tensor)."
        )
    MEAN_LOSS_BYTES.set(max(MEAN_LOSS_BYTES.get(), sum(t.numel() * t.element_size() for t in leaves)))
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


MEAN_LOSS_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("zoomem_mean_loss_bytes", default=0)
"""Bytes of the outputs :func:`default_loss` last took the mean of (0: it found a loss): planning warns where a
criterion on them could hold a share of the step that the plan never saw (:func:`mean_loss_warning`)."""


def mean_loss_warning(output_bytes: int, peak_bytes: int) -> str | None:
    """The warning for a plan traced with the mean of outputs of ``output_bytes`` as its loss, where they are at
    least 5% of the step's ``peak_bytes`` (a criterion on them holds a multiple of them: cross-entropy its
    log-probabilities and their gradient); ``None`` where they are less (a classifier's logits)."""
    if output_bytes < 0.05 * peak_bytes:
        return None
    return (
        f"zoomem planned this training step with the mean of the model's outputs as its loss: the output has no "
        f"`loss` and the batch no integer target, and the outputs are {output_bytes / 2**20:.1f} MiB, "
        f"{output_bytes / peak_bytes:.0%} of plain PyTorch's step. If your step computes its loss from them (an HF "
        f"model called without `labels`, your own criterion), pass that loss as `loss_fn=` (a callable "
        f"(output, zoomem.Batch) -> scalar tensor) to zoomem.wrap or zoomem.plan: a plan made for another loss holds "
        f"other tensors in backward, and can peak far above its prediction and the budget."
    )


class Adapter:
    """Base class of the zoo adapters; subclasses override what their zoo does differently.

    Subclasses set ``name`` and ``priority`` (higher is asked first) and register themselves with
    :func:`zoomem.adapters.register_adapter`.
    """

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0

    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter knows ``model``."""
        raise NotImplementedError

    def units(self, model: nn.Module) -> list[Unit]:
        """The checkpointable blocks of ``model``, non-overlapping, in forward order."""
        raise NotImplementedError

    def example_batch(self, model: nn.Module, batch_size: int, **sizes: int) -> Batch:
        """A random batch built from the model's config (sequence length, image size, graph size in ``sizes``)."""
        raise NotImplementedError(
            f"The {self.name!r} adapter cannot build an example batch for {type(model).__name__}: "
            "pass a real batch instead."
        )

    def sub_batch(self, batch: Batch, n: int) -> Batch:
        """The first ``n`` samples of ``batch``: zoomem plans a step too large to trace at once from two smaller
        ones (``trace_batch_size``). Samples are rows of every tensor whose dim 0 is the batch dimension.

        Raises:
            ValueError: the batch has no dimension that can be cut this way (an adapter says why).
        """
        return batch.take(n)

    def loss(self, model: nn.Module, batch: Batch, output: Any) -> torch.Tensor:
        """The scalar loss a training step would minimise, used for tracing and planning."""
        return default_loss(output, batch.target)

    def set_native_checkpointing(self, model: nn.Module, enable: bool) -> bool:
        """Turn the zoo's own full checkpointing on or off; return False where the model has none."""
        return False

    native_flags: ClassVar[tuple[str, ...]] = ()
    """Module attributes that hold the zoo's own checkpointing settings (which layers, with what function)."""

    def native_checkpointing(self, model: nn.Module) -> bool:
        """Whether the zoo's own full checkpointing is on (``gradient_checkpointing_enable()``,
        ``set_grad_checkpointing()``): :func:`zoomem.wrap` turns it off while wrapped, its plan deciding instead."""
        return False

    def suspend_native_checkpointing(self, model: nn.Module) -> Callable[[], None] | None:
        """Turn the zoo's own checkpointing off where it is on; return what sets every module's
        :attr:`native_flags` back as they were (the user's layers, function and options, not the defaults that
        :meth:`set_native_checkpointing` would choose), or ``None`` where it was off."""
        if not self.native_checkpointing(model):
            return None
        saved = [(m, {k: m.__dict__[k] for k in self.native_flags if k in m.__dict__}) for m in model.modules()]
        self.set_native_checkpointing(model, False)

        def restore() -> None:
            for module, flags in saved:
                for name, value in flags.items():
                    setattr(module, name, value)

        return restore

    def recompute_inputs(self, unit: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments a unit gets in a step that recomputes units: what makes its forward safe to run twice
        (the zoo's own checkpointing passes the same). Unchanged by default."""
        return args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
