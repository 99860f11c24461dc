"""What an optimizer adds to a training step's memory: its state between steps, and what ``step()`` allocates
while it runs.

Once a plan takes the backward's peak low, the step's peak can be the optimizer's: the gradients, the output the
loop still holds, and the step's own scratch (AdamW's for-loop form allocates a square root and a quotient the
size of the largest parameter, its foreach form one tensor per parameter group, the fused form none). Planning
counts both, so that a budget bounds the whole training step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .measure import holder_bytes

__all__ = ["Footprint", "footprint", "unwrapped"]

logger = logging.getLogger(__name__)


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that steps: Accelerate's ``AcceleratedOptimizer`` and similar wrappers hold it as ``.optimizer``."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@dataclass(frozen=True)
class Footprint:
    """What an optimizer adds to a training step's memory."""

    state: int
    """Bytes it holds across steps."""
    scratch: int
    """Bytes its ``step()`` allocates above the parameters, gradients and state while it runs, and frees."""


def footprint(optimizer: torch.optim.Optimizer | None) -> Footprint:
    """The optimizer's :class:`Footprint`. The state is measured where it has some, else it is what a stand-in's
    first step makes (:func:`_stand_in`: Adam's 2x the parameters, RMSprop's 1x), else Adam's 2x or SGD momentum's
    1x; the scratch is the stand-in's second step's (0 where a stand-in cannot step)."""
    if optimizer is None:
        return Footprint(0, 0)
    optimizer = unwrapped(optimizer)
    measured = _stand_in(optimizer)
    state, scratch = measured if measured is not None else (_state_by_type(optimizer), 0)
    if optimizer.state:
        state = holder_bytes(list(optimizer.state.values()))
    return Footprint(state, scratch)


def _state_by_type(optimizer: torch.optim.Optimizer) -> int:
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    pbytes = sum(p.numel() * p.element_size() for p in params)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * pbytes
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return pbytes
    return 0


def _stand_in(optimizer: torch.optim.Optimizer) -> tuple[int, int] | None:
    """(state bytes, step bytes) of a copy of ``optimizer`` stepping on stand-ins of its parameters and gradients.

    Measured, not looked up: the copy (the optimizer's type, every group's hyperparameters, ``foreach`` and
    ``fused`` included) steps twice under ``FakeTensorMode``, so no byte is allocated and the real optimizer is not
    touched. The state is what the first step made; PyTorch's ``MemTracker`` counts the second, whose peak above
    its start is the step's scratch. An optimizer that cannot step so (one that needs a closure, or runs its own
    kernels) is logged, and ``None`` returned.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker

        with FakeTensorMode(allow_non_fake_inputs=True):  # tensor hyperparameters (a tensor lr) stay real
            groups, params = [], []
            for group in optimizer.param_groups:
                fakes = [torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device,
                                             requires_grad=p.requires_grad) for p in group["params"]]
                for fake in fakes:
                    if fake.requires_grad:
                        fake.grad = torch.empty_like(fake)
                params += fakes
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fakes})
            copy = type(optimizer)(groups)
            copy.step()
            devices = {p.device for p in params}
            state = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(dict(copy.state))
                        if isinstance(t, torch.Tensor) and t.device in devices)
            tracker = MemTracker()
            tracker.track_external(*params, copy)
            with tracker:
                before = sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())
                copy.step()
            peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        return state, max(0, int(peak - before))
    except Exception as exc:  # noqa: BLE001 - any optimizer may be passed; the plan stands without its scratch
        logger.warning("zoomem: could not step a stand-in of %s to measure its state and what its step allocates "
                       "(%s: %s); plans leave the step's scratch out of their peak", type(optimizer).__name__,
                       type(exc).__name__, exc)
        return None
