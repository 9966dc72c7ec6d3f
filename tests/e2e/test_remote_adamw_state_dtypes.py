"""fusedps.torch.RemoteAdamW with low-precision storage (state_dtype, params_dtype), over a real
server: int8 state trains a model about as torch.optim.AdamW does, its state_dict comes back
dequantized and loads back quantized (checked against quant_reference.py's independent
quantizer), bf16 params reach the model as bf16 values, mistakes are refused before any call,
and the examples take the storage flags."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import fusedps
from fusedps.torch import RemoteAdamW
from quant_reference import SIGNED, UNSIGNED, is_bf16, quantize_blocks, recover_codes
from server_fixture import REPO_ROOT, running_server

pytestmark = pytest.mark.filterwarnings(
    "ignore:GradScaler is going to stop passing itself:FutureWarning")


class Mlp(torch.nn.Module):
    """16 -> 256 -> 4: fc1.weight (4096 elements) has int8 state in an int8 group; fc2.weight
    (1024) and the biases keep fp32 state."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(16, 256)
        self.fc2 = torch.nn.Linear(256, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(n=512):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    teacher = torch.randn(16, 4, generator=gen)
    return x, (x @ teacher).argmax(1)


def _train(model, opt, steps, start=0):
    x, y = _data()
    x = x.to(next(model.parameters()).dtype)
    losses = []
    for step in range(start, start + steps):
        batch = slice((step * 64) % 512, (step * 64) % 512 + 64)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_loss(model):
    x, y = _data()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y).item()


def test_int8_state_trains_and_its_state_dict_round_trips(server_target):
    model, reference = Mlp(1), Mlp(1)
    opt = RemoteAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.01,
                      targets=server_target, prefix="i8/", state_dtype="int8")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    assert [s.state_dtype for s in opt.storage] == ["int8"]
    layouts = {t.name: t.state_dtype for t in opt.client.list_tensors()
               if t.name.startswith("i8/")}
    assert layouts == {"i8/fc1.weight": "int8", "i8/fc1.bias": "fp32",
                       "i8/fc2.weight": "fp32", "i8/fc2.bias": "fp32"}
    first = _full_loss(model)
    _train(model, opt, 40)
    _train(reference, ref_opt, 40)
    final, ref_final = _full_loss(model), _full_loss(reference)
    assert final < 0.3 * first, (first, final)
    assert final < 1.1 * ref_final + 0.005, (final, ref_final)  # as torch fp32 AdamW does

    saved = copy.deepcopy(opt.state_dict())
    assert set(saved["state"]) == {0, 1, 2, 3}
    for entry in saved["state"].values():
        assert int(entry["step"].item()) == 40
        assert entry["exp_avg"].dtype == torch.float32
    # fc1.weight's state comes back dequantized: each block on its map's grid.
    for field, table in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
        values = saved["state"][0][field].reshape(-1).double().numpy()
        grid = recover_codes(values, table).dequantize(table)
        np.testing.assert_array_equal(grid, values.astype(np.float32))

    # Into a fresh int8 optimizer (other values on the server until the load writes).
    model2 = Mlp(2)
    model2.load_state_dict(model.state_dict())
    opt2 = RemoteAdamW(model2.named_parameters(), lr=1e-2, weight_decay=0.01,
                       targets=server_target, prefix="i8-loaded/", state_dtype="int8")
    opt2.load_state_dict(saved)
    assert opt2.write_pending_state()
    loaded = opt2.state_dict()
    for index in (1, 2, 3):  # fp32 state: exactly
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][index][field], saved["state"][index][field])
    for field, table in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
        sent = saved["state"][0][field].reshape(-1).double().numpy()
        want = quantize_blocks(sent, table)  # the loaded fp32 values, quantized on the server
        got = recover_codes(loaded["state"][0][field].reshape(-1).double().numpy(), table)
        diff = got.codes - want.codes
        assert not diff[~want.near_boundary].any(), field
        assert (np.abs(diff) <= 1).all(), field
        # Quantizing dequantized values keeps them within a map step of their block's scale.
        np.testing.assert_allclose(got.dequantize(table), sent, rtol=0.1,
                                   atol=0.02 * float(np.abs(sent).max()))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert {int(e["step"].item()) for e in loaded["state"].values()} == {40}
    losses = _train(model2, opt2, 20, start=40)
    assert _full_loss(model2) <= final + 0.02, (losses[-1], final)
    assert {int(e["step"].item()) for e in opt2.state_dict()["state"].values()} == {60}
    opt.close()
    opt2.close()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_bf16_params_reach_the_model_as_bf16(server_target, model_dtype):
    model = Mlp(3).to(model_dtype)
    opt = RemoteAdamW(model.named_parameters(), lr=1e-2, targets=server_target,
                      prefix=f"bf16p-{model_dtype}/", params_dtype="bf16", rounding_seed=11,
                      state_dtype="bf16")
    assert opt._pull_dtype == "bfloat16"
    _train(model, opt, 5)
    pulled = opt.client.pull_parameters(opt.tensor_names)
    for (name, p), server_name in zip(model.named_parameters(), opt.tensor_names):
        assert p.dtype == model_dtype
        assert is_bf16(p.detach().float().numpy()).all(), name
        assert torch.equal(p.detach().float(), pulled[server_name]), name
    group = opt.client.info().param_groups
    group = {g.name: g for g in group}[f"bf16p-{model_dtype}/group0"]
    assert (group.state_dtype, group.params_dtype, group.rounding_seed) == ("bf16", "bf16", 11)
    opt.close()


