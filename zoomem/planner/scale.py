"""A step's cost model at a batch too large to trace, from the same step traced at two smaller batches.

Planning traces one plain training step, which holds every activation at once: at the batch sizes zoomem exists
for (those plain PyTorch cannot fit) that step runs out of memory before there is a plan. Every byte the cost
model holds (a storage, a measured memory point, a unit's recompute transient, the batch itself) is affine in
the batch size for models whose samples are independent rows, and the same ops run at every size; so two
traces at ``n1 < n2`` samples determine them at ``n`` (exactly for tensor sizes; for measured peaks, which are
maxima over ops, to the accuracy with which the same op stays the peak). Times scale too, between the larger
trace's and proportionally. The runtime then measures the plan's real step at ``n`` before using it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from .compression import SavedInfo
from .costs import _NO_SAVING, CompactSaving, CostModel, _Point, _Storage

__all__ = ["Scale", "ScalingError", "scale_costs", "scale_saved", "sizes_within", "trace_sizes"]


class ScalingError(ValueError):
    """Two traces of a step at different batch sizes differ in more than their sizes, so neither predicts a third."""


@dataclass(frozen=True)
class Scale:
    """Traced at ``small`` and ``large`` samples, planned for ``target``."""

    small: int
    large: int
    target: int

    def bytes(self, a: float, b: float) -> int:
        """The affine function of the batch size through ``(small, a)`` and ``(large, b)``, at ``target``."""
        return int(round(a + (b - a) * (self.target - self.small) / (self.large - self.small)))

    def seconds(self, a: float, b: float) -> float:
        """A time at ``target``: the affine extrapolation, kept between the larger trace's time and that time
        scaled in proportion (small-batch times are noisy, and fixed per-op costs do not grow). A negative time
        (a compact form's credit) is kept between the same two."""
        if b == float("inf") or a == float("inf"):
            return float("inf")
        lo, hi = sorted((b, b * self.target / self.large))
        return min(max(a + (b - a) * (self.target - self.small) / (self.large - self.small), lo), hi)

    def sizes(self) -> list[int]:
        """``[small, large, target]``, as :attr:`zoomem.Plan.traced_at` records them."""
        return [self.small, self.large, self.target]


def trace_sizes(target: int, trace_batch_size: int) -> Scale:
    """The two sizes to trace for a step of ``target`` samples: ``trace_batch_size`` and about half of it.

    Raises:
        ValueError: fewer than 3 samples to trace, or not fewer than the target.
    """
    if not 3 <= trace_batch_size < target:
        raise ValueError(
            f"trace_batch_size={trace_batch_size} cannot plan a batch of {target}: it must be at least 3 (zoomem "
            f"traces it and about half of it, each at least 2 samples) and below the batch size {target}."
        )
    return Scale(max(2, trace_batch_size // 2), trace_batch_size, target)


def sizes_within(target: int, peaks: Sequence[tuple[int, int]], allowed: int,
                 cap: Scale | None = None) -> tuple[Scale | None, int]:
    """The sizes to run a measurement of a ``target``-sample batch at so that its peak stays within ``allowed``
    bytes, and its predicted peak there.

    ``peaks`` are the measurement's peaks, ``(samples, bytes)``, at two or more batch sizes. Each phase of a step
    holds bytes affine in the batch size, so its peak, the largest phase's, is convex: piecewise linear through the
    measured sizes, and below the smallest on the line through the two smallest, which predicts too little where
    another phase takes over (the sensitivity probe of ViT-Tiny's small layout on ``ad419a6``, whose sign vectors were
    a phase of their own: 72.7 MiB at 2 samples, 58.3 on the line through 16 and 32; the caller measures the size
    chosen, :func:`zoomem.runtime.wrap._refresh_scale`).
    ``cap`` (the sizes that ran already; ``None``: the batch) where they fit, or where ``peaks`` cannot tell, or
    where not even 3 samples fit (then the peak returned is above ``allowed``: measuring on a few samples would not
    keep within it, and would measure worse); else the largest :func:`trace_sizes` below ``cap`` that fits.
    """
    points = sorted({n: b for n, b in sorted(peaks, key=lambda p: p[1])}.items())  # one per size: its largest
    largest = cap.large if cap is not None else target
    if len(points) < 2:
        return cap, points[-1][1] if points else 0

    def peak(n: int) -> int:
        i = 0
        while i < len(points) - 2 and n > points[i + 1][0]:
            i += 1
        (n0, b0), (n1, b1) = points[i], points[i + 1]
        return int(round(b0 + (b1 - b0) * (n - n0) / (n1 - n0)))

    if peak(largest) <= allowed:
        return cap, peak(largest)
    samples = next((k for k in range(largest - 1, 2, -1) if peak(k) <= allowed), None)
    if samples is None:
        return cap, peak(largest)
    return trace_sizes(target, samples), peak(samples)


def scale_costs(small: CostModel, large: CostModel, scale: Scale) -> CostModel:
    """``large``'s cost model with every byte and time extrapolated to ``scale.target`` samples.

    Raises:
        ScalingError: the two traces differ in structure (other units, storages, memory points or chains).
    """
    _check_same(small, large)
    by = scale.bytes
    storages = [dataclasses.replace(b, nbytes=max(0, by(a.nbytes, b.nbytes)))
                for a, b in zip(small.storages, large.storages)]
    points = [_Point(b.phase, b.seg, by(a.measured, b.measured)) for a, b in zip(small.points, large.points)]

    def times(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {k: scale.seconds(x.get(k, y.get(k, 0.0)), y.get(k, x.get(k, 0.0))) for k in {**x, **y}}

    stored = {}
    for unit in [u for u in large.units if u in small.compact_saving_stored or u in large.compact_saving_stored]:
        a3, b3 = small.compact_saving_stored.get(unit, _NO_SAVING), large.compact_saving_stored.get(unit, _NO_SAVING)
        stored[unit] = CompactSaving(*(by(x, y) for x, y in zip(a3, b3)))
    compact = {}
    for unit in [u for u in large.units if u in small.compact_saving or u in large.compact_saving]:
        a3, b3 = small.compact_saving.get(unit, _NO_SAVING), large.compact_saving.get(unit, _NO_SAVING)
        gains = CompactSaving(*(by(x, y) for x, y in zip(a3, b3)))
        if max(gains) > 0:  # as the trace keeps them: only forms that take something off somewhere
            compact[unit] = gains
    outside: list[int] = []
    if small.outside_gain or large.outside_gain:
        zeros = [0] * len(points)
        outside = [by(a, b) for a, b in zip(small.outside_gain or zeros, large.outside_gain or zeros)]
    windows: list[tuple[int, str, int, int, int, str]] = []
    if [(w[:2], w[3], w[5:]) for w in small.backward_windows] == [
            (w[:2], w[3], w[5:]) for w in large.backward_windows]:
        windows = [(seg, key, by(a, b), node, by(ra, rb), *rest)
                   for (seg, key, a, node, ra, *rest), (_, _, b, _, rb, *_)
                   in zip(small.backward_windows, large.backward_windows)]
    forward_windows: list[tuple[int, str, int, int]] = []
    if [w[:2] for w in small.forward_windows] == [w[:2] for w in large.forward_windows]:
        forward_windows = [(seg, key, by(a, b), by(ra, rb)) for (seg, key, a, ra), (_, _, b, rb)
                           in zip(small.forward_windows, large.forward_windows)]
    return dataclasses.replace(
        large,
        fixed_bytes=by(small.fixed_bytes, large.fixed_bytes),
        optimizer_bytes=by(small.optimizer_bytes, large.optimizer_bytes),
        optimizer_gain=by(small.optimizer_gain, large.optimizer_gain),
        storages=storages,
        points=points,
        recompute_s=times(small.recompute_s, large.recompute_s),
        recompute_cheap_s=times(small.recompute_cheap_s, large.recompute_cheap_s),
        transient={k: by(small.transient[k], v) for k, v in large.transient.items()},
        forward_excess={k: max(0, by(small.forward_excess[k], v)) for k, v in large.forward_excess.items()},
        shared_bytes=max(0, by(small.shared_bytes, large.shared_bytes)),
        own_excess={k: v for k in sorted(small.own_excess.keys() | large.own_excess.keys())
                    if (v := max(0, by(small.own_excess.get(k, 0), large.own_excess.get(k, 0))))},
        transient_cheap={k: max(0, by(small.transient_cheap[k], v)) for k, v in large.transient_cheap.items()},
        # signed, as the forms' savings; measured only where a form lets go early, which either trace may not see
        compact_recompute_gain={k: by(small.compact_recompute_gain[k], v)
                                for k, v in large.compact_recompute_gain.items() if k in small.compact_recompute_gain},
        saved_bytes={k: max(0, by(small.saved_bytes.get(k, 0), v)) for k, v in large.saved_bytes.items()},
        step_s=scale.seconds(small.step_s, large.step_s),
        compact_saving=compact,
        compact_s={k: v for k, v in times(small.compact_s, large.compact_s).items()
                   if k in compact or k not in large.units},
        compact_recompute=large.compact_recompute & frozenset(compact),
        outside_gain=outside,
        compact_saving_stored=stored,
        saved=[], saved_seg=[], saved_alive=[], own_windows={}, own_forward={},
        backward_windows=windows, forward_windows=forward_windows,
    )


def scale_saved(small: list[SavedInfo], large: list[SavedInfo], grad_sq: float,
                scale: Scale) -> tuple[list[SavedInfo], float]:
    """The probe's saved tensors at ``scale.target`` samples, and ``||g||**2`` there: shapes and bytes
    extrapolated per dimension, the larger probe's sensitivities ``C_s`` and ``grad_sq`` both times
    ``large / target``, so every relative variance ``C_s / ||g||**2`` stays the larger probe's.

    Why: with a loss that averages over samples, each saved element's derivative of the parameter gradient
    falls as 1 / batch and their number grows as the batch, so ``C_s`` falls as 1 / batch (measured: ``C_s *
    batch`` constant within 10% from 4 to 32 sequences on a 2-layer BERT; on a BatchNorm ResNet it falls
    further, 2066 to 612 from 4 to 32 images, so the estimate errs high there). ``||g||**2`` is the squared
    mean gradient, ``||G||**2 + tr(Sigma) / batch``; at the batches these probes run its sampling term dominates
    (``grad_sq * batch`` within 15% from 4 to 32 on both), and taking it as all sampling term again errs on
    the side of more noise. Adaptive levels allocate the same bits whatever the factor (all ``C_s`` move
    together); the budgeted program prices the noise relative to ``||g||**2``.

    Raises:
        ScalingError: the two probes saved different tensors.
    """
    if [(s.key, s.dtype, len(s.shape)) for s in small] != [(s.key, s.dtype, len(s.shape)) for s in large]:
        raise ScalingError(_differ("saved tensors", [s.key for s in small], [s.key for s in large]))
    factor = scale.large / scale.target
    out = []
    for a, b in zip(small, large):
        shape = tuple(scale.bytes(x, y) for x, y in zip(a.shape, b.shape))
        if any(d < 0 for d in shape):
            raise ScalingError(f"saved tensor {b.key} shrinks as the batch grows ({a.shape} -> {b.shape})")
        out.append(dataclasses.replace(b, shape=shape, nbytes=max(0, scale.bytes(a.nbytes, b.nbytes)),
                                       sensitivity=b.sensitivity * factor))
    return out, grad_sq * factor


def _structure(s: _Storage) -> tuple:  # type: ignore[type-arg]
    return (s.base_held, s.pinned, tuple(sorted(s.savers)), tuple(sorted(s.input_of)),
            tuple(sorted(s.cheap_kept_by)), tuple(sorted(s.chained_by)), s.last_forward_use, s.dies_between, s.born)


def _check_same(a: CostModel, b: CostModel) -> None:
    checks: list[tuple[str, Callable[[CostModel], object]]] = [
        ("units", lambda c: c.units),
        ("storages held for backward", lambda c: [_structure(s) for s in c.storages]),
        ("memory points", lambda c: [(p.phase, p.seg) for p in c.points]),
        ("chainable unit inputs", lambda c: c.chain),
        ("recompute transients", lambda c: sorted(c.transient)),
        ("forward excesses", lambda c: sorted(c.forward_excess)),
        ("cheap recompute rises", lambda c: sorted(c.transient_cheap)),
    ]
    for what, get in checks:
        x, y = get(a), get(b)
        if x != y:
            raise ScalingError(_differ(what, x, y))


def _differ(what: str, x: object, y: object) -> str:
    def short(v: object) -> str:
        text = repr(v)
        return text if len(text) <= 200 else text[:200] + "..."

    return (f"the step traced at two batch sizes differs in its {what} ({short(x)} against {short(y)}), so its "
            "costs at a third size cannot be extrapolated: some op's choice or a tensor's sharing depends on the "
            "batch size. Pass a larger trace_batch_size, or plan at the real batch (trace_batch_size=None).")
