"""The tracer on the zoo matrix: truthful saved bytes, untouched model state, and clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoomem
from zoomem import zoo
from zoomem.adapters.base import Adapter, Unit
from zoomem.graph import OUTSIDE, OpGraph, TraceError


def _step(model: nn.Module, adapter: Adapter, batch: zoomem.Batch, meter: zoomem.MemoryMeter | None = None):
    out = batch.call(model)
    loss = adapter.loss(model, batch, out)
    if meter is not None:
        meter.mark("forward")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("model_id", zoo.ZOO_MATRIX)
def test_trace_matches_meter_and_leaves_state(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    reference = copy.deepcopy(model)
    for p in model.parameters():  # a gradient the user already had must survive tracing
        p.grad = torch.full_like(p, 0.5)
    rng = torch.get_rng_state()

    graph = zoomem.trace(model, batch, adapter=adapter)

    assert torch.equal(torch.get_rng_state(), rng), "tracing changed the RNG state"
    for (n, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), f"tracing changed {n}"
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    for p in model.parameters():
        p.grad = None

    assert len([u for u in graph.units if u.name != OUTSIDE]) >= 2
    assert graph.saved_bytes > 0 and graph.held_bytes >= graph.saved_bytes
    assert sum(u.saved_bytes for u in graph.units) == graph.saved_bytes
    assert any(op.phase == "backward" for op in graph.ops) and graph.flops > 0

    torch.manual_seed(1)
    with zoomem.MemoryMeter(model, batch) as meter:
        loss, grads = _step(model, adapter, batch, meter)
    torch.manual_seed(1)
    ref_loss, ref_grads = _step(reference, adapter, batch)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)

    held = meter.report.activation_bytes
    assert held is not None
    assert abs(graph.held_bytes - held) <= 0.01 * held, (
        f"{model_id}: traced {graph.held_bytes} B held at end of forward, meter saw {held} B"
    )


def test_json_round_trip_and_summary() -> None:
    model, adapter, batch = zoo.small("timm/resnet18")
    graph = zoomem.trace(model, batch, adapter=adapter)
    graph.forward_excess = {1: 4096, 2: 0}  # as planning fills it in: integer segments, not JSON's string keys
    again = OpGraph.from_json(graph.to_json())
    assert again == graph
    text = graph.summary()
    assert "layer1.0" in text and "saved MiB" in text and "x2" in text  # repeated blocks are grouped


class _Seq(Adapter):
    name = "test-seq"

    def units(self, model: nn.Module) -> list[Unit]:
        return [Unit(str(i), m) for i, m in enumerate(model)]


def test_double_saves_and_views_count_once() -> None:
    # one activation saved by two consumers, and a view of it saved by a third
    class Twice(nn.Module):
        def forward(self, x):
            h = torch.sigmoid(x)  # saves its output h
            return (h * x).sum() + (h * 2).exp().sum() + h.view(-1).sin().sum()

    x = torch.randn(256, 256, requires_grad=True)
    graph = zoomem.trace(nn.Sequential(Twice(), nn.Identity()), (x,), adapter=_Seq(), loss_fn=lambda out, b: out)
    h_storage = next(op for op in graph.forward_ops if "sigmoid" in op.name).outputs[0]
    sid = graph.tensors[h_storage].storage
    assert sid in graph.saved_storages
    savers = [op for op in graph.forward_ops if any(graph.tensors[t].storage == sid for t in op.saved)]
    assert len(savers) >= 3  # sigmoid, mul, sin (through a view)
    assert graph.saved_bytes == sum(graph.storages[s] for s in set(graph.saved_storages))


def test_saved_tensors_attributed_to_their_op() -> None:
    lin = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    graph = zoomem.trace(lin, (x,), adapter=_Seq(), loss_fn=lambda out, b: out.square().mean())
    by_name = {op.name: op for op in graph.forward_ops}
    relu = by_name["aten.relu.default"]
    assert [graph.tensors[t].shape for t in relu.saved] == [[8, 32]]
    second = [op for op in graph.forward_ops if op.name == "aten.addmm.default"][1]
    assert [8, 32] in [graph.tensors[t].shape for t in second.saved]  # the addmm that consumes relu's output
    assert relu.unit == "1" and second.unit == "2" and relu.module == "1"


def test_unknown_op_is_generic_not_an_error() -> None:
    lib = torch.library.Library("zoomem_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")

    class UsesCustom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.ops.zoomem_test.twice(self.lin(x).detach()) + self.lin(x)

    graph = zoomem.trace(nn.Sequential(UsesCustom(), nn.Linear(4, 2)), (torch.randn(3, 4),), adapter=_Seq(),
                         loss_fn=lambda out, b: out.sum())
    custom = [op for op in graph.ops if op.name.startswith("zoomem_test.twice")]
    assert custom and custom[0].kind == "generic"


def test_failure_names_module_and_op() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(TraceError) as err:
        zoomem.trace(model, (torch.randn(2, 8),), adapter=_Seq())
    msg = str(err.value)
    assert "'2'" in msg and "Linear" in msg and "aten." in msg and "Try:" in msg
    # the model is intact after a failed trace
    assert all(p.grad is None for p in model.parameters())


def test_failure_keeps_training_mode_and_buffers() -> None:
    model = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.eval()
    before = copy.deepcopy(model.state_dict())
    zoomem.trace(model, (torch.randn(4, 8),), adapter=_Seq(), loss_fn=lambda out, b: out.sum())
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_forward_excess_is_a_units_scratch_without_autograd() -> None:
    """What a chain's recipe adds when it runs a unit again without autograd: its forward's rise above what it
    leaves behind (its output). Linear -> ReLU -> Dropout -> Linear holds three hidden-sized tensors at most (ReLU's
    output, dropout's float mask and its output) and leaves the output: 3 hidden - out, in bytes, where the traced
    rise holds every intermediate to the end. BatchNorm's statistics and the RNG are as they were."""
    from zoomem.graph.timeline import measure_forward_rises

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, 8)), nn.BatchNorm1d(8)]
    model = nn.Sequential(*blocks)
    batch = zoomem.Batch.of(torch.randn(32, 8))
    units = [Unit(name=str(i), module=m) for i, m in enumerate(blocks)]
    state, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()

    excess, rise = measure_forward_rises(model, batch, units)

    hidden, out = 32 * 256 * 4, 32 * 8 * 4
    assert excess[1] == 3 * hidden - out and rise[1] == 3 * hidden
    assert set(excess) == set(rise) == {1, 2}
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), "running statistics changed"


