"""The fusedps checkpoint format (docs/checkpoints.md): the names that fusedps.checkpoint's reader
(to_torch) and writer (from_torch, fusedps/_checkpoint_write.py) share, and manifest.json <->
the message it is, fusedps.v1.CheckpointManifest (proto/fusedps/v1/checkpoint.proto). Internal
module; the public names are re-exported by fusedps.checkpoint.

Format 4 is the message in protobuf's JSON mapping (proto field names, every field printed,
64-bit integers as strings, enums by name): parse_manifest parses it with json_format, refusing
a key the message lacks, and manifest_json prints it. Formats 2 and 3 (written by servers
before 4; read-only) are converted to the message in one place, _legacy_to_proto, so that the
reader deals with the message alone.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import re
from typing import Any, Callable, Dict, Mapping

from google.protobuf import json_format

from . import _dtypes, _hyperparameters
from .v1 import checkpoint_pb2 as ckpt_pb
from .v1 import parameter_service_pb2 as pb

FORMAT = "fusedps-checkpoint"
# The format written: 4, the manifest is fusedps.v1.CheckpointManifest in protobuf's JSON
# mapping. Read: 4; 3 (a group's hyperparameters in that mapping, the rest by hand, dtypes by
# their short names) and 2 (each hyperparameter a key of its group).
FORMAT_VERSION = 4
READ_FORMAT_VERSIONS = (2, 3, 4)
MANIFEST = "manifest.json"
LATEST = "latest"
PARAMS = "params.safetensors"
EXP_AVG = "exp_avg.safetensors"
EXP_AVG_SQ = "exp_avg_sq.safetensors"
MAX_EXP_AVG_SQ = "max_exp_avg_sq.safetensors"
PARAM_COPY = "param_copy.safetensors"
BUFFERS = "buffers.safetensors"  # The model's buffers, when it has any.
# Per hashed embedding table t: "t.slot_keys" and "t.slot_stamps", I64 [capacity].
HASHED_TABLES = "hashed_tables.safetensors"

_DIR_RE = re.compile(r"checkpoint-([0-9]{20})\Z")
# A param copy's dtype as formats 2 and 3 (and --param-copy-dtype) spell it -> format 4's DType
# code (0, UNSPECIFIED: no copy).
_PARAM_COPY_CODES = {"none": 0, **{_dtypes.short(n): _dtypes.WIRE_CODES[n]
                                   for n in _dtypes.PARAM_COPY_DTYPES}}
_PARAM_COPY_NAMES = tuple(_PARAM_COPY_CODES)
# Formats 2 and 3's short dtype names of a tensor's storage -> format 4's codes.
_PARAMS_CODES = {_dtypes.short(n): _dtypes.WIRE_CODES[n] for n in _dtypes.PARAMS_DTYPES}
_STATE_CODES = {_dtypes.short(n): c for n, c in _dtypes.STATE_CODES.items()}
_MAX_SEED = (1 << 64) - 1

# json_format's option that prints fields with their default values: renamed in protobuf 26.
_PRINT_DEFAULTS = ("always_print_fields_with_no_presence"
                   if "always_print_fields_with_no_presence" in
                   inspect.signature(json_format.MessageToDict).parameters
                   else "including_default_value_fields")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _in_field_order(value: Dict[str, Any], descriptor) -> Dict[str, Any]:
    """MessageToDict's dict with the keys in field-number order at every level (json_format puts
    the fields it prints for their defaults last), as the server's printer orders them."""
    out = {}
    for f in descriptor.fields:
        if f.name not in value:
            continue
        v = value[f.name]
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry:
                of = f.message_type.fields_by_name["value"].message_type
                if of is not None:
                    v = {k: _in_field_order(x, of) for k, x in v.items()}
            elif isinstance(v, list):  # A repeated field.
                v = [_in_field_order(x, f.message_type) for x in v]
            else:
                v = _in_field_order(v, f.message_type)
        out[f.name] = v
    return out


