"""zoomem under HuggingFace Accelerate and the HF Trainer, checked through real ``accelerate launch`` processes.

The multi-process path on a machine without a GPU: ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu
--num_processes 2`` starts two gloo processes that Accelerate reports as MULTI_CPU and wraps in DDP (verified in
``test_launch_gives_two_gloo_processes_under_ddp``). ``--cpu --num_processes 2`` starts one process, and
``--multi_gpu`` without ``ACCELERATE_USE_CPU`` starts two processes that each run alone:
``zoomem.accelerate.check_processes`` turns both into errors (``test_process_count_check``).

One launch (``tests/launch/ddp_checks.py train``) runs every DDP section and writes one JSON per rank; the tests
below read their part of it. The tiny BERT (2 layers, hidden 64, batch 8 x 64 tokens, dropout on) and the budgets
that make the planner recompute or compress live in that script.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

import zoomem
import zoomem.accelerate as za
from zoomem import zoo

LAUNCH = Path(__file__).resolve().parent / "launch" / "ddp_checks.py"
_spec = importlib.util.spec_from_file_location("_zoomem_ddp_checks", LAUNCH)
assert _spec is not None and _spec.loader is not None
L = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(L)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(mode: str, out: Path, *flags: str, use_cpu: bool = True, extra: tuple[str, ...] = (),
            timeout: int = 400) -> subprocess.CompletedProcess[str]:
    """``accelerate launch <flags> ddp_checks.py <mode> <out>``, isolated from any user accelerate config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(HF_HOME=str(out / "hf_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(LAUNCH), mode, str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _ranks(out: Path, mode: str, proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    files = sorted(out.glob(f"{mode}-rank*.json"))
    assert proc.returncode == 0 and len(files) == 2, f"launch {mode} failed:\n{proc.stderr[-6000:]}"
    return [json.loads(f.read_text()) for f in files]


MULTI = ("--multi_gpu", "--num_processes", "2")


def _recomputes(decisions: list[str]) -> bool:
    """The budget made the planner recompute (fully or the cheap ops) at least one unit."""
    return any(d.startswith("recompute") for d in decisions)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The one 2-process ``train`` launch every DDP test reads (about 40 s on 2 cores)."""
    out = tmp_path_factory.mktemp("ddp")
    proc = _launch("train", out, *MULTI)
    return SimpleNamespace(out=out, ranks=_ranks(out, "train", proc), stderr=proc.stderr)


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """In-process Accelerate/Trainer tests start and leave with no Accelerate state and autocast off."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.set_autocast_enabled("cpu", False)


# --- the launch itself --------------------------------------------------------------------------------------


def test_launch_gives_two_gloo_processes_under_ddp(ddp: SimpleNamespace) -> None:
    for r in ddp.ranks:
        assert r["distributed_type"] == "MULTI_CPU" and r["num_processes"] == 2 and r["is_ddp"], r


@pytest.mark.parametrize("flags, use_cpu, message", [
    (("--cpu", "--num_processes", "2"), False, "expects 2 processes but Accelerate runs 1"),
    (MULTI, False, "The launcher started 2 processes"),
], ids=["cpu-flag-starts-one", "multi-gpu-without-gpu-runs-alone"])
def test_process_count_check(tmp_path: Path, flags: tuple[str, ...], use_cpu: bool, message: str) -> None:
    """Both silent misconfigurations raise ProcessCountError with the launch command that works."""
    proc = _launch("count", tmp_path, *flags, use_cpu=use_cpu, extra=("--expect", "2"), timeout=200)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "ProcessCountError" in proc.stderr and message in proc.stderr, proc.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in proc.stderr
    assert not list(tmp_path.glob("count-rank*.json"))


# --- DDP: lossless, compression, mixed precision ------------------------------------------------------------


def test_lossless_ddp_matches_plain_accelerate(ddp: SimpleNamespace) -> None:
    """A recomputing budget, wrapped before prepare and through zoomem.accelerate.prepare: after three DDP steps
    the parameters equal plain Accelerate's and each other across ranks, although each rank trained on its own
    batches. Each plan counts DDP's gradient buckets. Not bitwise: the budget needs the compact forms too, whose output-activated LayerNorm reassociates
    (1e-7 relative in the gradients, up to a few 1e-6 in parameters after three AdamW steps at lr 1e-3)."""
    r0, r1 = ddp.ranks
    for r in ddp.ranks:
        for how in ("before", "helper"):
            assert _recomputes(r[f"lossless_{how}_plan"]["decisions"]), r[f"lossless_{how}_plan"]
            assert len(r[f"lossless_{how}_plan"]["signatures"]) == 1  # no accumulation: one plan
            assert r[f"lossless_{how}_plan"]["ddp_bytes"] == r[f"lossless_{how}_plan"]["bucket_bytes"] > 0
            assert r[f"lossless_{how}_max_param_diff"] <= 1e-5, (how, r[f"lossless_{how}_max_param_diff"])
            assert r[f"lossless_{how}_losses"] == pytest.approx(r["lossless_plain_losses"], rel=1e-6)
    assert r0["lossless_plain_losses"] != r1["lossless_plain_losses"]  # different data per rank ...
    assert r0["lossless_param_checksum"] == r1["lossless_param_checksum"]  # ... and synced gradients


def test_ranks_whose_inputs_differ_in_shape_plan_their_own(ddp: SimpleNamespace) -> None:
    """Dynamic padding under DDP (tests/launch/ddp_checks.py ``SHAPES``): with a lossless budget each rank plans
    for its own lengths when it meets them (rank 1 alone at step 1: no collective, so nothing waits) and runs a
    larger length's plan for shorter ones; the losses and parameters are plain Accelerate's, equal across ranks.
    Under L2, whose bits every rank shares (``LOSSY_SHAPES``): every step runs one plan on both ranks, the one for
    the largest inputs; rank 1 plans alone where its inputs hold rank 0's and nothing is cached for them, and both
    ranks raise where neither's inputs hold the other's."""
    r0, r1 = ddp.ranks
    for r in ddp.ranks:
        assert r["shapes_helper_losses"] == pytest.approx(r["shapes_plain_losses"], rel=1e-6)
        assert r["shapes_max_param_diff"] <= 1e-5, r["shapes_max_param_diff"]
    assert r0["shapes_param_checksum"] == r1["shapes_param_checksum"]
    assert len(r0["shapes_plans"]) == 1 and len(r1["shapes_plans"]) == 2, (r0["shapes_plans"], r1["shapes_plans"])
    steps = len(L.LOSSY_SHAPES) - 1
    for rank, r in enumerate(ddp.ranks):
        assert r["shapes_lossy_step"] == steps, r["shapes_lossy_error"]
        assert f"rank {rank} meets" in r["shapes_lossy_error"] and "no rank's inputs" in r["shapes_lossy_error"]
    (bits0, smaller0), (bits1, smaller1) = zip(*r0["shapes_lossy_ran"]), zip(*r1["shapes_lossy_ran"])
    assert len(bits0) == steps and bits0 == bits1 and all(bits0), (bits0, bits1)  # one plan per step, both ranks
    assert bits0[0] == bits0[3] != bits0[1] == bits0[2]  # 56's plan (rank 1's, alone) at steps 0 and 3; 64's
    assert smaller0 == (True, False, True, False) and smaller1 == (False, False, True, True)
    assert r0["shapes_lossy_param_checksum"] == r1["shapes_lossy_param_checksum"]
    assert "rank 1, whose inputs hold the others', planned" in ddp.stderr


def test_a_budget_one_ranks_inputs_cannot_meet_stops_the_launch(tmp_path: Path) -> None:
    """Lossless plans are per rank, so an infeasible budget is found by the rank whose inputs it cannot hold (here
    rank 1's 64 tokens, where rank 0 has 16 and plans within it: tests/launch/ddp_checks.py ``infeasible``). That
    rank raises the error naming the smallest budget that works; rank 0, waiting in DDP's all-reduce, fails as its
    peer closes (gloo) and the launch ends at once instead of waiting out the collective's timeout."""
    import re
    import time

    start = time.perf_counter()
    proc = _launch("infeasible", tmp_path, *MULTI, timeout=300)
    took = time.perf_counter() - start
    assert proc.returncode != 0 and not list(tmp_path.glob("infeasible-rank*.json")), proc.stderr[-4000:]
    assert "zoomem (rank 0): planned" in proc.stderr, proc.stderr[-4000:]  # rank 0's batch fits
    errors = re.findall(r"\[rank1\]: zoomem\.planner\.plan\.InfeasibleBudgetError: No ilp plan keeps this step "
                        r"within [\d.]+ MiB \((\d+) bytes\): the smallest feasible budget is [\d.]+ MiB \((\d+) bytes",
                        proc.stderr)
    assert errors and all(int(least) > int(budget) for budget, least in errors), proc.stderr[-4000:]
    assert "Raise the budget to at least that, or lower the batch size." in proc.stderr
    assert took < 120, took  # (gloo's default timeout is 30 minutes)


def test_compression_levels_use_the_same_bits_on_every_rank(ddp: SimpleNamespace) -> None:
    """L2's sensitivities are all-reduced and every rank takes rank 0's plan (zoomem.runtime.distributed), at
    planning and when measured again: both ranks use the same bits, although their batches differ; the
    re-measurement is logged by rank 0 only."""
    r0, r1 = (r["compress_L2"] for r in ddp.ranks)
    assert r0["bits"] and r0["bits"] == r1["bits"] and len(r0["signatures"]) == len(r1["signatures"]) == 1
    assert r0["sensitivity"] == r1["sensitivity"]
    assert r0["losses"] != r1["losses"] and r0["param_checksum"] == r1["param_checksum"]
    assert ddp.stderr.count("sensitivities re-measured at step 2") == 1, ddp.stderr[-3000:]


def test_compress_auto_uses_the_same_bits_on_every_rank(ddp: SimpleNamespace) -> None:
    r0, r1 = (r["compress_auto"] for r in ddp.ranks)
    assert r0["sensitivity"] == r1["sensitivity"] and r0["param_checksum"] == r1["param_checksum"]
    assert r0["bits"] and r0["bits"] == r1["bits"]


def test_bf16_accumulation_and_clipping(ddp: SimpleNamespace) -> None:
    """mixed_precision='bf16', gradient_accumulation_steps=2 (no_sync, then sync) and clip_grad_norm_: with a
    lossless budget the synced gradients and clipped norms equal plain Accelerate's; with L2 they stay close;
    every loss is finite and autocast is off again after the steps."""
    for r in ddp.ranks:
        plain, lossless, l2 = r["bf16_plain"], r["bf16_lossless"], r["bf16_L2"]
        assert _recomputes(lossless["plan"]["decisions"]) and l2["plan"]["bits"]
        for run in (lossless, l2):  # the second micro-batch starts with the gradients: a plan of its own
            assert len(run["plan"]["signatures"]) == 2 and "gradients held" in run["plan"]["signatures"][1], run
        for run in (plain, lossless, l2):
            assert bool(torch.isfinite(torch.tensor(run["losses"])).all()) and run["grads_finite"], run
            assert len(run["norms"]) == 2 and not run["autocast_after"]
        assert max(lossless["grad_rel_diff"]) <= 1e-3, lossless["grad_rel_diff"]
        assert lossless["norms"] == pytest.approx(plain["norms"], rel=1e-3)
        assert max(l2["grad_rel_diff"]) <= 0.1, l2["grad_rel_diff"]
        assert l2["norms"] == pytest.approx(plain["norms"], rel=0.1)


# --- save_state / load_state --------------------------------------------------------------------------------


def test_save_state_load_state_resumes_with_zoomem(ddp: SimpleNamespace) -> None:
    """save_state after 2 steps; a new 2-process launch load_states it and runs the next 2 steps: the same losses
    (model, optimizer and per-rank RNG restored; dropout on). The checkpoint's keys are plain PyTorch's."""
    r0 = ddp.ranks[0]
    assert r0["saved_keys"] == r0["plain_keys"] == r0["state_dict_keys"]
    resumed = _ranks(ddp.out, "resume", _launch("resume", ddp.out, *MULTI))
    for before, after in zip(ddp.ranks, resumed):
        assert after["loaded_param_checksum"] == before["saved_param_checksum"]
        assert _recomputes(after["resume_plan"]["decisions"]) and len(after["resume_plan"]["signatures"]) == 1
        assert after["resumed_losses"] == pytest.approx(before["after_save_losses"], rel=1e-6, abs=1e-7)


def test_prepare_single_process_plans_eagerly_and_logs_once(fresh_accelerate: None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """One process: expect_processes=1 passes, batch= plans inside prepare, log_plans prints the summary."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt = L.model_and_opt()
    model, opt = za.prepare(acc, model, opt, budget=L.LOSSLESS, expect_processes=1, batch=L.batch(0, 0))
    (plan,) = za.plans(model)
    assert _recomputes([u.decision.value for u in plan.units])
    with caplog.at_level(logging.INFO, logger="zoomem.accelerate"):
        assert za.log_plans(acc, model) == [plan]
    assert sum("zoomem plan (ilp" in m for m in caplog.messages) == 1
    acc.backward(model(**L.batch(0, 0)).loss)
    assert za.plans(model) == [plan]  # the same signature: no second plan


# --- HF Trainer ---------------------------------------------------------------------------------------------


def test_trainer_callback_under_ddp(ddp: SimpleNamespace) -> None:
    """The Trainer (2 processes, DDP built before on_train_begin) with ZoomemCallback and dynamic padding: the
    callback wraps the module inside DDP, and each rank plans for the lengths it meets (they differ between the
    ranks); losses and parameters equal the run without it, on both ranks; unwrapped at the end."""
    assert ddp.ranks[0]["trainer_lengths"] != ddp.ranks[1]["trainer_lengths"]
    for r in ddp.ranks:
        plain, wrapped = r["trainer_plain"], r["trainer_zoomem"]
        assert wrapped["container"] == "DistributedDataParallel"
        assert _recomputes(wrapped["decisions"]) and wrapped["unwrapped_after"]
        assert wrapped["ddp_bytes"] == wrapped["bucket_bytes"] > 0  # DDP's buckets, in the plan's fixed bytes
        assert wrapped["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        assert r["trainer_max_param_diff"] <= 1e-5  # the compact forms' reassociated LayerNorm, as above
    assert ddp.ranks[0]["trainer_zoomem"]["param_checksum"] == ddp.ranks[1]["trainer_zoomem"]["param_checksum"]


def test_trainer_callback_single_process(tmp_path: Path, fresh_accelerate: None,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """One process, use_cpu=True: the same losses, gradient norms and parameters as without the callback, the
    plan summary logged once, and the model handed back unwrapped."""
    from zoomem.hf_trainer import ZoomemCallback

    with torch.random.fork_rng(devices=[]):
        plain = L.run_trainer(tmp_path)
        cb = ZoomemCallback(L.LOSSLESS)
        with caplog.at_level(logging.INFO, logger="zoomem.hf_trainer"):
            wrapped = L.run_trainer(tmp_path, cb)
    logs = [[h[k] for h in t.state.log_history if "loss" in h for k in ("loss", "grad_norm")]
            for t in (plain, wrapped)]
    assert len(logs[0]) == 6 and logs[1] == pytest.approx(logs[0], rel=1e-6), logs
    for p, q in zip(plain.model.parameters(), wrapped.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert _recomputes([u.decision.value for u in cb.plans[0].units])
    assert sum("zoomem plan (ilp" in m for m in caplog.messages) == 1, caplog.messages
    assert not zoomem.is_wrapped(wrapped.model)


def test_trainer_callback_with_skip_logits_trains_a_causal_lm(tmp_path: Path, fresh_accelerate: None) -> None:
    """``ZoomemCallback(budget, skip_logits=True)`` on a causal LM: the Trainer reads ``outputs["loss"]``, so it
    trains on the forward that returns ``logits=None``, with plain training's losses and parameters."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    from zoomem.hf_trainer import ZoomemCallback

    def run(callback: Any) -> tuple[Any, list[bool]]:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model, _ = zoo.build("hf/gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64)
        ids = torch.randint(0, 300, (16, 32), generator=torch.Generator().manual_seed(5))
        rows = [{"input_ids": r, "labels": r} for r in ids]
        seen: list[bool] = []
        model.register_forward_hook(lambda m, a, out: seen.append(out.logits is None) if m.training else None)
        targs = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3,
                                  per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                                  save_strategy="no", seed=0, disable_tqdm=True, optim="sgd")
        trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[callback] if callback else None)
        trainer.train()
        return trainer, seen

    with torch.random.fork_rng(devices=[]):
        cb = ZoomemCallback(0.55, skip_logits=True)  # (without skip_logits the smallest budget is 60%)
        (plain, seen_plain), (wrapped, seen) = run(None), run(cb)
    assert cb.plans[0].outside_compact  # the fused loss runs
    assert seen_plain == [False] * 3 and seen[-3:] == [True] * 3, seen  # (planning's own forwards come first)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, wrapped)]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-6), losses
    # SGD: the fused loss's gradients differ from stock's in the last bits, which AdamW's 1/sqrt(v) would blow up
    # to a whole step of the learning rate where a gradient is near zero
    for p, q in zip(plain.model.parameters(), wrapped.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert not zoomem.is_wrapped(wrapped.model)


def test_skip_logits_under_accelerate_bf16_returns_no_float32_copy(fresh_accelerate: None) -> None:
    """Under ``mixed_precision="bf16"`` Accelerate's forward turns half-precision outputs into float32 copies, and
    zoomem wraps that forward: the logits its fused loss left unsaved are dropped before the conversion (before,
    their float32 copy came back and was held into backward). Gradients as the same plan's keeping its logits,
    within the bf16 rounding of the vocabulary slices made again in backward."""
    from accelerate import Accelerator

    from zoomem.ops.loss import set_skip_logits

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, _ = zoo.build("hf/gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=4096, n_positions=64)
    model.config.use_cache = False
    ids = torch.randint(0, 4096, (8, 32), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids}
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = za.prepare(acc, model, opt, budget=0.83, skip_logits=True)  # (the least is 81%)
    torch.manual_seed(1)  # the same dropout masks in both forwards
    out = model(**batch)
    assert za.plans(model)[0].outside_compact  # the fused loss runs
    assert out.logits is None and out.loss.dtype == torch.float32
    acc.backward(out.loss)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    set_skip_logits(acc.unwrap_model(model), False)  # the same plan keeping its logits: Accelerate converts them
    torch.manual_seed(1)
    kept = model(**batch)
    assert kept.logits.dtype == torch.float32
    acc.backward(kept.loss)
    assert out.loss.item() == pytest.approx(kept.loss.item(), rel=1e-3)
    for (name, p), g in zip(model.named_parameters(), grads):
        assert (g - p.grad).norm() <= 1e-2 * p.grad.norm() + 1e-6, name
    model.eval()
    with torch.no_grad():  # evaluation keeps its logits, converted as Accelerate converts them
        assert model(**batch).logits.dtype == torch.float32


def test_trainer_callback_refuses_hf_gradient_checkpointing(tmp_path: Path, fresh_accelerate: None) -> None:
    from zoomem.hf_trainer import ZoomemCallback

    with pytest.raises(ValueError, match="drop gradient_checkpointing=True"):
        L.run_trainer(tmp_path, ZoomemCallback(L.LOSSLESS), gradient_checkpointing=True)


# --- what is refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fix", [("FSDP", "fsdp_activation_checkpointing"), ("DEEPSPEED", "--multi_gpu"),
                                       ("XLA", "--multi_gpu")])
def test_unsupported_distributed_types_say_what_to_use(kind: str, fix: str) -> None:
    """FSDP (checked: torch's fully_shard on gloo fails inside zoomem's trace, whose storages of sharded
    parameters are invalid), DeepSpeed and XLA are refused before anything is wrapped."""
    from accelerate.utils import DistributedType

    with pytest.raises(za.UnsupportedDistributedError, match=f"distributed_type {kind}") as err:
        za.check_distributed_type(SimpleNamespace(distributed_type=DistributedType[kind]))
    assert fix in str(err.value)
    za.check_distributed_type(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))


# --- regressions: zoomem runtime bugs met on the way, fixed in zoomem/runtime ------------------------------


def test_wrap_before_prepare_under_bf16_leaves_autocast_off(fresh_accelerate: None) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = L.model_and_opt()
    zoomem.wrap(model, strategy="all")  # full recomputation: no selective checkpointing (the bug below)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(**L.batch(0, 0)).loss)
    assert not torch.is_autocast_enabled("cpu")


def test_first_step_under_autocast_with_cheap_recomputation(fresh_accelerate: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that plans, under autocast, runs cheap recomputation (every unit the plan recomputes made
    ``recompute_cheap``: the program picks it or not by measured times, and the test skipped when it did not) and
    gives plain autocast's gradients, bitwise."""
    wrap_module = importlib.import_module("zoomem.runtime.wrap")  # the module (zoomem.runtime.wrap is a function)
    real = wrap_module._make

    def cheap(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        for unit in plan.units:
            if unit.decision != zoomem.Decision.KEEP:
                unit.decision = zoomem.Decision.RECOMPUTE_CHEAP
        return plan

    monkeypatch.setattr(wrap_module, "_make", cheap)
    model, _ = L.model_and_opt()
    reference, _ = L.model_and_opt()
    grads = []
    for m in (reference, model):
        if m is model:
            zoomem.wrap(model, L.LOSSLESS)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**L.batch(0, 0)).loss
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert "recompute_cheap" in [u.decision.value for u in za.plans(model)[0].units]
    for ours, plain in zip(*grads):
        assert torch.equal(ours, plain)


def test_wrapped_forward_keeps_its_signature_and_survives_accelerate_unwrapping(fresh_accelerate: None) -> None:
    """zoomem's forward is a method that looks like the original: HF Trainer reads its signature to choose
    dataset columns, and Accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` rebinds its function."""
    import inspect

    from accelerate import Accelerator

    model, opt = L.model_and_opt()
    before = list(inspect.signature(model.forward).parameters)
    zoomem.wrap(model, strategy="all")
    assert list(inspect.signature(model.forward).parameters) == before
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = acc.prepare(model, opt)
    acc.backward(model(**L.batch(0, 0)).loss)
    bare = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert bare(**L.batch(0, 1)).loss.isfinite()  # zoomem's forward, bound as a method again
    with pytest.warns(UserWarning, match="replaced after zoomem"):
        zoomem.unwrap(model)  # Accelerate's wrapper (if any) on top stays; zoomem's beneath it passes through
    assert model(**L.batch(0, 1)).loss.isfinite()
    assert not zoomem.is_wrapped(model)
