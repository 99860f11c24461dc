"""zoomem.ops: packbits, the memory-efficient autograd Functions and the per-instance Impl registry (CPU)."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode

from zoomem.ops import functional as Zf
from zoomem.ops.checkpoints import own_checkpoint
from zoomem.ops.impls import IMPLS, Impl, find_inplace_writers, impls_for, install_impl, installed_impl, register_impl
from zoomem.ops.packbits import narrowest_uint, pack_bool, packed_nbytes, unpack_bool

timm = pytest.importorskip("timm")


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _as_zoomem_recomputes(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` as zoomem's recomputation of a unit runs it, under its own checkpoint: inside a checkpoint of the
    model's own the compact forms run the stock ops (:mod:`zoomem.ops.checkpoints`)."""
    def run(*args: torch.Tensor) -> torch.Tensor:
        with own_checkpoint():
            return fn(*args)

    return run


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: nn.Module) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and sum the storage bytes of what autograd saves (each storage once), parameters and buffers of
    ``exclude`` left out (they are not activation memory)."""
    skip = {t.untyped_storage().data_ptr() for t in (*exclude.parameters(), *exclude.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of ``a`` from ``b``."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _rand_norm_params(m: nn.Module) -> None:
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") and p.dim() == 1:
                p.normal_()


def llama_rmsnorm(dim: int) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(dim, eps=1e-6)


def timm_bn_act(act: str) -> nn.Module:
    from timm.layers import BatchNormAct2d

    if act == "relu":
        return BatchNormAct2d(8, act_layer=nn.ReLU)
    if act == "leaky":
        return BatchNormAct2d(8, act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.1})
    if act in ("silu", "hardswish", "relu6", "gelu"):  # as timm's EfficientNet, MobileNetV3, MobileNetV2 build them
        layer = {"silu": nn.SiLU, "hardswish": nn.Hardswish, "relu6": nn.ReLU6, "gelu": nn.GELU}[act]
        return BatchNormAct2d(8, act_layer=layer, act_kwargs={} if act == "gelu" else {"inplace": True})
    return BatchNormAct2d(8, apply_act=False)


@dataclass
class Case:
    """One Impl on one module. ``consumer`` follows the module (it saves the module's output, as a real next layer
    does), so that output-activated norms show their saving. ``ratio``: expected saved bytes (impl / stock) in fp32
    for ``x``'s shape; ``tol``: None = bitwise gradients, else the fp32 relative tolerance."""

    impl: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    ratio: float
    tol: float | None = None
    consumer: Callable[[], nn.Module] | None = None
    id: str = ""
    extra: dict = field(default_factory=dict)


# ratios: 4-byte floats vs 1 bit -> 1/32; norms: stock saves input (+stats) and the consumer saves the output,
# the impl saves only the output (shared) + stats; maxpool k3 s2 p1 on 16x16: stock 4*256 + 8*64 bytes per plane,
# impl 64 bytes; split linear/conv: same saved tensors (the gain is the backward order, tested separately).
CASES = [
    Case("relu_bitmask", lambda: nn.ReLU(), (8, 256), 1 / 32, id="relu"),
    Case("relu_bitmask", lambda: nn.ReLU(inplace=True), (8, 256), 1 / 32, id="relu_inplace"),
    Case("hardtanh_bitmask", lambda: nn.ReLU6(), (8, 256), 1 / 32, id="relu6"),
    Case("hardtanh_bitmask", lambda: nn.ReLU6(inplace=True), (8, 256), 1 / 32, id="relu6_inplace"),
    Case("hardtanh_bitmask", lambda: nn.Hardtanh(-0.3, 1.7), (8, 256), 1 / 32, id="hardtanh"),
    Case("leaky_relu_bitmask", lambda: nn.LeakyReLU(0.2), (8, 256), 1 / 32, id="leaky"),
    Case("leaky_relu_bitmask", lambda: nn.LeakyReLU(0.2, inplace=True), (8, 256), 1 / 32, id="leaky_inplace"),
    Case("threshold_bitmask", lambda: nn.Threshold(0.3, -1.0), (8, 256), 1 / 32, id="threshold"),
    Case("dropout_bitmask", lambda: nn.Dropout(0.3), (8, 256), 1 / 32, id="dropout"),
    Case("dropout_bitmask", lambda: nn.Dropout(0.3, inplace=True), (8, 256), 1 / 32, id="dropout_inplace"),
    Case("batchnorm_output", lambda: nn.BatchNorm2d(8), (4, 8, 16, 16), 0.5, 1e-5,
         lambda: nn.Conv2d(8, 4, 3, padding=1), id="bn2d"),
    Case("batchnorm_output", lambda: nn.BatchNorm1d(8, momentum=None), (64, 8), 0.5, 1e-5,
         lambda: nn.Linear(8, 4), id="bn1d_cumulative"),
    Case("batchnorm_output", lambda: nn.BatchNorm2d(8, affine=False, track_running_stats=False), (4, 8, 16, 16),
         0.5, 1e-5, lambda: nn.Conv2d(8, 4, 3, padding=1), id="bn2d_plain"),
    Case("batchnorm_act_output", lambda: timm_bn_act("relu"), (4, 8, 16, 16), 1.0, 1e-5,
         lambda: nn.Conv2d(8, 4, 3, padding=1), id="timm_bnact_relu"),
    Case("batchnorm_act_output", lambda: timm_bn_act("leaky"), (4, 8, 16, 16), 0.5, 1e-5,
         lambda: nn.Conv2d(8, 4, 3, padding=1), id="timm_bnact_leaky"),
    Case("batchnorm_act_output", lambda: timm_bn_act("identity"), (4, 8, 16, 16), 0.5, 1e-5,
         lambda: nn.Conv2d(8, 4, 3, padding=1), id="timm_bnact_identity"),
    # stock: the input, the in-place activation's copy of its input, the output; here the output of the norm
    # (saved by it and by the activation) and the activation's output
    *(Case("batchnorm_act_output", (lambda a=act: timm_bn_act(a)), (4, 8, 16, 16), 2 / 3, 1e-5,
           lambda: nn.Conv2d(8, 4, 3, padding=1), id=f"timm_bnact_{act}") for act in ("silu", "hardswish", "relu6")),
    Case("batchnorm_act_output", lambda: timm_bn_act("gelu"), (4, 8, 16, 16), 2 / 3, 1e-5,
         lambda: nn.Conv2d(8, 4, 3, padding=1), id="timm_bnact_gelu"),
    Case("layernorm_output", lambda: nn.LayerNorm(64), (4, 16, 64), 0.5, 1e-5, lambda: nn.Linear(64, 8), id="ln"),
    Case("rmsnorm_output", lambda: llama_rmsnorm(64), (4, 16, 64), 1 / 3, 1e-5, lambda: nn.Linear(64, 8),
         id="llama_rms"),
    Case("maxpool2d_compact", lambda: nn.MaxPool2d(3, 2, 1), (2, 8, 16, 16), 64 / (4 * 256 + 8 * 64), id="maxpool"),
    Case("maxpool2d_compact", lambda: nn.MaxPool2d(2, ceil_mode=True, dilation=2), (2, 8, 15, 15),
         1 * 49 / (4 * 225 + 8 * 49), id="maxpool_dilated_ceil"),
    Case("linear_split_backward", lambda: nn.Linear(64, 32), (4, 16, 64), 1.0, id="linear3d"),
    Case("linear_split_backward", lambda: nn.Linear(64, 32, bias=False), (16, 64), 1.0, id="linear2d_nobias"),
    Case("conv2d_split_backward", lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1), (2, 8, 16, 16), 1.0, id="conv"),
    Case("conv2d_split_backward", lambda: nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False), (2, 8, 16, 16), 1.0,
         id="conv_grouped"),
]


