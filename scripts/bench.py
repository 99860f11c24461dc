#!/usr/bin/env python
"""zoomem benchmarks, one subcommand each; numbers come from :mod:`zoomem.measure` (DESIGN.md section 8).

Subcommands:

- ``baseline``: plain PyTorch's training step (AdamW, foreach) for every model of ``zoo.ZOO_MATRIX``, at
  realistic CPU-feasible sizes (:data:`BASELINE_SIZES`) or, with ``--quick``, the ``zoo.small`` variants.

    python scripts/bench.py baseline [--quick] [--models ID ...] [--out benchmarks/baseline.json] [--markdown]

Each model is built with random weights (nothing is downloaded), stepped twice with AdamW, each step measured by
``measure_step``; the second step (optimizer state already created: the steady state) is reported. Progress goes
to stderr (tqdm), the table to stdout, the full reports to the JSON file (with each step's wall time, profiler on: a
feasibility figure, not an overhead measure).

- ``sweep``: peak memory against step-time overhead, per model (:data:`SWEEP_SIZES`), all methods in one
  process: plain PyTorch, the zoo's own full checkpointing, ``torch.compile`` with an activation memory budget
  (where it runs), zoomem's ILP at 100..40% of PyTorch's peak and at the minimum feasible budget, zoomem's
  ``all`` and ``sqrt``. Plans are made before any timing; steps are timed without the meter, interleaved (one step
  of each method per round, order rotated), the median over ``--steps`` rounds after ``--warmup``; one more metered
  step per method gives the forward+backward peak. Then the ILP solve time on BERT-large and ResNet-152 at batch
  32 (:data:`SOLVE_SIZES`). Writes a JSON, a PNG (peak against overhead, one subplot per model) and prints the
  tables and the project's targets, judged on the numbers.

    python scripts/bench.py sweep [--quick] [--models ID ...] [--steps 5] [--out benchmarks/sweep.json]
        [--plot benchmarks/sweep.png] [--markdown]

- ``compress``: activation compression, per model (:data:`COMPRESS_SIZES`), all in one process: plain PyTorch, every
  level ``L0`` .. ``L3`` (``zoomem.wrap(level=...)``), and at budgets of 90..30% of PyTorch's peak (plus the minimum
  feasible one) lossless planning (``wrap(budget=...)``) and the combined mode (``wrap(budget=...,
  compress="auto")``), both modes again just below the peak of each lossy level and lossless plan (``--matched``,
  the default: each of those then meets a plan of both modes at its own memory). The model is wrapped once; every
  other plan comes from ``zoomem.plan`` on it and is put in the wrap's plan cache while it runs. Reports activation
  bytes against PyTorch's (the issue's goals: >= 8x at L2.2, >= 6x at L2), measured peaks, step-time overheads
  (interleaved, medians, one torch thread by default), and per budget and per overhead cap whether the combined mode
  gets lower than either alone.

    python scripts/bench.py compress [--quick] [--models ID ...] [--levels L ...] [--fractions F ...] [--steps 3]
        [--out benchmarks/compress.json] [--markdown]

- ``accuracy``: issue 4's accuracy claim on real data (``zoomem.tasks``: digits, text, graph): per task and seed,
  plain PyTorch (L0) and each level trained with the same seed and steps; per seed and on the mean over seeds,
  the level's accuracy minus L0's, judged against the allowed drop (L2 0.5 points, L1.2 2 points).

    python scripts/bench.py accuracy [--quick] [--tasks digits text graph] [--seeds 0 1 2 3 4] [--levels L2 L1.2]
        [--out benchmarks/accuracy.json] [--markdown]

- ``quantizer``: the quantizer's speed, ns per byte of fp32 to quantize and dequantize tensors shaped like the
  ``compress`` models' activations, per width, beside the planner's probe (``seconds_per_byte``); ``--against REV``
  loads ``zoomem/compress/quantize.py`` of a git revision and alternates it with this checkout's in one process.

    python scripts/bench.py quantizer [--quick] [--bits 1 2 4 8] [--against REV] [--out benchmarks/quantizer.json]
        [--markdown]

- ``scale``: planning a batch from traces of smaller ones (``trace_batch_size``, what zoomem does when a plain step
  at the batch runs out of memory), per model (:data:`SCALE_SIZES`): the cost model traced at the batch against
  the one extrapolated from traces at a quarter and a half of it (``--trace-fraction``), compared on the peaks they predict for
  keeping, recomputing and cheaply recomputing every unit (and with the plain step's measured peak), the time each
  takes to build, and a budgeted plan made from the extrapolated costs, measured at the batch.

    python scripts/bench.py scale [--quick] [--models ID ...] [--fraction 0.6] [--trace-fraction 0.5]
        [--out benchmarks/scale.json] [--markdown]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from zoomem.benchtools import (  # shared with zoomem.maxbatch
    Alarm as _Alarm, exc_text as _exc_text, git_info as _git_info, grid as _grid, machine_info,
    machine_line as _machine_line, median as _median, result_head as _result_head, train_step as _train_step,
)

logger = logging.getLogger("bench")

MIB = 1024 * 1024


@dataclass(frozen=True)
class BenchSize:
    """Build overrides, batch size and ``example_batch`` sizes of one model in a benchmark."""

    batch_size: int
    sizes: dict[str, int] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)


_IMG224 = {"image_size": 224}
_GRAPH20K = BenchSize(1, {"num_nodes": 20_000, "num_edges": 200_000})  # one graph; 10 random edges per node

BASELINE_SIZES: dict[str, BenchSize] = {
    "timm/resnet18": BenchSize(8, _IMG224),
    "timm/resnet50": BenchSize(8, _IMG224),
    "timm/mobilenetv2_100": BenchSize(8, _IMG224),
    "timm/efficientnet_b0": BenchSize(8, _IMG224),
    "timm/convnext_atto": BenchSize(8, _IMG224),
    "timm/vit_tiny_patch16_224": BenchSize(8, _IMG224),
    "hf/bert-base-uncased": BenchSize(8, {"seq_len": 128}),
    "hf/gpt2": BenchSize(4, {"seq_len": 128}),
    "hf/llama": BenchSize(4, {"seq_len": 128}),
    "hf/t5-small": BenchSize(8, {"seq_len": 128}),
    "hf/bart-base": BenchSize(8, {"seq_len": 128}),
    "hf/vit-base-patch16-224": BenchSize(4, _IMG224),
    "pyg/gcn": _GRAPH20K,
    "pyg/gat": _GRAPH20K,
    "pyg/sage": _GRAPH20K,
    "pyg/gin": _GRAPH20K,
}
"""Default ``baseline`` sizes: the real layouts (timm defaults with 1000 classes, the catalogue's HF layouts and
PyG constructor defaults), at batch sizes a 2-core CPU steps in seconds."""


# -- baseline ---------------------------------------------------------------------------------------------------


def _param_bytes(model: Any) -> int:
    seen: dict[int, int] = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _sizes_of(batch: Any, spec: BenchSize, model_id: str) -> dict[str, int]:
    """The sizes the batch really has (read from its tensors where the adapter chose a default)."""
    sizes = dict(spec.sizes)
    if model_id.startswith("pyg/"):
        x, edge_index = batch.args[0], batch.args[1]
        sizes = {"num_nodes": int(x.shape[0]), "num_edges": int(edge_index.shape[1])}
    return sizes


def baseline_one(model_id: str, quick: bool, seed: int, foreach: bool, steps: int = 2) -> dict[str, Any]:
    """Build ``model_id`` and measure ``steps`` plain training steps; report the last one."""
    import torch

    from zoomem import zoo
    from zoomem.measure import measure_step

    t0 = time.perf_counter()
    if quick:
        small = zoo.SMALL[model_id]
        spec = BenchSize(small.batch_size, dict(small.sizes), dict(small.overrides))
        model, adapter, batch = zoo.small(model_id, seed=seed)
    else:
        spec = BASELINE_SIZES[model_id]
        torch.manual_seed(seed)
        model, adapter = zoo.build(model_id, **spec.overrides)
        batch = adapter.example_batch(model, spec.batch_size, **spec.sizes)
    params = _param_bytes(model)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
    build_s = time.perf_counter() - t0

    def loss_fn(output: Any, b: Any) -> torch.Tensor:
        return adapter.loss(model, b, output)

    step_s: list[float] = []
    report = None
    for _ in range(steps):
        t = time.perf_counter()
        report = measure_step(model, batch, loss_fn, optimizer)
        step_s.append(time.perf_counter() - t)
    assert report is not None
    ph = report.phases
    fwd_bwd_peak = max(ph["forward"].peak_bytes, ph["backward"].peak_bytes)
    return {
        "id": model_id,
        "variant": "small" if quick else "default",
        "batch_size": spec.batch_size,
        "sizes": _sizes_of(batch, spec, model_id),
        "overrides": spec.overrides,
        "num_params": n_params,
        "param_mib": params / MIB,
        "baseline_mib": report.baseline_bytes / MIB,
        "activation_mib": report.activation_bytes / MIB,
        "fwd_bwd_peak_mib": fwd_bwd_peak / MIB,
        "optimizer_peak_mib": ph["optimizer"].peak_bytes / MIB,
        "step_peak_mib": report.peak_bytes / MIB,
        "build_s": build_s,
        "step_s": step_s,
        "report": report.to_dict(),
    }


def _mib(v: float) -> str:
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


_SIZE_ABBR = {"image_size": "img", "seq_len": "seq", "num_nodes": "nodes", "num_edges": "edges"}


def _size_text(r: dict[str, Any]) -> str:
    parts = [f"b{r['batch_size']}"] + [f"{_SIZE_ABBR.get(k, k)} {v}" for k, v in r["sizes"].items()]
    return ", ".join(parts)


BASELINE_COLUMNS = (
    ("model", lambda r: r["id"]),
    ("sizes", _size_text),
    ("params MiB", lambda r: _mib(r['param_mib'])),
    ("baseline MiB", lambda r: _mib(r['baseline_mib'])),
    ("activations MiB", lambda r: _mib(r['activation_mib'])),
    ("fwd+bwd peak MiB", lambda r: _mib(r['fwd_bwd_peak_mib'])),
    ("optimizer peak MiB", lambda r: _mib(r['optimizer_peak_mib'])),
    ("step peak MiB", lambda r: _mib(r['step_peak_mib'])),
)


def format_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[tuple[str, Callable[[dict[str, Any]], str]]],
    markdown: bool,
) -> str:
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["id"], f"FAILED: {r['error']}"] + [""] * (len(columns) - 2))
        else:
            cells.append([fn(r) for _, fn in columns])
    heads = [h for h, _ in columns]
    if markdown:
        rule = "|" + "|".join("---" if i < 2 else "---:" for i in range(len(heads))) + "|"
        lines = ["| " + " | ".join(heads) + " |", rule]
        lines += ["| " + " | ".join([f"`{c[0]}`", *c[1:]]) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    fmt = lambda row: "  ".join(  # noqa: E731
        (v.ljust(w) if i < 2 else v.rjust(w)) for i, (v, w) in enumerate(zip(row, widths))
    )
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells])


def cmd_baseline(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from zoomem import zoo

    models = args.models or list(zoo.ZOO_MATRIX)
    known = zoo.SMALL if args.quick else BASELINE_SIZES
    unknown = [m for m in models if m not in known]
    if unknown:
        print(f"bench: no {'small variant' if args.quick else 'baseline size'} for {unknown}; "
              f"known: {', '.join(known)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    command = "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv)
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    bar = tqdm(models, desc="baseline", unit="model", file=sys.stderr, dynamic_ncols=True)
    for model_id in bar:
        bar.set_postfix_str(model_id)
        try:
            r = baseline_one(model_id, args.quick, args.seed, args.foreach)
        except Exception as exc:  # noqa: BLE001 - one failing model must not lose the others' numbers
            logger.exception("%s failed", model_id)
            r = {"id": model_id, "error": f"{type(exc).__name__}: {exc}"}
        else:
            bar.write(f"{model_id}: step peak {r['step_peak_mib']:.1f} MiB, activations {r['activation_mib']:.1f} MiB, "
                      f"step {r['step_s'][-1]:.1f} s", file=sys.stderr)
        rows.append(r)
    wall = time.perf_counter() - t0
    machine = machine_info()
    payload = {
        "benchmark": "baseline",
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine,
        "wall_s": wall,
        "settings": {
            "quick": args.quick,
            "seed": args.seed,
            "optimizer": f"torch.optim.AdamW(lr=1e-3, weight_decay=0.01, foreach={args.foreach})",
            "steps": 2,
            "reported_step": 2,
            "meter": "zoomem.measure.measure_step (CPU: PyTorch profiler allocator trace)",
        },
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    logger.info("wrote %s", out)
    if args.markdown:
        print(f"`{command}` on {_machine_line(machine)}, {started:%Y-%m-%d}, {wall:.0f} s in all:\n")
    else:
        print(f"{command}\n{_machine_line(machine)}, {started:%Y-%m-%d %H:%M} UTC, {wall:.0f} s in all\n")
    print(format_table(rows, BASELINE_COLUMNS, args.markdown))
    return 1 if any("error" in r for r in rows) else 0


# -- sweep: peak memory against overhead -------------------------------------------------------------------------

SWEEP_SIZES: dict[str, BenchSize] = {
    "timm/resnet50": BenchSize(16, _IMG224),
    "hf/bert-base-uncased": BenchSize(4, {"seq_len": 512}, {"num_hidden_layers": 4}),
    "hf/gpt2": BenchSize(2, {"seq_len": 512}, {"n_layer": 4}),
    "pyg/gcn": BenchSize(1, {"num_nodes": 100_000, "num_edges": 1_000_000}),
    "timm/vit_tiny_patch16_224": BenchSize(32, _IMG224),
    "hf/bert-large-uncased": BenchSize(2, {"seq_len": 512}, {"num_hidden_layers": 4}),
    "hf/bert-base-uncased-mlm": BenchSize(4, {"seq_len": 512}, {"num_hidden_layers": 4}),
    "hf/bart-base": BenchSize(4, {"seq_len": 512}, {"encoder_layers": 2, "decoder_layers": 2}),
}
"""Default ``sweep`` sizes: batches at which activations are most of plain PyTorch's forward+backward peak while
one step stays within seconds on a 2-core CPU. The HF layouts keep 4 of their layers (12 for BERT-base and GPT-2,
24 for BERT-large; hidden sizes, heads, vocabularies as released) so that a step at sequence length 512 fits that
time. ResNet-50, BERT-base, GPT-2 and the GCN are issue 3's models; ViT and BERT-large complete issue 6's set;
BERT-base with its masked-LM head (vocabulary-sized logits, as pretrained) is the classification layout's twin;
BART-base (2+2 of its 6+6 layers) the encoder-decoder whose loss reads the head's output plus a bias buffer."""

