"""Adapters: registration, unit finding, example batches, native checkpointing, registered ops."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zoomem import zoo
from zoomem.adapters import LAYERS, get_adapter, layer_spec, register_layer
from zoomem.batch import Batch
from zoomem.ops.registry import op_name, op_spec


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(op_name(func))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------- generic


class _MyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class _Net(nn.Module):
    """No Sequential/ModuleList at the top: blocks are attributes, a long Sequential hides inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.a = _MyBlock(8)
        self.b = _MyBlock(8)
        self.c = _MyBlock(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c(self.b(self.a(self.stem(x)))))


@pytest.fixture
def registered_block():
    register_layer(_MyBlock, kind="block", zoo="test")
    try:
        yield _MyBlock
    finally:
        LAYERS.pop(_MyBlock, None)


def test_generic_split_without_registration() -> None:
    net = _Net()
    adapter = get_adapter(net)
    assert adapter.name == "generic"
    # the longest (3 children), shallowest Sequential is a.inner
    assert [u.name for u in adapter.units(net)] == ["a.inner.0", "a.inner.1", "a.inner.2"]
    with pytest.raises(NotImplementedError, match="pass a real batch"):
        adapter.example_batch(net, 2)


def test_register_layer_makes_user_block_a_unit(registered_block) -> None:
    net = _Net()
    adapter = get_adapter(net)
    assert layer_spec(net.a).kind == "block"
    assert [u.name for u in adapter.units(net)] == ["a", "b", "c"]
    batch = Batch(args=(torch.randn(3, 4),))
    adapter.loss(net, batch, batch.call(net)).backward()
    assert all(p.grad is not None for p in net.parameters())


def test_generic_sequential_and_param_children() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert [u.name for u in get_adapter(seq).units(seq)] == ["0", "1", "2"]

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Linear(2, 2)
            self.act = nn.ReLU()
            self.y = nn.Linear(2, 2)

    flat = Flat()
    assert [u.name for u in get_adapter(flat).units(flat)] == ["x", "y"]


def test_registered_block_takes_precedence_in_zoo_adapter() -> None:
    from torch_geometric.nn.models import MLP

    model, adapter, _ = zoo.small("pyg/gin")
    assert [u.name for u in adapter.units(model)] == ["convs.0", "convs.1", "convs.2"]
    register_layer(MLP, kind="block", zoo="test")
    try:
        assert [u.name for u in adapter.units(model)] == ["convs.0.nn", "convs.1.nn", "convs.2.nn"]
    finally:
        LAYERS.pop(MLP, None)


