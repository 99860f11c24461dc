"""Operators: the registry of known aten/custom ops (and, with the planner, their memory-efficient forms)."""

from .registry import OPS, OpSpec, op_name, op_spec, register_op

__all__ = ["OPS", "OpSpec", "op_name", "op_spec", "register_op"]