_FULL_LAYERS = {"hf/bert-base-uncased": (("num_hidden_layers", 12),), "hf/gpt2": (("n_layer", 12),),
                "hf/bert-base-uncased-mlm": (("num_hidden_layers", 12),),
                "hf/bert-large-uncased": (("num_hidden_layers", 24),),
                "hf/bart-base": (("encoder_layers", 6), ("decoder_layers", 6))}
"""Layer-count fields of the HF layouts and their released values (encoder and decoder for BART)."""

SWEEP_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
"""zoomem ILP budgets, as fractions of plain PyTorch's forward+backward peak (the one zoomem's trace measures)."""
BELOW_ALL = 0.98
"""One more ILP budget: this fraction of the peak zoomem predicts for ``all`` (every unit recomputed, what the zoos'
full checkpointing does): the cheapest plan that beats full checkpointing on memory."""
QUICK_FRACTIONS = (1.0, 0.6)
"""``--quick``: two fractions (the small variants' fixed bytes often put 60% below the minimum: then skipped), plus
the minimum feasible budget."""

SOLVE_SIZES: dict[str, BenchSize] = {
    "hf/bert-large-uncased": BenchSize(32, {"seq_len": 128}),
    "timm/resnet152": BenchSize(32, _IMG224),
}
"""The ILP solve-time check: real layouts at batch 32 (BERT-large at sequence length 128)."""

COMPILE_MODELS = tuple(SWEEP_SIZES)
"""Models the sweep tries ``torch.compile`` (with an activation memory budget) on: every one, as issue 3 asks
("where it runs"); one that does not compile within ``--compile-timeout`` is reported so. (Until stop 29 only
ResNet-50; the GCN, ViT-Tiny, BERT-base, GPT-2 and BERT-large were then measured with ``--compile-models``,
BENCHMARKS.md.)"""

TARGET_OVERHEAD = 1.10
TARGET_PEAK_RATIO = 1 / 3
TARGET_SOLVE_S = 10.0
TARGET_A_MODELS = ("timm/resnet50", "hf/bert-base-uncased")


class _CostsPlanner:
    """Plans many budgets from one trace, as ``zoomem.plan`` does for one (trace, cost model, ``make_plan``).

    ``zoomem.plan`` traces the step (two extra steps) on each call; a sweep of ten budgets traces once.
    """

    def __init__(self, model: Any, batch: Any, adapter: Any, loss_fn: Any, optimizer: Any, time_limit: float):
        from zoomem.optimizer import footprint
        from zoomem.planner import Decision
        from zoomem.runtime.wrap import cost_model

        t0 = time.perf_counter()  # the trace, and the step once more with the compact implementations on
        self.costs, self.chosen, _ = cost_model(model, batch, adapter, None, loss_fn)
        self.trace_s = time.perf_counter() - t0
        # the optimizer's state, not its step: the curves are of forward+backward peaks, as the issue's targets
        self.costs.fixed_bytes += footprint(optimizer).state
        self.baseline = self.costs.peak({u: Decision.KEEP for u in self.costs.units})
        self.time_limit = time_limit
        self.min_budget: int | None = None
        self.min_search_s = 0.0

    def plan(self, budget: int | None, strategy: str = "ilp") -> Any:
        from zoomem.planner import make_plan

        return make_plan(self.costs, budget, strategy=strategy, time_limit=self.time_limit)

    def find_min_budget(self) -> int:
        """``InfeasibleBudgetError.min_budget`` of a budget no plan meets (1 byte)."""
        import zoomem

        t0 = time.perf_counter()
        try:
            self.plan(1)
        except zoomem.InfeasibleBudgetError as exc:
            self.min_budget = int(exc.min_budget)
        else:  # pragma: no cover - a 1-byte budget cannot be met
            raise RuntimeError("a 1-byte budget was reported feasible")
        self.min_search_s = time.perf_counter() - t0
        return self.min_budget

    def plan_min(self) -> Any:
        """The ILP plan at the minimum feasible budget (nudged up by 0.01% steps if rounding makes it miss)."""
        import zoomem

        assert self.min_budget is not None
        budget = self.min_budget
        for _ in range(5):
            try:
                return self.plan(budget)
            except zoomem.InfeasibleBudgetError:
                budget = int(budget * 1.0001) + 1
        return self.plan(budget)


def _plan_info(plan: Any) -> dict[str, Any]:
    from zoomem.planner import Decision

    return {
        "strategy": plan.strategy,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_mib": plan.predicted_peak_bytes / MIB,
        "predicted_pytorch_peak_mib": plan.baseline_peak_bytes / MIB,
        "predicted_overhead": plan.overhead,
        "lp_bound_s": plan.lp_bound,  # the relaxation's recompute seconds: how far from proven the plan may be
        "solve_s": plan.solve_s,
        "solver": plan.solver,
        "status": plan.status,
        "units": len(plan.units),
        "recomputed": sum(u.decision == Decision.RECOMPUTE for u in plan.units),
        "recomputed_cheap": sum(u.decision == Decision.RECOMPUTE_CHEAP for u in plan.units),
        "recomputed_chain": sum(u.decision == Decision.RECOMPUTE_CHAIN for u in plan.units),
        "compact": sum(bool(u.compact) for u in plan.units),
    }


@dataclass
class _Method:
    """One way to run the training step; ``enter``/``leave`` switch the shared model to it and back."""

    key: str
    label: str
    kind: str  # "pytorch", "peer" or "zoomem"
    model: Any
    optimizer: Any
    loss_fn: Any
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    budget: str = "—"
    budget_frac: float | None = None
    plan: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    report: Any = None
    error: str | None = None


def _zoomem_switch(model: Any, plan: Any, batch: Any, adapter: Any, optimizer: Any, loss_fn: Any,
                   chosen: Any = None):
    """``enter``/``leave`` that wrap the model with a plan made beforehand (no re-trace) and unwrap it;
    ``chosen``: the planner's compact implementations, installed behind the plan's switches as wrap does."""
    import zoomem
    from zoomem.runtime.wrap import install_impls, plan_key

    sig = plan_key(batch)  # a training step that starts without gradients

    def enter() -> None:
        zoomem.wrap(model, plan.budget_bytes, strategy=plan.strategy, adapter=adapter, optimizer=optimizer,
                    loss_fn=loss_fn)
        handle = model.__dict__["_zoomem"]
        if chosen:
            install_impls(handle, chosen)
        handle.plans[sig] = plan

    def leave() -> None:
        plans = model.__dict__["_zoomem"].plans
        zoomem.unwrap(model)
        if len(plans) != 1 or next(iter(plans.values())) is not plan:
            raise RuntimeError("zoomem planned again inside the sweep (the batch signature changed?)")

    return enter, leave


def _native_switch(model: Any, adapter: Any):
    def enter() -> None:
        adapter.set_native_checkpointing(model, True)

    def leave() -> None:
        adapter.set_native_checkpointing(model, False)

    return enter, leave


def _time_interleaved(methods: Sequence[_Method], batch: Any, warmup: int, steps: int,
                      say: Callable[[str], None]) -> list[float]:
    """Time ``methods`` interleaved: one training step of each per round, the order rotated every round, the
    first ``warmup`` rounds untimed; appends to each method's ``times``/``cpu_times``; returns the load average
    after each round."""
    rounds = warmup + steps
    load: list[float] = []
    for r in range(rounds):
        order = list(methods[r % len(methods):]) + list(methods[: r % len(methods)])
        for m in order:
            m.enter()
            try:
                t, c = time.perf_counter(), time.process_time()
                _train_step(m.model, batch, m.loss_fn, m.optimizer)
                dt, dc = time.perf_counter() - t, time.process_time() - c
            finally:
                m.leave()
            if r >= warmup:
                m.times.append(dt)
                m.cpu_times.append(dc)
        load.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
        say(f"round {r + 1}/{rounds} done, load average {load[-1]:.2f}" + (" (warm-up)" if r < warmup else ""))
    return load


def _meter_each(methods: Sequence[_Method], batch: Any) -> None:
    """One more step of each method under ``measure_step``, into its ``report``."""
    import gc

    from zoomem.measure import measure_step

    for m in methods:
        gc.collect()
        m.enter()
        try:
            m.report = measure_step(m.model, batch, m.loss_fn, m.optimizer)
        finally:
            m.leave()


def _compile_method(model: Any, adapter: Any, batch: Any, budget: float, timeout: float) -> _Method:
    """``torch.compile`` of a copy of the model under ``activation_memory_budget``, compiled (first step) now."""
    import copy

    import torch
    import torch._functorch.config as functorch_config

    label = f"torch.compile, activation_memory_budget={budget:g}"
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(twin.parameters(), foreach=True)
    compiled = torch.compile(twin)

    def loss_fn(output: Any, b: Any) -> Any:
        return adapter.loss(twin, b, output)

    m = _Method("compile", label, "peer", compiled, opt, loss_fn)
    patches: list[Any] = []

    def enter() -> None:
        patches.append(functorch_config.patch(activation_memory_budget=budget))
        patches[-1].__enter__()

    def leave() -> None:
        patches.pop().__exit__(None, None, None)

    m.enter, m.leave = enter, leave
    t0 = time.perf_counter()
    try:
        with functorch_config.patch(activation_memory_budget=budget), _Alarm(timeout, "compilation"):
            _train_step(compiled, batch, loss_fn, opt)  # compiles forward and backward
            _train_step(compiled, batch, loss_fn, opt)  # the first step may recompile once (optimizer state)
    except Exception as exc:  # noqa: BLE001 - any failure is a result: "did not run"
        m.error = f"did not run: {_exc_text(exc)}"
        logger.warning("torch.compile on %s: %s", type(model).__name__, m.error)
    m.info["compile_s"] = time.perf_counter() - t0
    m.info["activation_memory_budget"] = budget
    return m


def _spec_of(model_id: str, quick: bool, table: dict[str, BenchSize]) -> BenchSize:
    from zoomem import zoo

    if quick:
        s = zoo.SMALL[model_id]
        return BenchSize(s.batch_size, dict(s.sizes), dict(s.overrides))
    return table[model_id]


def _layers_note(model_id: str, spec: BenchSize, quick: bool) -> str:
    if quick:
        return "zoo.small variant"
    if model_id in _FULL_LAYERS:
        full = [f for _, f in _FULL_LAYERS[model_id]]
        used = [spec.overrides.get(k, f) for k, f in _FULL_LAYERS[model_id]]
        text = lambda ns: "+".join(map(str, ns))  # noqa: E731
        return f"{text(used)} of {text(full)} layers" if used != full else f"{text(full)} layers"
    return "full layout"


def sweep_one(model_id: str, args: argparse.Namespace, bar: Any = None) -> dict[str, Any]:
    """All methods of one model in this process: plan, interleaved timing, then one metered step each."""
    import gc

    import torch

    import zoomem
    from zoomem import zoo

    def say(msg: str) -> None:
        (bar.write if bar is not None else print)(f"{model_id}: {msg}", file=sys.stderr)

    spec = _spec_of(model_id, args.quick, SWEEP_SIZES)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, adapter = zoo.build(model_id, **spec.overrides)
    batch = adapter.example_batch(model, spec.batch_size, **spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=args.foreach)

    def loss_fn(output: Any, b: Any) -> Any:
        return adapter.loss(model, b, output)

    _train_step(model, batch, loss_fn, optimizer)  # creates AdamW's state: every later step is a steady one
    build_s = time.perf_counter() - t0

    # -- plans (before any timing) --
    planner = _CostsPlanner(model, batch, adapter, loss_fn, optimizer, args.time_limit)
    say(f"traced in {planner.trace_s:.1f} s; predicted PyTorch peak {planner.baseline / MIB:.0f} MiB")
    min_budget = planner.find_min_budget()
    say(f"minimum feasible budget {min_budget / MIB:.0f} MiB ({min_budget / planner.baseline:.0%}), "
        f"found in {planner.min_search_s:.1f} s")

    methods: list[_Method] = [_Method("pytorch", "plain PyTorch", "pytorch", model, optimizer, loss_fn)]
    native = _Method("native", "", "peer", model, optimizer, loss_fn)
    if adapter.set_native_checkpointing(model, False):
        native.label = {"transformers": "HF gradient_checkpointing_enable", "timm": "timm set_grad_checkpointing"}.get(
            adapter.name, f"{adapter.name} native checkpointing")
        native.enter, native.leave = _native_switch(model, adapter)
    else:
        p = planner.plan(None, "all")
        native.label = f"full checkpointing ({adapter.name} has none: zoomem `all`)"
        native.plan, native.info = p, _plan_info(p)
        native.enter, native.leave = _zoomem_switch(model, p, batch, adapter, optimizer, loss_fn, planner.chosen)
    methods.append(native)

    skipped: list[dict[str, Any]] = []
    fractions = QUICK_FRACTIONS if args.quick else SWEEP_FRACTIONS
    from zoomem.planner import parse_budget

    for frac in fractions:
        budget = parse_budget(frac, baseline_peak=planner.baseline)
        assert budget is not None
        if budget < min_budget:
            skipped.append({"budget_frac": frac, "budget_bytes": budget,
                            "reason": f"below the minimum feasible budget ({min_budget / MIB:.0f} MiB)"})
            continue
        m = _Method(f"ilp@{frac:.0%}", "zoomem ILP", "zoomem", model, optimizer, loss_fn,
                    budget=f"{frac:.0%}", budget_frac=frac)
        try:
            m.plan = planner.plan(budget)
        except zoomem.InfeasibleBudgetError as exc:
            m.error = f"infeasible: {exc}"
        else:
            m.info = _plan_info(m.plan)
            m.enter, m.leave = _zoomem_switch(model, m.plan, batch, adapter, optimizer, loss_fn, planner.chosen)
        methods.append(m)
    # just under full checkpointing: the cheapest plan that holds less than recomputing every unit does (zoomem's
    # `all` predicts the zoos' own full checkpointing to 0.1 MiB; measured peaks are the judge)
    below_all = int(BELOW_ALL * planner.plan(None, "all").predicted_peak_bytes)
    if below_all >= min_budget:
        m = _Method("ilp@below-all", "zoomem ILP", "zoomem", model, optimizer, loss_fn,
                    budget=f"{BELOW_ALL:.0%} of `all`", budget_frac=below_all / planner.baseline)
        m.plan = planner.plan(below_all)
        m.info = _plan_info(m.plan)
        m.enter, m.leave = _zoomem_switch(model, m.plan, batch, adapter, optimizer, loss_fn, planner.chosen)
        methods.append(m)
    else:
        skipped.append({"budget_frac": below_all / planner.baseline, "budget_bytes": below_all,
                        "reason": f"{BELOW_ALL:.0%} of `all` is below the minimum feasible budget"})
    m = _Method("ilp@min", "zoomem ILP", "zoomem", model, optimizer, loss_fn,
                budget=f"min ({min_budget / planner.baseline:.0%})", budget_frac=min_budget / planner.baseline)
    m.plan = planner.plan_min()
    m.info = _plan_info(m.plan)
    m.info["min_search_s"] = planner.min_search_s
    m.enter, m.leave = _zoomem_switch(model, m.plan, batch, adapter, optimizer, loss_fn, planner.chosen)
    methods.append(m)
    for strategy in ("all", "sqrt"):
        p = planner.plan(None, strategy)
        m = _Method(strategy, f"zoomem `{strategy}`", "zoomem", model, optimizer, loss_fn, plan=p, info=_plan_info(p))
        m.enter, m.leave = _zoomem_switch(model, p, batch, adapter, optimizer, loss_fn, planner.chosen)
        methods.append(m)

    if args.quick:
        compile_m = None
        compile_note = "not tried (--quick)"
    elif model_id in args.compile_models:
        say("compiling (torch.compile, first steps)")
        compile_m = _compile_method(model, adapter, batch, args.compile_budget, args.compile_timeout)
        methods.insert(2, compile_m)
        compile_note = compile_m.error or f"compiled in {compile_m.info['compile_s']:.0f} s"
        say(f"torch.compile: {compile_note}")
    else:
        compile_m = None
        compile_note = f"not tried (the sweep tries torch.compile on {', '.join(args.compile_models) or 'no model'})"

    runnable = [m for m in methods if m.error is None]
    load = _time_interleaved(runnable, batch, args.warmup, args.steps, say)
    _meter_each(runnable, batch)

    ref = methods[0]
    ref_time = _median(ref.times)
    ref_peak = _fwd_bwd(ref.report)
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m.key, "label": m.label, "kind": m.kind, "budget": m.budget,
                               "budget_frac": m.budget_frac, **m.info}
        if m.error is not None:
            row["error"] = m.error
        else:
            rep = m.report
            peak = _fwd_bwd(rep)
            row.update({
                "fwd_bwd_peak_mib": peak / MIB,
                "pct_of_pytorch": 100.0 * peak / ref_peak,
                "activation_mib": rep.activation_bytes / MIB,
                "optimizer_peak_mib": rep.phases["optimizer"].peak_bytes / MIB,
                "step_peak_mib": rep.peak_bytes / MIB,
                "step_s": m.times,
                "median_step_s": _median(m.times),
                "step_cpu_s": m.cpu_times,
                "cpu_overhead": _median(m.cpu_times) / _median(ref.cpu_times),
                "overhead": _median(m.times) / ref_time,
                "report": rep.to_dict(),
            })
        rows.append(row)
    if compile_m is None:
        rows.insert(2, {"method": "compile", "label": f"torch.compile, activation_memory_budget={args.compile_budget:g}",
                        "kind": "peer", "budget": "—", "budget_frac": None, "error": compile_note})
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    result = {
        "id": model_id,
        "variant": "small" if args.quick else "sweep",
        "layers": _layers_note(model_id, spec, args.quick),
        "batch_size": spec.batch_size,
        "sizes": _sizes_of(batch, spec, model_id),
        "overrides": spec.overrides,
        "num_params": n_params,
        "param_mib": _param_bytes(model) / MIB,
        "build_s": build_s,
        "trace_s": planner.trace_s,
        "predicted_pytorch_peak_mib": planner.baseline / MIB,
        "min_budget_mib": min_budget / MIB,
        "min_budget_frac": min_budget / planner.baseline,
        "min_search_s": planner.min_search_s,
        "pytorch_median_step_s": ref_time,
        "load_average_per_round": load,
        "skipped_budgets": skipped,
        "methods": rows,
    }
    del methods, runnable, planner, model, optimizer
    gc.collect()
    return result


