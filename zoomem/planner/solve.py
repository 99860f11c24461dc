"""Strategies that turn a :class:`CostModel` and a budget into a :class:`Plan`.

``ilp`` is the joint 0-1 program (PuLP; HiGHS when installed, else CBC), warm-started from ``greedy``.
The baselines produce Plans of the same type: ``none`` (PyTorch as is), ``all`` (every unit recomputed, as
HF's ``gradient_checkpointing_enable`` and timm's ``set_grad_checkpointing`` do), ``sqrt`` (Chen et al. 2016:
keep every ceil(sqrt(n))-th unit, recompute the rest) and ``greedy`` (recompute the unit that frees most
bytes per second of recompute until the prediction fits).
"""

from __future__ import annotations

import logging
import math
import time
from functools import lru_cache
from typing import Callable

from .costs import CostModel
from .plan import Decision, InfeasibleBudgetError, Plan, UnitPlan

__all__ = ["SAFETY_MARGIN", "STRATEGIES", "make_plan", "min_feasible_budget"]

logger = logging.getLogger(__name__)
_MIB = 1024**2


def _decisions_none(model: CostModel, budget: int | None) -> dict[str, Decision]:
    return {u: Decision.KEEP for u in model.units}


def _decisions_all(model: CostModel, budget: int | None) -> dict[str, Decision]:
    return {u: Decision.RECOMPUTE for u in model.units}


def _decisions_sqrt(model: CostModel, budget: int | None) -> dict[str, Decision]:
    step = max(1, math.ceil(math.sqrt(len(model.units))))
    return {u: Decision.KEEP if (i + 1) % step == 0 else Decision.RECOMPUTE for i, u in enumerate(model.units)}


def _decisions_greedy(model: CostModel, budget: int | None) -> dict[str, Decision]:
    decisions = _decisions_none(model, budget)
    if budget is None:
        return decisions
    peak = model.peak(decisions)
    while peak > budget:
        best, best_score, best_peak = None, 0.0, peak
        for u in model.units:
            if decisions[u] != Decision.KEEP:
                continue
            for d in (Decision.RECOMPUTE_CHEAP, Decision.RECOMPUTE):
                if model.recompute_time({u: d}) == float("inf"):
                    continue
                trial = dict(decisions, **{u: d})
                p = model.peak(trial)
                cost = model.recompute_time({u: d}) + 1e-9
                score = (peak - p) / cost
                if p < peak and score > best_score:
                    best, best_score, best_peak = (u, d), score, p
        if best is None:
            break
        decisions[best[0]] = best[1]
        peak = best_peak
    return decisions


def _solver(time_limit: float, msg: bool = False):  # type: ignore[no-untyped-def]
    import pulp

    if "HiGHS" in _available_solvers():
        return "HiGHS", pulp.HiGHS(msg=msg, timeLimit=time_limit)
    return "CBC", pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, warmStart=True)


@lru_cache(maxsize=1)
def _available_solvers() -> tuple[str, ...]:
    try:
        import pulp
    except ImportError as e:  # pragma: no cover - pulp is a dependency
        raise ImportError("The ILP planner needs PuLP: pip install pulp (it ships the CBC solver).") from e
    return tuple(pulp.listSolvers(onlyAvailable=True))


def _build(model: CostModel, limit: int | None, relax: bool = False, warm: dict[str, Decision] | None = None):  # type: ignore[no-untyped-def]
    """The program: minimise recompute time s.t. every memory point <= limit (or minimise the peak)."""
    import pulp

    prob = pulp.LpProblem("zoomem", pulp.LpMinimize)
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    x: dict[tuple[str, Decision], pulp.LpVariable] = {}
    for i, u in enumerate(model.units):
        choices = [Decision.KEEP, Decision.RECOMPUTE]
        if model.recompute_cheap_s.get(u, 0.0) < model.recompute_s.get(u, 0.0):
            choices.append(Decision.RECOMPUTE_CHEAP)
        for d in choices:
            x[u, d] = pulp.LpVariable(f"x_{i}_{d.value}", 0, 1, cat)
            if warm is not None:
                x[u, d].setInitialValue(1 if warm[u] == d else 0)
        prob += pulp.lpSum(x[u, d] for d in choices) == 1
    keep = lambda seg: x[model.units[seg - 1], Decision.KEEP]  # noqa: E731
    cheap = lambda seg: x.get((model.units[seg - 1], Decision.RECOMPUTE_CHEAP), 0)  # noqa: E731
    h: dict[int, pulp.LpVariable] = {}
    for s in model.storages:
        if s.pinned:
            continue
        v = h[s.sid] = pulp.LpVariable(f"h_{s.sid}", 0, 1)
        for seg in s.savers:
            prob += v >= keep(seg)
        for seg in s.input_of:
            prob += v >= 1 - keep(seg)
        for seg in s.cheap_kept_by:
            prob += v >= cheap(seg)
    peak = pulp.LpVariable("peak", 0) if limit is None else None
    for p in model.points:
        expr = p.measured + pulp.lpSum(c * (h[s.sid] - int(s.base_held)) for s, c in model._coefficients(p))
        if p.phase == "recompute" and 1 <= p.seg <= len(model.units) and model.transient.get(p.seg):
            expr += model.transient[p.seg] * (1 - keep(p.seg))
        prob += expr <= (peak if peak is not None else limit - model.fixed_bytes)
    time_cost = pulp.lpSum(
        x[u, d] * (model.recompute_s[u] if d == Decision.RECOMPUTE else model.recompute_cheap_s[u])
        for (u, d) in x
        if d != Decision.KEEP
    )
    # minimise time; for the min-peak program minimise the peak first, time as a tie-breaker
    prob += time_cost if peak is None else peak + 1e-3 * time_cost
    return prob, x


