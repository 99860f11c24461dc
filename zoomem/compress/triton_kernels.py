"""Optional Triton kernels for :mod:`zoomem.compress.quantize` on CUDA: one program per group, fused.

The PyTorch path makes a padded copy of the tensor, then min, max, scale, noise, floor, clamp and pack each as
its own pass over memory (in chunks). Here one program loads a group once, from the tensor itself (a row's
padding is its last value, as there), draws its rounding noise with Philox (``tl.rand``, seeded from zoomem's
generator), and writes the packed bytes and the group's fp32 minimum and step: the same layout, the same
arithmetic in the same order, so the PyTorch dequantizer reads these codes and this dequantizer reads those.
Dequantizing writes the output tensor directly, in its dtype. :func:`quantize` / :func:`dequantize` use these
kernels for CUDA tensors when Triton is installed (``ZOOMEM_TRITON=0`` turns them off); the tests run them on CPU
under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

__all__ = ["is_triton_available", "triton_dequantize", "triton_quantize", "use_triton"]


@functools.cache
def is_triton_available() -> bool:
    """Whether Triton imports (it comes with PyTorch's CUDA builds)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor, group_size: int) -> bool:
    """Whether :mod:`zoomem.compress.quantize` runs the kernels for ``t``: a CUDA tensor, Triton installed,
    ``ZOOMEM_TRITON`` not ``0``, and a power-of-two group size (a Triton block)."""
    return (t.is_cuda and os.environ.get("ZOOMEM_TRITON", "1") != "0" and group_size & (group_size - 1) == 0
            and is_triton_available())


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(x_ptr, codes_ptr, lo_ptr, step_ptr, seed_ptr, row_len, per_row, numel,
                        BITS: tl.constexpr, G: tl.constexpr, ROW: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, G).to(tl.int64)
        if ROW:  # row-grouped: group j of row r holds the row's elements j*G .. j*G+G-1
            r = g // per_row
            pos = (g % per_row) * G + i
            offs = r * row_len + pos
            last = r * row_len + row_len - 1
            inside = pos < row_len
        else:  # grouped flat
            offs = g * G + i
            last = g * 0 + numel - 1
            inside = offs < numel
        pad = tl.load(x_ptr + last).to(tl.float32)  # padding repeats the last value: inside the group's range
        x = tl.where(inside, tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32), pad)
        finite = tl.min((tl.abs(x) < float("inf")).to(tl.int32), axis=0)  # NaN compares false too
        lo = tl.min(x, axis=0)
        hi = tl.max(x, axis=0)
        lo = tl.where(finite > 0, lo, float("nan"))  # tl.min skips NaN: mark the group, the caller keeps x exact
        levels: tl.constexpr = (1 << BITS) - 1
        step = hi / levels - lo / levels  # no overflow of hi - lo near the fp32 limit
        safe = tl.where(step > 0, step, 1.0)
        u = tl.rand(tl.load(seed_ptr), (g * G + i).to(tl.uint32))  # offsets wrap at 2**32 elements
        code = tl.floor((x - lo) / safe + u)
        code = tl.minimum(tl.maximum(code, 0.0), levels).to(tl.int32)
        PER: tl.constexpr = 8 // BITS
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(tl.reshape(code, (PER, G // PER)) << shifts[:, None], axis=0)  # plane by plane
        tl.store(codes_ptr + g * (G // PER) + tl.arange(0, G // PER), packed.to(tl.uint8))
        tl.store(lo_ptr + g, lo)
        tl.store(step_ptr + g, step)

    @triton.jit
    def dequantize_kernel(codes_ptr, lo_ptr, step_ptr, out_ptr, row_len, per_row, numel,
                          BITS: tl.constexpr, G: tl.constexpr, ROW: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)
        PER: tl.constexpr = 8 // BITS
        packed = tl.load(codes_ptr + g * (G // PER) + tl.arange(0, G // PER)).to(tl.int32)
        shifts = tl.arange(0, PER) * BITS
        code = tl.reshape((packed[None, :] >> shifts[:, None]) & ((1 << BITS) - 1), (G,))
        vals = code.to(tl.float32) * tl.load(step_ptr + g) + tl.load(lo_ptr + g)
        i = tl.arange(0, G).to(tl.int64)
        if ROW:
            pos = (g % per_row) * G + i
            offs = (g // per_row) * row_len + pos
            inside = pos < row_len
        else:
            offs = g * G + i
            inside = offs < numel
        tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=inside)

    return quantize_kernel, dequantize_kernel


def triton_quantize(x: torch.Tensor, bits: int, group_size: int, generator: torch.Generator | None) -> Any:
    """:func:`zoomem.compress.quantize.quantize` in one kernel; ``None`` for NaN/Inf or a range beyond fp32."""
    from .quantize import Quantized, group_layout

    x = x.detach().contiguous()
    rows, per_row, groups = group_layout(x.shape, group_size)
    numel = x.numel()
    codes = torch.empty(groups, group_size * bits // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(groups, dtype=torch.float32, device=x.device)
    step = torch.empty(groups, dtype=torch.float32, device=x.device)
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, generator=generator, dtype=torch.int64)
    if groups:
        quantize_kernel, _ = _kernels()
        quantize_kernel[(groups,)](x, codes, lo, step, seed, numel // rows if per_row else numel, max(per_row, 1),
                                   numel, BITS=bits, G=group_size, ROW=bool(per_row))
    if not bool(torch.isfinite(lo).all() & torch.isfinite(step).all()):
        return None
    return Quantized(codes, lo, step, x.shape, x.dtype, bits, per_row, group_size)


def triton_dequantize(q: Any) -> torch.Tensor:
    """:func:`zoomem.compress.quantize.dequantize` in one kernel, written in the tensor's dtype."""
    numel = math.prod(q.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.codes.device)
    groups = q.codes.shape[0]
    if groups and numel:
        _, dequantize_kernel = _kernels()
        row_len = numel // q.shape[0] if q.row_groups else numel
        dequantize_kernel[(groups,)](q.codes, q.lo, q.step, out, row_len, max(q.row_groups, 1), numel,
                                     BITS=q.bits, G=q.group_size, ROW=bool(q.row_groups))
    return out
