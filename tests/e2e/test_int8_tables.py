"""End-to-end: embedding tables in a param group with int8 state (docs/dev/embedding-tables.md):
each moment of a table's row is kept as 8-bit codes of the dynamic map with one fp32 scale per
row (a block of dim elements, not the dense tensors' 256), so that a push re-quantizes the rows
it names and no others. Tables under 4096 elements keep fp32 state.

The oracle is quant_reference.py's float64 SparseAdam (sparse_adam_rows, from
torch.optim.SparseAdam's definition, with decoupled weight decay) and its quantization with a
block of dim, checked as test_state_dtypes.py checks dense int8 state (_check_int8_state): each
step starts from the rows as the server served them before it (codes dequantized), so a code
off by one at a decision boundary does not carry on; params within torch's fused-vs-for-loop
tolerance; the same codes as the reference except within fp32 error of a decision boundary (one
off there); each row's scale within its largest element's error. Rows a push does not name, and
pushes the server refuses or skips, keep every bit. Gradients are integers times powers of two
(a row spans nine decades, so most of the map is used) whose duplicates sum exactly in fp32.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import fusedps
from fusedps import checkpoint
from hashed_table_reference import HashedTableReference, init_row
from quant_reference import (SIGNED, UNSIGNED, Hyper, error_bound_exp_avg,
                             error_bound_exp_avg_sq, quantize_blocks, recover_codes,
                             sparse_adam_rows)
from server_fixture import running_server
from test_checkpoint_state_dtypes import _read_stored
from test_state_dtypes import _check_int8_state
from test_tables import _batch, _embedding_grad

RTOL, ATOL = 1.3e-6, 1e-5  # test_tables.py's: torch's own for fused vs for-loop AdamW
FIELDS = ("param", "exp_avg", "exp_avg_sq")
DECAY = Hyper(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
PLAIN = Hyper(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.0)
STEPS = 24


def _group(client, name, h, state_dtype="int8"):
    client.register_param_group(name, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                weight_decay=h.weight_decay, state_dtype=state_dtype)


def _gradients(gen, keys, dim):
    """[n, dim] gradient rows for ``keys`` (repeats allowed): element j of an occurrence of key
    k is an integer in [-127, 127] times 2^e[k, j], e in [-30, 0] drawn per key and element
    for this push, so duplicates sum exactly in fp32; the rows of one key in eight are zero."""
    keys = torch.as_tensor(keys)
    unique, inverse = torch.unique(keys, return_inverse=True)
    exponents = torch.randint(-30, 1, (unique.numel(), dim), generator=gen).double()
    ints = torch.randint(-127, 128, (keys.numel(), dim), generator=gen).double()
    grads = ints * torch.pow(2.0, exponents[inverse])
    grads[(unique[inverse] % 8) == 3] = 0
    return grads.float()


def _lookup(client, table, keys):
    """field -> the rows of ``keys`` as fp32 tensors, and the table's step."""
    out = {f: client.lookup_rows(table, keys, field=f) for f in FIELDS}
    assert len({r.step for r in out.values()}) == 1
    return {f: r.rows for f, r in out.items()}, out["param"].step


def _bits(t):
    return t.contiguous().view(torch.int32)


def _check_step(h, step, keys, grads, before, after, dim, what, used_codes):
    """The rows ``after`` (field -> [u, dim], in sorted unique-key order) against the reference
    step from ``before`` (same layout; the state the server read) with gradients (keys as
    positions into before, grads)."""
    f64 = {f: before[f].double().numpy() for f in FIELDS}
    u, g, p_ref, m_ref, v_ref = sparse_adam_rows(h, step, keys, grads.double().numpy(),
                                                 f64["param"], f64["exp_avg"], f64["exp_avg_sq"])
    torch.testing.assert_close(after["param"], torch.from_numpy(p_ref).float(), rtol=RTOL,
                               atol=ATOL, msg=lambda m: f"{what}: params: {m}")
    m_err = error_bound_exp_avg(h, g, f64["exp_avg"][u], m_ref)
    v_err = error_bound_exp_avg_sq(h, g, f64["exp_avg_sq"][u], v_ref)
    q = _check_int8_state(f"{what}: exp_avg", after["exp_avg"].double().numpy().reshape(-1),
                          m_ref.reshape(-1), m_err.reshape(-1), SIGNED, dim)
    used_codes.update(q.codes.tolist())
    _check_int8_state(f"{what}: exp_avg_sq", after["exp_avg_sq"].double().numpy().reshape(-1),
                      v_ref.reshape(-1), v_err.reshape(-1), UNSIGNED, dim)


