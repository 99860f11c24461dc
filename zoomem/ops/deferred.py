"""An LM head's output that is not computed unless something other than the fused loss reads it.

With ``skip_logits`` the fused LM-head loss (:mod:`zoomem.ops.loss`) reads only the head's input and weight, and
the model returns no logits; yet the head's ``nn.Linear`` still makes the whole ``batch x sequence x vocabulary``
tensor in the forward (GPT-2 at 8 x 512 tokens: 785 MiB in fp32), at the one moment every activation saved for
backward is alive too. :class:`DeferredLogits` stands in for that output: a tensor of the right shape, dtype and
device over a one-element storage, that records the head's call (its input, its forward, the grad mode and the
autocast state) instead of running it. The ops HF's losses apply before their cross-entropy (``.float()``,
``.view(-1, vocab)``, ``.reshape``), and adding a constant row over the vocabulary to the head's output (BART's
``final_logits_bias``), give more such stand-ins, and the routed cross-entropy recognises them and
computes the loss from the head's input a slice of the vocabulary at a time, as Liger-Kernel's fused linear
cross-entropy does.

Anything else that reads a stand-in, a value, a stride, a pointer, makes the real output first (the head's own
forward, under the recorded grad mode and autocast state; once, shared by the stand-ins derived from it), then
runs on it: a model that divides its logits or adds a bias to them, or code that prints them, gets exactly what the
head would have made, only later, and then holds it as it would have. Shape, dtype, device and the other
attributes that describe a tensor without reading it are the stand-in's own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["DeferredLogits", "defer", "materialize", "is_deferred", "root", "offsets"]


class _Call:
    """The head's call a :class:`DeferredLogits` stands for, and its result once something has made it."""

    __slots__ = ("owner", "forward", "hidden", "grad", "autocast", "matmul_dtype", "real", "__weakref__")

    def __init__(self, owner: Any, forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 matmul_dtype: torch.dtype) -> None:
        device = hidden.device.type
        self.owner, self.forward, self.hidden, self.matmul_dtype = owner, forward, hidden, matmul_dtype
        self.grad = torch.is_grad_enabled()
        self.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        self.real: torch.Tensor | None = None

    def make(self) -> torch.Tensor:
        if self.real is None:
            device = self.hidden.device.type
            with torch.set_grad_enabled(self.grad), torch.autocast(device, dtype=self.autocast,
                                                                   enabled=self.autocast is not None):
                self.real = self.forward(self.hidden)
        return self.real


_DESCRIBE_PROPS = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "_base", "_version", "layout",
                   "ndim", "is_cuda", "is_cpu", "is_sparse", "is_meta", "is_quantized", "is_nested", "grad")
_DESCRIBE_METHODS = ("size", "dim", "numel", "nelement", "is_floating_point", "is_complex", "element_size",
                     "get_device", "__len__", "__hash__", "_is_view", "untyped_storage", "data_ptr", "stride",
                     "storage_offset", "is_contiguous")
_DESCRIBE = frozenset([getattr(torch.Tensor, p).__get__ for p in _DESCRIBE_PROPS]
                      + [getattr(torch.Tensor, m) for m in _DESCRIBE_METHODS])
"""What a stand-in answers itself: attributes that describe a tensor without reading its values (the storage and
pointer are the stand-in's one element: nothing else exists yet)."""

_UPCASTS = frozenset([torch.Tensor.float, torch.Tensor.to])
_VIEWS = frozenset([torch.Tensor.view, torch.Tensor.reshape, torch.reshape])
_ADDS = frozenset([torch.Tensor.add, torch.Tensor.__add__, torch.add])


