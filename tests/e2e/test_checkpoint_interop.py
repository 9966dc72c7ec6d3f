"""End-to-end checkpoint interop with PyTorch (docs/checkpoints.md), against real servers.

server -> torch: a server trains a few steps and writes a checkpoint (Client.checkpoint());
fusedps.checkpoint.to_torch reads it, bit-exact to what the server serves, into a torch model
and optimizer, which then take the same steps as the server: both agree within test_parity's
tolerances (steps exactly).

torch -> server: a torch model trains a few steps; fusedps.checkpoint.from_torch writes its
state; a server started on it (--checkpoint-dir=ROOT, or --restore=<the directory>) serves
those tensors, groups and steps, bit-exact, then continues as torch does.

Both ways the manifest is format 4 (fusedps.v1.CheckpointManifest's JSON); from_torch's, rewritten
as format 3, restores the same through the server's converter of older formats.

Each test starts its own server (the flags differ); the CPU backend unless
FUSEDPS_TEST_DEVICE says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib

import pytest
import torch

import fusedps
from fusedps import checkpoint
from checkpoint_server import manifest_of, to_format_3
from server_fixture import running_server
from test_parity import ATOL, RTOL, _assert_matches_torch, _torch_optimizer

pytestmark = pytest.mark.skipif(not hasattr(fusedps.Client, "checkpoint"),
                                reason="this fusedps client has no Client.checkpoint")

FIELDS = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]


@contextlib.contextmanager
def _server(extra_args):
    with running_server(list(extra_args)) as target, fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        yield client


def _grads(gen, names, shapes):
    return {n: torch.randn(s, generator=gen) for n, s in zip(names, shapes)}


def _push_and_step(client, opt, params, grads):
    """The same fp32 gradients to the server (one push) and to torch (one step)."""
    for n, p in params.items():
        p.grad = grads[n].clone() if n in grads else None
    r = client.push_gradients(grads, grad_dtype="float32")
    assert not r.step_skipped and not r.duplicate, r
    assert r.tensors_updated == len(grads)
    opt.step()


def _assert_state_equals_server(client, names, model_state, optim_state, amsgrad):
    """to_torch's output is exactly what the server serves: params, state fields, steps."""
    pulled = client.pull_parameters(names)
    for n in names:
        assert model_state[n].dtype == torch.float32 and model_state[n].shape == pulled[n].shape
        assert torch.equal(model_state[n], pulled[n]), n
    index = {n: i for g in optim_state["param_groups"]
             for i, n in zip(g["params"], g["param_names"])}
    for field in FIELDS if amsgrad else FIELDS[:2]:
        served, _, steps = client.pull_state(field, names)
        for n in names:
            st = optim_state["state"].get(index[n])
            assert steps[n] == (int(st["step"].item()) if st else 0), n
            expected = st[field] if st else torch.zeros_like(model_state[n])
            assert torch.equal(expected, served[n]), (field, n)


# register_param_group kwargs of the group under test.
SERVER_CASES = {
    "amsgrad": dict(lr=0.01, weight_decay=0.1, amsgrad=True),
    "defaults": dict(),
    "l2_maximize": dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.05, maximize=True,
                        decoupled_weight_decay=False),
}
SHAPES = [(), (1,), (257, 129), (3, 1, 7)]


@pytest.mark.parametrize("case_id", list(SERVER_CASES))
def test_server_checkpoint_continues_in_torch(tmp_path, case_id):
    hyper = SERVER_CASES[case_id]
    amsgrad = hyper.get("amsgrad", False)
    decoupled = hyper.get("decoupled_weight_decay", True)
    gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    names = [f"interop/{case_id}/t{i}" for i in range(len(SHAPES))]
    root = tmp_path / "ckpt"
    with _server([f"--checkpoint-dir={root}"]) as client:
        client.register_param_group("interop", **hyper)
        inits = [torch.randn(s, generator=gen) for s in SHAPES]
        client.register_model(list(zip(names, inits)), param_group="interop")
        for _ in range(3):
            r = client.push_gradients(_grads(gen, names, SHAPES), grad_dtype="float32")
            assert not r.step_skipped
        version, path = client.checkpoint()
        assert version == client.info().version
        assert re.fullmatch(r"checkpoint-[0-9]{20}", os.path.basename(path)), path
        assert os.path.samefile(os.path.dirname(path), root)
        assert (root / "latest").read_text().strip() == os.path.basename(path)
        manifest = manifest_of(path)
        # Format 4, as the server writes it: 64-bit integers are JSON strings.
        assert manifest["format_version"] == 4 and manifest["version"] == str(version)
        assert [t["name"] for t in manifest["tensors"]] == names

        model_state, optim_state = checkpoint.to_torch(path)
        assert checkpoint.resolve_checkpoint(str(root)) == path
        assert list(model_state) == names
        groups = optim_state["param_groups"]  # "default" has no tensors: left out
        assert [g["name"] for g in manifest["param_groups"]][0] == "default"
        assert len(groups) == 1 and groups[0]["param_names"] == names
        assert groups[0]["params"] == list(range(len(names)))
        served = {g.name: g for g in client.info().param_groups}["interop"]
        g = groups[0]
        assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == \
            (served.lr, served.betas, served.eps, served.weight_decay)
        assert (g["amsgrad"], g["maximize"], g["decoupled_weight_decay"]) == \
            (amsgrad, hyper.get("maximize", False), decoupled)
        assert set(optim_state["state"]) == set(g["params"])
        assert all(st["step"].item() == 3 for st in optim_state["state"].values())
        _assert_state_equals_server(client, names, model_state, optim_state, amsgrad)

        # torch continues from the checkpoint: AdamW, or Adam for L2 decay.
        params = {n: torch.nn.Parameter(t.clone()) for n, t in model_state.items()}
        opt = _torch_optimizer([{"params": [params[n] for n in grp["param_names"]]}
                                for grp in groups], {"decoupled_weight_decay": decoupled})
        opt.load_state_dict(optim_state)
        for grp in opt.param_groups:
            grp["foreach"] = False
        for _ in range(5):
            _push_and_step(client, opt, params, _grads(gen, names, SHAPES))
        _assert_matches_torch(client, names, [params[n] for n in names], opt, amsgrad, RTOL,
                              ATOL, msg=case_id)
        assert client.pull_parameters(names).steps == {n: 8 for n in names}