def test_importing_adapters_does_not_import_zoos() -> None:
    code = (
        "import sys, torch\n"
        "from zoomem.adapters import get_adapter\n"
        "a = get_adapter(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))\n"
        "assert a.name == 'generic', a\n"
        "loaded = [m for m in ('timm', 'transformers', 'torch_geometric') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------------ timm


def test_timm_units_match_timm_groups() -> None:
    expected = {
        "timm/resnet18": ("layer1.0", 8),
        "timm/resnet50": ("layer1.0", 16),
        "timm/mobilenetv2_100": ("blocks.0.0", 17),
        "timm/efficientnet_b0": ("blocks.0.0", 16),
        "timm/convnext_atto": ("stages.0.blocks.0", 15),
        "timm/vit_tiny_patch16_224": ("blocks.0", 12),
    }
    for mid, (first, count) in expected.items():
        model, _ = zoo.build(mid, **zoo.small_overrides(mid))
        names = [u.name for u in get_adapter(model).units(model)]
        assert (names[0], len(names)) == (first, count), (mid, names)
    model, _ = zoo.build("timm/convnext_atto")
    names = [u.name for u in get_adapter(model).units(model)]
    assert "stages.1.downsample" in names and "stages.0.blocks.1" in names and "head.fc" not in names


def test_timm_example_batch_follows_model() -> None:
    model, adapter = zoo.build("timm/vit_tiny_patch16_224", img_size=64, num_classes=5)
    batch = adapter.example_batch(model, 3)
    assert tuple(batch.args[0].shape) == (3, 3, 64, 64)  # from patch_embed.img_size, not pretrained_cfg
    assert batch.target.shape == (3,) and int(batch.target.max()) < 5
    model, adapter = zoo.build("timm/resnet18")
    assert tuple(adapter.example_batch(model, 1).args[0].shape) == (1, 3, 224, 224)
    assert tuple(adapter.example_batch(model, 1, image_size=32).args[0].shape) == (1, 3, 32, 32)
    # a size of another zoo is ignored (one CLI size set serves mixed models), a typo is an error
    assert tuple(adapter.example_batch(model, 1, image_size=32, seq_len=7).args[0].shape) == (1, 3, 32, 32)
    with pytest.raises(TypeError, match="imagesize"):
        adapter.example_batch(model, 1, imagesize=32)


def test_timm_registered_layers() -> None:
    import timm.layers

    model, adapter = zoo.build("timm/resnet18")
    assert adapter.name == "timm"
    assert layer_spec(timm.layers.BatchNormAct2d(4)).kind == "norm_act"
    assert LAYERS[timm.layers.Attention].kind == "attention"
    vit, _ = zoo.build("timm/vit_tiny_patch16_224", img_size=32)
    assert layer_spec(vit.blocks[0].attn).kind == "attention"


@pytest.mark.parametrize("model_id", ["timm/resnet18", "timm/convnext_atto", "timm/vit_tiny_patch16_224"])
def test_timm_native_checkpointing_toggles(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    flags = lambda: {getattr(m, "grad_checkpointing") for m in model.modules() if hasattr(m, "grad_checkpointing")}  # noqa: E731
    assert flags() == {False}
    assert adapter.set_native_checkpointing(model, True) is True
    assert flags() == {True}
    adapter.loss(model, batch, batch.call(model)).backward()
    assert adapter.set_native_checkpointing(model, False) is True
    assert flags() == {False}


class _BackboneAndHead(nn.Module):
    """A model of the user's own: a timm backbone under a head of theirs."""

    def __init__(self, backbone: nn.Module, features: int | None = None) -> None:
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(features or backbone.num_features, 3)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.backbone(*args, **kwargs)
        return self.head(out if isinstance(out, torch.Tensor) else out.logits)


@pytest.mark.parametrize("model_id", ["timm/resnet50", "timm/convnext_atto"])
def test_a_timm_backbone_under_a_users_head_is_split_into_its_blocks(model_id: str) -> None:
    """A model of the user's own holding a timm backbone gets the backbone's blocks as units, as the timm adapter
    finds them in the bare model, and the backbone's own checkpointing is turned off while wrapped and back on
    after, as for a bare timm model. Before, the generic split took the longest ``ModuleList`` (one ResNet stage's
    blocks, 6 of ResNet-50's 16): under a head, at batch 16 and 128 px, the smallest budget a plan had was 83% of
    plain PyTorch's peak, now 55%."""
    import zoomem

    backbone, adapter = zoo.build(model_id, **{**zoo.small_overrides(model_id), "num_classes": 0})
    model = _BackboneAndHead(backbone)
    generic = get_adapter(model)
    assert generic.name == "generic"
    assert [u.name for u in generic.units(model)] == ["backbone." + u.name for u in adapter.units(backbone)]
    backbone.set_grad_checkpointing(True)
    zoomem.wrap(model)
    assert not any(getattr(m, "grad_checkpointing", False) for m in model.modules())
    zoomem.unwrap(model)
    assert any(getattr(m, "grad_checkpointing", False) for m in model.modules())


def test_an_hf_backbones_own_checkpointing_under_a_users_module_is_off_while_wrapped() -> None:
    """HF's ``gradient_checkpointing_enable()`` on a backbone inside a model of the user's own is turned off by
    wrap and back on by unwrap. Before, it stayed on: the trace took the checkpointed step for plain PyTorch's (a
    4-layer BERT under a head at 16 x 128 tokens read 31.9 MiB for it instead of 88.1, and a 60% budget was
    infeasible)."""
    import zoomem

    backbone, hf = zoo.build("hf/bert-base-uncased", **zoo.small_overrides("hf/bert-base-uncased"))
    model = _BackboneAndHead(backbone, features=backbone.config.num_labels)
    backbone.gradient_checkpointing_enable()
    assert get_adapter(model).name == "generic" and get_adapter(model).native_checkpointing(model)
    zoomem.wrap(model)
    assert not hf.native_checkpointing(backbone)
    zoomem.unwrap(model)
    assert hf.native_checkpointing(backbone)


# ---------------------------------------------------------------------------------------- transformers


def test_hf_example_batches_by_head() -> None:
    bert, a, b = zoo.small("hf/bert-base-uncased")
    assert tuple(b.kwargs["input_ids"].shape) == (2, 64) and tuple(b.kwargs["labels"].shape) == (2,)
    assert b.target is None and torch.equal(b.kwargs["attention_mask"], torch.ones(2, 64, dtype=torch.long))

    gpt2, a, b = zoo.small("hf/gpt2")
    assert torch.equal(b.kwargs["labels"], b.kwargs["input_ids"]) and b.kwargs["use_cache"] is False
    assert b.kwargs["labels"].data_ptr() != b.kwargs["input_ids"].data_ptr()

    t5, a, b = zoo.small("hf/t5-small")
    assert tuple(b.kwargs["labels"].shape) == (2, 64)
    assert torch.equal(b.kwargs["decoder_input_ids"][:, 1:], b.kwargs["labels"][:, :-1])

    bart, a, b = zoo.small("hf/bart-base")  # labels shifted right behind its decoder start token, no KV cache
    assert tuple(b.kwargs["labels"].shape) == (2, 64) and b.kwargs["use_cache"] is False
    assert torch.equal(b.kwargs["decoder_input_ids"][:, 1:], b.kwargs["labels"][:, :-1])

    mlm, a = zoo.build("hf/bert-base-uncased-mlm", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                       intermediate_size=64)
    b = a.example_batch(mlm, 8, seq_len=128)
    labels, ids = b.kwargs["labels"], b.kwargs["input_ids"]
    picked = labels != -100  # as HF's MLM collator labels them: ~15% of the tokens, the input's ids there
    assert 0.08 < float(picked.float().mean()) < 0.3 and picked[:, 0].all() and torch.equal(labels[picked], ids[picked])

    vit, a, b = zoo.small("hf/vit-base-patch16-224")
    assert tuple(b.kwargs["pixel_values"].shape) == (2, 3, 64, 64) and int(b.kwargs["labels"].max()) < 10

    from transformers import BertConfig, BertModel

    base = BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=40))
    b = get_adapter(base).example_batch(base, 2)
    assert "labels" not in b.kwargs and tuple(b.kwargs["input_ids"].shape) == (2, 40)  # min(128, max positions)
    get_adapter(base).loss(base, b, b.call(base)).backward()


