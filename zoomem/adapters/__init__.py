"""Adapters: what zoomem knows about each model zoo (timm, HF transformers, PyG, any nn.Module)."""

from .base import Adapter, Unit, default_loss
from .registry import ADAPTERS, LAYERS, LayerSpec, get_adapter, layer_spec, register_adapter, register_layer

__all__ = [
    "ADAPTERS",
    "LAYERS",
    "Adapter",
    "LayerSpec",
    "Unit",
    "default_loss",
    "get_adapter",
    "layer_spec",
    "register_adapter",
    "register_layer",
]
