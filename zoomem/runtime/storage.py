"""zoomem's saved-tensor hooks: every tensor autograd saves inside a wrapped forward goes through here.

A :class:`SavedTensorStore` is entered around one forward (``torch.autograd.graph.saved_tensors_hooks``, a
thread-local context, never a process-global hook). Each distinct saved tensor gets a stable key,
``"<region>#<k>"``: the region is the unit the forward is in (or ``<stem>`` / ``<after:unit>`` outside them) and
``k`` counts distinct tensors saved in that region, so the same step with the same input signature names its
tensors the same way every time. What the store does with a tensor depends on its key:

- ``bits[key]`` set and the tensor lossy-eligible: it is quantized (:func:`~zoomem.compress.quantize`, in groups of
  ``groups[key]`` elements where backward reads it in rows, else 256) and dequantized when backward unpacks it; with
  ``offload`` the packed form moves to host memory in between;
- ``lse_of[key]`` set (a fused attention's log-sum-exp) and its query or key stored lossily: it comes back
  recomputed from their stored forms, so the kernel's backward rebuilds probabilities that sum to one;
- otherwise it is kept as is.

The keys assume that one input signature saves the same tensors in the same order every time. A model whose
control flow depends on the batch's values breaks that (an HF model that leaves its attention mask out of a batch
without padding saves one tensor fewer per layer; a mixture of experts skips experts that get no tokens), and
``bits`` would then quantize other tensors than were planned, with groups and exactness worked out for others.
With ``saves`` (what the plan's forward saved under each key, :func:`save_sig`) the store compares every save with
it: at the first difference it goes on with a variant that saved the same so far (:attr:`SavedTensorStore.variants`),
else from there on it stores every tensor exactly (:attr:`SavedTensorStore.diverged` says where) and logs a
warning once per difference. A plan made for larger inputs (dynamic padding's shorter batches run the longest's)
is compared by dtype, rank and no dimension larger (:attr:`SavedTensorStore.smaller`).

A tensor saved twice (a linear's input that is also the previous GELU's output) is stored once: the second save
gets the first one's packed object. So is a view saved beside the contiguous tensor it lies in, in either order
(attention's output, saved transposed by attention and contiguous by the projection after it): the view becomes
a view of that tensor's packed form. Autograd owns the packed objects, so ``retain_graph=True`` and double backward
work. Lossy-eligible means floating, at least ``min_numel`` elements, computed in the forward (not a leaf: not a
parameter, buffer or input) and not a copy or view of a parameter (autocast's fp16 weights); a tensor holding NaN
or Inf stays exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from ..batch import tensors_in
from ..compress.quantize import GROUP_SIZE, Quantized, dequantize, quantize, rows_fit
from ..measure import tensor_nbytes
from ..ops.attention import attention_logsumexp
from ..ops.functional import separate_masks
from ..planner.compression import DUPLICATE, SavedInfo, region_of

__all__ = ["SavedTensorStore", "lossy_reason", "save_sig", "save_sigs", "save_within", "MIN_NUMEL"]

MIN_NUMEL = 4096
"""Tensors smaller than this are never stored lossily: their bytes do not matter and their statistics might."""

_PASS_THROUGH = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
    "TransposeBackward0", "ExpandBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ReshapeAliasBackward0", "CloneBackward0",
})


def lossy_reason(t: torch.Tensor, min_numel: int = MIN_NUMEL, leaves: frozenset[int] | None = None) -> str | None:
    """Why ``t`` must stay exact (``None``: it may be quantized).

    ``leaves``: the storages of the tensors that exist before the forward (parameters, buffers, inputs). A tensor
    without ``grad_fn`` outside them was computed in the forward without gradient (an attention-dropout mask):
    its bytes are the forward's. The probe cannot measure how its rounding moves the gradient (no autograd node
    to hook), so it may be quantized only when every bit width holds it exactly: its values are 0 and one other
    (a dropout mask, 0 or 1/(1-p)). Without ``leaves`` every such tensor counts as a leaf.
    """
    if not t.is_floating_point():
        return "not floating"
    if t.layout != torch.strided:
        return "not dense"
    if t.numel() < min_numel:
        return "tiny"
    node = t.grad_fn
    if node is None:
        if t.requires_grad or leaves is None or _ptr(t) in leaves:
            return "leaf (parameter, buffer or input)"
        if not _zero_or_one_value(t):  # a probe cannot measure its sensitivity (no autograd node to hook)
            return "computed without gradient"
        return None  # a dropout mask: any bit width holds its two values exactly
    for _ in range(4):  # a parameter seen through casts and views (autocast's low-precision weight copies)
        if type(node).__name__ not in _PASS_THROUGH:
            return None
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return None
        node = nxt[0]
        if type(node).__name__ == "AccumulateGrad":
            return "parameter copy"
    return None


@dataclass(eq=False)
class _Packed:
    """What autograd holds for one saved tensor: the tensor itself, or its quantized form."""

    tensor: torch.Tensor | None
    quantized: Quantized | None = None
    device: torch.device | None = None  # where to bring an offloaded form back
    key: str = ""
    store: "SavedTensorStore | None" = None  # recording stores only: perturbs keys on unpack (brute force)
    view_of: "tuple[_Packed, tuple[int, ...], tuple[int, ...], int] | None" = None  # (base, shape, stride, offset)
    lse_of: "tuple[_Packed, _Packed, _Packed | None, float | None, bool] | None" = None
    """A fused attention's log-sum-exp (this tensor): its query, key and mask as packed, scale, is_causal. Where the
    query or key comes back rounded, so does this, recomputed from them (:attr:`SavedInfo.lse_of`)."""
    _recent: "weakref.ref[torch.Tensor] | None" = None  # the last dequantized form, while something holds it

    def lossy(self) -> bool:
        """Whether :meth:`unpack` gives other values than were saved."""
        if self.view_of is not None:
            return self.view_of[0].lossy()
        if self.quantized is not None:
            return True
        return self.store is not None and bool(self.store.perturb.get(self.key))

    def peek(self) -> torch.Tensor:
        """What :meth:`unpack` gives, without dequantizing again while backward still holds the last result."""
        if self.view_of is not None:
            base, shape, stride, offset = self.view_of
            whole = base.peek()
            return whole.as_strided(shape, stride, whole.storage_offset() + offset)
        recent = self._recent() if self._recent is not None else None
        return recent if recent is not None else self.unpack()

    def unpack(self) -> torch.Tensor:
        if self.lse_of is not None and self.tensor is not None:
            q, k, mask, scale, causal = self.lse_of
            if q.lossy() or k.lossy():
                return attention_logsumexp(q.peek(), k.peek(), None if mask is None else mask.peek(), causal, scale,
                                           self.tensor)
            return self.tensor
        if self.view_of is not None:
            base, shape, stride, offset = self.view_of
            whole = base.unpack()  # the tensor itself (at its own storage offset) or a fresh dequantized one
            return whole.as_strided(shape, stride, whole.storage_offset() + offset)
        if self.tensor is not None:
            bits = self.store.perturb.get(self.key) if self.store is not None else None
            if bits:
                group = self.store.groups.get(self.key, GROUP_SIZE)  # type: ignore[union-attr]
                q = quantize(self.tensor, bits, group, generator=self.store.generator)  # type: ignore[union-attr]
                if q is None:
                    return self.tensor
                out = dequantize(q)
                self._recent = weakref.ref(out)
                return out
            return self.tensor
        assert self.quantized is not None
        q = self.quantized
        if self.device is not None and q.codes.device != self.device:
            q = q.to(self.device, non_blocking=True)
        out = dequantize(q)
        self._recent = weakref.ref(out)
        return out


logger = logging.getLogger(__name__)


def save_sig(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    """What a save is compared by (:attr:`SavedTensorStore.saves`): ``"8x64x128 torch.float32"``."""
    return f"{'x'.join(map(str, shape))} {dtype}"


def save_within(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, planned: str) -> bool:
    """Whether a save of ``shape`` and ``dtype`` may be the one a plan for larger inputs saved as ``planned``
    (:func:`save_sig`): the same dtype and rank, no dimension larger.

    >>> save_within((8, 60, 128), torch.float32, "8x64x128 torch.float32"), save_within((480, 128), torch.float32,
    ...     "8x64x128 torch.float32")
    (True, False)
    """
    dims, _, planned_dtype = planned.partition(" ")
    if planned_dtype != str(dtype):
        return False
    want = tuple(int(d) for d in dims.split("x")) if dims else ()
    return len(want) == len(shape) and all(a <= b for a, b in zip(shape, want))


def save_sigs(infos: Any) -> dict[str, str]:
    """:attr:`~zoomem.planner.Plan.saves` of a plan made from ``infos`` (the probe's :class:`SavedInfo` list)."""
    return {i.key: save_sig(i.shape, i.dtype) for i in infos}


_WARNED: set[str] = set()


@dataclass
class SavedTensorStore:
    """The per-forward saved-tensor policy (see the module docstring).

    Args:
        bits: key -> bits (1, 2, 4, 8) for tensors to quantize; a missing key is kept exact.
        groups: key -> elements per quantization group, where not the default (:attr:`SavedInfo.group`).
        lse_of: key of a fused attention's log-sum-exp -> what it is recomputed from (:attr:`SavedInfo.lse_of`).
        offload: move quantized forms to host memory until backward needs them.
        generator: the stochastic-rounding noise source (zoomem's own: the user's RNG stream is untouched).
        record: fill :attr:`infos` (and keep the tensors in :attr:`tensors`, for the sensitivity estimator).
        saves: key -> what the plan's forward saved under it (:func:`save_sig`); empty: no comparison.
    """

    bits: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, int] = field(default_factory=dict)
    lse_of: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    offload: bool = False
    generator: torch.Generator | None = None
    record: bool = False
    min_numel: int = MIN_NUMEL
    perturb: dict[str, int] = field(default_factory=dict)
    """With ``record``: keys quantized afresh each time backward unpacks them (for brute-force variance)."""
    infos: dict[str, SavedInfo] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    duplicates: dict[str, torch.Tensor] = field(default_factory=dict)
    """With ``record``: the objects saved under keys stored as another's (:attr:`SavedInfo.lossy` ``"duplicate of
    ..."``: the 2-D views of one input that a layer's query, key and value projections each make and save). What
    backward reads through them is what the stored tensor holds (:func:`zoomem.runtime.probe.probe_saved`)."""
    packed_nbytes: int = 0
    """Bytes the quantized forms of the last forward held."""
    saves: Mapping[str, str] = field(default_factory=dict)
    """Compared in the regions holding keys of :attr:`bits` only: elsewhere nothing is looked up by key, and a
    unit storing nothing lossily runs its compact forms as without the store, saving other tensors than the
    plan's probe (which records every unit as storing lossily) saw."""
    smaller: bool = False
    """The plan was made for larger inputs (the same inputs and dtypes, no dimension smaller: dynamic padding's
    longer batch): a save matches :attr:`saves` where its dtype and rank are the planned ones and no dimension is
    larger (:func:`save_within`), and a tensor grouped by rows is stored exactly where the groups no longer divide
    them (:attr:`row_dims`)."""
    unchecked: frozenset[str] = frozenset()
    """Regions whose saves are not compared with :attr:`saves`: units the plan recomputes, whose forward saves what
    recomputation needs where the plan's probe (every unit kept) saw the unit's own tensors. Keys count per region,
    so those saves name nothing in the other regions."""
    row_dims: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """With :attr:`smaller`: for the keys of :attr:`groups`, the trailing dimensions each row read spans
    (:attr:`~zoomem.planner.Plan.row_dims`)."""
    variants: list[dict[str, Mapping[str, Any]]] = field(default_factory=list)
    """Other plans for the same input signature, made on batches whose forward saved other tensors: each a dict of
    ``saves``, ``bits``, ``groups`` and ``lse_of``. At the first save that differs from :attr:`saves`, the store
    takes the first variant whose saves match every save so far and this one, and goes on with its bits."""
    diverged: tuple[str, str, str] | None = None
    """The first save of the last forward that differed from :attr:`saves`: its key, what was saved and what the
    plan saved there (from there on that forward stored every tensor exactly); None if none did."""
    _region: str = "<stem>"
    _counts: dict[str, int] = field(default_factory=dict)
    _seen: dict[tuple, tuple[weakref.ref, weakref.ref, str]] = field(default_factory=dict)
    _by_key: dict[str, weakref.ref] = field(default_factory=dict)
    _bases: dict[tuple, list[tuple[weakref.ref, weakref.ref, int, int]]] = field(default_factory=dict)
    _loose: dict[tuple, list[tuple[weakref.ref, weakref.ref, int, int, tuple, tuple]]] = field(default_factory=dict)
    held: Mapping[tuple[str, int], str] = field(default_factory=dict)
    """With ``record``: (unit, index of its tensor argument) -> the last region during which the model's own code
    still holds that memory (:func:`zoomem.runtime.probe.held_by_caller`); the tensors saved in it get
    :attr:`SavedInfo.held_through`."""
    _input_ptrs: dict[int, list[str]] = field(default_factory=dict)
    _held_ptrs: dict[int, str] = field(default_factory=dict)
    _unit_args: frozenset[int] = frozenset()
    _leaves: frozenset[int] | None = None
    _lossy_regions: frozenset[str] = frozenset()
    _history: list[tuple[str, str]] = field(default_factory=list)

    # ------------------------------------------------------------------ regions
    @contextlib.contextmanager
    def unit(self, name: str, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> Iterator[None]:
        """Mark the forward of unit ``name``: tensors saved inside belong to its region."""
        if self.record:  # saved tensors sharing storage with a unit's input: a checkpoint of it would hold them
            self._unit_args = frozenset(_ptr(t) for t in _tensors(args, kwargs or {}))
            for index, t in enumerate(_tensors(args, kwargs or {})):
                ptr, until = _ptr(t), self.held.get((name, index))
                if until is not None:  # the tensors saved in it so far, and (in _pack) those saved later
                    self._held_ptrs[ptr] = until
                for key in self._input_ptrs.get(ptr, ()):
                    info = self.infos[key]
                    if info.region != name and name not in info.input_of:
                        info.input_of += (name,)
                    if until is not None:
                        info.held_through = until
        self._region = name
        # its compact forms save what rounding perturbs little only where it stores some tensor lossily; elsewhere
        # they run as without the store (the plan counts them so): no recording, and no bits for this unit's tensors
        try:
            with separate_masks(self.record or name in self._lossy_regions):
                yield
        finally:
            self._region = f"<after:{name}>"

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module | None = None, args: tuple = (),
              kwargs: Mapping[str, Any] | None = None) -> Iterator["SavedTensorStore"]:
        """Enter the hooks for one forward of ``model`` on ``args``/``kwargs`` (which tell what already exists
        before the forward: see :func:`lossy_reason`). On exit the store lets go of every packed object (autograd
        owns them) so nothing outlives the backward that needs it."""
        self._region, self._counts, self._seen, self._input_ptrs, self._held_ptrs = "<stem>", {}, {}, {}, {}
        self._by_key = {}
        self.diverged, self._history = None, []
        self._lossy_regions = frozenset(map(region_of, self.bits))
        self._bases, self._loose, self._unit_args = {}, {}, frozenset()
        self._leaves = None if model is None else frozenset(
            _ptr(t) for t in (*model.parameters(), *model.buffers(), *_tensors(args, kwargs or {})))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), separate_masks():
                yield self
        finally:
            packed = [ref() for _, ref, _ in self._seen.values()]
            self.packed_nbytes = sum(p.quantized.nbytes for p in packed if p is not None and p.quantized is not None)
            self._seen, self._input_ptrs, self._bases, self._loose, self._held_ptrs = {}, {}, {}, {}, {}
            self._by_key = {}
            if not self.record:
                self.tensors, self.duplicates = {}, {}
            if self.diverged is not None:
                _warn_diverged(*self.diverged, smaller=self.smaller)

    def unit_returned(self, name: str, output: Any) -> None:
        """Recording: mark the tensors unit ``name`` saved that are (views of) what it returns. Packing them frees
        nothing while the forward after the unit runs: the caller holds the output whole."""
        if not self.record:
            return
        for t in _tensors((output,), {}):
            for key in self._input_ptrs.get(_ptr(t), ()):
                if self.infos[key].region == name:
                    self.infos[key].unit_output = True

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> _Packed:
        strided = t.layout == torch.strided
        ident = (_ptr(t), t.storage_offset() if strided else 0, tuple(t.shape), t.stride() if strided else (),
                 t.dtype, t.device)
        # every save gets a key, duplicates included: a key must not depend on whether another region (a unit
        # that may be recomputed) saved the same tensor first
        region = self._region
        k = self._counts.get(region, 0)
        self._counts[region] = k + 1
        key = f"{region}#{k}"
        if (self.saves and self.diverged is None and not self.record and region in self._lossy_regions
                and region not in self.unchecked):  # (only where the plan stores tensors lossily: see saves)
            want = self.saves.get(key, "nothing")
            if self.smaller:  # (no variants then: the text of the save only for the warning)
                if not save_within(t.shape, t.dtype, want):
                    self.diverged = (key, save_sig(t.shape, t.dtype), want)
            else:
                got = save_sig(t.shape, t.dtype)
                if got != want and not self._take_variant(key, got):
                    self.diverged = (key, got, want)
                if self.variants:
                    self._history.append((key, got))
        hit = self._seen.get(ident)
        anchor = _anchor(t)
        earlier = hit[1]() if hit is not None and hit[0]() is anchor else None
        view = None if earlier is not None or not strided else self._view_of_packed(t)
        if earlier is not None or view is not None:  # the same tensor, or a view (a transpose) of one: stored once
            if self.record:
                base = hit[2] if earlier is not None else view.view_of[0].key  # type: ignore[union-attr,index]
                self.infos[key] = SavedInfo(key, region, tuple(t.shape), t.dtype, 0, f"{DUPLICATE}{base}")
                self.duplicates[key] = t
            same = earlier if earlier is not None else view
            if self.lse_of or self.variants:  # what a log-sum-exp is recomputed from is found by key
                self._by_key[key] = weakref.ref(same)  # type: ignore[arg-type]
            return same  # type: ignore[return-value]
        # the data only: autograd re-attaches the saved tensor's grad_fn on unpack, and a packed object holding
        # ``t`` itself closes a cycle through C++ (node -> saved -> t -> node) that Python's collector cannot see:
        # a graph never backpropagated (an exception, a forward without backward) would then leak. A constant (no
        # grad_fn, no gradient) closes no cycle and is held as itself, as autograd without hooks holds it: code
        # that keeps weak references to what it saved (a GNN's shared adjacency) sees it alive until backward
        data = t if t.grad_fn is None and not t.requires_grad else t.detach()
        packed = _Packed(data, key=key, store=self) if self.record else _Packed(data)
        bits = self.bits.get(key) if self.diverged is None else None
        reason = lossy_reason(t, self.min_numel, self._leaves) if (bits or self.record) else "not asked"
        group = self.groups.get(key, GROUP_SIZE)
        if bits and reason is None and self.smaller and key in self.groups \
                and not rows_fit(t.shape, self.row_dims.get(key, ()), group):
            reason = f"its rows no longer follow groups of {group} at this shape"
        if bits and reason is None:
            q = quantize(t, bits, group, generator=self.generator)
            if q is not None:
                if self.offload and t.device.type != "cpu":
                    q, packed.device = q.to("cpu", non_blocking=True), t.device
                packed = _Packed(None, q, packed.device)
        if self.record:
            part = strided and tensor_nbytes(t) < t.untyped_storage().nbytes()  # recording holds each saved tensor
            shares = tuple(k for k in self._input_ptrs.get(_ptr(t), ()) if part and 0 < self.infos[k].nbytes
                           and tensor_nbytes(self.tensors[k]) < t.untyped_storage().nbytes())
            self.infos[key] = SavedInfo(key, region, tuple(t.shape), t.dtype, tensor_nbytes(t), reason,
                                        held_through=self._held_ptrs.get(_ptr(t)),
                                        unit_input=not region.startswith("<") and _ptr(t) in self._unit_args,
                                        shares=shares)
            self.tensors[key] = t
            self._input_ptrs.setdefault(_ptr(t), []).append(key)
        if key in self.lse_of and packed.tensor is not None and self.diverged is None:
            packed.lse_of = self._lse_sources(key)
        # weak references only: autograd owns the packed objects, the store must not keep them (or an exact
        # tensor) alive after backward used them
        self._seen[ident] = (weakref.ref(anchor), weakref.ref(packed), key)
        if self.lse_of or self.variants:
            self._by_key[key] = weakref.ref(packed)
        where = (_ptr(t), t.dtype, t.device)
        if strided and t.is_contiguous():  # whatever its form, so that keys never depend on the bits
            self._bases.setdefault(where, []).append(
                (weakref.ref(anchor), weakref.ref(packed), t.storage_offset(), t.numel()))
            self._adopt_loose(where, packed, key, t.storage_offset(), t.numel())
        elif strided and all(s >= 0 for s in t.stride()):  # a contiguous tensor saved later may hold it
            self._loose.setdefault(where, []).append(
                (weakref.ref(anchor), weakref.ref(packed), *_span(t), tuple(t.shape), tuple(t.stride())))
        return packed

    def _take_variant(self, key: str, got: str) -> bool:
        """Go on with the first of :attr:`variants` whose forward saved what this one has so far (see there)."""
        for variant in self.variants:
            saves = variant["saves"]
            if saves.get(key) == got and all(saves.get(k) == g for k, g in self._history):
                self.saves, self.bits, self.groups, self.lse_of = (variant[name] for name in
                                                                   ("saves", "bits", "groups", "lse_of"))
                self._lossy_regions = frozenset(map(region_of, self.bits))
                self.variants = []
                return True
        return False

    def _lse_sources(self, key: str) -> tuple:  # type: ignore[type-arg]
        """The packed query, key and mask the log-sum-exp saved under ``key`` is recomputed from."""
        spec = self.lse_of[key]
        names = [spec["query"], spec["key"], spec["mask"]]
        found = [None if n is None else (self._by_key[n]() if n in self._by_key else None) for n in names]
        missing = [n for n, f in zip(names, found) if n is not None and f is None]
        if missing:
            raise RuntimeError(
                f"zoomem: the plan recomputes the attention log-sum-exp saved as {key} from {', '.join(missing)}, "
                "which this forward did not save before it: the model's forward no longer matches its plan. "
                "Re-plan it (zoomem.unwrap, then zoomem.wrap) or report the model.")
        return (*found, spec["scale"], spec["causal"])

    def _adopt_loose(self, where: tuple, base: _Packed, base_key: str, offset: int, numel: int) -> None:
        """Make the views saved earlier that lie in ``base``'s memory views of its packed form: their own packed
        forms (a second quantized copy of the same bytes) are dropped. The weak reference to each view's anchor
        (:func:`_anchor`) proves its memory is still the one ``base`` lies in (a dead one's address may have been
        reused)."""
        kept = []
        for entry in self._loose.get(where, ()):
            ref, packed_ref, lo, hi, shape, stride = entry
            if ref() is None or (packed := packed_ref()) is None:
                continue
            if not (offset <= lo and hi < offset + numel):
                kept.append(entry)
                continue
            packed.tensor, packed.quantized, packed.device = None, None, None
            packed.view_of = (base, shape, stride, lo - offset)
            if self.record and packed.key in self.infos:
                old = self.infos[packed.key]
                self.infos[packed.key] = dataclasses.replace(old, nbytes=0, lossy=f"{DUPLICATE}{base_key}")
        self._loose[where] = kept

    def _view_of_packed(self, t: torch.Tensor) -> _Packed | None:
        """A packed contiguous tensor whose memory holds all of ``t`` (``t`` a view of it), as a view of it."""
        if any(s < 0 for s in t.stride()):
            return None
        lo, hi = _span(t)
        for ref, packed_ref, offset, numel in self._bases.get((_ptr(t), t.dtype, t.device), ()):
            packed = packed_ref()
            if ref() is not None and packed is not None and offset <= lo and hi < offset + numel:
                return _Packed(None, view_of=(packed, tuple(t.shape), tuple(t.stride()), lo - offset))
        return None

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        return packed.unpack()



