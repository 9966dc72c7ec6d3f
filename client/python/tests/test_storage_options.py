"""The storage options of param groups (state_dtype, params_dtype, rounding_seed) in the client:
what Client and ShardedClient send, what they report back, and the mistakes refused before any
call. Against fake services in this process (the server's behaviour is tests/e2e's:
test_state_dtypes.py)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

import fusedps
from fusedps import _remote_optim as ro
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc


class RecordingService(pb_grpc.ParameterServiceServicer):
    """Answers RegisterParamGroup with the group as sent (as a server that fills nothing in)
    and ListTensors with ``infos``; records the requests."""

    def __init__(self):
        self.groups = []
        self.infos = []

    def RegisterParamGroup(self, request, context):
        self.groups.append(request.param_group)
        return pb.RegisterParamGroupResponse(created=True, param_group=request.param_group)

    def ListTensors(self, request, context):
        return pb.ListTensorsResponse(version=1, tensors=self.infos)


def _serve(count):
    services, servers, targets = [], [], []
    for _ in range(count):
        service = RecordingService()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ParameterServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        services.append(service)
        servers.append(server)
        targets.append(f"127.0.0.1:{port}")
    return services, servers, targets


@pytest.fixture
def fakes():
    services, servers, targets = _serve(2)
    yield services, targets
    for server in servers:
        server.stop(grace=0)


def test_register_param_group_sends_and_reports_the_storage(fakes):
    (service, _), (target, _) = fakes
    with fusedps.Client(target) as client:
        group = client.register_param_group("q", lr=0.1, state_dtype="int8",
                                            params_dtype="bf16", rounding_seed=2**64 - 1)
        plain = client.register_param_group("plain", lr=0.1)
        long_names = client.register_param_group("long", state_dtype="bfloat16",
                                                 params_dtype="float32", rounding_seed=0)
    h = service.groups[0].hyperparameters
    assert h.state_dtype == pb.STATE_DTYPE_INT8 and h.params_dtype == pb.DTYPE_BFLOAT16
    assert h.rounding_seed == 2**64 - 1
    assert (group.state_dtype, group.params_dtype, group.rounding_seed) == ("int8", "bf16",
                                                                             2**64 - 1)
    # Not given: not sent (the server's defaults, fp32), and a server that fills nothing in
    # (an older one) is reported as None.
    h = service.groups[1].hyperparameters
    assert not any(h.HasField(f) for f in ("state_dtype", "params_dtype", "rounding_seed"))
    assert (plain.state_dtype, plain.params_dtype, plain.rounding_seed) == (None, None, None)
    h = service.groups[2].hyperparameters
    assert (h.state_dtype, h.params_dtype) == (pb.STATE_DTYPE_BFLOAT16, pb.DTYPE_FLOAT32)
    assert h.HasField("rounding_seed") and h.rounding_seed == 0
    assert (long_names.state_dtype, long_names.params_dtype) == ("bf16", "fp32")


BAD_STORAGE = [
    (dict(state_dtype="int4"), "state_dtype must be one of 'fp32', 'bf16', 'int8'"),
    (dict(state_dtype="float16"), "state_dtype"),
    (dict(state_dtype=torch.bfloat16), "state_dtype"),
    (dict(params_dtype="int8"), "params_dtype must be one of 'fp32', 'bf16'"),
    (dict(params_dtype="fp16"), "params_dtype"),
    (dict(rounding_seed=-1), "rounding_seed must be an int in"),
    (dict(rounding_seed=2**64), "rounding_seed"),
    (dict(rounding_seed=1.0), "rounding_seed"),
    (dict(rounding_seed=True), "rounding_seed"),
    (dict(rounding_seed="7"), "rounding_seed"),
    (dict(amsgrad=True, state_dtype="int8"), "state_dtype='int8' with amsgrad=True"),
    (dict(amsgrad=True, state_dtype="bf16"), "state_dtype='bf16' with amsgrad=True"),
]


@pytest.mark.parametrize("kwargs,match", BAD_STORAGE)
def test_bad_storage_is_refused_before_any_call(fakes, kwargs, match):
    services, targets = fakes
    with fusedps.Client(targets[0]) as client:
        with pytest.raises(ValueError, match=match):
            client.register_param_group("g", **kwargs)
    with fusedps.ShardedClient(targets) as sharded:
        with pytest.raises(ValueError, match=match):
            sharded.register_param_group("g", **kwargs)
    assert all(not s.groups for s in services)


def test_amsgrad_with_fp32_state_is_fine(fakes):
    (service, _), (target, _) = fakes
    with fusedps.Client(target) as client:
        client.register_param_group("g", amsgrad=True, state_dtype="fp32", params_dtype="bf16")
    assert service.groups[0].hyperparameters.amsgrad


def test_sharded_client_passes_the_storage_to_every_shard(fakes):
    services, targets = fakes
    with fusedps.ShardedClient(targets) as sharded:
        groups = sharded.register_param_group("q", state_dtype="bf16", params_dtype="bf16",
                                              rounding_seed=5)
    assert [(g.state_dtype, g.params_dtype, g.rounding_seed) for g in groups] == \
        [("bf16", "bf16", 5)] * 2
    for s in services:
        h = s.groups[0].hyperparameters
        assert (h.state_dtype, h.params_dtype, h.rounding_seed) == (
            pb.STATE_DTYPE_BFLOAT16, pb.DTYPE_BFLOAT16, 5)


def test_set_hyperparameters_takes_no_storage(fakes):
    (_, _), (target, _) = fakes
    with fusedps.Client(target) as client:
        with pytest.raises(TypeError):
            client.set_hyperparameters("g", state_dtype="int8")


def test_tensor_info_reports_each_tensors_storage(fakes):
    (service, _), (target, _) = fakes
    service.infos = [
        pb.TensorInfo(name="w", shape=[64, 64], numel=4096, params_dtype=pb.DTYPE_BFLOAT16,
                      state_dtype=pb.STATE_DTYPE_INT8),
        pb.TensorInfo(name="b", shape=[64], numel=64, params_dtype=pb.DTYPE_BFLOAT16,
                      state_dtype=pb.STATE_DTYPE_FLOAT32),
        pb.TensorInfo(name="old", shape=[3], numel=3),  # a server without the fields
        pb.TensorInfo(name="h", shape=[2], numel=2, state_dtype=pb.STATE_DTYPE_BFLOAT16)]
    with fusedps.Client(target) as client:
        listed = {t.name: (t.params_dtype, t.state_dtype) for t in client.list_tensors()}
    assert listed == {"w": ("bf16", "int8"), "b": ("bf16", "fp32"), "old": ("fp32", "fp32"),
                      "h": ("fp32", "bf16")}


# -- RemoteAdamW's side (no server: the helpers of fusedps._remote_optim) ----------------------

def test_group_storage_takes_the_groups_own_keys_over_the_default():
    default = ro.group_storage(dict(state_dtype="int8", params_dtype="bfloat16",
                                    rounding_seed=3), ro.Storage(), "RemoteAdamW")
    assert default == ro.Storage("int8", "bf16", 3)
    assert ro.group_storage({"amsgrad": False}, default, "g") == default
    assert ro.group_storage({"state_dtype": "fp32", "amsgrad": True}, default, "g") == \
        ro.Storage("fp32", "bf16", 3)
    with pytest.raises(ValueError, match="param group 1: state_dtype must be one of"):
        ro.group_storage({"state_dtype": "int2"}, default, "param group 1")
    with pytest.raises(ValueError, match="amsgrad needs state_dtype 'fp32'"):
        ro.group_storage({"amsgrad": True}, default, "param group 0")
    with pytest.raises(ValueError, match="rounding_seed"):
        ro.group_storage({"rounding_seed": -2}, default, "param group 0")


def test_a_loaded_state_dict_does_not_change_the_storage():
    p = torch.nn.Parameter(torch.zeros(3))
    groups = [dict(params=[p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                   amsgrad=False, maximize=False, state_dtype="int8")]
    saved = {"state": {}, "param_groups": [dict(
        params=[0], lr=0.2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
        maximize=False, state_dtype="fp32", params_dtype="bf16", rounding_seed=9)]}
    loaded = ro.validate_state_dict(saved, groups, [False])
    assert loaded.groups[0]["lr"] == 0.2 and loaded.groups[0]["state_dtype"] == "int8"
    assert "params_dtype" not in loaded.groups[0] and "rounding_seed" not in loaded.groups[0]


def test_check_server_storage():
    ours = ro.Storage("int8", "fp32", 0)
    ro.check_server_storage("g", fusedps.ParamGroup("g", 0.1, (0.9, 0.99), 1e-8, 0.0, False,
                                                    False, True, "int8", "fp32", 0), ours)
    # An older server reports None: nothing to compare.
    ro.check_server_storage("g", fusedps.ParamGroup("g", 0.1, (0.9, 0.99), 1e-8, 0.0, False,
                                                    False, True), ours)
    with pytest.raises(ValueError, match="has state_dtype='bf16'; this optimizer's has "
                                         "state_dtype='int8'"):
        ro.check_server_storage("g", fusedps.ParamGroup(
            "g", 0.1, (0.9, 0.99), 1e-8, 0.0, False, False, True, "bf16", "fp32", 0), ours)
