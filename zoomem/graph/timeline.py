"""The measured memory timeline of a plain training step, segment by segment.

The tracer's dispatch mode sees every op, but it also changes what some backward formulas do (under a
dispatch mode autograd picks out-of-place variants, as for tensor subclasses), so the bytes it would measure
are not plain PyTorch's. The timeline is therefore measured in a second, plain run of the same step, cut into
segments by markers only: a unit's forward (module hooks), the code between units, and each unit's backward
(the first time autograd unpacks a tensor that unit saved). Those are the figures the planner predicts from.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from ..adapters import Unit
from ..batch import Batch
from ..measure import MemoryMeter
from ..state import snapshot_buffers

__all__ = ["BackwardWindow", "ForwardRises", "ForwardWindow", "SegmentStat", "measure_forward_rises",
           "measure_timeline", "meter_busy", "restored_state"]

logger = logging.getLogger(__name__)


@dataclass
class SegmentStat:
    """One stretch of the plain step: bytes above the step's start when it began, at its peak and at its end.

    ``seg`` is 0 for the stem (before the first unit), 1..n for the units (and the code right after each), and
    n + 1 for the head (after the last unit: output layers, loss; their backward comes first). ``phase`` is
    ``"forward"``, ``"backward"``, or ``"after"``: the backward of the code after unit ``seg`` (timm's DenseNet
    transition, PyG's activations between convs), which runs before the unit's own and, where that code saves
    tensors, is a stretch of its own: a recomputed unit's saved tensors are not back yet there.
    """

    seg: int
    phase: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    time_s: float


class _Held:
    __slots__ = ("tensor", "seg", "raw", "key")

    def __init__(self, tensor: Any, seg: int, raw: bool = False, key: str = "") -> None:
        self.tensor, self.seg, self.raw, self.key = tensor, seg, raw, key


ForwardWindow = tuple[int, str, int, int]
"""(segment, key, peak bytes above the step's start, rise) of one stretch of a forward: from saving the tensor
``key`` to saving the next one (or the segment's end); a segment's first stretch has key ``""``. ``rise``: its peak
above its start, what the forward's work after the saving adds (a quantization's scratch, at the saving, counts
only beyond it)."""

BackwardWindow = tuple[int, str, int, int, int, str]
"""(segment, key, peak bytes above the step's start, node, rise, phase) of one stretch of a backward: from autograd
unpacking the saved tensor ``key`` (named as :class:`~zoomem.runtime.storage.SavedTensorStore` names it,
``"<region>#<k>"``) to its unpacking the next one; the first stretch of a segment has key ``""``. ``node`` numbers
the autograd node that unpacked it (in the order backward runs them; -1 for a first stretch): the tensors one node
unpacks come back together, and a split backward's second node unpacks only its weight. ``rise``: its peak above
its start, what the backward's work after the unpacking adds (a dequantization's scratch beyond it is extra).
``phase``: ``"after"`` in the backward of the code after the unit, which runs first (:class:`SegmentStat`), else
``"backward"``."""


def measure_timeline(
    model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor], units: list[Unit],
    saved_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
    windows: list[BackwardWindow] | None = None,
    forward_windows: list[ForwardWindow] | None = None,
    grads: bool = False,
) -> list[SegmentStat]:
    """Run one plain training step of ``model`` and return its segments in execution order.

    ``grads``: the step starts with every trainable parameter's gradient present (zeros), as a micro-batch after
    the first one under gradient accumulation does; backward adds into them instead of allocating them.

    ``windows``, a list, receives the backward cut finer, at every saved tensor unpacked (:data:`BackwardWindow`):
    where in a unit's backward its peak is, which tells the planner which of its lossy tensors are still packed
    there. ``forward_windows`` receives the forward cut at every tensor saved (:data:`ForwardWindow`): which of
    them are packed, and free, before a unit's forward peaks.

    The step's own saved-tensor hooks (they mark where backward crosses a unit) sit innermost, so a runtime
    that stores saved tensors in its own form passes its ``(pack, unpack)`` as ``saved_hooks`` to be measured.

    What the step changes is put back afterwards: gradients, buffers (BatchNorm statistics), the RNG state.
    Returns an empty list, with a log line, when a profiler or :class:`MemoryMeter` is already running.
    """
    if meter_busy():
        return []
    with restored_state(model, batch, grads), torch.enable_grad():
        return _measure(model, batch, loss_fn, units, saved_hooks, windows, forward_windows)


class ForwardRises(NamedTuple):
    """What each unit's forward (segment 1..n) holds when it runs without autograd, as a chain's recipe and a
    recomputed unit's checkpointed forward run it (no intermediate saved)."""

    excess: dict[int, int]
    """Its rise above what it leaves behind (its outputs): what bringing a dropped input back adds."""
    rise: dict[int, int]
    """Its rise above its start: where a unit's forward peaks in the code after it (timm's DenseNet concatenating
    its block), this is what its own stretch holds when recomputed, and can top that code's."""


def measure_forward_rises(model: nn.Module, batch: Batch, units: list[Unit]) -> ForwardRises:
    """Per unit segment (1..n), the bytes its forward rises when it runs without autograd: its scratch beyond its
    outputs (``excess``), far below the rise of the traced forward, which saves every intermediate (ResNet-50's
    bottleneck: a few feature maps against a dozen), and above its start (``rise``). A unit called twice counts its
    larger call. The step's state is put back afterwards, as :func:`measure_timeline` does; both empty when a
    profiler or meter is running."""
    if meter_busy():
        return ForwardRises({}, {})
    seg_of = {u.module: i + 1 for i, u in enumerate(units)}
    meter = MemoryMeter(model, batch)
    marks: list[int] = []  # the segment each phase of the meter closes (0: code outside the units)

    def mark(seg: int) -> None:
        meter.mark(f"{len(marks)}:{seg}")
        marks.append(seg)

    handles = []
    for u in units:
        handles.append(u.module.register_forward_pre_hook(lambda mod, args: mark(0)))
        handles.append(u.module.register_forward_hook(lambda mod, args, out: mark(seg_of[mod])))
    try:
        with restored_state(model, batch), torch.no_grad(), meter:
            batch.call(model)
            mark(0)
    finally:
        for h in handles:
            h.remove()
    out = ForwardRises({}, {})
    start = meter.report.baseline_bytes
    for seg, stat in zip(marks, meter.report.phases.values()):
        if seg:
            out.excess[seg] = max(out.excess.get(seg, 0), stat.peak_bytes - stat.end_bytes)
            out.rise[seg] = max(out.rise.get(seg, 0), stat.peak_bytes - start)
        start = stat.end_bytes
    return out


def meter_busy(quiet: bool = False) -> bool:
    """Whether a profiler or :class:`MemoryMeter` is running already (then nothing here can measure), logged
    unless ``quiet``."""
    from .. import measure

    if measure._active_meter is not None or torch._C._autograd._profiler_enabled():
        if not quiet:
            logger.info("a profiler or MemoryMeter is running, so the step's memory is not measured")
        return True
    return False


@contextlib.contextmanager
def restored_state(model: nn.Module, batch: Batch, with_grads: bool = False) -> Iterator[None]:
    """Put back what a measured step changes: gradients, buffers (BatchNorm statistics), the RNG state. Inside,
    the gradients are ``None``, or ``with_grads`` zeros of each trainable parameter's shape."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    restore_buffers = snapshot_buffers(model)
    devices = sorted({t.device.index or 0 for t in params + batch.tensors() if t.device.type == "cuda"})
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if with_grads and p.requires_grad else None
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        restore_buffers()
        for p, g in zip(params, grads):
            p.grad = g


def _measure(
    model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor], units: list[Unit],
    saved_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
    windows: list[BackwardWindow] | None = None,
    forward_windows: list[ForwardWindow] | None = None,
) -> list[SegmentStat]:
    n = len(units)
    head = n + 1
    seg_of = {u.module: i + 1 for i, u in enumerate(units)}
    name_of = {u.module: u.name for u in units}
    meter = MemoryMeter(model, batch)
    marks: list[tuple[int, str, float, bool, str, int]] = []  # (seg, phase, time, closes a segment, window key, node)
    state: dict[str, Any] = {"seg": 0, "inside": False, "bseg": head, "backward": False, "region": "<stem>",
                             "key": "", "node": -1, "bphase": "backward"}
    nodes: dict[int, int] = {}  # id of an autograd node -> its number (backward creates no nodes: ids stay unique)
    counts: dict[str, int] = {}

    def mark(seg: int, phase: str, closes: bool = True) -> None:
        meter.mark(f"{len(marks)}:{phase}:{seg}")
        marks.append((seg, phase, time.perf_counter(), closes, state["key"], state["node"]))

    def pre_hook(mod: nn.Module, args: Any) -> None:
        mark(state["seg"], "forward")
        state["seg"], state["inside"], state["region"], state["key"] = seg_of[mod], True, name_of[mod], ""

    def post_hook(mod: nn.Module, args: Any, out: Any) -> None:
        k = seg_of[mod]
        mark(k, "forward")
        state["seg"], state["inside"], state["region"] = (k if k < n else head), False, f"<after:{name_of[mod]}>"
        state["key"] = ""

    inner_pack, inner_unpack = saved_hooks or (None, None)

    def pack(t: torch.Tensor) -> Any:
        if state["backward"]:  # a backward that recomputes (zoomem's attention, a reentrant checkpoint) saves for
            return _Held(t, state["bseg"], raw=True)  # its own short-lived graph: no segment, not the runtime's
        region = state["region"]  # every save counted, as the saved-tensor store keys them
        k = counts[region] = counts.get(region, -1) + 1
        if forward_windows is not None:
            mark(state["seg"], "forward", closes=False)
            state["key"] = f"{region}#{k}"
        return _Held(inner_pack(t) if inner_pack else t, state["seg"], key=f"{region}#{k}")

    def unpack(h: Any) -> torch.Tensor:
        after = h.key.startswith("<after:") and h.seg <= n  # the head is all code after the last unit
        if h.seg != state["bseg"] or (state["bphase"] == "after" and not after and not h.raw):
            mark(state["bseg"], state["bphase"])  # a new segment, or the unit's own backward after its code's
            state["bseg"], state["key"], state["node"] = h.seg, "", -1
            state["bphase"] = "after" if after else "backward"
        if windows is not None and not h.raw and h.key != state["key"]:
            mark(state["bseg"], state["bphase"], closes=False)
            node = torch._C._current_autograd_node()
            state["key"], state["node"] = h.key, -1 if node is None else nodes.setdefault(id(node), len(nodes))
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
                state["backward"], state["key"] = True, ""
                loss.backward()
                mark(state["bseg"], state["bphase"])
            del output, loss
    finally:
        for h in handles:
            h.remove()
    report = meter.report
    base = report.baseline_bytes
    first = len(windows) if windows is not None else 0
    out: list[SegmentStat] = []
    prev_end, prev_t = base, start
    current: list[Any] | None = None  # the segment being assembled from its stretches: seg, phase, start, peak, end
    for (seg, phase, t, closes, key, node), stat in zip(marks, report.phases.values()):
        peak = stat.peak_bytes - base
        if windows is not None and phase != "forward":
            windows.append((seg, key, peak, node, stat.peak_bytes - prev_end, phase))
        if forward_windows is not None and phase == "forward":
            forward_windows.append((seg, key, peak, stat.peak_bytes - prev_end))
        if current is None:
            current = [seg, phase, prev_end - base, peak, stat.end_bytes - base]
        else:
            current[3], current[4] = max(current[3], peak), stat.end_bytes - base
        prev_end = stat.end_bytes
        if closes:
            out.append(SegmentStat(*current, t - prev_t))
            current, prev_t = None, t
    # a unit that saved nothing has no backward of its own to come after: its code's is the segment's backward
    own = {st.seg for st in out if st.phase == "backward"}
    out = [replace(st, phase="backward") if st.phase == "after" and st.seg not in own else st for st in out]
    if windows is not None:
        windows[first:] = [(*w[:5], "backward") if w[5] == "after" and w[0] not in own else w
                           for w in windows[first:]]
    return out
