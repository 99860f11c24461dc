"""The largest batch (or width, depth, image resolution, sequence length) each training method fits in a budget.

Memory a method saves is worth what it lets you train; the number users compare is the largest batch that fits
a fixed budget (GACT's experiments; DESIGN.md section 8: "the largest batch whose measured peak stays within the
budget, every probe a real step").

A probe builds the model afresh (same seed, so methods never share state), creates AdamW's state (a step on
zero gradients), applies the method and runs real training steps (forward, loss, backward, ``optimizer.step()``)
at that size:

1. one warm-up step: zoomem traces and plans here, ``torch.compile`` compiles;
2. one step under :func:`zoomem.measure.measure_step`: its whole-step peak (forward, backward and optimizer
   phases, parameters and optimizer state included) must be within the budget. On CPU that is the allocator
   trace against the budget; on CUDA the caching allocator is also capped at the budget
   (``torch.cuda.set_per_process_memory_fraction``) so that a step over it raises ``torch.cuda.OutOfMemoryError``,
   caught in-process;
3. when it fits, ``time_steps`` timed steps (no meter), for the step time at that size.

``zoomem.InfeasibleBudgetError`` (no plan for this size within the budget) and an out-of-memory error count as
"does not fit"; any other error stops that method's search and is reported. On CPU with one torch thread each
probe runs in a forked child process (:attr:`SearchConfig.isolate`), so that nothing a probe leaks outlives it.

The search per method (:func:`search_max`) doubles from a start value (plain PyTorch's own maximum for the other
methods) until a probe fails or ``cap`` is reached, then narrows the bracket between the largest fitting and the
smallest failing value until they are adjacent (or within ``rtol``): by bisection, every other round replaced by
a probe where a straight line through the two ends' measured peaks crosses the budget, and its neighbour. Every
probe is appended to a JSONL log as it finishes, so a long run resumes (``resume=True`` reuses the records of
the same model, sizes, method, budget and dimension).

>>> from zoomem.maxbatch import search_max
>>> search_max(lambda b: b <= 37, start=1, cap=1024)
(37, 38)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import logging
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .benchtools import Alarm, exc_text, git_info, grid, machine_line, median, result_head, train_step

__all__ = [
    "DIMS",
    "GOALS",
    "METHODS",
    "Method",
    "ProbeLog",
    "SearchConfig",
    "Workload",
    "add_arguments",
    "format_goal_summary",
    "format_results",
    "get_method",
    "parse_budget_text",
    "plot_results",
    "probe",
    "run",
    "run_probe",
    "search_max",
]

logger = logging.getLogger(__name__)
MIB = 1024 * 1024
DIMS = ("batch", "width", "depth", "resolution", "seqlen")
"""What the search grows: the batch, or (at a fixed batch) the model's width or depth, the images' side, the
sequence length."""

GOALS = {"lossless": 4.0, "L2": 10.0}
"""Issue 6's goals for the max batch, as multiples of plain PyTorch's at the same budget; and, for every peer,
a zoomem method with at least its batch at no more per-sample time."""


# -- what a probe builds: the searched dimension ------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One probe's size: build overrides, batch size, example-batch sizes, and the searched value it stands for."""

    overrides: dict[str, Any]
    batch_size: int
    sizes: dict[str, int]
    value: int


@dataclass
class Workload:
    """A model id and the dimension searched; ``at(k)`` gives the size of the ``k``-th grid point.

    The grid is ``k * step`` in the dimension's own unit: batch 1, 2, 3, ...; width in multiples of the head
    count (so heads still divide it); resolution in multiples of the patch size (ViT) or 32 (CNNs); sequence
    length in multiples of 8; depth in layers. PyG's batch is ``k`` graphs' worth of nodes and edges
    (``num_nodes``/``num_edges`` per unit, default 1000 and 10 per node) in one random graph.

    Raises:
        ValueError: an unknown dimension, or one this model does not have (the message lists those it has).
    """

    model_id: str
    dim: str = "batch"
    overrides: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    batch_size: int = 4
    step: int = field(init=False)
    _at: Callable[[int], Setting] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dim not in DIMS:
            raise ValueError(f"Could not resolve dim {self.dim!r} among choices {list(DIMS)}.")
        zoo_name = self.model_id.partition("/")[0]
        rule = _RULES.get((zoo_name, self.dim)) or _RULES.get(("*", self.dim))
        got = rule(self) if rule is not None else None
        if got is None:
            have = [d for d in DIMS if d == "batch" or ((zoo_name, d) in _RULES and _RULES[(zoo_name, d)](self))]
            raise ValueError(f"{self.model_id} has no {self.dim!r} dimension zoomem can grow; it has: {have}.")
        self.step, self._at = got

    def at(self, k: int) -> Setting:
        return self._at(k)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model": self.model_id, "dim": self.dim, "overrides": self.overrides,
                             "sizes": self.sizes, "step": self.step}
        if self.dim != "batch":
            d["batch_size"] = self.batch_size
        return d


_Rule = Callable[[Workload], "tuple[int, Callable[[int], Setting]] | None"]


def _batch(w: Workload) -> tuple[int, Callable[[int], Setting]]:
    return 1, lambda k: Setting(dict(w.overrides), k, dict(w.sizes), k)


def _pyg_batch(w: Workload) -> tuple[int, Callable[[int], Setting]]:
    nodes = int(w.sizes.get("num_nodes", 1000))
    edges = int(w.sizes.get("num_edges", 10 * nodes))
    return 1, lambda k: Setting(dict(w.overrides), 1, {"num_nodes": nodes * k, "num_edges": edges * k}, k)


def _grow(w: Workload, step: int, over: Callable[[int], dict[str, Any]],
          sizes: Callable[[int], dict[str, int]]) -> tuple[int, Callable[[int], Setting]]:
    """A grid ``k * step``: the overrides and sizes of value ``k * step`` on top of the workload's own."""

    def at(k: int) -> Setting:
        v = k * step
        return Setting({**w.overrides, **over(v)}, w.batch_size, {**w.sizes, **sizes(v)}, v)

    return step, at


def _hf_config(w: Workload) -> Any:
    import transformers

    from . import zoo

    layout = zoo.HF_MODELS.get(w.model_id.partition("/")[2])
    if layout is None:
        return None
    return getattr(transformers, layout.config_cls)(**{**layout.fields, **w.overrides})


