"""End-to-end: dense-id embedding tables (docs/api.md, "Embedding tables") on a real server
(the CPU backend, or the CUDA one under FUSEDPS_TEST_DEVICE=cuda), through Client.register_table, push_rows and lookup_rows.

The oracle is torch.optim.SparseAdam (its state after the same sparse gradients, pushed
uncoalesced as nn.Embedding(sparse=True) makes them), torch.optim.AdamW (foreach=False) for the
dense tensors of the same pushes, and a float64 SparseAdam written here from the formulas for
the decoupled weight decay SparseAdam lacks. Tolerance: rtol=1.3e-6, atol=1e-5, PyTorch's own
for fused vs for-loop AdamW (as tests/e2e/test_parity.py); steps exactly; what must not change
(rows not pushed, a refused push) bit for bit.

Every test registers its own names (a prefix of its own) in a param group of its own, so one
server serves the module.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

import fusedps
from fusedps import _native

RTOL = 1.3e-6
ATOL = 1e-5
FIELDS = ("param", "exp_avg", "exp_avg_sq")
# push_rows and lookup_rows go over grpcio on either transport; the rest of a client on the
# native one (its pulls, say) goes through the C++ client.
TRANSPORTS = ["grpcio", pytest.param("native", marks=pytest.mark.skipif(
    _native.library() is None, reason=f"no native library: {_native.load_error()}"))]


def _batch(gen: torch.Generator, rows: int, n: int, repeats: int,
           high: int = 0) -> torch.Tensor:
    """n random row indices in [0, high or rows), then the first ``repeats`` of them again
    (so that every batch has duplicate keys), shuffled."""
    idx = torch.randint(0, high or rows, (n,), generator=gen)
    idx = torch.cat([idx, idx[:repeats]])
    return idx[torch.randperm(idx.numel(), generator=gen)]


def _embedding_grad(emb: torch.nn.Embedding, idx: torch.Tensor,
                    gen: torch.Generator) -> torch.Tensor:
    """Runs a forward and backward through ``emb`` at ``idx`` (each occurrence of a key gets a
    gradient row of its own) and returns its sparse, uncoalesced weight.grad."""
    emb.weight.grad = None
    coeffs = torch.randn(idx.numel(), emb.embedding_dim, generator=gen)
    (emb(idx).tanh() * coeffs).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.is_sparse and not grad.is_coalesced()
    return grad


def _all_rows(client: fusedps.Client, table: str, rows: int, field: str = "param"):
    return client.lookup_rows(table, torch.arange(rows), field=field)


def _assert_table_matches(client, table: str, weight: torch.Tensor, state: Dict, step: int):
    """The server's table (params and both moments, all rows) against torch's."""
    rows = weight.shape[0]
    want = {"param": weight.detach(), "exp_avg": state["exp_avg"],
            "exp_avg_sq": state["exp_avg_sq"]}
    for field in FIELDS:
        got = _all_rows(client, table, rows, field)
        assert got.step == step, field
        assert got.rows.dtype == torch.float32 and got.rows.shape == weight.shape
        torch.testing.assert_close(got.rows, want[field].float(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{table} {field} after {step} steps: {m}")


def test_sparse_adam_parity(server_target):
    """24 pushes of nn.Embedding(50, 8, sparse=True)'s uncoalesced gradients (batches with
    duplicate keys, some rows left out of each) give torch.optim.SparseAdam's params,
    exp_avg and exp_avg_sq; the table's step is 24 and each push advances the version by 1.
    max_chunk_bytes=2048 splits each push's rows over several TableRows messages."""
    prefix, group = "parity.", "tables.parity"
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    with fusedps.Client(server_target, max_chunk_bytes=2048) as client:
        client.register_param_group(group, weight_decay=0.0, **hyper)
        registered = client.register_table("emb", emb.weight.detach(), param_group=group,
                                           prefix=prefix)
        assert registered.tensors_created == 1
        before = client.lookup_rows(prefix + "emb", torch.arange(50))
        assert before.step == 0 and torch.equal(before.rows, emb.weight.detach())
        optimizer = torch.optim.SparseAdam(emb.parameters(), **hyper)
        gen = torch.Generator().manual_seed(1)
        version = before.version
        for step in range(1, 25):
            idx = _batch(gen, 50, 40, 20)  # 60 rows of 40 bytes: more than one message
            grad = _embedding_grad(emb, idx, gen)
            result = client.push_rows({"emb": grad}, prefix=prefix)
            assert not result.step_skipped and not result.duplicate
            assert result.tensors_updated == 1
            assert result.version == version + 1
            version = result.version
            optimizer.step()
            got = client.lookup_rows(prefix + "emb", torch.arange(50))
            assert got.step == step and got.version == version
            torch.testing.assert_close(got.rows, emb.weight.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"param after step {step}: {m}")
        _assert_table_matches(client, prefix + "emb", emb.weight, optimizer.state[emb.weight],
                              24)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dense_and_table_in_one_push(server_target, transport):
    """A push of a dense tensor's gradient and a table's rows is one step of both: the dense
    tensor follows torch.optim.AdamW (foreach=False), the table SparseAdam, tensors_updated is
    2 and the version advances by 1 per push. On a client of either transport."""
    prefix, group = f"mixed.{transport}.", f"tables.mixed.{transport}"
    lr, betas, eps = 0.005, (0.9, 0.999), 1e-8
    torch.manual_seed(2)
    emb = torch.nn.Embedding(30, 6, sparse=True)
    proj = torch.nn.Linear(6, 4, bias=False)
    with fusedps.Client(server_target, transport=transport, streams=2) as client:
        assert client.transport_in_use == transport
        client.register_param_group(group, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        client.register_model({"proj": proj.weight}, param_group=group, prefix=prefix)
        client.register_table("emb", emb.weight.detach(), param_group=group, prefix=prefix)
        sparse = torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=betas, eps=eps)
        dense = torch.optim.AdamW([proj.weight], lr=lr, betas=betas, eps=eps,
                                  weight_decay=0.0, foreach=False)
        gen = torch.Generator().manual_seed(3)
        version = client.info().version
        for step in range(1, 9):
            idx = _batch(gen, 30, 16, 6)
            emb.weight.grad = None
            proj.weight.grad = None
            proj(emb(idx)).square().mean().backward()
            result = client.push_rows({"emb": emb.weight.grad},
                                      dense={"proj": proj.weight.grad}, prefix=prefix)
            assert not result.step_skipped
            assert result.tensors_updated == 2
            assert result.version == version + 1
            version = result.version
            sparse.step()
            dense.step()
        pulled = client.pull_parameters([prefix + "proj"])
        assert pulled.steps[prefix + "proj"] == 8
        torch.testing.assert_close(pulled[prefix + "proj"], proj.weight.detach(), rtol=RTOL,
                                   atol=ATOL)
        for field in ("exp_avg", "exp_avg_sq"):
            state, _, steps = client.pull_state(field, [prefix + "proj"])
            torch.testing.assert_close(state[prefix + "proj"], dense.state[proj.weight][field],
                                       rtol=RTOL, atol=ATOL, msg=lambda m: f"{field}: {m}")
        _assert_table_matches(client, prefix + "emb", emb.weight, sparse.state[emb.weight], 8)


