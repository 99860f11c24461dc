"""What the Accelerate recipes in ``recipes/`` share: flags, the Accelerator, zoomem modes, step statistics, summary.

The recipes (``accelerate launch recipes/bert_large.py``, ``resnet50.py``, ``gnn.py``, ``gpt2.py``) stay plain
Accelerate training scripts; this module holds only what they would otherwise repeat, so that a flag or a summary
field means the same in each:

- :func:`add_common_args`: ``--zoomem {off,lossless,auto,L0..L3}``, ``--budget``, steps, seed, lr, output dir,
  ``--expect-processes`` ...; :func:`wrap_options` turns the zoomem flags into :func:`zoomem.wrap` arguments.
- :func:`make_accelerator`: an ``Accelerator`` that forms a gloo process group when a multi-process launch runs on
  a machine without an accelerator device (``accelerate launch --multi_gpu`` there would otherwise start N
  independent rank-0 processes), checked with :func:`zoomem.accelerate.check_processes`.
- :class:`StepStats`: wall time and samples of the training steps (throughput) and the peak memory of one step,
  measured with :class:`zoomem.MemoryMeter` (DESIGN.md section 8: CPU allocator trace, or CUDA allocator stats).
- :func:`finish`: the final JSON summary, printed and written to ``<output-dir>/summary.json``.
- :func:`fixed_length` and :func:`tokenize`: the text recipes' token ids at a fixed length (the embedded task's
  word-level ids, or a checkpoint's tokenizer); :func:`eval_subset`: ``--max-eval-samples``.

>>> parser = add_common_args(argparse.ArgumentParser(), steps=10, lr=1e-3, batch_size=8)
>>> args = parser.parse_args(["--zoomem", "lossless", "--budget", "70%"])
>>> wrap_options(args)
{'budget': '70%'}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .measure import MemoryMeter, MemoryReport
from .planner.compression import LEVELS

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "MODES",
    "StepStats",
    "add_common_args",
    "batches",
    "finish",
    "fill_defaults",
    "fixed_length",
    "make_accelerator",
    "plan_info",
    "setup_logging",
    "tokenize",
    "total_steps",
    "warmup_cosine",
    "wrap_options",
]

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("off", "lossless", "auto", *LEVELS)
"""``--zoomem`` choices: ``off`` plain PyTorch (zoomem not imported into the step), ``lossless`` a budgeted plan of
recomputation and exact compact forms, ``auto`` the same budget with lossy compression planned jointly
(``compress="auto"``), and the GACT-style levels (no budget)."""

DEFAULT_BUDGET = "80%"
"""Budget of ``lossless``/``auto`` when ``--budget`` is not given: a fraction of plain PyTorch's predicted peak
(the whole step: parameters, gradients and the optimizer state count, so small-batch runs cannot go much lower)."""

_MIB = float(1 << 20)


# ---------------------------------------------------------------------------------------------- flags


def _default(value: Any) -> str:
    return f"default {value}" if value is not None else "default: per device, see above"


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    steps: int | None,
    lr: float | None,
    batch_size: int | None,
    eval_batch_size: int | None = 256,
    seed: int = 0,
    budget: str = DEFAULT_BUDGET,
) -> argparse.ArgumentParser:
    """Add the flags every recipe takes (each recipe adds its model and data flags) and return the parser.

    ``None`` defaults are resolved by the recipe once it knows the device (full model on CUDA, shrunk on CPU);
    ``budget`` only describes the default budget in ``--help`` (the recipe sets ``args.budget`` if it differs).
    """
    g = parser.add_argument_group("training (shared by the recipes)")
    g.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"examples per process per step (global batch = this x processes); {_default(batch_size)}")
    g.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per process ({_default(steps)}; or what --epochs gives)")
    g.add_argument("--epochs", type=float, default=None, help="train this many passes over the training split "
                   "instead of --steps (steps = ceil(epochs x batches per process))")
    g.add_argument("--lr", type=float, default=lr, help="peak learning rate (linear warm-up over 10%% of the "
                   f"steps, then cosine decay to 0); {_default(lr)}")
    g.add_argument("--seed", type=int, default=seed, help="seeds the model, data order and dropout (all ranks)")
    g.add_argument("--eval-batch-size", type=int, default=eval_batch_size,
                   help=f"examples per process per evaluation forward; {_default(eval_batch_size)}")
    g.add_argument("--max-eval-samples", type=int, default=None,
                   help="evaluate on the first N examples of the eval split only (default: all of it)")
    g.add_argument("--log-every", type=int, default=20, help="log the loss (mean over processes) every N steps")
    g.add_argument("--meter-step", type=int, default=2,
                   help="0-based step measured with zoomem.MemoryMeter for the peak memory (default 2: after a "
                        "warm-up step, and not step 1, where adaptive compression measures its sensitivities again "
                        "outside the budget); -1 measures none")
    g.add_argument("--output-dir", type=Path, default=None, help="where summary.json goes (default out/<recipe>)")
    g.add_argument("--expect-processes", type=int, default=None,
                   help="fail unless Accelerate runs exactly N processes (catches `--cpu --num_processes N`, "
                        "which starts one)")
    z = parser.add_argument_group("zoomem")
    z.add_argument("--zoomem", choices=MODES, default="lossless", metavar="MODE",
                   help="off: plain PyTorch; lossless (default): recomputation + exact compact forms under "
                        "--budget; auto: the same with lossy compression chosen by the ILP (compress='auto'); "
                        f"{', '.join(LEVELS)}: GACT-style compression levels without a budget")
    z.add_argument("--budget", default=None,
                   help=f"memory budget of a training step per process for lossless/auto: bytes, '6GiB', '500MB' "
                        f"or a fraction of plain PyTorch's peak ('60%%' or 0.6); default {budget.replace('%', '%%')}")
    return parser


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any], from_config: bool, pretrained_lr: float,
                  output_dir: str, shape: tuple[str, ...] = ("layers", "hidden_size", "heads")) -> None:
    """Fill the flags left unset from one device's ``defaults``: the ``shape`` ones only for a model built from its
    config (a Hub checkpoint keeps its own shape), ``lr`` as ``pretrained_lr`` for a checkpoint (fine-tuning),
    the others always; ``--output-dir`` as ``output_dir``."""
    for key, value in defaults.items():
        if key == "lr":
            args.lr = args.lr or (value if from_config else pretrained_lr)
        elif getattr(args, key) is None and (from_config or key not in shape):
            setattr(args, key, value)
    args.output_dir = args.output_dir or Path(output_dir)


def _budget(text: str) -> int | float | str:
    """``--budget`` as :func:`zoomem.wrap` takes it: ``"0.6"`` -> 0.6, ``"1000000"`` -> bytes, else the string."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    if not 0 < value <= 1:
        raise ValueError(f"--budget {text}: a bare number is a fraction in (0, 1] or whole bytes; use e.g. "
                         "'60%', 0.6, '6GiB' or 6442450944.")
    return value


