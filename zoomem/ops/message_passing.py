"""PyG message passing through a sparse adjacency (CSR SpMM) instead of per-edge messages.

With an ``edge_index`` of shape [2, E], a PyG conv gathers an E x F tensor of messages, scatters it, and in
backward materialises its E x F gradient: on a 100k-node graph with 10 edges a node and 256 features, 1 GiB
each way. Convs that implement ``message_and_aggregate`` (GCN, GraphSAGE, GIN, GraphConv, ...) can instead take
the transposed adjacency as a ``torch.sparse_csr`` tensor and aggregate with one SpMM that never holds an
edges-by-features tensor. This implementation converts the edge list on the way in and calls the conv's own
forward; in a wrapped model it runs inside zoomem's forward of the conv's unit (``runtime.compact.UNIT_INNER``),
so a recomputed conv converts its edge list again rather than holding the adjacency from forward to backward.

It applies only where both paths compute the same thing, checked on every call (otherwise the conv runs its edge
list): no extra inputs but a constant ``edge_weight`` (the adjacency's values, for GCN's and GraphConv's sums), and
a simple graph (no self-loops, no repeated edges) or a conv whose CSR path is known to take the others as its edge
list does (:func:`_multigraph_rule`: GCN, GIN, GraphConv and GraphSAGE; GCN's replaced self-loops dropped first,
repeated edges weighted by their count, or their weights summed, for a sum, kept once for a max or min, counted by
a mean on CPU). A conv given ``(x_source, x_target)`` (a bipartite edge type: ``to_hetero``'s convs) gets a
targets-by-sources adjacency, where no edge is a self-loop. Every other conv class's ``message_and_aggregate`` is taken on
trust for simple graphs, and checked: planning compares the form's output with the conv's own on the planning batch
and leaves it off a conv where they differ or it fails (``Impl.checked``; GCN with ``improved=True``, whose edge
list in PyG 2.8 gives its self-loops weight 1 where its CSR path gives 2; ARMA and MF, which cannot take a CSR
matrix). The sums run in another order, so results agree to float rounding (about 1e-7 relative), not bitwise.

What the products save is the adjacency's structure in a compact form (indices in their own storage, int32 where
they fit): PyG builds a CSR's column indices as a view of a ``[2, E]`` edge list, so the stock product of a GCN
layer keeps both int64 rows of its self-looped edge list alive (16 bytes an edge for its column indices, where 4
do). GCN's normalised values are not saved at all: they are checked, bit for bit, to be ``gcn_norm`` of the
structure and rebuilt from it in backward (:class:`_GcnSpmm`; 4 bytes an edge in all, from 20); another constant
matrix is saved whole (:func:`_compact_csr`, 8 bytes an edge). And the layers share what they save: each layer of
a GNN builds the same adjacency from the same edge list, so the parts one layer saved are reused by the next while
autograd holds them (:func:`_shared_parts`, compared bit for bit): an L-layer model keeps one adjacency for
backward instead of L.

Double backward (``create_graph=True``): PyG's ``spmm`` runs ``aggr="add"`` as a plain ``torch.sparse.mm``, which
supports it; other reductions on CPU go to aten's ``_sparse_mm_reduce_impl``, whose backward has no derivative
formula. Inside the conv's forward these calls on our adjacency are routed to :class:`_CsrSpmmReduce`: the same
forward kernel (bitwise the same output) and, in an ordinary backward, the same backward kernel (bitwise the same
gradient); under ``create_graph`` its backward is rebuilt from differentiable ops (the transposed SpMM for
sum/mean, a scatter through the saved argmax for max/min). The adjacency is a constant (an integer structure with
unit values): no gradient flows to it, as none does through the edge list.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .functional import _kernel_value
from .impls import Impl, register_impl

__all__ = ["register_message_passing_impl"]


def _multigraph_rule(module: nn.Module) -> tuple[bool, str] | None:
    """How ``module``'s CSR path takes a graph with self-loops or repeated edges as its edge list does: whether
    self-loops are dropped first, and what a repeated edge becomes: ``"weights"`` (one entry holding its count: a
    sum), ``"once"`` (one unit entry: a max or min, which a repeat does not change), ``"mean"`` (its count, the mean
    routed to divide by the counts: :class:`_RouteReduceSpmm`'s ``mean_by``) or ``"fail"`` (the edge list runs).
    None where the class's paths are not known to agree (every class but the four below, whose paths PyG 2.8's code
    shows and the tests measure; subclasses may aggregate otherwise).

    GCN's normalisation drops a graph's self-loops and adds one a node (``add_remaining_self_loops`` without edge
    weights), where its CSR path would add one beside each: so they are dropped first. To the others a self-loop
    is an edge like any other on both paths. PyG builds a CSR matrix with one unit entry per edge pair, so a
    repeated edge would count once; with its count as the entry's value, GCN's degrees and every sum see it as
    often as the edge list does. A mean divides by the entries of a row, not their values: with repeated edges its
    product is routed to the weighted sum over the row's weights (on CPU, where PyG's mean is ``torch.sparse.mm``'s
    ``reduce``; elsewhere it divides by the entries itself: no rule)."""
    from torch_geometric.nn.conv import GCNConv, GINConv, GraphConv, SAGEConv

    if type(module) not in (GCNConv, GINConv, GraphConv, SAGEConv):
        return None
    drop_loops = isinstance(module, GCNConv) and module.normalize and module.add_self_loops
    if drop_loops and module.improved:  # its edge list ignores ``improved`` (loops of weight 1), its CSR path not
        return None
    aggr = getattr(module, "aggr", None)
    repeats = {"add": "weights", "sum": "weights", "max": "once", "min": "once", "mean": "mean"}.get(aggr) \
        if isinstance(aggr, str) else None
    return (drop_loops, repeats or "fail")


class _Adjacency(NamedTuple):
    edges: torch.Tensor
    """``[2, E]`` (sources, targets), sorted by target, then source, each pair once."""
    values: torch.Tensor | None
    """Each entry's value (None: all 1)."""
    mean_by: torch.Tensor | None = None
    """For a mean over entries that hold repeated edges' counts: each target's edges, repeats counted
    (:class:`_RouteReduceSpmm` divides the weighted sum by it)."""


