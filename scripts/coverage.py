"""Wrap models beyond the zoo matrix and check their gradients against plain PyTorch's.

The tests cover the zoo matrix (``zoomem.zoo.ZOO_MATRIX``); users wrap far more. For each model here, built small
from its config (random weights, no download) with a generated batch, this script

- finds the smallest feasible lossless budget (``InfeasibleBudgetError.min_budget`` of a 5% budget), wraps the model
  at it (a fresh trace: the budget an error names must work for the user who follows it) and compares one step's
  loss and gradients with plain PyTorch's (the tests' tolerance: 1e-5 of each gradient's norm plus 1e-6 of the
  largest; bitwise where nothing compact runs);
- wraps it at ``L2`` (adaptive bits, sensitivities not refreshed; ``--levels`` for others) and compares three
  steps' gradients with plain PyTorch's: the worst squared error, relative to the squared gradient norm, must be
  within 3x the plan's predicted relative variance (``plan.variance``) - a first-order estimate that a backward
  reading a rounded value nonlinearly would break. It also names the parameter whose gradient is furthest off,
  relative to its norm. On the batch it planned on, no step may leave its plan (save other tensors than the
  plan names, a path planning's forward did not take), and a metered step may peak at most ``PEAK_SLACK`` times
  the plan's prediction.

    python scripts/coverage.py --markdown                     # every model (about 3.5 minutes on 2 CPU cores)
    python scripts/coverage.py --models timm:hrnet_w18_small hf:mistral pyg:pna
    python scripts/coverage.py --models timm:vit_tiny_patch16_224 --image-size 224 --levels L1.2 L2.2
    python scripts/coverage.py --models hf:distilbert --per-tensor 8 --markdown   # each tensor vs brute force

A model that fails to build or trace is reported with its error, not skipped silently.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zoomem  # noqa: E402
from zoomem import Batch  # noqa: E402
from zoomem.adapters import get_adapter  # noqa: E402
from zoomem.planner import InfeasibleBudgetError  # noqa: E402

TIMM = [
    "swin_tiny_patch4_window7_224", "deit_tiny_patch16_224", "eva02_tiny_patch14_224", "cait_xxs24_224",
    "levit_128s", "maxvit_tiny_rw_224", "mixer_s16_224", "poolformer_s12", "convnextv2_atto", "edgenext_xx_small",
    "regnetx_002", "densenet121", "hrnet_w18_small", "dla34", "res2net50_14w_8s", "resnetv2_50",
    "seresnext26d_32x4d", "xception41", "repvgg_a0", "rexnet_100", "ghostnet_100", "mobilenetv3_small_100",
]
"""timm models (beyond the matrix's ResNet, MobileNetV2, EfficientNet, ConvNeXt and ViT), at 64 px."""

_TXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 1000}
HF: dict[str, tuple[str, str, dict[str, Any]]] = {
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128, "vocab_size": 1000}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", _TXT),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", {**_TXT, "embedding_size": 32}),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", {**_TXT, "embedding_size": 32}),
    "deberta-v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", _TXT),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_TXT, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_TXT, "num_key_value_heads": 2}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_TXT, "num_key_value_heads": 2, "head_dim": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", _TXT),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _TXT),
    "opt": ("OPTConfig", "OPTForCausalLM", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                            "ffn_dim": 128, "vocab_size": 1000, "word_embed_proj_dim": 64}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000}),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                                                         "num_heads": 4, "vocab_size": 1000,
                                                         "decoder_start_token_id": 0}),
    "swin": ("SwinConfig", "SwinForImageClassification", {"image_size": 32, "patch_size": 4, "embed_dim": 16,
                                                          "depths": [1, 1], "num_heads": [2, 2], "window_size": 4}),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
                 {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
    "deit": ("DeiTConfig", "DeiTForImageClassification", {**_TXT, "image_size": 32, "patch_size": 8}),
    "roberta-token": ("RobertaConfig", "RobertaForTokenClassification", _TXT),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_TXT, "num_key_value_heads": 2, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_TXT, "num_key_value_heads": 2, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_TXT, "num_key_value_heads": 2, "pad_token_id": 0}),
    "vit-mae": ("ViTMAEConfig", "ViTMAEForPreTraining", {**_TXT, "image_size": 32, "patch_size": 8,
                                                         "decoder_hidden_size": 32, "decoder_num_hidden_layers": 1,
                                                         "decoder_num_attention_heads": 4,
                                                         "decoder_intermediate_size": 64}),
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation",
                  {"num_labels": 3, "hidden_sizes": [16, 32, 64, 128], "decoder_hidden_size": 64,
                   "depths": [1, 1, 1, 1], "num_attention_heads": [1, 2, 4, 8]}),
}
"""HF layouts (beyond the matrix's BERT, GPT-2, Llama, T5, BART and ViT), reduced: class names and config fields."""