def wrap_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`zoomem.wrap` arguments of ``--zoomem``/``--budget`` (``{}`` never means off: check ``off`` first).

    Raises:
        ValueError: ``--zoomem off`` (nothing to wrap), or a level given with a budget (levels take none).
    """
    mode = args.zoomem
    if mode == "off":
        raise ValueError("--zoomem off means no zoomem.wrap at all; check for it before asking for wrap options.")
    if mode in LEVELS:
        if args.budget is not None:
            raise ValueError(f"--zoomem {mode} is a compression level without a budget; drop --budget {args.budget} "
                             "or use --zoomem auto (budgeted, lossy) / lossless (budgeted, exact).")
        return {"level": mode}
    options: dict[str, Any] = {"budget": _budget(args.budget or DEFAULT_BUDGET)}
    if mode == "auto":
        options["compress"] = "auto"
    return options


def total_steps(args: argparse.Namespace, default: int, batches_per_epoch: int) -> int:
    """``--steps``, or ``--epochs`` worth of batches, or the recipe's default."""
    if args.steps is not None and args.epochs is not None:
        raise ValueError("Give --steps or --epochs, not both.")
    if args.epochs is not None:
        return max(1, math.ceil(args.epochs * batches_per_epoch))
    steps = default if args.steps is None else args.steps
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}.")
    return steps


# ---------------------------------------------------------------------------------------------- accelerator