def _fwd_bwd(report: Any) -> int:
    ph = report.phases
    return max(ph["forward"].peak_bytes, ph["backward"].peak_bytes)


# -- solve time ---------------------------------------------------------------------------------------------------


def solve_one(model_id: str, batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Trace one step of ``model_id`` at ``batch_size`` and time the ILP at every sweep budget and the minimum."""
    import gc

    import torch

    import zoomem
    from zoomem import zoo
    from zoomem.planner import parse_budget

    spec = SOLVE_SIZES[model_id]
    torch.manual_seed(args.seed)
    model, adapter = zoo.build(model_id, **spec.overrides)
    batch = adapter.example_batch(model, batch_size, **spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=args.foreach)  # no state yet: Adam's 2x params counted
    loss_fn = lambda output, b: adapter.loss(model, b, output)  # noqa: E731
    with _Alarm(args.trace_timeout, "the trace"):
        planner = _CostsPlanner(model, batch, adapter, loss_fn, optimizer, args.time_limit)
    print(f"{model_id} b{batch_size}: traced in {planner.trace_s:.0f} s", file=sys.stderr, flush=True)
    del batch
    gc.collect()
    min_budget = planner.find_min_budget()
    solves: list[dict[str, Any]] = []
    for frac in SWEEP_FRACTIONS:
        budget = parse_budget(frac, baseline_peak=planner.baseline)
        if budget < min_budget:
            continue
        try:
            p = planner.plan(budget)
        except zoomem.InfeasibleBudgetError as exc:
            solves.append({"budget": f"{frac:.0%}", "budget_frac": frac, "error": str(exc)})
            continue
        solves.append({"budget": f"{frac:.0%}", "budget_frac": frac, **_plan_info(p)})
    p = planner.plan_min()
    solves.append({"budget": f"min ({min_budget / planner.baseline:.0%})", "budget_frac": min_budget / planner.baseline,
                   **_plan_info(p)})
    times = [s["solve_s"] for s in solves if "solve_s" in s]
    return {
        "id": model_id,
        "layers": _layers_note(model_id, spec, False),
        "batch_size": batch_size,
        "sizes": dict(spec.sizes),
        "units": len(planner.costs.units),
        "memory_points": len(planner.costs.points),
        "storages": len(planner.costs.storages),
        "trace_s": planner.trace_s,
        "predicted_pytorch_peak_mib": planner.baseline / MIB,
        "min_budget_mib": min_budget / MIB,
        "min_search_s": planner.min_search_s,
        "min_search": "time to the InfeasibleBudgetError of a 1-byte budget (the failed ILP, then the minimum-peak "
                      "ILP that names the smallest feasible budget)",
        "max_solve_s": max(times) if times else None,
        "solves": solves,
    }


def cmd_solve_child(args: argparse.Namespace) -> int:
    """Hidden subcommand: :func:`solve_one` in a process of its own (the parent retries smaller on a timeout)."""
    try:
        result = solve_one(args.model, args.batch_size, args)
    except Exception as exc:  # noqa: BLE001
        logger.exception("solve %s b%d failed", args.model, args.batch_size)
        result = {"id": args.model, "batch_size": args.batch_size, "error": f"{type(exc).__name__}: {exc}"}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def solve_section(models: Sequence[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each model in a child process; a trace over ``--trace-timeout`` retries at half the batch, said so."""
    import subprocess
    import tempfile

    out: list[dict[str, Any]] = []
    for model_id in models:
        batch_size = SOLVE_SIZES[model_id].batch_size
        attempts: list[dict[str, Any]] = []
        while True:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "solve.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "_solve", model_id, str(batch_size),
                       "--out", str(path), "--seed", str(args.seed), "--time-limit", str(args.time_limit),
                       "--trace-timeout", str(args.trace_timeout)]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, stderr=None, timeout=args.trace_timeout + 1800)
                wall = time.perf_counter() - t0
                if path.exists():
                    r = json.loads(path.read_text())
                else:
                    r = {"id": model_id, "batch_size": batch_size,
                         "error": f"the child process exited with {proc.returncode} and no result (out of memory?)"}
            r["wall_s"] = wall
            if "error" not in r:
                break
            attempts.append(r)
            print(f"{model_id} b{batch_size}: {r['error']}", file=sys.stderr, flush=True)
            if batch_size <= 4:
                break
            batch_size //= 2
        if attempts and "error" not in r:
            r["smaller_batch_because"] = [f"b{a['batch_size']}: {a['error']}" for a in attempts]
        out.append(r)
    return out


# -- targets, tables, plot ----------------------------------------------------------------------------------------


def _ok_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in result.get("methods", []) if "error" not in m]


