"""Which memory-efficient implementations a unit can switch on, and switching them per plan.

For every module inside a unit the first registered :class:`~zoomem.ops.Impl` that applies is a candidate,
except output-saving ones (BatchNorm/LayerNorm/RMSNorm reconstructing their input from their output) on a
module whose output is later overwritten in place (``x += shortcut``, an in-place ReLU), where they would be
wrong, or whose output no op saves (a shortcut's BatchNorm feeding an addition), where they would trade the input
for an output held as long and add their backward's temporary: there the next one that applies is taken
(BatchNorm's ``batchnorm_rebuilt_output``, where nothing but zoomem's ReLU family changes the output in place). A unit's candidates are switched on together when its plan says ``compact``; the planner knows
what that saves because the runtime measured the step's timeline once with all of them on.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

from torch import nn

from ..adapters import Unit
from ..batch import Batch
from ..ops import Impl, impls_for, install_impl
from ..ops.impls import OutputUses, check_impls, scan_outputs
from ..ops.impls import dispatch_impl, set_attribute, with_setup
from ..ops.rebuild import set_owner
from ..planner import OUTSIDE_UNITS
from .calls import CallUnit, current_call, shared_module
from .patch import set_forward

logger = logging.getLogger(__name__)

__all__ = ["OUTPUT_SAVING", "OUTSIDE_UNITS", "PASSES_REBUILD", "REBUILT_OUTPUT", "UNIT_INNER", "choose_impls",
           "install_switched", "install_all", "wrap_root"]

UNIT_INNER = "zoomem_unit_inner"
"""Attribute of zoomem's forward of a unit: a one-element list holding the callable it runs (and recomputes)
inside, the module's own forward. :func:`install_switched` puts an implementation of the unit's own module there,
beneath the recomputation: a recomputed unit runs it again, and its checkpoint holds the inputs as they came (an
edge list), not as the implementation turned them (PyG's CSR adjacency, which it would otherwise hold from the
forward to the unit's backward)."""

OUTPUT_SAVING = frozenset({"batchnorm_output", "batchnorm_act_output", "layernorm_output", "rmsnorm_output"})
"""Implementations that keep the module's output instead of its input: unsafe if the output is later mutated."""

REBUILT_OUTPUT = frozenset({"batchnorm_rebuilt_output"})
"""Implementations whose output the layers after them may rebuild (:mod:`zoomem.ops.rebuild`): worth it only where
nothing but an implementation that passes the recipe on changes that output."""

PASSES_REBUILD = frozenset({"relu_bitmask", "hardtanh_bitmask", "leaky_relu_bitmask", "threshold_bitmask"})
"""Implementations whose output is as rebuildable as their input (they extend the recipe)."""


def choose_impls(
    model: nn.Module, units: list[Unit], batch: Batch, outside: bool = False
) -> dict[str, list[tuple[nn.Module, Impl]]]:
    """Per unit name: the (module, implementation) pairs its ``compact`` switch turns on.

    A module reachable from two units or from outside them (PyG's GIN passes one activation module to every
    conv) is skipped: one switch per module, or a recomputation could run another form than its forward. The
    calls of a shared layer (:mod:`zoomem.runtime.calls`) are the exception: its modules are candidates of each
    call, and run the form of the call they are in (:func:`install_switched`). With ``outside``, modules that only
    code outside every unit runs get their own switch, :data:`OUTSIDE_UNITS`.
    """
    candidates: dict[str, list[tuple[str, nn.Module, list[Impl]]]] = {}
    owners: dict[int, set[str]] = {}  # a module shared by two units, or also used outside them, is left alone
    calls = {u.name: u.module.split_name for u in units if isinstance(u.module, CallUnit)}
    shared = set(calls.values())
    for path, mod in model.named_modules(remove_duplicate=False):
        owner = next((u.name for u in units if path == u.name or path.startswith(u.name + ".")), "")
        if not owner and any(path == n or path.startswith(n + ".") for n in shared):
            continue  # a shared layer's: owned by its calls (below)
        owners.setdefault(id(mod), set()).add(owner)
    for name, split in calls.items():
        for mod in next(u.module for u in units if u.name == name).modules():
            owners.setdefault(id(mod), set()).add(name)
    paths = {id(mod): path for path, mod in model.named_modules()}  # (a shared layer's modules: their own)
    for unit in units:
        split = calls.get(unit.name)
        for name, mod in unit.module.named_modules():
            mine = owners.get(id(mod), set())
            impls = impls_for(mod) if mine == {unit.name} or split and {calls.get(o) for o in mine} == {split} else []
            if mod is shared_module(unit.module):  # the unit's own forward runs the plan: only input-changing
                impls = [i for i in impls if i.wraps]  # impls go on it
            if impls:
                full = paths[id(mod)] if split else ".".join(n for n in (unit.name, name) if n)
                candidates.setdefault(unit.name, []).append((full, mod, impls))
    if outside:
        for path, mod in model.named_modules():
            if owners.get(id(mod)) != {""}:
                continue
            impls = impls_for(mod)
            if mod is model:  # its forward is zoomem's: only implementations that wrap it (zoomem's forward calls
                impls = [i for i in impls if i.wraps]  # them, see ROOT) or replace another attribute
            if impls:
                candidates.setdefault(OUTSIDE_UNITS, []).append((path, mod, impls))
    _drop_unchecked(model, candidates, batch)
    uses = OutputUses({}, frozenset())
    if any(impls[0].name in OUTPUT_SAVING for pairs in candidates.values() for _, _, impls in pairs):
        uses = scan_outputs(model, *batch.args, **batch.kwargs)
    writers = uses.writers

    def usable(full: str, impl: Impl) -> bool:  # safe, and saving something, here
        return impl.name not in OUTPUT_SAVING or (full not in writers and full in uses.saved)

    chosen: dict[str, list[tuple[nn.Module, Impl]]] = {}
    for unit, pairs in candidates.items():
        first = {full: next((i for i in impls if usable(full, i)), None) for full, _, impls in pairs}
        chosen[unit] = []
        for full, mod, _ in pairs:
            impl = first[full]
            if impl is None or (impl.name in REBUILT_OUTPUT and not all(
                    first.get(w) is not None and first[w].name in PASSES_REBUILD for w in writers.get(full, []))):
                continue  # a rebuildable output only where nothing but an activation passing it on changes it
            chosen[unit].append((mod, impl))
            # tensors one of its forms makes rebuildable are rebuilt within the unit (a shared layer's: the call)
            set_owner(mod, current_call if unit in calls else unit)
    return chosen


_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, dict[str, str | None]]" = weakref.WeakKeyDictionary()
"""Per module, per checked implementation: why it computes otherwise than the module (None: it does not)."""


