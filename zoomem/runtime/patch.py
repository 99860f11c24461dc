"""Instance-level forward replacement, the one way zoomem changes a module (never its class)."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["set_forward"]


def set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Make ``forward`` the instance's forward; return the undo, which restores what was there before."""
    had_own = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.__dict__["forward"] = forward

    def undo() -> None:
        if had_own:
            module.__dict__["forward"] = old
        else:
            module.__dict__.pop("forward", None)

    return undo
