"""PyG message passing through a sparse adjacency (CSR SpMM) instead of per-edge messages.

With an ``edge_index`` of shape [2, E], a PyG conv gathers an E x F tensor of messages, scatters it, and in
backward materialises its E x F gradient: on a 100k-node graph with 10 edges a node and 256 features, 1 GiB
each way. Convs that implement ``message_and_aggregate`` (GCN, GraphSAGE, GIN, GraphConv, ...) can instead take
the transposed adjacency as a ``torch.sparse_csr`` tensor and aggregate with one SpMM that never holds an
edges-by-features tensor. This implementation converts the edge list on the way in and calls the conv's own
forward; in a wrapped model it runs inside zoomem's forward of the conv's unit (``runtime.compact.UNIT_INNER``),
so a recomputed conv converts its edge list again rather than holding the adjacency from forward to backward.

It applies only where both paths compute the same thing: a simple graph (no duplicate edges, no self
loops, checked on every call; otherwise it falls back to the edge list) and no edge weights or extra inputs.
The sums run in another order, so results agree to float rounding (about 1e-7 relative), not bitwise.

What the products save is the adjacency's structure in a compact form (:func:`_compact_csr`: indices in their
own storage, int32 where they fit): PyG builds a CSR's column indices as a view of a ``[2, E]`` edge list, so the
stock product of a GCN layer keeps both int64 rows of its self-looped edge list alive (16 bytes an edge for its
column indices, where 4 do; 8 an edge with the values).

Double backward (``create_graph=True``): PyG's ``spmm`` runs ``aggr="add"`` as a plain ``torch.sparse.mm``, which
supports it; other reductions on CPU go to aten's ``_sparse_mm_reduce_impl``, whose backward has no derivative
formula. Inside the conv's forward these calls on our adjacency are routed to :class:`_CsrSpmmReduce`: the same
forward kernel (bitwise the same output) and, in an ordinary backward, the same backward kernel (bitwise the same
gradient); under ``create_graph`` its backward is rebuilt from differentiable ops (the transposed SpMM for
sum/mean, a scatter through the saved argmax for max/min). The adjacency is a constant (an integer structure with
unit values): no gradient flows to it, as none does through the edge list.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .functional import _kernel_value
from .impls import Impl, register_impl

__all__ = ["register_message_passing_impl"]


def _simple_graph(edge_index: torch.Tensor, num_nodes: int) -> bool:
    if bool((edge_index[0] == edge_index[1]).any()):
        return False
    keys = edge_index[0] * num_nodes + edge_index[1]
    return torch.unique(keys).numel() == keys.numel()


def _spmm_forward(module: nn.Module, original: Callable[..., Any], x: Any, edge_index: Any, *args: Any, **kwargs: Any) -> Any:
    from torch_geometric.utils import to_torch_csr_tensor

    plain = (
        isinstance(x, torch.Tensor)
        and isinstance(edge_index, torch.Tensor)
        and edge_index.layout == torch.strided
        and edge_index.dim() == 2
        and edge_index.size(0) == 2
        and not edge_index.is_floating_point()
        and not args
        and all(v is None for v in kwargs.values())
    )
    if not plain or not _simple_graph(edge_index, x.size(0)):
        return original(x, edge_index, *args, **kwargs)
    n = x.size(0)
    with warnings.catch_warnings():  # torch's note that sparse invariant checks are off: we built it sorted
        warnings.simplefilter("ignore", UserWarning)
        adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(n, n))  # rows: targets, as PyG's adj_t
    with _RouteReduceSpmm(adj_t):
        return original(x, adj_t)


_REDUCES = frozenset({"sum", "mean", "max", "min", "amax", "amin"})


def _compact_member(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A member of a CSR matrix as ``dtype`` in a storage of its own (a copy if it is a view into a larger one),
    not a view of the matrix (``values()`` is one: it would keep the whole matrix alive)."""
    if t.dtype != dtype:
        return t.to(dtype)
    own = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.detach() if own else t.clone(memory_format=torch.contiguous_format)


