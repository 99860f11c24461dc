"""The optimizer's part of a training step: its step's scratch as zoomem measures it on fake tensors against a
metered real step, and plans whose budget bounds the whole step, the optimizer's included."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import zoomem
from zoomem import zoo
from zoomem.measure import holder_bytes, measure_step
from zoomem.optimizer import footprint, unwrapped


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 8))


def _metered_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes one real ``step()`` allocates above what exists before it (the second step: the first makes state)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    with zoomem.MemoryMeter(model, optimizer) as meter:
        optimizer.step()
        meter.mark("step")
    return meter.report.phases["step"].peak_bytes - meter.report.baseline_bytes


_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True, lr=torch.tensor(1e-3)),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps),
}


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_footprint_matches_a_metered_step(name: str) -> None:
    """What stepping a copy on fake tensors counts is what a real step allocates, to the step counters' bytes, and
    the state it makes is the real one's, to the byte."""
    model = _mlp()
    optimizer = _OPTIMIZERS[name](model.parameters())
    before = pytree.tree_leaves(copy.deepcopy((optimizer.state_dict(), model.state_dict())))
    predicted_state, predicted = footprint(optimizer).state, footprint(optimizer).scratch
    after = pytree.tree_leaves((optimizer.state_dict(), model.state_dict()))  # Adagrad has state already
    assert len(after) == len(before) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(after, before)), (
        "measuring touched the real optimizer or model")
    metered = _metered_step(model, optimizer)
    assert abs(predicted - metered) <= 1024, f"{name}: predicted {predicted}, metered {metered}"
    state = holder_bytes(list(optimizer.state.values()))  # before the first step: the stand-in's (RMSprop's 1x)
    assert predicted_state == state == footprint(optimizer).state, (name, predicted_state, state)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = {"adamw": 2 * largest, "adamw-foreach": total, "adamw-fused": 0, "sgd-momentum": 0}  # README's figures
    if name in expected:
        assert abs(predicted - expected[name]) <= 1024, f"{name}: {predicted} bytes, expected {expected[name]}"


def test_an_optimizer_that_cannot_step_alone_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    optimizer = torch.optim.LBFGS(_mlp().parameters())  # its step needs a closure
    with caplog.at_level(logging.WARNING, logger="zoomem"):
        assert footprint(optimizer).scratch == 0
    assert "could not step a stand-in of LBFGS" in caplog.text


def test_wrapped_optimizers_are_seen_through() -> None:
    class Wrapper(torch.optim.Optimizer):  # as Accelerate's AcceleratedOptimizer holds the real one
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), foreach=False)
    assert unwrapped(Wrapper(inner)) is inner
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert footprint(Wrapper(inner)) == footprint(inner)
    assert footprint(inner).state == 2 * params + 4 * len(list(model.parameters())) and footprint(inner).scratch > 0


