"""Random valid lossless plans, each run once: where the cost model predicts a memory point lower than it measures.

    python scripts/random_plans.py timm/resnet50 --batch 16 --plans 20 --seed 2
    python scripts/random_plans.py pyg/sage --small --plans 12

The planner picks few of the plans it could pick, so a cost model can be right on its choices and wrong on the rest;
these plans draw each unit's mode from the program's own menu (keep, recompute, recompute_cheap, recompute_chain
after a recomputed unit, each with the unit's compact forms where it has them) and the forms outside the units on
half the time. The model is wrapped once as plain PyTorch (no optimizer: the points are bytes above the step's
start); each plan runs one step with its memory timeline measured, compared point by point through
``zoomem.runtime.wrap.plan_points``. Exits 1 where some point measures more than ``--tolerance`` KiB above its
prediction, naming it.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys

import torch

import zoomem
from zoomem.benchtools import model_and_batch
from zoomem.planner import CostModel, Decision, Plan
from zoomem.planner.solve import unit_modes
from zoomem.runtime.wrap import plan_points

MIB = 2**20
DRAW_ORDER = [(Decision.KEEP, 0), (Decision.RECOMPUTE, 0), (Decision.RECOMPUTE_CHEAP, 0), (Decision.KEEP, 1),
              (Decision.RECOMPUTE, 1), (Decision.RECOMPUTE_CHAIN, 0), (Decision.RECOMPUTE_CHAIN, 1)]
"""The order modes are drawn from, which a seed's plans depend on (BENCHMARKS.md's were drawn in it)."""
SHORT = {Decision.KEEP: "k", Decision.RECOMPUTE: "r", Decision.RECOMPUTE_CHEAP: "rcheap",
         Decision.RECOMPUTE_CHAIN: "rchain"}


def random_plan(base: Plan, costs: CostModel, rng: random.Random) -> Plan:
    """A copy of ``base`` with every unit's mode drawn from those the program offers it (``unit_modes``)."""
    plan = copy.deepcopy(base)
    previous = Decision.KEEP
    for i, unit in enumerate(plan.units):
        modes = sorted(((d, on) for d, on in unit_modes(costs, i) if d != Decision.RECOMPUTE_CHAIN
                        or previous in (Decision.RECOMPUTE, Decision.RECOMPUTE_CHAIN)),  # after a recomputed unit
                       key=DRAW_ORDER.index)
        decision, on = rng.choice(modes)
        unit.decision, unit.compact = decision, bool(on)
        previous = decision
    plan.outside_compact = bool(costs.outside_gain) and rng.random() < 0.5
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a zoo id (zoomem.zoo), built from its config")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="the test suite's small layout (zoomem.zoo.small)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="config override (layers)")
    parser.add_argument("--plans", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=64.0, help="KiB a point may measure above its prediction")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, adapter, batch = model_and_batch(args.model, args.batch, args.small, args.set)
    zoomem.wrap(model, strategy="none", adapter=adapter, batch=batch)
    handle = model.__dict__["_zoomem"]
    base = next(iter(handle.plans.values()))
    costs = CostModel.from_graph(handle.last_graph)
    rng = random.Random(args.seed)
    over_peak, over_point = [], []
    for k in range(args.plans):
        plan = random_plan(base, costs, rng)
        points = [(p, v, got) for p, v, got in plan_points(model, plan, costs, batch) if got is not None]
        predicted = max(v for _, v, _ in points)
        measured = max(got for _, _, got in points)
        worst = max(points, key=lambda t: t[2] - t[1])
        error = worst[2] - worst[1]
        modes = " ".join(SHORT[u.decision] + "+c" * u.compact for u in plan.units)
        print(f"plan {k}: {modes}{' | outside compact' if plan.outside_compact else ''}")
        # the point predicted furthest above what it measures (a recomputed unit's recompute point measures its
        # stretch's start, against the larger prediction of it and its backward: not compared here)
        high = min((t for t in points if t[0].phase != "recompute"), key=lambda t: t[2] - t[1])
        print(f"   peak predicted {predicted / MIB:.2f} MiB, measured {measured / MIB:.2f} (bytes above the step's "
              f"start); worst point {worst[0].phase} {worst[0].seg}: measured {error / MIB:+.2f} MiB over; "
              f"most over-predicted {high[0].phase} {high[0].seg}: {high[1] / MIB:.2f} against {high[2] / MIB:.2f}")
        if measured - predicted > args.tolerance * 1024:
            over_peak.append((k, (measured - predicted) / MIB))
        if error > args.tolerance * 1024:
            over_point.append((k, worst[0].phase, worst[0].seg, error / MIB))
    print(f"{args.plans} plans: peak over prediction in {len(over_peak)} {over_peak}; some point over it in "
          f"{len(over_point)} {over_point} (MiB; tolerance {args.tolerance:g} KiB)")
    return 1 if over_point else 0


if __name__ == "__main__":
    sys.exit(main())
