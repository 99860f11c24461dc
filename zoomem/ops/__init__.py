"""Operators: the registry of known aten/custom ops and the memory-efficient implementations the planner picks."""

from . import functional
from .impls import (
    IMPLS,
    POINTWISE,
    Impl,
    find_inplace_writers,
    impls_for,
    install_impl,
    installed_impl,
    register_impl,
    register_pointwise,
)
from .packbits import pack_bool, unpack_bool
from .registry import OPS, OpSpec, op_name, op_spec, register_op

__all__ = [
    "IMPLS",
    "OPS",
    "POINTWISE",
    "Impl",
    "OpSpec",
    "find_inplace_writers",
    "functional",
    "impls_for",
    "install_impl",
    "installed_impl",
    "op_name",
    "op_spec",
    "pack_bool",
    "register_impl",
    "register_op",
    "register_pointwise",
    "unpack_bool",
]
