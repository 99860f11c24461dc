"""Per-group stochastic-rounding quantization of activations to 1, 2, 4 or 8 bits, packed into bytes.

A floating tensor is cut into groups of ``group_size`` contiguous elements: along each row (rows follow the batch
dimension) when a row holds at least one group, else along the flattened tensor. Each group keeps its minimum
and its step ``(max - min) / (2**bits - 1)`` in fp32 (never fp16: tiny ranges would underflow, wide ones
overflow), and every value becomes ``floor((x - min) / step + u)`` with ``u`` uniform in (0, 1): stochastic
rounding, so the dequantized tensor is an unbiased estimate of ``x`` (up to ``step / 2**17``: ``u`` has 16 random
bits, see :func:`_uniform`) whose per-element variance is at most ``step**2 / 4``. Values are packed ``8 // bits``
to a byte, plane by plane (:func:`_pack`). A group whose values are all equal comes back exactly.

The work runs in chunks of groups so that its fp32 temporaries stay small next to the activation itself, and it
is plain vectorised PyTorch: ``torch.compile`` fuses :func:`_quantize_rows` (see ``tests/test_quantize.py``). On
CUDA with Triton installed, :mod:`.triton_kernels` does the same in one fused kernel each way (same layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.packbits import pack_planes, unpack_planes
from .triton_kernels import triton_dequantize, triton_quantize, use_triton

__all__ = ["BITS", "GROUP_SIZE", "Quantized", "quantize", "dequantize", "quantized_nbytes", "group_layout",
           "row_group", "row_dims", "rows_fit", "scratch_nbytes", "seconds_per_byte", "seconds_per_call"]

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


MIN_ROW_GROUP = 32
"""The narrowest group :func:`row_group` gives: at 32 elements a group's min and scale (8 bytes) already weigh as
much as its values at 2 bits."""


def row_group(row: int, group_size: int = GROUP_SIZE) -> int | None:
    """The group size for a tensor that backward reads in rows of ``row`` elements, each normalised by its own
    spread (a norm's input): ``group_size`` where it divides ``row``, else the largest multiple of 8 up to
    ``group_size`` that divides it, so that no group mixes two rows; ``None`` where there is none of at least
    :data:`MIN_ROW_GROUP` (the tensor stays exact).

    A group holding parts of two rows brings a row whose spread is small next to the group's range (a ViT's class
    token at initialisation: row std 0.03 in groups of range 4) back as noise times the row's ``1/std``, and a
    norm's backward is quadratic in that: at 2 bits in groups of 256, timm's EVA-02 and DeiT-Tiny (192 wide, at
    initialisation) had squared gradient errors 1,100 and 2,000 times the squared gradient norm where the plans
    predicted 0.64 and 1.2, against 0.32 for 0.26 predicted on ResNet-50 (all at 64 px; ``scripts/coverage.py``,
    BENCHMARKS.md)."""
    if row % group_size == 0:
        return group_size
    for g in range(group_size - group_size % 8, MIN_ROW_GROUP - 1, -8):
        if row % g == 0:
            return g
    return None


def row_dims(shape: torch.Size | tuple[int, ...], row: int) -> int:
    """How many trailing dimensions of ``shape`` make up a row of ``row`` elements (a norm's normalised dimensions);
    0 where no trailing dimensions do. With it, :func:`rows_fit` checks a group size against other shapes.

    >>> row_dims((8, 64, 128), 128), row_dims((8, 64, 128), 64)
    (1, 0)
    """
    n = 1
    for k, d in enumerate(reversed(shape), 1):
        n *= d
        if n == row:
            return k
        if n > row:
            break
    return 0


def rows_fit(shape: torch.Size | tuple[int, ...], dims: tuple[int, ...], group_size: int) -> bool:
    """Whether groups of ``group_size`` still follow the rows of a tensor of ``shape`` that backward reads in rows
    of its last ``dims[i]`` dimensions (each a :func:`row_dims`; 0: rows of no trailing dimensions): a plan made
    at other shapes runs its groups here only then (a norm over a dimension that shrank may no longer divide).

    >>> rows_fit((8, 60, 128), (1,), 128), rows_fit((8, 2, 48), (1,), 64), rows_fit((8, 60), (0,), 32)
    (True, False, False)
    """
    return bool(dims) and all(k > 0 and math.prod(shape[-k:]) % group_size == 0 for k in dims)


def quantized_nbytes(shape: torch.Size | tuple[int, ...], bits: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes :func:`quantize` holds for a tensor of ``shape`` at ``bits`` (the planner's view of a lossy form)."""
    groups = group_layout(shape, group_size)[2]
    return groups * (group_size * bits // 8 + 8)


def scratch_nbytes(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, bits: int, group_size: int = GROUP_SIZE,
                   fused: bool = False) -> tuple[int, int]:
    """Bytes :func:`quantize` and :func:`dequantize` allocate for a tensor beyond their results, at most at once:
    the planner adds them where a lossy tensor is packed (its segment's forward) and unpacked (its backward).

    Per chunk of groups (``_CHUNK_ELEMS`` values at most) quantizing holds the fp32 noise, the fp32 scaled values
    and the codes (9 bytes a value; 2 more at 8 bits, whose codes pass through int16; 4 more when the input is not
    fp32, for its fp32 copy) and the chunk's group statistics, beside the chunks packed so far; joining these
    holds the packed size once more. So beyond the result: the larger of a chunk's scratch less one packed chunk,
    and the packed size. First comes the padded copy of the whole tensor where its rows are not a whole number of
    groups. Dequantizing holds one block's unpacked codes (none at 8 bits) and their fp32 values (5 bytes a value, 4
    at 8 bits): a chunk of groups, or for rows that end in padding as many whole rows as a chunk holds, or a chunk
    of one row's groups. Measured with :class:`~zoomem.MemoryMeter` (``tests/test_quantize.py``): exact on flat
    fp32 and bf16 tensors of 256 K, 1 M and 4 M values at every width (2.20 MiB beyond
    the result quantizing at 2 bits, 2.51 at 8 bits, 4.12 for 4 M values at 8 bits where joining the packed
    chunks is the peak; 1.25 dequantizing), and up to 0.15 MiB high on padded rows. ``fused`` (the Triton
    kernels): nothing beyond the result.
    """
    if fused:
        return 0, 0
    rows, per_row, groups = group_layout(shape, group_size)
    numel = math.prod(shape)
    chunk_groups = max(1, _CHUNK_ELEMS // group_size)
    chunks = -(-groups // chunk_groups)
    elems = min(groups, chunk_groups) * group_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = groups * group_size
    pad_copy = padded * itemsize if padded != numel else 0
    per_value = 9 + (2 if bits == 8 else 0) + (0 if dtype == torch.float32 else 4)
    packed = quantized_nbytes(shape, bits, group_size)
    stats = min(groups, chunk_groups) * 16  # lo, hi, step and its safe copy, fp32 per group
    quant = pad_copy + max(elems * per_value + stats - packed // max(chunks, 1), packed)
    if per_row and (numel // rows) % group_size:  # padded rows: dequantize's blocks
        rows_at_once, span = _block(shape, per_row, group_size)
        elems = rows_at_once * span * group_size
    dequant = elems * (4 if bits == 8 else 5)
    return quant, dequant


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``x`` as (groups, group_size), padded by repeating each row's last value (inside that group's range)."""
    rows, per_row, groups = group_layout(x.shape, group_size)
    flat = x.reshape(rows, -1) if per_row else x.reshape(1, -1)
    pad = (per_row or groups) * group_size - flat.shape[1]
    if pad:
        flat = torch.cat([flat, flat[:, -1:].expand(flat.shape[0], pad)], dim=1)
    return flat.reshape(groups, group_size), per_row


def _uniform(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Rounding noise in (0, 1): 16 random bits a value, on the centres of a 2**-16 grid.

    One 64-bit draw gives four values: on CPU ``torch.rand`` draws (and converts) once per value, which took most
    of quantizing's time. A grid of 2**16 cells moves the chance of rounding up by at most 2**-17, so the bias of
    a dequantized value is at most ``step / 2**17`` (far below its standard deviation, up to ``step / 2``).
    """
    n = math.prod(shape)
    draws = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(1 << 63), None, generator=generator)
    return draws.view(torch.int16)[:n].float().add_(32768.5).mul_(2.0**-16).view(shape)


def _quantize_rows(x: torch.Tensor, noise: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize (groups, group_size) values with uniform ``noise``: codes (uint8, unpacked), lo, step."""
    xf = x.float()
    lo = xf.amin(dim=1)
    hi = xf.amax(dim=1)
    levels = (1 << bits) - 1
    step = hi / levels - lo / levels  # no overflow of hi - lo near the fp32 limit
    # divide (not multiply by 1/step: denormal steps); a constant group has x - lo == 0 and step 1 here: code 0
    safe = torch.where(step > 0, step, torch.ones_like(step))
    scaled = xf - lo[:, None]  # one fp32 temporary, then in place; >= 0, so the integer cast is the floor
    scaled.div_(safe[:, None]).add_(noise).clamp_(0, levels)
    # a cast to int8 runs vectorised on CPU, one to uint8 does not: int8 holds codes below 128, and
    # 8-bit codes pass through int16 (2 bytes a value more scratch, see scratch_nbytes)
    codes = scaled.to(torch.int8).view(torch.uint8) if bits < 8 else scaled.to(torch.int16).to(torch.uint8)
    return codes, lo, step


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack each group's codes plane by plane (:func:`~zoomem.ops.packbits.pack_planes`): byte ``k`` holds values
    ``k, k + n, k + 2n, ...`` (``n`` bytes a group), lowest bits first."""
    return codes if bits == 8 else pack_planes(codes.view(codes.shape[0], 8 // bits, -1), bits)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`_pack` packed, as (groups, group_size) uint8."""
    return packed if bits == 8 else unpack_planes(packed, bits).view(packed.shape[0], -1)


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
        # the noise lives only through this call, the codes only through this pass: nothing of one chunk's
        # scratch is alive while the next chunk draws its noise (see scratch_nbytes)
        c, lo, step = _quantize_rows(part, _uniform(part.shape, x.device, generator), bits)
        codes.append(_pack(c, bits))
        los.append(lo)
        steps.append(step)
        del c
    if not codes:  # an empty tensor: no groups
        codes = [torch.empty(0, group_size * bits // 8, dtype=torch.uint8, device=x.device)]
        los = steps = [torch.empty(0, dtype=torch.float32, device=x.device)]
    lo, step = torch.cat(los), torch.cat(steps)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(step).all()):  # NaN/Inf in x, or a range beyond fp32
        return None
    return Quantized(torch.cat(codes), lo, step, x.shape, x.dtype, bits, per_row, group_size)


def _block(shape: torch.Size | tuple[int, ...], row_groups: int, group_size: int) -> tuple[int, int]:
    """(rows, groups of a row) :func:`dequantize` unpacks at once for padded rows: whole rows while a chunk holds
    one, else a chunk of one row's groups."""
    chunk = max(1, _CHUNK_ELEMS // group_size)
    return (min(shape[0], chunk // row_groups), row_groups) if row_groups <= chunk else (1, chunk)


def _values(q: Quantized, g0: int, g1: int) -> torch.Tensor:
    """The fp32 values of groups ``g0 .. g1 - 1``, (groups, group_size)."""
    return _unpack(q.codes[g0:g1], q.bits).float().mul_(q.step[g0:g1, None]).add_(q.lo[g0:g1, None])


def dequantize(q: Quantized) -> torch.Tensor:
    """The tensor a :class:`Quantized` form stands for (same shape, dtype and device as the codes' tensor)."""
    if use_triton(q.codes, q.group_size):
        return triton_dequantize(q)
    numel = math.prod(q.shape)
    out = torch.empty(numel, dtype=q.dtype, device=q.codes.device)
    g, per_row = q.group_size, q.row_groups
    row_len = numel // q.shape[0] if per_row else numel
    if per_row and row_len % g:  # padded rows: each row's padding sits at its end
        rows_at_once, span = _block(q.shape, per_row, g)
        view = out.view(q.shape[0], row_len)
        for r0 in range(0, q.shape[0], rows_at_once):
            r1 = min(q.shape[0], r0 + rows_at_once)
            for c0 in range(0, per_row, span):  # one pass unless a row is longer than a chunk
                c1 = min(per_row, c0 + span)
                n = min(row_len, c1 * g) - c0 * g
                vals = _values(q, r0 * per_row + c0, (r1 - 1) * per_row + c1)  # contiguous groups
                view[r0:r1, c0 * g:c0 * g + n] = vals.view(r1 - r0, -1)[:, :n]
                del vals  # one block's values at a time (scratch_nbytes)
    else:  # grouped flat, or rows that are whole groups: the same layout
        chunk = max(1, _CHUNK_ELEMS // g)
        for g0 in range(0, q.codes.shape[0], chunk):
            g1 = min(q.codes.shape[0], g0 + chunk)
            n = min(numel, g1 * g) - g0 * g
            vals = _values(q, g0, g1)
            out[g0 * g:g0 * g + n] = vals.view(-1)[:n]
            del vals
    return out.view(q.shape)


_SPEED: dict[tuple[str, int, int], float] = {}


def _probe_seconds(device: torch.device, bits: int, numel: int) -> float:
    """Seconds to quantize and dequantize ``numel`` fp32 values on ``device`` (cached): the median of 3 runs, 9 for
    tensors of 1 MiB or less (their times are a fraction of a millisecond), after one untimed run. Without that
    run the first probe of a process read 35% slow on CPU here (1.86-1.92 ns a byte at 2 bits, 1.34-1.40 after)."""
    key = (str(device), bits, numel)
    if key not in _SPEED:
        import time

        # its own generator: the user's RNG stream (dropout masks) must not depend on whether this ran before
        # in the process (it is cached); it did, and the same seed gave different trainings
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(numel, device=device, generator=gen)
        dequantize(quantize(x, bits, generator=gen))  # type: ignore[arg-type]
        times = []
        for _ in range(3 if numel * 4 > 1 << 20 else 9):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            q = quantize(x, bits, generator=gen)
            assert q is not None
            dequantize(q)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        _SPEED[key] = sorted(times)[len(times) // 2]
    return _SPEED[key]


_LARGE, _SMALL = 1 << 20, 1 << 14  # 4 MiB and 64 KiB of fp32


def seconds_per_byte(device: torch.device | str, bits: int) -> float:
    """Measured seconds to quantize and later dequantize one byte of fp32 activation on ``device`` (cached): the
    rate of a 4 MiB tensor, the part of the time that grows with the tensor (see :func:`seconds_per_call`)."""
    return _probe_seconds(torch.device(device), bits, _LARGE) / (_LARGE * 4)


def seconds_per_call(device: torch.device | str, bits: int) -> float:
    """Measured seconds one quantize + dequantize costs beyond :func:`seconds_per_byte` whatever its size: the ops'
    dispatch and the Python around them (cached). From a 64 KiB tensor; never negative. 0.07-0.22 ms on one CPU
    thread here (BENCHMARKS.md), so a model with many small lossy tensors (ViT-Tiny at batch 8: 133, 1.7 MB on
    average) pays 9-29 ms a step that the rate alone does not see."""
    device = torch.device(device)
    return max(0.0, _probe_seconds(device, bits, _SMALL) - seconds_per_byte(device, bits) * _SMALL * 4)
