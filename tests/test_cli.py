"""The zoomem command: trace, plan, models, and its errors."""

from __future__ import annotations

import json

import pytest

from zoomem.cli import main


def test_trace_json_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    from zoomem import OpGraph

    assert main(["trace", "pyg/gcn", "--num-nodes", "500", "--json"]) == 0
    graph = OpGraph.from_dict({k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "id"})
    assert graph.adapter == "pyg" and [u.name for u in graph.units][:3] == ["convs.0", "convs.1", "convs.2"]


def test_trace_table_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "hf/bert-base-uncased", "--batch", "2", "--seq-len", "32",
                 "--set", "num_hidden_layers=3", "--set", "hidden_size=64", "--set", "num_attention_heads=2",
                 "--set", "intermediate_size=128"]) == 0
    out = capsys.readouterr().out
    assert "bert.encoder.layer.2" in out and "BertLayer x3" in out and "saved MiB" in out


def test_plan_prints_summary_and_infeasible_budget_names_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "timm/resnet18", "--batch", "4", "--image-size", "64"]
    assert main(args + ["--strategy", "all"]) == 0
    assert "recompute" in capsys.readouterr().out
    assert main(args + ["--budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "smallest feasible budget is" in err and "MiB" in err


def test_unknown_model_lists_known_ids(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "nope/model"]) == 2
    err = capsys.readouterr().err
    assert "hf/bert-base-uncased" in err and "timm/<any timm model name>" in err
    assert main(["models"]) == 0
    assert "pyg/gat" in capsys.readouterr().out


def test_plan_with_a_compression_level(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "hf/bert-base-uncased", "--batch", "2", "--seq-len", "64", "--set", "num_hidden_layers=2",
                 "--level", "L2.2"]) == 0
    assert "compression L2.2" in capsys.readouterr().out
    assert main(["plan", "pyg/gcn", "--level", "L2", "--budget", "1GiB"]) == 2
    assert "compress='auto'" in capsys.readouterr().err


def test_plan_skip_logits_prices_the_step_without_logits(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    args = ["plan", "hf/gpt2", "--batch", "2", "--seq-len", "64", "--set", "n_layer=1", "--set", "n_embd=32",
            "--set", "n_head=2", "--budget", "70%", "--json"]
    peaks = []
    for extra in ([], ["--skip-logits"]):
        assert main(args + extra) == 0
        peaks.append(json.loads(capsys.readouterr().out)["predicted_peak_bytes"])
    assert peaks[0] - peaks[1] >= 2 * 64 * 50257 * 4 * 0.5  # most of the fp32 logits no longer held
