"""What an optimizer adds to a training step's memory: its state between steps, and what ``step()`` allocates
while it runs.

Once a plan takes the backward's peak low, the step's peak can be the optimizer's: the gradients, the output the
loop still holds, and the step's own scratch (AdamW's for-loop form allocates a square root and a quotient the
size of the largest parameter, its foreach form one tensor per parameter group, the fused form none). Planning
counts both, so that a budget bounds the whole training step.
"""

from __future__ import annotations

import logging

import torch

from .measure import holder_bytes

__all__ = ["state_bytes", "step_bytes", "unwrapped"]

logger = logging.getLogger(__name__)


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that steps: Accelerate's ``AcceleratedOptimizer`` and similar wrappers hold it as ``.optimizer``."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the optimizer holds across steps (measured when it has state, else Adam's 2x / SGD momentum's 1x)."""
    if optimizer is None:
        return 0
    optimizer = unwrapped(optimizer)
    if optimizer.state:
        return holder_bytes(list(optimizer.state.values()))
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    pbytes = sum(p.numel() * p.element_size() for p in params)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * pbytes
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return pbytes
    return 0


def step_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes ``optimizer.step()`` allocates above the parameters, gradients and state while it runs, and frees.

    Measured, not looked up: a copy of the optimizer (its type, every group's hyperparameters, ``foreach`` and
    ``fused`` included) steps twice over stand-ins of the parameters and gradients under ``FakeTensorMode``, so
    no byte is allocated and the real optimizer is not touched; PyTorch's ``MemTracker`` counts the second step
    (the first made the state). An optimizer that cannot step so (one that needs a closure, or runs its own
    kernels) is logged and counted as 0, as before zoomem measured it.
    """
    if optimizer is None:
        return 0
    optimizer = unwrapped(optimizer)
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
            tracker = MemTracker()
            tracker.track_external(*params, copy)
            with tracker:
                before = sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())
                copy.step()
            peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        return max(0, int(peak - before))
    except Exception as exc:  # noqa: BLE001 - any optimizer may be passed; the plan stands without its scratch
        logger.warning("zoomem: could not step a stand-in of %s to measure what its step allocates (%s: %s); plans "
                       "leave that out of their peak", type(optimizer).__name__, type(exc).__name__, exc)
        return 0
