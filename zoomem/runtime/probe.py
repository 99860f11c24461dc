"""One recorded step: which tensors a forward saves, under which keys, and each one's sensitivity.

The probe runs the model's forward with a recording :class:`~.storage.SavedTensorStore` (unit regions marked by
forward hooks on the units, so it needs no wrapper), then :func:`~zoomem.compress.estimate_sensitivity`. It
leaves no trace: RNG streams (CPU and the model's accelerator), buffers (BatchNorm statistics) and ``.grad`` are
as before. In a data-parallel run every rank gets the mean of the ranks' sensitivities, so all ranks pick the
same bits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..adapters import Unit
from ..adapters.base import MEAN_LOSS_BYTES, default_loss
from ..autograd_graph import autograd_nodes
from ..batch import Batch
from ..compress.quantize import GROUP_SIZE, row_dims, row_group
from ..compress.sensitivity import estimate_sensitivity
from ..ops.attention import differentiable_attention
from ..ops.functional import differentiable_hardsigmoid, norms_at_saved_statistics, separate_masks
from ..ops.loss import cross_entropy, sensitivity_pass
from ..planner.compression import SavedInfo, duplicate_of, floor_sensitivities
from ..state import restore_buffers
from .capture import output_grad_loss, output_leaves
from .distributed import all_reduce_mean, rank_mean, world_size
from .storage import SavedTensorStore, _anchor, _tensors

__all__ = ["probe_saved", "held_by_caller", "liveness", "EXACT_READS"]

logger = logging.getLogger(__name__)

_COMPARISONS = (
    "ReluBackward0", "ThresholdBackward0", "LeakyReluBackward0", "HardtanhBackward0", "EluBackward0",
    "AbsBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0", "HardswishBackward0",
    "HardsigmoidBackward0", "MaximumBackward0", "MinimumBackward0", "RreluWithNoiseBackward0",
    "SoftshrinkBackward0", "HardshrinkBackward0", "ScatterReduceBackward0", "AmaxBackward0", "AminBackward0",
    "MaxBackward0", "MaxBackward1", "MinBackward0", "MinBackward1",
)
_RECIPROCALS = ("LogBackward0", "Log1pBackward0", "SqrtBackward0", "PowBackward0", "PowBackward1",
                "PowBackward2")
_EXPONENTIALS = ("LogSoftmaxBackward0", "LogsumexpBackward0")
_ATTENTION_SCORES = ("_saved_query", "_saved_key", "_saved_logsumexp", "_saved_log_sumexp", "_saved_attn_mask",
                     "_saved_attn_bias")
EXACT_READS: dict[str, tuple[str, ...] | None] = {
    **{name: None for name in _COMPARISONS + _RECIPROCALS + _EXPONENTIALS},
    "DivBackward0": ("_saved_other",),
    **{f"ScaledDotProduct{kernel}Backward0": _ATTENTION_SCORES
       for kernel in ("FlashAttention", "EfficientAttention", "CudnnAttention")},
    "ScaledDotProductFlashAttentionForCpuBackward0": ("_saved_logsumexp", "_saved_attn_mask"),
}
"""Autograd nodes (and which of their saved tensors; ``None``: all) whose backward reads a saved value through a
comparison (a ReLU's mask from its output), a reciprocal (a softmax denominator) or an exponential (log-softmax's
backward is ``g - exp(out) * sum(g)``: rounding a log-probability by a fraction of its group's range, several
units over a vocabulary, multiplies the softmax by up to ``e`` to that, and not unbiasedly; fused attention's backward
rebuilds its probabilities as ``exp(q @ k.T * scale + mask - logsumexp)`` from the saved query, key, mask and
log-sum-exp, so rounding q or k against the exact log-sum-exp makes rows that no longer sum to one: DeiT-Tiny with
its qkv weights scaled 3x, as sharp as trained attention, had a 2-bit squared gradient error 61,862 times the squared
gradient norm against a bound of 3.3 in
``tests/test_compression.py::test_what_a_backward_reads_nonlinearly_is_stored_as_it_is_read`` on ``aa0ff16``): there
rounding is not a small perturbation, a first-order sensitivity cannot see it, so these tensors stay exact (the
value and output enter those backwards linearly and may be lossy). The CPU kernel's query and key may be lossy after
all (:data:`LSE_READS`): its log-sum-exp then comes back recomputed from their stored forms."""

LSE_READS: dict[str, Callable[[Any], tuple[Any, ...]]] = {
    "ScaledDotProductFlashAttentionForCpuBackward0": lambda node: (
        node._saved_query, node._saved_key, node._saved_attn_mask, node._saved_logsumexp, node._saved_scale,
        node._saved_is_causal),
}
"""Fused attention nodes whose saved log-sum-exp the store may recompute from the stored query and key
(:func:`zoomem.ops.attention.attention_logsumexp`): (query, key, mask, log-sum-exp, scale, is_causal). Then the
backward's probabilities are a softmax of slightly moved scores, which a first-order sensitivity describes, and q and
k may be lossy. zoomem's own Functions declare theirs as ``lse_of`` (indices in ``saved_tensors`` of query, key,
mask or ``None``, log-sum-exp; ``scale`` and ``is_causal`` attributes). The CUDA kernels' log-sum-exp layouts
differ (padded rows), untested here: their q and k stay exact."""

EXP_MIN_BITS = 4
"""The narrowest width for a query or key whose log-sum-exp is recomputed (:attr:`SavedInfo.min_bits`): rounding
moves the scores, and the probabilities by ``exp`` of that, further than a first-order sensitivity sees at 2 bits.
``tests/test_compression.py::test_what_a_backward_reads_nonlinearly_is_stored_as_it_is_read`` (DeiT-Tiny with its
qkv weights scaled 3x, as sharp as trained attention, 64 px, ``L1.2``) fails with q and k in 2 bits (this set to
1): a squared gradient error 6.0 times the squared gradient norm where the plan predicted 0.94."""

def _mean_of_squares(node: Any) -> list[tuple[torch.Tensor, int]]:
    """``x.pow(2).mean(-1, keepdim=True)`` over trailing dimensions, as HF's RMSNorms (Llama, Mistral, Qwen2, Gemma,
    T5) compose it: ``x`` is then normalised by its rows' root mean square, and saved for that (and by the power)."""
    below = node.next_functions[0][0] if node.next_functions else None
    name = type(below).__name__
    if name == "PowBackward0" and getattr(below, "_saved_exponent", None) == 2:
        x = below._saved_self
    elif name == "MulBackward0" and below._saved_self is not None and below._saved_other is not None \
            and below._saved_self.data_ptr() == below._saved_other.data_ptr():  # x * x
        x = below._saved_self
    else:
        return []
    sizes = node._saved_self_sym_sizes
    dims = sorted({(d - (1 << 64) if d >= 1 << 63 else d) % len(sizes) for d in node._saved_dim})
    if not dims or dims != list(range(len(sizes) - len(dims), len(sizes))):  # not the trailing dimensions
        return []
    return [(x, math.prod(sizes[d] for d in dims))]


