"""fusedps.checkpoint.from_torch: a torch model + AdamW state written as a server checkpoint
(docs/checkpoints.md): its manifest is a fusedps.v1.CheckpointManifest message, written as
format 4's JSON (_checkpoint_format.manifest_json). Internal module; fusedps.checkpoint
re-exports from_torch, whose docstring says what it writes.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from . import _dtypes, _hyperparameters
from ._checkpoint_format import (BUFFERS, EXP_AVG, EXP_AVG_SQ, FORMAT, FORMAT_VERSION, LATEST,
                                 MANIFEST, MAX_EXP_AVG_SQ, PARAM_COPY, PARAMS, _DIR_RE,
                                 _PARAM_COPY_CODES, _PARAM_COPY_NAMES, _is_count, _is_number,
                                 manifest_json)
from ._safetensors import write_safetensors
from ._torch_defaults import ADAMW
from .v1 import checkpoint_pb2 as ckpt_pb
from .v1 import parameter_service_pb2 as pb

_HYPER_KEYS = ADAMW._fields  # What a torch AdamW group has: lr, betas, ..., maximize.
# What from_torch writes: fp32 storage only (low-precision state is quantized by a server).
_FP32_STORAGE = {key: _hyperparameters.DEFAULTS[key] for key in _hyperparameters.STORAGE}
_MAX_TENSOR_NAME_BYTES = 256
_MAX_GROUP_NAME_BYTES = 128


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(directory: str, name: str, data: bytes) -> None:
    """directory/name via name.tmp: write, fsync, rename, fsync of the directory."""
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def _float(value, where: str) -> float:
    """A finite float from a number or a one-element tensor (torch allows tensor lr/betas)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not _is_number(value):
        raise TypeError(f"{where} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    return float(value)


def _fp32(value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or not value.is_floating_point():
        raise TypeError(f"{where} must be a dense floating point tensor, got {value.dtype} "
                        f"{value.layout}")
    return value.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _step(value, where: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not _is_number(value) or not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"{where} must be a non-negative integer, got {value!r}")
    return int(value)


def _group_hyper(g: Mapping[str, Any], gi: int) -> Dict[str, Any]:
    where = f"optim_state['param_groups'][{gi}]"
    for key in _HYPER_KEYS:
        if key not in g:
            raise ValueError(f"{where} has no {key!r}")
    betas = g["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}['betas'] must be (beta1, beta2), got {betas!r}")
    h: Dict[str, Any] = {"lr": _float(g["lr"], f"{where}['lr']"),
                         "betas": (_float(betas[0], f"{where}['betas'][0]"),
                                   _float(betas[1], f"{where}['betas'][1]")),
                         "eps": _float(g["eps"], f"{where}['eps']"),
                         "weight_decay": _float(g["weight_decay"], f"{where}['weight_decay']")}
    for key in ("lr", "eps", "weight_decay"):
        if h[key] < 0:
            raise ValueError(f"{where}[{key!r}] must be >= 0, got {h[key]}")
    for beta in h["betas"]:
        if not 0 <= beta < 1:
            raise ValueError(f"{where}['betas'] must be in [0, 1), got {beta}")
    for key, default in [("amsgrad", None), ("maximize", None), ("decoupled_weight_decay", True)]:
        v = g.get(key, default)
        if not isinstance(v, bool):
            raise TypeError(f"{where}[{key!r}] must be a bool, got {v!r}")
        h[key] = v
    for key in ("state_dtype", "params_dtype"):
        if _dtypes.lookup(g.get(key, "fp32")) != "float32":
            raise ValueError(
                f"{where}[{key!r}] is {g[key]!r}: from_torch writes fp32 state and params "
                "only. Register the group with that storage on a server and load the state "
                "through Client.load_state or RemoteAdamW.load_state_dict, which quantize it "
                "on the server")
    h.update(_FP32_STORAGE)
    return h


def _default_group() -> Dict[str, Any]:
    """The server's group 0 as from_torch writes it when no group is named "default":
    torch.optim.AdamW's defaults, decoupled decay, fp32 storage."""
    return dict(name="default", **_group_hyper(ADAMW._asdict(), 0))


def _param_copy_name(value: Any) -> str:
    """from_torch's param_copy_dtype as a manifest spells it: "none", "bf16" or "fp16" (given
    as "none", or a dtype in either spelling: "bf16" or "bfloat16", "fp16" or "float16").

    Raises:
      ValueError: anything else, naming param_copy_dtype and the values it takes.
    """
    if value == "none":
        return value
    names = _PARAM_COPY_NAMES[1:]
    return _dtypes.short(_dtypes.checked(value, "param_copy_dtype", names, or_else="'none'"))


def _names(items: Sequence[Any], where: str, max_bytes: int) -> List[str]:
    names = list(items)
    seen = set()
    for n in names:
        if not isinstance(n, str) or not 0 < len(n.encode("utf-8")) <= max_bytes:
            raise ValueError(f"{where}: {n!r:.80} is not a string of 1 to {max_bytes} bytes")
        if n in seen:
            raise ValueError(f"{where}: {n!r} appears twice")
        seen.add(n)
    return names


def from_torch(model_state: Mapping[str, torch.Tensor], optim_state: Mapping[str, Any],
               root: str, *, param_names: Optional[Sequence[str]] = None,
               group_names: Optional[Sequence[str]] = None, param_copy_dtype: str = "none",
               version: Optional[int] = None) -> str:
    """Writes a torch model + AdamW (or Adam) state as a new checkpoint under ``root``.

    A server started with ``--checkpoint-dir=root`` (or ``--restore=<the directory>``) then
    holds these params, optimizer state, steps and hyperparameters, and continues the run as
    torch would (docs/checkpoints.md). Groups are written with fp32 storage only; for others
    ("state_dtype" / "params_dtype" keys) use Client.load_state or RemoteAdamW.load_state_dict,
    which quantize on the server.

    Args:
      model_state: name -> tensor, e.g. ``model.state_dict()``: the optimizer's params (any
        float dtype or device; stored as float32), and the module's buffers, every other entry
        (BatchNorm's running statistics: written as they are, dtype included, to
        buffers.safetensors, which a server restores with the model and to_torch returns).
      optim_state: a torch.optim.AdamW/Adam ``state_dict()``: "param_groups" (each with
        "params" (indices), lr, betas, eps, weight_decay, amsgrad, maximize; optional
        decoupled_weight_decay, True when absent: torch versions whose Adam lacks that
        option, 1.13 among them, leave it out of Adam's state too, so set it to False in
        such an Adam (L2 decay) state) and "state" (index -> {"step" (tensor
        or number), "exp_avg", "exp_avg_sq", "max_exp_avg_sq" for amsgrad (zeros when
        absent)}). A param without state has step 0 and zero state.
      root: the checkpoint root (created if missing).
      param_names: names of the optimizer's params in its order (flattened over its groups);
        used when the groups have no "param_names" (torch >= 2.6 puts them there when the
        optimizer got named params). Default: model_state's keys, in order, which is valid
        only when there are as many as the optimizer has params.
      group_names: one name per param group (1 to 128 bytes); default "default" for group 0,
        "group<i>" for group i > 0. The server's group 0 is always "default": "default" may
        only name the first group, and when no group is named so, a "default" group with
        torch.optim.AdamW's defaults and no tensors is written first (to_torch leaves it out).
      param_copy_dtype: "none", or "bf16" / "fp16" (or "bfloat16" / "float16") to also write
        param_copy.safetensors, the params rounded to nearest even (torch's
        .to(torch.bfloat16) / .to(torch.float16)).
      version: the shard version recorded; default the highest step.

    Tensors are registered group by group, in the optimizer's order within a group; the
    serial is one more than the highest ``checkpoint-<20 digits>`` in root. The data files are
    fsynced, then manifest.json (tmp, fsync, rename, fsync of the directory), then ``latest``
    the same way. server_version is "python" and the retry table is empty.

    Returns:
      The new checkpoint's directory.
    Raises:
      ValueError: a missing or bad field (the message names it): no params or param_groups,
        a hyperparameter missing or out of range, a state without step/exp_avg/exp_avg_sq, a
        state shape unlike its param's, names that repeat, are empty or too long (tensors
        256 bytes, groups 128) or whose count differs from the optimizer's params, a name not
        in model_state, "default" naming a later group, a bad param_copy_dtype or version,
        a group whose state_dtype or params_dtype is not fp32.
      TypeError: a non-floating param, a buffer that is not a tensor or of a dtype the
        format lacks, a non-number hyperparameter, a non-bool flag.
      OSError: writing failed (the checkpoint is then incomplete and never loaded).
    """
    if not isinstance(model_state, Mapping):
        raise TypeError(f"model_state must be a mapping, got {type(model_state).__name__}")
    param_copy_dtype = _param_copy_name(param_copy_dtype)
    if not isinstance(optim_state, Mapping):
        raise TypeError(f"optim_state must be a mapping, got {type(optim_state).__name__}")
    for key in ("state", "param_groups"):
        if key not in optim_state:
            raise ValueError(f"optim_state has no {key!r}")
    groups, state = list(optim_state["param_groups"]), optim_state["state"]
    if not isinstance(state, Mapping):
        raise TypeError(f"optim_state['state'] must be a mapping, got {type(state).__name__}")
    if not groups:
        raise ValueError("optim_state['param_groups'] is empty")
    ids: List[List[Any]] = []
    for gi, g in enumerate(groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"optim_state['param_groups'][{gi}] has no 'params'")
        ids.append(list(g["params"]))
    flat = [i for group_ids in ids for i in group_ids]
    if len(set(flat)) != len(flat):
        raise ValueError("optim_state['param_groups']: a param index appears twice")

    with_names = ["param_names" in g for g in groups]
    if all(with_names):
        names = []
        for gi, g in enumerate(groups):
            if len(g["param_names"]) != len(ids[gi]):
                raise ValueError(f"optim_state['param_groups'][{gi}]['param_names'] has "
                                 f"{len(g['param_names'])} names for {len(ids[gi])} params")
            names += list(g["param_names"])
        where = "optim_state['param_groups'][*]['param_names']"
    elif any(with_names):
        raise ValueError("optim_state['param_groups']: some groups have 'param_names' and "
                         "some do not")
    elif param_names is not None:
        names, where = list(param_names), "param_names"
    else:
        names, where = list(model_state), "model_state's keys"
    if len(names) != len(flat):
        raise ValueError(f"{where}: {len(names)} names for the optimizer's {len(flat)} params "
                         f"(pass param_names, in the optimizer's order)")
    names = _names(names, where, _MAX_TENSOR_NAME_BYTES)
    if group_names is None:
        group_names = ["default"] + [f"group{i}" for i in range(1, len(groups))]
    group_names = _names(group_names, "group_names", _MAX_GROUP_NAME_BYTES)
    if len(group_names) != len(groups):
        raise ValueError(f"group_names: {len(group_names)} names for {len(groups)} groups")
    if "default" in group_names[1:]:
        raise ValueError("group_names: 'default' must come first (the server's group 0)")
    hypers = [_group_hyper(g, gi) for gi, g in enumerate(groups)]

    files: Dict[str, Dict[str, torch.Tensor]] = {
        PARAMS: {}, EXP_AVG: {}, EXP_AVG_SQ: {}, MAX_EXP_AVG_SQ: {}}
    tensors = []
    name_of = dict(zip(flat, names))
    for gi, group_ids in enumerate(ids):
        for pid in group_ids:
            name = name_of[pid]
            if name not in model_state:
                raise ValueError(f"model_state has no {name!r} (param {pid} of "
                                 f"optim_state['param_groups'][{gi}])")
            p = _fp32(model_state[name], f"model_state[{name!r}]")
            st = state.get(pid) or {}
            where = f"optim_state['state'][{pid}] ({name!r})"
            if st:
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    if key not in st:
                        raise ValueError(f"{where} has no {key!r}")
            step = _step(st["step"], f"{where}['step']") if st else 0
            row = [(PARAMS, p)]
            keys = [("exp_avg", EXP_AVG), ("exp_avg_sq", EXP_AVG_SQ)]
            if hypers[gi]["amsgrad"]:
                keys.append(("max_exp_avg_sq", MAX_EXP_AVG_SQ))
            for key, file in keys:
                v = _fp32(st[key], f"{where}[{key!r}]") if key in st else torch.zeros_like(p)
                if v.shape != p.shape:
                    raise ValueError(f"{where}[{key!r}] has shape {tuple(v.shape)}, the param "
                                     f"{tuple(p.shape)}")
                row.append((file, v))
            for file, v in row:
                files[file][name] = v
            tensors.append(ckpt_pb.CheckpointManifest.Tensor(
                name=name, shape=list(p.shape), param_group=group_names[gi], step=step,
                params_dtype=pb.DTYPE_FLOAT32, state_dtype=pb.STATE_DTYPE_FLOAT32))
    if version is None:
        version = max((t.step for t in tensors), default=0)
    if not _is_count(version):
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    if not files[MAX_EXP_AVG_SQ]:
        del files[MAX_EXP_AVG_SQ]
    params = set(names)
    buffers = {n: t for n, t in model_state.items() if n not in params}
    for n, t in buffers.items():
        _names([n], "model_state's buffer names", _MAX_TENSOR_NAME_BYTES)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{n!r}] is a {type(t).__name__}, not a tensor")
    if buffers:
        files[BUFFERS] = buffers
    if param_copy_dtype != "none":
        copy_dtype = _dtypes.torch_dtype(param_copy_dtype)
        files[PARAM_COPY] = {n: p.to(copy_dtype) for n, p in files[PARAMS].items()}

    os.makedirs(root, exist_ok=True)
    serials = [int(m.group(1)) for m in map(_DIR_RE.match, os.listdir(root)) if m]
    serial = max(serials, default=0) + 1
    if serial >= 1 << 64:
        raise ValueError(f"{root}: no serial left after {serial - 1}")
    dir_name = f"checkpoint-{serial:020d}"
    directory = os.path.join(root, dir_name)
    os.mkdir(directory)
    _fsync_dir(root)
    manifest = ckpt_pb.CheckpointManifest(
        format=FORMAT, format_version=FORMAT_VERSION, serial=serial, version=version,
        server_version="python", created_unix_seconds=time.time(),
        param_copy_dtype=_PARAM_COPY_CODES[param_copy_dtype], tensors=tensors)
    for g in ([] if group_names[0] == "default" else [_default_group()]) + \
            [dict(name=n, **h) for n, h in zip(group_names, hypers)]:
        manifest.param_groups.add(name=g.pop("name"),
                                  hyperparameters=_hyperparameters.to_proto(g))
    for file, content in files.items():
        size, crc = write_safetensors(os.path.join(directory, file), content, fsync=True)
        manifest.files[file].bytes, manifest.files[file].crc32 = size, crc
    _write_durably(directory, MANIFEST, manifest_json(manifest).encode("utf-8"))
    _write_durably(root, LATEST, dir_name.encode("utf-8"))
    return directory