def _build(case: Case, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = case.make()
    _rand_norm_params(m)
    seq = nn.Sequential(m, case.consumer()) if case.consumer is not None else nn.Sequential(m)
    return seq.to(dtype).train()


def _run(seq: nn.Module, x0: torch.Tensor, g_seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict, int]:
    x = x0.detach().clone().requires_grad_(True)
    torch.manual_seed(123)  # dropout draws
    out, nbytes = saved_bytes(lambda: seq(x * 1), seq)  # x*1: a non-leaf input, so in-place modules may run
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad for n, p in seq.named_parameters()}, nbytes


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_impl_matches_stock_fp32(case: Case) -> None:
    stock = _build(case, torch.float32)
    ours = copy.deepcopy(stock)
    assert IMPLS[case.impl] in impls_for(ours[0])
    install_impl(ours[0], case.impl)
    x0 = torch.randn(case.shape, generator=torch.Generator().manual_seed(7)) * 2

    y_s, gx_s, gp_s, bytes_s = _run(stock, x0)
    y_o, gx_o, gp_o, bytes_o = _run(ours, x0)

    assert y_o.dtype == y_s.dtype and torch.equal(y_o, y_s), "forward must be bitwise identical"
    grads = [(gx_o, gx_s)] + [(gp_o[n], gp_s[n]) for n in gp_s]
    for a, b in grads:
        if case.tol is None:
            assert torch.equal(a, b)
        else:
            assert rel(a, b) <= case.tol
    for (n, b_s), (_, b_o) in zip(stock.named_buffers(), ours.named_buffers()):
        assert torch.equal(b_s, b_o), f"buffer {n} differs after a step"
    ratio = bytes_o / bytes_s
    assert ratio == pytest.approx(case.ratio, rel=0.03, abs=2e-3), f"saved {bytes_o} vs stock {bytes_s} bytes"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_impl_matches_stock_bf16(case: Case) -> None:
    stock = _build(case, torch.bfloat16)
    ours = copy.deepcopy(stock)
    install_impl(ours[0], case.impl)
    ref32 = copy.deepcopy(stock).float()  # the same bf16 weights, run in fp32: the accuracy yardstick
    x0 = (torch.randn(case.shape, generator=torch.Generator().manual_seed(7)) * 2).bfloat16()

    y_s, gx_s, gp_s, _ = _run(stock, x0)
    y_o, gx_o, gp_o, _ = _run(ours, x0)
    assert y_o.dtype == torch.bfloat16 and torch.equal(y_o, y_s)
    assert gx_o.dtype == torch.bfloat16 and all(gp_o[n].dtype == torch.bfloat16 for n in gp_o)
    if case.tol is None:
        assert torch.equal(gx_o, gx_s) and all(torch.equal(gp_o[n], gp_s[n]) for n in gp_s)
        return
    _, gx_r, gp_r, _ = _run(ref32, x0.float())
    # not bitwise: at least as close to the fp32 result as the stock bf16 op is, up to one bf16 rounding
    for a, b, r in [(gx_o, gx_s, gx_r)] + [(gp_o[n], gp_s[n], gp_r[n]) for n in gp_s]:
        assert rel(a, r) <= 2 * rel(b, r) + 2**-8


# ----------------------------------------------------------------------------------------------------------------
# packbits


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001, 4096])
def test_pack_bool_roundtrip(n: int) -> None:
    m = torch.rand(n) > 0.4
    packed, shape = pack_bool(m)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n) == (n + 7) // 8
    assert torch.equal(unpack_bool(packed, shape), m)
    # plane by plane: bit p of byte k holds element p * bytes + k (4096: whole 64-bit words; the others: bytes)
    planes = torch.cat([m, m.new_zeros(8 * packed.numel() - n)]).view(8, packed.numel()).to(torch.uint8)
    assert torch.equal(packed.int(), sum(planes[p].int() << p for p in range(8)))
    m3 = (torch.rand(3, 5, 7) > 0.5).transpose(0, 2)  # non-contiguous: logical order
    assert torch.equal(unpack_bool(*pack_bool(m3)), m3)
    assert narrowest_uint(255) == torch.uint8 and narrowest_uint(256) == torch.int16


# ----------------------------------------------------------------------------------------------------------------
# functional details


def test_inplace_relu_output_may_be_modified_later() -> None:
    x0 = torch.randn(4, 32)
    # stock: relu_ saves its output, so a later in-place op breaks backward
    x = x0.clone().requires_grad_(True)
    y = F.relu(x * 1, inplace=True)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()
    # ours: only the mask is saved; the gradient is the one of the out-of-place program
    x = x0.clone().requires_grad_(True)
    y = Zf.relu(x * 1, inplace=True)
    y.mul_(2)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * (x0 > 0).float())


def test_dropout_same_draws_as_stock() -> None:
    x = torch.randn(64, 33)
    for p in (0.1, 0.123, 0.5, 0.9):
        torch.manual_seed(0)
        a = F.dropout(x, p)
        after_a = torch.rand(3)
        torch.manual_seed(0)
        b = Zf.dropout(x.requires_grad_(True), p)
        after_b = torch.rand(3)
        assert torch.equal(a, b.detach()) and torch.equal(after_a, after_b)
        x = x.detach()
    assert Zf.dropout(x, 0.0) is x or torch.equal(Zf.dropout(x, 0.0), x)


def test_output_saving_norm_then_inplace_relu_runs_out_of_place() -> None:
    bn, relu = nn.BatchNorm2d(4), nn.ReLU(inplace=True)
    _rand_norm_params(bn)
    ref = nn.Sequential(copy.deepcopy(bn), copy.deepcopy(relu))
    install_impl(bn, "batchnorm_output")
    install_impl(relu, "relu_bitmask")
    ours = nn.Sequential(bn, relu)
    x0 = torch.randn(3, 4, 5, 5)
    grads = []
    for model in (ref, ours):
        x = x0.clone().requires_grad_(True)
        model(x).square().sum().backward()
        grads.append(x.grad)
    assert rel(grads[1], grads[0]) < 1e-5


def test_output_saving_norm_modified_in_place_raises_clearly() -> None:
    bn = nn.BatchNorm1d(4)
    install_impl(bn, "batchnorm_output")
    x = torch.randn(8, 4, requires_grad=True)
    y = bn(x)
    y += 1.0  # like `x += shortcut` in a ResNet block
    with pytest.raises(RuntimeError, match="zoomem: batch_norm_act saves its output"):
        y.sum().backward()


@pytest.mark.parametrize("which", ["bn", "ln", "rms"])
def test_zero_gamma_falls_back_to_saving_the_input(which: str) -> None:
    torch.manual_seed(0)
    if which == "bn":
        m, impl, shape = nn.BatchNorm2d(6), "batchnorm_output", (4, 6, 5, 5)
    elif which == "ln":
        m, impl, shape = nn.LayerNorm(6), "layernorm_output", (4, 5, 6)
    else:
        m, impl, shape = llama_rmsnorm(6), "rmsnorm_output", (4, 5, 6)
    _rand_norm_params(m)
    with torch.no_grad():
        m.weight[1] = 0.0  # timm zero-inits the last BN of every residual block
    ours = copy.deepcopy(m)
    install_impl(ours, impl)
    x0 = torch.randn(shape)
    res = []
    for model in (m, ours):
        x = x0.clone().requires_grad_(True)
        out, nbytes = saved_bytes(lambda: model(x), model)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        res.append((x.grad, model.weight.grad, nbytes))
    assert torch.isfinite(res[1][0]).all() and torch.isfinite(res[1][1]).all()
    assert rel(res[1][0], res[0][0]) < 1e-6 and rel(res[1][1], res[0][1]) < 1e-6
    assert res[1][1][1] != 0  # the zero-gamma channel's gamma gradient needs the input: it is there
    assert res[1][2] >= x0.numel() * 4  # the input is saved


def test_maxpool_large_kernel_uses_wider_offsets() -> None:
    x0 = torch.randn(1, 2, 40, 40)
    a, b = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    F.max_pool2d(a, 17, 3).sum().backward()  # kernel area 289 > 256: int16 offsets
    out, nbytes = saved_bytes(lambda: Zf.max_pool2d(b, 17, 3), nn.Module())
    out.sum().backward()
    assert torch.equal(a.grad, b.grad) and nbytes == out.numel() * 2


def test_maxpool_channels_last() -> None:
    x0 = torch.randn(2, 4, 11, 11).to(memory_format=torch.channels_last)
    a, b = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    ya, yb = F.max_pool2d(a, 3, 2, 1), Zf.max_pool2d(b, 3, 2, 1)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad)
    assert b.grad.is_contiguous(memory_format=torch.channels_last)


class _LogMM(TorchDispatchMode):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.log.append(("mm", tuple(out.shape)))
        return out


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.parametrize("split", [False, True])
def test_linear_split_backward_frees_input_before_grad_input(split: bool) -> None:
    import weakref

    log: list = []

    def pack(t: torch.Tensor) -> _Holder:
        h = _Holder(t)
        if t.shape == (64, 32):
            weakref.finalize(h, log.append, ("released input",))
        return h

    x0 = torch.randn(64, 32, requires_grad=True)
    lin = nn.Linear(32, 16)
    if split:
        install_impl(lin, "linear_split_backward")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        y = lin(x0 * 2)  # the input is held by the linear layer alone
    with _LogMM(log):
        y.sum().backward()
    if split:  # grad_weight (16x32), then the input is gone, then grad_input (64x32)
        assert log == [("mm", (16, 32)), ("released input",), ("mm", (64, 32))]
    else:  # stock: grad_input is allocated while the input is still held
        assert log.index(("mm", (64, 32))) < log.index(("released input",))


def test_linear_split_backward_lowers_measured_peak() -> None:
    from zoomem.measure import MemoryMeter

    peaks = []
    for split in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(1024, 64)
        if split:
            install_impl(lin, "linear_split_backward")
        w = torch.randn(1, 1024, requires_grad=True)
        with MemoryMeter(lin) as meter:
            h = w.repeat(256, 1)  # 1 MiB, held only by the linear layer; its backward allocates little
            y = lin(h)
            del h
            meter.mark("forward")
            y.sum().backward()
            meter.mark("backward")
        peaks.append(meter.report.phases["backward"].peak_bytes)
    assert peaks[0] - peaks[1] >= 256 * 1024 * 4 * 0.9  # |input| less


