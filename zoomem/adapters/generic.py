"""The fallback adapter for any ``nn.Module``, and the unit-finding helpers every adapter shares.

Units of a model no zoo adapter knows, in order of preference:

1. modules whose class (or a base class) was registered with ``register_layer(cls, kind="block")``,
   outermost only;
2. the children of the longest ``nn.Sequential`` / ``nn.ModuleList`` in the model (most children; ties go to
   the shallowest), when it has at least two;
3. the model's direct children that hold parameters.

A timm model inside (a backbone under a head of the user's, a siamese pair) gives its blocks as the timm adapter
finds them, before 2 and 3 (whose longest list is one ResNet stage's blocks there). The own checkpointing of the
timm and HF models inside (``set_grad_checkpointing``, ``gradient_checkpointing_enable``) is turned off while
wrapped, as for a bare model of their zoo.

Registered blocks take precedence in every adapter: :func:`with_registered_blocks` merges them into the units a
zoo adapter found, dropping the zoo's units that overlap them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import nn

from .base import Adapter, Unit
from .registry import layer_spec, register_adapter

__all__ = [
    "GenericAdapter",
    "registered_blocks",
    "sequential_units",
    "with_registered_blocks",
    "outermost",
    "sort_units",
    "SIZE_NAMES",
    "drop_foreign_sizes",
]

logger = logging.getLogger(__name__)


SIZE_NAMES = ("seq_len", "image_size", "num_nodes", "num_edges")
"""Every size an adapter's ``example_batch`` accepts, across zoos."""


def drop_foreign_sizes(adapter: str, sizes: dict, accepted: tuple[str, ...]) -> None:
    """Check the extra ``sizes`` given to ``adapter.example_batch`` (already stripped of ``accepted`` ones).

    Sizes that belong to another zoo (``seq_len`` for an image model) are ignored with a log line, so one set of
    sizes can serve a mixed list of models; a name no adapter knows is a typo and raises ``TypeError``.
    """
    unknown = sorted(k for k in sizes if k not in SIZE_NAMES)
    if unknown:
        raise TypeError(
            f"Unknown size(s) {unknown} for the {adapter!r} adapter; it accepts {list(accepted)} "
            f"(all adapters together: {list(SIZE_NAMES)})."
        )
    if sizes:
        logger.info("%s adapter: ignoring sizes %s (it uses %s)", adapter, sorted(sizes), list(accepted))


def _is_inside(name: str, parent: str) -> bool:
    """Whether module path ``name`` is ``parent`` or lies below it (``""`` is the root)."""
    return parent == "" or name == parent or name.startswith(parent + ".")


def outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Keep the modules of ``named`` (in ``named_modules`` order) that no other listed module contains."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(_is_inside(name, k) for k, _ in kept):
            continue
        kept.append((name, module))
    return kept


def registered_blocks(model: nn.Module) -> list[Unit]:
    """The outermost modules of ``model`` registered with ``register_layer(kind="block")``, in module order."""
    found = []
    for name, module in model.named_modules():
        spec = layer_spec(module)
        if spec is not None and spec.kind == "block":
            found.append((name, module))
    return [Unit(n, m) for n, m in outermost(found)]


def sort_units(model: nn.Module, units: list[Unit]) -> list[Unit]:
    """``units`` in the order ``model.named_modules()`` lists them (registration order, forward order in practice)."""
    index = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(units, key=lambda u: index.get(u.name, len(index)))


def with_registered_blocks(model: nn.Module, units: list[Unit]) -> list[Unit]:
    """Merge user-registered blocks into a zoo adapter's ``units``.

    Registered blocks win: a zoo unit that contains a registered block or lies inside one is dropped. When
    nothing is registered, ``units`` come back unchanged (same order).
    """
    blocks = registered_blocks(model)
    if not blocks:
        return units
    kept = [
        u for u in units
        if not any(_is_inside(u.name, b.name) or _is_inside(b.name, u.name) for b in blocks)
    ]
    return sort_units(model, blocks + kept)


def sequential_units(model: nn.Module) -> list[Unit]:
    """The generic split: children of the longest Sequential/ModuleList, else the parameterised children."""
    best: tuple[int, int, str, nn.Module] | None = None  # (-children, depth, name, module)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            key = (-len(module), 0 if name == "" else name.count(".") + 1, name, module)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is not None and -best[0] >= 2:
        _, _, name, seq = best
        prefix = f"{name}." if name else ""
        return [Unit(f"{prefix}{child_name}", child) for child_name, child in seq.named_children()]
    return [
        Unit(name, child)
        for name, child in model.named_children()
        if next(child.parameters(), None) is not None
    ]


def _zoo_models_inside(model: nn.Module) -> list[tuple[Adapter, nn.Module]]:
    """Each outermost timm or HF model inside ``model`` with its zoo's adapter (none of a zoo not imported)."""
    found: list[tuple[Adapter, nn.Module]] = []
    if "timm" in sys.modules:
        from .timm import TimmAdapter, timm_models_inside

        found += [(TimmAdapter(), m) for _, m in timm_models_inside(model)]
    if "transformers" in sys.modules:
        from .transformers import TransformersAdapter, hf_models_inside

        found += [(TransformersAdapter(), m) for _, m in hf_models_inside(model)]
    return found


def _timm_units(model: nn.Module) -> list[Unit]:
    """The blocks of the timm models inside ``model``, named from ``model`` (none where timm is not imported)."""
    if "timm" not in sys.modules:
        return []
    from .timm import TimmAdapter, timm_models_inside

    return [Unit(f"{name}.{u.name}", u.module) for name, sub in timm_models_inside(model)
            for u in TimmAdapter().units(sub)]


@register_adapter
class GenericAdapter(Adapter):
    """Any ``nn.Module``: registered blocks, else a structural split (see the module docstring).

    The generic adapter cannot guess a model's inputs, so :meth:`example_batch` raises and callers pass a real
    batch; the planning loss is :func:`~zoomem.adapters.base.default_loss`.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> [u.name for u in GenericAdapter().units(model)]
    ['0', '1', '2']
    """

    name = "generic"
    priority = 0

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, nn.Module)

    def units(self, model: nn.Module) -> list[Unit]:
        blocks = registered_blocks(model)
        if blocks:
            return blocks
        return _timm_units(model) or sequential_units(model)

    native_flags = ("grad_checkpointing", "gradient_checkpointing", "_gradient_checkpointing_func")  # timm's, HF's

    def native_checkpointing(self, model: nn.Module) -> bool:
        return any(zoo.native_checkpointing(m) for zoo, m in _zoo_models_inside(model))

    def set_native_checkpointing(self, model: nn.Module, enable: bool) -> bool:
        done = [zoo.set_native_checkpointing(m, enable) for zoo, m in _zoo_models_inside(model)]
        return any(done)

    def recompute_inputs(self, unit: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """An HF layer inside a model of the user's own (a GPT-2 or Llama backbone under a head of theirs) gets the
        transformers adapter's arguments: without them its recomputation writes the KV cache a second time, which
        HF decoders fill in training unless told ``use_cache=False``, and checkpointing raises."""
        if "transformers" in sys.modules:
            from .transformers import TransformersAdapter, is_hf_layer

            if is_hf_layer(unit):
                return TransformersAdapter().recompute_inputs(unit, args, kwargs)
        return args, kwargs
