"""Tests of fusedps.Client over real gRPC against a small fake ParameterService in this process
(not fusedps-server): ListTensors pages, pulls whose TensorInfo continue past the header, and
deadlines."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import torch

import fusedps
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

PAGE_SIZE = 3          # Tensors per ListTensors page when the request leaves it 0.
INFOS_PER_MESSAGE = 2  # TensorInfo in a pull's header, and in each message after it.


class FakeService(pb_grpc.ParameterServiceServicer):
    """fp32 tensors given by the test; knobs to behave as an old server or to misbehave."""

    def __init__(self):
        self.tensors = {}  # name -> torch.Tensor, in registration order
        self.list_calls = 0
        self.legacy_pull = False
        self.chunk_before_info = False
        self.hang_get_info = False
        self.hang_pull_after_header = False

    def ListTensors(self, request, context):
        self.list_calls += 1
        names = list(self.tensors)
        begin = int(request.page_token or 0)
        end = min(begin + min(request.page_size or PAGE_SIZE, PAGE_SIZE), len(names))
        return pb.ListTensorsResponse(
            version=5, tensors=[self._info(n) for n in names[begin:end]],
            next_page_token=str(end) if end < len(names) else "")

    def PullParameters(self, request, context):
        names = list(request.tensors) or list(self.tensors)
        header = pb.PullHeader(version=5, dtype=pb.DTYPE_FLOAT32)
        if self.legacy_pull:
            header.tensors.extend(self._info(n) for n in names)
            rest = []
        else:
            header.tensor_count = len(names)
            header.tensors.extend(self._info(n) for n in names[:INFOS_PER_MESSAGE])
            rest = names[INFOS_PER_MESSAGE:]
        yield pb.PullParametersResponse(header=header)
        if self.hang_pull_after_header:
            while context.is_active():
                time.sleep(0.01)
            return
        if self.chunk_before_info and rest:
            yield self._chunk(rest[-1])
        for i in range(0, len(rest), INFOS_PER_MESSAGE):
            yield pb.PullParametersResponse(
                tensors=[self._info(n) for n in rest[i:i + INFOS_PER_MESSAGE]])
        for name in names:
            if self.tensors[name].numel():
                yield self._chunk(name)

    def GetInfo(self, request, context):
        while self.hang_get_info and context.is_active():
            time.sleep(0.01)
        return pb.GetInfoResponse(version=5, backend="fake")

    def _info(self, name):
        t = self.tensors[name]
        return pb.TensorInfo(name=name, shape=list(t.shape), param_group="default", step=1,
                             numel=t.numel())

    def _chunk(self, name):
        data = self.tensors[name].reshape(-1).numpy().astype("<f4").tobytes()
        return pb.PullParametersResponse(chunks=[pb.TensorChunk(tensor=name, offset=0, data=data)])


@pytest.fixture
def service():
    return FakeService()


@pytest.fixture
def target(service):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ParameterServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=0)


def named(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{9 - i}.weight": torch.randn(i + 1, 2, generator=gen) for i in range(n)}


def test_defaults_are_finite(target):
    with fusedps.Client(target) as client:
        assert client.timeout == 30.0 and client.min_bytes_per_second == 10e6
        assert client._timeout(248_000_000) == pytest.approx(54.8)
    with fusedps.Client(target, timeout=None) as client:
        assert client._timeout(1 << 40) is None
    with pytest.raises(ValueError):
        fusedps.Client(target, timeout=0)


def test_list_tensors_follows_pages(service, target):
    service.tensors = named(10)
    with fusedps.Client(target) as client:
        listed = client.list_tensors()
    assert [t.name for t in listed] == list(service.tensors)
    assert listed.version == 5 and service.list_calls == 4
    assert listed[-1].shape == (10, 2) and listed[-1].numel == 20


@pytest.mark.parametrize("legacy", [False, True])
def test_pull_takes_tensor_info_from_header_and_later_messages(service, target, legacy):
    service.tensors = named(7, seed=1)
    service.legacy_pull = legacy
    with fusedps.Client(target) as client:
        pulled = client.pull_parameters()
        model = {name: torch.zeros_like(t) for name, t in service.tensors.items()}
        client.pull_parameters(model)
    assert list(pulled) == list(service.tensors)
    for name, t in service.tensors.items():
        assert torch.equal(pulled[name], t) and torch.equal(model[name], t)
    assert pulled.version == 5 and pulled.steps[name] == 1


def test_chunk_before_its_tensor_info_is_malformed(service, target):
    service.tensors = named(3)
    service.chunk_before_info = True
    with fusedps.Client(target) as client:
        with pytest.raises(RuntimeError, match="malformed pull reply: a chunk of 'layer7.weight' "
                                               "before its TensorInfo"):
            client.pull_parameters()


def test_unanswered_call_fails_at_its_deadline(service, target):
    service.hang_get_info = True
    with fusedps.Client(target, timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.info()
        elapsed = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.29 <= elapsed < 2.0


def test_stalled_pull_fails_at_timeout_plus_its_announced_bytes(service, target):
    service.tensors = {"w": torch.zeros(100_000)}  # 400 KB: 0.4 s at 1 MB/s.
    service.hang_pull_after_header = True
    # A base timeout of 1 s, not less: the header must arrive within it, also on a loaded CI
    # machine (at 0.2 s it once arrived late, and the deadline had no bytes to add).
    with fusedps.Client(target, timeout=1.0, min_bytes_per_second=1e6) as client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.pull_parameters()
        elapsed = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "400000 bytes" in e.value.details()
    assert 1.39 <= elapsed < 4.0
