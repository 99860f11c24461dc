"""`scripts/bench.py baseline --quick` runs end to end and writes a JSON whose numbers obey the meter's definitions."""

import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def test_bench_baseline_quick(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "baseline", "--quick",
           "--models", "timm/resnet18", "pyg/gcn", "--out", str(out), "--markdown"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
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
