"""Strategies that turn a :class:`CostModel` and a budget into a :class:`Plan`.

``ilp`` is the joint 0-1 program (PuLP; HiGHS when installed, else CBC), warm-started from ``greedy``.
The baselines produce Plans of the same type: ``none`` (PyTorch as is), ``all`` (every unit recomputed, as
HF's ``gradient_checkpointing_enable`` and timm's ``set_grad_checkpointing`` do), ``sqrt`` (Chen et al. 2016:
segments of ceil(sqrt(n)) units that keep only their first input) and ``greedy`` (recompute the unit that frees most
bytes per second of recompute until the prediction fits).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from functools import lru_cache
from typing import Callable, Iterator

# imported with zoomem, not on the first plan: PuLP keeps the import errors of the solvers it lacks, tracebacks
# included, on its solver classes, and those frames' callers (the first plan's, with its model) would live on
import pulp

from .compression import CompressOptions, region_of
from .costs import OUTSIDE_UNITS, CostModel
from .plan import Decision, InfeasibleBudgetError, Plan, UnitPlan

__all__ = ["MIP_GAP", "SAFETY_MARGIN", "STRATEGIES", "make_plan", "min_feasible_budget"]

logger = logging.getLogger(__name__)
_MIB = 1024**2
_PER_MIB = 1.0 / _MIB


Choice = tuple[dict[str, Decision], frozenset[str], dict[str, int]]
"""Per-unit decisions, the units whose compact implementations are on, and bits per lossy saved tensor."""


def _decisions_none(model: CostModel, budget: int | None) -> Choice:
    return {u: Decision.KEEP for u in model.units}, frozenset(), {}


def _decisions_all(model: CostModel, budget: int | None) -> Choice:
    return {u: Decision.RECOMPUTE for u in model.units}, frozenset(), {}


def _decisions_sqrt(model: CostModel, budget: int | None) -> Choice:
    """Chen et al.'s segments: ceil(sqrt(n)) units each; only a segment's first input is kept, the units after
    the first drop theirs (``RECOMPUTE_CHAIN``) where they can, else keep it (``RECOMPUTE``)."""
    step = max(1, math.ceil(math.sqrt(len(model.units))))
    d = {u: Decision.RECOMPUTE_CHAIN if i % step and i + 1 in model.chain else Decision.RECOMPUTE
         for i, u in enumerate(model.units)}
    return d, frozenset(), {}


def _decisions_greedy(model: CostModel, budget: int | None) -> Choice:
    """Apply, one at a time, the move that frees most predicted peak bytes per second it costs."""
    decisions = {u: Decision.KEEP for u in model.units}
    compact: frozenset[str] = frozenset()
    if budget is None:
        return decisions, compact, {}
    peak = model.peak(decisions, compact)
    while peak > budget:
        best, best_score, best_peak = None, 0.0, peak
        moves: list[tuple[str, Decision | None]] = []
        for u in model.units:
            if decisions[u] == Decision.KEEP:
                moves += [(u, Decision.RECOMPUTE_CHEAP), (u, Decision.RECOMPUTE)]
            if u in model.compact_saving and u not in compact and (
                    decisions[u] == Decision.KEEP or decisions[u] == Decision.RECOMPUTE and u in model.compact_recompute):
                moves.append((u, None))  # None: switch on the unit's compact implementations
        for u, d in moves:
            if d is None:
                trial_d, trial_c, cost = decisions, compact | {u}, max(0.0, model.compact_s.get(u, 0.0))
            else:
                cost = model.recompute_time({u: d})
                if cost == float("inf"):
                    continue
                trial_d = dict(decisions, **{u: d})
                trial_c = compact if d == Decision.RECOMPUTE and u in model.compact_recompute else compact - {u}
            p = model.peak(trial_d, trial_c)
            score = (peak - p) / (cost + 1e-9)
            if p < peak and score > best_score:
                best, best_score, best_peak = (trial_d, trial_c), score, p
        if best is None:  # no single move lowers the binding point (two units bind it together): recompute the rest
            rest = {u: Decision.RECOMPUTE for u, d in decisions.items() if d != Decision.RECOMPUTE}
            if rest:
                decisions = {**decisions, **rest}
                compact = frozenset(u for u in compact if u not in rest or u in model.compact_recompute)
            break
        decisions, compact = best
        peak = best_peak
    return decisions, compact, {}


MAX_CHAIN = 16
"""The program's longest run of units that drop their inputs (``RECOMPUTE_CHAIN``). Whether a dropped input is back
during a later unit's backward depends on every unit between them, so the program needs terms for each pair within
a run: capped, they grow with units x MAX_CHAIN, not units squared (an 80-layer model would be 80 x 80). Chen et
al.'s segments are sqrt(n) long: 16 covers models of 256 units."""


