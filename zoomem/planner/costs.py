"""The planner's cost model: the measured memory timeline of a traced step, and how each decision moves it.

The step is cut into segments: the stem (ops before the first unit), one segment per unit, and the head (ops
after the last unit, the loss and its backward). For every segment the trace gives the measured peak of its
forward ops, the peak of its backward ops, and the bytes live when its backward starts. A plan changes these
only through which storages stay held between forward and backward, so every memory point is

    measured peak at that point  +  sum over storages s of  c(s, point) * h(s)  +  constant,

linear in the 0-1 "held" indicator h(s) of each storage, itself bounded below by the unit decisions:
a storage is held if a unit that keeps its tensors saves it, if it is the input of a recomputed unit (the
checkpoint keeps its inputs), or if a unit recomputing only its cheap ops keeps it as a matmul/conv output.
That is MONeT's stage-by-node formulation in bytes we measured rather than estimated, linear in the number of
units and storages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from ..graph import OUTSIDE, OpGraph
from ..graph.model import is_activation
from .compression import SavedInfo, duplicate_of, region_of
from .plan import Decision

__all__ = ["CompactSaving", "CostModel", "EXPENSIVE_KINDS", "OUTSIDE_UNITS"]

OUTSIDE_UNITS = "<outside>"
"""The compact switch of the modules no unit contains (a head's linear, a stem's pooling, PyG's activations
between convs): never recomputed, so their exact compact forms are a plan-wide choice, not a unit's."""

EXPENSIVE_KINDS = frozenset({"matmul", "conv", "attention", "embedding"})
"""Op kinds whose outputs ``RECOMPUTE_CHEAP`` keeps: recomputing them costs most of a unit's time."""


@dataclass
class _Storage:
    sid: int
    nbytes: int
    base_held: bool  # held at the end of forward in plain PyTorch
    pinned: bool  # held whatever the plan (saved outside units, or an output)
    savers: set[int] = field(default_factory=set)  # unit segments whose ops save it
    input_of: set[int] = field(default_factory=set)  # unit segments that take it as input
    cheap_kept_by: set[int] = field(default_factory=set)  # unit segments that keep it under RECOMPUTE_CHEAP
    chained_by: set[int] = field(default_factory=set)  # unit segments that hold it under RECOMPUTE_CHAIN
    last_forward_use: int = 0
    dies_between: bool = False
    """Its last forward use is in the code after its segment's unit (timm's DenseNet block concatenating its
    feature maps as it returns), or in the head, not in a unit."""
    born: int = 0
    """The first forward segment at which a plan can hold it (past ``last_forward_use`` for what a recomputed
    unit's checkpoint makes as it starts: the generator's state)."""


def _rng_state_nbytes() -> int:
    """Bytes of the CPU generator's state, which ``torch.utils.checkpoint`` copies per checkpointed call."""
    import torch

    return int(torch.get_rng_state().nbytes)


class CompactSaving(NamedTuple):
    """What one unit's compact implementations take off, measured as the step with every one on against the step
    without (negative: they hold more, a CSR adjacency)."""

    held: int
    """After its forward: the bytes it holds."""
    local_fwd: int
    """Its forward's own rise."""
    local_bwd: int
    """Its backward's own rise."""
    released: int = 0
    """Where its backward starts, beyond ``held``: what its forms let go of earlier. A tensor that outlives the
    forward anyway (the unit's output, held by the next unit) but that the plain form also saves (ReLU its
    output) is freed there by the next unit's backward instead of its own; one a form saves that the plain one
    does not (LayerNorm its output) is held longer."""


_NO_SAVING = CompactSaving(0, 0, 0, 0)


@dataclass
class _Point:
    phase: str  # "forward", "after" (the backward of the code after the unit), "backward" or "recompute"
    seg: int
    measured: int  # bytes above the step's start, measured in the plain step