def test_per_group_storage(server_target):
    model = Mlp(4)
    groups = [{"params": [("fc1.weight", model.fc1.weight)], "state_dtype": "int8"},
              {"params": [(n, p) for n, p in model.named_parameters() if n != "fc1.weight"],
               "weight_decay": 0.0}]
    opt = RemoteAdamW(groups, lr=1e-2, targets=server_target, prefix="pg/",
                      state_dtype="bf16")
    assert [(s.state_dtype, s.params_dtype) for s in opt.storage] == [("int8", "fp32"),
                                                                       ("bf16", "fp32")]
    assert opt._pull_dtype == "float32"
    listed = {t.name: t.state_dtype for t in opt.client.list_tensors()
              if t.name.startswith("pg/")}
    assert listed == {"pg/fc1.weight": "int8", "pg/fc1.bias": "bf16", "pg/fc2.weight": "bf16",
                      "pg/fc2.bias": "bf16"}
    # A loaded state_dict's storage keys are not taken: the storage is the registration's.
    sd = opt.state_dict()
    sd["param_groups"][0]["state_dtype"] = "fp32"
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["state_dtype"] == "int8"
    opt.close()


def test_storage_mistakes_are_refused_before_any_call(server_target):
    named = list(Mlp(5).named_parameters())
    unreachable = dict(targets="127.0.0.1:1", connect_timeout=None,
                       client_options={"timeout": 2.0})
    for kwargs, match in [
            (dict(state_dtype="int4"), "state_dtype must be one of"),
            (dict(params_dtype="int8"), "params_dtype must be one of"),
            (dict(rounding_seed=-1), "rounding_seed must be an int"),
            (dict(state_dtype="int8", amsgrad=True), "amsgrad needs state_dtype 'fp32'"),
            (dict(params=[{"params": named, "state_dtype": "bf16", "amsgrad": True}]),
             "param group 0: state_dtype='bf16' with amsgrad")]:
        kwargs = dict(kwargs)
        params = kwargs.pop("params", named)
        with pytest.raises(ValueError, match=match):
            RemoteAdamW(params, **unreachable, **kwargs)
    # A group registered with other storage (a restarted trainer with other settings).
    RemoteAdamW(named, targets=server_target, prefix="restart-i8/", state_dtype="int8").close()
    with pytest.raises(ValueError, match="has state_dtype='int8'; this optimizer's has "
                                         "state_dtype='fp32'"):
        RemoteAdamW(named, lr=0.5, targets=server_target, prefix="restart-i8/",
                    on_existing="resume")
    # The same storage with another lr: the group takes the new lr.
    opt = RemoteAdamW(named, lr=0.5, targets=server_target, prefix="restart-i8/",
                      state_dtype="int8", on_existing="resume")
    group = {g.name: g for g in opt.client.info().param_groups}["restart-i8/group0"]
    assert (group.lr, group.state_dtype) == (0.5, "int8")
    opt.close()


def test_sharded_storage_applies_per_slice():
    """Two servers, fc1.weight cut in slices: each slice is a tensor of its own there, so the
    4096-element floor of int8 state is per slice."""
    model = Mlp(6)
    with running_server() as a, running_server() as b:
        plan = fusedps.make_plan([(n, tuple(p.shape), "group0")
                                  for n, p in model.named_parameters()], 2, slice_elements=2048)
        client = fusedps.ShardedClient([a, b], plan=plan)
        opt = RemoteAdamW(model.named_parameters(), client=client, lr=1e-2,
                          state_dtype="int8")
        _train(model, opt, 3)
        layouts = [t.state_dtype for c in client.clients for t in c.list_tensors()]
        assert set(layouts) == {"fp32"}  # every slice is under 4096 elements
        opt.close()
        client.close()


def _result_line(cmd):
    """The JSON of the "RESULT {...}" line that a command must print last."""
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.rstrip("\n").split("\n")[-1]
    assert last.startswith("RESULT "), last
    return json.loads(last[len("RESULT "):])


def test_examples_end_with_a_result_line(server_target):
    """The examples take the storage flags and end with one parseable line of results."""
    digits = _result_line([os.path.join(REPO_ROOT, "examples", "train_digits.py"), "--target",
                           server_target, "--epochs", "2", "--state-dtype", "int8",
                           "--params-dtype", "bf16", "--seed", "3", "--prefix", "ex-digits.",
                           "--min-accuracy", "0.5"])
    assert (digits["state_dtype"], digits["params_dtype"], digits["seed"]) == ("int8", "bf16", 3)
    assert digits["test_accuracy"] > 0.5 and digits["final_train_loss"] > 0
    assert digits["final_val_loss"] is None and digits["steps"] == 90
    if not os.path.exists("/usr/share/doc/jargon-text/jargon.txt.gz"):
        pytest.skip("no jargon-text corpus for the GPT example")
    gpt = _result_line([os.path.join(REPO_ROOT, "examples", "train_gpt.py"), "--target",
                        server_target, "--optimizer", "remote", "--preset", "tiny", "--steps",
                        "4", "--sample-bytes", "0", "--state-dtype", "bf16", "--seed", "4",
                        "--prefix", "ex-gpt."])
    assert (gpt["state_dtype"], gpt["params_dtype"], gpt["seed"]) == ("bf16", "fp32", 4)
    assert gpt["steps"] == 4 and gpt["final_val_loss"] > 0 and gpt["test_accuracy"] is None
