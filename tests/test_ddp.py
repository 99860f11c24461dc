"""DDP's gradient buckets in a plan's budget, in one process (a gloo group of one; the two-process launches are in
tests/test_accelerate.py): ``DistributedDataParallel`` allocates a flat copy of the gradients when it is built
and holds it for good, so a step under DDP needs that much more than the same step without it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zoomem
from zoomem import zoo
from zoomem.accelerate import plans
from zoomem.measure import measure_step
from zoomem.runtime.distributed import bucket_bytes, ddp_of, holding


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _logged_bucket_bytes(ddp: DistributedDataParallel) -> int:
    return sum(int(b) for b in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(","))


@pytest.mark.parametrize("view", [False, True], ids=["buckets", "gradient_as_bucket_view"])
def test_a_plan_under_ddp_counts_its_gradient_buckets(gloo: None, view: bool) -> None:
    """Small ResNet-18 at batch 48 under a 90% budget: building DDP allocates its buckets (42.7 MiB, the gradients'
    size); the plan, made inside DDP's first forward, counts them in its fixed bytes, and a metered step after
    DDP's bucket rebuild is predicted within 1%. Without them the prediction was 42.7 MiB (24%) low. With
    ``gradient_as_bucket_view=True`` the gradients are the buckets, and the backward makes none of its own: the
    plan counted them twice, 17.5 MiB (9%) high without a budget."""
    model, adapter, batch = zoo.small("timm/resnet18", batch_size=48)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zoomem.MemoryMeter(model) as meter:
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=view)
    buckets = bucket_bytes(ddp)
    assert buckets == _logged_bucket_bytes(ddp) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(meter.report.peak_delta_bytes - buckets) <= 0.002 * buckets, (meter.report.peak_delta_bytes, buckets)

    zoomem.wrap(model, "90%", adapter=adapter, optimizer=opt)
    loss_fn = lambda out, b: adapter.loss(model, b, out)  # noqa: E731
    for _ in range(2):  # the first step plans (inside DDP's forward); DDP rebuilds its buckets in the second
        loss_fn(batch.call(ddp), batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    (plan,) = plans(ddp)
    assert plan.ddp_bytes == buckets and "DDP's gradient buckets 42.7 MiB included" in plan.summary()
    assert plan.optimizer_bytes < buckets if view else plan.optimizer_bytes > buckets  # the gradients, or none
    report = measure_step(ddp, batch, loss_fn, opt)  # (a DDP holder: its buckets in the meter's baseline)
    assert abs(report.baseline_bytes - plan.fixed_bytes) <= 1024, (report.baseline_bytes, plan.fixed_bytes)
    assert abs(report.peak_bytes - plan.predicted_peak_bytes) <= 0.01 * report.peak_bytes, \
        (report.peak_bytes, plan.predicted_peak_bytes)
    assert report.peak_bytes <= plan.budget_bytes
    print(f"DDP built {meter.report.peak_delta_bytes / 2**20:.2f} MiB, buckets {buckets / 2**20:.2f}; step measured "
          f"{report.peak_bytes / 2**20:.2f} MiB, predicted {plan.predicted_peak_bytes / 2**20:.2f}")
    zoomem.unwrap(model)


def test_a_plan_made_outside_ddps_forward_counts_the_buckets_of_the_ddp_named(gloo: None) -> None:
    """``wrap(batch=...)`` plans at once, outside any DDP forward: :func:`holding` names the container (as
    ``zoomem.accelerate.prepare`` does; through ``torch.compile``'s wrapper too); without it no buckets are known.
    An infeasible budget's error names them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    ddp = DistributedDataParallel(model)
    assert ddp_of(model) is None
    with holding(torch.compile(ddp)):
        assert ddp_of(model) is ddp
        zoomem.wrap(model, batch=torch.randn(32, 64), level="L0")
    assert [p.ddp_bytes for p in plans(model)] == [bucket_bytes(ddp)] and bucket_bytes(ddp) > 0
    zoomem.unwrap(model)
    with holding(ddp), pytest.raises(zoomem.InfeasibleBudgetError, match="and DDP's gradient buckets"):
        zoomem.wrap(model, 4096, batch=torch.randn(32, 64))  # the error names what the fixed bytes hold
    assert not zoomem.is_wrapped(model)
    zoomem.wrap(model, batch=torch.randn(32, 64), level="L0")
    assert [p.ddp_bytes for p in plans(model)] == [0]
    zoomem.unwrap(model)


def _event_names(trace: object) -> set[str]:
    names: set[str] = set()
    stack = list(trace.experimental_event_tree())  # type: ignore[attr-defined]
    while stack:
        event = stack.pop()
        names.add(event.name)
        stack.extend(event.children)
    return names


def test_the_cpu_meter_records_no_gloo_collective(gloo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo ends a collective's record function on its worker thread after the collective's future has completed,
    so a DDP step's all-reduce can end after backward returned and the meter closed, writing into the closed
    session's freed records (a 2-process CI run aborted with heap corruption right after a metered DDP step). The
    meter's session records none of them, and still its marks; a plain profiler session records the all-reduce."""
    ddp = DistributedDataParallel(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as plain:
        ddp(x).sum().backward()
        time.sleep(0.05)  # this session is exposed to the race: let gloo's thread end its record function first
    assert "gloo:all_reduce" in _event_names(plain.profiler.kineto_results)

    traces: list[object] = []
    disable = torch.autograd._disable_profiler
    monkeypatch.setattr(torch.autograd, "_disable_profiler", lambda: traces.append(disable()) or traces[-1])
    report = measure_step(ddp, zoomem.Batch(args=(x,)), lambda out, batch: out.sum())
    names = _event_names(traces[0])
    assert not {n for n in names if n.startswith("gloo:")}
    assert {"zoomem::mark::forward", "zoomem::mark::backward"} <= names
    assert report.peak_delta_bytes > 0
