"""Checkpoints of low-precision storage (issue 16; docs/checkpoints.md) and fusedps.checkpoint.

Against real servers: a checkpoint holds the stored form (U8 codes and F32 scales of int8
state, BF16 state and params) that an independent reader here dequantizes to exactly what the
server serves; to_torch returns exactly that; a server restored from it serves the same bits
and, with bf16 params, rounds the next steps' params to the same bits as the server that wrote
it.

Offline: to_torch of hand-made checkpoints of formats 2, 3 and 4 (its codebook is the
manifest's, not its own), of manifests written before the storage keys (all fp32), and of bad
ones; from_torch writes fp32 storage only.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest
import torch

import fusedps
from fusedps import checkpoint
from quant_reference import SIGNED, UNSIGNED, is_bf16
from server_fixture import running_server

# name -> (shape, group); groups: register_param_group storage.
GROUPS = {"ck-int8": dict(state_dtype="int8", lr=0.01),
          "ck-bf16": dict(state_dtype="bf16", params_dtype="bf16", rounding_seed=5, lr=0.01),
          "ck-int8bf": dict(state_dtype="int8", params_dtype="bf16", rounding_seed=6, lr=0.01),
          "ck-ams": dict(amsgrad=True, lr=0.01)}
TENSORS = {"ck-int8/w": ((4, 1099), "ck-int8"), "ck-int8/b": ((300,), "ck-int8"),
           "ck-bf16/w": ((64, 64), "ck-bf16"), "ck-int8bf/w": ((80, 64), "ck-int8bf"),
           "ck-ams/w": ((10,), "ck-ams")}
LAYOUTS = {"ck-int8/w": ("fp32", "int8"), "ck-int8/b": ("fp32", "fp32"),
           "ck-bf16/w": ("bf16", "bf16"), "ck-int8bf/w": ("bf16", "int8"),
           "ck-ams/w": ("fp32", "fp32")}
NAMES = list(TENSORS)


def _read_stored(path):
    """name -> numpy array of a safetensors file in its stored dtype (F32, BF16 as float32,
    U8), read by the format's definition."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        chunk = data[begin:end]
        if e["dtype"] == "F32":
            values = np.frombuffer(chunk, "<f4")
        elif e["dtype"] == "BF16":
            values = (np.frombuffer(chunk, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            assert e["dtype"] == "U8", e
            values = np.frombuffer(chunk, np.uint8)
        out[name] = (e["dtype"], values.reshape(e["shape"]))
    return out


def _write_stored(path, tensors):
    """Writes name -> torch tensor (float32, bfloat16 or uint8) as a safetensors file by the
    format's definition; returns (bytes, crc32) for the manifest."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        flat = t.contiguous().reshape(-1)
        raw = (flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    data = struct.pack("<Q", len(head)) + head + b"".join(blobs)
    with open(path, "wb") as f:
        f.write(data)
    return len(data), zlib.crc32(data)


def _setup(client, seed=1):
    for group, kwargs in GROUPS.items():
        client.register_param_group(group, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    for name, (shape, group) in TENSORS.items():
        client.register_model([(name, torch.randn(shape, generator=gen))], param_group=group)


def _push(client, gen):
    grads = {n: torch.randn(s, generator=gen) * 10.0 ** torch.empty(()).uniform_(
        -3, 1, generator=gen) for n, (s, _) in TENSORS.items()}
    assert not client.push_gradients(grads, grad_dtype="float32").step_skipped


def _served(client):
    """field -> name -> fp32 tensor as the server serves it (every tensor; max_exp_avg_sq
    of the amsgrad one)."""
    out = {"param": dict(client.pull_parameters(NAMES))}
    for field in ("exp_avg", "exp_avg_sq"):
        out[field] = client.pull_state(field, NAMES)[0]
    out["max_exp_avg_sq"] = client.pull_state("max_exp_avg_sq", ["ck-ams/w"])[0]
    return out


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_checkpoint_holds_the_stored_form_and_to_torch_dequantizes_it_exactly(tmp_path):
    root = tmp_path / "ckpt"
    gen = torch.Generator().manual_seed(2)
    with running_server([f"--checkpoint-dir={root}"]) as target, \
            fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        _setup(client)
        for _ in range(3):
            _push(client, gen)
        _, path = client.checkpoint()
        served = _served(client)

    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["format_version"] == 4
    groups = {g["name"]: g["hyperparameters"] for g in manifest["param_groups"]}
    proto_names = {"fp32": "FLOAT32", "bf16": "BFLOAT16", "int8": "INT8"}
    for group, kwargs in GROUPS.items():
        g = groups[group]  # protobuf's JSON mapping: enums by name, uint64 as a string
        assert g["state_dtype"] == "STATE_DTYPE_" + proto_names[kwargs.get("state_dtype", "fp32")]
        assert g["params_dtype"] == "DTYPE_" + proto_names[kwargs.get("params_dtype", "fp32")]
        assert g["rounding_seed"] == str(kwargs.get("rounding_seed", 0))
    for t in manifest["tensors"]:  # format 4: the proto's enums, by name
        params_dtype, state_dtype = LAYOUTS[t["name"]]
        assert (t["params_dtype"], t["state_dtype"]) == (
            "DTYPE_" + proto_names[params_dtype], "STATE_DTYPE_" + proto_names[state_dtype])
    books = manifest["int8_codebooks"]
    assert np.array_equal(np.float32(books["exp_avg"]), SIGNED.astype(np.float32))
    assert np.array_equal(np.float32(books["exp_avg_sq"]), UNSIGNED.astype(np.float32))
    assert {"exp_avg_absmax.safetensors", "exp_avg_sq_absmax.safetensors"} <= set(
        manifest["files"])

    # The files, read and dequantized here: exactly what the server serves.
    files = {f[:-len(".safetensors")]: _read_stored(os.path.join(path, f))
             for f in manifest["files"]}
    for name in NAMES:
        params_dtype, state_dtype = LAYOUTS[name]
        numel = served["param"][name].numel()
        dtype, values = files["params"][name]
        assert dtype == {"fp32": "F32", "bf16": "BF16"}[params_dtype], name
        assert np.array_equal(values, served["param"][name].numpy()), name
        if params_dtype == "bf16":
            assert is_bf16(values).all()
        for field, table in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
            dtype, values = files[field][name]
            assert dtype == {"fp32": "F32", "bf16": "BF16", "int8": "U8"}[state_dtype], name
            if state_dtype == "int8":
                scale_dtype, absmax = files[f"{field}_absmax"][name]
                assert scale_dtype == "F32" and absmax.shape == (-(-numel // 256),)
                values = (table.astype(np.float32)[values.reshape(-1).astype(np.int64)] *
                          np.repeat(absmax, 256)[:numel]).reshape(values.shape)
            else:
                assert name not in files.get(f"{field}_absmax", {}), name
            assert np.array_equal(values.view(np.int32),
                                  served[field][name].numpy().view(np.int32)), (name, field)

    model_state, optim_state = checkpoint.to_torch(path)
    index = {n: i for g in optim_state["param_groups"]
             for i, n in zip(g["params"], g["param_names"])}
    for name in NAMES:
        assert model_state[name].dtype == torch.float32
        assert torch.equal(_bits(model_state[name]), _bits(served["param"][name])), name
        entry = optim_state["state"][index[name]]
        assert int(entry["step"].item()) == 3
        for field in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name in served[field]:
                assert entry[field].dtype == torch.float32
                assert torch.equal(_bits(entry[field]), _bits(served[field][name])), (name,
                                                                                     field)


def test_restore_serves_the_same_bits_and_replays_the_rounding(tmp_path):
    """A server restored from a checkpoint serves its codes, scales and bf16 values bit for bit,
    and 10 more identical pushes give the same bits on both (stochastic rounding included)."""
    root = tmp_path / "ckpt"
    gen = torch.Generator().manual_seed(4)
    with running_server([f"--checkpoint-dir={root}"]) as target, \
            fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        _setup(client, seed=3)
        for _ in range(2):
            _push(client, gen)
        _, path = client.checkpoint()
        at_checkpoint = _served(client)
        state = gen.get_state()
        for _ in range(10):
            _push(client, gen)
        after = _served(client)
    with running_server([f"--restore={path}"]) as target, fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        restored = _served(client)
        gen.set_state(state)
        for _ in range(10):
            _push(client, gen)
        replayed = _served(client)
    for field in at_checkpoint:
        for name in at_checkpoint[field]:
            assert torch.equal(_bits(restored[field][name]),
                               _bits(at_checkpoint[field][name])), (field, name)
            assert torch.equal(_bits(replayed[field][name]), _bits(after[field][name])), (
                field, name)
    for name in ("ck-bf16/w", "ck-int8bf/w"):  # the rounding moved them
        assert not torch.equal(after["param"][name], at_checkpoint["param"][name])


# -- offline: hand-made checkpoints ---------------------------------------------------------------

def _hand_made(root, *, codebook_scale=1.0, format_version=2, table=False):
    """A checkpoint written here by the format's definition (docs/checkpoints.md, format 2, 3
    or 4): group "q" (int8 state, bf16 params) with "q/w" (5000 elements: int8) and "q/b" (10:
    fp32 state), group "h" (bf16 state) with "h/w"; with ``table`` (format 4), group "e" (int8
    state) with the embedding table "e/t" [120, 37]: one scale per row. Returns (directory,
    expected fp32 values: field -> name -> tensor). The codebooks are a linear map times
    codebook_scale, not the server's: to_torch must use the manifest's. The bad-storage cases
    below edit format 2's keys (and format 4's), and the server's checkpoints of format 4 are
    tested above."""
    gen = torch.Generator().manual_seed(8)
    book = {"exp_avg": torch.linspace(-1, 1, 256) * codebook_scale,
            "exp_avg_sq": torch.linspace(0, 1, 256) * codebook_scale}
    book = {k: v.float() for k, v in book.items()}
    params = {"q/w": torch.randn(50, 100, generator=gen).bfloat16(),
              "q/b": torch.randn(10, generator=gen).bfloat16(),
              "h/w": torch.randn(7, 3, generator=gen)}
    files = {"params": dict(params), "exp_avg": {}, "exp_avg_sq": {}, "exp_avg_absmax": {},
             "exp_avg_sq_absmax": {}}
    expected = {"param": {n: p.float() for n, p in params.items()}, "exp_avg": {},
                "exp_avg_sq": {}}
    codes = torch.randint(0, 256, (2, 5000), generator=gen, dtype=torch.uint8)
    for i, field in enumerate(("exp_avg", "exp_avg_sq")):
        absmax = torch.rand(20, generator=gen) * 10 ** i
        files[field]["q/w"] = codes[i].reshape(50, 100)
        files[f"{field}_absmax"]["q/w"] = absmax
        expected[field]["q/w"] = torch.from_numpy(
            book[field].numpy()[codes[i].numpy().astype(np.int64)] *
            np.repeat(absmax.numpy(), 256)[:5000]).reshape(50, 100)
        small = torch.rand(10, generator=gen)
        files[field]["q/b"] = small
        expected[field]["q/b"] = small
        bf = torch.rand(7, 3, generator=gen).bfloat16()
        files[field]["h/w"] = bf
        expected[field]["h/w"] = bf.float()
        if table:  # A scale per row: value = book[code] * absmax[i // 37].
            row_codes = torch.randint(0, 256, (120, 37), generator=gen, dtype=torch.uint8)
            row_absmax = torch.rand(120, generator=gen) * 10.0 ** torch.arange(-5.0, 7.0).repeat(
                10)
            files[field]["e/t"], files[f"{field}_absmax"]["e/t"] = row_codes, row_absmax
            expected[field]["e/t"] = book[field][row_codes.long()] * row_absmax.unsqueeze(1)
    if table:
        files["params"]["e/t"] = torch.randn(120, 37, generator=gen)
        expected["param"]["e/t"] = files["params"]["e/t"]
    directory = os.path.join(root, "checkpoint-%020d" % 1)
    os.makedirs(directory)
    listed = {}
    for field, tensors in files.items():
        size, crc = _write_stored(os.path.join(directory, f"{field}.safetensors"), tensors)
        listed[f"{field}.safetensors"] = {"bytes": size, "crc32": crc}
    if format_version == 2:  # Each hyperparameter a key of its group.
        hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                     amsgrad=False, maximize=False, decoupled_weight_decay=True)
        param_groups = [dict(name="default", **hyper),
                        dict(name="q", state_dtype="int8", params_dtype="bf16",
                             rounding_seed=2**64 - 1, **hyper),
                        dict(name="h", state_dtype="bf16", params_dtype="fp32",
                             rounding_seed=0, **hyper)]
    else:  # protobuf's JSON mapping of fusedps.v1.Hyperparameters; absent fields: defaults.
        hyper = dict(lr=0.01, weight_decay=0.0, weight_decay_mode="WEIGHT_DECAY_MODE_DECOUPLED")
        param_groups = [dict(name="default", hyperparameters=hyper),
                        dict(name="q", hyperparameters=dict(
                            state_dtype="STATE_DTYPE_INT8", params_dtype="DTYPE_BFLOAT16",
                            rounding_seed=str(2**64 - 1), **hyper)),
                        dict(name="h", hyperparameters=dict(
                            state_dtype="STATE_DTYPE_BFLOAT16", **hyper))]
        if table:
            param_groups.append(dict(name="e", hyperparameters=dict(
                state_dtype="STATE_DTYPE_INT8", **hyper)))
    manifest = {
        "format": "fusedps-checkpoint", "format_version": format_version, "serial": 1,
        "version": 4, "server_version": "test", "created_unix_seconds": 0,
        "param_copy_dtype": "none", "param_groups": param_groups,
        "tensors": [dict(name="q/w", shape=[50, 100], param_group="q", step=4,
                         params_dtype="bf16", state_dtype="int8"),
                    dict(name="q/b", shape=[10], param_group="q", step=4,
                         params_dtype="bf16", state_dtype="fp32"),
                    dict(name="h/w", shape=[7, 3], param_group="h", step=2,
                         params_dtype="fp32", state_dtype="bf16")],
        "int8_codebooks": {k: [float(x) for x in v] for k, v in book.items()},
        "retry_table": [], "files": listed}
    if table:
        assert format_version == 4
        manifest["tensors"].append(dict(name="e/t", shape=[120, 37], param_group="e", step=3,
                                        params_dtype="fp32", state_dtype="int8", table=True))
    if format_version == 4:  # fusedps.v1.CheckpointManifest: 64-bit integers as strings, enums
        enum = {"fp32": "FLOAT32", "bf16": "BFLOAT16", "int8": "INT8"}
        manifest.update(serial="1", version="4", plan_hash="",
                        param_copy_dtype="DTYPE_UNSPECIFIED")
        for t in manifest["tensors"]:
            t.update(shape=[str(d) for d in t["shape"]], step=str(t["step"]),
                     params_dtype="DTYPE_" + enum[t["params_dtype"]],
                     state_dtype="STATE_DTYPE_" + enum[t["state_dtype"]])
        for entry in listed.values():
            entry["bytes"] = str(entry["bytes"])
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return directory, expected


@pytest.mark.parametrize("format_version", [2, 3, 4])
def test_to_torch_dequantizes_with_the_manifests_codebooks(tmp_path, format_version):
    for scale in (1.0, 0.5):
        directory, expected = _hand_made(tmp_path / str(scale), codebook_scale=scale,
                                         format_version=format_version)
        model_state, optim_state = checkpoint.to_torch(directory)
        index = {n: i for g in optim_state["param_groups"]
                 for i, n in zip(g["params"], g["param_names"])}
        assert [g["param_names"] for g in optim_state["param_groups"]] == [["q/w", "q/b"],
                                                                            ["h/w"]]
        for name, want in expected["param"].items():
            assert model_state[name].dtype == torch.float32
            assert torch.equal(model_state[name], want), name
        for field in ("exp_avg", "exp_avg_sq"):
            for name, want in expected[field].items():
                got = optim_state["state"][index[name]][field]
                assert got.dtype == torch.float32 and got.shape == want.shape
                assert torch.equal(_bits(got), _bits(want)), (scale, field, name)


def test_to_torch_dequantizes_a_tables_int8_state_row_by_row(tmp_path):
    """An embedding table's int8 state has one scale per row (the manifest's tensor has
    ``table``: a block of dim elements, not 256): to_torch dequantizes it with its row's scale;
    scales of another count, or a table mark on a dense tensor, are refused."""
    directory, expected = _hand_made(tmp_path / "ok", format_version=4, table=True)
    model_state, optim_state = checkpoint.to_torch(directory)
    index = {n: i for g in optim_state["param_groups"]
             for i, n in zip(g["params"], g["param_names"])}
    assert torch.equal(model_state["e/t"], expected["param"]["e/t"])
    entry = optim_state["state"][index["e/t"]]
    for field in ("exp_avg", "exp_avg_sq"):
        got, want = entry[field], expected[field]["e/t"]
        assert got.dtype == torch.float32 and got.shape == (120, 37)
        assert torch.equal(_bits(got), _bits(want)), field
        assert torch.equal(_bits(optim_state["state"][index["q/w"]][field]),
                           _bits(expected[field]["q/w"])), field  # still blocks of 256
    # The table unmarked (its 120 scales read as a dense tensor's 18), a dense tensor marked.
    for t, mark, match in (
            (3, False, r"'e/t' is torch.float32 \(120,\), expected torch.float32 \(18,\)"),
            (0, True, r"'q/w' is torch.float32 \(20,\), expected torch.float32 \(50,\)")):
        directory, _ = _hand_made(tmp_path / str(t), format_version=4, table=True)
        _edit_manifest(directory, lambda m: m["tensors"][t].update(table=mark))
        with pytest.raises(ValueError, match=match):
            checkpoint.to_torch(directory)
    directory, _ = _hand_made(tmp_path / "1d", format_version=4, table=True)
    _edit_manifest(directory, lambda m: m["tensors"][1].update(table=True))
    with pytest.raises(ValueError, match=r"a table's shape must be \[rows, dim\]"):
        checkpoint.to_torch(directory)


def _edit_manifest(directory, edit):
    path = os.path.join(directory, "manifest.json")
    with open(path, encoding="utf-8") as f:
        m = json.load(f)
    edit(m)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(m, f)


BAD_MANIFESTS = [
    (lambda m: m.pop("int8_codebooks"), "int8_codebooks is missing"),
    (lambda m: m["int8_codebooks"]["exp_avg"].pop(), "is not 256 numbers"),
    (lambda m: m["int8_codebooks"]["exp_avg_sq"].reverse(), "not ascending"),
    (lambda m: m["param_groups"][1].update(state_dtype="int4"), "state_dtype 'int4'"),
    (lambda m: m["param_groups"][1].update(params_dtype="fp16"), "params_dtype 'fp16'"),
    (lambda m: m["param_groups"][1].update(rounding_seed=-1), "rounding_seed -1"),
    (lambda m: m["param_groups"][2].update(amsgrad=True), "amsgrad with state_dtype"),
    (lambda m: m["tensors"][1].update(state_dtype="int8"), "state_dtype 'int8', but its group"),
    (lambda m: m["tensors"][0].update(params_dtype="fp32"), "params_dtype 'fp32', but its"),
    # Either wrong entry may be named first (the reader's file order).
    (lambda m: _all_fp32_state(m), r"torch\.(uint8|bfloat16) .*expected torch\.float32"),
]


def _all_fp32_state(m):
    """The groups say fp32 state: the files' U8 and BF16 entries are then of the wrong dtype."""
    for g in m["param_groups"][1:]:
        g["state_dtype"] = "fp32"
    for t in m["tensors"]:
        t.pop("state_dtype")


