"""fusedps checkpoints <-> PyTorch state dicts (the format: docs/checkpoints.md).

A fusedps server with ``--checkpoint-dir=DIR`` writes checkpoints of its shard (fp32 params,
AdamW state, steps, param groups) as safetensors files plus a ``manifest.json``. This module
reads one into a torch model state_dict and a torch.optim.AdamW state_dict (to_torch), and
writes one from them (from_torch) that a server loads at start.

The math: the server's update is torch.optim.AdamW's single-tensor (foreach=False) step, and
torch.optim.Adam's for a group with decoupled_weight_decay=False (L2 decay). A checkpoint holds
that update's complete state, exactly: fp32 params, exp_avg, exp_avg_sq, max_exp_avg_sq
(amsgrad groups) and each tensor's step; so a torch optimizer loaded from to_torch continues
the run with torch's own math, and a server started from from_torch's output continues a torch
run. Nothing is rounded on the way in either direction (hyperparameters are JSON doubles,
printed with Python's shortest round-trip repr).

Example::

    from fusedps import checkpoint
    model_state, optim_state = checkpoint.to_torch("/ckpt")        # the newest one in /ckpt
    params = {n: torch.nn.Parameter(t) for n, t in model_state.items()}
    opt = torch.optim.AdamW([{"params": [params[n] for n in g["param_names"]]}
                             for g in optim_state["param_groups"]])
    opt.load_state_dict(optim_state)

    checkpoint.from_torch(model.state_dict(), opt.state_dict(), "/ckpt")

Safetensors files are written and read by fusedps._safetensors (write_safetensors,
decode_safetensors and read_safetensors are re-exported here): written as the server writes
them, read with the ``safetensors`` package when it is importable.

The reader is this module; from_torch lives in fusedps/_checkpoint_write.py, and the names both
use (file names, FORMAT, FORMAT_VERSION) in fusedps/_checkpoint_format.py.
"""

from __future__ import annotations

import collections
import json
import math
import os
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, cast

import torch

from . import _checkpoint_format, _checkpoint_write, _hyperparameters, _stored_state as stored
from ._checkpoint_format import (BUFFERS, EXP_AVG, EXP_AVG_SQ, FORMAT, FORMAT_VERSION, LATEST,
                                 MANIFEST, MAX_EXP_AVG_SQ, PARAMS, READ_FORMAT_VERSIONS, _DIR_RE,
                                 _PARAM_COPY_NAMES, _is_count, _is_number)
from ._checkpoint_write import from_torch
from ._safetensors import decode_safetensors, read_safetensors, write_safetensors

__all__ = ["FORMAT", "FORMAT_VERSION", "decode_safetensors", "from_torch", "read_safetensors",
           "resolve_checkpoint", "to_torch", "write_safetensors"]

# Names of the format and of the writer that this module had before they moved.
PARAM_COPY = _checkpoint_format.PARAM_COPY
_default_group = _checkpoint_write._default_group


# ----------------------------------------------------------------------------------------------
# Reading a checkpoint
# ----------------------------------------------------------------------------------------------

