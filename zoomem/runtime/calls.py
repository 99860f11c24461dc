"""Per-call units: a unit that one forward calls several times is planned call by call.

A layer shared across depth (HF's ALBERT runs one ``AlbertLayer`` for all its 12 layers; a weight-tied GNN one conv
8 times; a recurrent cell once per time step) is one module but many stretches of the step. Planned as one unit,
its calls were one segment, and recomputing it was priced as holding every call's activations at once, so it was
never chosen (ALBERT with its layer a unit: 96% of plain PyTorch's peak at the least). A unit with other units
between its calls (a backbone run on two views) stays one: the units are planned in forward order.

Here each call becomes a unit of its own: a :class:`CallUnit` per call, outside the model's tree (its parameters,
buffers and submodules are the shared module's), and the shared module's forward dispatches its n-th call of a
forward to the n-th one (:func:`split_calls`). The tracer, the timelines, the probes and the runtime know units by
their module's hooks and forward, so each call is measured, planned and run as a unit, recomputation included.
Each forward of the model counts its calls from the first (its forward hooks: a forward nested in
another, as planning's inside the step's, counts its own). Calls beyond those split (a later input
that loops longer) run the shared module's own forward, planned as code outside the units, until planning
splits them too (:meth:`Split.grow`).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..adapters import Adapter, Unit
from .patch import SPLITS, eager_under_compile, set_forward

__all__ = ["CallUnit", "Split", "casts_cached", "current_call", "shared_module", "split_calls", "splits_of", "units_of",
           "unsplit"]

_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("zoomem_call_unit", default=None)


def current_call() -> str | None:
    """The name of the call unit whose forward (or recomputation) is running, if any: a shared layer's modules
    run the compact forms of the call they are in (:func:`zoomem.runtime.compact.install_switched`)."""
    return _CALL.get()


class CallUnit(nn.Module):
    """One call of a module that each forward calls several times, as a unit of its own.

    Its parameters, buffers, submodules and training mode are the shared module's (``shared``, registered as its
    child: recomputing it restores the shared module's buffers); it is no child of the model, so the model's
    ``state_dict``, parameters and names are unchanged."""

    def __init__(self, split: "Split", index: int) -> None:
        super().__init__()
        self.shared = split.shared
        self.index = index
        self.unit_name = f"{split.name}#{index}"
        self.split_name = split.name
        self.__dict__["_split"] = split  # (not a submodule: the split holds this unit)

    @property  # type: ignore[override]
    def training(self) -> bool:  # the shared module's mode: model.train() / eval() never reach this unit
        return self.shared.training

    @training.setter
    def training(self, value: bool) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        token = _CALL.set(self.unit_name)
        try:
            return self._split.inner[0](*args, **kwargs)
        finally:
            _CALL.reset(token)

    def extra_repr(self) -> str:
        return f"call {self.index} of {type(self.shared).__name__}"


@dataclass(eq=False)
class Split:
    """A shared unit's calls split into :class:`CallUnit` s: ``name`` is the unit's, ``previous`` the forward it had
    before (zoomem's unit forward where the model is wrapped: what runs a call beyond those split), ``inner`` a
    one-element list holding what each call runs, the shared module's own forward (the dispatching forward's
    ``UNIT_INNER``: an implementation of the shared module itself goes there, beneath the calls)."""

    name: str
    shared: nn.Module
    previous: Callable[..., Any]
    inner: list[Callable[..., Any]]
    calls: list[CallUnit] = field(default_factory=list)
    counts: list[int] = field(default_factory=lambda: [0])  # calls so far, per model forward running (nested ones:
    # planning's inside the step's own); the first counts calls made outside any (a backbone called directly)
    most: int = 0  # the most calls one forward made since the split
    undo: list[Callable[[], None]] = field(default_factory=list)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The shared module's forward: its n-th call of this forward runs the n-th call unit."""
        index = self.counts[-1]
        self.counts[-1] += 1
        self.most = max(self.most, index + 1)
        if index < len(self.calls):
            return self.calls[index](*args, **kwargs)
        return self.previous(*args, **kwargs)

    def grow(self, calls: int) -> list[CallUnit]:
        """Split up to ``calls`` calls; return the call units added."""
        new = [CallUnit(self, i) for i in range(len(self.calls), calls)]
        self.calls.extend(new)
        return new

    def units(self) -> list[Unit]:
        return [Unit(c.unit_name, c) for c in self.calls]


def split_calls(model: nn.Module, unit: Unit, calls: int) -> Split:
    """Plan ``unit`` of ``model`` call by call, for up to ``calls`` calls per forward (more where it is split
    already); :func:`unsplit` undoes it."""
    splits = model.__dict__.setdefault(SPLITS, {})
    split = splits.get(unit.name)
    if split is None:
        from .compact import UNIT_INNER  # (compact imports this module)

        previous = unit.module.forward
        split = splits[unit.name] = Split(unit.name, unit.module, previous,
                                          [getattr(previous, UNIT_INNER, [previous])[0]])

        def start(module: nn.Module, args: Any) -> None:
            split.counts.append(0)

        def end(module: nn.Module, args: Any, output: Any) -> None:
            if len(split.counts) > 1:
                split.counts.pop()

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return split.dispatch(*args, **kwargs)

        setattr(dispatch, UNIT_INNER, split.inner)
        hooks = [model.register_forward_pre_hook(start, prepend=True),
                 model.register_forward_hook(end, always_call=True)]
        # (eager where the shared layer is compiled in place: Dynamo would guard on the call's index)
        split.undo = [set_forward(unit.module, eager_under_compile(dispatch)), *(h.remove for h in hooks)]
    split.grow(calls)
    return split


def unsplit(model: nn.Module, name: str | None = None) -> None:
    """Undo :func:`split_calls` for the unit ``name`` of ``model`` (every one where ``None``)."""
    splits = splits_of(model)
    for key in [name] if name is not None else list(splits):
        split = splits.pop(key, None)
        if split is not None:
            for undo in reversed(split.undo):
                undo()
    if not splits:
        model.__dict__.pop(SPLITS, None)


def splits_of(model: nn.Module) -> dict[str, Split]:
    """``model``'s split units by name."""
    return model.__dict__.get(SPLITS, {})


def units_of(adapter: Adapter, model: nn.Module) -> list[Unit]:
    """``adapter``'s units of ``model``, each split unit as its calls (in call order)."""
    units = adapter.units(model)
    splits = splits_of(model)
    if not splits:
        return units
    out: list[Unit] = []
    for u in units:
        split = splits.get(u.name)
        out.extend(split.units() if split is not None and split.shared is u.module else [u])
    return out


def casts_cached() -> bool:
    """Whether autocast is on, with its weight-cast cache. Then a shared layer's calls after its first find their
    weights cast already, and its backward adds their gradients in the cast's dtype, as plain PyTorch does; in
    backward the cache is empty, so selective recomputation (``RECOMPUTE_CHEAP``), which must run the ops its
    forward ran, casts again and torch raises ("aten._to_copy.default invocation index ... not found in storage";
    ALBERT under Accelerate's bf16). Such calls recompute whole instead (the graph is the forward's: plain
    PyTorch's gradients, bitwise)."""
    return torch.is_autocast_cache_enabled() and any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def shared_module(module: nn.Module) -> nn.Module:
    """The module a unit's forward runs: the shared one for a :class:`CallUnit`, else ``module``."""
    return module.shared if isinstance(module, CallUnit) else module