def evaluate_targets(results: Sequence[dict[str, Any]], solve: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The project's targets, judged on the measured numbers (ILP points are zoomem's curve)."""
    a, b = [], []
    for r in results:
        if "error" in r:
            continue
        rows = _ok_rows(r)
        ref = next(m for m in rows if m["method"] == "pytorch")
        ilp = [m for m in rows if m["method"].startswith("ilp@")]
        if r["id"] in TARGET_A_MODELS:
            within = [m for m in ilp if m["overhead"] <= TARGET_OVERHEAD]
            best = min(within, key=lambda m: m["fwd_bwd_peak_mib"]) if within else None
            entry = {"id": r["id"], "pytorch_peak_mib": ref["fwd_bwd_peak_mib"],
                     "target_peak_mib": ref["fwd_bwd_peak_mib"] * TARGET_PEAK_RATIO}
            if best is None:
                entry.update(met=False, best=None, note=f"no ILP point within {TARGET_OVERHEAD:.2f}x")
            else:
                entry.update(met=best["fwd_bwd_peak_mib"] <= entry["target_peak_mib"], best=best["method"],
                             best_peak_mib=best["fwd_bwd_peak_mib"], best_pct=best["pct_of_pytorch"],
                             best_overhead=best["overhead"])
            # lowest peak at any overhead, and what that costs
            low = min(ilp, key=lambda m: m["fwd_bwd_peak_mib"]) if ilp else None
            if low is not None:
                entry.update(lowest=low["method"], lowest_peak_mib=low["fwd_bwd_peak_mib"],
                             lowest_pct=low["pct_of_pytorch"], lowest_overhead=low["overhead"])
            a.append(entry)
        for peer in (m for m in rows if m["kind"] == "peer"):
            cands = [m for m in ilp if m["overhead"] <= peer["overhead"]]
            best = min(cands, key=lambda m: m["fwd_bwd_peak_mib"]) if cands else None
            entry = {"id": r["id"], "peer": peer["method"], "peer_label": peer["label"],
                     "peer_peak_mib": peer["fwd_bwd_peak_mib"], "peer_overhead": peer["overhead"]}
            if best is None:
                entry.update(met=False, best=None,
                             note=f"no ILP point at or below the peer's overhead {peer['overhead']:.2f}x")
                lower = [m for m in ilp if m["fwd_bwd_peak_mib"] < peer["fwd_bwd_peak_mib"]]
                if lower:
                    q = min(lower, key=lambda m: m["overhead"])
                    entry.update(cheapest_lower=q["method"], cheapest_lower_overhead=q["overhead"],
                                 cheapest_lower_peak_mib=q["fwd_bwd_peak_mib"])
            else:
                entry.update(met=best["fwd_bwd_peak_mib"] < peer["fwd_bwd_peak_mib"], best=best["method"],
                             best_peak_mib=best["fwd_bwd_peak_mib"], best_overhead=best["overhead"])
            b.append(entry)
    c = []
    for s in solve:
        if "error" in s:
            c.append({"id": s["id"], "met": False, "note": s["error"]})
        else:
            c.append({"id": s["id"], "batch_size": s["batch_size"], "max_solve_s": s["max_solve_s"],
                      "min_search_s": s["min_search_s"],
                      "met": s["max_solve_s"] is not None and s["max_solve_s"] <= TARGET_SOLVE_S})
    return {
        "a": {"rule": f"at <= {TARGET_OVERHEAD:.2f}x overhead, ILP peak <= 1/3 of PyTorch's", "models": a},
        "b": {"rule": "for every peer, an ILP point at equal or lower overhead with a lower peak", "peers": b},
        "c": {"rule": f"ILP solve time (Plan.solve_s, each budget) <= {TARGET_SOLVE_S:g} s", "models": c},
    }


def _fmt_overhead(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def sweep_table(result: dict[str, Any], markdown: bool) -> str:
    heads = ["method", "budget", "measured peak MiB", "% of PyTorch", "activations MiB", "predicted MiB",
             "overhead x", "solve s"]
    cells = []
    for m in result["methods"]:
        name = m["label"] if m["kind"] != "zoomem" or m["method"] in ("all", "sqrt") else "zoomem ILP"
        if "error" in m:
            cells.append([name, m["budget"], m["error"], "", "", "", "", ""])
            continue
        pred = m.get("predicted_peak_mib")
        cells.append([
            name, m["budget"], _mib(m["fwd_bwd_peak_mib"]), f"{m['pct_of_pytorch']:.0f}%", _mib(m["activation_mib"]),
            "—" if pred is None else _mib(pred), _fmt_overhead(m["overhead"]),
            f"{m['solve_s']:.2f}" if "solve_s" in m else "—",
        ])
    return _grid(heads, cells, markdown)


def _model_head(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['id']}: FAILED: {r['error']}"
    return (f"{r['id']} ({r['layers']}; {_size_text(r)}; {r['param_mib']:.0f} MiB of parameters; "
            f"plain PyTorch {r['pytorch_median_step_s']:.2f} s/step; trace {r['trace_s']:.1f} s; "
            f"minimum feasible budget {r['min_budget_mib']:.0f} MiB = {r['min_budget_frac']:.0%} of the predicted "
            f"PyTorch peak)")


def solve_table(solve: Sequence[dict[str, Any]], markdown: bool) -> str:
    heads = ["model", "batch", "units", "trace s", "budgets solved", "max solve s", "solve s per budget",
             "min-budget search s"]
    cells = []
    for s in solve:
        if "error" in s:
            cells.append([s["id"], f"b{s['batch_size']}", "", "", "", "", f"FAILED: {s['error']}", ""])
            continue
        per = ", ".join(f"{x['budget'].split(' ')[0]} {x['solve_s']:.1f}" for x in s["solves"] if "solve_s" in x)
        sizes = ", ".join(f"{_SIZE_ABBR.get(k, k)} {v}" for k, v in s["sizes"].items())
        cells.append([s["id"] + f" ({s['layers']})", f"b{s['batch_size']}, {sizes}", str(s["units"]),
                      f"{s['trace_s']:.0f}", str(sum('solve_s' in x for x in s["solves"])),
                      f"{s['max_solve_s']:.2f}", per, f"{s['min_search_s']:.1f}"])
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|---|---|" + "---:|" * 4 + "---|---:|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    return "\n".join("  ".join(c) for c in [heads] + cells)


def targets_text(t: dict[str, Any]) -> str:
    yes = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
    lines = [f"(a) {t['a']['rule']}:"]
    for e in t["a"]["models"]:
        if e.get("best") is None:
            lines.append(f"  - {e['id']}: {yes(False)}: {e['note']}")
            continue
        s = (f"  - {e['id']}: {yes(e['met'])}: best within {TARGET_OVERHEAD:.2f}x is {e['best']} at "
             f"{e['best_peak_mib']:.0f} MiB = {e['best_pct']:.0f}% of PyTorch's {e['pytorch_peak_mib']:.0f} MiB "
             f"({e['best_overhead']:.2f}x); the target is {e['target_peak_mib']:.0f} MiB")
        if not e["met"]:
            s += f", missed by {e['best_peak_mib'] - e['target_peak_mib']:.0f} MiB"
        if "lowest" in e:
            s += (f". Lowest ILP peak at any overhead: {e['lowest_peak_mib']:.0f} MiB = {e['lowest_pct']:.0f}% "
                  f"({e['lowest']}, {e['lowest_overhead']:.2f}x)")
        lines.append(s)
    lines.append(f"(b) {t['b']['rule']}:")
    for e in t["b"]["peers"]:
        head = f"  - {e['id']} vs {e['peer_label']} ({e['peer_peak_mib']:.0f} MiB, {e['peer_overhead']:.2f}x): "
        if e.get("best") is None:
            s = head + f"{yes(False)}: {e['note']}"
            if "cheapest_lower" in e:
                s += (f"; the cheapest lower ILP point is {e['cheapest_lower']} ({e['cheapest_lower_peak_mib']:.0f} "
                      f"MiB at {e['cheapest_lower_overhead']:.2f}x)")
            lines.append(s)
        else:
            lines.append(head + f"{yes(e['met'])}: {e['best']} {e['best_peak_mib']:.0f} MiB at "
                         f"{e['best_overhead']:.2f}x ({e['best_peak_mib'] - e['peer_peak_mib']:+.1f} MiB)")
    lines.append(f"(c) {t['c']['rule']}:")
    for e in t["c"]["models"]:
        if "max_solve_s" in e:
            s = f"  - {e['id']} b{e['batch_size']}: {yes(e['met'])}: slowest plan {e['max_solve_s']:.2f} s"
            if not e["met"]:
                s += f", {e['max_solve_s'] - TARGET_SOLVE_S:.2f} s over"
            s += f" (finding the minimum feasible budget: {e['min_search_s']:.1f} s)"
            lines.append(s)
        else:
            lines.append(f"  - {e['id']}: {yes(False)}: {e['note']}")
    return "\n".join(lines)


def plot_sweep(results: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    ncols = 2 if len(ok) > 1 else 1
    nrows = (len(ok) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.8 * nrows), squeeze=False)
    short = {"pytorch": "PyTorch", "native": "full ckpt", "compile": "compile", "all": "all", "sqrt": "sqrt"}
    peer_style = {"pytorch": ("*", "black", 14), "native": ("^", "tab:red", 10), "compile": ("P", "tab:purple", 11),
                  "all": ("s", "tab:green", 8), "sqrt": ("D", "tab:olive", 8)}
    for ax, r in zip(axes.flat, ok):
        rows = _ok_rows(r)
        ref = next(m for m in rows if m["method"] == "pytorch")
        ilp = sorted((m for m in rows if m["method"].startswith("ilp@")), key=lambda m: -m["budget_frac"])
        ax.plot([m["overhead"] for m in ilp], [m["fwd_bwd_peak_mib"] for m in ilp], "o-", color="tab:blue",
                label="zoomem ILP (budget % of PyTorch)", zorder=3)
        for m in ilp:
            below = m["method"] == "ilp@below-all"  # beside `min`, often: its label goes under the point
            ax.annotate(m["budget"].replace(" (", "\n(").replace(" of ", "\nof "), (m["overhead"], m["fwd_bwd_peak_mib"]),
                        fontsize=7, xytext=(4, -16 if below else 3), textcoords="offset points", color="tab:blue")
        for m in rows:
            if m["method"] in peer_style:
                marker, color, size = peer_style[m["method"]]
                ax.plot([m["overhead"]], [m["fwd_bwd_peak_mib"]], linestyle="none", marker=marker, color=color,
                        markersize=size, label=m["label"], zorder=4, alpha=0.9)
                ax.annotate(short[m["method"]], (m["overhead"], m["fwd_bwd_peak_mib"]), fontsize=7, color=color,
                            xytext=(5, -11), textcoords="offset points")
        third = ref["fwd_bwd_peak_mib"] * TARGET_PEAK_RATIO
        ax.axhline(third, color="grey", linestyle="--", linewidth=0.8, label="1/3 of PyTorch's peak")
        ax.axvline(TARGET_OVERHEAD, color="grey", linestyle=":", linewidth=0.8, label=f"{TARGET_OVERHEAD:.2f}x")
        ax.set_ylim(bottom=0, top=max(m["fwd_bwd_peak_mib"] for m in rows) * 1.12)
        xs = [m["overhead"] for m in rows] + [1.0, TARGET_OVERHEAD]
        span = max(xs) - min(xs)
        ax.set_xlim(min(xs) - 0.05 * span, max(xs) + 0.15 * span)
        ax.set_title(f"{r['id']} ({r['layers']}; {_size_text(r)})", fontsize=9)
        ax.set_xlabel("step time / plain PyTorch's (median, interleaved)", fontsize=8)
        ax.set_ylabel("measured fwd+bwd peak (MiB)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best", framealpha=0.85)  # "best": the least-covered corner (GCN: top)
    for ax in list(axes.flat)[len(ok):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _known_models(models: Sequence[str], known: Any, quick: bool, what: str) -> bool:
    """Whether every id has a size (or, with ``--quick``, a ``zoo.small`` variant); says which do not."""
    unknown = [m for m in models if m not in known]
    if unknown:
        print(f"bench: no {'small variant' if quick else what} for {unknown}; known: {', '.join(known)}",
              file=sys.stderr)
    return not unknown


def _run_models(models: Sequence[str], one: Callable[..., dict[str, Any]], args: argparse.Namespace,
                desc: str, after_each: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """``one(model_id, args, bar)`` for each model under a tqdm bar; a failing model becomes an error row;
    ``after_each(results so far)`` after each model."""
    from tqdm import tqdm

    results: list[dict[str, Any]] = []
    bar = tqdm(models, desc=desc, unit="model", file=sys.stderr, dynamic_ncols=True)
    for model_id in bar:
        bar.set_postfix_str(model_id)
        tm = time.perf_counter()
        try:
            r = one(model_id, args, bar)
        except Exception as exc:  # noqa: BLE001 - one failing model must not lose the others' numbers
            logger.exception("%s failed", model_id)
            r = {"id": model_id, "error": f"{type(exc).__name__}: {exc}"}
        r["wall_s"] = time.perf_counter() - tm
        results.append(r)
        if after_each is not None:
            after_each(results)
    bar.close()
    return results


def _print_run_head(command: str, machine: dict[str, Any], started: _dt.datetime, wall: float,
                    markdown: bool) -> None:
    if markdown:
        print(f"`{command}` on {_machine_line(machine)}, {started:%Y-%m-%d}, {wall:.0f} s in all:\n")
    else:
        print(f"{command}\n{_machine_line(machine)}, {started:%Y-%m-%d %H:%M} UTC, {wall:.0f} s in all\n")


def cmd_sweep(args: argparse.Namespace) -> int:
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="zoomem-bench-inductor-"))
    import torch

    from zoomem import zoo

    if args.render:
        return render_sweep(json.loads(Path(args.render).read_text()), args)
    if args.plot is None:
        args.plot = "benchmarks/sweep.png"
    models = args.models or list(SWEEP_SIZES)
    if not _known_models(models, zoo.SMALL if args.quick else SWEEP_SIZES, args.quick, "sweep size"):
        return 2
    if args.quick:
        args.steps = min(args.steps, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("zoomem").setLevel(logging.WARNING)
    command = "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv)
    git_info = _git_info()  # at the start: the code the run imports
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    results = _run_models(models, sweep_one, args, "sweep")
    solve: list[dict[str, Any]] = []
    if not args.quick and not args.skip_solve:
        solve = solve_section(args.solve_models, args)
    wall = time.perf_counter() - t0
    machine = machine_info()
    targets = evaluate_targets(results, solve)
    payload = {
        **_result_head("sweep", command, started, wall, git_info, machine),
        "settings": {
            "quick": args.quick,
            "seed": args.seed,
            "optimizer": f"torch.optim.AdamW(lr=1e-3, weight_decay=0.01, foreach={args.foreach})",
            "step": "forward, loss, backward, optimizer.step(), zero_grad(set_to_none=True)",
            "warmup_rounds": args.warmup,
            "timed_rounds": args.steps,
            "timing": "no meter; one step of each method per round, the order rotated each round; median",
            "meter": "one more step per method under zoomem.measure.measure_step (CPU: PyTorch profiler "
                     "allocator trace); peak = max(forward, backward phase peaks), absolute",
            "budget_fractions": list(QUICK_FRACTIONS if args.quick else SWEEP_FRACTIONS),
            "budget_of": "zoomem's float budget: a fraction of plain PyTorch's forward+backward peak as zoomem's trace "
                         "measures it (optimizer state included)",
            "planning": "one zoomem.trace per model, then zoomem.planner.make_plan per budget on its cost model "
                        "(what zoomem.plan does per call); plans installed with zoomem.wrap",
            "solver_time_limit_s": args.time_limit,
            "compile_models": [] if args.quick else list(args.compile_models),
            "compile_activation_memory_budget": args.compile_budget,
        },
        "results": results,
        "solve": solve,
        "targets": targets,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    logger.info("wrote %s", out)
    if args.plot:
        title = f"{command}\n{_machine_line(machine)}, {started:%Y-%m-%d}"
        plot_sweep(results, Path(args.plot), title)
        logger.info("wrote %s", args.plot)
    _print_sweep(command, machine, started, wall, results, solve, targets, args.markdown)
    return 1 if any("error" in r for r in results) or any("error" in s for s in solve) else 0


def render_sweep(data: dict[str, Any], args: argparse.Namespace) -> int:
    """``sweep --render``: the tables (and, with ``--plot``, the PNG) of a sweep JSON written before."""
    started = _dt.datetime.fromisoformat(data["date"])
    if args.plot:
        plot_sweep(data["results"], Path(args.plot), f"{data['command']}\n{_machine_line(data['machine'])}, "
                                                      f"{started:%Y-%m-%d}")
    _print_sweep(data["command"], data["machine"], started, data["wall_s"], data["results"], data["solve"],
                 data["targets"], args.markdown)
    return 0


def _print_sweep(command: str, machine: dict[str, Any], started: Any, wall: float, results: Sequence[dict[str, Any]],
                 solve: Sequence[dict[str, Any]], targets: dict[str, Any], markdown: bool) -> None:
    _print_run_head(command, machine, started, wall, markdown)
    for r in results:
        print(("#### " if markdown else "") + _model_head(r) + "\n")
        if "error" not in r:
            print(sweep_table(r, markdown) + "\n")
    if solve:
        print(("#### " if markdown else "") + "ILP solve time\n")
        print(solve_table(solve, markdown) + "\n")
    print(targets_text(targets))


# -- compress: GACT-style levels, and compression planned with recomputation -----------------------------------------

COMPRESS_SIZES: dict[str, BenchSize] = {
    "timm/resnet50": BenchSize(4, _IMG224),
    "hf/bert-base-uncased": BenchSize(2, {"seq_len": 512}, {"num_hidden_layers": 2}),
    "hf/gpt2": BenchSize(2, {"seq_len": 256}, {"n_layer": 2}),
    "timm/vit_tiny_patch16_224": BenchSize(8, _IMG224),
    "pyg/gcn": _GRAPH20K,
    "pyg/gat": _GRAPH20K,
}
"""Default ``compress`` sizes. Each model is planned about 15 times (every plan traces the step and, when lossy,
probes the sensitivities again) and stepped at every level and budget, so a plain step takes 1-2 s here (one
torch thread). Activations are a quarter to three quarters of plain PyTorch's forward+backward peak at these
sizes (parameters with AdamW's state and gradients are most of the rest; the GCN's peak is message passing's
scratch). The two HF layouts keep 2 of their 12 layers (hidden sizes, heads, vocabularies as released)."""

COMPRESS_LEVELS = ("L0", "L1.1", "L1", "L1.2", "L2", "L2.1", "L2.2", "L3")
"""The levels measured, in the order of the tables (``zoomem.LEVELS``)."""
COMPRESS_FRACTIONS = (0.9, 0.7, 0.5, 0.3)
"""Budgets of the combined-mode comparison, as fractions of plain PyTorch's forward+backward peak."""
QUICK_COMPRESS_FRACTIONS = (0.8, 0.5)
COMPRESS_GOALS = {"L2.2": 8.0, "L2": 6.0}
"""The issue's goals: plain PyTorch's activation bytes over the level's, at least this."""
OVERHEAD_CAPS = (1.10, 1.25, 1.5, 2.0, 3.0, None)
"""Overhead caps at which the three modes' lowest measured peaks are compared (``None``: any overhead)."""
COMBINED_MARGIN = 0.01
"""A peak counts as lower than another only by more than this fraction of plain PyTorch's peak."""
MATCHED_GAP = 0.0125
"""``--matched``: both modes' extra budgets sit this fraction of PyTorch's peak below the predicted peak of each
lossy level and lossless plan (the verdict's margin, plus a quarter of it for the prediction error)."""
_WRAP_LEVEL = "L2"
"""The level the model is wrapped with first (installs zoomem's forwards and every compact implementation)."""
_MODES = {"lossless": "lossless `wrap(budget=...)`", "alone": "compression alone (cheapest fitting level)",
          "combined": "`wrap(budget=..., compress=\"auto\")`"}


def _level_text(name: str) -> str:
    import zoomem

    lv = zoomem.LEVELS[name]
    if lv.bits is not None:
        what = f"{lv.bits} bits"
    elif lv.avg_bits is not None:
        what = f"adaptive, {lv.avg_bits:g} bits avg"
    else:
        what = "nothing lossy"
    return f"{name} ({what}{', offload' if lv.offload else ''})"


def _compress_info(plan: Any) -> dict[str, Any]:
    """:func:`_plan_info` plus what the plan stores lossily (from ``plan.bits`` and ``plan.saved``)."""
    from collections import Counter

    info = _plan_info(plan)
    sizes = {d["key"]: d["nbytes"] for d in plan.saved}
    lossy_bytes = sum(sizes.get(k, 0) for k in plan.bits)
    by_bits: Counter[int] = Counter()
    for k, b in plan.bits.items():
        by_bits[b] += sizes.get(k, 0)
    from zoomem.planner.compression import duplicate_of

    exact = Counter("duplicate of another saved tensor (stored once)" if duplicate_of(d["lossy"]) is not None
                    else d["lossy"] for d in plan.saved if d["lossy"])
    exact["eligible, zero measured sensitivity"] = sum(
        1 for d in plan.saved if not d["lossy"] and not d.get("sensitivity"))
    measured = plan.extras.get("measured_peak_bytes")
    info.update({
        "level": plan.level,
        "compact_units": sum(bool(u.compact) for u in plan.units),
        "saved_tensors": len(plan.saved),
        "saved_mib": sum(sizes.values()) / MIB,
        "lossy_tensors": len(plan.bits),
        "lossy_mib": lossy_bytes / MIB,
        "avg_bits": sum(b * n for b, n in by_bits.items()) / lossy_bytes if lossy_bytes else None,
        "lossy_mib_by_bits": {str(b): n / MIB for b, n in sorted(by_bits.items())},
        "exact_tensors_by_reason": {k: v for k, v in exact.items() if v},
        "predicted_variance": plan.variance,
        "offload": plan.offload,
        "verified_peak_mib": None if measured is None else measured / MIB,
    })
    return info


