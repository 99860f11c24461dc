"""The inputs of one training step, in one shape for every zoo.

A model of any zoo is called as ``model(*batch.args, **batch.kwargs)``; ``batch.target`` holds what the
planning loss compares the output with (labels), or ``None`` when the output carries its own loss (HF
models given ``labels``).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["Batch", "no_larger", "tensors_in"]


@dataclass
class Batch:
    """Positional and keyword inputs of one model call, plus an optional target.

    Args:
        args: positional inputs of ``model(...)``.
        kwargs: keyword inputs of ``model(...)``.
        target: labels for the planning loss, or ``None`` when the model computes its own loss.

    >>> b = Batch.of(torch.zeros(2, 3))
    >>> b.signature()
    (('args', ((2, 3), 'torch.float32')), ('kwargs',), ('target', None))
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None

    @classmethod
    def of(cls, obj: Any, model: torch.nn.Module | None = None) -> "Batch":
        """Build a Batch from what users pass: a Batch, dict, tuple/list, tensor or PyG ``Data``.

        A PyG data object goes to ``model``'s forward as its parameters name its attributes (``x, edge_index``,
        ``batch``, ``edge_attr``, ...: :func:`_pyg_call`), or whole where the forward takes one input
        (``forward(self, data)``); without a model, as ``(x, edge_index)``. Its ``y`` is the target."""
        if isinstance(obj, Batch):
            return obj
        if isinstance(obj, dict):
            return cls(kwargs=dict(obj))
        if isinstance(obj, (tuple, list)):
            return cls(args=tuple(obj))
        if isinstance(obj, torch.Tensor):
            return cls(args=(obj,))
        if _is_pyg_data(obj) and model is not None:
            args, kwargs = _pyg_call(obj, model)
            return cls(args=args, kwargs=kwargs, target=getattr(obj, "y", None))
        if hasattr(obj, "x") and hasattr(obj, "edge_index"):  # torch_geometric.data.Data without importing PyG
            return cls(args=(obj.x, obj.edge_index), target=getattr(obj, "y", None))
        raise TypeError(
            f"Cannot use {type(obj).__name__} as a batch: pass a zoomem.Batch, a dict of keyword inputs, "
            "a tuple of positional inputs, a tensor, or a torch_geometric Data object."
        )

    def call(self, model: torch.nn.Module) -> Any:
        """Run ``model`` on this batch."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (inputs and target), those inside PyG data objects included."""
        return tensors_in((self.args, self.kwargs, self.target))

    def inputs(self) -> list[torch.Tensor]:
        """Every tensor of the model's inputs (:meth:`tensors` but the target's)."""
        return tensors_in((self.args, self.kwargs))

    def to(self, device: torch.device | str) -> "Batch":
        """A copy with every tensor moved to ``device``."""
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        args, kwargs, target = _map_tensors(move, (self.args, self.kwargs, self.target))
        return Batch(tuple(args), dict(kwargs), target)

    def detached(self) -> "Batch":
        """This batch cut from the autograd graph that made it: each tensor that requires grad becomes a detached
        alias of it (same memory and version counter) that requires grad; ``self`` where none does. Planning's
        passes on it differentiate to the inputs as the step does, never into the caller's graph (a GAN's
        generator, an encoder outside the wrapped model, whose saved tensors they would free) nor into a leaf
        input's ``.grad`` (adversarial training's input gradient)."""
        if not any(t.requires_grad for t in self.tensors()):
            return self
        def cut(t: Any) -> Any:
            return t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad else t

        args, kwargs, target = _map_tensors(cut, (self.args, self.kwargs, self.target))
        return Batch(tuple(args), dict(kwargs), target)

    def batch_size(self) -> int | None:
        """The size of the batch dimension: dim 0 of the first input tensor (``None`` when there is none; a PyG data
        object's nodes are not samples: its tensors are not looked at)."""
        first = next((t for t in pytree.tree_leaves((self.args, self.kwargs))
                      if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        return None if first is None else int(first.shape[0])

    def take(self, n: int) -> "Batch":
        """The first ``n`` samples: every tensor whose dim 0 is the batch dimension, sliced; the rest as it is.

        For batches whose samples are independent rows (images, token sequences and their labels); a graph's
        nodes are not (its edges index them), which is why adapters decide (:meth:`Adapter.sub_batch`).
        """
        size = self.batch_size()
        if size is None or not 1 <= n <= size:
            raise ValueError(f"Cannot take {n} samples of a batch of {size}: pick 1 <= n <= the batch size.")
        cut = lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size else t  # noqa: E731
        args, kwargs, target = pytree.tree_map(cut, (self.args, self.kwargs, self.target))
        return Batch(tuple(args), dict(kwargs), target)

    def nbytes(self) -> int:
        """Bytes of the batch's tensors (storage-deduplicated)."""
        seen: dict[int, int] = {}
        for t in self.tensors():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def signature(self) -> tuple:
        """Shapes and dtypes of every input: plans are cached per signature."""

        def sig(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), str(x.dtype))
            if isinstance(x, (int, float, bool, str, type(None))):
                return x
            if _is_pyg_data(x):  # its tensors by name (its other values, a molecule's SMILES, are per sample)
                return (type(x).__name__,) + tuple((k, sig(v)) for k, v in _pyg_items(x) if isinstance(v, torch.Tensor))
            return type(x).__name__

        kw = tuple(sorted((k, tuple(sig(leaf) for leaf in pytree.tree_leaves(v))) for k, v in self.kwargs.items()))
        args = tuple(sig(a) for a in pytree.tree_leaves(self.args))
        target = None if self.target is None else tuple(sig(t) for t in pytree.tree_leaves(self.target))
        return (("args",) + args, ("kwargs",) + kw, ("target", target))


def _is_pyg_data(x: Any) -> bool:
    """Whether ``x`` is a PyG data object (``Data``, ``HeteroData``, their mini-batches): pytree takes it for a leaf,
    but its tensors are the model's inputs. (PyG is loaded wherever one exists: nothing is imported here.)"""
    data = sys.modules.get("torch_geometric.data.data")
    return data is not None and isinstance(x, data.BaseData)


def _pyg_call(data: Any, model: torch.nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``model(...)`` takes a PyG data object as: the object itself where its forward has one
    required parameter that the object has no attribute of (``forward(self, data)``); else each parameter the
    object has an attribute of (``x_dict`` and ``edge_index_dict`` of a ``HeteroData`` too), positionally up to the
    first it lacks (PyG's examples call ``model(data.x, data.edge_index, data.batch)``), by name after.

    Raises:
        TypeError: the forward names none of the object's attributes and takes more than one input."""
    params = [p for p in inspect.signature(type(model).forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][1:]  # not self
    has = lambda name: getattr(data, name, None) is not None  # noqa: E731
    required = [p for p in params if p.default is p.empty]
    if len(required) == 1 and not has(required[0].name):
        return (data,), {}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in params:
        if not has(p.name):
            continue
        if not kwargs and p.kind != p.KEYWORD_ONLY and len(args) == params.index(p):
            args.append(getattr(data, p.name))
        else:
            kwargs[p.name] = getattr(data, p.name)
    if not args and not kwargs:
        raise TypeError(
            f"Cannot pass this {type(data).__name__} to {type(model).__name__}.forward: its parameters "
            f"({', '.join(p.name for p in params)}) name none of its attributes. Pass a zoomem.Batch(args=(...), "
            "kwargs={...}) built as your training step calls the model."
        )
    return tuple(args), kwargs


def _pyg_items(x: Any) -> list[tuple[str, Any]]:
    """A PyG data object's values by their path (``['x']``, ``['paper']['x']`` in a ``HeteroData``)."""
    flat, _ = pytree.tree_flatten_with_path(x.to_dict())
    return [(pytree.keystr(path), value) for path, value in flat]


def _leaves(tree: Any) -> list[Any]:
    """pytree's leaves of ``tree``, with each PyG data object's values in its place."""
    out: list[Any] = []
    for leaf in pytree.tree_leaves(tree):
        if _is_pyg_data(leaf):
            out.extend(v for _, v in _pyg_items(leaf))
        else:
            out.append(leaf)
    return out


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` (pytree's containers), those inside PyG data objects included."""
    return [t for t in _leaves(tree) if isinstance(t, torch.Tensor)]


def _map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to each tensor, those inside PyG data objects too (in a copy of the object: the
    caller's is left as it is)."""
    def each(leaf: Any) -> Any:
        if _is_pyg_data(leaf):
            return copy.copy(leaf).apply(fn)
        return fn(leaf) if isinstance(leaf, torch.Tensor) else leaf

    return pytree.tree_map(each, tree)


def no_larger(small: Any, large: Any) -> bool:
    """Whether the :meth:`Batch.signature` ``small`` is ``large`` with no tensor dimension larger: the same inputs,
    dtypes, ranks and non-tensor values (a shorter padded batch, fewer samples, a smaller image).

    >>> no_larger(Batch.of(torch.zeros(2, 30)).signature(), Batch.of(torch.zeros(2, 32)).signature())
    True
    >>> no_larger(Batch.of(torch.zeros(4, 30)).signature(), Batch.of(torch.zeros(2, 32)).signature())
    False
    """
    if _tensor_signature(small) and _tensor_signature(large):
        (small_shape, small_dtype), (large_shape, large_dtype) = small, large
        return small_dtype == large_dtype and len(small_shape) == len(large_shape) and all(
            a <= b for a, b in zip(small_shape, large_shape))
    if isinstance(small, tuple) and isinstance(large, tuple):
        return len(small) == len(large) and all(no_larger(a, b) for a, b in zip(small, large))
    return bool(small == large)


def signature_numel(signature: Any) -> int:
    """The elements of every tensor in a :meth:`Batch.signature`.

    >>> signature_numel(Batch.of((torch.zeros(2, 30), torch.zeros(3))).signature())
    63
    """
    if _tensor_signature(signature):
        return math.prod(signature[0])
    return sum(signature_numel(x) for x in signature) if isinstance(signature, tuple) else 0


def _tensor_signature(x: Any) -> bool:
    """A tensor's entry in a signature: ``(shape, "torch.<dtype>")``."""
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and all(isinstance(d, int) for d in x[0])
            and isinstance(x[1], str) and x[1].startswith("torch."))
