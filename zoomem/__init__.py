"""zoomem: train timm, HuggingFace and PyG models in less accelerator memory.

The public API, and nothing else:

>>> import zoomem
>>> graph = zoomem.trace(model, batch)          # doctest: +SKIP
>>> print(graph.summary())                      # doctest: +SKIP
>>> with zoomem.MemoryMeter(model) as meter:    # doctest: +SKIP
...     loss = model(x).sum(); meter.mark("forward"); loss.backward()
"""

from importlib.metadata import PackageNotFoundError, version

from .adapters import Adapter, Unit, get_adapter, register_adapter, register_layer
from .batch import Batch
from .graph import OpGraph, TraceError, trace
from .measure import MemoryMeter, MemoryReport, measure_step
from .ops import register_op
from .planner import Decision, InfeasibleBudgetError, Plan, parse_budget
from .planner.compression import LEVELS, CompressOptions
from .runtime import disabled, is_wrapped, plan, unwrap, wrap

try:
    __version__ = version("zoomem")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"

__all__ = [
    "Adapter",
    "Batch",
    "CompressOptions",
    "Decision",
    "LEVELS",
    "InfeasibleBudgetError",
    "Plan",
    "disabled",
    "is_wrapped",
    "parse_budget",
    "plan",
    "unwrap",
    "wrap",
    "MemoryMeter",
    "MemoryReport",
    "OpGraph",
    "TraceError",
    "Unit",
    "__version__",
    "get_adapter",
    "measure_step",
    "register_adapter",
    "register_layer",
    "register_op",
    "trace",
]