def _compact_csr(adj: torch.Tensor, narrow: bool = True) -> torch.Tensor:
    """The same CSR matrix holding only its own bytes: each tensor in a storage of its own and, with ``narrow``,
    indices int32 where the sizes fit (``torch.sparse.mm`` takes either: bitwise the same results on CPU, which
    the tests check; on CUDA not measured here)."""
    crow, col, values = adj.crow_indices(), adj.col_indices(), adj.values()
    dtype = torch.int32 if narrow and max(adj.shape[-1], col.numel()) < 2**31 else crow.dtype
    with warnings.catch_warnings():  # torch's note that sparse invariant checks are off: the structure is adj's
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(_compact_member(crow, dtype), _compact_member(col, dtype),
                                       _compact_member(values, values.dtype), adj.shape)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _CsrSpmmReduce(torch.autograd.Function):
    """``torch.sparse.mm(adj, x, reduce)`` for a constant CSR ``adj`` (unit values) and a dense 2-D ``x``.

    Forward: aten's ``_sparse_mm_reduce_impl``, what ``torch.sparse.mm`` runs. Backward: aten's
    ``_sparse_mm_reduce_impl_backward`` (bitwise the stock gradient) and, when the backward itself is recorded
    (``create_graph``), that value carrying the graph of a differentiable rewrite. Saves the adjacency's integer
    structure and, for max/min, the argmax (the stock node saves the adjacency, ``x`` and the argmax).
    """

    @staticmethod
    def forward(ctx, adj, x, reduce):  # type: ignore[override]
        if reduce in ("sum", "mean"):
            out, arg_out = torch.ops.aten._sparse_mm_reduce_impl(adj, x, reduce)
        else:  # aten computes the argmax only while it records a graph: let it, on a detached leaf, hooks off
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                out, arg_out = torch.ops.aten._sparse_mm_reduce_impl(adj, x.detach().requires_grad_(), reduce)
            out = out.detach()
        ctx.reduce, ctx.x_shape, ctx.adj_shape, ctx.v_dtype = reduce, x.shape, adj.shape, adj.values().dtype
        compact = _compact_csr(adj, narrow=False)  # the reduce kernels' backward: int64 indices, as aten built them
        ctx.save_for_backward(compact.crow_indices(), compact.col_indices(), arg_out)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[1]:
            return None, None, None
        crow, col, arg_out = ctx.saved_tensors
        with torch.no_grad():
            ones = torch.ones(col.numel(), dtype=ctx.v_dtype, device=col.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                adj = torch.sparse_csr_tensor(crow, col, ones, ctx.adj_shape)
            dummy = grad.new_empty(()).expand(ctx.x_shape)  # read for its shape only (no value gradient asked)
            _, gx = torch.ops.aten._sparse_mm_reduce_impl_backward(adj, grad, dummy, ctx.reduce, arg_out, [False, True])
            del adj, ones
        if torch.is_grad_enabled():
            gx = _kernel_value(gx, _spmm_reduce_grad(crow, col, arg_out, grad, ctx.reduce, ctx.x_shape))
        return None, gx, None


def _spmm_reduce_grad(
    crow: torch.Tensor, col: torch.Tensor, arg_out: torch.Tensor, grad: torch.Tensor, reduce: str, x_shape: torch.Size
) -> torch.Tensor:
    """d/dx of ``spmm(adj, x, reduce)`` (unit values) applied to ``grad``, with differentiable ops."""
    nnz = col.numel()
    if nnz == 0:
        return grad.new_zeros(x_shape)
    if reduce in ("sum", "mean"):
        deg = crow[1:] - crow[:-1]
        if reduce == "mean":
            grad = grad / deg.clamp(min=1).unsqueeze(-1).to(grad.dtype)
        rows = torch.repeat_interleave(torch.arange(deg.numel(), device=col.device), deg)
        perm = torch.argsort(col, stable=True)
        crow_t = torch.zeros(x_shape[0] + 1, dtype=crow.dtype, device=col.device)
        crow_t[1:] = torch.bincount(col, minlength=x_shape[0]).cumsum(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            adj_tt = torch.sparse_csr_tensor(
                crow_t, rows[perm], torch.ones(nnz, dtype=grad.dtype, device=col.device), (x_shape[0], deg.numel())
            )
        return torch.sparse.mm(adj_tt, grad)  # adj^T @ grad: differentiable in grad
    # max / min: each output element came from the entry arg_out (== nnz for an empty row, which gets nothing)
    valid = arg_out < nnz
    src = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return grad.new_zeros(x_shape).scatter_add(0, col[arg_out.clamp(max=nnz - 1)], src)


def _const_csr_product(adj: Any, x: Any) -> bool:
    """Whether ``torch.sparse.mm(adj, x)`` multiplies a constant CSR matrix into a dense 2-D ``x`` that needs a
    gradient (autograd then saves the matrix)."""
    return (
        isinstance(adj, torch.Tensor) and adj.layout == torch.sparse_csr and adj.dim() == 2 and not adj.requires_grad
        and isinstance(x, torch.Tensor) and x.layout == torch.strided and x.dim() == 2 and x.requires_grad
        and torch.is_grad_enabled()
    )


class _RouteReduceSpmm(TorchFunctionMode):
    """Inside a conv's forward, sends ``torch.sparse.mm(adj, x, reduce)`` on our adjacency to
    :class:`_CsrSpmmReduce`, and ``torch.sparse.mm(a, x)`` on any constant CSR matrix (GCN normalises ours into
    another) to the same product on :func:`_compact_csr` of it, when ``x`` needs a gradient; every other call runs
    unchanged."""

    def __init__(self, adj: torch.Tensor) -> None:
        super().__init__()
        self.adj = adj

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.sparse.mm and len(args) == 2 and not kwargs and _const_csr_product(*args):
            # the stock product, on the same matrix held compactly: bitwise the same output and gradient, and
            # autograd saves the compact one (before the product runs, as for any input it saves)
            return torch.sparse.mm(_compact_csr(args[0]), args[1])
        if func is torch.sparse.mm and args and args[0] is self.adj:
            other = args[1] if len(args) > 1 else kwargs.get("mat2")
            reduce = args[2] if len(args) > 2 else kwargs.get("reduce")
            if (
                reduce in _REDUCES
                and isinstance(other, torch.Tensor)
                and other.layout == torch.strided
                and other.dim() == 2
                and other.requires_grad
                and torch.is_grad_enabled()
            ):
                return _CsrSpmmReduce.apply(self.adj, other, reduce)
        return func(*args, **kwargs)


def register_message_passing_impl() -> Impl | None:
    """Register ``message_passing_spmm`` for PyG convs with a fused ``message_and_aggregate`` (once)."""
    from .impls import IMPLS

    if "message_passing_spmm" in IMPLS:
        return IMPLS["message_passing_spmm"]
    try:
        from torch_geometric.nn.conv import MessagePassing
    except ImportError:  # PyG not installed: nothing to register
        return None

    def applies(m: nn.Module) -> bool:
        return type(m).message_and_aggregate is not MessagePassing.message_and_aggregate

    return register_impl(
        Impl(
            "message_passing_spmm",
            (MessagePassing,),
            _spmm_forward,
            applies,
            "PyG conv aggregating through a CSR adjacency (SpMM) instead of E x F messages; simple graphs only; "
            "~1e-7 relative.",
            wraps_original=True,
        )
    )