_HF_WIDTH = (("hidden_size", "intermediate_size", "num_attention_heads"), ("n_embd", "n_inner", "n_head"),
             ("d_model", "d_ff", "num_heads"))
_HF_DEPTH = (("num_hidden_layers",), ("n_layer",), ("num_layers", "num_decoder_layers"))
_HF_POSITIONS = ("max_position_embeddings", "n_positions")


def _hf_vision(c: Any) -> bool:
    return hasattr(c, "image_size") and hasattr(c, "patch_size")


def _hf_width(w: Workload) -> Any:
    c = _hf_config(w)
    keys = next((k for k in _HF_WIDTH if c is not None and hasattr(c, k[0])), None)
    if keys is None:
        return None
    hidden, inner, heads = keys
    ratio = (getattr(c, inner, None) or 4 * getattr(c, hidden)) / getattr(c, hidden)
    step = getattr(c, heads) if hidden != "d_model" else 8  # T5's heads have their own d_kv
    return _grow(w, step, lambda v: {hidden: v, inner: int(round(ratio * v))}, lambda v: {})


def _hf_depth(w: Workload) -> Any:
    c = _hf_config(w)
    keys = next((k for k in _HF_DEPTH if c is not None and hasattr(c, k[0])), None)
    if keys is None:
        return None
    return _grow(w, 1, lambda v: {k: v for k in keys if hasattr(c, k)}, lambda v: {})


def _hf_seqlen(w: Workload) -> Any:
    c = _hf_config(w)
    if c is None or _hf_vision(c):
        return None
    pos = next((p for p in _HF_POSITIONS if hasattr(c, p)), None)
    limit = getattr(c, pos) if pos else None
    return _grow(w, 8, lambda v: {pos: v} if pos and v > limit else {}, lambda v: {"seq_len": v})


def _hf_resolution(w: Workload) -> Any:
    c = _hf_config(w)
    if c is None or not _hf_vision(c):
        return None
    return _grow(w, int(c.patch_size), lambda v: {"image_size": v}, lambda v: {"image_size": v})


def _timm_vit(w: Workload) -> Any:
    """A timm model with ViT-style ``embed_dim``/``blocks``/``patch_embed`` (None for CNNs)."""
    from . import zoo

    model, _ = zoo.build(w.model_id, **w.overrides)
    if not (hasattr(model, "embed_dim") and hasattr(model, "blocks") and hasattr(model, "patch_embed")):
        return None
    return model


def _timm_width(w: Workload) -> Any:
    m = _timm_vit(w)
    if m is None:
        return None
    return _grow(w, int(m.blocks[0].attn.num_heads), lambda v: {"embed_dim": v}, lambda v: {})


def _timm_depth(w: Workload) -> Any:
    return None if _timm_vit(w) is None else _grow(w, 1, lambda v: {"depth": v}, lambda v: {})


def _timm_resolution(w: Workload) -> Any:
    m = _timm_vit(w)
    if m is None:
        return _grow(w, 32, lambda v: {}, lambda v: {"image_size": v})
    return _grow(w, int(m.patch_embed.patch_size[0]), lambda v: {"img_size": v}, lambda v: {"image_size": v})


_RULES: dict[tuple[str, str], _Rule] = {
    ("*", "batch"): _batch,
    ("pyg", "batch"): _pyg_batch,
    ("pyg", "width"): lambda w: _grow(w, 8, lambda v: {"hidden_channels": v}, lambda v: {}),
    ("pyg", "depth"): lambda w: _grow(w, 1, lambda v: {"num_layers": v}, lambda v: {}),
    ("hf", "width"): _hf_width,
    ("hf", "depth"): _hf_depth,
    ("hf", "seqlen"): _hf_seqlen,
    ("hf", "resolution"): _hf_resolution,
    ("timm", "width"): _timm_width,
    ("timm", "depth"): _timm_depth,
    ("timm", "resolution"): _timm_resolution,
}
"""(zoo, dimension) -> how a grid index becomes a model and batch; a zoo's missing dimension has no entry."""


# -- methods ----------------------------------------------------------------------------------------------------


@dataclass
class SearchConfig:
    """Settings every probe shares (the resume key includes those that change memory)."""

    device: str = "cpu"
    seed: int = 0
    foreach: bool = False
    time_steps: int = 2
    time_limit: float = 10.0
    compile_budget: float = 0.5
    compile_timeout: float = 600.0
    skip_logits: bool = False
    """zoomem's methods wrap with ``skip_logits=True`` (HF LMs: the training forward returns ``logits=None`` where the
    fused LM-head loss runs); plain PyTorch and the peers return their logits as usual."""
    isolate: bool = False
    """Run each probe in a forked child process where that is safe (CPU, one torch thread, and no multi-threaded
    OpenMP pool created earlier in this process: GNU OpenMP hangs in a child forked from such a parent, which is
    why it is opt-in, for a fresh command-line process; not ``compile``, whose graphs are reused across probes as they are
    across a training run's steps): whatever a probe leaves behind (the heap the allocator keeps grown, anything a
    model's own code caches) dies with the child."""


@dataclass
class _Probe:
    """What a method's ``prepare`` gets: the fresh model of one probe and what its step needs."""

    model: torch.nn.Module
    adapter: Any
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    budget_bytes: int | None
    config: SearchConfig


@dataclass
class Prepared:
    """A method applied to one probe's model: what to call, the context every step runs in, how to undo it."""

    module: Any
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    close: Callable[[], None] = lambda: None
    label: str | None = None
    warm_timeout: float | None = None


@dataclass(frozen=True)
class Method:
    """One way to train: ``prepare`` applies it to a probe's fresh model; ``begin`` runs before its search."""

    name: str
    label: str
    kind: str  # "pytorch", "peer" or "zoomem"
    prepare: Callable[[_Probe], Prepared]
    begin: Callable[[], None] = lambda: None
    key: dict[str, Any] = field(default_factory=dict)  # settings of the method that change its memory


def _plain(p: _Probe) -> Prepared:
    return Prepared(p.model)


def _wrap(p: _Probe, budget: int | None = None, peer: bool = False, **kwargs: Any) -> Prepared:
    import zoomem

    zoomem.wrap(p.model, budget, adapter=p.adapter, optimizer=p.optimizer, loss_fn=p.loss_fn,
                time_limit=p.config.time_limit, skip_logits=p.config.skip_logits and not peer, **kwargs)
    return Prepared(p.model, close=lambda: zoomem.unwrap(p.model))


