"""The server's contract under hostile and unusual input, over the raw wire API: each test is
one defect or contract gap of the shard-core issue, run against a fresh fusedps-server.

They use only the wire API, so they run against any server binary ($FUSEDPS_SERVER); run
against the base commit's binary, each fails (or, for new flags, cannot start).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from contract_helpers import (SlowPull, in_thread, pull, push, push_messages, register, stub)
from fusedps.v1 import parameter_service_pb2 as pb
from server_fixture import running_server, server_command, server_path, wait_for_port

MiB = 1 << 20


NOT_SERVING = 2  # grpc.health.v1.HealthCheckResponse.ServingStatus


def health_status(target: str):
    """grpc.health.v1 Check for the whole server, without the health stubs (Debian's grpcio
    ships none): the request is an empty message, the reply's field 1 is the status."""
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            reply = check(b"", timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return reply[1] if len(reply) == 2 and reply[0] == 0x08 else 0


def floats(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


class HeldStream:
    """A client stream whose first `n` messages go out at once; the rest wait for release().
    REQUIRES: more than n messages, so that the call stays open until release()."""

    def __init__(self, call, messages, n: int):
        assert len(messages) > n
        self._release = threading.Event()
        self._sent = threading.Event()

        def requests():
            for i, m in enumerate(messages):
                if i == n:
                    self._sent.set()
                    self._release.wait()
                yield m
            self._sent.set()
        self.future = call.future(requests(), timeout=60)
        assert self._sent.wait(10)

    def release(self):
        self._release.set()
        return self.future.result()


# Defect 1: a zero-byte reservation (a trainer re-registering tensors that exist) shared an
# offset with a later push, and releasing both lost that push's bytes for good: every push that
# needed them waited for ever while the pool's metrics read empty.
def test_zero_byte_reservations_do_not_lose_staging():
    n = MiB // 4  # 1 MiB of fp32 each; the pool holds exactly both.
    with running_server(["--staging-pool-bytes=2097152"]) as target, stub(target) as s:
        register(s, {"p1": floats(n, 1), "p2": floats(n, 2)})
        # Each push sends its header and one of its 16 chunks, then waits.
        p1 = HeldStream(s.PushGradients, push_messages({"p1": floats(n, 3)}, chunk_bytes=64 << 10),
                        2)
        # Re-registration of a tensor that exists: 0 bytes of staging, held while it streams.
        again = HeldStream(s.RegisterTensors, [pb.RegisterTensorsRequest(
            header=pb.RegisterTensorsHeader(tensors=[pb.TensorSpec(name="p1", shape=[n])])),
            pb.RegisterTensorsRequest()], 1)
        p2 = HeldStream(s.PushGradients, push_messages({"p2": floats(n, 4)}, chunk_bytes=64 << 10),
                        2)
        assert again.release().tensors_existing == 1
        p2.release()
        p1.release()
        # The whole pool is free again: a push of both tensors must get it.
        reply = push(s, {"p1": floats(n, 5), "p2": floats(n, 6)}, timeout=10)
        assert not reply.step_skipped


# A valid tiny grad_scale (1e-39 is a positive, finite float) made 1 / grad_scale overflow, so
# zero gradients became NaN and the step was skipped.
def test_tiny_grad_scale_divides():
    w = floats(64, 7)
    with running_server() as target, stub(target) as s:
        register(s, {"w": w})
        grad = np.zeros(64, np.float32)
        grad[:4] = np.float32(3e-40)  # Divided by 1e-39: 0.3.
        reply = push(s, {"w": grad}, grad_scale=1e-39)
        assert not reply.step_skipped
        _, _, got = pull(s, ["w"])
    param = torch.nn.Parameter(torch.from_numpy(w.copy()))
    opt = torch.optim.AdamW([param])
    param.grad = torch.from_numpy(grad.astype(np.float64) / 1e-39).float()
    opt.step()
    np.testing.assert_allclose(got["w"], param.detach().numpy(), rtol=1.3e-6, atol=1e-5)


# weight_decay_mode = 99 was taken as DECOUPLED, and SetHyperparameters with it silently switched
# an L2 group to decoupled decay.
def test_unknown_weight_decay_mode_is_invalid_argument():
    with running_server() as target, stub(target) as s:
        bad = pb.Hyperparameters(weight_decay_mode=99)
        with pytest.raises(grpc.RpcError) as e:
            s.RegisterParamGroup(pb.RegisterParamGroupRequest(
                param_group=pb.ParamGroup(name="g", hyperparameters=bad)), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "weight_decay_mode" in e.value.details()
        s.RegisterParamGroup(pb.RegisterParamGroupRequest(param_group=pb.ParamGroup(
            name="l2", hyperparameters=pb.Hyperparameters(
                weight_decay_mode=pb.WEIGHT_DECAY_MODE_L2))), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            s.SetHyperparameters(pb.SetHyperparametersRequest(param_group="l2",
                                                              hyperparameters=bad), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = s.GetInfo(pb.GetInfoRequest(), timeout=10)
        l2 = {g.name: g for g in info.param_groups}["l2"]
        assert l2.hyperparameters.weight_decay_mode == pb.WEIGHT_DECAY_MODE_L2


# An error echoed a 20 KB tensor name, so a default client saw RESOURCE_EXHAUSTED (metadata too
# large) instead of NOT_FOUND.
def test_long_unknown_names_are_not_found_with_a_short_message():
    huge = "n" * 20480
    with running_server() as target, stub(target) as s:
        register(s, {"w": floats(4)})
        with pytest.raises(grpc.RpcError) as e:
            push(s, {huge: np.zeros(4, np.float32)}, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(e.value.details()) < 300
        with pytest.raises(grpc.RpcError) as e:
            pull(s, [huge], timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


# 40,000 tensors with long names: ListTensors and a pull of every tensor failed with "Sent
# message larger than max" (one reply held all the metadata).
def test_listing_and_pulling_40000_tensors():
    count, name_bytes = 40000, 200
    names = [f"{i:06d}".ljust(name_bytes, "x") for i in range(count)]
    with running_server() as target, stub(target) as s:
        for start in range(0, count, 10000):  # The specs of one call fit in one message.
            register(s, {n: np.full(1, i, np.float32) for i, n in
                         enumerate(names[start:start + 10000], start)}, timeout=120)
        listed, token, pages = [], "", 0
        while True:
            reply = s.ListTensors(pb.ListTensorsRequest(page_token=token), timeout=60)
            listed.extend(t.name for t in reply.tensors)
            pages += 1
            token = reply.next_page_token
            if not token:
                break
        assert listed == names and pages > 1
        header, infos, values = pull(s, timeout=120)
        assert header.tensor_count == count
        assert [i.name for i in infos] == names
        assert all(values[n][0] == i for i, n in enumerate(names))


# client_id had no length limit: 200 pushes with distinct 1 MiB ids grew the server by 207 MiB.
def test_client_id_has_a_length_limit():
    with running_server() as target, stub(target) as s:
        register(s, {"w": floats(8)})
        with pytest.raises(grpc.RpcError) as e:
            push(s, {"w": floats(8)}, client_id="c" * MiB, sequence_number=1, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "client_id" in e.value.details()
        push(s, {"w": floats(8)}, client_id="c" * 256, sequence_number=1, timeout=10)


# The proto promises a retry its own push's reply; a retry of an older sequence number got the
# last push's.
def test_each_retry_gets_its_own_reply():
    with running_server() as target, stub(target) as s:
        register(s, {"w": floats(8)})
        first = [push(s, {"w": floats(8, i)}, client_id="t", sequence_number=i) for i in (1, 2, 3)]
        for i, original in zip((1, 2, 3), first):
            retry = push(s, {"w": floats(8, i)}, client_id="t", sequence_number=i)
            assert retry.duplicate and retry.version == original.version


# A retry is recognized from its header: its chunks are never read (here it sends none, which a
# push that is read would fail on).
def test_a_retry_is_answered_from_its_header():
    with running_server() as target, stub(target) as s:
        register(s, {"w": floats(8)})
        original = push(s, {"w": floats(8)}, client_id="t", sequence_number=7)
        retry = push(s, {"w": floats(8)}, client_id="t", sequence_number=7, with_chunks=False)
        assert retry.duplicate and retry.version == original.version


# Retrying one part of an already-applied push waited for the other parts, failed after the part
# wait, and poisoned the key for a minute; it must get `duplicate` like a retry of all parts.
def test_retry_of_one_part_of_an_applied_push_is_a_duplicate():
    with running_server(["--push-part-wait-seconds=3"]) as target, stub(target) as s:
        register(s, {"a": floats(16), "b": floats(16)})
        parts = [in_thread(push, s, {"a": floats(16, 1)}, names=["a", "b"], client_id="t",
                           sequence_number=5, part=(0, 2)),
                 in_thread(push, s, {"b": floats(16, 2)}, names=["a", "b"], client_id="t",
                           sequence_number=5, part=(1, 2))]
        replies = [join(30) for join in parts]
        assert replies[0].version == replies[1].version and not replies[0].duplicate
        start = time.monotonic()
        retry = push(s, {"b": floats(16, 2)}, names=["a", "b"], client_id="t",
                     sequence_number=5, part=(1, 2), timeout=10)
        assert retry.duplicate and retry.version == replies[0].version
        assert time.monotonic() - start < 1.5


# One slow reader stopped every push: a pull reading one message a second held 64 of 96 MiB of
# staging, a 48 MiB push queued behind it, and 8 KB pushes that fit in the free 32 MiB queued
# behind that one and timed out.
def test_a_slow_reader_holds_one_window_and_small_pushes_pass_a_waiting_large_one():
    with running_server([f"--staging-pool-bytes={96 * MiB}"]) as target, stub(target) as s:
        for name, n in (("x", 16 * MiB), ("big", 20 * MiB), ("small", 2048)):
            register(s, {name: floats(n, n % 7)}, timeout=120)  # Each fits in the pool.
        slow = SlowPull(s, ["x"])  # 64 MiB, read one message and then nothing.
        # 80 MiB: waits for the reader's staging either way.
        waiting = in_thread(push, s, {"big": floats(20 * MiB, 4)}, timeout=120)
        time.sleep(0.5)
        start = time.monotonic()
        for i in range(3):
            push(s, {"small": floats(2048, 10 + i)}, timeout=5)
        assert time.monotonic() - start < 5
        slow.drain()
        assert not waiting(60).step_skipped


# A tensor larger than the staging pool could not be registered ("split it into smaller pushes",
# impossible for one tensor); registration streams through the pool in windows.
def test_a_tensor_larger_than_the_pool_registers_and_pulls():
    values = floats(3 * MiB // 4 + 5, 9)  # 3 MiB and 20 bytes.
    with running_server(["--staging-pool-bytes=1048576"]) as target, stub(target) as s:
        assert register(s, {"w": values}).tensors_created == 1
        _, _, got = pull(s, ["w"])
        np.testing.assert_array_equal(got["w"], values)


# A client that stops sending held its push's staging until TCP gave up (about two hours).
def test_an_idle_push_ends_and_gives_back_its_staging():
    n = MiB // 4
    with running_server(["--staging-pool-bytes=1048576", "--call-idle-seconds=1"]) as target, \
            stub(target) as s:
        register(s, {"w": floats(n)})
        stalled = HeldStream(s.PushGradients,
                             push_messages({"w": floats(n, 1)}, chunk_bytes=64 << 10), 2)
        with pytest.raises(grpc.RpcError) as e:
            stalled.future.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--call-idle-seconds" in e.value.details()
        stalled._release.set()
        # The whole pool is free: the next push of the whole tensor goes through.
        assert not push(s, {"w": floats(n, 2)}, timeout=10).step_skipped


def test_list_tensors_pages_by_page_size():
    with running_server() as target, stub(target) as s:
        register(s, {f"t{i}": floats(2) for i in range(7)})
        names, token = [], ""
        while True:
            reply = s.ListTensors(pb.ListTensorsRequest(page_size=3, page_token=token),
                                  timeout=10)
            assert len(reply.tensors) <= 3
            names.extend(t.name for t in reply.tensors)
            token = reply.next_page_token
            if not token:
                break
        assert names == [f"t{i}" for i in range(7)]
        with pytest.raises(grpc.RpcError) as e:
            s.ListTensors(pb.ListTensorsRequest(page_token="garbage"), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# A device fault left a half-stepped shard serving: one push got INTERNAL, health stayed
# SERVING, and later pushes computed on counters that no longer agreed. Now the shard stops:
# health NOT_SERVING, every call UNAVAILABLE, and the process exits with status 3. The server
# keeps answering UNAVAILABLE for the whole drain: it used to start gRPC's shutdown at once, and
# calls made during the drain were sometimes CANCELLED instead (2 of about 8 runs of make test).
def test_a_device_fault_stops_the_shard_and_the_process_exits_3():
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen(
            server_command(server_path(), port_file, ["--metrics-listen=",
                                                      "--testing-fault-at-step=2",
                                                      "--fault-drain-seconds=5"], device="cpu"),
            stderr=subprocess.PIPE)
        try:
            port = wait_for_port(proc, port_file, 30, lambda: "" if proc.poll() is None
                                 else proc.stderr.read().decode())
            target = f"127.0.0.1:{port}"
            with stub(target) as s:
                register(s, {"w": floats(8)})
                assert push(s, {"w": floats(8, 1)}).version == 1
                with pytest.raises(grpc.RpcError) as e:
                    push(s, {"w": floats(8, 2)})
                assert e.value.code() == grpc.StatusCode.INTERNAL
                time.sleep(0.5)  # Well inside the drain: calls made now still get answers.
                assert health_status(target) == NOT_SERVING
                try:
                    s.GetInfo(pb.GetInfoRequest(), timeout=5)
                    pytest.fail("GetInfo answered after a fault")
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert proc.wait(timeout=20) == 3
            assert b"fault" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# The fault-injecting backend of --testing-fault-at-step was made before --param-copy-dtype was
# read, so a server started with both kept no bf16 copy.
def test_the_fault_injecting_backend_keeps_the_backend_options():
    with running_server(["--testing-fault-at-step=100", "--param-copy-dtype=bf16"],
                        device="cpu") as target:
        with stub(target) as s:
            info = s.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.param_copy_dtype == pb.DTYPE_BFLOAT16


# Shutdown took about 1.5 s more than the drain, spent stopping the metrics endpoint (civetweb
# polls for its stop flag every 2 s).
def test_sigterm_with_nothing_in_flight_exits_at_once():
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen(server_command(server_path(), port_file, device="cpu"),
                                stderr=subprocess.DEVNULL)
        try:
            wait_for_port(proc, port_file, 30, lambda: "")
            start = time.monotonic()
            proc.terminate()
            assert proc.wait(timeout=10) == 0
            assert time.monotonic() - start < 0.5
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
