"""The HuggingFace transformers adapter: any ``transformers.PreTrainedModel``, bare or inside a PEFT wrapper.

Units are the outermost ``transformers.modeling_layers.GradientCheckpointingLayer`` instances, HF's own notion of
a checkpointable layer (``bert.encoder.layer.3``, ``transformer.h.0``, ``model.layers.7``, ``encoder.block.1``);
models with none fall back to the generic split. The example batch follows ``model.main_input_name`` and the head
(labels go in ``kwargs`` so the model returns ``.loss``). The SDPA aten ops are registered as attention at import;
the ``*Attention`` layer classes once transformers' modeling code is imported.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

import torch
from torch import nn

from ..batch import Batch
from ..ops.registry import register_op
from .base import Adapter, Unit, default_loss
from .generic import drop_foreign_sizes, outermost, sequential_units, with_registered_blocks
from .registry import LAYERS, register_adapter, register_layer

__all__ = ["TransformersAdapter", "HF_ATTENTION_OPS", "HF_MATH_ATTENTION_OPS", "hf_core", "hf_models_inside",
           "is_hf_layer", "register_attention_layers"]

logger = logging.getLogger(__name__)

HF_ATTENTION_OPS: tuple[str, ...] = (
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)
"""aten ops behind ``attn_implementation="sdpa"`` (every SDPA backend, forward and backward)."""

_ATTENTION_MODULES = ("bert", "gpt2", "llama", "t5", "vit")
"""transformers.models.<name>.modeling_<name> modules whose ``*Attention`` classes are registered up front."""

_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")
_SEQUENCE_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification")


HF_MATH_ATTENTION_OPS: dict[str, str] = {"_safe_softmax": "softmax"}
"""Ops of SDPA's math path, which training takes on CPU whenever attention dropout is on (BERT, GPT-2, T5):
``_safe_softmax`` (a softmax whose fully masked rows give 0) between two ``bmm`` and a ``native_dropout``."""


def _register_ops() -> None:
    kinds = {**{n: "attention" for n in HF_ATTENTION_OPS}, **HF_MATH_ATTENTION_OPS}
    for n, kind in kinds.items():
        try:
            register_op(f"aten.{n}", kind=kind, zoo="transformers")
        except ValueError as exc:  # registered under another category by someone else: keep theirs
            logger.debug("not registering aten.%s as %s: %s", n, kind, exc)


_register_ops()

_layers_registered = False


def _hf_loaded() -> bool:
    return "transformers.modeling_utils" in sys.modules


def register_attention_layers(classes: list[type]) -> None:
    """Register HF classes named ``*Attention`` as ``kind="attention"`` (skipping any already registered)."""
    for cls in classes:
        if (
            isinstance(cls, type)
            and issubclass(cls, nn.Module)
            and cls.__name__.endswith("Attention")
            and cls.__module__.startswith("transformers.")
            and cls not in LAYERS
        ):
            register_layer(cls, kind="attention", zoo="transformers")


def _register_layers() -> None:
    global _layers_registered
    if _layers_registered:
        return
    _layers_registered = True
    for name in _ATTENTION_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # pragma: no cover - a model family removed from transformers
            continue
        register_attention_layers([v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__])


if _hf_loaded():
    _register_layers()


MLM_PROBABILITY = 0.15
"""Share of the tokens a masked-LM example batch labels (``DataCollatorForLanguageModeling``'s default)."""


SHARED_LAYERS = frozenset({"AlbertLayer"})
"""HF layers that one module runs for every layer of the model (ALBERT shares its layer across depth) and that are
no ``GradientCheckpointingLayer``: each is a unit, and planning splits its calls into units of their own
(:mod:`zoomem.runtime.calls`); the generic split took the whole backbone as one unit."""


def _checkpointing_layer() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module``'s class is transformers' own (a ``GPT2Block``, ``LlamaDecoderLayer``, ...) or derives from
    one (a user's ``class MyBlock(GPT2Block)``): the layers whose recomputation needs
    :meth:`TransformersAdapter.recompute_inputs`, whatever model holds them."""
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def hf_models_inside(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``PreTrainedModel`` modules inside a model of the user's own (a backbone under a head of
    theirs), by path, ``model`` itself left out."""
    if not _hf_loaded():
        return []
    from transformers import PreTrainedModel

    return outermost([(n, m) for n, m in model.named_modules() if n and isinstance(m, PreTrainedModel)])


def hf_core(model: nn.Module) -> nn.Module | None:
    """The ``PreTrainedModel`` that ``model`` is, or that a PEFT wrapper (``PeftModel``: LoRA, prefix tuning, ...)
    holds through ``get_base_model()``; ``None`` for anything else. A PEFT model is an ``nn.Module`` of its own, not
    a ``PreTrainedModel``, but it trains the same layers with the same keyword batches, so it needs this adapter's
    units and KV-cache handling: under the generic one, a recomputed GPT-2 block wrote its keys and values to the
    cache a second time and checkpointing raised."""
    if not _hf_loaded():  # no HF model exists before transformers' modeling code is imported: never import it here
        return None
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    base = getattr(type(model), "get_base_model", None)
    if base is None:
        return None
    try:
        core = model.get_base_model()  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - a wrapper whose accessor fails is not one we know
        return None
    return core if isinstance(core, PreTrainedModel) and core is not model else None


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu"), torch.float32
    return param.device, (param.dtype if param.is_floating_point() else torch.float32)


def _refuse_filled_cache(unit: nn.Module, cache: Any) -> None:
    """Raise where the cache a layer gets already holds positions before the step (PEFT prefix tuning passes its
    learned prefix so; a prompt cache too): dropping it, as a recomputed layer's forward must, would change what
    the layer attends to, and keeping it would make the recomputation read the layer's own keys twice. (Torch
    raised a shape mismatch from inside HF's attention mask code before.) Planning such units as never recomputed
    is not built."""
    idx = next((m.layer_idx for m in unit.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)
    if idx is None:  # the positions the earlier layers of this step added are not this layer's
        return
    try:
        held = int(cache.get_seq_length(idx))
    except Exception:  # noqa: BLE001 - not a cache we can read: an empty one is all training passes
        return
    if held > 0:
        raise ValueError(
            f"zoomem cannot plan this model: the model passes {type(unit).__name__} a key/value cache that already "
            f"holds {held} positions (PEFT prefix tuning's prefix, or a prompt cache), and every plan measures "
            "recomputing its layers, which would not see that cache as their forward did. Fine-tune with LoRA "
            "(peft.LoraConfig), whose layers read no cache, or train this model without zoomem (zoomem.unwrap).")


@register_adapter
class TransformersAdapter(Adapter):
    """HF transformers models: ``GradientCheckpointingLayer`` units, batches from the config, the model's own loss.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128))
    >>> [u.name for u in TransformersAdapter().units(model)]
    ['encoder.layer.0', 'encoder.layer.1']
    """

    name = "transformers"
    priority = 20

    def matches(self, model: nn.Module) -> bool:
        if not _hf_loaded():
            return False
        _register_layers()
        return hf_core(model) is not None

    def units(self, model: nn.Module) -> list[Unit]:
        _register_layers()
        register_attention_layers(list({type(m) for m in model.modules()}))
        gc_layer = _checkpointing_layer()
        found = [(n, m) for n, m in model.named_modules() if gc_layer is not None and isinstance(m, gc_layer)]
        units = [Unit(n, m) for n, m in outermost(found)]
        if not units:
            units = [Unit(n, m) for n, m in model.named_modules()
                     if type(m).__name__ in SHARED_LAYERS and is_hf_layer(m)] or sequential_units(model)
        return with_registered_blocks(model, units)

    def example_batch(
        self,
        model: nn.Module,
        batch_size: int,
        seq_len: int | None = None,
        image_size: int | None = None,
        **sizes: Any,
    ) -> Batch:
        """A random batch for ``model.main_input_name``, with labels for the model's head.

        Args:
            model: a ``PreTrainedModel`` or a PEFT model holding one (its config, inputs and head decide).
            batch_size: rows of the batch.
            seq_len: tokens per row for text models; default ``min(128, max_position_embeddings)``.
            image_size: height = width for vision models; default ``config.image_size``.

        Returns:
            ``Batch(kwargs={input, attention_mask?, labels?, use_cache=False?}, target=None)``: labels are
            ``(b,)`` class ids for sequence/image classification, ``input_ids`` for causal LMs, ``input_ids`` at
            :data:`MLM_PROBABILITY` of the positions (``-100`` elsewhere, as HF's MLM collator makes) for masked LMs,
            ``(b, seq_len)`` random ids for encoder-decoder LMs (with ``decoder_input_ids``, the labels shifted right), none
            for base models without a head.

        Raises:
            NotImplementedError: the main input is neither ``input_ids`` nor ``pixel_values``.
        """
        drop_foreign_sizes(self.name, sizes, ("seq_len", "image_size"))
        model = hf_core(model) or model  # a PEFT wrapper passes the same keyword arguments through
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        main = getattr(model, "main_input_name", "input_ids")
        device, dtype = _device_dtype(model)
        params = _forward_params(model)
        cls_name = type(model).__name__
        kwargs: dict[str, Any] = {}
        if main == "input_ids":
            max_pos = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
            length = int(seq_len) if seq_len is not None else min(128, int(max_pos or 128))
            vocab = int(text_config.vocab_size)
            input_ids = torch.randint(0, vocab, (batch_size, length), device=device)
            kwargs["input_ids"] = input_ids
            if "attention_mask" in params:
                kwargs["attention_mask"] = torch.ones(batch_size, length, dtype=torch.long, device=device)
        elif main == "pixel_values":
            size = image_size if image_size is not None else getattr(config, "image_size", 224)
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            channels = int(getattr(config, "num_channels", 3))
            kwargs["pixel_values"] = torch.randn(batch_size, channels, h, w, device=device, dtype=dtype)
            length = None
        else:
            raise NotImplementedError(
                f"The 'transformers' adapter builds example batches for main_input_name 'input_ids' or "
                f"'pixel_values', not {main!r} ({cls_name}): pass a real batch instead."
            )

        is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))
        if "labels" in params:
            num_labels = int(getattr(config, "num_labels", 2))
            if is_enc_dec and length is not None:
                labels = torch.randint(0, int(text_config.vocab_size), (batch_size, length), device=device)
                kwargs["labels"] = labels
                if "decoder_input_ids" in params:  # shift right ourselves: v5 configs may lack decoder_start_token_id
                    start = getattr(config, "decoder_start_token_id", None)
                    start = getattr(config, "pad_token_id", None) if start is None else start
                    first = torch.full((batch_size, 1), int(start or 0), dtype=labels.dtype, device=device)
                    kwargs["decoder_input_ids"] = torch.cat([first, labels[:, :-1]], dim=1)
            elif cls_name.endswith(_SEQUENCE_HEADS):
                if num_labels == 1:  # regression head (MSE)
                    kwargs["labels"] = torch.randn(batch_size, device=device, dtype=dtype)
                else:
                    kwargs["labels"] = torch.randint(0, num_labels, (batch_size,), device=device)
            elif cls_name.endswith("ForTokenClassification") and length is not None:
                kwargs["labels"] = torch.randint(0, num_labels, (batch_size, length), device=device)
            elif cls_name.endswith("ForMaskedLM") and "input_ids" in kwargs:  # as HF's MLM collator labels them
                ids = kwargs["input_ids"]
                picked = torch.rand(ids.shape, device=device) < MLM_PROBABILITY
                picked[:, 0] = True  # at least one label per sequence
                kwargs["labels"] = torch.where(picked, ids, torch.full_like(ids, -100))
            elif cls_name.endswith(_LM_HEADS) and "input_ids" in kwargs:
                kwargs["labels"] = kwargs["input_ids"].clone()
            else:
                logger.debug("no example labels for %s: the planning loss uses its outputs", cls_name)
        elif is_enc_dec and length is not None and "decoder_input_ids" in params:
            kwargs["decoder_input_ids"] = torch.randint(0, int(text_config.vocab_size), (batch_size, length), device=device)
        if "use_cache" in params:
            kwargs["use_cache"] = False
        return Batch(kwargs=kwargs, target=None)

    def loss(self, model: nn.Module, batch: Batch, output: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        return default_loss(output, batch.target)

    def recompute_inputs(self, unit: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """As HF's ``GradientCheckpointingLayer`` does under its own checkpointing: no ``use_cache``, and no
        key/value cache (``cache``, ``layer_past``, or a ``Cache`` passed by position, as ``GPT2Model`` passes it
        to its blocks) unless the layer only reads it. A recomputation would otherwise append the layer's keys and
        values to the cache a second time (T5's decoder trains with ``use_cache=True`` by default, and so does
        GPT-2 where the batch does not say ``use_cache=False``: its ``config.use_cache`` is the default) and,
        reading twice as many keys, save other tensors than its forward did. HF's own checkpointing is spared the
        positional case because ``GPT2Model`` passes ``None`` itself while its flag is on."""
        changed = dict(kwargs)
        if changed.get("use_cache"):
            changed["use_cache"] = False
        if getattr(unit, "_can_checkpoint_with_cache", False):
            return args, changed
        for name in ("cache", "layer_past"):
            if changed.get(name) is not None:
                _refuse_filled_cache(unit, changed[name])
                changed[name] = None
        from transformers.cache_utils import Cache

        if any(isinstance(a, Cache) for a in args):
            for a in args:
                _refuse_filled_cache(unit, a)
            args = tuple(None if isinstance(a, Cache) else a for a in args)
        return args, changed

    native_flags = ("gradient_checkpointing", "_gradient_checkpointing_func")

    def native_checkpointing(self, model: nn.Module) -> bool:
        core = hf_core(model) or model
        on = getattr(core, "is_activation_checkpointing", None)  # transformers 5's name (the old one warns)
        return bool(getattr(core, "is_gradient_checkpointing", False) if on is None else on)

    def set_native_checkpointing(self, model: nn.Module, enable: bool) -> bool:
        supported = bool(getattr(model, "supports_gradient_checkpointing", False))
        if not supported:
            return False
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so (the old is deprecated)
            if enable:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.activation_checkpointing_disable()
        elif enable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        return supported