def _decode(model: CostModel, x: dict) -> dict[str, Decision]:  # type: ignore[type-arg]
    out = {}
    for u in model.units:
        best = max((d for (v, d) in x if v == u), key=lambda d: x[u, d].value() or 0.0)
        out[u] = best
    return out


def min_feasible_budget(model: CostModel, time_limit: float = 10.0) -> tuple[int, dict[str, Decision]]:
    """The smallest peak any plan reaches (bytes, fixed included), and that plan's decisions."""
    prob, x = _build(model, None)
    prob.solve(_solver(time_limit)[1])
    decisions = _decode(model, x)
    return model.peak(decisions), decisions


def _decisions_ilp(model: CostModel, budget: int | None, time_limit: float = 10.0) -> tuple[dict[str, Decision], dict]:  # type: ignore[type-arg]
    import pulp

    if budget is None:
        return _decisions_none(model, None), {"solver": "", "status": "no budget"}
    warm = _decisions_greedy(model, budget)
    name, solver = _solver(time_limit)
    prob, x = _build(model, budget, warm=warm)
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    relaxed, _ = _build(model, budget, relax=True)
    relaxed.solve(_solver(time_limit)[1])
    bound = pulp.value(relaxed.objective) if pulp.LpStatus[relaxed.status] == "Optimal" else None
    if status != "Optimal":
        return {}, {"solver": name, "status": status, "lp_bound": bound}
    decisions = _decode(model, x)
    return decisions, {"solver": name, "status": status.lower(), "lp_bound": float(bound) if bound is not None else None}


STRATEGIES: dict[str, Callable[[CostModel, int | None], dict[str, Decision]]] = {
    "none": _decisions_none,
    "all": _decisions_all,
    "sqrt": _decisions_sqrt,
    "greedy": _decisions_greedy,
}
"""Baseline strategies by name; ``ilp`` is handled by :func:`make_plan`."""


SAFETY_MARGIN = 0.01
"""Plans aim this fraction below the budget: the timeline is measured, but a run differs by a few KiB."""


def make_plan(
    model: CostModel, budget: int | None, strategy: str = "ilp", time_limit: float = 10.0, margin: float = SAFETY_MARGIN
) -> Plan:
    """Plan under ``budget`` bytes (whole forward+backward peak, fixed bytes included).

    The plan's predicted peak stays ``margin`` below the budget, and so does the smallest feasible budget an
    error reports.

    Raises:
        InfeasibleBudgetError: no plan of this strategy fits; the message names the smallest budget that has one.
        ValueError: an unknown strategy.
    """
    if strategy != "ilp" and strategy not in STRATEGIES:
        raise ValueError(f"Could not resolve strategy {strategy!r} among choices {['ilp', *STRATEGIES]}.")
    t0 = time.perf_counter()
    info: dict = {"solver": "", "status": "optimal"}  # type: ignore[type-arg]
    target = None if budget is None else int(budget / (1 + margin))
    baseline = model.peak(_decisions_none(model, None))
    if budget is not None and budget >= baseline and strategy in ("ilp", "greedy"):
        target = None  # plain PyTorch fits: its peak is measured, not predicted, so it needs no margin
    if strategy == "ilp":
        decisions, info = _decisions_ilp(model, target, time_limit)
    else:
        decisions = STRATEGIES[strategy](model, target)
    solve_s = time.perf_counter() - t0
    peak = model.peak(decisions) if decisions else None
    if target is not None and (peak is None or (strategy in ("ilp", "greedy") and peak > target)):
        smallest = min(math.ceil(min_feasible_budget(model, time_limit)[0] * (1 + margin)), baseline)
        raise InfeasibleBudgetError(
            f"No {strategy} plan keeps this step within {budget / _MIB:.1f} MiB ({budget} bytes): the smallest "
            f"feasible budget is {smallest / _MIB:.1f} MiB ({smallest} bytes; plain PyTorch needs "
            f"{baseline / _MIB:.1f} MiB, of which {model.fixed_bytes / _MIB:.1f} MiB are parameters, buffers and "
            "the batch). Raise the budget to at least that, or lower the batch size.",
            smallest,
        )
    assert peak is not None
    if budget is not None and peak > budget:
        logger.warning(
            "strategy %r predicts a peak of %.1f MiB, above the budget of %.1f MiB", strategy, peak / _MIB, budget / _MIB
        )
    units = [
        UnitPlan(
            name=u,
            decision=decisions[u],
            kept_bytes=model.kept_bytes(u, decisions),
            recompute_s=model.recompute_time({u: decisions[u]}),
        )
        for u in model.units
    ]
    return Plan(
        strategy=strategy,
        units=units,
        budget_bytes=budget,
        fixed_bytes=model.fixed_bytes,
        predicted_peak_bytes=peak,
        baseline_peak_bytes=baseline,
        recompute_s=model.recompute_time(decisions),
        step_s=model.step_s,
        solver=info.get("solver", ""),
        status=info.get("status", "optimal"),
        lp_bound=info.get("lp_bound"),
        solve_s=solve_s,
    )
