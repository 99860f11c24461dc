"""Per-group stochastic-rounding quantization of activations to 1, 2, 4 or 8 bits, packed into bytes.

A floating tensor is cut into groups of ``group_size`` contiguous elements: along each row (rows follow the batch
dimension) when a row holds at least one group, else along the flattened tensor. Each group keeps its minimum
and its step ``(max - min) / (2**bits - 1)`` in fp32 (never fp16: tiny ranges would underflow, wide ones
overflow), and every value becomes ``floor((x - min) / step + u)`` with ``u ~ U[0, 1)``: stochastic rounding,
so the dequantized tensor is an unbiased estimate of ``x`` whose per-element variance is at most ``step**2 / 4``.
Values are packed ``8 // bits`` to a byte. A group whose values are all equal comes back exactly.

The work runs in chunks of groups so that its fp32 temporaries stay small next to the activation itself, and it
is plain vectorised PyTorch: ``torch.compile`` fuses :func:`_quantize_rows` (see ``tests/test_quantize.py``). On
CUDA with Triton installed, :mod:`.triton_kernels` does the same in one fused kernel each way (same layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .triton_kernels import triton_dequantize, triton_quantize, use_triton

__all__ = ["BITS", "GROUP_SIZE", "Quantized", "quantize", "dequantize", "quantized_nbytes", "group_layout",
           "scratch_nbytes", "seconds_per_byte"]

BITS = (1, 2, 4, 8)
GROUP_SIZE = 256
_CHUNK_ELEMS = 1 << 18  # elements (de)quantized at once: bounds the fp32 temporaries to two of 1 MiB


@dataclass(eq=False)
class Quantized:
    """A quantized tensor: packed codes, per-group fp32 minimum and step, and what it takes to rebuild it."""

    codes: torch.Tensor  # uint8, (groups, group_size * bits // 8)
    lo: torch.Tensor  # fp32, (groups,)
    step: torch.Tensor  # fp32, (groups,)
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    row_groups: int  # groups per row (0: the tensor was grouped flat)
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes this form holds (codes and group statistics)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lo, self.step))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Quantized":
        """The same form on another device (offload to host memory and back)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        if device == "cpu" and torch.cuda.is_available() and self.codes.is_cuda:
            move = lambda t: t.to("cpu", non_blocking=non_blocking).pin_memory() if not non_blocking else (  # noqa: E731
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
        return Quantized(move(self.codes), move(self.lo), move(self.step), self.shape, self.dtype, self.bits,
                         self.row_groups, self.group_size)


def group_layout(shape: torch.Size | tuple[int, ...], group_size: int = GROUP_SIZE) -> tuple[int, int, int]:
    """(rows, groups per row, groups) of a tensor of ``shape``; rows = 1 when grouped flat."""
    numel = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 0 and numel // shape[0] >= group_size:
        rows, row_len = shape[0], numel // shape[0]
        per_row = -(-row_len // group_size)
        return rows, per_row, rows * per_row
    return 1, 0, -(-numel // group_size)


def quantized_nbytes(shape: torch.Size | tuple[int, ...], bits: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes :func:`quantize` holds for a tensor of ``shape`` at ``bits`` (the planner's view of a lossy form)."""
    groups = group_layout(shape, group_size)[2]
    return groups * (group_size * bits // 8 + 8)


def scratch_nbytes(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, bits: int, group_size: int = GROUP_SIZE,
                   fused: bool = False) -> tuple[int, int]:
    """Bytes :func:`quantize` and :func:`dequantize` allocate for a tensor beyond their results, at most at once:
    the planner adds them where a lossy tensor is packed (its segment's forward) and unpacked (its backward).

    Per chunk of groups (``_CHUNK_ELEMS`` values at most) quantizing holds the fp32 noise, the fp32 scaled values
    and the uint8 codes (9 bytes a value; 4 more when the input is not fp32, for its fp32 copy), the packed chunks
    until they are joined (the packed size again), and first the padded copy of the whole tensor where its rows
    are not a whole number of groups; dequantizing holds the unpacked codes and their fp32 values, two chunks'
    worth once there is more than one (5 and 9 bytes a value). Measured with :class:`~zoomem.MemoryMeter` on fp32
    tensors of 256 K, 1 M and 4 M values at 2 bits: 2.20, 2.45 and 2.45 MiB beyond the result quantizing (these
    give 2.32, 2.53, 3.38), 1.25, 2.25 and 2.25 dequantizing (1.25, 2.25, 2.25). ``fused`` (the Triton kernels):
    nothing beyond the result.
    """
    if fused:
        return 0, 0
    rows, per_row, groups = group_layout(shape, group_size)
    numel = math.prod(shape)
    chunk_groups = max(1, _CHUNK_ELEMS // group_size)
    elems = min(groups, chunk_groups) * group_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = groups * group_size
    pad_copy = padded * itemsize if padded != numel else 0
    quant = pad_copy + elems * (9 if dtype == torch.float32 else 13) + quantized_nbytes(shape, bits, group_size)
    dequant = elems * (5 if groups <= chunk_groups else 9)
    return quant, dequant


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``x`` as (groups, group_size), padded by repeating each row's last value (inside that group's range)."""
    rows, per_row, groups = group_layout(x.shape, group_size)
    flat = x.reshape(rows, -1) if per_row else x.reshape(1, -1)
    pad = (per_row or groups) * group_size - flat.shape[1]
    if pad:
        flat = torch.cat([flat, flat[:, -1:].expand(flat.shape[0], pad)], dim=1)
    return flat.reshape(groups, group_size), per_row


def _quantize_rows(x: torch.Tensor, noise: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize (groups, group_size) values with uniform ``noise``: codes (uint8, unpacked), lo, step."""
    xf = x.float()
    lo = xf.amin(dim=1)
    hi = xf.amax(dim=1)
    levels = (1 << bits) - 1
    step = hi / levels - lo / levels  # no overflow of hi - lo near the fp32 limit
    # divide (not multiply by 1/step: denormal steps); a constant group has x - lo == 0 and step 1 here: code 0
    safe = torch.where(step > 0, step, torch.ones_like(step))
    scaled = xf - lo[:, None]  # one fp32 temporary, then in place
    codes = scaled.div_(safe[:, None]).add_(noise).floor_().clamp_(0, levels).to(torch.uint8)
    return codes, lo, step


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    per = 8 // bits
    c = codes.reshape(codes.shape[0], -1, per)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (c << shifts).sum(dim=2, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    return ((packed[..., None] >> shifts) & mask).reshape(packed.shape[0], -1)


def quantize(
    x: torch.Tensor, bits: int, group_size: int = GROUP_SIZE, generator: torch.Generator | None = None
) -> Quantized | None:
    """Quantize a floating tensor to ``bits`` per value with unbiased stochastic rounding.

    Args:
        x: fp32, bf16 or fp16 values (any shape, any device).
        bits: 1, 2, 4 or 8.
        group_size: elements per group (a multiple of 8).
        generator: source of the rounding noise; zoomem passes its own so the user's RNG stream is untouched.

    Returns:
        The :class:`Quantized` form, or ``None`` when ``x`` holds NaN or Inf or a range beyond fp32 (the caller
        keeps such a tensor exact).

    >>> q = quantize(torch.randn(4, 512), bits=2)
    >>> dequantize(q).shape
    torch.Size([4, 512])
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported; choose one of {BITS}.")
    if not x.is_floating_point():
        raise TypeError(f"quantize takes floating tensors, got {x.dtype}; keep integer and bool tensors exact.")
    if group_size % 8:
        raise ValueError(f"group_size={group_size} must be a multiple of 8.")
    if use_triton(x, group_size):
        return triton_quantize(x, bits, group_size, generator)
    grouped, per_row = _grouped(x.detach(), group_size)
    chunk = max(1, _CHUNK_ELEMS // group_size)
    codes, los, steps = [], [], []
    for start in range(0, grouped.shape[0], chunk):
        part = grouped[start:start + chunk]
        noise = torch.rand(part.shape, device=x.device, dtype=torch.float32, generator=generator)
        c, lo, step = _quantize_rows(part, noise, bits)
        codes.append(_pack(c, bits))
        los.append(lo)
        steps.append(step)
    if not codes:  # an empty tensor: no groups
        codes = [torch.empty(0, group_size * bits // 8, dtype=torch.uint8, device=x.device)]
        los = steps = [torch.empty(0, dtype=torch.float32, device=x.device)]
    lo, step = torch.cat(los), torch.cat(steps)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(step).all()):  # NaN/Inf in x, or a range beyond fp32
        return None
    return Quantized(torch.cat(codes), lo, step, x.shape, x.dtype, bits, per_row, group_size)


def dequantize(q: Quantized) -> torch.Tensor:
    """The tensor a :class:`Quantized` form stands for (same shape, dtype and device as the codes' tensor)."""
    if use_triton(q.codes, q.group_size):
        return triton_dequantize(q)
    chunk = max(1, _CHUNK_ELEMS // q.group_size)
    numel = math.prod(q.shape)
    out = torch.empty(numel, dtype=q.dtype, device=q.codes.device)
    if q.row_groups:  # row-grouped: each row's padding sits at its end
        rows = q.shape[0]
        row_len = numel // rows
        view = out.view(rows, row_len)
        for r0 in range(0, rows, max(1, chunk // q.row_groups)):
            r1 = min(rows, r0 + max(1, chunk // q.row_groups))
            g0, g1 = r0 * q.row_groups, r1 * q.row_groups
            vals = _unpack(q.codes[g0:g1], q.bits).float().mul_(q.step[g0:g1, None]).add_(q.lo[g0:g1, None])
            view[r0:r1] = vals.reshape(r1 - r0, -1)[:, :row_len]
    else:
        for g0 in range(0, q.codes.shape[0], chunk):
            g1 = min(q.codes.shape[0], g0 + chunk)
            vals = _unpack(q.codes[g0:g1], q.bits).float().mul_(q.step[g0:g1, None]).add_(q.lo[g0:g1, None])
            n = min(numel, g1 * q.group_size) - g0 * q.group_size
            out[g0 * q.group_size:g0 * q.group_size + n] = vals.reshape(-1)[:n]
    return out.view(q.shape)


_SPEED: dict[tuple[str, int], float] = {}


def seconds_per_byte(device: torch.device | str, bits: int) -> float:
    """Measured seconds to quantize and later dequantize one byte of fp32 activation on ``device`` (cached)."""
    device = torch.device(device)
    key = (str(device), bits)
    if key not in _SPEED:
        import time

        # its own generator: the user's RNG stream (dropout masks) must not depend on whether this ran before
        # in the process (it is cached); it did, and the same seed gave different trainings
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(1 << 20, device=device, generator=gen)  # 4 MiB
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            q = quantize(x, bits, generator=gen)
            assert q is not None
            dequantize(q)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        _SPEED[key] = sorted(times)[1] / (x.numel() * 4)
    return _SPEED[key]