def _wrapped_gpt2(**how: Any) -> tuple[nn.Module, Any, zoomem.Batch, torch.optim.Optimizer]:
    model, adapter, batch = zoo.small("hf/gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    zoomem.wrap(model, adapter=adapter, optimizer=optimizer, batch=batch, **how)
    return model, adapter, batch, optimizer


def _plan(model: nn.Module) -> zoomem.Plan:
    (plan,) = model._zoomem.plans.values()
    return plan


@pytest.mark.parametrize("skip_logits", [False, True], ids=["logits", "skip_logits"])
def test_a_plan_predicts_the_optimizers_step_where_it_is_the_peak(skip_logits: bool) -> None:
    """Small GPT-2 with AdamW at L2: compression takes the backward below the step of AdamW (the gradients, the
    logits the loop holds, two temporaries of the embedding's size), which is then the step's peak. The plan
    predicts it, where it predicted the backward before (38 MiB short). With ``skip_logits`` the loop holds no
    logits through the step, and the plan counts none (it counted them until it knew the fused loss drops them)."""
    model, adapter, batch, optimizer = _wrapped_gpt2(level="L2", skip_logits=skip_logits)
    plan = _plan(model)
    assert plan.optimizer_bytes > 0 and plan.predicted_peak_bytes == plan.fixed_bytes + plan.optimizer_bytes
    assert "the step's peak" in plan.summary()
    report = measure_step(model, batch, lambda out, b: adapter.loss(model, b, out), optimizer)
    phases = {k: v.peak_bytes for k, v in report.phases.items()}
    assert phases["optimizer"] == report.peak_bytes > max(phases["forward"], phases["backward"]), phases
    assert abs(report.peak_bytes - plan.predicted_peak_bytes) <= 0.01 * report.peak_bytes, (
        f"predicted {plan.predicted_peak_bytes}, measured {report.peak_bytes}")
    assert zoomem.Plan.from_json(plan.to_json()).optimizer_bytes == plan.optimizer_bytes
    zoomem.unwrap(model)


@pytest.mark.parametrize("skip_logits", [False, True], ids=["logits", "skip_logits"])
def test_a_budget_below_the_optimizers_step_is_refused_and_the_one_named_holds_the_whole_step(
        skip_logits: bool) -> None:
    """90% of plain PyTorch's step (80% with ``skip_logits``, whose step holds no logits) is below AdamW's step on
    small GPT-2, whatever the plan: the error says so and names the smallest budget, under which the metered step,
    the optimizer's included, stays, and which the plan measured in verification (with ``skip_logits``, the
    logits its step does not hold not counted there either)."""
    with pytest.raises(zoomem.InfeasibleBudgetError, match="its step needs") as err:
        _wrapped_gpt2(budget="80%" if skip_logits else "90%", skip_logits=skip_logits)
    model, adapter, batch, optimizer = _wrapped_gpt2(budget=err.value.min_budget, skip_logits=skip_logits)
    plan = _plan(model)
    assert err.value.min_budget >= plan.fixed_bytes + plan.optimizer_bytes
    assert plan.extras["measured_peak_bytes"] <= err.value.min_budget, plan.extras
    report = measure_step(model, batch, lambda out, b: adapter.loss(model, b, out), optimizer)
    assert report.peak_bytes <= err.value.min_budget, f"{report.peak_bytes} over {err.value.min_budget}"
    assert abs(report.peak_bytes - plan.predicted_peak_bytes) <= 0.01 * report.peak_bytes
    zoomem.unwrap(model)
    if skip_logits:
        return
    # where the step would fit without the optimizer's scratch, the error says which optimizers allocate none
    step, scratch = plan.fixed_bytes + plan.optimizer_bytes, footprint(optimizer).scratch
    with pytest.raises(zoomem.InfeasibleBudgetError, match="fused=True"):
        _wrapped_gpt2(budget=step - scratch // 2)
    with pytest.raises(zoomem.InfeasibleBudgetError) as below:
        _wrapped_gpt2(budget=step - 2 * scratch)
    assert "its step needs" in str(below.value) and "fused=True" not in str(below.value)


def test_later_micro_batches_of_gradient_accumulation_are_planned_with_the_gradients_held() -> None:
    """Under gradient accumulation every micro-batch after the first starts with the gradients present: small
    ResNet-18's step then measures 16 MiB more than the first micro-batch's plan predicts. Such a step gets a plan
    of its own, measured with the gradients present, that predicts it. Inside a meter (nothing can measure a new
    plan there), it runs the first micro-batch's plan until the later one is made."""
    model, adapter, batch = zoo.small("timm/resnet18")
    zoomem.wrap(model, adapter=adapter)

    def micro_batch(metered: bool = False) -> int:
        with zoomem.MemoryMeter(model, batch) if metered else contextlib.nullcontext() as meter:
            adapter.loss(model, batch, batch.call(model)).backward()
        return meter.report.peak_bytes if metered else 0

    micro_batch()  # plans the first micro-batch
    first_meter = micro_batch(metered=True)  # with the gradients held, inside a meter: the first plan runs
    assert len(model._zoomem.plans) == 1
    micro_batch()  # plans a later micro-batch
    plans = {held: plan for (_, _, held, *_), plan in model._zoomem.plans.items()}
    assert set(plans) == {False, True} and "gradients held" in plans[True].signature
    model.zero_grad(set_to_none=True)
    first = micro_batch(metered=True)
    later = micro_batch(metered=True)
    assert model._zoomem.last_sig[2]  # the later plan ran
    assert later == first_meter > first + 8 * 2**20, (first, later)
    assert abs(first - plans[False].predicted_peak_bytes) <= 0.01 * first, (first, plans[False].predicted_peak_bytes)
    assert abs(later - plans[True].predicted_peak_bytes) <= 0.01 * later, (later, plans[True].predicted_peak_bytes)
    zoomem.unwrap(model)


def test_a_later_micro_batchs_plan_is_verified_as_it_runs() -> None:
    """Under a budget, planning runs each plan once to check it: a later micro-batch's plan runs with the
    gradients present there, and that measurement is the whole micro-batch's (it was 16 MiB low on small
    ResNet-18, measured without them)."""
    model, adapter, batch = zoo.small("timm/resnet18", batch_size=16)  # activations above the gradients
    zoomem.wrap(model, "96%", adapter=adapter)
    for _ in range(2):  # the first micro-batch plans, the second plans with the gradients held
        adapter.loss(model, batch, batch.call(model)).backward()
    later_plan = {held: plan for (_, _, held, *_), plan in model._zoomem.plans.items()}[True]
    with zoomem.MemoryMeter(model, batch) as meter:
        adapter.loss(model, batch, batch.call(model)).backward()
    assert model._zoomem.last_sig[2]  # the metered step ran the later plan (it ran the first one, keeping all)
    checked = later_plan.extras["measured_peak_bytes"]
    assert abs(checked - meter.report.peak_bytes) <= 0.005 * meter.report.peak_bytes, (checked, meter.report.peak_bytes)
    assert meter.report.peak_bytes <= later_plan.budget_bytes
    zoomem.unwrap(model)
