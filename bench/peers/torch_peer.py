#!/usr/bin/python3
"""torch_peer.py: the parameter server a user would write instead of fusedps.

A grpcio server speaking fusedps.v1.ParameterService (the same proto, so the same load generator
and the same Python client drive it) that keeps every registered tensor as an fp32 torch tensor
on --device and applies torch's own optimizer, one instance per param group:
torch.optim.AdamW (torch.optim.Adam for L2 groups) with fused=True on CUDA, foreach=True on
the CPU (Debian's torch 1.13 has no fused AdamW on the CPU), the group's hyperparameters and
torch's defaults for the rest. It is the peer fusedps is measured against (docs/benchmarks.md).

    PYTHONPATH=build/python /usr/bin/python3 bench/peers/torch_peer.py \\
        --listen=0.0.0.0:50051 --device=cuda --port-file=/tmp/peer.port

A push is received on its gRPC worker thread: each chunk is copied from the message into a
gradient tensor in the wire dtype on the device, as it arrives (several pushes may be received
at once). Then, under one lock: grads are converted to fp32 (and divided by grad_scale), set as
p.grad of the pushed tensors (the others have None), each involved optimizer's step() runs, the
device is synchronized, and the version is incremented; the reply goes out after that, so an
acknowledged push has been applied.

A push may also come in parts (PushHeader.part_index/part_count, as `fusedps-bench --streams=N`
sends it): parallel calls with the same client_id and sequence_number, each a share of the
chunks. The first part to arrive makes the push's gradient tensors, every part copies its chunks
into them, and the last part to end well applies the push as above; every part gets that reply.
A part that fails (bad header or chunk, cancelled, deadline) fails the push: the other parts, and
parts that come later under that client_id and sequence_number (for a minute), get ABORTED.
Parts that have ended wait on their gRPC worker thread until the push is applied, so
--max-workers must cover every part in flight (e.g. clients x streams), or parts deadlock until
their deadlines.

Simplifications, on purpose (this is the simple peer):
  * chunk sizes and bounds are checked, overlapping chunks are not detected;
  * non-finite gradients are applied as torch would apply them, unless --skip-non-finite
    (then one check per tensor and one host sync decide, and the step is skipped);
  * worker_count > 1 is UNIMPLEMENTED, base_version is ignored; client_id + sequence_number
    retries are recognized, as the contract says.
SIGTERM or SIGINT: stop accepting calls, let calls in flight finish, exit 0.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import signal
import sys
import threading
import time
import warnings
from concurrent import futures

import grpc
import torch

from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

# Beside this file: the param groups, tensors and chunk receiving the servicer below uses.
from torch_peer_store import (RpcError, _check_hyperparameters, _check_received, _Group,
                              _PushInParts, _receive, _receive_into, _rpc, _Tensor, _to_fp32,
                              _with_defaults, _without_part_index)

# torch.frombuffer on the immutable bytes of a message warns once; nothing writes to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DEFAULT_GROUP = "default"
_WIRE_DTYPES = {pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_BFLOAT16: torch.bfloat16,
                pb.DTYPE_FLOAT16: torch.float16}
_STATE_FIELDS = {pb.TENSOR_FIELD_EXP_AVG: "exp_avg", pb.TENSOR_FIELD_EXP_AVG_SQ: "exp_avg_sq",
                 pb.TENSOR_FIELD_MAX_EXP_AVG_SQ: "max_exp_avg_sq"}
_DEFAULT_PULL_CHUNK_BYTES = 1 << 20
_MIN_PULL_CHUNK_BYTES = 16
_MAX_PULL_CHUNK_BYTES = 4 << 20
_SKIP_NON_FINITE = "non_finite_grad"
_MAX_PARTS = 64
_FAILED_PUSH_SECONDS = 60  # How long parts of a failed push in parts are ABORTED.


class TorchPeer(pb_grpc.ParameterServiceServicer):
    """fusedps.v1.ParameterService on torch tensors and torch optimizers."""

    def __init__(self, device: torch.device, max_message_bytes: int, skip_non_finite: bool):
        self.device = device
        self.max_message_bytes = max_message_bytes
        self.skip_non_finite = skip_non_finite
        self._lock = threading.Lock()  # Guards everything below; held for a whole step.
        self._groups = {DEFAULT_GROUP: _Group(DEFAULT_GROUP, _with_defaults(pb.Hyperparameters()),
                                              device)}
        self._tensors = {}  # name -> _Tensor, in registration order.
        self._version = 0
        self._last_push = {}  # client_id -> (sequence_number, PushGradientsResponse)
        # Pushes in parts, by (client_id, sequence_number): those in flight and, for
        # _FAILED_PUSH_SECONDS, those that failed. Guarded by self._parts, a lock of its own
        # (never held with self._lock) that waiting parts wait on.
        self._parts = threading.Condition()
        self._pushes = {}

    def _lookup(self, names):
        """The named tensors (every tensor when names is empty). REQUIRES: self._lock held."""
        if not names:
            return list(self._tensors.values())
        if len(set(names)) != len(names):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "a tensor is named twice")
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"tensor '{missing[0]}' is not registered")
        return [self._tensors[n] for n in names]

    @_rpc
    def RegisterParamGroup(self, request, context):
        name = request.param_group.name
        if not 1 <= len(name) <= 128:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "param group name: 1..128 chars")
        h = _with_defaults(request.param_group.hyperparameters)
        _check_hyperparameters(h)
        stored = pb.ParamGroup(name=name, hyperparameters=h)
        with self._lock:
            existing = self._groups.get(name)
            if existing is not None:
                if existing.hyperparameters != h:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"param group '{name}' exists with other hyperparameters")
                return pb.RegisterParamGroupResponse(created=False, param_group=stored)
            self._groups[name] = _Group(name, h, self.device)
        return pb.RegisterParamGroupResponse(created=True, param_group=stored)

    @_rpc
    def RegisterTensors(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "the first RegisterTensorsRequest must carry header")
        specs = list(first.header.tensors)
        if len({s.name for s in specs}) != len(specs):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "a tensor is named twice")
        new_specs = []
        with self._lock:
            for s in specs:
                group = s.param_group or DEFAULT_GROUP
                if not 1 <= len(s.name) <= 256 or any(d < 0 for d in s.shape):
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"bad spec for '{s.name}'")
                if group not in self._groups:
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"param group '{group}' unknown")
                t = self._tensors.get(s.name)
                if t is None:
                    new_specs.append(s)
                elif t.shape != tuple(s.shape) or t.group.name != group:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"tensor '{s.name}' exists with another spec")
        # Values: fp32 chunks for the new tensors (those of existing ones are ignored).
        shapes = {s.name: tuple(s.shape) for s in specs}
        values, _ = _receive(first, request_iterator, shapes, torch.float32, self.device,
                             required=[s.name for s in new_specs])
        with self._lock:
            created = 0
            for s in new_specs:
                if s.name in self._tensors:  # Registered meanwhile by another call.
                    continue
                group = self._groups[s.param_group or DEFAULT_GROUP]
                self._tensors[s.name] = _Tensor(s, group, values[s.name])
                group.add_params([values[s.name]])
                created += 1
            return pb.RegisterTensorsResponse(tensors_created=created,
                                              tensors_existing=len(specs) - created,
                                              version=self._version)

    @_rpc
    def PushGradients(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "the first PushGradientsRequest must carry header")
        header = first.header
        dtype = _WIRE_DTYPES.get(header.grad_dtype)
        if dtype is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "grad_dtype: FLOAT32/BFLOAT16/FLOAT16")
        grad_scale = header.grad_scale if header.HasField("grad_scale") else None
        if grad_scale is not None and not (math.isfinite(grad_scale) and grad_scale > 0):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "grad_scale must be finite and > 0")
        if header.worker_count > 1:
            raise RpcError(grpc.StatusCode.UNIMPLEMENTED, "worker_count > 1")
        parts = header.part_count
        if parts > 1 and not (header.part_index < parts <= _MAX_PARTS and header.client_id
                              and header.sequence_number):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a push in parts needs part_index < part_count <= {_MAX_PARTS}, "
                           f"client_id and sequence_number (part {header.part_index} of {parts})")
        with self._lock:
            tensors = self._lookup(list(header.tensors))
        if parts > 1:
            return self._push_part(first, request_iterator, context, tensors, dtype, grad_scale)
        grads, nbytes = _receive(first, request_iterator, {t.name: t.shape for t in tensors},
                                 dtype, self.device)
        grads = _to_fp32(grads, grad_scale)
        with self._lock:
            return self._apply(header, tensors, grads, nbytes)

    def _push_part(self, first, rest, context, tensors, dtype, grad_scale):
        """One call of a push in parts; returns the push's reply once it has been applied."""
        header = _without_part_index(first.header)
        push = self._join(header, first.header.part_index, tensors, dtype)
        context.add_callback(lambda: self._fail(push, "a part was cancelled"))
        try:
            received, nbytes = _receive_into(push.grads, first, rest)
        except RpcError as e:
            self._fail(push, str(e))
            raise
        except grpc.RpcError:  # Raised by the request iterator: the call was cancelled.
            self._fail(push, "a part was cancelled")
            raise RpcError(grpc.StatusCode.CANCELLED, "cancelled")
        with self._parts:
            if push.error is not None:
                raise self._aborted(push)
            for name, n in received.items():
                push.received[name] += n
            push.nbytes += nbytes
            push.ended += 1
            if push.ended < header.part_count:
                return self._wait_locked(push, context)
            try:
                _check_received(push.grads, push.received)
            except RpcError as e:
                self._fail_locked(push, str(e))
                raise
            push.over = True  # The last part: it applies the push for every part.
        response = None
        try:
            grads = _to_fp32(push.grads, grad_scale)
            with self._lock:
                response = self._apply(header, push.tensors, grads, push.nbytes)
        finally:
            with self._parts:
                push.response = response
                if response is None:
                    push.error, push.failed_at = "the step failed", time.monotonic()
                else:
                    del self._pushes[(header.client_id, header.sequence_number)]
                self._parts.notify_all()
        return response

    def _join(self, header, index, tensors, dtype):
        """The push in parts that this part belongs to; the first part to arrive makes it."""
        key = (header.client_id, header.sequence_number)
        with self._parts:
            push = self._pushes.get(key)
            if push is None:
                now = time.monotonic()
                for k in [k for k, p in self._pushes.items()
                          if p.error is not None and now - p.failed_at > _FAILED_PUSH_SECONDS]:
                    del self._pushes[k]
                push = self._pushes[key] = _PushInParts(header, tensors, dtype, self.device)
            if push.error is not None:
                raise self._aborted(push)
            if push.header != header or index in push.joined:
                reason = (f"part {index} arrived twice, or its header differs from the first "
                          "part's (only part_index may)")
                self._fail_locked(push, reason)
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason)
            push.joined.add(index)
            return push

    def _wait_locked(self, push, context):
        """Waits until the last part has applied the push, at most until this call's deadline.

        REQUIRES: self._parts held.
        """
        timeout = min(context.time_remaining(), threading.TIMEOUT_MAX)
        if not self._parts.wait_for(
                lambda: push.response is not None or push.error is not None, timeout):
            self._fail_locked(push, "a part's deadline passed while it waited for the others")
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "waited for the other parts")
        if push.error is not None:
            raise self._aborted(push)
        return push.response

    def _fail(self, push, reason):
        with self._parts:
            self._fail_locked(push, reason)

    def _fail_locked(self, push, reason):
        """Fails the push unless it is over; its waiting parts wake. REQUIRES: self._parts held."""
        if not push.over:
            push.over, push.error, push.failed_at = True, reason, time.monotonic()
            self._parts.notify_all()

    @staticmethod
    def _aborted(push):
        return RpcError(grpc.StatusCode.ABORTED, f"another part of this push failed: {push.error}")

    def _apply(self, header, tensors, grads, nbytes):
        """One optimizer step of ``tensors``. REQUIRES: self._lock held."""
        retry_key = header.client_id if header.client_id and header.sequence_number else None
        if retry_key is not None and retry_key in self._last_push:
            last_sequence, last_response = self._last_push[retry_key]
            if header.sequence_number <= last_sequence:
                response = pb.PushGradientsResponse()
                response.CopyFrom(last_response)
                response.duplicate = True
                return response
        skipped = False
        if self.skip_non_finite:
            finite = torch.stack([torch.isfinite(g).all() for g in grads.values()]).all()
            skipped = not bool(finite)
        if not skipped:
            groups = {}
            for t in tensors:
                t.param.grad = grads[t.name]
                groups[id(t.group)] = t.group
            for group in groups.values():
                group.optimizer.step()
            for t in tensors:
                t.param.grad = None
                t.step += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # Acknowledge applied pushes only.
            self._version += 1
        response = pb.PushGradientsResponse(
            version=self._version, step_skipped=skipped,
            skip_reason=_SKIP_NON_FINITE if skipped else "",
            tensors_updated=0 if skipped else len(tensors), grad_bytes=nbytes)
        if retry_key is not None:
            self._last_push[retry_key] = (header.sequence_number, response)
        return response

    @_rpc
    def PullParameters(self, request, context):
        wire = request.dtype or pb.DTYPE_FLOAT32
        dtype = _WIRE_DTYPES.get(wire)
        if dtype is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "dtype: FLOAT32/BFLOAT16/FLOAT16")
        chunk_bytes = request.max_chunk_bytes or _DEFAULT_PULL_CHUNK_BYTES
        if not _MIN_PULL_CHUNK_BYTES <= chunk_bytes <= _MAX_PULL_CHUNK_BYTES:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"max_chunk_bytes = {chunk_bytes}")
        field = request.field or pb.TENSOR_FIELD_PARAM
        if field != pb.TENSOR_FIELD_PARAM and field not in _STATE_FIELDS:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"field = {field}")
        with self._lock:  # One consistent snapshot, copied to host memory.
            tensors = self._lookup(list(request.tensors))
            header = pb.PullHeader(version=self._version, dtype=wire,
                                   tensors=[t.info() for t in tensors])
            arrays = [self._read(t, field, dtype) for t in tensors]
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self._pull_messages(header, tensors, arrays, itemsize, chunk_bytes)

    def _read(self, t: _Tensor, field: int, dtype: torch.dtype):
        """t's field as a flat host byte array in ``dtype``. REQUIRES: self._lock held."""
        if field == pb.TENSOR_FIELD_PARAM:
            src = t.param
        else:
            key = _STATE_FIELDS[field]
            if key == "max_exp_avg_sq" and not t.group.hyperparameters.amsgrad:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"tensor '{t.name}': max_exp_avg_sq needs an amsgrad group")
            src = t.group.optimizer.state.get(t.param, {}).get(key)
            if src is None:  # Never stepped: torch would start from zeros.
                src = torch.zeros_like(t.param)
        host = src.detach().reshape(-1).to("cpu", dtype, copy=True)
        return host.view(torch.uint8).numpy()

    @staticmethod
    def _pull_messages(header, tensors, arrays, itemsize, chunk_bytes):
        """The header message, then chunks packed into messages of <= chunk_bytes payload."""
        yield pb.PullParametersResponse(header=header)
        message = pb.PullParametersResponse()
        chunk_bytes -= chunk_bytes % itemsize
        room = chunk_bytes
        for t, data in zip(tensors, arrays):
            start = 0
            while start < len(data):
                stop = min(len(data), start + room)
                message.chunks.add(tensor=t.name, offset=start // itemsize,
                                   data=data[start:stop].tobytes())
                room -= stop - start
                start = stop
                if room < itemsize:
                    yield message
                    message = pb.PullParametersResponse()
                    room = chunk_bytes
        if message.chunks:
            yield message

    @_rpc
    def GetInfo(self, request, context):
        with self._lock:
            fused = (self.device.type == "cuda"
                     and "fused" in inspect.signature(torch.optim.AdamW).parameters)
            return pb.GetInfoResponse(
                version=self._version, backend="torch",
                device=f"{self._device_name()} (torch {torch.__version__}, "
                       f"AdamW {'fused' if fused else 'foreach'})",
                tensor_count=len(self._tensors),
                parameter_count=sum(t.numel for t in self._tensors.values()),
                param_groups=[pb.ParamGroup(name=g.name, hyperparameters=g.hyperparameters)
                              for g in self._groups.values()],
                server_version="torch_peer", max_message_bytes=self.max_message_bytes)

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} {torch.cuda.get_device_name(self.device)}"
        return f"cpu ({torch.get_num_threads()} threads)"

    @_rpc
    def ListTensors(self, request, context):
        with self._lock:
            return pb.ListTensorsResponse(version=self._version,
                                          tensors=[t.info() for t in self._tensors.values()])

    @_rpc
    def SetHyperparameters(self, request, context):
        name = request.param_group or DEFAULT_GROUP
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"param group '{name}' unknown")
            group.set_hyperparameters(request.hyperparameters)
            return pb.SetHyperparametersResponse(
                param_group=pb.ParamGroup(name=name, hyperparameters=group.hyperparameters))


