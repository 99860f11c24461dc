"""Per-call units: a layer that one forward calls several times is planned, run and undone call by call."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

import zoomem
from zoomem import Batch
from zoomem.planner import Decision, InfeasibleBudgetError
from zoomem.runtime.calls import splits_of
from zoomem.runtime.patch import is_ours

from test_wrap import _assert_grads_close


def _smallest(model: nn.Module, batch: Any, **kw: Any) -> int:
    """The smallest budget zoomem.wrap accepts for ``model`` on ``batch`` (what its error names)."""
    with pytest.raises(InfeasibleBudgetError) as err:
        zoomem.wrap(model, 0.01, batch=batch, **kw)
    assert not zoomem.is_wrapped(model)
    return err.value.min_budget


def _step(model: nn.Module, batch: Batch, loss_fn: Any = None, seed: int = 0) -> tuple[dict, int]:
    """One training step (dropout from ``seed``): the gradients and the metered peak."""
    torch.manual_seed(seed)
    with zoomem.MemoryMeter(model, batch) as meter:
        out = batch.call(model)
        (out.loss if loss_fn is None else loss_fn(out, batch)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, meter.report.peak_bytes


def _untouched(model: nn.Module) -> bool:
    """Nothing of zoomem's left on ``model``: no instance forward, no split, no hook of zoomem's."""
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return (all("forward" not in m.__dict__ for m in model.modules()) and not splits_of(model)
            and not any(is_ours(h) for h in hooks))


def _albert() -> tuple[nn.Module, Batch]:
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=100, embedding_size=32, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
                       intermediate_size=256, max_position_embeddings=128, hidden_dropout_prob=0.1,
                       attention_probs_dropout_prob=0.1)  # dropout on: each call's recomputation replays its masks
    torch.manual_seed(0)
    model = AlbertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(0)
    batch = Batch.of(dict(input_ids=torch.randint(0, 100, (4, 128), generator=g),
                          labels=torch.randint(0, 2, (4,), generator=g)), model)
    return model, batch


def test_albert_plans_each_call_of_its_shared_layer_with_plain_gradients() -> None:
    """ALBERT runs one ``AlbertLayer`` for all its layers and has no ``GradientCheckpointingLayer`` (HF's
    ``gradient_checkpointing_enable()`` raises for it). zoomem plans each call of the layer as a unit: the plans
    recompute calls, the smallest budget is a fraction of the one with the backbone as one unit (58% of plain
    PyTorch's peak in BENCHMARKS.md "Stop 57"; 13% now at 12 layers), and every budget trains with plain PyTorch's
    gradients (bitwise where no compact form runs), dropout included. ``zoomem.plan`` and ``zoomem.unwrap`` leave the model as it was."""
    model, batch = _albert()
    keys = list(model.state_dict())
    layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    want, plain = _step(copy.deepcopy(model), batch)

    plan = zoomem.plan(model, batch, 0.6)
    assert [u.name for u in plan.units] == [f"{layer}#{i}" for i in range(6)]
    assert _untouched(model)

    smallest = _smallest(model, batch)
    assert smallest < 0.45 * plan.baseline_peak_bytes
    for budget in (0.6, smallest):
        zoomem.wrap(model, budget, batch=batch)
        _step(model, batch, seed=1)  # (the plan is made on a step of its own)
        grads, peak = _step(model, batch)
        handle_plan = next(iter(model._zoomem.plans.values()))
        assert peak <= handle_plan.budget_bytes
        assert budget != smallest or sum(u.decision != Decision.KEEP for u in handle_plan.units) >= 3
        assert grads.keys() == want.keys()
        if not handle_plan.outside_compact and not any(u.compact for u in handle_plan.units):
            assert all(torch.equal(grads[k], want[k]) for k in want)  # no compact form runs: bitwise
        else:  # (the compact forms round otherwise)
            _assert_grads_close(grads, want, f"ALBERT at a budget of {budget}")
        assert list(model.state_dict()) == keys
        zoomem.unwrap(model)
        assert _untouched(model)


class _TiedGCN(nn.Module):
    """One ``GCNConv`` run ``depth`` times (weights tied across depth), or ``depth`` convs of their own."""

    def __init__(self, depth: int = 4, width: int = 32, tied: bool = True) -> None:
        from torch_geometric.nn import GCNConv

        super().__init__()
        self.inp = nn.Linear(8, width)
        self.convs = nn.ModuleList([GCNConv(width, width) for _ in range(1 if tied else depth)])
        self.depth = depth
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(self.depth):
            x = torch.relu(self.convs[i % len(self.convs)](x, edge_index))
        return self.out(x)


def test_a_weight_tied_gnn_plans_each_call_with_its_compact_forms() -> None:
    """A conv called at every depth keeps its compact forms (the CSR adjacency) call by call: its smallest budget
    is about the untied model's (51% against 37% of plain PyTorch's peak when all calls were one unit), and its
    gradients are plain PyTorch's."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, edges = torch.randn(4000, 8, generator=g), torch.randint(0, 4000, (2, 40000), generator=g)
    batch = Batch(args=(x, edges), target=torch.randint(0, 4, (4000,), generator=g))

    def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
        return F.cross_entropy(out, b.target)

    smallest = {}
    for tied in (False, True):
        torch.manual_seed(0)
        smallest[tied] = _smallest(_TiedGCN(tied=tied), batch, loss_fn=loss_fn)
    assert smallest[True] <= 1.05 * smallest[False]

    torch.manual_seed(0)
    model = _TiedGCN()
    want, _ = _step(copy.deepcopy(model), batch, loss_fn)
    zoomem.wrap(model, smallest[True], batch=batch, loss_fn=loss_fn)
    plan = next(iter(model._zoomem.plans.values()))
    assert [u.name for u in plan.units] == [f"convs.0#{i}" for i in range(4)] and any(u.compact for u in plan.units)
    grads, peak = _step(model, batch, loss_fn)
    assert peak <= smallest[True]
    _assert_grads_close(grads, want, "a weight-tied GCN at its smallest budget")
    zoomem.unwrap(model)
    assert _untouched(model)