@pytest.mark.parametrize("edit,match", BAD_MANIFESTS)
def test_to_torch_refuses_bad_storage(tmp_path, edit, match):
    directory, _ = _hand_made(tmp_path)
    _edit_manifest(directory, edit)
    with pytest.raises(ValueError, match=match):
        checkpoint.to_torch(directory)


# Format 4: the manifest is the message's JSON (a key it lacks is refused, naming it; dtypes
# are the proto's enums), then held to the same rules as formats 2 and 3.
BAD_FORMAT_4 = [
    (lambda m: m.update(trained_on="cluster-7"), "trained_on"),
    (lambda m: m["files"]["params.safetensors"].update(sha256="00"), "sha256"),
    (lambda m: m["tensors"][0].update(state_dtype="int8"), "int8"),
    (lambda m: m["tensors"][1].update(state_dtype="STATE_DTYPE_INT8"),
     "state_dtype 'int8', but its group"),
    (lambda m: m["int8_codebooks"]["exp_avg"].pop(), "is not 256 numbers"),
    (lambda m: m["param_groups"][2]["hyperparameters"].update(amsgrad=True),
     "amsgrad with state_dtype"),
    (lambda m: m["tensors"][2].update(step="-1"), "step is not a non-negative integer"),
]


@pytest.mark.parametrize("edit,match", BAD_FORMAT_4)
def test_to_torch_refuses_a_bad_format_4_manifest(tmp_path, edit, match):
    directory, _ = _hand_made(tmp_path, format_version=4)
    checkpoint.to_torch(directory)
    _edit_manifest(directory, edit)
    with pytest.raises(ValueError, match=match):
        checkpoint.to_torch(directory)


