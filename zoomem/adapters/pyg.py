"""The PyTorch Geometric adapter: graph neural networks built from ``MessagePassing`` layers.

Units are the outermost ``MessagePassing`` modules in forward order (``convs.0``, ``convs.1``, ... in the
``torch_geometric.nn.models`` GCN/GAT/GraphSAGE/GIN). The example batch is one random graph. The aten ops that
message passing runs for gathering, scattering and sparse products are registered at import (they need no PyG);
``MessagePassing`` itself is registered as ``kind="message_passing"`` once PyG is imported.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from ..batch import Batch
from ..ops.registry import register_op
from .base import Adapter, Unit, default_loss
from .generic import drop_foreign_sizes, outermost, with_registered_blocks
from .registry import LAYERS, register_adapter, register_layer

__all__ = ["PyGAdapter", "PYG_OPS", "NODES_PER_GRAPH", "EDGES_PER_NODE"]

logger = logging.getLogger(__name__)

NODES_PER_GRAPH = 1000
"""Default nodes of the example graph per unit of ``batch_size`` (``num_nodes = 1000 * batch_size``)."""
EDGES_PER_NODE = 10
"""Default edges of the example graph per node (``num_edges = 10 * num_nodes``)."""

PYG_OPS: dict[str, tuple[str, ...]] = {
    # aggregation of messages into nodes (sum/mean/max/min aggregation and their backward)
    "scatter": ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                "index_add", "index_add_", "index_reduce", "index_reduce_", "index_put", "index_put_",
                "_index_put_impl_", "segment_reduce", "_segment_reduce_backward"),
    # lifting node features to edges (x_j = x[edge_index[0]]) and the backward of scatter
    "gather": ("index_select", "index_select_backward", "gather", "index", "take_along_dim"),
    # sparse-adjacency message passing (adj_t @ x with torch.sparse / CSR, with or without a reduction)
    "spmm": ("_sparse_mm", "_sparse_addmm", "_sparse_sparse_matmul", "sparse_sampled_addmm", "_sparse_mm_reduce_impl",
             "_sparse_mm_reduce_impl_backward", "hspmm", "smm", "_sparse_sum", "_sparse_csr_sum"),
}
"""Op category -> aten op names that PyG's message passing runs (observed on CPU for GCN/GAT/SAGE/GIN)."""


def _register_ops() -> None:
    for kind, names in PYG_OPS.items():
        for n in names:
            try:
                register_op(f"aten.{n}", kind=kind, zoo="pyg")
            except ValueError as exc:  # someone registered it under another category first: keep theirs
                logger.debug("not registering aten.%s for PyG: %s", n, exc)


_register_ops()

_layers_registered = False


def _pyg_loaded() -> bool:
    return "torch_geometric" in sys.modules


def _message_passing() -> type | None:
    try:
        from torch_geometric.nn.conv import MessagePassing
    except ImportError:
        return None
    return MessagePassing


def _register_layers() -> None:
    global _layers_registered
    if _layers_registered:
        return
    _layers_registered = True
    mp = _message_passing()
    if mp is not None and mp not in LAYERS:
        register_layer(mp, kind="message_passing", zoo="pyg")
    if mp is not None:
        from ..ops.message_passing import register_message_passing_impl

        register_message_passing_impl()


if _pyg_loaded():
    _register_layers()