def test_linear_under_cpu_autocast() -> None:
    lin = nn.Linear(32, 16)
    ours = copy.deepcopy(lin)
    install_impl(ours, "linear_split_backward")
    x0 = torch.randn(4, 32)
    res = []
    for model in (lin, ours):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
        res.append((y, x.grad, model.weight.grad))
    assert res[0][0].dtype == res[1][0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1]))


# ----------------------------------------------------------------------------------------------------------------
# double backward: every Function's backward is differentiable (float64 gradgradcheck), also w.r.t. the tensors it
# saved (what zoomem's sensitivity estimator differentiates), and create_graph leaves first-order values bitwise


def _grid(*shape: int) -> torch.Tensor:
    """float64 values -1.45, -1.35, ..., 1.45 (shuffled, cycled): at least 0.05 from the kinks used below (0, 0.3,
    -0.7, 0.9), so finite differences never straddle one."""
    n = math.prod(shape)
    v = torch.linspace(-1.45, 1.45, 30, dtype=torch.float64).repeat(n // 30 + 1)[:n]
    return v[torch.randperm(n, generator=torch.Generator().manual_seed(n))].view(shape).requires_grad_(True)


def _randn(*shape: int, seed: int = 0, lo: float | None = None) -> torch.Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if lo is not None:  # keep |t| >= lo (gamma away from 0)
        t = t.sign() * (t.abs() + lo)
    return t.requires_grad_(True)


def _distinct(*shape: int) -> torch.Tensor:
    """Distinct values 0.1 apart (no ties inside a pooling window)."""
    n = math.prod(shape)
    return (torch.randperm(n, generator=torch.Generator().manual_seed(1)).double() / 10).view(shape).requires_grad_()


def _gamma(c: int, zero: bool = False) -> torch.Tensor:
    g = _randn(c, seed=5, lo=0.5).detach()
    if zero:
        g[1] = 0.0  # the output-activated norms fall back to saving the input
    return g.requires_grad_(True)


def _seeded_dropout(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)
    return Zf.dropout(x * 1, 0.3)


def _fused_dropout(x: torch.Tensor) -> torch.Tensor:  # the CUDA path (native_dropout), run on CPU
    with mock.patch.object(Zf, "_fused_dropout_device", lambda t: True):
        return _seeded_dropout(x)


def _bn(act: str, zero: bool = False, affine: bool = True, shape: tuple = (3, 3, 2, 2)) -> tuple:
    c = shape[1]
    if not affine:
        return (lambda x: Zf.batch_norm_act(x, None, None, None, None, True, act=act, negative_slope=0.1)), (
            lambda: (_randn(*shape),))
    return (lambda x, w, b: Zf.batch_norm_act(x, None, None, w, b, True, act=act, negative_slope=0.1)), (
        lambda: (_randn(*shape), _gamma(c, zero), _randn(c, seed=6)))


def _stored(fn: Callable) -> Callable:
    """``fn`` as it runs under zoomem's saved-tensor store (``separate_masks``: BatchNorm saves xhat and a mask)."""
    def run(*args: torch.Tensor) -> torch.Tensor:
        with Zf.separate_masks():
            return fn(*args)

    return run


def _ln(zero: bool = False) -> tuple:
    fn = lambda x, w, b: Zf.layer_norm(x, (4,), w, b)  # noqa: E731
    return fn, (lambda: (_randn(2, 3, 4), _gamma(4, zero), _randn(4, seed=6)))


def _spmm(reduce: str) -> tuple:
    from zoomem.ops.message_passing import _CsrSpmmReduce

    n = 7  # rows 0..6 with 2, 1, 0, 3, 1, 2, 1 entries (an empty row)
    crow = torch.tensor([0, 2, 3, 3, 6, 7, 9, 10])
    col = torch.tensor([1, 4, 0, 1, 2, 5, 3, 0, 6, 2])

    def spmm(x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():  # torch's note that sparse CSR support is in beta
            warnings.simplefilter("ignore", UserWarning)
            adj = torch.sparse_csr_tensor(crow, col, torch.ones(10, dtype=x.dtype), (n, n))
        return _CsrSpmmReduce.apply(adj, x, reduce)

    return spmm, (lambda: (_distinct(n, 3),))


# id -> (fn, inputs factory, gradcheck tolerances)
DD_CASES: dict[str, tuple[Callable, Callable, dict]] = {
    "relu": (lambda x: Zf.relu(x), lambda: (_grid(3, 10),), {}),
    "relu_inplace": (lambda x: Zf.relu(x * 1, inplace=True), lambda: (_grid(3, 10),), {}),
    "hardtanh": (lambda x: Zf.hardtanh(x, -0.7, 0.9), lambda: (_grid(3, 10),), {}),
    "leaky_inplace": (lambda x: Zf.leaky_relu(x * 1, 0.2, inplace=True), lambda: (_grid(3, 10),), {}),
    "threshold": (lambda x: Zf.threshold(x, 0.3, -1.0), lambda: (_grid(3, 10),), {}),
    "dropout": (_seeded_dropout, lambda: (_randn(3, 10),), {}),
    "dropout_fused": (_fused_dropout, lambda: (_randn(3, 10),), {}),
    **{f"bn_{a}": (*_bn(a), {}) for a in ("identity", "relu", "leaky_relu")},
    **{f"bn_{a}_gamma0": (*_bn(a, zero=True), {}) for a in ("identity", "relu", "leaky_relu")},
    "bn1d_plain": (*_bn("identity", affine=False, shape=(6, 3)), {}),
    **{f"bn_{a}_stored{z}": (_stored(_bn(a, zero=bool(z))[0]), _bn(a, zero=bool(z))[1], {})
       for a in ("identity", "relu", "leaky_relu") for z in ("", "_gamma0")},
    "ln_stored": (_stored(_ln()[0]), _ln()[1], {}),
    "ln": (*_ln(), {}),
    "ln_gamma0": (*_ln(zero=True), {}),
    "ln_plain_2d": (lambda x: Zf.layer_norm(x, (3, 4)), lambda: (_randn(2, 3, 4),), {}),
    # HF's RMSNorm computes in fp32 whatever the input dtype: finite differences need a larger step
    "rms": (lambda x, w: Zf.rms_norm(x, w, 1e-6), lambda: (_randn(2, 3, 4), _gamma(4)),
            {"eps": 1e-3, "atol": 2e-3, "rtol": 2e-3}),
    "rms_gamma0": (lambda x, w: Zf.rms_norm(x, w, 1e-6), lambda: (_randn(2, 3, 4), _gamma(4, zero=True)),
                   {"eps": 1e-3, "atol": 2e-3, "rtol": 2e-3}),
    "rms_stored": (_stored(lambda x, w: Zf.rms_norm(x, w, 1e-6)), lambda: (_randn(2, 3, 4), _gamma(4)),
                   {"eps": 1e-3, "atol": 2e-3, "rtol": 2e-3}),
    "maxpool": (lambda x: Zf.max_pool2d(x, 3, 2, 1), lambda: (_distinct(1, 2, 6, 6),), {}),
    "maxpool_dilated_ceil_cl": (
        lambda x: Zf.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2, dilation=2, ceil_mode=True),
        lambda: (_distinct(1, 2, 5, 5),), {}),
    "linear3d": (lambda x, w, b: Zf.linear(x, w, b), lambda: (_randn(2, 3, 4), _randn(5, 4, seed=1), _randn(5)), {}),
    "linear2d_nobias": (lambda x, w: Zf.linear(x, w), lambda: (_randn(3, 4), _randn(5, 4, seed=1)), {}),
    "linear_weight_only": (lambda w: Zf.linear(torch.ones(3, 4, dtype=w.dtype), w),
                           lambda: (_randn(5, 4, seed=1),), {}),
    "conv_grouped": (lambda x, w, b: Zf.conv2d(x, w, b, 2, 1, 1, 2),
                     lambda: (_randn(1, 4, 3, 3), _randn(2, 2, 2, 2, seed=1), _randn(2)), {}),
    "conv_channels_last": (lambda x, w: Zf.conv2d(x.contiguous(memory_format=torch.channels_last), w, None, 1, 1),
                           lambda: (_randn(1, 3, 4, 4), _randn(2, 3, 3, 3, seed=1)), {}),
    "conv_bias_only": (lambda b: Zf.conv2d(torch.ones(1, 2, 4, 4, dtype=b.dtype), torch.ones(3, 2, 3, 3, dtype=b.dtype),
                                           b, 1, 1),
                       lambda: (_randn(3),), {}),
    **{f"spmm_{r}": (*_spmm(r), {}) for r in ("sum", "mean", "max", "min")},
}


def test_batch_norm_under_the_store_saves_unit_scale_xhat() -> None:
    """Under the store a saved tensor may be rounded: BatchNorm saves xhat (channels at unit scale) rather than
    its input (channel scales 1e-3..1e3 in one rounding group) or its output (read back through 1 / gamma)."""
    x = torch.randn(8, 4, 3, 3) * torch.tensor([1e-3, 1.0, 1e3, 5.0]).view(1, 4, 1, 1)
    w = torch.tensor([1e-6, 0.0, 1.0, 2.0], requires_grad=True)
    b = torch.zeros(4, requires_grad=True)
    with Zf.separate_masks():
        y = Zf.batch_norm_act(x.requires_grad_(), None, None, w, b, True, act="identity")
    saved = y.grad_fn.saved_tensors[0]
    assert saved.shape == x.shape
    mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
    torch.testing.assert_close(saved, (x - mean) / torch.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)  # F's eps
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    y.backward(g)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.batch_norm(ref_x, None, None, ref_w, b.detach(), True).backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(DD_CASES))
def test_gradgradcheck(case: str) -> None:
    fn, inputs, tol = DD_CASES[case]
    assert torch.autograd.gradcheck(fn, inputs(), **tol)
    assert torch.autograd.gradgradcheck(fn, inputs(), **tol)


