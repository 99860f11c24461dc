"""The measured memory timeline of a plain training step, segment by segment.

The tracer's dispatch mode sees every op, but it also changes what some backward formulas do (under a
dispatch mode autograd picks out-of-place variants, as for tensor subclasses), so the bytes it would measure
are not plain PyTorch's. The timeline is therefore measured in a second, plain run of the same step, cut into
segments by markers only: a unit's forward (module hooks), the code between units, and each unit's backward
(the first time autograd unpacks a tensor that unit saved). Those are the figures the planner predicts from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..adapters import Unit
from ..batch import Batch
from ..measure import MemoryMeter

__all__ = ["SegmentStat", "measure_timeline"]

logger = logging.getLogger(__name__)


@dataclass
class SegmentStat:
    """One stretch of the plain step: bytes above the step's start when it began, at its peak and at its end.

    ``seg`` is 0 for the stem (before the first unit), 1..n for the units (and the code right after each), and
    n + 1 for the head (after the last unit: output layers, loss; their backward comes first).
    """

    seg: int
    phase: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    time_s: float


class _Held:
    __slots__ = ("tensor", "seg", "raw")

    def __init__(self, tensor: Any, seg: int, raw: bool = False) -> None:
        self.tensor, self.seg, self.raw = tensor, seg, raw


def measure_timeline(
    model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor], units: list[Unit],
    saved_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
) -> list[SegmentStat]:
    """Run one plain training step of ``model`` and return its segments in execution order.

    The step's own saved-tensor hooks (they mark where backward crosses a unit) sit innermost, so a runtime
    that stores saved tensors in its own form passes its ``(pack, unpack)`` as ``saved_hooks`` to be measured.

    What the step changes is put back afterwards: gradients, buffers (BatchNorm statistics), the RNG state.
    Returns an empty list, with a log line, when a profiler or :class:`MemoryMeter` is already running.
    """
    from .. import measure

    if measure._active_meter is not None or torch._C._autograd._profiler_enabled():
        logger.info("a profiler or MemoryMeter is running, so the step's memory timeline is not measured")
        return []
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    devices = sorted({t.device.index or 0 for t in params + batch.tensors() if t.device.type == "cuda"})
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            return _measure(model, batch, loss_fn, units, saved_hooks)
    finally:
        with torch.no_grad():
            for b, old in zip(buffers, saved):
                b.copy_(old)
        for p, g in zip(params, grads):
            p.grad = g


def _measure(
    model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor], units: list[Unit],
    saved_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
) -> list[SegmentStat]:
    n = len(units)
    head = n + 1
    seg_of = {u.module: i + 1 for i, u in enumerate(units)}
    meter = MemoryMeter(model, batch)
    marks: list[tuple[int, str, float]] = []
    state = {"seg": 0, "inside": False, "bseg": head, "backward": False}

    def mark(seg: int, phase: str) -> None:
        meter.mark(f"{len(marks)}:{phase}:{seg}")
        marks.append((seg, phase, time.perf_counter()))

    def pre_hook(mod: nn.Module, args: Any) -> None:
        mark(state["seg"], "forward")
        state["seg"], state["inside"] = seg_of[mod], True

    def post_hook(mod: nn.Module, args: Any, out: Any) -> None:
        k = seg_of[mod]
        mark(k, "forward")
        state["seg"], state["inside"] = (k if k < n else head), False

    inner_pack, inner_unpack = saved_hooks or (None, None)

    def pack(t: torch.Tensor) -> Any:
        if state["backward"]:  # a backward that recomputes (zoomem's attention, a reentrant checkpoint) saves for
            return _Held(t, state["bseg"], raw=True)  # its own short-lived graph: no segment, not the runtime's
        return _Held(inner_pack(t) if inner_pack else t, state["seg"])

    def unpack(h: Any) -> torch.Tensor:
        if h.seg != state["bseg"]:
            mark(state["bseg"], "backward")
            state["bseg"] = h.seg
        return inner_unpack(h.tensor) if inner_unpack and not h.raw else h.tensor

    handles = []
    for u in units:
        handles.append(u.module.register_forward_pre_hook(pre_hook))
        handles.append(u.module.register_forward_hook(post_hook))
    start = time.perf_counter()
    try:
        with meter:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                output = batch.call(model)
                loss = loss_fn(output, batch)
                mark(state["seg"], "forward")
                state["backward"] = True
                loss.backward()
                mark(state["bseg"], "backward")
            del output, loss
    finally:
        for h in handles:
            h.remove()
    report = meter.report
    out: list[SegmentStat] = []
    prev_end, prev_t = report.baseline_bytes, start
    for (seg, phase, t), stat in zip(marks, report.phases.values()):
        base = report.baseline_bytes
        out.append(SegmentStat(seg, phase, prev_end - base, stat.peak_bytes - base, stat.end_bytes - base, t - prev_t))
        prev_end, prev_t = stat.end_bytes, t
    return out
