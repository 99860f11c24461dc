"""The operator registry: which aten ops zoomem knows, their category, and (later) their implementations.

An op no one registered is never an error: it is recorded as ``generic`` and kept as autograd keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OPS", "OpSpec", "register_op", "op_spec", "op_name"]


@dataclass(frozen=True)
class OpSpec:
    """What zoomem knows of one aten op (keyed by its overload packet, e.g. ``aten.mm``)."""

    name: str
    kind: str = "generic"
    zoo: str | None = None


OPS: dict[str, OpSpec] = {}
"""Op packet name (``"aten.mm"``) -> spec."""


def op_name(op: Any) -> str:
    """The packet name of an op given as an OpOverload, OpOverloadPacket or string.

    >>> op_name(torch.ops.aten.mm.default)
    'aten.mm'
    """
    if isinstance(op, str):
        parts = op.replace("::", ".").split(".")
        return ".".join(parts[:2])
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return str(op).replace("::", ".")
    raise TypeError(
        f"Expected an aten op such as torch.ops.aten.mm (or its name 'aten.mm'), got {op!r} of type {type(op).__name__}."
    )


def register_op(op: Any, *, kind: str, zoo: str | None = None, overwrite: bool = False) -> OpSpec:
    """Register an operator (an aten op, or a custom op from ``torch.library``) with zoomem.

    Args:
        op: ``torch.ops.ns.name`` (packet or overload) or its name ``"ns.name"``.
        kind: its category (``"matmul"``, ``"attention"``, ``"scatter"``, ...), shown in traces and used by the
            planner's cost model.
        zoo: the zoo it comes from, for display.
        overwrite: replace an earlier registration instead of failing.

    >>> spec = register_op("mylib.fused_act", kind="activation", overwrite=True)
    >>> spec.kind
    'activation'
    """
    name = op_name(op)
    if name in OPS and not overwrite and OPS[name].kind != kind:
        raise ValueError(
            f"Op {name!r} is already registered as kind={OPS[name].kind!r}; pass overwrite=True to replace it."
        )
    spec = OpSpec(name, kind, zoo)
    OPS[name] = spec
    return spec


def op_spec(op: Any) -> OpSpec:
    """The registered spec of ``op``, or a ``generic`` spec for an op no one registered."""
    name = op_name(op)
    return OPS.get(name) or OpSpec(name)


_BUILTIN: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm"),
    "conv": ("convolution", "mkldnn_convolution", "cudnn_convolution", "_convolution", "_slow_conv2d_forward",
             "convolution_backward", "_depthwise_conv2d", "conv_depthwise2d"),
    "norm": ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
             "cudnn_batch_norm", "native_layer_norm", "native_group_norm", "_fused_rms_norm", "rms_norm",
             "_batch_norm_with_update", "_batch_norm_no_update"),
    "activation": ("relu", "relu_", "threshold", "threshold_", "gelu", "silu", "silu_", "hardtanh", "hardtanh_",
                   "leaky_relu", "leaky_relu_", "sigmoid", "tanh", "hardswish", "hardswish_", "hardsigmoid",
                   "hardsigmoid_", "elu", "mish", "clamp_min", "clamp"),
    "dropout": ("native_dropout", "bernoulli", "bernoulli_", "dropout"),
    "pool": ("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool2d",
             "max_pool2d", "mean"),
    "softmax": ("_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                  "_efficient_attention_forward", "scaled_dot_product_attention"),
    "embedding": ("embedding", "embedding_dense_backward", "_embedding_bag"),
    "loss": ("nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss", "mse_loss", "binary_cross_entropy_with_logits"),
    "scatter": ("scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add", "index_add_",
                "segment_reduce", "_segment_reduce_backward", "index_reduce"),
    "gather": ("index_select", "gather", "index"),
    "view": ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
             "slice", "select", "as_strided", "alias", "split", "split_with_sizes", "chunk", "unbind", "flatten",
             "detach", "lift_fresh"),
    "copy": ("clone", "_to_copy", "copy_", "contiguous", "cat", "stack", "zeros_like", "empty_like", "new_zeros",
             "fill_", "zero_"),
}


def _register_builtin() -> None:
    for kind, names in _BUILTIN.items():
        for n in names:
            OPS.setdefault(f"aten.{n}", OpSpec(f"aten.{n}", kind))


_register_builtin()