def test_decoupled_weight_decay_of_pushed_rows(server_target):
    """weight_decay=0.1: each pushed row decays (param -= lr * wd * param) before SparseAdam's
    step, against a float64 reference written from the formulas; 20 pushes of (keys, grads)
    pairs as lists of ints, in bfloat16 with a grad_scale. Rows never pushed stay bit-identical
    (params) and zero (moments)."""
    prefix, group = "decay.", "tables.decay"
    rows, dim, pushed_rows = 48, 5, 40
    lr, b1, b2, eps, wd, scale = 0.02, 0.8, 0.95, 1e-6, 0.1, 4.0
    gen = torch.Generator().manual_seed(4)
    init = torch.randn(rows, dim, generator=gen)
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        client.register_table("t", init, param_group=group, prefix=prefix)
        param = init.double()
        exp_avg = torch.zeros(rows, dim, dtype=torch.float64)
        exp_avg_sq = torch.zeros(rows, dim, dtype=torch.float64)
        for step in range(1, 21):
            keys = _batch(gen, rows, 12, 5, high=pushed_rows)
            grads = torch.randn(keys.numel(), dim, generator=gen)
            result = client.push_rows({"t": (keys.tolist(), grads * scale)},
                                      grad_dtype="bfloat16", grad_scale=scale, prefix=prefix)
            assert not result.step_skipped and result.tensors_updated == 1
            # The reference: what the server receives (bf16 of the scaled grads, divided by the
            # scale: exact, a power of two), duplicates summed, then SparseAdam with decay.
            received = (grads * scale).to(torch.bfloat16).double() / scale
            g = torch.zeros(rows, dim, dtype=torch.float64).index_add_(0, keys, received)
            k = torch.unique(keys)
            gk = g[k]
            param[k] -= lr * wd * param[k]
            exp_avg[k] = b1 * exp_avg[k] + (1 - b1) * gk
            exp_avg_sq[k] = b2 * exp_avg_sq[k] + (1 - b2) * gk * gk
            step_size = lr * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step)
            param[k] -= step_size * exp_avg[k] / (exp_avg_sq[k].sqrt() + eps)
        want = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        for field in FIELDS:
            got = _all_rows(client, prefix + "t", rows, field)
            assert got.step == 20
            torch.testing.assert_close(got.rows, want[field].float(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{field}: {m}")
            if field == "param":
                assert torch.equal(got.rows[pushed_rows:], init[pushed_rows:])
            else:
                assert torch.equal(got.rows[pushed_rows:], torch.zeros(rows - pushed_rows, dim))


def _snapshot(client, prefix: str, tables: Dict[str, int], dense: List[str]) -> Tuple:
    """Every field of every table (all rows) and dense tensor, their steps, and the version."""
    out = {}
    for name, rows in tables.items():
        for field in FIELDS:
            got = _all_rows(client, prefix + name, rows, field)
            out[name, field] = (got.rows, got.step)
    for field in FIELDS:
        values, _, steps = client.pull_state(field, [prefix + n for n in dense])
        for name in dense:
            out[name, field] = (values[prefix + name], steps[prefix + name])
    return out, client.info().version


def _assert_same(before, after):
    (values, version), (now, version_now) = before, after
    assert version_now == version
    assert values.keys() == now.keys()
    for key, (tensor, step) in values.items():
        assert now[key][1] == step, key
        assert torch.equal(now[key][0], tensor), key


def test_a_refused_push_changes_nothing(server_target):
    """Pushes the server refuses (a key outside [0, rows), a dense tensor named as a table, a
    table named as a dense tensor, rows of another dim, an unknown table) leave every table,
    dense tensor, step and the version bit-identical, also the other table and dense tensor
    of the same push; the messages name the key."""
    prefix, group = "refused.", "tables.refused"
    gen = torch.Generator().manual_seed(5)
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, lr=0.01, weight_decay=0.0)
        client.register_table("t", torch.randn(10, 4, generator=gen), param_group=group,
                              prefix=prefix)
        client.register_table("u", torch.randn(6, 4, generator=gen), param_group=group,
                              prefix=prefix)
        client.register_model({"d": torch.randn(3, generator=gen)}, param_group=group,
                              prefix=prefix)
        # One good push first, so that the state is not all zeros.
        client.push_rows({"t": ([1, 2, 2], torch.randn(3, 4, generator=gen)),
                          "u": ([5], torch.randn(1, 4, generator=gen))},
                         dense={"d": torch.randn(3, generator=gen)}, prefix=prefix)
        tables, dense = {"t": 10, "u": 6}, ["d"]
        before = _snapshot(client, prefix, tables, dense)
        good_u = ([0, 3], torch.randn(2, 4, generator=gen))
        with pytest.raises(fusedps.errors.InvalidArgument,
                           match=r"keys\[1\] = 10 is outside \[0, 10\)"):
            client.push_rows({"u": good_u, "t": ([3, 10], torch.randn(2, 4, generator=gen))},
                             dense={"d": torch.randn(3, generator=gen)}, prefix=prefix)
        with pytest.raises(fusedps.errors.InvalidArgument, match=r"keys\[0\] = -1 is outside"):
            client.push_rows({"t": ([-1, 4], torch.randn(2, 4, generator=gen))}, prefix=prefix)
        with pytest.raises(fusedps.errors.InvalidArgument, match="refused.d"):
            client.push_rows({"u": good_u, "d": ([0], torch.randn(1, 3, generator=gen))},
                             prefix=prefix)
        with pytest.raises(fusedps.errors.InvalidArgument, match="refused.t"):
            client.push_rows({"u": good_u}, dense={"t": torch.randn(10, 4, generator=gen)},
                             prefix=prefix)
        with pytest.raises(fusedps.errors.InvalidArgument):
            client.push_rows({"t": ([1], torch.randn(1, 3, generator=gen))}, prefix=prefix)
        with pytest.raises(fusedps.errors.NotFound):
            client.push_rows({"no_such_table": ([1], torch.randn(1, 4, generator=gen))},
                             prefix=prefix)
        with pytest.raises(fusedps.errors.InvalidArgument, match=r"keys\[2\] = 10 is outside"):
            client.lookup_rows(prefix + "t", [0, 9, 10])
        with pytest.raises(fusedps.errors.InvalidArgument):
            client.lookup_rows(prefix + "d", [0])
        with pytest.raises(fusedps.errors.NotFound):
            client.lookup_rows(prefix + "no_such_table", [0])
        _assert_same(before, _snapshot(client, prefix, tables, dense))


def test_lookup_in_bfloat16_and_in_key_order(server_target):
    """Keys in any order, with repeats, come back row for row; bfloat16 rows are the float32
    rows rounded to nearest even; a whole-table pull gives the same rows."""
    prefix, group = "lookup.", "tables.lookup"
    gen = torch.Generator().manual_seed(6)
    with fusedps.Client(server_target, max_chunk_bytes=2048) as client:
        client.register_param_group(group, lr=0.05, weight_decay=0.0)
        client.register_table("t", torch.randn(20, 7, generator=gen), param_group=group,
                              prefix=prefix)
        for _ in range(3):
            keys = _batch(gen, 20, 10, 4)
            client.push_rows({"t": (keys, torch.randn(keys.numel(), 7, generator=gen))},
                             prefix=prefix)
        full = client.lookup_rows(prefix + "t", torch.arange(20))
        assert full.step == 3
        pulled = client.pull_parameters([prefix + "t"])
        assert torch.equal(pulled[prefix + "t"], full.rows)
        assert pulled.version == full.version
        # 200 keys of 7 floats: the reply spans several messages of 2048 bytes.
        keys = torch.cat([torch.tensor([7, 3, 7, 0, 19, 3]),
                          torch.randint(0, 20, (194,), generator=gen)])
        for key_form in (keys, keys.to(torch.int32), keys.tolist()):
            some = client.lookup_rows(prefix + "t", key_form)
            assert some.version == full.version and some.step == 3
            assert torch.equal(some.rows, full.rows[keys])
        for field in FIELDS:
            f32 = client.lookup_rows(prefix + "t", keys, field=field)
            bf16 = client.lookup_rows(prefix + "t", keys, field=field, dtype="bfloat16")
            assert bf16.rows.dtype == torch.bfloat16 and bf16.rows.shape == (200, 7)
            assert torch.equal(bf16.rows, f32.rows.to(torch.bfloat16)), field
            if field != "param":
                assert f32.rows.abs().sum() > 0, field  # pushed rows have moments


def test_a_table_named_without_rows_is_stepped(server_target):
    """A table given no rows is stepped all the same, as SparseAdam steps a param whose sparse
    gradient is empty: its step advances, no row changes (moments included), and the next
    push's bias correction counts on from it."""
    prefix, group = "empty.", "tables.empty"
    hyper = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8)
    torch.manual_seed(7)
    emb = torch.nn.Embedding(12, 3, sparse=True)
    gen = torch.Generator().manual_seed(8)
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, weight_decay=0.0, **hyper)
        client.register_table("t", emb.weight.detach(), param_group=group, prefix=prefix)
        optimizer = torch.optim.SparseAdam(emb.parameters(), **hyper)
        client.push_rows({"t": _embedding_grad(emb, _batch(gen, 12, 6, 3), gen)},
                         prefix=prefix)
        optimizer.step()
        before = {f: _all_rows(client, prefix + "t", 12, f) for f in FIELDS}
        result = client.push_rows({"t": ([], torch.zeros(0, 3))}, prefix=prefix)
        assert result.tensors_updated == 1 and not result.step_skipped
        assert result.version == before["param"].version + 1
        for field in FIELDS:
            after = _all_rows(client, prefix + "t", 12, field)
            assert after.step == 2 and torch.equal(after.rows, before[field].rows), field
        # torch's SparseAdam after an empty sparse gradient: its step count alone advances
        # (torch 1.13's SparseAdam cannot take an empty gradient: sparse_mask fails on it).
        optimizer.state[emb.weight]["step"] += 1
        client.push_rows({"t": _embedding_grad(emb, _batch(gen, 12, 6, 3), gen)},
                         prefix=prefix)
        optimizer.step()
        _assert_table_matches(client, prefix + "t", emb.weight, optimizer.state[emb.weight], 3)


