"""End-to-end: hashed embedding tables (docs/api.md, "Embedding tables"; issue 38) on a real
server (the CPU backend, or the CUDA one under FUSEDPS_TEST_DEVICE=cuda), through
Client.register_hashed_table, push_rows and lookup_rows.

The oracle (hashed_table_reference.py) assigns slots by the documented rules, written
independently of the server's code, and steps the slots with torch.optim.SparseAdam; created
rows start from an initializer written with the standard library's log and cos. Tolerance:
rtol=1.3e-6, atol=1e-5 (tests/e2e/test_tables.py's); what must not change (a refused or
skipped push) bit for bit. Which key holds which slot is checked exactly, through the table's
slots as pull_parameters reads them.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import List

import pytest
import torch

import fusedps
import fusedps.checkpoint
from checkpoint_server import ServerProcess, shard_digest
from hashed_table_reference import HashedTableReference, init_row

RTOL = 1.3e-6
ATOL = 1e-5
FIELDS = ("param", "exp_avg", "exp_avg_sq")
HYPER = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8)
# Feature ids: any int64, the extremes included.
UNIVERSE = [-(2**63), -5, 0, 1, 2, 3, 7, 11, 2**31, 2**40 + 3, 2**62 + 7, 2**63 - 1] + [
    1000 + 37 * i for i in range(28)]


def _push_keys(gen: torch.Generator, n: int, repeats: int) -> torch.Tensor:
    """n keys drawn from UNIVERSE (so that a small table evicts), then the first ``repeats``
    again (duplicates), shuffled."""
    idx = torch.randint(0, len(UNIVERSE), (n,), generator=gen)
    keys = torch.tensor([UNIVERSE[i] for i in idx], dtype=torch.int64)
    keys = torch.cat([keys, keys[:repeats]])
    return keys[torch.randperm(keys.numel(), generator=gen)]


def _assert_matches(client, table: str, ref: HashedTableReference, what: str) -> None:
    """The server's table against the reference: the slots exactly where they are (so which
    key holds which slot), and a lookup of every key of UNIVERSE in each field."""
    slots = client.pull_parameters([table])[table]
    torch.testing.assert_close(slots, ref.slots(), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: the slots: {m}")
    for field in FIELDS:
        got = client.lookup_rows(table, UNIVERSE, field=field)
        assert got.step == ref.step, what
        torch.testing.assert_close(got.rows, ref.rows(UNIVERSE, field), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {field} by key: {m}")


@pytest.mark.parametrize("dim,state_dtype", [(8, "fp32"), (6, "fp32"), (8, "bf16")])
def test_hashed_table_evicts_least_recently_updated_and_matches_sparse_adam(server_target,
                                                                           dim, state_dtype):
    """24 pushes of keys from 40 feature ids into a table of 16 slots (duplicates in each
    push; most pushes evict): the slots, every key's params and moments, and the step follow
    the reference, which assigns slots and evicts by the documented rules and steps with
    torch.optim.SparseAdam. dim 8 and 6: the CUDA update's 16-byte and 4-byte paths; bf16
    state: the reference's moments rounded to bf16 after each step."""
    prefix, group = f"hashed.parity{dim}{state_dtype}.", f"hashed.parity{dim}{state_dtype}"
    capacity, seed, init_std = 16, 12345, 0.1
    with fusedps.Client(server_target, max_chunk_bytes=2048) as client:
        client.register_param_group(group, weight_decay=0.0, state_dtype=state_dtype, **HYPER)
        registered = client.register_hashed_table("emb", capacity, dim, seed=seed,
                                                   init_std=init_std, param_group=group,
                                                   prefix=prefix)
        assert registered.tensors_created == 1
        table = prefix + "emb"
        info = {t.name: t for t in client.list_tensors()}[table]
        assert (info.table, info.hashed, info.shape) == (True, True, (capacity, dim))
        assert info.table_seed == seed and info.table_init_std == pytest.approx(init_std)
        ref = HashedTableReference(capacity, dim, seed, init_std,
                                   bf16_state=state_dtype == "bf16", **HYPER)
        _assert_matches(client, table, ref, "before any push")  # Every key: its initializer.
        gen = torch.Generator().manual_seed(dim)
        evictions = 0
        for step in range(1, 25):
            keys = _push_keys(gen, 10, 4)
            grads = torch.randn(keys.numel(), dim, generator=gen)
            result = client.push_rows({"emb": (keys, grads)}, prefix=prefix)
            assert not result.step_skipped and result.tensors_updated == 1
            evictions += ref.push(keys, grads)
            _assert_matches(client, table, ref, f"after push {step}")
        assert evictions > 20  # The table was full, and kept evicting.


