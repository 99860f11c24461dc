"""zoomem.measure: the numbers every benchmark rests on, checked against sizes computed by hand."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from zoomem.batch import Batch
from zoomem.measure import MemoryMeter, MemoryReport, PhaseStat, holder_bytes, measure_step

F32 = 4
REPO = Path(__file__).resolve().parents[1]


# -- exact bytes ----------------------------------------------------------------------------------------------------


def test_known_allocation_is_exact():
    with MemoryMeter() as meter:
        x = torch.empty(1_000_000)
        meter.mark("alloc")
    r = meter.report
    assert r.device == "cpu"
    assert r.baseline_bytes == 0
    assert r.peak_delta_bytes == 4_000_000
    assert r.peak_bytes == 4_000_000
    assert r.phases == {"alloc": PhaseStat(peak_bytes=4_000_000, end_bytes=4_000_000)}
    assert r.activation_bytes is None
    del x


def test_temporary_counts_in_peak_not_in_held_bytes():
    with MemoryMeter() as meter:
        tmp = torch.empty(1_000_000)
        del tmp
        meter.mark("temp")
        kept = torch.empty(250_000)
        meter.mark("kept")
    r = meter.report
    assert r.peak_delta_bytes == 4_000_000
    assert r.phases["temp"] == PhaseStat(peak_bytes=4_000_000, end_bytes=0)
    # The second phase starts from 0 held bytes: the first phase's temporary does not leak into its peak.
    assert r.phases["kept"] == PhaseStat(peak_bytes=1_000_000, end_bytes=1_000_000)
    assert list(r.phases) == ["temp", "kept"]
    del kept


def test_reused_pointers_are_tracked_per_block():
    with MemoryMeter() as meter:
        for _ in range(20):  # the allocator hands back the same block again and again
            t = torch.empty(1_000_000)
            del t
        t = torch.empty(1_000_000)
        meter.mark("end")
    assert meter.report.peak_delta_bytes == 4_000_000
    assert meter.report.phases["end"].end_bytes == 4_000_000
    del t


def test_frees_of_blocks_from_before_the_window_are_ignored():
    pre = torch.empty(1_000_000)
    with MemoryMeter(pre) as meter:
        del pre
        meter.mark("freed")
        small = torch.empty(10)
    r = meter.report
    assert r.baseline_bytes == 4_000_000
    assert r.peak_delta_bytes == 40
    assert r.phases["freed"] == PhaseStat(peak_bytes=4_000_000, end_bytes=4_000_000)
    del small


def test_block_allocated_in_an_earlier_window_is_ignored_when_freed():
    # The profiler remembers the size of blocks allocated while any earlier session ran, and reports their frees;
    # the meter must still ignore them, or held bytes would go negative.
    with MemoryMeter():
        kept = torch.empty(1_000_000)
    with MemoryMeter(kept) as meter:
        del kept
        meter.mark("freed")
    r = meter.report
    assert r.peak_delta_bytes == 0
    assert r.phases["freed"].end_bytes == r.baseline_bytes == 4_000_000


def test_conv_forward_scratch_is_seen():
    conv = nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(2, 16, 16, 16)
    with torch.no_grad():
        conv(x)  # warm-up: first-call setup is not part of the measurement
        with MemoryMeter(conv, x) as meter:
            out = conv(x)
            meter.mark("forward")
    r = meter.report
    # Only the output survives, but oneDNN needs an output-sized buffer and reordered weights on the way
    # (measured here: 2 * 32768 + 9216 = 74752 bytes), which dispatch-level trackers miss.
    assert r.activation_bytes == out.nbytes == 2 * 16 * 16 * 16 * F32
    assert r.peak_delta_bytes >= 2 * out.nbytes


# -- training steps ------------------------------------------------------------------------------------------------

B, I, H, O = 64, 32, 128, 10


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(I, H), nn.ReLU(), nn.Linear(H, O))


def test_mlp_activation_bytes_are_the_saved_tensors():
    model = _mlp()
    x = torch.randn(B, I)
    model(x).sum().backward()  # warm-up
    model.zero_grad(set_to_none=True)
    with MemoryMeter(model, x) as meter:
        out = model(x)
        meter.mark("forward")
    r = meter.report
    # Linear1 saves x and its weight (both from before the window); ReLU saves its output [B, H], which Linear2
    # saves too; Linear1's output [B, H] is freed once ReLU has run; the output [B, O] is held.
    assert r.activation_bytes == (B * H + B * O) * F32
    # Linear1's output and the ReLU output are live together for a moment.
    assert r.peak_delta_bytes == 2 * B * H * F32
    assert r.baseline_bytes == sum(p.nbytes for p in model.parameters()) + x.nbytes
    del out


def test_measure_step_phases_with_adamw():
    model = _mlp()
    x, y = torch.randn(B, I), torch.randint(0, O, (B,))
    batch = Batch(args=(x,), target=y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = lambda out, b: nn.functional.cross_entropy(out, b.target)  # noqa: E731
    param_bytes = sum(p.nbytes for p in model.parameters())
    n_params = len(list(model.parameters()))
    output_and_loss = B * O * F32 + F32

    first = measure_step(model, batch, loss_fn, opt)
    assert list(first.phases) == ["forward", "backward", "optimizer"]
    assert first.baseline_bytes == param_bytes + x.nbytes + y.nbytes
    fwd, bwd, step = (first.phases[k] for k in ("forward", "backward", "optimizer"))
    for phase in (fwd, bwd, step):
        assert phase.peak_bytes >= phase.end_bytes >= first.baseline_bytes
    assert first.activation_bytes == fwd.end_bytes - first.baseline_bytes == (B * H + B * O) * F32
    assert bwd.peak_bytes >= fwd.end_bytes  # a phase's peak includes what it started with
    assert first.peak_bytes == max(p.peak_bytes for p in first.phases.values())
    # First step: AdamW allocates exp_avg, exp_avg_sq (one parameter's size each) and a 4-byte step per
    # parameter; zero_grad(set_to_none=True) frees the grads the window allocated; output and loss stay.
    assert step.end_bytes - first.baseline_bytes == 2 * param_bytes + n_params * F32 + output_and_loss
    assert all(p.grad is None for p in model.parameters())

    second = measure_step(model, batch, loss_fn, opt)
    state_bytes = 2 * param_bytes + n_params * F32
    assert second.baseline_bytes == first.baseline_bytes + state_bytes
    assert second.phases["optimizer"].end_bytes - second.baseline_bytes == output_and_loss
    assert second.activation_bytes == first.activation_bytes
    assert second.peak_delta_bytes == first.peak_delta_bytes


def test_measure_step_without_optimizer_and_bad_loss():
    model = _mlp()
    r = measure_step(model, torch.randn(4, I), lambda out, b: out.sum())
    assert list(r.phases) == ["forward", "backward"]
    with pytest.raises(TypeError, match="scalar"):
        measure_step(model, torch.randn(4, I), lambda out, b: out)
    # The failed step closed its meter: a new one opens.
    with MemoryMeter():
        pass


# -- baseline ------------------------------------------------------------------------------------------------------


def test_baseline_is_deduplicated_param_and_buffer_bytes():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: one storage
    model = nn.ModuleDict({"emb": emb, "norm": nn.BatchNorm1d(4), "head": head})
    expected = 10 * 4 * F32 + 4 * 4 * F32 + 8  # embedding; BN weight, bias, running mean, var; num_batches_tracked
    assert holder_bytes(model) == expected
    with MemoryMeter(model) as meter:
        pass
    assert meter.report.baseline_bytes == expected

    x = torch.zeros(100)
    x.grad = torch.zeros(100)
    # A view shares its base's storage; an existing .grad counts; the model given twice counts once.
    assert holder_bytes(model, x, x[10:20], {"again": [model]}) == expected + 2 * 100 * F32
    assert holder_bytes(Batch(args=(x,), kwargs={"v": x.view(10, 10)})) == 100 * F32


# -- errors and lifetime -------------------------------------------------------------------------------------------


def test_report_and_mark_outside_the_window_raise():
    meter = MemoryMeter()
    with pytest.raises(RuntimeError, match="after the `with` block"):
        meter.report
    with pytest.raises(RuntimeError, match="outside"):
        meter.mark("forward")
    with meter:
        with pytest.raises(RuntimeError, match="still open"):
            meter.report
        meter.mark("a")
        with pytest.raises(ValueError, match="already used"):
            meter.mark("a")
    assert list(meter.report.phases) == ["a"]
    with pytest.raises(RuntimeError, match="one window"):
        with meter:
            pass


def test_nested_meters_and_running_profiler_raise():
    with MemoryMeter() as outer:
        with pytest.raises(RuntimeError, match="cannot nest"):
            with MemoryMeter():
                pass
    assert outer.report.peak_delta_bytes == 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="profiler is already running"):
            with MemoryMeter():
                pass
    with MemoryMeter() as after:  # nothing left half-open
        t = torch.empty(10)
    assert after.report.peak_delta_bytes == 40
    del t


def test_error_inside_the_window_still_closes_it():
    meter = MemoryMeter()
    with pytest.raises(KeyError):
        with meter:
            t = torch.empty(1000)
            raise KeyError("boom")
    assert meter.report.peak_delta_bytes == 4000
    del t
    with MemoryMeter():
        pass


def test_bad_holders_and_devices_raise():
    with pytest.raises(TypeError, match="cannot find the tensors of a object"):
        MemoryMeter(object())
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        MemoryMeter(device="meta")
    assert MemoryMeter(nn.Linear(2, 2)).device == torch.device("cpu")


def test_meter_keeps_no_holder_alive():
    t = torch.empty(1000)
    ref = weakref.ref(t)
    meter = MemoryMeter(t)
    with meter:
        del t
        gc.collect()
        assert ref() is None


def test_to_dict_round_trips_through_json():
    with MemoryMeter(torch.zeros(3)) as meter:
        out = torch.empty(100)
        meter.mark("forward")
        meter.mark("backward")
    r = meter.report
    data = json.loads(json.dumps(r.to_dict()))
    assert data == r.to_dict()
    assert data["phases"]["forward"] == {"peak_bytes": 412, "end_bytes": 412}
    assert MemoryReport.from_dict(data) == r
    assert "MiB" in r.summary() and "forward" in r.summary()
    del out


def test_kineto_noise_is_silenced_in_a_fresh_process(tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from zoomem.measure import MemoryMeter
        with MemoryMeter() as m:
            x = torch.empty(1000)
        print(m.report.peak_delta_bytes)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4000"
    assert "USDT" not in done.stderr and "gpuGetDeviceCount" not in done.stderr, done.stderr


# -- CUDA ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_known_allocation_and_phases():
    pre = torch.empty(1 << 20, device="cuda")
    with MemoryMeter(pre) as meter:
        tmp = torch.empty(1 << 20, device="cuda")
        del tmp
        meter.mark("forward")
        kept = torch.empty(1 << 18, device="cuda")
        meter.mark("backward")
    r = meter.report
    assert r.device.startswith("cuda:")
    assert r.baseline_bytes >= 4 << 20
    assert r.peak_delta_bytes == 4 << 20
    assert r.activation_bytes == 0
    assert r.phases["forward"] == PhaseStat(r.baseline_bytes + (4 << 20), r.baseline_bytes)
    assert r.phases["backward"] == PhaseStat(r.baseline_bytes + (1 << 20), r.baseline_bytes + (1 << 20))
    del kept, pre


def test_out_of_memory_is_recognised() -> None:
    """A real CPU allocation failure (1 PiB), CUDA's error type and Python's MemoryError count; other errors not."""
    from zoomem.measure import is_out_of_memory

    with pytest.raises(RuntimeError) as cpu:
        torch.empty(1 << 50, dtype=torch.uint8)
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))
