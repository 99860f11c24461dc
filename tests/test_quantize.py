"""The quantizer: unbiased, within its variance bound, exact where it must be, every dtype, real byte savings."""

from __future__ import annotations

import pytest
import torch

from zoomem.compress import BITS, dequantize, quantize, quantized_nbytes
from zoomem.compress.quantize import _grouped, _quantize_rows
from zoomem.measure import holder_bytes


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-element step of x's group (same grouping as quantize)."""
    g, _ = _grouped(x.float(), 256)
    step = (g.amax(1) - g.amin(1)) / ((1 << bits) - 1)
    return step[:, None].expand_as(g)


@pytest.mark.parametrize("bits", BITS)
def test_unbiased_and_variance_within_bound(bits: int) -> None:
    x = torch.randn(16, 512, generator=_gen(1)) * torch.linspace(0.1, 10, 512)
    n = 400
    samples = torch.stack([dequantize(quantize(x, bits, generator=_gen(i))) for i in range(n)])
    g_x, _ = _grouped(x, 256)
    g_mean, _ = _grouped(samples.mean(0), 256)
    g_var, _ = _grouped(samples.var(0), 256)
    step = _steps(x, bits)
    # the mean of n dequantizations converges to x: within 6 standard errors (step / 2 / sqrt(n)) everywhere
    assert ((g_mean - g_x).abs() <= 6 * step / 2 / n**0.5 + 1e-6).all()
    # per element the variance is step^2 p (1 - p) <= step^2 / 4
    frac = ((g_x - g_x.amin(1, keepdim=True)) / torch.where(step > 0, step, 1)).frac()
    theory = step**2 * frac * (1 - frac)
    assert (g_var <= step**2 / 4 * 1.35 + 1e-9).all()
    assert torch.allclose(g_var.mean(), theory.mean(), rtol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
def test_dtypes_shapes_and_bytes(dtype: torch.dtype, bits: int) -> None:
    for shape in [(4, 512), (3, 10), (2, 3, 100, 7), (1000,), (5, 300)]:
        x = torch.randn(shape, generator=_gen()).to(dtype)
        q = quantize(x, bits, generator=_gen())
        assert q is not None
        y = dequantize(q)
        assert y.shape == x.shape and y.dtype == dtype
        # what the planner assumes is what the form holds
        assert q.nbytes == quantized_nbytes(x.shape, bits) == holder_bytes(q.codes, q.lo, q.step)
        assert q.lo.dtype == q.step.dtype == torch.float32  # never fp16 statistics
        step = (x.float().max() - x.float().min()) / ((1 << bits) - 1)
        assert (y.float() - x.float()).abs().max() <= step * 1.01 + 1e-2


def test_savings_are_real() -> None:
    """2 bits with 256-element groups: 0.25 bytes + 8 bytes per 256 elements = 14.2x less than fp32."""
    x = torch.randn(64, 4096)
    q = quantize(x, 2)
    assert q is not None
    assert x.numel() * 4 / q.nbytes == pytest.approx(32 / (2 + 64 / 256), rel=1e-3)


@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_round_trip_exactly(bits: int) -> None:
    x = torch.arange(8.0)[:, None].expand(8, 512).contiguous() * 0.37 - 1.3  # every group is constant
    y = dequantize(quantize(x, bits, generator=_gen()))
    assert torch.equal(y, x)
    z = torch.zeros(3, 7)
    assert torch.equal(dequantize(quantize(z, bits)), z)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused(bad: float) -> None:
    x = torch.randn(4, 512)
    x[2, 100] = bad
    assert quantize(x, 4) is None  # the caller keeps such a tensor exact


def test_extreme_ranges() -> None:
    big = torch.tensor([[-1e38, 1e38] * 256])
    y = dequantize(quantize(big, 1, generator=_gen()))
    assert torch.equal(y.abs(), big.abs())  # 1 bit of a two-valued group: both ends exactly
    assert quantize(torch.tensor([[-3e38, 3e38] * 256]), 1) is None  # range beyond fp32: stays exact
    tiny = torch.full((2, 512), 1e-30)
    tiny[0, ::2] += 1e-38  # a denormal range
    y = dequantize(quantize(tiny, 8, generator=_gen()))
    assert torch.isfinite(y).all() and (y - tiny).abs().max() <= 2e-38
    half = (torch.randn(4, 512) * 1e-4).half()  # fp16 with a range that fp16 statistics would lose
    y = dequantize(quantize(half, 4, generator=_gen()))
    assert (y.float() - half.float()).abs().max() <= (half.float().max() - half.float().min()) / 15 * 1.01


def test_noise_comes_from_the_given_generator_only() -> None:
    x = torch.randn(8, 512)
    state = torch.get_rng_state()
    a = dequantize(quantize(x, 2, generator=_gen(5)))
    b = dequantize(quantize(x, 2, generator=_gen(5)))
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)


def test_rejects_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.randn(4), 3)
    with pytest.raises(TypeError, match="keep integer"):
        quantize(torch.arange(10), 4)


def test_torch_compile_fuses_the_kernel() -> None:
    """The core is plain tensor code: torch.compile (inductor, fullgraph) gives the same codes."""
    x, _ = _grouped(torch.randn(16, 512), 256)
    noise = torch.rand(x.shape, generator=_gen())
    compiled = torch.compile(_quantize_rows, fullgraph=True, dynamic=False)
    for a, b in zip(compiled(x, noise, 4), _quantize_rows(x, noise, 4)):
        assert torch.allclose(a.float(), b.float(), atol=1 if a.dtype == torch.uint8 else 1e-6)


def test_speed_measurement_leaves_the_global_rng_alone() -> None:
    """The (once per process) speed measurement draws from its own generator: otherwise the same seed gave a
    different dropout stream, and training, depending on whether an earlier wrap had measured it already."""
    import importlib

    q = importlib.import_module("zoomem.compress.quantize")  # the module (the package exports the function)

    q._SPEED.pop(("cpu", 2), None)
    torch.manual_seed(0)
    q.seconds_per_byte("cpu", 2)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
