"""fusedps.torch.RemoteEmbedding, RemoteEmbeddingBag and RemoteSparseAdam against the local
modules they stand in for, on a real server (CPU, or CUDA
under FUSEDPS_TEST_DEVICE=cuda): torch.nn.Embedding(sparse=True) and
torch.nn.EmbeddingBag(sparse=True) with torch.optim.SparseAdam (the oracle), the dense rest of
the model with torch.optim.AdamW locally and fusedps.torch.RemoteAdamW remotely. Tolerance:
rtol=1.3e-6, atol=1e-5 (tests/e2e/test_parity.py's, torch's own for fused vs for-loop AdamW).
"""

from __future__ import annotations

import pytest
import torch

from fusedps.torch import (RemoteAdamW, RemoteEmbedding, RemoteEmbeddingBag, RemoteSparseAdam,
                           remote_tables)

RTOL = 1.3e-6
ATOL = 1e-5
ROWS, DIM = 40, 6


def _tokens(step: int, micro: int = 0) -> torch.Tensor:
    """A batch of 8 sequences of 5 keys, with repeats within and across sequences."""
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, ROWS // 2, (8, 5), generator=gen) * 2 % ROWS


class Model(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module, bag: bool):
        super().__init__()
        self.embedding = embedding
        self.bag = bag
        self.head = torch.nn.Linear(DIM, 3)

    def forward(self, tokens):
        h = self.embedding(tokens) if self.bag else self.embedding(tokens).mean(1)
        return self.head(torch.tanh(h))


def _pair(server_target: str, name: str, bag: bool, mode: str = "mean"):
    """(local model, its optimizers; remote model, its optimizers), equal at the start."""
    torch.manual_seed(5)
    weight = torch.randn(ROWS, DIM)
    if bag:
        local_emb = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=True, _weight=weight)
        remote_emb = RemoteEmbeddingBag(ROWS, DIM, name=name, mode=mode, target=server_target,
                                        _weight=weight)
    else:
        local_emb = torch.nn.Embedding(ROWS, DIM, sparse=True, _weight=weight)
        remote_emb = RemoteEmbedding(ROWS, DIM, name=name, target=server_target,
                                     _weight=weight)
    torch.manual_seed(6)
    local = Model(local_emb, bag)
    torch.manual_seed(6)
    remote = Model(remote_emb, bag)
    hyper = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    local_opts = [torch.optim.SparseAdam(list(local_emb.parameters()), **hyper),
                  torch.optim.AdamW(local.head.parameters(), foreach=False, **hyper)]
    remote_opts = [RemoteSparseAdam(remote_tables(remote), **hyper),
                   RemoteAdamW(remote.head.named_parameters(), targets=server_target,
                               prefix=name + ".", **hyper)]
    return local, local_opts, remote, remote_opts


def _train_step(model, opts, step: int, micro_batches: int = 1) -> None:
    for opt in opts:
        opt.zero_grad()
    for micro in range(micro_batches):
        tokens = _tokens(step, micro)
        target = tokens.sum(1) % 3
        torch.nn.functional.cross_entropy(model(tokens), target).backward()
    for opt in opts:
        opt.step()


def _assert_same(local, remote, steps: int) -> None:
    name = remote.embedding.name
    rows = remote.embedding.client.lookup_rows(name, torch.arange(ROWS))
    assert rows.step == steps
    torch.testing.assert_close(rows.rows, local.embedding.weight.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(local.head.parameters(), remote.head.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bag,mode", [(False, None), (True, "mean"), (True, "sum")])
def test_trains_as_the_local_sparse_modules(server_target, bag, mode):
    name = f"remb.{bag}.{mode}"
    local, local_opts, remote, remote_opts = _pair(server_target, name, bag, mode or "mean")
    for step in range(20):
        _train_step(local, local_opts, step)
        _train_step(remote, remote_opts, step)
    _assert_same(local, remote, 20)
    with torch.no_grad():  # And they predict alike.
        tokens = _tokens(99)
        torch.testing.assert_close(remote(tokens), local(tokens), rtol=RTOL, atol=ATOL)
    remote_opts[1].close()
    remote.embedding.close()


def test_micro_batches_accumulate_and_a_scheduler_sets_the_lr(server_target):
    """Three forwards per step (the rows of each pushed together, as sparse gradients add),
    and an lr schedule; eval forwards push nothing and do not step the table."""
    local, local_opts, remote, remote_opts = _pair(server_target, "remb.accumulate", False)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
                 for o in local_opts + remote_opts]
    for step in range(10):
        _train_step(local, local_opts, step, micro_batches=3)
        _train_step(remote, remote_opts, step, micro_batches=3)
        for s in schedules:
            s.step()
    _assert_same(local, remote, 10)
    remote.eval()
    with torch.no_grad():
        remote(_tokens(50))
    remote_opts[0].step()  # Nothing looked up with a gradient: no push, no step.
    assert remote_opts[0].last_push_results == {}
    _assert_same(local, remote, 10)
    remote_opts[1].close()
    remote.embedding.close()


def test_a_key_outside_the_table_is_refused_naming_it(server_target):
    import fusedps

    emb = RemoteEmbedding(ROWS, DIM, name="remb.outside", target=server_target)
    with pytest.raises(fusedps.errors.InvalidArgument, match=r"keys\[1\] = 40 is outside"):
        emb(torch.tensor([3, 40]))
    with pytest.raises(ValueError, match="padding_idx"):
        RemoteEmbedding(ROWS, DIM, name="remb.padding", target=server_target, padding_idx=0)
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        RemoteEmbeddingBag(ROWS, DIM, name="remb.max", target=server_target, mode="max")
    emb.close()


def test_tables_of_one_client_are_one_push_based_on_their_lookups(server_target):
    """In a bounded model (max_staleness 1), two tables on one client train for 6 steps beside
    local SparseAdam: each step is one push of both tables (the version advances by one, one
    PushResult for both), based on the version the rows were looked up at; the client never
    pulls, so a push based on its last pull would be refused from the third step on."""
    import fusedps

    with fusedps.Client(server_target) as admin:
        admin.create_model("remb-bounded", mode="bounded", max_staleness=1)
    client = fusedps.Client(server_target, model="remb-bounded")
    torch.manual_seed(11)
    weights = [torch.randn(ROWS, DIM), torch.randn(ROWS // 2, DIM)]
    remote = [RemoteEmbedding(ROWS, DIM, name="a", client=client, _weight=weights[0]),
              RemoteEmbedding(ROWS // 2, DIM, name="b", client=client, _weight=weights[1])]
    local = [torch.nn.Embedding(w.shape[0], DIM, sparse=True, _weight=w.clone()) for w in weights]
    hyper = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    remote_opt = RemoteSparseAdam(remote, **hyper)
    local_opt = torch.optim.SparseAdam([e.weight for e in local], **hyper)
    version = None
    for step in range(6):
        tokens = _tokens(step)
        for embs, opt in ((remote, remote_opt), (local, local_opt)):
            opt.zero_grad()
            (embs[0](tokens).tanh().sum() + embs[1](tokens // 2).sin().sum()).backward()
            opt.step()
        results = remote_opt.last_push_results
        assert results["a"] is results["b"], f"step {step}: two pushes"
        assert results["a"].tensors_updated == 2
        if version is not None:
            assert results["a"].version == version + 1
        version = results["a"].version
    for emb, loc in zip(remote, local):
        rows = client.lookup_rows(emb.name, torch.arange(loc.num_embeddings))
        assert rows.step == 6
        torch.testing.assert_close(rows.rows, loc.weight.detach(), rtol=RTOL, atol=ATOL)
    client.close()
