"""Training forwards whose backward has not run yet: how many a step runs before its backward.

A contrastive step runs the model on two views and differentiates one loss of both; a GAN's discriminator step
runs it on the real and the fake batch; a siamese or triplet loss, R-Drop and SimCSE run it twice or three times.
Every forward's saved tensors stay until that backward, so a plan made for one forward would let the step peak
above the budget by what the others hold. Each training forward is tracked from its outputs' autograd nodes: it
is in flight until backward reaches one of them (a pre-hook) or its graph is freed unused (a token in the nodes'
``metadata``, finalized with them: an output dropped without backward).
"""

from __future__ import annotations

import weakref
from typing import Any

from .capture import output_leaves

__all__ = ["InFlight"]


class _Forward:
    """One tracked forward: in flight until backward reaches its outputs or their nodes are freed."""

    __slots__ = ("live", "done", "left_bytes", "forwards")

    def __init__(self, left_bytes: int, forwards: int) -> None:
        self.live, self.done, self.left_bytes, self.forwards = 0, False, left_bytes, forwards

    def freed(self) -> None:
        self.live -= 1
        if self.live <= 0:
            self.done = True

    def reached(self, grad_outputs: Any) -> None:  # a node pre-hook: returns None, the gradients pass unchanged
        self.done = True


class _Token:
    """What a node's ``metadata`` holds: finalized when the node is freed."""

    __slots__ = ("__weakref__",)


class InFlight:
    """The training forwards of one wrapped model whose backward has not run (:meth:`count`)."""

    def __init__(self) -> None:
        self.forwards: list[_Forward] = []

    def count(self) -> int:
        """Forwards tracked whose graph is alive and not yet differentiated."""
        self.forwards = [f for f in self.forwards if not f.done]
        return len(self.forwards)

    def held_bytes(self, forwards: int) -> int:
        """What the forwards in flight that ran plans for ``forwards`` forwards a step hold, as their plans predict
        (:attr:`~zoomem.planner.Plan.left_bytes`; a forward that ran a plan for fewer, before zoomem saw the step's
        count, is left out: plans leave room for what their own step's forwards leave)."""
        self.count()
        return sum(f.left_bytes for f in self.forwards if f.forwards == forwards)

    def track(self, output: Any, left_bytes: int = 0, forwards: int = 1) -> None:
        """Track the forward that returned ``output``, whose plan, made for ``forwards`` forwards a step, predicts
        it leaves ``left_bytes`` for its backward (nothing to track where no output tensor has a graph)."""
        nodes = {id(n): n for n in (t.grad_fn for t in output_leaves(output)) if n is not None}
        if not nodes:
            return
        forward = _Forward(left_bytes, forwards)
        for node in nodes.values():
            token = _Token()
            node.metadata.setdefault("zoomem_in_flight", []).append(token)
            weakref.finalize(token, forward.freed)
            node.register_prehook(forward.reached)
            forward.live += 1
        self.forwards.append(forward)
