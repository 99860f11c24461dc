"""Trace one real training step into an :class:`OpGraph`.

The step runs for real (forward, planning loss, backward) on the example batch, watched at three levels:
- a ``TorchDispatchMode`` records every aten op as executed (so Python control flow, HF attention dispatch
  and PyG message passing are seen as they ran), with its inputs, outputs, FLOPs and time;
- a ``TorchFunctionMode`` brackets each torch-level call, so that a tensor autograd saves (observed through
  ``saved_tensors_hooks``, which fire before the op for inputs and after it for outputs) is attributed to
  the op that saved it, not guessed;
- per-instance module hooks give every op its module path and unit.
Backward ops are attributed to the unit whose saved tensors autograd unpacked last.

Everything the step changes is put back: parameter gradients, buffers (BatchNorm running statistics),
train/eval mode and the RNG state.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from ..adapters import Adapter, Unit, get_adapter
from ..batch import Batch
from ..measure import is_out_of_memory
from ..ops import op_spec
from ..state import set_training, snapshot_buffers, uncompiled
from .model import OUTSIDE, OpGraph, OpNode, TensorInfo, UnitInfo, is_activation
from .timeline import SegmentStat, measure_timeline

__all__ = ["trace", "TraceError"]

logger = logging.getLogger(__name__)



class TraceError(RuntimeError):
    """The traced step failed; the message names the module and op where, and what to try."""


class _Saved:
    """What our pack hook hands autograd: the tensor plus the id of its pack record."""

    __slots__ = ("tensor", "pack", "__weakref__")

    def __init__(self, tensor: torch.Tensor, pack: int) -> None:
        self.tensor = tensor
        self.pack = pack


@dataclass
class _Pack:
    tensor: int
    last_op: int  # ops recorded before the pack
    span: tuple[int, int] | None  # (first op index of the enclosing torch call, its serial)
    ref: Any = None  # weakref to the _Saved handle: alive <=> still held by autograd
    op: int = -1


@dataclass
class _State:
    phase: str = "forward"
    module_stack: list[str] = field(default_factory=list)
    unit_of_module: dict[str, str] = field(default_factory=dict)
    ops: list[OpNode] = field(default_factory=list)
    tensors: dict[int, TensorInfo] = field(default_factory=dict)
    storages: dict[int, int] = field(default_factory=dict)
    packs: list[_Pack] = field(default_factory=list)
    span_ends: dict[int, int] = field(default_factory=dict)  # span serial -> op index after its last op
    backward_unit: str = OUTSIDE
    backward_module: str = ""
    failed_op: str | None = None
    sync_cuda: bool = False


class _Ids:
    """Stable ids for tensors and storages, held weakly so the tracer keeps nothing alive."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self._tensor_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._storage_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._storage_role: dict[int, str] = {}

    def storage(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        sid = self._storage_ids.get(s)
        if sid is None:
            sid = len(self.state.storages)
            self._storage_ids[s] = sid
            self.state.storages[sid] = s.nbytes()
        return sid

    def tensor(self, t: torch.Tensor, role: str = "activation", producer: int | None = None) -> int:
        tid = self._tensor_ids.get(t)
        if tid is not None:
            return tid
        tid = len(self.state.tensors)
        self._tensor_ids[t] = tid
        sid = self.storage(t)
        storage_role = self._storage_role.get(sid)
        if storage_role is not None:
            role = storage_role
        elif producer is None and role == "activation":
            role = "external"  # existed before the step and is none of params, buffers, batch
        self.state.tensors[tid] = TensorInfo(
            id=tid,
            shape=list(t.shape),
            dtype=str(t.dtype).replace("torch.", ""),
            nbytes=t.numel() * t.element_size(),
            storage=sid,
            role=role,
            producer=producer,
        )
        if role == "activation":
            self._storage_role.setdefault(sid, "activation")
        return tid

    def seed(self, tensors: list[torch.Tensor], role: str) -> None:
        for t in tensors:
            if t.device.type == "meta":
                continue
            self._storage_role.setdefault(self.storage(t), role)


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = func.overloadpacket
    fn = flop_registry.get(packet)
    try:
        if fn is not None:
            return int(fn(*args, **kwargs, out_val=out))
        name = packet.__name__
        if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            q, k = args[0], args[1]
            b, h, s, d = q.shape
            flops = 4 * b * h * s * k.shape[-2] * d
            return 2 * flops if name.endswith("backward") else flops
    except Exception:  # a formula that does not fit an unusual call never breaks tracing
        return 0
    return 0


class _OpRecorder(TorchDispatchMode):
    def __init__(self, state: _State, ids: _Ids) -> None:
        super().__init__()
        self.state = state
        self.ids = ids

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        st = self.state
        st.failed_op = str(func)
        index = len(st.ops)
        if st.sync_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if st.sync_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        st.failed_op = None
        in_ids = [self.ids.tensor(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out_ids = [
            self.ids.tensor(t, producer=index) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        ]
        if st.phase == "forward":
            module = st.module_stack[-1] if st.module_stack else ""
            unit = next((st.unit_of_module[m] for m in st.module_stack if m in st.unit_of_module), OUTSIDE)
        else:
            module, unit = st.backward_module, st.backward_unit
        st.ops.append(
            OpNode(
                index=index,
                name=str(func),
                kind=op_spec(func).kind,
                module=module,
                unit=unit,
                phase=st.phase,
                inputs=in_ids,
                outputs=out_ids,
                flops=_flops(func, args, kwargs, out),
                time_s=dt,
            )
        )
        return out


class _CallSpans(TorchFunctionMode):
    """Brackets each torch-level call so saved tensors can be attributed to the op inside it."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state
        self.current: tuple[int, int] | None = None
        self.serial = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.state.phase != "forward":
            return func(*args, **(kwargs or {}))
        outer = self.current
        self.serial += 1
        span = (len(self.state.ops), self.serial)
        self.current = span
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.state.span_ends[span[1]] = len(self.state.ops)
            self.current = outer


def _resolve_packs(state: _State) -> None:
    """Attribute every saved tensor to the op that saved it.

    Autograd saves an op's inputs just before the op runs and its outputs just after, so a pack made
    inside a torch-level call belongs to the first later op of that call that consumes the tensor, or else
    to the last earlier op that produced it. A tensor packed twice for the same op is the producer's save
    followed by the consumer's (``log_softmax`` then ``nll_loss`` inside ``cross_entropy``).
    """
    ops = state.ops
    assigned: set[tuple[int, int]] = set()
    for p in state.packs:
        if p.op >= 0:
            assigned.add((p.tensor, p.op))
            continue
        lo, hi = (p.span[0], state.span_ends.get(p.span[1], len(ops))) if p.span else (p.last_op, p.last_op + 1)
        hi = min(hi, len(ops))
        before, after = range(max(lo, 0), min(p.last_op, hi)), range(p.last_op, hi)
        consumer = next((i for i in after if p.tensor in ops[i].inputs), None)
        producer = next((i for i in reversed(before) if p.tensor in ops[i].outputs), None)
        if producer is None and p.span is None and p.last_op > 0 and p.tensor in ops[p.last_op - 1].outputs:
            producer = p.last_op - 1
        if consumer is not None and (p.tensor, consumer) in assigned and producer is not None:
            chosen = producer
        elif consumer is not None:
            chosen = consumer
        elif producer is not None:
            chosen = producer
        else:  # custom autograd Functions save after their last op, outside any torch-level call
            chosen = max(min(p.last_op, len(ops)) - 1, 0)
        p.op = chosen
        assigned.add((p.tensor, chosen))
        if p.tensor not in ops[chosen].saved:
            ops[chosen].saved.append(p.tensor)


def _units_info(state: _State, units: list[Unit]) -> list[UnitInfo]:
    info: dict[str, UnitInfo] = {}
    signatures: dict[tuple, int] = {}
    for u in units + [Unit(OUTSIDE, nn.Identity())]:
        info[u.name] = UnitInfo(name=u.name, cls=u.cls if u.name != OUTSIDE else "-", group=-1)
    sig_ops: dict[str, list] = {u: [] for u in info}
    for op in state.ops:
        ui = info.get(op.unit) or info[OUTSIDE]
        if op.phase == "forward":
            if ui.first_op < 0:
                ui.first_op = op.index
            ui.last_op = op.index
            ui.flops_fwd += op.flops
            ui.time_fwd_s += op.time_s
            sig_ops[ui.name].append(
                (op.name, tuple(tuple(state.tensors[t].shape) for t in op.inputs + op.outputs))
            )
        else:
            ui.flops_bwd += op.flops
            ui.time_bwd_s += op.time_s
    for name, ui in info.items():
        key = (ui.cls, tuple(sig_ops[name])) if name != OUTSIDE else ("outside",)
        ui.group = signatures.setdefault(key, len(signatures))
    return list(info.values())


def trace(
    model: nn.Module,
    batch: Any = None,
    *,
    adapter: Adapter | str | None = None,
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
    batch_size: int = 2,
    train: bool = True,
    memory: bool = True,
    units: list[Unit] | None = None,
    **sizes: int,
) -> OpGraph:
    """Trace one training step of ``model`` into an :class:`OpGraph`.

    Args:
        model: any ``nn.Module``; timm, HF transformers and PyG models are recognised by their adapters.
        batch: the step's inputs (a :class:`Batch`, dict, tuple, tensor or PyG ``Data``); when ``None`` the
            adapter builds a random one from the model's config with ``batch_size`` and ``sizes``
            (``seq_len``, ``image_size``, ``num_nodes``, ...).
        adapter: an adapter (or its name) instead of the one that matches.
        loss_fn: ``(output, batch) -> scalar``; by default the adapter's planning loss.
        train: trace in training mode (dropout and BatchNorm as in training); the mode is restored after.
        memory: run the step a second time, plainly, to measure its memory timeline unit by unit (CPU:
            profiler allocator trace; CUDA: allocator statistics), the figures the planner predicts peaks
            from. Skipped, with a log line, when a profiler or :class:`~zoomem.MemoryMeter` is running.
        units: the units to trace, in forward order (planning passes a shared layer's calls, each a unit:
            :mod:`zoomem.runtime.calls`); the adapter's by default.

    Returns:
        The graph. The model's parameters, gradients, buffers, mode and the RNG state are as before.

    Raises:
        TraceError: the step failed; the message names the module and op.

    >>> import timm, zoomem
    >>> g = zoomem.trace(timm.create_model("resnet18"), batch_size=1, image_size=32)  # doctest: +SKIP
    >>> print(g.summary())  # doctest: +SKIP
    """
    if isinstance(adapter, str) or adapter is None:
        adapter = get_adapter(model, adapter)
    batch = adapter.example_batch(model, batch_size, **sizes) if batch is None else Batch.of(batch, model)
    loss_fn = loss_fn or (lambda out, b: adapter.loss(model, b, out))  # type: ignore[union-attr]
    units = adapter.units(model) if units is None else units

    state = _State()
    ids = _Ids(state)
    params = [p for p in model.parameters()]
    buffers = [b for b in model.buffers()]
    ids.seed(params, "param")
    ids.seed(buffers, "buffer")
    ids.seed(batch.tensors(), "input")
    fixed = {}
    for t in params + buffers + batch.tensors():
        s = t.untyped_storage()
        fixed[s.data_ptr()] = s.nbytes()
    param_bytes = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values())

    device = next((t.device for t in params + batch.tensors()), torch.device("cpu"))
    state.sync_cuda = device.type == "cuda"
    names = {m: n for n, m in model.named_modules()}
    apart = [u.module for u in units if u.module not in names]  # a shared layer's calls (no child of the model)
    names.update({u.module: u.name for u in units})
    state.unit_of_module = {u.name: u.name for u in units}
    spans = _CallSpans(state)

    # per running module call: the storages of its arguments, and the units whose inputs are among them (the
    # caller's frame holds an argument until the call returns: see UnitInfo.inputs_held_to)
    calls: list[tuple[set[int], list[str]]] = []
    held_to: dict[str, int] = {}

    def pre_hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
        state.module_stack.append(names.get(mod, "?"))
        leaves = pytree.tree_leaves((args, kwargs))
        calls.append(({ids.storage(t) for t in leaves if isinstance(t, torch.Tensor)}, []))

    unit_inputs: dict[str, list[int]] = {}
    unit_calls: dict[str, int] = {}
    call_order: list[str] = []

    def unit_pre_hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
        name = names.get(mod, "?")
        if state.phase == "forward":
            unit_calls[name] = unit_calls.get(name, 0) + 1
            call_order.append(name)
        if name not in unit_inputs:
            leaves = pytree.tree_leaves((args, kwargs))
            unit_inputs[name] = sorted({ids.storage(t) for t in leaves if isinstance(t, torch.Tensor)})
            for args_of, dependents in calls:  # the calls running now (this unit's own is pushed after this hook)
                if args_of.intersection(unit_inputs[name]):
                    dependents.append(name)

    def post_hook(mod: nn.Module, args: Any, out: Any) -> None:
        if state.module_stack:
            state.module_stack.pop()
        if calls:
            for name in calls.pop()[1]:
                held_to[name] = max(held_to.get(name, 0), len(unit_inputs))

    def pack(t: torch.Tensor) -> Any:
        if state.phase != "forward":
            return t
        tid = ids.tensor(t)
        handle = _Saved(t, len(state.packs))
        state.packs.append(_Pack(tensor=tid, last_op=len(state.ops), span=spans.current, ref=weakref.ref(handle)))
        return handle

    def unpack(h: Any) -> torch.Tensor:
        if isinstance(h, _Saved):
            p = state.packs[h.pack]
            if p.op < 0:
                _resolve_packs(state)
            op = state.ops[p.op]
            state.backward_unit, state.backward_module = op.unit, op.module
            return h.tensor
        return h

    saved_grads = {p: p.grad for p in params}
    restore_buffers = snapshot_buffers(model)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    handles = []
    t_start = time.perf_counter()
    restore_modes = set_training(model, train)  # through the timeline's run too
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=rng_devices))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(uncompiled())  # the ops a compiled frame runs are not seen one by one
            for p in params:
                p.grad = None
            for u in units:
                handles.append(u.module.register_forward_pre_hook(unit_pre_hook, with_kwargs=True))
            for mod in [*model.modules(), *apart]:
                handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(mod.register_forward_hook(post_hook))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            stack.enter_context(_OpRecorder(state, ids))
            with spans:
                output = batch.call(model)
                loss = loss_fn(output, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TraceError(
                    f"The planning loss must be a scalar tensor that requires grad, got "
                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}. "
                    "Pass `loss_fn=` or check that the model has trainable parameters."
                )
            _resolve_packs(state)
            held_saved = {state.tensors[p.tensor].storage for p in state.packs if p.ref() is not None}
            out_storages = {
                ids.storage(t) for t in pytree.tree_leaves((output, loss)) if isinstance(t, torch.Tensor)
            }
            n_forward = len(state.ops)
            state.phase = "backward"
            # the output stays alive through backward, as in an ordinary training loop
            loss.backward()
            del output, loss
        for h in handles:
            h.remove()
        handles.clear()
        restore_buffers()  # the timeline run starts from the same state as the traced one
        with uncompiled():
            timeline = measure_timeline(model, batch, loss_fn, units) if memory else []
    except TraceError:
        raise
    except Exception as e:
        if is_out_of_memory(e):  # not the model's fault: the caller may trace a smaller batch
            raise
        where = state.module_stack[-1] if state.module_stack else "(model root)"
        mod = dict(model.named_modules()).get(where if where != "(model root)" else "", model)
        op = f" at op {state.failed_op}" if state.failed_op else ""
        raise TraceError(
            f"Tracing {type(model).__name__} failed in module '{where}' ({type(mod).__name__}){op} during "
            f"{state.phase}: {type(e).__name__}: {e}\nTry: check that the batch matches the model's forward "
            f"(adapter {adapter.name!r} builds one with example_batch), run one plain forward/backward to see "
            "whether the failure is zoomem's, or pass an explicit `adapter=` / `loss_fn=`."
        ) from e
    finally:
        for h in handles:
            h.remove()
        restore_buffers()
        for p, g in saved_grads.items():
            p.grad = g
        restore_modes()
    step_time = time.perf_counter() - t_start

    role = {}
    for t in state.tensors.values():
        role.setdefault(t.storage, t.role)
    saved_storages = sorted(s for s in held_saved if is_activation(role.get(s, "external")))
    held_storages = sorted(s for s in held_saved | out_storages if is_activation(role.get(s, "external")))
    graph = OpGraph(
        model=type(model).__name__,
        adapter=adapter.name,
        device=str(device),
        batch_signature=_describe(batch),
        ops=state.ops,
        tensors=state.tensors,
        storages=state.storages,
        units=_units_info(state, units),
        held_storages=held_storages,
        saved_storages=saved_storages,
        fixed_bytes=sum(fixed.values()),
        param_bytes=param_bytes,
        step_time_s=step_time,
        timeline=timeline,
    )
    alive = set(saved_storages)
    counted: dict[str, set[int]] = {}
    for p in state.packs:
        s = state.tensors[p.tensor].storage
        if s in alive and p.op < n_forward:
            counted.setdefault(state.ops[p.op].unit, set()).add(s)
    for u in graph.units:
        u.input_storages = unit_inputs.get(u.name, [])
        u.inputs_held_to = held_to.get(u.name, 0)
        u.calls = unit_calls.get(u.name, 0)
        if u.calls > 1:
            at = [i for i, name in enumerate(call_order) if name == u.name]
            u.interleaved = len(set(call_order[at[0]:at[-1] + 1])) > 1
    _dedupe_across_units(graph, counted)
    _say_repeated_units(model, graph)
    return graph


_SAID_REPEATED: "weakref.WeakKeyDictionary[nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _say_repeated_units(model: nn.Module, graph: OpGraph) -> None:
    """Log once per model and unit that a unit ran more than once in one forward with other units between its
    calls: planning keeps such calls one stretch (it splits the calls of a layer shared across depth, which run
    one after another), so recomputing it is priced as holding every call's activations at once, and plans gain
    little from it."""
    said = _SAID_REPEATED.setdefault(model, set())
    for u in graph.units:
        if u.interleaved and u.name not in said:
            said.add(u.name)
            logger.warning(
                "zoomem: unit %r (%s) ran %d times in one forward with other units between its calls (a backbone "
                "run on several views inside one forward, say): zoomem plans its calls as one, so recomputing it "
                "saves little. Where each call is a forward of its own module, make those the units (wrap the "
                "backbone and call it once per view).",
                u.name, u.cls, u.calls)


def _dedupe_across_units(graph: OpGraph, counted: dict[str, set[int]]) -> None:
    """A storage saved by two units (a block's output saved by the next block too) counts in the first."""
    seen: set[int] = set()
    for u in graph.units:
        mine = counted.get(u.name, set()) - seen
        u.saved_bytes = sum(graph.storages[s] for s in mine)
        seen |= mine


def _describe(batch: Batch) -> str:
    parts = []
    for i, a in enumerate(batch.args):
        if isinstance(a, torch.Tensor):
            parts.append(f"arg{i}={list(a.shape)}:{str(a.dtype).replace('torch.', '')}")
    for k, v in batch.kwargs.items():
        if isinstance(v, torch.Tensor):
            parts.append(f"{k}={list(v.shape)}:{str(v.dtype).replace('torch.', '')}")
    return ", ".join(parts)
