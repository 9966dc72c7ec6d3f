"""The grpcio transport without a server: the raw request encoding against protobuf's parser,
pushes in parts over fake channels, the error classes, and imports that leave torch alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import torch

from fusedps import _chunks, _dtypes, _transport, errors
from fusedps.v1 import parameter_service_pb2 as pb


def _views(items, wire):
    return {n: _chunks.to_wire_array(t, wire).view(np.uint8) for n, t in items}


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
def test_encoded_messages_parse_as_protobuf(wire):
    items = [("w", torch.randn(5000)), ("bias", torch.randn(3)), ("é/ü", torch.randn(700))]
    itemsize = _dtypes.element_size(wire)
    plan = list(_chunks.plan_messages([(n, t.numel()) for n, t in items], itemsize, 4096))
    views = _views(items, wire)
    messages = list(_chunks.encode_messages(plan, views, itemsize))
    assert len(messages) == len(plan) >= 3
    rebuilt = {n: bytearray() for n, _ in items}
    for raw, chunks in zip(messages, plan):
        assert len(raw) <= 4096
        parsed = pb.PushGradientsRequest.FromString(raw)
        assert [(c.tensor, c.offset, len(c.data)) for c in parsed.chunks] == [
            (n, a, (b - a) * itemsize) for n, a, b in chunks]
        assert raw == parsed.SerializeToString()  # the canonical encoding, byte for byte
        for c in parsed.chunks:
            assert len(rebuilt[c.tensor]) == c.offset * itemsize
            rebuilt[c.tensor] += c.data
    for name, t in items:
        assert bytes(rebuilt[name]) == views[name].tobytes()


def test_chunk_messages_carry_the_load_state_field_canonically():
    items = [("w", torch.randn(3000)), ("b", torch.randn(5))]
    messages = list(_chunks.chunk_messages(items, "float32", 4096,
                                           field=pb.TENSOR_FIELD_EXP_AVG_SQ))
    got = {n: [] for n, _ in items}
    for raw in messages:
        assert len(raw) <= 4096
        parsed = pb.LoadStateRequest.FromString(raw)
        assert raw == parsed.SerializeToString()
        for c in parsed.chunks:
            assert c.field == pb.TENSOR_FIELD_EXP_AVG_SQ
            got[c.tensor].append((c.offset, np.frombuffer(c.data, dtype="<f4")))
    for name, t in items:
        values = np.concatenate([v for _, v in sorted(got[name], key=lambda x: x[0])])
        assert np.array_equal(values, t.numpy())


class _FakeChannel:
    """Records the requests of each stream_unary call; fails when told to."""

    def __init__(self, fail_with=None):
        self.calls = []
        self.fail_with = fail_with
        self.lock = threading.Lock()

    def stream_unary(self, method, request_serializer, response_deserializer):
        assert method == "/fusedps.v1.ParameterService/PushGradients"
        assert request_serializer is None

        def call(requests, timeout=None):
            messages = [pb.PushGradientsRequest.FromString(r) for r in requests]
            with self.lock:
                self.calls.append((messages, timeout))
            if self.fail_with is not None:
                raise self.fail_with
            return pb.PushGradientsResponse(version=7, tensors_updated=2)

        return call


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _push(channels, items, max_bytes=4096):
    pusher = _transport.GrpcioPusher(channels)
    named = []
    header = pb.PushHeader(tensors=[n for n, _ in items])
    try:
        reply = pusher.push(header, items, "float32", max_bytes, lambda b: 30 + b / 1e7,
                            lambda h: (named.append(True), setattr(h, "client_id", "me"),
                                       setattr(h, "sequence_number", 5)))
    finally:
        pusher.close()
    return reply, named


def test_push_goes_as_parts_one_per_channel_covering_every_element():
    items = [("w", torch.randn(6000)), ("b", torch.randn(10))]
    channels = [_FakeChannel() for _ in range(3)]
    reply, named = _push(channels, items)
    assert reply.version == 7 and named == [True]
    received = {n: torch.full((t.numel(),), float("nan")) for n, t in items}
    for index, channel in enumerate(channels):
        assert len(channel.calls) == 1
        messages, timeout = channel.calls[0]
        h = messages[0].header
        assert (h.part_index, h.part_count, h.client_id, h.sequence_number) == (index, 3, "me", 5)
        payload = 0
        for m in messages[1:]:
            for c in m.chunks:
                values = torch.from_numpy(np.frombuffer(c.data, dtype="<f4").copy())
                received[c.tensor][c.offset:c.offset + values.numel()] = values
                payload += len(c.data)
        assert timeout == pytest.approx(30 + payload / 1e7)
    for name, t in items:
        assert torch.equal(received[name], t)


def test_a_small_push_is_one_call_and_keeps_its_header():
    channels = [_FakeChannel() for _ in range(4)]
    _, named = _push(channels, [("b", torch.randn(10))])
    assert named == [] and [len(c.calls) for c in channels] == [1, 0, 0, 0]
    header = channels[0].calls[0][0][0].header
    assert header.part_count == 0 and header.client_id == ""


def test_the_root_cause_of_a_failed_part_wins_over_the_aborted_parts():
    aborted = _RpcError(grpc.StatusCode.ABORTED, "another part failed")
    channels = [_FakeChannel(aborted), _FakeChannel(aborted),
                _FakeChannel(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "tensor 'w': size"))]
    with pytest.raises(errors.InvalidArgument, match="tensor 'w'"):
        _push(channels, [("w", torch.randn(6000))])


def test_errors_keep_code_and_details_and_are_rpc_errors():
    e = errors.from_rpc_error(_RpcError(grpc.StatusCode.NOT_FOUND, "tensor 'x' is not"))
    assert isinstance(e, errors.NotFound) and isinstance(e, errors.FusedPSError)
    assert isinstance(e, grpc.RpcError)
    assert e.code() == grpc.StatusCode.NOT_FOUND and e.details() == "tensor 'x' is not"
    assert str(e) == "NOT_FOUND: tensor 'x' is not"
    for code in grpc.StatusCode:
        if code != grpc.StatusCode.OK:
            mapped = errors.error_for(code, "m")
            assert mapped.code() == code and type(mapped).status_code == code

    @errors.translated
    def fails():
        raise _RpcError(grpc.StatusCode.ABORTED, "stale")

    with pytest.raises(errors.Aborted) as info:
        fails()
    assert isinstance(info.value.__cause__, _RpcError)


def test_import_and_info_leave_torch_and_numpy_unimported():
    code = ("import sys, fusedps\n"
            "c = fusedps.Client('127.0.0.1:1', transport='grpcio', timeout=0.5)\n"
            "try:\n    c.info()\nexcept fusedps.errors.Unavailable:\n    pass\n"
            "except fusedps.errors.DeadlineExceeded:\n    pass\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