def _push_checked(client, table, h, step, keys, grads, before_all, dim, used_codes):
    """Pushes (keys, grads) to a dense-id table whose rows were ``before_all`` (field ->
    [rows, dim]); checks the pushed rows against the reference and every other row bit for
    bit; returns the table's rows after."""
    rows = before_all["param"].shape[0]
    result = client.push_rows({table: (keys, grads)})
    assert not result.step_skipped and result.tensors_updated == 1
    after_all, got_step = _lookup(client, table, torch.arange(rows))
    assert got_step == step
    unique = torch.unique(keys)
    _check_step(h, step, keys, grads, before_all, {f: after_all[f][unique] for f in FIELDS},
                dim, f"{table} step {step}", used_codes)
    pushed = torch.zeros(rows, dtype=torch.bool)
    pushed[unique] = True
    for f in FIELDS:
        assert torch.equal(_bits(after_all[f][~pushed]), _bits(before_all[f][~pushed])), (
            table, step, f)
    # A whole-table pull reads (and dequantizes) as the lookups do.
    for f in FIELDS:
        pulled = client.pull_state(f, [table])[0][table]
        assert torch.equal(_bits(pulled), _bits(after_all[f])), (table, step, f)
    return after_all


@pytest.mark.parametrize("dim,rows,h", [(64, 100, DECAY), (64, 100, PLAIN), (37, 120, DECAY),
                                        (37, 120, PLAIN)],
                         ids=["dim64-decay", "dim64-nodecay", "dim37-decay", "dim37-nodecay"])
def test_dense_id_table_matches_the_float64_reference(server_target, dim, rows, h):
    """24 pushes with duplicate keys to a dense-id table with int8 state: each pushed row's
    params, codes and scale follow the reference step from the rows before it; the rows a push
    leaves out (and the last 10, never pushed) keep every bit of params and both moments."""
    tag = f"{dim}.{h.weight_decay}"
    table, group = f"i8.dense{tag}", f"i8.dense{tag}"
    gen = torch.Generator().manual_seed(dim + int(h.weight_decay * 10))
    init = torch.randn(rows, dim, generator=gen)
    with fusedps.Client(server_target) as client:
        _group(client, group, h)
        client.register_table(table, init, param_group=group)
        info = {t.name: t for t in client.list_tensors()}[table]
        assert (info.table, info.state_dtype, info.params_dtype) == (True, "int8", "fp32")
        before, step0 = _lookup(client, table, torch.arange(rows))
        assert step0 == 0 and torch.equal(before["param"], init)
        assert not before["exp_avg"].any() and not before["exp_avg_sq"].any()
        used_codes: set = set()
        for step in range(1, STEPS + 1):
            keys = _batch(gen, rows, 30, 12, high=rows - 10)
            before = _push_checked(client, table, h, step, keys, _gradients(gen, keys, dim),
                                   before, dim, used_codes)
        assert not before["exp_avg"][rows - 10:].any()
        assert torch.equal(before["param"][rows - 10:], init[rows - 10:])
        assert len(used_codes) > 128  # the gradients exercise most of the signed map


def _snapshot(client, table, rows):
    """The bits of every row (lookups, and whole-table pulls), the table's step, the version."""
    values, step = _lookup(client, table, torch.arange(rows))
    bits = {f: _bits(t) for f, t in values.items()}
    for f in ("exp_avg", "exp_avg_sq"):
        bits["pull_" + f] = _bits(client.pull_state(f, [table])[0][table])
    return bits, step, client.info().version


def _assert_same(before, after):
    assert after[1:] == before[1:]
    for key, bits in before[0].items():
        assert torch.equal(after[0][key], bits), key


