"""Planning a batch too large to trace: costs from two smaller traces, extrapolated (zoomem.planner.scale)."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zoomem
from zoomem import zoo
from zoomem.planner import Decision
from zoomem.planner.scale import Scale, ScalingError, scale_costs, sizes_within, trace_sizes
from zoomem.runtime.wrap import _scaled_cost_model, cost_model

from test_wrap import _assert_grads_close, _step

ROOT = Path(__file__).resolve().parent.parent


def test_batch_take_cuts_every_tensor_along_the_batch_dimension() -> None:
    ids = torch.arange(24).reshape(6, 4)
    batch = zoomem.Batch(kwargs={"input_ids": ids, "attention_mask": torch.ones(6, 4), "position_ids":
                                 torch.arange(4)[None], "labels": torch.arange(6)}, target=torch.arange(6))
    assert batch.batch_size() == 6
    part = batch.take(2)
    assert part.kwargs["input_ids"].tolist() == ids[:2].tolist()
    assert part.kwargs["labels"].tolist() == [0, 1] and part.target.tolist() == [0, 1]
    assert part.kwargs["position_ids"].shape == (1, 4)  # not a batch dimension: left whole
    with pytest.raises(ValueError, match="Cannot take 7 samples of a batch of 6"):
        batch.take(7)


def test_sizes_within_a_limit() -> None:
    """The largest sizes whose peak, on the lines through the measured ones, stays within the limit."""
    peaks = [(32, 100 + 10 * 32), (16, 100 + 10 * 16)]  # 100 fixed, 10 per sample
    assert sizes_within(32, peaks, 420) == (None, 420)  # the whole batch fits
    assert sizes_within(32, peaks, 419) == (trace_sizes(32, 31), 410)
    assert sizes_within(32, peaks, 255) == (trace_sizes(32, 15), 250)
    assert sizes_within(32, peaks, 130) == (trace_sizes(32, 3), 130)
    assert sizes_within(32, peaks, 129) == (None, 420)  # not even 3 samples fit: the batch, and its peak
    assert sizes_within(32, peaks, 400, cap=Scale(4, 8, 32)) == (Scale(4, 8, 32), 180)  # no larger than what ran
    assert sizes_within(32, peaks, 150, cap=Scale(4, 8, 32)) == (trace_sizes(32, 5), 150)
    assert sizes_within(32, [(32, 420)], 100) == (None, 420)  # one size: no line to choose by
    assert sizes_within(4, peaks, 135) == (trace_sizes(4, 3), 130)
    assert sizes_within(3, peaks, 135) == (None, 130)  # nothing below 3 samples to go to
    # the largest phase's peak: parameter-sized tensors below 8 samples, activations above (convex in the batch)
    convex = [(32, 420), (16, 260), (8, 200)]  # 10 a sample above 16, 7.5 from 8 to 16
    assert sizes_within(32, convex, 245) == (trace_sizes(32, 14), 245)  # within the measured sizes: between them
    assert sizes_within(32, convex, 185) == (trace_sizes(32, 6), 185)  # below them: the line through the two smallest


def test_trace_sizes_and_time_extrapolation() -> None:
    assert trace_sizes(64, 8) == Scale(4, 8, 64)
    assert trace_sizes(10, 3) == Scale(2, 3, 10)
    for bad in (2, 64, 100):
        with pytest.raises(ValueError, match="trace_batch_size"):
            trace_sizes(64, bad)
    s = Scale(4, 8, 64)
    assert s.bytes(100, 180) == 100 + 80 * 60 // 4  # affine through both points
    assert s.seconds(1.0, 2.0) == 16.0  # proportional from the larger trace at most ...
    assert s.seconds(1.9, 2.0) == pytest.approx(2.0 + 0.1 * 14)  # ... the affine fit inside the bounds ...
    assert s.seconds(2.5, 2.0) == 2.0  # ... and never below the larger trace's time (noise at small batches)
    assert s.seconds(-1.0, -2.0) == -16.0  # a compact form's credit: the same bounds, mirrored
    assert s.seconds(-1.9, -2.0) == pytest.approx(-2.0 - 0.1 * 14)
    assert s.seconds(-2.5, -2.0) == -2.0


@pytest.mark.parametrize("model_id, tolerance", [
    ("timm/resnet18", 0.01), ("hf/bert-base-uncased", 0.01), ("hf/gpt2", 0.01), ("timm/mobilenetv2_100", 0.03),
])
def test_scaled_costs_predict_what_a_trace_at_the_batch_measures(model_id: str, tolerance: float) -> None:
    model, adapter, batch = zoo.small(model_id, batch_size=16)
    direct, _, _ = cost_model(model, batch, adapter)
    scaled, _, _ = _scaled_cost_model(model, batch, adapter, None, None, trace_sizes(16, 4))
    assert scaled.fixed_bytes == direct.fixed_bytes  # parameters, buffers and the batch
    for decision in (Decision.KEEP, Decision.RECOMPUTE, Decision.RECOMPUTE_CHEAP):
        plan = {u: decision for u in direct.units}
        want, got = direct.peak(plan), scaled.peak(plan)
        assert abs(got - want) <= tolerance * want, f"{decision.value}: {got / 2**20:.2f} vs {want / 2**20:.2f} MiB"
    assert [s.nbytes for s in scaled.storages] == [s.nbytes for s in direct.storages]
    # what a recomputed unit's compact forms take off its backward, measured where they let go early (ResNet-18's
    # blocks end in ReLU, GPT-2's forms let go of a tensor too), extrapolated with the rest
    assert set(scaled.compact_recompute_gain) == set(direct.compact_recompute_gain)
    plan, compact = {u: Decision.RECOMPUTE for u in direct.units}, frozenset(direct.compact_saving)
    want, got = direct.peak(plan, compact), scaled.peak(plan, compact)
    assert abs(got - want) <= tolerance * want, f"recompute, compact: {got / 2**20:.2f} vs {want / 2**20:.2f} MiB"


def test_traces_of_different_steps_refuse_to_extrapolate() -> None:
    m1, a1, b1 = zoo.small("timm/resnet18", batch_size=2)
    m2, a2, b2 = zoo.small("timm/mobilenetv2_100", batch_size=4)
    c1, _, _ = cost_model(m1, b1, a1)
    c2, _, _ = cost_model(m2, b2, a2)
    with pytest.raises(ScalingError, match="differs in its units.*trace_batch_size"):
        scale_costs(c1, c2, Scale(2, 4, 16))


def test_wrap_plans_a_large_batch_from_small_traces_with_exact_gradients() -> None:
    model, adapter, batch = zoo.small("hf/bert-base-uncased", batch_size=24)
    reference = copy.deepcopy(model)
    ref_loss, ref_grads, ref_peak = _step(reference, adapter, batch)
    zoomem.wrap(model, "70%", adapter=adapter, batch=batch, trace_batch_size=6)  # at 80% compact forms do
    plan = next(iter(model._zoomem.plans.values()))
    assert plan.traced_at == [3, 6, 24] and "traced at batches of 3 and 6 samples and extrapolated to 24" in plan.summary()
    assert any(u.decision != Decision.KEEP for u in plan.units)
    assert abs(plan.baseline_peak_bytes - ref_peak) <= 0.02 * ref_peak  # plain PyTorch's peak, never traced at 24
    loss, grads, peak = _step(model, adapter, batch)
    assert torch.equal(loss, ref_loss)
    _assert_grads_close(grads, ref_grads, "scaled plan")
    assert peak <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak
    assert zoomem.Plan.from_json(plan.to_json()).traced_at == [3, 6, 24]


def test_levels_from_small_probes_store_what_a_full_probe_would() -> None:
    model, adapter, batch = zoo.small("hf/bert-base-uncased", batch_size=16)
    full = zoomem.plan(model, batch, level="L2", adapter=adapter)
    scaled = zoomem.plan(model, batch, level="L2", adapter=adapter, trace_batch_size=4)
    assert scaled.traced_at == [2, 4, 16]
    assert set(scaled.bits) == set(full.bits)  # the same tensors lossy, with their sizes at 16 sequences
    assert {d["key"]: d["shape"] for d in scaled.saved} == {d["key"]: d["shape"] for d in full.saved}
    assert abs(scaled.predicted_peak_bytes - full.predicted_peak_bytes) <= 0.01 * full.predicted_peak_bytes
    # relative variance: the probe at 4 sequences stands for 16 (both C_s and ||g||^2 fall as 1 / batch here)
    assert full.variance / 4 <= scaled.variance <= 4 * full.variance

    zoomem.wrap(model, level="L2", adapter=adapter, trace_batch_size=4)
    for _ in range(2):  # the first step plans, the second measures the sensitivities again: on 2 and 4 sequences
        adapter.loss(model, batch, batch.call(model)).backward()
        model.zero_grad(set_to_none=True)
    ((sig, plan),) = model._zoomem.plans.items()
    assert plan.traced_at == [2, 4, 16] and set(plan.bits) == set(full.bits)
    assert model._zoomem.planning[sig].probe_scale == Scale(2, 4, 16)


def test_pyg_graphs_cannot_be_planned_from_smaller_batches() -> None:
    model, adapter, batch = zoo.small("pyg/gcn")
    with pytest.raises(ValueError, match="cannot plan a PyG graph batch from smaller ones"):
        zoomem.plan(model, batch, 0.8, adapter=adapter, trace_batch_size=3)


@pytest.mark.parametrize("bad", [2, 0, 3.5, True])
def test_trace_batch_size_is_checked(bad) -> None:
    model, adapter, batch = zoo.small("timm/resnet18")
    with pytest.raises(ValueError, match="trace_batch_size must be an int >= 3"):
        zoomem.wrap(model, "80%", adapter=adapter, trace_batch_size=bad)
    assert not zoomem.is_wrapped(model)


_OUT_OF_MEMORY = textwrap.dedent("""
    import json, logging, resource, sys, torch, zoomem
    from zoomem import zoo
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model, adapter, batch = zoo.small("timm/mobilenetv2_100", batch_size=128)
    def step():
        torch.manual_seed(0)
        loss = adapter.loss(model, batch, batch.call(model))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return loss.item(), grads
    ref_loss, ref_grads = step()  # plain PyTorch, before memory is capped
    def vm():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    # measured with this script: a plain step at 128 images fits in 820 MiB more address space, not in 720; the
    # trace at 128 fails at 820 too, and the plan within 40% of plain PyTorch's peak fits in 640, not in 560
    resource.setrlimit(resource.RLIMIT_AS, (vm() + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY))
    try:
        step()
        plain = "fits"
    except RuntimeError as e:
        plain = "out of memory" if zoomem.measure.is_out_of_memory(e) else repr(e)
    for p in model.parameters():
        p.grad = None  # what the failed backward had accumulated
    zoomem.wrap(model, "40%", adapter=adapter, batch=batch)
    plan = next(iter(model._zoomem.plans.values()))
    loss, grads = step()
    top = max(r.norm() for r in ref_grads)  # as test_wrap._assert_grads_close: exact zeros are rounding noise
    off = [i for i, (g, r) in enumerate(zip(grads, ref_grads)) if (g - r).norm() > 1e-5 * r.norm() + 1e-6 * top]
    print(json.dumps({"plain": plain, "traced_at": plan.traced_at, "loss": loss, "ref_loss": ref_loss,
                      "grads_off": off, "budget": plan.budget_bytes, "measured": plan.extras["measured_peak_bytes"]}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="caps address space with RLIMIT_AS (Linux)")
def test_a_batch_whose_plain_step_runs_out_of_memory_trains_under_a_plan(tmp_path: Path) -> None:
    """The real thing on CPU: address space capped so that a plain step at the batch fails to allocate; planning
    falls back to halves of the batch, and the plan trains at the full batch with plain PyTorch's gradients."""
    script = tmp_path / "oom.py"
    script.write_text(_OUT_OF_MEMORY)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script), "680"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["plain"] == "out of memory", result
    assert "tracing the step at a batch of 128 ran out of memory; planning from batches of 32 and 64" in run.stderr
    assert result["traced_at"] == [32, 64, 128]
    assert result["loss"] == result["ref_loss"] and result["grads_off"] == []
    assert result["measured"] <= result["budget"]
