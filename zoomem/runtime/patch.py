"""Instance-level forward replacement, the one way zoomem changes a module (never its class)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from torch import nn

__all__ = ["set_forward"]


def set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Make ``forward`` the instance's forward; return the undo, which restores what was there before."""
    had_own = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.__dict__["forward"] = forward

    def undo() -> None:
        if module.__dict__.get("forward") is not forward:  # wrapped again on top (accelerator.prepare): keep that
            warnings.warn(f"zoomem: the forward of this {type(module).__name__} was replaced after zoomem's (by "
                          "accelerator.prepare, say); it is left in place and zoomem's beneath it passes "
                          "straight through.", stacklevel=3)
            return
        if had_own:
            module.__dict__["forward"] = old
        else:
            module.__dict__.pop("forward", None)

    return undo
