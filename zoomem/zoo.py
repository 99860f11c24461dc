"""The model catalogue: ids the CLI, tests, benchmarks and recipes build models from, without downloading.

Ids:

- ``timm/<name>``: any model name ``timm.is_model`` accepts, built with ``pretrained=False``; overrides go to
  ``timm.create_model`` (``num_classes=10``, ``img_size=64``, ...).
- ``hf/<name>``: a layout from the built-in table (:data:`HF_MODELS`), built from its config class with random
  weights and ``attn_implementation="sdpa"``; overrides are fields of that config class, with its own names
  (GPT-2: ``n_layer``/``n_embd``/``n_head``/``n_inner``; T5: ``num_layers``/``num_decoder_layers``/``d_model``/
  ``d_ff``; the others ``num_hidden_layers``/``hidden_size``/``num_attention_heads``/``intermediate_size``).
  A name not in the table goes to ``transformers.AutoConfig.from_pretrained``: a local ``config.json`` or a folder
  holding one works offline (built as its ``architectures`` entry says); a Hub name needs the network.
- ``pyg/gcn``, ``pyg/gat``, ``pyg/sage``, ``pyg/gin``: ``torch_geometric.nn.models`` GNNs; overrides are their
  constructor arguments (``in_channels``, ``hidden_channels``, ``num_layers``, ``out_channels``, ...).

:data:`ZOO_MATRIX` lists the models every test and benchmark runs, and :func:`small` builds CPU-test-sized
variants of them with a seeded example batch.

>>> model, adapter = build("timm/resnet18", num_classes=10)
>>> adapter.name
'timm'
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adapters.base import Adapter
from .adapters.registry import get_adapter
from .batch import Batch

__all__ = [
    "HF_MODELS",
    "PYG_MODELS",
    "SMALL",
    "SmallSpec",
    "ZOO_MATRIX",
    "build",
    "example_batch",
    "list_models",
    "small",
    "small_overrides",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFLayout:
    """One ``hf/<name>`` entry: config class, model class (names in ``transformers``) and config fields."""

    config_cls: str
    model_cls: str
    fields: dict[str, Any] = field(default_factory=dict)
    doc: str = ""


HF_MODELS: dict[str, HFLayout] = {
    "albert-base-v2": HFLayout(
        "AlbertConfig",
        "AlbertForSequenceClassification",
        {"embedding_size": 128, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
        "ALBERT-base layout (12 x 768, one layer shared across depth: planned call by call), classification head",
    ),
    "bart-base": HFLayout(
        "BartConfig",
        "BartForConditionalGeneration",
        {"d_model": 768, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 12,
         "decoder_attention_heads": 12, "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072},
        "BART-base layout (6+6 x 768, 12 heads), encoder-decoder LM head with its final_logits_bias",
    ),
    "bert-base-uncased": HFLayout(
        "BertConfig", "BertForSequenceClassification", {}, "BERT-base layout (12 x 768, 12 heads), classification head"
    ),
    "bert-base-uncased-mlm": HFLayout(
        "BertConfig", "BertForMaskedLM", {}, "BERT-base layout, masked-LM head (tied to the word embeddings), as pretrained"
    ),
    "bert-large-uncased": HFLayout(
        "BertConfig",
        "BertForSequenceClassification",
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
        "BERT-large layout (24 x 1024, 16 heads), classification head",
    ),
    "gpt2": HFLayout("GPT2Config", "GPT2LMHeadModel", {}, "GPT-2 small layout (12 x 768), LM head"),
    "llama": HFLayout(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 1376,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
        },
        "a REDUCED Llama layout (8 x 512, 8 heads, MLP 1376, vocab 32000), not a released checkpoint's size",
    ),
    "t5-small": HFLayout(
        "T5Config",
        "T5ForConditionalGeneration",
        {"decoder_start_token_id": 0},
        "T5-small layout (6+6 x 512), encoder-decoder LM head",
    ),
    "vit-base-patch16-224": HFLayout(
        "ViTConfig", "ViTForImageClassification", {}, "ViT-B/16 layout at 224 px, classification head"
    ),
}
"""Built-in ``hf/<name>`` layouts (no download)."""

PYG_MODELS: dict[str, str] = {"gcn": "GCN", "gat": "GAT", "sage": "GraphSAGE", "gin": "GIN"}
"""``pyg/<name>`` -> class in ``torch_geometric.nn.models``."""

PYG_DEFAULTS: dict[str, Any] = {"in_channels": 128, "hidden_channels": 256, "num_layers": 3, "out_channels": 16}
"""Constructor defaults of the ``pyg/*`` models (each overridable)."""

_HF_PASSTHROUGH = {"attn_implementation", "dtype", "torch_dtype"}


@dataclass(frozen=True)
class SmallSpec:
    """A CPU-test-sized variant of a zoo model: build overrides, batch size and example-batch sizes."""

    overrides: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 2
    sizes: dict[str, int] = field(default_factory=dict)


_TIMM_SIZES = {"image_size": 64}
_TEXT_SIZES = {"seq_len": 64}
_GRAPH = SmallSpec(
    {"in_channels": 32, "hidden_channels": 64, "num_layers": 3, "out_channels": 8},
    batch_size=1,
    sizes={"num_nodes": 2000, "num_edges": 20000},
)

SMALL: dict[str, SmallSpec] = {
    "timm/resnet18": SmallSpec({"num_classes": 10}, 2, _TIMM_SIZES),
    "timm/resnet50": SmallSpec({"num_classes": 10}, 2, _TIMM_SIZES),
    "timm/mobilenetv2_100": SmallSpec({"num_classes": 10}, 2, _TIMM_SIZES),
    "timm/efficientnet_b0": SmallSpec({"num_classes": 10}, 2, _TIMM_SIZES),
    "timm/convnext_atto": SmallSpec({"num_classes": 10}, 2, _TIMM_SIZES),
    "timm/vit_tiny_patch16_224": SmallSpec({"num_classes": 10, "img_size": 64}, 2, _TIMM_SIZES),
    "hf/bert-base-uncased": SmallSpec(
        {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512}, 2, _TEXT_SIZES
    ),
    "hf/gpt2": SmallSpec({"n_layer": 2, "n_embd": 128, "n_head": 4, "n_inner": 512}, 2, _TEXT_SIZES),
    "hf/llama": SmallSpec(
        {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 344},
        2,
        _TEXT_SIZES,
    ),
    "hf/t5-small": SmallSpec(
        {"num_layers": 2, "num_decoder_layers": 2, "d_model": 128, "d_kv": 32, "num_heads": 4, "d_ff": 512},
        2,
        _TEXT_SIZES,
    ),
    "hf/bart-base": SmallSpec(
        {"encoder_layers": 2, "decoder_layers": 2, "d_model": 128, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512},
        2,
        _TEXT_SIZES,
    ),
    "hf/vit-base-patch16-224": SmallSpec(
        {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512,
         "image_size": 64, "num_labels": 10},
        2,
        {"image_size": 64},
    ),
    "pyg/gcn": _GRAPH,
    "pyg/gat": _GRAPH,
    "pyg/sage": _GRAPH,
    "pyg/gin": _GRAPH,
}
"""CPU-test-sized variants of the :data:`ZOO_MATRIX` models (a few seconds each for a training step on CPU)."""

ZOO_MATRIX: list[str] = list(SMALL)
"""The models every test, benchmark and recipe matrix covers."""


def list_models(include_all_timm: bool = False) -> list[str]:
    """The catalogued model ids.

    Args:
        include_all_timm: list every ``timm/<name>`` timm knows (about 1300) instead of only the matrix ones;
            any timm model name works with :func:`build` either way.
    """
    ids = [f"hf/{n}" for n in HF_MODELS] + [f"pyg/{n}" for n in PYG_MODELS]
    if include_all_timm:
        import timm

        ids += [f"timm/{n}" for n in timm.list_models()]
    else:
        ids += [m for m in ZOO_MATRIX if m.startswith("timm/")]
    return sorted(ids)


def _unknown(model_id: str, detail: str = "") -> ValueError:
    known = list_models()
    close = difflib.get_close_matches(model_id, known, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(
        f"Unknown model id {model_id!r}.{(' ' + detail) if detail else ''}{hint} Known ids: {', '.join(known)}, "
        "and 'timm/<any timm model name>' (see timm.list_models())."
    )


def _build_timm(name: str, overrides: dict[str, Any]) -> nn.Module:
    try:
        import timm
    except ImportError as exc:
        raise ImportError("timm models need timm: `pip install timm`.") from exc
    if not timm.is_model(name):
        close = timm.list_models(f"*{name}*")[:8] or difflib.get_close_matches(name, timm.list_models(), n=5)
        hint = f" Close timm names: {', '.join(close)}." if close else ""
        raise _unknown(f"timm/{name}", f"timm has no model named {name!r}.{hint}")
    return timm.create_model(name, pretrained=False, **overrides)


def _build_hf(name: str, overrides: dict[str, Any]) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("hf/ models need transformers: `pip install transformers`.") from exc
    layout = HF_MODELS.get(name)
    if layout is not None:
        config_cls = getattr(transformers, layout.config_cls)
        default = config_cls()
        unknown = sorted(
            k for k in overrides if k not in _HF_PASSTHROUGH and k not in layout.fields and not hasattr(default, k)
        )
        if unknown:
            raise ValueError(
                f"{layout.config_cls} has no field(s) {unknown} (model id 'hf/{name}'). Use the config's own "
                f"field names, e.g. {sorted(k for k in default.to_dict() if not k.startswith('_'))[:40]}."
            )
        kwargs = {"attn_implementation": "sdpa", **layout.fields, **overrides}
        config = config_cls(**kwargs)
        return getattr(transformers, layout.model_cls)(config)
    try:
        config = transformers.AutoConfig.from_pretrained(name, **overrides)
    except Exception as exc:  # noqa: BLE001 - offline, private, or no such repo: all say the same to the user
        raise _unknown(
            f"hf/{name}",
            f"It is not a built-in layout and transformers.AutoConfig.from_pretrained({name!r}) failed "
            f"({type(exc).__name__}: {exc}).",
        ) from exc
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_cls = getattr(transformers, arch, None) if arch else None
    try:
        config._attn_implementation = "sdpa"
        return model_cls(config) if model_cls is not None else transformers.AutoModel.from_config(config)
    except (ValueError, ImportError) as exc:  # the architecture has no SDPA path: use its default attention
        logger.info("hf/%s: no SDPA attention (%s); using the default implementation", name, exc)
        config._attn_implementation = None
        return model_cls(config) if model_cls is not None else transformers.AutoModel.from_config(config)


def _build_pyg(name: str, overrides: dict[str, Any]) -> nn.Module:
    try:
        from torch_geometric.nn import models
    except ImportError as exc:
        raise ImportError("pyg/ models need PyTorch Geometric: `pip install torch_geometric`.") from exc
    cls = getattr(models, PYG_MODELS[name])
    return cls(**{**PYG_DEFAULTS, **overrides})


def build(model_id: str, **overrides: Any) -> tuple[nn.Module, Adapter]:
    """Build a zoo model with random weights (nothing is downloaded for the built-in ids) and its adapter.

    Args:
        model_id: ``timm/<name>``, ``hf/<name>`` or ``pyg/<gcn|gat|sage|gin>`` (see the module docstring).
        **overrides: ``timm.create_model`` kwargs, config fields, or GNN constructor arguments.

    Returns:
        ``(model, adapter)``; the model is in training mode on the CPU.

    Raises:
        ValueError: unknown id (the message lists the known ones) or an unknown config field.

    >>> model, adapter = build("pyg/gcn", num_layers=2)
    >>> [u.name for u in adapter.units(model)]
    ['convs.0', 'convs.1']
    """
    zoo, _, name = model_id.partition("/")
    if zoo == "timm" and name:
        model = _build_timm(name, overrides)
    elif zoo == "hf" and name:
        model = _build_hf(name, overrides)
    elif zoo == "pyg" and name in PYG_MODELS:
        model = _build_pyg(name, overrides)
    else:
        raise _unknown(model_id)
    model.train()
    return model, get_adapter(model)


def example_batch(model_id_or_model: str | nn.Module, batch_size: int, **sizes: int) -> Batch:
    """An example batch for a zoo id (the model is built for it) or for a model, through its adapter.

    >>> example_batch("pyg/gcn", 1, num_nodes=100).args[0].shape
    torch.Size([100, 128])
    """
    if isinstance(model_id_or_model, str):
        model, adapter = build(model_id_or_model)
    else:
        model, adapter = model_id_or_model, get_adapter(model_id_or_model)
    return adapter.example_batch(model, batch_size, **sizes)


def small_overrides(model_id: str) -> dict[str, Any]:
    """The build overrides of the small variant of ``model_id`` (``{}`` for ids without one)."""
    spec = SMALL.get(model_id)
    return dict(spec.overrides) if spec is not None else {}


def small(model_id: str, seed: int = 0, batch_size: int | None = None) -> tuple[nn.Module, Adapter, Batch]:
    """Build the CPU-test-sized variant of a :data:`ZOO_MATRIX` model and its example batch, deterministically.

    The weights and the batch depend only on ``seed``; the caller's global RNG state is left untouched.

    Raises:
        ValueError: ``model_id`` has no small variant (the message lists those that do).

    >>> model, adapter, batch = small("timm/resnet18")
    >>> tuple(batch.args[0].shape)
    (2, 3, 64, 64)
    """
    spec = SMALL.get(model_id)
    if spec is None:
        raise ValueError(f"No small variant of {model_id!r}; the small variants are: {', '.join(SMALL)}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, adapter = build(model_id, **spec.overrides)
        batch = adapter.example_batch(model, batch_size or spec.batch_size, **spec.sizes)
    return model, adapter, batch
