"""Predicted against measured bytes at every memory point of zoomem plans: where a cost model is off.

    python scripts/point_errors.py hf/bert-base-uncased --batch 8 --set num_hidden_layers=2 L1.2 auto@0.9

Each plan argument is a level (``L1.2``), ``lossless@F`` or ``auto@F`` (a budget of F times plain PyTorch's
peak, lossless or ``compress="auto"``). The model is wrapped once (``level="L2"``); each plan is made on it as
``zoomem.plan`` makes it, then one step runs under it with the memory timeline measured, and every point of the
cost model (a segment's forward peak, backward peak, and the bytes live where its backward starts; where the code
after a unit saves tensors, as timm's DenseNet transitions do, that code's backward peak apart, ``after``) is
printed beside the measured one. Points are bytes above the step's start (parameters, optimizer state and batch
apart). The head line's peaks are the forward's and backward's; the optimizer's step, which a plan's peak also
counts, is not run here and is printed as predicted.

Where the step has no stretch for a point, or one stretch measures two, ``zoomem.runtime.wrap.plan_points`` folds
the predictions into the measured stretch's, the larger of them: a recomputed unit's backward point measures its
recomputation (its ``recompute`` point is measured where the backward starts, before the first unpacking runs
it, so that one reads high by about the unit's forward rise) and its ``after`` point (n/a: the measuring hooks do
not see the unit's own backward start, its checkpoint unpacks it); a unit that drops its input
(``recompute_chain``) shows n/a at its backward point, measured in the stretch that ran before it.
"""

from __future__ import annotations

import argparse
import sys

import torch

import zoomem
from zoomem import zoo
from zoomem.planner import Decision
from zoomem.planner.compression import CompressOptions, get_level
from zoomem.runtime.wrap import _make, plan_points

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a zoo id (zoomem.zoo), built from its config")
    parser.add_argument("plans", nargs="+", help="L0..L3, lossless@F or auto@F")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="config override (layers)")
    parser.add_argument("--seq-len", type=int, default=512, help="HF models")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, adapter = zoo.build(args.model, **{k: int(v) for k, v in (s.split("=") for s in args.set)})
    sizes = {"seq_len": args.seq_len} if args.model.startswith("hf/") else {}
    batch = adapter.example_batch(model, args.batch, **sizes)
    optimizer = torch.optim.AdamW(model.parameters())
    loss_fn = lambda out, b: adapter.loss(model, b, out)  # noqa: E731
    zoomem.wrap(model, level="L2", batch=batch, optimizer=optimizer, loss_fn=loss_fn, sensitivity_interval=0)
    handle = model.__dict__["_zoomem"]
    for name in args.plans:
        kind, _, frac = name.partition("@")
        with handle.planning_scope():
            try:
                plan = _make(model, batch, float(frac) if frac else None, "ilp", adapter, optimizer, loss_fn, 10.0,
                             compress=CompressOptions() if kind == "auto" else None,
                             level=get_level(kind) if not frac else None)
            except zoomem.InfeasibleBudgetError as exc:
                print(f"== {name}: infeasible, min {exc.min_budget / MIB:.1f} MiB")
                continue
        costs = plan.extras["_planning"].costs if "_planning" in plan.extras else None
        if costs is None:
            print(f"== {name}: a lossless plan without its cost model here; use auto@F")
            continue
        points = plan_points(model, plan, costs, batch)
        measured = [got for _, _, got in points if got is not None]
        recomputed = sum(u.decision != Decision.KEEP for u in plan.units)
        compact = sum(u.compact for u in plan.units) + int(plan.outside_compact)
        # the points are the forward's and backward's; the optimizer's step (in the plan's peak) is not run here
        predicted = costs.fixed_bytes + max(value for _, value, _ in points)
        print(f"== {name}: predicted peak {predicted / MIB:.1f} MiB, measured "
              f"{(costs.fixed_bytes + max(measured)) / MIB:.1f}; {len(plan.bits)} tensors lossy, "
              f"{recomputed} of {len(plan.units)} units recomputed, {compact} compact switches on; the optimizer's "
              f"step {(costs.fixed_bytes + costs.optimizer_bytes) / MIB:.1f} MiB, predicted")
        print(f"   {'point':14s} {'plain':>9s} {'predicted':>10s} {'measured':>9s} {'error':>8s}  (MiB)")
        for p, value, got in points:
            err = f"{(value - got) / MIB:+8.1f}" if got is not None else "     n/a"
            got_text = f"{got / MIB:9.1f}" if got is not None else "      n/a"
            print(f"   {p.phase:9s} {p.seg:4d} {p.measured / MIB:9.1f} {value / MIB:10.1f} {got_text} {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
