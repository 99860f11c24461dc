"""The ``zoomem`` command: ``zoomem demo``, ``zoomem max-batch|trace|plan <model-id>``, ``zoomem models``,
``zoomem bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Sequence

__all__ = ["main"]

logger = logging.getLogger(__name__)

DEMO_ARGV = ("hf/bert-base-uncased", "--set", "num_hidden_layers=6", "--set", "hidden_size=128", "--set",
             "num_attention_heads=4", "--set", "intermediate_size=512", "--set", "vocab_size=8192", "--seq-len", "32",
             "--budget", "48MiB", "--methods", "pytorch", "checkpoint", "lossless", "L2", "auto", "--time-steps", "1",
             "--threads", "1")
"""``zoomem demo``: the max-batch search it runs. A 6-layer BERT 128 wide (vocabulary 8192) at sequence length 32:
a probe takes seconds on one CPU thread, and its activations, not its parameters, fill the budget. One torch thread
so that a shared or busy machine does not slow it down further; `compile` is left out (minutes of compilation)."""


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"zoomem: --set expects KEY=VALUE (e.g. --set num_hidden_layers=2), got {pair!r}")
        k, v = pair.split("=", 1)
        out[k] = _parse_value(v)
    return out


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    names = ("seq_len", "image_size", "num_nodes", "num_edges")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _trace_one(model_id: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from . import zoo
    from .graph import trace

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, adapter = zoo.build(model_id, **_overrides(args.set))
    model.to(args.device)
    batch = adapter.example_batch(model, args.batch, **_sizes(args)).to(args.device)
    built = time.perf_counter() - t0
    graph = trace(model, batch, adapter=adapter)
    return {"id": model_id, "graph": graph, "build_s": built, "trace_s": time.perf_counter() - t0 - built}


def cmd_trace(args: argparse.Namespace) -> int:
    results = [_trace_one(mid, args) for mid in args.model]
    if args.json:
        payload = [dict(id=r["id"], **r["graph"].to_dict()) for r in results]
        json.dump(payload if len(payload) > 1 else payload[0], sys.stdout)
        sys.stdout.write("\n")
        return 0
    for r in results:
        print(f"\n== {r['id']}  (built in {r['build_s']:.2f} s, traced in {r['trace_s']:.2f} s)")
        print(r["graph"].summary())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from . import zoo
    from .runtime import plan

    torch.manual_seed(args.seed)
    model, adapter = zoo.build(args.model, **_overrides(args.set))
    model.to(args.device)
    batch = adapter.example_batch(model, args.batch, **_sizes(args)).to(args.device)
    budget: object = args.budget
    if budget is not None and budget.replace(".", "", 1).isdigit():
        budget = float(budget) if "." in budget else int(budget)
    result = plan(model, batch, budget, strategy=args.strategy, adapter=adapter, time_limit=args.time_limit,
                  compress=args.compress, level=args.level, skip_logits=args.skip_logits)
    if args.json:
        print(result.to_json())
    else:
        print(f"== {args.model}")
        print(result.summary())
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import zoo

    for mid in zoo.list_models():
        print(mid)
    print("timm/<any timm model name>   (built with pretrained=False)")
    return 0


def cmd_max_batch(args: argparse.Namespace) -> int:
    from . import maxbatch

    return maxbatch.main(args, maxbatch.command_line("zoomem max-batch", args.argv[1:]))


def cmd_demo(args: argparse.Namespace) -> int:
    from . import maxbatch

    argv = ["max-batch", *DEMO_ARGV] + (["--markdown"] if args.markdown else [])
    print(f"zoomem demo = {maxbatch.command_line('zoomem', argv)}\n", flush=True)
    sub = build_parser().parse_args(argv)
    return maxbatch.main(sub, maxbatch.command_line("zoomem", argv))


def cmd_bench(args: argparse.Namespace) -> int:
    """``scripts/bench.py`` lives in the repository, not in the installed package: run it from the checkout (its
    tables read the checkout's git state, and its sizes are the repository's benchmark record)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
    if not script.exists():
        print("zoomem bench: scripts/bench.py is not here; it ships with the source checkout "
              "(git clone the repository, `pip install -e .`, then `zoomem bench ...`).", file=sys.stderr)
        return 2
    bench = runpy.run_path(str(script), run_name="zoomem_bench")
    return int(bench["main"](list(args.bench_args)))


def _add_size_flags(p: argparse.ArgumentParser, default_batch: int) -> None:
    p.add_argument("--batch", type=int, default=default_batch, help="batch size (graphs: scales the node count)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="sequence length (HF text models)")
    p.add_argument("--image-size", dest="image_size", type=int, help="image height = width (timm, HF ViT)")
    p.add_argument("--num-nodes", dest="num_nodes", type=int, help="nodes of the random graph (PyG)")
    p.add_argument("--num-edges", dest="num_edges", type=int, help="edges of the random graph (PyG)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a model/config field, e.g. --set num_hidden_layers=2 (repeatable)",
    )
    p.add_argument("--device", default="cpu", help="device to trace on (cpu, cuda, cuda:1, ...)")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="zoomem", description=__doc__)
    parser.add_argument("--version", action="version", version=f"zoomem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trace", help="trace one training step and print the per-unit table")
    p.add_argument("model", nargs="+", help="model ids: timm/resnet50, hf/bert-base-uncased, pyg/gcn, ...")
    _add_size_flags(p, default_batch=8)
    p.add_argument("--json", action="store_true", help="print the operator graph as JSON")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("demo", help="find each method's largest batch within a budget on a small BERT (CPU, "
                       "minutes) and print the comparison; `zoomem trace` prints the per-unit tables")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.set_defaults(func=cmd_demo)

    from . import maxbatch

    p = sub.add_parser("max-batch", help="each method's largest batch (or width, depth, resolution, sequence "
                       "length) within a memory budget, every probe a real training step")
    maxbatch.add_arguments(p)
    p.set_defaults(func=cmd_max_batch)

    p = sub.add_parser("bench", add_help=False, help="run scripts/bench.py (needs the source checkout): baseline, "
                       "sweep, compress")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="scripts/bench.py's arguments")
    p.set_defaults(func=cmd_bench)  # main() hands everything after `bench` over unparsed (its --help included)

    p = sub.add_parser("plan", help="plan a training step under a memory budget and print the plan")
    p.add_argument("model", help="model id: timm/resnet50, hf/bert-base-uncased, pyg/gcn, ...")
    p.add_argument(
        "--budget", default=None,
        help="bytes with a unit ('6GiB', '512MiB'), a share of plain PyTorch's peak ('60%%' or 0.6), or bytes",
    )
    p.add_argument("--strategy", default="ilp", help="ilp (default), none, all, sqrt, greedy")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=10.0,
                   help="seconds for solving the plan (warm start, program and bound together)")
    p.add_argument("--compress", choices=["auto"], default=None,
                   help="with --budget: also store saved tensors in 8/4/2/1 bits, chosen with recomputation")
    p.add_argument("--level", default=None,
                   help="compression level without a budget: L0, L1, L1.1, L1.2, L2, L2.1, L2.2, L3")
    p.add_argument("--skip-logits", dest="skip_logits", action="store_true",
                   help="HF LMs: plan the step that returns logits=None (zoomem.wrap(skip_logits=True))")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_size_flags(p, default_batch=8)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list the built-in model ids")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # unknown ids, bad overrides, infeasible budgets: the message says what to do
        print(f"zoomem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