class DeferredLogits(torch.Tensor):
    """A stand-in for an LM head's output (or its ``.float()`` copy, its sum with a constant row, or a view keeping
    the vocabulary dimension last) that has not been computed; see the module docstring."""

    _zm_call: _Call
    _zm_parent: "DeferredLogits | None"
    _zm_step: tuple[str, Any]
    _zm_real: torch.Tensor | None

    @staticmethod
    def _make(call: _Call, shape: torch.Size, dtype: torch.dtype, parent: "DeferredLogits | None",
              step: tuple[str, Any]) -> "DeferredLogits":
        base = torch.empty((), dtype=dtype, device=call.hidden.device).expand(shape)
        t = torch.Tensor._make_subclass(DeferredLogits, base, True)
        t._zm_call, t._zm_parent, t._zm_step, t._zm_real = call, parent, step, None
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        this = args[0] if args and isinstance(args[0], DeferredLogits) else None
        if this is not None and this._zm_call.real is None:
            if func in _DESCRIBE:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            derived = _derive(this, func, args[1:], kwargs)
            if derived is not None:
                return derived
        args, kwargs = pytree.tree_map_only(DeferredLogits, materialize, (args, kwargs))
        return func(*args, **kwargs)


def _derive(t: DeferredLogits, func: Callable[..., Any], args: tuple, kwargs: dict) -> DeferredLogits | None:
    """The stand-in for ``func(t, *args, **kwargs)`` where that is an upcast to fp32, a view keeping the last
    (vocabulary) dimension, or (on the head's output itself) the sum with a constant row over the vocabulary of its
    dtype; ``None`` for anything else."""
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = t.shape, t.dtype
        if func in _UPCASTS:
            if func is torch.Tensor.to:
                target = kwargs.get("dtype", args[0] if len(args) == 1 else None)
                if not isinstance(target, torch.dtype) or set(kwargs) - {"dtype"} or len(args) > 1:
                    return None
            elif args or kwargs:
                return None
            else:
                target = torch.float32
            if target == dtype:
                return t  # as torch does: the same tensor
            if target != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
                return None
            return DeferredLogits._make(t._zm_call, shape, target, t, ("float", None))
        if func in _ADDS and len(args) == 1 and not kwargs and t._zm_parent is None:
            other = args[0]  # a constant row over the vocabulary (BART's final_logits_bias): the head's bias plus it
            if (type(other) is not torch.Tensor or other.requires_grad or other.dtype != dtype
                    or other.device != t.device or other.numel() != shape[-1] or other.shape[-1] != shape[-1]):
                return None
            return DeferredLogits._make(t._zm_call, shape, dtype, t, ("add", other))
        if func in _VIEWS and not kwargs:
            sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            try:
                new = torch.empty((), dtype=dtype).expand(shape).reshape(*sizes).shape
            except (RuntimeError, TypeError):
                return None
            if not new or new[-1] != shape[-1]:
                return None
            return DeferredLogits._make(t._zm_call, new, dtype, t, ("view", new))
    return None


def materialize(t: DeferredLogits) -> torch.Tensor:
    """The real tensor ``t`` stands for: the head's output made (once), then the steps ``t`` was derived by."""
    if t._zm_real is None:
        if t._zm_parent is None:
            real = t._zm_call.make()
        else:
            real = materialize(t._zm_parent)
            kind, arg = t._zm_step
            with torch.set_grad_enabled(t._zm_call.grad):  # the steps' graph too, as they would have run
                real = real.float() if kind == "float" else real + arg if kind == "add" else real.reshape(arg)
        t._zm_real = real
    return t._zm_real


def is_deferred(t: Any) -> bool:
    """Whether ``t`` is a stand-in whose head output nothing has made yet."""
    return isinstance(t, DeferredLogits) and t._zm_call.real is None


def offsets(t: DeferredLogits) -> list[torch.Tensor]:
    """The constants added to the head's output on the way to ``t`` (each a row over the vocabulary)."""
    found = []
    while t._zm_parent is not None:
        if t._zm_step[0] == "add":
            found.append(t._zm_step[1])
        t = t._zm_parent
    return found


def root(t: DeferredLogits) -> DeferredLogits:
    """The stand-in for the head's output itself that ``t`` was derived from."""
    while t._zm_parent is not None:
        t = t._zm_parent
    return t


def defer(owner: Any, forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
          matmul_dtype: torch.dtype) -> DeferredLogits:
    """A stand-in for ``forward(hidden)``, the output of ``owner``, an ``nn.Linear`` with ``weight``, run in
    ``matmul_dtype``."""
    call = _Call(owner, forward, hidden, matmul_dtype)
    return DeferredLogits._make(call, hidden.shape[:-1] + weight.shape[:1], matmul_dtype, None, ("head", None))