def _native(p: _Probe) -> Prepared:
    if p.adapter.set_native_checkpointing(p.model, True):
        label = {"transformers": "HF gradient_checkpointing_enable", "timm": "timm set_grad_checkpointing"}.get(
            p.adapter.name, f"{p.adapter.name} native checkpointing")
        return Prepared(p.model, label=label)
    prepared = _wrap(p, peer=True, strategy="all")
    prepared.label = f"full checkpointing ({p.adapter.name} has none: zoomem `all`)"
    return prepared


def _compile(p: _Probe) -> Prepared:
    import torch._functorch.config as functorch_config

    budget = p.config.compile_budget
    return Prepared(torch.compile(p.model), context=lambda: functorch_config.patch(activation_memory_budget=budget),
                    label=f"torch.compile, activation_memory_budget={budget:g}", warm_timeout=p.config.compile_timeout)


def _dynamo_reset() -> None:
    """A compile search starts from empty caches; later probes reuse its (dynamic-shape) graphs as users' would."""
    torch._dynamo.reset()


def _level(name: str) -> Method:
    return Method(name, f"zoomem level {name}", "zoomem",
                  lambda p: _wrap(p, level=name, sensitivity_interval=0))


METHODS: dict[str, Method] = {
    "pytorch": Method("pytorch", "plain PyTorch", "pytorch", _plain),
    "checkpoint": Method("checkpoint", "full checkpointing (the zoo's own)", "peer", _native),
    "compile": Method("compile", "torch.compile, activation_memory_budget", "peer", _compile, _dynamo_reset),
    "lossless": Method("lossless", "zoomem wrap(budget=...)", "zoomem", lambda p: _wrap(p, p.budget_bytes)),
    "L1": _level("L1"),
    "L2": _level("L2"),
    "L3": _level("L3"),
    "auto": Method("auto", "zoomem wrap(budget=..., compress='auto')", "zoomem",
                   lambda p: _wrap(p, p.budget_bytes, compress="auto", sensitivity_interval=0)),
}
"""The methods by name, in the order of the tables; any other ``zoomem.LEVELS`` name works too."""


def get_method(name: str) -> Method:
    """The method called ``name`` (a key of :data:`METHODS` or a zoomem level such as ``L2.2``)."""
    import zoomem

    if name in METHODS:
        return METHODS[name]
    if name in zoomem.LEVELS:
        return _level(name)
    raise ValueError(f"Could not resolve method {name!r} among choices {[*METHODS, *zoomem.LEVELS]}.")


