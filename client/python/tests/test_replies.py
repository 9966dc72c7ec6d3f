"""Unit tests of fusedps._replies: a pull's reply and ListTensors' pages, from messages built by
hand (no server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusedps import _replies
from fusedps.v1 import parameter_service_pb2 as pb


def info(name, shape, numel=0):
    return pb.TensorInfo(name=name, shape=list(shape), step=3, numel=numel)


def header(tensor_count, infos, dtype=pb.DTYPE_FLOAT32):
    return pb.PullParametersResponse(header=pb.PullHeader(
        version=7, dtype=dtype, tensors=infos, tensor_count=tensor_count))


def infos(*items):
    return pb.PullParametersResponse(tensors=list(items))


def chunk(name, offset, values, dtype="<f4"):
    data = np.asarray(values, dtype=dtype).tobytes()
    return pb.PullParametersResponse(chunks=[pb.TensorChunk(tensor=name, offset=offset,
                                                            data=data)])


def assemble(messages, wire="float32", requested=()):
    assembler = _replies.PullAssembler(wire)
    for message in messages:
        assembler.add(message)
    return assembler.finish(requested)


def test_header_without_tensor_count_holds_them_all():
    reply = assemble([header(0, [info("a", [2]), info("b", [])]),
                      chunk("b", 0, [3]), chunk("a", 0, [1, 2])], requested=["a", "b"])
    assert reply.version == 7
    assert [i.name for i in reply.infos] == ["a", "b"]
    assert torch.equal(reply.tensors["a"], torch.tensor([1.0, 2.0]))
    assert reply.tensors["b"].shape == () and reply.tensors["b"].item() == 3.0


def test_tensor_info_continues_past_the_header():
    assembler = _replies.PullAssembler("float32")
    assembler.add(header(3, [info("a", [1])]))
    assert assembler.announced_bytes == 4
    assembler.add(infos(info("b", [1]), info("c", [2, 1], numel=2)))
    assert assembler.announced_bytes == 16
    for message in [chunk("c", 1, [6]), chunk("a", 0, [1]), chunk("c", 0, [5]),
                    chunk("b", 0, [2])]:
        assembler.add(message)
    reply = assembler.finish()
    assert [i.name for i in reply.infos] == ["a", "b", "c"]
    assert torch.equal(reply.tensors["c"], torch.tensor([[5.0], [6.0]]))


def test_bfloat16_reply():
    bits = torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.int16).numpy()
    reply = assemble([header(1, [info("w", [2])], dtype=pb.DTYPE_BFLOAT16),
                      chunk("w", 0, bits.view(np.uint16), dtype="<u2")], wire="bfloat16")
    assert reply.tensors["w"].dtype == torch.bfloat16
    assert reply.tensors["w"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize("messages, message", [
    ([header(2, [info("a", [1])]), chunk("b", 0, [1]), infos(info("b", [1]))],
     "a chunk of 'b' before its TensorInfo"),
    ([header(2, [info("a", [1])]), chunk("a", 0, [1])], "1 TensorInfo, not its tensor_count of 2"),
    ([header(1, [info("a", [1])]), infos(info("b", [1]))],
     "more TensorInfo than its tensor_count of 1"),
    ([header(0, [info("a", [1])]), infos(info("b", [1]))],
     "TensorInfo past the header, whose tensor_count of 0 says it holds them all"),
    ([infos(info("a", [1]))], "data before its header"),
    ([header(2, [info("a", [1])]), infos(info("a", [1]))], "tensor 'a' is described twice"),
    ([header(0, []), header(0, [])], "a second header"),
    ([], "no header"),
    ([header(1, [info("a", [2], numel=3)])], "tensor 'a' has numel 3 that does not match"),
    ([header(1, [info("a", [2])]), chunk("a", 1, [1, 2])], "out of bounds"),
    ([header(1, [info("a", [2])]), chunk("a", 1, [1])], "1 elements of 'a', not 2"),
    ([header(1, [info("a", [1])], dtype=pb.DTYPE_BFLOAT16)], "asked for float32"),
])
def test_malformed_replies_raise(messages, message):
    with pytest.raises(RuntimeError, match="^malformed pull reply: ") as e:
        assemble(messages)
    assert message in str(e.value)


def test_requested_tensors_must_all_arrive():
    with pytest.raises(RuntimeError, match=r"requested tensors \['b'\] are missing"):
        assemble([header(0, [info("a", [0])])], requested=["a", "b"])


def listing(names, page_size_served=3):
    """A fetch_page over `names`, pages of at most page_size_served, tokens "offset"."""
    requests = []

    def fetch_page(request):
        requests.append(request)
        begin = int(request.page_token or 0)
        size = min(request.page_size or page_size_served, page_size_served)
        end = min(begin + size, len(names))
        return pb.ListTensorsResponse(
            version=len(requests), tensors=[info(n, []) for n in names[begin:end]],
            next_page_token=str(end) if end < len(names) else "")

    return fetch_page, requests


def test_list_pages_follows_tokens_to_the_last_page():
    names = [f"layer{i}.weight" for i in range(10)]
    fetch_page, requests = listing(names)
    version, listed = _replies.list_pages(fetch_page)
    assert [t.name for t in listed] == names
    assert len(requests) == 4 and requests[0].page_token == "" and requests[0].page_size == 0
    assert [r.page_token for r in requests[1:]] == ["3", "6", "9"]
    assert version == 1  # The first page's.


def test_list_pages_of_an_empty_shard_is_one_call():
    fetch_page, requests = listing([])
    assert _replies.list_pages(fetch_page) == (1, [])
    assert len(requests) == 1


def test_list_pages_rejects_a_repeated_token():
    def fetch_page(request):
        return pb.ListTensorsResponse(tensors=[info("a", [])], next_page_token="same")

    with pytest.raises(RuntimeError, match="repeats its page token after 2 tensors"):
        _replies.list_pages(fetch_page)
