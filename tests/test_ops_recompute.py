"""zoomem.ops: the implementations that keep an op's inputs and recompute the rest in backward (SDPA's math path,
multi-op activations, an LM head's cross-entropy), against the stock ops (CPU)."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from zoomem.ops import attention as A
from zoomem.ops import functional as Zf
from zoomem.ops.impls import IMPLS, impls_for, install_impl, installed_impl
from zoomem.ops import loss as L
from zoomem.ops.loss import CrossEntropy, LinearCrossEntropy, cross_entropy, route_cross_entropy

from test_ops import rel, saved_bytes  # noqa: E402  (tests/ is on sys.path under pytest)

transformers = pytest.importorskip("transformers")


def saved_storage_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and sum the bytes of the storages autograd saves (each once)."""
    return saved_bytes(fn, exclude=nn.Module())


# ----------------------------------------------------------------------------------------------------------------
# attention: SDPA's math path keeping q, k, v


def _attention_inputs(mask: str, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, dtype=dtype).requires_grad_(True) for _ in range(3))
    if mask == "hf_layout":  # q, k, v as transposed views of one projection's output, as HF's layers pass them
        qkv = torch.randn(2, 16, 3, 3, 8, generator=gen, dtype=dtype).requires_grad_(True)
        return [t for t in (qkv * 1).permute(2, 0, 3, 1, 4)], {}
    kw: dict = {}
    if mask == "float":
        m = torch.zeros(2, 1, 1, 16, dtype=dtype)
        m[0, ..., -3:] = torch.finfo(dtype).min
        kw["attn_mask"] = m
    elif mask == "bool":
        m = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        m[1, ..., :2] = False
        m[1, 0, 3, :] = False  # a row that attends to nothing: _safe_softmax gives it 0
        kw["attn_mask"] = m
    elif mask == "causal":
        kw["is_causal"] = True
    elif mask == "scale":
        kw["scale"] = 0.3
    return [q, k, v], kw


def _sdpa(routed: bool, qkv: list[torch.Tensor], kw: dict, dropout_p: float,
          stored: bool = False) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    ctx = A.recompute_attention() if routed else contextlib.nullcontext()
    with ctx, Zf.separate_masks() if stored else contextlib.nullcontext():
        out, saved = saved_storage_bytes(lambda: F.scaled_dot_product_attention(*qkv, dropout_p=dropout_p, **kw))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, qkv, g)
    return out, *grads, torch.rand(3), torch.tensor(saved)


