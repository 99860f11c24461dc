"""A plan's predicted peak beside a metered training step, phase by phase, for the optimizers you name.

    python scripts/step_memory.py hf/gpt2 --batch 8 --set n_layer=2 --seq-len 256 --level L2 \\
        --optimizers adamw adamw-foreach adamw-fused sgd   # 5 min, 2 cores

``--lora c_attn c_proj c_fc`` makes the model a PEFT LoRA one (r=16, dropout 0.1, on the modules named; needs
``pip install peft``): only the adapters train, so the gradients and the optimizer's state are theirs alone.

``--ddp`` runs each step under ``DistributedDataParallel`` in a one-process gloo group: its gradient buckets (a
flat copy of the gradients, built with it) count in the plan's fixed bytes and in the meter's baseline.

For each optimizer the model is built afresh, wrapped with that optimizer (``optimizer=``, refreshes of
sensitivities off) and stepped twice. Step 0 plans. Step 1 is metered as an ordinary loop steps (forward, loss,
backward, ``optimizer.step()``, ``zero_grad``, the output held to the end: ``zoomem.measure_step``). The plan's
predicted peak counts the optimizer's step (the gradients, the output held, the step's own scratch), which is
the step's peak once a plan takes the backward low enough.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zoomem
from zoomem.benchtools import add_model_arguments, model_from_arguments
from zoomem.measure import holder_bytes
from zoomem.runtime.wrap import _loss

MIB = 2**20

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=8)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--level", default="L2", help="a compression level (default L2)")
    which.add_argument("--budget", default=None, help="a budget instead (lossless), e.g. 60%% or 2GiB")
    parser.add_argument("--optimizers", nargs="+", default=["adamw"], choices=list(OPTIMIZERS))
    parser.add_argument("--ddp", action="store_true", help="step under DDP (one gloo process)")
    parser.add_argument("--lora", nargs="+", metavar="MODULE",
                        help="a PEFT LoRA model (r=16, dropout 0.1) on these target modules, e.g. c_attn c_proj c_fc")
    args = parser.parse_args(argv)
    with _gloo() if args.ddp else contextlib.nullcontext():
        _table(args)
    return 0


@contextlib.contextmanager
def _gloo() -> Iterator[None]:
    """A gloo process group of one, for DDP without a launcher."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=(Path(tmp) / "store").as_uri(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _table(args: argparse.Namespace) -> None:
    how = {"budget": args.budget} if args.budget is not None else {"level": args.level, "sensitivity_interval": 0}
    if args.budget is not None:
        print(f"budget {args.budget}")
    print("| optimizer | predicted peak | optimizer's step, predicted | forward | backward | optimizer | measured peak "
          "| measured / predicted |" + (" DDP's buckets |" if args.ddp else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.ddp else ""))
    for name in args.optimizers:
        torch.manual_seed(0)
        model, adapter, batch = model_from_arguments(args)
        if args.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, target_modules=args.lora, lora_dropout=0.1))
            adapter = zoomem.adapters.get_adapter(model)
        model.train()
        loss_fn = _loss(adapter, model, None)
        optimizer = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
        runner = DistributedDataParallel(model) if args.ddp else model
        zoomem.wrap(model, optimizer=optimizer, adapter=adapter, **how)
        try:
            loss_fn(batch.call(runner), batch).backward()  # step 0 plans (planning measures; it runs outside a meter)
        except zoomem.InfeasibleBudgetError as exc:
            print(f"| {name} | no plan: the smallest feasible budget is {exc.min_budget / MIB:.1f} MiB |||||||",
                  flush=True)
            zoomem.unwrap(model)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.ddp:  # DDP rebuilds its buckets in its second forward (the meter would miss the old ones' free)
            loss_fn(batch.call(runner), batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        report = zoomem.measure_step(runner, batch, loss_fn, optimizer)
        # what exists before the step, DDP's buckets as torch reports them (a zoomem before it counted them too)
        start = holder_bytes(model, optimizer, batch) + _buckets(runner)
        (plan,) = model.__dict__["_zoomem"].plans.values()
        step = getattr(plan, "optimizer_bytes", 0)  # (a zoomem before it counted the step: 0)
        phases = {k: (start + v.peak_bytes - report.baseline_bytes) / MIB for k, v in report.phases.items()}
        peak = start + report.peak_delta_bytes
        print(f"| {name} | {plan.predicted_peak_bytes / MIB:.1f} | "
              f"{(plan.fixed_bytes + step) / MIB if step else 0:.1f} | {phases['forward']:.1f} | "
              f"{phases['backward']:.1f} | {phases['optimizer']:.1f} | {peak / MIB:.1f} | "
              f"{peak / plan.predicted_peak_bytes:.3f} |"
              + (f" {_buckets(runner) / MIB:.1f} |" if args.ddp else ""), flush=True)
        zoomem.unwrap(model)


def _buckets(runner: torch.nn.Module) -> int:
    """DDP's gradient buckets, in bytes, as DDP reports them (0 without DDP)."""
    if not isinstance(runner, DistributedDataParallel):
        return 0
    return sum(int(b) for b in str(runner._get_ddp_logging_data()["bucket_sizes"]).split(","))


if __name__ == "__main__":
    sys.exit(main())
