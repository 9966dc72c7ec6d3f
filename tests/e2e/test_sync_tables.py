"""End-to-end: embedding tables in sync mode (docs/consistency.md, docs/api.md "Embedding
tables") on a real server (the CPU backend, or the CUDA one under FUSEDPS_TEST_DEVICE=cuda).

Two trainer threads, each its own Client and client_id, push every round with push_rows: rows
of a dense-id table and of a hashed one, and a dense tensor's gradient, in one push. A round is
one step on the mean of its two pushes. The oracles, computed here from the same data:
torch.optim.SparseAdam on the mean sparse gradient (both trainers' rows concatenated, each
halved: SparseAdam sums the duplicates) for the dense-id table, HashedTableReference (the
documented slot rules, SparseAdam over the slots) on the same for the hashed one, and
torch.optim.AdamW (foreach=False) on the mean dense gradient. Tolerances are test_tables.py's.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
import torch

import fusedps
from hashed_table_reference import HashedTableReference
from server_fixture import running_server

RTOL = 1.3e-6
ATOL = 1e-5
FIELDS = ("param", "exp_avg", "exp_avg_sq")
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)
ROWS, DIM = 40, 8
CAPACITY, HDIM, SEED, INIT_STD = 12, 4, 7, 0.1
UNIVERSE = [k * 1_000_003 - 9 for k in range(24)]  # Hashed feature ids: twice the slots.
TRAINERS = 2
SCALE = 4.0  # Trainer 0 pushes its gradients times SCALE with grad_scale=SCALE (GradScaler).


def _batch(gen: torch.Generator, high: int, n: int, repeats: int) -> torch.Tensor:
    idx = torch.randint(0, high, (n,), generator=gen)
    idx = torch.cat([idx, idx[:repeats]])  # Duplicates in every push.
    return idx[torch.randperm(idx.numel(), generator=gen)]


def _gradients(step: int, rank: int):
    """Trainer `rank`'s gradients at `step`: (dense-id keys, rows), (hashed keys, rows), the
    dense tensor's."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    keys = _batch(gen, ROWS, 6, 3)
    hashed = torch.tensor([UNIVERSE[i] for i in _batch(gen, len(UNIVERSE), 4, 2)])
    return ((keys, torch.randn(keys.numel(), DIM, generator=gen)),
            (hashed, torch.randn(hashed.numel(), HDIM, generator=gen)),
            torch.randn(5, 3, generator=gen))


@pytest.fixture(scope="module")
def sync_target():
    with running_server(["--mode=sync", f"--total-replicas={TRAINERS}",
                         "--round-timeout-seconds=60"]) as target:
        yield target