def test_absmax_of_another_shape_is_refused(tmp_path):
    directory, _ = _hand_made(tmp_path)
    path = os.path.join(directory, "exp_avg_absmax.safetensors")
    size, crc = _write_stored(path, {"q/w": torch.ones(19)})
    _edit_manifest(directory, lambda m: m["files"]["exp_avg_absmax.safetensors"].update(
        bytes=size, crc32=crc))
    with pytest.raises(ValueError, match=r"'q/w' is torch.float32 \(19,\), expected "
                                         r"torch.float32 \(20,\)"):
        checkpoint.to_torch(directory)


def _torch_state():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_manifest_without_storage_keys_reads_as_fp32(tmp_path):
    """Checkpoints written before the storage keys existed: every group and tensor fp32."""
    model, opt = _torch_state()
    directory = checkpoint.from_torch(model.state_dict(), opt.state_dict(), str(tmp_path),
                                      param_names=["weight", "bias"])
    before = checkpoint.to_torch(directory)

    def strip(m):
        for entry in m["param_groups"] + m["tensors"]:
            for key in ("state_dtype", "params_dtype", "rounding_seed"):
                entry.pop(key, None)
    _edit_manifest(directory, strip)
    after = checkpoint.to_torch(directory)
    for name in ("weight", "bias"):
        assert torch.equal(before[0][name], after[0][name])
    for i in (0, 1):
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before[1]["state"][i][field], after[1]["state"][i][field])