class _Recurrent(nn.Module):
    """A GRU cell run once per time step, with dropout on its inputs (the generic adapter's units)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 64)
        self.cell = nn.GRUCell(64, 64)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 64)
        e = self.emb(x)
        for t in range(x.shape[1]):
            h = self.cell(self.drop(e[:, t]), h)
        return self.out(h)


def test_a_loop_over_time_steps_plans_each_step_and_grows_with_longer_inputs(caplog) -> None:
    """A cell called once per time step is split into as many units as the longest input has steps: a longer
    sequence later adds units, the shorter one runs its own plan, and each step's gradients are plain PyTorch's
    (bitwise: dropout masks replayed per call), and eval forwards give its outputs. The split's hooks on the model
    are not taken for the user's."""
    def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
        return out.square().mean()

    torch.manual_seed(0)
    model = _Recurrent()
    reference = copy.deepcopy(model)
    zoomem.wrap(model, 0.75, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(0)
    for steps in (6, 10, 6):
        batch = Batch(args=(torch.randn(128, steps, 16, generator=g),))
        want, _ = _step(reference, batch, loss_fn)
        with caplog.at_level(logging.INFO, logger="zoomem"):
            torch.manual_seed(1)
            loss_fn(batch.call(model), batch).backward()  # plans (once per length)
            model.zero_grad(set_to_none=True)
        grads, _ = _step(model, batch, loss_fn)
        assert all(torch.equal(grads[k], want[k]) for k in want), steps
        plan = next(p for p in model._zoomem.plans.values() if f"(128, {steps}, 16)" in p.signature)
        assert [u.name for u in plan.units][1:-1] == [f"cell#{i}" for i in range(steps)]
        assert any(u.decision != Decision.KEEP for u in plan.units)
    assert len(splits_of(model)["cell"].calls) == 10
    split_said = [r.message for r in caplog.records if "each call is planned as a unit of its own" in r.message]
    assert len(split_said) == 2  # split at 6 steps, grown at 10
    assert not any("module hooks on" in r.message for r in caplog.records)  # (the split's own hook is none)
    model.eval(), reference.eval()  # eval and no_grad forwards through the split: plain PyTorch's outputs
    with torch.no_grad():
        assert torch.equal(batch.call(model), batch.call(reference))
    model.train(), reference.train()
    copied = copy.deepcopy(model)  # (an EMA copy): a plain model of its own, gradients in its own parameters
    assert all("forward" not in m.__dict__ for m in copied.modules())
    loss_fn(copied(batch.args[0]), batch).backward()
    assert all(p.grad is not None for p in copied.parameters()) and all(p.grad is None for p in model.parameters())
    zoomem.unwrap(model)
    assert _untouched(model)


def test_a_unit_called_with_other_units_between_its_calls_stays_one_unit_and_says_so(caplog) -> None:
    """A block run on two views with another unit between its calls cannot be split in call order: it stays one
    unit, a warning says why once, and its gradients are plain PyTorch's."""
    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, width), nn.Linear(width, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.gelu(self.up(x)))

    class TwoViews(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.mix = Block(128), Block(32)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.backbone(self.mix(self.backbone(a)) + b)

    torch.manual_seed(0)
    model = TwoViews()
    batch = Batch(args=(torch.randn(512, 32), torch.randn(512, 32)))

    def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
        return out.square().mean()

    want, _ = _step(copy.deepcopy(model), batch, loss_fn)
    with caplog.at_level(logging.WARNING, logger="zoomem"):
        zoomem.wrap(model, 1.0, loss_fn=loss_fn, batch=batch)
    plan = next(iter(model._zoomem.plans.values()))
    assert [u.name for u in plan.units] == ["backbone", "mix"] and not splits_of(model)
    said = [r.message for r in caplog.records if "other units between its calls" in r.message]
    assert len(said) == 1 and "'backbone'" in said[0]
    grads, _ = _step(model, batch, loss_fn)
    assert all(torch.equal(grads[k], want[k]) for k in want)
    zoomem.unwrap(model)


def test_a_plan_made_on_another_rank_splits_the_shared_layers_it_names() -> None:
    """Under DDP a rank may run a plan that another rank made (inputs whose shapes differ by rank, under lossy
    plans), without tracing: it splits its shared layers as that plan names their calls, so the plan's decisions
    reach them (they ran kept, and its forms off, where the names matched no unit)."""
    def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
        return out.square().mean()

    torch.manual_seed(0)
    model = _Recurrent()
    batch = Batch(args=(torch.randn(128, 6, 16),))
    plan = zoomem.plan(copy.deepcopy(model), batch, 0.75, loss_fn=loss_fn)
    zoomem.wrap(model, 0.75, loss_fn=loss_fn)
    model._zoomem._split_as(plan)
    assert [u.name for u in model._zoomem.units] == [u.name for u in plan.units]
    assert len(splits_of(model)["cell"].calls) == 6
    zoomem.unwrap(model)
    assert _untouched(model)


def test_a_shared_layers_calls_recompute_whole_under_autocast() -> None:
    """Under autocast a shared layer's calls after its first find their weights cast already (autocast's cache),
    and backward adds their gradients in bfloat16, as plain PyTorch does. Selective recomputation would cast them
    again in backward, where the cache is empty (torch raised "aten._to_copy.default invocation index ... not found
    in storage": ALBERT under Accelerate's bf16), so such a call runs ``RECOMPUTE_CHEAP`` as ``RECOMPUTE``, and plans
    made under autocast offer it none; gradients are plain PyTorch's, bitwise."""
    from zoomem import Unit
    from zoomem.runtime.calls import split_calls, unsplit
    from zoomem.runtime.units import run_unit

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    holder = nn.Sequential(layer)
    split = split_calls(holder, Unit("0", layer), 3)
    x = torch.randn(16, 32)

    def grads(cheap: bool) -> dict:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for call in split.calls:
                h = run_unit(call, call.forward, Decision.RECOMPUTE_CHEAP, (h,), {}) if cheap else call(h)
        h.float().square().mean().backward()
        out = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return out

    want, got = grads(False), grads(True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    unsplit(holder)
    assert _untouched(holder)

    model, batch = _albert()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _step(copy.deepcopy(model), batch)[0]
        zoomem.wrap(model, 0.3, batch=batch)
        plan = next(iter(model._zoomem.plans.values()))
        assert all(u.decision != Decision.RECOMPUTE_CHEAP for u in plan.units)
        assert any(u.decision != Decision.KEEP for u in plan.units)
        got = _step(model, batch)[0]
    assert all(torch.equal(got[k], want[k]) for k in want)
    zoomem.unwrap(model)


def test_a_split_model_copies_without_its_split_and_is_freed_when_dropped() -> None:
    """The split lives on the model (a global table would have held a model dropped while wrapped alive, through
    the forwards its split holds): ``copy.deepcopy`` leaves it out, and a wrapped model dropped without
    ``unwrap`` is freed."""
    import gc
    import weakref

    def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
        return out.square().mean()

    torch.manual_seed(0)
    model = _Recurrent()
    batch = Batch(args=(torch.randn(128, 6, 16),))
    zoomem.wrap(model, 0.75, loss_fn=loss_fn, batch=batch)
    assert len(splits_of(model)["cell"].calls) == 6
    copied = copy.deepcopy(model)
    assert not splits_of(copied) and _untouched(copied)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