def _has_accelerator_device() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def make_accelerator(expect_processes: int | None = None, **kwargs: Any) -> Accelerator:
    """An ``Accelerator()`` that really forms the process group the launcher asked for, checked.

    ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun``) on a machine without an accelerator device
    starts N processes with ``WORLD_SIZE=N``, but ``Accelerator()`` then runs each alone as rank 0 (distributed type
    ``NO``: no gradient sync, no warning) unless ``cpu=True``. Here ``cpu=True`` is passed in exactly that case, so
    the processes form a gloo group (``MULTI_CPU``); on machines with a device nothing changes.

    Args:
        expect_processes: fail unless Accelerate runs this many processes.
        kwargs: more ``Accelerator`` arguments.

    Raises:
        zoomem.accelerate.ProcessCountError: the launch gave other processes than asked for, or processes that do
            not talk to each other.
    """
    from accelerate import Accelerator

    from .accelerate import check_processes

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and not kwargs.get("cpu") and not _has_accelerator_device():
        kwargs["cpu"] = True  # gloo processes, not N independent rank-0 runs
    accelerator = Accelerator(**kwargs)
    check_processes(accelerator, expect_processes)
    if (accelerator.num_processes == 1 and "WORLD_SIZE" not in os.environ and os.environ.get("MASTER_PORT")
            and expect_processes is None):
        logger.warning(
            "MASTER_PORT is set but WORLD_SIZE is not: `accelerate launch --cpu --num_processes N` starts one "
            "process. For N gloo processes use `accelerate launch --multi_gpu --num_processes N`; pass "
            "--expect-processes N to make this an error."
        )
    return accelerator


