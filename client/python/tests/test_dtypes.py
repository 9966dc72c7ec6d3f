"""fusedps._dtypes: the one table of dtype names, codes, sizes and spellings, against the proto's
enums and torch; every dtype argument taking both spellings ("float32" / "fp32", "bfloat16" /
"bf16", "float16" / "fp16") and refusing others with the argument and its values named; and
fusedps._torch_defaults against torch.optim.AdamW's own signature. No server."""

from __future__ import annotations

import inspect
import json
import os
import re

import pytest
import torch

import fusedps
from fusedps import _chunks, _dtypes, _requests, checkpoint
from fusedps import _remote_optim as ro
from fusedps._torch_defaults import ADAMW
from fusedps.results import TensorInfo
from fusedps.torch import RemoteAdamW
from fusedps.v1 import parameter_service_pb2 as pb

# (the enum, its prefix, its table in _dtypes)
ENUMS = [("DType", "DTYPE_", _dtypes.WIRE_CODES),
         ("StateDType", "STATE_DTYPE_", _dtypes.STATE_CODES),
         ("TensorField", "TENSOR_FIELD_", _dtypes.TENSOR_FIELDS)]


# -- the tables against the proto -----------------------------------------------------------------

@pytest.mark.parametrize("enum,prefix,table", ENUMS, ids=[e[0] for e in ENUMS])
def test_every_enum_value_has_a_name_and_every_name_round_trips(enum, prefix, table):
    descriptor = pb.DESCRIPTOR.enum_types_by_name[enum]
    values = {v.number: v.name for v in descriptor.values}
    assert set(table.values()) == set(values) - {0}  # all but UNSPECIFIED, each once
    assert len(set(table.values())) == len(table)
    assert values[0] == prefix + "UNSPECIFIED"
    for name, code in table.items():
        assert values[code] == prefix + name.upper()
        assert getattr(pb, prefix + name.upper()) == code


def test_the_inverse_tables():
    assert _dtypes.WIRE_NAMES == {c: n for n, c in _dtypes.WIRE_CODES.items()}
    assert _dtypes.STATE_NAMES == {c: n for n, c in _dtypes.STATE_CODES.items()}
    assert _dtypes.WIRE_CODES["bfloat16"] == pb.DTYPE_BFLOAT16
    assert _dtypes.STATE_CODES["int8"] == pb.STATE_DTYPE_INT8
    assert _dtypes.TENSOR_FIELDS["param"] == pb.TENSOR_FIELD_PARAM
    assert _requests._FIELDS is _dtypes.TENSOR_FIELDS


def test_what_each_argument_takes_is_in_the_enums():
    assert set(_dtypes.WIRE_DTYPES) == set(_dtypes.WIRE_CODES)
    assert set(_dtypes.STATE_DTYPES) == set(_dtypes.STATE_CODES)
    for subset in (_dtypes.PARAMS_DTYPES, _dtypes.PULL_DTYPES, _dtypes.PARAM_COPY_DTYPES):
        assert set(subset) <= set(_dtypes.WIRE_CODES)


def test_sizes_and_torch_dtypes():
    assert {n: _dtypes.element_size(n) for n in _dtypes.WIRE_CODES} == \
        {"float32": 4, "bfloat16": 2, "float16": 2}
    assert _dtypes.element_size("int8") == 1 and _dtypes.element_size("fp32") == 4
    for name in _dtypes.WIRE_CODES:
        dtype = _dtypes.torch_dtype(name)
        assert dtype == getattr(torch, name) and _dtypes.torch_dtype(_dtypes.short(name)) == dtype
        assert torch.empty((), dtype=dtype).element_size() == _dtypes.element_size(name)
        assert _chunks.numpy_dtype(name).itemsize == _dtypes.element_size(name)


def test_short_names():
    assert [_dtypes.short(n) for n in ("float32", "bfloat16", "float16", "int8")] == \
        ["fp32", "bf16", "fp16", "int8"]


def test_storage_the_server_reports():
    info = TensorInfo._from_pb(pb.TensorInfo(name="w", shape=[2], numel=2,
                                             params_dtype=pb.DTYPE_BFLOAT16,
                                             state_dtype=pb.STATE_DTYPE_INT8))
    assert (info.params_dtype, info.state_dtype) == ("bf16", "int8")
    # UNSPECIFIED (an older server) is fp32; a code from a newer server is named as unknown.
    assert _dtypes.storage_name(0, _dtypes.STATE_NAMES) == "fp32"
    assert _dtypes.storage_name(99, _dtypes.WIRE_NAMES) == "unknown(99)"