ROW_READS: dict[str, Callable[[Any], list[tuple[torch.Tensor, int]]]] = {
    "NativeLayerNormBackward0": lambda node: [(node._saved_input, math.prod(node._saved_normalized_shape))],
    "MeanBackward1": _mean_of_squares,
}
"""Autograd nodes whose backward reads a saved tensor in rows, each normalised by its own spread (a layer norm's
input, read as ``(x - mean) * rstd``, its backward quadratic in that; a composed RMSNorm's, found at the mean of its
squares): [(the tensor, the row's length)]. That tensor is quantized in groups that follow the rows
(:func:`zoomem.compress.quantize.row_group`), or stays exact where no group size fits. zoomem's own Functions
declare theirs as ``norm_rows`` (index in ``saved_tensors``, row)."""


_EXACT_UNLESS: dict[str, Callable[[Any], bool]] = {
    # x ** e with e >= 1 (GPT-2's GELU cubes its input) has the bounded derivative e * x ** (e - 1): no reciprocal
    "PowBackward0": lambda node: isinstance(getattr(node, "_saved_exponent", None), (int, float))
    and node._saved_exponent >= 1,
}
"""Nodes of :data:`EXACT_READS` whose saved tensors may be lossy after all when the predicate holds."""


def _mark_exact_reads(root: torch.Tensor, store: SavedTensorStore) -> int:
    """Store each saved tensor as its backward reads it: never lossy where an :data:`EXACT_READS` backward reads it
    (returns how many), in groups that follow rows where a :data:`ROW_READS` one does, and a fused attention's
    log-sum-exp recomputed from its stored query and key (:data:`LSE_READS`); and number the nodes that hold saved
    tensors (:attr:`SavedInfo.node`). A tensor read through a duplicate save counts as its base."""
    def ident(t: torch.Tensor) -> tuple:  # type: ignore[type-arg]  (unpacking makes new objects: match storage)
        return (t.data_ptr(), tuple(t.shape), t.stride()) if t.layout == torch.strided else (id(t),)

    own_id = {ident(t): key for key, t in store.tensors.items()}
    for key, t in store.duplicates.items():
        own_id.setdefault(ident(t), key)
    by_id = {i: _base_key(store.infos, key) for i, key in own_id.items()}  # what is read through a duplicate save
    marked = 0
    for number, node in enumerate(autograd_nodes(root.grad_fn), 1):
        _number_node(node, number, own_id, store, ident)
        name = type(node).__name__
        rows = [(node.saved_tensors[i], row) for i, row in getattr(node, "norm_rows", ())]
        if name in ROW_READS:
            rows += ROW_READS[name](node)
        for t, row in rows:
            key = by_id.get(ident(t))
            if key is not None and store.infos[key].lossy is None:
                marked += _group_rows(store.infos[key], row, name)
        lse = LSE_READS[name](node) if name in LSE_READS else None
        if getattr(node, "lse_of", None) is not None:
            q, k, mask, lse_i = node.lse_of
            tensors = node.saved_tensors
            lse = (tensors[q], tensors[k], None if mask is None else tensors[mask], tensors[lse_i], node.scale,
                   node.is_causal)
        if lse is not None:
            keys = [None if t is None else own_id.get(ident(t)) for t in lse[:4]]  # the store finds them by these
            marked += _recompute_lse(store.infos, keys, lse[2] is not None, lse[4], lse[5], name)
        own = getattr(node, "exact_reads", None)  # zoomem's own Functions declare theirs (indices of saved_tensors)
        if own:
            tensors = node.saved_tensors
            for i in own:
                key = by_id.get(ident(tensors[i]))
                if key is not None and store.infos[key].lossy is None:
                    store.infos[key].lossy = f"read through a comparison or exponential ({name})"
                    marked += 1
            continue
        if name not in EXACT_READS or (name in _EXACT_UNLESS and _EXACT_UNLESS[name](node)):
            continue
        attrs = EXACT_READS[name]
        for attr in dir(node) if attrs is None else attrs:
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr, None)
            key = by_id.get(ident(value)) if isinstance(value, torch.Tensor) else None
            if key is not None and store.infos[key].lossy is None:
                store.infos[key].lossy = f"read through a comparison, reciprocal or exponential ({name})"
                marked += 1
    return marked


