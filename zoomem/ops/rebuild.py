"""Tensors a layer may save as the recipe that rebuilds them from tensors saved anyway (MONeT's BN + ReLU form).

In a ResNet bottleneck a convolution saves its input, the output of BatchNorm and an in-place ReLU, for its weight
gradient; the BatchNorm saves its own input for its backward. The first is a function of the second, so keeping
both holds one tensor too many per layer. A producer that knows its output is such a function registers it here
(:func:`register`: the inputs the recipe reads and the function); zoomem's elementwise activations extend the
recipe to their own output (:func:`extend`); zoomem's convolution and linear look their input up
(:func:`rebuild_of`) and save the recipe's inputs instead, running it in backward just before the weight gradient
and dropping the result right after. The recipe reruns the kernels of the forward on the same values, so the
rebuilt tensor is bitwise the forward's.

A registration holds for that very tensor object at its version at registration: a view, a copy, or an in-place
change by anything that does not extend the recipe (``x += shortcut``) finds nothing, and the tensor is saved as
is. The recipe's inputs go through ``save_for_backward``, so a checkpoint drops and recomputes them like any saved
tensor, and zoomem's saved-tensor store stores them once.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["Rebuild", "extend", "rebuild_of", "register", "running", "set_owner"]


@dataclass(frozen=True)
class Rebuild:
    """``fn(*inputs)`` computes the registered tensor again, bitwise. A backward calls it from the inputs as
    ``save_for_backward`` gives them back, under its own grad mode: ``create_graph`` records the rebuild, so second
    derivatives reach the inputs."""

    inputs: tuple[torch.Tensor | None, ...]
    fn: Callable[..., torch.Tensor]


_REGISTRY: dict[int, tuple[weakref.ref, int, Rebuild, object]] = {}
_OWNER: "weakref.WeakKeyDictionary[nn.Module, str | Callable[[], str | None]]" = weakref.WeakKeyDictionary()
_SCOPE: contextvars.ContextVar[object] = contextvars.ContextVar("zoomem_rebuild_scope", default=None)


def set_owner(module: nn.Module, unit: str | Callable[[], str | None]) -> None:
    """Record the unit ``module`` runs in: a registration is used only by modules of the same unit. A callable
    names it as the module runs (a shared layer's module runs in each of its calls' units)."""
    _OWNER[module] = unit


@contextlib.contextmanager
def running(module: nn.Module) -> Iterator[None]:
    """Around a memory-efficient implementation's forward: registrations and lookups inside are ``module``'s unit's.

    A recomputed unit must save the same tensors in its recomputation as in its forward. Its input there is the
    checkpoint's copy, never registered, so a lookup of an input registered outside the unit would differ between
    the two; scoping by unit rules that out (and drops what an earlier unit registered, with what it holds)."""
    owner = _OWNER.get(module)
    token = _SCOPE.set(owner() if callable(owner) else owner)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def register(t: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], fn: Callable[..., torch.Tensor]) -> None:
    """Make ``t`` (as it is now) rebuildable as ``fn(*inputs)``; the entry holds ``inputs`` and goes with ``t``,
    when ``t`` changes in place, or when another unit registers or looks up."""
    scope = _SCOPE.get()
    _sweep(scope)
    key = id(t)
    _REGISTRY[key] = (weakref.ref(t, lambda _, key=key: _forget(key)), t._version, Rebuild(inputs, fn), scope)


def _forget(key: int) -> None:
    entry = _REGISTRY.get(key)
    if entry is not None and entry[0]() is None:
        del _REGISTRY[key]


def _sweep(scope: object) -> None:
    """Drop the entries no lookup from ``scope`` may use: another unit's, and those of tensors changed in place."""
    for key, (ref, version, _, owner) in list(_REGISTRY.items()):
        t = ref()
        if owner != scope or t is None or t._version != version:
            del _REGISTRY[key]


def rebuild_of(t: torch.Tensor) -> Rebuild | None:
    """The recipe of ``t`` if ``t`` is a tensor registered in this unit and not changed in place since; else None."""
    _sweep(_SCOPE.get())
    entry = _REGISTRY.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[2]


def extend(source: Rebuild, out: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Register ``out = op(source's tensor)`` (``op`` may run in place on the tensor it gets: it is a fresh one)."""
    fn = source.fn
    register(out, source.inputs, lambda *inputs: op(fn(*inputs)))
