"""zoomem.maxbatch: the search on a real small GCN (every probe a real step), its evidence, resume, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from zoomem import maxbatch, zoo
from zoomem.maxbatch import ProbeLog, SearchConfig, Workload, parse_budget_text, search_max

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
GCN = zoo.small_overrides("pyg/gcn")  # 32 -> 64 -> 64 -> 8 channels; a batch unit is 1000 nodes, 10000 edges
BUDGET = 16 * MIB  # plain PyTorch fits 2 units here; message passing's edges x features tensors fill the rest


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Probes are small: one torch thread is as fast, and on a shared CPU much steadier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gcn_search(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """pytorch, lossless and L2 on the small GCN at 16 MiB, exact search (rtol 0), one timed step per fit; the
    probe log is at ``data["log"]``."""
    log = tmp_path_factory.mktemp("gcn") / "probes.jsonl"
    data = _search(ProbeLog(log))
    data["log"] = log
    return data


def _search(log: ProbeLog) -> dict:
    return maxbatch.run("pyg/gcn", BUDGET, ["L2", "lossless", "pytorch"], overrides=GCN,
                        config=SearchConfig(time_steps=1), progress=False, log=log)


def _evidence(row: dict) -> tuple[dict, dict]:
    by_value = {p["value"]: p for p in row["probes"]}
    return by_value[row["max_value"]], by_value[row["max_value"] + 1]


@pytest.mark.parametrize("b", [0, 1, 2, 3, 37, 64, 1000])
def test_search_max_finds_the_boundary_and_probes_both_sides(b: int) -> None:
    calls: list[int] = []

    def fits(k: int) -> bool:
        calls.append(k)
        return k <= b

    lo, hi = search_max(fits, start=1, cap=1024)
    assert (lo, hi) == (b, b + 1)
    assert (b == 0 or b in calls) and b + 1 in calls
    assert len(calls) <= 2 * 11  # doubling, then bisection: logarithmic
    # a guess (here off by 2) ends the search sooner, with the same evidence
    calls.clear()
    assert search_max(fits, 1, 1024, guess=lambda lo, hi: b + 2) == (b, b + 1)
    assert (b == 0 or b in calls) and b + 1 in calls


def test_search_max_cap_start_and_tolerance() -> None:
    assert search_max(lambda k: True, start=3, cap=50) == (50, None)
    assert search_max(lambda k: k <= 5, start=16, cap=64) == (5, 6)  # the start itself fails: bisect below it
    lo, hi = search_max(lambda k: k <= 300, start=1, cap=1024, rtol=0.1)
    assert lo <= 300 < hi and hi - lo <= 30


def test_gcn_order_of_methods_and_probe_evidence(gcn_search: dict) -> None:
    rows = {r["method"]: r for r in gcn_search["results"]}
    assert [r["method"] for r in gcn_search["results"]] == ["pytorch", "L2", "lossless"]  # plain PyTorch first
    pt, lossless, l2 = rows["pytorch"]["max_value"], rows["lossless"]["max_value"], rows["L2"]["max_value"]
    assert 1 <= pt
    # exact storage forms (CSR SpMM instead of edges x features) and planned recomputation fit more; so do 4 bits
    assert lossless > pt and l2 > pt
    assert rows["lossless"]["ratio"] == pytest.approx(lossless / pt)
    for name, row in rows.items():
        assert "error" not in row and not row["at_cap"], name
        fit, over = _evidence(row)  # the maximum was probed and fits; one more was probed and does not
        assert fit["fits"] and fit["peak_bytes"] <= BUDGET, name
        assert over["fits"] is False, name
        assert over["reason"].startswith("zoomem: infeasible") or over["peak_bytes"] > BUDGET, name
        assert row["peak_bytes"] == fit["peak_bytes"] and row["step_s"] > 0
        # every probe that fits lies below every one that does not (memory grows with the batch)
        fitting = [p["value"] for p in row["probes"] if p["fits"]]
        failing = [p["value"] for p in row["probes"] if not p["fits"]]
        assert max(fitting) < min(failing)
    # the other methods start from plain PyTorch's maximum instead of 1
    assert rows["lossless"]["probes"][0]["value"] == pt and rows["L2"]["probes"][0]["value"] == pt
    assert rows["pytorch"]["overhead"] == 1.0
    goal = next(g for g in gcn_search["goals"] if g["method"] == "lossless")
    assert goal["met"] == (lossless >= 4 * pt)


def test_resume_skips_recorded_probes(gcn_search: dict, tmp_path: Path) -> None:
    lines = gcn_search["log"].read_text().splitlines()
    assert len(lines) == sum(len(r["probes"]) for r in gcn_search["results"])
    log_path = tmp_path / "probes.jsonl"
    log_path.write_text("\n".join(lines[:-1]) + "\n")  # as if killed before its last probe

    again = _search(ProbeLog(log_path, resume=True))
    assert again["settings"]["reused_probes"] == len(lines) - 1
    ran = [p for r in again["results"] for p in r["probes"] if not p.get("reused")]
    last = json.loads(lines[-1])
    assert [(p["method"], p["k"]) for p in ran] == [(last["method"], last["k"])]  # only the missing probe ran
    assert [r["max_value"] for r in again["results"]] == [r["max_value"] for r in gcn_search["results"]]
    assert len(log_path.read_text().splitlines()) == len(lines)

    third = _search(ProbeLog(log_path, resume=True))  # everything recorded now: nothing runs
    assert third["settings"]["reused_probes"] == len(lines)
    assert len(log_path.read_text().splitlines()) == len(lines)
    ProbeLog(log_path, resume=False)  # without --resume the log starts over
    assert log_path.read_text() == ""


def test_a_probe_that_dies_is_an_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --isolate, probes run in a forked child on CPU with one thread: a child killed (out of host memory)
    stops that method's search with an error; the comparison goes on. (The child here uses no OpenMP, so it cannot
    hang even when the test process has a multi-threaded pool.)"""
    import os
    import signal

    monkeypatch.setattr(maxbatch, "run_probe", lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    w = Workload("pyg/gcn", overrides=dict(GCN))
    rec = maxbatch.probe(w, maxbatch.METHODS["pytorch"], 3, BUDGET, SearchConfig(isolate=True))
    assert rec["fits"] is None and "exit code -9" in rec["error"] and rec["value"] == 3


def test_budgets_and_dimensions() -> None:
    assert parse_budget_text("256MiB") == (256 * MIB, "256 MiB")
    assert parse_budget_text(str(10 * MIB))[0] == 10 * MIB
    with pytest.raises(ValueError, match="--ref-value"):
        parse_budget_text("50%", "cpu")
    assert parse_budget_text("50%", "cpu", reference=lambda: 100 * MIB)[0] == 50 * MIB

    width = Workload("pyg/gcn", "width", dict(GCN))
    assert width.step == 8 and width.at(3).overrides["hidden_channels"] == 24
    bert = Workload("hf/bert-base-uncased", "width", zoo.small_overrides("hf/bert-base-uncased"))
    s = bert.at(2)  # 4 heads: widths 4, 8, ...; the MLP keeps its ratio (4x)
    assert bert.step == 4 and s.overrides["hidden_size"] == 8 and s.overrides["intermediate_size"] == 32
    seq = Workload("hf/bert-base-uncased", "seqlen").at(80)  # past BERT's 512 positions: more position embeddings
    assert seq.sizes["seq_len"] == 640 and seq.overrides["max_position_embeddings"] == 640
    nodes = Workload("pyg/gcn", "batch", sizes={"num_nodes": 500}).at(3)
    assert nodes.sizes == {"num_nodes": 1500, "num_edges": 15000}
    with pytest.raises(ValueError, match="has no 'depth' dimension.*'batch', 'resolution'"):
        Workload("timm/resnet18", "depth")
    with pytest.raises(ValueError, match="Could not resolve method 'L9'"):
        maxbatch.get_method("L9")


def test_depth_search_rebuilds_the_model() -> None:
    data = maxbatch.run("pyg/gcn", 8 * MIB, ["pytorch"], dim="depth", overrides=GCN, batch_size=1,
                        sizes={"num_nodes": 1000}, config=SearchConfig(time_steps=0), progress=False)
    row = data["results"][0]
    assert row["max_value"] >= 2 and not row["at_cap"]
    fit, over = _evidence(row)
    assert fit["peak_bytes"] <= 8 * MIB < over["peak_bytes"]
    assert data["goals"] == []  # the goals are about batches


def test_cli_max_batch_writes_json_log_png_and_renders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zoomem.cli import main

    out = tmp_path / "mb.json"
    argv = ["max-batch", "pyg/gcn", *sum((["--set", f"{k}={v}"] for k, v in GCN.items()), []), "--budget", "16MiB",
            "--methods", "pytorch", "checkpoint", "--time-steps", "1", "--threads", "1", "--out", str(out),
            "--markdown", "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| method | how | max batch | x PyTorch |" in table
    assert "| checkpoint | full checkpointing (pyg has none: zoomem `all`) |" in table
    data = json.loads(out.read_text())
    assert data["command"].startswith("zoomem max-batch pyg/gcn") and data["settings"]["budget_bytes"] == BUDGET
    assert [r["method"] for r in data["results"]] == ["pytorch", "checkpoint"]
    assert (tmp_path / "mb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n = sum(len(r["probes"]) for r in data["results"])
    assert len((tmp_path / "mb.json.probes.jsonl").read_text().splitlines()) == n

    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "max_batch_size.py"), "--render", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max batch" in proc.stdout and "checkpoint" in proc.stdout

    from zoomem.cli import DEMO_ARGV, build_parser

    demo = build_parser().parse_args(["max-batch", *DEMO_ARGV])  # what `zoomem demo` runs parses
    assert demo.model == "hf/bert-base-uncased" and demo.budget == "48MiB"

    with pytest.raises(SystemExit) as exit_:  # `zoomem bench ...` is scripts/bench.py, flags untouched
        main(["bench", "--help"])
    assert exit_.value.code == 0 and "baseline" in capsys.readouterr().out


def test_skip_logits_gives_zoomem_larger_batches_on_a_language_model() -> None:
    """A GPT-2 layout whose logits (50257 per token) are most of a sample's bytes: with ``--skip-logits`` zoomem's
    lossless plans fit a larger batch within the same budget, and the settings and table say so. (The search stops
    at 16 sequences: with the logits never made, the skipping search would go on to hundreds of them.)"""
    from zoomem.cli import build_parser

    gpt = {"n_layer": 1, "n_embd": 32, "n_head": 2}
    found = {}
    for skip in (False, True):
        data = maxbatch.run("hf/gpt2", 64 * MIB, ["lossless"], overrides=gpt, sizes={"seq_len": 32},
                            config=SearchConfig(time_steps=0, skip_logits=skip), cap=16, progress=False)
        (row,) = data["results"]
        found[skip] = row["max_value"]
        assert data["settings"]["skip_logits"] == skip
        assert ("zoomem with skip_logits" in maxbatch.format_results(data)) == skip
    assert found[True] > found[False] >= 1, found
    assert build_parser().parse_args(["max-batch", "hf/gpt2", "--budget", "1GiB", "--skip-logits"]).skip_logits
