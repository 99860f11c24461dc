"""What the compact forms add to a step's time: as the cost model measures it, and over interleaved timed steps.

    python scripts/compact_times.py timm/resnet50 --batch 16     # about 3 minutes on 2 CPU cores

The cost model times each unit's compact forms as the difference between two single timed steps (all forms on
against the forms outside the units only), and the forms outside the units against the plain step. One step's
noise can be larger than the forms' cost, so the program prices a negative difference at zero unless a form may
run faster than the stock op (``zoomem.ops.Impl.may_be_faster``). This script shows both: the raw differences of
``--traces`` cost models in a row (before that rule), and the medians of ``--rounds`` interleaved steps of the
wrapped model with no form, every unit's forms, and the forms outside the units on.
"""

from __future__ import annotations

import argparse
import sys

import torch

import zoomem
from zoomem.benchtools import interleaved_medians, model_and_batch
from zoomem.planner import CostModel
from zoomem.planner.costs import OUTSIDE_UNITS
from zoomem.runtime.wrap import _loss, cost_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a zoo id (zoomem.zoo), built from its config")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--small", action="store_true", help="the test suite's small layout (zoomem.zoo.small)")
    parser.add_argument("--traces", type=int, default=2, help="cost models measured in a row")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per configuration")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, adapter, batch = model_and_batch(args.model, args.batch, args.small)
    for k in range(args.traces):
        costs, _, graph = cost_model(model, batch, adapter)
        graph.compact_faster = [*costs.units, OUTSIDE_UNITS]  # every measured difference as it came out
        raw = CostModel.from_graph(graph).compact_s
        units = sum(v for u, v in raw.items() if u in costs.units)
        priced = sum(costs.compact_s.get(u, 0.0) for u in costs.units)
        print(f"cost model {k + 1}: plain step {costs.step_s:.3f} s; units' forms {units:+.3f} s, forms outside "
              f"the units {raw.get(OUTSIDE_UNITS, 0.0):+.3f} s (as priced: units' {priced:+.3f} s, outside "
              f"{costs.compact_s.get(OUTSIDE_UNITS, 0.0):+.3f} s)")

    loss_fn = _loss(adapter, model, None)
    zoomem.wrap(model, strategy="none", adapter=adapter, batch=batch)
    plan = next(iter(model.__dict__["_zoomem"].plans.values()))  # the plan in force: switched per configuration
    configs = {"no form": (False, False), "every unit's forms": (True, False), "forms outside the units": (False, True)}

    def step(name: str) -> None:
        units_on, outside_on = configs[name]
        for u in plan.units:
            u.compact = units_on
        plan.outside_compact = outside_on
        model.zero_grad(set_to_none=True)
        loss_fn(batch.call(model), batch).backward()

    medians = interleaved_medians(list(configs), step, args.rounds)
    zoomem.unwrap(model)
    base = medians["no form"]
    for name, mid in medians.items():
        print(f"{name}: median {mid:.3f} s over {args.rounds} interleaved steps, {mid - base:+.3f} s "
              f"({mid / base:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