def _zoomem_nodes(t: torch.Tensor) -> list:
    """The zoomem autograd-Function nodes of ``t``'s graph."""
    seen, stack, nodes = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, BackwardCFunction) and node._forward_cls.__module__.startswith("zoomem."):
            nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


@pytest.mark.parametrize("case", list(DD_CASES))
def test_double_backward_reaches_saved_tensors(case: str) -> None:
    """Each backward, called on a stand-in ctx whose saved floating tensors are independent leaves, is
    differentiable w.r.t. them (and the incoming gradients, one per output of the Function), correctly: gradcheck."""
    fn, inputs, tol = DD_CASES[case]
    nodes = _zoomem_nodes(fn(*inputs()))
    assert nodes
    for node in nodes:
        saved = node.saved_tensors
        floating = [i for i, t in enumerate(saved) if t is not None and t.is_floating_point()]
        gen = torch.Generator().manual_seed(2)
        grads = [torch.randn(tuple(m.shape), generator=gen, dtype=torch.float64).requires_grad_(True)
                 for m in node._input_metadata]  # one per output of the Function
        leaves = [saved[i].detach().double().requires_grad_(True) for i in floating]

        def backward(*args: torch.Tensor, node=node, saved=saved, floating=floating) -> tuple:
            values = list(saved)
            for i, t in zip(floating, args[: len(floating)]):
                values[i] = t
            ctx = SimpleNamespace(**vars(node), saved_tensors=tuple(values), needs_input_grad=node.needs_input_grad)
            out = node._forward_cls.backward(ctx, *args[len(floating):])
            return tuple(g for g in out if g is not None)

        assert torch.autograd.gradcheck(backward, (*leaves, *grads), fast_mode=True, **tol), type(node).__name__


@pytest.mark.parametrize("case", list(DD_CASES))
def test_create_graph_keeps_first_order_bitwise(case: str) -> None:
    """fp32: the gradients a create_graph backward returns are the ordinary backward's, bitwise, and differentiable."""
    fn, inputs, _ = DD_CASES[case]
    xs = [t.detach().float().requires_grad_(True) for t in inputs()]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    plain = torch.autograd.grad(out, xs, g, retain_graph=True)
    recorded = torch.autograd.grad(out, xs, g, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert any(r.requires_grad for r in recorded)


# ----------------------------------------------------------------------------------------------------------------
# registry and installation


def test_impls_for_and_applies() -> None:
    assert [i.name for i in impls_for(nn.ReLU())] == ["relu_bitmask"]
    assert [i.name for i in impls_for(nn.ReLU6())] == ["hardtanh_bitmask"]
    assert [i.name for i in impls_for(nn.BatchNorm2d(4))] == ["batchnorm_output", "batchnorm_rebuilt_output"]
    assert [i.name for i in impls_for(timm_bn_act("relu"))] == ["batchnorm_act_rebuilt_output", "batchnorm_act_output"]
    from timm.layers import BatchNormAct2d

    # any activation runs after the identity op (it saves the norm's output as its input); a drop keeps the stock op
    assert [i.name for i in impls_for(BatchNormAct2d(4, act_layer=nn.GELU))] == ["batchnorm_act_output"]
    assert impls_for(BatchNormAct2d(4, act_layer=nn.GELU, drop_layer=nn.Dropout)) == []
    assert impls_for(nn.MaxPool2d(2, return_indices=True)) == []
    assert impls_for(nn.SyncBatchNorm(4)) == []
    assert impls_for(nn.GELU()) == [] and impls_for(nn.SiLU()) == []

    class MyReLU(nn.ReLU):
        def forward(self, x):
            return super().forward(x) * 2

    assert impls_for(MyReLU()) == []  # overrides forward: not ours to replace
    assert [i.name for i in impls_for(llama_rmsnorm(8))] == ["rmsnorm_output"]

    class GemmaLikeRMSNorm(nn.Module):  # same attributes, different numbers: (1 + weight)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.eps = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).type_as(x)

    assert impls_for(GemmaLikeRMSNorm()) == []
    assert impls_for(nn.RMSNorm(8, eps=1e-6)) == []  # F.rms_norm: fused kernels elsewhere, not the HF op sequence


def test_register_impl_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_impl(Impl("relu_bitmask", (nn.ReLU,), lambda m, x: x))


def test_install_undo_leaves_module_identical() -> None:
    m = nn.BatchNorm2d(4)
    calls = []
    m.register_forward_hook(lambda mod, i, o: calls.append(1))
    keys, dict_keys = list(m.state_dict()), set(m.__dict__)
    undo = install_impl(m, "batchnorm_output")
    assert list(m.state_dict()) == keys and [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert installed_impl(m) is IMPLS["batchnorm_output"]
    m(torch.randn(2, 4, 3, 3, requires_grad=True))
    assert calls == [1]  # hooks still run
    with pytest.raises(ValueError, match="already runs"):
        install_impl(m, "batchnorm_output")
    with pytest.raises(ValueError, match="does not apply"):
        install_impl(nn.ReLU(), "batchnorm_output")
    with pytest.raises(KeyError, match="Unknown implementation"):
        install_impl(nn.ReLU(), "nope")
    undo()
    assert set(m.__dict__) == dict_keys and installed_impl(m) is None and list(m.state_dict()) == keys
    assert type(m).forward is nn.BatchNorm2d.forward  # the class was never touched
    m(torch.randn(2, 4, 3, 3))
    assert calls == [1, 1]


def test_installed_model_deepcopies_and_pickles() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    install_impl(m[0], "linear_split_backward")
    install_impl(m[1], "relu_bitmask")
    c = copy.deepcopy(m)
    assert c[1].forward.args[0] is c[1]  # the copy's wrapper drives the copy
    c(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert c[0].weight.grad is not None and m[0].weight.grad is None
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert installed_impl(loaded[1]).name == "relu_bitmask"


def test_eval_and_no_grad_call_the_stock_forward() -> None:
    calls = []
    name = "test_counting_bn"
    impl = IMPLS.get(name) or register_impl(
        Impl(name, (nn.BatchNorm2d,), lambda m, x: (calls.append(1), IMPLS["batchnorm_output"].forward(m, x))[1])
    )
    m = nn.BatchNorm2d(4)
    ref = copy.deepcopy(m)
    install_impl(m, impl)
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    m.eval(), ref.eval()
    assert torch.equal(m(x), ref(x)) and calls == []
    m.train(), ref.train()
    with torch.no_grad():
        assert torch.equal(m(x), ref(x)) and calls == []
    with torch.inference_mode():
        m(x)
    assert calls == []
    m(x.detach())  # nothing needs a gradient... but the BN parameters do
    assert calls == [1]
    for (n, a), (_, b) in zip(m.named_buffers(), ref.named_buffers()):
        assert n != "num_batches_tracked" or int(a) == int(b) + 2
    del IMPLS[name]


def test_find_inplace_writers() -> None:
    m = nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(inplace=True))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert find_inplace_writers(m, torch.randn(3, 4)) == {"0": ["1"]}
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # running stats restored


# ----------------------------------------------------------------------------------------------------------------
# a real model


def _resnet_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = model(x)
    loss = out.logsumexp(-1).mean() + out.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("everything", [False, True], ids=["relu_bn", "all_impls"])
def test_timm_resnet18_gradients_match(everything: bool) -> None:
    torch.manual_seed(0)
    stock = timm.create_model("resnet18", pretrained=False, num_classes=10).train()
    for m in stock.modules():  # non-zero gammas everywhere (timm zero-inits each block's last BN)
        if isinstance(m, nn.BatchNorm2d):
            _rand_norm_params(m)
    ours = copy.deepcopy(stock)
    x = torch.randn(2, 3, 64, 64)

    writers = find_inplace_writers(ours, x)
    relus = {n for n, m in ours.named_modules() if isinstance(m, nn.ReLU)}
    installed, skipped = [], []
    for n, m in ours.named_modules():
        if n in relus:
            install_impl(m, "relu_bitmask")
            installed.append(n)
        elif isinstance(m, nn.BatchNorm2d):
            # safe when nothing but a bitmask ReLU (which then runs out of place) writes over its output
            if set(writers.get(n, [])) <= relus:
                install_impl(m, "batchnorm_output")
                installed.append(n)
            else:
                skipped.append(n)
        elif everything and impls_for(m):
            install_impl(m, impls_for(m)[0])
            installed.append(n)
    # BasicBlock.bn2's output gets `x += shortcut`: the only BNs that must keep the stock op
    assert skipped == [f"layer{i}.{j}.bn2" for i in range(1, 5) for j in range(2)]
    assert len(installed) == 17 + 12 + (20 + 1 + 1 if everything else 0)  # relus, bns, (convs, maxpool, fc)

    for _ in range(2):  # two steps: running statistics feed nothing here, but must match
        loss_s, g_s = _resnet_step(stock, x)
        loss_o, g_o = _resnet_step(ours, x)
        assert torch.equal(loss_s, loss_o)  # forward is bitwise identical
        for n in g_s:
            assert g_s[n].norm() > 0
            assert rel(g_o[n], g_s[n]) < 1e-5, n
        for (n, a), (_, b) in zip(stock.named_buffers(), ours.named_buffers()):
            assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "model_id, impls",
    [
        ("timm/resnet18", {"relu_bitmask", "batchnorm_rebuilt_output", "conv2d_split_backward"}),
        ("hf/bert-base-uncased", {"dropout_bitmask", "layernorm_output", "linear_split_backward",
                                  "attention_recompute"}),
        ("hf/gpt2", {"attention_recompute", "pointwise_recompute", "cross_entropy_logits", "embedding_tied_grad"}),
        ("pyg/sage", {"message_passing_spmm"}),  # mean aggregation: aten's CPU SpMM-reduce kernel, routed
        ("pyg/gcn", {"message_passing_spmm"}),  # a normalised adjacency: its product routed, saved compactly
    ],
)
def test_compact_model_supports_gradient_of_gradients(model_id: str, impls: set[str]) -> None:
    """grad(loss, params, create_graph=True), then the gradient of a scalar of those gradients, through a model
    with every compact implementation zoomem would switch on: first-order gradients bitwise as without
    create_graph, second-order ones finite and as the stock model's, to fp32 rounding (each Function's second
    order is checked exactly above; this checks the assembly)."""
    from zoomem.runtime.compact import choose_impls, install_all
    from zoomem.zoo import small

    if model_id.startswith("pyg/"):
        pytest.importorskip("torch_geometric")
    flat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
    results = []
    for compact in (False, True):
        model, adapter, batch = small(model_id, batch_size=1)
        model.train()
        if compact:
            chosen = choose_impls(model, adapter.units(model), batch, outside=True)
            assert impls <= {impl.name for pairs in chosen.values() for _, impl in pairs}
            install_all(chosen)
        params = [p for p in model.parameters() if p.requires_grad]
        torch.manual_seed(0)  # dropout draws
        loss = adapter.loss(model, batch, batch.call(model))
        plain = torch.autograd.grad(loss, params, retain_graph=True)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        # bitwise, but where a tied LM head hands its weight gradient to the embedding (off under create_graph):
        # the same sum, reassociated
        tied = getattr(model.get_input_embeddings(), "weight", None) if compact and model_id == "hf/gpt2" else None
        assert all(torch.equal(a, b) or (p is tied and rel(a, b) < 1e-6) for p, a, b in zip(params, plain, grads))
        penalty = sum(g.square().sum() for g in grads)
        second = torch.autograd.grad(penalty, params)
        results.append((flat(grads).detach(), flat(second)))
    (g_stock, h_stock), (g_ours, h_ours) = results
    assert torch.isfinite(h_ours).all() and h_ours.norm() > 0
    assert rel(g_ours, g_stock) < 1e-5 and rel(h_ours, h_stock) < 1e-4


@pytest.mark.parametrize("improved", [False, True])
def test_gcn_conv_keeps_only_its_adjacency_structure(improved: bool) -> None:
    """A GCN layer through the CSR path keeps no CSR matrix after its forward, only the structure of its normalised
    adjacency (int32 row pointers and column indices, 4 bytes an edge, in storages of their own); backward rebuilds
    the values bit for bit. The stock product keeps GCN's normalised matrix, whose column indices are a view of the
    self-looped ``[2, E]`` int64 edge list (20 bytes an edge). Output and input gradient bitwise the stock CSR
    product's."""
    import gc

    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GCNConv

    from zoomem.ops import message_passing as mp

    mp.register_message_passing_impl()  # (importing zoomem's PyG adapter does it; not every test run has)

    def alive_csr() -> list[torch.Tensor]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.layout == torch.sparse_csr]

    torch.manual_seed(0)
    n = 300
    edge_index = torch.randint(0, n, (2, 3000))
    edge_index = torch.unique(edge_index[:, edge_index[0] != edge_index[1]], dim=1)  # simple: the CSR path applies
    x0 = torch.randn(n, 8)
    results = []
    for compact in (False, True):
        torch.manual_seed(1)
        conv = GCNConv(8, 4, improved=improved)
        if compact:
            install_impl(conv, "message_passing_spmm")
        mp._LIVE.clear()
        before = {id(t) for t in alive_csr()}
        x = x0.clone().requires_grad_()
        out = conv(x, edge_index) if compact else _stock_csr_conv(conv, x, edge_index)
        held = [t for t in alive_csr() if id(t) not in before]
        parts = [tuple(r() for r in entry) for entry in mp._LIVE]
        results.append((out, torch.autograd.grad(out.sum(), x)[0], held, parts))
        del held, parts
    (out_s, gx_s, (adj_s,), _), (out_c, gx_c, held_c, parts_c) = results
    assert torch.equal(out_c, out_s) and torch.equal(gx_c, gx_s)
    assert held_c == [] and len(parts_c) == 1
    (crow, col), nnz = parts_c[0], adj_s.values().numel()
    own = lambda t: t.untyped_storage().nbytes()  # noqa: E731
    assert crow.dtype == col.dtype == torch.int32 and own(crow) + own(col) == 4 * (n + 1) + 4 * nnz
    assert own(adj_s.col_indices()) == 16 * nnz  # the stock one: both rows of the edge list