def _write_port_file(path: str, port: int) -> None:
    """Writes the port atomically (tmp + rename), as fusedps-server does."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:50051",
                        help="gRPC address, HOST:PORT; port 0 picks one")
    parser.add_argument("--port-file", default="",
                        help="once serving, write the bound port to this file (atomically)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device of params and optimizer state (default: cuda if "
                             "available, else cpu)")
    parser.add_argument("--max-workers", type=int, default=16,
                        help="gRPC thread pool size (calls served at once)")
    parser.add_argument("--max-message-bytes", type=int, default=8 << 20,
                        help="gRPC max receive and send message size")
    parser.add_argument("--skip-non-finite", action="store_true",
                        help="skip a push whose gradients hold inf or NaN (costs a host sync)")
    parser.add_argument("--shutdown-grace-seconds", type=float, default=30,
                        help="on SIGTERM/SIGINT, how long calls in flight may take to finish")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    peer = TorchPeer(device, args.max_message_bytes, args.skip_non_finite)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.max_workers),
        options=[("grpc.max_receive_message_length", args.max_message_bytes),
                 ("grpc.max_send_message_length", args.max_message_bytes)])
    pb_grpc.add_ParameterServiceServicer_to_server(peer, server)
    port = server.add_insecure_port(args.listen)
    if port == 0:
        print(f"torch_peer: cannot listen on '{args.listen}'", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    host = args.listen.rsplit(":", 1)[0]
    print(f"torch_peer listening on {host}:{port} ({peer._device_name()}, torch "
          f"{torch.__version__})", file=sys.stderr, flush=True)
    if args.port_file:
        _write_port_file(args.port_file, port)
    while not stop.wait(0.5):
        pass
    print(f"torch_peer: stopping, draining for up to {args.shutdown_grace_seconds}s",
          file=sys.stderr, flush=True)
    server.stop(args.shutdown_grace_seconds).wait()
    print("torch_peer: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