def _group_rows(info: SavedInfo, row: int, name: str) -> int:
    """Make ``info`` quantized in groups that follow rows of ``row`` elements (and those of any other such read of
    it), or exact where no group size fits (returns 1 then)."""
    group = row_group(row)
    if group is not None and info.group != GROUP_SIZE:  # read in rows by another node too: groups that fit both
        group = row_group(math.gcd(group, info.group))
    if group is None:
        info.lossy = f"read in rows of {row} by {name}, and no quantization group follows them"
        return 1
    info.group = group
    info.row_dims += (row_dims(info.shape, row),)
    return 0


def _recompute_lse(infos: dict[str, SavedInfo], keys: list[str | None], has_mask: bool, scale: float | None,
                   is_causal: bool, name: str) -> int:
    """Let the log-sum-exp (``keys``: query, key, mask, log-sum-exp) come back recomputed from the stored query and
    key (:attr:`SavedInfo.lse_of`), so those may be lossy; where the store could not (a tensor it never saw, or the
    log-sum-exp saved before the query and key: it needs their stored forms), they stay exact (returns how many
    that marks)."""
    q, k, mask, lse = keys

    def index(key: str) -> int:
        return int(key.rsplit("#", 1)[1])

    if q is not None and k is not None and lse is not None and (mask is not None or not has_mask) \
            and index(lse) > max(index(q), index(k)):
        infos[lse].lse_of = {"query": q, "key": k, "mask": mask, "scale": scale, "causal": bool(is_causal)}
        for key in (q, k):
            base = _base_key(infos, key)
            infos[base].min_bits = max(infos[base].min_bits, EXP_MIN_BITS)
        return 0
    marked = 0
    for key in (_base_key(infos, key) for key in (q, k) if key is not None):
        if infos[key].lossy is None:
            infos[key].lossy = f"read through an exponential ({name}), its log-sum-exp not recomputable"
            marked += 1
    return marked