def test_a_constant_product_saves_its_matrix_compactly() -> None:
    """``torch.sparse.mm`` of a constant CSR matrix whose values are not GCN's normalisation of its structure:
    the product saves the whole matrix, int32 indices and values in storages of their own; output and gradient
    bitwise the stock product's, a second backward through it as through the stock one."""
    import gc

    from zoomem.ops.message_passing import _compact_product, _gcn_fill

    torch.manual_seed(0)
    n = 200
    dense = torch.rand(n, n) * (torch.rand(n, n) < 0.05)
    wide = dense.to_sparse_csr()
    adj = torch.sparse_csr_tensor(wide.crow_indices(), torch.cat([wide.col_indices(), torch.zeros(7, dtype=torch.long)])[:-7],
                                  wide.values(), wide.shape)  # column indices a view into a larger storage
    assert _gcn_fill(adj) is None
    x = torch.randn(n, 6, requires_grad=True)
    ref = torch.sparse.mm(adj, x)
    g_ref, = torch.autograd.grad(ref.square().sum(), x, create_graph=True)
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    out = _compact_product(adj, x)
    gc.collect()
    held = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.layout == torch.sparse_csr
            and id(o) not in before]
    g_out, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    assert torch.equal(out, ref) and torch.equal(g_out, g_ref)
    assert torch.equal(torch.autograd.grad(g_out.sum(), x)[0], torch.autograd.grad(g_ref.sum(), x)[0])
    assert len(held) == 1 and held[0].col_indices().dtype == torch.int32
    assert held[0].col_indices().untyped_storage().nbytes() == 4 * adj.values().numel()