def test_grad_bytes_count_the_rows(server_target):
    """PushResult.grad_bytes ("payload bytes received") counts a push's gradient rows: at
    least their grads' bytes, in the push's grad_dtype."""
    prefix, group = "bytes.", "tables.bytes"
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, weight_decay=0.0)
        client.register_table("t", torch.randn(10, 6), param_group=group, prefix=prefix)
        for grad_dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
            result = client.push_rows({"t": ([1, 2, 2, 9], torch.randn(4, 6))},
                                      grad_dtype=grad_dtype, prefix=prefix)
            assert result.grad_bytes >= 4 * 6 * itemsize, grad_dtype


def test_bf16_state_table_matches_sparse_adam_with_bf16_moments(server_target):
    """A table in a group with state_dtype bf16 stores its moments as bf16, rounded to nearest
    even after each update, the params fp32: 20 pushes give torch.optim.SparseAdam's params when
    its moments are rounded to bf16 after each of its steps (torch's .bfloat16() rounds to
    nearest even), and those moments exactly, widened to fp32 by the lookups."""
    prefix, group = "bf16state.", "tables.bf16state"
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    torch.manual_seed(6)
    emb = torch.nn.Embedding(40, 8, sparse=True)
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, weight_decay=0.0, state_dtype="bf16", **hyper)
        client.register_table("emb", emb.weight.detach(), param_group=group, prefix=prefix)
        info = {t.name: t for t in client.list_tensors()}[prefix + "emb"]
        assert (info.params_dtype, info.state_dtype) == ("fp32", "bf16")
        optimizer = torch.optim.SparseAdam(emb.parameters(), **hyper)
        gen = torch.Generator().manual_seed(7)
        for step in range(1, 21):
            grad = _embedding_grad(emb, _batch(gen, 40, 30, 10), gen)
            client.push_rows({"emb": grad}, prefix=prefix)
            optimizer.step()
            state = optimizer.state[emb.weight]
            for field in ("exp_avg", "exp_avg_sq"):
                state[field].copy_(state[field].bfloat16().float())
        state = optimizer.state[emb.weight]
        got = {f: _all_rows(client, prefix + "emb", 40, f).rows for f in FIELDS}
        torch.testing.assert_close(got["param"], emb.weight.detach(), rtol=RTOL, atol=ATOL)
        for field in ("exp_avg", "exp_avg_sq"):
            # The same fp32 ops as torch's, then the same rounding: the same bf16 values.
            assert torch.equal(got[field], state[field]), field


