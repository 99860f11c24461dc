"""Telling zoomem's own checkpoints from a model's own ``torch.utils.checkpoint`` regions.

A model may checkpoint parts of itself (a hand-rolled ``checkpoint(block, x)``, inside a block or around it). Its
recomputation runs in backward, where no plan of zoomem's is in force, so whatever zoomem changes in that region
(a compact form, a recomputed unit) would run in the forward but not in the recomputation, and torch refuses the
mismatch ("Recomputed values for the following tensors have different metadata"). Inside such a region the model
runs as it is: its checkpoint already drops what the region saves, so zoomem's forms would save nothing there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["in_models_checkpoint", "own_checkpoint"]

_OWN: set[int] = set()
"""The pack hooks of zoomem's checkpoints running now (forward or recomputation). Not thread-local: on CUDA the
recomputation runs on autograd's device thread."""


def _top_pack() -> object | None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top[0] if top else None


@contextlib.contextmanager
def own_checkpoint() -> Iterator[None]:
    """Entered by the function zoomem checkpoints, as it runs in forward and again in recomputation: the innermost
    saved-tensor hooks, the checkpoint's, are zoomem's for as long."""
    pack = _top_pack()
    key = id(pack) if pack is not None else None
    fresh = key is not None and key not in _OWN
    if fresh:
        _OWN.add(key)  # type: ignore[arg-type]
    try:
        yield
    finally:
        if fresh:
            _OWN.discard(key)  # type: ignore[arg-type]


def in_models_checkpoint() -> bool:
    """Whether the code running now is inside a ``torch.utils.checkpoint`` region of the model's own (its forward
    or its recomputation): the innermost saved-tensor hooks are a checkpoint's that zoomem did not start."""
    pack = _top_pack()
    return (pack is not None and getattr(pack, "__module__", None) == "torch.utils.checkpoint"
            and id(pack) not in _OWN)