@pytest.mark.parametrize("model_id", ["pyg/gcn", "pyg/sage"])
@pytest.mark.parametrize("store", [False, True], ids=["plain", "store"])
def test_gnn_layers_share_one_saved_adjacency(model_id: str, store: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer builds the same adjacency from one edge list: through the CSR path the layers' products save
    one copy of its parts between them (GCN's normalised matrix through the plain product, SAGE's structure
    through the reduce product), with zoomem's saved-tensor store around the forward or not; the step holds one
    adjacency after forward where it held one a layer, and output and gradients are bitwise the same."""
    pytest.importorskip("torch_geometric")
    from zoomem.measure import MemoryMeter
    from zoomem.ops import message_passing as mp
    from zoomem.runtime.compact import choose_impls, install_all
    from zoomem.runtime.storage import SavedTensorStore
    from zoomem.zoo import small

    @contextlib.contextmanager
    def own_copies(parts: tuple, dtypes: tuple) -> Iterator[tuple]:
        yield tuple(mp._compact_member(p, d) for p, d in zip(parts, dtypes))

    model, adapter, batch = small(model_id)
    install_all(choose_impls(model, adapter.units(model), batch, outside=True))
    assert len(model.convs) == 3
    results = []
    for shared in (True, False):
        with monkeypatch.context() as m:
            if not shared:
                m.setattr(mp, "_shared_parts", own_copies)
            mp._LIVE.clear()
            model.zero_grad(set_to_none=True)
            hooks = SavedTensorStore().hooks(model, batch.args, batch.kwargs) if store else contextlib.nullcontext()
            with MemoryMeter() as meter:
                with hooks:
                    out = batch.call(model)
                meter.mark("forward")
                loss = adapter.loss(model, batch, out)
                held = [parts for parts in (tuple(r() for r in entry) for entry in mp._LIVE) if all(p is not None for p in parts)]
                loss.backward()
            results.append((out.detach(), [p.grad.clone() for p in model.parameters()],
                            meter.report.activation_bytes, held))
            del held
    (out_s, g_s, end_s, held_s), (out_o, g_o, end_o, _) = results
    assert len(held_s) == 1  # one set of parts alive after forward, for all three layers
    parts = held_s[0]
    adjacency = sum(p.untyped_storage().nbytes() for p in parts)
    assert torch.equal(out_s, out_o) and all(torch.equal(a, b) for a, b in zip(g_s, g_o))
    # GCN's first layer multiplies its transformed input (which needs a gradient) by the adjacency, so all three
    # products save it; SAGE's aggregates the input features themselves (no gradient): two save it
    saving = {"pyg/gcn": 3, "pyg/sage": 2}[model_id]
    assert end_o - end_s == (saving - 1) * adjacency, (end_o, end_s, adjacency)


def test_gcn_layers_on_different_graphs_share_nothing() -> None:
    """Two graphs alive in one autograd graph (the same layer run on two edge lists of the same size before one
    backward, as a model with two edge types does), then a forward under ``no_grad``: each product keeps its own
    graph's structure (the sharing compares bits, not sizes), gradients are bitwise the stock CSR product's, and
    without grad PyG's own path runs and nothing is made."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GCNConv

    from zoomem.ops import message_passing as mp

    mp.register_message_passing_impl()
    torch.manual_seed(0)
    n = 300
    graphs = []
    for _ in range(2):
        e = torch.randint(0, n, (2, 3000))
        graphs.append(torch.unique(e[:, e[0] != e[1]], dim=1)[:, :2500])  # simple, and the same edge count
    x0 = torch.randn(n, 8)
    results = []
    for compact in (False, True):
        torch.manual_seed(1)
        conv = GCNConv(8, 4)
        if compact:
            install_impl(conv, "message_passing_spmm")
        mp._LIVE.clear()
        x = x0.clone().requires_grad_()
        outs = [conv(x, g) if compact else _stock_csr_conv(conv, x, g) for g in graphs]
        alive = [tuple(r() for r in entry) for entry in mp._LIVE]
        results.append((outs, torch.autograd.grad(sum(o.square().sum() for o in outs), [x, conv.lin.weight]), alive))
        del alive
    (outs_s, grads_s, _), (outs_c, grads_c, alive_c) = results
    assert all(torch.equal(a, b) for a, b in zip(outs_c, outs_s)) and all(map(torch.equal, grads_c, grads_s))
    assert len(alive_c) == 2 and not torch.equal(alive_c[0][1], alive_c[1][1])
    mp._LIVE.clear()
    with torch.no_grad():  # zoomem's forms stay out of no_grad forwards: PyG's own edge-list path, bitwise
        out, stock = conv(x0, graphs[0]), type(conv).forward(conv, x0, graphs[0])
    assert mp._LIVE == [] and torch.equal(out, stock)


def _multigraph(n: int, edges: int, loops: bool, repeats: bool) -> torch.Tensor:
    """A random ``[2, E]`` edge list on ``n`` nodes with self-loops and repeated edges where asked, in no order."""
    e = torch.randint(0, n, (2, edges))
    e = torch.unique(e[:, e[0] != e[1]], dim=1)
    parts = [e]
    if repeats:
        parts.append(e[:, : edges // 5])  # a fifth of the edges twice, some three times
        parts.append(e[:, : edges // 20])
    if loops:
        parts.append(torch.arange(0, n, 3).repeat(2, 1))
        if repeats:
            parts.append(torch.arange(0, n, 6).repeat(2, 1))
    e = torch.cat(parts, 1)
    return e[:, torch.randperm(e.size(1))]


@pytest.mark.parametrize("case, through_csr", [
    ("gcn", (True, True)), ("gcn_no_loops_added", (True, True)), ("gin", (True, True)), ("graph_conv", (True, True)),
    ("sage_sum", (True, True)), ("sage_max", (True, True)), ("sage_mean", (True, True)),
    ("gcn_improved", (False, False)), ("sg", (False, False)),
])
def test_message_passing_spmm_on_graphs_with_self_loops_and_repeated_edges(
        case: str, through_csr: tuple[bool, bool]) -> None:
    """Graphs with self-loops (loops only; loops and repeated edges): the CSR path is taken where it computes what
    the conv's edge list does (GCN drops the loops its normalisation replaces, a repeated edge is an entry weighted
    by its count for a sum, one entry for a max, a mean over the counts; GCN's ``improved`` and classes whose paths
    are not known fall back to the edge list); output (from an input that needs a gradient and from one that does
    not) and gradients within float rounding of the edge list's."""
    pytest.importorskip("torch_geometric")
    from torch_geometric import nn as pnn

    from zoomem.ops import message_passing as mp

    mp.register_message_passing_impl()
    make = {
        "gcn": lambda: pnn.GCNConv(8, 4), "gcn_no_loops_added": lambda: pnn.GCNConv(8, 4, add_self_loops=False),
        "gin": lambda: pnn.GINConv(nn.Linear(8, 4)), "graph_conv": lambda: pnn.GraphConv(8, 4),
        "sage_sum": lambda: pnn.SAGEConv(8, 4, aggr="sum"), "sage_max": lambda: pnn.SAGEConv(8, 4, aggr="max"),
        "sage_mean": lambda: pnn.SAGEConv(8, 4), "gcn_improved": lambda: pnn.GCNConv(8, 4, improved=True),
        "sg": lambda: pnn.SGConv(8, 4, K=2),
    }[case]
    torch.manual_seed(0)
    n, x0 = 300, torch.randn(300, 8)
    for repeats, csr in zip((False, True), through_csr):
        edge_index = _multigraph(n, 2000, loops=True, repeats=repeats)
        results = []
        for compact in (False, True):
            torch.manual_seed(1)
            conv = make()
            adj = mp._adjacency_edges(conv, edge_index, n)
            assert (adj is not None) is csr
            if adj is not None:  # sorted by target, then source, each pair once: the CSR's order, built unsorted
                keys = adj.edges[1] * n + adj.edges[0]
                assert bool((keys[1:] > keys[:-1]).all())
            if compact:
                install_impl(conv, "message_passing_spmm")
            x = x0.clone().requires_grad_()
            out = conv(x, edge_index)
            grads = torch.autograd.grad(out.square().sum(), [x, *conv.parameters()])
            results.append([out, conv(x0, edge_index), *grads])
        for stock, ours in zip(*results):
            assert (ours - stock).abs().max() <= 1e-5 * stock.abs().max(), (case, repeats)


@pytest.mark.parametrize("case, through_csr", [("gcn", (True, False)), ("graph_conv", (True, True)),
                                               ("graph_conv_mean", (False, False))])
def test_message_passing_spmm_takes_edge_weights(case: str, through_csr: tuple[bool, bool]) -> None:
    """A constant ``edge_weight`` (positional or by name) becomes the CSR adjacency's values, a repeated edge's
    weights summed, for the sums of GCN and GraphConv; not with self-loops in GCN (its edge list keeps a loop's own
    weight), for a mean, or for a weight that needs a gradient. Output and gradients within float rounding of the
    edge list's."""
    pytest.importorskip("torch_geometric")
    from torch_geometric import nn as pnn

    from zoomem.ops import message_passing as mp

    mp.register_message_passing_impl()
    make = {"gcn": lambda: pnn.GCNConv(8, 4), "graph_conv": lambda: pnn.GraphConv(8, 4),
            "graph_conv_mean": lambda: pnn.GraphConv(8, 4, aggr="mean")}[case]
    torch.manual_seed(0)
    n, x0 = 300, torch.randn(300, 8)
    for loops, csr in zip((False, True), through_csr):
        edge_index = _multigraph(n, 2000, loops=loops, repeats=True)
        weight = torch.rand(edge_index.size(1)) + 0.5
        assert mp._edge_weight(edge_index, (weight.requires_grad_(),), {}) == (False, None)
        weight.requires_grad_(False)
        for by_name in (False, True):
            results = []
            for compact in (False, True):
                torch.manual_seed(1)
                conv = make()
                assert (mp._adjacency_edges(conv, edge_index, n, weight) is not None) is csr
                if compact:
                    install_impl(conv, "message_passing_spmm")
                x = x0.clone().requires_grad_()
                out = conv(x, edge_index, edge_weight=weight) if by_name else conv(x, edge_index, weight)
                results.append([out, *torch.autograd.grad(out.square().sum(), [x, *conv.parameters()])])
            for stock, ours in zip(*results):
                assert (ours - stock).abs().max() <= 1e-5 * stock.abs().max(), (case, loops, by_name)


@pytest.mark.parametrize("case, through_csr", [("sage", (True, True)), ("sage_sum", (True, True)),
                                               ("gin", (True, True)), ("graph_conv", (True, True))])
def test_message_passing_spmm_on_bipartite_graphs(case: str, through_csr: tuple[bool, bool]) -> None:
    """A conv given ``(x_source, x_target)`` (a bipartite edge type, as ``to_hetero`` calls them): the CSR
    adjacency is targets by sources; on a simple graph and on one with repeated edges, output and both inputs'
    gradients within float rounding of the edge list's."""
    pytest.importorskip("torch_geometric")
    from torch_geometric import nn as pnn

    from zoomem.ops import message_passing as mp

    mp.register_message_passing_impl()
    make = {"sage": lambda: pnn.SAGEConv((8, 6), 4), "sage_sum": lambda: pnn.SAGEConv((8, 6), 4, aggr="sum"),
            "gin": lambda: pnn.GINConv(nn.Linear(8, 4)), "graph_conv": lambda: pnn.GraphConv((8, 6), 4)}[case]
    torch.manual_seed(0)
    sources, targets = 400, 300
    xs, xt = torch.randn(sources, 8), torch.randn(targets, 8 if case == "gin" else 6)
    simple = torch.unique(torch.stack([torch.randint(0, sources, (2000,)), torch.randint(0, targets, (2000,))]), dim=1)
    for edge_index, csr in zip((simple, torch.cat([simple, simple[:, :400]], 1)), through_csr):
        results = []
        for compact in (False, True):
            torch.manual_seed(1)
            conv = make()
            assert (mp._adjacency_edges(conv, edge_index, sources, targets=targets) is not None) is csr
            if compact:
                install_impl(conv, "message_passing_spmm")
            x = (xs.clone().requires_grad_(), xt.clone().requires_grad_())
            out = conv(x, edge_index)
            grads = torch.autograd.grad(out.square().sum(), [*x, *conv.parameters()], allow_unused=True)
            results.append([out, *(g for g in grads if g is not None)])
        for stock, ours in zip(*results, strict=True):
            assert (ours - stock).abs().max() <= 1e-5 * stock.abs().max(), case


def test_a_checked_implementation_is_left_off_where_it_computes_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    """``message_passing_spmm`` covers every PyG conv with its own ``message_and_aggregate``; checked on the
    planning batch, it is left off the ones that compute otherwise through it (GCN with ``improved=True``, whose
    edge list in PyG 2.8 gives its self-loops weight 1 and its CSR path 2) or fail on it (ARMA, MF), with the reason
    logged; a plain GCN keeps it. Before the check, a wrapped model of the first ran with gradients 21% off."""
    import logging

    pytest.importorskip("torch_geometric")
    from torch_geometric import nn as pnn

    import zoomem
    from zoomem.runtime.compact import choose_impls

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList([pnn.GCNConv(8, 16, improved=True), pnn.ARMAConv(16, 16), pnn.MFConv(16, 16),
                                        pnn.GCNConv(16, 4)])

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            for conv in self.convs:
                x = conv(x, edge_index).relu()
            return x

    torch.manual_seed(0)
    model, x = Net(), torch.randn(300, 8)
    batch = zoomem.Batch(args=(x, _multigraph(300, 2000, loops=False, repeats=False)))
    adapter = zoomem.get_adapter(model)
    with caplog.at_level(logging.INFO, logger="zoomem"):
        chosen = choose_impls(model, adapter.units(model), batch)
    assert {u for u, pairs in chosen.items() for _, i in pairs if i.name == "message_passing_spmm"} == {"convs.3"}
    left = sorted(r.getMessage().split(" (")[0] for r in caplog.records if "left off" in r.getMessage())
    assert left == [f"zoomem: message_passing_spmm left off convs.{i}" for i in range(3)]
    assert "largest magnitude off" in caplog.text and "raised RuntimeError" in caplog.text
    assert "raised NotImplementedError" in caplog.text


def test_a_check_that_runs_out_of_memory_gives_no_verdict() -> None:
    """A checked implementation that raises is left off with the error as the reason, unless the error is an
    allocation that did not fit: that goes up to planning, which plans from smaller batches where it can, and no
    verdict is given. The module's buffers and the RNG state are as before the check."""
    from zoomem.ops.impls import check_impls

    def raising(error: Exception) -> Impl:
        def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            raise error
        return Impl("raising", (nn.BatchNorm1d,), forward, checked=True)

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    x = torch.randn(16, 4)
    stats, rng = model[1].running_mean.clone(), torch.get_rng_state()
    failed = check_impls(model, [("1", model[1], raising(ValueError("no\nmore")))], x)
    assert failed == {"1": "it raised ValueError: no"}
    with pytest.raises(torch.OutOfMemoryError):
        check_impls(model, [("1", model[1], raising(torch.OutOfMemoryError("out of memory")))], x)
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def _stock_csr_conv(conv: nn.Module, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    """``conv`` on the CSR adjacency zoomem builds, through PyG's own code (the stock sparse product)."""
    from torch_geometric.utils import to_torch_csr_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(x.size(0), x.size(0)))
    return conv(x, adj_t)


# CPU flash attention for the sensitivity probe: the stock kernel's values, and a backward a second backward
# can go through
@pytest.mark.parametrize("case", ["plain", "causal", "float_mask", "bool_mask", "scale", "grouped"])
def test_differentiable_attention_is_the_stock_kernel(case: str) -> None:
    """"grouped": grouped-query attention (Mistral, Qwen2, Gemma), 4 query heads to 2 key and value heads."""
    import torch.nn.functional as F

    from zoomem.ops.attention import differentiable_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4 if case == "grouped" and i == 0 else 2, 10, 8, requires_grad=True) for i in range(3))
    kw: dict = {"causal": {"is_causal": True}, "scale": {"scale": 0.2}, "grouped": {"enable_gqa": True},
                "float_mask": {"attn_mask": torch.randn(2, 1, 10, 10)}}.get(case, {})
    if case == "bool_mask":
        mask = torch.rand(10, 10) > 0.3
        mask[:, 0] = True
        kw = {"attn_mask": mask}
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    assert ref.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"  # what this stands in for
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    with differentiable_attention():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert out.grad_fn.name() == "FlashAttentionCpuBackward"
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), g), ref_grads))
    with differentiable_attention():  # dropout goes to PyTorch's math path, which is differentiable already
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=case == "grouped")
    assert dropped.grad_fn.name() != "FlashAttentionCpuBackward"


