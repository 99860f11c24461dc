"""``zoomem.wrap`` / ``zoomem.unwrap`` / ``zoomem.plan``: install a memory plan on a live model, undoably.

``wrap`` changes the model in place at instance level (never its class): the model's ``forward`` and each
unit's ``forward`` become thin wrappers; parameters, buffers, ``state_dict`` keys, hooks and devices are
untouched. On the first training forward with a new input signature (shapes, dtypes) it traces one step on
that very batch, plans under the budget, caches the plan on the model's handle and logs a line; in ``eval()``
or under ``torch.no_grad()`` the original forward runs as it is.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..adapters import Adapter, Unit, get_adapter
from ..batch import Batch
from ..graph import OpGraph, trace
from ..graph.timeline import measure_timeline
from ..measure import holder_bytes
from ..planner import STRATEGIES, CostModel, Decision, InfeasibleBudgetError, Plan, make_plan, parse_budget
from ..planner.solve import SAFETY_MARGIN
from .compact import choose_impls, install_all, install_switched
from .patch import set_forward
from .units import run_unit

__all__ = ["wrap", "unwrap", "plan", "is_wrapped", "disabled"]

logger = logging.getLogger(__name__)
_ATTR = "_zoomem"
_MIB = 1024**2


@dataclass(frozen=True)
class _Active:
    """The plan in force during one forward, as the lookups every unit and implementation makes per call."""

    decisions: dict[str, Decision]
    compact: frozenset[str]

    @classmethod
    def of(cls, plan: Plan) -> "_Active":
        return cls(plan.decisions, frozenset(u.name for u in plan.units if u.compact))


@dataclass
class _Handle:
    """Per-model zoomem state: configuration, installed wrappers and the plan cache (keyed by input signature)."""

    model: nn.Module
    budget: int | float | str | None
    strategy: str
    adapter: Adapter
    units: list[Unit]
    time_limit: float
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None
    plans: dict[tuple, Plan] = field(default_factory=dict)
    active: "_Active | None" = None
    busy: bool = False
    enabled: bool = True
    undo: list[Callable[[], None]] = field(default_factory=list)
    impl_undos: list[Callable[[], None]] = field(default_factory=list)
    last_graph: OpGraph | None = None

    def compact_on(self, unit: str) -> bool:
        """Whether the running plan switches on the memory-efficient implementations inside ``unit``."""
        return self.active is not None and unit in self.active.compact

    def clear_cache(self) -> None:
        """Forget every cached plan: the next training forward plans again."""
        self.plans.clear()

    def plan_for(self, batch: Batch) -> Plan:
        sig = (Batch(batch.args, batch.kwargs).signature(), self.model.training)  # what forward sees
        cached = self.plans.get(sig)
        if cached is not None:
            return cached
        self.busy = True
        try:
            new = _make(self.model, batch, self.budget, self.strategy, self.adapter, self.optimizer,
                        self.loss_fn, self.time_limit)
        finally:
            self.busy = False
        new.signature = repr(sig[0])
        self.plans[sig] = new
        recomputed = sum(u.decision != Decision.KEEP for u in new.units)
        logger.info(
            "zoomem: planned %s for a new input signature: %d of %d units recomputed, predicted peak %.1f MiB "
            "(PyTorch %.1f MiB)", type(self.model).__name__, recomputed, len(new.units),
            new.predicted_peak_bytes / _MIB, new.baseline_peak_bytes / _MIB,
        )
        return new


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the optimizer holds across steps (measured when it has state, else Adam's 2x / SGD momentum's 1x)."""
    if optimizer is None:
        return 0
    if optimizer.state:
        return holder_bytes(list(optimizer.state.values()))
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    pbytes = sum(p.numel() * p.element_size() for p in params)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * pbytes
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return pbytes
    return 0