def _zero_or_one_value(t: torch.Tensor) -> bool:
    """Whether ``t`` holds only 0 and one other value (its maximum)."""
    top = t.amax()
    return bool(((t == 0) | (t == top)).all())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and last storage element a strided tensor with non-negative strides touches."""
    lo = t.storage_offset()
    return lo, lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _anchor(t: torch.Tensor) -> torch.Tensor:
    """The tensor object whose life proves ``t``'s memory is still the one it was: its base when it is a view.
    A view dies with the op that made it (``linear`` flattens a 3-D input into a fresh 2-D view for each call, so
    the query, key and value projections each save a different view object of one input) while its base, and so
    its memory, lives on; a weak reference to the view would lose the match and store the input three times."""
    return t._base if t._base is not None else t


def _ptr(t: torch.Tensor) -> int:
    if t.layout != torch.strided:  # sparse (PyG's CSR adjacency) or nested: no single storage
        return id(t)
    return t.untyped_storage().data_ptr()


def _tensors(args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    return tensors_in((args, dict(kwargs)))


def _warn_diverged(key: str, got: str, want: str, smaller: bool = False) -> None:
    """Log, once per difference, that a forward left its plan's saves (see the module docstring)."""
    if smaller:
        msg = (f"zoomem: a training forward on inputs smaller than its plan's saved {got} as {key}, where the plan's "
               f"forward saved {want}: control flow that depends on the shape or the batch's values. From there on "
               "that forward stored every tensor exactly; its input signature plans on its own at the next step.")
    else:
        msg = (f"zoomem: a training forward saved {got} as {key}, where its plan's forward saved {want}: the model's "
               "control flow depends on the batch's values (an attention mask left out of a batch without padding, "
               "experts that get no tokens), so its saved tensors no longer match the plan's. From there on that "
               "forward stored every tensor exactly: its gradients carry no lossy storage it was not planned for, "
               "but the step holds more than the plan predicted. Under a compression level in one process, zoomem "
               "plans such batches apart at the next step (a few variants per input signature at most); otherwise "
               "batches of one kind per signature (all padded) or a lossless budget avoid it.")
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)
