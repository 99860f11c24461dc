"""The timm adapter: image models from ``timm.create_model``.

Units are the blocks as timm itself groups them for layer-wise learning-rate decay
(``model.group_matcher(coarse=False)`` with ``timm.models.group_modules``): ``layer1.0`` in a ResNet,
``blocks.3`` in a ViT, ``stages.0.blocks.1`` (and ``stages.1.downsample``) in a ConvNeXt, ``blocks.2.1`` in an
EfficientNet/MobileNet. Stem and head groups are not units.

timm is imported only once a timm model exists (``"timm" in sys.modules``), so ``import zoomem`` stays cheap
and works without timm.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import torch
from torch import nn

from ..batch import Batch
from .base import Adapter, Unit, default_loss
from .generic import drop_foreign_sizes, outermost, sequential_units, with_registered_blocks
from .registry import LAYERS, register_adapter, register_layer

__all__ = ["TimmAdapter", "timm_block_paths", "timm_models_inside"]

logger = logging.getLogger(__name__)

_MATCH_PREV_GROUP = (99999,)  # timm's marker for "belongs to the previous group" (final norm, conv_head)

_NORM_ACT_LAYERS = (
    "BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d", "GroupNormAct", "GroupNorm1Act",
    "LayerNormAct", "LayerNormAct2d", "LayerNormActFp32", "LayerNormAct2dFp32",
    "RmsNormAct", "RmsNormAct2d", "RmsNormActFp32", "RmsNormAct2dFp32",
)
_ATTENTION_LAYERS = ("Attention", "AttentionRope", "Attention2d", "MultiQueryAttention2d", "MultiQueryAttentionV2",
                     "DiffAttention")

_layers_registered = False


def _timm_loaded() -> bool:
    return "timm" in sys.modules


def _register_layers() -> None:
    """Register timm's fused norm+act layers and attention layers (once; user registrations are kept)."""
    global _layers_registered
    if _layers_registered:
        return
    _layers_registered = True
    try:
        import timm.layers as tl
        import timm.layers.norm_act as na
    except ImportError:  # pragma: no cover - timm missing or broken
        return
    for kind, names, home in (("norm_act", _NORM_ACT_LAYERS, na), ("attention", _ATTENTION_LAYERS, tl)):
        for cls_name in names:
            cls = getattr(home, cls_name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in LAYERS:
                register_layer(cls, kind=kind, zoo="timm")


if _timm_loaded():
    _register_layers()


def _block_specs(matcher: dict) -> list[tuple[re.Pattern, bool]]:
    """timm's matcher dict as ``(regex, is_block)`` in timm's own matching order (first match wins)."""
    specs: list[tuple[re.Pattern, bool]] = []
    for group_name, mspec in matcher.items():
        if mspec is None:
            continue
        in_blocks = "block" in group_name and not group_name.startswith("stem")
        entries = mspec if isinstance(mspec, (tuple, list)) else [(mspec, None)]
        for entry in entries:
            regex, suffix = (entry, None) if isinstance(entry, str) else (entry[0], entry[1])
            is_block = in_blocks and tuple(suffix or ()) != _MATCH_PREV_GROUP
            specs.append((re.compile(regex), is_block))
    return specs


def _to_boundary(name: str, end: int) -> str:
    """The module path ``name[:end]`` widened to a whole path component, without a trailing dot."""
    if end < len(name) and name[end] != "." and end > 0 and name[end - 1] != ".":
        nxt = name.find(".", end)
        end = len(name) if nxt < 0 else nxt
    return name[:end].rstrip(".")


def _inside(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def _common_prefix(names: list[str]) -> str:
    """The longest common dotted prefix of module paths (``""`` when they share none)."""
    common: list[str] = []
    for comps in zip(*(n.split(".") for n in names)):
        if len(set(comps)) != 1:
            break
        common.append(comps[0])
    return ".".join(common)


def _numbered_prefix(name: str) -> str:
    """``blocks.22.attn.qkv`` -> ``blocks.22``: the path up to the first numeric component, else ``""``."""
    comps = name.split(".")
    for i, c in enumerate(comps[1:], start=1):
        if c.isdigit():
            return ".".join(comps[: i + 1])
    return ""


def _classifier_path(model: nn.Module) -> str | None:
    get = getattr(model, "get_classifier", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(head, nn.Module) or next(head.parameters(), None) is None:
        return None
    return next((n for n, m in model.named_modules() if m is head and n), None)


def timm_block_paths(model: nn.Module) -> list[str]:
    """Module paths of the blocks timm's ``group_matcher(coarse=False)`` defines, in timm's group order.

    Each module with parameters is matched the way timm matches it; a match of a block regex names the block
    (``layer1.0.conv1`` under ``^layer(\\d+)\\.(\\d+)`` -> ``layer1.0``). Stem groups and the tail entries timm
    folds into the last block (``conv_head``, the final ``norm``) are skipped. For matchers given as functions
    (CaiT, Inception), group 0 (the stem) is skipped and each other group becomes the smallest module holding all
    its members, or, when only the whole model holds them, the numbered modules inside (``blocks.22``). The
    classifier is never a block; nested paths keep the outermost.

    Returns ``[]`` when the model has no usable ``group_matcher``.
    """
    if not hasattr(model, "group_matcher"):
        return []
    try:
        matcher = model.group_matcher(coarse=False)
        from timm.models import group_modules

        group_of = group_modules(model, matcher, reverse=True)  # module name -> timm group id
    except Exception as exc:  # noqa: BLE001 - a model-specific matcher may fail; fall back to the generic split
        logger.debug("group_matcher of %s failed (%s); using the generic split", type(model).__name__, exc)
        return []
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    paths: dict[str, tuple[float, int]] = {}  # path -> (timm group, module index): sort key
    if isinstance(matcher, dict):
        specs = _block_specs(matcher)
        for name in group_of:
            for regex, is_block in specs:
                m = regex.match(name)
                if m:
                    if is_block:
                        path = _to_boundary(name, m.end())
                        key = (group_of[name], order.get(path, 0))
                        paths[path] = min(paths.get(path, key), key)
                    break
    else:
        groups: dict[float, list[str]] = {}
        for name, gid in group_of.items():
            groups.setdefault(gid, []).append(name)
        first = min(groups) if len(groups) > 2 else None  # timm's function matchers give the stem group 0
        for gid, names in groups.items():
            if gid == first:
                continue
            common = _common_prefix(names)
            candidates = [common] if common else [p for p in map(_numbered_prefix, names) if p]
            for path in candidates:
                key = (gid, order.get(path, 0))
                paths[path] = min(paths.get(path, key), key)
    classifier = _classifier_path(model)
    if classifier is not None:  # a head is never a block
        paths = {p: k for p, k in paths.items()
                 if not (_inside(p, classifier) or _inside(classifier, p))}
    ranked = sorted(paths, key=lambda p: paths[p])
    modules = dict(model.named_modules())
    # nested paths (a stage and one of its blocks) would overlap: keep the outermost, in group order
    kept = {n for n, _ in outermost(sorted(((p, modules[p]) for p in ranked if p in modules),
                                           key=lambda pm: order.get(pm[0], 0)))}
    return [p for p in ranked if p in kept]


def timm_models_inside(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost timm models inside a model of the user's own (a backbone under a head of theirs, a siamese
    pair), by path: timm's classes with a ``group_matcher``, ``model`` itself left out."""
    found = [(n, m) for n, m in model.named_modules()
             if n and type(m).__module__.startswith("timm.") and hasattr(m, "group_matcher")]
    return outermost(found)


@register_adapter
class TimmAdapter(Adapter):
    """timm models: blocks from timm's group matcher, image batches from ``pretrained_cfg``, cross-entropy.

    >>> import timm
    >>> model = timm.create_model("resnet18", pretrained=False)
    >>> [u.name for u in TimmAdapter().units(model)][:3]
    ['layer1.0', 'layer1.1', 'layer2.0']
    """

    name = "timm"
    priority = 30

    def matches(self, model: nn.Module) -> bool:
        if not _timm_loaded():
            return False
        _register_layers()
        return type(model).__module__.startswith("timm.")

    def units(self, model: nn.Module) -> list[Unit]:
        _register_layers()
        modules = dict(model.named_modules())
        units = [Unit(p, modules[p]) for p in timm_block_paths(model)]
        if len(units) < 2:
            units = sequential_units(model)
        return with_registered_blocks(model, units)

    def example_batch(self, model: nn.Module, batch_size: int, image_size: int | None = None, **sizes: Any) -> Batch:
        """Random images of the model's input size and random labels in ``model.num_classes``.

        Args:
            model: a timm model.
            batch_size: images per batch.
            image_size: height = width; default from ``model.patch_embed.img_size`` (which follows an
                ``img_size=`` override) or ``model.pretrained_cfg["input_size"]``.

        Shapes:
            args: ``(batch_size, C, H, W)`` float32; target: ``(batch_size,)`` int64.
        """
        drop_foreign_sizes(self.name, sizes, ("image_size",))
        cfg = getattr(model, "pretrained_cfg", None) or {}
        c, h, w = tuple(cfg.get("input_size", (3, 224, 224)))
        patch_embed = getattr(model, "patch_embed", None)
        pe_size = getattr(patch_embed, "img_size", None)
        if isinstance(pe_size, (tuple, list)) and len(pe_size) == 2 and all(isinstance(s, int) for s in pe_size):
            h, w = pe_size
        first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        if first_conv is not None:
            c = first_conv.in_channels
        if image_size is not None:
            h = w = int(image_size)
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        images = torch.randn(batch_size, c, h, w, device=device)
        num_classes = int(getattr(model, "num_classes", 0) or cfg.get("num_classes", 1000) or 1000)
        target = torch.randint(0, num_classes, (batch_size,), device=device)
        return Batch(args=(images,), target=target)

    def loss(self, model: nn.Module, batch: Batch, output: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor) and isinstance(batch.target, torch.Tensor):
            return nn.functional.cross_entropy(output.float(), batch.target)
        return default_loss(output, batch.target)

    native_flags = ("grad_checkpointing",)

    def native_checkpointing(self, model: nn.Module) -> bool:
        """timm's ``set_grad_checkpointing(True)`` sets ``grad_checkpointing`` on the model and its stages."""
        return any(getattr(m, "grad_checkpointing", False) is True for m in model.modules())

    def set_native_checkpointing(self, model: nn.Module, enable: bool) -> bool:
        fn = getattr(model, "set_grad_checkpointing", None)
        if fn is None:
            return False
        try:
            fn(enable)
        except (NotImplementedError, AssertionError) as exc:
            logger.info("%s has no native gradient checkpointing: %s", type(model).__name__, exc)
            return False
        return True
