"""Walking the autograd graph behind a tensor: one home for the loop the probe, the sensitivity pass and the fused
LM-head loss each need."""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["autograd_nodes"]


def autograd_nodes(grad_fn: torch.autograd.graph.Node | None) -> Iterator[torch.autograd.graph.Node]:
    """Every node reachable from ``grad_fn`` once, depth first (the same order for the same graph, so nodes can be
    numbered by it), parameters' ``AccumulateGrad`` nodes included."""
    seen: set[int] = set()
    stack = [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
        yield node
