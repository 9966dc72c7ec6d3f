"""Low-precision optimizer state and bf16 params (issue 16) through a real server, against the
independent float64 reference of quant_reference.py.

Each step of the reference starts from the server's stored values before the step (params and
state as pulled: the fp32 the next step reads, bf16 widened, int8 dequantized), so that one
rounding decision that went the other way does not carry into the later steps; the step count
and the gradients are the reference's own. What each check allows, and why:
  * params with fp32 storage: torch's tolerance for its fused vs for-loop AdamW (rtol 1.3e-6,
    atol 1e-5), whatever the state dtype: the step's param update reads the new fp32 state
    before it is rounded or quantized (quant_math.h), so from the same stored inputs the
    update is the fp32 one;
  * fp32 state: within error_bound_* (a few fp32 roundings of the step's operands);
  * bf16 state: exactly the reference's value rounded to nearest even, except where that value
    lies within error_bound_* of a rounding boundary: one bf16 ulp off there;
  * int8 state: the same codes as the reference's quantization (nearest map value of value /
    block absmax, ties away from zero), except within fp32 error of a decision boundary: one
    code off there; scales within the max element's error bound;
  * bf16 params: one of the two bf16 values around the reference's value.
"""

from __future__ import annotations

import zlib

import grpc
import numpy as np
import pytest
import torch

import fusedps
from fusedps.v1 import parameter_service_pb2 as pb
from quant_reference import (BLOCK, MIN_QUANT_NUMEL, SIGNED, UNSIGNED, Hyper, U32, adamw_step,
                             bf16_midpoint_distance, bf16_neighbours, bf16_rne,
                             error_bound_exp_avg, error_bound_exp_avg_sq, is_bf16,
                             quantize_blocks, recover_codes)
from server_fixture import running_server

