"""zoomem for the HuggingFace ``Trainer``: one callback, ``callbacks=[ZoomemCallback(budget="6GiB")]``.

The Trainer builds its ``Accelerator``, DDP container and optimizer inside ``train()``, before any callback sees
the model, and offers no hook between. The callback therefore wraps in ``on_train_begin``, which comes after
``accelerator.prepare`` and before the first forward: it wraps the bare model the Trainer holds (``model`` there
is the unwrapped module; DDP keeps it as ``.module``). ``zoomem.wrap`` changes forwards at instance level only, so
DDP's parameters, buckets and hooks are untouched, and zoomem's forward sits outside the autocast wrapper that
``bf16=True`` puts on the model (see :mod:`zoomem.accelerate` for why that order matters). The plan is made on
the first training forward, logged once on the main process, and the model is unwrapped when training ends.

>>> from transformers import Trainer, TrainingArguments
>>> from zoomem.hf_trainer import ZoomemCallback
>>> trainer = Trainer(model, TrainingArguments("out"), train_dataset=ds,
...                   callbacks=[ZoomemCallback(level="L2")])   # doctest: +SKIP
>>> trainer.train()                                              # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .accelerate import _bare, check_distributed_type, check_processes, plans
from .adapters.transformers import TransformersAdapter
from .planner import Plan
from .planner.compression import CompressOptions
from .runtime import is_wrapped, unwrap, wrap

__all__ = ["ZoomemCallback"]

logger = logging.getLogger(__name__)


class ZoomemCallback(TrainerCallback):
    """Wrap the Trainer's model with :func:`zoomem.wrap` for the length of ``trainer.train()``.

    Args:
        budget, level, compress: as in :func:`zoomem.wrap` (per process).
        expect_processes: the number of processes the run needs; a launch that gave another raises
            :class:`~zoomem.accelerate.ProcessCountError` at the start of training.
        unwrap_at_end: undo the wrap in ``on_train_end`` (the model leaves ``train()`` as it came in).
        wrap_kwargs: more :func:`zoomem.wrap` arguments (``strategy``, ``time_limit``, ``sensitivity_interval``,
            ...). The Trainer's optimizer is passed as ``optimizer=`` unless given.

    Attributes:
        plans: the plans made during the last ``train()`` (one per input signature), for inspection.

    Raises:
        ValueError: (at ``on_train_begin``) ``TrainingArguments(gradient_checkpointing=True)``: HF's checkpointing
            already recomputes every layer, and zoomem plans recomputation itself.
        UnsupportedDistributedError: the Trainer runs FSDP or DeepSpeed.
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        *,
        level: str | None = None,
        compress: str | CompressOptions | None = None,
        expect_processes: int | None = None,
        unwrap_at_end: bool = True,
        **wrap_kwargs: Any,
    ) -> None:
        self.budget, self.level, self.compress = budget, level, compress
        self.expect_processes = expect_processes
        self.unwrap_at_end = unwrap_at_end
        self.wrap_kwargs = wrap_kwargs
        self.plans: list[Plan] = []
        self._model: nn.Module | None = None
        self._logged: list[Plan] = []

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        from accelerate.state import AcceleratorState, is_initialized

        if model is None:
            raise ValueError("ZoomemCallback needs the Trainer's model in on_train_begin; none was passed.")
        if is_initialized():
            acc = AcceleratorState()
            check_processes(acc, self.expect_processes)
            check_distributed_type(acc)
        if TransformersAdapter().native_checkpointing(model) or args.gradient_checkpointing:
            raise ValueError(
                "TrainingArguments(gradient_checkpointing=True) makes HF recompute every layer, and zoomem plans "
                "recomputation itself (only where the budget needs it): drop gradient_checkpointing=True and let "
                "ZoomemCallback's budget decide, or drop the callback."
            )
        bare = _bare(model)
        kw = dict(self.wrap_kwargs)
        if "optimizer" not in kw and optimizer is not None:
            kw["optimizer"] = optimizer  # (an AcceleratedOptimizer: zoomem.optimizer sees through it)
        wrap(bare, self.budget, level=self.level, compress=self.compress, **kw)
        self._model, self.plans, self._logged = bare, [], []

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Collect the plans made so far and log each new one once, on the main process."""
        if self._model is None:
            return
        self.plans = plans(self._model)
        for p in self.plans:
            if not any(p is q for q in self._logged):
                self._logged.append(p)
                if state.is_world_process_zero:
                    logger.info("zoomem plan for %s:\n%s", p.signature or "the first batch", p.summary())

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._model is not None:
            self.plans = plans(self._model)
            if self.unwrap_at_end and is_wrapped(self._model):
                unwrap(self._model)
        self._model = None