def _drop_unchecked(model: nn.Module, candidates: dict[str, list[tuple[str, nn.Module, list[Impl]]]],
                    batch: Batch) -> None:
    """Take out of ``candidates`` the checked implementations (``Impl.checked``) that compute otherwise than their
    module on ``batch`` (:func:`check_impls`, once per module and implementation: the first plan's choice is the one
    installed)."""
    todo = list({(id(mod), impl.name): (full, mod, impl) for pairs in candidates.values()  # (a shared layer's
                 for full, mod, impls in pairs for impl in impls  # modules: once)
                 if impl.checked and impl.name not in _VERDICTS.get(mod, {})}.values())
    if todo:
        failed = check_impls(model, todo, *batch.args, **batch.kwargs)
        for full, mod, impl in todo:
            why = _VERDICTS.setdefault(mod, {})[impl.name] = failed.get(full)
            if why is not None:
                logger.info("zoomem: %s left off %s (%s), checked on the planning batch: %s",
                            impl.name, full, type(mod).__name__, why)
    for pairs in candidates.values():
        for _, mod, impls in pairs:
            impls[:] = [i for i in impls if not i.checked or _VERDICTS[mod][i.name] is None]
    for unit in list(candidates):
        candidates[unit] = [(full, mod, impls) for full, mod, impls in candidates[unit] if impls]


