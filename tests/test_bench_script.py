"""The scripts in ``scripts/`` end to end on small models: each writes what its docstring says, and its numbers obey
the meter's definitions.

``bench.py baseline`` runs as users run it, in a subprocess; the others call the script's ``main(argv)`` in this
process (:func:`run_script`, as ``zoomem bench`` does): the same code after ``if __name__ == "__main__"``, without
paying about 6 s of imports (torch, transformers, timm, PyG) per run.
"""

import contextlib
import datetime
import io
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def run_script(cmd: list[str], cwd: Path = REPO) -> SimpleNamespace:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for ``cmd = [python, script, *argv]``, run in this
    process as ``zoomem bench`` runs ``bench.py`` (``runpy.run_path``, then its ``main(argv)``), stdout and stderr
    captured, in ``cwd``; torch's thread count and the loggers' levels (which the scripts set: ``bench.py`` quiets
    ``zoomem`` to warnings) restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    threads, here = torch.get_num_threads(), Path.cwd()
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    levels = [(lg, lg.level) for lg in loggers]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            script = runpy.run_path(cmd[1], run_name=f"zoomem_script_{Path(cmd[1]).stem}")
            try:
                code = script["main"]([str(a) for a in cmd[2:]])
            except SystemExit as exit_:  # argparse errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
        for lg, level in levels:
            lg.setLevel(level)
    return SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())


def test_bench_baseline_quick(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "baseline", "--quick",
           "--models", "timm/resnet18", "pyg/gcn", "--out", str(out), "--markdown"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)  # as users run it
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| `timm/resnet18` |" in proc.stdout and "| `pyg/gcn` |" in proc.stdout

    data = json.loads(out.read_text())
    assert data["benchmark"] == "baseline"
    assert data["settings"]["quick"] is True
    machine = data["machine"]
    assert machine["torch"] == torch.__version__ and machine["cores"] >= 1 and "processor" in machine
    datetime.datetime.fromisoformat(data["date"])

    results = {r["id"]: r for r in data["results"]}
    assert list(results) == ["timm/resnet18", "pyg/gcn"]
    assert results["timm/resnet18"]["sizes"] == {"image_size": 64}
    assert results["pyg/gcn"]["sizes"]["num_nodes"] == 2000
    for r in results.values():
        assert "error" not in r
        rep = r["report"]
        phases = rep["phases"]
        assert list(phases) == ["forward", "backward", "optimizer"]
        base, peak, act = rep["baseline_bytes"], rep["peak_bytes"], rep["activation_bytes"]
        param = r["param_mib"] * MIB
        fwd_bwd = max(phases["forward"]["peak_bytes"], phases["backward"]["peak_bytes"])
        assert r["param_mib"] > 0 and act > 0
        # second step: params, AdamW's exp_avg and exp_avg_sq (each the params' size) are all live at the start
        assert base >= 3 * param
        assert phases["forward"]["peak_bytes"] >= base + act  # forward's end is inside its phase
        assert peak >= fwd_bwd >= base + act
        assert peak >= phases["optimizer"]["peak_bytes"] >= base
        assert r["fwd_bwd_peak_mib"] * MIB == fwd_bwd and r["step_peak_mib"] * MIB == peak
        assert r["activation_mib"] * MIB == act and r["optimizer_peak_mib"] * MIB == phases["optimizer"]["peak_bytes"]


