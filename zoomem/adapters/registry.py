"""The adapter and layer registries: plain dicts filled by decorators that refuse duplicates."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

from torch import nn

from .base import Adapter

__all__ = ["ADAPTERS", "LAYERS", "LayerSpec", "register_adapter", "register_layer", "get_adapter", "layer_spec"]

logger = logging.getLogger(__name__)

ADAPTERS: dict[str, Adapter] = {}
"""Adapter name -> adapter instance."""


@dataclass(frozen=True)
class LayerSpec:
    """What zoomem knows of a layer class.

    ``kind`` is ``"block"`` for checkpointable units, otherwise a category that annotates the ops run inside
    the layer (``"norm_act"``, ``"attention"``, ``"message_passing"``, ...).
    """

    cls: type
    kind: str = "block"
    zoo: str | None = None


LAYERS: dict[type, LayerSpec] = {}
"""Layer class -> spec, consulted by every adapter (user registrations included)."""

A = TypeVar("A", bound=type)


def register_adapter(cls: A) -> A:
    """Class decorator: instantiate and register an :class:`Adapter` subclass under ``cls.name``."""
    if cls.name in ADAPTERS:
        raise ValueError(
            f"An adapter named {cls.name!r} is already registered ({type(ADAPTERS[cls.name]).__name__}); "
            "give the new adapter another `name`."
        )
    ADAPTERS[cls.name] = cls()
    return cls


def register_layer(cls: type, *, kind: str = "block", zoo: str | None = None, overwrite: bool = False) -> type:
    """Tell zoomem about a layer class of your own.

    Args:
        cls: an ``nn.Module`` subclass.
        kind: ``"block"`` makes every instance a checkpointable unit; any other string is a category for the
            ops the layer runs (shown in traces, used by the planner to pick implementations).
        zoo: the zoo it belongs to, for display.
        overwrite: replace an earlier registration instead of failing.

    Returns:
        ``cls``, so it can be used as a decorator.

    >>> import torch
    >>> class MyBlock(torch.nn.Module): ...
    >>> _ = register_layer(MyBlock)
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_layer expects an nn.Module subclass, got {cls!r}.")
    if cls in LAYERS and not overwrite:
        raise ValueError(
            f"{cls.__qualname__} is already registered as kind={LAYERS[cls].kind!r}; pass overwrite=True to replace it."
        )
    LAYERS[cls] = LayerSpec(cls, kind, zoo)
    return cls


def layer_spec(module: nn.Module) -> LayerSpec | None:
    """The registered spec of ``module``'s class or its nearest registered base class."""
    for klass in type(module).__mro__:
        spec = LAYERS.get(klass)
        if spec is not None:
            return spec
    return None


def get_adapter(model: nn.Module, name: str | None = None) -> Adapter:
    """The adapter for ``model``: the named one, else the highest-priority adapter that matches.

    Raises:
        KeyError: ``name`` is not a registered adapter.
    """
    _load_builtin_adapters()
    if name is not None:
        if name not in ADAPTERS:
            raise KeyError(f"Could not resolve adapter {name!r} among choices {sorted(ADAPTERS)}.")
        return ADAPTERS[name]
    for adapter in sorted(ADAPTERS.values(), key=lambda a: -a.priority):
        if adapter.matches(model):
            return adapter
    raise LookupError("No adapter matched, not even the generic one; was the registry reset?")


_builtin_loaded = False


def _load_builtin_adapters() -> None:
    """Import the built-in adapters once (lazily, so `import zoomem` does not import every zoo)."""
    global _builtin_loaded
    if _builtin_loaded:
        return
    _builtin_loaded = True
    from . import generic, pyg, timm, transformers  # noqa: F401


def _reset_registries() -> None:
    """For tests: forget user registrations and reload the built-in ones."""
    global _builtin_loaded
    ADAPTERS.clear()
    LAYERS.clear()
    _builtin_loaded = False
    import importlib

    from . import generic, pyg, timm, transformers

    for mod in (generic, pyg, timm, transformers):
        importlib.reload(mod)
    _builtin_loaded = True
