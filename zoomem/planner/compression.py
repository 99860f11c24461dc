"""Lossy storage in the plan: GACT's levels, the bit allocator, and what the joint program needs per tensor.

The runtime enumerates the tensors a forward saves (:class:`SavedInfo`, keyed ``"<region>#<k>"``) and measures
each one's sensitivity C_s (:mod:`zoomem.compress.sensitivity`): storing it in b bits adds about
``C_s / (2**b - 1)**2`` to the variance of the parameter gradient. Levels fix the bits, or the average bits, for
use without a budget; with a budget and ``compress="auto"`` the ILP (:mod:`.solve`) picks bits and recomputation
together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..compress.quantize import BITS, GROUP_SIZE, quantized_nbytes

__all__ = ["DUPLICATE", "LEVELS", "CompressOptions", "Level", "SavedInfo", "allocate_bits", "duplicate_of",
           "get_level", "region_of", "total_variance"]

logger = logging.getLogger(__name__)


def region_of(key: str) -> str:
    """The region (a unit's name, ``<stem>`` or ``<after:unit>``) of a saved tensor's key ``"<region>#<k>"``."""
    return key.rsplit("#", 1)[0]


DUPLICATE = "duplicate of "
"""How :attr:`SavedInfo.lossy` starts for a save stored as an earlier one (the same tensor, or a view of it)."""


def duplicate_of(lossy: str | None) -> str | None:
    """The key whose stored form a duplicate save shares (its ``lossy`` reason names it), or ``None``."""
    return lossy[len(DUPLICATE):] if lossy is not None and lossy.startswith(DUPLICATE) else None


@dataclass
class SavedInfo:
    """One distinct tensor a forward saves for backward, as the runtime enumerated it."""

    key: str
    region: str  # the unit it was saved in, "<stem>" before the first unit, "<after:unit>" after one
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    lossy: str | None  # None: may be quantized; else why it must stay exact
    sensitivity: float = 0.0  # C_s
    input_of: tuple[str, ...] = ()  # units (other than its region) that take this tensor as input
    measured: bool = True  # False: C_s is a value-range proxy (the model has an op without a double backward)
    node: int = -1  # the autograd node whose backward unpacks it (numbered by the probe; its tensors come back at once)
    unit_output: bool = False  # its memory is what its region's unit returns: the next forward holds it whole
    held_through: str | None = None
    """The last region (a unit, ``"<after:unit>"``) of the forward during which the model's own code still holds
    this tensor's memory (HF's ``BertModel.forward`` keeps the embedding output in a local until it returns): until
    then packing it frees nothing. The probe finds it (:func:`zoomem.runtime.probe.held_by_caller`)."""
    unit_input: bool = False
    """Its memory is an input of the unit it is saved in (a block's input its first conv saves): the caller holds
    it until that unit has returned, into the first stretch of the forward after it."""
    dead_at: str | None = None
    """The key of the first later save in its own region by which nothing but autograd holds this tensor's memory
    (a BatchNorm's normalised input, made only to be saved, by the next save): packed, it frees its bytes from
    there on in its own forward. ``None``: still held when its region's saving ends (:func:`zoomem.runtime.probe.
    liveness`)."""
    shares: tuple[str, ...] = ()
    """Keys of the tensors saved before it that are other parts of the same memory, none of them all of it (timm's
    attention saves q, k and v, views of one ``qkv`` output): packing one frees nothing while another is kept exact,
    so a plan stores them lossily all or none."""
    group: int = GROUP_SIZE
    """Elements per quantization group: fewer where backward reads it in rows that groups of the default size would
    mix (a 192-wide layer norm's input; :func:`zoomem.compress.quantize.row_group`)."""
    row_dims: tuple[int, ...] = ()
    """For a tensor grouped by :attr:`group` (read in rows): per read, how many of its trailing dimensions make up a
    row (:func:`zoomem.compress.quantize.row_dims`; 0: no trailing ones). A plan reused at smaller inputs keeps
    the groups only where they still divide the rows (:func:`zoomem.compress.quantize.rows_fit`)."""
    min_bits: int = 1
    """The narrowest width it may be stored in, whatever the level: 4 for a fused attention's query and key, whose
    rounding moves the probabilities through ``exp`` (:data:`zoomem.runtime.probe.EXP_MIN_BITS`)."""
    lse_of: dict | None = None  # type: ignore[type-arg]
    """For a fused attention's saved log-sum-exp: the keys of its ``query``, ``key`` and ``mask`` (or ``None``),
    and its ``scale`` and ``causal``. Where the query or key is stored lossily, the store recomputes it from their
    stored forms (:func:`zoomem.ops.attention.attention_logsumexp`; :data:`zoomem.runtime.probe.LSE_READS`)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def packed_nbytes(self, bits: int) -> int:
        return quantized_nbytes(self.shape, bits, self.group)

    def variance(self, bits: int) -> float:
        return self.sensitivity / ((1 << bits) - 1) ** 2

    def to_dict(self) -> dict:  # type: ignore[type-arg]
        return {"key": self.key, "region": self.region, "shape": list(self.shape), "dtype": str(self.dtype),
                "nbytes": self.nbytes, "lossy": self.lossy, "sensitivity": self.sensitivity,
                "input_of": list(self.input_of), "node": self.node, "unit_output": self.unit_output,
                "held_through": self.held_through, "unit_input": self.unit_input, "dead_at": self.dead_at,
                "shares": list(self.shares), "group": self.group, "row_dims": list(self.row_dims),
                "min_bits": self.min_bits, "lse_of": self.lse_of}


@dataclass(frozen=True)
class CompressOptions:
    """How the joint program (``compress="auto"`` under a budget) may store tensors lossily.

    Args:
        bits: the bit widths it may choose from.
        variance_tolerance: the predicted relative gradient variance (variance over ``||g||**2``) that the
            objective charges as much as one step of compute; smaller is more cautious (more recomputation,
            more bits).
    """

    bits: tuple[int, ...] = BITS
    variance_tolerance: float = 0.05

    def __post_init__(self) -> None:
        bad = [b for b in self.bits if b not in BITS]
        if bad or not self.bits:
            raise ValueError(f"bits={self.bits} must be a non-empty subset of {BITS}.")
        if self.variance_tolerance <= 0:
            raise ValueError(f"variance_tolerance must be positive, got {self.variance_tolerance}.")


@dataclass(frozen=True)
class Level:
    """A GACT-style compression level: fixed bits, or an average over tensors chosen by sensitivity."""

    name: str
    bits: int | None = None  # fixed bits for every eligible tensor
    avg_bits: float | None = None  # adaptive: average bits per element, allocated by sensitivity
    offload: bool = False  # also move the compressed forms to host memory
    min_bits: int = 1  # adaptive: the narrowest width the allocator may choose
    help: str = ""

    def __post_init__(self) -> None:
        if self.min_bits not in BITS or (self.avg_bits is not None and self.min_bits > self.avg_bits):
            raise ValueError(f"Level {self.name!r}: min_bits={self.min_bits} must be one of {BITS} and at most "
                             f"avg_bits={self.avg_bits}.")

    @property
    def lossy(self) -> bool:
        return self.bits is not None or self.avg_bits is not None

    @property
    def adaptive(self) -> bool:
        return self.avg_bits is not None


LEVELS: dict[str, Level] = {
    lv.name: lv
    for lv in (
        Level("L0", help="nothing lossy (plain PyTorch)"),
        Level("L1", bits=4, help="every eligible tensor in 4 bits"),
        Level("L1.1", bits=8, help="every eligible tensor in 8 bits"),
        Level("L1.2", bits=2, help="every eligible tensor in 2 bits"),
        Level("L2", avg_bits=4, min_bits=2, help="adaptive bits by sensitivity, 4 on average, 2 at least"),
        Level("L2.1", avg_bits=3, help="adaptive bits by sensitivity, 3 on average"),
        Level("L2.2", avg_bits=2, help="adaptive bits by sensitivity, 2 on average"),
        Level("L3", avg_bits=4, min_bits=2, offload=True,
              help="L2, with the compressed forms offloaded to host memory"),
    )
}
"""GACT's levels (DESIGN.md section 6). Levels above L0 also switch on the exact compact forms (1-bit masks,
output-saving norms) of every unit. L2 and L3 never store a tensor in 1 bit: with 4 bits on average to spend they
can afford 2, and the 1-bit form (every element rounded to its group's min or max) is where the first-order
sensitivity model is least accurate: on the digits task, 1-bit storage of the stem's activations cost seeds 0 and
3 of `scripts/bench.py accuracy` 1.00 and 1.67 points against plain PyTorch, with 2 bits at least +0.33 each."""


def get_level(level: str | Level) -> Level:
    if isinstance(level, Level):
        return level
    if level not in LEVELS:
        raise ValueError(f"Could not resolve level {level!r} among choices {list(LEVELS)}.")
    return LEVELS[level]


def eligible(infos: list[SavedInfo]) -> list[SavedInfo]:
    """Tensors that may be quantized (those read through comparisons or reciprocals were already excluded by the
    probe)."""
    return [s for s in infos if s.lossy is None]


def floor_sensitivities(infos: list[SavedInfo]) -> None:
    """Give measured tensors with no effect on this step's gradient (C_s = 0) the per-element sensitivity of the
    least sensitive tensor that has one: no effect *yet* is not no effect (timm's ResNet blocks start with a zero
    BatchNorm weight, so their branch's tensors matter from the first update on; refreshes then measure them)."""
    cands = [s for s in eligible(infos) if s.measured and s.numel]
    dens = [s.sensitivity / s.numel for s in cands if s.sensitivity > 0]
    if not dens:
        return
    least = min(dens)
    for s in cands:
        if s.sensitivity <= 0:
            s.sensitivity = least * s.numel


def allocate_bits(infos: list[SavedInfo], level: Level, time_limit: float = 10.0) -> dict[str, int]:
    """Bits per eligible tensor for ``level``.

    Fixed levels give every eligible tensor the same bits. Adaptive levels minimise the summed predicted gradient
    variance ``sum C_s / (2**b - 1)**2`` subject to an average of ``avg_bits`` per element over the eligible
    tensors (a multiple-choice knapsack, solved exactly by the planner's ILP solver; GACT solves it greedily), with
    widths from ``level.min_bits`` up. A tensor's own :attr:`SavedInfo.min_bits` raises its width at any level.
    """
    if not level.lossy:
        return {}
    cands = eligible(infos)
    if level.bits is not None:
        return {s.key: max(level.bits, s.min_bits) for s in cands}
    if any(not s.measured for s in cands):  # no real sensitivities: the widest fixed bits within the average
        bits = max(b for b in BITS if b <= level.avg_bits)  # type: ignore[operator]
        logger.warning("zoomem: %s without measured sensitivities: every eligible tensor in %d bits", level.name, bits)
        return {s.key: max(bits, s.min_bits) for s in cands}
    if not cands:
        return {}
    import pulp

    from .solve import _solver, solve

    total = sum(s.numel for s in cands)
    scale = max(max(s.sensitivity for s in cands), 1e-30)
    prob = pulp.LpProblem("zoomem_bits", pulp.LpMinimize)
    widths = {s.key: [b for b in BITS if b >= max(level.min_bits, s.min_bits)] for s in cands}
    x = {(s.key, b): pulp.LpVariable(f"b_{i}_{b}", cat=pulp.LpBinary) for i, s in enumerate(cands)
         for b in widths[s.key]}
    for s in cands:
        prob += pulp.lpSum(x[s.key, b] for b in widths[s.key]) == 1
    floor = sum(min(widths[s.key]) * s.numel for s in cands) / total  # the least average the tensors' floors allow
    prob += pulp.lpSum(x[s.key, b] * b * s.numel / total for s in cands for b in widths[s.key]) \
        <= max(level.avg_bits, floor)  # type: ignore[type-var]
    prob += pulp.lpSum(x[s.key, b] * s.variance(b) / scale for s in cands for b in widths[s.key])
    solve(prob, _solver(time_limit)[1])
    if pulp.LpStatus[prob.status] != "Optimal":
        raise RuntimeError(f"The bit allocation for {level.name} did not solve (status {pulp.LpStatus[prob.status]}).")
    return {s.key: max(widths[s.key], key=lambda b: x[s.key, b].value() or 0.0) for s in cands}


def total_variance(infos: list[SavedInfo], bits: dict[str, int]) -> float:
    """Predicted gradient variance of an assignment of bits (sum over tensors)."""
    by_key = {s.key: s for s in infos}
    return sum(by_key[k].variance(b) for k, b in bits.items() if k in by_key)