class _Convs(nn.Module):
    """Two PyG convolutions with a ReLU between them, for convolutions PyG ships no model of."""

    def __init__(self, first: nn.Module, second: nn.Module, edges: bool = False) -> None:
        super().__init__()
        self.convs, self.edges = nn.ModuleList([first, second]), edges

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        extra = (edge_attr,) if self.edges else ()
        return self.convs[1](torch.relu(self.convs[0](x, edge_index, *extra)), edge_index, *extra)


def _pyg() -> dict[str, tuple[Callable[[], nn.Module], bool, bool]]:
    import torch_geometric.nn as G

    mlp = lambda i, o: nn.Sequential(nn.Linear(i, o), nn.ReLU())  # noqa: E731
    return {
        "gatv2": (lambda: G.models.GAT(16, 32, 2, 4, v2=True, heads=2), False, False),
        "gat-edge-features": (lambda: G.models.GAT(16, 32, 2, 4, edge_dim=8, heads=2), True, False),
        "sage-jk-cat": (lambda: G.models.GraphSAGE(16, 32, 3, 4, jk="cat"), False, False),
        "gin-batch-norm": (lambda: G.models.GIN(16, 32, 3, 4, norm="batch_norm"), False, False),
        "gcn-layer-norm-dropout": (lambda: G.models.GCN(16, 32, 3, 4, norm="layer_norm", dropout=0.3), False, False),
        "pna": (lambda: G.models.PNA(16, 32, 2, 4, aggregators=["mean", "max", "std"],
                                     scalers=["identity", "amplification"],
                                     deg=torch.tensor([0, 10, 40, 80, 50, 20])), False, False),
        "edgecnn": (lambda: G.models.EdgeCNN(16, 32, 2, 4), False, False),
        "transformerconv": (lambda: _Convs(G.TransformerConv(16, 32, heads=2), G.TransformerConv(64, 4)),
                            False, False),
        "gineconv": (lambda: _Convs(G.GINEConv(mlp(16, 32), edge_dim=8), G.GINEConv(mlp(32, 4), edge_dim=8),
                                    edges=True), True, False),
        "gcn-improved": (lambda: _Convs(G.GCNConv(16, 32, improved=True), G.GCNConv(32, 4, improved=True)),
                         False, True),
        "graphconv": (lambda: _Convs(G.GraphConv(16, 32), G.GraphConv(32, 4)), False, False),
        "tagconv": (lambda: _Convs(G.TAGConv(16, 32), G.TAGConv(32, 4)), False, True),
        "armaconv": (lambda: _Convs(G.ARMAConv(16, 32), G.ARMAConv(32, 4)), False, True),
        "mfconv": (lambda: _Convs(G.MFConv(16, 32), G.MFConv(32, 4)), False, True),
    }
"""PyG models and convolutions (beyond the matrix's GCN, GAT, GraphSAGE and GIN) on a 500-node random graph drawn
with ``torch.randint``, self-loops and repeated edges included (first flag: with edge features), or, second flag,
only its distinct edges between distinct nodes (a simple graph, as datasets have: the convs whose SpMM form is
checked against their own forward, :func:`zoomem.ops.impls.check_impls`, take it on simple graphs only)."""