def test_hf_fallback_without_checkpointing_layers() -> None:
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):
        model_type = "zoomem-tiny"

        def __init__(self, width: int = 8, **kwargs) -> None:
            self.width = width
            super().__init__(**kwargs)

    class Tiny(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config: TinyConfig) -> None:
            super().__init__(config)
            self.layers = nn.ModuleList([nn.Linear(config.width, config.width) for _ in range(3)])
            self.post_init()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Tiny(TinyConfig())
    adapter = get_adapter(model)
    assert adapter.name == "transformers"
    assert [u.name for u in adapter.units(model)] == ["layers.0", "layers.1", "layers.2"]
    assert adapter.set_native_checkpointing(model, True) is False


@pytest.mark.parametrize("model_id", ["hf/bert-base-uncased", "hf/llama"])
def test_hf_native_checkpointing_toggles(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    assert not model.is_activation_checkpointing
    assert adapter.set_native_checkpointing(model, True) is True
    assert model.is_activation_checkpointing
    loss = adapter.loss(model, batch, batch.call(model))
    loss.backward()
    assert torch.isfinite(loss)
    assert adapter.set_native_checkpointing(model, False) is True
    assert not model.is_activation_checkpointing


@pytest.mark.parametrize("model_id", ["hf/llama", "hf/bert-base-uncased"])
def test_hf_attention_registered(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    adapter.units(model)
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    assert layer_spec(attn).kind == "attention"
    with _Recorder() as rec:
        adapter.loss(model, batch, batch.call(model)).backward()
    # Llama (no attention dropout) runs the fused CPU kernel; BERT trains with attention dropout, which SDPA on
    # CPU runs on its math path (_safe_softmax)
    sdpa = {o for o in rec.ops if "scaled_dot_product" in o or o == "aten._safe_softmax"}
    assert sdpa, sorted(rec.ops)
    for o in sdpa:
        assert op_spec(o).zoo == "transformers" and op_spec(o).kind in ("attention", "softmax"), o
    for name in ("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_cudnn_attention"):
        assert op_spec(name).kind == "attention" and op_spec(name).zoo == "transformers"


# ------------------------------------------------------------------------------------------------- PyG

_PYG_FAMILY = ("scatter", "index", "gather", "segment", "sparse", "spmm")


@pytest.mark.parametrize("model_id", ["pyg/gcn", "pyg/gat"])
def test_pyg_registered_ops_cover_message_passing(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    with _Recorder() as rec:
        adapter.loss(model, batch, batch.call(model)).backward()
    assert {"aten.index_select", "aten.scatter_add_"} <= rec.ops, sorted(rec.ops)
    family = {o for o in rec.ops if any(k in o for k in _PYG_FAMILY)}
    for o in family:
        spec = op_spec(o)
        assert spec.zoo == "pyg" and spec.kind in ("scatter", "gather", "spmm"), (o, spec)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:Sparse invariant checks")
def test_pyg_registered_ops_cover_sparse_adjacency() -> None:
    from torch_geometric.utils import to_torch_csr_tensor

    model, adapter, batch = zoo.small("pyg/sage")
    x, edge_index = batch.args
    adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(x.shape[0], x.shape[0]))
    with _Recorder() as rec:
        nn.functional.cross_entropy(model(x, adj_t), batch.target).backward()
    spmm = {o for o in rec.ops if op_spec(o).kind == "spmm"}
    assert "aten._sparse_mm_reduce_impl" in spmm and all(op_spec(o).zoo == "pyg" for o in spmm)


def test_pyg_message_passing_registered_and_batch_shapes() -> None:
    from torch_geometric.nn.conv import MessagePassing

    model, adapter = zoo.build("pyg/gcn", in_channels=6, out_channels=3)
    assert LAYERS[MessagePassing].kind == "message_passing"
    assert layer_spec(model.convs[0]).kind == "message_passing"
    batch = adapter.example_batch(model, 2)
    x, edge_index = batch.args
    assert tuple(x.shape) == (2000, 6) and tuple(edge_index.shape) == (2, 20000)
    assert int(edge_index.max()) < 2000 and int(batch.target.max()) < 3
    conv = model.convs[0]
    assert [u.name for u in get_adapter(conv).units(conv)] == [""]
