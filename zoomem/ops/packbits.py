"""Exact compact storage for what autograd saves: 1-bit masks and narrow integers.

Everything here is vectorised PyTorch and runs on any device; nothing here is lossy.

>>> m = torch.tensor([True, False, True, True, False, False, False, False, True])
>>> packed, shape = pack_bool(m)
>>> packed.dtype, packed.numel()
(torch.uint8, 2)
>>> torch.equal(unpack_bool(packed, shape), m)
True
"""

from __future__ import annotations

import logging

import torch

__all__ = ["pack_bool", "unpack_bool", "packed_nbytes", "narrowest_uint", "to_narrow_uint"]

logger = logging.getLogger(__name__)


def _shifts(device: torch.device) -> torch.Tensor:
    # bit k of byte i holds element 8*i + k (little-endian bit order, like numpy.packbits(bitorder="little"))
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_bool(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """Pack a boolean tensor into bytes, 8 elements per byte (1 bit each).

    The elements are taken in the tensor's logical (row-major) order, whatever its strides.

    Args:
        mask: a ``torch.bool`` tensor of any shape and device (other dtypes are read as ``mask != 0``).

    Returns:
        ``(packed, shape)``: a 1-D ``uint8`` tensor of ``ceil(numel / 8)`` bytes on ``mask``'s device, and the
        shape to give back to :func:`unpack_bool`.

    Shapes:
        mask: any; packed: ``(ceil(mask.numel() / 8),)``.
    """
    shape = mask.shape
    if mask.dtype != torch.bool:
        mask = mask != 0
    flat = mask.reshape(-1)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = flat.view(-1, 8).view(torch.uint8)  # bool -> uint8 is a free reinterpretation (0/1 bytes)
    packed = (bits << _shifts(mask.device)).sum(dim=1, dtype=torch.uint8)
    return packed, shape


def unpack_bool(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bool`: a contiguous ``torch.bool`` tensor of ``shape`` on ``packed``'s device."""
    shape = torch.Size(shape)
    n = shape.numel()
    bits = (packed.unsqueeze(1) >> _shifts(packed.device)) & 1
    return bits.view(-1)[:n].view(torch.bool).view(shape)


def packed_nbytes(numel: int) -> int:
    """Bytes that :func:`pack_bool` uses for ``numel`` elements."""
    return (numel + 7) // 8


def narrowest_uint(max_value: int) -> torch.dtype:
    """The narrowest integer dtype that holds ``0..max_value`` (``uint8``, ``int16``, ``int32`` or ``int64``).

    >>> narrowest_uint(8)
    torch.uint8
    >>> narrowest_uint(300)
    torch.int16
    """
    if max_value < 0:
        raise ValueError(f"max_value must be >= 0, got {max_value}.")
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if max_value <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def to_narrow_uint(values: torch.Tensor, max_value: int) -> torch.Tensor:
    """``values`` (integers in ``0..max_value``) cast to :func:`narrowest_uint` of ``max_value``; exact."""
    return values.to(narrowest_uint(max_value))
