"""The zoo catalogue: every ZOO_MATRIX model builds small, gets its adapter, and trains one step on CPU."""

from __future__ import annotations

import pytest
import torch

from zoomem import zoo
from zoomem.adapters.base import Unit

EXPECTED_ADAPTER = {"timm": "timm", "hf": "transformers", "pyg": "pyg"}


def _forward_order(model: torch.nn.Module, units: list[Unit], batch) -> list[str]:
    """Unit names in the order their modules are first entered during one forward."""
    seen: list[str] = []
    handles = []
    for u in units:
        def hook(module, args, kwargs=None, _name=u.name):  # noqa: ARG001
            if _name not in seen:
                seen.append(_name)
        handles.append(u.module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            batch.call(model)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("model_id", zoo.ZOO_MATRIX)
def test_matrix_model_trains_one_step(model_id: str) -> None:
    model, adapter, batch = zoo.small(model_id)
    assert adapter.name == EXPECTED_ADAPTER[model_id.split("/")[0]]

    units = adapter.units(model)
    names = [u.name for u in units]
    assert len(units) >= 2, names
    modules = dict(model.named_modules())
    for u in units:
        assert modules[u.name] is u.module
    for a in names:  # non-overlapping
        assert not any(b != a and b.startswith(a + ".") for b in names), names
    assert len(set(names)) == len(names)
    assert _forward_order(model, units, batch) == names

    model.zero_grad(set_to_none=True)
    out = batch.call(model)
    loss = adapter.loss(model, batch, out)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None for g in grads)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)


def test_small_is_deterministic_and_keeps_global_rng() -> None:
    state = torch.random.get_rng_state()
    m1, _, b1 = zoo.small("pyg/gcn")
    m2, _, b2 = zoo.small("pyg/gcn")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(b1.tensors(), b2.tensors()))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_matrix_covers_every_zoo_and_has_small_variants() -> None:
    assert set(zoo.ZOO_MATRIX) == set(zoo.SMALL)
    assert {m.split("/")[0] for m in zoo.ZOO_MATRIX} == {"timm", "hf", "pyg"}
    assert zoo.small_overrides("timm/vit_tiny_patch16_224")["img_size"] == 64
    assert zoo.small_overrides("timm/not-in-table") == {}
    listed = zoo.list_models()
    for mid in ("hf/bert-base-uncased", "hf/bert-large-uncased", "hf/gpt2", "hf/llama", "hf/t5-small", "hf/bart-base",
                "hf/vit-base-patch16-224", "pyg/gcn", "pyg/gat", "pyg/sage", "pyg/gin", "timm/resnet50"):
        assert mid in listed


@pytest.mark.parametrize("bad", ["foo/bar", "nonsense", "pyg/transformer", "hf/", "timm/"])
def test_unknown_id_lists_known_ids(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        zoo.build(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    assert "hf/gpt2" in msg and "pyg/gcn" in msg and "timm/<any timm model name>" in msg


def test_unknown_timm_name_suggests() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        zoo.build("timm/resnet18x")


def test_unknown_hf_name_without_hub_lists_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError) as err:
        zoo.build("hf/some-org/some-model")
    msg = str(err.value)
    assert "no network" in msg and "hf/bert-base-uncased" in msg and "hf/llama" in msg


def test_hf_overrides_are_config_fields() -> None:
    model, adapter = zoo.build("hf/gpt2", n_layer=1, n_embd=64, n_head=2)
    assert model.config.n_layer == 1 and len(adapter.units(model)) == 1
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="n_layr"):
        zoo.build("hf/gpt2", n_layr=1)


def test_hf_layout_table() -> None:
    large = zoo.HF_MODELS["bert-large-uncased"].fields
    assert (large["hidden_size"], large["num_hidden_layers"], large["num_attention_heads"],
            large["intermediate_size"]) == (1024, 24, 16, 4096)
    model, adapter = zoo.build("hf/albert-base-v2", num_hidden_layers=2)  # (AlbertConfig's default is xxlarge)
    assert (model.config.hidden_size, model.config.embedding_size) == (768, 128)
    assert [u.name for u in adapter.units(model)] == ["albert.encoder.albert_layer_groups.0.albert_layers.0"]
    assert "REDUCED" in zoo.HF_MODELS["llama"].doc


def test_pyg_defaults_and_overrides() -> None:
    model, adapter = zoo.build("pyg/sage", num_layers=4, out_channels=5)
    assert (model.in_channels, model.out_channels, model.num_layers) == (128, 5, 4)
    assert [u.name for u in adapter.units(model)] == [f"convs.{i}" for i in range(4)]


def test_example_batch_convenience() -> None:
    model, _ = zoo.build("timm/resnet18", num_classes=7)
    batch = zoo.example_batch(model, 3, image_size=32)
    assert tuple(batch.args[0].shape) == (3, 3, 32, 32)
    assert int(batch.target.max()) < 7
    graph = zoo.example_batch("pyg/gcn", 1, num_nodes=50, num_edges=200)
    assert tuple(graph.args[0].shape) == (50, 128) and tuple(graph.args[1].shape) == (2, 200)


def test_hf_local_config_builds_offline(tmp_path) -> None:
    from transformers import BertConfig

    BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
               architectures=["BertForMaskedLM"]).save_pretrained(tmp_path)
    for where in (str(tmp_path), str(tmp_path / "config.json")):
        model, adapter = zoo.build(f"hf/{where}", num_hidden_layers=1)
        assert type(model).__name__ == "BertForMaskedLM" and adapter.name == "transformers"
        assert len(adapter.units(model)) == 1  # the override reached the config