@dataclass
class CostModel:
    """Memory points and per-unit costs of one traced step (see the module docstring)."""

    units: list[str]
    fixed_bytes: int
    storages: list[_Storage]
    points: list[_Point]
    recompute_s: dict[str, float]
    recompute_cheap_s: dict[str, float]
    transient: dict[int, int]
    saved_bytes: dict[str, int]
    step_s: float
    optimizer_bytes: int = 0
    """Bytes above the fixed ones while the optimizer steps: what the backward leaves (the gradients, and the output
    and loss the loop still holds) plus the step's own scratch (:func:`zoomem.optimizer.footprint`). The same for
    every plan but for :attr:`optimizer_gain`; 0 where no optimizer was given."""
    optimizer_scratch: int = 0
    """The step's own scratch, part of :attr:`optimizer_bytes`."""
    grads_held: bool = False
    """The step starts with the gradients present (a later micro-batch of gradient accumulation); the points count
    them (:func:`zoomem.runtime.wrap.cost_model`)."""
    held_grad_bytes: int = 0
    """The gradients' bytes :attr:`grads_held` put on every point (0 where they are DDP's buckets, in the fixed
    bytes)."""
    others: int = 0
    """Other training forwards of the model that a step runs before its backward (a contrastive step's second
    view, a GAN discriminator's real and fake batches), each holding what this plan's forward leaves: every point
    holds that as many times more (:meth:`left_index`), or :attr:`others_floor` where that is more. The last
    forward's backward runs first (autograd runs the later nodes first), while the others hold everything; the
    optimizer's step comes after every backward."""
    others_floor: int = 0
    """The least bytes each of :attr:`others` holds: where the forwards before this one hold more than it leaves
    (a step's smaller crops, planned to keep more, before its larger ones)."""
    ddp_bytes: int = 0
    """DDP's gradient buckets (:func:`zoomem.runtime.distributed.bucket_bytes`), part of :attr:`fixed_bytes`: held
    for the whole step where the model trains inside a ``DistributedDataParallel``."""
    grads_in_buckets: bool = False
    """DDP's ``gradient_as_bucket_view=True``: the gradients are views into its buckets (:attr:`ddp_bytes`), so the
    points are the plain step's measured with the gradients present, without their bytes on top."""
    optimizer_gain: int = 0
    """What the compact forms outside the units take off what the backward leaves: a fused LM-head loss that skips
    the logits leaves the loop no logits to hold (:meth:`optimizer_step`)."""
    compact_saving: dict[str, CompactSaving] = field(default_factory=dict)
    """Per unit with compact implementations: bytes they take off, measured plain with and without them."""
    compact_s: dict[str, float] = field(default_factory=dict)
    """Per unit (and :data:`OUTSIDE_UNITS`): seconds its compact implementations add to the step, negative where
    they run faster than the stock ops."""
    compact_saving_stored: dict[str, CompactSaving] = field(default_factory=dict)
    """The same for every unit with compact implementations, as they run under zoomem's saved-tensor store, in a
    unit that stores some tensor lossily (they save what rounding perturbs little: attention its softmax too).
    Empty unless the trace was made for lossy plans; a unit runs them so exactly where the plan has bits for a
    tensor saved in it (:meth:`stored_units`)."""
    compact_recompute: frozenset[str] = frozenset()
    """Units whose compact forms may also run in a recomputed unit (they run inside the checkpoint)."""
    saved: list[SavedInfo] = field(default_factory=list)
    """Lossy-eligible saved tensors (compression modes only), with the segment each is saved in."""
    saved_seg: list[int] = field(default_factory=list)
    backward_windows: list[tuple[int, str, int, int, int, str]] = field(default_factory=list)
    """The backward of the step as lossy plans run it (compact forms on), cut at every saved tensor unpacked:
    (segment, key, peak bytes, node, rise, phase), in order (:data:`zoomem.graph.timeline.BackwardWindow`)."""
    own_windows: dict[tuple[str, int], list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]] = (
        field(default_factory=dict))
    """Per (phase, segment), ``"backward"`` or ``"after"`` (the code after the unit, whose backward runs first), the
    states of the segment's own lossy-eligible tensors through that backward: (bytes below that phase's peak there,
    indices into ``saved`` still packed, indices unpacked by the node running, those whose dequantization opens
    the stretch, what the stretch's work rises after it)."""
    forward_windows: list[tuple[int, str, int, int]] = field(default_factory=list)
    """The forward of the step as lossy plans run it, cut at every tensor saved: (segment, key, peak bytes, rise),
    in order (:data:`zoomem.graph.timeline.ForwardWindow`)."""
    own_forward: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                      int]]] = field(default_factory=dict)
    """Per segment, its forward's stretches as its own lossy-eligible tensors stand there: (bytes below the
    segment's forward peak, indices into ``saved`` packed and free by then, those packed but still held by the
    model's code, the one whose packing opens the stretch if any, earlier segments' tensors still whole there,
    what the stretch's work rises after the packing that opens it).
    The last: the head's first stretch starts as the last unit returns, before its caller lets go of that unit's
    input and the stage input it was called with (:meth:`_lingering`); packed, they are whole there still."""
    saved_alive: list[int] = field(default_factory=list)
    """Per saved tensor, the last segment whose forward holds it whole whatever its form: its own, a later unit's
    that takes it as input, the next one's when it is its unit's output (the caller holds that), or the last one
    that starts while the model's code still holds it (:attr:`SavedInfo.held_through`)."""
    compress_s_per_byte: dict[int, float] = field(default_factory=dict)
    compress_s_per_call: dict[int, float] = field(default_factory=dict)
    """Seconds each lossy tensor costs beyond its bytes' (:func:`~zoomem.compress.seconds_per_call`), per width."""
    compress_scale: float = 1.0
    """What storing lossily measured in this model's own step over what the probes price it at (1: not measured;
    :func:`zoomem.runtime.wrap._compression_scale`). Multiplies every lossy tensor's price."""
    grad_sq: float = 0.0
    fused_quantize: bool = False
    """(De)quantization runs in the fused Triton kernels (CUDA), which hold nothing beyond their results."""
    outside_gain: list[int] = field(default_factory=list)
    """Per memory point: bytes the compact forms outside the units take off (measured; empty: none to use), with
    every unit kept: see :meth:`outside_lost`."""
    after_peaks: frozenset[int] = frozenset()
    """Unit segments whose forward peaks in the code after the unit (before the next one), not in the unit."""
    chain: dict[int, int] = field(default_factory=dict)
    """Unit segment -> index in ``storages`` of the input that ``RECOMPUTE_CHAIN`` may drop: the unit's one
    activation input made by the unit before it, needed by nothing else (no other unit takes it, nothing outside
    the units saves it)."""
    chain_held_to: dict[int, int] = field(default_factory=dict)
    """Chain segment -> the last unit segment whose forward a caller holds that input through anyway (a module
    call around the unit got it as an argument: :attr:`~zoomem.graph.UnitInfo.inputs_held_to`); absent: none."""
    forward_excess: dict[int, int] = field(default_factory=dict)
    """Unit segment -> its forward's rise without autograd above what it leaves behind, as a chain's recipe runs
    it (:attr:`~zoomem.graph.OpGraph.forward_excess`; measured only where some unit can drop its input)."""
    shared_units: tuple[str, ...] = ()
    """Units, in forward order, whose compact forms share what they save (PyG's one CSR adjacency for every
    layer, :attr:`~zoomem.ops.Impl.shares_saved`); the first of them that keeps its tensors with its forms on holds
    the shared part, :attr:`shared_bytes`."""
    shared_bytes: int = 0
    """The part :attr:`shared_units` share (:attr:`~zoomem.graph.OpGraph.shared_bytes`). :attr:`compact_saving` is
    measured with every form on, where the first of them holds it; where a later one is the first kept with its forms
    on, it holds it from its forward to the end of its backward (GCN, 3 layers, the first without its forms: 96004
    bytes over the prediction at every later point before stop 55)."""
    own_excess: dict[int, int] = field(default_factory=dict)
    """Unit segment of :attr:`after_peaks` -> bytes its forward point holds above the code after it when the unit
    is recomputed: that code's peak falls by the unit's saved tensors, the unit's own forward (its checkpointed run,
    no intermediate saved, :attr:`~zoomem.graph.OpGraph.forward_rise`) by less, and can top it (timm's DenseNet
    block's last layer under one torch thread: its bottleneck output, which the layer's code holds through its second
    conv, 32 KiB above the prediction at 64 px b2). Counted at that point for every decision but ``KEEP``."""
    transient_cheap: dict[int, int] = field(default_factory=dict)
    """Unit segment -> what its recomputation under ``RECOMPUTE_CHEAP`` rises, measured as the runtime runs it
    (:attr:`~zoomem.graph.OpGraph.cheap_rise`): its matmul/conv outputs come from the cache, held already. Absent:
    ``transient``, the traced rise, which bounds it (ResNet-50's first block 122.5 MiB high at batch 16)."""
    compact_recompute_gain: dict[int, int] = field(default_factory=dict)
    """Unit segment -> the bytes its compact forms take off its backward's peak when it is recomputed, measured as
    the runtime runs it (:attr:`~zoomem.graph.OpGraph.compact_recompute_gain`). Absent: the forms' ``held`` and
    ``local_bwd`` plus a negative ``released`` (:meth:`compact_gain`)."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_graph(cls, graph: OpGraph, stored_compact: list | None = None) -> "CostModel":
        """The cost model of a traced step; ``stored_compact``: the timeline with every compact form on as they run
        under zoomem's saved-tensor store (:attr:`compact_saving_stored`)."""
        if not graph.timeline:
            raise ValueError(
                "This trace has no memory timeline (it ran inside a profiler or MemoryMeter, or with memory=False); "
                "trace again outside any profiler to plan."
            )
        units = [u.name for u in graph.units if u.name != OUTSIDE]
        seg_of_unit = {name: i + 1 for i, name in enumerate(units)}
        head = len(units) + 1

        unit_ops = [op.index for op in graph.forward_ops if op.unit in seg_of_unit]
        first, last = (min(unit_ops), max(unit_ops)) if unit_ops else (0, -1)
        fwd_seg: dict[int, int] = {}
        current = 0
        for op in graph.forward_ops:
            if op.unit in seg_of_unit:
                current = seg_of_unit[op.unit]
                fwd_seg[op.index] = current
            else:  # stem before the first unit, head after the last, else the unit it runs between
                fwd_seg[op.index] = 0 if op.index < first else head if op.index > last else current

        bwd_seg: dict[int, int] = {}
        seen_unit = False
        for op in graph.backward_ops:
            if op.unit in seg_of_unit:
                seen_unit = True
                bwd_seg[op.index] = seg_of_unit[op.unit]
            else:  # the head's backward runs before any unit's, the stem's after
                bwd_seg[op.index] = 0 if seen_unit else head

        role: dict[int, str] = {}
        for t in graph.tensors.values():
            role.setdefault(t.storage, t.role)
        saved = set(graph.saved_storages)
        held = set(graph.held_storages)
        storages: dict[int, _Storage] = {}

        def get(sid: int) -> _Storage:
            if sid not in storages:
                storages[sid] = _Storage(sid, graph.storages[sid], sid in held, sid in held - saved)
            return storages[sid]

        producer_seg: dict[int, int] = {}
        between: dict[int, bool] = {}  # storage -> whether the last forward op that made or read it ran between units
        for op in graph.forward_ops:
            seg = fwd_seg[op.index]
            for t in op.outputs:
                sid = graph.tensors[t].storage
                if sid not in producer_seg:
                    producer_seg[sid] = seg
                    between[sid] = op.unit not in seg_of_unit
            for t in op.inputs:
                sid = graph.tensors[t].storage
                if sid in storages or is_activation(role.get(sid, "external")):
                    s = get(sid)
                    s.last_forward_use = max(s.last_forward_use, seg)
                    between[sid] = op.unit not in seg_of_unit
            for t in op.saved:
                sid = graph.tensors[t].storage
                if sid not in saved:
                    continue
                s = get(sid)
                if op.unit in seg_of_unit:
                    s.savers.add(seg)
                else:  # saved by code outside every unit (stem, head, between units): never recomputed
                    s.pinned = True
            if op.unit in seg_of_unit and op.kind in EXPENSIVE_KINDS:
                for t in op.outputs:
                    sid = graph.tensors[t].storage
                    if is_activation(role.get(sid, "external")):
                        get(sid).cheap_kept_by.add(seg)
        for u in graph.units:
            if u.name not in seg_of_unit:
                continue
            for sid in u.input_storages:
                if is_activation(role.get(sid, "external")):
                    get(sid).input_of.add(seg_of_unit[u.name])
        for s in storages.values():
            s.last_forward_use = max(s.last_forward_use, producer_seg.get(s.sid, 0))
            s.dies_between = 0 < s.last_forward_use and between.get(s.sid, False)
        chain: dict[int, int] = {}
        chain_held_to: dict[int, int] = {}
        order = list(storages)
        for u in graph.units:
            seg = seg_of_unit.get(u.name)
            if seg is None or seg < 2:
                continue
            made_before = [sid for sid in u.input_storages if sid in storages and producer_seg.get(sid) == seg - 1]
            if len(made_before) != 1:
                continue
            s = storages[made_before[0]]
            if (not s.pinned and s.input_of == {seg} and s.savers <= {seg - 1, seg} and s.cheap_kept_by <= {seg - 1}
                    and s.last_forward_use == seg):
                chain[seg] = order.index(s.sid)
                if u.inputs_held_to > seg:
                    chain_held_to[seg] = u.inputs_held_to

        rng = _rng_state_nbytes() if graph.device.startswith("cpu") else 0
        if rng:
            # the checkpoint keeps the CPU generator's state (``preserve_rng_state``) from a recomputed unit's
            # forward to its backward: CPU memory beside the unit's inputs (5056 bytes a unit; on a device the
            # state's CPU tensor is outside the device's budget). A storage per unit, held when it recomputes.
            for seg in range(1, head):
                storages[-seg] = _Storage(-seg, rng, False, False, input_of={seg}, last_forward_use=seg - 1,
                                          born=seg)
            # and a unit whose input its successor drops (``RECOMPUTE_CHAIN``) registers how to run it again, its
            # generator state with it, from the end of its forward to the successor's backward
            for seg in chain:
                storages[-head - seg] = _Storage(-head - seg, rng, False, False, chained_by={seg},
                                                 last_forward_use=seg - 2, born=seg - 1)
        points = _points(graph.timeline, head)
        after_peaks = []
        for seg in range(1, head):
            f = [t for t in graph.timeline if t.seg == seg and t.phase == "forward"]
            if len(f) > 1 and max(t.peak_bytes for t in f[1:]) > f[0].peak_bytes:
                after_peaks.append(seg)
        transient: dict[int, int] = {}
        unit_time = {seg: 0.0 for seg in range(head + 1)}
        for seg in range(head + 1):
            f = [t for t in graph.timeline if t.seg == seg and t.phase == "forward"]
            if f:
                # the unit's own forward, run again (on CPU beside a second generator state: recomputation forks
                # the generator, saving its state, to run at the one saved in forward)
                transient[seg] = f[0].peak_bytes - f[0].start_bytes + (rng if 0 < seg < head else 0)
                unit_time[seg] = f[0].time_s
        # the compact forms outside the units: a measured offset per point; the units' own compact forms are then
        # measured against the step with those on (they are on in every plan that uses any)
        base = graph.timeline
        outside_gain: list[int] = []
        outside_s = 0.0
        if graph.timeline_outside and [(t.seg, t.phase) for t in graph.timeline_outside] == [
                (t.seg, t.phase) for t in graph.timeline]:
            outside_gain = [p.measured - o.measured for p, o in zip(points, _points(graph.timeline_outside, head))]
            # timed over the segments where code outside the units runs (stem, head, between units): the units'
            # own segments would add their noise only (ResNet-50, b4: -0.22..-0.02 s over four cost models, its
            # stem's and head's -0.05..+0.03 s)
            outside_segs = {fwd_seg[op.index] for op in graph.forward_ops if op.unit not in seg_of_unit}
            outside_s = sum(o.time_s - t.time_s for t, o in zip(graph.timeline, graph.timeline_outside)
                            if t.seg in outside_segs)
            base = graph.timeline_outside

        # RECOMPUTE_CHEAP caches matmul/conv outputs; a unit that later mutates one in place cannot use it
        cached = {seg: set() for seg in range(1, len(units) + 1)}
        mutated = {seg: set() for seg in range(1, len(units) + 1)}
        for op in graph.forward_ops:
            seg = fwd_seg[op.index]
            if op.unit not in seg_of_unit:
                continue
            if op.kind in EXPENSIVE_KINDS:
                cached[seg].update(graph.tensors[t].storage for t in op.outputs)
            if op.name.split(".")[1].endswith("_") and op.inputs:
                mutated[seg].add(graph.tensors[op.inputs[0]].storage)
        cheap_ok = {units[seg - 1]: not (cached[seg] & mutated[seg]) for seg in cached}

        # recompute time: the unit's forward as measured in the plain run; the cheap share from the traced ops
        op_time = {name: 0.0 for name in units}
        op_cheap = {name: 0.0 for name in units}
        for op in graph.forward_ops:
            if op.unit in op_time:
                op_time[op.unit] += op.time_s
                if op.kind not in EXPENSIVE_KINDS:
                    op_cheap[op.unit] += op.time_s
        times = {u: unit_time[seg_of_unit[u]] for u in units}
        cheap = {u: times[u] * op_cheap[u] / op_time[u] if op_time[u] > 0 else 0.0 for u in units}
        group = {u.name: u.group for u in graph.units if u.name in seg_of_unit}
        times, cheap = _share_by_group(times, group), _share_by_group(cheap, group)
        compact_saving, compact_s = _compact_savings(graph.compact_units, seg_of_unit, base, graph.timeline_compact)
        # a form that does the stock work and more cannot run faster: a credit measured for it is one timed step's
        # noise (ResNet-50 at b16, two cost models in a row: the blocks' forms summed to -0.08 s and -4.7 s, where
        # five interleaved steps measure +0.37 s: scripts/compact_times.py)
        faster = set(graph.compact_faster)
        compact_s = {u: s if u in faster else max(0.0, s) for u, s in _share_by_group(compact_s, group).items()}
        if OUTSIDE_UNITS not in faster:
            outside_s = max(0.0, outside_s)
        stored, _ = _compact_savings(graph.compact_units, seg_of_unit, base, stored_compact or [], every=True)
        if outside_gain:
            compact_s[OUTSIDE_UNITS] = outside_s
        costs = cls(
            units=units,
            fixed_bytes=graph.fixed_bytes,
            storages=list(storages.values()),
            points=points,
            recompute_s=times,
            recompute_cheap_s={u: t if cheap_ok[u] else float("inf") for u, t in cheap.items()},
            transient=transient,
            saved_bytes={u.name: u.saved_bytes for u in graph.units if u.name in seg_of_unit},
            step_s=sum(t.time_s for t in graph.timeline),
            compact_saving=compact_saving,
            compact_s=compact_s,
            compact_recompute=frozenset(graph.compact_recompute_units) & frozenset(compact_saving),
            outside_gain=outside_gain,
            chain=chain,
            chain_held_to=chain_held_to,
            compact_saving_stored=stored,
            after_peaks=frozenset(after_peaks),
            shared_units=tuple(graph.shared_units) if graph.shared_bytes else (),
            shared_bytes=graph.shared_bytes,
        )
        costs.take_rises(graph)
        return costs

    def attach_saved(self, infos: list[SavedInfo], grad_sq: float, seconds_per_byte: dict[int, float],
                     fused: bool | None = None, seconds_per_call: dict[int, float] | None = None) -> None:
        """Add the probe's saved tensors (those that may be stored lossily) for the joint program; ``fused``:
        whether (de)quantizing runs the Triton kernels, ``seconds_per_call`` each tensor's fixed time (``None``:
        as before)."""
        seg = {u: i + 1 for i, u in enumerate(self.units)}
        head = len(self.units) + 1

        def seg_of(region: str) -> int:
            if region == "<stem>":
                return 0
            if region.startswith("<after:"):
                unit = region[len("<after:"):-1]
                return head if unit == self.units[-1] else seg.get(unit, head)
            return seg.get(region, head)

        from .compression import eligible

        duplicates = {s.key for s in infos if s.nbytes == 0}  # a view adopted by its base saved later
        self.saved = [replace(s, shares=tuple(k for k in s.shares if k not in duplicates)) if s.shares else s
                      for s in eligible(infos)]
        self.saved_seg = [seg_of(s.region) for s in self.saved]
        self.saved_alive = [max([k + int(s.unit_output), *(seg[u] for u in s.input_of if u in seg),
                                 seg_of(s.held_through) if s.held_through else k])
                            for s, k in zip(self.saved, self.saved_seg)]
        aliases = {s.key: base for s in infos if (base := duplicate_of(s.lossy)) is not None}
        self.own_windows = self._own_windows(aliases)
        self.own_forward = self._own_forward()
        self.grad_sq = grad_sq
        self.compress_s_per_byte = dict(seconds_per_byte)
        if seconds_per_call is not None:
            self.compress_s_per_call = dict(seconds_per_call)
        if fused is not None:
            self.fused_quantize = fused
        self.__dict__.pop("_matrix_cache", None)

    def scratch(self, s: SavedInfo, bits: int) -> tuple[int, int]:
        """Bytes quantizing ``s`` in ``bits`` holds beyond its packed form where it is saved, and dequantizing it
        beyond its unpacked copy where it comes back (:func:`zoomem.compress.quantize.scratch_nbytes`)."""
        from ..compress.quantize import scratch_nbytes

        fused = self.fused_quantize and s.group & (s.group - 1) == 0  # the Triton kernels take powers of two
        return scratch_nbytes(s.shape, s.dtype, bits, s.group, fused=fused)

    def unpack_groups(self) -> dict[int, list[list[int]]]:
        """Per segment, the lossy-eligible tensors (indices into ``saved``) that one autograd node's backward
        unpacks together (:attr:`SavedInfo.node`; a tensor whose node is unknown is a group of its own)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (s, k) in enumerate(zip(self.saved, self.saved_seg)):
            groups.setdefault((k, s.node if s.node >= 0 else -1 - j), []).append(j)
        out: dict[int, list[list[int]]] = {}
        for (k, _), members in groups.items():
            out.setdefault(k, []).append(members)
        return out

    def _own_windows(self, aliases: dict[str, str]) -> dict[
            tuple[str, int], list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]]:
        """:attr:`own_windows` from :attr:`backward_windows`: walking a segment's backward, the node running holds
        dequantized copies of the lossy-eligible tensors it unpacks (a duplicate's unpacking is its base's), a
        tensor not yet unpacked for the last time is still packed, and one past that is gone (in the plain step
        too). The node is the one each window records; a node that unpacks only tensors kept exact (a split
        backward's grad-input node, its weight) holds no copy: its grad-weight node has let go of the input's.
        A stretch opened by dequantizing a tensor holds its scratch only beyond what the stretch's own work rises
        after it. Without windows (a trace extrapolated from smaller batches) each group in forward order is taken
        to run at the segment's peak, the backward running them in reverse, each dequantization's scratch on top:
        never more gain than there is. The code after a unit runs its backward first: its stretches are those of
        the segment's ``"after"`` point, below that point's own peak, the unit's tensors all still packed there."""
        index = {s.key: j for j, s in enumerate(self.saved)}
        out: dict[tuple[str, int], list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]] = {}
        by_seg: dict[int, list[tuple[str, int, int, int, str]]] = {}
        for seg, key, peak, node, rise, *phase in self.backward_windows:
            by_seg.setdefault(seg, []).append((key, peak, node, rise, phase[0] if phase else "backward"))
        for k, groups in self.unpack_groups().items():
            mine = {j for g in groups for j in g}
            walk = by_seg.get(k)
            if not walk:  # groups in forward order (the order the forward packed them), run in about the reverse
                states, before = [(0, (), (), (), 0)], []
                for g in sorted(groups, key=min):
                    states.append((0, tuple(before), tuple(g), tuple(g), 0))
                    before += g
                out["backward", k] = states
                continue
            top: dict[str, int] = {}
            for _, peak, _, _, phase in walk:
                top[phase] = max(top.get(phase, peak), peak)
            own = [index.get(aliases.get(key, key)) for key, _, _, _, _ in walk]
            own = [j if j is not None and j in mine else None for j in own]
            unpacks: dict[int, set[int]] = {}  # node -> the segment's eligible tensors it unpacks
            for (_, _, node, _, _), j in zip(walk, own):
                if node >= 0 and j is not None:
                    unpacks.setdefault(node, set()).add(j)
            current: tuple[int, ...] = ()
            running = []
            for (_, peak, node, rise, phase), j in zip(walk, own):
                if node >= 0:  # else a segment's first stretch, before any unpacking
                    current = tuple(sorted(unpacks.get(node, ())))
                running.append((phase, top[phase] - peak, current, () if j is None else (j,), rise))
            last = {j: i for i, (_, _, cur, _, _) in enumerate(running) for j in cur}
            best: dict[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int], int] = {}
            for i, (phase, deficit, cur, opened, rise) in enumerate(running):
                pending = tuple(sorted(j for j in mine if j not in cur and last.get(j, -1) > i))
                state = (phase, pending, cur, opened, rise if opened else 0)
                best[state] = min(best.get(state, deficit), deficit)
            for (phase, *state), d in best.items():
                out.setdefault((phase, k), []).append((d, *state))
        return out

    def _lingering(self) -> tuple[int, ...]:
        """The lossy-eligible tensors (indices into ``saved``) the model's code still holds as the last unit returns:
        that unit's input (saved in it, or the earlier unit's saved output it takes) and what is held through it
        (the stage input of ``x = self.layer4(x)``, let go of when the call returns). The head's forward starts
        there; each is credited from its segment on (:attr:`saved_alive` is the last unit's)."""
        if not self.units:
            return ()
        n, last = len(self.units), self.units[-1]
        return tuple(j for j, (s, k, alive) in enumerate(zip(self.saved, self.saved_seg, self.saved_alive))
                     if alive == n and ((s.unit_input and k == n) or last in s.input_of or s.held_through == last))

    def _own_forward(self) -> dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                                   tuple[int, ...], int]]]:
        """:attr:`own_forward` from :attr:`forward_windows` and each tensor's :attr:`SavedInfo.dead_at`: a tensor
        is packed from the stretch its saving opens, and free from the one its ``dead_at`` save opens; the head's
        first stretch holds :meth:`_lingering` whole. The quantization scratch of the tensor whose packing opens a
        stretch counts only beyond what the stretch's work rises after it: it is gone before that work runs."""
        by_seg: dict[int, list[tuple[str, int, int]]] = {}
        for seg, key, peak, rise in self.forward_windows:
            by_seg.setdefault(seg, []).append((key, peak, rise))
        mine: dict[int, list[int]] = {}
        for j, k in enumerate(self.saved_seg):
            mine.setdefault(k, []).append(j)
        head, lingering = len(self.units) + 1, self._lingering()
        out: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                  int]]] = {}
        for k, walk in by_seg.items():
            if k not in mine and not (k == head and lingering):
                continue
            top = max(peak for _, peak, _ in walk)
            opens = {key: i for i, (key, _, _) in enumerate(walk) if key}
            never = len(walk)
            states: dict[tuple[Any, ...], int] = {}  # a state's least deficit: one constraint each
            for i, (key, peak, rise) in enumerate(walk):
                packed = [j for j in mine.get(k, ()) if opens.get(self.saved[j].key, never) <= i]
                free = tuple(j for j in packed if opens.get(self.saved[j].dead_at or "", never) <= i)
                held = tuple(j for j in packed if j not in free)
                opened = tuple(j for j in packed if self.saved[j].key == key)
                state = (free, held, opened, lingering if k == head and i == 0 else (), rise if opened else 0)
                states[state] = min(states.get(state, top - peak), top - peak)
            out[k] = [(d, *state) for state, d in states.items()]
        return out

    def stretches(self) -> dict[tuple[str, int], list[tuple[int, list[tuple[int, str, int]]]]]:
        """The stretches of each unit's own forward (:attr:`own_forward`) and backward (:attr:`own_windows`) as
        linear terms in the bits: (``"forward"``, ``"after"`` or ``"backward"``, segment) -> [(bytes below that
        phase's peak, [(index into ``saved``, kind, rise)])], each term's bytes given by :meth:`term_bytes`. The
        bytes the bits take off that phase are the least over its stretches: :meth:`compress_gain_rows` evaluates
        it, the joint program bounds one variable by each stretch."""
        out: dict[tuple[str, int], list[tuple[int, list[tuple[int, str, int]]]]] = {}
        for k, fstates in self.own_forward.items():
            out["forward", k] = [(d, [*((j, "free", 0) for j in free), *((j, "beside", 0) for j in held),
                                      *((j, "packing", rise) for j in opened), *((j, "whole", 0) for j in whole)])
                                 for d, free, held, opened, whole, rise in fstates]
        for (phase, k), states in self.own_windows.items():
            out[phase, k] = [(d, [*((j, "free", 0) for j in pending), *((j, "beside", 0) for j in cur),
                                  *((j, "unpacking", rise) for j in opened)])
                             for d, pending, cur, opened, rise in states]
        return out

    def term_bytes(self, j: int, kind: str, bits: int, rise: int = 0) -> int:
        """Bytes saved tensor ``j`` stored in ``bits`` takes off a stretch (:meth:`stretches`): ``free`` its
        bytes less its packed form (packed, and nothing else holds it), ``beside`` minus its packed form (beside
        the whole tensor the model's code or a dequantized copy holds), ``whole`` minus what packing would free
        (credited from its segment on, but still whole there), ``packing`` minus its quantization scratch and
        ``unpacking`` minus its dequantization scratch, each beyond the stretch's own ``rise``."""
        s = self.saved[j]
        if kind == "free":
            return s.nbytes - s.packed_nbytes(bits)
        if kind == "beside":
            return -s.packed_nbytes(bits)
        if kind == "whole":
            return s.packed_nbytes(bits) - s.nbytes
        if kind == "packing":
            return -max(0, self.scratch(s, bits)[0] - rise)
        if kind == "unpacking":
            return -max(0, self.scratch(s, bits)[1] - rise)
        raise ValueError(f"unknown stretch term {kind!r}")

    def compress_gain_rows(self, bits: dict[str, int]) -> np.ndarray:
        """Bytes a bit assignment takes off each memory point.

        A tensor saved in segment k is held packed at every point after k's forward and when k's backward starts;
        during the later forwards that hold it whole anyway (:attr:`saved_alive`) it counts whole. During k's own
        forward the gain is the least over its stretches (:attr:`own_forward`) of what the stretch lies below the
        peak plus the tensors packed and free by then, less the packed forms of those the model's code still holds
        and the quantization scratch of the one being packed beyond the work after it, and less the gains of
        earlier tensors the model's code still holds there (the head's first stretch: :meth:`_lingering`) (without
        stretches, a trace extrapolated from smaller batches: none, and everything whole). During k's own backward
        the gain is the least over the stretches of it (:attr:`own_windows`) of what that stretch lies below the
        peak plus what is packed there: the tensors not yet unpacked for the last time, less the packed forms beside the dequantized copies of the
        node running (a backward node unpacks all it saved at once: attention's q, k, v and softmax); the tensors
        of the nodes run before are gone in the plain step too; the stretch a dequantization opens holds its scratch
        beyond the work after it.
        (Crediting every tensor of the segment there, as before, predicted BERT's attention backward 145 MiB low:
        by then the feed-forward tensors are gone in both.)"""
        out = np.zeros(len(self.points))
        if not bits:
            return out
        seg = np.array([p.seg for p in self.points])
        stretches = self.stretches()
        at_start = np.array([self.packed_at_start(p, stretches) for p in self.points])
        in_backward = np.array([p.phase == "backward" for p in self.points])
        in_after = np.array([p.phase == "after" for p in self.points])
        in_recompute = np.array([p.phase == "recompute" for p in self.points])
        in_forward = ~(at_start | in_backward | in_after)
        gone = self.gone_at_start()
        for j, (s, k, alive) in enumerate(zip(self.saved, self.saved_seg, self.saved_alive)):
            b = bits.get(s.key)
            if b:
                start = at_start & ~(in_recompute & gone[j])
                credited = np.where(in_forward, seg > alive, (seg > k) | ((seg == k) & start))
                out += credited * (s.nbytes - s.packed_nbytes(b))
        phase = {"forward": in_forward, "backward": in_backward, "after": in_after & ~at_start}
        for (name, k), stretches in stretches.items():
            least = min(d + sum(self.term_bytes(j, kind, bits[self.saved[j].key], rise)
                                for j, kind, rise in terms if bits.get(self.saved[j].key))
                        for d, terms in stretches)
            out += ((seg == k) & phase[name]) * least
        return out

    def gone_at_start(self) -> list[bool]:
        """Per lossy-eligible tensor: whether it is gone where its segment's recomputation runs, the start of the
        unit's own backward: saved by the code after the unit, whose backward ran before, apart (an ``"after"``
        point) (DenseNet's transition: crediting its tensors as packed there read a block's last layer 223 KiB
        low)."""
        apart = {p.seg for p in self.points if p.phase == "after"}
        return [s.region.startswith("<after:") and k in apart for s, k in zip(self.saved, self.saved_seg)]

    @staticmethod
    def packed_at_start(point: _Point, stretches: dict) -> bool:  # type: ignore[type-arg]
        """Whether ``point`` sees every lossy tensor of its own segment packed: where a recomputation runs, and in
        the backward of the code after the unit when it has no stretches of its own to say which come back."""
        return point.phase == "recompute" or point.phase == "after" and ("after", point.seg) not in stretches

    def compress_time(self, bits: dict[str, int]) -> float:
        by_key = {s.key: s for s in self.saved}
        return sum(self.compress_seconds(b, by_key[k].nbytes) for k, b in bits.items() if k in by_key)

    def compress_seconds(self, bits: int, nbytes: int) -> float:
        """Predicted seconds to quantize and dequantize one tensor of ``nbytes`` in ``bits``."""
        return self.compress_scale * (
            self.compress_s_per_call.get(bits, 0.0) + self.compress_s_per_byte.get(bits, 0.0) * nbytes)

    def relative_variance(self, bits: dict[str, int]) -> float:
        by_key = {s.key: s for s in self.saved}
        total = sum(by_key[k].variance(b) for k, b in bits.items() if k in by_key)
        return total / self.grad_sq if self.grad_sq > 0 else 0.0

    # ------------------------------------------------------------------ the linear model
    def coefficients(self, point: _Point) -> list[tuple[_Storage, int]]:
        """(storage, c) pairs: the point's bytes move by c * (h(s) - base_held(s))."""
        out = []
        k = point.seg
        for s in self.storages:
            if s.pinned:
                continue
            if point.phase == "forward":
                # where the code after the unit (before the next one) holds the segment's forward peak, a storage
                # last used in the unit is past its last use there: counted as at later points. One last used in
                # that code too, or in the head, where plain PyTorch frees it (timm's DenseNet block concatenating
                # its feature maps as it returns): held, it adds there; one plain PyTorch keeps is not counted there
                # (the code's peak may come before that use, and a plan must not count a saving it does not make)
                alive = k >= s.born and (k > s.last_forward_use or (
                    k == s.last_forward_use and not (s.dies_between and s.base_held)
                    and (k in self.after_peaks or s.dies_between and k == len(self.units) + 1)))
            else:
                needed_by = s.savers | s.input_of | s.cheap_kept_by | s.chained_by
                alive = bool(needed_by) and k >= min(needed_by)
                # kept, or rematerialised for this unit's own backward; but a matmul output its own unit does not
                # save (ViT's attention projection, its MLP's second linear) is gone by that backward in plain
                # PyTorch, and cached for RECOMPUTE_CHEAP it is there (one of them 102 KiB above the prediction at
                # 64 px b8, hidden while the recomputation was counted high)
                if point.phase == "backward" and (k in s.savers or (k in s.cheap_kept_by and s.base_held)):
                    alive = False
            if alive:
                out.append((s, s.nbytes))
        return out

    def prefix_terms(self) -> list[tuple[int, int, int, bool]]:
        """(point index, storage index, last holder, held in plain PyTorch): the backward points where a storage
        that several units hold is held only by those whose backward has not run yet, the ones at segments up to
        ``last`` (DenseNet's feature maps, each taken by every later layer of its block: kept alive by the latest
        recomputed one only until that one's backward). There it counts ``c * (held by those - held in plain
        PyTorch by its savers among them)`` in place of ``c * (h - base_held)``. A unit's output that the next
        unit takes is one (saved by both: timm's block output, which the next block's first conv saves): at the
        previous unit's recompute point the next one's backward has run, so only the previous unit holds it, if it
        keeps its tensors (counted held to the end before stop 37: ResNet-50 b16, 49 MiB high at the first block's
        recompute point). Where the next unit drops it (``RECOMPUTE_CHAIN``), :meth:`chain_points` counts it at
        that unit's backward and later, points these terms never reach (they stop before the last holder)."""
        cache = self.__dict__.get("_prefix_cache")
        if cache is not None:
            return cache
        out = []
        for i, p in enumerate(self.points):
            if p.phase == "forward" or p.seg > len(self.units):
                continue
            counted = {id(t) for t, _ in self._coefficients(p)}
            for j, s in enumerate(self.storages):
                if id(s) not in counted:
                    continue
                holders = s.savers | s.input_of | s.cheap_kept_by | s.chained_by
                if max(holders) <= p.seg:
                    continue
                last = max(k for k in holders if k <= p.seg)
                out.append((i, j, last, s.base_held and any(k <= last for k in s.savers)))
        self.__dict__["_prefix_cache"] = out
        return out

    def _coefficients(self, point: _Point) -> list[tuple[_Storage, int]]:
        cache = self.__dict__.setdefault("_coef_cache", {})
        key = (point.phase, point.seg)
        if key not in cache:
            cache[key] = self.coefficients(point)
        return cache[key]

    def held(self, s: _Storage, decisions: dict[str, Decision]) -> bool:
        if s.pinned:
            return True
        for seg in s.savers:
            if decisions.get(self.units[seg - 1], Decision.KEEP) == Decision.KEEP:
                return True
        for seg in s.input_of:
            if decisions.get(self.units[seg - 1], Decision.KEEP) != Decision.KEEP:
                return True
        for seg in s.cheap_kept_by:
            if decisions.get(self.units[seg - 1], Decision.KEEP) == Decision.RECOMPUTE_CHEAP:
                return True
        return any(decisions.get(self.units[seg - 1]) == Decision.RECOMPUTE_CHAIN for seg in s.chained_by)

    @staticmethod
    def stored_units(bits: dict[str, int] | None) -> frozenset[str]:
        """The regions (units) whose compact forms run as stored: those with a tensor stored lossily."""
        return frozenset(map(region_of, bits or {}))

    def compact_gain(self, point: _Point, unit: str, decision: Decision, stored: bool = False) -> int:
        """Bytes the compact implementations of ``unit`` (under ``decision``; ``stored``: as they run in a unit
        storing tensors lossily) take off this point."""
        held, local_fwd, local_bwd, released = (self.compact_saving_stored if stored else self.compact_saving).get(
            unit, _NO_SAVING)
        seg = self.units.index(unit) + 1
        if point.seg > seg:  # its compact forms are what it holds, if it holds its tensors at all
            return held if decision == Decision.KEEP else 0
        if point.seg == seg:  # its backward starts with what it holds (kept, or recomputed just before)
            if decision != Decision.KEEP:  # the recomputation runs the compact forward again; what a form saves
                # that outlives the forward anyway when kept (LayerNorm its output, the unit's) is a fresh copy now,
                # held through this backward as when kept (a negative ``released``; RoBERTa's layer measured 15 KiB
                # over its prediction without it). What a form lets go of earlier when kept (a positive one)
                # depends on the model: a ResNet-v1 block's last ReLU saves its recomputed output plainly and lets
                # it go compactly, a GPT-2 layer's form makes it again; measured where it exists
                backward = held + min(0, released) + local_bwd
                if not stored:
                    backward = self.compact_recompute_gain.get(seg, backward)
                # where the code after the unit holds the segment's forward peak, the forms' measured gain there is
                # what they hold less, which a recomputed unit does not hold at all (timm's DenseNet block's last
                # layer: 0.35 MiB over its prediction at 224 px b2, growth 8)
                forward = 0 if seg in self.after_peaks else local_fwd
                return {"forward": forward, "backward": backward, "after": 0}.get(point.phase, local_fwd)
            return {"forward": local_fwd, "backward": held + released + local_bwd}.get(point.phase, held + released)
        return 0

    def peak(
        self, decisions: dict[str, Decision], compact: frozenset[str] = frozenset(), bits: dict[str, int] | None = None
    ) -> int:
        """Predicted peak of a training step (fixed bytes included) under a set of unit decisions: its forward and
        backward, and the optimizer's step (:attr:`optimizer_bytes`).

        Every memory point is its measured bytes, plus ``coefficients`` times (held - held in plain PyTorch), plus
        the recompute transient of recomputed units, minus the gains of compact units; evaluated as matrix
        products because greedy calls it thousands of times on 50-unit models.
        """
        if not self.points:
            return self.fixed_bytes + self.optimizer_step(compact)
        return self.fixed_bytes + max(int(round(self.point_bytes(decisions, compact, bits).max())),
                                      self.optimizer_step(compact))

    def optimizer_step(self, compact: frozenset[str] = frozenset()) -> int:
        """Bytes above the fixed ones while the optimizer steps, under a plan whose compact forms are ``compact``."""
        return self.optimizer_bytes - (self.optimizer_gain if OUTSIDE_UNITS in compact and self.outside_gain else 0)

    def point_bytes(
        self, decisions: dict[str, Decision], compact: frozenset[str] = frozenset(), bits: dict[str, int] | None = None
    ) -> np.ndarray:
        """Predicted bytes above the fixed ones at each memory point (``points``) of a plan: what :meth:`peak`
        takes the maximum of, and what a measured timeline is compared with point by point."""
        m = self._matrices()
        keep = np.array([decisions.get(u, Decision.KEEP) == Decision.KEEP for u in self.units], dtype=np.float64)
        cheap = np.array([decisions.get(u, Decision.KEEP) == Decision.RECOMPUTE_CHEAP for u in self.units],
                         dtype=np.float64)
        chain = np.array([decisions.get(u) == Decision.RECOMPUTE_CHAIN for u in self.units], dtype=np.float64)
        held = (m["pinned"] | (m["savers"] @ keep > 0) | (m["inputs"] @ (1 - keep) > 0) | (m["cheap"] @ cheap > 0)
                | (m["chained"] @ chain > 0))
        values = (m["measured"] + m["coef"] @ (held.astype(np.float64) - m["base"])
                  + m["transient"] @ (1 - keep - cheap) + m["transient_cheap"] @ cheap)
        if m["prefix_i"].size:  # held only by the holders whose backward has not run yet (prefix_terms)
            early = ((m["prefix_savers"] @ keep > 0) | (m["prefix_inputs"] @ (1 - keep) > 0)
                     | (m["prefix_cheap"] @ cheap > 0) | (m["prefix_chained"] @ chain > 0))
            j = m["prefix_j"]
            np.add.at(values, m["prefix_i"], m["prefix_c"] * (
                (early - m["prefix_base"]) - (held[j].astype(np.float64) - m["base"][j])))
        chained = [decisions.get(u) == Decision.RECOMPUTE_CHAIN for u in self.units]
        if any(chained):
            self.check_chain(decisions)
            for seg, j in self.chain.items():
                if not chained[seg - 1]:
                    continue
                for i, last in self.chain_points(seg):  # held there only while the whole chain seg..last is dropped
                    e = 0.0 if last is None else float(all(chained[seg - 1:last]))
                    values[i] += m["coef"][i, j] * (e - float(held[j]))
                i = self._recompute_point(seg)
                if i is not None and not (seg < len(chained) and chained[seg]):  # else the next unit's brought it
                    values[i] += max([0] + [self.chain_transient(seg, l) for l in range(seg - 1, 0, -1)
                                            if all(chained[l:seg])])
        if OUTSIDE_UNITS in compact and self.outside_gain:
            values -= m["outside"] - m["outside_lost"] @ (1 - keep)
        stored = self.stored_units(bits)
        for unit in compact:
            if unit in stored and unit in self.compact_saving_stored and keep[self.units.index(unit)]:
                values -= m["gain_stored"][:, self.units.index(unit)]
                continue
            if unit not in self.compact_saving:
                continue
            i = self.units.index(unit)
            values -= m["gain_keep"][:, i] if keep[i] else m["gain_rec"][:, i]
        if self.shared_bytes and compact:
            values += self.shared_bytes * self._shared_rows(compact, keep)
        if bits:
            values -= self.compress_gain_rows(bits)
        left = self.left_index() if self.others else None  # (greedy calls this thousands of times)
        if left is not None:
            values += self.others * max(float(self.others_floor), values[left] - self.held_grad_bytes)
        return values

    def _shared_rows(self, compact: frozenset[str], keep: np.ndarray) -> np.ndarray:
        """Per point, 1 where a plan holds :attr:`shared_bytes` beyond what :attr:`compact_saving` counts: the first
        sharing unit kept with its forms on holds it from its forward to the end of its backward, which the measured
        savings count only for the first of them; and a sharing unit recomputed with its forms on makes it again in
        its backward where no earlier one keeps it alive there."""
        rows = np.zeros(len(self.points))
        on = [u for u in self.shared_units if u in compact]
        payer = next((u for u in on if keep[self.units.index(u)]), None)
        if payer is not None and payer != self.shared_units[0]:
            seg = self.units.index(payer) + 1
            rows += np.array([float(p.seg >= seg) for p in self.points])
        for u in on:
            seg = self.units.index(u) + 1
            if keep[seg - 1] or (payer is not None and self.units.index(payer) < seg - 1):
                continue
            rows += np.array([float(p.phase == "backward" and p.seg == seg) for p in self.points])
        return rows

    def left_bytes(self, decisions: dict[str, Decision], compact: frozenset[str] = frozenset(),
                   bits: dict[str, int] | None = None) -> int:
        """Bytes a plan's forward leaves for its backward (:meth:`left_index`), the gradients held left out."""
        left = self.left_index()
        if left is None:
            return 0
        others, self.others = self.others, 0
        try:
            return max(0, int(round(self.point_bytes(decisions, compact, bits)[left])) - self.held_grad_bytes)
        finally:
            self.others = others

    def left_index(self) -> int | None:
        """The point whose bytes a forward leaves for its backward: the backward's start, where the head's (the
        code after the last unit: output layers, loss) begins; ``None`` where no backward was measured."""
        starts = [i for i, p in enumerate(self.points) if p.phase == "recompute"]
        return max(starts, key=lambda i: self.points[i].seg, default=None)

    def check_chain(self, decisions: dict[str, Decision]) -> None:
        """Raise if a ``RECOMPUTE_CHAIN`` unit cannot drop its input: not eligible, or its previous unit is kept."""
        for i, u in enumerate(self.units):
            if decisions.get(u) != Decision.RECOMPUTE_CHAIN:
                continue
            if i + 1 not in self.chain:
                raise ValueError(f"Unit {u!r} cannot recompute its input: it is not the previous unit's output alone, "
                                 "or something besides this unit holds it. Give it another decision.")
            if decisions.get(self.units[i - 1]) not in (Decision.RECOMPUTE, Decision.RECOMPUTE_CHAIN):
                raise ValueError(f"Unit {u!r} recomputes its input from unit {self.units[i - 1]!r}, which must then be "
                                 "recomputed too (decision recompute or recompute_chain).")

    def chain_points(self, seg: int) -> list[tuple[int, int | None]]:
        """The memory points where dropping unit ``seg``'s input moves the bytes, as (point index, last): the
        input is absent there (``last`` None: forward, the head's backward), or it is back there only if every
        unit from ``seg`` to ``last`` drops its input too (the backward of unit ``last`` recomputes the chain
        down to its nearest kept input, and every boundary in between stays until its own unit's backward)."""
        j = self.chain[seg]
        coef = self._matrices()["coef"]
        out: list[tuple[int, int | None]] = []
        held_to = self.chain_held_to.get(seg, 0)
        if max(held_to, seg) == len(self.units):
            # the code after the last unit is the head's forward: a call around the unit returns there, and so
            # does the unit's own call, to a caller (a Sequential's loop) that lets go of the input only then
            held_to = len(self.units) + 1
        for i, p in enumerate(self.points):
            if coef[i, j] == 0:
                continue
            if p.phase == "forward" and seg <= p.seg <= held_to:
                continue  # a module call around the unit holds it there whatever the unit does
            if p.phase == "forward" or p.seg > len(self.units):
                out.append((i, None))
            elif p.seg >= seg:  # the code after unit k runs its backward before k recomputes: k + 1's chain is back
                out.append((i, p.seg + 1 if p.phase == "after" else p.seg))
        return out

    def chain_transient(self, seg: int, run: int) -> int:
        """Bytes added at unit ``seg``'s recompute point when bringing its dropped input back runs unit ``run``'s
        forward (it does when every unit from ``run + 1`` to ``seg`` drops its input and unit ``seg + 1`` does not;
        if that one does, its own recompute brought this input back already): that forward's rise without
        autograd above what it leaves (``forward_excess``; the outputs it leaves are the inputs the point counts
        back) beyond the unit's own recompute, which comes after it. Without that measurement, the traced rise,
        which bounds it (every intermediate saved): ResNet-50's chains 23% high at their recompute point."""
        rise = self.forward_excess.get(run, self.transient.get(run, 0))
        return max(0, rise - self.transient.get(seg, 0))

    def take_rises(self, graph: OpGraph) -> None:
        """Take the rises the runtime measured into ``graph`` after this model was made from it (it measures
        them only where this model has chains, units peaking in the code after them, cheap modes or compact forms
        that let go early): ``forward_excess``, ``transient_cheap``, ``compact_recompute_gain``; and
        :attr:`own_excess` from ``forward_rise``."""
        rng = _rng_state_nbytes() if graph.device.startswith("cpu") else 0
        self.forward_excess = dict(graph.forward_excess)
        self.transient_cheap = {seg: rise + rng for seg, rise in graph.cheap_rise.items()}
        self.compact_recompute_gain = dict(graph.compact_recompute_gain)
        self.own_excess = {}
        self.__dict__.pop("_matrix_cache", None)
        if self.after_peaks and graph.timeline:
            self.own_excess = self._own_excess(graph, rng)
            self.__dict__.pop("_matrix_cache", None)

    def _own_excess(self, graph: OpGraph, rng: int) -> dict[int, int]:
        """:attr:`own_excess`: per segment of :attr:`after_peaks`, the unit's own forward when it alone is
        recomputed (where it starts in the plain step, plus its rise without autograd and the generator state its
        checkpoint copies; the traced rise where that was not measured, which bounds it) above what the point
        predicts then; where the unit may drop its input, above what it predicts with the input dropped (the code
        after the unit no longer holds it; the unit's forward does), for every decision but ``KEEP``."""
        others, self.others = self.others, 0  # (this plan's forward alone)
        try:
            forward = {p.seg: i for i, p in enumerate(self.points) if p.phase == "forward"}
            out = {}
            for seg in sorted(self.after_peaks):
                own = next(t for t in graph.timeline if t.seg == seg and t.phase == "forward")
                rise = graph.forward_rise.get(seg)
                held = own.start_bytes + (rise + rng if rise is not None else self.transient.get(seg, 0))
                after = self.point_bytes({self.units[seg - 1]: Decision.RECOMPUTE})[forward[seg]]
                j = self.chain.get(seg)
                if j is not None:  # dropped (RECOMPUTE_CHAIN), its input leaves that code, not the unit's forward
                    after -= next((c for t, c in self._coefficients(self.points[forward[seg]])
                                   if t is self.storages[j]), 0)
                if held > after:
                    out[seg] = int(held - after)
            return out
        finally:
            self.others = others

    def recompute_transient(self, seg: int, decision: Decision) -> int:
        """Bytes unit ``seg``'s recomputation adds at its recompute point under ``decision`` (not ``KEEP``)."""
        if decision == Decision.RECOMPUTE_CHEAP and seg in self.transient_cheap:
            return self.transient_cheap[seg]
        return self.transient.get(seg, 0)

    def _recompute_point(self, seg: int) -> int | None:
        return next((i for i, p in enumerate(self.points) if p.phase == "recompute" and p.seg == seg), None)

    def _matrices(self) -> dict[str, np.ndarray]:
        cache = self.__dict__.get("_matrix_cache")
        if cache is not None:
            return cache
        n, ns, npt = len(self.units), len(self.storages), len(self.points)
        index = {id(s): j for j, s in enumerate(self.storages)}
        savers, inputs, cheap, chained = np.zeros((ns, n)), np.zeros((ns, n)), np.zeros((ns, n)), np.zeros((ns, n))
        for j, s in enumerate(self.storages):
            for seg in s.savers:
                savers[j, seg - 1] = 1
            for seg in s.input_of:
                inputs[j, seg - 1] = 1
            for seg in s.cheap_kept_by:
                cheap[j, seg - 1] = 1
            for seg in s.chained_by:
                chained[j, seg - 1] = 1
        coef = np.zeros((npt, ns))
        transient, transient_cheap = np.zeros((npt, n)), np.zeros((npt, n))
        gain_keep, gain_rec, gain_stored = np.zeros((npt, n)), np.zeros((npt, n)), np.zeros((npt, n))
        outside_lost = np.zeros((npt, n))
        for i in range(npt):
            lost = self.outside_lost(i)
            if lost is not None:
                outside_lost[i, lost[0] - 1] = lost[1]
        for i, p in enumerate(self.points):
            for s, c in self._coefficients(p):
                coef[i, index[id(s)]] = c
            if p.phase == "recompute" and 1 <= p.seg <= n:
                transient[i, p.seg - 1] = self.transient.get(p.seg, 0)
                transient_cheap[i, p.seg - 1] = self.recompute_transient(p.seg, Decision.RECOMPUTE_CHEAP)
            if p.phase == "forward" and p.seg in self.own_excess:  # the unit's own forward, however it recomputes
                transient[i, p.seg - 1] = transient_cheap[i, p.seg - 1] = self.own_excess[p.seg]
            for k, u in enumerate(self.units):
                if u in self.compact_saving:
                    gain_keep[i, k] = self.compact_gain(p, u, Decision.KEEP)
                    gain_rec[i, k] = self.compact_gain(p, u, Decision.RECOMPUTE)
                if u in self.compact_saving_stored:
                    gain_stored[i, k] = self.compact_gain(p, u, Decision.KEEP, stored=True)
        terms = self.prefix_terms()
        upto = np.array([[1.0 if seg <= last else 0.0 for seg in range(1, n + 1)] for _, _, last, _ in terms]
                        ).reshape(len(terms), n)
        rows = [j for _, j, _, _ in terms]
        cache = {
            "prefix_i": np.array([i for i, _, _, _ in terms], dtype=np.int64),
            "prefix_j": np.array(rows, dtype=np.int64),
            "prefix_c": np.array([coef[i, j] for i, j, _, _ in terms]),
            "prefix_base": np.array([float(b) for _, _, _, b in terms]),
            "prefix_savers": savers[rows] * upto, "prefix_inputs": inputs[rows] * upto,
            "prefix_cheap": cheap[rows] * upto, "prefix_chained": chained[rows] * upto,
            "pinned": np.array([s.pinned for s in self.storages], dtype=bool),
            "base": np.array([float(s.base_held) for s in self.storages]),
            "measured": np.array([float(p.measured) for p in self.points]),
            "savers": savers, "inputs": inputs, "cheap": cheap, "chained": chained, "coef": coef, "transient": transient,
            "transient_cheap": transient_cheap,
            "gain_keep": gain_keep, "gain_rec": gain_rec, "gain_stored": gain_stored,
            "outside": np.array([float(g) for g in self.outside_gain]) if self.outside_gain else np.zeros(npt),
            "outside_lost": outside_lost,
        }
        self.__dict__["_matrix_cache"] = cache
        return cache

    def outside_lost(self, i: int) -> tuple[int, float] | None:
        """(unit segment, bytes) of :attr:`outside_gain` at point ``i`` that the unit loses when it recomputes.

        A gain at a unit's own backward is a tensor outside it that the forms stop saving, an input of the unit
        freed inside its backward once the unit's own ops are done with it; a recomputed unit's checkpoint holds
        its inputs through all of its backward (PyG's SAGE: the ReLU output between two convs, a 12% lower peak
        predicted than measured at 2000 nodes). At its backward and recompute points only the gain that holds
        throughout the units' backward (its smallest there: ResNet's max-pool offsets; the stem's and the head's
        own backward, where the forms' tensors are used up, do not count) is counted."""
        p = self.points[i]
        n = len(self.units)
        if not self.outside_gain or p.phase not in ("backward", "recompute") or not 1 <= p.seg <= n:
            return None
        floor = self.__dict__.get("_outside_floor")
        if floor is None:  # asked once a point, by the matrices and by the program: worked out once
            floor = self.__dict__["_outside_floor"] = min(
                g for q, g in zip(self.points, self.outside_gain) if q.phase != "forward" and 1 <= q.seg <= n)
        lost = self.outside_gain[i] - min(self.outside_gain[i], floor)
        return (p.seg, float(lost)) if lost > 0 else None

    def recompute_time(self, decisions: dict[str, Decision], compact: frozenset[str] = frozenset()) -> float:
        total = sum(self.compact_s.get(u, 0.0) for u in compact)
        for name, d in decisions.items():
            if d in (Decision.RECOMPUTE, Decision.RECOMPUTE_CHAIN):
                total += self.recompute_s.get(name, 0.0)
            if d == Decision.RECOMPUTE_CHAIN:  # the previous unit's forward once more, to bring its output back
                total += self.recompute_s.get(self.units[self.units.index(name) - 1], 0.0)
            elif d == Decision.RECOMPUTE_CHEAP:
                total += self.recompute_cheap_s.get(name, 0.0)
        return total

    def kept_bytes(self, unit: str, decisions: dict[str, Decision]) -> int:
        """Bytes held at the end of forward on account of ``unit`` (its saved tensors, or its inputs)."""
        seg = self.units.index(unit) + 1
        dropped = {self.chain[k] for k in self.chain if decisions.get(self.units[k - 1]) == Decision.RECOMPUTE_CHAIN}
        total = 0
        for j, s in enumerate(self.storages):
            if j in dropped:
                continue
            owners = s.savers | s.input_of | s.cheap_kept_by | s.chained_by
            if seg in owners and min(owners) == seg and self.held(s, decisions) and not s.pinned:
                total += s.nbytes
        return total


