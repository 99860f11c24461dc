"""What ``skip_logits`` saves and costs on an HF language model: memory held after forward, the forward's peak, the
step's peak and its time, with the rest of the plan fixed.

    python scripts/skip_logits.py hf/gpt2 --batch 2 --set n_layer=2 --seq-len 256    # about 2 minutes, 2 CPU cores

The model is wrapped with no unit recomputed and no unit's forms on; three configurations of that plan run
interleaved: the stock loss (no form at all), the fused LM-head loss keeping the logits (the forms outside the
units on), and the same with ``skip_logits`` (the forward returns ``logits=None``; the loss's backward makes each
slice of the logits again). The caller holds the output until the step ends, as a training loop does. One metered
step per configuration gives the bytes; ``--rounds`` interleaved steps after one warm-up round give the times
(medians).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import zoomem
from zoomem.benchtools import add_model_arguments, interleaved_medians, model_from_arguments
from zoomem.ops.loss import set_skip_logits
from zoomem.runtime.wrap import _loss

MIB = 2**20
CONFIGS = {"stock loss": (False, False), "fused loss": (True, False), "fused loss, skip_logits": (True, True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=2, what="an HF language-model zoo id (zoomem.zoo)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per configuration")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, adapter, batch = model_from_arguments(args)
    loss_fn = _loss(adapter, model, None)
    zoomem.wrap(model, strategy="none", adapter=adapter, batch=batch)
    plan = next(iter(model.__dict__["_zoomem"].plans.values()))  # the plan in force: switched per configuration
    for u in plan.units:
        u.compact = False

    def step(name: str, meter: zoomem.MemoryMeter | None = None) -> Any:
        plan.outside_compact, skip = CONFIGS[name]
        set_skip_logits(model, skip)
        model.zero_grad(set_to_none=True)
        out = batch.call(model)
        if meter is not None:
            meter.mark("forward")
        loss_fn(out, batch).backward()
        return out  # (the caller holds the output to the end of the step)

    for name in CONFIGS:
        # the previous configuration's gradients freed before the meter starts: it ignores frees of blocks from
        # before its window, so freeing them inside would count them as held through this step
        model.zero_grad(set_to_none=True)
        with zoomem.MemoryMeter(model, batch) as meter:
            out = step(name, meter)
        report = meter.report
        print(f"{name}: logits returned {out.logits is not None}; held after forward "
              f"{report.activation_bytes / MIB:.1f} MiB, forward peak {report.phases['forward'].peak_bytes / MIB:.1f} "
              f"MiB, step peak {report.peak_bytes / MIB:.1f} MiB")
        del out
    medians = interleaved_medians(list(CONFIGS), step, args.rounds)
    zoomem.unwrap(model)
    for name, mid in medians.items():
        print(f"{name}: median {mid:.3f} s over {args.rounds} interleaved steps "
              f"({mid / medians['fused loss']:.3f}x the fused loss)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