def test_refused_and_skipped_pushes_change_nothing(server_target):
    """A push of more unique keys than the capacity is InvalidArgument naming the capacity; one
    with a non-finite gradient is skipped. Neither changes a bit of the table, nor which keys
    it holds: the new keys they named stay unheld, and later pushes place keys as if they had
    never come."""
    prefix, group = "hashed.refused.", "hashed.refused"
    capacity, dim, seed, init_std = 8, 4, 7, 0.5
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, weight_decay=0.0, **HYPER)
        client.register_hashed_table("emb", capacity, dim, seed=seed, init_std=init_std,
                                     param_group=group, prefix=prefix)
        table = prefix + "emb"
        ref = HashedTableReference(capacity, dim, seed, init_std, **HYPER)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            keys = torch.tensor(UNIVERSE[:6], dtype=torch.int64)
            grads = torch.randn(6, dim, generator=gen)
            client.push_rows({"emb": (keys, grads)}, prefix=prefix)
            ref.push(keys, grads)

        def state():
            digest = hashlib.sha256()
            for field in FIELDS:
                digest.update(client.lookup_rows(table, UNIVERSE, field=field).rows.numpy())
            digest.update(client.pull_parameters([table])[table].numpy())
            return digest.hexdigest(), client.list_tensors().version

        before = state()
        too_many = torch.tensor(UNIVERSE[:capacity + 1], dtype=torch.int64)
        with pytest.raises(fusedps.errors.InvalidArgument, match="capacity of 8 rows"):
            client.push_rows({"emb": (too_many, torch.ones(capacity + 1, dim))}, prefix=prefix)
        assert state() == before
        new_keys = torch.tensor([UNIVERSE[20], UNIVERSE[21], UNIVERSE[0]], dtype=torch.int64)
        bad = torch.ones(3, dim)
        bad[1, 2] = float("inf")
        result = client.push_rows({"emb": (new_keys, bad)}, prefix=prefix)
        assert result.step_skipped
        assert state() == before
        # The skipped push's new keys are not held: their lookups are the initializer's.
        got = client.lookup_rows(table, new_keys[:2])
        torch.testing.assert_close(
            got.rows, torch.stack([init_row(seed, int(k), init_std, dim) for k in new_keys[:2]]),
            rtol=RTOL, atol=ATOL)
        # Later pushes place keys as the reference, which never saw the two above.
        for _ in range(3):
            keys = torch.tensor(UNIVERSE[4:12], dtype=torch.int64)
            grads = torch.randn(8, dim, generator=gen)
            client.push_rows({"emb": (keys, grads)}, prefix=prefix)
            ref.push(keys, grads)
        _assert_matches(client, table, ref, "after the refused and skipped pushes")


def test_registration_of_hashed_tables(server_target):
    """Registering the same hashed table again is a no-op; another seed or init_std is
    AlreadyExists; a group a table cannot have (bf16 params) is InvalidArgument, one with int8
    state is not; the client refuses bad arguments before sending; load_state refuses a hashed
    table."""
    prefix, group = "hashed.register.", "hashed.register"
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, **HYPER)
        first = client.register_hashed_table("emb", 32, 4, seed=1, init_std=0.02,
                                             param_group=group, prefix=prefix)
        assert first.tensors_created == 1
        again = client.register_hashed_table("emb", 32, 4, seed=1, init_std=0.02,
                                             param_group=group, prefix=prefix)
        assert (again.tensors_created, again.tensors_existing) == (0, 1)
        with pytest.raises(fusedps.errors.AlreadyExists, match="seed 1"):
            client.register_hashed_table("emb", 32, 4, seed=2, init_std=0.02,
                                         param_group=group, prefix=prefix)
        with pytest.raises(fusedps.errors.AlreadyExists, match="hashed"):
            client.register_table("emb", torch.zeros(32, 4), param_group=group, prefix=prefix)
        client.register_param_group(group + ".bf16p", params_dtype="bf16", **HYPER)
        with pytest.raises(fusedps.errors.InvalidArgument, match="param_group"):
            client.register_hashed_table("bf16p", 8, 4, param_group=group + ".bf16p",
                                         prefix=prefix)
        assert prefix + "bf16p" not in [t.name for t in client.list_tensors()]
        # int8 state is accepted (test_int8_tables.py): under 4096 elements it is fp32.
        client.register_param_group(group + ".int8", state_dtype="int8", **HYPER)
        for name, capacity in (("int8", 8), ("int8big", 1024)):
            assert client.register_hashed_table(name, capacity, 4, param_group=group + ".int8",
                                                prefix=prefix).tensors_created == 1
        listed = {t.name: t.state_dtype for t in client.list_tensors()}
        assert (listed[prefix + "int8"], listed[prefix + "int8big"]) == ("fp32", "int8")
        for bad in (dict(capacity=-1), dict(dim=0), dict(init_std=-1.0),
                    dict(init_std=float("nan")), dict(seed=-1)):
            args = dict(capacity=8, dim=4, init_std=1.0, seed=0)
            args.update(bad)
            with pytest.raises(ValueError):
                client.register_hashed_table("bad", args.pop("capacity"), args.pop("dim"),
                                             param_group=group, prefix=prefix, **args)
        with pytest.raises(fusedps.errors.InvalidArgument, match="hashed embedding table"):
            client.load_state({prefix + "emb": {"param": torch.zeros(32, 4)}}, steps={
                prefix + "emb": 0})


