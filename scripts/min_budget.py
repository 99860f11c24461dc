"""The smallest budget an infeasible-budget error names, over fresh traces, and whether wrapping at it works.

    python scripts/min_budget.py timm:densenet121 hf:roberta --repeat 4

Each repeat asks a fresh wrap for 5% of plain PyTorch's peak (far below what any plan reaches), reads the smallest
feasible budget the error names, and wraps again at exactly that budget, as a user following the error's advice
would: another trace, so other timings and possibly other plans. A row per repeat: the named budget, the plan the
retry kept (predicted and measured peak, units recomputed) or the retry's own error. Models as
``scripts/coverage.py`` builds them (``kind:name``: 64 px images, small text configs), or zoo ids at full size
(``kind/name``, :func:`zoomem.zoo.build`, at ``--batch``: ``timm/densenet121 --batch 8`` is 224 px); random
weights, nothing downloaded.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import zoomem  # noqa: E402
from coverage import build  # noqa: E402
from zoomem import zoo  # noqa: E402
from zoomem.planner import Decision, InfeasibleBudgetError  # noqa: E402

MIB = 2**20


def repeat(spec: str, times: int, batch_size: int = 8) -> list[dict]:  # type: ignore[type-arg]
    """One row per fresh trace of ``spec`` (see the module's docstring)."""
    if ":" in spec:
        model, adapter, batch = build(spec, 64)
    else:
        torch.manual_seed(0)
        model, adapter = zoo.build(spec)
        batch = adapter.example_batch(model, batch_size)
    model.train()
    initial = copy.deepcopy(model.state_dict())
    rows = []
    for _ in range(times):
        model.load_state_dict(initial)
        try:
            zoomem.wrap(model, 0.05, adapter=adapter, batch=batch)
        except InfeasibleBudgetError as err:
            named = err.min_budget
        else:
            zoomem.unwrap(model)
            rows.append({"model": spec, "named": None})
            continue
        model.load_state_dict(initial)
        row = {"model": spec, "named": named}
        try:
            zoomem.wrap(model, named, adapter=adapter, batch=batch)
        except InfeasibleBudgetError as err:
            row["retry_error"] = err.min_budget
        else:
            plan = next(iter(model.__dict__["_zoomem"].plans.values()))
            row.update(predicted=plan.predicted_peak_bytes, measured=plan.extras.get("measured_peak_bytes"),
                       recomputed=sum(u.decision != Decision.KEEP for u in plan.units), units=len(plan.units))
            zoomem.unwrap(model)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model specs of scripts/coverage.py (timm:NAME, hf:NAME, pyg:NAME) "
                        "or zoo ids (timm/resnet50, hf/bert-base-uncased, pyg/gcn)")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="batch size of zoo ids (graphs: 1000 nodes each)")
    args = parser.parse_args(argv)
    print("| model | named minimum (bytes) | retry: predicted | measured | units recomputed |")
    print("|---|---:|---:|---:|---:|")
    failed = 0
    for spec in args.models:
        for r in repeat(spec, args.repeat, args.batch):
            if r["named"] is None:
                print(f"| {spec} | (5% fits) | | | |")
            elif "retry_error" in r:
                failed += 1
                print(f"| {spec} | {r['named']} ({r['named'] / MIB:.2f} MiB) | RETRY FAILED: names "
                      f"{r['retry_error']} | | |")
            else:
                print(f"| {spec} | {r['named']} ({r['named'] / MIB:.2f} MiB) | {r['predicted']} | {r['measured']} | "
                      f"{r['recomputed']} of {r['units']} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
