"""Pieces every zoomem benchmark shares: the machine and code a run measured, one training step, a timeout,
aligned or markdown tables.

``scripts/bench.py`` and :mod:`zoomem.maxbatch` both use them, so that their JSON files describe machines the
same way and their tables read alike.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["Alarm", "add_model_arguments", "exc_text", "git_info", "grid", "machine_info", "machine_line", "median",
           "model_and_batch", "model_from_arguments", "result_head", "train_step"]


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
    """Processor, cores, torch threads and versions: what a reader needs to compare two runs."""
    import torch

    info: dict[str, Any] = {
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["cuda_device"] = props.name
        info["cuda_memory_bytes"] = int(props.total_memory)
    return info


def machine_line(m: dict[str, Any]) -> str:
    """One line for a table's heading: CPU, cores, torch threads, torch version (and the GPU where there is one)."""
    cpu = m["cpu_model"] or m["processor"] or m["machine"]
    line = f"{cpu} ({m['machine']}), {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}"
    if m.get("cuda_device"):
        line += f", {m['cuda_device']} ({m['cuda_memory_bytes'] / 2**30:.0f} GiB)"
    return line


def git_info(root: Path | None = None) -> dict[str, Any]:
    """The checkout's HEAD and which files under zoomem/ or scripts/ differ from it (``{}`` outside a git
    checkout): a result names the code it measured."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=20)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "zoomem", "scripts"], cwd=root,
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if head.returncode != 0:
        return {}
    return {"commit": head.stdout.strip(), "dirty": [line[3:] for line in dirty.stdout.splitlines()]}


def result_head(benchmark: str, command: str, started: datetime.datetime, wall_s: float, code: dict[str, Any],
                machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every result JSON starts with: what ran, when, on which machine and code, for how long."""
    return {
        "benchmark": benchmark,
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine or machine_info(),
        "git": code,
        "wall_s": wall_s,
    }


def train_step(model: Any, batch: Any, loss_fn: Any, optimizer: Any) -> None:
    """Forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``: one ordinary step."""
    output = batch.call(model)
    loss = loss_fn(output, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Alarm:
    """Raise TimeoutError in the main thread after ``seconds`` (no-op where SIGALRM is missing or seconds <= 0)."""

    def __init__(self, seconds: float | None, what: str) -> None:
        self.seconds, self.what = seconds or 0.0, what

    def _fire(self, *_: Any) -> None:
        raise TimeoutError(f"{self.what} did not finish in {self.seconds:.0f} s")

    def __enter__(self) -> "Alarm":
        import signal

        if hasattr(signal, "SIGALRM") and self.seconds > 0:
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        if hasattr(signal, "SIGALRM") and self.seconds > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)


def model_and_batch(model_id: str, batch_size: int, small: bool = False,
                    overrides: Sequence[str] = ()) -> tuple[Any, Any, Any]:
    """A zoo model, its adapter and its example batch as the scripts take them: the test suite's small layout
    (``small``, :func:`zoomem.zoo.small`) or the full one with ``KEY=INT`` config overrides (``--set``)."""
    from zoomem import zoo

    if small:
        return zoo.small(model_id, batch_size=batch_size)
    model, adapter = zoo.build(model_id, **{k: int(v) for k, v in (s.split("=") for s in overrides)})
    return model, adapter, adapter.example_batch(model, batch_size)


def add_model_arguments(parser: Any, batch: int, what: str = "a zoo id (zoomem.zoo)") -> None:
    """The arguments that pick a zoo model and its example batch, as :func:`model_from_arguments` reads them."""
    parser.add_argument("model", help=f"{what}, built from its config")
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the adapter's)")
    parser.add_argument("--small", action="store_true", help="the test suite's small layout (zoomem.zoo.small)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="config override")


def model_from_arguments(args: Any) -> tuple[Any, Any, Any]:
    """The model, adapter and example batch that :func:`add_model_arguments`' arguments name."""
    model, adapter, batch = model_and_batch(args.model, args.batch, args.small, args.set)
    if args.seq_len is not None:
        batch = adapter.example_batch(model, args.batch, seq_len=args.seq_len)
    return model, adapter, batch


def exc_text(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def interleaved_medians(names: Sequence[str], step: Callable[[str], Any], rounds: int) -> dict[str, float]:
    """Median seconds of ``step(name)`` per name over ``rounds`` rounds that run every name in turn, after one
    untimed warm-up round: each configuration meets the machine's drift alike."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in names:
            start = time.perf_counter()
            step(name)
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in times.items()}


def grid(heads: Sequence[str], cells: Sequence[Sequence[str]], markdown: bool, left: int = 2) -> str:
    """A table: markdown, or aligned text; the first ``left`` columns left-aligned, the others right-aligned."""
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * left + "---:|" * (len(heads) - left)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    fmt = lambda row: "  ".join(  # noqa: E731
        (v.ljust(w) if i < left else v.rjust(w)) for i, (v, w) in enumerate(zip(row, widths))
    )
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells])
