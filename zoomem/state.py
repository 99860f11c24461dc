"""Putting back what a forward that is not the user's changes in the model: module modes and buffers.

Planning traces and measures training steps, probes run forwards, and recomputation runs a unit's forward again in
backward; none of these is a training step of the user's, so each leaves the model as it found it. Buffers are put
back as objects and values: a forward may update one in place (BatchNorm's running statistics) or assign it a new
tensor (``self.ema = 0.9 * self.ema + 0.1 * x.mean()``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["restore_buffers", "snapshot_buffers", "training_scope"]


@contextlib.contextmanager
def training_scope(model: nn.Module, mode: bool = True) -> Iterator[None]:
    """``model`` in train (``mode``) or eval mode inside, every module's own mode put back afterwards. A model
    already in ``mode`` is left as it is: modules its user put in the other mode (a frozen backbone's BatchNorm in
    eval, a teacher) stay there, as in its training steps, where ``model.train(mode)`` would switch every one."""
    modes = [(m, m.training) for m in model.modules()]
    if model.training != mode:
        model.train(mode)
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


def snapshot_buffers(module: nn.Module) -> Callable[[], None]:
    """``module``'s buffers as they are now; the function returned puts them back (each under its name, the same
    object holding the same values), as often as it is called."""
    held = [(m, name, b, b.detach().clone()) for m in module.modules() for name, b in m._buffers.items()
            if b is not None]

    def restore() -> None:
        with torch.no_grad():
            for m, name, b, old in held:
                m._buffers[name] = b
                b.copy_(old)

    return restore


@contextlib.contextmanager
def restore_buffers(module: nn.Module) -> Iterator[None]:
    """``module``'s buffers put back after the block (:func:`snapshot_buffers`): running statistics are updated
    once per step, by the step's own forward."""
    restore = snapshot_buffers(module)
    try:
        yield
    finally:
        restore()