def _make(
    model: nn.Module,
    batch: Batch,
    budget: int | float | str | None,
    strategy: str,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None,
    time_limit: float,
    graph: OpGraph | None = None,
) -> Plan:
    graph = graph or trace(model, batch, adapter=adapter, loss_fn=loss_fn)
    handle = model.__dict__.get(_ATTR)
    units = adapter.units(model)
    chosen = choose_impls(model, units, batch)
    if any(chosen.values()) and graph.timeline:
        # measure once with every candidate implementation on: what `compact` saves per unit, and costs
        undo = install_all(chosen)
        try:
            graph.timeline_compact = measure_timeline(model, batch, _loss(adapter, model, loss_fn), units)
        finally:
            undo()
        graph.compact_units = [u for u, pairs in chosen.items() if pairs]
    if handle is not None:
        handle.last_graph = graph
        if not handle.impl_undos and any(chosen.values()):
            handle.impl_undos = install_switched(chosen, handle.compact_on)
            handle.undo.extend(handle.impl_undos)
    costs = CostModel.from_graph(graph)
    costs.fixed_bytes += _optimizer_state_bytes(optimizer)
    baseline = costs.peak({u: Decision.KEEP for u in costs.units})
    budget_bytes = parse_budget(budget, baseline_peak=baseline)
    new = make_plan(costs, budget_bytes, strategy=strategy, time_limit=time_limit)
    if handle is None or budget_bytes is None or strategy not in ("ilp", "greedy"):
        return new
    # measured peaks are the judge: run the plan once; if it overshoots, plan again with that much less
    margin = SAFETY_MARGIN
    for _ in range(_VERIFY_ROUNDS):
        measured = _measured_peak(handle, new, batch, adapter, loss_fn, units, costs.fixed_bytes)
        new.extras["measured_peak_bytes"] = measured
        if measured is None or measured <= budget_bytes or all(u.decision == Decision.KEEP and not u.compact
                                                               for u in new.units):
            return new
        logger.info("zoomem: the plan measured %.1f MiB against a budget of %.1f MiB; planning again with "
                    "that much less", measured / _MIB, budget_bytes / _MIB)
        margin += (measured - budget_bytes) / budget_bytes + 0.002
        new = make_plan(costs, budget_bytes, strategy=strategy, time_limit=time_limit, margin=margin)
    raise InfeasibleBudgetError(
        f"The plans zoomem found for {budget_bytes / _MIB:.1f} MiB measured {measured / _MIB:.1f} MiB at best "
        f"(its model of this step is off by more than its margin); raise the budget to about "
        f"{measured / _MIB:.1f} MiB or lower the batch size.",
        int(measured or budget_bytes),
    )


_VERIFY_ROUNDS = 3


def _measured_peak(handle: "_Handle", candidate: Plan, batch: Batch, adapter: Adapter,
                   loss_fn: Callable[[Any, Batch], torch.Tensor] | None, units: list[Unit], fixed: int) -> int | None:
    """The forward+backward peak of one real step under ``candidate`` (fixed bytes included)."""
    previous, handle.active = handle.active, _Active.of(candidate)
    try:
        timeline = measure_timeline(handle.model, batch, _loss(adapter, handle.model, loss_fn), units)
    finally:
        handle.active = previous
    return fixed + max(t.peak_bytes for t in timeline) if timeline else None


def _check_strategy(strategy: str) -> None:
    if strategy != "ilp" and strategy not in STRATEGIES:
        raise ValueError(f"Could not resolve strategy {strategy!r} among choices {['ilp', *STRATEGIES]}.")


def _loss(adapter: Adapter, model: nn.Module, loss_fn: Callable[[Any, Batch], torch.Tensor] | None):  # type: ignore[no-untyped-def]
    return loss_fn or (lambda out, b: adapter.loss(model, b, out))


def plan(
    model: nn.Module,
    batch: Any = None,
    budget: int | float | str | None = None,
    *,
    strategy: str = "ilp",
    adapter: Adapter | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    time_limit: float = 10.0,
    batch_size: int = 2,
    **sizes: int,
) -> Plan:
    """Plan ``model``'s training step on ``batch`` under ``budget`` without installing anything.

    Args:
        model: any model (wrapped or not).
        batch: the step's inputs; ``None`` builds the adapter's example batch (``batch_size``, ``sizes``).
        budget: bytes (int), a string (``"6GiB"``, ``"60%"``) or a fraction (float) of plain PyTorch's peak;
            the whole forward+backward peak, parameters, gradients, batch and optimizer state included.
        strategy: ``ilp`` (default), or a baseline: ``none``, ``all``, ``sqrt``, ``greedy``.
        optimizer: its state (or Adam's 2x parameters before its first step) counts in the budget.
        loss_fn: ``(output, batch) -> scalar``; by default the adapter's planning loss.
        time_limit: seconds for the solver.

    Returns:
        The :class:`Plan` (``plan.summary()``, ``plan.to_json()``).

    Raises:
        InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.

    >>> import timm, zoomem
    >>> p = zoomem.plan(timm.create_model("resnet18"), budget=0.6, batch_size=8, image_size=64)  # doctest: +SKIP
    >>> print(p.summary())  # doctest: +SKIP
    """
    _check_strategy(strategy)
    if isinstance(adapter, str) or adapter is None:
        adapter = get_adapter(model, adapter)
    batch = adapter.example_batch(model, batch_size, **sizes) if batch is None else Batch.of(batch)
    handle: _Handle | None = model.__dict__.get(_ATTR)
    if handle is not None:
        handle.busy = True
    try:
        return _make(model, batch, budget, strategy, adapter, optimizer, loss_fn, time_limit)
    finally:
        if handle is not None:
            handle.busy = False