def test_refused_and_skipped_pushes_change_no_bit(server_target):
    """Pushes refused (a key outside [0, rows), rows of another dim) or skipped (a NaN or an
    infinite gradient, also on the bfloat16 wire) leave every row's params, codes and scales,
    the step and the version as they were; the next push is the reference's next step."""
    table, group, rows, dim = "i8.refused", "i8.refused", 120, 37
    gen = torch.Generator().manual_seed(5)
    with fusedps.Client(server_target) as client:
        _group(client, group, DECAY)
        client.register_table(table, torch.randn(rows, dim, generator=gen), param_group=group)
        used: set = set()
        before, _ = _lookup(client, table, torch.arange(rows))
        for step in range(1, 4):
            keys = _batch(gen, rows, 40, 10)
            before = _push_checked(client, table, DECAY, step, keys,
                                   _gradients(gen, keys, dim), before, dim, used)
        snap = _snapshot(client, table, rows)
        keys = _batch(gen, rows, 20, 5)
        good = _gradients(gen, keys, dim)
        with pytest.raises(fusedps.errors.InvalidArgument, match=r"keys\[\d+\] = 120"):
            client.push_rows({table: (torch.cat([keys, torch.tensor([120])]),
                                      torch.cat([good, torch.ones(1, dim)]))})
        with pytest.raises(fusedps.errors.InvalidArgument, match=r"keys\[0\] = -1"):
            client.push_rows({table: (torch.cat([torch.tensor([-1]), keys]),
                                      torch.cat([torch.ones(1, dim), good]))})
        with pytest.raises(fusedps.errors.InvalidArgument):
            client.push_rows({table: (keys, good[:, :dim - 1].contiguous())})
        _assert_same(snap, _snapshot(client, table, rows))
        for bad_value, wire in ((float("nan"), "float32"), (float("inf"), "float32"),
                                (float("-inf"), "bfloat16")):
            bad = good.clone()
            bad[3, 5] = bad_value
            assert client.push_rows({table: (keys, bad)}, grad_dtype=wire).step_skipped
            _assert_same(snap, _snapshot(client, table, rows))
        _push_checked(client, table, DECAY, 4, keys, good, before, dim, used)


UNIVERSE = [-(2**63), -7, 0, 1, 2, 3, 2**40 + 3, 2**63 - 1] + [5000 + 97 * i for i in range(88)]


def test_hashed_table_with_int8_state_evicts_and_matches(server_target):
    """24 pushes of 20 keys (and 6 repeats) from 96 feature ids into a hashed table of 64 slots
    of dim 64 with int8 state: which key holds which slot follows HashedTableReference (the
    documented slot rules); a pushed key's row follows the float64 reference from the row
    looked up before the push, which for a key not held (new, or evicted earlier and back)
    is the initializer's with zero moments; slots the push does not touch keep every bit."""
    table, group, capacity, dim, seed, init_std = "i8.hashed", "i8.hashed", 64, 64, 77, 0.05
    h = DECAY
    gen = torch.Generator().manual_seed(9)
    with fusedps.Client(server_target) as client:
        _group(client, group, h)
        client.register_hashed_table(table, capacity, dim, seed=seed, init_std=init_std,
                                     param_group=group)
        assert {t.name: t for t in client.list_tensors()}[table].state_dtype == "int8"
        ref = HashedTableReference(capacity, dim, seed, init_std, lr=h.lr,
                                   betas=(h.beta1, h.beta2), eps=h.eps)
        used: set = set()
        evicted_ever: set = set()
        came_back = 0
        for step in range(1, STEPS + 1):
            idx = torch.randint(0, len(UNIVERSE), (20,), generator=gen)
            keys = torch.tensor([UNIVERSE[i] for i in idx], dtype=torch.int64)
            keys = torch.cat([keys, keys[:6]])[torch.randperm(26, generator=gen)]
            grads = _gradients(gen, keys, dim)
            unique = torch.unique(keys)
            before, _ = _lookup(client, table, unique)
            slots_before = {f: (client.pull_parameters([table]) if f == "param" else
                                client.pull_state(f, [table])[0])[table] for f in FIELDS}
            for i, k in enumerate(unique.tolist()):
                if k not in ref.slot_of:  # created by this push: the initializer's row
                    assert not before["exp_avg"][i].any() and not before["exp_avg_sq"][i].any()
                    torch.testing.assert_close(before["param"][i],
                                               init_row(seed, k, init_std, dim),
                                               rtol=RTOL, atol=ATOL)
                    came_back += k in evicted_ever
            held_before = dict(ref.slot_of)
            result = client.push_rows({table: (keys, grads)})
            assert not result.step_skipped
            ref.push(keys, grads)
            evicted_ever |= set(held_before) - set(ref.slot_of)
            after, got_step = _lookup(client, table, unique)
            assert got_step == step == ref.step
            positions = torch.searchsorted(unique, keys)
            _check_step(h, step, positions, grads, before, after, dim, f"hashed step {step}",
                        used)
            # The slots: each held key's row where the reference put it, free slots zero,
            # and slots of keys held before and not pushed bit-identical.
            held, pushed = sorted(ref.slot_of), set(unique.tolist())
            rows_now, _ = _lookup(client, table, torch.tensor(held, dtype=torch.int64))
            for f in FIELDS:
                slots = (client.pull_parameters([table]) if f == "param" else
                         client.pull_state(f, [table])[0])[table]
                where = torch.tensor([ref.slot_of[k] for k in held])
                assert torch.equal(_bits(slots[where]), _bits(rows_now[f])), (step, f)
                free = torch.tensor([s for s in range(capacity) if ref.stamp[s] == -1],
                                    dtype=torch.int64)
                assert not slots[free].any(), (step, f)
                for k, s in held_before.items():
                    if ref.slot_of.get(k) == s and k not in pushed:
                        assert torch.equal(_bits(slots[s]), _bits(slots_before[f][s])), (k, f)
        assert ref.evictions > 40 and came_back > 5, (ref.evictions, came_back)
        assert len(used) > 128