# The torch side: (names, AdamW hyperparameters) per group.
TORCH_GROUPS = [
    ("body", ["fc1.weight", "fc1.bias", "scale"], dict(lr=0.01, weight_decay=0.1)),
    ("head", ["fc2.weight", "fc2.bias", "offset", "unused"],
     dict(lr=0.005, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, amsgrad=True)),
]
TORCH_ORDER = [n for _, names, _ in TORCH_GROUPS for n in names]


def _torch_model():
    """Two Linear layers, a 0-dim param, a 1-element one, and one that never gets a grad."""
    gen = torch.Generator().manual_seed(7)
    m = torch.nn.Module()
    m.fc1 = torch.nn.Linear(9, 33)
    m.fc2 = torch.nn.Linear(33, 4)
    m.scale = torch.nn.Parameter(torch.zeros(()))
    m.offset = torch.nn.Parameter(torch.zeros(1))
    m.unused = torch.nn.Parameter(torch.zeros(5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


@pytest.mark.parametrize("restore,format_version", [("checkpoint_dir", 4), ("restore_path", 4),
                                                    ("checkpoint_dir", 3)])
def test_torch_checkpoint_continues_on_server(tmp_path, restore, format_version):
    model = _torch_model()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([dict(params=[params[n] for n in names], **h)
                             for _, names, h in TORCH_GROUPS], foreach=False)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{restore}{format_version}".encode()))
    stepped = [n for n in TORCH_ORDER if n != "unused"]
    shapes = [params[n].shape for n in stepped]
    for _ in range(3):
        for n, g in _grads(gen, stepped, shapes).items():
            params[n].grad = g
        opt.step()

    root = tmp_path / "ckpt"
    path = checkpoint.from_torch(model.state_dict(), opt.state_dict(), str(root),
                                 param_names=TORCH_ORDER,
                                 group_names=[name for name, _, _ in TORCH_GROUPS])
    manifest = manifest_of(path)
    assert manifest["format_version"] == 4 and manifest["server_version"] == "python"
    if format_version == 3:  # As a from_torch before format 4 wrote it.
        with open(os.path.join(path, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(to_format_3(manifest), f)
    args = [f"--checkpoint-dir={root}"] if restore == "checkpoint_dir" else \
        [f"--restore={path}"]
    with _server(args) as client:
        listed = {t.name: t for t in client.list_tensors()}
        for group, names, _ in TORCH_GROUPS:
            for n in names:
                t = listed[n]
                assert (t.shape, t.param_group) == (tuple(params[n].shape), group), n
                assert t.step == (0 if n == "unused" else 3), n
        info = client.info()
        assert info.version == 3  # from_torch's default: the highest step
        assert info.tensor_count == len(TORCH_ORDER)
        served = {g.name: g for g in info.param_groups}
        for (group, _, _), g in zip(TORCH_GROUPS, opt.param_groups):
            s = served[group]
            assert (s.lr, s.betas, s.eps, s.weight_decay, s.amsgrad, s.maximize) == \
                (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["amsgrad"],
                 g["maximize"]), group
            assert s.decoupled_weight_decay is True

        # Bit-exact: the server serves torch's params, state and steps.
        pulled = client.pull_parameters(TORCH_ORDER)
        for n in TORCH_ORDER:
            assert torch.equal(pulled[n], params[n].detach()), n
        for group, names, h in TORCH_GROUPS:
            for field in FIELDS if h.get("amsgrad") else FIELDS[:2]:
                state, _, steps = client.pull_state(field, names)
                for n in names:
                    p = params[n]
                    expected = opt.state[p][field] if p in opt.state else torch.zeros_like(p)
                    assert torch.equal(state[n], expected.detach()), (field, n)
                    assert steps[n] == (0 if n == "unused" else 3), n

        for _ in range(5):
            _push_and_step(client, opt, params, _grads(gen, stepped, shapes))
        for group, names, h in TORCH_GROUPS:
            _assert_matches_torch(client, names, [params[n] for n in names], opt,
                                  h.get("amsgrad", False), RTOL, ATOL, msg=f"{restore} {group}")