MIP_GAP = 0.02
"""The budget-constrained program stops once the best plan's proven bound is within this fraction of its own plan's
time (HiGHS and CBC take the relative gap of the incumbent's objective): that plan may be up to
``MIP_GAP / (1 - MIP_GAP)``, 2.04%, slower than the best.

The recompute times it weighs are measured, to a few percent at best, so proving the last 2% buys nothing; on
24 identical BERT-large layers it took the whole 10 s limit (the incumbent was found in 0.1 s). The min-peak
program that names the smallest feasible budget is solved to the solver's default (0.01%)."""


def _solver(time_limit: float, msg: bool = False, gap: float | None = None):  # type: ignore[no-untyped-def]
    """HiGHS when installed, else CBC; either starts from the variables' initial values (a warm start)."""

    if "HiGHS" in _available_solvers():
        return "HiGHS", _warm_highs()(msg=msg, timeLimit=time_limit, gapRel=gap)
    return "CBC", pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, warmStart=True, gapRel=gap)


@lru_cache(maxsize=1)
def _warm_highs() -> type:
    """PuLP's HiGHS, given the variables' initial values as a (partial) MIP start: PuLP passes them to CBC
    (``warmStart``) but not to HiGHS, which completes a partial start itself."""
    import numpy as np

    class WarmHiGHS(pulp.HiGHS):  # type: ignore[misc, name-defined]
        def callSolver(self, lp):  # type: ignore[no-untyped-def]
            start = [(v.index, float(v.varValue)) for v in lp.variables() if v.varValue is not None]
            if start and self.mip and any(v.cat == pulp.LpInteger for v in lp.variables()):  # not the LP bound
                index, value = zip(*start)
                lp.solverModel.setSolution(len(index), np.array(index, dtype=np.int32), np.array(value))
            super().callSolver(lp)

    return WarmHiGHS


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Keep the solver library's banner ("Running HiGHS ...") off the process's stdout (``zoomem plan --json``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured or replaced stdout: nothing to protect
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def solve(prob, solver) -> None:  # type: ignore[no-untyped-def]
    """``prob.solve(solver)`` without the solver's banner on stdout."""
    with _quiet_stdout():
        prob.solve(solver)


@lru_cache(maxsize=1)
def _available_solvers() -> tuple[str, ...]:
    return tuple(pulp.listSolvers(onlyAvailable=True))


def unit_modes(model: CostModel, i: int, lossy: bool = False) -> list[tuple[Decision, int]]:
    """The modes the program offers unit ``i`` (0-based): (decision, 0 plain forms | 1 compact | 2 compact as
    stored, ``lossy`` programs only). A chained mode needs the unit before it recomputed, which the program adds."""
    u = model.units[i]
    modes: list[tuple[Decision, int]] = [(Decision.RECOMPUTE, 0)]
    if model.recompute_cheap_s.get(u, 0.0) < model.recompute_s.get(u, 0.0):
        modes.append((Decision.RECOMPUTE_CHEAP, 0))  # never compact: they would change its cached outputs
    if u not in model.compact_saving:
        modes.append((Decision.KEEP, 0))
    else:
        modes += [(Decision.KEEP, 0), (Decision.KEEP, 1)]
        if u in model.compact_recompute:  # its compact forms run inside the checkpoint, and again in recompute
            modes.append((Decision.RECOMPUTE, 1))
    if lossy and u in model.compact_saving_stored:  # what storing some tensor lossily runs
        modes.append((Decision.KEEP, 2))
    if i + 1 in model.chain:
        modes.append((Decision.RECOMPUTE_CHAIN, 0))
        if (Decision.RECOMPUTE, 1) in modes:
            modes.append((Decision.RECOMPUTE_CHAIN, 1))
    return modes


def _build(model: CostModel, limit: int | None, relax: bool = False, warm: Choice | None = None,  # type: ignore[no-untyped-def]
           compress: CompressOptions | None = None):
    """The program: minimise recompute time s.t. every memory point <= limit (or minimise the peak).

    With ``compress``, each lossy-eligible saved tensor s also gets one 0-1 variable per bit width b; the tensor
    exists only if the unit it is saved in keeps its tensors, and its storage is freed only if no recomputed unit
    holds it as an input, so ``q[s, b] <= keep`` of both; it takes ``nbytes - packed(b)`` off the points after
    its segment (:meth:`CostModel.compress_gain_rows`) and adds its (de)quantization time plus the variance term
    ``C_s / (2**b - 1)**2`` (DESIGN.md section 4) to the objective. A unit with compact implementations has, in
    compression modes, one more mode besides every lossless one: kept, its compact forms as they run where
    tensors are stored lossily (they save what rounding perturbs little: attention keeps its softmax); its tensors
    may be lossy only in that mode, and it only with one lossy (``q <= x[u, keep, stored] <= sum of q``), so every
    lossless plan is a combined plan too. Tensors that are parts of one memory (:attr:`SavedInfo.shares`) are
    lossy all or none. The compact forms outside the units are on in compression modes, and elsewhere the
    program's choice (one 0-1 switch for the plan, a measured gain per point, their time in the objective).
    """

    prob = pulp.LpProblem("zoomem", pulp.LpMinimize)
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    # One 0-1 variable per unit and mode (decision, compact implementations on or off), exactly one mode per unit.
    # Modes, not a decision plus a compact switch joined by products: the one-hot is the convex hull of the
    # unit's choices, so the LP relaxation is as tight as it can be (on BERT-large it bounds as the products did:
    # what ended the 10 s runs there was MIP_GAP).
    x: dict[tuple[str, Decision, int], pulp.LpVariable] = {}
    kept: dict[str, pulp.LpAffineExpression] = {}  # 1 when the unit keeps its tensors, in either compact mode
    for i, u in enumerate(model.units):
        modes = unit_modes(model, i, lossy=compress is not None)
        if warm is not None:  # the warm plan's mode: compact forms as stored where it stores a tensor lossily
            warm_on = int(u in warm[1])
            if warm_on and (warm[0][u], 2) in modes and any(region_of(key) == u for key in warm[2]):
                warm_on = 2
        for d, on in modes:
            x[u, d, on] = pulp.LpVariable(f"x_{i}_{d.value}{('', '_c', '_s')[on]}", 0, 1, cat)
            if warm is not None:
                x[u, d, on].setInitialValue(1 if warm[0][u] == d and warm_on == on else 0)
        prob += pulp.lpSum(x[u, d, on] for d, on in modes) == 1
        kept[u] = pulp.lpSum(x[u, d, on] for d, on in modes if d == Decision.KEEP)
    keep = lambda seg: kept[model.units[seg - 1]]  # noqa: E731
    # a unit drops its input only if the unit before it is recomputed too (whose forward brings the input back)
    drop: dict[int, pulp.LpAffineExpression] = {}
    for seg in model.chain:
        u, prev = model.units[seg - 1], model.units[seg - 2]
        chained = [v for (w, d, _), v in x.items() if w == u and d == Decision.RECOMPUTE_CHAIN]
        if chained:
            drop[seg] = pulp.lpSum(chained)
            prob += drop[seg] <= pulp.lpSum(v for (w, d, _), v in x.items() if w == prev and d in (
                Decision.RECOMPUTE, Decision.RECOMPUTE_CHAIN))
    for seg in drop:  # at most MAX_CHAIN dropped inputs in a row
        window = range(seg, seg + MAX_CHAIN + 1)
        if all(k in drop for k in window):
            prob += pulp.lpSum(drop[k] for k in window) <= MAX_CHAIN
    cheap = lambda seg: x.get((model.units[seg - 1], Decision.RECOMPUTE_CHEAP, False), 0)  # noqa: E731

    def held_by(s, name: str, last: float = math.inf) -> pulp.LpVariable | int:  # type: ignore[no-untyped-def]
        """Whether ``s`` is held by its holders at segments up to ``last``: at least each one's indicator."""
        if any(seg <= last for seg in s.savers & s.input_of):  # saved by a unit that also takes it: held whatever
            return 1  # it does (a constant, not v >= keep and v >= 1 - keep, whose LP relaxation frees half of it)
        v = pulp.LpVariable(name, 0, 1)
        for seg in (k for k in s.savers if k <= last):
            prob.addConstraint(v >= keep(seg))
        for seg in (k for k in s.input_of if k <= last):
            prob.addConstraint(v >= 1 - keep(seg))
        for seg in (k for k in s.cheap_kept_by if k <= last):
            prob.addConstraint(v >= cheap(seg))
        for seg in (k for k in s.chained_by if k <= last and k in drop):
            prob.addConstraint(v >= drop[seg])
        return v

    h = {s.sid: held_by(s, f"h_{s.sid}") for s in model.storages if not s.pinned}
    q: dict[tuple[str, int], pulp.LpVariable] = {}
    seg_index = {u: i + 1 for i, u in enumerate(model.units)}
    if compress is not None:
        in_region: dict[str, list[pulp.LpVariable]] = {}
        of_key: dict[str, list[pulp.LpVariable]] = {}
        for j, (s, k) in enumerate(zip(model.saved, model.saved_seg)):
            owners = [v for v in s.input_of if v in seg_index and v != s.region]
            vs = []
            for b in (b for b in compress.bits if b >= s.min_bits):
                v = q[s.key, b] = pulp.LpVariable(f"q_{j}_{b}", 0, 1, cat)
                if warm is not None:
                    v.setInitialValue(1 if warm[2].get(s.key) == b else 0)
                if (s.region, Decision.KEEP, 2) in x:  # its unit runs its compact forms as stored
                    prob += v <= x[s.region, Decision.KEEP, 2]
                elif s.region in seg_index:
                    prob += v <= keep(seg_index[s.region])
                for owner in owners:
                    prob += v <= keep(seg_index[owner])
                vs.append(v)
                in_region.setdefault(s.region, []).append(v)
            prob += pulp.lpSum(vs) <= 1
            of_key[s.key] = vs
        for s in model.saved:  # parts of one memory: all lossy or none (one kept exact holds it all)
            for other in s.shares:
                prob += pulp.lpSum(of_key[s.key]) == pulp.lpSum(of_key.get(other, []))
        for (u, d, on), v in x.items():  # a unit runs them as stored only where it stores some tensor lossily
            if on == 2:
                prob += v <= pulp.lpSum(in_region.get(u, []))
    # the first sharing unit kept with its forms on holds their shared part (CostModel.shared_bytes): a later one
    # pays it where none before it is so, y >= its indicator - theirs, from its forward to the end of its backward
    # and one recomputed with its forms on makes it again in its backward where none before it keeps it
    pays: dict[int, pulp.LpVariable] = {}
    remade: dict[int, pulp.LpVariable] = {}
    before: list[pulp.LpVariable] = []
    for k, u in enumerate(model.shared_units if model.shared_bytes else ()):
        seg = seg_index[u]
        on = [x[u, Decision.KEEP, c] for c in (1, 2) if (u, Decision.KEEP, c) in x]
        again = [v for (w, d, c), v in x.items() if w == u and d != Decision.KEEP and c]
        if k and on:
            pays[seg] = pulp.LpVariable(f"pays_shared_{seg}", 0)
            prob += pays[seg] >= pulp.lpSum(on) - pulp.lpSum(before)
        if again:
            remade[seg] = pulp.LpVariable(f"remade_shared_{seg}", 0)
            prob += remade[seg] >= pulp.lpSum(again) - pulp.lpSum(before)
        before += on
    by_key = {s.key: (s, k) for s, k in zip(model.saved, model.saved_seg)}
    alive = dict(zip((s.key for s in model.saved), model.saved_alive))
    # during a unit's own forward and backward its tensors take off the least over the stretches of that phase
    # (CostModel.stretches): gain[phase, k] <= (below the phase's peak there) + (each term's bytes at its bits)
    gain: dict[tuple[str, int], pulp.LpVariable] = {}
    phases = model.stretches() if q else {}
    if q:
        for (phase, k), stretches in phases.items():
            terms = [[(j, kind, rise, b) for j, kind, rise in t for b in compress.bits
                      if (model.saved[j].key, b) in q] for _, t in stretches]
            if not any(terms):
                continue
            gain[phase, k] = pulp.LpVariable(f"gain_{phase}_{k}")
            for (d, _), ts in zip(stretches, terms):
                prob += gain[phase, k] * _PER_MIB <= (d + pulp.lpSum(
                    model.term_bytes(j, kind, b, rise) * q[model.saved[j].key, b] for j, kind, rise, b in ts)
                ) * _PER_MIB
    # a dropped input is absent in forward; in backward it is back from the backward of its own unit on, while
    # every unit up to the one running drops its input too: z >= h - drop, z >= (sum of those drops) - (count - 1)
    chain_of = {model.storages[j].sid: seg for seg, j in model.chain.items() if seg in drop}
    at: dict[tuple[int, int], int | None] = {}
    for seg in drop:
        for i, last in model.chain_points(seg):
            at[seg, i] = last
    z: dict[tuple[int, int], pulp.LpVariable] = {}

    def chain_held(s, i):  # type: ignore[no-untyped-def]
        seg = chain_of[s.sid]
        last = at[seg, i]
        if last is None or last - seg >= MAX_CHAIN:  # absent (a longer run of dropped inputs is ruled out)
            return h[s.sid] - drop[seg]
        if (seg, last) not in z:
            v = z[seg, last] = pulp.LpVariable(f"z_{seg}_{last}", 0, 1)
            prob.addConstraint(v >= h[s.sid] - drop[seg])
            if all(k in drop for k in range(seg, last + 1)):
                prob.addConstraint(v >= pulp.lpSum(drop[k] for k in range(seg, last + 1)) - (last - seg))
        return z[seg, last]

    # a storage several units hold is held at a backward point only by those whose backward has not run yet:
    # a >= each of their indicators, per (storage, last such holder) (CostModel.prefix_terms)
    index = {id(s): j for j, s in enumerate(model.storages)}
    prefix = {(i, j): (last, base) for i, j, last, base in model.prefix_terms()}
    early: dict[tuple[int, int], pulp.LpVariable | int] = {}

    def held_term(s, i):  # type: ignore[no-untyped-def]
        if s.sid in chain_of and (chain_of[s.sid], i) in at:
            return chain_held(s, i) - int(s.base_held)
        j = index[id(s)]
        last, base = prefix.get((i, j), (None, s.base_held))
        if last is None:
            return h[s.sid] - int(base)
        if (j, last) not in early:
            early[j, last] = held_by(s, f"a_{j}_{last}", last)
        return early[j, last] - int(base)

    # the compact forms outside the units: one plan-wide switch, a measured gain per point; on in compression
    # modes (their trace measured with them on), else the program's choice (on and off: one-hot, as unit modes)
    outside: bool | tuple[pulp.LpVariable, pulp.LpVariable] = bool(model.outside_gain) and compress is not None
    if model.outside_gain and compress is None:
        outside = (pulp.LpVariable("outside_on", 0, 1, cat=cat), pulp.LpVariable("outside_off", 0, 1, cat=cat))
        prob += outside[0] + outside[1] == 1
        if warm is not None:
            outside[0].setInitialValue(int(OUTSIDE_UNITS in warm[1]))
            outside[1].setInitialValue(int(OUTSIDE_UNITS not in warm[1]))
    switch = outside[0] if isinstance(outside, tuple) else int(outside)
    peak = pulp.LpVariable("peak", 0) if limit is None else None
    at_start = [model.packed_at_start(p, phases) for p in model.points]  # lossy tensors all packed there
    gone = dict(zip((s.key for s in model.saved), model.gone_at_start()))
    exprs = []
    for i, p in enumerate(model.points):
        expr = p.measured - (model.outside_gain[i] * switch if model.outside_gain else 0) + pulp.lpSum(
            k * held_term(s, i) for s, k in model._coefficients(p))
        lost = model.outside_lost(i)
        if lost is not None and not (isinstance(switch, int) and switch == 0):
            # the forms are on and the unit recomputes: w = switch * (1 - keep), as small as the constraint lets it
            w = pulp.LpVariable(f"outside_lost_{i}", 0)
            prob += w >= switch - keep(lost[0])
            expr += lost[1] * w
        if p.phase == "recompute" and p.seg in drop:  # bringing the input back runs earlier units' forwards first
            runs = []
            for run in range(p.seg - 1, max(0, p.seg - MAX_CHAIN - 1), -1):
                if not all(k in drop for k in range(run + 1, p.seg + 1)):
                    break
                if model.chain_transient(p.seg, run) > 0:
                    runs.append((run, model.chain_transient(p.seg, run)))
            if runs:
                tau = pulp.LpVariable(f"tau_{p.seg}", 0)
                after = drop.get(p.seg + 1, 0)  # the next unit dropping its input brought this one back already
                for run, extra in runs:  # tau >= extra when units run + 1 .. seg all drop their inputs, seg + 1 not
                    prob += tau * _PER_MIB >= extra * _PER_MIB * (
                        pulp.lpSum(drop[k] for k in range(run + 1, p.seg + 1)) - (p.seg - run - 1) - after)
                expr += tau
        for (u, d, on), v in x.items():
            if on:  # a gain can be negative (a cost)
                expr -= model.compact_gain(p, u, d, stored=on == 2) * v
        if pays or remade:
            expr += model.shared_bytes * (pulp.lpSum(v for seg, v in pays.items() if seg <= p.seg)
                                          + (remade.get(p.seg, 0) if p.phase == "backward" else 0))
        if p.phase == "forward" and p.seg in model.own_excess:  # its own forward, above the code after it
            expr += model.own_excess[p.seg] * (1 - keep(p.seg))
        if p.phase == "recompute" and 1 <= p.seg <= len(model.units):  # the unit's recomputation, as its mode runs it
            full, part = model.transient.get(p.seg, 0), model.recompute_transient(p.seg, Decision.RECOMPUTE_CHEAP)
            expr += full * (1 - keep(p.seg) - cheap(p.seg)) + part * cheap(p.seg)
        gains = [v * (by_key[key][0].nbytes - by_key[key][0].packed_nbytes(b)) for (key, b), v in q.items()
                 if (p.seg > alive[key] if p.phase == "forward" else
                     p.seg > by_key[key][1] or (p.seg == by_key[key][1] and at_start[i]
                                                and not (p.phase == "recompute" and gone[key])))]
        if gains:
            expr -= pulp.lpSum(gains)
        if (p.phase, p.seg) in gain:
            expr -= gain[p.phase, p.seg]
        exprs.append(expr)
    left = model.left_index() if model.others else None
    others: pulp.LpVariable | int = 0  # in MiB: what each other forward of the step holds (CostModel.others)
    if left is not None:  # at least what this plan's forward leaves, and the floor
        others = pulp.LpVariable("left_by_forward", model.others_floor * _PER_MIB)
        prob += others >= (exprs[left] - model.held_grad_bytes) * _PER_MIB
    for expr in exprs:
        # in MiB: byte-sized coefficients (1e9 and more) against 0-1 variables defeat the solver's tolerances
        prob += expr * _PER_MIB + model.others * others <= (
            peak if peak is not None else (limit - model.fixed_bytes) * _PER_MIB)
    if model.optimizer_bytes:  # the optimizer's step: what the backward leaves, less with the outside forms on
        step = model.optimizer_bytes - (model.optimizer_gain * switch if model.outside_gain else 0)
        prob += step * _PER_MIB <= (peak if peak is not None else (limit - model.fixed_bytes) * _PER_MIB)
    seconds = {(u, d, on): model.recompute_time({u: d}) + (model.compact_s.get(u, 0.0) if on else 0.0)
               for u, d, on in x}
    # a compact form that runs faster than the stock op is a credit: every mode of its unit is charged that much
    # more (one mode per unit: a constant, which keeps the objective non-negative, so the 2% gap of MIP_GAP stays
    # a share of seconds spent, not of a sum near zero), in the variables' coefficients (PuLP leaves an
    # objective's constant out of what the solver sees: taken off there, the objective's value is seconds again)
    shift = dict.fromkeys(model.units, 0.0)
    for (u, _, _), t in seconds.items():
        shift[u] = max(shift[u], -t)
    time_cost = pulp.lpSum(v * (seconds[k] + shift[k[0]]) for k, v in x.items()) - sum(shift.values())
    if isinstance(outside, tuple):  # its time, a credit where faster, shifted as a unit's modes are
        t = model.compact_s.get(OUTSIDE_UNITS, 0.0)
        lift = max(0.0, -t)
        time_cost += (t + lift) * outside[0] + lift * outside[1] - lift
    if q:
        assert compress is not None
        # seconds charged per unit of predicted gradient variance: one step per `variance_tolerance` of ||g||^2
        lam = model.step_s / (compress.variance_tolerance * model.grad_sq) if model.grad_sq > 0 else 0.0
        time_cost += pulp.lpSum(
            v * (model.compress_seconds(b, by_key[key][0].nbytes) + lam * by_key[key][0].variance(b))
            for (key, b), v in q.items()
        )
    # minimise time; for the min-peak program minimise the peak first, time as a tie-breaker
    prob += time_cost if peak is None else peak + 1e-3 * time_cost
    return prob, (x, q, outside)


def _decode(model: CostModel, xq: tuple) -> Choice:  # type: ignore[type-arg]
    x, q, outside = xq
    outside_on = (outside[0].value() or 0.0) > 0.5 if isinstance(outside, tuple) else outside
    out, compact = {}, {OUTSIDE_UNITS} if outside_on else set()
    for u in model.units:
        _, d, on = max((k for k in x if k[0] == u), key=lambda k: x[k].value() or 0.0)
        out[u] = d
        if on:
            compact.add(u)
    bits = {key: b for (key, b), var in q.items() if (var.value() or 0.0) > 0.5}
    return out, frozenset(compact), bits


def min_feasible_budget(model: CostModel, time_limit: float = 10.0,
                        compress: CompressOptions | None = None) -> tuple[int, Choice]:
    """The smallest peak any plan reaches (bytes, fixed included), and that plan's choice."""
    prob, xq = _build(model, None, compress=compress)
    solve(prob, _solver(time_limit)[1])
    choice = _decode(model, xq)
    return model.peak(*choice), choice


MIN_SOLVER_S = 1.0
"""The least time the budget-constrained program is given, however much of the plan's time limit tracing the
warm start and building the program took: enough for the solver to return the warm start or better."""


def _decisions_ilp(model: CostModel, budget: int | None, time_limit: float = 10.0,  # type: ignore[type-arg]
                   compress: CompressOptions | None = None,
                   deadline: float | None = None, warm: Choice | None = None) -> tuple[Choice | None, dict]:
    """The program under ``budget``, solved by ``deadline`` (``time.perf_counter()`` seconds; default: ``time_limit``
    from now), then relaxed in place for its LP bound in the time left. ``warm``: a plan to start from (default:
    the greedy baseline's, lossless programs only)."""

    if budget is None:
        return _decisions_none(model, None), {"solver": "", "status": "no budget"}
    if deadline is None:
        deadline = time.perf_counter() + time_limit
    if warm is None and compress is None:
        warm = _decisions_greedy(model, budget)
    prob, xq = _build(model, budget, warm=warm, compress=compress)
    name, solver = _solver(max(MIN_SOLVER_S, deadline - time.perf_counter()), gap=MIP_GAP)
    solve(prob, solver)
    status = pulp.LpStatus[prob.status]
    # PuLP reports a run stopped by the time limit with an incumbent as "Optimal"; its solution status tells
    proven = prob.sol_status == pulp.constants.LpSolutionOptimal
    choice = _decode(model, xq) if status == "Optimal" else None
    # the LP bound from the same program with its 0-1 variables relaxed (an LP: fast; building it again was not)
    for v in prob.variables():
        v.cat = pulp.LpContinuous
    left = deadline - time.perf_counter()
    bound = None
    if left > 0:
        solve(prob, _solver(left)[1])
        bound = pulp.value(prob.objective) if pulp.LpStatus[prob.status] == "Optimal" else None
    if choice is None:
        return None, {"solver": name, "status": status, "lp_bound": bound}
    return choice, {"solver": name, "status": "optimal" if proven else "feasible (time limit)",
                    "lp_bound": float(bound) if bound is not None else None}


STRATEGIES: dict[str, Callable[[CostModel, int | None], Choice]] = {
    "none": _decisions_none,
    "all": _decisions_all,
    "sqrt": _decisions_sqrt,
    "greedy": _decisions_greedy,
}
"""Baseline strategies by name; ``ilp`` is handled by :func:`make_plan`."""


SAFETY_MARGIN = 0.01
"""Plans aim this fraction below the budget: the timeline is measured, but a run differs by a few KiB."""


def make_plan(
    model: CostModel, budget: int | None, strategy: str = "ilp", time_limit: float = 10.0,
    margin: float = SAFETY_MARGIN, compress: CompressOptions | None = None, faster_forms: bool = True,
) -> Plan:
    """Plan under ``budget`` bytes (the whole step's peak, fixed bytes included).

    ``compress`` (ILP only) lets the program store saved tensors lossily (:meth:`CostModel.attach_saved`).

    The plan's predicted peak stays ``margin`` below the budget, and so does the smallest feasible budget an error
    reports. A budget that plain PyTorch's measured peak fits gets plain PyTorch's plan, or, where some unit's
    compact forms run faster than the stock ops (:attr:`CostModel.compact_s`), the program's fastest plan if it is
    faster and fits with the margin (``faster_forms=False``: plain PyTorch's plan, what a run that measured the
    faster plan above such a budget falls back to). ``time_limit`` bounds the whole plan (the greedy warm start,
    building the program, solving it, its LP bound), not each solver call: the program gets what is left, at least
    :data:`MIN_SOLVER_S`, and the LP bound is skipped (``None``) when nothing is left. After a failure the
    least-peak program runs (up to ``time_limit`` more): its peak is the smallest feasible budget the error names,
    or, where its plan fits (the budgeted program found none in time: the combined one has no greedy start), the
    program runs again from that plan (up to ``time_limit`` more), which is the plan if nothing better comes back.

    Raises:
        InfeasibleBudgetError: no plan of this strategy fits; the message names the smallest budget that has one.
        ValueError: an unknown strategy.
    """
    if strategy != "ilp" and strategy not in STRATEGIES:
        raise ValueError(f"Could not resolve strategy {strategy!r} among choices {['ilp', *STRATEGIES]}.")
    t0 = time.perf_counter()
    info: dict = {"solver": "", "status": "optimal"}  # type: ignore[type-arg]
    target = None if budget is None else int(budget / (1 + margin))
    baseline = model.peak(*_decisions_none(model, None))
    faster_within = None
    if budget is not None and budget >= baseline and strategy in ("ilp", "greedy"):
        target = None  # plain PyTorch fits: its peak is measured, not predicted, so it needs no margin
        if strategy == "ilp" and faster_forms and any(model.compact_s.get(u, 0.0) < 0 for u in model.compact_saving):
            faster_within = int(budget / (1 + margin))  # but some compact form runs faster: where it fits, use it
    choice: Choice | None
    if compress is not None and strategy != "ilp":
        raise ValueError(f"Compression under a budget is planned by the ILP; strategy {strategy!r} cannot plan it.")
    least_step = min(model.optimizer_step(frozenset()), model.optimizer_step(frozenset({OUTSIDE_UNITS})))
    if target is not None and model.fixed_bytes + least_step > target:
        choice = None  # the optimizer's step alone is above it, whatever the plan
    elif strategy == "ilp":
        choice, info = _decisions_ilp(model, target, time_limit, compress, deadline=t0 + time_limit)
        if faster_within is not None:
            faster, faster_info = _decisions_ilp(model, faster_within, time_limit, compress,
                                                 deadline=t0 + time_limit)
            if faster is not None and model.peak(*faster) <= faster_within and model.recompute_time(
                    faster[0], faster[1]) + model.compress_time(faster[2]) < 0:
                choice, info = faster, faster_info
    else:
        choice = STRATEGIES[strategy](model, target)
    peak = model.peak(*choice) if choice else None

    def misses(peak: int | None) -> bool:
        return target is not None and (peak is None or (strategy in ("ilp", "greedy") and peak > target))

    least = None
    if misses(peak):
        least, least_choice = min_feasible_budget(model, time_limit, compress)
        if strategy == "ilp" and not misses(least):
            # the program found no plan in time (the combined one has no greedy start), yet the least-peak plan
            # fits: start from it (what the solver finds then costs less time or variance, or it is the plan)
            logger.info("zoomem: the program found no plan for %.1f MiB in %.0f s; starting again from the "
                        "least-peak plan (%.1f MiB)", target / _MIB, time_limit, least / _MIB)
            choice, info = _decisions_ilp(model, target, time_limit, compress, warm=least_choice)
            peak = model.peak(*choice) if choice else None
            if misses(peak):
                choice, peak, info = least_choice, least, {**info, "status": "feasible (least-peak plan)"}
    solve_s = time.perf_counter() - t0
    if misses(peak):
        assert least is not None
        # + 64 bytes: the budget-constrained program must find it feasible too, after rounding and tolerances
        smallest = min(math.ceil(least * (1 + margin)) + 64, baseline)
        raise InfeasibleBudgetError(
            f"No {strategy} plan keeps this step within {budget / _MIB:.1f} MiB ({budget} bytes): the smallest "
            f"feasible budget is {smallest / _MIB:.1f} MiB ({smallest} bytes; plain PyTorch needs "
            f"{baseline / _MIB:.1f} MiB, of which {model.fixed_bytes / _MIB:.1f} MiB are parameters, buffers, the "
            "batch and the optimizer's state"
            + (f" and DDP's gradient buckets ({model.ddp_bytes / _MIB:.1f} MiB)" if model.ddp_bytes else "")
            + (f"; the step runs {model.others + 1} forwards before its backward, each holding what it leaves until "
               "then" if model.others else "")
            + (f"; its step needs {(model.fixed_bytes + least_step) / _MIB:.1f} MiB, the gradients, the output "
               f"and {model.optimizer_scratch / _MIB:.1f} MiB of its own scratch included" if least_step else "")
            + ("; a fused optimizer (`fused=True` where it has one) allocates no scratch"
               if model.fixed_bytes + least_step - model.optimizer_scratch <= target < model.fixed_bytes + least_step
               else "")
            + "). Raise the budget to at least that, or lower the batch size.",
            smallest,
        )
    assert peak is not None and choice is not None
    decisions, compact, bits = choice
    if budget is not None and peak > budget:
        logger.warning(
            "strategy %r predicts a peak of %.1f MiB, above the budget of %.1f MiB", strategy, peak / _MIB, budget / _MIB
        )
    units = [
        UnitPlan(
            name=u,
            decision=decisions[u],
            kept_bytes=model.kept_bytes(u, decisions),
            recompute_s=model.recompute_time({u: decisions[u]}, compact & {u}),
            compact=u in compact,
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
        recompute_s=model.recompute_time(decisions, compact),
        bits=bits,
        level="auto" if compress is not None else "",
        outside_compact=OUTSIDE_UNITS in compact,
        variance=model.relative_variance(bits),
        compress_s=model.compress_time(bits),
        compress_scale=model.compress_scale,
        optimizer_bytes=model.optimizer_step(frozenset(compact)),
        ddp_bytes=model.ddp_bytes,
        forwards=model.others + 1,
        left_bytes=model.left_bytes(decisions, compact, bits),
        others_floor=model.others_floor,
        saved=[s.to_dict() for s in model.saved],
        step_s=model.step_s,
        solver=info.get("solver", ""),
        status=info.get("status", "optimal"),
        lp_bound=info.get("lp_bound"),
        solve_s=solve_s,
    )