@pytest.mark.parametrize("mask, causal, kv_heads", [(False, False, 2), (True, False, 2), (False, True, 2),
                                                    (True, False, 1)])
def test_differentiable_attention_gradgradcheck(mask: bool, causal: bool, kv_heads: int) -> None:
    from zoomem.ops.attention import FlashAttentionCpu

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2 if i == 0 else kv_heads, 5, 4, dtype=torch.float64, requires_grad=True)
               for i in range(3))
    m = torch.randn(1, 1, 5, 5, dtype=torch.float64) if mask else None

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return FlashAttentionCpu.apply(q, k, v, m, causal, None)  # (out, lse): both differentiated

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


# The sensitivity probe's stand-ins for ops whose backward a second backward cannot go through, or goes through
# otherwise than a backward from stored tensors runs
def test_differentiable_hardsigmoid_is_the_stock_op() -> None:
    """MobileNetV3's and GhostNet's squeeze-excite gates: aten's hardsigmoid_backward has no derivative, so their
    sensitivities fell back to value ranges (MobileNetV3 at `L2`: 75x its predicted gradient error)."""
    import torch.nn.functional as F

    from zoomem.ops.functional import _Hardsigmoid, differentiable_hardsigmoid

    x = (torch.arange(-40, 40, dtype=torch.float64) / 10).requires_grad_()  # both kinks and the flat parts
    g = torch.randn_like(x)
    ref = F.hardsigmoid(x)
    with differentiable_hardsigmoid():
        out = F.hardsigmoid(x)
        stock = F.hardsigmoid(x.detach().clone(), inplace=True)  # in place: left to aten
    assert out.grad_fn.name() == "_HardsigmoidBackward" and stock.grad_fn is None
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    y = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(_Hardsigmoid.apply, (y,))


