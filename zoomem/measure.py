"""A truthful memory meter for one training step, on CPU and CUDA (DESIGN.md section 8).

Every number zoomem reports (and every baseline it is compared with) comes from here, so the definition is
fixed in one place:

* **CUDA**: bytes of the caching allocator, ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` after a
  reset, read at each mark.
* **CPU**: the allocator trace of the PyTorch profiler (``profile_memory=True``). It sees every block the CPU
  allocator hands out, op scratch buffers included (a 64-channel conv2d forward peaks at about twice its output),
  which dispatch-level storage trackers miss. Frees of blocks allocated before the window are ignored: the profiler
  does not know their size, so counting only what the window allocated keeps every number well defined.

Limits of the CPU meter: it sees allocations made on the thread that opened it (CPU autograd runs backward on
that thread; other Python threads and DataLoader workers are not seen, and the profiler's ``profile_all_threads``
option loses the main thread's allocations in torch 2.14), and only blocks from PyTorch's CPU allocator (not
NumPy's or a library's own ``malloc``). The first time a pre-window block is freed inside a window, c10 logs
"Memory block of unknown size was allocated before the profiling started" once to stderr; it is harmless.

The CPU session records no ``USER_SCOPE`` record functions (``torch.profiler.record_function``, DDP's forward
label, gloo's collectives): gloo ends a collective's record function on its worker thread after the collective's
future has completed, so the gradient all-reduce of a DDP step can end after backward returned and the meter
closed, and write through the closed session's freed records (heap corruption; a 2-process CI run aborted with
"malloc(): unsorted double linked list corrupted" right after a metered DDP step). Marks are ``FUNCTION``-scope.

>>> model = torch.nn.Linear(4, 4)
>>> with MemoryMeter(model) as meter:
...     y = model(torch.zeros(8, 4))
...     meter.mark("forward")
>>> meter.report.phases["forward"].end_bytes - meter.report.baseline_bytes
256
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from zoomem.batch import Batch

__all__ = ["MemoryMeter", "MemoryReport", "PhaseStat", "holder_bytes", "is_out_of_memory", "measure_step",
           "tensor_nbytes"]

logger = logging.getLogger(__name__)

_MARK_PREFIX = "zoomem::mark::"
_MIB = float(1 << 20)
# The one meter open in this process: a CUDA meter resets the device's peak statistics and a CPU meter owns the
# profiler, so two open meters would corrupt each other. Set and cleared only by MemoryMeter.__enter__/__exit__.
_active_meter: MemoryMeter | None = None


@dataclass
class PhaseStat:
    """Memory of one phase of the window (from the previous mark, or the start, to its own mark).

    Args:
        peak_bytes: highest bytes live during the phase (baseline included).
        end_bytes: bytes live at the phase's mark (baseline included).
    """

    peak_bytes: int
    end_bytes: int


@dataclass
class MemoryReport:
    """What one metered window held, in bytes. All ``*_bytes`` values except the deltas are absolute.

    Args:
        device: the measured device, ``"cpu"`` or ``"cuda:N"``.
        baseline_bytes: bytes live when the window opened. CUDA: ``torch.cuda.memory_allocated()``. CPU: the
            storage-deduplicated bytes of the meter's holders (the CPU allocator has no global counter).
        peak_bytes: ``baseline_bytes + peak_delta_bytes``.
        peak_delta_bytes: highest bytes the window itself held above its start.
        activation_bytes: bytes held at the ``"forward"`` mark above the start, i.e. what forward keeps for
            backward (and its output); ``None`` without such a mark.
        phases: one :class:`PhaseStat` per mark, in mark order.
    """

    device: str
    baseline_bytes: int
    peak_bytes: int
    peak_delta_bytes: int
    activation_bytes: int | None
    phases: dict[str, PhaseStat] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of ints and strings, ready for ``json.dumps``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryReport:
        """Inverse of :meth:`to_dict`."""
        kwargs = dict(data)
        kwargs["phases"] = {name: PhaseStat(**stat) for name, stat in data.get("phases", {}).items()}
        return cls(**kwargs)

    def summary(self) -> str:
        """A few human lines in MiB, for logs and the CLI."""
        lines = [
            f"device {self.device}: peak {self.peak_bytes / _MIB:.2f} MiB "
            f"(baseline {self.baseline_bytes / _MIB:.2f} MiB + step {self.peak_delta_bytes / _MIB:.2f} MiB)"
        ]
        if self.activation_bytes is not None:
            lines.append(f"  held for backward after forward: {self.activation_bytes / _MIB:.2f} MiB")
        for name, stat in self.phases.items():
            lines.append(f"  {name}: peak {stat.peak_bytes / _MIB:.2f} MiB, end {stat.end_bytes / _MIB:.2f} MiB")
        return "\n".join(lines)


class MemoryMeter:
    """Context manager that measures the memory one window of code (a training step) allocates.

    Marks cut the window into phases (``"forward"``, ``"backward"``, ``"optimizer"``): the optimizer step's
    temporaries can be the peak of the whole step and hide every activation saving, so they are reported apart.
    The meter keeps no reference to the holders after entering and allocates nothing inside the window.

    Only one meter can be open at a time, and on CPU no other ``torch.profiler`` session may run (the profiler
    cannot nest). On CPU the meter sets ``KINETO_LOG_LEVEL=6`` (unless already set) to silence Kineto's stderr
    lines; Kineto reads it once, when the first profiler of the process starts.

    Args:
        *holders: what is live when the window opens: modules (parameters, buffers, existing ``.grad``),
            optimizers (parameters and state), :class:`~zoomem.Batch` objects, tensors, or dicts/lists/tuples of
            these. They give the CPU baseline and the default device.
        device: the device to measure; default the device of the holders' first tensor, else CPU.

    Raises:
        ValueError: a device other than CPU or CUDA.
        TypeError: a holder of an unsupported type.

    >>> meter = MemoryMeter()
    >>> with meter:
    ...     x = torch.empty(1_000_000)
    >>> meter.report.peak_delta_bytes
    4000000
    """

    def __init__(self, *holders: Any, device: torch.device | str | None = None) -> None:
        self._holders: tuple[Any, ...] | None = holders
        self.device = _resolve_device(holders, device)
        self._marks: list[str] = []
        self._open = False
        self._report: MemoryReport | None = None
        self._baseline = 0
        self._cuda_phases: list[PhaseStat] = []
        self._tracing = False

    # -- window -------------------------------------------------------------------------------------------------

    def __enter__(self) -> MemoryMeter:
        global _active_meter
        if self._open or self._holders is None:
            raise RuntimeError("A MemoryMeter measures one window: create a new MemoryMeter for each step.")
        if _active_meter is not None:
            raise RuntimeError(
                "Another MemoryMeter is already open; meters cannot nest (they share the peak statistics and "
                "the profiler). Close the outer meter first, or use its marks to cut phases."
            )
        holders, self._holders = self._holders, None  # keep nothing alive while the window is open
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if torch._C._autograd._profiler_enabled():
                raise RuntimeError(
                    "A torch profiler is already running on this thread; the CPU MemoryMeter needs its own "
                    "profiler session and the profiler cannot nest. Measure outside the other profiler."
                )
            self._baseline = holder_bytes(*holders, device=self.device)
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's USDT/ERROR stderr lines; read at first start
            _start_trace()
            self._tracing = True
        del holders
        self._open = True
        _active_meter = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active_meter
        if not self._open:
            return
        self._open = False
        _active_meter = None
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                tail_peak = torch.cuda.max_memory_allocated(self.device)
                self._report = self._build_cuda_report(tail_peak)
            else:
                assert self._tracing
                self._tracing = False
                trace = torch.autograd._disable_profiler()
                self._report = self._build_cpu_report(trace)
                del trace
        except Exception:
            if exc and exc[0] is not None:  # don't hide the step's own error behind the meter's
                logger.warning("MemoryMeter could not build its report after the step failed", exc_info=True)
                return
            raise
        logger.debug("MemoryMeter report:\n%s", self._report.summary())

    def mark(self, name: str) -> None:
        """End the current phase and name it, e.g. ``"forward"``, ``"backward"``, ``"optimizer"``.

        Raises:
            RuntimeError: the meter is not open.
            ValueError: an empty or already used name.
        """
        if not self._open:
            raise RuntimeError(f"MemoryMeter.mark({name!r}) called outside the meter's `with` block.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"A mark needs a non-empty string name, got {name!r}.")
        if name in self._marks:
            raise ValueError(f"Mark {name!r} was already used in this window (marks so far: {self._marks}).")
        self._marks.append(name)
        with torch._C._profiler._RecordFunctionFast(_MARK_PREFIX + name):  # CPU: its start time cuts the trace
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            end = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the next phase's peak starts from `end`
            self._cuda_phases.append(PhaseStat(peak_bytes=peak, end_bytes=end))

    @property
    def report(self) -> MemoryReport:
        """The measurements, available once the ``with`` block has exited."""
        if self._report is None:
            state = "is still open" if self._open else "has not been run (or failed)"
            raise RuntimeError(f"MemoryMeter.report is available after the `with` block exits; this meter {state}.")
        return self._report

    # -- reports ------------------------------------------------------------------------------------------------

    def _finish(self, phases: list[PhaseStat], peak_delta: int) -> MemoryReport:
        named = dict(zip(self._marks, phases))
        forward = named.get("forward")
        return MemoryReport(
            device=str(self.device),
            baseline_bytes=self._baseline,
            peak_bytes=self._baseline + peak_delta,
            peak_delta_bytes=peak_delta,
            activation_bytes=None if forward is None else forward.end_bytes - self._baseline,
            phases=named,
        )

    def _build_cuda_report(self, tail_peak: int) -> MemoryReport:
        peak = max([tail_peak] + [p.peak_bytes for p in self._cuda_phases])
        return self._finish(self._cuda_phases, max(peak - self._baseline, 0))

    def _build_cpu_report(self, trace: Any) -> MemoryReport:
        events, mark_times = _read_trace(trace)
        missing = [m for m in self._marks if m not in mark_times]
        if missing:
            raise RuntimeError(
                f"The profiler trace lacks the mark events {missing}; was the profiler disabled inside the window?"
            )
        cuts = [mark_times[m] for m in self._marks]
        phases: list[PhaseStat] = []
        live: dict[int, int] = {}  # ptr -> bytes, blocks allocated inside the window and not yet freed
        held = phase_peak = window_peak = 0
        k = 0
        for time_ns, size, ptr in events:
            while k < len(cuts) and time_ns > cuts[k]:
                phases.append(PhaseStat(self._baseline + phase_peak, self._baseline + held))
                phase_peak = held
                k += 1
            if size > 0:
                if ptr in live:  # a free we never saw (e.g. lost at a session edge): don't count the block twice
                    held -= live[ptr]
                live[ptr] = size
                held += size
            else:
                held -= live.pop(ptr, 0)  # frees of blocks from before the window are ignored
            phase_peak = max(phase_peak, held)
            window_peak = max(window_peak, held)
        for _ in cuts[k:]:
            phases.append(PhaseStat(self._baseline + phase_peak, self._baseline + held))
            phase_peak = held
        return self._finish(phases, window_peak)


def measure_step(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Batch], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    holders: tuple[Any, ...] = (),
) -> MemoryReport:
    """Run one real training step under a :class:`MemoryMeter` and report its memory.

    Phases: forward (mark ``"forward"``); ``loss_fn(output, batch)`` and backward (mark ``"backward"``);
    ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` when an optimizer is given (mark ``"optimizer"``).
    Output and loss stay alive to the end of the window, as in an ordinary training loop. The model's train/eval
    mode is used as it is.

    Args:
        model: the model to step.
        batch: anything :meth:`Batch.of` accepts; ``loss_fn`` receives it as a :class:`Batch`.
        loss_fn: ``loss_fn(output, batch) -> scalar tensor``.
        optimizer: stepped and zeroed when given.
        holders: more objects live during the step, counted in the CPU baseline in addition to
            ``(model, optimizer, batch)``.

    Returns:
        The :class:`MemoryReport` of the step.

    Raises:
        TypeError: ``loss_fn`` did not return a scalar tensor.

    >>> model = torch.nn.Linear(4, 2)
    >>> report = measure_step(model, torch.zeros(8, 4), lambda out, b: out.sum())
    >>> list(report.phases)
    ['forward', 'backward']
    """
    b = Batch.of(batch, model)
    meter = MemoryMeter(model, optimizer, b, *holders)
    with meter:
        output = b.call(model)
        meter.mark("forward")
        loss = loss_fn(output, b)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a scalar tensor, got {got}; reduce the loss, e.g. `.mean()`.")
        loss.backward()
        meter.mark("backward")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meter.mark("optimizer")
    del output, loss
    return meter.report


# -- helpers ----------------------------------------------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that did not fit: CUDA's (or any accelerator's) ``OutOfMemoryError``, the
    CPU allocator's ``RuntimeError`` ("can't allocate memory"), which PyTorch does not raise as one, or Python's
    ``MemoryError`` (the profiler's ``std::bad_alloc``)."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses: a sparse tensor's indices and values, not its dense size."""
    return sum(p.numel() * p.element_size() for p in _plain_tensors(t))


def holder_bytes(*holders: Any, device: torch.device | str = "cpu") -> int:
    """Storage-deduplicated bytes of every tensor the holders own on ``device`` (views and shared weights once), a
    ``DistributedDataParallel``'s gradient buckets included."""
    device = torch.device(device)
    storages: dict[int, int] = {}
    for t in _iter_tensors(holders):
        for leaf in _plain_tensors(t):
            if leaf.device.type != device.type or (device.index is not None and leaf.device.index != device.index):
                continue
            storage = leaf.untyped_storage()
            ptr = storage.data_ptr()
            if ptr:
                storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
    return sum(storages.values()) + sum(_ddp_buckets(h, device) for h in holders)


def _ddp_buckets(holder: Any, device: torch.device) -> int:
    """A DDP holder's gradient buckets, which no Python object exposes as tensors (where they are the gradients,
    ``gradient_as_bucket_view=True`` after a backward, the gradients' storages counted them already)."""
    from torch.nn.parallel import DistributedDataParallel

    from .runtime.distributed import bucket_bytes

    if not isinstance(holder, DistributedDataParallel):  # (every other holder: nothing to walk)
        return 0
    params = list(holder.parameters())
    if not params or params[0].device.type != device.type:
        return 0
    if getattr(holder, "gradient_as_bucket_view", False) and any(p.grad is not None for p in params):
        return 0
    return bucket_bytes(holder)


def _resolve_device(holders: tuple[Any, ...], device: torch.device | str | None) -> torch.device:
    first: torch.Tensor | None = None
    for t in _iter_tensors(holders):  # walk them all: an unsupported holder fails here, not at __enter__
        first = t if first is None else first
    if device is None:
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"MemoryMeter measures 'cpu' or 'cuda' devices, got {str(device)!r}.")


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a holder owns, depth first, duplicates included."""
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _iter_tensors(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                yield from _iter_tensors(p)
        for state in obj.state.values():
            yield from _iter_tensors(state)
    elif isinstance(obj, Batch):
        yield from obj.tensors()
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _iter_tensors(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from _iter_tensors(value)
    elif isinstance(obj, (int, float, bool, str, bytes)):
        return
    elif hasattr(obj, "edge_index") and callable(getattr(obj, "to_dict", None)):  # torch_geometric Data
        yield from _iter_tensors(obj.to_dict())
    else:
        raise TypeError(
            f"MemoryMeter cannot find the tensors of a {type(obj).__name__}; pass modules, optimizers, "
            "zoomem.Batch objects, tensors, or dicts/lists/tuples of these."
        )


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own storage behind ``t``: itself, a sparse tensor's parts, a wrapper subclass's inners."""
    if t.layout == torch.sparse_coo:
        yield from (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain = (
            (t.crow_indices(), t.col_indices())
            if t.layout in (torch.sparse_csr, torch.sparse_bsr)
            else (t.ccol_indices(), t.row_indices())
        )
        yield from (compressed, plain, t.values())
    elif is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            yield from _plain_tensors(getattr(t, attr))
    else:
        yield t


def _start_trace() -> None:
    """Open the CPU meter's profiler session: allocations recorded, record functions of every scope but
    ``USER_SCOPE`` (see the module's docstring: gloo ends those on its own thread, possibly after the session)."""
    from torch._C._profiler import ProfilerActivity, RecordScope, _ExperimentalConfig
    from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    scopes = {s for s in RecordScope.__members__.values() if s != RecordScope.USER_SCOPE}
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU}, scopes)


def _read_trace(trace: Any) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """CPU allocation events ``(time_ns, bytes, ptr)`` sorted by time (frees negative), and mark start times, of
    the result of ``torch.autograd._disable_profiler()``."""
    allocation = torch._C._profiler._EventType.Allocation
    events: list[tuple[int, int, int]] = []
    marks: dict[str, int] = {}
    stack = list(reversed(trace.experimental_event_tree()))
    while stack:  # pre-order, iterative: deep models give deep trees
        event = stack.pop()
        if event.tag == allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu" and fields.alloc_size:
                events.append((event.start_time_ns, fields.alloc_size, fields.ptr))
        elif event.name.startswith(_MARK_PREFIX):
            marks[event.name[len(_MARK_PREFIX) :]] = event.start_time_ns
        stack.extend(reversed(event.children))
    events.sort(key=lambda e: e[0])  # stable: ties keep the order above
    return events, marks
