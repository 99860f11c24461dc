"""Sending calls of one torch function elsewhere for the duration of a ``with`` block (a ``TorchFunctionMode``,
entered only around the code it concerns, never process-wide)."""

from __future__ import annotations

from typing import Any, Callable

from torch.overrides import TorchFunctionMode

__all__ = ["RoutingMode"]


class RoutingMode(TorchFunctionMode):
    """Offers every call of ``target`` to :meth:`route`; a call it returns ``None`` for runs as it is, every other
    torch call too."""

    target: Callable[..., Any]

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is self.target:
            routed = self.route(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)

    def route(self, *args: Any, **kwargs: Any) -> Any:
        """The result of the call routed elsewhere, or ``None`` to run it as it is."""
        return None
