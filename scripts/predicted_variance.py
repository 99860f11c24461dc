"""A lossy plan's predicted gradient variance beside the variance its steps make, against plain PyTorch's gradient.

    python scripts/predicted_variance.py timm/vit_tiny_patch16_224 --small --batch 32       # 20 s, 2 cores
    python scripts/predicted_variance.py pyg/gcn --small --batch 2 --level L2.2 --steps 16
    python scripts/predicted_variance.py pyg/gcn --small --batch 2 --refreshed

Wraps the model at ``--level`` (sensitivities not refreshed; with ``--refreshed``, once), runs one step to plan, then ``--steps`` steps on the
same batch (dropout masks alike) and prints the mean of their squared gradient error relative to plain PyTorch's
squared gradient norm beside the plan's ``variance``, and the error of the steps' mean gradient (what rounding noise
alone leaves of it: the mean error over the number of steps; more is bias). The tests hold the prediction within 3x
of what is made on one layout (``tests/test_compression.py -k without_its_loss``); this shows it for any zoo model.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import zoomem
from zoomem.benchtools import add_model_arguments, model_from_arguments


def _grads(model: nn.Module, adapter: object, batch: object) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same dropout masks every step
    model.zero_grad(set_to_none=True)
    adapter.loss(model, batch, batch.call(model)).backward()  # type: ignore[attr-defined]
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _sq(gs: list[torch.Tensor]) -> float:
    return float(sum(g.double().square().sum() for g in gs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=8)
    parser.add_argument("--level", default="L2", help="a lossy level (default L2)")
    parser.add_argument("--steps", type=int, default=8, help="steps whose error is averaged (default 8)")
    parser.add_argument("--refreshed", action="store_true",
                        help="predict after the first refresh (steps 1-2: against the gradient step 1's loss sent "
                             "the outputs) rather than from planning's measurement")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, adapter, batch = model_from_arguments(args)
    model.train()
    ref = _grads(model, adapter, batch)
    zoomem.wrap(model, level=args.level, adapter=adapter, sensitivity_interval=200 if args.refreshed else 0)
    handle = model.__dict__["_zoomem"]
    for _ in range(3 if args.refreshed else 1):  # plans (step 0), holds step 1's output gradient, refreshes (2)
        _grads(model, adapter, batch)
    handle.sensitivity_interval = 0  # the plan stays while its steps are measured
    plan = next(iter(handle.plans.values()))
    runs = [_grads(model, adapter, batch) for _ in range(args.steps)]
    made = sum(_sq([a - b for a, b in zip(g, ref)]) for g in runs) / len(runs) / _sq(ref)
    mean = [sum(gs) / len(runs) for gs in zip(*runs)]
    of_mean = _sq([a - b for a, b in zip(mean, ref)]) / _sq(ref)
    print(f"{args.model} batch {args.batch} {args.level}: predicted relative variance {plan.variance:.3e}, made "
          f"{made:.3e} ({made / plan.variance if plan.variance else float('inf'):.2f}x the prediction) over {len(runs)} steps; error of their mean "
          f"{of_mean:.3e} (rounding noise alone: {made / len(runs):.3e})")
    zoomem.unwrap(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
