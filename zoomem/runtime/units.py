"""Run one unit as its plan says: as is, or under a non-reentrant checkpoint (full or cheap-ops-only).

Recomputation goes through ``torch.utils.checkpoint`` (``use_reentrant=False``, RNG state preserved so dropout
masks match). Three traps it leaves to us, all handled here:
- it keeps a unit's list and dict arguments by reference and calls the forward on them again in backward: a
  forward that fills its input list in place (timm's HRNet stages) or a caller that appends to it afterwards
  (timm's DenseNet blocks) would recompute from other tensors, silently: recomputation gets copies of the
  containers as they were when the unit was called (and a chained unit's dropped input inside one, as the
  checkpoint's own arguments, as a reference that brings it back);
- recomputing a unit that holds BatchNorm would update its running statistics a second time (timm's own
  checkpointing does): the recompute context restores the unit's buffers afterwards;
- ``RECOMPUTE_CHEAP`` keeps the outputs of matmul/conv/attention ops through selective checkpointing
  (``create_selective_checkpoint_contexts``) and recomputes the rest.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.checkpoint import _CachedTorchDispatchMode  # (the recompute mode: see _kept_for)

from ..adapters import Unit
from ..batch import Batch
from ..graph.timeline import meter_busy, restored_state
from ..measure import MemoryMeter
from ..ops import op_spec
from ..ops.checkpoints import own_checkpoint
from ..planner import EXPENSIVE_KINDS, Decision
from ..state import restore_buffers
from .calls import CallUnit, casts_cached, shared_module
from .chain import Chain, bring_back
from .compact import UNIT_INNER
from .patch import set_forward

__all__ = ["measure_recompute_backward", "measure_recompute_rises", "run_unit"]


def _cheap_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op_spec(op).kind in EXPENSIVE_KINDS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE

def _context_fn(
    module: nn.Module, decision: Decision, replay: Callable[[], Any] | None
) -> Callable[[], tuple[Any, Any]]:
    def make() -> tuple[Any, Any]:
        fwd, rec = (
            create_selective_checkpoint_contexts(_cheap_policy)
            if decision == Decision.RECOMPUTE_CHEAP
            else (contextlib.nullcontext(), contextlib.nullcontext())
        )

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            # the plan in force outside selective checkpointing's mode, whose recomputation admits no op it did not
            # see in forward (a meter's mark: measure_recompute_rises)
            with restore_buffers(module), (replay() if replay else contextlib.nullcontext()), _kept_for(rec):
                yield

        return fwd, _Reenterable(recompute)

    return make


def _kept_for(rec: Any) -> Any:
    """Selective checkpointing's recompute mode, or, in a backward that keeps the graph (``retain_graph=True``,
    ``create_graph=True``: a gradient penalty), the same mode over a copy of its cache: the mode marks each cached
    output used, so a second backward through the unit raised ("backward an extra time") where plain PyTorch
    runs it. The cache then lives as long as the graph, as every saved tensor of a kept graph does."""
    if not isinstance(rec, _CachedTorchDispatchMode) or not torch._C._autograd._get_current_graph_task_keep_graph():
        return rec
    copy = {key: dict(entries) for key, entries in rec.storage.items()}
    return type(rec)(None, copy, rec.allow_cache_entry_mutation)


class _Reenterable:
    """A context manager entered once per recomputation: a second backward through a retained graph recomputes
    the unit again, and a generator-based context manager cannot be entered twice."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.stack = make, []  # type: ignore[var-annotated]

    def __enter__(self) -> None:
        cm = self.make()
        cm.__enter__()
        self.stack.append(cm)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.pop().__exit__(*exc)


def _is_box(obj: Any) -> bool:
    return isinstance(obj, (list, tuple, dict))


