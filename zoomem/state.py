"""Leaving the model as its user had it across passes that are not the user's: module modes, buffers, hooks.

Planning traces and measures training steps, probes run forwards, and recomputation runs a unit's forward again in
backward; none of these is a training step of the user's, so each leaves the model as it found it. Buffers are put
back as objects and values: a forward may update one in place (BatchNorm's running statistics) or assign it a new
tensor (``self.ema = 0.9 * self.ema + 0.1 * x.mean()``). Their version counters stay as they were, as
BatchNorm's own update leaves them: a graph of the step that saved them (an earlier forward whose backward comes
later: a contrastive step's first view) must still find them unchanged. Hooks on parameters, which act on a
training step (an optimizer stepped in backward), are not called in planning's passes, and nothing in them runs
compiled (:func:`uncompiled`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["parameter_hooks_off", "planning_passes", "restore_buffers", "set_training", "snapshot_buffers",
           "training_scope", "uncompiled"]


def set_training(model: nn.Module, mode: bool = True) -> Callable[[], None]:
    """Put ``model`` in train (``mode``) or eval mode; the function returned puts every module's own mode back. A
    model already in ``mode`` is left as it is: modules its user put in the other mode (a frozen backbone's
    BatchNorm in eval, a teacher) stay there, as in its training steps, where ``model.train(mode)`` would switch
    every one."""
    modes = [(m, m.training) for m in model.modules()]
    if model.training != mode:
        model.train(mode)

    def restore() -> None:
        for m, was in modes:
            m.training = was

    return restore


@contextlib.contextmanager
def training_scope(model: nn.Module, mode: bool = True) -> Iterator[None]:
    """``model`` in ``mode`` inside (:func:`set_training`), every module's own mode put back afterwards."""
    restore = set_training(model, mode)
    try:
        yield
    finally:
        restore()


def snapshot_buffers(module: nn.Module) -> Callable[[], None]:
    """``module``'s buffers as they are now; the function returned puts them back (each under its name, the same
    object holding the same values), as often as it is called."""
    held = [(m, name, b, b.detach().clone()) for m in module.modules() for name, b in m._buffers.items()
            if b is not None]

    def restore() -> None:
        with torch.no_grad():
            for m, name, b, old in held:
                m._buffers[name] = b
                b.data.copy_(old)  # (not `b`'s version: a graph of the step that saved it holds these values)

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


@contextlib.contextmanager
def parameter_hooks_off(model: nn.Module) -> Iterator[None]:
    """Inside, the hooks on ``model``'s parameters (``register_hook``, ``register_post_accumulate_grad_hook``) are
    not called: planning's backward passes are not training steps, and such hooks act on one (PyTorch's optimizer
    step in backward steps there; until stop 53 planning stepped it 4 more times on the first batch). Their dicts
    are emptied and refilled in place (autograd holds the dicts themselves), in their order, before any hook
    registered inside and not removed."""
    emptied = []
    for p in model.parameters():
        for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
            if hooks:
                emptied.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, own in emptied:
            added = dict(hooks)
            hooks.clear()
            hooks.update(own)
            hooks.update(added)


def uncompiled() -> contextlib.AbstractContextManager[None]:
    """Inside, nothing torch.compile compiled runs compiled (``force_eager``): planning's passes call a model or
    blocks compiled in place (``model.compile()``, regional compilation), whose compiled frames would trace the
    passes' hooks and meter marks (recompiling at each), hide their ops from the tracer and raise on zoomem's
    checkpoints."""
    return torch.compiler.set_stance("force_eager")  # type: ignore[return-value]


@contextlib.contextmanager
def planning_passes(model: nn.Module) -> Iterator[None]:
    """Inside, planning's passes over ``model`` run as they must: its parameters' hooks off
    (:func:`parameter_hooks_off`) and nothing compiled (:func:`uncompiled`)."""
    with parameter_hooks_off(model), uncompiled():
        yield