def test_sync_rounds_of_table_rows_step_the_mean_of_the_pushes(sync_target):
    """20 rounds of two trainers, each pushing rows of both tables and the dense tensor in one
    push (trainer 0 with grad_scale, its gradients scaled up): after every round each table's
    params and moments (every row, every field) and the dense tensor follow the oracles on the
    mean; the tables' steps are the rounds'. Round 8 has a non-finite row gradient in one push:
    the whole round is skipped for both, and nothing changes."""
    group, skipped_round = "sync.tables", 8
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
    dense0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(fusedps.Client(sync_target))
        admin.register_param_group(group, weight_decay=0.0, **HYPER)
        admin.register_table("emb", init, param_group=group)
        admin.register_hashed_table("h", CAPACITY, HDIM, seed=SEED, init_std=INIT_STD,
                                    param_group=group)
        admin.register_model({"w": dense0}, param_group=group)
        clients = [stack.enter_context(fusedps.Client(sync_target, client_id=f"trainer-{r}"))
                   for r in range(TRAINERS)]
        pool = stack.enter_context(ThreadPoolExecutor(TRAINERS))

        weight = torch.nn.Parameter(init.clone())
        sparse_adam = torch.optim.SparseAdam([weight], **HYPER)
        dense = torch.nn.Parameter(dense0.clone())
        adamw = torch.optim.AdamW([dense], weight_decay=0.0, foreach=False, **HYPER)
        hashed = HashedTableReference(CAPACITY, HDIM, SEED, INIT_STD, **HYPER)
        version, steps, evictions = admin.pull_parameters(["w"]).version, 0, 0

        def push(rank: int, step: int, barrier: threading.Barrier):
            (keys, rows), (hkeys, hrows), g = _gradients(step, rank)
            if step == skipped_round and rank == 1:
                rows = rows.clone()
                rows[2, 1] = float("inf")
            scale = SCALE if rank == 0 else None
            factor = SCALE if rank == 0 else 1.0
            barrier.wait(timeout=30)
            return clients[rank].push_rows(
                {"emb": (keys, rows * factor), "h": (hkeys, hrows * factor)},
                dense={"w": g * factor}, grad_scale=scale, sequence_number=step + 1,
                base_version=version)

        for step in range(20):
            barrier = threading.Barrier(TRAINERS)
            results = list(pool.map(lambda r: push(r, step, barrier), range(TRAINERS)))
            skipped = step == skipped_round
            for rank, r in enumerate(results):
                where = f"round {step}, trainer {rank}"
                assert r.round_workers == TRAINERS, where
                assert r.step_skipped == skipped, where
                assert r.version == version + (0 if skipped else 1), where
                assert r.tensors_updated == (0 if skipped else 3), where
            if not skipped:
                version += 1
                steps += 1
                grads = [_gradients(step, rank) for rank in range(TRAINERS)]
                weight.grad = torch.sparse_coo_tensor(
                    torch.cat([k for (k, _), _, _ in grads]).unsqueeze(0),
                    torch.cat([v / TRAINERS for (_, v), _, _ in grads]), (ROWS, DIM))
                sparse_adam.step()
                evictions += hashed.push(torch.cat([k for _, (k, _), _ in grads]),
                                         torch.cat([v / TRAINERS for _, (_, v), _ in grads]))
                dense.grad = sum(g for _, _, g in grads) / TRAINERS
                adamw.step()
            state = sparse_adam.state[weight]
            want = {"param": weight.detach(), "exp_avg": state["exp_avg"],
                    "exp_avg_sq": state["exp_avg_sq"]}
            for field in FIELDS:
                got = admin.lookup_rows("emb", torch.arange(ROWS), field=field)
                assert got.step == steps and got.version == version
                torch.testing.assert_close(got.rows, want[field], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"emb {field}, round {step}: {m}")
                got = admin.lookup_rows("h", UNIVERSE, field=field)
                assert got.step == steps
                torch.testing.assert_close(got.rows, hashed.rows(UNIVERSE, field), rtol=RTOL,
                                           atol=ATOL,
                                           msg=lambda m: f"h {field}, round {step}: {m}")
            torch.testing.assert_close(admin.pull_parameters(["w"])["w"], dense.detach(),
                                       rtol=RTOL, atol=ATOL)
        assert evictions > 10  # The hashed table was full, and the rounds evicted.


def test_a_push_beyond_a_hashed_tables_capacity_in_a_round_is_refused(sync_target):
    """A push whose new keys would bring the round's unique keys of a hashed table above its
    capacity is InvalidArgument naming the table and the capacity; the round goes on without
    it, and the trainer's next push (fewer keys) joins it. Two trainers push 4 and 3 keys of a
    6-slot table at once: whichever comes second is refused (its keys would make 7)."""
    group = "sync.capacity"
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(fusedps.Client(sync_target))
        admin.register_param_group(group, weight_decay=0.0, **HYPER)
        admin.register_hashed_table("cap", 6, 2, seed=1, init_std=0.1, param_group=group,
                                    prefix="sync.")
        clients = [stack.enter_context(fusedps.Client(sync_target, client_id=f"cap-{r}"))
                   for r in range(TRAINERS)]
        version = admin.pull_parameters(["sync.cap"]).version
        keys = [[1, 2, 3, 4], [5, 6, 7]]
        pool = stack.enter_context(ThreadPoolExecutor(TRAINERS))
        pushes = [pool.submit(clients[r].push_rows,
                              {"cap": (torch.tensor(keys[r]), torch.ones(len(keys[r]), 2))},
                              prefix="sync.", sequence_number=1, base_version=version)
                  for r in range(TRAINERS)]
        done, _ = wait(pushes, timeout=30, return_when=FIRST_COMPLETED)
        assert len(done) == 1, "one push waits in the round, the other is refused"
        refused = pushes.index(done.pop())
        with pytest.raises(fusedps.errors.InvalidArgument,
                           match=r"table 'sync.cap': the sync round's pushes would name 7 unique "
                                 r"keys \(\d new in this push\), above the table's capacity of 6"):
            pushes[refused].result()
        joined = clients[refused].push_rows({"cap": ([4, 5], torch.ones(2, 2))}, prefix="sync.",
                                            sequence_number=2, base_version=version)
        first = pushes[1 - refused].result(timeout=30)
        assert first.round_workers == joined.round_workers == TRAINERS
        assert first.version == joined.version == version + 1
        assert admin.lookup_rows("sync.cap", [1]).step == 1
        # The round's keys hold a slot each; the refused push's took none: the other slots are
        # free (zeros, as a pull reads a free slot).
        held = set(keys[1 - refused]) | {4, 5}
        slots = admin.pull_parameters(["sync.cap"])["sync.cap"]
        assert int((slots.abs().sum(1) == 0).sum()) == 6 - len(held)