def _by_module(chosen: dict[str, list[tuple[nn.Module, Impl]]]) -> list[tuple[nn.Module, Impl, list[str]]]:
    """Each chosen (module, implementation) once, with the units it is chosen for (several: the calls of a shared
    layer, :mod:`zoomem.runtime.calls`)."""
    seen: dict[tuple[int, str], tuple[nn.Module, Impl, list[str]]] = {}
    for unit, pairs in chosen.items():
        for mod, impl in pairs:
            seen.setdefault((id(mod), impl.name), (mod, impl, []))[2].append(unit)
    return list(seen.values())


def install_all(chosen: dict[str, list[tuple[nn.Module, Impl]]]) -> Callable[[], None]:
    """Switch every chosen implementation on (for measuring); returns the undo. A shared layer's modules run them
    in the calls ``chosen`` names."""
    undos = [install_impl(mod, impl) if len(units) == 1 else _install_one(mod, impl, None, frozenset(units).__contains__)
             for mod, impl, units in _by_module(chosen)]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def install_switched(
    chosen: dict[str, list[tuple[nn.Module, Impl]]], is_on: Callable[[str], bool], root: nn.Module | None = None
) -> tuple[list[Callable[[], None]], list[Impl]]:
    """Install each chosen implementation behind a switch: it runs when ``is_on(unit)`` is true. Those that wrap
    the forward of ``root`` (a wrapped model, whose forward is zoomem's) are not put on it, where Accelerate's
    wrappers expect a method, but returned: zoomem's forward calls them (:func:`wrap_root`) once it knows the
    step's plan. Returns the undos (the root implementations' setups included) and those implementations."""
    undos: list[Callable[[], None]] = []
    on_root: list[Impl] = []
    for mod, impl, units in _by_module(chosen):
        if mod is root and impl.attribute == "forward":
            undos.append(with_setup(mod, impl, lambda: None))
            on_root.append(impl)
            continue
        undos.append(_install_one(mod, impl, units[0] if len(units) == 1 else None, is_on))
    return undos, on_root


def _install_one(mod: nn.Module, impl: Impl, unit: str | None, is_on: Callable[[str], bool]) -> Callable[[], None]:
    """Install ``impl`` on ``mod`` behind the switch ``is_on(unit)`` (``unit`` ``None``: the call of a shared layer
    that is running, :func:`~zoomem.runtime.calls.current_call`); return the undo."""
    inner = getattr(getattr(mod, impl.attribute), UNIT_INNER, None) if impl.attribute == "forward" else None
    if inner is not None:  # a unit's own module: inside zoomem's forward of the unit
        return with_setup(mod, impl, _set_inner(inner, functools.partial(_switched, unit, is_on, mod, impl, inner[0])))
    switched = functools.partial(_switched, unit, is_on, mod, impl, getattr(mod, impl.attribute))
    if impl.attribute == "forward":
        return with_setup(mod, impl, set_forward(mod, switched))
    return with_setup(mod, impl, set_attribute(mod, impl.attribute, switched))


def _set_inner(inner: list, forward: Callable[..., Any]) -> Callable[[], None]:  # type: ignore[type-arg]
    previous, inner[0] = inner[0], forward

    def undo() -> None:
        inner[0] = previous

    return undo


def wrap_root(root: nn.Module, impls: list[Impl], forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (the root's original) run through the implementations :func:`install_switched` returned."""
    for impl in impls:
        forward = functools.partial(dispatch_impl, root, impl, forward)
    return forward


def _switched(
    unit: str | None, is_on: Callable[[str], bool], module: nn.Module, impl: Impl, original: Callable[..., Any],
    *args: Any, **kwargs: Any,
) -> Any:
    if unit is None:
        unit = current_call()
    if unit is not None and is_on(unit):
        return dispatch_impl(module, impl, original, *args, **kwargs)
    return original(*args, **kwargs)