def _cache_switch(handle: Any, sig: Any, plan: Any):
    """``enter``/``leave`` that put ``plan`` in the wrapped model's plan cache (what its next forward runs)."""

    def enter() -> None:
        handle.plans[sig] = plan

    def leave() -> None:
        if len(handle.plans) != 1 or handle.plans.get(sig) is not plan:
            raise RuntimeError("zoomem planned again inside the benchmark (the batch signature changed?)")

    return enter, leave


def _disabled_switch(model: Any):
    """``enter``/``leave`` for plain PyTorch on a wrapped model (``zoomem.disabled``: the original forwards)."""
    import zoomem

    ctx: list[Any] = []

    def enter() -> None:
        ctx.append(zoomem.disabled(model))
        ctx[-1].__enter__()

    def leave() -> None:
        ctx.pop().__exit__(None, None, None)

    return enter, leave


def compress_one(model_id: str, args: argparse.Namespace, bar: Any = None) -> dict[str, Any]:
    """Every level and every budget (lossless and combined) of one model in this process: plan each through
    zoomem's public API on one wrapped model, then time them interleaved and meter one step each."""
    import gc

    import torch

    import zoomem
    from zoomem import zoo
    from zoomem.cli import _overrides
    from zoomem.planner import parse_budget

    def say(msg: str) -> None:
        (bar.write if bar is not None else print)(f"{model_id}: {msg}", file=sys.stderr)

    spec = _spec_of(model_id, args.quick, COMPRESS_SIZES)
    spec = BenchSize(args.batch or spec.batch_size, dict(spec.sizes), {**spec.overrides, **_overrides(args.set)})
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, adapter = zoo.build(model_id, **spec.overrides)
    batch = adapter.example_batch(model, spec.batch_size, **spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=args.foreach)

    def loss_fn(output: Any, b: Any) -> Any:
        return adapter.loss(model, b, output)

    _train_step(model, batch, loss_fn, optimizer)  # creates AdamW's state: every later step is a steady one
    build_s = time.perf_counter() - t0
    common = dict(adapter=adapter, optimizer=optimizer, loss_fn=loss_fn, time_limit=args.time_limit)
    skip = dict(skip_logits=True) if getattr(args, "skip_logits", False) else {}

    # -- plans (before any timing), all on one wrapped model: each method puts its plan in the wrap's cache --
    wrap_level, wrap_error = _WRAP_LEVEL, None
    t = time.perf_counter()
    try:
        zoomem.wrap(model, level=_WRAP_LEVEL, batch=batch, sensitivity_interval=0, **skip, **common)
    except Exception as exc:  # noqa: BLE001 - a result: that level (and likely every lossy one) fails here
        wrap_level, wrap_error = "L0", f"failed: {_exc_text(exc)}"
        logger.debug("wrap(level=%s) of %s failed", _WRAP_LEVEL, model_id, exc_info=True)
        say(f"zoomem.wrap(level={_WRAP_LEVEL!r}) {wrap_error}; wrapping with L0 (nothing lossy) instead")
        t = time.perf_counter()
        zoomem.wrap(model, level="L0", batch=batch, sensitivity_interval=0, **skip, **common)
    wrap_s = time.perf_counter() - t
    handle = model.__dict__["_zoomem"]
    (sig, wrap_plan), = handle.plans.items()
    baseline = wrap_plan.baseline_peak_bytes
    say(f"wrapped with level {wrap_level} in {wrap_s:.1f} s; predicted PyTorch peak {baseline / MIB:.0f} MiB")

    plain = _Method("pytorch", "plain PyTorch", "pytorch", model, optimizer, loss_fn)
    plain.enter, plain.leave = _disabled_switch(model)
    methods: list[_Method] = [plain]

    def planned(m: _Method, make: Callable[[], Any]) -> _Method:
        t = time.perf_counter()
        try:
            m.plan = make()
        except zoomem.InfeasibleBudgetError as exc:
            m.error = f"infeasible (min {exc.min_budget / MIB:.0f} MiB)"
            m.info["min_budget_bytes"] = int(exc.min_budget)
        except Exception as exc:  # noqa: BLE001 - a result: zoomem could not plan this method
            m.error = f"failed: {_exc_text(exc)}"
            logger.debug("%s %s failed", model_id, m.key, exc_info=True)
        m.info["plan_s"] = time.perf_counter() - t
        if m.plan is not None:
            m.info.update(_compress_info(m.plan))
            m.enter, m.leave = _cache_switch(handle, sig, m.plan)
        methods.append(m)
        say(f"{m.key}: " + (m.error or f"planned in {m.info['plan_s']:.1f} s, {m.info['lossy_tensors']} of "
                              f"{m.info['saved_tensors']} saved tensors lossy, {m.info['recomputed']} of "
                              f"{m.info['units']} units recomputed"))
        return m

    for name in args.levels:
        m = _Method(name, _level_text(name), "level", model, optimizer, loss_fn)
        if name == wrap_level:  # planned by the wrap itself
            planned(m, lambda: wrap_plan).info["plan_s"] = wrap_s
        elif name == _WRAP_LEVEL and wrap_error is not None:
            m.error = wrap_error
            methods.append(m)
        else:
            planned(m, lambda: zoomem.plan(model, batch, level=name, **common))

    skipped: list[dict[str, Any]] = []
    for mode, compress in (("lossless", None), ("combined", "auto")):
        min_budget: int | None = None
        for frac in args.fractions:
            budget = parse_budget(frac, baseline_peak=baseline)
            assert budget is not None
            if min_budget is not None and budget < min_budget:  # lower budgets are infeasible too
                skipped.append({"mode": mode, "budget": f"{frac:.0%}", "budget_frac": frac, "budget_bytes": budget,
                                "min_budget_bytes": min_budget})
                continue
            m = _Method(f"{mode}@{frac:.0%}", _MODES[mode], mode, model, optimizer, loss_fn, budget=f"{frac:.0%}",
                        budget_frac=frac)
            m.info["budget_bytes"] = budget
            planned(m, lambda: zoomem.plan(model, batch, frac, compress=compress, **common))
            if "min_budget_bytes" in m.info:
                min_budget = m.info["min_budget_bytes"]
        if min_budget is not None:
            for attempt in range(2):  # the minimum feasible budget; a plan that measures over it names a higher one
                m = _Method(f"{mode}@min", _MODES[mode], mode, model, optimizer, loss_fn,
                            budget=f"min ({min_budget / baseline:.0%})", budget_frac=min_budget / baseline)
                m.info["budget_bytes"] = min_budget
                planned(m, lambda: zoomem.plan(model, batch, min_budget, compress=compress, **common))
                if "min_budget_bytes" not in m.info:  # planned, or failed for another reason
                    break
                if attempt == 0:
                    methods.remove(m)
                    min_budget = max(m.info["min_budget_bytes"], int(min_budget * 1.001) + 1)
        # the combined mode covers every lossless plan: at their floor's budget too
        least = next((m for m in methods if m.key == "lossless@min" and m.plan is not None and mode == "combined"), None)
        if least is not None:
            at = least.info["budget_bytes"]
            m = _Method("combined@lossless min", _MODES[mode], mode, model, optimizer, loss_fn,
                        budget=f"lossless min ({at / baseline:.0%})", budget_frac=at / baseline)
            m.info["budget_bytes"] = at
            planned(m, lambda: zoomem.plan(model, batch, at, compress=compress, **common))
        if args.matched:
            _plan_below_others(methods, mode, min_budget, baseline, planned,
                               lambda b: zoomem.plan(model, batch, b, compress=compress, **common))

    # -- interleaved timing, then one metered step each --
    runnable = [m for m in methods if m.error is None]
    load = _time_interleaved(runnable, batch, args.warmup, args.steps, say)
    _meter_each(runnable, batch)

    ref = plain
    ref_time, ref_peak, ref_act = _median(ref.times), _fwd_bwd(ref.report), ref.report.activation_bytes
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m.key, "label": m.label, "kind": m.kind, "budget": m.budget,
                               "budget_frac": m.budget_frac, **m.info}
        if m.error is not None:
            row["error"] = m.error
        else:
            rep = m.report
            peak = _fwd_bwd(rep)
            row.update({
                "fwd_bwd_peak_mib": peak / MIB,
                "pct_of_pytorch": 100.0 * peak / ref_peak,
                "activation_mib": rep.activation_bytes / MIB,
                "activation_ratio": ref_act / rep.activation_bytes if rep.activation_bytes > 0 else float("inf"),
                "step_peak_mib": rep.peak_bytes / MIB,
                "step_s": m.times,
                "median_step_s": _median(m.times),
                "step_cpu_s": m.cpu_times,
                "cpu_overhead": _median(m.cpu_times) / _median(ref.cpu_times),
                "overhead": _median(m.times) / ref_time,
                "overhead_of_fastest": min(m.times) / min(ref.times),
                "report": rep.to_dict(),
            })
        rows.append(row)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    result = {
        "id": model_id,
        "variant": "small" if args.quick else "compress",
        "layers": _layers_note(model_id, spec, args.quick),
        "skip_logits": bool(skip),
        "batch_size": spec.batch_size,
        "sizes": _sizes_of(batch, spec, model_id),
        "overrides": spec.overrides,
        "num_params": n_params,
        "param_mib": _param_bytes(model) / MIB,
        "build_s": build_s,
        "wrap_level": wrap_level,
        "wrap_error": wrap_error,
        "wrap_s": wrap_s,
        "predicted_pytorch_peak_mib": baseline / MIB,
        "pytorch_median_step_s": ref_time,
        "pytorch_peak_mib": ref_peak / MIB,
        "pytorch_activation_mib": ref_act / MIB,
        "load_average_per_round": load,
        "skipped_budgets": skipped,
        "methods": rows,
    }
    zoomem.unwrap(model)
    del methods, runnable, plain, model, optimizer, handle, wrap_plan
    gc.collect()
    result["comparison"] = compare_modes(result)
    return result


def _plan_below_others(methods: list[_Method], mode: str, min_budget: int | None, baseline: int,
                       planned: Callable[[_Method, Callable[[], Any]], _Method], plan: Callable[[int], Any]) -> None:
    """``mode`` (lossless or combined) at budgets just below the predicted peak of each lossy level and each lossless
    plan made at a fraction or the minimum (by :data:`MATCHED_GAP` of PyTorch's peak, beyond the verdict's margin):
    that plan fits a little above, so the program answers whether it gets lower at no more time. Both modes get the
    same anchors. Lowest first. A budget is left out when a plan of this mode already made answers it: one whose
    budget is at least this one and whose predicted peak fits it with the planner's safety margin (the program's
    fastest plan there is that one), or one within a quarter of the margin (the same plan, or nearly); and below a
    minimum an infeasible budget named. A plan at a lower budget does not answer it: it may take more time."""
    from zoomem.planner import solve

    gap, near = int(MATCHED_GAP * baseline), COMBINED_MARGIN * baseline / 4
    made = [(m.info["budget_bytes"], m.plan.predicted_peak_bytes) for m in methods
            if m.kind == mode and m.plan is not None]
    anchors = [m for m in methods if m.plan is not None and (
        (m.kind == "lossless" and "@<" not in m.key) or (m.kind == "level" and m.info.get("lossy_tensors")))]
    for anchor in sorted(anchors, key=lambda m: m.plan.predicted_peak_bytes):
        budget = int(anchor.plan.predicted_peak_bytes) - gap
        if (min_budget is not None and budget < min_budget) or any(
                peak * (1 + solve.SAFETY_MARGIN) <= budget <= b or abs(budget - b) <= near for b, peak in made):
            continue
        name = anchor.key.replace("@", " ")
        m = _Method(f"{mode}@<{name}", _MODES[mode], mode, anchor.model, anchor.optimizer, anchor.loss_fn,
                    budget=f"<{name} ({budget / baseline:.0%})", budget_frac=budget / baseline)
        m.info["budget_bytes"] = budget
        planned(m, lambda: plan(budget))
        if m.plan is not None:
            made.append((budget, m.plan.predicted_peak_bytes))
        elif "min_budget_bytes" in m.info:
            min_budget = max(min_budget or 0, m.info["min_budget_bytes"])


