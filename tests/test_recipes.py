"""The Accelerate recipes end to end: real ``accelerate launch`` subprocesses with tiny flags, on the CPU.

Process start-up and imports are most of each launch's cost, so each launch checks several things at once; the
whole file runs in about two to three minutes on two cores. The flag mapping and the small helpers of
``zoomem.recipes`` are tested in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from zoomem import recipes

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240  # seconds per launch: generous, a loaded 2-core machine runs each in 15-40 s

TINY_BERT = ["--layers", "2", "--hidden-size", "64", "--heads", "2", "--seq-len", "32", "--batch-size", "64",
             "--steps", "4", "--log-every", "2", "--eval-batch-size", "1024", "--max-eval-samples", "512"]


def _free_port() -> int:
    with socket.socket() as s:  # other test files may launch at the same time: never the default 29500
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: str, out: Path, *flags: str, processes: int = 1, launch_flags: tuple[str, ...] = (),
           check: bool = True) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess]:
    """``accelerate launch [--multi_gpu --num_processes N] recipes/<recipe>.py --output-dir out flags...``."""
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    cmd += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    cmd += [*launch_flags, str(ROOT / "recipes" / f"{recipe}.py"), "--output-dir", str(out), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts (SIGABRT at exit, seen once) prints where its threads were
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    path = out / "summary.json"
    return (json.loads(path.read_text()) if path.exists() else None), proc


def test_bert_off_and_lossless_train_the_same(tmp_path: Path) -> None:
    """Seeded runs: a lossless plan (recomputation) changes memory, not the training (same losses)."""
    off, proc = launch("bert_large", tmp_path / "off", *TINY_BERT, "--zoomem", "off")
    on, _ = launch("bert_large", tmp_path / "on", *TINY_BERT, "--zoomem", "lossless", "--budget", "70%")
    assert off is not None and on is not None
    assert json.loads(proc.stdout[proc.stdout.index("{"):]) == off, "the summary printed is the one written"
    assert off["zoomem"] == {"mode": "off"}
    plan = on["zoomem"]["plans"][0]
    assert plan["recomputed_units"] >= 1, plan
    assert on["zoomem"]["budget"] == "70%" and plan["budget_mib"] is not None
    assert set(off["loss_log"]) == set(on["loss_log"]) == {"2", "4"}
    for step, loss in off["loss_log"].items():
        assert on["loss_log"][step] == pytest.approx(loss, rel=1e-4), step
    assert on["final_loss"] == pytest.approx(off["final_loss"], rel=1e-4)
    for s in (off, on):
        assert s["num_processes"] == 1 and s["distributed_type"] == "NO"
        assert s["model"]["layers"] == 2 and s["model"]["hidden_size"] == 64 and s["model"]["seq_len"] == 32
        assert s["dataset"]["name"] == "text" and s["dataset"]["num_classes"] == 4 and s["eval_examples"] == 512
        assert 0 <= s["eval_accuracy"] <= 100 and s["samples_per_s"] > 0 and s["peak_memory_mib"] > 0


def test_bert_two_gloo_processes(tmp_path: Path) -> None:
    """`--multi_gpu --num_processes 2` without a GPU (and without ACCELERATE_USE_CPU) forms one gloo group."""
    if torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available():
        pytest.skip("checks the CPU-only launch")
    summary, _ = launch("bert_large", tmp_path, *TINY_BERT, "--zoomem", "lossless", "--budget", "70%",
                        "--expect-processes", "2", "--max-eval-samples", "501", processes=2)
    assert summary is not None
    assert summary["num_processes"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert summary["global_batch_size"] == 2 * summary["batch_size_per_process"]
    assert summary["dataset"]["test"] == 3797 and summary["eval_examples"] == 501  # the split; evaluated, each once
    # (gather_for_metrics drops the sample that pads one rank's share)
    assert summary["zoomem"]["plans"][0]["recomputed_units"] >= 1


def test_gpt2_without_logits_trains_as_plain_pytorch(tmp_path: Path) -> None:
    """The causal-LM recipe: zoomem's plan with ``skip_logits`` (the default) returns no logits in training, holds
    less than plain PyTorch, and trains the same (seeded losses; evaluation has its logits)."""
    tiny = [*TINY_BERT, "--eval-batch-size", "128", "--budget", "60%"]
    off, _ = launch("gpt2", tmp_path / "off", *TINY_BERT, "--eval-batch-size", "128", "--zoomem", "off")
    on, _ = launch("gpt2", tmp_path / "on", *tiny)
    assert off is not None and on is not None
    assert off["training_forward_returned_logits"] is True and on["training_forward_returned_logits"] is False
    assert on["zoomem"]["skip_logits"] is True and "skip_logits" not in off["zoomem"]
    assert on["zoomem"]["plans"][0]["measured_peak_mib"] <= on["zoomem"]["plans"][0]["budget_mib"]
    assert on["peak_memory_mib"] < 0.6 * off["peak_memory_mib"]
    assert set(on["loss_log"]) == {"2", "4"}
    for step, loss in off["loss_log"].items():
        assert on["loss_log"][step] == pytest.approx(loss, rel=1e-4), step
    assert on["eval_loss"] == pytest.approx(off["eval_loss"], rel=1e-4)
    assert on["model"]["vocab_size"] == off["model"]["vocab_size"] > 10000  # the task's word-level vocabulary
    assert on["dataset"]["test"] == 3797 and on["eval_examples"] == 512 and on["eval_perplexity"] > 1


def test_cpu_num_processes_is_caught(tmp_path: Path) -> None:
    """`accelerate launch --cpu --num_processes 2` starts one process: --expect-processes 2 makes that an error."""
    _, proc = launch("gnn", tmp_path, "--expect-processes", "2", "--steps", "1", launch_flags=("--cpu",),
                     check=False)
    assert proc.returncode != 0
    assert "ProcessCountError" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_resnet50_compressed(tmp_path: Path) -> None:
    """timm ResNet-50 on the digits under a GACT level; the summary reports the lossy plan and its memory. The
    recipe's loss lies outside the forward: the refresh due at step 1 measures at step 2, against the gradient step
    1's loss sent the logits."""
    summary, proc = launch("resnet50", tmp_path, "--steps", "3", "--batch-size", "8", "--log-every", "1",
                           "--eval-batch-size", "600", "--max-eval-samples", "100", "--zoomem", "L2")
    assert "re-measured at step 2 against the gradient step 1's loss sent the outputs" in proc.stderr, proc.stderr
    assert summary is not None
    assert summary["model"]["id"] == "timm/resnet50" and summary["model"]["image_size"] == 32
    assert summary["dataset"]["name"] == "digits" and summary["dataset"]["test"] == 599
    plan = summary["zoomem"]["plans"][0]
    assert plan["level"] == "L2" and plan["lossy_tensors"] > 0
    assert summary["peak_memory"]["phases_peak_mib"].keys() == {"forward", "backward", "optimizer"}
    assert len(summary["loss_log"]) == 3


