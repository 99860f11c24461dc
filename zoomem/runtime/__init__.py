"""The runtime: installs a Plan on a live model (unit checkpointing) and undoes it."""

from .units import run_unit
from .wrap import disabled, is_wrapped, plan, unwrap, wrap

__all__ = ["disabled", "is_wrapped", "plan", "run_unit", "unwrap", "wrap"]