def _point(m: dict[str, Any] | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {"method": m["method"], "peak_mib": m["fwd_bwd_peak_mib"], "overhead": m["overhead"]}


def compare_modes(r: dict[str, Any]) -> dict[str, Any]:
    """The combined mode against each alone: at every budget (lossless plan, cheapest level whose measured peak
    fits, combined plan), and the lowest measured peak each mode reaches within each overhead cap."""
    rows = _ok_rows(r)
    by_key = {m["method"]: m for m in r["methods"]}
    levels = [m for m in rows if m["kind"] == "level"]
    combined = [m for m in rows if m["kind"] == "combined"]
    points = {  # a combined plan that stores nothing lossily is a lossless plan too: it cannot beat lossless planning
        "lossless": [m for m in rows if m["kind"] in ("pytorch", "lossless")] + [
            m for m in combined if not m.get("lossy_tensors")],
        "alone": levels,
        "combined": combined,
    }

    def fitting_level(budget: float) -> dict[str, Any] | None:
        fits = [m for m in levels if m["fwd_bwd_peak_mib"] * MIB <= budget]
        return min(fits, key=lambda m: m["overhead"]) if fits else None

    skipped = {(s["mode"], s["budget"]): s for s in r.get("skipped_budgets", [])}

    def state(mode: str, suffix: str) -> dict[str, Any] | None:
        m = by_key.get(f"{mode}@{suffix}")
        if m is None:
            s = skipped.get((mode, suffix))
            return None if s is None else {
                "budget_bytes": s["budget_bytes"], "error": f"below its min ({s['min_budget_bytes'] / MIB:.0f} MiB)"}
        return m

    suffixes = [m["method"].split("@")[1] for m in r["methods"] if m["kind"] in ("lossless", "combined")]
    entries = [(s, state("lossless", s), state("combined", s)) for s in dict.fromkeys(suffixes)
               if s not in ("min", "lossless min")]
    entries += [(f"{mode} min", by_key[f"{mode}@min"] if mode == "lossless" else None,
                 by_key.get("combined@lossless min") if mode == "lossless" else by_key[f"{mode}@min"])
                for mode in ("lossless", "combined") if f"{mode}@min" in by_key]
    budgets = []
    for name, lossless, combined in entries:
        budget = (lossless or combined or {})["budget_bytes"]
        out: dict[str, Any] = {"budget": name, "budget_mib": budget / MIB}
        for mode, m in (("lossless", lossless), ("combined", combined)):
            if m is None or "error" in m:
                out[mode] = None if m is None else {"method": m.get("method"), "error": m["error"]}
            else:
                out[mode] = {**_point(m), "fits": m["fwd_bwd_peak_mib"] * MIB <= budget,
                             "lossy_tensors": m["lossy_tensors"], "recomputed": m["recomputed"] + m["recomputed_cheap"],
                             "units": m["units"], "predicted_peak_mib": m["predicted_peak_mib"],
                             "verified_peak_mib": m["verified_peak_mib"],
                             "predicted_overhead": m.get("predicted_overhead")}
        out["alone"] = _point(fitting_level(budget))
        budgets.append(out)
    margin = COMBINED_MARGIN * r["pytorch_peak_mib"]
    caps = []
    for cap in OVERHEAD_CAPS:
        low = {}
        for mode, pts in points.items():
            within = [m for m in pts if cap is None or m["overhead"] <= cap]
            best = min(within, key=lambda m: m["fwd_bwd_peak_mib"]) if within else None
            low[mode] = None if best is None else {**_point(best), "lossy_tensors": best.get("lossy_tensors", 0)}
        c = low["combined"]
        others = [o["peak_mib"] for o in (low["lossless"], low["alone"]) if o is not None]
        if c is None:
            verdict = "no combined point"
        elif all(c["peak_mib"] < o - margin for o in others):
            verdict = "lower"
        elif all(c["peak_mib"] <= o + margin for o in others):
            verdict = "tie"
        else:
            verdict = "higher"
        caps.append({"cap": cap, **low, "verdict": verdict,
                     "combined_minus_best_other_mib": None if c is None or not others else c["peak_mib"] - min(others)})
    return {
        "rule": "lowest measured fwd+bwd peak of each mode within an overhead cap (lossless: plain PyTorch, "
                "the lossless budget plans and the combined plans that store nothing lossily; alone: the levels; "
                "combined: the compress='auto' budget plans); the "
                f"combined mode is 'lower' at a cap when its lowest peak is more than {COMBINED_MARGIN:.0%} of plain "
                "PyTorch's peak below both others', a 'tie' within that margin",
        "margin_mib": margin,
        "budgets": budgets,
        "caps": caps,
        "at_any_overhead": caps[-1]["verdict"],
        "caps_where_combined_lower": [c["cap"] for c in caps if c["verdict"] == "lower" and c["cap"] is not None],
    }


def evaluate_compress_goals(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    goals = []
    for level, target in COMPRESS_GOALS.items():
        for r in results:
            if "error" in r:
                continue
            m = next((m for m in r["methods"] if m["method"] == level), None)
            if m is None:
                continue
            e = {"level": level, "target": target, "id": r["id"]}
            if "error" in m:
                e.update(met=False, note=m["error"])
            else:
                e.update(met=m["activation_ratio"] >= target, ratio=m["activation_ratio"],
                         activation_mib=m["activation_mib"], pytorch_activation_mib=r["pytorch_activation_mib"],
                         lossy_tensors=m["lossy_tensors"], saved_tensors=m["saved_tensors"])
            goals.append(e)
    combined = []
    for r in results:
        if "error" in r:
            continue
        comp = r["comparison"]
        any_cap = comp["caps"][-1]
        combined.append({"id": r["id"], "at_any_overhead": comp["at_any_overhead"],
                         "caps_where_combined_lower": comp["caps_where_combined_lower"],
                         "any": {k: any_cap[k] for k in ("lossless", "alone", "combined")}})
    return {"activation_ratio": goals, "combined": combined}


def _ratio(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:.1f}x"


def levels_table(r: dict[str, Any], markdown: bool) -> str:
    heads = ["level", "lossy tensors", "lossy MiB (avg bits)", "activations MiB", "activation ratio",
             "measured peak MiB", "predicted peak MiB", "% of PyTorch", "overhead x", "predicted x", "fastest x",
             "plan s", "predicted rel. variance"]
    cells = []
    for m in r["methods"]:
        if m["kind"] not in ("pytorch", "level"):
            continue
        if "error" in m:
            cells.append([m["label"], m["error"]] + [""] * (len(heads) - 2))
            continue
        if m["kind"] == "pytorch":
            lossy, mib, var, plan_s, pred, pred_x = "—", "—", "—", "—", "—", "—"
        else:
            pred = _mib(m["predicted_peak_mib"])
            pred_x = _fmt_overhead(m.get("predicted_overhead"))
            lossy = f"{m['lossy_tensors']} of {m['saved_tensors']}"
            mib = f"{_mib(m['lossy_mib'])} of {_mib(m['saved_mib'])}" + (
                f" ({m['avg_bits']:.2f})" if m["avg_bits"] is not None else "")
            var = f"{m['predicted_variance']:.1e}"
            plan_s = f"{m['plan_s']:.1f}"
        cells.append([m["label"], lossy, mib, _mib(m["activation_mib"]), _ratio(m["activation_ratio"]),
                      _mib(m["fwd_bwd_peak_mib"]), pred, f"{m['pct_of_pytorch']:.0f}%", _fmt_overhead(m["overhead"]),
                      pred_x, _fmt_overhead(m["overhead_of_fastest"]), plan_s, var])
    return _grid(heads, cells, markdown, left=3)


def _cell(p: dict[str, Any] | None, with_method: bool = False) -> tuple[str, str]:
    if p is None:
        return "—", "—"
    if "error" in p:
        return p["error"], ""
    name = f"{p['method']}: " if with_method else ""
    return name + _mib(p["peak_mib"]) + ("" if p.get("fits", True) else " (over)"), _fmt_overhead(p["overhead"])


def budgets_table(r: dict[str, Any], markdown: bool) -> str:
    heads = ["budget", "budget MiB", "lossless peak MiB", "lossless x", "compression alone: level, peak MiB",
             "alone x", "combined peak MiB", "combined x (predicted)", "lossless: recomputed units",
             "combined: lossy tensors, recomputed units", "combined: predicted / zoomem-verified MiB"]

    def what(p: dict[str, Any] | None, lossy: bool) -> str:
        if p is None or "error" in p:
            return ""
        return (f"{p['lossy_tensors']}, " if lossy else "") + f"{p['recomputed']} of {p['units']}"

    def check(p: dict[str, Any] | None) -> str:
        if p is None or "error" in p:
            return ""
        verified = p["verified_peak_mib"]
        return f"{_mib(p['predicted_peak_mib'])} / " + ("—" if verified is None else _mib(verified))

    cells = []
    for b in r["comparison"]["budgets"]:
        lp, lx = _cell(b["lossless"])
        ap, ax = _cell(b["alone"], with_method=True) if b["alone"] else ("no level fits", "")
        cp, cx = _cell(b["combined"])
        predicted_x = (b["combined"] or {}).get("predicted_overhead")
        if cx and predicted_x is not None:
            cx += f" ({_fmt_overhead(predicted_x)})"
        cells.append([b["budget"], _mib(b["budget_mib"]), lp, lx, ap, ax, cp, cx, what(b["lossless"], False),
                      what(b["combined"], True), check(b["combined"])])
    return _grid(heads, cells, markdown, left=1)


def caps_table(r: dict[str, Any], markdown: bool) -> str:
    heads = ["overhead cap", "lossless: lowest peak MiB (x)", "compression alone", "combined", "combined is"]

    def cell(p: dict[str, Any] | None) -> str:
        return "—" if p is None else f"{_mib(p['peak_mib'])} ({p['method']}, {p['overhead']:.2f}x)"

    cells = [[("any" if c["cap"] is None else f"<= {c['cap']:.2f}x"), cell(c["lossless"]), cell(c["alone"]),
              cell(c["combined"]), c["verdict"]] for c in r["comparison"]["caps"]]
    return _grid(heads, cells, markdown, left=1)


def _compress_head(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['id']}: FAILED: {r['error']}"
    skip = "; zoomem with skip_logits" if r.get("skip_logits") else ""
    return (f"{r['id']} ({r['layers']}{skip}; {_size_text(r)}; {r['param_mib']:.0f} MiB of parameters; plain PyTorch "
            f"{r['pytorch_median_step_s']:.2f} s/step, {r['pytorch_activation_mib']:.1f} MiB of activations, "
            f"fwd+bwd peak {r['pytorch_peak_mib']:.1f} MiB)")


def compress_goals_text(g: dict[str, Any]) -> str:
    yes = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
    lines = []
    for level, target in COMPRESS_GOALS.items():
        lines.append(f"{level}: activations >= {target:g}x smaller than plain PyTorch's:")
        entries = [e for e in g["activation_ratio"] if e["level"] == level]
        if not entries:
            lines.append("  (level not measured)")
        for e in entries:
            if "ratio" not in e:
                lines.append(f"  - {e['id']}: {yes(False)}: {e['note']}")
                continue
            lines.append(f"  - {e['id']}: {yes(e['met'])}: {e['ratio']:.1f}x ({e['pytorch_activation_mib']:.1f} -> "
                         f"{e['activation_mib']:.1f} MiB; {e['lossy_tensors']} of {e['saved_tensors']} saved tensors "
                         "lossy)")
    lines.append("combined mode (compress='auto' under a budget) reaches a lower peak than lossless planning and "
                 f"than compression alone (by more than {COMBINED_MARGIN:.0%} of PyTorch's peak), at any overhead "
                 "and within which overhead caps (a combined plan that stores nothing lossily counts as a lossless "
                 "plan too):")

    def low(p: dict[str, Any] | None) -> str:
        return "none" if p is None else f"{_mib(p['peak_mib'])} MiB ({p['method']}, {p['overhead']:.2f}x)"

    for e in g["combined"]:
        caps = ", ".join(f"<= {c:.2f}x" for c in e["caps_where_combined_lower"]) or "none"
        a = e["any"]
        note = " (it stores nothing lossy)" if a["combined"] is not None and not a["combined"]["lossy_tensors"] else ""
        lines.append(f"  - {e['id']}: {e['at_any_overhead'].upper()} at any overhead: combined {low(a['combined'])}"
                     f"{note}, lossless {low(a['lossless'])}, compression alone {low(a['alone'])}; lower within "
                     f"the caps: {caps}")
    return "\n".join(lines)


# -- accuracy: compressed training against plain PyTorch on real data --------------------------------------------

ACCURACY_ALLOWED = {"L2": 0.5, "L1.2": 2.0}
"""Issue 4's allowed accuracy drop against L0, in points, per level (other levels are reported, not judged)."""


def _noise_label(relative: float) -> str:
    """The control method's name: plain PyTorch with ``zoomem.tasks.gradient_noise(relative)``."""
    return f"L0+{relative:.0%} noise"


def accuracy_run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (task, seed, method) run of ``zoomem.tasks.run_task``; written to ``--out`` after each run."""
    import torch

    import zoomem
    from zoomem.tasks import gradient_noise, run_task

    if args.threads:
        torch.set_num_threads(args.threads)
    started, t0 = _dt.datetime.now(_dt.timezone.utc), time.perf_counter()
    code = _git_info()  # the code this process imported, not whatever HEAD is when a later run is written
    command = "python scripts/bench.py accuracy " + shlex.join(sys.argv[2:])
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    control = [_noise_label(args.control_noise)] if args.control_noise > 0 else []
    jobs = [(t, s, m) for t in args.tasks for s in args.seeds for m in ["L0", *args.levels, *control]]
    from tqdm import tqdm

    for task, seed, method in tqdm(jobs, desc="accuracy", unit="run", file=sys.stderr, disable=args.no_progress):
        if method == "L0":
            prep = None
        elif method in control:  # the instrument's resolution: plain PyTorch with a small exact-zero-free noise
            prep = gradient_noise(args.control_noise, seed=seed)
        else:
            prep = lambda m, lvl=method: zoomem.wrap(m, level=lvl)  # noqa: E731
        r = run_task(task, prep, seed=seed, steps=args.steps)
        runs.append({"task": task, "seed": seed, "method": method, "accuracy": r.accuracy, "steps": r.steps,
                     "seconds": r.seconds, "final_loss": r.losses[-1] if r.losses else None})
        result = {**_result_head("accuracy", command, started, time.perf_counter() - t0, code),
                  "threads": torch.get_num_threads(), "runs": runs, "verdicts": accuracy_verdicts(runs)}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def accuracy_verdicts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and level: the per-seed differences to L0 and their mean, judged against ACCURACY_ALLOWED."""
    acc = {(r["task"], r["seed"], r["method"]): r["accuracy"] for r in runs}
    out = []
    for task in dict.fromkeys(r["task"] for r in runs):
        levels = [m for m in dict.fromkeys(r["method"] for r in runs if r["task"] == task) if m != "L0"]
        for level in levels:
            seeds = [s for (t, s, m) in acc if t == task and m == level and (t, s, "L0") in acc]
            diffs = [acc[task, s, level] - acc[task, s, "L0"] for s in seeds]
            if not diffs:
                continue
            allowed = ACCURACY_ALLOWED.get(level)
            mean = sum(diffs) / len(diffs)
            out.append({"task": task, "level": level, "seeds": seeds, "diffs": diffs, "mean_diff": mean,
                        "mean_abs_diff": sum(abs(d) for d in diffs) / len(diffs),
                        "worst_diff": min(diffs), "allowed_drop": allowed,
                        "mean_met": None if allowed is None else mean >= -allowed,
                        "seeds_met": None if allowed is None else sum(d >= -allowed for d in diffs)})
    return out


def print_accuracy(result: dict[str, Any], markdown: bool) -> None:
    runs = result["runs"]
    acc = {(r["task"], r["seed"], r["method"]): r["accuracy"] for r in runs}
    methods = list(dict.fromkeys(r["method"] for r in runs))
    for task in dict.fromkeys(r["task"] for r in runs):
        seeds = sorted({s for (t, s, _) in acc if t == task})
        rows = []
        for s in seeds:
            rows.append([str(s)] + [f"{acc[task, s, m]:.2f}" if (task, s, m) in acc else "" for m in methods])
        means = {m: [acc[task, s, m] for s in seeds if (task, s, m) in acc] for m in methods}
        rows.append(["mean"] + [f"{sum(v) / len(v):.2f}" if v else "" for v in means.values()])
        print(f"\n{'#### ' if markdown else ''}{task}: accuracy (%) per seed\n")
        print(_grid(["seed", *methods], rows, markdown))
    print()
    for v in result["verdicts"]:
        judged = "" if v["allowed_drop"] is None else (
            f" (allowed drop {v['allowed_drop']}: mean {'MET' if v['mean_met'] else 'NOT MET'}, "
            f"{v['seeds_met']} of {len(v['diffs'])} seeds within)")
        spread = f" (mean |diff| {v['mean_abs_diff']:.2f})" if "mean_abs_diff" in v else ""
        print(f"- {v['task']} {v['level']}: mean {v['mean_diff']:+.2f}{spread} points against L0, worst seed "
              f"{v['worst_diff']:+.2f}, per seed {', '.join(f'{d:+.2f}' for d in v['diffs'])}{judged}")


def cmd_accuracy(args: argparse.Namespace) -> int:
    if args.render:
        print_accuracy(json.loads(Path(args.render).read_text()), args.markdown)
        return 0
    if args.control_noise < 0:
        print(f"--control-noise must be >= 0 (0 skips the control), got {args.control_noise}.", file=sys.stderr)
        return 2
    if args.quick:
        args.tasks, args.seeds, args.steps = args.tasks or ["graph"], args.seeds or [0], args.steps or 3
    args.tasks = args.tasks or ["digits", "text", "graph"]
    args.seeds = args.seeds or [0, 1, 2, 3, 4]
    result = accuracy_run(args)
    print_accuracy(result, args.markdown)
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    import torch

    from zoomem import zoo

    if args.render:
        data = json.loads(Path(args.render).read_text())
        for r in data["results"]:  # judged by this checkout's rules, from the measured rows
            if "error" not in r:
                r["comparison"] = compare_modes(r)
        data["goals"] = evaluate_compress_goals(data["results"])
        print_compress(data, args.markdown)
        return 0
    models = args.models or list(COMPRESS_SIZES)
    if not _known_models(models, zoo.SMALL if args.quick else COMPRESS_SIZES, args.quick, "compress size"):
        return 2
    if args.fractions is None:
        args.fractions = list(QUICK_COMPRESS_FRACTIONS if args.quick else COMPRESS_FRACTIONS)
    args.fractions = sorted(set(args.fractions), reverse=True)
    if args.quick:
        args.steps = min(args.steps, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("zoomem").setLevel(logging.WARNING)
    command = "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv)
    git_info = _git_info()  # at the start: the code the run imports
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def payload(results: list[dict[str, Any]], partial: bool) -> dict[str, Any]:
        return {
            **_result_head("compress", command, started, time.perf_counter() - t0, git_info),
            "partial": partial,
            "settings": {
                "quick": args.quick,
                "seed": args.seed,
                "optimizer": f"torch.optim.AdamW(lr=1e-3, weight_decay=0.01, foreach={args.foreach})",
                "step": "forward, loss, backward, optimizer.step(), zero_grad(set_to_none=True)",
                "levels": list(args.levels),
                "budget_fractions": list(args.fractions),
                "budget_of": "zoomem's float budget: a fraction of plain PyTorch's forward+backward peak as zoomem's "
                             "trace predicts it (optimizer state included)",
                "matched_budgets": (f"both budget modes also at the predicted peak of each lossy level and "
                                    f"lossless plan less {MATCHED_GAP:.2%} of plain PyTorch's (methods "
                                    "MODE@<LEVEL, MODE@<lossless BUDGET)") if args.matched else None,
                "planning": f"the model is wrapped once (zoomem.wrap(level={_WRAP_LEVEL!r}, batch=..., "
                            "sensitivity_interval=0)); every other level and budget is planned with zoomem.plan on the "
                            "wrapped model (its own trace and sensitivity probe each) and put in the wrap's plan cache "
                            "while it runs; plain PyTorch runs under zoomem.disabled",
                "sensitivity_interval": 0,
                "warmup_rounds": args.warmup,
                "timed_rounds": args.steps,
                "timing": "no meter; one step of each method per round, the order rotated each round; median",
                "meter": "one more step per method under zoomem.measure.measure_step (CPU: PyTorch profiler "
                         "allocator trace); activations = bytes held at the forward mark above the step's start; "
                         "peak = max(forward, backward phase peaks), absolute",
                "solver_time_limit_s": args.time_limit,
                "overhead_caps": [c for c in OVERHEAD_CAPS],
            },
            "results": results,
            "goals": evaluate_compress_goals(results),
        }

    def save(results: list[dict[str, Any]], partial: bool = True) -> dict[str, Any]:
        data = payload(results, partial)
        out.write_text(json.dumps(data, indent=1) + "\n")  # after every model: a killed run keeps what it measured
        return data

    results = _run_models(models, compress_one, args, "compress", after_each=save)
    data = save(results, partial=False)
    logger.info("wrote %s", out)
    print_compress(data, args.markdown)
    return 1 if any("error" in r for r in results) else 0


def print_compress(data: dict[str, Any], markdown: bool) -> None:
    """The ``compress`` tables and verdicts of a result JSON (``--render`` prints a saved one again)."""
    started = _dt.datetime.fromisoformat(data["date"])
    _print_run_head(data["command"], data["machine"], started, data["wall_s"], markdown)
    if data.get("partial"):
        print("(partial: the run stopped before its last model)\n")
    h = "#### " if markdown else ""
    for r in data["results"]:
        print(h + _compress_head(r) + "\n")
        if "error" in r:
            continue
        print(levels_table(r, markdown) + "\n")
        print(budgets_table(r, markdown) + "\n")
        print(caps_table(r, markdown) + "\n")
    print(compress_goals_text(data["goals"]))


# -- command line -----------------------------------------------------------------------------------------------


# -- scale: planning a batch from traces of smaller ones ---------------------------------------------------------

SCALE_SIZES: dict[str, BenchSize] = {
    "timm/resnet50": BenchSize(16, _IMG224),
    "timm/mobilenetv2_100": BenchSize(32, _IMG224),
    "timm/vit_tiny_patch16_224": BenchSize(32, _IMG224),
    "hf/bert-base-uncased": BenchSize(16, {"seq_len": 256}, {"num_hidden_layers": 4}),
    "hf/gpt2": BenchSize(16, {"seq_len": 128}, {"n_layer": 4}),
    "hf/llama": BenchSize(16, {"seq_len": 128}),
    "hf/t5-small": BenchSize(16, {"seq_len": 128}),
}
"""Default ``scale`` sizes: real layouts (the HF ones with 4 layers) at batches a 2-core CPU traces in seconds to
a minute, each planned from traces at a quarter and a half of its batch (by default). PyG graphs have no batch
dimension."""


def scale_one(model_id: str, args: argparse.Namespace, bar: Any = None) -> dict[str, Any]:
    import torch

    import zoomem
    from zoomem import zoo
    from zoomem.measure import measure_step
    from zoomem.planner import Decision
    from zoomem.planner.scale import trace_sizes
    from zoomem.runtime.wrap import _scaled_cost_model, cost_model

    if args.quick:
        spec = BenchSize(8, dict(zoo.SMALL[model_id].sizes), dict(zoo.SMALL[model_id].overrides))
    else:
        spec = SCALE_SIZES[model_id]
    torch.manual_seed(args.seed)
    model, adapter = zoo.build(model_id, **spec.overrides)
    batch = adapter.example_batch(model, spec.batch_size, **spec.sizes)
    scale = trace_sizes(spec.batch_size, max(3, round(spec.batch_size * args.trace_fraction)))

    def loss_fn(output: Any, b: Any) -> torch.Tensor:
        return adapter.loss(model, b, output)

    t = time.perf_counter()
    direct, _, _ = cost_model(model, batch, adapter)
    direct_s = time.perf_counter() - t
    t = time.perf_counter()
    scaled, _, _ = _scaled_cost_model(model, batch, adapter, None, None, scale)
    scaled_s = time.perf_counter() - t
    plain = measure_step(model, batch, loss_fn)
    measured = max(plain.phases["forward"].peak_bytes, plain.phases["backward"].peak_bytes)
    peaks = {}
    for d in (Decision.KEEP, Decision.RECOMPUTE, Decision.RECOMPUTE_CHEAP):
        plan = {u: d for u in direct.units}
        peaks[d.value] = {"direct_mib": direct.peak(plan) / MIB, "scaled_mib": scaled.peak(plan) / MIB}
    budget = int(args.fraction * scaled.peak({u: Decision.KEEP for u in scaled.units}))
    wrapped: dict[str, Any] = {"fraction": args.fraction}
    for attempt in (budget, None):
        try:
            zoomem.wrap(model, attempt or wrapped["min_budget_bytes"], adapter=adapter, batch=batch,
                        trace_batch_size=scale.large)
        except zoomem.InfeasibleBudgetError as exc:
            wrapped.update(min_budget_bytes=exc.min_budget, error=str(exc))
            continue
        wrapped.pop("error", None)
        p = next(iter(model.__dict__["_zoomem"].plans.values()))
        wrapped.update(budget_mib=p.budget_bytes / MIB, predicted_mib=p.predicted_peak_bytes / MIB,
                       measured_mib=(p.extras.get("measured_peak_bytes") or 0) / MIB, traced_at=p.traced_at,
                       recomputed=sum(u.decision != Decision.KEEP for u in p.units), units=len(p.units))
        zoomem.unwrap(model)
        break
    if bar is not None:
        bar.write(f"{model_id}: keep {peaks['keep']['direct_mib']:.1f} / {peaks['keep']['scaled_mib']:.1f} MiB "
                  f"(direct / from {scale.small} and {scale.large}), planning {direct_s:.1f} / {scaled_s:.1f} s",
                  file=sys.stderr)
    return {"id": model_id, "batch_size": spec.batch_size, "sizes": spec.sizes, "overrides": spec.overrides,
            "traced_at": scale.sizes(), "plain_measured_mib": measured / MIB, "peaks": peaks,
            "direct_s": direct_s, "scaled_s": scaled_s, "plan": wrapped}


def _scale_cell(p: dict[str, float]) -> str:
    err = (p["scaled_mib"] - p["direct_mib"]) / p["direct_mib"]
    return f"{p['direct_mib']:.1f} / {p['scaled_mib']:.1f} ({err:+.1%})"


def _scale_plan_cell(r: dict[str, Any]) -> str:
    p = r["plan"]
    if "measured_mib" not in p:
        return "no plan: " + p.get("error", "")[:120]
    return (f"{p['budget_mib']:.1f} / {p['predicted_mib']:.1f} / {p['measured_mib']:.1f} "
            f"({p['recomputed']} of {p['units']} recomputed)")


SCALE_COLUMNS = (
    ("model", lambda r: r["id"]),
    ("sizes", _size_text),
    ("traced at", lambda r: f"{r['traced_at'][0]}, {r['traced_at'][1]}"),
    ("plain measured MiB", lambda r: _mib(r["plain_measured_mib"])),
    ("keep: direct / scaled MiB", lambda r: _scale_cell(r["peaks"]["keep"])),
    ("recompute", lambda r: _scale_cell(r["peaks"]["recompute"])),
    ("recompute_cheap", lambda r: _scale_cell(r["peaks"]["recompute_cheap"])),
    ("planning s: direct / scaled", lambda r: f"{r['direct_s']:.1f} / {r['scaled_s']:.1f}"),
    ("plan from scaled costs: budget / predicted / measured MiB", _scale_plan_cell),
)


def cmd_scale(args: argparse.Namespace) -> int:
    import torch

    from zoomem import zoo

    models = args.models or list(zoo.SMALL if args.quick else SCALE_SIZES)
    models = [m for m in models if not m.startswith("pyg/")]
    if not _known_models(models, zoo.SMALL if args.quick else SCALE_SIZES, args.quick, "scale size"):
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv)
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    rows = _run_models(models, scale_one, args, "scale")
    wall = time.perf_counter() - t0
    machine = machine_info()
    payload = {"benchmark": "scale", "command": command, "date": started.isoformat(timespec="seconds"),
               "machine": machine, "git": _git_info(), "wall_s": wall,
               "settings": {"quick": args.quick, "seed": args.seed, "fraction": args.fraction,
                            "trace_fraction": args.trace_fraction}, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    _print_run_head(command, machine, started, wall, args.markdown)
    print(format_table(rows, SCALE_COLUMNS, args.markdown))
    return 1 if any("error" in r for r in rows) else 0


# -- quantizer ---------------------------------------------------------------------------------------------------

QUANTIZER_SHAPES: dict[str, tuple[int, ...]] = {
    "flat 4 MiB (the planner's probe)": (1 << 20,),
    "ViT-Tiny b8 block activation": (8, 197, 192),
    "ViT-Tiny b8 MLP hidden": (8, 197, 768),
    "ResNet-50 b4 layer1": (4, 256, 56, 56),
    "ResNet-50 b4 stem": (4, 64, 112, 112),
    "BERT b2 seq 512 hidden": (2, 512, 768),
    "GNN 20k nodes x 64": (20_000, 64),
}
QUICK_QUANTIZER_SHAPES: dict[str, tuple[int, ...]] = {"flat 256 K": (1 << 16,), "rows with padding": (4, 3, 100)}
MASK_SHAPES: dict[str, tuple[int, ...]] = {"ResNet-50 b4 layer1 ReLU": (4, 256, 56, 56),
                                          "ViT-Tiny b8 MLP hidden": (8, 197, 768)}
QUICK_MASK_SHAPES: dict[str, tuple[int, ...]] = {"small": (4, 3, 100)}


def _time_alternating(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions alternating within each repeat (order reversed every other
    repeat), after ``warmup`` untimed repeats."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            fns[k]()
            if i >= warmup:
                times[k].append(time.perf_counter() - start)
    return {k: _median(v) for k, v in times.items()}


def _git_show(rev: str, path: str) -> str:
    """The text of ``path`` at git revision ``rev`` (``CalledProcessError`` if git does not know either)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True,
                          check=True).stdout


def _import_source(source: str, name: str) -> Any:
    """``source`` imported as module ``name``."""
    import importlib.util
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # read once, while the module executes
        file = Path(tmp) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def _quantizer_modules(rev: str) -> tuple[Any, Any]:
    """``zoomem/compress/quantize.py`` and ``zoomem/ops/packbits.py`` as they were at git revision ``rev``, the
    quantizer importing that packbits where it imports one (its other relative imports point at this checkout's
    package), to time them beside this checkout's in one process."""
    import re

    tag = re.sub(r"\W", "_", rev)
    packbits = _import_source(_git_show(rev, "zoomem/ops/packbits.py"), f"zoomem_packbits_{tag}")
    source = _git_show(rev, "zoomem/compress/quantize.py").replace("from ..ops.packbits", f"from zoomem_packbits_{tag}")
    source = source.replace("from ..", "from zoomem.").replace("from .", "from zoomem.compress.")
    return _import_source(source, f"zoomem_quantize_{tag}"), packbits


def cmd_quantizer(args: argparse.Namespace) -> int:
    """Seconds per byte of fp32 to quantize and dequantize typical activations, per width (and against an older
    revision's quantizer, interleaved in the same process), beside the planner's probe (``seconds_per_byte``)."""
    import importlib
    import subprocess

    import torch

    if args.render:
        data = json.loads(Path(args.render).read_text())
        print(quantizer_table(data, args.markdown))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    current = importlib.import_module("zoomem.compress.quantize")
    from zoomem.ops import packbits
    from zoomem.ops.functional import _masked_grad

    try:
        old, old_bits = _quantizer_modules(args.against) if args.against else (None, None)
    except subprocess.CalledProcessError as e:
        print(f"cannot read zoomem's quantizer or packbits at {args.against!r}: {e.stderr.strip()}", file=sys.stderr)
        return 2
    command = "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv)
    git_info = _git_info()
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    modules = {"current": current, **({args.against: old} if old else {})}
    rows = []
    for name, shape in (QUICK_QUANTIZER_SHAPES if args.quick else QUANTIZER_SHAPES).items():
        x = torch.randn(shape, generator=gen)
        for bits in args.bits:
            times = _time_alternating({k: (lambda m=m: m.dequantize(m.quantize(x, bits, generator=gen)))
                                       for k, m in modules.items()}, args.warmup, args.repeats)
            rows.append({"tensor": name, "shape": list(shape), "bits": bits,
                         **{f"ns_per_byte_{k}": v / (x.numel() * 4) * 1e9 for k, v in times.items()}})
    # the 1-bit masks of ReLU / BatchNorm + ReLU: packing, unpacking, and applying one to a gradient in backward
    # (this checkout's plane-by-plane way; with --against, that revision's packbits and its masked_fill on the mask)
    masks = []
    for name, shape in (QUICK_MASK_SHAPES if args.quick else MASK_SHAPES).items():
        mask, grad = torch.randn(shape, generator=gen) > 0, torch.randn(shape, generator=gen)
        libs = {"current": packbits, **({args.against: old_bits} if old_bits else {})}
        packed = {k: lib.pack_bool(mask) for k, lib in libs.items()}
        ops = {
            "pack": {k: (lambda lib=lib: lib.pack_bool(mask)) for k, lib in libs.items()},
            "unpack": {k: (lambda lib=lib, k=k: lib.unpack_bool(*packed[k])) for k, lib in libs.items()},
            "apply to a gradient": {"current": lambda: _masked_grad(grad, *packed["current"]), **(
                {args.against: lambda: grad.masked_fill(~old_bits.unpack_bool(*packed[args.against]), 0)}
                if old_bits else {})},
        }
        with torch.no_grad():
            for op, fns in ops.items():
                times = _time_alternating(fns, args.warmup, args.repeats)
                masks.append({"mask": name, "shape": list(shape), "operation": op,
                              **{f"ms_{k}": v * 1e3 for k, v in times.items()}})
    probe = {b: current.seconds_per_byte("cpu", b) * 1e9 for b in args.bits}
    per_call = {b: current.seconds_per_call("cpu", b) * 1e3 for b in args.bits}
    data = {**_result_head("quantizer", command, started, time.perf_counter() - t0, git_info),
            "settings": {"repeats": args.repeats, "warmup": args.warmup, "against": args.against,
                         "timing": "quantize then dequantize one fp32 tensor, median over repeats; with --against, "
                                   "the two quantizers alternate within each repeat"},
            "probe_ns_per_byte": probe, "probe_ms_per_call": per_call, "rows": rows, "masks": masks}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(quantizer_table(data, args.markdown))
    return 0


def quantizer_table(data: dict[str, Any], markdown: bool) -> str:
    against = data["settings"]["against"]
    per_call = data.get("probe_ms_per_call")  # runs before seconds_per_call have none
    rate = {str(b): v for b, v in data["probe_ns_per_byte"].items()}  # int keys, or str ones read back from JSON
    fixed = {str(b): v for b, v in (per_call or {}).items()}

    def model(r: dict[str, Any]) -> list[str]:  # the planner's price of this tensor, per byte
        if per_call is None:
            return []
        bits = str(r["bits"])
        return [f"{rate[bits] + fixed[bits] * 1e6 / (4 * math.prod(r['shape'])):.2f}"]

    heads = (["tensor", "shape", "bits", "ns/B"] + (["planner's ns/B"] if per_call is not None else [])
             + ([f"ns/B at {against}", "speed-up"] if against else []))
    cells = []
    for r in data["rows"]:
        row = [r["tensor"], "x".join(map(str, r["shape"])), str(r["bits"]), f"{r['ns_per_byte_current']:.2f}", *model(r)]
        if against:
            row += [f"{r[f'ns_per_byte_{against}']:.2f}", f"{r[f'ns_per_byte_{against}'] / r['ns_per_byte_current']:.2f}x"]
        cells.append(row)
    probe = ", ".join(f"{b} bits {v:.2f}" for b, v in data["probe_ns_per_byte"].items())
    if per_call is not None:
        probe += "; per tensor (seconds_per_call), ms: " + ", ".join(f"{b} bits {v:.3f}" for b, v in per_call.items())
    mask_heads = ["1-bit mask", "shape", "operation", "ms"] + ([f"ms at {against}", "speed-up"] if against else [])
    mask_cells = []
    for r in data.get("masks", []):
        row = [r["mask"], "x".join(map(str, r["shape"])), r["operation"], f"{r['ms_current']:.2f}"]
        if against:
            row += [f"{r[f'ms_{against}']:.2f}", f"{r[f'ms_{against}'] / r['ms_current']:.2f}x"]
        mask_cells.append(row)
    return (f"{_machine_line(data['machine'])}\n{data['command']}\n\n" + _grid(heads, cells, markdown, left=3)
            + f"\n\nThe planner's probe (seconds_per_byte, this checkout), ns/B: {probe}"
            + ("\n\n" + _grid(mask_heads, mask_cells, markdown, left=3) if mask_cells else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "baseline",
        help="plain PyTorch training step (AdamW) of the zoo matrix models",
        description="Measure plain PyTorch's training step (AdamW, 2 steps, the second reported) of each zoo "
        "matrix model with zoomem's memory meter.",
    )
    p.add_argument("--quick", action="store_true", help="the zoo.small variants (seconds; for tests)")
    p.add_argument("--models", nargs="+", metavar="ID", help="model ids (default: all of zoo.ZOO_MATRIX)")
    p.add_argument("--out", default="benchmarks/baseline.json", help="JSON output (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True,
                   help="AdamW foreach implementation (the CUDA default; default: %(default)s)")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser(
        "sweep",
        help="peak memory against step-time overhead: zoomem's ILP budgets and the peers, per model",
        description="For each model, in one process: plain PyTorch, the zoo's own full checkpointing, torch.compile "
        "with an activation memory budget (on --compile-models), zoomem's ILP at 100..40%% of PyTorch's peak and "
        "at the minimum feasible budget, and zoomem's `all` and `sqrt` baselines. Steps are timed interleaved "
        "without the meter; one more metered step per method gives the memory. Then (not with --quick) the ILP's "
        "solve time on BERT-large and ResNet-152 at batch 32.",
    )
    p.add_argument("--quick", action="store_true",
                   help="the zoo.small variants, one budget fraction and the minimum, 2 steps, no compile, no "
                   "solve-time section (seconds; for tests)")
    p.add_argument("--models", nargs="+", metavar="ID", help=f"model ids (default: {' '.join(SWEEP_SIZES)})")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method (median; default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds, untimed (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/sweep.json", help="JSON output (default: %(default)s)")
    p.add_argument("--plot", help="PNG output; '' for none (default: benchmarks/sweep.png when running, none with "
                   "--render, which would otherwise overwrite the stored run's plot with another JSON's)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True,
                   help="AdamW foreach implementation (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=10.0, help="ILP solver time limit, s (default: %(default)s)")
    p.add_argument("--compile-models", nargs="*", default=list(COMPILE_MODELS), metavar="ID",
                   help="models to try torch.compile on (default: %(default)s)")
    p.add_argument("--compile-budget", type=float, default=0.5,
                   help="torch._functorch.config.activation_memory_budget (default: %(default)s)")
    p.add_argument("--compile-timeout", type=float, default=600.0,
                   help="give up compiling after this many seconds (default: %(default)s)")
    p.add_argument("--skip-solve", action="store_true", help="skip the solve-time section")
    p.add_argument("--render", metavar="JSON", help="print the tables of a result JSON written before and redraw "
                   "--plot from it; run nothing")
    p.add_argument("--solve-models", nargs="+", default=list(SOLVE_SIZES), metavar="ID", choices=list(SOLVE_SIZES),
                   help="models of the solve-time section (default: %(default)s)")
    p.add_argument("--trace-timeout", type=float, default=600.0,
                   help="solve-time section: a trace slower than this retries at half the batch (default: %(default)s)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "compress",
        help="activation compression (GACT-style levels) and compression planned with recomputation, per model",
        description="For each model, in one process: plain PyTorch, zoomem's compression levels L0..L3 and, at "
        "budgets of 90..30%% of plain PyTorch's peak (and the minimum feasible one), lossless planning "
        "(wrap(budget=...)) and the combined mode (wrap(budget=..., compress='auto')). Reports the activation "
        "bytes against plain PyTorch's, the measured peaks and the step-time overheads (interleaved, medians), "
        "and whether the combined mode reaches lower peaks than either alone at the same overhead.",
    )
    p.add_argument("--quick", action="store_true",
                   help="the zoo.small variants, budgets 80%% and 50%% (and the minimum), 2 timed steps "
                   "(seconds; for tests)")
    p.add_argument("--models", nargs="+", metavar="ID", help=f"model ids (default: {' '.join(COMPRESS_SIZES)})")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="batch size for every model instead of its COMPRESS_SIZES one (default: those)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every model, over its COMPRESS_SIZES ones (e.g. --set n_layer=12: "
                   "GPT-2 at its released depth)")
    p.add_argument("--levels", nargs="+", default=list(COMPRESS_LEVELS), choices=list(COMPRESS_LEVELS),
                   metavar="LEVEL", help="levels to measure (default: %(default)s)")
    p.add_argument("--fractions", nargs="+", type=float, metavar="F",
                   help=f"budgets, fractions of plain PyTorch's peak (default: {' '.join(map(str, COMPRESS_FRACTIONS))})")
    p.add_argument("--skip-logits", action="store_true",
                   help="wrap with skip_logits=True: HF LMs' training forward returns logits=None where the fused "
                   "LM-head loss runs (plain PyTorch's step still returns them)")
    p.add_argument("--matched", action=argparse.BooleanOptionalAction, default=True,
                   help="also plan both budget modes just below the predicted peak of each lossy level and lossless "
                   "plan, so that each meets a plan of both modes at its own memory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method (median; default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds, untimed (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/compress.json", help="JSON output (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0: torch's choice (default: %(default)s: on a shared CPU, more "
                   "threads than the cores left free make every step slower and its time noisy)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True,
                   help="AdamW foreach implementation (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=10.0, help="ILP solver time limit, s (default: %(default)s)")
    p.add_argument("--render", metavar="JSON", help="print the tables of a result JSON written before; run nothing")
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser(
        "accuracy",
        help="compressed training against plain PyTorch on real data (zoomem.tasks), several seeds",
        description="Per task and seed: plain PyTorch (L0) and each level, the same seed and steps; the per-seed and "
        "mean accuracy differences, judged against issue 4's allowed drops (L2 0.5, L1.2 2 points).",
    )
    p.add_argument("--quick", action="store_true", help="the graph task, seed 0, 3 steps (seconds; for tests)")
    p.add_argument("--tasks", nargs="+", choices=["digits", "text", "graph"], help="tasks (default: all three)")
    p.add_argument("--seeds", nargs="+", type=int, help="seeds (default: 0 1 2 3 4)")
    p.add_argument("--levels", nargs="+", default=["L2", "L1.2"], metavar="LEVEL",
                   help="levels against L0 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: each task's own)")
    p.add_argument("--control-noise", type=float, default=0.01, metavar="REL",
                   help="also run plain PyTorch with every gradient element times 1 + REL * N(0, 1) "
                        "(zoomem.tasks.gradient_noise), reported beside the levels: how far a small perturbation "
                        "alone moves each task's accuracy; 0: skip (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0: torch's choice (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/accuracy.json", help="JSON output (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--render", metavar="JSON", help="print the tables of a result JSON written before; run nothing")
    p.set_defaults(func=cmd_accuracy)

    p = sub.add_parser(
        "scale",
        help="planning a batch from traces of smaller ones: extrapolated costs against a trace at the batch",
        description="Per model, the cost model traced at the batch against the one extrapolated from traces at a "
        "quarter and a half of it (the peaks both predict, the plain step's measured peak, planning time), and a "
        "budgeted plan from the extrapolated costs measured at the batch.",
    )
    p.add_argument("--quick", action="store_true", help="the zoo.small variants at batch 8 (seconds; for tests)")
    p.add_argument("--models", nargs="+", metavar="ID", help="model ids (default: SCALE_SIZES)")
    p.add_argument("--fraction", type=float, default=0.6,
                   help="budget of the plan, as a fraction of plain PyTorch's predicted peak (default: %(default)s)")
    p.add_argument("--trace-fraction", type=float, default=0.5,
                   help="trace at this share of the batch and half of it (default: %(default)s, the sizes zoomem "
                   "falls back to when the batch runs out of memory)")
    p.add_argument("--out", default="benchmarks/scale.json", help="JSON output (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: %(default)s)")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser(
        "quantizer",
        help="the quantizer's speed (ns per byte to quantize and dequantize typical activations, per width) and the "
        "1-bit masks' (pack, unpack, apply to a gradient)",
        description="Quantize then dequantize fp32 tensors shaped like the compress models' activations, per bit "
        "width, median of --repeats; with --against REV, the quantizer of that git revision alternates with this "
        "checkout's in the same process. Prints the planner's probe (seconds_per_byte) beside them. Then the 1-bit "
        "masks of ReLU and BatchNorm + ReLU: pack, unpack and apply to a gradient in backward (with --against, that "
        "revision's packbits and masked_fill on its mask, the backward before the plane-by-plane one).",
    )
    p.add_argument("--quick", action="store_true", help="two small tensors (seconds; for tests)")
    p.add_argument("--bits", nargs="+", type=int, default=[1, 2, 4, 8], choices=[1, 2, 4, 8],
                   help="widths (default: %(default)s)")
    p.add_argument("--against", metavar="REV", help="also time zoomem/compress/quantize.py of this git revision")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats (median; default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats first (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0: torch's choice (default: %(default)s, as compress)")
    p.add_argument("--seed", type=int, default=0, help="noise and data seed (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/quantizer.json", help="JSON output (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--render", metavar="JSON", help="print the table of a result JSON written before; run nothing")
    p.set_defaults(func=cmd_quantizer)

    p = sub.add_parser("_solve")  # internal: one model of the solve-time section, in a child process
    p.add_argument("model", choices=list(SOLVE_SIZES))
    p.add_argument("batch_size", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--trace-timeout", type=float, default=600.0)
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_solve_child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