def test_layer_norm_at_saved_statistics_is_the_stock_op() -> None:
    """The stock values, saved tensors (in the stock node's order) and first-order gradients; the double backward
    holds the saved mean and 1/std fixed (``zoomem.compress.sensitivity``)."""
    import torch.nn.functional as F

    from zoomem.ops.functional import norms_at_saved_statistics

    torch.manual_seed(0)
    x = (torch.randn(3, 5, 16) * 2 + 1).requires_grad_()
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    for weight, bias in ((w, b), (w, None), (None, None)):
        saves: list[list[tuple[int, ...]]] = [[], []]
        runs = []
        for i, mode in enumerate((contextlib.nullcontext, norms_at_saved_statistics)):
            def pack(t: torch.Tensor, i: int = i) -> torch.Tensor:
                saves[i].append(tuple(t.shape))
                return t

            with mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = F.layer_norm(x, (16,), weight, bias)
            runs.append(out)
        assert saves[0] == saves[1] and runs[1].grad_fn.name() == "_LayerNormAtSavedStatisticsBackward"
        assert torch.equal(runs[0], runs[1])
        inputs = [t for t in (x, weight, bias) if t is not None]
        g = torch.randn_like(out)
        assert all(torch.equal(a, c) for a, c in zip(torch.autograd.grad(runs[0], inputs, g),
                                                     torch.autograd.grad(runs[1], inputs, g)))
    with norms_at_saved_statistics():  # d(gamma's gradient)/dx at fixed statistics: g * rstd, elementwise
        out = F.layer_norm(x, (16,), w, b)
    gw = torch.autograd.grad(out, w, g, create_graph=True)[0]
    v = torch.randn(16)
    (jv,) = torch.autograd.grad(gw, x, v)
    rstd = (x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    assert torch.allclose(jv, g * rstd * v, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# BatchNorm's output rebuilt by the conv after it (MONeT's BN + ReLU form)


def _conv_bn_relu(channels: int = 8, inplace: bool = True, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=inplace),
                      nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace),
                      nn.Conv2d(4, 2, 1)).to(dtype)
    _rand_norm_params(m)
    return m


def _rebuilding(m: nn.Sequential) -> list[Callable[[], None]]:
    names = {nn.Conv2d: "conv2d_split_backward", nn.BatchNorm2d: "batchnorm_rebuilt_output", nn.ReLU: "relu_bitmask"}
    return [install_impl(mod, names[type(mod)]) for mod in m]


def _bitwise_and_saved_bytes(stock: nn.Module, ours: nn.Module) -> list[int]:
    """One step of each on the same batch: output, gradients and running statistics bitwise equal; the bytes each
    saves for backward."""
    x0 = torch.randn(4, 3, 16, 16)
    res, held = [], []
    for model in (stock, ours):
        x = x0.clone().requires_grad_(True)
        y, nbytes = saved_bytes(lambda: model(x), model)
        held.append(nbytes)
        y.square().sum().backward()
        res.append([y, x.grad, *(p.grad for p in model.parameters()), *model.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1]))
    return held


def test_batchnorm_rebuilt_output_is_bitwise_and_the_conv_saves_nothing_new() -> None:
    stock = _conv_bn_relu()
    ours = copy.deepcopy(stock)
    _rebuilding(ours)
    held = _bitwise_and_saved_bytes(stock, ours)
    # the two ReLU outputs (4x8x16x16 and 4x4x16x16 floats) are not held: 1-bit masks are
    relu_outputs = 4 * (8 + 4) * 16 * 16 * 4
    assert held[0] - held[1] == relu_outputs - relu_outputs // 32


def test_batchnorm_rebuilt_output_second_derivatives() -> None:
    m = _conv_bn_relu(4, dtype=torch.float64)
    _rebuilding(m)
    x = _grid(2, 3, 5, 5).requires_grad_(True)
    w = m[3].weight.detach().clone().requires_grad_(True)  # the conv that rebuilds its input for this gradient
    fn = lambda x, w: torch.func.functional_call(m, {"3.weight": w}, (x,))  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x, w), eps=1e-6, atol=1e-5)


def test_batchnorm_rebuilt_output_is_not_passed_on_after_an_in_place_change_by_other_code() -> None:
    from zoomem.ops import rebuild

    bn, conv = nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)
    install_impl(bn, "batchnorm_rebuilt_output")
    install_impl(conv, "conv2d_split_backward")
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    y = bn(x)
    assert rebuild.rebuild_of(y) is not None
    y += 1.0  # x += shortcut: the recipe would give the old values
    assert rebuild.rebuild_of(y) is None
    ref = y.detach().clone()
    out = conv(y)
    out.sum().backward()  # the conv saved y itself: its weight gradient reads the changed values
    expected = ref.sum((0, 2, 3)).view(1, 4, 1, 1).expand(2, 4, 1, 1)
    assert torch.allclose(conv.weight.grad, expected, rtol=1e-5, atol=1e-4)


def test_batchnorm_rebuilt_output_inside_a_checkpoint_fed_from_outside() -> None:
    from torch.utils.checkpoint import checkpoint

    from zoomem.ops import rebuild

    stem, body = _conv_bn_relu(), _conv_bn_relu()
    body[0] = nn.Conv2d(2, 8, 3, padding=1)  # takes the stem's output
    stem = nn.Sequential(*stem[:3])  # conv, BN, ReLU: its output is rebuildable in the stem's unit
    body = nn.Sequential(*body[:4])  # its first conv takes it: the checkpoint recomputes it from its own copy
    ref_stem, ref_body = copy.deepcopy(stem), copy.deepcopy(body)
    stem[0] = nn.Conv2d(3, 2, 3, padding=1)
    ref_stem[0] = copy.deepcopy(stem[0])
    stem[1], ref_stem[1] = nn.BatchNorm2d(2), nn.BatchNorm2d(2)
    for mod in stem:
        rebuild.set_owner(mod, "stem")
    for mod in body:
        rebuild.set_owner(mod, "body")
    _rebuilding(stem)
    _rebuilding(body)
    x0 = torch.randn(2, 3, 8, 8)
    grads = []
    for s, b in ((ref_stem, ref_body), (stem, body)):
        x = x0.clone().requires_grad_(True)
        z = s(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, torch.clone):  # the recomputation gets another
            out = checkpoint(_as_zoomem_recomputes(b), z, use_reentrant=False)  # tensor, as where zoomem's chain
            # brings an input back
        out.square().sum().backward()
        grads.append([x.grad, *(p.grad for p in (*s.parameters(), *b.parameters()))])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("act", ["relu", "leaky"])
def test_timm_batchnorm_act_rebuilt_output_is_bitwise_and_the_conv_saves_nothing_new(act: str) -> None:
    """DenseNet's layers and ResNet-v2's blocks: timm's fused BatchNorm + ReLU, then a conv."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), timm_bn_act(act), nn.Conv2d(8, 2, 3, padding=1))
    _rand_norm_params(stock)
    ours = copy.deepcopy(stock)
    install_impl(ours[1], "batchnorm_act_rebuilt_output")
    install_impl(ours[2], "conv2d_split_backward")
    held = _bitwise_and_saved_bytes(stock, ours)
    activated = 4 * 8 * 16 * 16 * 4  # held as a 1-bit mask
    assert held[0] - held[1] == activated - activated // 32


def test_conv_split_backward_gives_its_input_gradient_the_input_the_weight_gradient_read() -> None:
    """The input gradient's kernel (oneDNN on CPU) needs only the input's shape, but copies a zero-stride stand-in
    to a contiguous input-sized tensor. A ResNet shortcut's conv shares the block input with the block's first conv
    (freeing it after the weight gradient frees nothing: ResNet-50 b8's stride-2 block 25 MB over the stock
    backward), and a recomputed unit's input is a new tensor, the forward's being gone (a block whose input a chain
    drops: 4 MiB over its prediction at 64 px, b16). The weight gradient hands over the input it read, held as
    long as the stock conv holds it; a stand-in is left only where no weight gradient runs and the input is gone."""

    class _ConvInputs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.strides: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.convolution_backward.default and args[-1] == [True, False, False]:
                self.strides.append(tuple(args[1].stride()))
            return func(*args, **(kwargs or {}))

    seen = {}
    for case in ("shared", "alone", "recomputed", "frozen"):
        torch.manual_seed(0)
        conv = nn.Conv2d(8, 4, 1, stride=2)
        stock = copy.deepcopy(conv)
        install_impl(conv, "conv2d_split_backward")
        for m in (conv, stock):
            m.requires_grad_(case != "frozen")
        w = torch.randn(2, 8, 6, 6, requires_grad=True)
        w_stock = w.detach().clone().requires_grad_(True)
        (stock(w_stock * 2) * torch.arange(4.0).view(1, 4, 1, 1)).sum().backward()
        if case == "recomputed":
            y = torch.utils.checkpoint.checkpoint(_as_zoomem_recomputes(lambda t: conv(t * 2)), w, use_reentrant=False)
            held = []
        else:
            h = w * 2
            y = conv(h)
            held = [h] if case == "shared" else []  # as the block's first conv holds the block input
            del h
        with _ConvInputs() as log:
            (y * torch.arange(4.0).view(1, 4, 1, 1)).sum().backward()
        seen[case] = log.strides
        del held
        assert torch.equal(w.grad, w_stock.grad), case  # gradients: the stock op's, bitwise
        if case != "frozen":
            assert torch.equal(conv.weight.grad, stock.weight.grad) and torch.equal(conv.bias.grad, stock.bias.grad)
    assert seen["shared"] == seen["alone"] == seen["recomputed"] == [(288, 36, 6, 1)]  # the input itself
    assert seen["frozen"] == [(0, 0, 0, 0)]  # nothing read it, and it is gone: a stand-in