# -- one probe ----------------------------------------------------------------------------------------------------


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class _Collect(logging.Handler):
    """Keeps zoomem's warnings of one probe (the probe's record lists them; the console gets them once, below
    the table, instead of once per probe)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _zoomem_warnings() -> Iterator[_Collect]:
    log = logging.getLogger("zoomem")
    handler, propagate = _Collect(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


@contextlib.contextmanager
def _capped(device: torch.device, budget_bytes: int | None) -> Iterator[None]:
    """On CUDA, let the caching allocator hold at most the budget (an over-budget step raises OOM)."""
    if device.type != "cuda" or budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state exists from the first probe step on, as in the steady state of training (one step on zero
    gradients creates it without a forward)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _plan_info(model: torch.nn.Module) -> dict[str, Any]:
    """What zoomem planned for the probe's size (read from the wrapped model's plan cache)."""
    from .planner import Decision

    handle = model.__dict__.get("_zoomem")
    if handle is None or not handle.plans:
        return {}
    plan = list(handle.plans.values())[-1]
    measured = plan.extras.get("measured_peak_bytes")
    return {
        "strategy": plan.strategy,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "zoomem_measured_peak_bytes": measured,
        "recomputed_units": sum(u.decision != Decision.KEEP for u in plan.units),
        "units": len(plan.units),
        "lossy_tensors": len(plan.bits),
    }


def run_probe(workload: Workload, method: Method, k: int, budget_bytes: int | None,
              config: SearchConfig) -> dict[str, Any]:
    """Build, apply ``method`` and step at grid point ``k``; return the probe's record.

    Returns:
        ``{"value", "fits", "peak_bytes", "step_s", "reason", "error", ...}``; ``fits`` is None when the probe
        failed for another reason than memory (``error`` says which).
    """
    import zoomem

    from . import zoo
    from .measure import measure_step

    setting = workload.at(k)
    device = torch.device(config.device)
    rec: dict[str, Any] = {"method": method.name, "k": k, "value": setting.value, "fits": None}
    t0 = time.perf_counter()
    model = optimizer = batch = prepared = None
    with warnings.catch_warnings(record=True) as caught, _zoomem_warnings() as logged:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(config.seed)
            model, adapter = zoo.build(workload.model_id, **setting.overrides)
            model.to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=config.foreach)
            _create_state(optimizer)
            batch = adapter.example_batch(model, setting.batch_size, **setting.sizes).to(device)
            m = model
            loss_fn = lambda out, b: adapter.loss(m, b, out)  # noqa: E731
            with _capped(device, budget_bytes):
                prepared = method.prepare(_Probe(model, adapter, optimizer, loss_fn, budget_bytes, config))
                with prepared.context(), Alarm(prepared.warm_timeout, f"{method.name}'s first step"):
                    train_step(prepared.module, batch, loss_fn, optimizer)
                with prepared.context():
                    report = measure_step(prepared.module, batch, loss_fn, optimizer)
                ph = report.phases
                rec.update(
                    fits=budget_bytes is None or report.peak_bytes <= budget_bytes,
                    peak_bytes=report.peak_bytes,
                    fwd_bwd_peak_bytes=max(ph["forward"].peak_bytes, ph["backward"].peak_bytes),
                    optimizer_peak_bytes=ph["optimizer"].peak_bytes,
                    baseline_bytes=report.baseline_bytes,
                    activation_bytes=report.activation_bytes,
                )
                if not rec["fits"]:
                    rec["reason"] = f"peak {report.peak_bytes / MIB:.1f} MiB > budget"
                else:
                    times = []
                    for _ in range(config.time_steps):
                        t = time.perf_counter()
                        with prepared.context():
                            train_step(prepared.module, batch, loss_fn, optimizer)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        times.append(time.perf_counter() - t)
                    rec["step_s"] = times
        except zoomem.InfeasibleBudgetError as exc:
            rec.update(fits=False, reason=f"zoomem: infeasible (needs {exc.min_budget / MIB:.1f} MiB)",
                       min_budget_bytes=int(exc.min_budget))
        except torch.OutOfMemoryError:
            planning = model is not None and "_zoomem" in model.__dict__ and not model.__dict__["_zoomem"].plans
            rec.update(fits=False, reason="CUDA out of memory" + (" while zoomem planned (down to its smallest "
                                                                   "sub-batch traces)" if planning else ""))
        except Exception as exc:  # noqa: BLE001 - a result: this method cannot run at this size
            logger.debug("%s at %s=%d failed", method.name, workload.dim, setting.value, exc_info=True)
            rec["error"] = exc_text(exc)
        finally:
            if model is not None:
                rec.update(_plan_info(model))
            if prepared is not None:
                if prepared.label:
                    rec["label"] = prepared.label
                prepared.close()
            del model, optimizer, batch, prepared
            _free(device)
    rec["warnings"] = sorted({str(w.message).splitlines()[0][:300] for w in caught
                              if not issubclass(w.category, (DeprecationWarning, FutureWarning))}
                             | {m.splitlines()[0][:300] for m in logged.messages})
    rec["probe_s"] = time.perf_counter() - t0
    return rec


def _isolated(method: Method, config: SearchConfig) -> bool:
    import os

    return (config.isolate and method.name != "compile" and hasattr(os, "fork")
            and torch.device(config.device).type == "cpu" and torch.get_num_threads() == 1)


def _child(send: Any, args: tuple[Any, ...]) -> None:
    send.send(run_probe(*args))
    send.close()


def probe(workload: Workload, method: Method, k: int, budget_bytes: int | None,
          config: SearchConfig) -> dict[str, Any]:
    """:func:`run_probe`, in a forked child process when :attr:`SearchConfig.isolate` applies."""
    if not _isolated(method, config):
        return run_probe(workload, method, k, budget_bytes, config)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, (workload, method, k, budget_bytes, config)), daemon=True)
    t0 = time.perf_counter()
    child.start()
    send.close()
    try:
        rec: dict[str, Any] | None = recv.recv()
    except EOFError:  # the child died without a word: killed (out of host memory?) or crashed
        rec = None
    child.join()
    recv.close()
    if rec is None:
        rec = {"method": method.name, "k": k, "value": workload.at(k).value, "fits": None, "warnings": [],
               "probe_s": time.perf_counter() - t0,
               "error": f"the probe's process ended with exit code {child.exitcode} before reporting"
                        + (" (killed: out of host memory?)" if child.exitcode == -9 else "")}
    return rec


# -- search -------------------------------------------------------------------------------------------------------


def search_max(fits: Callable[[int], bool], start: int = 1, cap: int = 1024, rtol: float = 0.0,
               guess: Callable[[int, int], int | None] | None = None) -> tuple[int, int | None]:
    """The largest ``k`` in ``[1, cap]`` with ``fits(k)``, assuming fitting is monotone in ``k``.

    Doubles from ``start`` until a probe fails (or ``cap`` fits), then narrows the bracket (largest fitting,
    smallest failing) until the two are adjacent, or ``hi - lo <= rtol * lo``. Narrowing bisects; with ``guess``
    (``guess(lo, hi)``: a predicted boundary, e.g. from a linear fit of the measured peaks) every other round
    probes the guess and then its neighbour on the open side instead, so a good guess ends the search in two
    probes and a bad one costs at most one round before the next bisection.

    Returns:
        ``(lo, hi)``: ``lo`` the largest fitting ``k`` found (0: nothing fits), ``hi`` the smallest failing one
        (None: ``cap`` fits).
    """
    lo, hi, k = 0, None, max(1, min(start, cap))
    while True:
        if fits(k):
            lo = k
            if k >= cap:
                return lo, None
            k = min(2 * k, cap)
        else:
            hi = k
            break

    def probe(k: int) -> None:
        nonlocal lo, hi
        if fits(k):
            lo = k
        else:
            hi = k

    def open_gap() -> bool:
        return hi - lo > max(1, int(rtol * lo))

    guessing = guess is not None
    while open_gap():
        g = guess(lo, hi) if guessing else None
        if g is None:
            probe((lo + hi) // 2)
        else:
            k = min(max(g, lo + 1), hi - 1)
            probe(k)
            neighbour = k + 1 if lo == k else k - 1
            if open_gap() and lo < neighbour < hi:
                probe(neighbour)
        guessing = guess is not None and not guessing
    return lo, hi


class ProbeLog:
    """Probe records, one JSON line each, appended as they finish; ``resume`` reuses the file's records."""

    def __init__(self, path: str | Path | None, resume: bool = False) -> None:
        self.path = Path(path) if path else None
        self.records: dict[str, dict[str, Any]] = {}
        self.reused = 0
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.records[r["key"]] = r
        elif not resume:
            self.path.write_text("")

    @staticmethod
    def key(**parts: Any) -> str:
        return json.dumps(parts, sort_keys=True, default=str)

    def get(self, key: str) -> dict[str, Any] | None:
        r = self.records.get(key)
        if r is not None:
            self.reused += 1
        return r

    def add(self, key: str, record: dict[str, Any]) -> None:
        record = {"key": key, **record}
        self.records[key] = record
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")


class _Stop(Exception):
    """A probe failed for another reason than memory: the method's search ends there."""


