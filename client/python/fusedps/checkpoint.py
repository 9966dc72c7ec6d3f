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
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
import re
import time
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _dtypes, _stored_state as stored
from ._safetensors import decode_safetensors, read_safetensors, write_safetensors
from ._torch_defaults import ADAMW

__all__ = ["FORMAT", "FORMAT_VERSION", "decode_safetensors", "from_torch", "read_safetensors",
           "resolve_checkpoint", "to_torch", "write_safetensors"]

FORMAT = "fusedps-checkpoint"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
PARAMS = "params.safetensors"
EXP_AVG = "exp_avg.safetensors"
EXP_AVG_SQ = "exp_avg_sq.safetensors"
MAX_EXP_AVG_SQ = "max_exp_avg_sq.safetensors"
PARAM_COPY = "param_copy.safetensors"
BUFFERS = "buffers.safetensors"  # The model's buffers, when it has any.

_DIR_RE = re.compile(r"checkpoint-([0-9]{20})\Z")
# A manifest's param_copy_dtype: "none" or the short name of a param copy's dtype.
_PARAM_COPY_NAMES = ("none",) + tuple(_dtypes.short(n) for n in _dtypes.PARAM_COPY_DTYPES)
_HYPER_KEYS = ADAMW._fields  # What a torch AdamW group has: lr, betas, ..., maximize.
# What from_torch writes: fp32 storage only (low-precision state is quantized by a server).
_FP32_STORAGE = dict(state_dtype="fp32", params_dtype="fp32", rounding_seed=0)
_MAX_TENSOR_NAME_BYTES = 256
_MAX_GROUP_NAME_BYTES = 128


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


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_crc32(x) -> bool:
    """Whether ``x`` is a manifest file checksum: a CRC-32 (zlib.crc32's), 0..2**32-1."""
    return _is_count(x) and x <= 0xFFFFFFFF


def _read_manifest(directory: str) -> Dict[str, Any]:
    """The manifest of ``directory``, checked for the keys and types to_torch uses."""
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
    if m.get("format_version") != FORMAT_VERSION or isinstance(m.get("format_version"), bool):
        raise bad(f"format_version {m.get('format_version')!r} is unknown (this reader knows "
                  f"{FORMAT_VERSION})")
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
        for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            if not _is_number(g.get(key)):
                raise bad(f"param_groups[{i}] ({g['name']!r}): {key!r} is not a number")
        for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
            if not isinstance(g.get(key), bool):
                raise bad(f"param_groups[{i}] ({g['name']!r}): {key!r} is not a boolean")
        stored.check_group_storage(g, bad, f"param_groups[{i}] ({g['name']!r})")
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
            data[field][name] = (
                stored.dequantize(t, data[f"{field}_absmax"][name], books[field])
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
            "lr": g["lr"], "betas": (g["beta1"], g["beta2"]), "eps": g["eps"],
            "weight_decay": g["weight_decay"], "amsgrad": g["amsgrad"], "foreach": None,
            "maximize": g["maximize"], "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": g["decoupled_weight_decay"],
            "params": ids, "param_names": [t["name"] for t in members]})
    return model_state, {"state": state, "param_groups": param_groups}


# ----------------------------------------------------------------------------------------------
# Writing a checkpoint
# ----------------------------------------------------------------------------------------------

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
    h = {"lr": _float(g["lr"], f"{where}['lr']"),
         "beta1": _float(betas[0], f"{where}['betas'][0]"),
         "beta2": _float(betas[1], f"{where}['betas'][1]"),
         "eps": _float(g["eps"], f"{where}['eps']"),
         "weight_decay": _float(g["weight_decay"], f"{where}['weight_decay']")}
    for key in ("lr", "eps", "weight_decay"):
        if h[key] < 0:
            raise ValueError(f"{where}[{key!r}] must be >= 0, got {h[key]}")
    for key in ("beta1", "beta2"):
        if not 0 <= h[key] < 1:
            raise ValueError(f"{where}['betas'] must be in [0, 1), got {h[key]}")
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
            tensors.append({"name": name, "shape": list(p.shape),
                            "param_group": group_names[gi], "step": step,
                            "params_dtype": "fp32", "state_dtype": "fp32"})
    if version is None:
        version = max((t["step"] for t in tensors), default=0)
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
    listed = {}
    for file, content in files.items():
        size, crc = write_safetensors(os.path.join(directory, file), content, fsync=True)
        listed[file] = {"bytes": size, "crc32": crc}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "serial": serial,
        "version": version,
        "server_version": "python",
        "created_unix_seconds": int(time.time()),
        "param_copy_dtype": param_copy_dtype,
        "param_groups": ([] if group_names[0] == "default" else [_default_group()]) +
                        [dict(name=n, **h) for n, h in zip(group_names, hypers)],
        "tensors": tensors,
        "retry_table": [],
        "files": listed,
    }
    text = json.dumps(manifest, indent=1, ensure_ascii=False, allow_nan=False)
    _write_durably(directory, MANIFEST, text.encode("utf-8"))
    _write_durably(root, LATEST, dir_name.encode("utf-8"))
    return directory