def build(spec: str, image_size: int = 64) -> tuple[nn.Module, Any, Batch]:
    """Model, adapter and batch of ``kind:name`` (deterministic: seeded here); timm models at ``image_size``."""
    kind, name = spec.split(":", 1)
    torch.manual_seed(0)
    if kind == "timm":
        import timm

        kwargs: dict[str, Any] = {"pretrained": False, "num_classes": 10}
        if any(k in name for k in ("vit", "deit", "cait", "eva", "mixer", "levit", "swin")):
            kwargs["img_size"] = image_size
        if "swin" in name:
            kwargs["window_size"] = 4
        model = timm.create_model(name, **kwargs)
        adapter = get_adapter(model)
        return model, adapter, adapter.example_batch(model, 2, image_size=image_size)
    if kind == "hf":
        import transformers

        if name not in HF:
            raise ValueError(f"No hf layout {name!r} here; the layouts are {', '.join(HF)}.")
        config_cls, model_cls, fields = HF[name]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields))
        adapter = get_adapter(model)
        text = getattr(model, "main_input_name", "input_ids") == "input_ids"
        return model, adapter, adapter.example_batch(model, 2, **({"seq_len": 32} if text else {"image_size": 32}))
    if kind == "pyg":
        models = _pyg()
        if name not in models:
            raise ValueError(f"No pyg model {name!r} here; the models are {', '.join(models)}.")
        make, edges, simple = models[name]
        model = make()
        g = torch.Generator().manual_seed(0)
        x, edge_index = torch.randn(500, 16, generator=g), torch.randint(0, 500, (2, 4000), generator=g)
        if simple:
            edge_index = torch.unique(edge_index[:, edge_index[0] != edge_index[1]], dim=1)
        kwargs = {"edge_attr": torch.randn(edge_index.size(1), 8, generator=g)} if edges else {}
        return model, get_adapter(model), Batch(args=(x, edge_index), kwargs=kwargs,
                                                target=torch.randint(0, 4, (500,), generator=g))
    raise ValueError(f"Unknown model kind in {spec!r}: use timm:<name>, hf:<name> or pyg:<name>.")


def all_specs() -> list[str]:
    return [f"timm:{n}" for n in TIMM] + [f"hf:{n}" for n in HF] + [f"pyg:{n}" for n in _pyg()]