def _search_method(workload: Workload, method: Method, budget_bytes: int, config: SearchConfig, log: ProbeLog,
                   start: int, cap: int, rtol: float, bar: Any = None) -> dict[str, Any]:
    """One method's search; returns its result row with every probe record it used."""
    records: list[dict[str, Any]] = []
    method.begin()
    _free(torch.device(config.device))  # each probe frees what it allocated; this frees what came before

    def fits(k: int) -> bool:
        key = ProbeLog.key(**workload.describe(), k=k, method=method.name, method_key=method.key,
                           budget_bytes=budget_bytes, device=torch.device(config.device).type, seed=config.seed,
                           foreach=config.foreach,
                           **({"compile_budget": config.compile_budget} if method.name == "compile" else {}),
                           **({"skip_logits": True} if config.skip_logits and method.kind == "zoomem" else {}))
        rec = log.get(key)
        if rec is None or (rec.get("fits") and len(rec.get("step_s", [])) < config.time_steps):
            rec = probe(workload, method, k, budget_bytes, config)
            log.add(key, rec)
        else:
            rec = {**rec, "reused": True}
        records.append(rec)
        if bar is not None:
            state = "error" if rec["fits"] is None else ("fits" if rec["fits"] else "over")
            bar.set_postfix_str(f"{workload.dim}={rec['value']} {state}")
            bar.update(1)
        if rec["fits"] is None:
            raise _Stop(rec.get("error", "failed"))
        return bool(rec["fits"])

    def need(k: int) -> int | None:
        """Bytes grid point ``k`` needs: its measured peak, or zoomem's minimum budget where it could not plan."""
        r = next((r for r in reversed(records) if r["k"] == k), None)
        return None if r is None else (r.get("peak_bytes") or r.get("min_budget_bytes"))

    def guess(lo: int, hi: int) -> int | None:
        """The boundary a straight line through the two bracket ends' needs predicts."""
        a, b = need(lo), need(hi)
        if a is None or b is None or b <= a or a > budget_bytes:
            return None
        return lo + int((budget_bytes - a) * (hi - lo) // (b - a))

    row: dict[str, Any] = {"method": method.name, "label": method.label, "kind": method.kind}
    try:
        lo, hi = search_max(fits, start=start, cap=cap, rtol=rtol, guess=guess)
    except _Stop as exc:
        ok = [r["k"] for r in records if r["fits"]]
        lo, hi = (max(ok) if ok else 0), None
        row["error"] = str(exc)
        row["stopped_at"] = records[-1]["value"]
    by_k = {r["k"]: r for r in records}
    row.update(max_k=lo, max_value=workload.at(lo).value if lo else 0, at_cap=hi is None and "error" not in row)
    row["label"] = next((r["label"] for r in records if r.get("label")), method.label)
    if lo:
        best = by_k[lo]
        row.update({k: best.get(k) for k in ("peak_bytes", "fwd_bwd_peak_bytes", "optimizer_peak_bytes",
                                             "activation_bytes", "predicted_peak_bytes", "recomputed_units",
                                             "units", "lossy_tensors")})
        row["step_s"] = median(best.get("step_s", []))
    if hi is not None:
        above = by_k[hi]
        row.update(first_over_value=above["value"], first_over_reason=above.get("reason"))
    row["warnings"] = sorted({w for r in records for w in r.get("warnings", [])})
    row["probes"] = records
    return row


# -- the whole comparison -------------------------------------------------------------------------------------------


def parse_budget_text(text: str | int, device: torch.device | str = "cpu",
                      reference: Callable[[], int] | None = None) -> tuple[int, str]:
    """Bytes of a budget given as bytes (``"268435456"``), with a unit (``"256MiB"``, ``"6GiB"``) or as a
    percentage.

    A percentage is of the CUDA device's total memory; on CPU there is no device memory to take a share of, so
    it is of plain PyTorch's measured step peak at a reference size, which ``reference()`` measures (the CLI's
    ``--ref-value``); without one it is an error.

    Returns:
        ``(bytes, how the budget was read)``.

    >>> parse_budget_text("256MiB")
    (268435456, '256 MiB')
    """
    from .planner import parse_budget

    device = torch.device(device)
    if isinstance(text, int) or str(text).strip().isdigit():
        b = int(text)
        return b, f"{b / MIB:g} MiB"
    s = str(text).strip()
    if s.endswith("%"):
        frac = float(s[:-1]) / 100
        if not 0 < frac <= 1:
            raise ValueError(f"A percentage budget must be in (0%, 100%], got {s!r}.")
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return int(frac * props.total_memory), f"{s} of {props.name}'s {props.total_memory / 2**30:.1f} GiB"
        if reference is None:
            raise ValueError(f"On CPU a percentage budget ({s!r}) needs a reference: pass --ref-value N (the "
                             "percentage is then of plain PyTorch's measured step peak at that size), or give "
                             "bytes such as '256MiB'.")
        ref = reference()
        return int(frac * ref), f"{s} of plain PyTorch's measured peak ({ref / MIB:.1f} MiB)"
    b = parse_budget(s)
    assert b is not None
    return b, f"{b / MIB:g} MiB"


def _summarize(rows: list[dict[str, Any]], dim: str) -> None:
    """Ratios to plain PyTorch's maximum and per-sample time against PyTorch's at its maximum (in place)."""
    ref = next((r for r in rows if r["method"] == "pytorch" and r["max_value"]), None)
    for r in rows:
        if ref is None or not r["max_value"]:
            r["ratio"] = None
            r["overhead"] = None
            continue
        r["ratio"] = r["max_value"] / ref["max_value"]
        t, t0 = r.get("step_s"), ref.get("step_s")
        ok = t is not None and t0 is not None and t == t and t0 == t0 and t0 > 0
        # batch: time per sample; other dimensions: time per step (the model itself differs)
        r["overhead"] = ((t / r["max_value"]) / (t0 / ref["max_value"]) if dim == "batch" else t / t0) if ok else None


def _goals(rows: list[dict[str, Any]], dim: str) -> list[dict[str, Any]]:
    """Issue 6's goals, judged on the measured rows (batch searches only)."""
    by = {r["method"]: r for r in rows}
    ref = by.get("pytorch")
    if dim != "batch" or ref is None or not ref["max_value"]:
        return []
    out: list[dict[str, Any]] = []
    for name, target in GOALS.items():
        r = by.get(name)
        if r is None:
            continue
        ratio = r.get("ratio") or 0.0
        out.append({"goal": f"{name} >= {target:g}x PyTorch's batch", "method": name, "target_ratio": target,
                    "ratio": ratio, "met": ratio >= target, "max_value": r["max_value"],
                    "needed_value": int(-(-target * ref["max_value"] // 1)), "at_cap": r.get("at_cap", False)})
    zoomem_rows = [r for r in rows if r["kind"] == "zoomem" and r["max_value"] and r.get("overhead") is not None]
    for peer in (r for r in rows if r["kind"] == "peer"):
        entry: dict[str, Any] = {"goal": f"a zoomem method fits at least {peer['method']}'s batch at no more "
                                         "time per sample", "peer": peer["method"]}
        if not peer["max_value"] or peer.get("overhead") is None:
            entry.update(met=None, note=f"{peer['method']} has no measured maximum"
                                        + (f" ({peer['error']})" if peer.get("error") else ""))
            out.append(entry)
            continue
        within = [r for r in zoomem_rows if r["overhead"] <= peer["overhead"]]
        best = max(within, key=lambda r: r["max_value"]) if within else None
        entry.update(peer_value=peer["max_value"], peer_overhead=peer["overhead"],
                     best=None if best is None else best["method"],
                     best_value=None if best is None else best["max_value"],
                     best_overhead=None if best is None else best["overhead"],
                     met=best is not None and best["max_value"] >= peer["max_value"])
        largest = max(zoomem_rows, key=lambda r: (r["max_value"], -r["overhead"]), default=None)
        if largest is not None:
            entry.update(largest=largest["method"], largest_value=largest["max_value"],
                         largest_overhead=largest["overhead"])
        if best is None:
            cheapest = min(zoomem_rows, key=lambda r: r["overhead"], default=None)
            entry["note"] = ("no zoomem method at or below its time per sample" + (
                f" (the fastest, {cheapest['method']}, takes {cheapest['overhead']:.2f}x)" if cheapest else ""))
        out.append(entry)
    return out


def run(
    model_id: str,
    budget: str | int,
    methods: Sequence[str] = tuple(METHODS),
    *,
    dim: str = "batch",
    overrides: dict[str, Any] | None = None,
    sizes: dict[str, int] | None = None,
    batch_size: int = 4,
    config: SearchConfig | None = None,
    start: int = 1,
    cap: int = 1024,
    rtol: float = 0.0,
    ref_value: int | None = None,
    log: ProbeLog | None = None,
    progress: bool = True,
    command: str = "",
) -> dict[str, Any]:
    """Search every method's maximum of ``dim`` within ``budget``; return the result (what the JSON holds).

    Args:
        model_id: a zoo id (``timm/resnet50``, ``hf/bert-large-uncased``, ``pyg/gcn``, ...).
        budget: bytes, ``"256MiB"``, or a percentage (see :func:`parse_budget_text`).
        methods: names from :data:`METHODS` (or zoomem levels); plain PyTorch is searched first when listed, and
            the others start doubling from its maximum.
        dim: one of :data:`DIMS`.
        overrides / sizes / batch_size: the model's build overrides, the example batch's sizes, and the batch
            when another dimension is searched.
        start / cap / rtol: the search's first grid point, its largest, and the relative gap it may stop at.
        ref_value: on CPU, the grid value of plain PyTorch's step that a percentage budget is a share of.
        log: probe records (appended as they finish; with ``resume`` the file's records are reused).
    """
    from tqdm import tqdm

    config = config or SearchConfig()
    log = log or ProbeLog(None)
    workload = Workload(model_id, dim, dict(overrides or {}), dict(sizes or {}), batch_size)
    chosen = [get_method(m) for m in dict.fromkeys(methods)]
    chosen.sort(key=lambda m: m.name != "pytorch")  # stable: plain PyTorch first, the rest as given
    started = _dt.datetime.now(_dt.timezone.utc)
    code = git_info()
    t0 = time.perf_counter()

    reference: dict[str, Any] = {}

    def measure_reference() -> int:
        k = -(-int(ref_value or 0) // workload.step) if ref_value else 0
        if k <= 0:
            raise ValueError("--ref-value must be a positive size of the searched dimension.")
        key = ProbeLog.key(**workload.describe(), k=k, method="pytorch", reference=True,
                           device=torch.device(config.device).type, seed=config.seed, foreach=config.foreach)
        rec = log.get(key)
        if rec is None:
            rec = probe(workload, METHODS["pytorch"], k, None, config)
            log.add(key, rec)
        if rec.get("error"):
            raise RuntimeError(f"the reference step failed: {rec['error']}")
        reference.update(rec)
        return int(rec["peak_bytes"])

    if any(_isolated(m, config) for m in chosen):
        # one plain step here first: forked probes then start with imports, kernels and the profiler initialised
        # (a cold child spends about 2 s on them)
        run_probe(workload, METHODS["pytorch"], 1, None, SearchConfig(device=config.device, seed=config.seed,
                                                                       time_steps=0))
    budget_bytes, budget_text = parse_budget_text(budget, config.device,
                                                  measure_reference if ref_value is not None else None)
    rows: list[dict[str, Any]] = []
    first = start
    for method in chosen:
        bar = tqdm(desc=f"{method.name:>10}", unit="probe", file=sys.stderr, dynamic_ncols=True,
                   disable=not progress)
        try:
            row = _search_method(workload, method, budget_bytes, config, log, first, cap, rtol, bar)
        finally:
            bar.close()
        rows.append(row)
        if method.name == "pytorch" and row["max_k"]:
            first = row["max_k"]
    _summarize(rows, dim)
    return {
        **result_head("maxbatch", command, started, time.perf_counter() - t0, code),
        "settings": {
            **workload.describe(),
            "budget": str(budget),
            "budget_bytes": budget_bytes,
            "budget_text": budget_text,
            "reference": {k: reference.get(k) for k in ("value", "peak_bytes")} if reference else None,
            "methods": [m.name for m in chosen],
            "device": config.device,
            "seed": config.seed,
            "optimizer": f"torch.optim.AdamW(lr=1e-3, foreach={config.foreach}), state created before the step",
            "probe": "fresh model (same seed); one warm-up step (zoomem plans, torch.compile compiles); one step "
                     "under zoomem.measure.measure_step: fits when its whole-step peak (forward, backward, "
                     "optimizer) <= budget; then time_steps timed steps",
            "time_steps": config.time_steps,
            "overhead": ("time per sample at the method's maximum / plain PyTorch's at its maximum (median step "
                         "time over the timed steps)") if dim == "batch" else
                        "step time at the method's maximum / plain PyTorch's at its maximum",
            "search": f"doubling from {start} (the other methods: from plain PyTorch's maximum), then bisection; "
                      f"cap {cap}, rtol {rtol:g}",
            "compile_activation_memory_budget": config.compile_budget,
            "isolated_probes": "each probe in a forked child process (not compile's)"
                               if any(_isolated(m, config) for m in chosen) else "in this process",
            "solver_time_limit_s": config.time_limit,
            "skip_logits": config.skip_logits,
            "reused_probes": log.reused,
            "probe_s": sum(p["probe_s"] for r in rows for p in r["probes"]),
        },
        "results": rows,
        "goals": _goals(rows, dim),
    }


# -- output ---------------------------------------------------------------------------------------------------------


def _mib(v: float | None) -> str:
    return "—" if v is None else (f"{v / MIB:.1f}")


def format_results(data: dict[str, Any], markdown: bool = False) -> str:
    """The comparison table and the goals, as text or markdown."""
    s = data["settings"]
    dim = s["dim"]
    short = {"batch": "batch", "width": "width", "depth": "depth", "resolution": "px", "seqlen": "seq"}[dim]
    heads = ["method", "how", f"max {dim}", "x PyTorch", "peak MiB", "step s",
             "time/sample x" if dim == "batch" else "step time x", f"first {short} over the budget"]
    cells = []
    for r in data["results"]:
        mx = str(r["max_value"]) + (" (cap)" if r.get("at_cap") else "")
        over = "—"
        if r.get("first_over_value") is not None:
            over = f"{r['first_over_value']}: {r.get('first_over_reason') or ''}".strip()
        if r.get("error"):
            over = f"stopped at {r.get('stopped_at')}: {r['error']}"
            if r["method"] == "compile":
                over = "skipped: " + over
        cells.append([
            r["method"], r["label"], mx,
            "—" if r.get("ratio") is None else f"{r['ratio']:.2f}",
            _mib(r.get("peak_bytes")),
            "—" if r.get("step_s") is None or r["step_s"] != r["step_s"] else f"{r['step_s']:.2f}",
            "—" if r.get("overhead") is None else f"{r['overhead']:.2f}",
            over,
        ])
    head = (f"{s['model']}{' ' + json.dumps(s['overrides']) if s['overrides'] else ''}"
            f"{' sizes ' + json.dumps(s['sizes']) if s['sizes'] else ''}"
            f"{'; batch ' + str(s['batch_size']) if dim != 'batch' else ''}; budget {s['budget_text']} "
            f"({s['budget_bytes'] / MIB:.1f} MiB)"
            f"{'; zoomem with skip_logits' if s.get('skip_logits') else ''}; {machine_line(data['machine'])}; "
            f"{data['wall_s']:.0f} s"
            + (f" (the probes: {s['probe_s']:.0f} s, {s['reused_probes']} of them reused from the log)"
               if s.get("reused_probes") else ""))
    lines = [("`" + data["command"] + "`\n\n" if markdown and data.get("command") else "") + head, "",
             grid(heads, cells, markdown, left=2)]
    goals = format_goals(data.get("goals", []))
    if goals:
        lines += ["", goals]
    said: dict[str, list[str]] = {}
    for r in data["results"]:
        for w in r.get("warnings", []):
            said.setdefault(w, []).append(r["method"])
    if said:
        lines += ["", "Warnings during the probes:"] + [f"- {', '.join(m)}: {w}" for w, m in said.items()]
    return "\n".join(lines)


def format_goals(goals: Sequence[dict[str, Any]]) -> str:
    """One line per goal: MET / NOT MET and by how much."""
    out = []
    for g in goals:
        if "target_ratio" in g:
            s = f"- {g['goal']}: {'MET' if g['met'] else 'NOT MET'}: {g['ratio']:.2f}x (max {g['max_value']}"
            s += "" if g["met"] else f"; {g['target_ratio']:g}x needs {g['needed_value']}, short by " \
                                     f"{g['target_ratio'] - g['ratio']:.2f}x"
            out.append(s + (", at the search cap" if g.get("at_cap") else "") + ")")
        elif g["met"] is None:
            out.append(f"- {g['goal']}: not judged: {g['note']}")
        else:
            s = f"- {g['goal']}: "
            if g["best"] is None:
                s += f"NOT MET: {g['peer']} fits {g['peer_value']} at {g['peer_overhead']:.2f}x; {g['note']}"
            else:
                s += ("MET" if g["met"] else f"NOT MET (short by {g['peer_value'] - g['best_value']})") + (
                    f": {g['peer']} fits {g['peer_value']} at {g['peer_overhead']:.2f}x; {g['best']} fits "
                    f"{g['best_value']} at {g['best_overhead']:.2f}x")
            if g.get("largest") and g["largest"] != g["best"]:
                s += (f"; zoomem's largest at any time per sample: {g['largest']} {g['largest_value']} at "
                      f"{g['largest_overhead']:.2f}x")
            out.append(s)
    return "\n".join(out)


def format_goal_summary(datas: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One row per result: each goal's verdict and by how much (several searches, e.g. BENCHMARKS.md's)."""
    heads = ["model", "budget", "PyTorch's max", *(f"{m} (goal {t:g}x)" for m, t in GOALS.items()),
             "vs checkpoint", "vs compile"]
    cells = []
    for d in datas:
        by = {r["method"]: r for r in d["results"]}
        goals = d.get("goals", [])
        row = [d["settings"]["model"], f"{d['settings']['budget_bytes'] / MIB:.0f} MiB",
               str(by["pytorch"]["max_value"]) if "pytorch" in by else "—"]
        for name in GOALS:
            g = next((g for g in goals if g.get("method") == name), None)
            row.append("—" if g is None else f"{g['ratio']:.2f}x " + (
                "MET" if g["met"] else f"NOT MET (-{g['target_ratio'] - g['ratio']:.2f}x)"))
        for peer in ("checkpoint", "compile"):
            g = next((g for g in goals if g.get("peer") == peer), None)
            if g is None or g["met"] is None:
                row.append("—" if g is None else "not judged")
            elif g["best"] is None:
                row.append(f"NOT MET: {peer} {g['peer_value']} at {g['peer_overhead']:.2f}x, no zoomem method as "
                           "fast")
            else:
                row.append(("MET" if g["met"] else f"NOT MET (-{g['peer_value'] - g['best_value']})")
                           + f": {g['best']} {g['best_value']} at {g['best_overhead']:.2f}x vs {g['peer_value']} at "
                             f"{g['peer_overhead']:.2f}x")
        cells.append(row)
    return grid(heads, cells, markdown, left=1)


def plot_results(data: dict[str, Any], path: str | Path) -> None:
    """Bars of each method's maximum (labelled with its multiple of PyTorch's) and of its time overhead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    s = data["settings"]
    color = {"pytorch": "black", "peer": "tab:red", "zoomem": "tab:blue"}
    names = [r["method"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    bars = ax.bar(names, [r["max_value"] for r in rows], color=[color[r["kind"]] for r in rows])
    for b, r in zip(bars, rows):
        text = "skipped" if r.get("error") and not r["max_value"] else (
            "" if r.get("ratio") is None else f"{r['ratio']:.1f}x")
        ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(0, max([r["max_value"] for r in rows] + [1]) * 1.12)
    ax.set_ylabel(f"max {s['dim']} within {s['budget_bytes'] / MIB:.0f} MiB")
    ax.set_title(f"{s['model']} ({s['dim']})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax.grid(axis="y", alpha=0.3)
    over = [r.get("overhead") or 0 for r in rows]
    ax2.bar(names, over, color=[color[r["kind"]] for r in rows], alpha=0.75)
    ax2.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax2.set_ylabel("time per sample / PyTorch's" if s["dim"] == "batch" else "step time / PyTorch's")
    ax2.tick_params(axis="x", labelsize=8, rotation=20)
    ax2.grid(axis="y", alpha=0.3)
    import textwrap

    head = textwrap.fill(data.get("command") or "", 160, subsequent_indent="    ")
    fig.suptitle(head + "\n" + machine_line(data["machine"]), fontsize=7.5)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line (zoomem max-batch, scripts/max_batch_size.py, zoomem demo) ------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The max-batch flags, shared by ``zoomem max-batch`` and ``scripts/max_batch_size.py``."""
    p.add_argument("model", help="zoo id: timm/resnet50, hf/bert-large-uncased, pyg/gcn, ... (`zoomem models`)")
    p.add_argument("--budget", required=True,
                   help="bytes, '256MiB', '6GiB', or a percentage: of the CUDA device's memory, on CPU of plain "
                   "PyTorch's measured peak at --ref-value")
    p.add_argument("--methods", nargs="+", default=list(METHODS), metavar="M",
                   help=f"methods (default: {' '.join(METHODS)}; any zoomem level such as L2.2 too)")
    p.add_argument("--dim", choices=DIMS, default="batch", help="what to grow (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="the batch when --dim is not batch (default: %(default)s)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="sequence length (HF text models)")
    p.add_argument("--image-size", dest="image_size", type=int, help="image height = width (timm, HF ViT)")
    p.add_argument("--num-nodes", dest="num_nodes", type=int,
                   help="PyG: nodes per batch unit (default 1000; the batch is that many units in one graph)")
    p.add_argument("--num-edges", dest="num_edges", type=int, help="PyG: edges per batch unit (default 10/node)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model/config field, e.g. --set num_hidden_layers=4 (repeatable)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--ref-value", dest="ref_value", type=int,
                   help="CPU percentage budgets: the size whose plain PyTorch peak the percentage is of")
    p.add_argument("--start", type=int, default=1, help="first grid point of the search (default: %(default)s)")
    p.add_argument("--cap", type=int, default=1024, help="largest grid point tried (default: %(default)s)")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="stop bisecting when the gap is within this share of the maximum (default: %(default)s: "
                   "exact)")
    p.add_argument("--time-steps", dest="time_steps", type=int, default=2,
                   help="timed steps at each fitting probe (median; default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=False,
                   help="AdamW's foreach implementation (default: %(default)s: per parameter, so the optimizer "
                   "step's temporaries stay one parameter's size and the budget goes to activations)")
    p.add_argument("--compile-budget", dest="compile_budget", type=float, default=0.5,
                   help="torch._functorch.config.activation_memory_budget for `compile` (default: %(default)s)")
    p.add_argument("--compile-timeout", dest="compile_timeout", type=float, default=600.0,
                   help="give up on a torch.compile first step after this many seconds (default: %(default)s)")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=10.0,
                   help="seconds for each zoomem plan (warm start, program and bound together)")
    p.add_argument("--skip-logits", dest="skip_logits", action="store_true",
                   help="HF LMs: zoomem's methods wrap with skip_logits=True (the training forward returns "
                   "logits=None where the fused LM-head loss runs; plain PyTorch and the peers keep them)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="run each probe in a forked child process on CPU with one torch thread (--threads 1), so "
                   "that what a probe leaks dies with it; only in a fresh process (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON here (and its probes to OUT.probes.jsonl)")
    p.add_argument("--plot", help="write the bar chart PNG here (default with --out: OUT with .png)")
    p.add_argument("--log", help="the JSONL probe log (default with --out: OUT.probes.jsonl)")
    p.add_argument("--resume", action="store_true", help="reuse the probe log's records of this very search")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")


def main(args: argparse.Namespace, command: str = "") -> int:
    """Run the search the parsed flags describe; print the table, write the JSON, log and PNG asked for."""
    from .cli import _overrides

    if args.threads:
        torch.set_num_threads(args.threads)
    if not getattr(args, "verbose", False):
        logging.getLogger("zoomem").setLevel(logging.WARNING)  # a plan per probe: its log lines would drown the bars
    sizes = {n: getattr(args, n) for n in ("seq_len", "image_size", "num_nodes", "num_edges")
             if getattr(args, n, None) is not None}
    out = Path(args.out) if args.out else None
    log_path = args.log or (str(out) + ".probes.jsonl" if out else None)
    if args.resume and not log_path:
        raise ValueError("--resume needs a probe log: pass --out or --log.")
    config = SearchConfig(device=args.device, seed=args.seed, foreach=args.foreach, time_steps=args.time_steps,
                          time_limit=args.time_limit, compile_budget=args.compile_budget,
                          compile_timeout=args.compile_timeout, isolate=args.isolate, skip_logits=args.skip_logits)
    data = run(args.model, args.budget, args.methods, dim=args.dim, overrides=_overrides(args.set), sizes=sizes,
               batch_size=args.batch, config=config, start=args.start, cap=args.cap, rtol=args.rtol,
               ref_value=args.ref_value, log=ProbeLog(log_path, args.resume), progress=args.progress,
               command=command)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    plot = args.plot or (str(out.with_suffix(".png")) if out else None)
    if plot:
        plot_results(data, plot)
    print(format_results(data, args.markdown))
    return 1 if any(r.get("error") and r["method"] != "compile" for r in data["results"]) else 0


def command_line(prog: str, argv: Sequence[str]) -> str:
    return " ".join([prog, *(shlex.quote(a) for a in argv)])
