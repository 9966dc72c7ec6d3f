"""Offline tests of fusedps.checkpoint (no server): torch state dicts -> checkpoint -> torch state
dicts is bit-exact, a torch optimizer loaded from a checkpoint continues exactly as the original,
the files are plain safetensors (read back by test_cli's independent reader and, where it is
installed, by the safetensors package) whose sizes and crc32 match the manifest, corruption is
caught, bad inputs are refused naming the field, and the manifest has the keys
docs/checkpoints.md lists.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import time
import zlib

import pytest
import torch

from fusedps import checkpoint
from fusedps.v1 import checkpoint_pb2 as ckpt_pb
from checkpoint_server import to_format_3
from server_fixture import REPO_ROOT
from test_cli import read_safetensors as independent_read  # F32 only, the format's definition

try:
    import safetensors.torch as safetensors_torch
except ImportError:  # Not in Debian 12.
    safetensors_torch = None


def _supports_named_params() -> bool:
    """torch >= 2.6 takes (name, param) pairs and records "param_names" in its state_dict."""
    try:
        torch.optim.AdamW([("w", torch.nn.Parameter(torch.zeros(1)))])
        return True
    except (TypeError, ValueError):
        return False


NAMED = _supports_named_params()
GROUP_NAMES = ["body", "head"]
# (names, hyperparameters) per param group; registration order differs from the model's.
GROUPS = [
    (["fc1.weight", "fc1.bias", "scale"], dict(lr=0.01, weight_decay=0.1)),
    (["fc2.weight", "fc2.bias", "offset", "unused"],
     dict(lr=0.005, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, amsgrad=True)),
]
ORDER = [n for names, _ in GROUPS for n in names]


def _model(seed: int) -> torch.nn.Module:
    """Two Linear layers, a 0-dim param, a 1-element one and one that never gets a grad."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    m.scale = torch.nn.Parameter(torch.zeros(()))
    m.offset = torch.nn.Parameter(torch.zeros(1))
    m.unused = torch.nn.Parameter(torch.zeros(4))
    m.fc1 = torch.nn.Linear(6, 5)
    m.fc2 = torch.nn.Linear(5, 3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def _optimizer(model, hyper=True, named=NAMED, cls=torch.optim.AdamW):
    """cls over GROUPS (with their hyperparameters, or torch's defaults), foreach=False."""
    params = dict(model.named_parameters())
    groups = []
    for names, h in GROUPS:
        ps = [(n, params[n]) for n in names] if named else [params[n] for n in names]
        groups.append(dict(params=ps, **(h if hyper else {})))
    return cls(groups, foreach=False)


def _step(model, opt, step: int):
    """One step with seeded gradients (the same for every model at a given step)."""
    g = torch.Generator().manual_seed(1000 + step)
    for n, p in model.named_parameters():
        p.grad = None if n == "unused" else torch.randn(p.shape, generator=g)
    opt.step()


def _trained(steps=3, cls=torch.optim.AdamW):
    model = _model(1)
    opt = _optimizer(model, cls=cls)
    for s in range(steps):
        _step(model, opt, s)
    return model, opt


def _write(root, model, opt, **kw):
    kw.setdefault("group_names", GROUP_NAMES)
    if not NAMED:
        kw.setdefault("param_names", ORDER)
    return checkpoint.from_torch(model.state_dict(), opt.state_dict(), str(root), **kw)


def _unnamed(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def _manifest(path):
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _assert_same_training_state(model_a, opt_a, model_b, opt_b):
    pa, pb = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    for n in ORDER:
        assert torch.equal(pa[n].detach(), pb[n].detach()), n
        sa, sb = opt_a.state.get(pa[n], {}), opt_b.state.get(pb[n], {})
        assert set(sa) == set(sb), n
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (n, key)


def test_round_trip_is_bit_exact(tmp_path):
    model, opt = _trained()
    root = tmp_path / "ckpt"
    path = _write(root, model, opt)
    assert os.path.basename(path) == "checkpoint-%020d" % 1
    assert (root / "latest").read_text() == os.path.basename(path)
    model_state, optim_state = checkpoint.to_torch(path)

    assert list(model_state) == ORDER  # registration order: group by group
    params = dict(model.named_parameters())
    for n in ORDER:
        assert model_state[n].dtype == torch.float32
        assert torch.equal(model_state[n], params[n].detach()), n
    want = opt.state_dict()
    assert set(optim_state["state"]) == set(want["state"]) == set(range(6))  # not "unused"
    for i, st in want["state"].items():
        got = optim_state["state"][i]
        assert set(got) == set(st), i
        for key in st:
            assert got[key].dtype == st[key].dtype, (i, key)
            assert torch.equal(got[key], st[key]), (i, key)
    assert len(optim_state["param_groups"]) == len(GROUPS)
    for got, w, (names, _) in zip(optim_state["param_groups"], want["param_groups"], GROUPS):
        for key in ("lr", "eps", "weight_decay", "amsgrad", "maximize", "params"):
            assert got[key] == w[key], key
        assert tuple(got["betas"]) == tuple(w["betas"])
        assert got["param_names"] == names
        assert got["decoupled_weight_decay"] is True
        assert got["foreach"] is None and got["fused"] is None
        assert got["capturable"] is False and got["differentiable"] is False

    # The root resolves to the newest checkpoint; a second one gets the next serial.
    second = _write(root, model, opt, version=42)
    assert os.path.basename(second) == "checkpoint-%020d" % 2
    assert (root / "latest").read_text() == os.path.basename(second)
    assert checkpoint.resolve_checkpoint(str(root)) == second
    assert list(checkpoint.to_torch(str(root))[0]) == ORDER


def test_files_are_safetensors_that_match_the_manifest(tmp_path):
    model, opt = _trained()
    path = _write(tmp_path, model, opt)
    manifest = _manifest(path)
    params = dict(model.named_parameters())
    assert set(manifest["files"]) == {"params.safetensors", "exp_avg.safetensors",
                                      "exp_avg_sq.safetensors", "max_exp_avg_sq.safetensors"}
    for name, entry in manifest["files"].items():
        with open(os.path.join(path, name), "rb") as f:
            raw = f.read()
        assert len(raw) == int(entry["bytes"]), name  # a uint64: a JSON string
        assert zlib.crc32(raw) == entry["crc32"], name
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0, name  # the data starts 8-byte aligned, as the server writes it
        field = name[:-len(".safetensors")]
        tensors, _ = independent_read(os.path.join(path, name))
        want_names = ORDER if field != "max_exp_avg_sq" else GROUPS[1][0]
        assert set(tensors) == set(want_names), name
        for t in want_names:
            p = params[t]
            if field == "params":
                expected = p.detach()
            else:
                expected = opt.state[p][field] if p in opt.state else torch.zeros_like(p)
            got = torch.from_numpy(tensors[t].copy())
            assert got.shape == p.shape and torch.equal(got, expected), (name, t)
            if safetensors_torch is not None:
                loaded = safetensors_torch.load_file(os.path.join(path, name))
                assert torch.equal(loaded[t], expected), (name, t)


@pytest.mark.parametrize("copy_dtype,torch_dtype", [("bf16", torch.bfloat16),
                                                     ("fp16", torch.float16)])
def test_param_copy(tmp_path, copy_dtype, torch_dtype):
    model, opt = _trained()
    path = _write(tmp_path, model, opt, param_copy_dtype=copy_dtype)
    manifest = _manifest(path)
    assert manifest["param_copy_dtype"] == \
        {"bf16": "DTYPE_BFLOAT16", "fp16": "DTYPE_FLOAT16"}[copy_dtype]
    assert "param_copy.safetensors" in manifest["files"]
    with open(os.path.join(path, "param_copy.safetensors"), "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert {e["dtype"] for e in header.values()} == {"BF16" if copy_dtype == "bf16" else "F16"}
    backends = [False] + ([True] if safetensors_torch is not None else [])
    for use_package in backends:
        copies = checkpoint.decode_safetensors(raw, use_package=use_package)
        for name, p in model.named_parameters():
            assert copies[name].dtype == torch_dtype
            assert torch.equal(copies[name], p.detach().to(torch_dtype)), name
    checkpoint.to_torch(path)  # every file verifies


def test_codec_round_trip(tmp_path):
    g = torch.Generator().manual_seed(5)
    tensors = {
        "w\u00e9": torch.randn(3, 5, generator=g),
        "scalar": torch.tensor(0.25),
        "empty": torch.zeros(0, 4),
        "bf": torch.randn(7, generator=g).to(torch.bfloat16),
        "half": torch.randn(2, 3, generator=g).to(torch.float16),
    }
    path = str(tmp_path / "t.safetensors")
    size, crc = checkpoint.write_safetensors(path, tensors, metadata={"k": "v"})
    with open(path, "rb") as f:
        raw = f.read()
    assert size == len(raw) and crc == zlib.crc32(raw)
    assert struct.unpack("<Q", raw[:8])[0] % 8 == 0
    decoded = checkpoint.decode_safetensors(raw, use_package=False)
    assert list(decoded) == list(tensors)  # data in the order given
    for name, t in tensors.items():
        assert decoded[name].dtype == t.dtype and decoded[name].shape == t.shape, name
        assert torch.equal(decoded[name], t), name
    if safetensors_torch is not None:
        loaded = safetensors_torch.load_file(path)
        for name, t in tensors.items():
            assert torch.equal(loaded[name], t), name
        other = str(tmp_path / "package.safetensors")
        safetensors_torch.save_file(tensors, other)
        with open(other, "rb") as f:
            from_package = checkpoint.decode_safetensors(f.read(), use_package=False)
        for name, t in tensors.items():
            assert torch.equal(from_package[name], t), name
    for bad in [raw[:7], raw[:-1], raw + b"\0"]:
        with pytest.raises(ValueError, match="not a valid safetensors file"):
            checkpoint.decode_safetensors(bad, use_package=False)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_optimizer_loaded_from_checkpoint_continues_exactly(tmp_path, cls):
    model, opt = _trained(cls=cls)
    sd = opt.state_dict()
    if cls is torch.optim.Adam:
        for g in sd["param_groups"]:  # Adam's L2 decay; torch < 2.6 does not record it
            g.setdefault("decoupled_weight_decay", False)
            assert g["decoupled_weight_decay"] is False
    kw = {} if NAMED else {"param_names": ORDER}
    path = checkpoint.from_torch(model.state_dict(), sd, str(tmp_path), group_names=GROUP_NAMES,
                                 **kw)
    expected_decoupled = cls is torch.optim.AdamW
    groups = _manifest(path)["param_groups"]  # "default" (AdamW's defaults), body, head
    assert [g["hyperparameters"]["weight_decay_mode"] for g in groups] == \
        ["WEIGHT_DECAY_MODE_DECOUPLED"] + \
        ["WEIGHT_DECAY_MODE_DECOUPLED" if expected_decoupled else "WEIGHT_DECAY_MODE_L2"] * 2
    model_state, optim_state = checkpoint.to_torch(path)
    assert [g["decoupled_weight_decay"] for g in optim_state["param_groups"]] == \
        [expected_decoupled] * 2

    fresh = _model(2)  # other values, overwritten below
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(model_state[n])
    params = dict(fresh.named_parameters())
    # torch's default hyperparameters: load_state_dict brings the checkpoint's.
    fresh_opt = cls([{"params": [params[n] for n in g["param_names"]]}
                     for g in optim_state["param_groups"]], foreach=False)
    fresh_opt.load_state_dict(optim_state)
    for g in fresh_opt.param_groups:
        g["foreach"] = False
        assert g["lr"] in (0.01, 0.005)
    _assert_same_training_state(model, opt, fresh, fresh_opt)
    for s in range(3, 8):
        _step(model, opt, s)
        _step(fresh, fresh_opt, s)
    _assert_same_training_state(model, opt, fresh, fresh_opt)
    assert all(opt.state[p]["step"].item() == 8 for p in opt.state)
    assert params["unused"] not in fresh_opt.state


def test_corruption_is_reported(tmp_path):
    model, opt = _trained()
    root = tmp_path / "ckpt"
    path = _write(root, model, opt)
    checkpoint.to_torch(path)

    target = os.path.join(path, "exp_avg.safetensors")
    with open(target, "rb") as f:
        raw = f.read()
    with open(target, "wb") as f:
        f.write(raw[:-1] + bytes([raw[-1] ^ 0x01]))
    with pytest.raises(ValueError, match=r"/exp_avg\.safetensors does not match its crc32"):
        checkpoint.to_torch(path)
    with open(target, "wb") as f:
        f.write(raw[:-4])
    with pytest.raises(ValueError, match=r"/exp_avg\.safetensors has \d+ bytes"):
        checkpoint.to_torch(path)
    os.remove(target)
    with pytest.raises(ValueError, match=r"/exp_avg\.safetensors is missing"):
        checkpoint.to_torch(path)
    with open(target, "wb") as f:
        f.write(raw)
    checkpoint.to_torch(path)

    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path, "rb") as f:
        text = f.read()
    with open(manifest_path, "wb") as f:
        f.write(text[:len(text) // 2])
    with pytest.raises(ValueError, match=r"manifest\.json is not valid JSON"):
        checkpoint.to_torch(path)
    for key, value, match in [("format_version", 5, "format_version 5 is unknown"),
                              ("format_version", 1, "format_version 1 is unknown"),
                              ("format_version", "4", "format_version '4' is unknown"),
                              ("format", "other", "format 'other'"),
                              ("version", -1, "version"),
                              ("version", "x", "version"),
                              ("checksum", "crc32", "checksum")]:  # a key the message lacks
        m = json.loads(text)
        m[key] = value
        with open(manifest_path, "w", encoding="utf-8") as f:
            json.dump(m, f)
        with pytest.raises(ValueError, match=match):
            checkpoint.to_torch(path)

    def with_crc32(m, value):
        m["files"]["exp_avg.safetensors"]["crc32"] = value
        with open(manifest_path, "w", encoding="utf-8") as f:
            json.dump(m, f)

    # crc32, a uint32 of the message: what protobuf's JSON mapping takes for one (a number, or
    # its decimal string), never a bool, a negative, a wider number or the old sha256.
    crc = zlib.crc32(raw)
    for value in [True, -1, 1 << 32, 1.5, format(crc, "08x"), "0x%x" % crc]:
        with_crc32(json.loads(text), value)
        with pytest.raises(ValueError, match="crc32"):
            checkpoint.to_torch(path)
    for value in [crc, float(crc), str(crc)]:
        with_crc32(json.loads(text), value)
        checkpoint.to_torch(path)
    # Format 3: an unsigned 32-bit JSON integer only.
    for value in [True, -1, 1 << 32, float(crc), str(crc), format(crc, "08x"), None]:
        with_crc32(to_format_3(json.loads(text)), value)
        with pytest.raises(ValueError, match=r"a bad entry in 'files' for 'exp_avg\.safetensors'"):
            checkpoint.to_torch(path)
    with_crc32(to_format_3(json.loads(text)), crc)
    checkpoint.to_torch(path)


def test_root_resolution(tmp_path):
    model, opt = _trained()
    root = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError):
        checkpoint.to_torch(str(root))
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.to_torch(str(root))
    first = _write(root, model, opt, version=1)
    (root / ("checkpoint-%020d" % 2)).mkdir()  # incomplete: no manifest (a crash)
    assert checkpoint.resolve_checkpoint(str(root)) == first
    third = _write(root, model, opt, version=3)  # the serial counts the incomplete one too
    assert os.path.basename(third) == "checkpoint-%020d" % 3
    # A crash between the manifest's rename and latest's move: the manifest is the commit.
    (root / "latest").write_text(os.path.basename(first))
    assert checkpoint.resolve_checkpoint(str(root)) == third
    assert _manifest(checkpoint.resolve_checkpoint(str(root)))["version"] == "3"


def test_from_torch_rejects_bad_input(tmp_path):
    model, opt = _trained()
    ms, sd = model.state_dict(), _unnamed(opt.state_dict())
    root = tmp_path / "never"

    def fails(exc, match, model_state=ms, optim_state=sd, **kw):
        kw.setdefault("param_names", ORDER)
        with pytest.raises(exc, match=match):
            checkpoint.from_torch(model_state, optim_state, str(root), **kw)

    bad = copy.deepcopy(sd)
    del bad["state"][1]["exp_avg_sq"]
    fails(ValueError, r"optim_state\['state'\]\[1\] \('fc1.bias'\) has no 'exp_avg_sq'",
          optim_state=bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(2)
    fails(ValueError, r"\['exp_avg'\] has shape \(2,\)", optim_state=bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["step"] = torch.tensor(1.5)
    fails(ValueError, r"\['step'\] must be a non-negative integer", optim_state=bad)
    fails(ValueError, "param_names: 'scale' appears twice",
          param_names=ORDER[:-1] + ["scale"])
    fails(ValueError, "param_names: 6 names for the optimizer's 7 params",
          param_names=ORDER[:-1])
    fails(ValueError, "model_state's keys: 8 names for the optimizer's 7 params",
          model_state={**ms, "buffer": torch.zeros(1)}, param_names=None)
    fails(ValueError, "model_state has no 'fc1.bias'",
          model_state={k: v for k, v in ms.items() if k != "fc1.bias"})
    fails(TypeError, r"model_state\['scale'\] must be a dense floating point tensor",
          model_state={**ms, "scale": torch.tensor(1)})
    for key in ("lr", "eps", "amsgrad"):
        bad = copy.deepcopy(sd)
        del bad["param_groups"][1][key]
        fails(ValueError, rf"optim_state\['param_groups'\]\[1\] has no '{key}'", optim_state=bad)
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["betas"] = (0.9, 1.0)
    fails(ValueError, r"\['betas'\] must be in \[0, 1\)", optim_state=bad)
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = float("nan")
    fails(ValueError, r"\['lr'\] must be finite", optim_state=bad)
    bad = copy.deepcopy(sd)
    bad["param_groups"][1]["params"] = [0, 3, 4, 5]
    fails(ValueError, "a param index appears twice", optim_state=bad)
    fails(ValueError, "group_names: 1 names for 2 groups", group_names=["a"])
    fails(ValueError, "group_names: 'a' appears twice", group_names=["a", "a"])
    fails(ValueError, "'default' must come first", group_names=["a", "default"])
    fails(ValueError, "not a string of 1 to 128 bytes", group_names=["a", "\u00e9" * 65])
    fails(ValueError, "param_copy_dtype", param_copy_dtype="int8")
    fails(ValueError, "version must be a non-negative integer", version=-1)
    fails(ValueError, "optim_state has no 'state'", optim_state={"param_groups": []})
    assert not root.exists()  # nothing was written


def test_group_names_default_and_empty_groups(tmp_path):
    model, opt = _trained()
    path = _write(tmp_path, model, opt, group_names=None)
    m = _manifest(path)
    assert [g["name"] for g in m["param_groups"]] == ["default", "group1"]
    assert m["param_groups"][0]["hyperparameters"]["lr"] == 0.01
    assert m["param_groups"][1]["hyperparameters"]["amsgrad"] is True
    # A group without tensors (as the server's "default" often is) is left out of to_torch's
    # param_groups; indices still run group by group.
    m["param_groups"].insert(1, dict(m["param_groups"][0], name="idle"))
    with open(os.path.join(path, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(m, f)
    _, optim_state = checkpoint.to_torch(path)
    assert [g["params"] for g in optim_state["param_groups"]] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [g["param_names"] for g in optim_state["param_groups"]] == [g[0] for g in GROUPS]


def _doc_manifest_keys():
    """Top-level manifest keys and the keys of nested objects, from docs/checkpoints.md."""
    with open(os.path.join(REPO_ROOT, "docs", "checkpoints.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("| key | value |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", table, re.M)
    nested = {k: set(re.findall(r'"(\w+)"', _first_object(v))) for k, v in rows if "{" in v}
    return [k for k, _ in rows], nested


def _first_object(text):
    """The first {...} of a table cell, braces matched (the prose after it names values)."""
    begin = text.index("{")
    depth = 0
    for i, c in enumerate(text[begin:], begin):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return text[begin:i + 1]
    raise ValueError(f"unbalanced braces in {text!r}")


def test_manifest_has_the_documented_keys(tmp_path):
    keys, nested = _doc_manifest_keys()
    assert len(keys) == 13 and {"param_groups", "tensors", "files"} <= set(nested)
    assert keys[-1] == "int8_codebooks"  # only when a tensor has int8 state: never here
    model, opt = _trained()
    before = int(time.time())
    path = _write(tmp_path, model, opt)
    m = _manifest(path)
    # The message's fields, in their order, every one printed (defaults too), as documented.
    assert list(m) == keys[:-1]
    assert [f.name for f in ckpt_pb.CheckpointManifest.DESCRIPTOR.fields] == keys
    assert m["format"] == "fusedps-checkpoint" and m["format_version"] == 4
    # 64-bit integers are JSON strings in protobuf's JSON mapping.
    assert m["serial"] == "1" and m["version"] == "3" and m["server_version"] == "python"
    assert before <= m["created_unix_seconds"] <= time.time() + 1
    assert m["param_copy_dtype"] == "DTYPE_UNSPECIFIED"  # No param copy.
    assert m["retry_table"] == [] and m["plan_hash"] == ""
    # The server's group 0 is "default": from_torch adds it, with AdamW's defaults.
    assert [g["name"] for g in m["param_groups"]] == ["default"] + GROUP_NAMES
    defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    # Protobuf's JSON mapping of fusedps.v1.Hyperparameters, every field present.
    assert m["param_groups"][0] == dict(name="default", hyperparameters=dict(
        lr=defaults["lr"], beta1=defaults["betas"][0], beta2=defaults["betas"][1],
        eps=defaults["eps"], weight_decay=defaults["weight_decay"], amsgrad=False,
        maximize=False, weight_decay_mode="WEIGHT_DECAY_MODE_DECOUPLED",
        state_dtype="STATE_DTYPE_FLOAT32", params_dtype="DTYPE_FLOAT32", rounding_seed="0"))
    for g, (_, h) in zip(m["param_groups"][1:], GROUPS):
        assert set(g) == nested["param_groups"]
        hyper = g["hyperparameters"]
        assert (hyper["lr"], hyper["weight_decay"], hyper["amsgrad"]) == (
            h["lr"], h["weight_decay"], h.get("amsgrad", False))
    params = dict(model.named_parameters())
    assert [t["name"] for t in m["tensors"]] == ORDER
    for t in m["tensors"]:
        # "hashed" only for a table with hashed keys (none here).
        assert set(t) == nested["tensors"] - {"hashed"}
        assert t["shape"] == [str(d) for d in params[t["name"]].shape]
        assert t["step"] == ("0" if t["name"] == "unused" else "3")
        assert (t["params_dtype"], t["state_dtype"]) == ("DTYPE_FLOAT32", "STATE_DTYPE_FLOAT32")
        assert t["param_group"] == ("body" if t["name"] in GROUPS[0][0] else "head")
    for entry in m["files"].values():
        assert set(entry) == nested["files"]


def test_buffers_round_trip_through_from_torch_and_to_torch(tmp_path):
    """A module's buffers (model_state's entries that are not optimizer params) are written
    to buffers.safetensors as they are, dtype included, and come back from to_torch: a strict
    load_state_dict of a BatchNorm model works. Before, from_torch dropped them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 3)).square().mean().backward()
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    directory = checkpoint.from_torch(model.state_dict(), _unnamed(opt.state_dict()),
                                      str(tmp_path), param_names=names)
    assert checkpoint.BUFFERS in os.listdir(directory)
    model_state, _ = checkpoint.to_torch(directory)
    assert model_state["1.num_batches_tracked"].dtype == torch.int64
    restored = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    restored.load_state_dict(model_state, strict=True)
    for name, t in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], t), name
