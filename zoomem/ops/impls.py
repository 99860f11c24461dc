"""Module-level memory-efficient implementations, swappable per module instance.

An :class:`Impl` names a replacement ``forward`` for instances of some module classes, built on the autograd
Functions of :mod:`zoomem.ops.functional`. The planner picks one per module; :func:`install_impl` puts it on one
instance (never the class) and returns an undo function. The installed wrapper runs the module's own forward in
``eval()`` and under ``torch.no_grad()``/``inference_mode`` (same speed, same output, nothing saved), and when no
input or parameter needs a gradient; otherwise it runs the Impl. Parameters, buffers, ``state_dict`` keys and
hooks of the module are untouched (the hooks run around the wrapper as around the original forward).

>>> m = nn.ReLU(inplace=True)
>>> [impl.name for impl in impls_for(m)]
['relu_bitmask']
>>> undo = install_impl(m, IMPLS["relu_bitmask"])
>>> undo()
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..measure import is_out_of_memory
from ..state import restore_buffers, training_scope
from . import functional as Zf
from .attention import attention_applies, attention_forward
from .checkpoints import in_models_checkpoint
from .loss import record_head, routed_forward, tied_embedding
from .rebuild import register as register_rebuild
from .rebuild import running as rebuild_scope

__all__ = [
    "Impl",
    "IMPLS",
    "POINTWISE",
    "register_impl",
    "register_pointwise",
    "impls_for",
    "install_impl",
    "installed_impl",
    "set_attribute",
    "find_inplace_writers",
    "scan_outputs",
    "OutputUses",
    "check_impls",
]

logger = logging.getLogger(__name__)


def _always(module: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class Impl:
    """A memory-efficient implementation of a module's forward.

    Args:
        name: unique registry key, e.g. ``"relu_bitmask"``.
        module_types: the module classes it may replace (``isinstance`` check).
        forward: ``forward(module, *args, **kwargs) -> output``, the training-mode replacement of
            ``module.forward``; it must compute what the module's own forward computes.
        applies: a finer check on an instance (e.g. that its class does not override ``forward``, or the type of a
            fused activation).
        doc: what it saves instead of what, and how exact its gradients are.
        wraps_original: ``forward`` is called as ``forward(module, original_forward, *args, **kwargs)`` and
            changes the inputs of the module's current forward, or the context it runs in, rather than replacing it
            (PyG message passing through a sparse adjacency; ``cross_entropy_logits`` routing the loss of a whole
            model); such an implementation may sit on a unit itself, outside its plan, or on a wrapped model, where
            zoomem's forward calls it.
        attribute: the instance attribute it replaces: ``"forward"``, or another callable the module calls (HF's
            ``loss_function``), set through the class's property setter where there is one; ``forward`` is then
            called as with ``wraps_original``, with the attribute's previous value.
        setup: ``setup(module) -> undo``, run when the implementation is installed (switched on or not): what it
            needs beside the replaced attribute, e.g. the forward hook through which ``cross_entropy_logits`` learns
            the LM head's input.
        may_be_faster: it can run faster than the stock op (PyG's SpMM, the fused LM-head loss): a time credit
            measured for it is taken. The others do the stock work and more (a mask packed, a BatchNorm output
            rebuilt), so a credit measured for them is the noise of one timed step and counts as zero.
        checked: before it becomes a candidate on a module, its output is compared with the module's own forward's
            on the planning batch (:func:`check_impls`): for an implementation that covers a family of classes
            whose members may compute otherwise through it (PyG convs each implement ``message_and_aggregate`` in
            their own way, and some differ from, or fail on, the adjacency the implementation gives them).
        shares_saved: the modules it sits on share what it saves where their inputs are equal (PyG's one CSR
            adjacency for every layer, ``message_passing._shared_parts``): the first module with it on holds the
            shared part, which the cost model prices apart (``CostModel.shared_bytes``).
    """

    name: str
    module_types: tuple[type, ...]
    forward: Callable[..., Any]
    applies: Callable[[nn.Module], bool] = _always
    doc: str = ""
    wraps_original: bool = False
    attribute: str = "forward"
    setup: Callable[[nn.Module], Callable[[], None]] | None = None
    may_be_faster: bool = False
    checked: bool = False
    shares_saved: bool = False

    @property
    def wraps(self) -> bool:
        """``forward`` receives the replaced callable as its second argument."""
        return self.wraps_original or self.attribute != "forward"

    def matches(self, module: nn.Module) -> bool:
        """Whether this implementation may replace ``module``'s forward."""
        return isinstance(module, self.module_types) and bool(self.applies(module))


IMPLS: dict[str, Impl] = {}
"""Impl name -> Impl."""


def register_impl(impl: Impl) -> Impl:
    """Add ``impl`` to :data:`IMPLS`; refuses a name that is already taken.

    Raises:
        ValueError: if an implementation with the same name is registered.
    """
    if not isinstance(impl, Impl):
        raise TypeError(f"register_impl expects a zoomem.ops.Impl, got {type(impl).__name__}.")
    if impl.name in IMPLS:
        raise ValueError(
            f"An implementation named {impl.name!r} is already registered (for "
            f"{[t.__name__ for t in IMPLS[impl.name].module_types]}); give the new one another name."
        )
    IMPLS[impl.name] = impl
    return impl


def impls_for(module: nn.Module) -> list[Impl]:
    """The registered implementations that apply to ``module``, in registration order."""
    return [impl for impl in IMPLS.values() if impl.matches(module)]


_MARK = "__zoomem_impl__"


def installed_impl(module: nn.Module, attribute: str = "forward") -> Impl | None:
    """The Impl installed on ``module``'s ``attribute`` by :func:`install_impl`, or None."""
    value = module.__dict__.get("forward") if attribute == "forward" else getattr(module, attribute, None)
    return getattr(value, _MARK, None)


def set_attribute(module: nn.Module, name: str, value: Any) -> Callable[[], None]:
    """``setattr(module, name, value)`` (through a property setter if the class has one); returns the undo, which
    puts the instance's ``__dict__`` entries back exactly as they were (HF's ``loss_function`` setter stores into
    ``_loss_function``, whose absence means "the loss of ``config.loss_type``")."""
    from ..runtime.patch import record_patch  # (here: zoomem.runtime imports this module)

    before = dict(module.__dict__)
    setattr(module, name, value)
    changed = [k for k, v in module.__dict__.items() if k not in before or before[k] is not v]
    forget = record_patch(module, {k: (k in before, before.get(k)) for k in changed})

    def undo() -> None:
        forget()
        if getattr(module, name, None) is not value:  # replaced again since: keep that (zoomem's passes through)
            warnings.warn(f"zoomem: the {name} of this {type(module).__name__} was replaced after zoomem's; it is "
                          "left in place.", stacklevel=2)
            return
        for k in changed:
            if k in before:
                module.__dict__[k] = before[k]
            else:
                module.__dict__.pop(k, None)

    return undo


def _needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    for a in kwargs.values():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return any(p.requires_grad for p in module.parameters())


def dispatch_impl(module: nn.Module, impl: Impl, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``impl`` in training when something needs a gradient, else the module's ``original`` forward (also
    inside a checkpoint of the model's own, whose recomputation must see the ops its forward ran)."""
    if (not module.training or not torch.is_grad_enabled() or not _needs_grad(module, args, kwargs)
            or in_models_checkpoint()):
        return original(*args, **kwargs)
    with rebuild_scope(module):
        if impl.wraps:
            return impl.forward(module, original, *args, **kwargs)
        return impl.forward(module, *args, **kwargs)


def install_impl(module: nn.Module, impl: Impl | str) -> Callable[[], None]:
    """Make ``module`` (this instance only) run ``impl`` in training; returns the function that undoes it.

    Sets ``module.forward`` to a wrapper (a ``functools.partial``, so ``copy.deepcopy`` and pickling of the model
    keep working) that keeps the previous forward and calls it in eval mode, under no_grad, and when nothing needs
    a gradient. The class is never patched.

    Args:
        module: the module instance.
        impl: an :class:`Impl` or the name of a registered one.

    Returns:
        ``undo()``: restores the previous ``forward`` (the class's, or an instance-level one set before).

    Raises:
        KeyError: unknown impl name.
        ValueError: ``impl`` does not apply to ``module``, or an Impl is already installed on it.

    >>> undo = install_impl(nn.LayerNorm(8), "layernorm_output")
    >>> undo()
    """
    if isinstance(impl, str):
        if impl not in IMPLS:
            raise KeyError(f"Unknown implementation {impl!r}; registered: {sorted(IMPLS)}.")
        impl = IMPLS[impl]
    current = installed_impl(module, impl.attribute)
    if current is not None:
        raise ValueError(
            f"{type(module).__name__} already runs the implementation {current.name!r}; call the undo function "
            "returned by install_impl before installing another."
        )
    if not impl.matches(module):
        raise ValueError(
            f"Implementation {impl.name!r} does not apply to this {type(module).__name__}; applicable: "
            f"{[i.name for i in impls_for(module)]}."
        )
    wrapper = functools.partial(dispatch_impl, module, impl, getattr(module, impl.attribute))
    setattr(wrapper, _MARK, impl)
    if impl.attribute != "forward":
        return with_setup(module, impl, set_attribute(module, impl.attribute, wrapper))
    had_instance_forward = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = wrapper

    def undo() -> None:
        if module.__dict__.get("forward") is not wrapper:
            raise RuntimeError(
                f"Cannot undo {impl.name!r} on this {type(module).__name__}: its forward was replaced again after "
                "install_impl; undo the later change first."
            )
        if had_instance_forward:
            module.__dict__["forward"] = previous
        else:
            del module.__dict__["forward"]

    return with_setup(module, impl, undo)


def with_setup(module: nn.Module, impl: Impl, undo: Callable[[], None]) -> Callable[[], None]:
    """Run ``impl.setup`` on ``module`` (if any) beside an installation whose undo is ``undo``; returns the undo
    of both (the setup's last)."""
    if impl.setup is None:
        return undo
    undo_setup = impl.setup(module)

    def both() -> None:
        undo()
        undo_setup()

    return both


# ----------------------------------------------------------------------------------------------------------------
# forwards


def _has_own_forward(cls: type, module: nn.Module) -> bool:
    return type(module).forward is cls.forward


def _own_forward(cls: type) -> Callable[[nn.Module], bool]:
    """applies(): the instance's class runs ``cls``'s very ``forward`` (a subclass overriding it is excluded).

    A ``functools.partial`` (not a closure) so that a model with an installed Impl still pickles.
    """
    return functools.partial(_has_own_forward, cls)


def _relu_forward(m: nn.ReLU, input: torch.Tensor) -> torch.Tensor:
    return Zf.relu(input, m.inplace)


def _hardtanh_forward(m: nn.Hardtanh, input: torch.Tensor) -> torch.Tensor:
    return Zf.hardtanh(input, m.min_val, m.max_val, m.inplace)


def _leaky_forward(m: nn.LeakyReLU, input: torch.Tensor) -> torch.Tensor:
    return Zf.leaky_relu(input, m.negative_slope, m.inplace)


def _threshold_forward(m: nn.Threshold, input: torch.Tensor) -> torch.Tensor:
    return Zf.threshold(input, m.threshold, m.value, m.inplace)


def _dropout_forward(m: nn.Dropout, input: torch.Tensor) -> torch.Tensor:
    return Zf.dropout(input, m.p, m.training, m.inplace)


def _bn_common(m: _BatchNorm, x: torch.Tensor, act: str, slope: float) -> torch.Tensor:
    """``_BatchNorm.forward`` (momentum / cumulative average / num_batches_tracked) on the output-activated op."""
    factor = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
    track = not m.training or m.track_running_stats
    return Zf.batch_norm_act(
        x,
        m.running_mean if track else None,
        m.running_var if track else None,
        m.weight,
        m.bias,
        True,  # only called in training mode
        factor,
        m.eps,
        act,
        slope,
    )


def _bn_forward(m: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    m._check_input_dim(input)
    return _bn_common(m, input, "identity", 0.0)


def _bn_rebuild_forward(m: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """The stock forward, its output registered as rebuildable from the input the stock backward saves anyway."""
    out = _BatchNorm.forward(m, input)
    # the kernel path the forward took: with running statistics or without
    stat_dtype = m.running_mean.dtype if m.running_mean is not None and m.track_running_stats else None
    eps = m.eps

    def again(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        # batch statistics again, into throwaway running buffers (the output does not read them)
        stats = (None, None) if stat_dtype is None else (
            torch.zeros(x.shape[1], dtype=stat_dtype, device=x.device),
            torch.ones(x.shape[1], dtype=stat_dtype, device=x.device))
        return torch.nn.functional.batch_norm(x, *stats, weight, bias, True, 0.0, eps)

    register_rebuild(out, (input, m.weight, m.bias), again)
    return out


def _initialized(m: nn.Module) -> bool:
    return not any(nn.parameter.is_lazy(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


def _bn_applies(m: nn.Module) -> bool:
    return type(m).forward is _BatchNorm.forward and _initialized(m)


def _timm_bn_act_class() -> type | None:
    na = sys.modules.get("timm.layers.norm_act")  # a timm module instance implies timm is imported
    return getattr(na, "BatchNormAct2d", None)


def _no_hooks(m: nn.Module) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None))


def _bn_act_kind(m: nn.Module) -> tuple[str, float, nn.Module | None] | None:
    """The activation of a timm BatchNormAct2d as ("identity"|"relu"|"leaky_relu", slope, after): ReLU and
    LeakyReLU fuse into the op; any other activation module (SiLU, Hardswish, ReLU6, GELU, ...) is ``after``, run on
    the identity op's output; None where a drop or hooks are there."""
    act, drop = getattr(m, "act", None), getattr(m, "drop", None)
    if type(drop) is not nn.Identity or not _no_hooks(drop) or act is None or not _no_hooks(act):
        return None
    if type(act) is nn.Identity:
        return ("identity", 0.0, None)
    if type(act) is nn.ReLU:
        return ("relu", 0.0, None)
    if type(act) is nn.LeakyReLU and act.negative_slope > 0:
        return ("leaky_relu", float(act.negative_slope), None)
    return ("identity", 0.0, act)


def _timm_bn_act_applies(m: nn.Module) -> bool:
    cls = _timm_bn_act_class()
    return cls is not None and type(m).forward is cls.forward and _bn_act_kind(m) is not None


def _timm_bn_act_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.ndim != 4:
        raise ValueError(f"expected 4D input (got {x.ndim}D input)")
    kind = _bn_act_kind(m)
    assert kind is not None  # checked by applies()
    act, slope, after = kind
    y = _bn_common(m, x, act, slope)
    if after is None:
        return y
    # the identity op saves its output (or xhat): an activation asked to run in place (timm's default) runs out of
    # place here, as stock autograd's in-place SiLU/Hardswish copies its input for backward anyway
    inplace = getattr(after, "inplace", False) is True
    if inplace:
        after.inplace = False
    try:
        return after(y)
    finally:
        if inplace:
            after.inplace = True


def _timm_bn_act_rebuild_applies(m: nn.Module) -> bool:
    kind = _bn_act_kind(m) if _timm_bn_act_applies(m) else None
    return kind is not None and kind[0] in ("relu", "leaky_relu")


def _timm_bn_act_rebuild_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's BatchNormAct2d with ReLU / LeakyReLU as its own forward computes it (its batch norm is torch's, cut and
    pasted), the activation saving a mask and the output rebuildable from the input."""
    kind = _bn_act_kind(m)
    assert kind is not None  # checked by applies()
    y = _bn_rebuild_forward(m, x)
    return Zf.leaky_relu(y, kind[1], inplace=True) if kind[0] == "leaky_relu" else Zf.relu(y, inplace=True)


def _ln_forward(m: nn.LayerNorm, input: torch.Tensor) -> torch.Tensor:
    return Zf.layer_norm(input, m.normalized_shape, m.weight, m.bias, m.eps)


def _rms_eps(m: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(m, attr, None)
        if isinstance(v, float):
            return v
    return None


def _rms_applies(m: nn.Module) -> bool:
    """HF Llama-form RMSNorm: checked on its numbers, since many ``*RMSNorm`` classes compute differently
    (Gemma's ``1 + weight``, torch's ``nn.RMSNorm`` in reduced precision, ...)."""
    w = getattr(m, "weight", None)
    eps = _rms_eps(m)
    if not type(m).__name__.endswith("RMSNorm") or not isinstance(w, nn.Parameter) or w.dim() != 1 or eps is None:
        return False
    if w.device.type == "meta" or nn.parameter.is_lazy(w):
        return False
    if type(m).forward is getattr(getattr(nn, "RMSNorm", None), "forward", None):
        return False  # torch's F.rms_norm may dispatch to fused kernels with other numerics on other shapes
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, w.shape[0], generator=gen) * 3
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for dtype in {torch.float32, torch.bfloat16, w.dtype}:
                x = base.to(device=w.device, dtype=dtype)
                ref = m(x)
                if not isinstance(ref, torch.Tensor) or not torch.equal(ref, Zf._rms_forward(x, w, eps)[0]):
                    return False
    except Exception:  # noqa: BLE001 - any failure means "not the form we implement"
        logger.debug("RMSNorm probe failed on %s", type(m).__name__, exc_info=True)
        return False
    return True


def _rms_forward(m: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return Zf.rms_norm(hidden_states, m.weight, _rms_eps(m))  # type: ignore[arg-type]


def _maxpool_forward(m: nn.MaxPool2d, input: torch.Tensor) -> torch.Tensor:
    return Zf.max_pool2d(input, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)


def _maxpool_applies(m: nn.Module) -> bool:
    return type(m).forward is nn.MaxPool2d.forward and not m.return_indices


def _linear_forward(m: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return Zf.linear(input, m.weight, m.bias)


def _conv_forward(m: nn.Conv2d, input: torch.Tensor) -> torch.Tensor:
    return Zf.conv2d(input, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)


def _conv_applies(m: nn.Module) -> bool:
    return (
        type(m).forward is nn.Conv2d.forward
        and type(m)._conv_forward is nn.Conv2d._conv_forward
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
        and _initialized(m)
    )


POINTWISE: dict[str, str] = {
    f"transformers.activations.{name}": "transformers"
    for name in ("NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "AccurateGELUActivation",
                 "ClippedGELUActivation", "SqrtSoftplusActivation")
}
"""Qualified class name -> zoo of the parameterless elementwise activations written as several ops (each saving
its own intermediate), which ``pointwise_recompute`` keeps as their input. Those that save one tensor already
(``nn.GELU``, ``nn.SiLU``, HF's ``GELUActivation``, ``relu2``, ``laplace``) are not listed: recomputing them
would cost time and save nothing."""
POINTWISE.update({"timm.layers.activations.QuickGELU": "timm", "timm.layers.activations.Swish": "timm"})


def register_pointwise(cls: type, zoo: str = "user") -> type:
    """Make ``pointwise_recompute`` apply to the elementwise activation module ``cls`` (its forward must be a
    deterministic function of its one input that does not modify it); returns ``cls`` (a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_pointwise expects an nn.Module subclass, got {cls!r}.")
    POINTWISE[f"{cls.__module__}.{cls.__qualname__}"] = zoo
    return cls


def _pointwise_applies(m: nn.Module) -> bool:
    cls = type(m)
    return (f"{cls.__module__}.{cls.__qualname__}" in POINTWISE and not any(True for _ in m.parameters())
            and not getattr(m, "inplace", False))


def _pointwise_forward(m: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(m).forward
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return forward(m, *args, **kwargs)
    return Zf.recompute_pointwise(functools.partial(forward, m), args[0])


def _embedding_forward(m: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    return tied_embedding(input, m.weight, m.padding_idx)


def _embedding_applies(m: nn.Module) -> bool:
    return (_has_own_forward(nn.Embedding, m) and not m.sparse and not m.scale_grad_by_freq
            and m.max_norm is None)


def _lm_loss_applies(m: nn.Module) -> bool:
    """An HF model with an LM head (output embeddings), whose loss is a cross-entropy over the vocabulary."""
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None or not isinstance(m, mu.PreTrainedModel):
        return False
    try:
        return m.get_output_embeddings() is not None
    except Exception:  # noqa: BLE001 - a model without the accessor has no LM head we know of
        return False


def _register_builtin() -> None:
    for impl in (
        Impl("relu_bitmask", (nn.ReLU,), _relu_forward, _own_forward(nn.ReLU),
             "ReLU saving a 1-bit mask instead of its output (1/32 of fp32). Bitwise gradients. In-place works, and "
             "later in-place ops on its output are allowed; runs out of place on an output-activated norm's output."),
        Impl("hardtanh_bitmask", (nn.Hardtanh,), _hardtanh_forward, _own_forward(nn.Hardtanh),
             "Hardtanh/ReLU6 saving a 1-bit mask instead of its input. Bitwise gradients."),
        Impl("leaky_relu_bitmask", (nn.LeakyReLU,), _leaky_forward, _own_forward(nn.LeakyReLU),
             "LeakyReLU saving a 1-bit mask of x > 0 instead of its input. Bitwise gradients."),
        Impl("threshold_bitmask", (nn.Threshold,), _threshold_forward, _own_forward(nn.Threshold),
             "Threshold saving a 1-bit mask instead of its input. Bitwise gradients."),
        Impl("dropout_bitmask", (nn.Dropout,), _dropout_forward, _own_forward(nn.Dropout),
             "Dropout saving a 1-bit mask (vs a float noise tensor on CPU, a bool mask on CUDA). Same RNG draws, "
             "bitwise output and gradients."),
        Impl("batchnorm_output", (_BatchNorm,), _bn_forward, _bn_applies,
             "BatchNorm1d/2d/3d saving its output + 1/std instead of its input (the next layer saves the output "
             "anyway). Running stats exact; gradients ~1e-6 relative in fp32. Falls back to saving the input when "
             "some gamma == 0. Its output must not be modified in place later (see find_inplace_writers)."),
        Impl("batchnorm_rebuilt_output", (_BatchNorm,), _bn_rebuild_forward, _bn_applies,
             "BatchNorm1d/2d/3d run as is (saving its input), its output registered as rebuildable from that input: "
             "zoomem's ReLU-family activations pass that on, and zoomem's conv2d/linear after them save nothing new "
             "and rebuild their input (batch norm + activation again) for the weight gradient. One tensor per "
             "conv-BN-ReLU instead of two (MONeT). Bitwise gradients. Safe where the output is modified in place."),
        Impl("batchnorm_act_rebuilt_output", (nn.BatchNorm2d,), _timm_bn_act_rebuild_forward,
             _timm_bn_act_rebuild_applies,
             "timm BatchNormAct2d with ReLU or LeakyReLU (no drop): the norm saves its input as the stock op does, the "
             "activation a 1-bit mask, and the output is rebuildable (batchnorm_rebuilt_output): DenseNet's and "
             "ResNet-v2's conv after it saves nothing new. Bitwise gradients."),
        Impl("batchnorm_act_output", (nn.BatchNorm2d,), _timm_bn_act_forward, _timm_bn_act_applies,
             "timm BatchNormAct2d (no drop): identity and leaky save the activated output (shared with the next "
             "layer); ReLU saves the pre-activation output instead of the input; other activations (SiLU, "
             "Hardswish, ReLU6, ...) run after the identity op, out of place, and save its output as their input. "
             "Gradients ~1e-6 relative in fp32."),
        Impl("layernorm_output", (nn.LayerNorm,), _ln_forward, _own_forward(nn.LayerNorm),
             "LayerNorm saving its output + 1/std per row instead of its input + mean. Gradients ~1e-6 relative in "
             "fp32."),
        Impl("rmsnorm_output", (nn.Module,), _rms_forward, _rms_applies,
             "HF Llama-form *RMSNorm saving its output + 1/rms per row instead of an fp32 input copy and the "
             "normalized tensor. Forward bitwise; gradients ~1e-6 relative in fp32."),
        Impl("maxpool2d_compact", (nn.MaxPool2d,), _maxpool_forward, _maxpool_applies,
             "MaxPool2d saving uint8 window offsets instead of its input and int64 indices. Bitwise gradients."),
        Impl("linear_split_backward", (nn.Linear,), _linear_forward, _own_forward(nn.Linear),
             "Linear whose backward computes grad_weight first and frees the input before grad_input: lowers the "
             "backward peak by |input| when the input is held by this layer alone. Bitwise gradients."),
        Impl("conv2d_split_backward", (nn.Conv2d,), _conv_forward, _conv_applies,
             "Conv2d (zeros padding, numeric) with the split backward of linear_split_backward. Bitwise on CPU."),
        Impl("pointwise_recompute", (nn.Module,), _pointwise_forward, _pointwise_applies,
             "Elementwise activations written as several ops (POINTWISE: HF gelu_new / gelu_fast / quick_gelu, ...) "
             "saving only their input and recomputed in backward: 1 input-sized tensor instead of 2-4. Bitwise."),
        Impl("attention_recompute", (nn.Module,), attention_forward, attention_applies,
             "Attention layers (kind='attention') whose F.scaled_dot_product_attention runs on the math path (CPU "
             "with dropout): saves q, k, v and a 1-bit dropout mask instead of three N x N tensors, recomputing "
             "q k^T and the softmax in backward. Bitwise.", wraps_original=True),
        Impl("embedding_tied_grad", (nn.Embedding,), _embedding_forward, _embedding_applies,
             "Embedding that takes the weight gradient of an LM head tied to it (cross_entropy_logits' fused "
             "backward hands it over) and adds its rows in place: one vocabulary-sized gradient instead of two. "
             "Otherwise aten's own backward, bitwise; with the hand-over ~1e-7 relative.", may_be_faster=True),
        Impl("cross_entropy_logits", (nn.Module,), routed_forward,
             _lm_loss_applies,
             "HF LM heads: the F.cross_entropy calls made after the output embeddings ran (HF's loss_function, or "
             "nn.CrossEntropyLoss in forward: BertForMaskedLM, T5) keep the logits (the model's output) instead of "
             "the log-probabilities. Logits that are the output-embeddings Linear's output go with its input and "
             "weight to one fused backward, a slice of the vocabulary at a time (no logits-sized gradient, no "
             "log-probabilities in forward; under bf16/fp16 autocast it reads the bf16 logits, not HF's fp32 copy); "
             "others get one logits-sized gradient instead of three. With zoomem.wrap(skip_logits=True) the fused loss "
             "saves no logits (backward makes each slice again) and the forward returns logits=None. Loss and "
             "gradients ~1e-7 relative.",
             wraps_original=True, setup=record_head, may_be_faster=True),
    ):
        register_impl(impl)


_register_builtin()


# ----------------------------------------------------------------------------------------------------------------
# in-place hazards


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


@dataclass(frozen=True)
class OutputUses:
    """What one training forward does with each module's output (:func:`scan_outputs`)."""

    writers: dict[str, list[str]]
    """``{module name: [writer, ...]}`` for outputs overwritten in place later, a writer being a leaf module's name
    or ``"<code>"``."""
    saved: frozenset[str]
    """Modules whose output some op saves for backward (the module's own ops included)."""


def find_inplace_writers(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, list[str]]:
    """Which module outputs are overwritten in place later in one training forward, and by whom.

    Runs ``model(*args, **kwargs)`` once in training mode with gradients enabled (no backward), then restores the
    model's buffers (BatchNorm running statistics) and the RNG state. An output-saving implementation
    (``batchnorm_output``, ``layernorm_output``, ...) must not be installed on a module whose output is written in
    place by code (``"<code>"``, e.g. ``x += shortcut``) or by a module that keeps running in place.
    The bitmask activations (``relu_bitmask`` & co.) run out of place on such an output, so they are safe writers.

    Returns:
        ``{module name: [writer, ...]}``, a writer being a leaf module's name or ``"<code>"``; only modules whose
        output was overwritten are listed.

    >>> m = nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(inplace=True))
    >>> find_inplace_writers(m, torch.randn(3, 4))
    {'0': ['1']}
    """
    return scan_outputs(model, *args, **kwargs).writers


def scan_outputs(model: nn.Module, *args: Any, **kwargs: Any) -> OutputUses:
    """:func:`find_inplace_writers`, and which module outputs autograd saves: an output-saving implementation
    trades its input for its output, which gains only where another op saves that output too (a ResNet shortcut's
    BatchNorm feeds an addition, which saves nothing: there it would add its backward's temporary for nothing).

    >>> uses = scan_outputs(nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2)), torch.randn(3, 4))
    >>> sorted(uses.saved)  # the Linear saves the first BatchNorm's output, the second the Linear's
    ['0', '1']
    """
    names = {m: n for n, m in model.named_modules()}
    tracked: list[tuple[str, torch.Tensor]] = []  # every output stays alive: its storage is its identity here
    seen: list[int] = []
    writers: dict[str, list[str]] = {}
    saved: set[int] = set()

    def scan(who: str) -> None:
        for i, (name, t) in enumerate(tracked):
            v = t._version
            if v != seen[i]:
                seen[i] = v
                lst = writers.setdefault(name, [])
                if who not in lst and who != name:
                    lst.append(who)

    def pre(mod: nn.Module, inputs: Any) -> None:
        scan("<code>")

    def post(mod: nn.Module, inputs: Any, output: Any) -> None:
        leaf = next(iter(mod.children()), None) is None
        scan(names[mod] if leaf else "<code>")
        for t in _tensors(output):
            tracked.append((names[mod], t))
            seen.append(t._version)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        # detached: a node holding its own output as packed (the hook's result) would make a reference cycle
        # through autograd's C++ that the collector cannot see, keeping the graph and the model alive for good
        return t.detach()

    handles = []
    for mod in names:
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        with _probing(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args, **kwargs)
        scan("<code>")
    finally:
        for h in handles:
            h.remove()
    return OutputUses({k: v for k, v in writers.items() if v},
                      frozenset(name for name, t in tracked if t.untyped_storage().data_ptr() in saved))


@contextlib.contextmanager
def _probing(model: nn.Module) -> Iterator[None]:
    """Run a training forward of ``model`` inside (gradients on) that leaves no trace: its buffers (BatchNorm
    running statistics), every module's train/eval mode and the RNG state are put back afterwards."""
    rng = _rng_state()
    try:
        with restore_buffers(model), training_scope(model), torch.enable_grad():
            yield
    finally:
        _set_rng_state(rng)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _differs(stock: Any, other: Any) -> str | None:
    """Why ``other`` is not ``stock`` up to float rounding (another summation order: 1e-4 of the largest magnitude
    in 32 or 64 bits, 1e-2 in 16), or None."""
    a, b = _tensors(stock), _tensors(other)
    if len(a) != len(b):
        return f"it gives {len(b)} output tensors where the module's own forward gives {len(a)}"
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return (f"it gives an output of {tuple(y.shape)} {y.dtype} where the module's own is {tuple(x.shape)} "
                    f"{x.dtype}")
        x, y = x.detach(), y.detach()
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return "its integer outputs differ from the module's own"
            continue
        if not torch.equal(x.isnan(), y.isnan()):
            return "its outputs hold NaN elsewhere than the module's own"
        x, y = x.nan_to_num(), y.nan_to_num()
        scale = max(float(x.abs().max()) if x.numel() else 0.0, torch.finfo(x.dtype).tiny)
        err = float((x - y).abs().max()) if x.numel() else 0.0
        if err > (1e-4 if x.element_size() >= 4 else 1e-2) * scale:
            return f"its outputs are {err / scale:.1e} of their largest magnitude off the module's own"
    return None


def check_impls(
    model: nn.Module, pairs: list[tuple[str, nn.Module, Impl]], *args: Any, **kwargs: Any
) -> dict[str, str]:
    """Which of ``pairs`` (name, module, implementation) compute otherwise than their module's own forward on
    these inputs: ``{name: why}``.

    Runs ``model(*args, **kwargs)`` once as a training step's forward does (no backward) and, at each call of a
    listed module, its class's forward and the implementation again on the same inputs from the RNG state the call
    began with; outputs must agree up to float rounding (:func:`_differs`), and an implementation that raises
    fails. The model's buffers and the RNG state are put back (:func:`_probing`)."""
    listed = {id(mod): (name, mod, impl) for name, mod, impl in pairs}
    failed: dict[str, str] = {}
    began: dict[int, tuple[torch.Tensor, list[torch.Tensor] | None]] = {}

    def pre(mod: nn.Module, inputs: Any, kw: Any) -> None:
        began[id(mod)] = _rng_state()

    def post(mod: nn.Module, inputs: Any, kw: Any, output: Any) -> None:
        name, _, impl = listed[id(mod)]
        if name in failed:
            return
        after = _rng_state()
        own = type(mod).forward.__get__(mod)
        try:
            _set_rng_state(began[id(mod)])
            stock = own(*inputs, **kw)
            _set_rng_state(began[id(mod)])
            other = dispatch_impl(mod, impl, own, *inputs, **kw)
            why = _differs(stock, other)
        except Exception as exc:  # an implementation that cannot run here is not a candidate here
            if is_out_of_memory(exc):  # nor a verdict: planning's own handling of a step too large takes it
                raise
            why = f"it raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
        finally:
            _set_rng_state(after)
        if why is not None:
            failed[name] = why

    handles = []
    for _, mod, _ in pairs:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with _probing(model):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return failed
