"""RemoteAdamW(overlap=True) with each step's pull carried by its commit (PushCommit.pull,
OverlapEngine.pull_with_commit: a device workspace's default), against torch.optim.AdamW, on a
CPU server through a host workspace (the same protocol; the CPU server writes the params into
the shared memory before it replies). test_overlap.py runs every recipe this way; here: the
grpcio transport, a duplicate's reply that carries no pull, and the negative control (the
commit that claims its pull without the server writing it must fail the parity check).
"""

from __future__ import annotations

import dataclasses

import pytest

from fusedps import _pull_pipeline, _push_transaction
from fusedps.torch import RemoteAdamW
from test_overlap import STEPS, Mlp, loss_of, lrs_sent_before_step, run_recipe


def test_over_grpcio_the_commit_carries_the_pull(server_target):
    """The grpcio transport's commit (WorkspaceTransactionImpl) carries the pull too."""
    run_recipe(server_target, "clip", prefix="commit-pull-grpcio/", transport="grpcio",
               push_during_backward=False, pull_with_commit=True)


def test_a_commit_whose_reply_carries_no_pull_is_pulled_as_usual(server_target, monkeypatch):
    """A reply without a pull (pulled_version 0, as a duplicate's from the retry table) makes
    the step pull as it does without the commit's pull: the same results, nothing carried."""
    commit = _push_transaction.PushTransaction.commit

    def without_pull(self, grad_scale=None, then_pull=None):
        return commit(self, grad_scale)

    monkeypatch.setattr(_push_transaction.PushTransaction, "commit", without_pull)
    run_recipe(server_target, "plain", prefix="commit-pull-none/", push_during_backward=False,
               pull_with_commit=True, expect_carried=False)


def test_a_pull_claimed_without_the_servers_write_fails_parity(server_target, monkeypatch):
    """The control: the commit goes without its pull but reports one (pulled_version set), so
    the loop trains on whatever the landing buffer held: the parity check must fail."""
    commit = _push_transaction.PushTransaction.commit

    def claimed(self, grad_scale=None, then_pull=None):
        result = commit(self, grad_scale)
        return dataclasses.replace(result, pulled_version=result.version)

    monkeypatch.setattr(_push_transaction.PushTransaction, "commit", claimed)
    with pytest.raises(AssertionError):
        run_recipe(server_target, "plain", prefix="commit-pull-claimed/",
                   push_during_backward=False, pull_with_commit=True)
    assert STEPS > 1


def test_step_lands_a_carried_pull_and_begins_the_next_push(server_target):
    """With the pull carried by the commit, step() lands it (nothing is left for the next
    forward's hooks) and begins the next push (pushed at step(); not in the next forward,
    where the worker's Python would take the interpreter lock from the forward)."""
    model = Mlp(2)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="commit-pull-land/",
                      overlap=True, data_plane="workspace", push_during_backward=False, lr=0.01)
    opt._overlap.pull_with_commit = True
    try:
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            opt.step()
            assert opt._overlap.pulls._pull is None, "the carried pull was left to the forward"
            assert opt._overlap._step.begun is not None, "the next push was not begun"
        assert opt._overlap.pulls.carried == 3
    finally:
        opt.close()


@pytest.mark.parametrize("deferred", [True, False])
def test_with_a_carried_pull_the_next_lr_goes_at_the_next_forward(server_target, monkeypatch,
                                                                  deferred):
    """step() lands a carried pull, but the scheduler sets the next lr after step(): it is
    sent at the next forward's first module (on_landed, deferred), before step(), so the
    commit sends nothing. The control, with on_landed called in step() as for any landing,
    sends each lr at step()."""
    if not deferred:
        monkeypatch.setattr(_pull_pipeline.PullPipeline, "land_carried",
                            lambda self: self.wait() is None and False)
    assert lrs_sent_before_step(
        server_target, f"commit-pull-lr-{deferred}/", pull_with_commit=True,
        data_plane="workspace", push_during_backward=False) == [deferred] * 5
