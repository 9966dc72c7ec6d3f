#!/usr/bin/python3
"""Smoke test of the benchmark peers, through the fusedps Python client (CPU only).

    PYTHONPATH=build/python /usr/bin/python3 bench/peers/smoke_test.py \\
        --sink=build/bench/peers/fusedps-grpc-sink --torch-peer=bench/peers/torch_peer.py

Each peer is started on 127.0.0.1:0 with a port file. Two small tensors are registered (one
in a param group of its own, one in "default"), then three pushes go out (fp32, bf16 with a
grad_scale, fp32 of one tensor only) in messages small enough to split a tensor into chunks.
  * torch_peer.py: the pulled params and exp_avg must equal (bitwise) torch.optim.AdamW run
    here on the same grads, and a retried push must come back as a duplicate;
  * torch_peer.py, pushes in parts (a fresh peer; three concurrent calls through the generated
    stubs, each a disjoint share of the chunks): one step, the same reply to every part, params
    equal to AdamW's here; a part with a bad chunk fails the push (the others get ABORTED), and
    part_index >= part_count is INVALID_ARGUMENT;
  * fusedps-grpc-sink: versions, grad_bytes and the shapes it reports must be right.
Each peer then gets SIGTERM and must exit with code 0. Exit code 0 when everything passed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import torch

import fusedps
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

MAX_CHUNK_BYTES = 2048  # Splits "w" (4,800 bytes as fp32) over several messages.
GROUP = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


@contextlib.contextmanager
def running(command, start_timeout=60.0):
    """Runs a peer with --listen=127.0.0.1:0 --port-file=...; yields "127.0.0.1:<port>".

    On leaving, sends SIGTERM and checks for exit code 0 (AssertionError otherwise).
    """
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen(
            list(command) + ["--listen=127.0.0.1:0", f"--port-file={port_file}"])
        try:
            deadline = time.monotonic() + start_timeout
            while not os.path.exists(port_file):
                if proc.poll() is not None:
                    raise AssertionError(f"{command[-1]} exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{command[-1]}: no port file in {start_timeout}s")
                time.sleep(0.05)
            with open(port_file) as f:
                yield f"127.0.0.1:{int(f.read())}"
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 0, f"{command[-1]} exited with {rc} after SIGTERM"


def make_tensors():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(40, 30, generator=g), "b": torch.randn(7, generator=g)}
    # (grads, wire dtype, grad_scale, names pushed)
    pushes = [
        ({n: torch.randn(p.shape, generator=g) for n, p in params.items()}, "float32", None,
         ["w", "b"]),
        ({n: torch.randn(p.shape, generator=g) * 4 for n, p in params.items()}, "bfloat16", 4.0,
         ["w", "b"]),
        ({"w": torch.randn(params["w"].shape, generator=g)}, "float32", None, ["w"]),
    ]
    return params, pushes


def register(client, params):
    client.register_param_group("g", **GROUP)
    result = client.register_model({"w": params["w"]}, param_group="g")
    assert result.tensors_created == 1, result
    result = client.register_model({"b": params["b"]})
    assert result.tensors_created == 1, result


def check_torch_peer(command):
    params, pushes = make_tensors()
    # The oracle: torch.optim.AdamW here, on the same grads as they arrive on the server.
    local = {n: p.clone() for n, p in params.items()}
    optimizers = [torch.optim.AdamW([local["w"]], foreach=True, **GROUP),
                  torch.optim.AdamW([local["b"]], foreach=True)]
    with running(command) as target, fusedps.Client(target, MAX_CHUNK_BYTES) as client:
        register(client, params)
        for i, (grads, wire, scale, names) in enumerate(pushes, start=1):
            result = client.push_gradients(grads, grad_dtype=wire, grad_scale=scale,
                                           client_id="smoke", sequence_number=i)
            assert result.version == i and result.tensors_updated == len(names), result
            for name, t in local.items():
                g = grads.get(name)
                t.grad = None if g is None else g.to(getattr(torch, wire)).float() / (scale or 1)
            for opt in optimizers:
                opt.step()

        retry = client.push_gradients(pushes[2][0], client_id="smoke", sequence_number=3)
        assert retry.duplicate and retry.version == 3, retry

        pulled = client.pull_parameters()
        assert pulled.version == 3 and pulled.steps == {"w": 3, "b": 2}, (pulled.version,
                                                                          pulled.steps)
        exp_avg, _, _ = client.pull_state("exp_avg")
        # The same torch code on the same device (CPU, foreach): bitwise equal.
        for name, t in local.items():
            torch.testing.assert_close(pulled[name], t, rtol=0, atol=0)
            state = optimizers[0 if name == "w" else 1].state[t]["exp_avg"]
            torch.testing.assert_close(exp_avg[name], state, rtol=0, atol=0)
        pulled_bf16 = client.pull_parameters(dtype="bfloat16")
        for name, t in local.items():
            assert torch.equal(pulled_bf16[name], t.to(torch.bfloat16)), name
        info = client.info()
        assert info.backend == "torch" and info.tensor_count == 2, info
        assert info.parameter_count == 40 * 30 + 7, info
    print("torch_peer: ok")


def push_in_parts(stub, header, grads, part_count, elements=100, bad_part=None):
    """Sends one fp32 push as part_count concurrent calls, chunks of <= ``elements`` dealt out
    round-robin; ``bad_part`` also sends a chunk of an unknown tensor. Returns each part's reply,
    or its grpc.StatusCode when it failed."""
    chunks = [pb.TensorChunk(tensor=name, offset=start,
                             data=g.reshape(-1)[start:start + elements].numpy().tobytes())
              for name, g in grads.items() for start in range(0, g.numel(), elements)]

    def send(index):
        part_header = pb.PushHeader()
        part_header.CopyFrom(header)
        part_header.part_index = index
        messages = [pb.PushGradientsRequest(header=part_header)]
        messages += [pb.PushGradientsRequest(chunks=[c]) for c in chunks[index::part_count]]
        if index == bad_part:
            messages.append(pb.PushGradientsRequest(chunks=[pb.TensorChunk(tensor="nope")]))
        try:
            return stub.PushGradients(iter(messages), timeout=30)
        except grpc.RpcError as e:
            return e.code()

    with futures.ThreadPoolExecutor(part_count) as pool:
        return list(pool.map(send, range(part_count)))


def check_torch_peer_parts(command):
    params, pushes = make_tensors()
    grads = pushes[0][0]
    local = {n: p.clone() for n, p in params.items()}
    optimizers = [torch.optim.AdamW([local["w"]], foreach=True, **GROUP),
                  torch.optim.AdamW([local["b"]], foreach=True)]
    for name, t in local.items():
        t.grad = grads[name] / 2
    for opt in optimizers:
        opt.step()
    with running(command) as target, fusedps.Client(target, MAX_CHUNK_BYTES) as client, \
            grpc.insecure_channel(target) as channel:
        register(client, params)
        stub = pb_grpc.ParameterServiceStub(channel)
        header = pb.PushHeader(client_id="parts", sequence_number=1, grad_dtype=pb.DTYPE_FLOAT32,
                               grad_scale=2.0, part_count=3)
        replies = push_in_parts(stub, header, grads, 3)
        expected = pb.PushGradientsResponse(version=1, tensors_updated=2,
                                            grad_bytes=(40 * 30 + 7) * 4)
        assert replies == [expected] * 3, replies

        # A part with a bad chunk fails the push; the other parts, and a later one, get ABORTED.
        header.sequence_number = 2
        replies = push_in_parts(stub, header, grads, 3, bad_part=1)
        assert replies == [grpc.StatusCode.ABORTED, grpc.StatusCode.INVALID_ARGUMENT,
                           grpc.StatusCode.ABORTED], replies
        assert push_in_parts(stub, header, grads, 3)[0] == grpc.StatusCode.ABORTED

        header.sequence_number, header.part_index = 3, 3
        try:
            stub.PushGradients(iter([pb.PushGradientsRequest(header=header)]), timeout=30)
            raise AssertionError("part_index = part_count was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e

        pulled = client.pull_parameters()
        assert pulled.version == 1 and pulled.steps == {"w": 1, "b": 1}, (pulled.version,
                                                                          pulled.steps)
        for name, t in local.items():
            torch.testing.assert_close(pulled[name], t, rtol=0, atol=0)
    print("torch_peer, pushes in parts: ok")


def check_sink(command):
    params, pushes = make_tensors()
    with running(command) as target, fusedps.Client(target, MAX_CHUNK_BYTES) as client:
        register(client, params)
        for i, (grads, wire, scale, names) in enumerate(pushes, start=1):
            result = client.push_gradients(grads, grad_dtype=wire, grad_scale=scale)
            itemsize = 4 if wire == "float32" else 2
            expected_bytes = sum(grads[n].numel() * itemsize for n in names)
            assert result.version == i, result
            assert result.grad_bytes == expected_bytes, (result, expected_bytes)
            assert result.tensors_updated == len(names), result
        pulled = client.pull_parameters()
        assert pulled.version == 3, pulled.version
        for name, p in params.items():
            assert torch.equal(pulled[name], torch.zeros_like(p)), name
        tensors = {t.name: t for t in client.list_tensors()}
        assert tensors["w"].shape == (40, 30) and tensors["w"].param_group == "g", tensors
        assert tensors["b"].shape == (7,) and tensors["b"].param_group == "default", tensors
        info = client.info()
        assert info.backend == "sink" and info.parameter_count == 40 * 30 + 7, info
        assert [g.name for g in info.param_groups] == ["default", "g"], info
    print("fusedps-grpc-sink: ok")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sink", required=True, help="the fusedps-grpc-sink binary")
    parser.add_argument("--torch-peer", required=True, help="bench/peers/torch_peer.py")
    args = parser.parse_args()
    check_sink([args.sink])
    check_torch_peer([sys.executable, args.torch_peer, "--device=cpu"])
    check_torch_peer_parts([sys.executable, args.torch_peer, "--device=cpu"])
    print("peers smoke test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
