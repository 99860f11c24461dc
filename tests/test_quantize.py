"""The quantizer: unbiased, within its variance bound, exact where it must be, every dtype, real byte savings."""

from __future__ import annotations

import pytest
import torch

from zoomem.compress import BITS, dequantize, quantize, quantized_nbytes
from zoomem.compress.quantize import _grouped, _pack, _quantize_rows, _unpack
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


@pytest.mark.parametrize("group_size", [8, 32, 256])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_codes_are_packed_plane_by_plane(bits: int, group_size: int) -> None:
    """Byte k of a group holds codes k, k + n, k + 2n, ... (n bytes a group), lowest bits first: the layout the
    Triton kernels share. Group sizes whose planes are not whole 64-bit words take the byte-wise path."""
    codes = torch.randint(0, 1 << bits, (5, group_size), generator=_gen(), dtype=torch.uint8)
    packed = _pack(codes, bits)
    n = group_size * bits // 8
    assert packed.shape == (5, n) and packed.dtype == torch.uint8
    assert torch.equal(packed.int(), sum(codes[:, p * n:(p + 1) * n].int() << (p * bits) for p in range(8 // bits)))
    assert torch.equal(_unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("shape", [(1 << 20,), (8, 197, 192), (2, 300_000), (4, 256, 28, 28)])
def test_scratch_is_what_the_meter_sees(shape: tuple[int, ...], bits: int) -> None:
    """The planner's scratch (``scratch_nbytes``) against the meter: flat, rows ending in padding (several to a
    chunk, and rows longer than a chunk), and rows of whole groups. Never low; at most 0.2 MiB high."""
    from zoomem.compress.quantize import scratch_nbytes
    from zoomem.measure import MemoryMeter

    x = torch.randn(shape, generator=_gen())
    meter = MemoryMeter(x)
    with meter:
        q = quantize(x, bits, generator=_gen())
    quant = meter.report.peak_delta_bytes - q.nbytes
    meter = MemoryMeter(x, q.codes, q.lo, q.step)
    with meter:
        y = dequantize(q)
    dequant = meter.report.peak_delta_bytes - y.numel() * 4
    for seen, planned in zip((quant, dequant), scratch_nbytes(shape, x.dtype, bits)):
        assert 0 <= planned - seen <= 0.2 * 2**20, (seen / 2**20, planned / 2**20)


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
    """The (once per process) speed measurements draw from their own generator: otherwise the same seed gave a
    different dropout stream, and training, depending on whether an earlier wrap had measured it already."""
    import importlib

    q = importlib.import_module("zoomem.compress.quantize")  # the module (the package exports the function)

    for key in [k for k in q._SPEED if k[:2] == ("cpu", 2)]:
        q._SPEED.pop(key)
    torch.manual_seed(0)
    q.seconds_per_byte("cpu", 2)
    q.seconds_per_call("cpu", 2)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))


_TRITON_CHECKS = '''
import json, math, torch
from zoomem.compress.quantize import _grouped, dequantize, quantize
from zoomem.compress.triton_kernels import triton_dequantize, triton_quantize
gen = torch.Generator().manual_seed(0)
out = {"interop": [], "unbiased": {}, "exact": {}}
for shape, dtypes in [((4, 1000), (torch.float32, torch.bfloat16, torch.float16)), ((3, 7, 50), (torch.float32,)),
                      ((1000,), (torch.float32,)), ((5, 256), (torch.bfloat16,)), ((0, 8), (torch.float32,))]:
    for bits in (1, 2, 4, 8):
        for dtype in dtypes:
            x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
            t, p = triton_quantize(x, bits, 256, gen), quantize(x, bits, 256, gen)
            same_form = (t.codes.shape == p.codes.shape and t.row_groups == p.row_groups
                         and torch.equal(t.lo, p.lo) and torch.equal(t.step, p.step))
            # either dequantizer reads either's codes: a layout slip would put values far from x
            a, b, c = triton_dequantize(t), dequantize(t), triton_dequantize(p)
            tol = 0 if dtype == torch.float32 else 2 ** -7
            readable = (a.dtype == dtype and a.shape == x.shape
                        and torch.allclose(a.float(), b.float(), rtol=tol, atol=0)
                        and torch.allclose(c.float(), dequantize(p).float(), rtol=tol, atol=0))
            step = t.step.max().item() if t.step.numel() else 0.0
            ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
            within = bool(((a.float() - x.float()).abs() <= step * (1 + 1e-5) + x.float().abs() * ulp).all())
            out["interop"].append([list(shape), bits, str(dtype), same_form, readable, within])
for bits in (2, 4):
    x = torch.randn(1, 512, generator=gen) * torch.linspace(0.1, 10, 512)
    # 200 copies of x in one call: groups follow rows, so every copy has x's two groups, and each element draws its
    # own rounding noise (the interpreter's time goes with the elements: two rows took 15 s)
    mean = triton_dequantize(triton_quantize(x.repeat(200, 1), bits, 256, gen)).mean(0, keepdim=True)
    step = triton_quantize(x, bits, 256, gen).step
    out["unbiased"][bits] = float(((mean - x).abs() / step.repeat_interleave(256).view(1, 512)).mean())
c = torch.full((4, 600), 0.3)
out["exact"]["constant"] = torch.equal(triton_dequantize(triton_quantize(c, 2, 256, gen)), c)
out["exact"]["nan"] = triton_quantize(torch.tensor([1.0, float("nan")] * 3000), 4, 256, gen) is None
out["exact"]["inf"] = triton_quantize(torch.tensor([1.0, float("inf")] * 3000), 4, 256, gen) is None
big = torch.tensor([3e38, -3e38] * 3000)
out["exact"]["range"] = triton_quantize(big, 1, 256, gen) is None
print(json.dumps(out))
'''


def test_triton_kernels_under_the_interpreter(tmp_path) -> None:
    """The CUDA kernels, run on CPU by Triton's interpreter: the same form as the PyTorch path (group statistics
    bitwise, codes each dequantizer reads), unbiased, exact for constant groups, None for NaN/Inf/huge ranges."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "triton_checks.py"
    script.write_text(_TRITON_CHECKS)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    bad = [row for row in out["interop"] if not all(row[3:])]
    assert not bad, bad
    for bits, bias in out["unbiased"].items():  # mean of 200 roundings: about 0.8 step / (2 sqrt(200)) ~ 0.03 steps
        assert bias < 0.07, (bits, bias)
    assert all(out["exact"].values()), out["exact"]