def _grads(model: nn.Module, adapter: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same dropout masks every step
    loss = adapter.loss(model, batch, batch.call(model))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _sq(grads: dict[str, torch.Tensor]) -> float:
    return float(sum(g.double().square().sum() for g in grads.values()))


def check(spec: str, levels: tuple[str, ...] = ("L2",), image_size: int = 64) -> dict[str, Any]:
    """One model's row: lossless minimum and its gradient error; each level's error against its prediction (keys
    ``<level>_...``, lower case: ``l2_ok``), and the parameter whose gradient is furthest off (relative)."""
    t0 = time.perf_counter()
    model, adapter, batch = build(spec, image_size)
    model.train()
    reference = copy.deepcopy(model)
    ref_loss, ref = _grads(reference, adapter, batch)
    initial = copy.deepcopy(model.state_dict())
    row: dict[str, Any] = {"model": spec, "parameters_mib": sum(p.numel() * p.element_size()
                                                                for p in model.parameters()) / 2**20}
    try:
        zoomem.wrap(model, 0.05, adapter=adapter, batch=batch)
        budget = int(0.05 * next(iter(model.__dict__["_zoomem"].plans.values())).baseline_peak_bytes)
        zoomem.unwrap(model)
    except InfeasibleBudgetError as err:
        budget = err.min_budget
    model.load_state_dict(initial)
    zoomem.wrap(model, budget, adapter=adapter, batch=batch)
    plan = next(iter(model.__dict__["_zoomem"].plans.values()))
    loss, grads = _grads(model, adapter, batch)
    zoomem.unwrap(model)
    scale = max(float(g.norm()) for g in ref.values())
    worst = max(float((grads[k] - g).norm()) / (1e-5 * float(g.norm()) + 1e-6 * scale) for k, g in ref.items())
    row.update(units=len(plan.units), recomputed=sum(u.decision.name != "KEEP" for u in plan.units),
               min_share=plan.predicted_peak_bytes / plan.baseline_peak_bytes,
               lossless_loss_equal=bool(torch.equal(loss, ref_loss)), lossless_error_in_tolerances=worst,
               lossless_ok=worst <= 1.0 and torch.allclose(loss, ref_loss, rtol=1e-5, atol=0))
    for level in levels:
        model.load_state_dict(initial)
        zoomem.wrap(model, level=level, adapter=adapter, batch=batch, sensitivity_interval=0)
        plan = next(iter(model.__dict__["_zoomem"].plans.values()))
        errors, worst_param = [], (0.0, "")
        with _left_plan() as left:
            for _ in range(3):
                _, grads = _grads(model, adapter, batch)
                errors.append(_sq({k: grads[k] - g for k, g in ref.items()}) / max(_sq(ref), 1e-30))
                worst_param = max(worst_param, *((float((grads[k] - g).norm() / g.norm()), k)
                                                 for k, g in ref.items() if g.norm() > 0))
            report = zoomem.measure_step(model, batch, lambda out, b: adapter.loss(model, b, out))
        model.zero_grad(set_to_none=True)
        zoomem.unwrap(model)
        key = level.lower()
        peak = max(report.phases[p].peak_bytes for p in ("forward", "backward")) / plan.predicted_peak_bytes
        row.update({f"{key}_lossy": len(plan.bits), f"{key}_predicted_variance": plan.variance,
                    f"{key}_worst_error": max(errors), f"{key}_left_plan": len(left), f"{key}_peak_share": peak,
                    f"{key}_ok": max(errors) <= 3 * plan.variance + 1e-6 and not left and peak <= PEAK_SLACK,
                    f"{key}_worst_parameter": worst_param[1], f"{key}_worst_parameter_error": worst_param[0]})
    row["seconds"] = time.perf_counter() - t0
    return row


def per_tensor(spec: str, bits: int, image_size: int = 64, samples: int = 8, trials: int = 4,
               aten_norms: bool = False, stock: bool = False) -> list[dict[str, Any]]:
    """Each lossy-eligible saved tensor of ``spec`` (every compact form installed, as the levels run them; none with
    ``stock``): its predicted gradient variance in ``bits`` (``samples`` Hutchinson probes) against brute force
    (``trials`` roundings of that tensor alone; :func:`zoomem.compress.empirical_variance`). ``aten_norms``: layer
    norms differentiated by aten's double backward, as before ``norms_at_saved_statistics``."""
    import contextlib

    from zoomem.compress import empirical_variance, perturbed_grads
    from zoomem.ops.functional import separate_masks
    from zoomem.ops.impls import impls_for, install_impl
    from zoomem.runtime import probe
    from zoomem.runtime.storage import SavedTensorStore

    model, adapter, batch = build(spec, image_size)
    model.train()
    undo = [] if stock else [install_impl(m, impls_for(m)[0]) for m in model.modules() if impls_for(m)]
    units = adapter.units(model)
    loss_fn: Callable[[Any, Batch], torch.Tensor] = lambda out, b: adapter.loss(model, b, out)  # noqa: E731
    norms = probe.norms_at_saved_statistics
    try:
        if aten_norms:
            probe.norms_at_saved_statistics = contextlib.nullcontext  # type: ignore[assignment]
        infos, _ = probe.probe_saved(model, batch, loss_fn, units, samples=samples,
                                     generator=torch.Generator().manual_seed(0))
        store = SavedTensorStore(record=True, groups={i.key: i.group for i in infos},
                                 generator=torch.Generator().manual_seed(1))
        with torch.random.fork_rng(), store.hooks(), probe._regions(store, units), separate_masks():
            out = batch.call(model)  # the probe's dropout masks: it restored the RNG state it forked
        loss = loss_fn(out, batch)
        grads_with = perturbed_grads(store, loss, [p for p in model.parameters() if p.requires_grad])
        return [{"model": spec, "key": i.key, "shape": list(i.shape), "group": i.group, "bits": bits,
                 "predicted": i.variance(bits), "measured": empirical_variance(grads_with, i.key, bits, trials)}
                for i in infos if i.lossy is None and i.sensitivity > 0]
    finally:
        probe.norms_at_saved_statistics = norms
        for u in undo:
            u()


def _per_tensor_markdown(rows: list[dict[str, Any]], top: int = 8) -> str:
    """Per model: the ``top`` tensors by measured variance, then the sum over all."""
    lines = ["| model | saved tensor | shape (group) | predicted | measured | measured / predicted |",
             "|---|---|---|---:|---:|---:|"]
    for spec in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == spec]
        for r in sorted(mine, key=lambda r: -r["measured"])[:top]:
            lines.append(f"| {spec} | {r['key']} | {tuple(r['shape'])} ({r['group']}) | {r['predicted']:.2e} | "
                         f"{r['measured']:.2e} | {r['measured'] / r['predicted']:.2f} |")
        p, m = sum(r["predicted"] for r in mine), sum(r["measured"] for r in mine)
        lines.append(f"| {spec} | all {len(mine)} |  | {p:.2e} | {m:.2e} | {m / p:.2f} |")
    return "\n".join(lines)