@pytest.mark.parametrize("mask", ["none", "float", "bool", "causal", "scale", "hf_layout"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("stored", [False, True], ids=["exact", "under_store"])
def test_math_attention_is_the_stock_math_path(mask: str, dropout_p: float, stored: bool) -> None:
    """Output, gradients and the RNG stream after it bitwise as the stock math path (forced for dropout 0, where
    the CPU would run its flash kernel). What it saves: q, k, v and a 1-bit dropout mask; under zoomem's store the
    softmax too (what rounding may touch); the stock path saves the scaled q and k and three N x N tensors."""
    qkv, kw = _attention_inputs(mask)
    with sdpa_kernel(SDPBackend.MATH):
        ref = _sdpa(False, qkv, kw, dropout_p, stored)
        ours = _sdpa(True, qkv, kw, dropout_p, stored)
    assert all(torch.equal(a, b) for a, b in zip(ref[:5], ours[:5]))
    qkv_bytes = 3 * qkv[0].nbytes
    mask_bytes = kw["attn_mask"].nbytes if "attn_mask" in kw and not stored else 0
    n2 = 2 * 3 * 16 * 16 * 4  # one N x N fp32 tensor
    assert int(ours[5]) <= qkv_bytes + mask_bytes + (n2 if stored else 0) + n2 // 32 + 64
    assert int(ref[5]) >= 2 * qkv_bytes // 3 + (3 if dropout_p else 1) * n2


def test_math_attention_routes_only_the_math_path() -> None:
    """Calls that would run a fused kernel (CPU flash without dropout), without a gradient, under autocast or with
    grouped-query expansion run as they are."""
    qkv, _ = _attention_inputs("none")
    name = lambda out: out.grad_fn.name() if out.grad_fn is not None else None  # noqa: E731
    with A.recompute_attention():
        assert name(F.scaled_dot_product_attention(*qkv, dropout_p=0.1)) == "MathAttentionBackward"
        assert name(F.scaled_dot_product_attention(*qkv)) == "ScaledDotProductFlashAttentionForCpuBackward0"
        with torch.no_grad():
            assert name(F.scaled_dot_product_attention(*qkv, dropout_p=0.1)) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert name(F.scaled_dot_product_attention(*qkv, dropout_p=0.1)) != "MathAttentionBackward"
        out = F.scaled_dot_product_attention(*qkv, dropout_p=0.1, enable_gqa=True)
        assert name(out) != "MathAttentionBackward"
        half = [t.detach().bfloat16().requires_grad_() for t in qkv]  # aten upcasts on CPU: not our forward
        assert name(F.scaled_dot_product_attention(*half, dropout_p=0.1)) != "MathAttentionBackward"


def test_attention_with_a_learned_bias_runs_as_it_is() -> None:
    """A mask that needs a gradient (Swin's relative-position bias) runs PyTorch's own attention under both routing
    modes, stored lossily or not: the attention that keeps its softmax (under a lossy store) returned no gradient for
    the mask, so HF Swin's bias table got none at ``L2``."""
    from zoomem.ops.attention import differentiable_attention

    qkv, _ = _attention_inputs("none")
    bias = torch.randn(qkv[0].shape[-2], qkv[1].shape[-2], requires_grad=True)
    for mode, dropout, stored in ((A.recompute_attention, 0.1, False), (A.recompute_attention, 0.1, True),
                                  (differentiable_attention, 0.0, False)):
        grads = []
        for routed in (False, True):
            torch.manual_seed(0)
            with mode() if routed else contextlib.nullcontext(), Zf.separate_masks(stored):
                out = F.scaled_dot_product_attention(*qkv, attn_mask=bias, dropout_p=dropout)
            grads.append(torch.autograd.grad(out.square().sum(), bias, allow_unused=True)[0])
        assert grads[1] is not None, (mode, stored)
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["cpu_dropout", "native_dropout"])
@pytest.mark.parametrize("mask", ["none", "float", "causal"])
@pytest.mark.parametrize("stored", [False, True], ids=["exact", "under_store"])
def test_math_attention_gradgradcheck(fused: bool, mask: str, stored: bool) -> None:
    """Twice differentiable in float64 (with the same dropout mask on every evaluation), through CPU's dropout and
    through native_dropout (what CUDA's math path runs), and the native_dropout path draws like aten."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=gen, dtype=torch.float64).requires_grad_(True) for _ in range(3))
    kw = {"attn_mask": torch.randn(1, 1, 5, 5, dtype=torch.float64, generator=gen)} if mask == "float" else {}
    kw.update({"is_causal": True} if mask == "causal" else {})

    def f(q, k, v):  # type: ignore[no-untyped-def]
        torch.manual_seed(3)
        with A.recompute_attention(), Zf.separate_masks() if stored else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kw)
        assert out.grad_fn.name() == "MathAttentionBackward"
        return out

    with mock.patch.object(A, "_fused_dropout_device", lambda t: fused):
        assert torch.autograd.gradcheck(f, (q, k, v))
        assert torch.autograd.gradgradcheck(f, (q, k, v))
        if fused:
            out = f(q, k, v)
            scores = q @ k.transpose(-2, -1) / 3**0.5 + kw.get("attn_mask", 0)
            if mask == "causal":
                scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
            torch.manual_seed(3)
            torch.testing.assert_close(out, torch.native_dropout(torch.softmax(scores, -1), 0.3, True)[0] @ v)


def test_attention_impl_applies_to_the_innermost_attention_layer() -> None:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    from zoomem.adapters.registry import get_adapter

    bert = BertModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32))
    gpt2 = GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2))
    for m in (bert, gpt2):
        get_adapter(m)  # registers the *Attention classes
    names = lambda m: [i.name for i in impls_for(m)]  # noqa: E731
    assert "attention_recompute" in names(bert.encoder.layer[0].attention.self)
    assert "attention_recompute" not in names(bert.encoder.layer[0].attention)  # it holds the one above
    assert "attention_recompute" in names(gpt2.h[0].attn)


# ----------------------------------------------------------------------------------------------------------------
# multi-op pointwise activations, recomputed


def _hf_act(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast", "quick_gelu", "gelu_accurate", "gelu_10", "sqrtsoftplus"])
def test_pointwise_recompute_is_bitwise_and_saves_only_the_input(act: str) -> None:
    module = _hf_act(act)
    assert [i.name for i in impls_for(module)] == ["pointwise_recompute"]
    x0 = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    g = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    res = []
    for compact in (False, True):
        m = copy.deepcopy(module)
        if compact:
            install_impl(m, "pointwise_recompute")
        x = x0.clone().requires_grad_(True)
        y, saved = saved_storage_bytes(lambda: m(x * 1))  # x * 1: a non-leaf input, as inside a model
        (gx,) = torch.autograd.grad(y, x, g)
        res.append((y, gx, saved))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert res[1][2] == x0.nbytes < res[0][2]


def test_pointwise_recompute_gradgradcheck_and_double_backward_reaches_its_input() -> None:
    fn = _hf_act("gelu_new").forward
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: Zf.recompute_pointwise(fn, t), (x,))
    h = x * 2
    y = Zf.recompute_pointwise(fn, h)
    (gh,) = torch.autograd.grad(y.sum(), h, create_graph=True)
    (gx,) = torch.autograd.grad(gh.sum(), x)  # through the saved input's history
    (ref,) = torch.autograd.grad(torch.autograd.grad(fn(x * 2).sum(), x, create_graph=True)[0].sum() / 2, x)
    torch.testing.assert_close(gx, ref)


# ----------------------------------------------------------------------------------------------------------------
# cross-entropy keeping the logits


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_stock(reduction: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits0 = torch.randn(12, 50, generator=gen) * 4
    target = torch.randint(0, 50, (12,), generator=gen)
    target[[2, 7]] = -100
    grads, losses = [], []
    for ours in (False, True):
        logits = logits0.clone().requires_grad_(True)
        fn = cross_entropy if ours else F.cross_entropy
        loss, saved = saved_storage_bytes(lambda: fn(logits, target, ignore_index=-100, reduction=reduction))
        w = torch.arange(1, 13, dtype=torch.float32) if reduction == "none" else torch.tensor(2.0)
        (g,) = torch.autograd.grad(loss, logits, w)
        grads.append(g)
        losses.append(loss)
        if ours:  # the logits and the targets, nothing the size of the logits besides
            assert saved == logits.nbytes + target.nbytes
    assert torch.equal(losses[0], losses[1])
    assert rel(grads[1], grads[0]) < 1e-6
    assert grads[1][[2, 7]].abs().sum() == 0


def test_cross_entropy_gradgradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, generator=gen).requires_grad_(True)
    target = torch.tensor([1, -100, 6, 0, 3])
    for reduction in ("mean", "none"):
        f = lambda x: cross_entropy(x, target, reduction=reduction)  # noqa: E731
        assert torch.autograd.gradcheck(f, (logits,)) and torch.autograd.gradgradcheck(f, (logits,))


def test_cross_entropy_routes_only_what_it_computes() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, generator=gen, requires_grad=True)
    target = torch.randint(0, 9, (6,), generator=gen)
    name = lambda loss: loss.grad_fn.name()  # noqa: E731
    with route_cross_entropy():
        assert name(F.cross_entropy(logits, target)) == "CrossEntropyBackward"
        assert name(nn.CrossEntropyLoss()(logits, target)) == "CrossEntropyBackward"
        for kw in ({"weight": torch.rand(9)}, {"label_smoothing": 0.1}):
            assert name(F.cross_entropy(logits, target, **kw)) != "CrossEntropyBackward"
        assert name(F.cross_entropy(logits[None].transpose(1, 2), target[None])) != "CrossEntropyBackward"
        assert name(F.cross_entropy(logits, torch.softmax(logits.detach(), 1))) != "CrossEntropyBackward"
    with pytest.raises(ValueError, match="reduction must be one of"):
        cross_entropy(logits, target, reduction="avg")


def test_cross_entropy_lowers_the_loss_backward_peak() -> None:
    from zoomem.measure import MemoryMeter

    peaks = []
    for ours in (False, True):
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(256, 4096, generator=gen, requires_grad=True)  # 4 MiB
        target = torch.randint(0, 4096, (256,), generator=gen)
        with MemoryMeter(logits) as meter:
            loss = (cross_entropy if ours else F.cross_entropy)(logits, target)
            meter.mark("forward")
            loss.backward()
            meter.mark("backward")
        peaks.append((meter.report.activation_bytes, meter.report.peak_bytes - meter.report.baseline_bytes))
    (held0, peak0), (held1, peak1) = peaks
    assert held0 - held1 >= 0.95 * logits.nbytes  # no log-probabilities held
    assert peak0 - peak1 >= 1.9 * logits.nbytes  # nor nll_loss's dense gradient at the backward


def test_cross_entropy_impl_goes_on_the_model_forward_and_comes_off_exactly() -> None:
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    bert = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                    intermediate_size=32))
    assert "cross_entropy_logits" in [i.name for i in impls_for(gpt2)]
    assert "cross_entropy_logits" not in [i.name for i in impls_for(bert)]
    before = dict(gpt2.__dict__)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = gpt2(input_ids=ids, labels=ids)
    undo = install_impl(gpt2, "cross_entropy_logits")
    assert installed_impl(gpt2) is IMPLS["cross_entropy_logits"]
    pickle.loads(pickle.dumps(gpt2))
    torch.manual_seed(0)
    depth = torch._C._len_torch_function_stack()
    out = gpt2(input_ids=ids, labels=ids)
    assert out.loss.grad_fn.name() == "LinearCrossEntropyBackward"  # the logits are the LM head's output
    assert rel(out.loss, ref.loss) < 1e-6 and torch.equal(out.logits, ref.logits)
    assert torch._C._len_torch_function_stack() == depth and not L._WINDOWS  # the routing ends with the forward
    assert F.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).grad_fn.name() == "NllLossBackward0"
    gpt2.eval()  # eval and no_grad run HF's own loss
    assert "CrossEntropy" not in gpt2(input_ids=ids, labels=ids).loss.grad_fn.name()
    gpt2.train()
    with torch.no_grad():
        assert gpt2(input_ids=ids, labels=ids).loss.grad_fn is None
    with pytest.raises(Exception):  # labels the loss refuses: the routing still ends with the forward
        gpt2(input_ids=ids, labels=ids[:1])
    assert torch._C._len_torch_function_stack() == depth and not L._WINDOWS
    undo()
    assert gpt2.__dict__.keys() == before.keys() and "_loss_function" not in gpt2.__dict__
    assert not gpt2.lm_head._forward_hooks and gpt2.lm_head not in L._HEAD_IO  # the setup's hook is gone too
    buf = io.BytesIO()
    torch.save(gpt2.state_dict(), buf)


def _grads_close(stock: nn.Module, ours: nn.Module, tol: float = 1e-5) -> None:
    """Every gradient within ``tol`` of stock's, relative to the largest gradient of the model (BERT's key biases
    have a zero gradient in exact arithmetic: their float noise has no relative precision of its own)."""
    scale = max(float(p.grad.abs().max()) for p in stock.parameters() if p.grad is not None)
    for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            assert float((a.grad - b.grad).abs().max()) <= tol * scale, n


def _mlm_models() -> list[tuple[str, Callable[[], nn.Module]]]:
    from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, BertForMaskedLM, T5Config,
                              T5ForConditionalGeneration)

    def bart() -> nn.Module:
        model = BartForConditionalGeneration(BartConfig(
            encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=300, max_position_embeddings=64))
        model.final_logits_bias.normal_()  # zeros as initialised: the loss must read it all the same
        return model

    return [
        ("bart", bart),
        ("bert_mlm", lambda: BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                        intermediate_size=64, vocab_size=300))),
        ("t5", lambda: T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16,
                                                           num_heads=2, d_ff=64, vocab_size=300,
                                                           decoder_start_token_id=0))),
    ]


@pytest.mark.parametrize("skip", [False, True], ids=["logits", "skip_logits"])
@pytest.mark.parametrize("name", ["bert_mlm", "t5", "bart"])
def test_fused_head_routes_a_loss_the_forward_computes_itself(name: str, skip: bool) -> None:
    """BertForMaskedLM, T5 and BART call ``nn.CrossEntropyLoss`` in ``forward`` (on a view of the logits), not
    HF's ``loss_function``: the loss is fused all the same, with stock's values and gradients (ignored labels too;
    BART's logits are the head's output plus its ``final_logits_bias`` buffer). With ``skip_logits`` the head's
    output is never made (the loss computes the labelled rows from its input; BART's buffer joins the head's bias)."""
    torch.manual_seed(0)
    stock = dict(_mlm_models())[name]().train()
    ours = copy.deepcopy(stock)
    undo = install_impl(ours, "cross_entropy_logits")
    L.set_skip_logits(ours, skip)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, ::3] = -100
    losses = []
    for m in (stock, ours):
        torch.manual_seed(1)
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    assert (out.logits is None) == skip
    assert losses[1].grad_fn.name() == "LinearCrossEntropyBackward"
    assert rel(losses[1], losses[0]) < 1e-6
    _grads_close(stock, ours)
    L.set_skip_logits(ours, False)
    undo()


# ----------------------------------------------------------------------------------------------------------------
# the LM head's Linear and the cross-entropy, one backward a slice of the vocabulary at a time


def _head_inputs(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=gen, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(50, 16, generator=gen, dtype=dtype) * 0.5).requires_grad_(True)
    b = torch.randn(50, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    target = torch.randint(0, 50, (12,), generator=gen)
    target[[2, 7]] = -100
    return hidden, weight, b, target


@pytest.mark.parametrize("keep", [True, False], ids=["logits_saved", "logits_made_again"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_matches_stock(reduction: str, bias: bool, keep: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 96)  # slices of 8 rows and 8 of the 50 classes: a ragged last one
    hidden, weight, b, target = _head_inputs(bias)
    params = [t for t in (hidden, weight, b) if t is not None]
    w = torch.arange(1, 13, dtype=torch.float32) if reduction == "none" else torch.tensor(2.0)
    results = []
    for ours in (False, True):
        logits = F.linear(hidden, weight, b).view(-1, 50)
        if ours:
            loss = LinearCrossEntropy.apply(logits.detach(), hidden, weight, b, target, -100, reduction, None, keep)
            saved = loss.grad_fn.saved_tensors
            assert (saved[0] is not None) == keep  # skip_logits: backward makes the slices again
        else:
            loss = F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)
        results.append((loss, torch.autograd.grad(loss, params, w)))
    (loss0, grads0), (loss1, grads1) = results
    assert rel(loss1, loss0) < 1e-6
    for g0, g1 in zip(grads0, grads1):
        assert rel(g1, g0) < 1e-6
    assert grads1[0].view(12, 16)[[2, 7]].abs().sum() == 0  # ignored rows send nothing to the hidden states


@pytest.mark.parametrize("keep", [True, False], ids=["logits_saved", "logits_made_again"])
@pytest.mark.parametrize("ignored", ["most", "all"])
def test_linear_cross_entropy_leaves_ignored_rows_out(ignored: str, keep: bool) -> None:
    """Rows whose target is ignored carry no gradient: the backward leaves them out of its products (an MLM batch
    labels ~15% of its tokens) and their input gradient is exactly zero, as stock's is."""
    hidden, weight, b, target = _head_inputs(True)
    target[1:] = -100 if ignored == "most" else target[1:]
    if ignored == "all":
        target[:] = -100
    grads = []
    for ours in (False, True):
        logits = F.linear(hidden, weight, b).view(-1, 50)
        loss = (LinearCrossEntropy.apply(logits.detach(), hidden, weight, b, target, -100, "sum", None, keep) if ours
                else F.cross_entropy(logits, target, reduction="sum"))
        grads.append(torch.autograd.grad(loss, (hidden, weight, b)))
    for stock, ours in zip(*grads):
        assert rel(ours, stock) < 1e-6 if stock.any() else torch.equal(ours, stock)
    assert not grads[1][0].view(12, 16)[1:].any()


