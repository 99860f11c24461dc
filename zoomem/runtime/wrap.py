"""``zoomem.wrap`` / ``zoomem.unwrap`` / ``zoomem.plan``: install a memory plan on a live model, undoably.

``wrap`` changes the model in place at instance level (never its class): the model's ``forward`` and each
unit's ``forward`` become thin wrappers; parameters, buffers, ``state_dict`` keys, hooks and devices are
untouched. On the first training forward with a new input signature (shapes, dtypes) it traces one step on
that very batch, plans under the budget, caches the plan on the model's handle and logs a line; in ``eval()``
or under ``torch.no_grad()`` the original forward runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import warnings
from dataclasses import dataclass, field, replace
from types import MethodType
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from ..adapters import Adapter, Unit, get_adapter
from ..adapters.base import MEAN_LOSS_BYTES, mean_loss_warning, output_loss
from ..batch import Batch, no_larger, signature_numel
from ..graph import OpGraph, trace
from ..graph.timeline import (BackwardWindow, ForwardWindow, SegmentStat, measure_forward_rises, measure_timeline,
                              meter_busy)
from ..benchtools import exc_text
from ..measure import MemoryMeter, is_out_of_memory
from ..optimizer import footprint
from ..compress.quantize import GROUP_SIZE, seconds_per_byte, seconds_per_call
from ..compress.triton_kernels import use_triton
from ..planner.costs import _points
from ..planner import STRATEGIES, CostModel, Decision, InfeasibleBudgetError, Plan, make_plan, parse_budget
from ..planner.compression import CompressOptions, Level, SavedInfo, allocate_bits, get_level
from ..ops import Impl
from ..ops.functional import separate_masks, stores_lossily
from ..ops.loss import set_skip_logits, skips_logits
from ..planner.scale import Scale, scale_costs, scale_saved, sizes_within, trace_sizes
from ..planner.solve import SAFETY_MARGIN, min_feasible_budget, unit_modes
from ..ops.checkpoints import in_models_checkpoint
from ..state import planning_passes, restore_buffers
from .distributed import (all_reduce_mean, bucket_bytes, ddp_of, from_rank, from_rank0, gather, same_everywhere,
                          world_size)
from .compact import OUTSIDE_UNITS, UNIT_INNER, choose_impls, install_all, install_switched, wrap_root
from .patch import HANDLE, eager_under_compile, is_ours, set_forward
from .calls import CallUnit, casts_cached, shared_module, split_calls, splits_of, units_of, unsplit
from .capture import HeldOutputGrads
from .inflight import InFlight
from .probe import probe_saved
from .storage import SavedTensorStore, save_sigs
from .chain import Chain, Recipe
from .units import measure_recompute_backward, measure_recompute_rises, run_unit

__all__ = ["wrap", "unwrap", "plan", "is_wrapped", "disabled"]

logger = logging.getLogger(__name__)
_ATTR = HANDLE
_MIB = 1024**2


@dataclass(frozen=True)
class _Active:
    """The plan in force during one forward, as the lookups every unit and implementation makes per call."""

    decisions: dict[str, Decision]
    compact: frozenset[str]
    store: SavedTensorStore | None = None
    feeds_chain: frozenset[str] = frozenset()
    """Units whose next unit drops its input (``RECOMPUTE_CHAIN``): they register how to bring it back."""
    chain: Chain | None = None
    recomputes: bool = False
    """Some unit recomputes: every unit then runs with the adapter's ``recompute_inputs`` (no KV cache), so the
    step's cache is not left with some layers only."""

    @classmethod
    def of(cls, plan: Plan, generator: torch.Generator | None = None, variants: Sequence[Plan] = (),
           smaller: bool = False) -> "_Active":
        """``smaller``: the plan runs a step on inputs smaller than it was made for (:meth:`_Handle._larger_plan`)."""
        store = SavedTensorStore(
            bits=plan.bits, groups=plan.groups, lse_of=plan.lse_of, offload=plan.offload, generator=generator,
            saves=plan.saves, smaller=smaller, row_dims=plan.row_dims if smaller else {},
            unchecked=frozenset(u.name for u in plan.units if u.decision != Decision.KEEP),
            variants=[] if smaller else [{"saves": v.saves, "bits": v.bits, "groups": v.groups, "lse_of": v.lse_of}
                                         for v in variants]) if plan.bits else None
        compact = _compact_of(plan)
        feeds = frozenset(a.name for a, b in zip(plan.units, plan.units[1:]) if b.decision == Decision.RECOMPUTE_CHAIN)
        recomputes = any(d != Decision.KEEP for d in plan.decisions.values())
        return cls(plan.decisions, compact, store, feeds, Chain() if feeds else None, recomputes)

    def hooks(self, model: nn.Module, batch: Batch) -> contextlib.AbstractContextManager:  # type: ignore[type-arg]
        """The store's hooks around one forward of ``model`` on ``batch`` (a no-op when nothing is lossy)."""
        if self.store is None:
            return contextlib.nullcontext()
        return self.store.hooks(model, batch.args, batch.kwargs)

    def forward_done(self) -> None:
        """End of one forward under this plan, a training one or one measured while planning: the chain forgets
        its registry (it would keep every recipe, and so every chained unit's predecessor's input, to the end of
        backward)."""
        if self.chain is not None:
            self.chain.close()


def _compact_of(plan: Plan) -> frozenset[str]:
    """The units whose compact forms ``plan`` runs, :data:`OUTSIDE_UNITS` for the modules outside them."""
    return frozenset(u.name for u in plan.units if u.compact) | ({OUTSIDE_UNITS} if plan.outside_compact else set())


@dataclass
class _Planning:
    """What a plan was made from, kept to re-plan when sensitivities are measured again."""

    costs: CostModel
    budget_bytes: int | None
    chosen_units: frozenset[str]
    infos: list[SavedInfo]
    probe_scale: Scale | None = None
    """Where set, refreshes measure sensitivities on two smaller batches and extrapolate them: the measurement at
    the batch ran out of memory, or would peak above the budget (:func:`_refresh_scale`)."""
    out_of_memory: bool = False
    """The measurement ran out of memory on every size tried, a refresh's (the plan keeps its bits: a training step
    never fails for a refresh) or planning's (value ranges stand in): the plan's bits are measured no more."""


def plan_key(  # type: ignore[type-arg]
    batch: Batch, training: bool = True, grads_held: bool = False, frozen: tuple[int, ...] = (), forwards: int = 1,
    floor: int = 0,
) -> tuple[tuple, bool, bool, tuple[int, ...], int, int]:
    """The key of a step on ``batch`` in a wrapped model's plan cache: what its forward sees (the input signature,
    train mode), whether the step starts with the gradients held (a later micro-batch of accumulation), which
    parameters are frozen (:func:`_parameter_state`: a frozen backbone's forward saves nothing for backward, and
    its plan would not hold the step once it trains), how many training forwards a step runs before its
    backward (:class:`~.inflight.InFlight`: each holds what its forward leaves while the others run) and the least
    bytes each other one holds (``floor``: what the forwards before it hold, where that is more than it leaves)."""
    return (Batch(batch.args, batch.kwargs).signature(), training, grads_held, frozen, forwards, floor)


def _parameter_state(model: nn.Module) -> tuple[bool, tuple[int, ...]]:
    """Whether a parameter that requires a gradient holds one, and the positions in ``model.parameters()`` of
    those that require none (one pass, each training step)."""
    held, frozen = False, []
    for i, p in enumerate(model.parameters()):
        if not p.requires_grad:
            frozen.append(i)
        elif not held and p.grad is not None:
            held = True
    return held, tuple(frozen)