def test_gnn_two_processes_compressed_learns(tmp_path: Path) -> None:
    """GraphSAGE under level L2 on two gloo processes (sensitivities all-reduced) learns the SBM graph (chance 20%)."""
    summary, _ = launch("gnn", tmp_path, "--model", "sage", "--steps", "40", "--zoomem", "L2",
                        "--expect-processes", "2", processes=2)
    assert summary is not None
    assert summary["num_processes"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert summary["batch_size_per_process"] == 500 and summary["global_batch_size"] == 1000
    assert summary["model"]["class"] == "GraphSAGE"
    assert summary["zoomem"]["plans"][0]["lossy_tensors"] > 0
    assert summary["eval_accuracy"] > 80.0


# ---------------------------------------------------------------------------------------------- in-process


def _args(*argv: str) -> argparse.Namespace:
    parser = recipes.add_common_args(argparse.ArgumentParser(), steps=10, lr=1e-3, batch_size=8)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["--zoomem", "lossless"], {"budget": recipes.DEFAULT_BUDGET}),
        (["--zoomem", "lossless", "--budget", "0.6"], {"budget": 0.6}),
        (["--zoomem", "lossless", "--budget", "6GiB"], {"budget": "6GiB"}),
        (["--zoomem", "auto", "--budget", "1000000"], {"budget": 1000000, "compress": "auto"}),
        (["--zoomem", "L2.2"], {"level": "L2.2"}),
    ],
)
def test_wrap_options(argv: list[str], options: dict[str, Any]) -> None:
    assert recipes.wrap_options(_args(*argv)) == options


def test_wrap_options_refuses() -> None:
    with pytest.raises(ValueError, match="without a budget"):
        recipes.wrap_options(_args("--zoomem", "L2", "--budget", "60%"))
    with pytest.raises(ValueError, match="no zoomem.wrap"):
        recipes.wrap_options(_args("--zoomem", "off"))
    with pytest.raises(ValueError, match="fraction"):
        recipes.wrap_options(_args("--zoomem", "lossless", "--budget", "1.5"))


def test_total_steps_and_schedule() -> None:
    assert recipes.total_steps(_args(), 10, 7) == 10
    assert recipes.total_steps(_args("--epochs", "1.5"), 10, 7) == 11
    with pytest.raises(ValueError, match="not both"):
        recipes.total_steps(_args("--epochs", "1", "--steps", "3"), 10, 7)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = recipes.warmup_cosine(opt, 10, warmup=0.2)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and sched.get_last_lr()[0] == pytest.approx(0.0)


def test_fill_defaults_keeps_a_checkpoints_shape() -> None:
    parser = recipes.add_common_args(argparse.ArgumentParser(), steps=10, lr=None, batch_size=None)
    for flag in ("--layers", "--hidden-size", "--seq-len"):
        parser.add_argument(flag, type=int, default=None)
    cpu = {"layers": 4, "hidden_size": 256, "seq_len": 32, "batch_size": 32, "lr": 1e-3}
    args = parser.parse_args(["--layers", "2"])
    recipes.fill_defaults(args, cpu, from_config=True, pretrained_lr=5e-5, output_dir="out/x")
    assert (args.layers, args.hidden_size, args.seq_len, args.batch_size, args.lr) == (2, 256, 32, 32, 1e-3)
    assert args.output_dir == Path("out/x")
    args = parser.parse_args(["--batch-size", "8"])
    recipes.fill_defaults(args, cpu, from_config=False, pretrained_lr=5e-5, output_dir="out/x")
    assert (args.layers, args.hidden_size, args.seq_len, args.batch_size, args.lr) == (None, None, 32, 8, 5e-5)


def test_eval_subset_takes_the_first_examples() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    assert [int(x) for (x,) in recipes.eval_subset(data, 3)] == [0, 1, 2]
    assert recipes.eval_subset(data, None) is data and recipes.eval_subset(data, 50) is data
    with pytest.raises(ValueError, match="--max-eval-samples must be >= 1"):
        recipes.eval_subset(data, 0)
    assert _args("--max-eval-samples", "7").max_eval_samples == 7 and _args().max_eval_samples is None