def test_linear_cross_entropy_gradgradcheck() -> None:
    hidden, weight, b, target = _head_inputs(True, torch.float64)
    for reduction, keep in (("mean", True), ("none", True), ("mean", False), ("none", False)):
        def f(h: torch.Tensor, w: torch.Tensor, bb: torch.Tensor) -> torch.Tensor:
            logits = F.linear(h, w, bb).view(-1, 50).detach()
            return LinearCrossEntropy.apply(logits, h, w, bb, target, -100, reduction, None, keep)

        # fast mode (a random projection of the Jacobian, PyTorch's own) on these 1042 inputs: 16 s -> 0.1 s
        assert torch.autograd.gradcheck(f, (hidden, weight, b), fast_mode=True)
        assert torch.autograd.gradgradcheck(f, (hidden, weight, b), fast_mode=True)
    const = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def g(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # logits = head's output + a constant (BART's)
        logits = (F.linear(h, w) + const).view(-1, 50).detach()
        return LinearCrossEntropy.apply(logits, h, w, None, target, -100, "mean")

    assert torch.autograd.gradgradcheck(g, (hidden, weight), fast_mode=True)


def test_losses_in_a_sensitivity_pass_keep_only_the_graph_sensitivities_follow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``sensitivity_pass`` a create_graph backward of the losses gives the ordinary gradients, bitwise; their
    input gradients carry no graph (the logits, or without them the hidden states and log-sum-exp, stay exact), and
    the head's weight gradient ``g^T h`` carries only ``h``'s: what reaches ``h`` is ``g @ v``, ``g`` from the
    saved logits, made a slice at a time. A loss whose incoming gradient carries a graph gets the full derivative."""
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 96)  # slices of 8 of the 50 classes
    hidden, weight, b, target = _head_inputs(True, torch.float64)
    v = torch.randn(50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    logits = F.linear(hidden, weight, b).view(-1, 50).detach()
    valid = target != -100
    g = (torch.softmax(logits, 1) - F.one_hot(target.clamp(min=0), 50)) * (valid.double() / valid.sum()).unsqueeze(1)
    for keep in (True, False):
        with L.sensitivity_pass():
            loss = LinearCrossEntropy.apply(logits, hidden, weight, b, target, -100, "mean", None, keep)
        plain = torch.autograd.grad(loss, (hidden, weight, b), retain_graph=True)
        gh, gw, gb = torch.autograd.grad(loss, (hidden, weight, b), create_graph=True)
        assert all(torch.equal(x, y) for x, y in zip(plain, (gh, gw, gb)))
        assert not gh.requires_grad and not gb.requires_grad
        if not keep:
            assert not gw.requires_grad  # the hidden states stay exact: nothing here may be rounded
            continue
        (through_h,) = torch.autograd.grad(gw, hidden, v)
        assert rel(through_h.view(12, 16), g @ v) < 1e-12
    with L.sensitivity_pass():
        loss = CrossEntropy.apply(logits.requires_grad_(True), target, -100, "mean")
    (gl,) = torch.autograd.grad(loss, logits, create_graph=True)
    assert not gl.requires_grad and rel(gl, g) < 1e-12
    weights = torch.rand(12, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    second = []
    for block in (L.sensitivity_pass, contextlib.nullcontext):
        with block():
            loss = LinearCrossEntropy.apply(logits.detach(), hidden, weight, b, target, -100, "none", None, True)
        (gw,) = torch.autograd.grad((loss * weights).sum(), weight, create_graph=True)
        second.append(torch.autograd.grad(gw, (hidden, weights), v))
    assert all(torch.equal(x, y) for x, y in zip(*second))


class _Head(nn.Module):
    """An LM head computing its loss the way HF models do (``loss_function``, behind the route)."""

    def __init__(self, vocab: int = 4096) -> None:
        super().__init__()
        self.lm_head = nn.Linear(64, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, hidden: torch.Tensor, target: torch.Tensor, edit: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(hidden)
        if edit == "inplace":
            logits.mul_(1.0)
        elif edit == "copy":
            logits = logits * 1.0
        with route_cross_entropy(self.lm_head):  # HF upcasts bf16/fp16 logits before the loss
            if edit == "add_buffer":  # BART's final_logits_bias, added inside the routing window
                logits = logits + torch.linspace(-1, 1, logits.shape[-1])
            elif edit == "add_learned":
                logits = logits + torch.linspace(-1, 1, logits.shape[-1], requires_grad=True)
            return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target)


def test_fused_head_only_for_the_heads_own_unchanged_output() -> None:
    model, gen = _Head(64), torch.Generator().manual_seed(0)
    hidden, target = torch.randn(2, 5, 64, generator=gen, requires_grad=True), torch.randint(0, 64, (10,))
    undo = L.record_head(model)
    try:
        assert model(hidden, target)[1].grad_fn.name() == "LinearCrossEntropyBackward"
        for edit in ("inplace", "copy", "add_learned"):  # logits changed after the head: keep them
            assert model(hidden, target, edit)[1].grad_fn.name() == "CrossEntropyBackward"
        loss = model(hidden, target, "add_buffer")[1]  # plus a constant: the same gradient, fused
        assert loss.grad_fn.name() == "LinearCrossEntropyBackward"
        logits = model.lm_head(hidden) + torch.linspace(-1, 1, 64)
        ref = F.cross_entropy(logits.view(-1, 64), target)
        assert rel(loss, ref) < 1e-6
        for a, b in zip(torch.autograd.grad(loss, (hidden, model.lm_head.weight)),
                        torch.autograd.grad(ref, (hidden, model.lm_head.weight))):
            assert rel(a, b) < 1e-6
    finally:
        undo()
    assert model(hidden, target)[1].grad_fn.name() == "CrossEntropyBackward"  # nothing recorded any more


def _head_step(fused: bool, autocast: bool) -> tuple[Any, torch.Tensor]:
    """One forward + backward of :class:`_Head` (4 MiB of fp32 logits) under a meter: its report and the logits."""
    from zoomem.measure import MemoryMeter

    model, gen = _Head(), torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 64, 64, generator=gen, requires_grad=True)
    target = torch.randint(0, 4096, (256,), generator=gen)
    undo = L.record_head(model) if fused else (lambda: None)
    with MemoryMeter(model, hidden, target) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, loss = model(hidden, target)
        meter.mark("forward")
        loss.backward()
        meter.mark("backward")
    undo()
    assert (loss.grad_fn.name() == "LinearCrossEntropyBackward") == fused
    return meter.report, logits


def test_fused_head_lowers_the_forward_and_backward_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 1 << 16)  # slices of 1/16 of these logits
    (stock, logits), (ours, _) = _head_step(False, False), _head_step(True, False)
    fwd0, bwd0 = (stock.phases[p].peak_bytes for p in ("forward", "backward"))
    fwd1, bwd1 = (ours.phases[p].peak_bytes for p in ("forward", "backward"))
    assert fwd0 - fwd1 >= 0.9 * logits.nbytes  # no log-probabilities while the loss is computed
    assert bwd0 - bwd1 >= 0.8 * logits.nbytes  # and no logits-sized gradient at the head's backward (slices of 1/16)


@pytest.mark.parametrize("mode", ["autocast", "bf16_model", "bart_autocast"])
def test_fused_head_in_low_precision_matches_stock(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast, or with bf16 weights, HF's loss upcasts the head's logits to an fp32 copy; the fused
    loss reads the bf16 logits themselves (softmax in fp32, the products in bf16, as autocast's backward runs).
    BART adds its fp32 ``final_logits_bias`` to the bf16 logits, an fp32 sum: read that, products still bf16."""
    if mode == "bart_autocast":
        stock = dict(_mlm_models())["bart"]()
    else:
        stock = _tiny_gpt2()
    if mode == "bf16_model":
        stock = stock.to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    undos = [install_impl(ours, "cross_entropy_logits")]
    if mode != "bart_autocast":
        undos.append(install_impl(ours.transformer.wte, "embedding_tied_grad"))
    products = []
    real = L._sliced_grads
    monkeypatch.setattr(L, "_sliced_grads", lambda *a: products.append(a[9]) or real(*a))  # matmul_dtype
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (stock, ours):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "bf16_model"):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert losses[1].grad_fn.name() == "LinearCrossEntropyBackward" and losses[1].dtype == torch.float32
    assert products == [torch.bfloat16 if mode == "bart_autocast" else None]  # else the bf16 logits' own dtype
    assert rel(losses[1], losses[0]) < 1e-5
    for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
        assert b.grad.dtype == a.grad.dtype and rel(b.grad.float(), a.grad.float()) < 1e-3, n
    for undo in undos:
        undo()