@pytest.mark.parametrize("storage", [
    dict(amsgrad=True), dict(params_dtype="bf16"),
    dict(params_dtype="bf16", state_dtype="int8", rounding_seed=3),
    dict(decoupled_weight_decay=False)])
def test_a_group_a_table_cannot_have_is_refused(server_target, storage):
    """A table's group must keep fp32 params, without amsgrad, with decoupled weight decay
    (any state_dtype: int8 state is accepted, test_int8_tables.py): registering a table in
    another is INVALID_ARGUMENT naming param_group, and registers nothing."""
    tag = "-".join(f"{k}.{v}" for k, v in storage.items())
    group, name = f"tables.refused-group.{tag}", f"refused-group.{tag}"
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, **storage)
        with pytest.raises(fusedps.errors.InvalidArgument, match="param_group"):
            client.register_table(name, torch.randn(4, 3), param_group=group)
        assert name not in [t.name for t in client.list_tensors()]


def test_a_group_with_int8_state_takes_tables(server_target):
    """A group with state_dtype int8 takes dense-id and hashed tables: those of 4096 elements or
    more report int8 state, smaller ones fp32 (as dense tensors); registering again is a no-op.
    (Their math: test_int8_tables.py.)"""
    group = "tables.int8-group"
    with fusedps.Client(server_target) as client:
        client.register_param_group(group, state_dtype="int8", weight_decay=0.0)
        shapes = {"int8-group.big": (64, 64), "int8-group.small": (63, 64),
                  "int8-group.odd": (111, 37)}
        for name, shape in shapes.items():
            assert client.register_table(name, torch.randn(shape),
                                         param_group=group).tensors_created == 1
        assert client.register_hashed_table("int8-group.hashed", 128, 32,
                                            param_group=group).tensors_created == 1
        again = client.register_table("int8-group.big", torch.randn(64, 64), param_group=group)
        assert (again.tensors_created, again.tensors_existing) == (0, 1)
        listed = {t.name: (t.table, t.params_dtype, t.state_dtype) for t in client.list_tensors()
                  if t.name.startswith("int8-group.")}
        assert listed == {"int8-group.big": (True, "fp32", "int8"),
                          "int8-group.small": (True, "fp32", "fp32"),
                          "int8-group.odd": (True, "fp32", "int8"),
                          "int8-group.hashed": (True, "fp32", "int8")}