def _served(client, names, hashed):
    out = {"param": dict(client.pull_parameters(names))}
    for f in ("exp_avg", "exp_avg_sq"):
        out[f] = client.pull_state(f, names)[0]
    for f in FIELDS:
        out[f]["by_key"] = client.lookup_rows(hashed, UNIVERSE, field=f).rows
    return out


def test_checkpoint_restores_int8_tables_bit_for_bit(tmp_path):
    """A checkpoint of an int8 group holding a dense-id table (dim 37), a hashed table (dim 64)
    and a dense tensor: the files hold one scale per row for the tables (per 256 elements for
    the dense tensor) and dequantize, by the format's definition, to what the server serves;
    fusedps.checkpoint.to_torch and hashed_tables read the same fp32 state; a server restored
    from it serves the same bits, and three more pushes give the same bits on both."""
    root = tmp_path / "ckpt"
    gen = torch.Generator().manual_seed(13)
    names = ["ck8.t", "ck8.h", "ck8.d"]

    def pushes(n):
        out = []
        for _ in range(n):
            keys = _batch(gen, 120, 30, 8)
            hkeys = torch.tensor(UNIVERSE, dtype=torch.int64)[
                torch.randint(0, len(UNIVERSE), (24,), generator=gen)]
            out.append(({"ck8.t": (keys, _gradients(gen, keys, 37)),
                         "ck8.h": (hkeys, _gradients(gen, hkeys, 64))},
                        {"ck8.d": torch.randn(4, 1099, generator=gen)}))
        return out

    later = pushes(8)
    with running_server([f"--checkpoint-dir={root}"]) as target, \
            fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        _group(client, "ck8", DECAY)
        client.register_table("ck8.t", torch.randn(120, 37, generator=gen), param_group="ck8")
        client.register_hashed_table("ck8.h", 64, 64, seed=3, init_std=0.1, param_group="ck8")
        client.register_model([("ck8.d", torch.randn(4, 1099, generator=gen))],
                              param_group="ck8")
        for rows, dense in later[:5]:
            assert not client.push_rows(rows, dense=dense).step_skipped
        _, path = client.checkpoint()
        at_checkpoint = _served(client, names, "ck8.h")
        for rows, dense in later[5:]:
            client.push_rows(rows, dense=dense)
        after = _served(client, names, "ck8.h")

    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    tensors = {t["name"]: t for t in manifest["tensors"]}
    assert [tensors[n].get("table", False) for n in names] == [True, True, False]
    assert [int(d) for d in tensors["ck8.t"]["shape"]] == [120, 37]
    files = {f: _read_stored(os.path.join(path, f"{f}.safetensors")) for f in (
        "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")}
    for name, block in (("ck8.t", 37), ("ck8.h", 64), ("ck8.d", 256)):
        numel = at_checkpoint["param"][name].numel()
        for field, book in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
            dtype, codes = files[field][name]
            scale_dtype, absmax = files[f"{field}_absmax"][name]
            assert (dtype, scale_dtype, absmax.shape) == ("U8", "F32", (-(-numel // block),))
            values = (book.astype(np.float32)[codes.reshape(-1).astype(np.int64)] *
                      np.repeat(absmax, block)[:numel])
            assert np.array_equal(values.view(np.int32), at_checkpoint[field][name].reshape(
                -1).numpy().view(np.int32)), (name, field)
    model_state, optim_state = checkpoint.to_torch(path)
    index = {n: i for g in optim_state["param_groups"]
             for i, n in zip(g["params"], g["param_names"])}
    for name in names:
        assert torch.equal(_bits(model_state[name]), _bits(at_checkpoint["param"][name]))
        for field in ("exp_avg", "exp_avg_sq"):
            got = optim_state["state"][index[name]][field]
            assert torch.equal(_bits(got), _bits(at_checkpoint[field][name])), (name, field)
    hashed = checkpoint.hashed_tables(path)["ck8.h"]
    position = {k: i for i, k in enumerate(UNIVERSE)}
    held = [position[k] for k in hashed.keys.tolist()]
    assert 0 < len(held) <= 64
    for field in FIELDS:
        assert torch.equal(_bits(getattr(hashed, field)),
                           _bits(at_checkpoint[field]["by_key"][held])), field

    with running_server([f"--restore={path}"]) as target, fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        restored = _served(client, names, "ck8.h")
        for rows, dense in later[5:]:
            client.push_rows(rows, dense=dense)
        replayed = _served(client, names, "ck8.h")
    for field in FIELDS:
        for name in at_checkpoint[field]:
            assert torch.equal(_bits(restored[field][name]),
                               _bits(at_checkpoint[field][name])), (field, name)
            assert torch.equal(_bits(replayed[field][name]), _bits(after[field][name])), (
                field, name)


def test_load_state_quantizes_a_table_row_by_row(server_target):
    """load_state of a dense-id table with int8 state quantizes each row against its own scale:
    rows whose magnitudes differ by up to 1e9 all come back as the reference's codes, none of
    them zero (a block of 256 would round the small rows beside a large one to zero: the map's
    smallest nonzero magnitude is 5.5e-7)."""
    table, group, rows, dim = "i8.load", "i8.load", 120, 37
    gen = torch.Generator().manual_seed(17)
    with fusedps.Client(server_target) as client:
        _group(client, group, PLAIN)
        client.register_table(table, torch.zeros(rows, dim), param_group=group)
        magnitude = 10.0 ** (torch.arange(rows) % 10 - 9.0).unsqueeze(1)
        m = (torch.randn(rows, dim, generator=gen) * magnitude).float()
        v = (torch.rand(rows, dim, generator=gen) * magnitude ** 2).float()
        client.load_state({table: {"exp_avg": m, "exp_avg_sq": v}}, steps={table: 5})
        for field, x, book in (("exp_avg", m, SIGNED), ("exp_avg_sq", v, UNSIGNED)):
            pulled = client.pull_state(field, [table])[0][table].double().numpy().reshape(-1)
            want = quantize_blocks(x.double().numpy(), book, block=dim)
            got = recover_codes(pulled, book, block=dim)
            same = ~want.near_boundary
            assert not (got.codes != want.codes)[same].any(), field
            assert np.array_equal(want.dequantize(book)[same], pulled.astype(np.float32)[same])
            assert (np.abs(pulled).reshape(rows, dim).max(axis=1) > 0).all(), field


def test_a_table_under_4096_elements_keeps_fp32_state(server_target):
    """A table of 63 x 64 = 4032 elements in an int8 group is stored and stepped as in an fp32
    group, bit for bit, and follows torch.optim.SparseAdam (20 pushes of nn.Embedding's
    uncoalesced sparse gradients); 64 x 64 in the same group is quantized."""
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    torch.manual_seed(21)
    emb = torch.nn.Embedding(63, 64, sparse=True)
    with fusedps.Client(server_target) as client:
        for state in ("int8", "fp32"):
            client.register_param_group(f"i8.small.{state}", weight_decay=0.0,
                                        state_dtype=state, **hyper)
            client.register_table(f"i8.small.{state}", emb.weight.detach(),
                                  param_group=f"i8.small.{state}")
        client.register_table("i8.small.big", torch.randn(64, 64), param_group="i8.small.int8")
        listed = {t.name: t.state_dtype for t in client.list_tensors()}
        assert [listed[f"i8.small.{n}"] for n in ("int8", "fp32", "big")] == [
            "fp32", "fp32", "int8"]
        optimizer = torch.optim.SparseAdam(emb.parameters(), **hyper)
        gen = torch.Generator().manual_seed(22)
        for _ in range(20):
            grad = _embedding_grad(emb, _batch(gen, 63, 40, 15), gen)
            for state in ("int8", "fp32"):
                client.push_rows({f"i8.small.{state}": grad})
            optimizer.step()
        want = {"param": emb.weight.detach(), **optimizer.state[emb.weight]}
        a, _ = _lookup(client, "i8.small.int8", torch.arange(63))
        b, _ = _lookup(client, "i8.small.fp32", torch.arange(63))
        for field in FIELDS:
            assert torch.equal(_bits(a[field]), _bits(b[field])), field
            torch.testing.assert_close(a[field], want[field].float(), rtol=RTOL, atol=ATOL)