@pytest.mark.parametrize("mode", ["fp32", "autocast"])
def test_skip_logits_returns_no_logits_and_stock_gradients(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_skip_logits``: the training forward of an HF LM returns ``logits=None`` where the fused loss ran, its
    loss and gradients are stock's (the backward makes the logits again, a slice at a time, in the head's dtype)
    and nothing holds the logits after the forward, nor makes them in it (``zoomem.ops.deferred``: the forward's
    peak is lower by their bytes); eval, ``no_grad`` and forwards without labels return them."""
    from zoomem.measure import MemoryMeter

    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 1 << 12)
    stock = _tiny_gpt2(vocab=4000)  # logits well above the loss's slices
    ours = copy.deepcopy(stock)
    undos = [install_impl(ours, "cross_entropy_logits"), install_impl(ours.transformer.wte, "embedding_tied_grad")]
    ids = torch.randint(0, 4000, (2, 20), generator=torch.Generator().manual_seed(0))
    held, forward_peak = [], []
    for skip in (False, True):
        L.set_skip_logits(ours, skip)
        assert L.skips_logits(ours) == skip
        losses = []
        for m in (stock, ours):
            m.zero_grad()
            torch.manual_seed(1)
            with MemoryMeter(m) as meter:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                    out = m(input_ids=ids, labels=ids)
                meter.mark("forward")
                out.loss.backward()
            losses.append(out.loss)
        held.append(meter.report.activation_bytes)
        forward_peak.append(meter.report.phases["forward"].peak_bytes)
        assert (out.logits is None) == skip and type(out).__name__ == "CausalLMOutputWithCrossAttentions"
        assert losses[1].grad_fn.name() == "LinearCrossEntropyBackward"
        assert rel(losses[1], losses[0]) < (1e-6 if mode == "fp32" else 1e-5)
        # bf16: the products a slice at a time (small slices here), and a slice made again, may differ from the
        # forward's in the last bit (another blocking): within bf16's rounding of stock's gradient
        tol = 1e-5 if mode == "fp32" else 1e-2
        for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
            assert rel(b.grad, a.grad) < tol, n
    logits_bytes = 2 * 20 * 4000 * (2 if mode == "autocast" else 4)  # the head's output (bf16 under autocast)
    assert held[0] - held[1] >= logits_bytes
    assert forward_peak[1] <= forward_peak[0] - 0.9 * logits_bytes, forward_peak  # (kept: the logits made, held)
    assert ours(input_ids=ids).logits is not None  # no labels: no fused loss, the logits returned
    with torch.no_grad():
        assert ours(input_ids=ids, labels=ids).logits is not None
    ours.eval()
    assert ours(input_ids=ids, labels=ids).logits is not None
    L.set_skip_logits(ours, False)
    for undo in undos:
        undo()


def test_skip_logits_keeps_logits_it_cannot_make_again() -> None:
    """Under bf16 autocast BART's logits are the head's bf16 output plus its fp32 ``final_logits_bias``, an fp32 sum
    the fused loss cannot make again a slice at a time as the forward made it: it keeps them, the forward returns
    them, whatever ``skip_logits`` says. (In fp32 the bias joins the head's: nothing is made, nothing returned.)"""
    model = dict(_mlm_models())["bart"]()
    undo = install_impl(model, "cross_entropy_logits")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for skip in (False, True):
        L.set_skip_logits(model, skip)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        assert out.loss.grad_fn.name() == "LinearCrossEntropyBackward" and out.logits is not None
        assert out.logits.dtype == torch.float32 and out.loss.grad_fn.saved_tensors[0] is not None
        assert (model(input_ids=ids, labels=ids).logits is None) == skip
    L.set_skip_logits(model, False)
    undo()


def _stock_and_skipping(stock: nn.Module, ids: torch.Tensor, **kwargs: Any) -> list[Any]:
    """One training step of ``stock`` and of a copy with the fused loss and ``skip_logits`` on ``ids``: their outputs
    (the copy's gradients checked against stock's)."""
    ours = copy.deepcopy(stock)
    undo = install_impl(ours, "cross_entropy_logits")
    L.set_skip_logits(ours, True)
    outs = []
    for m in (stock, ours):
        torch.manual_seed(1)
        outs.append(m(input_ids=ids, labels=ids, **kwargs))
        (outs[-1][0] if isinstance(outs[-1], tuple) else outs[-1].loss).backward()
    _grads_close(stock, ours)
    L.set_skip_logits(ours, False)
    undo()
    return outs


def test_skip_logits_with_a_tuple_output_returns_the_logits_made() -> None:
    """``return_dict=False``: the output is a tuple the fused loss cannot drop the logits from; they come back made
    (a plain tensor, the head's output bitwise) before the forward returns, with stock's loss and gradients."""
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    (ref_loss, ref_logits, *_), (loss, logits, *_) = _stock_and_skipping(_tiny_gpt2(), ids, return_dict=False)
    assert type(logits) is torch.Tensor and torch.equal(logits, ref_logits)
    assert loss.grad_fn.name() == "LinearCrossEntropyBackward" and rel(loss, ref_loss) < 1e-6


def test_skip_logits_on_logits_the_model_changes_runs_stock() -> None:
    """Gemma-2 divides its head's output, takes ``tanh`` and multiplies (``final_logit_softcapping``): the deferred
    output is made at the division, the loss runs over the changed logits as stock's does (not fused: they are not
    the head's output) and the forward returns them."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    ref, out = _stock_and_skipping(Gemma2ForCausalLM(cfg).train(), ids)
    assert type(out.logits) is torch.Tensor and torch.equal(out.logits, ref.logits)
    assert out.loss.grad_fn.name() != "LinearCrossEntropyBackward" and rel(out.loss, ref.loss) < 1e-6


def test_fused_head_under_autocast_holds_no_fp32_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 1 << 16)
    (stock, logits), (ours, _) = _head_step(False, True), _head_step(True, True)
    assert logits.dtype == torch.bfloat16
    fp32 = 2 * logits.nbytes
    assert stock.activation_bytes - ours.activation_bytes >= 0.95 * fp32  # stock keeps fp32 log-probabilities
    # and its backward holds them beside their fp32 gradient
    assert stock.phases["backward"].peak_bytes - ours.phases["backward"].peak_bytes >= 1.5 * fp32


def test_tied_embedding_is_stock_without_a_handover() -> None:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 40, (3, 9), generator=gen)
    idx[0, :3] = 5
    for pad in (None, 5, -35):
        stock = nn.Embedding(40, 8, padding_idx=pad)
        ours = copy.deepcopy(stock)
        undo = install_impl(ours, "embedding_tied_grad")
        w = torch.randn(3, 9, 8, generator=gen)
        outs = [m(idx) for m in (stock, ours)]
        for m, out in zip((stock, ours), outs):
            (out * w).sum().backward()
        assert torch.equal(outs[0], outs[1]) and torch.equal(stock.weight.grad, ours.weight.grad)
        assert outs[1].grad_fn.name() == "_TiedEmbeddingBackward"
        with torch.no_grad():  # no_grad and eval run the stock op
            assert torch.equal(ours(idx), stock(idx))
        assert ours.eval()(idx).grad_fn.name() == "EmbeddingBackward0"
        undo()


def _tiny_gpt2(seed: int = 0, vocab: int = 300) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).train()


def test_tied_lm_head_hands_its_weight_gradient_to_the_embedding() -> None:
    stock = _tiny_gpt2()
    ours = copy.deepcopy(stock)
    undos = [install_impl(ours, "cross_entropy_logits"), install_impl(ours.transformer.wte, "embedding_tied_grad"),
             install_impl(ours.transformer.wpe, "embedding_tied_grad")]
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    handed = []
    real = L._TiedEmbedding.backward

    def spy(ctx: Any, grad: torch.Tensor) -> Any:
        handed.append(ctx.pending is not None)
        return real(ctx, grad)

    with mock.patch.object(L._TiedEmbedding, "backward", staticmethod(spy)):
        outs = []
        for m in (stock, ours):
            torch.manual_seed(1)
            out = m(input_ids=ids, labels=ids, output_hidden_states=True)
            out.loss.backward(retain_graph=True)
            outs.append(out)
    assert sorted(handed) == [False, True]  # wte took the head's gradient; wpe is not tied
    for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
        assert rel(b.grad, a.grad) < 1e-6, n
    # a pass that runs the head but not the embedding, then one that runs the embedding but not the head: the
    # gradient the first handed over is not the second's
    w_stock, w_ours = stock.transformer.wte.weight, ours.transformer.wte.weight
    for out in outs:
        torch.autograd.grad(out.loss, [out.hidden_states[1]], retain_graph=True)
    g_stock, g_ours = (torch.autograd.grad(out.hidden_states[0].square().sum(), [w])[0]
                       for out, w in zip(outs, (w_stock, w_ours)))
    assert torch.equal(g_ours, g_stock)
    for undo in undos:
        undo()


# ----------------------------------------------------------------------------------------------------------------
# what a lossy store may round: values read through exp() stay exact


class _Tiny(nn.Module):
    """Attention with dropout (through zoomem's math-path attention when ``routed``), a GELU written as several ops
    and a vocabulary-sized log-softmax: what an LM saves, small."""

    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.qkv, self.head, self.routed = nn.Linear(32, 96), nn.Linear(32, 512), routed

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(8, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
        with A.recompute_attention() if self.routed else contextlib.nullcontext():
            h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).transpose(1, 2).reshape(8, 64, 32)
        logits = self.head(_hf_act("gelu_new")(h)).reshape(-1, 512)
        with route_cross_entropy() if self.routed else contextlib.nullcontext():
            return F.cross_entropy(logits, target)  # inside the forward, as an HF LM head computes it


@pytest.mark.parametrize("routed", [False, True], ids=["stock", "zoomem"])
def test_values_read_through_exp_stay_exact(routed: bool) -> None:
    """Log-softmax's output (stock) and the logits (zoomem's cross-entropy) are never rounded."""
    import zoomem

    torch.manual_seed(0)
    model, x = _Tiny(routed), torch.randn(8, 64, 32)
    target = torch.randint(0, 512, (8 * 64,))
    plan = zoomem.plan(model, (x, target), level="L1.2", loss_fn=lambda out, b: out)
    reasons = {tuple(d["shape"]): d["lossy"] for d in plan.saved if "duplicate" not in (d["lossy"] or "")}
    if routed:  # the logits stay exact; under the store the attention saves the softmax (and q, k, v) to round
        assert "CrossEntropyBackward" in reasons[(512, 512)]
        assert reasons[(8, 2, 64, 64)] is None and reasons[(8, 2, 64, 16)] is None
    else:  # log_softmax's output is read through exp() by its backward
        assert "LogSoftmaxBackward0" in reasons[(512, 512)]
    assert plan.bits  # the rest is stored in 2 bits


def test_recomputing_attention_marks_q_and_k_exact() -> None:
    """Outside the store (exact storage) the attention recomputes the softmax from q and k: it declares them read
    through exp(), so a store that met this node would keep them exact."""
    qkv, _ = _attention_inputs("none")
    with A.recompute_attention():
        out = F.scaled_dot_product_attention(*qkv, dropout_p=0.1)
    assert out.grad_fn.exact_reads == (0, 1)
    with A.recompute_attention(), Zf.separate_masks():
        out = F.scaled_dot_product_attention(*qkv, dropout_p=0.1)
    assert out.grad_fn.exact_reads == ()
