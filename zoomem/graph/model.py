"""The operator graph: what one traced training step ran, kept and cost.

Plain dataclasses so that the planner (and users) can read them, and so that a graph survives a JSON round
trip: ``OpGraph.from_json(g.to_json()) == g``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from .timeline import SegmentStat

__all__ = ["TensorInfo", "OpNode", "UnitInfo", "OpGraph", "OUTSIDE"]

OUTSIDE = "(outside units)"
"""Pseudo-unit of the ops that run in no unit (stem, head, loss)."""

_ACTIVATION_ROLES = ("activation", "param_copy")


@dataclass
class TensorInfo:
    """One tensor seen during the step.

    ``role`` is ``activation`` (made by the step), ``param``, ``buffer``, ``input`` (part of the batch),
    ``param_copy`` (a cast of a parameter, e.g. under autocast) or ``external`` (existed before the step but
    is none of the above). ``storage`` identifies the underlying allocation, so views share it.
    """

    id: int
    shape: list[int]
    dtype: str
    nbytes: int
    storage: int
    role: str = "activation"
    producer: int | None = None


@dataclass
class OpNode:
    """One aten op of the step, in execution order (forward ops first, then backward ops)."""

    index: int
    name: str
    kind: str
    module: str
    unit: str
    phase: str
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    flops: int = 0
    time_s: float = 0.0


@dataclass
class UnitInfo:
    """A checkpointable unit and what it costs. ``group`` is shared by structurally identical units.

    ``input_storages`` are the storages of the tensors passed to the unit's forward: what a checkpoint of the
    unit keeps alive in place of the unit's saved tensors. ``inputs_held_to``: where a module call around the
    unit got one of them as an argument too, the number of units whose forward had started when the last such
    call returned (0: none). Its caller's frame holds an argument until the call returns, so dropping the input
    (``RECOMPUTE_CHAIN``) frees it only then: timm's ResNet holds a stage's input through all of the stage.
    ``calls``: how many times the unit's forward ran in the traced forward (more than once: a layer shared across
    depth, as ALBERT's, or a backbone run on several views inside one forward; all its calls are one segment).
    ``interleaved``: another unit ran between two of its calls (a backbone run on two views with a head between):
    planning then keeps its calls one unit (:mod:`zoomem.runtime.calls` splits the others call by call).
    """

    name: str
    cls: str
    group: int
    first_op: int = -1
    last_op: int = -1
    saved_bytes: int = 0
    flops_fwd: int = 0
    flops_bwd: int = 0
    time_fwd_s: float = 0.0
    time_bwd_s: float = 0.0
    input_storages: list[int] = field(default_factory=list)
    inputs_held_to: int = 0
    calls: int = 0
    interleaved: bool = False


@dataclass
class OpGraph:
    """The traced step. Build it with :func:`zoomem.trace`.

    Attributes:
        ops: every aten op of forward and backward, in order.
        tensors: tensor id -> info.
        storages: storage id -> bytes.
        units: the units in forward order, then the ``OUTSIDE`` pseudo-unit.
        held_storages: storages alive at the end of forward that the step made (saved for backward or
            outputs); their bytes are what the meter sees held at the end of forward.
        saved_storages: the subset saved by autograd.
        fixed_bytes: parameters, buffers and batch (bytes that exist before the step).
        timeline: the plain step's measured memory, segment by segment (empty when not measured).
        timeline_outside: the same with the memory-efficient implementations of the modules outside every unit
            installed (a head's linear, a stem's pooling); filled by the runtime when it plans.
        timeline_compact: the same with every memory-efficient implementation the runtime would use installed
            (units ``compact_units``, and those outside the units); filled by the runtime when it plans.
        shared_units: units, in forward order, whose implementations share what they save (``Impl.shares_saved``),
            from the one that holds the shared part in ``timeline_compact`` on; filled by the runtime when it plans.
        shared_bytes: that part's bytes, measured as what the next of them holds more when the forms before it are
            off (``CostModel.shared_bytes``).
        compact_recompute_units: those of ``compact_units`` whose compact forms all run inside the unit, so a
            recomputation of the unit runs them again: forms of its modules, and of the unit's own module where
            zoomem's forward of the unit runs them (``runtime.compact.UNIT_INNER``), not where they wrap it.
        forward_excess: per unit segment, its forward's rise without autograd above what it leaves behind
            (:func:`~zoomem.graph.timeline.measure_forward_rises`); filled by the runtime when it plans and some
            unit can drop its input (what bringing that input back costs) or peaks in the code after it, else empty.
        forward_rise: per unit segment, its forward's rise without autograd above its start, measured with
            ``forward_excess``: what a recomputed unit's own forward holds where the code after it holds the
            segment's plain peak.
        cheap_rise: per unit segment with a ``RECOMPUTE_CHEAP`` mode, what its recomputation rises in backward,
            measured as the runtime runs it (:func:`~zoomem.runtime.units.measure_recompute_rises`); filled by
            the runtime when it plans.
        compact_faster: those of ``compact_units`` (and ``"<outside>"``, the forms outside the units) with a form
            that may run faster than the stock op (``zoomem.ops.Impl.may_be_faster``): only their time credits
            are taken.
        compact_recompute_gain: per unit segment of ``compact_recompute_units`` whose forms let go of a tensor
            early when it is kept: how many bytes its compact forms take off the peak of its backward when it is
            recomputed (:func:`~zoomem.runtime.units.measure_recompute_backward`, with the forms and without); filled
            by the runtime when it plans.
    """

    model: str
    adapter: str
    device: str
    batch_signature: str
    ops: list[OpNode] = field(default_factory=list)
    tensors: dict[int, TensorInfo] = field(default_factory=dict)
    storages: dict[int, int] = field(default_factory=dict)
    units: list[UnitInfo] = field(default_factory=list)
    held_storages: list[int] = field(default_factory=list)
    saved_storages: list[int] = field(default_factory=list)
    fixed_bytes: int = 0
    param_bytes: int = 0
    step_time_s: float = 0.0
    timeline: list[SegmentStat] = field(default_factory=list)
    timeline_outside: list[SegmentStat] = field(default_factory=list)
    timeline_compact: list[SegmentStat] = field(default_factory=list)
    shared_units: list[str] = field(default_factory=list)
    shared_bytes: int = 0
    compact_units: list[str] = field(default_factory=list)
    compact_recompute_units: list[str] = field(default_factory=list)
    forward_excess: dict[int, int] = field(default_factory=dict)
    forward_rise: dict[int, int] = field(default_factory=dict)
    cheap_rise: dict[int, int] = field(default_factory=dict)
    compact_recompute_gain: dict[int, int] = field(default_factory=dict)
    compact_faster: list[str] = field(default_factory=list)

    # ----------------------------------------------------------------- derived figures
    @property
    def forward_ops(self) -> list[OpNode]:
        return [op for op in self.ops if op.phase == "forward"]

    @property
    def backward_ops(self) -> list[OpNode]:
        return [op for op in self.ops if op.phase == "backward"]

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd holds for backward at the end of forward (storage-deduplicated activations)."""
        return sum(self.storages[s] for s in self.saved_storages)

    @property
    def held_bytes(self) -> int:
        """Bytes the step itself holds at the end of forward: saved activations plus outputs and loss."""
        return sum(self.storages[s] for s in self.held_storages)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def unit(self, name: str) -> UnitInfo:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"No unit named {name!r}; units are {[u.name for u in self.units]}.")

    def saved_tensors(self, unit: str | None = None) -> list[TensorInfo]:
        """The tensors saved for backward (by the ops of ``unit``, or of all units)."""
        ids = [t for op in self.forward_ops if unit is None or op.unit == unit for t in op.saved]
        return [self.tensors[i] for i in dict.fromkeys(ids)]

    # ----------------------------------------------------------------- display
    def summary(self) -> str:
        """A per-unit table: saved bytes, FLOPs and time, each with its share of the total."""
        mib = 1024**2
        total_saved = max(sum(u.saved_bytes for u in self.units), 1)
        total_flops = max(sum(u.flops_fwd + u.flops_bwd for u in self.units), 1)
        total_time = max(sum(u.time_fwd_s + u.time_bwd_s for u in self.units), 1e-12)
        groups: dict[int, int] = defaultdict(int)
        for u in self.units:
            groups[u.group] += 1
        head = (
            f"{'unit':<34} {'class':<28} {'saved MiB':>10} {'share':>6} {'fwd GFLOP':>10} {'bwd GFLOP':>10} "
            f"{'fwd ms':>8} {'bwd ms':>8} {'time':>6}"
        )
        lines = [
            f"zoomem trace: {self.model}  (adapter {self.adapter}, device {self.device})",
            f"batch {self.batch_signature}",
            head,
            "-" * len(head),
        ]
        for u in self.units:
            same = f" x{groups[u.group]}" if groups[u.group] > 1 and u.name != OUTSIDE else ""
            lines.append(
                f"{u.name[:34]:<34} {(u.cls + same)[:28]:<28} {u.saved_bytes / mib:>10.2f} "
                f"{100 * u.saved_bytes / total_saved:>5.1f}% {u.flops_fwd / 1e9:>10.3f} {u.flops_bwd / 1e9:>10.3f} "
                f"{1e3 * u.time_fwd_s:>8.2f} {1e3 * u.time_bwd_s:>8.2f} "
                f"{100 * (u.time_fwd_s + u.time_bwd_s) / total_time:>5.1f}%"
            )
        lines.append("-" * len(head))
        lines.append(
            f"{'total':<34} {f'{len(self.units) - 1} units, {len(self.ops)} ops':<28} {total_saved / mib:>10.2f} "
            f"{'':>6} {sum(u.flops_fwd for u in self.units) / 1e9:>10.3f} "
            f"{sum(u.flops_bwd for u in self.units) / 1e9:>10.3f} "
            f"{1e3 * sum(u.time_fwd_s for u in self.units):>8.2f} {1e3 * sum(u.time_bwd_s for u in self.units):>8.2f}"
        )
        lines.append(
            f"held for backward at end of forward: {self.saved_bytes / mib:.2f} MiB saved + outputs = "
            f"{self.held_bytes / mib:.2f} MiB; parameters {self.param_bytes / mib:.2f} MiB; "
            f"fixed (params, buffers, batch) {self.fixed_bytes / mib:.2f} MiB; FLOPs {total_flops / 1e9:.3f} G"
        )
        return "\n".join(lines)

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["_type"] = "OpGraph"
        d["tensors"] = list(d["tensors"].values())
        d["storages"] = [[k, v] for k, v in self.storages.items()]
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpGraph":
        if d.get("_type") != "OpGraph":
            raise ValueError(f"Not an OpGraph dict (its _type is {d.get('_type')!r}).")
        d = dict(d)
        d.pop("_type")
        d["ops"] = [OpNode(**o) for o in d["ops"]]
        d["tensors"] = {t["id"]: TensorInfo(**t) for t in d["tensors"]}
        d["storages"] = {int(k): int(v) for k, v in d["storages"]}
        d["units"] = [UnitInfo(**u) for u in d["units"]]
        d["timeline"] = [SegmentStat(**t) for t in d.get("timeline", [])]
        d["timeline_outside"] = [SegmentStat(**t) for t in d.get("timeline_outside", [])]
        d["timeline_compact"] = [SegmentStat(**t) for t in d.get("timeline_compact", [])]
        d["forward_excess"] = {int(k): int(v) for k, v in d.get("forward_excess", {}).items()}
        d["forward_rise"] = {int(k): int(v) for k, v in d.get("forward_rise", {}).items()}
        d["cheap_rise"] = {int(k): int(v) for k, v in d.get("cheap_rise", {}).items()}
        d["compact_recompute_gain"] = {int(k): int(v) for k, v in d.get("compact_recompute_gain", {}).items()}
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "OpGraph":
        return cls.from_dict(json.loads(text))


def is_activation(role: str) -> bool:
    """Whether a tensor of this role is memory the step itself allocates."""
    return role in _ACTIVATION_ROLES