def _aliases(store: SavedTensorStore) -> dict[str, list[torch.Tensor]]:
    """Lossy-eligible key -> the other objects saved as views of its stored memory, each with its own autograd node:
    the 2-D views of one input that query, key and value projections each make, HF's LM-head loss's alias of the
    hidden states the head's 2-D view holds, a tensor saved beside a view of it (a transpose, a reshape). Rounding
    the stored tensor moves their uses too, so its sensitivity sums their gradients element by element
    (:func:`~zoomem.compress.estimate_sensitivity`, which stops what reaches any forward node, so none of them counts
    through another)."""
    out: dict[str, list[torch.Tensor]] = {}
    dups = [*store.duplicates.items(), *((k, t) for k, t in store.tensors.items()
                                        if duplicate_of(store.infos[k].lossy) is not None)]
    for key, t in dups:
        base = _base_key(store.infos, key)
        first = store.tensors.get(base)
        if first is not None and t is not first and store.infos[base].lossy is None:
            out.setdefault(base, []).append(t)
    return out


def _base_key(infos: dict[str, SavedInfo], key: str) -> str:
    """The key whose storage a duplicate save (:class:`~.storage.SavedTensorStore`) shares."""
    return duplicate_of(infos[key].lossy) or key


def _keep_memories_whole(infos: dict[str, SavedInfo]) -> None:
    """Parts of one memory (:attr:`SavedInfo.shares`: timm's q, k and v of one ``qkv`` output) may be lossy only all
    together: where one stays exact it holds the whole memory, so storing another lossily frees nothing, costs time
    and adds noise."""
    changed = True
    while changed:
        changed = False
        for info in infos.values():
            group = [info, *(infos[k] for k in info.shares)]
            exact = next((g for g in group if g.lossy is not None), None)
            for g in group if exact is not None else ():
                if g.lossy is None:
                    g.lossy = f"part of the memory of {exact.key}, which stays exact"
                    changed = True


def _number_node(node: Any, number: int, by_id: dict, store: SavedTensorStore,  # type: ignore[type-arg]
                 ident: Callable[[torch.Tensor], tuple]) -> None:  # type: ignore[type-arg]
    """Record ``number`` as the node of every saved tensor ``node`` holds: its backward unpacks them together, so
    the planner counts their dequantized copies at once."""
    try:
        if hasattr(node, "saved_tensors") and not any(a.startswith("_saved_") for a in dir(node)):
            tensors = list(node.saved_tensors)  # a custom Function's
        else:
            tensors = [getattr(node, a, None) for a in dir(node) if a.startswith("_saved_")]
    except RuntimeError:  # freed, or not unpackable here: no grouping for it
        return
    for t in tensors:
        key = by_id.get(ident(t)) if isinstance(t, torch.Tensor) else None
        if key is not None and store.infos[key].node < 0:
            store.infos[key].node = number