def _simple_random_graph(num_nodes: int, num_edges: int, device: torch.device) -> torch.Tensor:
    """``num_edges`` distinct random directed edges without self loops, sorted like a PyG dataset's."""
    keys = torch.empty(0, dtype=torch.long, device=device)
    while keys.numel() < num_edges:  # rejection: duplicates and self loops are rare for sparse graphs
        src = torch.randint(0, num_nodes, (num_edges,), device=device)
        dst = torch.randint(0, num_nodes, (num_edges,), device=device)
        fresh = (src * num_nodes + dst)[src != dst]
        keys = torch.unique(torch.cat([keys, fresh]))
        if keys.numel() >= num_nodes * (num_nodes - 1):
            break
    keys = keys[torch.randperm(keys.numel(), device=device)[:num_edges]].sort().values
    return torch.stack([keys // num_nodes, keys % num_nodes])


def _int_attr(model: nn.Module, *names: str) -> int | None:
    for n in names:
        v = getattr(model, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@register_adapter
class PyGAdapter(Adapter):
    """PyG models: message-passing layers as units, a random graph as example batch, cross-entropy per node.

    >>> from torch_geometric.nn.models import GCN
    >>> model = GCN(in_channels=16, hidden_channels=32, num_layers=3, out_channels=4)
    >>> [u.name for u in PyGAdapter().units(model)]
    ['convs.0', 'convs.1', 'convs.2']
    """

    name = "pyg"
    priority = 25

    def matches(self, model: nn.Module) -> bool:
        if not _pyg_loaded():
            return False
        _register_layers()
        mp = _message_passing()
        return mp is not None and any(isinstance(m, mp) for m in model.modules())

    def units(self, model: nn.Module) -> list[Unit]:
        _register_layers()
        mp = _message_passing()
        found = [(n, m) for n, m in model.named_modules() if mp is not None and isinstance(m, mp)]
        return with_registered_blocks(model, [Unit(n, m) for n, m in outermost(found)])

    def sub_batch(self, batch: Batch, n: int) -> Batch:
        """PyG batches are graphs: their nodes are not independent samples (edges index them), and a subgraph's
        edges do not shrink in proportion to its nodes, so a step cannot be planned from smaller ones."""
        raise ValueError(
            "zoomem cannot plan a PyG graph batch from smaller ones (trace_batch_size): its nodes are not "
            "independent samples. Plan at the real graph (trace_batch_size=None), or plan on a neighbour-sampled "
            "mini-batch of the same size (torch_geometric.loader.NeighborLoader)."
        )

    def example_batch(
        self,
        model: nn.Module,
        batch_size: int,
        num_nodes: int | None = None,
        num_edges: int | None = None,
        **sizes: Any,
    ) -> Batch:
        """One random graph for node classification.

        Args:
            model: a PyG model with integer ``in_channels`` (and ``out_channels`` or ``hidden_channels``), as the
                ``torch_geometric.nn.models`` GNNs and the conv layers have.
            batch_size: scales the default graph: ``num_nodes = 1000 * batch_size``.
            num_nodes: nodes of the graph (overrides the default).
            num_edges: distinct directed edges without self-loops, drawn uniformly at random;
                default ``10 * num_nodes``.

        Returns:
            ``Batch(args=(x, edge_index), target=y)``.

        Shapes:
            x: ``(num_nodes, in_channels)`` float; edge_index: ``(2, num_edges)`` int64;
            y: ``(num_nodes,)`` int64 in ``[0, out_channels)``.

        Raises:
            NotImplementedError: the model's channel counts cannot be read (lazy ``in_channels=-1``, bipartite).
        """
        drop_foreign_sizes(self.name, sizes, ("num_nodes", "num_edges"))
        in_channels = _int_attr(model, "in_channels")
        out_channels = _int_attr(model, "out_channels", "hidden_channels")
        if in_channels is None or out_channels is None:
            raise NotImplementedError(
                f"The 'pyg' adapter cannot read integer in_channels/out_channels from {type(model).__name__}: pass "
                "a real batch (a torch_geometric Data object, or a tuple (x, edge_index))."
            )
        n = int(num_nodes) if num_nodes is not None else NODES_PER_GRAPH * int(batch_size)
        e = int(num_edges) if num_edges is not None else EDGES_PER_NODE * n
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        x = torch.randn(n, in_channels, device=device, dtype=dtype)
        edge_index = _simple_random_graph(n, e, device)
        y = torch.randint(0, out_channels, (n,), device=device)
        return Batch(args=(x, edge_index), target=y)

    def loss(self, model: nn.Module, batch: Batch, output: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor) and isinstance(batch.target, torch.Tensor) \
                and not batch.target.is_floating_point() and output.dim() == 2:
            return nn.functional.cross_entropy(output.float(), batch.target)
        return default_loss(output, batch.target)
