"""Drop a recomputed unit's input and bring it back in backward from the previous unit's input (``RECOMPUTE_CHAIN``).

A non-reentrant checkpoint keeps its inputs as saved tensors (``torch.utils.checkpoint`` saves them through the
saved-tensor hooks in force when it is called). Around the checkpoint of a unit whose input the plan drops,
zoomem's hooks replace that input by a :class:`_Ref` to a :class:`Recipe` registered by the previous unit: its
forward, its arguments (its own input as a ``_Ref`` again when that one is dropped too), and the RNG and autocast
state it ran under. When backward unpacks the input, the recipe runs the previous unit's forward again without
autograd, under the same state, so the result is bitwise what the first forward produced; the inputs it needed on
the way are cached until their own units' backward takes them, so each unit of a chain runs once more, not once
per later unit.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import _get_autocast_kwargs, _infer_device_type, get_device_states, set_device_states

__all__ = ["Chain", "Recipe", "bring_back"]


def bring_back(obj: Any) -> Any:
    """A dropped input's value (the last reader: the unit whose input it is), anything else as is."""
    return obj.value(consume=True) if isinstance(obj, _Ref) else obj


class Recipe:
    """How to run one unit's forward again: function, arguments, and the state it first ran under."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, restore: Callable[[], Any],
                 ran_on: tuple[tuple, dict]) -> None:
        """``args``/``kwargs`` as the recipe will pass them (dropped inputs as references); ``ran_on`` the
        arguments the forward actually got, whose devices say which RNG states to keep (as the checkpoint does:
        a reference in place of the only CUDA input would leave CUDA's dropout masks unrestored)."""
        self.fn, self.restore = fn, restore
        self.args, self.kwargs = args, kwargs
        tensors = [a for a in tree_flatten(ran_on)[0] if isinstance(a, torch.Tensor)]
        self.device_type = _infer_device_type(*tensors)
        self.cpu_rng = torch.get_rng_state()
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []
        module = getattr(torch, self.device_type, None)
        if getattr(module, "_initialized", False):
            self.devices, self.device_states = get_device_states(*tensors)
        self.autocast, self.cpu_autocast = _get_autocast_kwargs(self.device_type)
        self.cache: list[Any] | None = None

    def leaves(self, consume: bool) -> list[Any]:
        """The outputs' leaves, recomputed if not cached; ``consume`` frees the cache (the last reader is the unit
        whose input this is; the readers before it are the recipes after it, bringing their own inputs back)."""
        leaves = self.cache
        if leaves is None:
            leaves = self._run()
        self.cache = None if consume else leaves
        return leaves

    def _run(self) -> list[Any]:
        resolve = lambda a: a.value(consume=False) if isinstance(a, _Ref) else a  # noqa: E731
        args, kwargs = tree_map(resolve, (self.args, self.kwargs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_states, device_type=self.device_type)
            if self.autocast is not None:
                stack.enter_context(torch.amp.autocast(device_type=self.device_type, **self.autocast))
            stack.enter_context(torch.amp.autocast("cpu", **self.cpu_autocast))
            stack.enter_context(self.restore())
            stack.enter_context(torch.no_grad())
            out = self.fn(*args, **kwargs)
        return tree_flatten(out)[0]


class _Ref:
    """A dropped input, as its checkpoint holds it: which output of which recipe, and the view taken of it."""

    def __init__(self, recipe: Recipe, leaf: int, like: torch.Tensor, base: torch.Tensor) -> None:
        self.recipe, self.leaf = recipe, leaf
        self.same = (like.shape, like.stride(), like.storage_offset()) == (
            base.shape, base.stride(), base.storage_offset()) and like.dtype == base.dtype
        self.view = (tuple(like.shape), tuple(like.stride()), like.storage_offset())

    def value(self, consume: bool) -> torch.Tensor:
        t = self.recipe.leaves(consume)[self.leaf]
        return t if self.same else t.as_strided(*self.view)


class Chain:
    """One forward's registry of unit outputs that the next unit's checkpoint drops (see the module docstring)."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[str, int], tuple[weakref.ref, Recipe, int, int]] = {}

    def register(self, output: Any, recipe: Recipe) -> None:
        for i, t in enumerate(tree_flatten(output)[0]):
            if isinstance(t, torch.Tensor) and t.numel() > 0 and t.is_floating_point():
                self._outputs[self._key(t)] = (weakref.ref(t), recipe, i, t._version)

    def ref_of(self, t: torch.Tensor) -> "_Ref | None":
        """The registered output ``t`` is (or views), while that output is alive; else None."""
        if t.numel() == 0:
            return None
        hit = self._outputs.get(self._key(t))
        if hit is None:
            return None
        base = hit[0]()
        if base is None:
            return None  # that output is gone: the address belongs to another tensor now
        if t._version != hit[3]:
            return None  # changed in place since its unit returned it: the recipe would bring back the old values
        return _Ref(hit[1], hit[2], t, base)

    def args_for_recipe(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A unit's arguments for its recipe: dropped inputs as references, so the recipe does not keep them."""
        swap = lambda a: (self.ref_of(a) or a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        return tree_map(swap, (args, kwargs))

    def close(self) -> None:
        """Forget the registry at the end of forward: the references packed so far keep their recipes; holding
        every recipe here would keep every segment's first input until the whole graph is freed."""
        self._outputs.clear()

    @contextlib.contextmanager
    def dropping(self) -> Iterator[None]:
        """Saved-tensor hooks around a checkpoint call: its registered inputs are held as references."""

        def pack(t: torch.Tensor) -> Any:
            return self.ref_of(t) or t

        with torch.autograd.graph.saved_tensors_hooks(pack, bring_back):
            yield

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[str, int]:
        return str(t.device), t.untyped_storage().data_ptr()
