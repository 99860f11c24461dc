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
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

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
    "hf/vit-base-patch16-224": BenchSize(4, _IMG224),
    "pyg/gcn": _GRAPH20K,
    "pyg/gat": _GRAPH20K,
    "pyg/sage": _GRAPH20K,
    "pyg/gin": _GRAPH20K,
}
"""Default ``baseline`` sizes: the real layouts (timm defaults with 1000 classes, the catalogue's HF layouts and
PyG constructor defaults), at batch sizes a 2-core CPU steps in seconds."""


# -- machine ----------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _machine_line(m: dict[str, Any]) -> str:
    cpu = m["cpu_model"] or m["processor"] or m["machine"]
    return f"{cpu} ({m['machine']}), {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}"


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


# -- command line -----------------------------------------------------------------------------------------------


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