RTOL, ATOL = 1.3e-6, 1e-5  # test_parity.py's: torch's own for fused vs for-loop AdamW
HYPER = Hyper(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SHAPES = {"w": (4, 1099),  # 4396 elements: 17 blocks of 256 and one of 44
          "v": (16, 256),  # 4096: the smallest tensor with int8 state
          "b": (300,)}     # fp32 state in an int8 group
STEPS = 6


def _register(client, group, shapes, seed, **storage):
    registered = client.register_param_group(
        group, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
        weight_decay=HYPER.weight_decay, **storage)
    gen = torch.Generator().manual_seed(seed)
    names = [f"{group}/{n}" for n in shapes]
    client.register_model([(n, torch.randn(s, generator=gen)) for n, s in
                           zip(names, shapes.values())], param_group=group)
    return registered, names


def _gradient(gen, numel, step):
    """Gradients whose blocks of 256 span five decades, with a block of zeros (block 1), one
    that is zero from step 3 on (block 2: its state decays), and in larger tensors a negative
    and a positive outlier (blocks 3 and 4: a block whose largest magnitude is negative, and
    one whose is positive)."""
    blocks = -(-numel // 256)
    scale = 10.0 ** torch.empty(blocks).uniform_(-4, 1, generator=gen)
    g = torch.randn(numel, generator=gen) * scale.repeat_interleave(256)[:numel]
    g[256:512] = 0
    if step >= 3:
        g[512:768] = 0
    if blocks > 4:
        g[3 * 256 + 7] = -40 * float(scale[3])
        g[4 * 256 + 9] = 40 * float(scale[4])
    return g


def _pull(client, names):
    params = client.pull_parameters(names)
    exp_avg = client.pull_state("exp_avg", names)[0]
    exp_avg_sq, _, steps = client.pull_state("exp_avg_sq", names)
    return ({n: params[n].reshape(-1).double().numpy() for n in names},
            {n: exp_avg[n].reshape(-1).double().numpy() for n in names},
            {n: exp_avg_sq[n].reshape(-1).double().numpy() for n in names}, steps)


def _check_bf16_state(name, pulled, ref, error):
    expected = bf16_rne(ref)
    near = bf16_midpoint_distance(ref) <= error
    off = pulled != expected
    assert is_bf16(pulled).all(), name
    assert not (off & ~near).any(), (name, np.flatnonzero(off & ~near)[:5])
    _, _, ulp = bf16_neighbours(ref)
    assert (np.abs(pulled - expected)[off] == ulp[off]).all(), name
    assert near.mean() < 0.01, (name, near.mean())  # the exact check covers nearly all


def _check_int8_state(name, pulled, ref, error, table, block=BLOCK):
    """pulled (flat, as the server serves it) against the reference's quantization of ref
    (float64, within error of the server's fp32 values), ``block`` elements per scale (256; an
    embedding table's dim: tests/e2e/test_int8_tables.py). Returns the reference's Quantized."""
    want = quantize_blocks(ref, table, error, block)
    got = recover_codes(pulled, table, block)
    diff = got.codes - want.codes
    assert not (diff[~want.near_boundary] != 0).any(), (
        name, np.flatnonzero((diff != 0) & ~want.near_boundary)[:5])
    assert (np.abs(diff) <= 1).all(), name
    assert want.near_boundary.mean() < 0.01, (name, want.near_boundary.mean())
    # The scales: the largest value's own error, plus fp32's rounding of it.
    padded = np.zeros(len(want.absmax) * block)
    padded[:len(error)] = error
    scale_error = padded.reshape(-1, block).max(axis=1) + 2 * U32 * want.absmax
    assert (np.abs(got.absmax - want.absmax) <= scale_error).all(), (
        name, np.flatnonzero(np.abs(got.absmax - want.absmax) > scale_error)[:5])
    # The pulled values are the reference's stored ones where the codes agree.
    stored = want.dequantize(table).astype(np.float64)
    same = diff == 0
    tolerance = np.repeat(scale_error, block)[:len(pulled)] + U32 * np.abs(stored)
    assert (np.abs(pulled - stored)[same] <= tolerance[same]).all(), name
    return want


STORAGE_CASES = {"fp32": dict(state_dtype="fp32"), "bf16": dict(state_dtype="bf16"),
                 "int8": dict(state_dtype="int8"),
                 "int8_bf16_params": dict(state_dtype="int8", params_dtype="bf16",
                                          rounding_seed=99)}


@pytest.mark.parametrize("case", list(STORAGE_CASES))
def test_steps_match_the_float64_reference(client, case):
    storage = STORAGE_CASES[case]
    state, params_dtype = storage["state_dtype"], storage.get("params_dtype", "fp32")
    group, names = _register(client, f"ref-{case}", SHAPES, zlib.crc32(case.encode()),
                             **storage)
    assert (group.state_dtype, group.params_dtype) == (state, params_dtype)
    assert group.rounding_seed == storage.get("rounding_seed", 0)
    layouts = {t.name: (t.params_dtype, t.state_dtype) for t in client.list_tensors()
               if t.name in names}
    for n in names:
        small = int(np.prod(SHAPES[n.split("/")[-1]])) < MIN_QUANT_NUMEL
        assert layouts[n] == (params_dtype, "fp32" if small and state == "int8" else state), n

    gen = torch.Generator().manual_seed(7)
    used_codes = set()
    for step in range(1, STEPS + 1):
        p0, m0, v0, steps = _pull(client, names)
        assert set(steps.values()) == {step - 1}
        grads = {n: _gradient(gen, len(p0[n]), step) for n in names}
        r = client.push_gradients({n: g.reshape(SHAPES[n.split("/")[-1]])
                                   for n, g in grads.items()}, grad_dtype="float32")
        assert not r.step_skipped
        p1, m1, v1, _ = _pull(client, names)
        for n in names:
            g = grads[n].double().numpy()
            p_ref, m_ref, v_ref = adamw_step(HYPER, step, g, p0[n], m0[n], v0[n])
            if params_dtype == "fp32":
                torch.testing.assert_close(torch.from_numpy(p1[n]), torch.from_numpy(p_ref),
                                           rtol=RTOL, atol=ATOL, msg=lambda m: f"{n} {m}")
            else:
                below, above, ulp = bf16_neighbours(p_ref)
                assert is_bf16(p1[n]).all(), n
                assert (np.abs(p1[n] - p_ref) <= ulp * (1 + 1e-3)).all(), n
            m_err = error_bound_exp_avg(HYPER, g, m0[n], m_ref)
            v_err = error_bound_exp_avg_sq(HYPER, g, v0[n], v_ref)
            layout = layouts[n][1]
            if layout == "fp32":
                assert (np.abs(m1[n] - m_ref) <= m_err).all(), (n, step)
                assert (np.abs(v1[n] - v_ref) <= v_err).all(), (n, step)
            elif layout == "bf16":
                _check_bf16_state(f"{n} exp_avg step {step}", m1[n], m_ref, m_err)
                _check_bf16_state(f"{n} exp_avg_sq step {step}", v1[n], v_ref, v_err)
            else:
                q = _check_int8_state(f"{n} exp_avg step {step}", m1[n], m_ref, m_err, SIGNED)
                used_codes.update(q.codes.tolist())
                _check_int8_state(f"{n} exp_avg_sq step {step}", v1[n], v_ref, v_err,
                                  UNSIGNED)
                # The block of zeros has the code of 0 and scale 0.
                assert not m1[n][256:512].any() and not v1[n][256:512].any()
    if state == "int8":
        assert len(used_codes) > 128  # the gradients exercise most of the signed map


def test_registration_reports_and_fixes_the_storage(client):
    """The group reports its storage; registering it again with other storage, or changing it
    with SetHyperparameters, is refused; amsgrad needs fp32 state (the client says so before
    calling, the server when called)."""
    group = client.register_param_group("fixed", state_dtype="int8", params_dtype="bf16",
                                        rounding_seed=17)
    assert (group.state_dtype, group.params_dtype, group.rounding_seed) == ("int8", "bf16", 17)
    same = client.register_param_group("fixed", state_dtype="int8", params_dtype="bf16",
                                       rounding_seed=17)
    assert same == group
    served = {g.name: g for g in client.info().param_groups}
    assert served["fixed"] == group and served["default"].state_dtype == "fp32"
    for other in (dict(state_dtype="bf16", params_dtype="bf16", rounding_seed=17),
                  dict(state_dtype="int8", rounding_seed=17),
                  dict(state_dtype="int8", params_dtype="bf16", rounding_seed=18)):
        with pytest.raises(fusedps.errors.AlreadyExists):
            client.register_param_group("fixed", **other)
    for change in (pb.Hyperparameters(state_dtype=pb.STATE_DTYPE_FLOAT32),
                   pb.Hyperparameters(params_dtype=pb.DTYPE_FLOAT32),
                   pb.Hyperparameters(rounding_seed=1)):
        with pytest.raises(grpc.RpcError) as e:
            client._stub.SetHyperparameters(pb.SetHyperparametersRequest(
                param_group="fixed", hyperparameters=change))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, change
    assert client.set_hyperparameters("fixed", lr=0.5).state_dtype == "int8"
    with pytest.raises(ValueError, match="amsgrad"):
        client.register_param_group("ams", amsgrad=True, state_dtype="int8")
    with pytest.raises(grpc.RpcError) as e:
        client._stub.RegisterParamGroup(pb.RegisterParamGroupRequest(param_group=pb.ParamGroup(
            name="ams", hyperparameters=pb.Hyperparameters(
                amsgrad=True, state_dtype=pb.STATE_DTYPE_BFLOAT16))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_small_tensors_of_an_int8_group_behave_as_fp32(client):
    """A tensor under 4096 elements of an int8 group is stored, and steps, exactly as the same
    tensor of an fp32 group; one of 4096 is quantized."""
    shapes = {"t4095": (4095,), "t4096": (64, 64)}
    _register(client, "floor-int8", shapes, 5, state_dtype="int8")
    _register(client, "floor-fp32", shapes, 5, state_dtype="fp32")
    layouts = {t.name: t.state_dtype for t in client.list_tensors()
               if t.name.startswith("floor-")}
    assert layouts == {"floor-int8/t4095": "fp32", "floor-int8/t4096": "int8",
                       "floor-fp32/t4095": "fp32", "floor-fp32/t4096": "fp32"}
    gen = torch.Generator().manual_seed(11)
    for step in range(1, 4):
        grads = {n: _gradient(gen, int(np.prod(s)), step).reshape(s) for n, s in shapes.items()}
        for group in ("floor-int8", "floor-fp32"):
            client.push_gradients({f"{group}/{n}": g for n, g in grads.items()},
                                  grad_dtype="float32")
    fields = {"param": client.pull_parameters(list(layouts))}
    for field in ("exp_avg", "exp_avg_sq"):
        fields[field] = client.pull_state(field, list(layouts))[0]
    for field, values in fields.items():
        a, b = values["floor-int8/t4095"], values["floor-fp32/t4095"]
        assert a.view(torch.int32).equal(b.view(torch.int32)), field  # bit for bit
    for field in ("exp_avg", "exp_avg_sq"):
        quantized = fields[field]["floor-int8/t4096"].reshape(-1)
        assert not torch.equal(quantized, fields[field]["floor-fp32/t4096"].reshape(-1))
        # Quantized: each block's values are map values times one scale.
        table = SIGNED if field == "exp_avg" else UNSIGNED
        codes = recover_codes(quantized.double().numpy(), table)
        np.testing.assert_array_equal(codes.dequantize(table), quantized.numpy())


# -- bf16 params: stochastic rounding ------------------------------------------------------------

N = 1 << 16
ULP = 2.0 ** -7  # bf16's ulp on [1, 2)


def _sr_group(client, group, seed, lr, names_shapes, inits):
    client.register_param_group(group, lr=lr, weight_decay=0.0, params_dtype="bf16",
                                rounding_seed=seed)
    client.register_model([(n, inits[n]) for n, _ in names_shapes], param_group=group)


def test_bf16_params_round_stochastically_without_bias(client):
    """Updates of about 0.3 bf16 ulp: nearest rounding would never move a param (an error of
    +0.3 ulp each step); stochastic rounding moves about 30% of them a whole ulp, and the mean
    error is 0."""
    gen = torch.Generator().manual_seed(3)
    init = 1.0 + torch.randint(1, 127, (N,), generator=gen).double() * ULP  # bf16, in (1, 2)
    name = "sr-grid/p"
    _sr_group(client, "sr-grid", 1234, 0.3 * ULP, [(name, (N,))], {name: init.float()})
    h = Hyper(lr=0.3 * ULP, weight_decay=0.0)
    # Registration stores bf16 values rounded to nearest even (as LoadState does).
    off_grid = torch.randn(4096, generator=gen)
    _sr_group(client, "sr-rne", 1, 1e-3, [("sr-rne/p", (4096,))], {"sr-rne/p": off_grid})
    pulled = client.pull_parameters(["sr-rne/p"])["sr-rne/p"]
    assert torch.equal(pulled, off_grid.to(torch.bfloat16).float())
    listed = {t.name: (t.params_dtype, t.state_dtype) for t in client.list_tensors()}
    assert listed[name] == listed["sr-rne/p"] == ("bf16", "fp32")

    for step in range(1, 4):
        p0, m0, v0, _ = (x[name] for x in _pull(client, [name]))
        if step == 1:
            assert np.array_equal(p0, init.numpy())
        grads = torch.empty(N).uniform_(0.5, 1.5, generator=gen)  # all > 0: all go down
        client.push_gradients({name: grads}, grad_dtype="float32")
        p1 = client.pull_parameters([name])[name].double().numpy()
        as_bf16 = client.pull_parameters([name], dtype="bfloat16")[name]
        assert np.array_equal(as_bf16.double().numpy(), p1)  # bf16 on the wire: exact
        exact, _, _ = adamw_step(h, step, grads.double().numpy(), p0, m0, v0)
        below, above, ulp = bf16_neighbours(exact)
        assert ((p1 == below) | (p1 == above)).all(), step
        error = (p1 - exact) / ulp
        up = (exact - below) / ulp  # the probability of rounding to `above`
        assert abs(error.mean()) < 0.01, (step, error.mean())  # its sd is 0.002 here
        assert abs((p1 == above).mean() - up.mean()) < 0.01, step
        assert 0.1 < (p1 != p0).mean() < 0.5, step


def _deterministic_run(seed, steps=3):
    """Registers two identical tensors under different names, pushes identical gradients,
    returns the params' bits after each step."""
    gen = torch.Generator().manual_seed(21)
    init = torch.randn(N, generator=gen)
    with running_server() as target, fusedps.Client(target) as c:
        c.wait_ready(timeout=10)
        _sr_group(c, "det", seed, 1e-3, [("det/a", (N,)), ("det/b", (N,))],
                  {"det/a": init, "det/b": init})
        bits = []
        for _ in range(steps):
            g = torch.randn(N, generator=gen)
            c.push_gradients({"det/a": g, "det/b": g}, grad_dtype="float32")
            pulled = c.pull_parameters(["det/a", "det/b"])
            bits.append({n: pulled[n].view(torch.int32).clone() for n in pulled})
    return bits


def test_bf16_params_are_deterministic():
    """The same pushes to two fresh servers give the same bits; another seed, or another
    tensor name, gives other bits (the rounding's random bits depend on both)."""
    first, second, other_seed = _deterministic_run(7), _deterministic_run(7), \
        _deterministic_run(8)
    for step, (a, b, c) in enumerate(zip(first, second, other_seed)):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
        differ = (a["det/a"] != c["det/a"]).double().mean().item()
        assert differ > 0.05, (step, differ)
        by_name = (a["det/a"] != a["det/b"]).double().mean().item()
        assert by_name > 0.05, (step, by_name)
