"""Instance-level forward replacement, the one way zoomem changes a module (never its class).

Every such change is recorded per module (:func:`record_patch`), so that a wrapped model copies and pickles as the
model it was before zoomem's changes: ``copy.deepcopy(model)`` (timm's ``ModelEmaV3``, a best-checkpoint snapshot)
and ``torch.save(model)`` go through ``__getstate__``, which zoomem sets on each changed module to return its
state without them (:func:`plain_state`). Without it the copy's forward was the original's closure: it ran the
original's weights and sent its gradients there, and pickling failed on the closures.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["HANDLE", "SPLITS", "eager_under_compile", "is_ours", "plain_state", "record_patch", "set_forward"]

HANDLE = "_zoomem"
"""The instance attribute of a wrapped model that holds its wrap (``zoomem.runtime.wrap``'s handle)."""

_PATCHES = "_zoomem_patches"
"""The instance attribute holding a module's changes in order, each ``{key: (present before, value before)}`` of the
``__dict__`` keys it set (on the module itself: a global table holding a previous forward bound to its module
would keep a model that was dropped wrapped alive)."""

SPLITS = "_zoomem_splits"
"""The instance attribute of a model that holds its shared layers split call by call, by unit name
(:mod:`zoomem.runtime.calls`; on the model: a global table would keep a model dropped while split alive, through
the wrapped forwards its splits hold)."""

PRIVATE_KEYS = frozenset({"__getstate__", HANDLE, _PATCHES, SPLITS})
"""Instance attributes of zoomem's own that no copy carries: the ``__getstate__`` below, the wrap's handle, the
changes' record and a model's split layers."""


def record_patch(module: nn.Module, before: dict[str, tuple[bool, Any]]) -> Callable[[], None]:
    """Note that zoomem set ``module.__dict__``'s keys of ``before`` (what was there before: present, value); return
    what forgets it (call it when the change is undone)."""
    patches = module.__dict__.setdefault(_PATCHES, [])
    patches.append(before)
    if "__getstate__" not in module.__dict__:
        ref = weakref.ref(module)
        module.__dict__["__getstate__"] = lambda: plain_state(ref())

    def forget() -> None:
        patches[:] = [p for p in patches if p is not before]
        if not patches and module.__dict__.get(_PATCHES) is patches:
            del module.__dict__[_PATCHES]
            module.__dict__.pop("__getstate__", None)

    return forget


def plain_state(module: nn.Module | None) -> dict[str, Any]:
    """``module``'s pickling state (``nn.Module.__getstate__``'s) as it was before zoomem changed it: every recorded
    change taken back, newest first, zoomem's own attributes and forward hooks left out."""
    if module is None:
        return {}
    state = module.__dict__.copy()
    state.pop("_compiled_call_impl", None)
    for before in reversed(module.__dict__.get(_PATCHES, [])):
        for key, (present, value) in before.items():
            if present:
                state[key] = value
            else:
                state.pop(key, None)
    for key in PRIVATE_KEYS:
        state.pop(key, None)
    for key in ("_forward_hooks", "_forward_pre_hooks"):  # (the LM head's loss routing: zoomem.ops.loss)
        hooks = state.get(key)
        if hooks and any(is_ours(h) for h in hooks.values()):
            state[key] = OrderedDict((k, h) for k, h in hooks.items() if not is_ours(h))
    return state


def is_ours(fn: Any) -> bool:
    """Whether ``fn`` (a hook) is zoomem's own."""
    return (getattr(fn, "__module__", None) or "").startswith("zoomem.")


def eager_under_compile(fn: Callable[..., Any], note: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``fn``, run eagerly (a graph break) where torch.compile traces the code that calls it; ``note`` is called
    (eagerly) each time it is.

    zoomem's forwards cannot be traced by Dynamo (checkpoints with a ``context_fn``, saved-tensor hooks that store
    tensors in other forms): the model's own when ``torch.compile(model)`` or ``model.compile()`` compiles the call
    around it, a unit's when that unit is compiled in place (``block.compile()`` per repeated block, PyTorch's
    regional compilation; Dynamo raised "checkpoint not implemented ... context_fn" there). Attributes of ``fn``
    carry over."""
    def eager(*args: Any, **kwargs: Any) -> Any:
        if note is not None:
            note()
        return fn(*args, **kwargs)

    uncompiled = torch.compiler.disable(eager)

    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return uncompiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return forward


def set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Make ``forward`` the instance's forward; return the undo, which restores what was there before."""
    had_own = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    forget = record_patch(module, {"forward": (had_own, old)})
    module.__dict__["forward"] = forward

    def undo() -> None:
        forget()
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