def manifest_json(manifest: "ckpt_pb.CheckpointManifest") -> str:
    """Format 4's JSON of ``manifest``: protobuf's JSON mapping with the proto's field names and
    every field printed (int8_codebooks only when set), as the server writes it."""
    as_dict = json_format.MessageToDict(manifest, preserving_proto_field_name=True,
                                        **{_PRINT_DEFAULTS: True})
    return json.dumps(_in_field_order(as_dict, manifest.DESCRIPTOR), indent=1,
                      ensure_ascii=False, allow_nan=False)


def parse_manifest(raw: bytes, path: str) -> "ckpt_pb.CheckpointManifest":
    """The manifest.json ``raw`` (read from ``path``, which errors name) as format 4's message,
    whatever its format (2 and 3 converted; their format_version stays theirs). Only the JSON's
    shape is checked here: keys, types, formats 2 and 3's dtype names.

    Raises:
      ValueError: not JSON, not a manifest, a format_version not in READ_FORMAT_VERSIONS, a
        key the message lacks or a value of the wrong type (naming the key).
    """
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
    version = m.get("format_version")
    if version not in READ_FORMAT_VERSIONS or isinstance(version, bool):
        raise bad(f"format_version {version!r} is unknown (this reader knows "
                  f"{', '.join(map(str, READ_FORMAT_VERSIONS))})")
    for key in ("version", "files"):
        if key not in m:
            raise bad(f"{key!r} is missing")
    if version != 4:
        return _legacy_to_proto(m, bad)
    manifest = ckpt_pb.CheckpointManifest()
    try:
        json_format.ParseDict(m, manifest)  # A key the message lacks is refused.
    except (json_format.ParseError, TypeError, ValueError) as e:
        raise bad(str(e)) from None
    return manifest


