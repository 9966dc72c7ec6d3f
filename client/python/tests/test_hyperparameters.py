"""fusedps._hyperparameters: torch's vocabulary <-> proto fusedps.v1.Hyperparameters, made from
the descriptor: every field of the proto survives both ways, and a name that is not a
hyperparameter is refused. No server, no torch."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import descriptor

from fusedps import _hyperparameters as hp
from fusedps.v1 import parameter_service_pb2 as pb

FD = descriptor.FieldDescriptor


def every_field_changed() -> "pb.Hyperparameters":
    """Every field set to a value other than its default (an enum to its last value that is a
    dtype or mode the client takes), so that a field the conversion forgets comes back unset."""
    h = pb.Hyperparameters()
    for i, f in enumerate(pb.Hyperparameters.DESCRIPTOR.fields):
        if f.cpp_type == FD.CPPTYPE_DOUBLE:
            setattr(h, f.name, 0.125 + i)
        elif f.cpp_type == FD.CPPTYPE_BOOL:
            setattr(h, f.name, True)
        elif f.cpp_type in (FD.CPPTYPE_UINT64, FD.CPPTYPE_INT64, FD.CPPTYPE_UINT32,
                            FD.CPPTYPE_INT32):
            setattr(h, f.name, 7 + i)
        elif f.cpp_type == FD.CPPTYPE_ENUM:
            # DTYPE_FLOAT16 is no params_dtype; BFLOAT16 is the last value every enum here takes.
            values = [v.number for v in f.enum_type.values if "FLOAT16" not in v.name
                      or "BFLOAT16" in v.name]
            setattr(h, f.name, values[-1])
        else:
            pytest.fail(f"test_hyperparameters does not know the type of field {f.name}")
    return h


def test_every_proto_field_survives_torch_names():
    h = every_field_changed()
    fields = hp.from_proto(h)
    assert hp.to_proto(fields) == h
    # Every torch name is one the module lists, and they cover the message.
    assert set(fields) == set(hp.NAMES)


def test_torch_spellings():
    fields = hp.from_proto(pb.Hyperparameters(
        beta1=0.8, beta2=0.99, weight_decay_mode=pb.WEIGHT_DECAY_MODE_L2,
        state_dtype=pb.STATE_DTYPE_INT8, params_dtype=pb.DTYPE_BFLOAT16, rounding_seed=2**64 - 1))
    assert fields == {"betas": (0.8, 0.99), "decoupled_weight_decay": False,
                      "state_dtype": "int8", "params_dtype": "bf16", "rounding_seed": 2**64 - 1}
    assert hp.from_proto(pb.Hyperparameters(beta2=0.5)) == {"betas": (None, 0.5)}
    assert hp.to_proto({"betas": (None, 0.5), "lr": None}) == pb.Hyperparameters(beta2=0.5)
    assert hp.to_proto({"state_dtype": "bfloat16", "params_dtype": "fp32"}) == pb.Hyperparameters(
        state_dtype=pb.STATE_DTYPE_BFLOAT16, params_dtype=pb.DTYPE_FLOAT32)
    # Values take the field's type: an int lr is a double on the wire.
    assert hp.to_proto({"lr": 1, "amsgrad": 1}) == pb.Hyperparameters(lr=1.0, amsgrad=True)


def test_a_name_that_is_not_a_hyperparameter_is_refused():
    with pytest.raises(TypeError, match="'momentum' is not a hyperparameter"):
        hp.to_proto({"momentum": 0.9})


def test_param_group_has_every_hyperparameter():
    # ParamGroup (what the clients return) is built from the message by these names: a field
    # added to the proto must get an attribute there.
    from fusedps.results import ParamGroup
    group = ParamGroup._from_pb(pb.ParamGroup(name="g", hyperparameters=every_field_changed()))
    assert {f.name for f in dataclasses.fields(ParamGroup)} == {"name", *hp.NAMES}
    assert hp.to_proto({n: getattr(group, n) for n in hp.NAMES}) == every_field_changed()
