"""What data-parallel ranks must agree on, and what DDP holds beside the model (its gradient buckets, which a
plan's budget counts).

Lossy plans keep bits per saved tensor that every rank must share: their sensitivities are averaged over ranks
and every rank takes rank 0's plan (:func:`all_reduce_mean`, :func:`from_rank0`), so those ranks plan together,
at the same steps, at steps where their inputs have one shape (:func:`same_everywhere`); at a step where they do
not, the rank with the largest inputs plans alone and sends its plan to the others (:func:`gather`,
:func:`from_rank`). Lossless plans need none of this: each rank plans for its own inputs, when it meets them,
with no collective. Every collective here is a no-op without an initialised process group of more than one
rank, or inside :func:`alone`.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import sys
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

__all__ = ["world_size", "all_reduce_mean", "rank_mean", "from_rank0", "from_rank", "alone", "gather", "same_everywhere",
           "bucket_bytes", "ddp_of", "holding"]

T = TypeVar("T")


_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("zoomem_alone", default=False)


def world_size() -> int:
    """Ranks of the default process group (1 when there is none, and inside :func:`alone`)."""
    import torch.distributed as dist

    if _ALONE.get():
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside, this rank works as if it were the only one: zoomem's collectives are no-ops (:func:`from_rank`)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


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


def rank_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of ``t`` (every rank passes its own of one shape), a new tensor on the collectives'
    device; ``t`` itself in one process."""
    import torch.distributed as dist

    if world_size() == 1:
        return t
    out = t.detach().to(_device(), copy=True)
    dist.all_reduce(out)
    return out.div_(dist.get_world_size())


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


def from_rank(src: int, make: Callable[[], T], encode: Callable[[T], str], decode: Callable[[str, None], T]) -> T:
    """Run ``make`` on rank ``src`` alone (:func:`alone`: its collectives off) and return its result on every rank
    (``encode``d there, ``decode(text, None)`` elsewhere); where it fails, every rank raises its error. The other
    ranks wait in the broadcast meanwhile."""
    import torch.distributed as dist

    if world_size() == 1:
        return make()
    local: T | None = None
    error: BaseException | None = None
    payload: list[object] = [None]
    if dist.get_rank() == src:
        try:
            with alone():
                local = make()
            payload = [("ok", encode(local))]
        except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
            error = exc
            payload = [("error", _picklable(exc, src))]
    dist.broadcast_object_list(payload, src=src, device=_device())
    kind, value = payload[0]  # type: ignore[misc]
    if kind == "error":
        raise error if error is not None else value  # type: ignore[misc]
    return local if local is not None else decode(value, None)  # type: ignore[arg-type]


def gather(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), by rank, over the group of :func:`same_everywhere`."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_cpu_group())
    return out


_SIDE: list[Any] = []
"""The gloo group :func:`same_everywhere` reduces over where the default group is not gloo (made once, lazily)."""


def _cpu_group() -> Any:
    """A group whose collectives take CPU tensors: the default one under gloo, else a gloo group of every rank
    (a per-step check over NCCL would wait for the device)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if not _SIDE or _SIDE[0][0] is not dist.group.WORLD:
        _SIDE[:] = [(dist.group.WORLD, dist.new_group(backend="gloo"))]
    return _SIDE[0][1]


def same_everywhere(key: str) -> bool:
    """Whether every rank passes the same ``key`` (one all-reduce of two integers: a 56-bit hash and its negation,
    by maximum). Every rank must call it at the same point."""
    import torch.distributed as dist

    if world_size() == 1:
        return True
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
    vec = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=_cpu_group())
    return int(vec[0]) == -int(vec[1])


def _picklable(error: BaseException, rank: int = 0) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"zoomem planning failed on rank {rank}: {type(error).__name__}: {error}")


# -- DDP's gradient buckets ----------------------------------------------------------------------------------------

_NAMED: contextvars.ContextVar[Any] = contextvars.ContextVar("zoomem_ddp", default=None)

_FRAMES = 64
"""Frames :func:`ddp_of` looks up for a DDP forward calling the model (DDP's own calls sit about 6 deep)."""


def bucket_bytes(ddp: nn.Module | None) -> int:
    """Bytes of ``ddp``'s gradient buckets: a flat copy of every dense gradient it reduces (the parameters that
    need a gradient, less those it was told to ignore and sparse embeddings'), which ``DistributedDataParallel``
    allocates when it is built and holds for good, beside the gradients themselves unless
    ``gradient_as_bucket_view=True`` (then the gradients are views into them). 0 for anything but a DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        return 0
    ignore = set(getattr(ddp, "parameters_to_ignore", ()))
    seen: set[int] = set()
    total = 0
    for prefix, module in ddp.module.named_modules():
        sparse = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse  # no dense bucket
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{prefix}.{name}" not in ignore and id(p) not in seen:  # (DDP's own naming)
                seen.add(id(p))
                total += 0 if sparse else p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def holding(container: nn.Module) -> Iterator[None]:
    """Inside, :func:`ddp_of` knows ``container`` (an integration that plans before any DDP forward runs)."""
    token = _NAMED.set(container)
    try:
        yield
    finally:
        _NAMED.reset(token)


def ddp_of(model: nn.Module) -> nn.Module | None:
    """The ``DistributedDataParallel`` that holds ``model``: the one :func:`holding` names, else the one whose
    forward is calling ``model`` now (zoomem plans inside the first training forward, which DDP makes), else
    None (a model planned outside DDP's forward, ``wrap(batch=...)`` before DDP is built, has no buckets yet)."""
    from torch.nn.parallel import DistributedDataParallel

    named = _NAMED.get()
    for _ in range(8):  # through the containers around it (torch.compile's, DataParallel's)
        if named is None or named is model:
            break
        if isinstance(named, DistributedDataParallel) and named.module is model:
            return named
        inner = getattr(named, "_orig_mod", None)
        named = inner if inner is not None else getattr(named, "module", None)
    codes = {DistributedDataParallel.forward.__code__, DistributedDataParallel._run_ddp_forward.__code__}
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            break
        if frame.f_code in codes:
            me = frame.f_locals.get("self")
            if isinstance(me, DistributedDataParallel) and me.module is model:
                return me
        frame = frame.f_back
    return None