PEAK_SLACK = 1.10
"""A level's metered step may peak this much above its plan's prediction (small layouts: a few KiB of allocator
rounding are a large share) before its row fails."""


@contextlib.contextmanager
def _left_plan() -> Iterator[list[str]]:
    """The warnings of steps whose forward saved other tensors than their plan named, logged inside: on the batch
    that was planned, every one is a finding (a path taken in training that planning's forward did not take: a
    masked LM's loss fell back to the plain cross-entropy so before stop 51)."""
    found: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "its plan's forward saved" in record.getMessage():
                found.append(record.getMessage())

    handler, log = _Catch(), logging.getLogger("zoomem")
    level, log.level = log.level, min(log.level or logging.WARNING, logging.WARNING)
    log.addHandler(handler)
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.level = level


def _ok(row: dict[str, Any], levels: tuple[str, ...]) -> bool:
    return "error" not in row and row["lossless_ok"] and all(row[f"{lv.lower()}_ok"] for lv in levels)


def _markdown(rows: list[dict[str, Any]], levels: tuple[str, ...]) -> str:
    """One row a model: the lossless check, then per level its lossy tensors, its squared error against its
    predicted variance and the parameter furthest off (the error of its gradient over its norm)."""
    head = "".join(f" {lv} lossy tensors | {lv} error / predicted variance | {lv} furthest off | {lv} peak / "
                   "predicted |" for lv in levels)
    lines = ["| model | units (recomputed at min) | min / PyTorch peak | lossless gradients |" + head + " verdict |",
             "|---|---:|---:|---|" + "---:|---:|---|---:|" * len(levels) + "---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | |" + " | | | |" * len(levels) + f" ERROR: {r['error']} |")
            continue
        tol = r["lossless_error_in_tolerances"]
        exact = "bitwise" if tol == 0 else f"{tol:.2f} of tol."
        cells = "".join(f" {r[k + '_lossy']} | {r[k + '_worst_error']:.1e} / {r[k + '_predicted_variance']:.1e} | "
                        f"{r[k + '_worst_parameter']} {r[k + '_worst_parameter_error']:.2f} | "
                        f"{r[k + '_peak_share']:.3f}{' (left its plan)' if r[k + '_left_plan'] else ''} |"
                        for k in (lv.lower() for lv in levels))
        lines.append(f"| {r['model']} | {r['units']} ({r['recomputed']}) | {100 * r['min_share']:.0f}% | {exact} |"
                     + cells + f" {'ok' if _ok(r, levels) else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=None, help="kind:name specs (default: every one here)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--levels", nargs="+", default=["L2"], help="compression levels to check (default L2)")
    parser.add_argument("--image-size", type=int, default=64, help="timm models' image size (default 64)")
    parser.add_argument("--per-tensor", type=int, metavar="BITS", choices=(1, 2, 4, 8),
                        help="instead: each saved tensor's predicted gradient variance in BITS against brute force")
    parser.add_argument("--aten-norms", action="store_true",
                        help="with --per-tensor: layer norms differentiated by aten's double backward")
    parser.add_argument("--stock-forms", action="store_true", help="with --per-tensor: no compact forms installed")
    args = parser.parse_args(argv)
    levels = tuple(args.levels)
    torch.set_num_threads(1)
    if args.per_tensor:
        rows = [r for spec in args.models or all_specs()
                for r in per_tensor(spec, args.per_tensor, args.image_size, aten_norms=args.aten_norms,
                                    stock=args.stock_forms)]
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(_per_tensor_markdown(rows) if args.markdown else "\n".join(json.dumps(r) for r in rows))
        return 0
    rows = []
    for spec in args.models or all_specs():
        try:
            row = check(spec, levels, args.image_size)
        except Exception as exc:  # noqa: BLE001 - a model zoomem cannot wrap is a finding, not a crash
            traceback.print_exc(file=sys.stderr)
            row = {"model": spec, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        print(_markdown(rows, levels))
    return int(not all(_ok(r, levels) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
