"""The memory and time of a step that measures sensitivities again, beside the steps of the plan around it.

    python scripts/refresh_memory.py hf/gpt2 --batch 8 --set n_layer=2 --seq-len 256 --level L2   # 2 min, 2 cores

Adaptive compression (a level, or ``--budget`` with ``compress="auto"``) measures every saved tensor's sensitivity
when it plans and again at steps 1, 4, 16, 64 and every ``sensitivity_interval``. That measurement holds every
activation and a second-order backward's own. This script wraps the model with AdamW, runs step 0 (it plans) and
then meters steps 1 to ``--steps``, one AdamW step each, and prints each step's peak and time beside the plan's
predicted peak, plain PyTorch's predicted peak and the budget, and the sizes refreshes measure at. A model whose
loss lies outside its forward (timm, PyG) holds step 1's output gradient and refreshes at step 2, against it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

import zoomem
from zoomem.benchtools import add_model_arguments, model_from_arguments
from zoomem.runtime.wrap import _loss

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=8)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--level", default="L2", help="an adaptive level (default L2)")
    which.add_argument("--budget", default=None, help="a budget for compress='auto' instead, e.g. 60%% or 2GiB")
    parser.add_argument("--steps", type=int, default=3, help="last metered step (step 1 or 2 refreshes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("zoomem.runtime.probe").setLevel(logging.WARNING)
    torch.manual_seed(0)
    model, adapter, batch = model_from_arguments(args)
    model.train()
    loss_fn = _loss(adapter, model, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    how = {"budget": args.budget, "compress": "auto"} if args.budget is not None else {"level": args.level}
    zoomem.wrap(model, optimizer=optimizer, adapter=adapter, **how)

    def step() -> None:
        loss_fn(batch.call(model), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # step 0: plans
    handle = model.__dict__["_zoomem"]
    ((plan,), (ctx,)) = handle.plans.values(), handle.planning.values()
    sizes = f"{ctx.probe_scale.small} and {ctx.probe_scale.large} samples" if ctx.probe_scale else "the batch"
    print(f"plan: predicted peak {plan.predicted_peak_bytes / MIB:.1f} MiB; plain PyTorch predicted "
          f"{plan.baseline_peak_bytes / MIB:.1f} MiB; budget "
          f"{'none' if plan.budget_bytes is None else f'{plan.budget_bytes / MIB:.1f} MiB'}; refreshes measure at "
          f"{sizes}")
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        before = handle.plans[handle.last_sig]
        with zoomem.MemoryMeter(model, optimizer, batch) as meter:
            step()
        what = (" (refresh)" if handle.plans[handle.last_sig] is not before
                else " (holds its output gradient for a refresh)" if handle.held is not None else "")
        print(f"step {i}: peak {meter.report.peak_bytes / MIB:.1f} MiB, {time.perf_counter() - t0:.2f} s{what}")
    zoomem.unwrap(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