@contextlib.contextmanager
def _regions(store: SavedTensorStore, units: list[Unit]) -> Iterator[None]:
    stack: list[contextlib.ExitStack] = []

    def pre(name: str) -> Callable:  # type: ignore[type-arg]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:  # type: ignore[type-arg]
            es = contextlib.ExitStack()
            es.enter_context(store.unit(name, args, kwargs))
            stack.append(es)

        return hook

    def post(name: str) -> Callable:  # type: ignore[type-arg]
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if stack:
                stack.pop().close()
            store.unit_returned(name, output)

        return hook

    handles = []
    for u in units:
        handles.append(u.module.register_forward_pre_hook(pre(u.name), with_kwargs=True))
        handles.append(u.module.register_forward_hook(post(u.name), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def held_by_caller(model: nn.Module, batch: Batch, units: list[Unit]) -> dict[tuple[str, int], str]:
    """(unit, index of its tensor argument) -> the last region (a unit, ``"<after:unit>"``) of the forward during
    which the model's own code still holds that argument's memory, for the arguments held past their own unit
    (:func:`liveness`)."""
    return liveness(model, batch, units)[0]


def liveness(model: nn.Module, batch: Batch, units: list[Unit]
             ) -> tuple[dict[tuple[str, int], str], dict[str, str]]:
    """What the model's own code holds, seen in one forward that saves nothing for backward (its pack hook keeps
    nothing, so only the model's code and the ops running hold tensors; an allocation trace cannot see a Python
    reference). The weak references are to each memory's owner (:func:`~.storage._anchor`): a view dies with the
    op that made it, its base does not. Returns:

    - (unit, index of its tensor argument) -> the last region (a unit, ``"<after:unit>"``) during which that
      argument's memory is still held, for the arguments held past their own unit. A unit input usually dies once
      the next unit has it (HF's layer loops rebind one name), so packing what the unit saved of it frees memory
      while later units run. Some forwards keep it in a local: HF's ``BertModel`` holds the embedding output until
      it returns, and a caller of ``nn.Sequential`` (timm's ViT blocks, ResNet stages) the first block's input
      until the last block returns.
    - saved tensor key (as :class:`~.storage.SavedTensorStore` names it) -> the key of the first later save in the
      same region by which its memory is free (:attr:`~zoomem.planner.compression.SavedInfo.dead_at`). The forward
      runs the compact forms as the store runs them (:func:`~zoomem.ops.functional.separate_masks`), so its saves
      are the recording's, key for key."""
    alive: dict[tuple[str, int], weakref.ref] = {}  # type: ignore[type-arg]
    held: dict[tuple[str, int], str] = {}
    saved: dict[str, weakref.ref] = {}  # type: ignore[type-arg]
    dead_at: dict[str, str] = {}
    counts: dict[str, int] = {}
    region = ["<stem>"]

    def look(key: str | None = None) -> None:
        for arg, ref in list(alive.items()):
            if ref() is None:
                del alive[arg]
            elif arg[0] != region[0]:
                held[arg] = region[0]
        for k, ref in list(saved.items()):
            if ref() is None:
                del saved[k]
                if key is not None and k.rpartition("#")[0] == region[0]:
                    dead_at[k] = key

    def pre(name: str) -> Callable:  # type: ignore[type-arg]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:  # type: ignore[type-arg]
            region[0] = name
            look()
            alive.update(((name, i), weakref.ref(_anchor(t))) for i, t in enumerate(_tensors(args, kwargs)))

        return hook

    def post(name: str) -> Callable:  # type: ignore[type-arg]
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            look()
            region[0] = f"<after:{name}>"

        return hook

    def pack(t: torch.Tensor) -> None:  # keeps nothing: only the model's code holds tensors in this forward
        k = counts[region[0]] = counts.get(region[0], -1) + 1
        key = f"{region[0]}#{k}"
        look(key)
        saved[key] = weakref.ref(_anchor(t))

    def unpack(packed: None) -> torch.Tensor:
        raise RuntimeError("zoomem: the forward that finds tensors held by the model's code saved nothing")

    handles = [h for u in units for h in (u.module.register_forward_pre_hook(pre(u.name), with_kwargs=True),
                                          u.module.register_forward_hook(post(u.name), with_kwargs=True))]
    try:
        with _no_trace(model), torch.enable_grad(), separate_masks(), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = batch.call(model)
            del out
    finally:
        for h in handles:
            h.remove()
    return held, dead_at


@contextlib.contextmanager
def _no_trace(model: nn.Module) -> Iterator[None]:
    """Restore RNG streams and buffers afterwards: the probe must not change the training run."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), restore_buffers(model):
        yield


def sampled_loss(output: Any, generator: torch.Generator | None = None) -> torch.Tensor:
    """What the sensitivity measurement differentiates where the adapter's loss found none and took the mean of the
    outputs (:func:`~zoomem.adapters.base.default_loss`; the target lies outside the forward, as timm's and PyG's
    training loops keep it): the logits (the output, its ``logits``, or its first element; two or more dimensions)
    under cross-entropy against classes drawn from their own softmax over the last dimension, what a training loss
    sends them (in distribution: the Fisher's gradient), and every other floating output under random signs.

    Why: the mean sends every sample the same gradient, which adds up over the batch where a training loss's
    per-sample gradients do not, so the parameter gradient's norm grew against the noise rounding adds, and
    sensitivities relative to it fell with the batch size (ViT-Tiny's small layout at 32 images: plans predicted
    19x less gradient variance than they made; 1.6x at 2 images). The cross-entropy is zoomem's, which keeps the
    logits (under :func:`~zoomem.ops.loss.sensitivity_pass` its second backward holds nothing of their size).
    """
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    total: torch.Tensor | None = None
    for t in output_leaves(output):
        x = t.float()
        probs = torch.softmax(x.detach().reshape(-1, x.shape[-1]), -1) if t is logits and x.dim() >= 2 \
            and x.shape[-1] > 1 else None
        if probs is not None and bool(torch.isfinite(probs).all()):
            drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            del probs
            part = cross_entropy(x.reshape(-1, x.shape[-1]), drawn)
        else:  # not logits, or not finite (their mean then carries the NaN as the stand-in did)
            signs = torch.randint(0, 2, x.shape, dtype=x.dtype, device=x.device, generator=generator).mul_(2).sub_(1)
            part = (x * signs).mean()
        total = part if total is None else total + part
    return total if total is not None else default_loss(output)


def probe_saved(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any, Batch], torch.Tensor],
    units: list[Unit],
    *,
    sensitivity: bool = True,
    samples: int = 1,
    generator: torch.Generator | None = None,
    output_grads: Sequence[torch.Tensor | None] | None = None,
    second_order: bool = True,
) -> tuple[list[SavedInfo], float]:
    """The saved tensors of one training step on ``batch`` with their sensitivities, and ``||g||**2``.

    The forward runs as the model is set up now (the caller switches implementations on as the plan will). Where
    ``loss_fn`` finds no loss (the mean of the outputs), sensitivities follow ``output_grads`` (what a training step's
    own loss sent the outputs of ``batch``, :func:`~.capture.output_grad_loss`), else :func:`sampled_loss`.
    ``second_order=False``: value ranges stand in for sensitivities (no second backward: it did not fit in memory).
    """
    t0 = time.perf_counter()
    held, dead_at = liveness(model, batch, units)
    store = SavedTensorStore(record=True, generator=generator, held=held)
    grad_sq = 0.0
    with _no_trace(model), torch.enable_grad():
        # the CPU flash-attention kernel and hardsigmoid have no double backward, and aten's layer norm's moves its
        # saved statistics with its input: the same kernels and saved tensors, differentiated as a backward from
        # stored tensors runs
        routed = contextlib.ExitStack()
        if sensitivity:
            routed.enter_context(differentiable_attention())
            routed.enter_context(norms_at_saved_statistics())
            routed.enter_context(differentiable_hardsigmoid())
            routed.enter_context(sensitivity_pass())  # the losses' second backward: only what sensitivities follow
        with store.hooks(model, batch.args, batch.kwargs), _regions(store, units), routed:
            out = batch.call(model)
        token = MEAN_LOSS_BYTES.set(0)
        try:
            loss = loss_fn(out, batch)
            if sensitivity and MEAN_LOSS_BYTES.get():  # no loss seen: one with a training loss's gradients
                own = output_grad_loss(out, output_grads) if output_grads is not None else None
                if own is not None:
                    loss = own
                else:
                    if output_grads is not None:
                        logger.info("zoomem: the held output gradient does not match the outputs' shapes: "
                                    "sensitivities measured against a sampled loss")
                    with sensitivity_pass():
                        loss = sampled_loss(out, generator)
        finally:
            MEAN_LOSS_BYTES.reset(token)
        _mark_exact_reads(loss, store)
        _keep_memories_whole(store.infos)
        if sensitivity:
            params = [p for p in model.parameters() if p.requires_grad]
            eligible = {k: t for k, t in store.tensors.items() if store.infos[k].lossy is None}
            result = estimate_sensitivity(loss, params, eligible, samples=samples, generator=generator,
                                          group_sizes={k: store.infos[k].group for k in eligible},
                                          aliases=_aliases(store), second_order=second_order,
                                          mean_over_ranks=rank_mean if world_size() > 1 else None)
            for key, c in all_reduce_mean(result.per_tensor).items():
                store.infos[key].sensitivity = c
                store.infos[key].measured = result.measured
            # data-parallel: the step averages the ranks' gradients, each with its own rounding noise, so the noise
            # is the ranks' mean over the world size, against the averaged gradient's norm
            grad_sq = result.grad_sq * world_size()
            floor_sensitivities(list(store.infos.values()))
        del out, loss
    infos = list(store.infos.values())
    for info in infos:
        info.dead_at = dead_at.get(info.key)
    store.tensors.clear()
    store.duplicates.clear()
    logger.info("zoomem: measured %d saved tensors%s in %.2f s", len(infos),
                " and their sensitivities" if sensitivity else "", time.perf_counter() - t0)
    return infos, grad_sq