def _adjacency_edges(
    module: nn.Module, edge_index: torch.Tensor, num_nodes: int, weight: torch.Tensor | None = None,
    targets: int | None = None,
) -> _Adjacency | None:
    """The edge list, and each entry's value, whose CSR adjacency gives ``module`` what its own edge list (with
    ``weight``, its ``edge_weight``) does; None where none does (:func:`_multigraph_rule`). A simple graph
    (no self-loops, no repeated edges) without weights is taken whole. Edge weights go to the sums of GCN and
    GraphConv, a repeated edge's summed; not with self-loops in GCN, whose edge list keeps a loop's own weight where
    its CSR path would add one to it. ``targets``: a bipartite graph's target nodes (``num_nodes`` its sources),
    where no edge is a self-loop. The edges come back sorted by target, then source, each pair once unless a rule
    keeps repeats: the order of the transposed adjacency's CSR entries (one sort, the unique's, builds it)."""
    rows = num_nodes if targets is None else targets  # the transposed adjacency's: one per target
    keys = edge_index[1] * num_nodes + edge_index[0]  # target-major: the unique's order is the CSR's
    loops = targets is None and bool((edge_index[0] == edge_index[1]).any())
    if weight is None:
        unique, counts = torch.unique(keys, return_counts=True)
    else:
        unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    edges = lambda k: torch.stack((k % num_nodes, k // num_nodes))  # noqa: E731
    if weight is None and not loops and unique.numel() == keys.numel():
        return _Adjacency(edges(unique), None)
    rule = _multigraph_rule(module)
    if rule is None:
        return None
    drop_loops, repeats = rule
    if weight is not None:
        from torch_geometric.nn.conv import GCNConv, GraphConv

        if not isinstance(module, (GCNConv, GraphConv)) or repeats != "weights" or (drop_loops and loops):
            return None
        return _Adjacency(edges(unique), weight.new_zeros(unique.numel()).index_add_(0, inverse, weight))
    if drop_loops and loops:
        keep = unique // num_nodes != unique % num_nodes
        unique, counts = unique[keep], counts[keep]
    if not (counts.numel() and bool((counts > 1).any())) or repeats == "once":
        return _Adjacency(edges(unique), None)
    if repeats == "fail" or (repeats == "mean" and edge_index.device.type != "cpu"):
        return None
    values = counts.to(torch.get_default_dtype())  # the dtype of PyG's unit entries
    if repeats == "weights":
        return _Adjacency(edges(unique), values)
    mean_by = torch.bincount(edge_index[1], minlength=rows).clamp_(min=1).unsqueeze(-1)
    return _Adjacency(edges(unique), values, mean_by)


def _edge_weight(edge_index: torch.Tensor, args: tuple, kwargs: dict) -> tuple[bool, torch.Tensor | None]:
    """Whether a conv's arguments after ``(x, edge_index)`` are at most an ``edge_weight`` (positional or by name,
    the rest ``None``) the CSR adjacency can hold as its values: one constant float per edge; and that weight."""
    rest = [v for k, v in kwargs.items() if k != "edge_weight"]
    if len(args) > 1 or any(v is not None for v in rest) or (args and kwargs.get("edge_weight") is not None):
        return False, None
    weight = args[0] if args else kwargs.get("edge_weight")
    if weight is None:
        return True, None
    usable = (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.is_floating_point()
              and weight.numel() == edge_index.size(1) and not weight.requires_grad)
    return usable, weight if usable else None


def _spmm_forward(module: nn.Module, original: Callable[..., Any], x: Any, edge_index: Any, *args: Any, **kwargs: Any) -> Any:
    from torch_geometric.utils import to_torch_csr_tensor

    pair = isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)
    plain = (
        (isinstance(x, torch.Tensor) or pair)
        and isinstance(edge_index, torch.Tensor)
        and edge_index.layout == torch.strided
        and edge_index.dim() == 2
        and edge_index.size(0) == 2
        and not edge_index.is_floating_point()
    )
    usable, weight = _edge_weight(edge_index, args, kwargs) if plain else (False, None)
    n, m = (x[0].size(0), x[1].size(0)) if pair else (x.size(0), None) if plain else (0, None)
    edges = _adjacency_edges(module, edge_index, n, weight, targets=m) if usable else None
    if edges is None:
        return original(x, edge_index, *args, **kwargs)
    with warnings.catch_warnings():  # torch's note that sparse invariant checks are off: we built it sorted
        warnings.simplefilter("ignore", UserWarning)  # rows: targets, as PyG's adj_t
        adj_t = to_torch_csr_tensor(edges.edges.flip(0), edges.values, size=(n if m is None else m, n),
                                    is_coalesced=True)  # (sorted and unique already: one sort fewer)
    with _RouteReduceSpmm(adj_t, edges.mean_by):
        return original(x, adj_t)


_REDUCES = frozenset({"sum", "mean", "max", "min", "amax", "amin"})


def _compact_member(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A member of a CSR matrix as ``dtype`` in a storage of its own (a copy if it is a view into a larger one),
    not a view of the matrix (``values()`` is one: it would keep the whole matrix alive)."""
    if t.dtype != dtype:
        return t.to(dtype)
    own = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.detach() if own else t.clone(memory_format=torch.contiguous_format)


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: Any) -> torch.Tensor:
    """``torch.sparse_csr_tensor`` of parts taken from a valid CSR matrix, without torch's note that its invariant
    checks are off (every structure here is one aten built)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape)


_LIVE: list[tuple[weakref.ref, ...]] = []  # type: ignore[type-arg]
"""Weak references to the adjacency parts :func:`_shared_parts` made that something (autograd) still holds."""

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype hold the same bits (``-0.0`` is not ``0.0`` to a product's sign of zero)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point():
        as_int = _SAME_WIDTH_INT[a.element_size()]
        a, b = a.view(as_int), b.view(as_int)
    return torch.equal(a, b)


@contextlib.contextmanager
def _shared_parts(
    parts: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]
) -> Iterator[tuple[torch.Tensor, ...]]:
    """``parts`` (an adjacency's members) each as its dtype in a storage of its own (:func:`_compact_member`), or
    bit for bit equal parts an earlier call made, while something still holds them.

    Every layer of a GNN turns the same edge list into the same adjacency (GCN's normalisation included) and its
    product saves that adjacency for backward: one copy, not one a layer (on a 3-layer GCN, 2 of the 3 copies). The
    copy is made either way and held to the end of the ``with`` block (the caller's product), so a layer's
    forward holds the same bytes whether or not an earlier layer kept its parts (a checkpointed one does not): what
    the planner measured of each layer's forward holds in any plan. The parts are constants (no gradient, never
    written), so sharing them changes no value. Not under ``torch.compile`` (nothing to compare)."""
    made = tuple(_compact_member(p, d) for p, d in zip(parts, dtypes))
    if torch.compiler.is_compiling() or any(p.device.type == "meta" for p in parts):
        yield made
        return
    found: tuple[torch.Tensor, ...] | None = None
    live = []
    for entry in _LIVE:
        held = tuple(ref() for ref in entry)
        if any(h is None for h in held):
            continue
        live.append(entry)
        if found is None and len(held) == len(made) and all(
            _bitwise_equal(h, m) for h, m in zip(held, made)  # type: ignore[arg-type]
        ):
            found = held  # type: ignore[assignment]
    if found is None:
        live.append(tuple(weakref.ref(m) for m in made))
    _LIVE[:] = live
    yield made if found is None else found


def _index_dtype(adj: torch.Tensor, narrow: bool) -> torch.dtype:
    """int32 where ``narrow`` and the sizes fit (``torch.sparse.mm`` takes either: bitwise the same results on
    CPU, which the tests check; on CUDA not measured here), else the matrix's own."""
    fits = max(adj.shape[-1], adj.col_indices().numel()) < 2**31
    return torch.int32 if narrow and fits else adj.crow_indices().dtype


@contextlib.contextmanager
def _compact_csr(adj: torch.Tensor) -> Iterator[torch.Tensor]:
    """The same CSR matrix holding only its own bytes, indices int32 where they fit, its parts shared with any
    equal matrix another layer saved (:func:`_shared_parts`), for the ``with`` block."""
    index = _index_dtype(adj, narrow=True)
    with _shared_parts((adj.crow_indices(), adj.col_indices(), adj.values()),
                       (index, index, adj.values().dtype)) as (crow, col, values):
        yield _csr(crow, col, values, adj.shape)


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
        index = _index_dtype(adj, narrow=False)  # the reduce kernels' backward: int64 indices, as aten built them
        with _shared_parts((adj.crow_indices(), adj.col_indices()), (index, index)) as (crow, col):
            ctx.save_for_backward(crow, col, arg_out)  # these objects: other layers find them (weakly) while saved
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[1]:
            return None, None, None
        crow, col, arg_out = ctx.saved_tensors
        with torch.no_grad():
            ones = torch.ones(col.numel(), dtype=ctx.v_dtype, device=col.device)
            adj = _csr(crow, col, ones, ctx.adj_shape)
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
        ones = torch.ones(nnz, dtype=grad.dtype, device=col.device)
        adj_tt = _csr(crow_t, rows[perm], ones, (x_shape[0], deg.numel()))
        return torch.sparse.mm(adj_tt, grad)  # adj^T @ grad: differentiable in grad
    # max / min: each output element came from the entry arg_out (== nnz for an empty row, which gets nothing)
    valid = arg_out < nnz
    src = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return grad.new_zeros(x_shape).scatter_add(0, col[arg_out.clamp(max=nnz - 1)], src)


def _gcn_fill(adj: torch.Tensor) -> float | None:
    """The self-loop weight (1 or 2) when ``adj``'s values are, bit for bit, PyG's ``gcn_norm`` of its own
    structure with unit edge weights: ``d[col] * w * d[row]``, ``d = deg^-1/2`` (0 where ``deg`` is 0), ``w`` 1 off
    the diagonal and the self-loop weight on it, ``deg`` the row sums of ``w``; else ``None``. Such values are
    rebuilt from the indices in backward instead of being saved (:func:`_gcn_values`)."""
    values = adj.values()
    if values.dtype not in (torch.float32, torch.float64) or adj.shape[0] != adj.shape[1] or values.numel() == 0:
        return None
    for fill in (1.0, 2.0):
        if _bitwise_equal(_gcn_values(adj.crow_indices(), adj.col_indices(), fill, values.dtype), values):
            return fill
    return None


def _gcn_values(crow: torch.Tensor, col: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """GCN's normalised values of the CSR structure ``(crow, col)`` (see :func:`_gcn_fill`), bit for bit as PyG
    computes them, with 8 bytes an entry of scratch at most (with a self-loop weight of 1; 13 with 2): the row
    sums of small integers are exact in any order, and a product by ``w`` (1, or 2 on the diagonal) is exact."""
    counts = crow[1:] - crow[:-1]
    deg = counts.to(dtype)
    diag = None
    if fill != 1.0:
        rows = torch.repeat_interleave(torch.arange(counts.numel(), device=col.device, dtype=crow.dtype), counts,
                                       output_size=col.numel())
        diag = rows == col
        del rows
        deg.index_put_((col[diag],), torch.tensor(fill - 1.0, dtype=dtype, device=col.device), accumulate=True)
    d = deg.pow_(-0.5)
    d.masked_fill_(d == float("inf"), 0)
    values = d[col]
    if diag is not None:
        values[diag] *= fill
        del diag
    return values.mul_(torch.repeat_interleave(d, counts, output_size=col.numel()))


class _GcnSpmm(torch.autograd.Function):
    """``torch.sparse.mm(adj, x)`` for a constant CSR ``adj`` holding GCN's normalisation of its structure
    (:func:`_gcn_fill`): saves the structure only (4 bytes an entry fewer than the matrix) and rebuilds the values
    in backward, bit for bit. Output and gradient are bitwise the stock product's; the gradient is taken with
    differentiable ops, so a second backward goes through it."""

    @staticmethod
    def forward(ctx, crow, col, fill, x, adj):  # type: ignore[override]
        ctx.fill, ctx.shape, ctx.v_dtype = fill, adj.shape, adj.values().dtype
        ctx.save_for_backward(crow, col)  # these objects: other layers find them (weakly) while saved
        with torch.no_grad():
            return torch.sparse.mm(adj, x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[3]:
            return None, None, None, None, None
        crow, col = ctx.saved_tensors
        adj = _csr(crow, col, _gcn_values(crow, col, ctx.fill, ctx.v_dtype), ctx.shape)
        return None, None, None, adj.t() @ grad, None


def _compact_product(adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.sparse.mm(adj, x)`` for a constant CSR ``adj``, saving it compactly: its structure only where its
    values are GCN's normalisation (:class:`_GcnSpmm`), else the whole matrix (:func:`_compact_csr`); the
    parts shared with any equal ones another layer saved."""
    fill = _gcn_fill(adj)
    if fill is None:
        with _compact_csr(adj) as compact:
            return torch.sparse.mm(compact, x)  # autograd saves the compact one
    index = _index_dtype(adj, narrow=True)
    with _shared_parts((adj.crow_indices(), adj.col_indices()), (index, index)) as (crow, col):
        # the product runs on the int32 structure too: on int64 indices the kernel makes a converted copy
        return _GcnSpmm.apply(crow, col, fill, x, _csr(crow, col, adj.values(), adj.shape))


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
    another) to :func:`_compact_product`, when ``x`` needs a gradient; every other call runs unchanged. With
    ``mean_by`` (our adjacency holds repeated edges' counts), a mean over it is its weighted sum divided by
    ``mean_by``, each target's edges (the edge list's mean), gradient or not."""

    def __init__(self, adj: torch.Tensor, mean_by: torch.Tensor | None = None) -> None:
        super().__init__()
        self.adj, self.mean_by = adj, mean_by

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.sparse.mm and len(args) == 2 and not kwargs and _const_csr_product(*args):
            # the stock product, saving the same matrix compactly: bitwise the same output and gradient
            return _compact_product(args[0], args[1])
        if func is torch.sparse.mm and args and args[0] is self.adj:
            other = args[1] if len(args) > 1 else kwargs.get("mat2")
            reduce = args[2] if len(args) > 2 else kwargs.get("reduce")
            if reduce == "mean" and self.mean_by is not None:
                total = _compact_product(self.adj, other) if _const_csr_product(self.adj, other) \
                    else torch.sparse.mm(self.adj, other)
                return total / self.mean_by.to(total.dtype)
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
            "PyG conv aggregating through a CSR adjacency (SpMM) instead of E x F messages; simple graphs, or "
            "self-loops, repeated edges and edge weights where the conv's CSR path takes them as its edge list does; "
            "~1e-7 relative.",
            wraps_original=True,
            may_be_faster=True,
            checked=True,
            shares_saved=True,
        )
    )