def _as_called(forward: Callable[..., Any], args: tuple, kwargs: dict, chain: Chain | None = None
               ) -> tuple[Callable[..., Any], tuple, dict]:
    """``forward`` and the arguments to hand the checkpoint for it: second and later calls (recomputation) get the
    containers among the arguments as they were now, fresh each time; the first call gets the caller's own, as
    plain PyTorch would.

    The checkpoint saves top-level tensor arguments itself (through the saved-tensor hooks in force, which may
    drop them: chained units), so those come from its call and the snapshot does not hold them. It keeps every
    other argument by reference until backward, so it gets ``None`` in each container's place: given the
    caller's own list, it held every feature map timm's DenseNet block appends to it after the call (on
    DenseNet-121 at 64 px, 256 KiB a recomputed unit beyond the plan's prediction). ``chain``: the unit drops its
    input (``RECOMPUTE_CHAIN``); the snapshot holds a dropped one as a reference, as the checkpoint holds its own
    arguments (a DenseNet block's last layer takes the previous layer's output in its list: kept, the plan's
    3.2 MiB of it at batch 8 stayed held through the rest of the step)."""
    if not any(_is_box(a) for a in (*args, *kwargs.values())):
        return forward, args, kwargs
    hold = (lambda t: (chain.ref_of(t) or t) if isinstance(t, torch.Tensor) else t) if chain else (lambda t: t)
    snapshot = (tuple(tree_map(hold, a) if _is_box(a) else None for a in args),
                {key: tree_map(hold, v) for key, v in kwargs.items() if _is_box(v)})
    first = [(args, kwargs)]  # the caller's own containers, for the first call only

    def call(*a: Any, **k: Any) -> Any:
        if first:
            own_args, own_kwargs = first.pop()
            return forward(*own_args, **own_kwargs)
        fresh_args, fresh_kwargs = tree_map(bring_back, snapshot)
        a = tuple(fresh if _is_box(orig) else x for x, fresh, orig in zip(a, fresh_args, snapshot[0]))
        return forward(*a, **{**k, **fresh_kwargs})

    held_args = tuple(None if _is_box(a) else a for a in args)
    held_kwargs = {key: None if _is_box(v) else v for key, v in kwargs.items()}
    return call, held_args, held_kwargs


def run_unit(
    module: nn.Module,
    forward: Callable[..., Any],
    decision: Decision,
    args: tuple,
    kwargs: dict,
    replay: Callable[[], Any] | None = None,
    chain: Chain | None = None,
) -> Any:
    """Call ``forward(*args, **kwargs)`` of ``module`` under ``decision``.

    ``replay()`` returns a context manager entered around recomputation, so that the recomputed forward sees
    the same runtime state (the plan in force) as the original one did. ``chain``: the forward's registry of
    the outputs a ``RECOMPUTE_CHAIN`` unit drops (its saved-tensor hooks in force around this call).
    """
    if decision == Decision.KEEP or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    forward, args, kwargs = _as_called(forward, args, kwargs, chain if decision == Decision.RECOMPUTE_CHAIN else None)

    def own(*a: Any, **k: Any) -> Any:  # (a checkpoint of the model's own inside runs as the model has it)
        with own_checkpoint():
            return forward(*a, **k)

    if decision == Decision.RECOMPUTE_CHEAP and isinstance(module, CallUnit) and casts_cached():
        decision = Decision.RECOMPUTE  # (see casts_cached; planned under autocast, such plans have none)
    return checkpoint(
        own,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=_context_fn(module, decision, replay),
        # what RECOMPUTE_CHEAP keeps (matmul/conv outputs, cached by selective checkpointing) stays exact and
        # outside zoomem's saved-tensor store, as the planner counts it; explicit, because torch warns that its
        # default will flip to routing those tensors through the surrounding hooks
        respect_saved_tensors_hooks=False,
        **kwargs,
    )


def measure_recompute_rises(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor],
                            units: list[Unit], decisions: dict[str, Decision],
                            recompute_inputs: Callable[[nn.Module, tuple, dict], tuple[tuple, dict]] | None = None) -> dict[int, int]:
    """Per unit segment (1..n) with a decision in ``decisions``: the bytes its recomputation in backward rises
    above where it starts, in one training step that runs those units as :func:`run_unit` does.

    What the traced forward's rise cannot tell: ``RECOMPUTE_CHEAP`` takes its matmul/conv outputs from the
    forward's cache, so it allocates only the cheap ops' tensors (ResNet-50's first block at batch 16, 224 px: its
    four conv outputs, 122.5 MiB, less than the traced rise). The step's state is put back
    (:func:`~zoomem.graph.timeline.restored_state`); empty when a profiler or meter is running.
    ``recompute_inputs``: the adapter's, as the runtime applies them."""
    return {seg: rise for seg, (rise, _) in _measure_recomputations(
        model, batch, loss_fn, units, decisions, recompute_inputs).items()}