def setup_logging(accelerator: Accelerator) -> None:
    """INFO on the main process (zoomem's planning lines, the recipe's loss log), warnings elsewhere."""
    logging.basicConfig(
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if accelerator.is_main_process:
        for noisy in ("httpx", "urllib3", "filelock", "fsspec"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------- training


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to zero at ``steps``.

    Stepped once per optimizer step by the recipe itself, not through ``accelerator.prepare``: a prepared scheduler
    steps ``num_processes`` times per call (it assumes schedules counted in single-process batches).
    """
    warm = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fixed_length(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Pad (with id 0) or cut token ids ``[rows, length]`` to ``seq_len`` (the embedded text task's ids).

    >>> fixed_length(torch.tensor([[5, 6, 7]]), 5).tolist(), fixed_length(torch.tensor([[5, 6, 7]]), 2).tolist()
    ([[5, 6, 7, 0, 0]], [[5, 6]])
    """
    if ids.size(1) >= seq_len:
        return ids[:, :seq_len].contiguous()
    return torch.nn.functional.pad(ids, (0, seq_len - ids.size(1)))


def tokenize(tokenizer: Any, texts: list[Any], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``tokenizer(*texts)`` padded and cut to ``seq_len`` (one or two text
    columns, as a sequence-pair task has)."""
    enc = tokenizer(*texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def eval_subset(dataset: Any, limit: int | None) -> Any:
    """The first ``limit`` examples of ``dataset`` (all of it when ``None``), as HF's examples'
    ``--max_eval_samples``: a quick evaluation on a large split.

    >>> len(eval_subset(list(range(10)), 3)), len(eval_subset(list(range(10)), None))
    (3, 10)
    """
    if limit is None or limit >= len(dataset):
        return dataset
    if limit < 1:
        raise ValueError(f"--max-eval-samples must be >= 1, got {limit}")
    return torch.utils.data.Subset(dataset, range(limit))


def batches(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, for a loop counted in steps (``set_epoch`` reshuffles each)."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("The training loader yields no batch: lower --batch-size (batches are full-size only).")
        epoch += 1


class StepStats:
    """Times the training steps and measures the peak memory of one of them.

    Throughput counts every step except the metered one (the CPU meter's profiler slows its step down) and the
    first (warm-up); peak memory is that of step ``meter_step`` as :class:`zoomem.MemoryMeter` defines it (the
    step's forward, backward and optimizer phases; fixed bytes of parameters, gradients, optimizer state and
    batch included). On CUDA the allocator's peak over all training steps is recorded as well (read after every
    step, since the meter resets the peak statistics; evaluation is not included).

    >>> stats = StepStats(torch.device("cpu"), meter_step=-1)
    >>> with stats.step(0, samples=8):
    ...     pass
    """

    def __init__(self, device: torch.device, meter_step: int = 2) -> None:
        self.device = device
        self.meter_step = meter_step
        self.seconds = 0.0
        self.samples = 0
        self.steps = 0
        self.report: MemoryReport | None = None
        self._meter: MemoryMeter | None = None
        self._cuda_peak = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)  # planning's own trace step is not training

    @contextlib.contextmanager
    def step(self, index: int, samples: int, *holders: Any) -> Iterator[None]:
        """Time step ``index`` of ``samples`` examples (all processes); meter it when it is ``meter_step``.

        ``holders`` (the bare model, the optimizer, the batch) give the CPU meter its baseline.
        """
        meter = MemoryMeter(*holders, device=self.device) if index == self.meter_step else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
        start = time.perf_counter()
        with meter if meter is not None else contextlib.nullcontext():
            self._meter = meter
            try:
                yield
            finally:
                self._meter = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
        if meter is not None:
            self.report = meter.report
            self._cuda_peak = max(self._cuda_peak, self.report.peak_bytes if self.device.type == "cuda" else 0)
        elif index > 0:
            self.seconds += time.perf_counter() - start
            self.samples += samples
            self.steps += 1

    def mark(self, name: str) -> None:
        """Cut the metered step into phases (``forward``, ``backward``, ``optimizer``); a no-op on other steps."""
        if self._meter is not None:
            self._meter.mark(name)

    def summary(self) -> dict[str, Any]:
        """Throughput and peak memory, for the final JSON."""
        out: dict[str, Any] = {
            "samples_per_s": round(self.samples / self.seconds, 2) if self.seconds > 0 else None,
            "timed_steps": self.steps,
            "seconds_per_step": round(self.seconds / self.steps, 4) if self.steps else None,
        }
        if self.report is not None:
            r = self.report
            out["peak_memory_mib"] = round(r.peak_bytes / _MIB, 2)
            out["peak_memory"] = {
                "source": f"zoomem.MemoryMeter on step {self.meter_step} "
                          + ("(CUDA allocator)" if r.device.startswith("cuda") else "(CPU allocator trace)"),
                "peak_bytes": r.peak_bytes,
                "baseline_bytes": r.baseline_bytes,
                "activation_bytes": r.activation_bytes,
                "phases_peak_mib": {k: round(v.peak_bytes / _MIB, 2) for k, v in r.phases.items()},
            }
        else:
            out["peak_memory_mib"] = None
        if self.device.type == "cuda":
            out["cuda_max_memory_allocated_mib"] = round(self._cuda_peak / _MIB, 2)
        return out


# ---------------------------------------------------------------------------------------------- summary


def plan_info(model: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """What zoomem ran: the mode and, per plan (one per input signature), its prediction and decisions."""
    info: dict[str, Any] = {"mode": args.zoomem}
    if args.zoomem == "off":
        return info
    from .accelerate import plans

    info.update(wrap_options(args))
    out = []
    for p in plans(model):
        recomputed = [u.name for u in p.units if u.decision.value != "keep"]
        out.append({
            "strategy": p.strategy,
            "level": p.level or None,
            "status": p.status,
            "budget_mib": None if p.budget_bytes is None else round(p.budget_bytes / _MIB, 2),
            "predicted_peak_mib": round(p.predicted_peak_bytes / _MIB, 2),
            "pytorch_predicted_peak_mib": round(p.baseline_peak_bytes / _MIB, 2),
            "measured_peak_mib": (round(p.extras["measured_peak_bytes"] / _MIB, 2)
                                  if p.extras.get("measured_peak_bytes") is not None else None),
            "fixed_mib": round(p.fixed_bytes / _MIB, 2),
            "units": len(p.units),
            "recomputed_units": len(recomputed),
            "compact_units": sum(bool(u.compact) for u in p.units),
            "lossy_tensors": len(p.bits),
            "predicted_overhead": None if math.isnan(p.overhead) else round(p.overhead, 3),
            "solve_s": round(p.solve_s, 3),
        })
    info["plans"] = out
    return info


def finish(accelerator: Accelerator, summary: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    """Print the summary as JSON and write ``<output_dir>/summary.json`` (main process), end training on every
    rank (the process group is destroyed); return the summary."""
    summary = {
        **summary,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "torch_threads": torch.get_num_threads(),
    }
    if accelerator.is_main_process:
        text = json.dumps(summary, indent=2)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "summary.json").write_text(text + "\n")
        print(text, flush=True)
        logger.info("summary written to %s", output_dir / "summary.json")
    # every rank leaves the process group together: a gloo group still alive at interpreter exit can abort a rank
    # ("terminate called without an active exception") after the run itself succeeded
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary
