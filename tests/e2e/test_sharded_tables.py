"""End-to-end: embedding tables striped over two shards (docs/sharding.md, "Embedding tables";
issue 38) through ShardedClient, on two real servers (CPU backend, or CUDA under
FUSEDPS_TEST_DEVICE=cuda).

The oracles: torch.optim.SparseAdam over the whole table (dense ids), and for a hashed table
one hashed_table_reference.HashedTableReference per shard, fed the keys that shard owns by the
documented rule (Mix64(key) mod 2), computed here with Python ints. Which shard holds which row
is checked on each server directly, through a plain Client. Tolerances as test_tables.py's.
"""

from __future__ import annotations

import pytest
import torch

import fusedps
from hashed_table_reference import HashedTableReference, _mix64
from server_fixture import running_server

RTOL = 1.3e-6
ATOL = 1e-5
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)


@pytest.fixture(scope="module")
def two_servers():
    with running_server() as a, running_server() as b:
        yield [a, b]


def test_dense_id_table_striped_over_two_shards_matches_sparse_adam(two_servers):
    """20 pushes of nn.Embedding(50, 8, sparse=True)'s uncoalesced gradients (duplicates in
    every batch) through a ShardedClient of two shards give SparseAdam's params and moments
    for every key; shard s holds rows s, s + 2, ... as its own rows 0, 1, ...; both shards'
    tables step on every push."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    optimizer = torch.optim.SparseAdam(emb.parameters(), **HYPER)
    gen = torch.Generator().manual_seed(1)
    with fusedps.ShardedClient(two_servers) as ps:
        ps.register_param_group("sharded.dense", weight_decay=0.0, **HYPER)
        results = ps.register_table("emb", emb.weight.detach(), param_group="sharded.dense",
                                    prefix="sharded.")
        assert [r.tensors_created for r in results] == [1, 1]
        for step in range(1, 21):
            idx = torch.randint(0, 50, (30,), generator=gen)
            idx = torch.cat([idx, idx[:10]])
            emb.weight.grad = None
            (emb(idx).tanh() * torch.randn(idx.numel(), 8, generator=gen)).sum().backward()
            pushed = ps.push_rows({"sharded.emb": emb.weight.grad})
            assert [r.step_skipped for r in pushed] == [False, False]
            optimizer.step()
        state = optimizer.state[emb.weight]
        want = {"param": emb.weight.detach(), "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"]}
        keys = torch.randperm(50, generator=gen)  # Any order, every key.
        for field, value in want.items():
            got = ps.lookup_rows("sharded.emb", keys, field=field)
            assert got.step == 20 and len(got.versions) == 2
            torch.testing.assert_close(got.rows, value[keys], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{field}: {m}")
        with pytest.raises(ValueError, match="outside"):
            ps.lookup_rows("sharded.emb", [50])
    for s, target in enumerate(two_servers):
        with fusedps.Client(target) as c:
            info = {t.name: t for t in c.list_tensors()}["sharded.emb"]
            assert info.shape == (25, 8) and info.step == 20
            got = c.lookup_rows("sharded.emb", torch.arange(25))
            torch.testing.assert_close(got.rows, emb.weight.detach()[s::2], rtol=RTOL, atol=ATOL)


def test_hashed_table_striped_over_two_shards_evicts_per_shard(two_servers):
    """A hashed table of capacity 20 over two shards (10 slots each) trained with keys from 40
    feature ids: each shard holds the keys Mix64(key) mod 2 gives it, evicts among them by the
    documented rules, and every key reads as the per-shard reference says."""
    universe = [-(2**63), -7, 0, 5, 2**40 + 1, 2**63 - 1] + [3000 + 101 * i for i in range(34)]
    seed, init_std, dim = 77, 0.3, 4
    refs = [HashedTableReference(10, dim, seed, init_std, **HYPER) for _ in range(2)]

    def owner(k: int) -> int:
        return _mix64(k & ((1 << 64) - 1)) % 2

    assert {owner(k) for k in universe} == {0, 1}
    gen = torch.Generator().manual_seed(4)
    with fusedps.ShardedClient(two_servers) as ps:
        ps.register_param_group("sharded.hashed", weight_decay=0.0, **HYPER)
        ps.register_hashed_table("words", 20, dim, seed=seed, init_std=init_std,
                                 param_group="sharded.hashed", prefix="sharded.")
        for _ in range(16):
            idx = torch.randint(0, len(universe), (12,), generator=gen)
            keys = torch.tensor([universe[i] for i in idx] + [universe[int(idx[0])]])
            grads = torch.randn(keys.numel(), dim, generator=gen)
            ps.push_rows({"sharded.words": (keys, grads)})
            for s in range(2):
                mine = torch.tensor([owner(int(k)) == s for k in keys])
                refs[s].push(keys[mine], grads[mine])
        for field in ("param", "exp_avg", "exp_avg_sq"):
            got = ps.lookup_rows("sharded.words", universe, field=field)
            want = torch.stack([refs[owner(k)].rows([k], field)[0] for k in universe])
            torch.testing.assert_close(got.rows, want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{field}: {m}")
    assert all(r.evictions > 0 for r in refs)
    for s, target in enumerate(two_servers):
        with fusedps.Client(target) as c:
            slots = c.pull_parameters(["sharded.words"])["sharded.words"]
            torch.testing.assert_close(slots, refs[s].slots(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"shard {s}'s slots: {m}")


def test_remote_embedding_bag_trains_over_a_sharded_client(two_servers):
    """fusedps.torch.RemoteEmbeddingBag on a ShardedClient (its table striped over both
    shards) with RemoteSparseAdam trains as nn.EmbeddingBag(sparse=True) with SparseAdam."""
    from fusedps.torch import RemoteEmbeddingBag, RemoteSparseAdam

    torch.manual_seed(3)
    local = torch.nn.EmbeddingBag(40, 6, mode="mean", sparse=True)
    local_opt = torch.optim.SparseAdam(local.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5)
    with fusedps.ShardedClient(two_servers) as ps:
        remote = RemoteEmbeddingBag(40, 6, mode="mean", client=ps, name="sharded.bag",
                                    _weight=local.weight.detach().clone())
        remote_opt = RemoteSparseAdam([remote], lr=0.05)
        for _ in range(10):
            idx = torch.randint(0, 40, (24,), generator=gen)
            offsets = torch.tensor([0, 5, 11, 17])
            target = torch.randn(4, 6, generator=gen)
            for module, opt in ((local, local_opt), (remote, remote_opt)):
                opt.zero_grad()
                ((module(idx, offsets) - target) ** 2).sum().backward()
                opt.step()
        got = ps.lookup_rows("sharded.bag", torch.arange(40)).rows
    torch.testing.assert_close(got, local.weight.detach(), rtol=RTOL, atol=ATOL)