@dataclass
class _Handle:
    """Per-model zoomem state: configuration, installed wrappers and the plan cache (:func:`plan_key`)."""

    model: nn.Module
    budget: int | float | str | None
    strategy: str
    adapter: Adapter
    units: list[Unit]
    time_limit: float
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None
    compress: CompressOptions | None = None
    level: Level | None = None
    sensitivity_interval: int = 0
    trace_batch_size: int | None = None
    reuse_plans: bool = True
    plans: dict[tuple, Plan] = field(default_factory=dict)
    planning: dict[tuple, _Planning] = field(default_factory=dict)
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    seed: int = 0
    steps: int = 0
    active: "_Active | None" = None
    busy: bool = False
    enabled: bool = True
    undo: list[Callable[[], None]] = field(default_factory=list)
    forward: Callable[..., Any] | None = None  # zoomem's model forward (a method of the model)
    impl_undos: list[Callable[[], None]] = field(default_factory=list)
    root_impls: list[Impl] = field(default_factory=list)
    """Implementations wrapping the model's own forward, run inside zoomem's when the plan switches on the
    outside units' forms (:data:`OUTSIDE_UNITS`)."""
    last_graph: OpGraph | None = None
    compile_warned: bool = False
    unplanned_warned: bool = False
    hooks_warned: bool = False
    variants: dict[str, list[Plan]] = field(default_factory=dict)
    """Per plan signature, plans of a compression level made on batches of that signature whose forward saved other
    tensors than the plan's (control flow that depends on the batch's values): the store goes on with one of them
    at the first save that differs (:attr:`SavedTensorStore.variants`)."""
    reused: dict[tuple, tuple] = field(default_factory=dict)  # type: ignore[type-arg]
    """Plan keys whose steps run the plan of larger inputs (:meth:`_larger_plan`) -> that plan's key."""
    own: set[tuple] = field(default_factory=set)  # type: ignore[type-arg]
    """Plan keys whose forward left the saves of the larger inputs' plan they ran: they plan on their own."""
    holding: tuple | None = None  # type: ignore[type-arg]
    """The plan key whose refresh is due: :meth:`plan_for` leaves it for the forward to hold the step's output
    gradient, and the refresh runs at the next training step, on that step's batch
    (:class:`~.capture.HeldOutputGrads`)."""
    held: tuple[tuple, HeldOutputGrads] | None = None  # type: ignore[type-arg]
    loss_in_output: bool = False
    """The last training forward's output held its loss (an HF model given ``labels``). Where it did not and no
    ``loss_fn`` was given, the loss lies outside the forward (timm's and PyG's loops): refreshes measure against the
    gradient it sends the outputs (:attr:`holding`)."""
    pending: tuple[tuple, Batch] | None = None
    """A plan key and the batch of a forward that left its plan's saves and found no variant: planned as a variant
    at the next training forward."""
    variant_tries: dict[str, int] = field(default_factory=dict)
    """Per plan signature, variants planned so far, kept or not (at most :data:`MAX_VARIANTS`)."""
    last_sig: tuple | None = None  # type: ignore[type-arg]
    runs_smaller: bool = False
    """The plan :meth:`plan_for` gave last was made for larger inputs than the step's (:meth:`_larger_plan`)."""
    in_flight: InFlight = field(default_factory=InFlight)
    forwards: int = 1
    """The most training forwards a step of this model has run before its backward (:class:`~.inflight.InFlight`):
    every plan from then on leaves room for as many, each holding what its forward leaves."""
    compress_scales: dict[tuple, float | None] = field(default_factory=dict)
    """Per input signature and training mode, the scale of lossy prices (:func:`_compression_scale`; ``None`` where
    it could not be measured): one measurement for every plan of that step, so that plans at different budgets are
    priced alike, and for the smaller inputs' (:meth:`compress_scale`)."""

    def in_force(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The model's ``forward`` as the plan in force runs it: through :attr:`root_impls` where it switches on the
        forms outside the units."""
        if self.active is not None and OUTSIDE_UNITS in self.active.compact and self.root_impls:
            return wrap_root(self.model, self.root_impls, forward)
        return forward

    def compact_on(self, unit: str) -> bool:
        """Whether the running plan switches on the memory-efficient implementations inside ``unit``."""
        return self.active is not None and unit in self.active.compact

    def clear_cache(self) -> None:
        """Forget every cached plan: the next training forward plans again."""
        self.plans.clear()
        self.planning.clear()
        self.reused.clear()
        self.own.clear()
        self.variants.clear()
        self.variant_tries.clear()
        self.pending = self.holding = self.held = None

    def generator(self, device: torch.device) -> torch.Generator:
        """zoomem's own stochastic-rounding noise stream on ``device`` (seeded from the user's seed at wrap)."""
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[key]

    def device(self) -> torch.device:
        return _model_device(self.model)

    def active_for(self, plan: Plan, smaller: bool = False) -> _Active:
        """What runs ``plan`` in a forward (``smaller``: on inputs smaller than it was made for)."""
        return _Active.of(plan, self.generator(self.device()) if plan.bits else None,
                          self.variants.get(plan.signature, ()) if plan.signature else (), smaller)

    @contextlib.contextmanager
    def planning_scope(self) -> Iterator[None]:
        """Plan or probe inside: the model's forward runs its original path, entered directly (a wrapper put on
        top of zoomem's, like Accelerate's mixed-precision one, is not re-entered: its autocast state is not
        re-entrant), and autocast's weight-cast cache is cleared afterwards (the planning forwards filled it, and
        selective recomputation must see the same casts in the step as in its recomputation). The hooks on the
        model's parameters are not called inside, nor compiled code (:func:`~zoomem.state.planning_passes`)."""
        was_busy, self.busy = self.busy, True
        outer = self.model.__dict__.get("forward")
        swap = self.forward is not None and outer is not self.forward
        if swap:
            self.model.__dict__["forward"] = self.forward
        try:
            with planning_passes(self.model):
                yield
        finally:
            if swap:
                self.model.__dict__["forward"] = outer
            self.busy = was_busy
            if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
                torch.clear_autocast_cache()

    def note_compiled(self) -> None:
        """Say once that torch.compile runs the training step's planned parts uncompiled."""
        if not self.compile_warned:
            self.compile_warned = True
            _log_rank0("zoomem: torch.compile runs this model's training step uncompiled where zoomem's plan runs "
                       "(the model's forward, or each unit compiled in place: the plan traces, recomputes and stores "
                       "saved tensors in ways Dynamo cannot follow); eval and no_grad forwards compile as usual",
                       level=logging.WARNING)

    def note_unplanned(self, unit: Unit) -> None:
        """Say once that a unit ran a training forward outside the wrapped model's forward, where no plan is in
        force (timm's ``model.forward_features(x)``, an HF model's ``model.base_model(...)``): it ran as plain
        PyTorch, saving nothing, where before stop 57 nothing said so."""
        if not self.unplanned_warned:
            self.unplanned_warned = True
            name = type(self.model).__name__
            _log_rank0("zoomem: %s's unit %r ran a training forward outside %s.forward (another method, as timm's "
                       "model.forward_features(x), or a submodule called directly, as an HF model's "
                       "model.base_model(...)): no plan is in force there, so it ran as plain PyTorch and saved "
                       "no memory. Wrap the module your training step calls (zoomem.wrap(model.base_model, ...), or "
                       "a module of your own around the backbone and head) to plan it.", name, unit.name, name,
                       level=logging.WARNING)

    def _planned(self, sig: tuple) -> bool:  # type: ignore[type-arg]
        """Whether a step of signature ``sig`` has a plan to run without planning (its own or a larger one's)."""
        return sig in self.plans or self._larger_plan(sig)[1] is not None

    def plan_for(self, batch: Batch, grads_held: bool | None = None, floor: int = 0) -> Plan:
        """The plan for a step on ``batch`` (made now if new). ``grads_held``: whether the step starts with the
        gradients present, as a later micro-batch of gradient accumulation does (``None``: as the model has them);
        ``floor``: the least bytes each other forward of the step holds (:func:`plan_key`)."""
        held, frozen = _parameter_state(self.model)
        first = plan_key(batch, self.model.training, False, frozen, self.forwards, floor)
        if grads_held is None:
            grads_held = held
            later = first[:2] + (True,) + first[3:]
            if grads_held and meter_busy(quiet=True) and not self._planned(later) and self._planned(first):
                grads_held = False  # nothing can measure the step so inside a meter: the first micro-batch's plan
        sig = first[:2] + (grads_held,) + first[3:]
        self.last_sig, self.runs_smaller = sig, sig in self.reused
        if self.held is not None and not self._held_waits():  # a refresh held a step's output gradient: it runs
            (held_sig, held), self.held = self.held, None       # now, on that step's batch (every rank: all held
            if held_sig in self.planning and held_sig in self.plans:  # at the same step)
                self._refresh(held_sig, held.batch, self.plans[held_sig], held)
        if self.lossy and world_size() > 1 and not same_everywhere(repr(sig)):  # (no repr per step in one process)
            return self._shared_plan(sig, batch)
        if self.pending is not None and not meter_busy(quiet=True):
            self._plan_variant(*self.pending)
        cached = self.plans.get(sig)
        if cached is not None:
            if (sig in self.planning and refresh_due(self.steps, self.sensitivity_interval)
                    and not self.planning[sig].out_of_memory and not self._skips_refresh(sig, cached)):
                if self.loss_fn is None and not self.loss_in_output:
                    self.holding = sig  # the refresh waits for this step's output gradient, to the next step
                else:
                    cached = self._refresh(sig, batch, cached)
            return cached
        source, larger = self._larger_plan(sig)
        if larger is not None:
            self.plans[sig], self.reused[sig], self.runs_smaller = larger, source, True
            _log_rank0("zoomem: %s's new input signature is no larger than one planned already: it runs that plan "
                       "(predicted peak %.1f MiB at the larger inputs%s)", type(self.model).__name__,
                       larger.predicted_peak_bytes / _MIB, ", its bits measured there" if larger.bits else "",
                       every_rank=not self.lossy)
            return larger
        if meter_busy(quiet=True):
            raise RuntimeError(
                f"zoomem: {type(self.model).__name__} has no plan for this step's inputs yet, and a torch profiler "
                "or zoomem.MemoryMeter is running: planning measures a real step's memory, which cannot run inside "
                "one (profilers do not nest). Run one training step on inputs of this shape before profiling (its "
                "plan is cached, and the profiled steps run it), or plan at once, outside the profiler, with "
                "zoomem.wrap(model, ..., batch=example).")

        def make() -> Plan:
            return self._make_plan(batch, sig)

        self._warn_of_hooks()
        with self.planning_scope():  # lossless: each rank its own plan, for its own inputs, with no collective
            new = from_rank0(make, _encode_plan, _decode_plan) if self.lossy else make()
        new.signature = _signature_text(sig)
        self.plans[sig] = new
        if "_planning" in new.extras:
            self.planning[sig] = new.extras.pop("_planning")
            new.saves = save_sigs(self.planning[sig].infos)
        if new.bits and new.variance > NOISY_VARIANCE:
            _log_rank0(
                "zoomem: the plan's lossy storage adds gradient noise of %.2f times the squared gradient norm (%s); "
                "training may be noisier or diverge. An adaptive level (L2, L2.1, "
                "L2.2) or compress='auto' spends the bits where this noise comes from.", new.variance,
                new.level or "auto", level=logging.WARNING,
            )
        recomputed = sum(u.decision != Decision.KEEP for u in new.units)
        trainable = any(k[:3] == sig[:3] and k[3] != sig[3] for k in self.plans)
        _log_rank0(
            "zoomem: planned %s for a new %s%s: %d of %d units recomputed, predicted peak %.1f MiB "
            "(PyTorch %.1f MiB)", type(self.model).__name__,
            f"set of trainable parameters ({len(frozen)} frozen)" if trainable else "input signature",
            (", the step starting with the gradients held (gradient accumulation)" if grads_held else "")
            + (f", {sig[4]} forwards before each backward" if sig[4] > 1 else ""), recomputed,
            len(new.units), new.predicted_peak_bytes / _MIB, new.baseline_peak_bytes / _MIB, every_rank=not self.lossy,
        )
        return new

    def after_others(self, batch: Batch, plan: Plan) -> Plan:
        """The plan for a forward on ``batch`` that follows others of its step: ``plan`` where it leaves room for
        what they hold (each as much as its own forward leaves, or its floor), else one made with that floor
        (:func:`plan_key`): a step's smaller crops, planned to keep more, before its larger ones. Where none fits,
        ``plan``, with a warning (once per plan): the step peaks up to that difference above the budget."""
        n = self.forwards - 1
        held, room = self.in_flight.held_bytes(self.forwards), n * max(plan.left_bytes, plan.others_floor)
        floor = -(-held // n)
        if held <= room or floor >= plan.extras.get("no_floor", floor + 1):
            return plan
        try:
            return self.plan_for(batch, floor=floor)
        except InfeasibleBudgetError as err:
            plan.extras["no_floor"] = floor  # (a higher floor fits no better: not planned again)
            if not plan.extras.get("floor_warned"):
                plan.extras["floor_warned"] = True
                _log_rank0("zoomem: the forwards of this step before this one hold %.1f MiB, more than its plan "
                           "leaves room for (%.1f MiB), and no plan fits beside them (%s): this forward runs its "
                           "plan, and the step may peak up to %.1f MiB above the budget", held / _MIB, room / _MIB,
                           err, (held - room) / _MIB, level=logging.WARNING)
            return plan

    def _warn_of_hooks(self) -> None:
        """Warn, once, that the model's module hooks (none are zoomem's) run in planning's passes too."""
        if self.hooks_warned:
            return
        hooked = _hooked_modules(self.model)
        if hooked:
            self.hooks_warned = True
            _log_rank0(
                "zoomem: module hooks on %s run in planning's forwards and backwards too, before this step's own "
                "(and forward hooks again where backward recomputes a unit, as under torch.utils.checkpoint): a hook "
                "that collects every call's output (a list it appends to) collects theirs too. Keep each module's "
                "last output instead (a dict by module name: this step's own forward writes it last). Hooks on "
                "parameters are not called in planning.", ", ".join(hooked[:3])
                + (f" and {len(hooked) - 3} more modules" if len(hooked) > 3 else ""), level=logging.WARNING)

    def _held_waits(self) -> bool:
        """Whether the held step's refresh waits for its backward (:meth:`HeldOutputGrads.waits`), decided alike on
        every rank (one collective while it waits: the refresh's own collectives follow)."""
        assert self.held is not None
        waits = self.held[1].waits(self.steps)
        return (same_everywhere(repr(waits)) and waits) if world_size() > 1 else waits

    def _skips_refresh(self, sig: tuple, plan: Plan) -> bool:  # type: ignore[type-arg]
        """Whether a refresh of ``plan`` is skipped (:func:`_at_fastest`). Under DDP the plan is rank 0's but each
        rank's cost model holds its own timings, so the ranks skip only where every one finds the plan at its
        fastest (one collective, at refresh steps of plans that store nothing lossily): a rank skipping alone
        would leave the others waiting in the refresh's collectives."""
        if plan.bits:
            return False
        fastest = _at_fastest(self.planning[sig].costs, plan)
        return same_everywhere(repr(fastest)) and fastest

    def _shared_plan(self, sig: tuple, batch: Batch) -> Plan:  # type: ignore[type-arg]
        """A training step whose inputs differ in shape by rank, under lossy plans (bits every rank shares): where
        one rank's inputs hold every other's (:func:`~zoomem.batch.no_larger`: dynamic padding, with rows of one
        batch size), every rank runs the plan for those largest inputs, as shorter inputs run a longer one's in one
        process: the one cached for them or for larger ones, else one that rank makes alone and sends to the others
        (:func:`~zoomem.runtime.distributed.from_rank`). That plan keeps the sensitivities it was made with (every
        rank refreshes them together, at one shape). Where no rank's inputs hold every other's, every rank raises
        (:func:`_refuse_other_shapes`). Every rank decides alike, from every rank's key and from caches that stay
        alike on every rank: such steps add the largest inputs' entry only, each rank's own key staying uncached."""
        keys = gather(sig)
        top = next((k for k in keys if all(o[1:] == k[1:] and no_larger(o[0], k[0]) for o in keys)), None)
        if top is None:
            _refuse_other_shapes(sig)
        plan, source = self.plans.get(top), self.reused.get(top, top)
        if plan is None:
            source, plan = self._larger_plan(top)
            if plan is None:
                owner = keys.index(top)

                def make() -> Plan:
                    with self.planning_scope():
                        new = self._make_plan(batch, top)
                    planning = new.extras.pop("_planning", None)  # (no refresh: see above)
                    if planning is not None:
                        new.saves = save_sigs(planning.infos)
                    return new

                plan, source = from_rank(owner, make, _encode_plan, _decode_plan), top
                self._split_as(plan)  # (the other ranks did not trace)
                self._install_forms(batch)
                plan.signature = _signature_text(top)
                _log_rank0("zoomem: the ranks' inputs differ in shape at this step: rank %d, whose inputs hold the "
                           "others', planned %s for them (predicted peak %.1f MiB there); every rank runs it",
                           owner, type(self.model).__name__, plan.predicted_peak_bytes / _MIB)
            self.plans[top] = plan
            if source != top:
                self.reused[top] = source
        self.runs_smaller = sig != top or source != top  # (this rank's key stays uncached: ranks' caches stay alike)
        return plan

    def _split_as(self, plan: Plan) -> None:
        """Split the shared layers whose calls ``plan``, made on another rank, names as units (``<unit>#<i>``)."""
        wanted: dict[str, int] = {}
        for u in plan.units:
            name, mark, index = u.name.rpartition("#")
            if mark and index.isdigit():
                wanted[name] = max(wanted.get(name, 0), int(index) + 1)
        _split(self.model, self.adapter, wanted)

    def _install_forms(self, batch: Batch) -> None:
        """Put the compact forms behind their switches as planning does (:func:`install_impls`), on a rank that
        runs a plan another rank made: without them its forward would save other tensors than the plan names."""
        if not self.impl_undos:
            with self.planning_scope():
                install_impls(self, choose_impls(self.model, self.units, batch, outside=True))

    def _make_plan(self, batch: Batch, sig: tuple) -> Plan:  # type: ignore[type-arg]
        """A plan for a step on ``batch`` under this wrap's settings, for the plan key ``sig`` (:func:`plan_key`:
        the gradients held or not, the forwards before each backward); call inside :meth:`planning_scope`."""
        return _seeing_the_loss(lambda: _make(
            self.model, batch, self.budget, self.strategy, self.adapter, self.optimizer, self.loss_fn,
            self.time_limit, compress=self.compress, level=self.level, trace_batch_size=self.trace_batch_size,
            grads_held=sig[2], others=sig[4] - 1, others_floor=sig[5]))

    def left_its_saves(self, sig: tuple, batch: Batch) -> None:  # type: ignore[type-arg]
        """A training forward on ``batch`` saved other tensors than its plan's forward and its variants' (the store
        stored exactly from there): plan a variant on it at the next training forward, for a compression level
        (its units all kept, its bits the whole plan) in one process, up to :data:`MAX_VARIANTS` per signature. A
        signature that ran a larger one's plan (:attr:`reused`) plans on its own at its next step instead, in one
        process (under DDP a lossy plan is made by every rank at once, and the others' forwards may not have left
        it: such forwards go on storing exactly from the difference, as those of a signature's own plan do)."""
        if sig in self.reused:  # the larger inputs' plan does not fit this signature's forward: plan it apart
            if world_size() == 1:
                del self.plans[sig], self.reused[sig]
                self.own.add(sig)
            return
        plan = self.plans.get(sig)
        if (self.pending is None and plan is not None and self.level is not None and self.level.lossy
                and self.compress is None and world_size() == 1
                and self.variant_tries.get(plan.signature, 0) < MAX_VARIANTS):
            self.pending = (sig, batch)

    def _plan_variant(self, sig: tuple, batch: Batch) -> None:  # type: ignore[type-arg]
        """Plan :attr:`pending`'s variant (planning it is optional: a failure is logged, not raised)."""
        self.pending = None
        primary = self.plans.get(sig)
        if primary is None:
            return
        self.variant_tries[primary.signature] = self.variant_tries.get(primary.signature, 0) + 1
        try:
            with self.planning_scope():
                new = self._make_plan(batch, sig)
        except Exception as exc:  # noqa: BLE001 - such batches go on storing exactly from where they differ
            _release_memory()
            _log_rank0("zoomem: planning a variant for batches whose forward saves other tensors failed (%s)",
                       exc_text(exc), level=logging.WARNING)
            return
        planning = new.extras.pop("_planning", None)
        known = self.variants.setdefault(primary.signature, [])
        if planning is None:
            return
        new.saves = save_sigs(planning.infos)
        if new.saves == primary.saves or any(v.saves == new.saves for v in known):
            return
        new.signature = primary.signature
        known.append(new)
        _log_rank0("zoomem: planned a variant of %s's %s plan for batches of its signature whose forward saves "
                   "other tensors (%d where the plan's saves %d): they run it from where they differ",
                   type(self.model).__name__, new.level, len(new.saves), len(primary.saves))

    @property
    def lossy(self) -> bool:
        """Whether plans may store tensors lossily (a lossy level, or ``compress``): their bits are per tensor,
        measured at one shape, and shared by every DDP rank."""
        return _lossy(self.level, self.compress)

    def _larger_plan(self, sig: tuple) -> tuple[tuple | None, Plan | None]:  # type: ignore[type-arg]
        """A plan made for inputs at least as large as ``sig``'s (:func:`~zoomem.batch.no_larger`; the same train
        mode and gradients flag) and its key, the one recomputing least (of those, made for the smallest inputs),
        where such a plan may run ``sig``'s step: activations only shrink with the inputs, and lossless decisions
        (keep, recompute, compact forms) do not depend on shapes. A lossy plan's bits stay those measured at its
        shape, its saves are compared by rank and size (:attr:`SavedTensorStore.smaller`), and its row-following
        groups kept only where they still divide the rows. Not for :attr:`own` keys."""
        if not self.reuse_plans or sig in self.own:
            return None, None
        fits = [(k, p) for k, p in self.plans.items()
                if k[1:] == sig[1:] and k not in self.reused and no_larger(sig[0], k[0])]
        return min(fits, key=lambda kp: (kp[1].recompute_s, signature_numel(kp[0][0])), default=(None, None))

    def compress_scale(self, batch: Batch, measure: Callable[[], float | None]) -> float:
        """The scale of lossy prices for a plan on ``batch``: the one of its input signature, else one measured at
        inputs at least as large (:func:`~zoomem.batch.no_larger`, the same training mode), else ``measure()``'s
        (``None``: not measurable there, 1). A ratio of the step's cost to the probes' (which price each tensor by
        its bytes and per call), it carries over to shorter inputs, and a lossy plan at each new length of
        dynamic padding skips the six steps that measure it (a third of small BERT's planning time)."""
        key = (batch.signature(), self.model.training)
        if key not in self.compress_scales:
            larger = next((s for (sig, training), s in self.compress_scales.items() if s is not None
                           and training == key[1] and no_larger(key[0], sig)), None)
            if larger is not None:
                logger.info("zoomem: lossy prices x %.2f, as measured at inputs at least as large", larger)
                return larger
            self.compress_scales[key] = measure()
        measured = self.compress_scales[key]
        return 1.0 if measured is None else measured

    def _refresh(self, sig: tuple, batch: Batch, old: Plan,  # type: ignore[type-arg]
                 held: HeldOutputGrads | None = None) -> Plan:
        """Measure the sensitivities again on ``batch`` and re-allocate the bits (the plan's units stay); the plans
        of smaller inputs that ran the old plan run the new one. With ``held`` (whose batch ``batch`` is) against
        its output gradient where it can be used, else against a sampled loss."""
        import time

        t0 = time.perf_counter()
        ctx = self.planning[sig]
        grads, against = None, ""
        if held is not None:
            unusable = held.unusable()
            if unusable is None:
                grads = held.grads
                against = f" against the gradient step {held.step}'s loss sent the outputs, on its batch"
            else:
                against = f" against a sampled loss ({unusable})"

        def replan() -> Plan:
            (infos, grad_sq), ctx.probe_scale = _fitting(
                batch, self.adapter, ctx.probe_scale, "measuring sensitivities",
                lambda s: _probe_at(self, batch, self.adapter, self.loss_fn, self.units, ctx.chosen_units, s,
                                    output_grads=grads))
            ctx.infos = infos
            ctx.costs.attach_saved(infos, grad_sq, ctx.costs.compress_s_per_byte)
            if self.level is not None:
                return _level_plan(ctx.costs, infos, self.level, ctx.chosen_units, self.time_limit)
            assert self.compress is not None
            return make_plan(ctx.costs, ctx.budget_bytes, strategy="ilp", time_limit=self.time_limit,
                             margin=old.extras.get("margin", SAFETY_MARGIN), compress=self.compress)

        failed = None
        try:
            with self.planning_scope():
                new = from_rank0(replan, _encode_plan, _decode_plan)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            failed = exc_text(exc)
        if failed is not None:  # (outside the except block: its traceback no longer holds the measurement's tensors)
            _release_memory()
            ctx.out_of_memory = True
            _log_rank0("zoomem: sensitivities not re-measured at step %d: the measurement ran out of memory on "
                       "every batch size tried (%s); the plan keeps the bits it has, and measures them no more",
                       self.steps, failed, level=logging.WARNING)
            return old
        new.signature, new.extras, new.traced_at, new.saves = old.signature, dict(old.extras), old.traced_at, old.saves
        del held, grads
        _log_rank0("zoomem: sensitivities re-measured at step %d%s in %.2f s (every %d steps); %d tensors lossy",
                   self.steps, against, time.perf_counter() - t0, self.sensitivity_interval, len(new.bits))
        self.plans[sig] = new
        for smaller, source in self.reused.items():  # they run this plan
            if source == sig:
                self.plans[smaller] = new
        return new


def _at_fastest(costs: CostModel, plan: Plan) -> bool:
    """Whether ``plan`` stores nothing lossily and runs every unit in its fastest mode. No sensitivity can then
    change what the program picks (a lossy option costs its (de)quantization seconds plus a multiple of its
    variance, neither below zero), so a refresh would only spend its measurement, which holds more than plain
    PyTorch's step (5.1 GB on GPT-2 b16, whose 50% plan is such a plan, against its 2.4 GB budget). A plan keeping
    a slower compact form to fit still refreshes: a lossy tensor could free the memory for the faster mode once
    sensitivities fall. The forms outside the units are no choice in compression modes (on wherever they free
    memory: :func:`~zoomem.planner.solve.make_plan`), so their time does not count: small BERT's, measured 1 ms
    faster in some runs, kept refreshing a plan that could not have turned them on."""
    if plan.bits:
        return False
    modes = {u.name: u for u in plan.units}
    for i, name in enumerate(costs.units):
        unit = modes.get(name)
        if unit is None:
            return False
        fastest = min(costs.recompute_time({name: d}) + (costs.compact_s.get(name, 0.0) if on else 0.0)
                      for d, on in unit_modes(costs, i, lossy=True))
        if costs.recompute_time({name: unit.decision}, frozenset({name}) if unit.compact else frozenset()) > fastest:
            return False
    return True


def _signature_text(key: tuple) -> str:  # type: ignore[type-arg]
    """:attr:`Plan.signature` of a plan made for the plan key ``key`` (:func:`plan_key`)."""
    frozen = f" with {len(key[3])} parameters frozen" if key[3] else ""
    forwards = f", {key[4]} forwards before each backward" if key[4] > 1 else ""
    if key[5]:
        forwards += f" (each other one holding at least {key[5] / _MIB:.1f} MiB)"
    return repr(key[0]) + (" with the gradients held (a later micro-batch)" if key[2] else "") + frozen + forwards


def _lossy(level: Level | None, compress: CompressOptions | None) -> bool:
    """Whether plans made with ``level`` or ``compress`` may store tensors lossily."""
    return compress is not None or (level is not None and level.lossy)


def _hooked_modules(model: nn.Module) -> list[str]:
    """The modules of ``model`` with forward or backward hooks (``"(every module)"`` first for global ones): code
    outside zoomem's, which leaves none, that every forward or backward of those modules runs."""
    from torch.nn.modules import module as torch_module

    def kept(*dicts: dict) -> bool:  # type: ignore[type-arg]
        return any(getattr(getattr(h, "func", h), "__name__", None) not in _STATELESS_HOOKS  # (through a partial)
                   and not is_ours(h) for d in dicts for h in d.values())  # (a shared layer's call counter)

    every = kept(torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
                 torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks)
    return (["(every module)"] if every else []) + [
        name or "(the model)" for name, m in model.named_modules()
        if kept(m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]


_STATELESS_HOOKS = frozenset({"make_inputs_require_grads", "_collect_output_hook"})
"""Hooks whose extra calls change nothing a step reads, left out of the warning: HF's ``enable_input_require_grads``
(PEFT calls it) marks the embeddings' output as needing a gradient; timm's hook-based feature extractors
(``features_only=True, feature_cls="hook"``) keep each module's last output, which the model's forward returns."""


def _model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


EARLY_REFRESHES = (1, 4, 16, 64)
"""Steps at which sensitivities are measured again besides every ``sensitivity_interval``: early training moves
them most (timm's ResNet blocks start with a zero BatchNorm weight, so their tensors matter only from step 1)."""


def refresh_due(step: int, interval: int) -> bool:
    """Whether adaptive bits are re-measured before training step ``step`` (0 is the one planned); where the loss
    lies outside the forward, that step holds its output gradient and the next one measures against it
    (:class:`~.capture.HeldOutputGrads`)."""
    return interval > 0 and step > 0 and (step in EARLY_REFRESHES or step % interval == 0)


def _encode_plan(plan: Plan) -> str:
    extras = plan.extras
    plan.extras = {k: v for k, v in extras.items() if k != "_planning"}
    try:
        return plan.to_json()
    finally:
        plan.extras = extras


def _decode_plan(text: str, local: Plan | None) -> Plan:
    """Rank 0's plan, with this rank's own planning context (to re-measure sensitivities later)."""
    plan = Plan.from_json(text)
    if local is not None and "_planning" in local.extras:
        plan.extras["_planning"] = local.extras["_planning"]
    return plan


def _refuse_other_shapes(sig: tuple) -> None:  # type: ignore[type-arg]
    """Lossy plans under DDP: every rank runs one plan, made for inputs that hold every rank's
    (:meth:`_Handle._shared_plan`). Where no rank's inputs hold every other's (one rank's batch has fewer rows, the
    other's longer ones), every rank raises here, at the same step."""
    import torch.distributed as dist

    raise RuntimeError(
        f"zoomem under DDP: rank {dist.get_rank()} meets {sig!r} (inputs, training, gradients held) at this step, "
        "and no rank's inputs are at least as large as every other's in every dimension. Lossy plans (compression "
        "levels, compress='auto') keep bits per saved tensor that every rank shares, so every rank runs the plan "
        "of the largest inputs: give every rank batches of one number of rows (drop_last=True, or "
        "even_batches) padded alike or to each batch's longest row, or to a fixed length (a tokenizer's "
        "padding='max_length'), or train with a lossless budget, whose plans are made per rank for its own inputs."
    )


MAX_VARIANTS = 3
"""Variants planned per plan signature at most (:attr:`_Handle.variants`): a model whose saves change with every
batch (a mixture of experts) would otherwise plan at every step."""

NOISY_VARIANCE = 0.1
"""Predicted relative gradient variance above which a plan warns: the noise's norm is a third of the gradient's
(fixed 2-bit L1.2 on a small ResNet predicts 0.73 and diverged in 1 of 5 seeds at SGD lr 0.1; L2 predicts 4e-4)."""


def _log_rank0(msg: str, *args: Any, level: int = logging.INFO, every_rank: bool = False) -> None:
    """Log on rank 0 only (or in one process); ``every_rank``: on every rank, prefixed with it (what one rank does
    on its own, such as a lossless plan for its own inputs, while the others may wait for it)."""
    import torch.distributed as dist

    if world_size() == 1 or dist.get_rank() == 0 and not every_rank:
        logger.log(level, msg, *args)
    elif every_rank:
        logger.log(level, "zoomem (rank %d): " + msg.removeprefix("zoomem: "), dist.get_rank(), *args)


def cost_model(
    model: nn.Module,
    batch: Batch,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    graph: OpGraph | None = None,
    lossy: bool = False,
    grads_held: bool = False,
) -> tuple[CostModel, dict[str, list], OpGraph]:  # type: ignore[type-arg]
    """What every plan of ``model`` on ``batch`` is made from: the traced step, measured once more with the
    memory-efficient implementations of the modules outside the units on, and once more with every one on (what
    ``compact`` saves per unit, and costs), as a :class:`CostModel` (optimizer state in its fixed bytes), with the
    implementations chosen per unit (:func:`install_impls`). ``lossy``: the compact forms are measured as they run
    under zoomem's saved-tensor store (BatchNorm then saves its normalised input and a 1-bit mask, tensors the
    plain compact form never makes), which is what lossy plans run and what their savings are counted against.
    ``grads_held``: the step starts with the gradients present (a micro-batch after the first under gradient
    accumulation): its plain memory points are measured so, the gradients' bytes on top of each."""
    graph = graph or trace(model, batch, adapter=adapter, loss_fn=loss_fn, units=units_of(adapter, model))
    if _split_shared(model, adapter, graph):  # a unit called several times per forward: plan it call by call
        graph = trace(model, batch, adapter=adapter, loss_fn=loss_fn, units=units_of(adapter, model))
    units = units_of(adapter, model)
    chosen = choose_impls(model, units, batch, outside=True)
    loss = _loss(adapter, model, loss_fn)
    as_stored = separate_masks if lossy else contextlib.nullcontext
    graph.compact_faster = sorted(u for u, pairs in chosen.items() if any(i.may_be_faster for _, i in pairs))
    graph.timeline_outside = []
    if chosen.get(OUTSIDE_UNITS) and graph.timeline:
        undo = install_all({OUTSIDE_UNITS: chosen[OUTSIDE_UNITS]})
        try:
            with as_stored():
                graph.timeline_outside = measure_timeline(model, batch, loss, units)
        finally:
            undo()
    windows: list[BackwardWindow] | None = [] if lossy else None
    forward_windows: list[ForwardWindow] | None = [] if lossy else None
    stored: list = []  # type: ignore[type-arg]
    if any(pairs for u, pairs in chosen.items() if u != OUTSIDE_UNITS) and graph.timeline:
        undo = install_all(chosen)
        try:
            graph.timeline_compact = measure_timeline(model, batch, loss, units)
            if lossy:  # and as they run in units that store tensors lossily
                with separate_masks():
                    stored = measure_timeline(model, batch, loss, units, windows=windows,
                                              forward_windows=forward_windows)
        finally:
            undo()
        graph.compact_units = [u for u, pairs in chosen.items() if pairs and u != OUTSIDE_UNITS]
        inside = {u.name for u in units if hasattr(u.module.forward, UNIT_INNER)}  # zoomem's unit forward runs
        modules = {u.name: u.module for u in units}  # a form of the unit's own module inside its recomputation
        graph.compact_recompute_units = [u for u in graph.compact_units
                                         if u in inside or all(mod is not modules.get(u) for mod, _ in chosen[u])]
        graph.shared_units, graph.shared_bytes = _shared_part(model, batch, loss, units, chosen,
                                                              graph.timeline_compact)
    if windows == [] and graph.timeline:  # no unit has compact forms: the windows of the step as lossy plans run it
        undo = install_all(chosen)
        try:
            with as_stored():
                measure_timeline(model, batch, loss, units, windows=windows, forward_windows=forward_windows)
        finally:
            undo()
    costs = CostModel.from_graph(graph, stored_compact=stored)
    if casts_cached():  # a shared layer's calls recompute whole under autocast (calls.casts_cached)
        costs.recompute_cheap_s.update({u.name: float("inf") for u in units if isinstance(u.module, CallUnit)})
    if (costs.chain or costs.after_peaks) and not graph.forward_excess and graph.timeline:
        # what bringing a dropped input back costs; what a recomputed unit's own forward holds
        graph.forward_excess, graph.forward_rise = measure_forward_rises(model, batch, units)
    cheap = {u: Decision.RECOMPUTE_CHEAP for i, u in enumerate(costs.units)
             if (Decision.RECOMPUTE_CHEAP, 0) in unit_modes(costs, i)}
    if cheap and not graph.cheap_rise and graph.timeline:  # what recomputing only the cheap ops holds
        graph.cheap_rise = measure_recompute_rises(model, batch, loss, units, cheap, adapter.recompute_inputs)
    early = [u for u in graph.compact_recompute_units
             if u in costs.compact_saving and costs.compact_saving[u].released > 0]
    if early and not graph.compact_recompute_gain and graph.timeline:  # what their forms take off, recomputed
        graph.compact_recompute_gain = _compact_recompute_gain(model, batch, loss, units, adapter,
                                                               {u: chosen[u] for u in early})
    costs.take_rises(graph)
    used = footprint(optimizer)
    ddp = ddp_of(model)  # (under DDP: planned inside the forward it makes)
    costs.ddp_bytes = bucket_bytes(ddp)
    costs.fixed_bytes += used.state + costs.ddp_bytes
    costs.grads_in_buckets = bool(costs.ddp_bytes and getattr(ddp, "gradient_as_bucket_view", False))
    costs.grads_held = grads_held
    end = graph.timeline[-1].end_bytes if graph.timeline else 0
    if (grads_held or costs.grads_in_buckets) and graph.timeline:
        held = measure_timeline(model, batch, loss, units, grads=True)
        _hold_grads(costs, model, held)
        if costs.grads_in_buckets and held:
            end = held[-1].end_bytes  # the gradients are the buckets, in the fixed bytes
    if optimizer is not None and graph.timeline:  # the backward leaves its end; the step allocates on top
        costs.optimizer_scratch = used.scratch
        costs.optimizer_bytes = end + costs.optimizer_scratch
        if costs.outside_gain:  # (measured: the outside forms' timeline matches the plain one's)
            costs.optimizer_gain = graph.timeline[-1].end_bytes - graph.timeline_outside[-1].end_bytes
    costs.backward_windows = windows or []
    costs.forward_windows = forward_windows or []
    return costs, chosen, graph


def _split_shared(model: nn.Module, adapter: Adapter, graph: OpGraph) -> bool:
    """Split each unit that ``graph``'s forward called more than once into a unit per call
    (:mod:`zoomem.runtime.calls`), and grow a split one that a forward called more often than it has units; return
    whether anything changed (then trace again). A wrapped model's handle runs the new units as planned, and
    unwrapping undoes the split."""
    splits = splits_of(model)
    wanted = {u.name: u.calls for u in graph.units if u.calls > 1 and not u.interleaved}
    wanted.update({name: s.most for name, s in splits.items() if s.most > len(s.calls)})
    return _split(model, adapter, wanted)


def _split(model: nn.Module, adapter: Adapter, wanted: dict[str, int]) -> bool:
    """Split each unit named in ``wanted`` into as many call units (:func:`_split_shared`); return whether any
    changed."""
    handle: _Handle | None = model.__dict__.get(_ATTR)
    current = {u.name: u for u in units_of(adapter, model)}
    splits = splits_of(model)
    wanted = {name: calls for name, calls in wanted.items()
              if (name in current or name in splits) and calls > len(splits[name].calls if name in splits else ())}
    for name, calls in wanted.items():
        fresh = name not in splits
        before = 0 if fresh else len(splits[name].calls)
        split = split_calls(model, current[name] if fresh else Unit(name, splits[name].shared), calls)
        _log_rank0("zoomem: unit %r (%s) ran %d times in one forward: each call is planned as a unit of its own "
                   "(%s#0 to #%d)", name, type(split.shared).__name__, calls, name, calls - 1)
        if handle is not None:
            if fresh:
                handle.undo.append(functools.partial(unsplit, model, name))
            for call in split.calls[before:]:
                handle.undo.append(set_forward(call, _unit_forward(handle, Unit(call.unit_name, call))))
    if wanted and handle is not None:
        handle.units = units_of(adapter, model)
    return bool(wanted)


def _hold_grads(costs: CostModel, model: nn.Module, timeline: list[SegmentStat]) -> None:
    """Raise every memory point of ``costs`` to what ``timeline``, the plain step measured with the gradients
    present, has there, plus those gradients' bytes: present from the start, they add to the forward whole, and
    to the backward what the first micro-batch had not made by then (its backward adds into them instead).
    A point that timeline lacks gets the gradients' bytes whole. Where the gradients are DDP's buckets
    (``costs.grads_in_buckets``), counted in the fixed bytes, each point is what ``timeline`` has there: the
    backward makes no gradient of its own (DDP copies each into its bucket and frees it)."""
    grads = costs.held_grad_bytes = 0 if costs.grads_in_buckets else _grad_bytes(model)
    held = {(p.phase, p.seg): p.measured + grads for p in _points(timeline, len(costs.units) + 1)}
    for p in costs.points:
        at = held.get((p.phase, p.seg), p.measured + grads)
        p.measured = at if costs.grads_in_buckets else max(p.measured, at)


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of the trainable parameters' gradients."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _compact_recompute_gain(model: nn.Module, batch: Batch, loss: Callable[[Any, Batch], torch.Tensor],
                            units: list[Unit], adapter: Adapter,
                            forms: dict[str, list]) -> dict[int, int]:  # type: ignore[type-arg]
    """Per segment of the units in ``forms``: the bytes those compact forms take off the unit's backward when it
    is recomputed (its peak above the recomputation's start), two steps with every one of them recomputed."""
    recomputed = {u: Decision.RECOMPUTE for u in forms}
    plain = measure_recompute_backward(model, batch, loss, units, recomputed, adapter.recompute_inputs)
    undo = install_all(forms)
    try:
        compact = measure_recompute_backward(model, batch, loss, units, recomputed, adapter.recompute_inputs)
    finally:
        undo()
    return {seg: plain[seg] - compact[seg] for seg in plain if seg in compact}


def install_impls(handle: "_Handle", chosen: dict[str, list]) -> None:  # type: ignore[type-arg]
    """Put the chosen implementations behind the wrapped model's per-unit switches (once per wrap)."""
    if not handle.impl_undos and any(chosen.values()):
        handle.impl_undos, handle.root_impls = install_switched(chosen, handle.compact_on, root=handle.model)
        handle.undo.extend(handle.impl_undos)


def _make(
    model: nn.Module,
    batch: Batch,
    budget: int | float | str | None,
    strategy: str,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None,
    time_limit: float,
    graph: OpGraph | None = None,
    compress: CompressOptions | None = None,
    level: Level | None = None,
    trace_batch_size: int | None = None,
    grads_held: bool = False,
    others: int = 0,
    others_floor: int = 0,
) -> Plan:
    handle = model.__dict__.get(_ATTR)
    lossy = _lossy(level, compress)
    scale = _first_scale(batch, trace_batch_size) if graph is None else None
    (costs, chosen, graph), scale = _fitting(
        batch, adapter, scale, "tracing the step",
        lambda s: cost_model(model, batch, adapter, optimizer, loss_fn, graph, lossy, grads_held) if s is None
        else _scaled_cost_model(model, batch, adapter, optimizer, loss_fn, s, lossy, grads_held))
    costs.others, costs.others_floor = others, others_floor
    units = units_of(adapter, model)  # (after the trace: a shared layer's calls may have become units)
    if handle is not None:
        handle.last_graph = graph
        install_impls(handle, chosen)
    baseline = costs.peak({u: Decision.KEEP for u in costs.units})
    budget_bytes = parse_budget(budget, baseline_peak=baseline)
    chosen_units = frozenset(u for u, pairs in chosen.items() if pairs)
    infos: list[SavedInfo] = []
    probe_scale = scale
    ranges_only = False
    if lossy:
        peaks: list[tuple[int, int]] = []
        failed = None
        try:
            (infos, grad_sq), probe_scale = _fitting(
                batch, adapter, scale, "measuring sensitivities",
                lambda s: _probe_at(handle, batch, adapter, loss_fn, units, chosen_units, s, model, chosen, peaks))
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            failed = exc_text(exc)
        if failed is not None:  # the second-order backward fits on no size: value ranges, a plain step's memory
            _release_memory()
            _log_rank0("zoomem: measuring sensitivities ran out of memory on every batch size tried (%s): the bits "
                       "follow each tensor's value range instead, and are not measured again", failed,
                       level=logging.WARNING)
            ranges_only, peaks = True, []
            (infos, grad_sq), probe_scale = _fitting(
                batch, adapter, scale, "measuring value ranges",
                lambda s: _probe_at(handle, batch, adapter, loss_fn, units, chosen_units, s, model, chosen,
                                    second_order=False))
        if handle is not None and not ranges_only:  # a wrapped model refreshes them
            probe_scale = _refresh_scale(
                batch, adapter, probe_scale, peaks, budget_bytes, baseline, costs.fixed_bytes,
                lambda n: _probe(handle, adapter.sub_batch(batch, n), adapter, loss_fn, units, chosen_units, model,
                                 chosen, peaks))
        device = _model_device(model)
        widths = (compress or CompressOptions()).bits
        costs.attach_saved(infos, grad_sq, {b: seconds_per_byte(device, b) for b in widths},
                           fused=use_triton(torch.empty(0, device=device), GROUP_SIZE),
                           seconds_per_call={b: seconds_per_call(device, b) for b in widths})
        if handle is not None and scale is None:  # a step at the batch runs here (not so when extrapolated)
            costs.compress_scale = handle.compress_scale(
                batch, lambda: _compression_scale(handle, costs, infos, chosen_units, batch, adapter, loss_fn, units,
                                                  time_limit))
    if level is not None:
        new = _level_plan(costs, infos, level, chosen_units if level.lossy else frozenset(), time_limit)
        new.budget_bytes = budget_bytes
        new.traced_at = scale.sizes() if scale is not None else []
        if lossy:
            new.extras["_planning"] = _Planning(costs, budget_bytes, chosen_units, infos, probe_scale,
                                                out_of_memory=ranges_only)
        return new
    verified = handle is not None and budget_bytes is not None and strategy in ("ilp", "greedy")

    def lossless_instead(err: InfeasibleBudgetError) -> Plan:
        """``compress="auto"`` covers every lossless plan, but its trace differs from the lossless one (the
        compact forms outside the units are measured as stored, and verification may refuse a plan the other
        trace would not), so near the lossless minimum it may find none: then plan without the store, and name
        the lower minimum."""
        if compress is None or budget_bytes is None:
            raise err
        try:
            plan = _make(model, batch, budget_bytes, strategy, adapter, optimizer, loss_fn, time_limit,
                         graph=graph if scale is None else None, trace_batch_size=trace_batch_size,
                         grads_held=grads_held, others=others, others_floor=others_floor)
        except InfeasibleBudgetError as lossless_err:
            raise (lossless_err if lossless_err.min_budget < err.min_budget else err) from None
        logger.info("zoomem: no plan storing tensors in fewer bits fits %.1f MiB; a lossless one does",
                    budget_bytes / _MIB)
        return plan

    def measured_minimum(err: InfeasibleBudgetError) -> InfeasibleBudgetError:
        """``err``, or where the least-peak plan measures above the smallest budget it names, the same error naming
        the measured peak: asked for the predicted one, verification would refuse it (a few KiB over on a small
        model), and the budget an error names must be one that works. A retry traces afresh and may pick other
        plans; verification ends with the least-peak plan (:func:`_least_peak_plan`), the one measured here."""
        assert handle is not None
        try:
            least = _least_peak_plan(costs, strategy, time_limit, compress)
            peak = _measured_peak(handle, least, batch, adapter, loss_fn, units, costs)
        except Exception as exc:  # noqa: BLE001 - no better figure: the prediction stands
            if isinstance(exc, InfeasibleBudgetError) or is_out_of_memory(exc):
                return err
            raise
        if peak <= err.min_budget:
            return err
        return InfeasibleBudgetError(
            f"No plan keeps this step within {budget_bytes / _MIB:.1f} MiB ({budget_bytes} bytes): the smallest "
            f"feasible budget is {peak / _MIB:.1f} MiB ({peak} bytes, what the least-peak plan measured; predicted "
            f"{err.min_budget} bytes). Raise the budget to at least that, or lower the batch size.", peak)

    margin, unmet = SAFETY_MARGIN, None
    try:
        new = make_plan(costs, budget_bytes, strategy=strategy, time_limit=time_limit, compress=compress)
    except InfeasibleBudgetError as err:
        # the margin covers an unmeasured prediction; this path measures, so a plan predicted within the budget
        # itself gets its chance (the last percent is a batch or two at a device's limit)
        if not verified:
            return lossless_instead(err)
        try:
            new = make_plan(costs, budget_bytes, strategy=strategy, time_limit=time_limit, margin=0.0,
                            compress=compress)
        except InfeasibleBudgetError:
            return lossless_instead(measured_minimum(err))
        margin, unmet = 0.0, err
    if compress is not None:
        new.extras["_planning"] = _Planning(costs, budget_bytes, chosen_units, infos, probe_scale,
                                            out_of_memory=ranges_only)
    traced_at = new.traced_at = scale.sizes() if scale is not None else []
    if not verified:
        return new
    assert handle is not None and budget_bytes is not None
    # measured peaks are the judge: run the plan once; if it overshoots, plan again that much lower
    measured: int | None = None
    tried: list[tuple[int, int]] = []  # (predicted, measured) of each plan that ran and overshot
    least_tried = False

    def last_resort() -> Plan | None:
        """The least-peak plan, where no plan measured so far was one: the last to measure before giving up. The
        budget an error named came from one trace's plans; a retry's fresh timings pick others, whose predictions
        err by other amounts (DenseNet-121's minimum plan recomputes 7 or 9 of 58 units run to run), and its
        margins may step past the plans that fit."""
        nonlocal least_tried
        if least_tried:
            return None
        least_tried = True
        try:
            least = _least_peak_plan(costs, strategy, time_limit, compress)
        except InfeasibleBudgetError:  # a baseline strategy that cannot reach the program's least peak
            return None
        if any(predicted <= least.predicted_peak_bytes for predicted, _ in tried):
            return None
        least.budget_bytes = budget_bytes
        return least

    for round_ in range(_VERIFY_ROUNDS + 1):  # the last round only for the least-peak plan
        try:
            measured = _measured_peak(handle, new, batch, adapter, loss_fn, units, costs)
            oom = False
        except Exception as exc:  # noqa: BLE001 - the device is the judge too: out of memory, the plan does not fit
            if not is_out_of_memory(exc):
                raise
            oom, measured = True, None
        if oom:
            _release_memory()
        new.extras["measured_peak_bytes"] = measured
        new.extras["margin"] = margin
        if not oom and (measured is None or measured <= budget_bytes or all(
                u.decision == Decision.KEEP and not u.compact for u in new.units) and not new.bits):
            return new
        if unmet is not None:  # the plan without a margin does not fit either: the first error stands
            return lossless_instead(unmet)
        if oom:
            logger.info("zoomem: the plan for %.1f MiB ran out of device memory; planning again with %.0f%% less",
                        budget_bytes / _MIB, 100 * _OOM_MARGIN)
            margin += _OOM_MARGIN
        else:
            assert measured is not None
            tried.append((new.predicted_peak_bytes, measured))
            margin = _next_margin(margin, budget_bytes, tried)
            logger.info("zoomem: the plan measured %.1f MiB against a budget of %.1f MiB (predicted %.1f); planning "
                        "again for %.1f MiB", measured / _MIB, budget_bytes / _MIB, new.predicted_peak_bytes / _MIB,
                        budget_bytes / (1 + margin) / _MIB)
        planning = new.extras.get("_planning")
        following: Plan | None = None
        if round_ < _VERIFY_ROUNDS - 1:
            try:  # a budget plain PyTorch's measured peak fits gets plain PyTorch's plan rather than lower aims
                following = make_plan(costs, budget_bytes, strategy=strategy, time_limit=time_limit, margin=margin,
                                      compress=compress, faster_forms=budget_bytes < new.baseline_peak_bytes)
            except InfeasibleBudgetError:  # nothing predicted that low
                pass
        if following is None:
            following = last_resort()
        if following is None:  # the measured overshoot is the answer
            break
        new = following
        new.traced_at = traced_at
        if compress is not None:
            new.extras["_planning"] = planning
    if tried:
        measured = min(m for _, m in tried)
    if measured is None:
        return lossless_instead(InfeasibleBudgetError(
            f"Every plan zoomem found for {budget_bytes / _MIB:.1f} MiB ran out of device memory (the budget is "
            "more than the device holds beside what else runs there, or zoomem's model of this step is off); "
            "lower the budget below the device's free memory, or lower the batch size.", int(budget_bytes)))
    return lossless_instead(InfeasibleBudgetError(
        f"The plans zoomem found for {budget_bytes / _MIB:.1f} MiB ({budget_bytes} bytes) measured "
        f"{measured / _MIB:.1f} MiB ({measured} bytes) at best (its model of this step is off by more than its "
        f"margin); raise the budget to about that or lower the batch size.",
        int(measured or budget_bytes),
    ))


def _least_peak_plan(costs: CostModel, strategy: str, time_limit: float,
                     compress: CompressOptions | None) -> Plan:
    """The plan with the lowest predicted peak (the fastest of those). Its peak is that plan's own: the plans of a
    budget, however small, are the fastest within it, so they err from their predictions by other amounts."""
    least, _ = min_feasible_budget(costs, time_limit, compress)
    # + 64 bytes: the budgeted program finds it feasible too, after rounding and tolerances (see make_plan)
    return make_plan(costs, least + 64, strategy=strategy, time_limit=time_limit, margin=0.0, compress=compress)


_OOM_MARGIN = 0.05
"""How much lower a plan aims after one ran out of device memory while verified (no peak to correct by)."""


def _set_compact(plan: Plan, units: frozenset[str]) -> None:
    """Levels run the exact compact forms of every unit (the probe enumerated its tensors with them on), and those
    outside the units."""
    for u in plan.units:
        u.compact = u.name in units and u.decision == Decision.KEEP
    plan.outside_compact = OUTSIDE_UNITS in units


def _level_plan(costs: CostModel, infos: list[SavedInfo], level: Level, chosen_units: frozenset[str],
                time_limit: float) -> Plan:
    """A level's plan: every unit kept, compact forms on (above L0), bits from the level."""
    plan = make_plan(costs, None, strategy="none")
    bits = allocate_bits(infos, level, time_limit)
    _set_compact(plan, chosen_units)
    keep = {u: Decision.KEEP for u in costs.units}
    plan.bits, plan.offload, plan.level = bits, level.offload, level.name
    plan.strategy = f"level {level.name}"
    plan.predicted_peak_bytes = costs.peak(keep, chosen_units, bits)
    plan.optimizer_bytes = costs.optimizer_step(chosen_units)
    plan.variance = costs.relative_variance(bits)
    plan.compress_s = costs.compress_time(bits)
    plan.recompute_s = costs.recompute_time(keep, chosen_units)
    plan.saved = [s.to_dict() for s in infos]
    return plan


_SCALE_RANGE = (0.5, 3.0)
_SCALE_MIN_SHARE = 0.05


def _compression_scale(handle: "_Handle", costs: CostModel, infos: list[SavedInfo], chosen_units: frozenset[str],
                      batch: Batch, adapter: Adapter, loss_fn: Callable[[Any, Batch], torch.Tensor] | None,
                      units: list[Unit], time_limit: float) -> float | None:
    """What storing tensors lossily costs in this model's step over what the quantizer's probes price it at.

    The probes time one tensor alone. In a step the same tensors cost more or less (ViT-Tiny at batch 8 here: 20%
    more, beside its ops' working sets), the store's own work comes with them, and the step's timeline, whose sum
    is every overhead's denominator, runs under the meter. So: three steps under the plan that stores every
    eligible tensor in 4 bits, and three under the same plan storing nothing lossily, measured as the timeline is,
    in turns; the difference of the fastest of each, over the price of those tensors, clamped to ``[0.5, 3]``.
    ``None`` (the probes' prices stand) where the price is under 5% of the step (the difference would be noise), a
    profiler or meter is running, or a step runs out of memory (the batch fits the device only as planned).
    Measured once per input signature of a wrapped model, and not for inputs no larger than a measured one's
    (:meth:`_Handle.compress_scale`): measured for each plan, it put ResNet-50's levels (b4) at 1.33-1.76x
    predicted in one run, all measured at 1.44-1.48x (BENCHMARKS.md)."""
    lossy = _level_plan(costs, infos, get_level("L1"), chosen_units, time_limit)
    if not lossy.bits or lossy.compress_s < _SCALE_MIN_SHARE * costs.step_s:
        return None
    exact = replace(lossy, bits={})
    fastest: dict[int, float] = {}
    for _ in range(3):
        for i, candidate in enumerate((exact, lossy)):
            try:
                timeline = _measured_timeline(handle, candidate, batch, adapter, loss_fn, units)
            except Exception as exc:  # noqa: BLE001 - out of memory: the probes' prices stand
                if not is_out_of_memory(exc):
                    raise
                _release_memory()
                logger.info("zoomem: no memory to time lossy storage in the step; its prices are the probes'")
                return None
            if not timeline:
                return None
            fastest[i] = min(fastest.get(i, float("inf")), sum(t.time_s for t in timeline))
    lo, hi = _SCALE_RANGE
    scale = min(hi, max(lo, (fastest[1] - fastest[0]) / lossy.compress_s))
    logger.info("zoomem: storing tensors lossily measured %.3f s a step against %.3f s priced: prices x %.2f",
                fastest[1] - fastest[0], lossy.compress_s, scale)
    return scale


def _probe(handle: "_Handle | None", batch: Batch, adapter: Adapter,
           loss_fn: Callable[[Any, Batch], torch.Tensor] | None, units: list[Unit], chosen_units: frozenset[str],
           model: nn.Module | None = None, chosen: dict[str, list] | None = None,  # type: ignore[type-arg]
           peaks: list[tuple[int, int]] | None = None,
           output_grads: Sequence[torch.Tensor | None] | None = None,
           second_order: bool = True) -> tuple[list[SavedInfo], float]:
    """Enumerate the saved tensors (compact forms on, nothing recomputed) and measure their sensitivities (against
    ``output_grads`` where the loss is not seen; value ranges without ``second_order``: :func:`probe_saved`); with
    ``peaks``, add ``(samples, peak bytes above its start)`` to it where nothing else is metering."""
    model = handle.model if handle is not None else model
    assert model is not None
    loss = _loss(adapter, model, loss_fn)
    generator = handle.generator(handle.device()) if handle is not None else None

    def run() -> tuple[list[SavedInfo], float]:
        if handle is not None:
            previous, handle.active = handle.active, _Active({u.name: Decision.KEEP for u in units}, chosen_units)
            previous_busy, handle.busy = handle.busy, True
            try:
                return probe_saved(model, batch, loss, units, generator=generator, output_grads=output_grads,
                                   second_order=second_order)
            finally:
                handle.active, handle.busy = previous, previous_busy
        undo = install_all(chosen or {})
        try:
            return probe_saved(model, batch, loss, units, generator=generator, output_grads=output_grads,
                               second_order=second_order)
        finally:
            undo()

    n = batch.batch_size()
    if peaks is None or n is None or meter_busy():
        return run()
    device = _model_device(model)
    with MemoryMeter(device=device) as meter:
        out = run()
    peaks.append((n, meter.report.peak_delta_bytes))
    return out


def _probe_at(handle: "_Handle | None", batch: Batch, adapter: Adapter,
              loss_fn: Callable[[Any, Batch], torch.Tensor] | None, units: list[Unit], chosen_units: frozenset[str],
              scale: Scale | None, model: nn.Module | None = None,
              chosen: dict[str, list] | None = None,  # type: ignore[type-arg]
              peaks: list[tuple[int, int]] | None = None,
              output_grads: Sequence[torch.Tensor | None] | None = None,
              second_order: bool = True) -> tuple[list[SavedInfo], float]:
    """:func:`_probe` on ``batch``, or on its two sub-batches of ``scale`` and extrapolated to the batch."""
    if scale is None:
        return _probe(handle, batch, adapter, loss_fn, units, chosen_units, model, chosen, peaks, output_grads,
                      second_order)
    small, _ = _probe(handle, adapter.sub_batch(batch, scale.small), adapter, loss_fn, units, chosen_units, model,
                      chosen, peaks, output_grads, second_order)
    large, grad_sq = _probe(handle, adapter.sub_batch(batch, scale.large), adapter, loss_fn, units, chosen_units,
                            model, chosen, peaks, output_grads, second_order)
    return scale_saved(small, large, grad_sq, scale)


def _refresh_scale(batch: Batch, adapter: Adapter, scale: Scale | None, peaks: list[tuple[int, int]],
                   budget: int | None, baseline: int, fixed: int, probe: Callable[[int], object]) -> Scale | None:
    """The sizes refreshes measure sensitivities at, so that they peak within the ``budget`` (else ``baseline``,
    plain PyTorch's predicted step): ``scale`` (what planning ran), or smaller sub-batches where the measurement's
    ``peaks`` (:func:`_probe`'s, averaged over ranks so all choose alike) say it would peak above that on top of
    the ``fixed`` bytes (parameters, optimizer state, batch). With one size measured, ``probe(samples)`` measures
    half of it: the second point of the line through which its peak grows with the batch; a size chosen below those
    measured is measured too, and a smaller one chosen while it peaks above (:func:`sizes_within`).

    Why: the measurement holds every activation and the second-order backward's own (2.8x plain PyTorch's step on
    ViT-Tiny's small layout at 32 images); at the steps it refreshes in (1, 4, 16, ...) it ran at the batch whatever
    the plan's budget.
    """
    n = batch.batch_size()
    if n is None or not peaks or not _can_cut(adapter, batch):
        return scale
    limit, limit_name = (budget, "the budget") if budget is not None else (baseline, "plain PyTorch's step")
    mean = all_reduce_mean({f"{i}:{s}": float(p) for i, (s, p) in enumerate(peaks)})
    peaks[:] = [(s, int(mean[f"{i}:{s}"])) for i, (s, _) in enumerate(peaks)]  # probe() adds to this list
    largest = max(peaks)
    if fixed + largest[1] <= limit:
        return scale

    def measured(samples: int) -> bool:
        """``probe(samples)``, its peak averaged over ranks; False where it failed (logged)."""
        try:
            probe(samples)
        except Exception as exc:  # noqa: BLE001 - a model that takes no sub-batch, or out of memory: keep the sizes
            _release_memory()
            _log_rank0("zoomem: measuring sensitivities at %d samples peaks above %s, and on %d samples failed (%s): "
                       "refreshes measure at %d", largest[0], limit_name, samples, exc_text(exc), largest[0])
            return False
        mean = all_reduce_mean({"peak": float(peaks[-1][1])})
        peaks[-1] = (peaks[-1][0], int(mean["peak"]))
        return True

    if len({s for s, _ in peaks}) < 2 and (largest[0] // 2 < 2 or not measured(largest[0] // 2)):
        return scale
    sizes, peak = sizes_within(n, peaks, limit - fixed, cap=scale)
    # a size chosen below every one measured is measured: the line through larger ones can predict too little there
    # (sizes_within); then a smaller one is chosen from that point, down to 3 samples
    while sizes not in (None, scale) and fixed + peak <= limit and sizes.large < min(s for s, _ in peaks):
        if not measured(sizes.large):
            return scale
        sizes, peak = sizes_within(n, peaks, limit - fixed, cap=scale)
    above = "measuring sensitivities at %d samples peaks at %.1f MiB, above %s (%.1f MiB)"
    values = (largest[0], (fixed + largest[1]) / _MIB, limit_name, limit / _MIB)
    if fixed + peak > limit:  # where a budget is broken, a warning
        _log_rank0("zoomem: " + above + ", and on 3 samples it would still be above: refreshes measure at %d "
                   "samples", *values, largest[0], level=logging.WARNING if budget is not None else logging.INFO)
    elif sizes != scale:
        _log_rank0("zoomem: " + above + "; refreshes measure them on %d and %d samples (%.1f MiB) and scale them "
                   "to the batch of %d", *values, sizes.small, sizes.large, (fixed + peak) / _MIB, n)
    return sizes


def _scaled_cost_model(
    model: nn.Module, batch: Batch, adapter: Adapter, optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None, scale: Scale, lossy: bool = False,
    grads_held: bool = False,
) -> tuple[CostModel, dict[str, list], OpGraph]:  # type: ignore[type-arg]
    """:func:`cost_model` at ``scale.target`` samples from traces of the batch's first ``scale.small`` and
    ``scale.large`` samples (:func:`zoomem.planner.scale.scale_costs`); the graph is the larger trace's."""
    small, _, _ = cost_model(model, adapter.sub_batch(batch, scale.small), adapter, optimizer, loss_fn, lossy=lossy,
                             grads_held=grads_held)
    large, chosen, graph = cost_model(model, adapter.sub_batch(batch, scale.large), adapter, optimizer, loss_fn,
                                      lossy=lossy, grads_held=grads_held)
    return scale_costs(small, large, scale), chosen, graph


def _first_scale(batch: Batch, trace_batch_size: int | None) -> Scale | None:
    """The sizes to trace at when the user caps them (``None``: trace the batch itself)."""
    n = batch.batch_size()
    if trace_batch_size is None or n is None or n <= trace_batch_size:
        return None
    return trace_sizes(n, trace_batch_size)


_T = TypeVar("_T")


def _fitting(batch: Batch, adapter: Adapter, scale: Scale | None, what: str,
             run: Callable[[Scale | None], _T]) -> tuple[_T, Scale | None]:
    """``run(scale)``; where it runs out of memory (a plain step of a batch too large for the device: what
    zoomem is for), ``run`` again on sub-batches half as large, down to 3 samples, with a warning each time."""
    while True:
        try:
            return run(scale), scale
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            n = batch.batch_size()
            failed_at = scale.large if scale is not None else n or 0
            if n is None or failed_at // 2 < 3 or not _can_cut(adapter, batch):
                raise
        _release_memory()  # outside the except block: its traceback no longer holds the failed step's tensors
        scale = trace_sizes(n, failed_at // 2)
        _log_rank0("zoomem: %s at a batch of %d ran out of memory; planning from batches of %d and %d samples, "
                   "extrapolated to %d", what, failed_at, scale.small, scale.large, n, level=logging.WARNING)


def _can_cut(adapter: Adapter, batch: Batch) -> bool:
    try:
        adapter.sub_batch(batch, 2)
    except ValueError:
        return False
    return True


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_VERIFY_ROUNDS = 5


def _next_margin(margin: float, budget: int, tried: list[tuple[int, int]]) -> float:
    """The margin for the next verification round, from the (predicted, measured) peaks of the plans that
    overshot.

    After one: aim lower by the overshoot (plus 0.2%). After two: a secant step through the last two, since a
    prediction that is low by a few percent is often low by more at lower targets (on BERT-large with compression
    three rounds of the first rule measured 1032.8, 1030.8 and 1029.5 MiB for targets 1013.9, 1003.3 and 995.0
    MiB); its slope is taken as at least 1/4, so one step goes at most four overshoots lower.
    """
    predicted, measured = tried[-1]
    aim = budget * (1 - 0.002)
    if len(tried) >= 2 and tried[-2][0] != predicted:
        slope = (tried[-2][1] - measured) / (tried[-2][0] - predicted)
        target = predicted - (measured - aim) / max(slope, 0.25)
    else:
        target = min(predicted, budget / (1 + margin)) - (measured - aim)
    return max(margin, budget / max(target, 1.0) - 1)


def _shared_part(model: nn.Module, batch: Batch, loss: Callable[[Any, Batch], torch.Tensor], units: list[Unit],
                 chosen: dict[str, list], compact: list[SegmentStat]) -> tuple[list[str], int]:  # type: ignore[type-arg]
    """The units whose compact forms share what they save (``Impl.shares_saved``), from the one that holds the
    shared part in ``compact`` (the step with every form on) on, and that part's bytes: what the next one's forward
    leaves more with the forms before it off. The first may hold none of it (GraphSAGE's first layer, on inputs that
    need no gradient, saves no adjacency): up to two are tried. ``([], 0)`` where nothing is shared."""
    seg_of = {u.name: i + 1 for i, u in enumerate(units)}
    shared = [u.name for u in units if any(i.shares_saved for _, i in chosen.get(u.name, []))]

    def left(timeline: list[SegmentStat], seg: int) -> int | None:
        f = next((t for t in timeline if t.seg == seg and t.phase == "forward"), None)
        return None if f is None else f.end_bytes - f.start_bytes

    for k in range(min(2, len(shared) - 1)):
        undo = install_all({u: pairs for u, pairs in chosen.items() if u not in shared[:k + 1]})
        try:
            timeline = measure_timeline(model, batch, loss, units)
        finally:
            undo()
        seg = seg_of[shared[k + 1]]
        with_all, without = left(compact, seg), left(timeline, seg)
        if with_all is not None and without is not None and without > with_all:
            return shared[k:], without - with_all
    return [], 0


def _measured_timeline(handle: "_Handle", candidate: Plan, batch: Batch, adapter: Adapter,
                       loss_fn: Callable[[Any, Batch], torch.Tensor] | None, units: list[Unit],
                       grads: bool = False) -> list:  # type: ignore[type-arg]
    """The memory timeline of one real step under ``candidate`` (``grads``: started with zero gradients present,
    which the timeline's bytes do not count)."""
    previous, handle.active = handle.active, handle.active_for(candidate)
    try:
        store = handle.active.store
        with handle.active.hooks(handle.model, batch):  # this forward's store state; the timeline calls into it
            return measure_timeline(handle.model, batch, _loss(adapter, handle.model, loss_fn), units,
                                    saved_hooks=(store._pack, store._unpack) if store is not None else None,
                                    grads=grads)
    finally:
        handle.active = previous


def _measured_peak(handle: "_Handle", candidate: Plan, batch: Batch, adapter: Adapter,
                   loss_fn: Callable[[Any, Batch], torch.Tensor] | None, units: list[Unit],
                   costs: CostModel) -> int | None:
    """The peak of one real step under ``candidate`` (fixed bytes included): its forward and backward as measured
    (started with the gradients present where ``costs`` was made so), the optimizer's step as ``costs`` predicts
    it under ``candidate``'s forms (planning cannot step the real one)."""
    timeline = _measured_timeline(handle, candidate, batch, adapter, loss_fn, units,
                                  grads=costs.grads_held or costs.grads_in_buckets)
    if not timeline:
        return None
    held = _grad_bytes(handle.model) if costs.grads_held and not costs.grads_in_buckets else 0
    if costs.others:  # the step's other forwards hold what this one leaves (CostModel.others)
        held += costs.others * max(costs.others_floor,
                                   next((t.start_bytes for t in timeline if t.phase != "forward"), 0))
    return costs.fixed_bytes + max(held + max(t.peak_bytes for t in timeline),
                                   costs.optimizer_step(_compact_of(candidate)))


def plan_points(model: nn.Module, candidate: Plan, costs: CostModel, batch: Batch) -> list[tuple[Any, float, int | None]]:
    """Every memory point of ``costs`` (what ``candidate``, a plan for the wrapped ``model``, was made from) with
    the bytes the cost model predicts there under ``candidate`` and the bytes one real step under it measures;
    bytes above the step's start. Where a cost model is off: ``scripts/point_errors.py``.

    A recomputed unit's backward stretch starts before its first unpacking runs the recomputation, so its
    ``recompute`` point measures that start and its backward point the recomputation too: the backward point's
    prediction is the larger of the two. Some points have no stretch of their own in the step (measured ``None``):
    a recomputed unit's ``after`` point, measured with its backward (the code's unpacking and the unit's run as one
    stretch); and the backward of a unit that drops its input (``RECOMPUTE_CHAIN``), which unpacks nothing the
    step's hooks see, so it runs inside the stretch before it (the code after it, else the next unit's backward or
    the head's). Such a point's prediction is folded into that stretch's, as the larger of the two, so every
    measured figure is compared with what was predicted for it."""
    handle: _Handle = model.__dict__[_ATTR]
    active = _Active.of(candidate)
    predicted = [float(v) for v in costs.point_bytes(active.decisions, active.compact, candidate.bits)]
    with handle.planning_scope():
        timeline = _measured_timeline(handle, candidate, batch, handle.adapter, handle.loss_fn, handle.units)
    measured = {(p.phase, p.seg): p.measured for p in _points(timeline, len(costs.units) + 1)}
    got = [measured.get((p.phase, p.seg)) for p in costs.points]
    index = {(p.phase, p.seg): i for i, p in enumerate(costs.points)}
    recomputed = {seg for seg, u in enumerate(costs.units, 1)
                  if active.decisions.get(u, Decision.KEEP) != Decision.KEEP}
    for (phase, seg), i in index.items():
        j = index.get(("backward", seg))
        if j is not None and ((phase == "after" and got[i] is None) or (phase == "recompute" and seg in recomputed)):
            predicted[j] = max(predicted[j], predicted[i])
    backward = sorted((p.seg, i) for i, p in enumerate(costs.points) if p.phase == "backward")
    for k, (_, i) in enumerate(backward):
        if got[i] is None:  # into the nearest measured stretch that ran before it: the next higher segment's
            j = next((j for _, j in backward[k + 1:] if got[j] is not None), None)
            if j is not None:
                predicted[j] = max(predicted[j], predicted[i])
    return list(zip(costs.points, predicted, got))


def _check_compression(budget: Any, compress: str | CompressOptions | None, level: str | Level | None,
                       strategy: str) -> tuple[CompressOptions | None, Level | None]:
    if compress is not None and not isinstance(compress, CompressOptions) and compress != "auto":
        raise ValueError(f"Could not resolve compress={compress!r} among choices [None, 'auto', CompressOptions(...)].")
    options = CompressOptions() if compress == "auto" else compress  # type: ignore[assignment]
    if level is not None:
        if budget is not None or options is not None:
            raise ValueError(
                f"level={level!r} is for training without a budget; with a budget pass compress='auto' instead and "
                "zoomem picks bits and recomputation together."
            )
        return None, get_level(level)
    if options is not None and budget is None:
        return None, get_level("L2")  # compression without a budget: the adaptive 4-bit level
    if options is not None and strategy != "ilp":
        raise ValueError(f"compress= is planned by the ILP; strategy={strategy!r} cannot plan it (use 'ilp').")
    return options, None


def _check_trace_batch_size(n: int | None) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 3):
        raise ValueError(f"trace_batch_size must be an int >= 3 (zoomem traces it and about half of it, each at "
                         f"least 2 samples) or None, got {n!r}.")


def _check_forwards(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"forwards_per_step must be a whole number of training forwards >= 1, got {n!r}.")


def _check_strategy(strategy: str) -> None:
    if strategy != "ilp" and strategy not in STRATEGIES:
        raise ValueError(f"Could not resolve strategy {strategy!r} among choices {['ilp', *STRATEGIES]}.")


def _loss(adapter: Adapter, model: nn.Module, loss_fn: Callable[[Any, Batch], torch.Tensor] | None):  # type: ignore[no-untyped-def]
    return loss_fn or (lambda out, b: adapter.loss(model, b, out))


def plan(
    model: nn.Module,
    batch: Any = None,
    budget: int | float | str | None = None,
    *,
    strategy: str = "ilp",
    adapter: Adapter | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    time_limit: float = 10.0,
    compress: str | CompressOptions | None = None,
    level: str | None = None,
    trace_batch_size: int | None = None,
    skip_logits: bool | None = None,
    forwards_per_step: int = 1,
    batch_size: int = 2,
    **sizes: int,
) -> Plan:
    """Plan ``model``'s training step on ``batch`` under ``budget`` without installing anything.

    Args:
        model: any model (wrapped or not).
        batch: the step's inputs; ``None`` builds the adapter's example batch (``batch_size``, ``sizes``).
        budget: bytes (int), a string (``"6GiB"``, ``"60%"``) or a fraction (float) of plain PyTorch's peak;
            the whole training step's peak, parameters, gradients, batch and optimizer state included.
        strategy: ``ilp`` (default), or a baseline: ``none``, ``all``, ``sqrt``, ``greedy``.
        optimizer: its state (or Adam's 2x parameters before its first step) and its step (gradients, held
            output, what ``step()`` allocates: :func:`zoomem.optimizer.footprint`) count in the budget.
        loss_fn: ``(output, batch) -> scalar``; by default the adapter's planning loss.
        time_limit: seconds for solving a plan (warm start, program and LP bound together; the program gets
            at least 1 s). Tracing the step is not counted.
        compress: ``"auto"`` (or :class:`CompressOptions`): with a budget, let the ILP also store saved tensors
            in 8/4/2/1 bits, chosen with recomputation by their measured effect on the gradient.
        level: a GACT-style level instead of a budget: ``L0``, ``L1`` (4 bits), ``L1.1`` (8), ``L1.2`` (2),
            ``L2``/``L2.1``/``L2.2`` (adaptive, 4/3/2 bits on average), ``L3`` (``L2`` + offload to host).
        trace_batch_size: trace at most this many samples (and about half as many) and extrapolate the costs
            to the batch; see :func:`wrap`.
        skip_logits: plan the step as :func:`wrap` with ``skip_logits`` runs it; ``None``: as ``model`` is wrapped
            (``False`` for a model that is not).
        forwards_per_step: training forwards of the model a step runs before its backward, each on a batch like
            ``batch``; see :func:`wrap`.

    Returns:
        The :class:`Plan` (``plan.summary()``, ``plan.to_json()``).

    Raises:
        InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.

    >>> import timm, zoomem
    >>> p = zoomem.plan(timm.create_model("resnet18"), budget=0.6, batch_size=8, image_size=64)  # doctest: +SKIP
    >>> print(p.summary())  # doctest: +SKIP
    """
    _check_strategy(strategy)
    _check_trace_batch_size(trace_batch_size)
    _check_forwards(forwards_per_step)
    options, lvl = _check_compression(budget, compress, level, strategy)
    if isinstance(adapter, str) or adapter is None:
        adapter = get_adapter(model, adapter)
    batch = adapter.example_batch(model, batch_size, **sizes) if batch is None else Batch.of(batch, model).detached()
    handle: _Handle | None = model.__dict__.get(_ATTR)
    native = _native_checkpointing_off(model, adapter, "zoomem.plan", "it is on again when the plan returns")
    try:
        with handle.planning_scope() if handle is not None else planning_passes(model), \
                _skipping_logits(model, skip_logits):
            new = _seeing_the_loss(lambda: _make(model, batch, budget, strategy, adapter, optimizer, loss_fn,
                                                 time_limit, compress=options, level=lvl,
                                                 trace_batch_size=trace_batch_size, others=forwards_per_step - 1))
    finally:
        if handle is None:
            unsplit(model)  # a shared layer split for planning (a wrapped model keeps its split until unwrapped)
        if native is not None:
            native()
    new.extras.pop("_planning", None)
    return new


def _seeing_the_loss(make: Callable[[], Plan]) -> Plan:
    """``make()``, with a warning where its trace took the mean of large outputs as the loss
    (:func:`~zoomem.adapters.base.mean_loss_warning`)."""
    token = MEAN_LOSS_BYTES.set(0)
    try:
        new = make()
        message = mean_loss_warning(MEAN_LOSS_BYTES.get(), new.baseline_peak_bytes) if MEAN_LOSS_BYTES.get() else None
    finally:
        MEAN_LOSS_BYTES.reset(token)
    if message is not None:
        warnings.warn(message, stacklevel=3)
    return new


def _native_checkpointing_off(model: nn.Module, adapter: Adapter, who: str, after: str) -> Callable[[], None] | None:
    """Turn off the zoo's own full checkpointing where the user turned it on (``gradient_checkpointing_enable()``,
    ``set_grad_checkpointing()``), with a warning; return what turns it back on as it was (``None`` where it was off).
    Beneath a plan it would recompute every layer again: the trace measured a checkpointed step as plain
    PyTorch's, so a fraction budget meant a fraction of that, and the smallest budget was that step's peak."""
    restore = adapter.suspend_native_checkpointing(model)
    if restore is None:
        return None
    warnings.warn(
        f"{who} turned off {type(model).__name__}'s own gradient checkpointing, which recomputes every layer: "
        f"zoomem's plan decides what to recompute under the budget ({after}). Drop the "
        "gradient_checkpointing_enable() / set_grad_checkpointing() call to silence this warning.",
        stacklevel=3,
    )
    return restore


@contextlib.contextmanager
def _skipping_logits(model: nn.Module, skip: bool | None) -> Iterator[None]:
    """Inside, ``model``'s fused LM-head loss drops the logits as ``skip`` says (``None``: as it is set)."""
    was = skips_logits(model)
    set_skip_logits(model, was if skip is None else skip)
    try:
        yield
    finally:
        set_skip_logits(model, was)


def wrap(
    model: nn.Module,
    budget: int | float | str | None = None,
    *,
    strategy: str = "ilp",
    adapter: Adapter | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    time_limit: float = 10.0,
    batch: Any = None,
    compress: str | CompressOptions | None = None,
    level: str | None = None,
    sensitivity_interval: int = 200,
    trace_batch_size: int | None = None,
    skip_logits: bool = False,
    reuse_plans: bool = True,
    forwards_per_step: int = 1,
) -> nn.Module:
    """Train ``model`` within ``budget`` bytes with gradients identical to plain PyTorch's (in place, undoable).

    Args:
        model: a timm, HF transformers, PyG or any ``nn.Module``.
        budget: bytes (int), a string (``"6GiB"``, ``"60%"``) or a fraction (float) of plain PyTorch's peak,
            for the whole training step's peak (under DDP its gradient buckets included: the DDP whose forward
            calls the model when it plans). ``None`` keeps everything (plain PyTorch).
        strategy: ``ilp`` (default) or a baseline (``none``, ``all``, ``sqrt``, ``greedy``).
        adapter: the zoo adapter (or its name) instead of the matching one.
        optimizer: counts its state and its step in the budget.
        loss_fn: ``(output, batch) -> scalar`` used when tracing; by default the adapter's planning loss.
        time_limit: seconds for solving a plan (warm start, program and LP bound together; the program gets
            at least 1 s). Tracing the step is not counted.
        batch: plan now on this example batch instead of lazily on the first training forward.
        compress: ``"auto"`` (or :class:`CompressOptions`): with a budget, the ILP also stores saved tensors in
            8/4/2/1 bits (unbiased stochastic rounding), picked jointly with recomputation by their measured
            effect on the gradient. Gradients are then unbiased, not exact. Without a budget it means ``L2``.
        level: GACT-style compression without a budget: ``L0`` (none), ``L1``/``L1.1``/``L1.2`` (4/8/2 bits),
            ``L2``/``L2.1``/``L2.2`` (adaptive, 4/3/2 bits on average), ``L3`` (``L2`` + offload to host).
        sensitivity_interval: adaptive plans measure sensitivities again every this many training steps, and
            at steps 1, 4, 16 and 64 (0: never after planning); each time costs about three passes, logged.
        trace_batch_size: plan batches larger than this from traces of its first ``trace_batch_size`` samples
            and about half as many, every byte and time extrapolated to the real batch (the plan is then measured
            at the real batch before use). ``None`` traces the batch itself, and falls back to halves of it when
            that runs out of memory: planning traces a plain step, which at the batches zoomem is for does not
            fit the device. Not for PyG graphs (their nodes are not independent samples).
        skip_logits: HF LMs trained with ``labels``: where the plan runs the fused LM-head loss (the
            ``cross_entropy_logits`` form, which a plan below 100% of PyTorch's peak and every level but ``L0``
            switch on), the training forward returns ``logits=None``, as Liger-Kernel's fused loss does: the
            ``batch x sequence x vocabulary`` logits are freed after the loss (GPT-2 at 2 x 256 tokens: 98 MiB) and
            the loss's backward makes each slice of them again from the head's input (one more head-sized
            product). Eval, ``no_grad`` and forwards without labels return them as usual.
        reuse_plans: a training step whose inputs are no larger than a planned one's (the same inputs and dtypes,
            no dimension larger: dynamic padding's shorter batches, a last smaller batch) runs that plan instead
            of planning its own, unmeasured at its own shape; a lossy plan with the bits measured at its shape,
            its row-following groups kept where they still divide the rows, and a signature whose forward saves
            other tensors than that plan's plans on its own at its next step. ``False``: every new signature
            plans.
        forwards_per_step: training forwards of the model a step runs before its backward (2 for a contrastive
            step's two views or a GAN discriminator's real and fake batches): each holds its saved tensors until
            then, and plans leave room for as many, each holding what its own forward leaves. zoomem counts them
            itself and plans again when a step runs more than it has seen (from that step's later forwards on);
            give the number where the first such step must keep to the budget too.

    Returns:
        ``model`` itself, so ``model = zoomem.wrap(model, budget="6GiB")`` reads naturally.

    Raises:
        InfeasibleBudgetError: (when planning) no plan fits; the message names the smallest feasible budget.

    >>> import timm, zoomem
    >>> model = zoomem.wrap(timm.create_model("resnet50"), budget="6GiB")  # doctest: +SKIP
    """
    _check_strategy(strategy)
    _check_trace_batch_size(trace_batch_size)
    _check_forwards(forwards_per_step)
    options, lvl = _check_compression(budget, compress, level, strategy)
    if sensitivity_interval < 0:
        raise ValueError(f"sensitivity_interval must be >= 0 steps, got {sensitivity_interval}.")
    if is_wrapped(model):
        warnings.warn(
            "This model is already wrapped by zoomem; re-wrapping it with the new settings. "
            "Call zoomem.unwrap(model) first to silence this warning.",
            stacklevel=2,
        )
        unwrap(model)
    if isinstance(adapter, str) or adapter is None:
        adapter = get_adapter(model, adapter)
    handle = _Handle(
        model=model, budget=budget, strategy=strategy, adapter=adapter, units=units_of(adapter, model),
        time_limit=time_limit, optimizer=optimizer, loss_fn=loss_fn, compress=options, level=lvl,
        sensitivity_interval=sensitivity_interval if (lvl is not None and lvl.adaptive) or options else 0,
        trace_batch_size=trace_batch_size, reuse_plans=reuse_plans, seed=torch.initial_seed() % (1 << 63),
        forwards=forwards_per_step,
    )
    model.__dict__[_ATTR] = handle
    native = _native_checkpointing_off(model, adapter, "zoomem.wrap", "zoomem.unwrap turns it back on")
    if native is not None:
        handle.undo.append(native)
    if skip_logits:
        set_skip_logits(model, True)
        handle.undo.append(lambda: set_skip_logits(model, False))
    original = model.forward

    def model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if handle.busy:  # planning: a candidate plan measured runs its own model-level forms
            try:
                return handle.in_force(original)(*args, **kwargs)
            finally:
                if handle.active is not None:
                    handle.active.forward_done()
        if not handle.enabled or not (model.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        return planned_entry(*args, **kwargs)  # traced by torch.compile, the planned step runs as it is, uncompiled

    native_switches = [(m, flag) for m in model.modules() for flag in handle.adapter.native_flags if hasattr(m, flag)]

    def planned(*args: Any, **kwargs: Any) -> Any:
        if any(getattr(m, flag, False) is True for m, flag in native_switches):  # the zoo's checkpointing, turned
            native = _native_checkpointing_off(  # on since wrap (HF Trainer's gradient_checkpointing=True does at
                model, handle.adapter, "zoomem's training step",  # train()): beneath a plan it fails in backward
                "zoomem.unwrap turns it back on")
            if native is not None:
                handle.undo.append(native)
        batch = Batch(tuple(args), dict(kwargs))
        cut = batch.detached()  # what planning, refreshes and variants run on (never the caller's graph)
        waiting = handle.in_flight.count()
        if waiting >= handle.forwards:  # more forwards before a backward than seen so far: plans leave room for them
            handle.forwards = waiting + 1
            _log_rank0("zoomem: %s ran %d training forwards before a backward (a contrastive step's views, a GAN "
                       "discriminator's real and fake batches): each holds its saved tensors until then, so its plans "
                       "from now on leave room for %d", type(model).__name__, handle.forwards, handle.forwards)
        plan = handle.plan_for(cut)
        if waiting and handle.forwards > 1 and plan.budget_bytes is not None:
            plan = handle.after_others(cut, plan)
        holding, handle.holding = handle.holding, None
        handle.active = handle.active_for(plan, smaller=handle.runs_smaller)
        handle.steps += 1
        try:
            with handle.active.hooks(model, batch):
                out = handle.in_force(original)(*args, **kwargs)
            handle.in_flight.track(out, plan.left_bytes, plan.forwards)
            handle.loss_in_output = output_loss(out) is not None
            if holding is not None and holding == handle.last_sig:  # a refresh waits for this step's output gradient
                handle.held = (holding, HeldOutputGrads.hold(handle.steps - 1, cut, out, plan.predicted_peak_bytes))
            return out
        finally:
            store, sig = handle.active.store, handle.last_sig
            if store is not None and store.diverged is not None and sig is not None:
                handle.left_its_saves(sig, cut)
            handle.active.forward_done()
            handle.active = None

    planned_entry = eager_under_compile(planned, handle.note_compiled)

    # a method of the model, looking like the original: wrappers that rebind `forward.__func__` (Accelerate's
    # mixed precision, and its unwrap_model) and readers of its signature (HF Trainer's column filter) work
    functools.update_wrapper(model_forward, original, updated=())
    del model_forward.__wrapped__  # type: ignore[attr-defined]
    try:
        params = list(inspect.signature(original).parameters.values())
        model_forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *params])
    except (TypeError, ValueError):
        pass
    handle.forward = MethodType(model_forward, model)
    handle.undo.append(set_forward(model, handle.forward))
    for unit in handle.units:
        handle.undo.append(set_forward(unit.module, _unit_forward(handle, unit)))
    if batch is not None:
        try:
            # a first micro-batch; later ones plan as they come
            handle.plan_for(Batch.of(batch, model).detached(), grads_held=False)
        except BaseException:
            unwrap(model)  # a failed wrap leaves the model as it was
            raise
    return model


def _unit_forward(handle: _Handle, unit: Unit) -> Callable[..., Any]:
    inner = [unit.module.forward]  # what runs (and is recomputed) inside; see :data:`UNIT_INNER`

    def forward(*args: Any, **kwargs: Any) -> Any:
        original = inner[0]
        active = handle.active
        if (active is None and handle.enabled and not handle.busy and unit.module.training
                and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1):  # (not a recomputation)
            handle.note_unplanned(unit)
        # a unit the model checkpoints itself runs as the model has it: that recomputation runs outside any plan
        planned = active is not None and not in_models_checkpoint()
        decision = active.decisions.get(unit.name, Decision.KEEP) if planned else Decision.KEEP  # type: ignore[union-attr]

        as_stored = False  # whether the compact forms run as stored in this forward (set once the store says)

        @contextlib.contextmanager
        def replay() -> Iterator[None]:  # recomputation in backward runs under the plan of its forward
            previous, handle.active = handle.active, active
            try:
                with separate_masks(as_stored):  # and saves what its forward saved
                    yield
            finally:
                handle.active = previous

        if planned and active.recomputes and torch.is_grad_enabled():  # type: ignore[union-attr]
            args, kwargs = handle.adapter.recompute_inputs(shared_module(unit.module), args, kwargs)  # no KV cache
            # written twice
        chain = active.chain if planned and torch.is_grad_enabled() else None  # type: ignore[union-attr]
        recipe = None
        if chain is not None and unit.name in active.feeds_chain:  # type: ignore[union-attr]
            @contextlib.contextmanager
            def restore() -> Iterator[None]:
                with replay(), restore_buffers(unit.module):
                    yield

            recipe = Recipe(original, *chain.args_for_recipe(args, kwargs), restore=restore, ran_on=(args, kwargs))
        with contextlib.ExitStack() as stack:
            if active is not None and active.store is not None:
                stack.enter_context(active.store.unit(unit.name, args, kwargs))
            as_stored = stores_lossily()
            if chain is not None and decision == Decision.RECOMPUTE_CHAIN:
                stack.enter_context(chain.dropping())
            out = run_unit(unit.module, original, decision, args, kwargs, replay, chain)
        if recipe is not None:
            chain.register(out, recipe)  # type: ignore[union-attr]
        return out

    setattr(forward, UNIT_INNER, inner)
    return eager_under_compile(forward, handle.note_compiled)  # a unit compiled in place (regional compilation)


def is_wrapped(model: nn.Module) -> bool:
    return _ATTR in model.__dict__


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: the original forwards come back; parameters and buffers were never touched."""
    handle: _Handle | None = model.__dict__.pop(_ATTR, None)
    if handle is None:
        warnings.warn("zoomem.unwrap: this model is not wrapped; nothing to undo.", stacklevel=2)
        return model
    handle.enabled = False  # a forward someone wrapped on top of zoomem's stays; it then passes straight through
    for undo in reversed(handle.undo):
        undo()
    return model


class disabled:
    """Context manager: run a wrapped model's original path (no plan, no recomputation) inside the block.

    >>> with zoomem.disabled(model):  # doctest: +SKIP
    ...     loss = model(x).sum()
    """

    def __init__(self, model: nn.Module) -> None:
        self.handle: _Handle | None = model.__dict__.get(_ATTR)
        self.was = True

    def __enter__(self) -> None:
        if self.handle is not None:
            self.was, self.handle.enabled = self.handle.enabled, False

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.enabled = self.was
