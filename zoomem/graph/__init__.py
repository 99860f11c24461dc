"""The operator graph and the tracer that builds it from one real training step."""

from .model import OUTSIDE, OpGraph, OpNode, TensorInfo, UnitInfo
from .tracer import TraceError, trace

__all__ = ["OUTSIDE", "OpGraph", "OpNode", "TensorInfo", "TraceError", "UnitInfo", "trace"]