def _group_v2(g: Mapping[str, Any], bad: Callable[[str], ValueError], where: str
              ) -> "pb.Hyperparameters":
    """A format 2 group's hyperparameters: each a key of the group, the storage keys optional
    (fp32, seed 0 when absent)."""
    for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
        if not _is_number(g.get(key)):
            raise bad(f"{where}: {key!r} is not a number")
    for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
        if not isinstance(g.get(key), bool):
            raise bad(f"{where}: {key!r} is not a boolean")
    fields = {key: g[key] for key in ("lr", "eps", "weight_decay", "amsgrad", "maximize",
                                      "decoupled_weight_decay")}
    fields["betas"] = (g["beta1"], g["beta2"])
    for key, names in (("state_dtype", _STATE_CODES), ("params_dtype", _PARAMS_CODES)):
        if key in g:
            if g[key] not in names:
                raise bad(f"{where}: {key} {g[key]!r} is not one of {tuple(names)}")
            fields[key] = g[key]
    if "rounding_seed" in g:
        seed = g["rounding_seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
            raise bad(f"{where}: rounding_seed {seed!r} is not an integer in [0, 2**64)")
        fields["rounding_seed"] = seed
    return _hyperparameters.to_proto(fields)


def _legacy_to_proto(m: Dict[str, Any], bad: Callable[[str], ValueError]
                     ) -> "ckpt_pb.CheckpointManifest":
    """A format 2 or 3 manifest (docs/checkpoints.md, "Formats 2 and 3") as the message; a key
    it does not know is ignored, as their readers did."""
    out = ckpt_pb.CheckpointManifest(format=FORMAT, format_version=m["format_version"])
    if not _is_count(m.get("version")):
        raise bad("'version' is missing or not a non-negative integer")
    out.version = m["version"]
    if _is_count(m.get("serial")):
        out.serial = m["serial"]
    if isinstance(m.get("server_version"), str):
        out.server_version = m["server_version"]
    if _is_number(m.get("created_unix_seconds")):
        out.created_unix_seconds = m["created_unix_seconds"]
    copy = m.get("param_copy_dtype", "none")
    if not isinstance(copy, str) or copy not in _PARAM_COPY_CODES:
        raise bad(f"param_copy_dtype {copy!r} is not none, bf16 or fp16")
    out.param_copy_dtype = _PARAM_COPY_CODES[copy]
    if isinstance(m.get("plan_hash"), str):
        out.plan_hash = m["plan_hash"]
    for key, kind in [("param_groups", list), ("tensors", list), ("files", dict)]:
        if not isinstance(m.get(key), kind):
            raise bad(f"{key!r} is missing or not a {kind.__name__}")
    for i, g in enumerate(m["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("name"), str):
            raise bad(f"param_groups[{i}] has no name, or a repeated one")
        where = f"param_groups[{i}] ({g['name']!r})"
        group = out.param_groups.add(name=g["name"])
        if m["format_version"] == 2:
            group.hyperparameters.CopyFrom(_group_v2(g, bad, where))
            continue
        if not isinstance(g.get("hyperparameters"), dict):
            raise bad(f"{where}: 'hyperparameters' is missing or not an object")
        try:
            json_format.ParseDict(g["hyperparameters"], group.hyperparameters)
        except (json_format.ParseError, TypeError, ValueError) as e:
            raise bad(f"{where}: hyperparameters: {e}") from None
    for i, t in enumerate(m["tensors"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tensors[{i}] has no name, or a repeated one")
        where = f"tensors[{i}] ({t['name']!r})"
        if not (isinstance(t.get("shape"), list) and all(_is_count(d) for d in t["shape"])):
            raise bad(f"{where}: bad shape {t.get('shape')!r}")
        if not isinstance(t.get("param_group"), str):
            raise bad(f"{where}: unknown param_group {t.get('param_group')!r}")
        if not _is_count(t.get("step")):
            raise bad(f"{where}: step is not a non-negative integer")
        tensor = out.tensors.add(name=t["name"], shape=t["shape"], param_group=t["param_group"],
                                 step=t["step"])
        for key, names in (("params_dtype", _PARAMS_CODES), ("state_dtype", _STATE_CODES)):
            if key in t:
                if t[key] not in names:
                    raise bad(f"{where}: {key} {t[key]!r} is not one of {tuple(names)}")
                setattr(tensor, key, names[t[key]])
    books = m.get("int8_codebooks")
    if books is not None:
        for key in ("exp_avg", "exp_avg_sq"):
            values = books.get(key) if isinstance(books, dict) else None
            if not (isinstance(values, list) and all(
                    _is_number(v) and math.isfinite(v) for v in values)):
                raise bad(f"int8_codebooks[{key!r}] is not a list of finite numbers")
            getattr(out.int8_codebooks, key).extend(values)
    for name, entry in m["files"].items():
        if not isinstance(entry, dict) or not _is_count(entry.get("bytes")) or \
                not _is_count(entry.get("crc32")) or entry["crc32"] > 0xFFFFFFFF:
            raise bad(f"a bad entry in 'files' for {name!r}")
        out.files[name].bytes = entry["bytes"]
        out.files[name].crc32 = entry["crc32"]
    for i, client in enumerate(m.get("retry_table", [])):
        _retry_client(client, out.retry_table.add(), bad, f"retry_table[{i}]")
    return out


def _retry_client(c: Any, out: "ckpt_pb.CheckpointManifest.RetryClient",
                  bad: Callable[[str], ValueError], where: str) -> None:
    """One entry of a format 2 or 3 retry table (round_workers and round_timed_out optional)."""
    if not (isinstance(c, dict) and isinstance(c.get("client_id"), str) and
            _is_count(c.get("highest")) and isinstance(c.get("replies"), list)):
        raise bad(f"{where} is not {{client_id, highest, replies}}")
    out.client_id, out.highest = c["client_id"], c["highest"]
    for k, r in enumerate(c["replies"]):
        counts = ("sequence_number", "version", "tensors_updated", "grad_bytes")
        if not (isinstance(r, dict) and all(_is_count(r.get(key)) for key in counts) and
                isinstance(r.get("skipped"), bool) and _is_count(r.get("round_workers", 0)) and
                isinstance(r.get("round_timed_out", False), bool) and
                all(isinstance(x, str) for x in r.get("missing_replicas", []))):
            raise bad(f"{where}.replies[{k}] has a key of the wrong type")
        out.replies.add(**{key: r[key] for key in counts + (
            "skipped", "round_workers", "round_timed_out", "missing_replicas") if key in r})