# -- the spellings taken ----------------------------------------------------------------------

SPELLINGS = [("float32", "float32"), ("fp32", "float32"), ("FP32", "float32"),
             ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("BFloat16", "bfloat16"),
             ("float16", "float16"), ("fp16", "float16"), ("int8", "int8")]


@pytest.mark.parametrize("spelling,name", SPELLINGS)
def test_lookup(spelling, name):
    assert _dtypes.lookup(spelling) == name


def test_wire_dtypes_take_torch_dtypes_and_the_older_spellings():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _dtypes.wire_dtype(dtype, "dtype") == str(dtype)[len("torch."):]
    assert [_dtypes.wire_dtype(s, "dtype") for s in ("f32", "f16", "half", "torch.float32")] == \
        ["float32", "float16", "float16", "float32"]
    assert _dtypes.lookup(torch.bfloat16) is None  # storage arguments take names only
    assert _dtypes.lookup("torch.bfloat16") is None


@pytest.mark.parametrize("state,params", [("fp32", "float32"), ("float32", "fp32"),
                                          ("bf16", "bfloat16"), ("bfloat16", "bf16"),
                                          ("int8", "BF16")])
def test_client_storage_arguments_take_both_spellings(state, params):
    h = _requests.checked_group_hyperparameters(state_dtype=state, params_dtype=params)
    assert h.state_dtype == _dtypes.STATE_CODES[_dtypes.lookup(state)]
    assert h.params_dtype == _dtypes.WIRE_CODES[_dtypes.lookup(params)]


@pytest.mark.parametrize("state,params", [("fp32", "float32"), ("bfloat16", "bf16"),
                                          ("int8", "bfloat16")])
def test_remote_adamw_storage_arguments_take_both_spellings(state, params):
    storage = ro.group_storage(dict(state_dtype=state, params_dtype=params, rounding_seed=0),
                               ro.Storage(), "RemoteAdamW")
    # Kept as the server reports them (check_server_storage compares the two).
    assert storage == ro.Storage(_dtypes.short(_dtypes.lookup(state)),
                                 _dtypes.short(_dtypes.lookup(params)), 0)


@pytest.mark.parametrize("spelling", ["float32", "fp32", torch.float32, "bfloat16", "bf16",
                                      torch.bfloat16])
def test_remote_adamw_wire_arguments_take_both_spellings(spelling):
    name = _dtypes.wire_dtype(spelling, "x")
    assert ro.wire_dtype(spelling, "grad_dtype") == name
    ro.check_overlap_options(True, None, 0, 10, spelling)  # pull_dtype
    # grad_dtype is RemoteAdamW's first check after the implementation flags: passing it, the
    # constructor stops at the next one (neither targets nor client), before any connection.
    with pytest.raises(ValueError, match="give exactly one of targets= and client="):
        RemoteAdamW(torch.nn.Linear(2, 2).named_parameters(), grad_dtype=spelling)


@pytest.mark.parametrize("spelling", ["float32", "fp32", "bfloat16", "bf16", "float16", "fp16",
                                      torch.float16])
def test_client_wire_arguments_take_both_spellings(spelling):
    # Each checks its dtype first; the error after it shows the spelling was taken (no server:
    # a client connects on its first call).
    with fusedps.Client("127.0.0.1:1", transport="grpcio") as client:
        with pytest.raises(ValueError, match="no gradients to push"):
            client.push_gradients({}, grad_dtype=spelling)
        with pytest.raises(ValueError, match="nothing to pull"):
            client.pull_into([], dtype=spelling)
        if _dtypes.wire_dtype(spelling, "dtype") in _dtypes.PULL_DTYPES:
            with pytest.raises(ValueError, match="nothing to pull"):
                client.pull_parameters([], dtype=spelling)


def _torch_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


@pytest.mark.parametrize("spelling,short", [("bf16", "bf16"), ("bfloat16", "bf16"),
                                            ("fp16", "fp16"), ("float16", "fp16")])
def test_from_torch_param_copy_dtype_takes_both_spellings(tmp_path, spelling, short):
    model_state, optim_state = _torch_state()
    path = checkpoint.from_torch(model_state, optim_state, str(tmp_path),
                                 param_copy_dtype=spelling)
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        # The manifest's spelling (format 4): the proto's DType member.
        assert json.load(f)["param_copy_dtype"] == "DTYPE_" + _dtypes.canonical(short).upper()
    copy = checkpoint.read_safetensors(os.path.join(path, "param_copy.safetensors"))
    assert {t.dtype for t in copy.values()} == {_dtypes.torch_dtype(short)}