def _pushes(count: int, seed: int) -> List:
    """``count`` pushes of the fault test's rows: (keys, grads) for a table of dim 4."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        keys = _push_keys(gen, 8, 3)
        out.append((keys, torch.randn(keys.numel(), 4, generator=gen)))
    return out


def _table_digest(client, table: str) -> str:
    """sha256 of what a hashed table serves: every key of UNIVERSE in each field (so which
    keys it holds, evicted ones reading as the initializer's), and its slots."""
    digest = hashlib.sha256()
    for field in FIELDS:
        got = client.lookup_rows(table, UNIVERSE, field=field)
        digest.update(got.rows.numpy())
        digest.update(int(got.step).to_bytes(8, "little"))
    return digest.hexdigest()


def _register(client) -> None:
    client.register_param_group("fault", **HYPER)
    client.register_hashed_table("emb", 12, 4, seed=99, init_std=0.05, param_group="fault")


def test_sigkill_during_hashed_pushes_restarts_bit_exact_at_the_checkpoint(tmp_path):
    """Issue 38's fault test: a server SIGKILLed while pushes to a hashed table (12 slots, keys
    from 40 ids: every push evicts) are in flight restarts from its last checkpoint with the
    table bit for bit as it was at the checkpoint, evicted rows included (they read as the
    initializer's), and then goes on exactly as a server that never stopped: the same pushes
    after the checkpoint give the same table as on a fresh server that replays them all."""
    root = str(tmp_path / "ckpt")
    pushes = _pushes(60, seed=5)
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        client = fusedps.Client(server.target)
        _register(client)
        for keys, grads in pushes[:20]:
            client.push_rows({"emb": (keys, grads)})
        version, _ = client.checkpoint()
        at_checkpoint = (_table_digest(client, "emb"), shard_digest(client))
        evicted = server.metrics().value("fusedps_table_evictions_total",
                                         model="default", table="emb")
        assert evicted > 0
        assert server.metrics().value("fusedps_table_rows", model="default", table="emb") == 12
        stop = threading.Event()

        def more():  # Pushes after the cut, in flight at the kill: lost with the process.
            c = fusedps.Client(server.target)
            for keys, grads in pushes[20:]:
                if stop.is_set():
                    return
                try:
                    c.push_rows({"emb": (keys, grads)})
                except fusedps.errors.FusedPSError:
                    return

        thread = threading.Thread(target=more)
        thread.start()
        while client.list_tensors().version < version + 5:
            time.sleep(0.002)
        server.kill()
        stop.set()
        thread.join()

    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        client = fusedps.Client(restarted.target)
        assert client.list_tensors().version == version
        assert (_table_digest(client, "emb"), shard_digest(client)) == at_checkpoint
        for keys, grads in pushes[20:40]:
            client.push_rows({"emb": (keys, grads)})
        resumed = (_table_digest(client, "emb"), shard_digest(client)[0])

    with ServerProcess(["--restore=none"]) as fresh:
        client = fusedps.Client(fresh.target)
        _register(client)
        for keys, grads in pushes[:40]:
            client.push_rows({"emb": (keys, grads)})
        assert (_table_digest(client, "emb"), shard_digest(client)[0]) == resumed


def test_checkpoint_reads_a_hashed_table_as_keys_and_rows(tmp_path):
    """fusedps.checkpoint.hashed_tables reads a checkpoint's hashed table as the keys it holds
    with their rows, moments and stamps: the keys and stamps the reference's, the rows what
    the server's lookups of those keys read, bit for bit; the counters the server's."""
    pushes = _pushes(15, seed=8)
    ref = HashedTableReference(12, 4, 99, 0.05, **HYPER)
    with ServerProcess([f"--checkpoint-dir={tmp_path}"]) as server:
        client = fusedps.Client(server.target)
        _register(client)
        for keys, grads in pushes:
            client.push_rows({"emb": (keys, grads)})
            ref.push(keys, grads)
        client.lookup_rows("emb", UNIVERSE[:5])  # 5 lookups, some misses, before the cut.
        _, path = client.checkpoint()
        held = fusedps.checkpoint.hashed_tables(path)
        assert list(held) == ["emb"]
        got = held["emb"]
        assert sorted(got.keys.tolist()) == sorted(ref.slot_of)
        assert got.stamps.tolist() == [ref.stamp[ref.slot_of[int(k)]] for k in got.keys]
        assert (got.step, got.seed, got.init_std) == (15, 99, pytest.approx(0.05))
        assert got.evictions_total == ref.evictions and got.lookups_total == 5
        assert got.lookup_misses_total == sum(k not in ref.slot_of for k in UNIVERSE[:5])
        for field in FIELDS:
            served = client.lookup_rows("emb", got.keys, field=field).rows
            assert torch.equal(getattr(got, field), served), field