def test_bench_sweep_quick(tmp_path):
    """`sweep --quick`: every method of two small models, measured and timed in one process each; JSON, PNG, tables."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "sweep", "--quick",
           "--models", "pyg/gcn", "hf/bert-base-uncased", "--out", str(out), "--plot", str(png), "--markdown"]
    level = logging.getLogger("zoomem").level
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert logging.getLogger("zoomem").level == level  # the sweep quiets zoomem; later tests read its INFO records
    assert "| plain PyTorch | — |" in proc.stdout and "| zoomem ILP | min (" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"  # --render: the same tables and a plot from the JSON alone
    rendered = run_script([sys.executable, str(REPO / "scripts" / "bench.py"), "sweep", "--render", str(out),
                          "--plot", str(again), "--markdown"])
    assert rendered.returncode == 0, rendered.stderr[-4000:]
    assert rendered.stdout == proc.stdout and again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tables_only = run_script([sys.executable, str(REPO / "scripts" / "bench.py"), "sweep", "--render", str(out)],
                             cwd=tmp_path)
    assert tables_only.returncode == 0, tables_only.stderr[-4000:]
    assert not (tmp_path / "benchmarks").exists()  # --render draws only where --plot says (no default overwrite)

    data = json.loads(out.read_text())
    assert data["benchmark"] == "sweep" and data["settings"]["quick"] is True
    assert data["settings"]["timed_rounds"] == 2 and data["settings"]["budget_fractions"] == [1.0, 0.6]
    assert data["machine"]["torch"] == torch.__version__
    assert data["git"] == {} or len(data["git"]["commit"]) == 40
    datetime.datetime.fromisoformat(data["date"])
    assert data["solve"] == [] and set(data["targets"]) == {"a", "b", "c"}

    results = {r["id"]: r for r in data["results"]}
    assert list(results) == ["pyg/gcn", "hf/bert-base-uncased"]
    for r in results.values():
        assert "error" not in r, r.get("error")
        methods = {m["method"]: m for m in r["methods"]}
        assert {"pytorch", "native", "compile", "ilp@100%", "ilp@min", "all", "sqrt"} <= set(methods)
        # 60% is either planned or recorded as skipped below the minimum feasible budget
        assert ("ilp@60%" in methods) != any(s["budget_frac"] == 0.6 for s in r["skipped_budgets"])
        assert methods["compile"]["error"].startswith("not tried")
        ref = methods["pytorch"]
        assert ref["overhead"] == 1.0 and ref["pct_of_pytorch"] == 100.0
        for key, m in methods.items():
            if key == "compile":
                continue
            phases = m["report"]["phases"]
            assert list(phases) == ["forward", "backward", "optimizer"]
            peak = max(phases["forward"]["peak_bytes"], phases["backward"]["peak_bytes"])
            assert m["fwd_bwd_peak_mib"] * MIB == peak
            assert m["activation_mib"] * MIB == m["report"]["activation_bytes"] > 0
            assert peak >= m["report"]["baseline_bytes"] + m["report"]["activation_bytes"]
            assert len(m["step_s"]) == 2 and m["overhead"] > 0
            assert abs(m["pct_of_pytorch"] - 100 * m["fwd_bwd_peak_mib"] / ref["fwd_bwd_peak_mib"]) < 1e-6
            if m["kind"] == "zoomem":
                assert m["predicted_peak_mib"] > 0 and m["solve_s"] >= 0 and m["units"] > 0
        assert methods["ilp@100%"]["recomputed"] + methods["ilp@100%"]["recomputed_cheap"] == 0
        assert methods["all"]["recomputed"] == methods["all"]["units"]
        assert methods["ilp@min"]["budget_bytes"] >= r["min_budget_mib"] * MIB - 1
    assert results["hf/bert-base-uncased"]["methods"][1]["label"] == "HF gradient_checkpointing_enable"
    assert "zoomem `all`" in results["pyg/gcn"]["methods"][1]["label"]  # PyG has no checkpointing of its own


def test_bench_compress_quick(tmp_path):
    """`compress --quick` on the small GCN: every level and both budget modes (also just below the levels' and the
    lossless plans' peaks), measured in one process; JSON, tables."""
    out = tmp_path / "compress.json"
    levels = ["L0", "L1.1", "L1.2", "L2", "L2.2"]  # fixed and adaptive bits, the wrap's own level; ~1 s a level
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "compress", "--quick", "--models", "pyg/gcn",
           "--levels", *levels, "--out", str(out), "--markdown"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| plain PyTorch | — |" in proc.stdout and "| L2.2 (adaptive, 2 bits avg) |" in proc.stdout
    assert "L2.2: activations >= 8x smaller" in proc.stdout and "| any |" in proc.stdout
    assert "| overhead x | predicted x |" in proc.stdout and "| combined x (predicted) |" in proc.stdout

    data = json.loads(out.read_text())
    assert data["benchmark"] == "compress" and data["settings"]["quick"] is True
    assert data["settings"]["timed_rounds"] == 2 and data["settings"]["budget_fractions"] == [0.8, 0.5]
    assert data["settings"]["levels"] == levels
    assert data["machine"]["torch"] == torch.__version__
    assert data["git"] == {} or len(data["git"]["commit"]) == 40
    datetime.datetime.fromisoformat(data["date"])

    (r,) = data["results"]
    assert r["id"] == "pyg/gcn" and "error" not in r, r.get("error")
    methods = {m["method"]: m for m in r["methods"]}
    assert set(data["settings"]["levels"]) | {"pytorch"} <= set(methods)
    ref = methods["pytorch"]
    assert ref["overhead"] == 1.0 and ref["activation_ratio"] == 1.0
    assert ref["activation_mib"] == r["pytorch_activation_mib"] and ref["fwd_bwd_peak_mib"] == r["pytorch_peak_mib"]
    for mode in ("lossless", "combined"):  # each budget is planned, infeasible, or skipped below the minimum
        for frac in (0.8, 0.5):
            key = f"{mode}@{frac:.0%}"
            assert (key in methods) != any(s["mode"] == mode and s["budget_frac"] == frac for s in r["skipped_budgets"])
    rows = {b["budget"]: b for b in r["comparison"]["budgets"]}
    if "error" not in methods.get("lossless@min", {"error": ""}):  # the combined mode at lossless planning's floor
        at = methods["combined@lossless min"]
        assert at["budget_bytes"] == methods["lossless@min"]["budget_bytes"]
        assert rows["lossless min"]["combined"]["method"] == "combined@lossless min"
    below = {k: m for k, m in methods.items() if "@<" in k}  # both modes just below a level's or plan's peak
    assert any(k.startswith("combined@<") for k in below) and data["settings"]["matched_budgets"]
    for key, m in below.items():  # "combined@<L1.1", "lossless@<lossless 80%", ...
        mode, anchor = key.split("@<")
        assert m["kind"] == mode and m["budget_bytes"] < methods[anchor.replace(" ", "@")]["predicted_peak_mib"] * MIB
    for key, m in methods.items():
        if "error" in m:
            assert m["kind"] in ("lossless", "combined") and m["error"].startswith("infeasible"), m
            continue
        phases = m["report"]["phases"]
        assert list(phases) == ["forward", "backward", "optimizer"]
        peak = max(phases["forward"]["peak_bytes"], phases["backward"]["peak_bytes"])
        assert m["fwd_bwd_peak_mib"] * MIB == peak
        assert m["activation_mib"] * MIB == m["report"]["activation_bytes"] > 0
        assert abs(m["activation_ratio"] - ref["activation_mib"] / m["activation_mib"]) < 1e-9
        assert len(m["step_s"]) == 2 and m["overhead"] > 0
        if key != "pytorch":
            assert m["plan_s"] >= 0 and m["units"] > 0 and m["lossy_tensors"] <= m["saved_tensors"]
    assert methods["L0"]["lossy_tensors"] == 0 and methods["L0"]["activation_mib"] == ref["activation_mib"]
    for level in ("L1.1", "L1.2", "L2", "L2.2"):  # the GCN's hidden features are lossy at every level
        assert methods[level]["lossy_tensors"] > 0 and methods[level]["activation_ratio"] > 1.0
    assert methods["L1.2"]["avg_bits"] == 2.0 and methods["L1.1"]["avg_bits"] == 8.0
    assert methods["L1.2"]["activation_mib"] < methods["L1.1"]["activation_mib"]

    comp = r["comparison"]
    assert [c["cap"] for c in comp["caps"]][-1] is None
    any_cap = comp["caps"][-1]
    for mode in ("lossless", "alone", "combined"):  # at any overhead: the lowest peak among the mode's points
        pts = [m for m in methods.values() if "error" not in m and
               m["kind"] in {"lossless": ("pytorch", "lossless"), "alone": ("level",), "combined": ("combined",)}[mode]]
        if pts:
            assert any_cap[mode]["peak_mib"] == min(m["fwd_bwd_peak_mib"] for m in pts)
    for b in comp["budgets"]:
        if b["alone"] is not None:
            assert methods[b["alone"]["method"]]["fwd_bwd_peak_mib"] <= b["budget_mib"]
    goals = data["goals"]
    assert {(g["level"], g["id"]) for g in goals["activation_ratio"]} == {("L2.2", "pyg/gcn"), ("L2", "pyg/gcn")}
    for g in goals["activation_ratio"]:
        assert g["met"] == (g["ratio"] >= g["target"])


def _bench_module():
    """``scripts/bench.py`` imported as a module (it is a script, not part of the package)."""
    import importlib.util

    name = "zoomem_bench_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "bench.py")
        bench = importlib.util.module_from_spec(spec)
        sys.modules[name] = bench  # its dataclasses look their module up
        spec.loader.exec_module(bench)
    return sys.modules[name]


def test_a_combined_plan_storing_nothing_lossily_cannot_beat_lossless_planning():
    """The verdict's pools: a combined plan with no lossy tensor is a lossless plan, so the same plan timed a little
    faster under its combined name is a tie with lossless planning, not a win; one that compresses can win."""
    bench = _bench_module()

    def row(method, kind, peak, overhead, lossy=0):
        return {"method": method, "kind": kind, "fwd_bwd_peak_mib": peak, "overhead": overhead,
                "lossy_tensors": lossy, "budget_bytes": int(peak * MIB), "recomputed": 0, "recomputed_cheap": 0,
                "units": 4, "predicted_peak_mib": peak, "verified_peak_mib": peak}

    def result(*extra):
        return {"pytorch_peak_mib": 1000.0, "skipped_budgets": [], "methods": [
            row("pytorch", "pytorch", 1000, 1.0), row("L2.2", "level", 500, 1.8, lossy=9),
            row("lossless@90%", "lossless", 640, 1.14), *extra]}

    same_plan = bench.compare_modes(result(row("combined@90%", "combined", 640, 1.09)))
    cap = {c["cap"]: c for c in same_plan["caps"]}
    assert cap[1.1]["lossless"]["method"] == "combined@90%" and cap[1.1]["verdict"] == "tie"
    assert cap[None]["verdict"] == "higher" and same_plan["caps_where_combined_lower"] == []

    compressing = bench.compare_modes(result(row("combined@90%", "combined", 600, 1.09, lossy=3)))
    cap = {c["cap"]: c for c in compressing["caps"]}
    assert cap[1.1]["lossless"]["method"] == "pytorch" and cap[1.1]["verdict"] == "lower"
    assert compressing["caps_where_combined_lower"] == [1.1, 1.25, 1.5]


def test_combined_budgets_below_other_plans_lowest_first_and_spaced():
    """`--matched` budget selection: one plan of the mode just below each lossy level and lossless plan, lowest
    first; none where a plan of the mode already made answers the budget (at least that budget, its peak at most
    it) or sits within a quarter of the margin; none below a minimum an infeasible one named."""
    from types import SimpleNamespace

    import zoomem

    bench = _bench_module()
    baseline = 1000 * MIB  # margin 10 MiB, gap 12.5 MiB

    def method(key, kind, predicted_mib, lossy=1, budget_mib=None):
        m = bench._Method(key, key, kind, None, None, None)
        m.plan = SimpleNamespace(predicted_peak_bytes=int(predicted_mib * MIB))
        m.info.update(lossy_tensors=lossy, budget_bytes=None if budget_mib is None else int(budget_mib * MIB))
        return m

    methods = [method("L0", "level", 1000, lossy=0), method("L1.1", "level", 500), method("L1.2", "level", 495),
               method("L1", "level", 540),
               method("L2.2", "level", 470), method("lossless@min", "lossless", 520),
               method("lossless@90%", "lossless", 560), method("combined@50%", "combined", 508, budget_mib=510),
               method("combined@60%", "combined", 540, budget_mib=600),
               method("combined@56%", "combined", 524, budget_mib=560),  # 524 MiB fit 527.5 but not with 1% to spare
               method("lossless@<L2.2", "lossless", 300)]  # itself matched: no anchor

    def planned(m, make):
        try:
            m.plan = make()
        except zoomem.InfeasibleBudgetError as exc:
            m.info["min_budget_bytes"] = exc.min_budget
        methods.append(m)
        return m

    def plan(budget):
        if budget < 465 * MIB:
            raise zoomem.InfeasibleBudgetError("too low", min_budget=465 * MIB)
        return SimpleNamespace(predicted_peak_bytes=budget)

    bench._plan_below_others(methods, "combined", None, baseline, planned, plan)
    made = {m.key: m.info["budget_bytes"] / MIB for m in methods[11:]}
    # L2.2's budget (457.5) is infeasible. L1.1's (487.5) is 5 MiB above L1.2's: planned, that plan may take more
    # time. lossless@min's (507.5) is within 2.5 MiB of combined@50%'s 510. combined@56% (560, peak 524) would answer
    # L1's 527.5 only without the planner's 1% margin; combined@60% (600, peak 540) answers lossless@90%'s 547.5
    assert made == {"combined@<L2.2": 457.5, "combined@<L1.2": 482.5, "combined@<L1.1": 487.5, "combined@<L1": 527.5}
    assert methods[11].plan is None and methods[12].plan is not None


def test_bench_accuracy_quick(tmp_path):
    out = tmp_path / "acc.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "accuracy", "--quick", "--out", str(out),
           "--markdown", "--no-progress"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "accuracy"
    assert [(r["task"], r["seed"], r["method"]) for r in data["runs"]] == [
        ("graph", 0, "L0"), ("graph", 0, "L2"), ("graph", 0, "L1.2"), ("graph", 0, "L0+1% noise")]
    assert all(0.0 <= r["accuracy"] <= 100.0 and r["steps"] == 3 for r in data["runs"])
    by_level = {v["level"]: v for v in data["verdicts"]}
    acc = {r["method"]: r["accuracy"] for r in data["runs"]}
    assert by_level["L2"]["mean_diff"] == acc["L2"] - acc["L0"] and by_level["L2"]["allowed_drop"] == 0.5
    assert by_level["L0+1% noise"]["allowed_drop"] is None  # the control is reported, not judged
    assert "| seed | L0 | L2 | L1.2 | L0+1% noise |" in proc.stdout and "graph L1.2: mean" in proc.stdout


def test_bench_scale_quick(tmp_path):
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "scale", "--quick",
           "--models", "hf/gpt2", "pyg/gcn", "--out", str(out), "--markdown"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| `hf/gpt2` |" in proc.stdout and "| `pyg/gcn` |" not in proc.stdout  # graphs: no batch dimension
    (r,) = json.loads(out.read_text())["results"]
    assert r["traced_at"] == [2, 4, 8]
    for p in r["peaks"].values():  # the small GPT-2's costs are affine in the batch: extrapolated exactly
        assert abs(p["scaled_mib"] - p["direct_mib"]) <= 0.01 * p["direct_mib"]
    plan = r["plan"]
    assert plan["traced_at"] == [2, 4, 8] and plan["measured_mib"] <= plan["budget_mib"]


def test_bench_quantizer_quick(tmp_path):
    """The quantizer's speed per width, beside a git revision's quantizer loaded from git (HEAD here: a clean
    clone has it) and the planner's probe; a revision git does not know is refused with a message."""
    out = tmp_path / "q.json"
    bench = [sys.executable, str(REPO / "scripts" / "bench.py"), "quantizer", "--quick", "--repeats", "2"]
    proc = run_script([*bench, "--against", "HEAD", "--bits", "2", "8", "--out", str(out), "--markdown"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert [(r["tensor"], r["bits"]) for r in data["rows"]] == [
        (t, b) for t in ("flat 256 K", "rows with padding") for b in (2, 8)]
    assert all(r["ns_per_byte_current"] > 0 and r["ns_per_byte_HEAD"] > 0 for r in data["rows"])
    assert set(data["probe_ns_per_byte"]) == set(data["probe_ms_per_call"]) == {"2", "8"}
    assert "| planner's ns/B | ns/B at HEAD | speed-up |" in proc.stdout and "planner's probe" in proc.stdout
    assert [r["operation"] for r in data["masks"]] == ["pack", "unpack", "apply to a gradient"]
    assert all(r["ms_current"] > 0 and r["ms_HEAD"] > 0 for r in data["masks"])
    bad = run_script([*bench, "--against", "no-such-rev", "--out", str(tmp_path / "b.json")])
    assert bad.returncode == 2 and "no-such-rev" in bad.stderr and not (tmp_path / "b.json").exists()


def test_point_errors_prints_every_point_of_a_level_plan():
    """`scripts/point_errors.py` prints the cost model's points predicted beside measured; a lossy level's peak on
    a one-layer BERT is predicted within 5% (the issue's bound), and every point has its measured value."""
    cmd = [sys.executable, str(REPO / "scripts" / "point_errors.py"), "hf/bert-base-uncased", "--batch", "2",
           "--seq-len", "64", "--set", "num_hidden_layers=1", "L1.2"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    head = next(line for line in proc.stdout.splitlines() if line.startswith("== L1.2"))
    predicted = float(head.split("predicted peak ")[1].split(" MiB")[0])
    measured = float(head.split("measured ")[1].split(";")[0])
    assert abs(predicted - measured) <= 0.05 * measured, head
    points = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("forward", "backward"))]
    assert len(points) >= 6 and all(p[-1] != "n/a" for p in points), proc.stdout


def test_coverage_script_checks_models_beyond_the_matrix(tmp_path):
    """`scripts/coverage.py` wraps a model (two PyG convolutions with edge features), compares its gradients with
    plain PyTorch's, reports a model it cannot build, and exits 0 only when every check holds."""
    out = tmp_path / "coverage.json"
    cmd = [sys.executable, str(REPO / "scripts" / "coverage.py"), "--models", "pyg:gineconv", "hf:nope",
           "--markdown", "--out", str(out)]
    proc = run_script(cmd)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the unknown model is reported, and fails the run
    rows = {r["model"]: r for r in json.loads(out.read_text())}
    good = rows["pyg:gineconv"]
    assert good["lossless_ok"] and good["l2_ok"] and good["l2_lossy"] > 0, good
    assert 0 < good["min_share"] < 1 and good["recomputed"] >= 1
    assert "No hf layout 'nope'" in rows["hf:nope"]["error"]
    assert "| pyg:gineconv | 2 (" in proc.stdout and "| ok |" in proc.stdout


def test_min_budget_script_names_the_same_budget_on_every_trace():
    """`scripts/min_budget.py` reads the smallest budget an error names on fresh traces and wraps at it: RoBERTa's
    (whose least-peak plan measured 15 KiB above its prediction until stop 34) is the same each time, and every retry
    at it fits. Zoo ids run at full size, at ``--batch``."""
    cmd = [sys.executable, str(REPO / "scripts" / "min_budget.py"), "hf:roberta", "--repeat", "2"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| hf:roberta")]
    assert len(rows) == 2 and rows[0][2] == rows[1][2], proc.stdout
    named = int(rows[0][2].split()[0])
    assert all(int(r[4]) <= named for r in rows), proc.stdout

    cmd = [sys.executable, str(REPO / "scripts" / "min_budget.py"), "pyg/gcn", "--batch", "1", "--repeat", "1"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    row = next(line.split("|") for line in proc.stdout.splitlines() if line.startswith("| pyg/gcn"))
    assert int(row[4]) <= int(row[2].split()[0]), proc.stdout


def test_random_plans_script_finds_no_point_predicted_low():
    """`scripts/random_plans.py` runs plans the planner may never pick (here ResNet-50 chains across and within
    stages, cheap recomputation, compact forms in kept and recomputed units) and compares every memory point with
    its prediction; before stop 36 this one measured a chained block's backward 12.6 MiB over its prediction (the
    backward runs inside the stretch before it) and exited 1."""
    cmd = [sys.executable, str(REPO / "scripts" / "random_plans.py"), "timm/resnet50", "--small", "--batch", "4",
           "--plans", "3", "--seed", "2"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    plans = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(plans) == 3 and "rchain" in plans[0] and "+c" in plans[0] and "rcheap" in plans[0], proc.stdout
    assert "some point over it in 0 []" in proc.stdout


def test_compact_times_script_shows_raw_and_priced_times():
    """`scripts/compact_times.py` prints the compact forms' time as each cost model measured it and as it is priced
    (a ResNet's forms cannot run faster: never below zero), then over interleaved steps of the wrapped model."""
    cmd = [sys.executable, str(REPO / "scripts" / "compact_times.py"), "timm/resnet18", "--small", "--batch", "4",
           "--traces", "1", "--rounds", "1"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    lines = proc.stdout.splitlines()
    priced = [line for line in lines if line.startswith("cost model 1:")]
    assert len(priced) == 1 and "as priced: units' -" not in priced[0] and "outside -" not in priced[0], proc.stdout
    assert sum(line.startswith(("no form:", "every unit's forms:", "forms outside the units:")) for line in lines) == 3


def test_skip_logits_script_shows_the_logits_gone_and_the_bytes_saved():
    """`scripts/skip_logits.py` meters and times the stock loss, the fused loss and the fused loss with
    ``skip_logits`` on one plan: only the last returns no logits, it holds the least after forward, and its forward
    peaks lower than the fused loss's by at least the logits (it never makes them)."""
    cmd = [sys.executable, str(REPO / "scripts" / "skip_logits.py"), "hf/gpt2", "--small", "--rounds", "1"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    held, peak = {}, {}
    for line in proc.stdout.splitlines():
        if "held after forward" in line:
            name = line.split(":")[0]
            held[name] = float(line.split("held after forward ")[1].split(" MiB")[0])
            peak[name] = float(line.split("forward peak ")[1].split(" MiB")[0])
            assert ("logits returned False" in line) == (name == "fused loss, skip_logits"), line
    assert list(held) == ["stock loss", "fused loss", "fused loss, skip_logits"], proc.stdout
    assert held["fused loss, skip_logits"] < held["fused loss"] < held["stock loss"], proc.stdout
    logits_mib = 2 * 64 * 50257 * 4 / 2**20  # zoo.small's GPT-2 batch: 2 x 64 tokens, fp32
    # (the loss's slices instead: 4 MiB and their exponential at a time)
    assert peak["fused loss, skip_logits"] <= peak["fused loss"] - 0.5 * logits_mib, proc.stdout
    assert sum("interleaved steps" in line for line in proc.stdout.splitlines()) == 3


def test_refresh_memory_script_meters_the_refresh_within_plain_pytorchs_step():
    """`scripts/refresh_memory.py` meters step 2 (sensitivities measured again, against the gradient step 1's loss
    sent the outputs) beside the plan's steps: on ViT-Tiny's small layout at batch 32 refreshes measure on
    sub-batches, and that step peaks within plain PyTorch's step. (Small GPT-2's measurement fits plain PyTorch's
    step at the batch since stop 49.)"""
    cmd = [sys.executable, str(REPO / "scripts" / "refresh_memory.py"), "timm/vit_tiny_patch16_224", "--small",
           "--batch", "32", "--steps", "3"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    lines = proc.stdout.splitlines()
    plan = next(line for line in lines if line.startswith("plan:"))
    plain = float(plan.split("plain PyTorch predicted ")[1].split(" MiB")[0])
    assert "refreshes measure at the batch" not in plan, plan
    peaks = [float(line.split("peak ")[1].split(" MiB")[0]) for line in lines if line.startswith("step ")]
    assert len(peaks) == 3 and "(holds its output gradient" in lines[-3], proc.stdout
    assert "(refresh)" in lines[-2] and "(refresh)" not in lines[-1], proc.stdout
    assert peaks[2] < peaks[1] <= plain * 1.02, proc.stdout


def test_step_memory_script_meters_the_optimizers_step_as_predicted():
    """`scripts/step_memory.py` wraps a model with each optimizer named and meters a whole step: on the small GPT-2
    at L2 the for-loop AdamW's step is the peak, fused AdamW's is lower, and both peaks are as predicted."""
    cmd = [sys.executable, str(REPO / "scripts" / "step_memory.py"), "hf/gpt2", "--small", "--optimizers", "adamw",
           "adamw-fused"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    rows = {cells[1].strip(): [float(c) for c in cells[2:-1]]
            for cells in (line.split("|") for line in proc.stdout.splitlines() if line.startswith("| adamw"))}
    assert set(rows) == {"adamw", "adamw-fused"}, proc.stdout
    for name, (predicted, step, forward, backward, optimizer, measured, ratio) in rows.items():
        assert 0.98 <= ratio <= 1.01 and abs(measured / predicted - ratio) < 1e-3, (name, proc.stdout)
    assert rows["adamw"][4] == rows["adamw"][5] > rows["adamw"][3], proc.stdout  # the optimizer's step, the peak
    assert rows["adamw-fused"][4] < rows["adamw"][4], proc.stdout


def test_step_memory_script_under_ddp_counts_its_buckets():
    """`scripts/step_memory.py --ddp`: the step under DDP (one gloo process) measures its gradient buckets
    beside the gradients, and the plan predicts it with them (on 0eba8e6, which left them out, the small GPT-2's
    step at L2 measured 1.120 of its prediction)."""
    cmd = [sys.executable, str(REPO / "scripts" / "step_memory.py"), "hf/gpt2", "--small", "--optimizers",
           "adamw-fused", "--ddp"]
    proc = run_script(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    (row,) = [[float(c) for c in line.split("|")[2:-1]] for line in proc.stdout.splitlines()
              if line.startswith("| adamw-fused")]
    predicted, measured, ratio, buckets = row[0], row[5], row[6], row[7]
    assert buckets > 0 and 0.99 <= ratio <= 1.01 and abs(measured / predicted - ratio) < 1e-3, proc.stdout
