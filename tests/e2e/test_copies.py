"""fusedps._copies.copy_in_pieces: a copy queued as pieces is the whole copy, at every size
against the piece (torch's own copy_ is the reference)."""

from __future__ import annotations

import pytest
import torch

from fusedps._copies import copy_in_pieces

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1001])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32),
                                    (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_every_element_is_copied_and_converted_as_copy_does(device, numel, dtypes):
    src_dtype, dst_dtype = dtypes
    src = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(src_dtype)
    src = src.to(device)
    pinned = device == "cuda"
    dst = torch.full((numel,), float("nan"), dtype=dst_dtype, pin_memory=pinned)
    # 8 elements per piece (4 bytes each, or 16 of bf16): sizes below, at and past a piece.
    copy_in_pieces(dst, src, piece_bytes=32)
    if device == "cuda":
        torch.cuda.synchronize()
    want = torch.empty(numel, dtype=dst_dtype)
    want.copy_(src.cpu())
    assert torch.equal(dst, want)


def test_pieces_of_a_view_write_only_the_view():
    base = torch.zeros(100)
    src = torch.arange(1, 41, dtype=torch.float32)
    copy_in_pieces(base[30:70], src, piece_bytes=12)
    assert torch.equal(base[30:70], src)
    assert not base[:30].any() and not base[70:].any()


def test_shapes_that_are_not_one_copy_are_refused():
    with pytest.raises(ValueError, match="1-D tensors of one numel"):
        copy_in_pieces(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="1-D"):
        copy_in_pieces(torch.zeros(2, 2), torch.zeros(2, 2))