def _compact_savings(names: list[str], seg_of_unit: dict[str, int], base: list, compact: list,
                     every: bool = False) -> tuple[dict[str, CompactSaving], dict[str, float]]:
    """Per unit with compact implementations, what they take off and the time they add, from the timeline with
    every one on against ``base``. Only units whose forms take something off somewhere, unless ``every``.

    The time is signed: a form that runs faster than the stock op (PyG's CSR SpMM against per-edge messages,
    about 0.3 s of a 1.25 s GCN step per layer) is credited, so the program runs it wherever the budget allows
    and the plan's predicted overhead says so."""
    saving: dict[str, CompactSaving] = {}
    seconds: dict[str, float] = {}
    if not compact or len(compact) != len(base):
        return saving, seconds
    for name in names:
        seg = seg_of_unit.get(name)
        if seg is None:
            continue
        pairs = [(a, b) for a, b in zip(base, compact) if a.seg == seg]
        fwd = [(a, b) for a, b in pairs if a.phase == "forward"]
        bwd = [(a, b) for a, b in pairs if a.phase == "backward"]
        if not fwd:
            continue
        a, b = fwd[0]
        held = (a.end_bytes - a.start_bytes) - (b.end_bytes - b.start_bytes)
        local_fwd = (a.peak_bytes - a.start_bytes) - (b.peak_bytes - b.start_bytes)
        local_bwd = max(((x.peak_bytes - x.start_bytes) - (y.peak_bytes - y.start_bytes) for x, y in bwd), default=0)
        # where its backward starts both steps differ by what every form holds less since this unit's forward
        # ended (the same in both) plus this unit's own release: the later units have let go of all theirs
        released = (bwd[0][0].start_bytes - bwd[0][1].start_bytes) - (a.end_bytes - b.end_bytes) if bwd else 0
        gains = CompactSaving(held, local_fwd, local_bwd, released)
        if every or max(gains) > 0:
            saving[name] = gains
            seconds[name] = sum(y.time_s - x.time_s for x, y in pairs)  # negative: the forms run faster
    return saving, seconds