def measure_recompute_backward(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor],
                               units: list[Unit], decisions: dict[str, Decision],
                               recompute_inputs: Callable[[nn.Module, tuple, dict], tuple[tuple, dict]] | None = None) -> dict[int, int]:
    """Per unit segment with a decision in ``decisions``: the peak of its backward after its recomputation, above
    where the recomputation started, in one step run as :func:`measure_recompute_rises` runs it (the backward
    ends where its input's gradient is ready; units whose input needs none are left out).

    Measured with a unit's compact forms installed and without, it says what the forms take off a recomputed
    unit's backward, which depends on the model: a ReLU ending a ResNet-v1 block saves its recomputed output
    plainly and a 1-bit mask compactly (the output then goes at once); a form whose tensor the recomputation makes
    anyway takes nothing more off (GPT-2, Llama). Empty when a profiler or meter is running."""
    return {seg: peak for seg, (_, peak) in _measure_recomputations(
        model, batch, loss_fn, units, decisions, recompute_inputs).items() if peak is not None}


def _measure_recomputations(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor],
                            units: list[Unit], decisions: dict[str, Decision],
                            recompute_inputs: Callable[[nn.Module, tuple, dict], tuple[tuple, dict]] | None
                            ) -> dict[int, tuple[int, int | None]]:
    """Per unit segment with a decision: its recomputation's rise above its start, and the peak of the unit's
    backward after it above the same start (``None`` where its input needs no gradient), in one training step
    whose units in ``decisions`` run as :func:`run_unit` runs them, meter marks around each recomputation
    (``run_unit``'s ``replay`` context) and where the unit's input gradient is ready; the state is put back."""
    if meter_busy():
        return {}
    meter = MemoryMeter(model, batch)
    marks: list[tuple[str, int]] = []  # per phase of the meter: what it ends ("replay"/"backward" of a segment)

    def mark(kind: str, seg: int) -> None:
        meter.mark(f"{len(marks)}:{kind}:{seg}")
        marks.append((kind, seg))

    def measured(seg: int, module: nn.Module, inner: Callable[..., Any], decision: Decision) -> Callable[..., Any]:
        @contextlib.contextmanager
        def replay() -> Iterator[None]:  # entered around the recomputation alone
            mark("other", seg)
            try:
                yield
            finally:
                mark("replay", seg)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if recompute_inputs is not None and torch.is_grad_enabled():
                args, kwargs = recompute_inputs(shared_module(module), args, kwargs)
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if first is not None and torch.is_grad_enabled():  # its gradient ready: the unit's backward has run
                hooks.append(first.register_hook(lambda grad: mark("backward", seg)))
            return run_unit(module, inner, decision, args, kwargs, replay)

        return forward

    undos, hooks = [], []
    for seg, u in enumerate(units, 1):
        if u.name in decisions:
            inner = getattr(u.module.forward, UNIT_INNER, [u.module.forward])[0]  # beneath zoomem's own forward
            undos.append(set_forward(u.module, measured(seg, u.module, inner, decisions[u.name])))
    try:
        with restored_state(model, batch), torch.enable_grad(), meter:
            output = batch.call(model)
            loss_fn(output, batch).backward()
            del output
            mark("other", 0)
    finally:
        for hook in hooks:  # the step's inputs may outlive it (a leaf batch tensor)
            hook.remove()
        for undo in reversed(undos):
            undo()
    found: dict[int, tuple[int, int | None]] = {}
    start = replayed = meter.report.baseline_bytes
    for (kind, seg), stat in zip(marks, meter.report.phases.values()):
        if kind == "replay":
            replayed = start
            found[seg] = (max(found.get(seg, (0, None))[0], stat.peak_bytes - start), None)
        elif kind == "backward" and seg in found:
            found[seg] = (found[seg][0], stat.peak_bytes - replayed)
        start = stat.end_bytes
    return found