def test_from_torch_takes_fp32_storage_in_both_spellings(tmp_path):
    model_state, optim_state = _torch_state()
    for spelling in ("fp32", "float32"):
        optim_state["param_groups"][0].update(state_dtype=spelling, params_dtype=spelling)
        checkpoint.from_torch(model_state, optim_state, str(tmp_path / spelling))
    optim_state["param_groups"][0]["state_dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="from_torch writes fp32 state and params only"):
        checkpoint.from_torch(model_state, optim_state, str(tmp_path / "bf16"))


# -- unknown spellings ------------------------------------------------------------------------

def _client_call(method, **kwargs):
    def call():
        with fusedps.Client("127.0.0.1:1", transport="grpcio") as client:
            getattr(client, method)(**kwargs)
    return call


def _named():
    return torch.nn.Linear(2, 2).named_parameters()


UNKNOWN = [
    ("state_dtype", ["'fp32', 'bf16', 'int8' or None", "'float32', 'bfloat16'"],
     lambda: _requests.checked_group_hyperparameters(state_dtype="fp8")),
    ("params_dtype", ["'fp32', 'bf16' or None", "'float32', 'bfloat16'"],
     lambda: _requests.checked_group_hyperparameters(params_dtype="float16")),
    ("state_dtype", ["'fp32', 'bf16', 'int8'"],
     lambda: ro.group_storage({"state_dtype": torch.bfloat16}, ro.Storage(), "g")),
    ("grad_dtype", ["'float32', 'bfloat16'", "'fp32', 'bf16' or a torch dtype"],
     lambda: RemoteAdamW(_named(), grad_dtype="fp16", targets="127.0.0.1:1")),
    ("pull_dtype", ["'float32', 'bfloat16' or None", "'fp32', 'bf16' or a torch dtype"],
     lambda: RemoteAdamW(_named(), pull_dtype="half", targets="127.0.0.1:1")),
    ("state_dtype", ["'fp32', 'bf16', 'int8' or None"],
     lambda: RemoteAdamW(_named(), state_dtype="int4", targets="127.0.0.1:1")),
    ("params_dtype", ["'fp32', 'bf16' or None"],
     lambda: RemoteAdamW(_named(), params_dtype="fp16", targets="127.0.0.1:1")),
    ("grad_dtype", ["'float32', 'bfloat16', 'float16'", "'fp32', 'bf16', 'fp16' or a torch"],
     _client_call("push_gradients", model_or_dict={}, grad_dtype="fp64")),
    ("dtype", ["'float32', 'bfloat16'", "'fp32', 'bf16' or a torch dtype"],
     _client_call("pull_parameters", model_or_names=["w"], dtype="float16")),
    ("dtype", ["'float32', 'bfloat16', 'float16'"],
     _client_call("pull_into", targets=[], dtype=torch.int8)),
    ("param_copy_dtype", ["'bf16', 'fp16' or 'none'", "'bfloat16', 'float16'"],
     lambda: checkpoint.from_torch({}, {}, "/nonexistent", param_copy_dtype="int8")),
]


@pytest.mark.parametrize("argument,accepted,call", UNKNOWN,
                         ids=[f"{i}-{u[0]}" for i, u in enumerate(UNKNOWN)])
def test_an_unknown_spelling_names_the_argument_and_the_values_it_takes(argument, accepted,
                                                                       call):
    with pytest.raises(ValueError) as raised:
        call()
    message = str(raised.value)
    assert f"{argument} must be one of" in message, message
    for words in accepted:
        assert words in message, message


def test_the_error_quotes_the_value_given():
    with pytest.raises(ValueError, match=re.escape("got 'fp64'")):
        _dtypes.wire_dtype("fp64", "grad_dtype")


# -- torch.optim.AdamW's defaults -------------------------------------------------------------

def test_the_defaults_are_torch_adamws():
    params = inspect.signature(torch.optim.AdamW.__init__).parameters
    assert {k: params[k].default for k in ADAMW._fields} == ADAMW._asdict()


def test_remote_adamw_and_from_torch_use_them():
    params = inspect.signature(RemoteAdamW.__init__).parameters
    assert {k: params[k].default for k in ADAMW._fields} == ADAMW._asdict()
    group = checkpoint._default_group()
    assert group == dict(name="default", lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                         weight_decay=ADAMW.weight_decay,
                         amsgrad=ADAMW.amsgrad, maximize=ADAMW.maximize,
                         decoupled_weight_decay=True, state_dtype="fp32",
                         params_dtype="fp32", rounding_seed=0)
