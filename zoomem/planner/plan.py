"""The Plan: what to do with each unit's saved tensors, and what the planner promises about memory."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["Decision", "Plan", "UnitPlan", "parse_budget", "InfeasibleBudgetError"]

_MIB = 1024**2


class Decision(str, enum.Enum):
    """What happens to a unit's saved tensors between forward and backward."""

    KEEP = "keep"
    """Autograd keeps them, as plain PyTorch does."""
    RECOMPUTE = "recompute"
    """Only the unit's inputs are kept; its forward runs again in backward (non-reentrant checkpoint)."""
    RECOMPUTE_CHEAP = "recompute_cheap"
    """Outputs of matmul/conv/attention ops are kept; the cheap ops between them run again in backward."""
    RECOMPUTE_CHAIN = "recompute_chain"
    """Recomputed, and its input is not kept either: it is the output of the previous unit (recomputed too), run
    again from that unit's input when backward reaches this unit. A run of these units is a checkpointed
    segment (Chen et al. 2016) that holds only its first input between forward and backward; backward brings
    its boundaries back from that input at once (one more forward of each unit but the last) and frees them one
    unit at a time."""


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget; ``min_budget`` is the smallest budget that has one."""

    def __init__(self, message: str, min_budget: int) -> None:
        super().__init__(message)
        self.min_budget = min_budget

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]  (picklable: ranks send it to each other)
        return (type(self), (str(self), self.min_budget))


@dataclass
class UnitPlan:
    """One unit's decision and what it costs: bytes kept at the end of forward, seconds of recompute and of its
    compact forms (negative where they run faster than the stock ops).

    ``compact`` switches on the memory-efficient implementations of the modules inside the unit (bit-packed
    masks, output-activated norms, compact pooling indices, split backward): exact storage forms, no recompute.
    """

    name: str
    decision: Decision
    kept_bytes: int = 0
    recompute_s: float = 0.0
    compact: bool = False

    def __post_init__(self) -> None:
        self.decision = Decision(self.decision)


@dataclass
class Plan:
    """A memory plan for one model and input signature, produced by a strategy (``ilp`` or a baseline).

    Attributes:
        strategy: ``ilp``, ``none``, ``all``, ``sqrt`` or ``greedy``.
        units: per-unit decisions, in forward order.
        budget_bytes: the budget the plan was made for (None: no budget).
        fixed_bytes: bytes that exist before the step (parameters, buffers, batch, optimizer state).
        predicted_peak_bytes: the peak of the training step the plan predicts (fixed bytes included): forward,
            backward and, where planning knew the optimizer, its step.
        baseline_peak_bytes: the same prediction for plain PyTorch.
        recompute_s: predicted extra seconds per step of recomputation and compact forms (negative where the
            forms run faster than the stock ops).
        step_s: measured seconds of the traced step's ops (for the overhead ratio).
        solver: solver name and status, ``lp_bound`` the LP relaxation's objective, ``solve_s`` the time.
        bits: saved-tensor key (``"<region>#<k>"``) -> bits it is stored in; absent keys are stored exact.
        offload: compressed forms wait in host memory between forward and backward.
        level: the compression level the plan implements (``""``: none, or ``auto`` under a budget).
        outside_compact: the modules outside every unit (a head's linear, a stem's pooling) run their exact
            compact forms.
        variance: predicted gradient variance of the lossy choices, relative to the squared gradient norm.
        compress_s: predicted seconds per step of storing tensors lossily (quantizing and dequantizing them).
        compress_scale: what storing lossily measured in the model's own step over the quantizer probes' price
            (1: not measured); ``compress_s`` includes it.
        optimizer_bytes: bytes above the fixed ones while the optimizer steps under this plan (the gradients,
            the output the loop holds, the step's scratch); 0 where planning had no optimizer.
        ddp_bytes: DDP's gradient buckets, part of ``fixed_bytes`` (0 outside DDP): a flat copy of the gradients
            that ``DistributedDataParallel`` holds for good.
        forwards: training forwards a step runs before its backward, which the plan leaves room for (each other
            one holding at least what this plan's forward leaves, ``left_bytes``, and ``others_floor``).
        left_bytes: predicted bytes this plan's forward leaves for its backward (above the fixed ones, the
            gradients left out): what it holds while a step's other forwards run.
        others_floor: the least bytes the plan takes each other forward of the step to hold (0: as much as its
            own forward leaves): what the forwards before it held where they hold more.
        saved: the saved tensors the plan was made from (key, shape, bytes, sensitivity), for inspection.
        saves: for a lossy plan, every saved-tensor key -> what the planned forward saved under it (shape and
            dtype, :func:`~zoomem.runtime.storage.save_sig`): a training forward whose saves differ (control flow
            that depends on the batch's values) stores everything exactly from the first difference on.
        traced_at: ``[small, large, batch]`` when the step was too large to trace and its costs were
            extrapolated from traces at ``small`` and ``large`` samples to the real ``batch``; empty otherwise.
    """

    strategy: str
    units: list[UnitPlan]
    budget_bytes: int | None
    fixed_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_s: float = 0.0
    step_s: float = 0.0
    solver: str = ""
    status: str = "optimal"
    lp_bound: float | None = None
    solve_s: float = 0.0
    signature: str = ""
    bits: dict[str, int] = field(default_factory=dict)
    offload: bool = False
    level: str = ""
    outside_compact: bool = False
    variance: float = 0.0
    compress_s: float = 0.0
    compress_scale: float = 1.0
    optimizer_bytes: int = 0
    ddp_bytes: int = 0
    forwards: int = 1
    left_bytes: int = 0
    others_floor: int = 0
    saved: list[dict[str, Any]] = field(default_factory=list)
    saves: dict[str, str] = field(default_factory=dict)
    traced_at: list[int] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    def decision(self, unit: str) -> Decision:
        for u in self.units:
            if u.name == unit:
                return u.decision
        return Decision.KEEP

    def compact(self, unit: str) -> bool:
        return any(u.compact for u in self.units if u.name == unit)

    @property
    def decisions(self) -> dict[str, Decision]:
        return {u.name: u.decision for u in self.units}

    @cached_property
    def groups(self) -> dict[str, int]:
        """Saved-tensor key -> elements per quantization group, for the lossy tensors not grouped by the default
        (:attr:`~zoomem.planner.compression.SavedInfo.group`). Worked out once: every training step's store reads
        it, and a plan's ``bits`` and ``saved`` are fixed once it is made."""
        from ..compress.quantize import GROUP_SIZE

        return {d["key"]: d["group"] for d in self.saved
                if d["key"] in self.bits and d.get("group", GROUP_SIZE) != GROUP_SIZE}

    @cached_property
    def row_dims(self) -> dict[str, tuple[int, ...]]:
        """For the keys of :attr:`groups`: per row read, the trailing dimensions its rows span
        (:attr:`~zoomem.planner.compression.SavedInfo.row_dims`; empty in plans saved before it was kept), which
        a run at smaller inputs checks the groups against. Worked out once, as :attr:`groups`."""
        return {d["key"]: tuple(d.get("row_dims", ())) for d in self.saved if d["key"] in self.groups}

    @cached_property
    def lse_of(self) -> dict[str, dict[str, Any]]:
        """Saved-tensor key of a fused attention's log-sum-exp -> what to recompute it from, where its query or key
        is lossy (:attr:`~zoomem.planner.compression.SavedInfo.lse_of`). Worked out once, as :attr:`groups`."""
        from .compression import duplicate_of

        base = {d["key"]: duplicate_of(d["lossy"]) or d["key"] for d in self.saved}
        return {d["key"]: d["lse_of"] for d in self.saved if d.get("lse_of")
                and any(base.get(d["lse_of"][t], d["lse_of"][t]) in self.bits for t in ("query", "key"))}

    @property
    def overhead(self) -> float:
        """Predicted step time with the plan over without it."""
        return 1.0 + (self.recompute_s + self.compress_s) / self.step_s if self.step_s > 0 else float("nan")

    def summary(self) -> str:
        """Per unit: decision, bytes kept, recompute cost; then the predicted peak against plain PyTorch."""
        head = f"{'unit':<34} {'decision':<26} {'kept MiB':>9} {'extra ms':>13}"
        lines = [
            f"zoomem plan ({self.strategy}{', ' + self.solver if self.solver else ''}, status {self.status}, "
            f"solved in {self.solve_s:.2f} s)",
            head,
            "-" * len(head),
        ]
        for u in self.units:
            lines.append(
                f"{_tail(u.name, 34):<34} {u.decision.value + (' + compact' if u.compact else ''):<26} "
                f"{u.kept_bytes / _MIB:>9.2f} {1e3 * u.recompute_s:>13.2f}"
            )
        lines.append("-" * len(head))
        if self.outside_compact:
            lines.append("modules outside the units: compact")
        if self.optimizer_bytes:
            step = self.fixed_bytes + self.optimizer_bytes
            lines.append(f"optimizer step {step / _MIB:.1f} MiB (gradients, held output, its scratch)"
                         + ("; the step's peak" if step >= self.predicted_peak_bytes else ""))
        if self.traced_at:
            small, large, n = self.traced_at
            lines.append(f"costs traced at batches of {small} and {large} samples and extrapolated to {n}")
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / _MIB:.1f} MiB"
        lines.append(
            f"predicted peak {self.predicted_peak_bytes / _MIB:.1f} MiB (plain PyTorch {self.baseline_peak_bytes / _MIB:.1f}"
            f" MiB, {self.predicted_peak_bytes / max(self.baseline_peak_bytes, 1):.0%}); budget {budget}; "
            f"fixed {self.fixed_bytes / _MIB:.1f} MiB"
            + (f" (DDP's gradient buckets {self.ddp_bytes / _MIB:.1f} MiB included)" if self.ddp_bytes else "")
            + f"; predicted overhead {self.overhead:.3f}x"
            + (f"; LP bound {1e3 * self.lp_bound:.2f} ms" if self.lp_bound is not None else "")
        )
        if self.bits or self.level:
            hist: dict[int, int] = {}
            sizes = {d["key"]: d["nbytes"] for d in self.saved}
            for key, b in self.bits.items():
                hist[b] = hist.get(b, 0) + sizes.get(key, 0)
            lossy = sum(hist.values())
            avg = sum(b * n for b, n in hist.items()) / lossy if lossy else 0.0
            lines.append(
                f"compression {self.level or 'custom'}: {len(self.bits)} of {len(self.saved)} saved tensors lossy "
                f"({lossy / _MIB:.1f} MiB, {avg:.2f} bits on average"
                + "".join(f"; {n / _MIB:.1f} MiB in {b} bits" for b, n in sorted(hist.items()))
                + f"){'; offloaded' if self.offload else ''}; predicted relative gradient variance {self.variance:.2e}"
                + (f"; priced x{self.compress_scale:.2f}, as measured in a training step" if self.compress_scale != 1 else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["units"] = [dict(u, decision=Decision(u["decision"]).value) for u in d["units"]]
        d["_type"] = "Plan"
        from .. import __version__

        d["zoomem_version"] = __version__
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("_type") != "Plan":
            raise ValueError(f"Not a Plan dict (its _type is {d.get('_type')!r}).")
        d = {k: v for k, v in d.items() if k not in ("_type", "zoomem_version")}
        d["units"] = [UnitPlan(**u) for u in d["units"]]
        d.setdefault("outside_compact", d.get("level", "") not in ("", "L0"))  # what plans of zoomem <= 0.4 ran
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4, "t": 1000**4}


def parse_budget(budget: int | float | str | None, baseline_peak: int | None = None) -> int | None:
    """Bytes from a budget given as bytes (int), a string (``"6GiB"``, ``"500 MB"``) or a fraction of the
    plain-PyTorch peak (a float in (0, 1], needs ``baseline_peak``).

    >>> parse_budget("1.5GiB")
    1610612736
    >>> parse_budget(0.5, baseline_peak=1000)
    500
    """
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int), a string such as '6GiB', or a fraction (float in (0, 1]).")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes.")
        return budget
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(
                f"A float budget is a fraction of plain PyTorch's peak and must be in (0, 1], got {budget}; "
                "give bytes as an int or a string such as '6GiB'."
            )
        if baseline_peak is None:
            raise ValueError("A fractional budget needs the baseline peak (trace the model first).")
        return int(budget * baseline_peak)
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if m and m.group(2).lower() in _UNITS:
            return parse_budget(int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
        pct = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%\s*", budget)
        if pct:
            return parse_budget(float(pct.group(1)) / 100, baseline_peak)
        raise ValueError(
            f"Cannot read budget {budget!r}: use bytes with a unit ('6GiB', '512MiB', '8GB'), a percentage of "
            "plain PyTorch's peak ('60%'), an int of bytes or a float fraction."
        )
    raise TypeError(f"budget must be an int, float or str, got {type(budget).__name__}.")


def _tail(name: str, width: int) -> str:
    """``name`` cut to ``width`` characters from the left, where the units' names differ (``encoder.layer.11``, a
    shared layer's ``...albert_layers.0#11``)."""
    return name if len(name) <= width else "..." + name[len(name) - width + 3:]