def wrap(
    model: nn.Module,
    budget: int | float | str | None = None,
    *,
    strategy: str = "ilp",
    adapter: Adapter | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    time_limit: float = 10.0,
    batch: Any = None,
) -> nn.Module:
    """Train ``model`` within ``budget`` bytes with gradients identical to plain PyTorch's (in place, undoable).

    Args:
        model: a timm, HF transformers, PyG or any ``nn.Module``.
        budget: bytes (int), a string (``"6GiB"``, ``"60%"``) or a fraction (float) of plain PyTorch's peak,
            for the whole forward+backward peak. ``None`` keeps everything (plain PyTorch).
        strategy: ``ilp`` (default) or a baseline (``none``, ``all``, ``sqrt``, ``greedy``).
        adapter: the zoo adapter (or its name) instead of the matching one.
        optimizer: counts its state in the budget.
        loss_fn: ``(output, batch) -> scalar`` used when tracing; by default the adapter's planning loss.
        time_limit: seconds for the solver.
        batch: plan now on this example batch instead of lazily on the first training forward.

    Returns:
        ``model`` itself, so ``model = zoomem.wrap(model, budget="6GiB")`` reads naturally.

    Raises:
        InfeasibleBudgetError: (when planning) no plan fits; the message names the smallest feasible budget.

    >>> import timm, zoomem
    >>> model = zoomem.wrap(timm.create_model("resnet50"), budget="6GiB")  # doctest: +SKIP
    """
    _check_strategy(strategy)
    if is_wrapped(model):
        warnings.warn(
            "This model is already wrapped by zoomem; re-wrapping it with the new settings. "
            "Call zoomem.unwrap(model) first to silence this warning.",
            stacklevel=2,
        )
        unwrap(model)
    if isinstance(adapter, str) or adapter is None:
        adapter = get_adapter(model, adapter)
    handle = _Handle(
        model=model, budget=budget, strategy=strategy, adapter=adapter, units=adapter.units(model),
        time_limit=time_limit, optimizer=optimizer, loss_fn=loss_fn,
    )
    model.__dict__[_ATTR] = handle
    original = model.forward

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        if handle.busy or not handle.enabled or not (model.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        handle.active = _Active.of(handle.plan_for(Batch(tuple(args), dict(kwargs))))
        try:
            return original(*args, **kwargs)
        finally:
            handle.active = None

    handle.undo.append(set_forward(model, model_forward))
    for unit in handle.units:
        handle.undo.append(set_forward(unit.module, _unit_forward(handle, unit)))
    if batch is not None:
        try:
            handle.plan_for(Batch.of(batch))
        except BaseException:
            unwrap(model)  # a failed wrap leaves the model as it was
            raise
    return model


def _unit_forward(handle: _Handle, unit: Unit) -> Callable[..., Any]:
    original = unit.module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        active = handle.active
        decision = active.decisions.get(unit.name, Decision.KEEP) if active is not None else Decision.KEEP

        @contextlib.contextmanager
        def replay() -> Iterator[None]:  # recomputation in backward runs under the plan of its forward
            previous, handle.active = handle.active, active
            try:
                yield
            finally:
                handle.active = previous

        return run_unit(unit.module, original, decision, args, kwargs, replay)

    return forward


def is_wrapped(model: nn.Module) -> bool:
    return _ATTR in model.__dict__


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: the original forwards come back; parameters and buffers were never touched."""
    handle: _Handle | None = model.__dict__.pop(_ATTR, None)
    if handle is None:
        warnings.warn("zoomem.unwrap: this model is not wrapped; nothing to undo.", stacklevel=2)
        return model
    for undo in reversed(handle.undo):
        undo()
    return model


class disabled:
    """Context manager: run a wrapped model's original path (no plan, no recomputation) inside the block.

    >>> with zoomem.disabled(model):  # doctest: +SKIP
    ...     loss = model(x).sum()
    """

    def __init__(self, model: nn.Module) -> None:
        self.handle: _Handle | None = model.__dict__.get(_ATTR)
        self.was = True

    def __enter__(self) -> None:
        if self.handle is not None:
            self.was, self.handle.enabled = self.handle.enabled, False

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.enabled = self.was