def _points(timeline: list, head: int) -> list[_Point]:
    """The memory points of a measured timeline: per segment, its forward peak, its backward peak, and the bytes
    live when its backward starts (where a recomputation runs); where the code after the unit saved tensors and
    the unit did too, the peak of that code's backward (``"after"``, :class:`~zoomem.graph.timeline.SegmentStat`),
    which runs first, apart."""
    points: list[_Point] = []
    for seg in range(head + 1):
        f = [t for t in timeline if t.seg == seg and t.phase == "forward"]
        a = [t for t in timeline if t.seg == seg and t.phase == "after"]
        b = [t for t in timeline if t.seg == seg and t.phase == "backward"]
        if f:
            points.append(_Point("forward", seg, max(t.peak_bytes for t in f)))
        if a:
            points.append(_Point("after", seg, max(t.peak_bytes for t in a)))
        if b:
            points.append(_Point("backward", seg, max(t.peak_bytes for t in b)))
            points.append(_Point("recompute", seg, b[0].start_bytes))
    return points


def _share_by_group(values: dict[str, float], group: dict[str, int]) -> dict[str, float]:
    """Structurally identical units (same class, ops and shapes) share one cost: the median of their measured
    times. Their compute is the same; only the machine's noise differs, and a program fed that noise both
    chases it (recompute the layers that happened to run fast) and spends its time limit telling near-ties
    apart (24 BERT-large layers: 10 s without sharing, under 1 s with it)."""
    members: dict[int, list[float]] = {}
    for u, v in values.items():
        if u in group:
            members.setdefault(group[u], []).append(v)
    medians = {g: float(np.median(vs)) for g, vs in members.items()}
    return {u: medians[group[u]] if u in group else v for u, v in values.items()}