def test_rises_are_not_measured_inside_an_open_meter() -> None:
    """Planning inside a user's :class:`MemoryMeter` (``measure_step`` around a first step) cannot open a second
    meter: both measurements give nothing (the cost model keeps the traced rises, which bound them) and run nothing."""
    from zoomem.graph.timeline import measure_forward_rises
    from zoomem.planner import Decision
    from zoomem.runtime.units import measure_recompute_rises

    model, adapter, batch = zoo.small("timm/resnet18", batch_size=2)
    units = adapter.units(model)
    state = copy.deepcopy(model.state_dict())
    with zoomem.MemoryMeter(model, batch):
        assert measure_forward_rises(model, batch, units) == ({}, {})
        assert measure_recompute_rises(model, batch, lambda out, b: adapter.loss(model, b, out), units,
                                       {units[0].name: Decision.RECOMPUTE_CHEAP}) == {}
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_unit_called_more_than_once_per_forward_is_counted_and_named_once(caplog) -> None:
    """A layer shared across depth (ALBERT's, a weight-tied GNN's) runs several times in one forward, all its calls
    one segment of the graph: the trace counts the calls, and marks a unit whose calls have another unit between
    them (planning splits the others call by call, :mod:`zoomem.runtime.calls`), saying once per model what that
    does to its plans."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 16)])
            self.out = nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for _ in range(3):
                x = self.layers[0](x)
            return self.out(self.layers[1](x))

    class Interleaved(Tied):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.layers[0](self.layers[1](self.layers[0](self.inp(x)))))

    x = torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="zoomem"):
        graph = zoomem.trace(Tied(), (x,), loss_fn=lambda out, b: out.sum(), memory=False)
        model = Interleaved()
        other = zoomem.trace(model, (x,), loss_fn=lambda out, b: out.sum(), memory=False)
        zoomem.trace(model, (x,), loss_fn=lambda out, b: out.sum(), memory=False)
    assert {u.name: (u.calls, u.interleaved) for u in graph.units if u.name != OUTSIDE} == {
        "layers.0": (3, False), "layers.1": (1, False)}
    assert {u.name: (u.calls, u.interleaved) for u in other.units if u.name != OUTSIDE} == {
        "layers.0": (2, True), "layers.1": (1, False)}
    said = [r.message for r in caplog.records if "in one forward with other units between its calls" in r.message]
    assert len(said) == 1 and "'layers.0'" in said[0] and "ran 2 times" in said[0]
