"""zoomem under HuggingFace Accelerate: ``accelerator.prepare`` as usual, with the bare model wrapped.

Accelerate has no extension point inside ``prepare()``, and DDP must never see its modules or parameters swapped
after it is built. ``zoomem.wrap`` changes forwards at instance level only, so it may wrap the bare model before
``prepare`` or the module DDP holds after it; :func:`prepare` does the latter (the order that also works under
mixed precision), after checking that the processes are the ones asked for:

>>> import zoomem.accelerate
>>> from accelerate import Accelerator
>>> accelerator = Accelerator()                                                     # doctest: +SKIP
>>> model, opt, loader = zoomem.accelerate.prepare(
...     accelerator, model, opt, loader, budget="6GiB", expect_processes=2)          # doctest: +SKIP

What it checks, and why:

- ``accelerate launch --cpu --num_processes 2`` starts *one* process, silently; ``--multi_gpu`` on a machine
  without a GPU and without ``ACCELERATE_USE_CPU=1`` starts N processes that each run alone as rank 0 (Accelerate
  reports ``NO``; nothing syncs the gradients). :func:`check_processes` turns both into a
  :class:`ProcessCountError` that says how to launch instead.
- Accelerate's DDP modes (``NO``, ``MULTI_CPU``, ``MULTI_GPU`` and the other ``MULTI_*`` device types) work on
  the wrapped model: gradients match those without zoomem, rank for rank. FSDP, DeepSpeed, Megatron-LM and XLA
  shard or replace the parameters and run their own hooks around forward and backward, while zoomem traces a
  whole training step inside the first forward: :func:`check_distributed_type` refuses them with
  :class:`UnsupportedDistributedError`, naming what to use instead.
- Lossless plans are per rank: each rank plans for its own inputs when it meets them (dynamic padding trains).
  Lossy plans share their bits: at a step of one shape every rank plans on its own batch, then takes rank 0's
  plan, from sensitivities averaged over the ranks (``zoomem.runtime.distributed``); at a step whose shapes
  differ, every rank runs the plan for the rank whose inputs hold the others' (made by that rank alone where
  none is cached), and where no rank's do, every rank raises at that step.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .batch import Batch
from .planner import Plan
from .planner.compression import CompressOptions
from .runtime import is_wrapped, wrap
from .runtime.distributed import holding

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "DDP_TYPES",
    "ProcessCountError",
    "UnsupportedDistributedError",
    "check_distributed_type",
    "check_processes",
    "log_plans",
    "plans",
    "prepare",
]

logger = logging.getLogger(__name__)

DDP_TYPES: frozenset[str] = frozenset({
    "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
    "MULTI_HPU", "MULTI_NEURON",
})
"""Accelerate distributed types zoomem supports: one process, or DDP (``prepare`` wraps in DistributedDataParallel)."""

_LAUNCH_CPU = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {n} script.py"


class ProcessCountError(RuntimeError):
    """The launch did not give the processes asked for (or gave processes that do not talk to each other)."""


class UnsupportedDistributedError(RuntimeError):
    """Accelerate runs a distributed mode zoomem does not support (FSDP, DeepSpeed, Megatron-LM, XLA)."""


def _kind(state: Any) -> str:
    kind = state.distributed_type
    return str(getattr(kind, "value", kind))


def check_processes(accelerator: Any, expected: int | None = None) -> int:
    """Fail loudly when the launch gave other processes than asked for; return the number of processes.

    Args:
        accelerator: an ``Accelerator`` (or ``AcceleratorState`` / ``PartialState``: anything with
            ``num_processes`` and ``distributed_type``).
        expected: the number of processes the run needs; ``None`` checks only what the environment reveals.

    Returns:
        ``accelerator.num_processes``.

    Raises:
        ProcessCountError: the launcher started ``WORLD_SIZE`` processes but Accelerate runs each alone (``--multi_gpu``
            without a GPU and without ``ACCELERATE_USE_CPU=1``), or ``expected`` differs from
            ``accelerator.num_processes`` (``--cpu --num_processes N`` starts one process).

    >>> check_processes(Accelerator(), expected=2)  # doctest: +SKIP
    """
    n = int(accelerator.num_processes)
    kind = _kind(accelerator)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world > n:
        raise ProcessCountError(
            f"The launcher started {world} processes (WORLD_SIZE={world}"
            + (f", LOCAL_WORLD_SIZE={local}" if local else "")
            + f") but Accelerate counts {n} (distributed_type {kind}): the processes train independently, every "
            "one as rank 0, with no gradient sync. On a machine without a GPU, `accelerate "
            "launch --multi_gpu` needs ACCELERATE_USE_CPU=1 (or Accelerator(cpu=True)) to start gloo processes "
            f"(MULTI_CPU): `{_LAUNCH_CPU.format(n=world)}`. On a GPU machine, check that torch.cuda.is_available()."
        )
    if expected is not None and n != expected:
        raise ProcessCountError(
            f"This run expects {expected} processes but Accelerate runs {n} (distributed_type {kind}). "
            "`accelerate launch --cpu --num_processes N` starts a single process without saying so; on a machine "
            f"without a GPU start N gloo processes with `{_LAUNCH_CPU.format(n=expected)}` (or `torchrun "
            f"--nproc_per_node {expected}` with Accelerator(cpu=True)); with GPUs, `accelerate launch --multi_gpu "
            f"--num_processes {expected}`."
        )
    return n


def check_distributed_type(accelerator: Any) -> None:
    """Refuse the distributed modes zoomem does not support, before anything is wrapped.

    Raises:
        UnsupportedDistributedError: ``accelerator.distributed_type`` is not in :data:`DDP_TYPES` (FSDP,
            DeepSpeed, Megatron-LM, XLA); the message says what to use instead.
    """
    kind = _kind(accelerator)
    if kind in DDP_TYPES:
        return
    why = {
        "FSDP": "FSDP shards the parameters (DTensors, whose storage zoomem's tracer cannot read) and gathers "
                "them in its own forward/backward hooks, while zoomem traces and measures a whole training step "
                "inside the first forward; that nesting is not supported. Use DDP (`accelerate launch --multi_gpu`) with zoomem, or FSDP's own activation "
                "checkpointing (`fsdp_activation_checkpointing: true` / FullyShardedDataParallelPlugin("
                "activation_checkpointing=True)) without zoomem",
        "DEEPSPEED": "DeepSpeed replaces the model with its engine and (ZeRO-3) partitions the parameters; "
                     "zoomem is not tested under it. Use DDP (`accelerate launch --multi_gpu`) with zoomem, or "
                     "DeepSpeed's activation checkpointing without zoomem",
    }.get(kind, "zoomem plans one process's step and is tested under DDP only. Use DDP (`accelerate launch "
                "--multi_gpu`) or a single process with zoomem")
    raise UnsupportedDistributedError(
        f"zoomem does not support Accelerate's distributed_type {kind} (supported: {sorted(DDP_TYPES)}). {why}."
    )


def _bare(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / torch.compile containers."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def prepare(
    accelerator: "Accelerator",
    model: nn.Module,
    *others: Any,
    budget: int | float | str | None = None,
    level: str | None = None,
    compress: str | CompressOptions | None = None,
    expect_processes: int | None = None,
    **wrap_kwargs: Any,
) -> Any:
    """Check the launch, ``accelerator.prepare(model, *others)``, then ``zoomem.wrap`` the bare model inside.

    The wrap comes after ``prepare`` on the very module DDP holds (instance forwards only: DDP's parameters,
    buckets and hooks are untouched), so zoomem's forward sits *outside* the autocast wrapper Accelerate puts on
    the model's forward under ``mixed_precision``. Wrapping before ``prepare`` works in full precision, but under
    mixed precision zoomem's planning (inside the first forward) re-enters Accelerate's single ``torch.autocast``
    object and leaves autocast switched on after the step; see tests/test_accelerate.py.

    Args:
        accelerator: the run's ``Accelerator``.
        model: the bare model (or one Accelerate already prepared: its inner module is wrapped).
        others: optimizers, data loaders and schedulers, passed on to ``accelerator.prepare``.
        budget, level, compress: as in :func:`zoomem.wrap` (per process: each rank plans its own step).
        expect_processes: the number of processes the run needs; a launch that gave another raises.
        wrap_kwargs: more :func:`zoomem.wrap` arguments. The first optimizer among ``others`` is passed as
            ``optimizer=`` (its state counts in the budget) unless given. A ``batch=`` plans now, on
            ``accelerator.device``.

    Returns:
        What ``accelerator.prepare`` returns: the prepared model alone, or a tuple in the order given.

    Raises:
        ProcessCountError: see :func:`check_processes`.
        UnsupportedDistributedError: see :func:`check_distributed_type`.

    >>> model, opt = zoomem.accelerate.prepare(accelerator, model, opt, level="L2")  # doctest: +SKIP
    """
    check_processes(accelerator, expect_processes)
    check_distributed_type(accelerator)
    if "optimizer" not in wrap_kwargs:
        wrap_kwargs["optimizer"] = next((o for o in others if isinstance(o, torch.optim.Optimizer)), None)
    prepared = accelerator.prepare(model, *others)
    container = prepared[0] if others else prepared
    bare = _bare(container)
    if wrap_kwargs.get("batch") is not None:
        wrap_kwargs["batch"] = Batch.of(wrap_kwargs["batch"], model).to(accelerator.device)
    with holding(container):  # a batch= plans now, outside DDP's forward: its buckets counted all the same
        wrap(bare, budget, level=level, compress=compress, **wrap_kwargs)
    return prepared


def plans(model: nn.Module) -> list[Plan]:
    """The plans a wrapped model has made so far (one per input signature planned; a smaller signature that runs a
    larger one's plan adds none), DDP containers looked through."""
    bare = _bare(model)
    if not is_wrapped(bare):
        return []
    return list({id(p): p for p in bare.__dict__["_zoomem"].plans.values()}.values())


def log_plans(accelerator: Any, model: nn.Module, level: int = logging.INFO) -> list[Plan]:
    """Log the summary of every plan ``model`` has made, on the main process only; return the plans.

    Every rank plans its own step (lossless plans may differ by measured timings and by each rank's input shapes;
    compression bits do not), so one rank's summary describes the run. Call it after the first training step:
    plans are made lazily.
    """
    found = plans(model)
    if getattr(accelerator, "is_main_process", True):
        for p in found:
            logger.log(level, "zoomem plan for %s:\n%s", p.signature or "the first batch", p.summary())
    return found