def _has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory that ``path`` names.

    ``path`` is a checkpoint directory (it has a manifest.json) or a checkpoint root (a
    ``--checkpoint-dir``). For a root: the complete checkpoint (one with a manifest.json) of
    the highest serial, ``checkpoint-<20 digits>``; that is the one ``latest`` names, except
    after a crash between a manifest's commit and ``latest``'s move, when ``latest`` still
    names the older one (the manifest is the commit point, as for the server). ``latest`` is
    also followed where it names a complete directory of another name.

    Raises:
      FileNotFoundError: no such directory, or no complete checkpoint in it.
    """
    path = os.fspath(path)
    if _has_manifest(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory or root")
    best: Tuple[int, Optional[str]] = (-1, None)
    for entry in os.listdir(path):
        m = _DIR_RE.match(entry)
        full = os.path.join(path, entry)
        if m and int(m.group(1)) > best[0] and _has_manifest(full):
            best = (int(m.group(1)), full)
    if best[1] is None:
        try:
            with open(os.path.join(path, LATEST), encoding="utf-8") as f:
                target = f.read().strip()
        except OSError:
            target = ""
        if target and "/" not in target and target not in (".", "..") and \
                _has_manifest(os.path.join(path, target)):
            return os.path.join(path, target)
        raise FileNotFoundError(f"no complete checkpoint under {path} (no {MANIFEST} there "
                                f"nor in a checkpoint-<serial> directory)")
    return best[1]


def _is_crc32(x) -> bool:
    """Whether ``x`` is a manifest file checksum: a CRC-32 (zlib.crc32's), 0..2**32-1."""
    return _is_count(x) and x <= 0xFFFFFFFF


def _group_v3(g: Dict[str, Any], bad: Callable[[str], ValueError], where: str
              ) -> Dict[str, Any]:
    """A format 3 manifest group as {"name", **hyperparameters by torch's names}: its
    "hyperparameters", protobuf's JSON mapping of fusedps.v1.Hyperparameters (an absent field
    takes the server's default)."""
    h = g.get("hyperparameters")
    if not isinstance(h, dict):
        raise bad(f"{where}: 'hyperparameters' is missing or not an object")
    try:
        return {"name": g["name"], **_hyperparameters.DEFAULTS, **_hyperparameters.from_json(h)}
    except ValueError as e:
        raise bad(f"{where}: hyperparameters: {e}") from None


def _group_v2(g: Dict[str, Any], bad: Callable[[str], ValueError], where: str
              ) -> Dict[str, Any]:
    """A format 2 manifest group (each hyperparameter a key; storage keys optional) checked and
    as _group_v3 gives it."""
    for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
        if not _is_number(g.get(key)):
            raise bad(f"{where}: {key!r} is not a number")
    for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
        if not isinstance(g.get(key), bool):
            raise bad(f"{where}: {key!r} is not a boolean")
    out = {key: g[key] for key in ("name", "lr", "eps", "weight_decay", "amsgrad", "maximize",
                                   "decoupled_weight_decay")}
    out["betas"] = (g["beta1"], g["beta2"])
    for key in _hyperparameters.STORAGE:
        out[key] = g.get(key, _hyperparameters.DEFAULTS[key])
    return out


def _read_manifest(directory: str) -> Dict[str, Any]:
    """The manifest of ``directory``, checked for the keys and types to_torch uses; its
    param_groups as {"name", **hyperparameters by torch's names}, whatever its format."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: {why}")

    if not isinstance(m, dict):
        raise bad("not a JSON object")
    if m.get("format") != FORMAT:
        raise bad(f"format {m.get('format')!r} is not {FORMAT!r}")
    if m.get("format_version") not in READ_FORMAT_VERSIONS or \
            isinstance(m.get("format_version"), bool):
        raise bad(f"format_version {m.get('format_version')!r} is unknown (this reader knows "
                  f"{', '.join(map(str, READ_FORMAT_VERSIONS))})")
    if not _is_count(m.get("version")):
        raise bad("'version' is missing or not a non-negative integer")
    for key, kind in [("param_groups", list), ("tensors", list), ("files", dict)]:
        if not isinstance(m.get(key), kind):
            raise bad(f"{key!r} is missing or not a {kind.__name__}")
    if m.get("param_copy_dtype", "none") not in _PARAM_COPY_NAMES:
        raise bad(f"param_copy_dtype {m.get('param_copy_dtype')!r} is not none, bf16 or fp16")
    groups = set()
    for i, g in enumerate(m["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("name"), str) or g["name"] in groups:
            raise bad(f"param_groups[{i}] has no name, or a repeated one")
        groups.add(g["name"])
        where = f"param_groups[{i}] ({g['name']!r})"
        g = m["param_groups"][i] = (_group_v3(g, bad, where) if m["format_version"] == 3
                                    else _group_v2(g, bad, where))
        stored.check_group_storage(g, bad, where)
    names = set()
    group_of = {g["name"]: g for g in m["param_groups"]}
    for i, t in enumerate(m["tensors"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t["name"] in names:
            raise bad(f"tensors[{i}] has no name, or a repeated one")
        names.add(t["name"])
        if not (isinstance(t.get("shape"), list) and all(_is_count(d) for d in t["shape"])):
            raise bad(f"tensors[{i}] ({t['name']!r}): bad shape {t.get('shape')!r}")
        if t.get("param_group") not in groups:
            raise bad(f"tensors[{i}] ({t['name']!r}): unknown param_group "
                      f"{t.get('param_group')!r}")
        if not _is_count(t.get("step")):
            raise bad(f"tensors[{i}] ({t['name']!r}): step is not a non-negative integer")
        stored.check_tensor_layout(
            t, stored.layout_of(group_of[t["param_group"]], math.prod(t["shape"])), bad,
            f"tensors[{i}] ({t['name']!r})")
    for name, e in m["files"].items():
        if "/" in name or name in (".", "..", MANIFEST) or not isinstance(e, dict) or \
                not _is_count(e.get("bytes")) or not _is_crc32(e.get("crc32")):
            raise bad(f"a bad entry in 'files' for {name!r}")
    return m


def _read_verified(directory: str, name: str, entry: Mapping[str, Any]) -> bytes:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (listed in {MANIFEST})") from None
    if len(data) != entry["bytes"]:
        raise ValueError(f"{path} has {len(data)} bytes, {MANIFEST} says {entry['bytes']}")
    if zlib.crc32(data) != entry["crc32"]:
        raise ValueError(f"{path} does not match its crc32 in {MANIFEST}")
    return data


def to_torch(path: str) -> Tuple["collections.OrderedDict[str, torch.Tensor]", Dict[str, Any]]:
    """Reads a checkpoint into ``(model_state, optim_state)``.

    Args:
      path: a checkpoint directory, or a checkpoint root (then its newest complete
        checkpoint, see resolve_checkpoint; unlike the server, an older one is never tried
        when that one is bad: pass its directory to read an older one).

    Returns:
      model_state: OrderedDict name -> CPU tensor: the params as float32, in registration
        order, with the registered shapes (() for a 0-dim tensor; bf16 params widened exactly);
        then the model's buffers (buffers.safetensors, written by RemoteAdamW(buffers=...) or
        Client.write_buffers), by name, each in its own dtype and shape. For a module whose
        params and buffers were all kept, ``module.load_state_dict(model_state)`` is strict.
      optim_state: a torch.optim.AdamW state_dict::

          {"state": {index: {"step": torch.tensor(float(step)),     # default dtype, 0-dim
                             "exp_avg": fp32, "exp_avg_sq": fp32,
                             "max_exp_avg_sq": fp32}},               # amsgrad groups only
           "param_groups": [{"lr", "betas": (beta1, beta2), "eps", "weight_decay", "amsgrad",
                             "maximize", "foreach": None, "capturable": False,
                             "differentiable": False, "fused": None,
                             "decoupled_weight_decay": bool,
                             "params": [index, ...], "param_names": [name, ...]}]}

        One param group per manifest group that has tensors, in group index order: groups
        without tensors (often the server's "default") are left out, so that the optimizer's
        groups, which load_state_dict matches one for one, are the ones in use. Indices run
        0, 1, ... group by group, and within a group in registration order: build the
        optimizer's groups from ``[model_state[n] for n in group["param_names"]]`` (or named
        params, torch >= 2.6).
        ``state`` has an entry for each tensor with step > 0 only (torch creates state at a
        tensor's first step; a tensor never stepped has zero state on the server).

      A group with decoupled_weight_decay=False is L2 decay, torch.optim.Adam's weight_decay:
      load it into torch.optim.Adam, never AdamW (AdamW always decouples; torch 2.11's Adam
      follows the loaded key either way, torch 1.13's Adam ignores it and does L2). "foreach":
      None lets torch choose (the single-tensor step on CPU); set ``group["foreach"] = False``
      after load_state_dict to pin it. The manifest's group names are not in optim_state
      (torch groups have no names): read manifest.json for them.

      Low-precision storage (docs/checkpoints.md) comes back as fp32, exactly what a server
      pulls: BF16 widened, int8 codes dequantized (the manifest's int8_codebooks[code] *
      absmax[i // 256], in float32). The storage settings are in manifest.json.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      ValueError: a manifest that does not parse, of another format or an unknown
        format_version, or without a key it needs (int8_codebooks with int8 state); bad
        storage keys, or a tensor layout its group does not give; a file the manifest lists
        that is missing or whose size or crc32 differs (the message names the file); a data
        file that is not valid safetensors or whose tensors, dtypes or shapes disagree with
        the manifest.
    """
    directory = resolve_checkpoint(path)
    m = _read_manifest(directory)
    raw = {name: _read_verified(directory, name, e) for name, e in m["files"].items()}
    groups = m["param_groups"]
    group_of = {g["name"]: g for g in groups}
    shapes = {t["name"]: tuple(t["shape"]) for t in m["tensors"]}
    layouts = {t["name"]: stored.layout_of(group_of[t["param_group"]], math.prod(t["shape"]))
               for t in m["tensors"]}
    int8_names = [n for n, lay in layouts.items() if lay.state == "int8"]
    books = stored.read_codebooks(m, bool(int8_names),
                                  lambda why: ValueError(f"{directory}/{MANIFEST}: {why}"))
    fields = [("param", PARAMS, list(shapes)), ("exp_avg", EXP_AVG, list(shapes)),
              ("exp_avg_sq", EXP_AVG_SQ, list(shapes)),
              ("max_exp_avg_sq", MAX_EXP_AVG_SQ,
               [t["name"] for t in m["tensors"] if group_of[t["param_group"]]["amsgrad"]])]
    fields += [(f"{f}_absmax", file, int8_names) for f, file in stored.ABSMAX_FILES.items()]
    data: Dict[str, Dict[str, torch.Tensor]] = {}
    for field, file, want in fields:
        if file not in raw:
            if want:
                raise ValueError(f"{os.path.join(directory, file)}: not in {MANIFEST}'s files")
            data[field] = {}
            continue
        what = os.path.join(directory, file)
        tensors = decode_safetensors(raw[file], what)
        if set(tensors) != set(want):
            extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
            raise ValueError(f"{what} holds other tensors than {MANIFEST} lists: missing "
                             f"{missing[:5]}, not listed {extra[:5]}")
        for name, t in tensors.items():
            dtype = layouts[name].stored_dtype(field)
            shape = shapes[name]
            if field.endswith("_absmax"):
                shape = (-(-math.prod(shape) // stored.QUANT_BLOCK),)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{what}: {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                                 f"{dtype} {shape}")
        data[field] = tensors
    for field in ("param", "exp_avg", "exp_avg_sq"):
        for name, t in data[field].items():
            data[field][name] = (  # int8 state: books were read (int8_names).
                stored.dequantize(t, data[f"{field}_absmax"][name],
                                  cast(Dict[str, Any], books)[field])
                if t.dtype == torch.uint8 else stored.to_fp32(t))

    model_state = collections.OrderedDict((n, data["param"][n]) for n in shapes)
    if BUFFERS in raw:
        what = os.path.join(directory, BUFFERS)
        for name, t in decode_safetensors(raw[BUFFERS], what).items():
            if name in model_state:
                raise ValueError(f"{what}: buffer {name!r} has the name of a tensor")
            model_state[name] = t
    by_group: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for t in m["tensors"]:
        by_group[t["param_group"]].append(t)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for g in groups:
        members = by_group[g["name"]]
        if not members:
            continue
        ids = list(range(index, index + len(members)))
        index += len(members)
        for i, t in zip(ids, members):
            if t["step"] == 0:
                continue
            st = {"step": torch.tensor(float(t["step"])),
                  "exp_avg": data["exp_avg"][t["name"]],
                  "exp_avg_sq": data["exp_avg_sq"][t["name"]]}
            if g["amsgrad"]:
                st["max_exp_avg_sq"] = data["max_exp_avg_sq"][t["name"]]
            state[i] = st
        param_groups.append({
            **{k: v for k, v in g.items() if k != "name" and k not in _hyperparameters.STORAGE},
            "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "params": ids, "param_names": [t["name"] for t in members]})
    return model_state, {"state": state, "param_groups": param_groups}