def test_client_side_checks(server_target):
    """Mistakes the client sees raise ValueError / TypeError before any call."""
    with fusedps.Client(server_target) as client:
        with pytest.raises(ValueError, match="2-D"):
            client.register_table("bad", torch.randn(4))
        with pytest.raises(ValueError, match="dim >= 1"):
            client.register_table("bad", torch.randn(4, 0))
        with pytest.raises(TypeError):
            client.register_table("bad", torch.ones(4, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"shape \[n, dim\]"):
            client.push_rows({"t": ([1, 2], torch.randn(3, 4))})
        with pytest.raises(TypeError, match="integer"):
            client.push_rows({"t": (torch.tensor([1.0]), torch.randn(1, 4))})
        with pytest.raises(ValueError, match="1 sparse and 1 dense"):
            client.push_rows({"t": torch.randn(4, 3).to_sparse()})
        with pytest.raises(ValueError, match="nothing to push"):
            client.push_rows({})
        with pytest.raises(ValueError, match="grad_dtype"):
            client.push_rows({"t": ([1], torch.randn(1, 4))}, grad_dtype="float16")
        with pytest.raises(ValueError, match="field"):
            client.lookup_rows("t", [0], field="max_exp_avg_sq")
    with fusedps.Client(server_target, max_chunk_bytes=2048) as small:
        with pytest.raises(ValueError, match="max_chunk_bytes"):
            small.push_rows({"t": ([0], torch.randn(1, 1000))})
        with pytest.raises(ValueError, match="max_chunk_bytes"):
            small.lookup_rows("t", list(range(300)))


def test_tables_in_a_bounded_model_and_a_sync_model(server_target):
    """Tables live in a model like other tensors (every call names the client's model). In a
    bounded model a push whose base_version is too far behind is ABORTED and applies nothing;
    in a sync model (K = 1 here; tests/e2e/test_sync_tables.py has rounds of two) a push of
    rows is a round's step, and one of a closed round's version is ABORTED."""
    gen = torch.Generator().manual_seed(9)
    with fusedps.Client(server_target) as admin:
        admin.create_model("tables-bounded", mode="bounded", max_staleness=1)
        admin.create_model("tables-sync", mode="sync", replicas_to_aggregate=1,
                           total_replicas=1)
    with fusedps.Client(server_target, model="tables-bounded") as client:
        client.register_param_group("g", lr=0.01, weight_decay=0.0)
        client.register_table("t", torch.randn(5, 2, generator=gen), param_group="g")
        start = client.lookup_rows("t", torch.arange(5))
        for _ in range(2):
            client.push_rows({"t": ([1, 1], torch.randn(2, 2, generator=gen))},
                             base_version=start.version)
        stale = client.lookup_rows("t", torch.arange(5))
        assert stale.step == 2 and stale.version == start.version + 2
        with pytest.raises(fusedps.errors.Aborted):
            client.push_rows({"t": ([2], torch.randn(1, 2, generator=gen))},
                             base_version=start.version)
        now = client.lookup_rows("t", torch.arange(5))
        assert now.version == stale.version and torch.equal(now.rows, stale.rows)
        assert now.step == 2
    with fusedps.Client(server_target, model="tables-sync", client_id="trainer-0") as client:
        client.register_param_group("g", lr=0.01, weight_decay=0.0)
        client.register_table("t", torch.randn(5, 2, generator=gen), param_group="g")
        version = client.info().version
        pushed = client.push_rows({"t": ([1], torch.randn(1, 2, generator=gen))},
                                  base_version=version, sequence_number=1)
        assert (pushed.version, pushed.round_workers) == (version + 1, 1)
        before = client.lookup_rows("t", torch.arange(5))
        assert before.step == 1
        with pytest.raises(fusedps.errors.Aborted, match="sync round closed"):
            client.push_rows({"t": ([2], torch.randn(1, 2, generator=gen))},
                             base_version=version, sequence_number=2)
        after = client.lookup_rows("t", torch.arange(5))
        assert after.step == 1 and torch.equal(after.rows, before.rows)


def test_a_table_survives_a_checkpoint_and_a_restart(tmp_path):
    """A checkpoint holds a table as a table (its manifest marks it): after a restart from it,
    the rows, both moments and the step are bit for bit those checkpointed, rows still push by
    key, and a dense push still may not name the table. The control: the manifest's mark."""
    import json
    import os

    from checkpoint_server import ServerProcess

    root = str(tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(11)
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        client = fusedps.Client(server.target)
        client.register_param_group("ckpt.tables", lr=0.02, weight_decay=0.0)
        client.register_table("ckpt.emb", torch.randn(12, 3, generator=gen),
                              param_group="ckpt.tables")
        for _ in range(3):
            client.push_rows({"ckpt.emb": (_batch(gen, 12, 5, 2),
                                           torch.randn(7, 3, generator=gen))})
        before = {f: _all_rows(client, "ckpt.emb", 12, f) for f in FIELDS}
        version, path = client.checkpoint()
        server.kill()
    with open(os.path.join(path, "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    assert [(t["name"], t["table"]) for t in tensors] == [("ckpt.emb", True)]
    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        client = fusedps.Client(restarted.target)
        for f in FIELDS:
            after = _all_rows(client, "ckpt.emb", 12, f)
            assert torch.equal(after.rows, before[f].rows), f
            assert (after.version, after.step) == (version, 3)
        assert [(t.name, t.table) for t in client.list_tensors()] == [("ckpt.emb", True)]
        r = client.push_rows({"ckpt.emb": (torch.tensor([0, 11]), torch.ones(2, 3))})
        assert r.version == version + 1
        with pytest.raises(fusedps.errors.InvalidArgument, match="is an embedding table"):
            client.push_gradients({"ckpt.emb": torch.ones(12, 3)})


def test_metrics_count_a_tables_rows_pushes_and_lookups():
    """/metrics (docs/metrics.md, "Embedding tables"): fusedps_table_rows per table, keys of
    applied pushes (a duplicate key counted each time it is named; a skipped step's not at all)
    and keys looked up, labelled by model and table. Counted against what this test sent."""
    from sync_helpers import running_shards, scrape

    with running_shards(1, []) as shards:
        client = fusedps.Client(shards[0].target)
        client.register_param_group("metrics.tables", weight_decay=0.0)
        client.register_table("words", torch.randn(40, 4), param_group="metrics.tables")
        client.register_table("tags", torch.randn(7, 4), param_group="metrics.tables")
        samples = scrape(shards[0])
        assert samples.value("fusedps_table_rows", model="default", table="words") == 40
        assert samples.value("fusedps_table_rows", model="default", table="tags") == 7
        assert samples.value("fusedps_table_pushed_keys_total", model="default",
                             table="words") == 0
        client.push_rows({"words": ([1, 2, 2, 39], torch.randn(4, 4)),
                          "tags": ([6], torch.randn(1, 4))})
        client.push_rows({"words": ([5], torch.randn(1, 4))})
        skipped = client.push_rows({"words": ([3, 4], torch.full((2, 4), float("nan")))})
        assert skipped.step_skipped
        client.lookup_rows("words", [0, 1, 2])
        client.lookup_rows("tags", [6, 6])
        samples = scrape(shards[0])
        assert samples.value("fusedps_table_pushed_keys_total", model="default",
                             table="words") == 5
        assert samples.value("fusedps_table_pushed_keys_total", model="default",
                             table="tags") == 1
        assert samples.value("fusedps_table_lookup_keys_total", model="default",
                             table="words") == 3
        assert samples.value("fusedps_table_lookup_keys_total", model="default",
                             table="tags") == 2
        client.close()
