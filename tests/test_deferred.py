"""A deferred LM-head output (``zoomem.ops.deferred``): described without being made, made once and exactly as the
head would have made it as soon as anything reads it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zoomem.ops.deferred import defer, is_deferred, materialize, offsets, root


def _head(dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    head = nn.Linear(16, 50).to(dtype)
    hidden = torch.randn(2, 6, 16, dtype=dtype, requires_grad=True)
    return head, hidden


def test_a_stand_in_describes_the_output_without_making_it() -> None:
    head, hidden = _head()
    d = defer(head, head.forward, hidden, head.weight, torch.float32)
    assert isinstance(d, torch.Tensor) and is_deferred(d)
    assert (d.shape, d.dtype, d.device, d.dim(), d.numel()) == ((2, 6, 50), torch.float32, hidden.device, 3, 600)
    assert d.requires_grad and d.untyped_storage().nbytes() == 4  # one element: nothing else exists
    assert d.float() is d and d.to(torch.float32) is d  # as torch returns the tensor itself
    rows = d.float().view(-1, d.size(-1))
    assert is_deferred(rows) and rows.shape == (12, 50) and root(rows) is d
    assert is_deferred(d.reshape(12, 50)) and is_deferred(torch.reshape(d, (3, 4, 50)))
    assert is_deferred(d)  # none of the above made it


def test_reading_a_stand_in_makes_the_output_once_and_views_share_it() -> None:
    head, hidden = _head()
    d = defer(head, head.forward, hidden, head.weight, torch.float32)
    rows = d.view(-1, 50)
    expected = head(hidden)
    doubled = d * 2  # a read: the head's output is made now
    assert type(doubled) is torch.Tensor and torch.equal(doubled, expected * 2)
    assert not is_deferred(d) and not is_deferred(rows)
    d.mul_(3)  # in place on the made output: the view derived before sees it, as a view of it would
    assert torch.equal(rows * 1, (expected * 3).view(-1, 50))
    assert materialize(rows).data_ptr() == materialize(d).data_ptr()
    assert d.shape == (2, 6, 50) and d.untyped_storage().nbytes() == 600 * 4  # now the real tensor's
    (materialize(d).sum() + rows.pow(2).sum()).backward()
    ref_head, ref_hidden = _head()
    out = ref_head(ref_hidden).mul(3)
    (out.sum() + out.view(-1, 50).pow(2).sum()).backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=0, atol=0)
    torch.testing.assert_close(head.weight.grad, ref_head.weight.grad, rtol=0, atol=0)


def test_a_stand_in_is_made_under_the_autocast_and_grad_mode_of_the_head_call() -> None:
    head, hidden = _head()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = defer(head, head.forward, hidden, head.weight, torch.bfloat16)
        expected = head(hidden)
        up = d.float()
    assert d.dtype == torch.bfloat16 and up.dtype == torch.float32 and is_deferred(up)
    with torch.no_grad():
        made = up + 0  # outside autocast and under no_grad: made as the head ran, with its graph
    assert made.dtype == torch.float32 and torch.equal(made, expected.float())
    assert materialize(d).grad_fn is not None and materialize(up).grad_fn.name() == "ToCopyBackward0"


@pytest.mark.parametrize("op", ["to_device", "slice", "contiguous", "view_splitting_vocab"])
def test_anything_but_an_upcast_or_a_view_keeping_the_vocabulary_makes_the_output(op: str) -> None:
    head, hidden = _head()
    d = defer(head, head.forward, hidden, head.weight, torch.float32)
    result = {"to_device": lambda: d.to("cpu"), "slice": lambda: d[:, :-1], "contiguous": lambda: d.contiguous(),
              "view_splitting_vocab": lambda: d.view(12, 5, 10)}[op]()
    assert not is_deferred(d) and type(result) is torch.Tensor
    expected = head(hidden)
    torch.testing.assert_close(result, {"to_device": expected, "slice": expected[:, :-1], "contiguous": expected,
                                        "view_splitting_vocab": expected.view(12, 5, 10)}[op], rtol=0, atol=0)


def test_a_constant_row_added_to_the_head_output_stays_deferred() -> None:
    """BART adds its ``final_logits_bias`` (``[1, vocab]``, no gradient) to the head's output: still a stand-in,
    made as the sum where read; a constant needing a gradient, another shape or another dtype makes the output."""
    head, hidden = _head()
    c = torch.randn(1, 50)
    d = defer(head, head.forward, hidden, head.weight, torch.float32)
    summed = d + c
    assert is_deferred(summed) and offsets(summed.view(-1, 50)) == [c] and root(summed) is d
    torch.testing.assert_close(summed * 1, head(hidden) + c, rtol=0, atol=0)
    for other in (torch.randn(1, 50, requires_grad=True), torch.randn(6, 50), torch.randn(1, 50).double()):
        d = defer(head, head.forward, hidden, head.weight, torch.float32)
        assert type(d + other) is torch.Tensor and not is_deferred(d)
