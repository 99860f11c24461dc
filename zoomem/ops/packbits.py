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
from collections.abc import Iterator

import torch

__all__ = ["bool_planes", "pack_bool", "pack_planes", "unpack_plane", "unpack_planes", "unpack_bool", "packed_nbytes",
           "narrowest_uint", "to_narrow_uint"]

logger = logging.getLogger(__name__)


def _words(planes: torch.Tensor) -> torch.Tensor:
    """``planes`` (uint8, contiguous last dimension) seen as 64-bit words where its last dimension allows, else as
    it is: a shift or mask on the words then moves eight bytes at once. Every value is below ``2**bits`` and moves
    by at most ``8 - bits``, so nothing crosses into the next byte."""
    return planes.view(torch.int64) if planes.shape[-1] % 8 == 0 and planes.numel() else planes


def _low_bits(bits: int, words: torch.Tensor) -> int:
    """The mask of the low ``bits`` of every byte of one element of ``words``."""
    return int.from_bytes(bytes([(1 << bits) - 1]) * words.element_size(), "little")


def pack_planes(planes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``planes`` (uint8, ``(..., 8 // bits, n)``, every value below ``2**bits``) into ``(..., n)`` bytes: bits
    ``p * bits`` on of byte ``k`` hold ``planes[..., p, k]``. Each plane is a contiguous run, shifted and or-ed as
    64-bit words; interleaving neighbours into a byte (a sum over a dimension of ``8 // bits``) was several times
    slower on CPU. The layout of :func:`pack_bool` (``bits=1``) and of the quantizer's codes."""
    words = _words(planes)
    packed = words[..., 0, :].clone()
    for p in range(1, 8 // bits):
        packed |= words[..., p, :] << (p * bits)
    return packed.view(torch.uint8)


def unpack_plane(packed: torch.Tensor, bits: int, p: int) -> torch.Tensor:
    """Plane ``p`` of :func:`pack_planes`' bytes ``packed``: ``(..., n)`` uint8 values below ``2**bits``."""
    words = _words(packed)
    return ((words >> (p * bits)) & _low_bits(bits, words)).view(torch.uint8)


def unpack_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: ``(..., 8 // bits, n)`` uint8."""
    words = _words(packed)
    mask = _low_bits(bits, words)
    planes = torch.empty(*words.shape[:-1], 8 // bits, words.shape[-1], dtype=words.dtype, device=packed.device)
    for p in range(8 // bits):
        torch.bitwise_and(words >> (p * bits), mask, out=planes[..., p, :])
    return planes.view(torch.uint8)


def pack_bool(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """Pack a boolean tensor into bytes, 8 elements per byte (1 bit each).

    The elements are taken in the tensor's logical (row-major) order, whatever its strides, and packed plane by
    plane (:func:`pack_planes`): with ``m = ceil(numel / 8)`` bytes, bit ``p`` of byte ``k`` holds element
    ``p * m + k``.

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
    m = -(-n // 8)
    if 8 * m != n:
        flat = torch.cat([flat, flat.new_zeros(8 * m - n)])
    return pack_planes(flat.view(torch.uint8).view(8, m), 1), shape  # bool -> uint8: a free reinterpretation


def unpack_bool(packed: torch.Tensor, shape: torch.Size | tuple[int, ...],
                dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Inverse of :func:`pack_bool`: a contiguous tensor of ``shape`` on ``packed``'s device, ``torch.bool`` or
    0 / 1 in ``dtype`` (converted from the unpacked bytes, which is faster than from a bool tensor)."""
    shape = torch.Size(shape)
    flat = unpack_planes(packed, 1).view(-1)[:shape.numel()]
    return (flat.view(torch.bool) if dtype == torch.bool else flat.to(dtype)).view(shape)


def bool_planes(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """The mask :func:`pack_bool` packed, one plane at a time: ``(start, values)``, ``values`` the flat mask's
    elements ``start, start + 1, ...`` as 0 / 1 in ``dtype``. A caller applying the mask holds an eighth of it at a
    time (``numel``: the mask's element count)."""
    m = packed.numel()
    for p in range(8):
        if p * m >= numel:
            return
        yield p * m, unpack_plane(packed, 1, p)[:min(m, numel - p * m)].to(dtype)


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