def test_from_torch_writes_fp32_storage_only(tmp_path):
    model, opt = _torch_state()
    directory = checkpoint.from_torch(model.state_dict(), opt.state_dict(), str(tmp_path),
                                      param_names=["weight", "bias"])
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    for g in m["param_groups"]:
        h = g["hyperparameters"]
        assert (h["state_dtype"], h["params_dtype"], h["rounding_seed"]) == (
            "STATE_DTYPE_FLOAT32", "DTYPE_FLOAT32", "0")
    for t in m["tensors"]:
        assert (t["params_dtype"], t["state_dtype"]) == ("DTYPE_FLOAT32", "STATE_DTYPE_FLOAT32")
    assert "int8_codebooks" not in m
    for key, value in (("state_dtype", "int8"), ("state_dtype", "bf16"),
                       ("params_dtype", "bf16")):
        sd = opt.state_dict()
        sd["param_groups"][0][key] = value
        with pytest.raises(ValueError, match=f"\\['{key}'\\] is '{value}': from_torch writes "
                                             "fp32 state and params only.*Client.load_state "
                                             "or RemoteAdamW.load_state_dict"):
            checkpoint.from_torch(model.state_dict(), sd, str(tmp_path / "refused"),
                                  param_names=["weight", "bias"])
    assert not (tmp_path / "refused").exists()
    sd = opt.state_dict()
    sd["param_groups"][0].update(state_dtype="fp32", params_dtype="float32")
    checkpoint.from_torch(model.state_dict(), sd, str(tmp_path / "fp32"),
                          param_names=["weight", "bias"])
