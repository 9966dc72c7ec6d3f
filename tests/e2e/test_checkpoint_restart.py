"""Durable shards: a fusedps-server killed (SIGKILL) or stopped (SIGTERM) and started again on
the same --checkpoint-dir comes back with its state bit for bit (docs/checkpoints.md).

References, independent of the server's checkpoint code:
  * a replay: the acknowledged pushes up to the checkpoint's version, re-applied in version
    order to a fresh server, give the state the restored server must have (shard_digest);
  * the checkpoint files read by the format's definition (checkpoint_server.py).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time

import grpc
import pytest
import torch

import fusedps

from checkpoint_server import (ServerProcess, complete_checkpoints, fsize_limit, manifest_of,
                               params_of, shard_digest)

SHAPES = {"w": (64, 33), "b": (33,), "e": (1000,), "s": ()}
GROUPS = {"w": "ams", "b": "ams", "e": "plain", "s": "plain"}


def register(client: fusedps.Client) -> None:
    client.register_param_group("ams", lr=0.01, weight_decay=0.1, amsgrad=True)
    client.register_param_group("plain", lr=0.002, betas=(0.8, 0.99))
    for group in ("ams", "plain"):
        g = torch.Generator().manual_seed(7)
        client.register_model({n: torch.randn(SHAPES[n], generator=g)
                               for n in SHAPES if GROUPS[n] == group}, param_group=group)


def grads_of(client_index: int, sequence_number: int):
    """The gradients of one push: a seeded subset of the tensors, seeded values."""
    g = torch.Generator().manual_seed(client_index * 100003 + sequence_number)
    names = [n for n in SHAPES if torch.rand((), generator=g) < 0.75] or ["w"]
    return {n: torch.randn(SHAPES[n], generator=g) for n in names}


def push(client: fusedps.Client, client_index: int, sequence_number: int):
    return client.push_gradients(grads_of(client_index, sequence_number), grad_dtype="float32",
                                 client_id=f"trainer-{client_index}",
                                 sequence_number=sequence_number)


def replay_digest(acked, version: int) -> str:
    """The digest of the state after the pushes of versions 1..version, re-applied in order to
    a fresh server (no checkpoints): the reference state at that version."""
    with ServerProcess(["--restore=none"]) as fresh:
        client = fusedps.Client(fresh.target)
        register(client)
        for v in range(1, version + 1):
            client_index, sequence_number = acked[v]
            r = client.push_gradients(grads_of(client_index, sequence_number),
                                      grad_dtype="float32")
            assert r.version == v
        return shard_digest(client)[0]


def test_sigkill_restart_resumes_bit_exact_at_the_checkpoint_and_retries_apply_once(tmp_path):
    root = str(tmp_path / "ckpt")
    acked = {}  # version -> (client index, sequence number)
    lock = threading.Lock()
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        register(fusedps.Client(server.target))
        stop = threading.Event()

        def trainer(index: int) -> None:
            client = fusedps.Client(server.target)
            seq = 0
            while not stop.is_set():
                seq += 1
                r = push(client, index, seq)
                with lock:
                    acked[r.version] = (index, seq)

        threads = [threading.Thread(target=trainer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        while len(acked) < 30:
            time.sleep(0.01)
        with lock:
            before = len(acked)
        version, path = fusedps.Client(server.target).checkpoint()
        with lock:
            during = len(acked) - before
        while len(acked) < version + 20:  # Pushes after the cut: lost by the SIGKILL.
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join()
        server.kill()
    print(f"pushes acknowledged while the checkpoint was taken: {during}")
    assert int(manifest_of(path)["version"]) == version
    assert max(acked) > version

    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        client = fusedps.Client(restarted.target)
        digest, restored_version = shard_digest(client)
        assert restored_version == version
        assert digest == replay_digest(acked, version)
        # A retry of a push in the checkpoint is answered from the restored retry table.
        index, seq = acked[version]
        r = push(client, index, seq)
        assert r.duplicate and r.version == version
        assert shard_digest(client) == (digest, version)
        # A push acknowledged after the cut was lost with the process: its retry applies it.
        index, seq = acked[version + 1]
        r = push(client, index, seq)
        assert not r.duplicate and r.version == version + 1
        assert push(client, index, seq).duplicate


def test_sigterm_checkpoints_after_the_drain_and_loses_nothing(tmp_path):
    root = str(tmp_path / "ckpt")
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        client = fusedps.Client(server.target)
        register(client)
        for seq in range(1, 8):
            push(client, 0, seq)
        expected = shard_digest(client)
        assert server.terminate() == 0
        assert "checkpoint on exit: version 7" in server.log()
    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        assert shard_digest(fusedps.Client(restarted.target)) == expected


def test_sigkill_during_checkpoint_writes_always_restarts_from_the_newest_complete(tmp_path):
    """50 SIGKILLs at random moments while checkpoints are written back to back (one per
    version); after each, the server restores the newest complete checkpoint, byte for byte."""
    root = str(tmp_path / "ckpt")
    rng = random.Random(20261123)
    big = {"big": (1 << 20,)}  # 4 MiB per field: each checkpoint takes a while to write.
    restored_versions = []
    for iteration in range(51):
        complete = complete_checkpoints(root)
        with ServerProcess([f"--checkpoint-dir={root}", "--checkpoint-every-versions=1",
                            "--checkpoint-keep=2"]) as server:
            client = fusedps.Client(server.target)
            listing = client.list_tensors()
            if complete:
                newest = complete[0][1]
                assert listing.version == int(manifest_of(newest)["version"]), (iteration,
                                                                                 newest)
                pulled = client.pull_parameters([t.name for t in listing])
                for name, values in params_of(newest).items():
                    assert torch.equal(pulled[name], values), (iteration, name)
                restored_versions.append(listing.version)
            else:
                assert iteration == 0 or not restored_versions, "a checkpoint vanished"
                if len(listing) == 0:
                    client.register_model({"big": torch.zeros(big["big"])})
            if iteration == 50:
                break
            deadline = time.monotonic() + rng.uniform(0.05, 0.4)
            while time.monotonic() < deadline:
                client.push_gradients({"big": torch.full(big["big"], 0.5)},
                                      grad_dtype="float32")
            server.kill()
    assert len(restored_versions) >= 45
    assert restored_versions == sorted(restored_versions), "a restart went back in time"


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated_manifest"])
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path, damage):
    root = str(tmp_path / "ckpt")
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        client = fusedps.Client(server.target)
        register(client)
        push(client, 0, 1)
        good = (shard_digest(client), client.checkpoint()[1])
        push(client, 0, 2)
        _, bad = client.checkpoint()
        server.kill()
    if damage == "flipped_byte":
        damaged = os.path.join(bad, "exp_avg.safetensors")
        with open(damaged, "r+b") as f:
            f.seek(os.path.getsize(damaged) - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    else:
        damaged = os.path.join(bad, "manifest.json")
        with open(damaged, "r+b") as f:
            f.truncate(os.path.getsize(damaged) // 2)
    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        assert shard_digest(fusedps.Client(restarted.target)) == good[0]
        log = restarted.log()
        assert f"checkpoint {bad} is skipped" in log and damaged in log, log
        assert f"from {good[1]}" in log


def test_an_explicit_restore_path_that_does_not_load_stops_the_server(tmp_path):
    missing = str(tmp_path / "checkpoint-00000000000000000001")
    os.makedirs(missing)
    with pytest.raises(Exception, match="restore"):
        ServerProcess([f"--restore={missing}"], start_timeout=20)


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def test_a_full_disk_fails_the_checkpoint_cleanly_and_training_goes_on(tmp_path):
    """A 2 MiB tmpfs when this machine lets us mount one, else a 2 MiB file size limit."""
    root = str(tmp_path / "small")
    mounted = _mount_tmpfs(root, "2m")
    preexec = None if mounted else fsize_limit(2 << 20)
    try:
        with ServerProcess([f"--checkpoint-dir={root}"], preexec_fn=preexec) as server:
            client = fusedps.Client(server.target)
            client.register_model({"a": torch.ones(50_000)})  # 3 files of 200 KB: fits.
            client.push_gradients({"a": torch.ones(50_000)})
            version, good = client.checkpoint()
            client.register_model({"b": torch.ones(600_000)})  # 3 files of 2.6 MB: no.
            with pytest.raises(grpc.RpcError) as failed:
                client.checkpoint()
            assert failed.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           grpc.StatusCode.OUT_OF_RANGE), failed.value
            r = client.push_gradients({"a": torch.ones(50_000), "b": torch.ones(600_000)})
            assert r.version == version + 1 and not r.step_skipped
            m = server.metrics()
            assert m.value("fusedps_checkpoint_failures_total", model="default",
                           reason="disk_full") == 1
            assert m.value("fusedps_checkpoint_last_success_timestamp_seconds", model="default") > 0
            assert [d for _, d in complete_checkpoints(root)] == [good]
            assert sorted(os.listdir(root)) == [os.path.basename(good), "latest"], \
                "the failed checkpoint's files were not removed"
            server.kill()
        with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
            assert fusedps.Client(restarted.target).list_tensors().version == version
    finally:
        if mounted:
            subprocess.run(["umount", root], check=False)
            shutil.rmtree(root, ignore_errors=True)


def test_the_cli_checkpoint_command_prints_the_version_and_the_directory(tmp_path):
    from test_cli import CLI as cli
    if not os.path.exists(cli):
        pytest.skip(f"no CLI at {cli}")
    root = str(tmp_path / "ckpt")
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        client = fusedps.Client(server.target)
        register(client)
        push(client, 0, 1)
        out = subprocess.run([cli, f"--target={server.target}", "checkpoint"],
                             capture_output=True, text=True, check=True).stdout
        [(_, directory)] = complete_checkpoints(root)
        assert out == f"version 1 {directory}\n"
    with ServerProcess([]) as plain:  # No --checkpoint-dir.
        failed = subprocess.run([cli, f"--target={plain.target}", "checkpoint"],
                                capture_output=True, text=True)
        assert failed.returncode == 1 and "FAILED_PRECONDITION" in failed.stderr, failed


@pytest.mark.parametrize("transport", ["grpcio", "native"])
def test_a_pull_after_a_restore_that_rolled_back_raises_naming_both_versions(tmp_path,
                                                                             transport):
    """Issue 35, item 7: a server killed after its last checkpoint comes back at that
    checkpoint's version; a client that had pulled a later one must hear of it, not train on
    silently, unless it was told to (allow_version_regression)."""
    from fusedps import _native

    if transport == "native" and _native.library() is None:
        pytest.skip(f"no native library: {_native.load_error()}")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"--checkpoint-dir={tmp_path / 'ckpt'}", f"--listen=127.0.0.1:{port}"]
    names = list(SHAPES)
    with ServerProcess(args) as server:
        client = fusedps.Client(server.target, transport=transport, streams=2)
        register(client)
        for seq in range(1, 4):
            push(client, 0, seq)
        assert client.checkpoint()[0] == 3
        for seq in range(4, 6):
            push(client, 0, seq)
        targets = [(n, torch.empty(int(torch.tensor(SHAPES[n]).prod()))) for n in names]
        assert client.pull_into(targets)[0] == 5
        server.kill()  # SIGKILL: no checkpoint on exit; versions 4 and 5 are lost.
    with ServerProcess(args):  # The same port, restored at version 3.
        client.wait_ready(30.0)
        with pytest.raises(fusedps.errors.VersionRegression) as info:
            client.pull_into(targets)
        assert (info.value.seen, info.value.now) == (5, 3)
        assert "from version 5 to 3" in str(info.value) and str(port) in str(info.value)
        with pytest.raises(fusedps.errors.VersionRegression):
            client.pull_parameters(names)
        client.allow_version_regression = True  # Told to go on from the restored values.
        assert client.pull_parameters(names).version == 3
        client.close()
