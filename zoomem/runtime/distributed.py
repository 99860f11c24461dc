"""What data-parallel ranks must agree on: sensitivities (averaged) and plans (rank 0's, for every rank).

Each rank traces and measures its own step, so measured times, verified peaks and sensitivities differ a little
by rank; a plan made from them could then differ too (other bits, other recomputed units), and one rank could
even find the budget infeasible while the others train on. Every collective here is a no-op without an
initialised process group of more than one rank.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

__all__ = ["world_size", "all_reduce_mean", "from_rank0"]

T = TypeVar("T")


def world_size() -> int:
    """Ranks of the default process group (1 when there is none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """The mean over ranks of each value (every rank must pass the same keys)."""
    import torch.distributed as dist

    if world_size() == 1 or not values:
        return values
    keys = sorted(values)
    vec = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(vec)
    vec /= dist.get_world_size()
    return dict(zip(keys, vec.tolist()))


def from_rank0(make: Callable[[], T], encode: Callable[[T], str], decode: Callable[[str, T | None], T]) -> T:
    """Run ``make`` on every rank and return rank 0's result everywhere.

    Every rank runs ``make`` (each needs its own trace and cost model to re-plan later), then rank 0's result
    (``encode``d) or its error is broadcast; ``decode(text, local_result_or_None)`` turns it back into the
    rank's own object. If rank 0 failed, every rank raises its error; if only another rank failed, it adopts
    rank 0's result, so no rank is left waiting in a collective.
    """
    import torch.distributed as dist

    if world_size() == 1:
        return make()
    local: T | None = None
    error: BaseException | None = None
    try:
        local = make()
    except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank, if rank 0 had it)
        error = exc
    payload: list[object] = [None]
    if dist.get_rank() == 0:
        payload = [("ok", encode(local)) if error is None else ("error", _picklable(error))]  # type: ignore[arg-type]
    dist.broadcast_object_list(payload, src=0, device=_device())
    kind, value = payload[0]  # type: ignore[misc]
    if kind == "error":
        raise error if error is not None else value  # type: ignore[misc]
    return decode(value, local)  # type: ignore[arg-type]


def _picklable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"zoomem planning failed on rank 0: {type(error).__name__}: {error}")
