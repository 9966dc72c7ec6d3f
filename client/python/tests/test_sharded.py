"""Tests of fusedps.ShardedClient over real gRPC against fake shards in this process (not
fusedps-server): each fake keeps its tensors in fp32, applies a push as SGD with lr 1
(param -= grad / grad_scale) and enforces the plan_hash rule of docs/sharding.md."""

from __future__ import annotations

import itertools
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

import fusedps
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

SHARDS = 3
SLICE = 50  # Elements; cuts the test model's weights into several slices.


class FakeShard(pb_grpc.ParameterServiceServicer):
    def __init__(self):
        self.tensors = {}  # name -> flat float32 tensor, in registration order
        self.shapes, self.groups = {}, {}
        self.plan_hash = ""
        self.version = 0
        self.push_headers = []
        self.pull_requests = []
        self.lock = threading.Lock()

    def RegisterParamGroup(self, request, context):
        return pb.RegisterParamGroupResponse(created=True, param_group=request.param_group)

    def SetHyperparameters(self, request, context):
        return pb.SetHyperparametersResponse(param_group=pb.ParamGroup(
            name=request.param_group, hyperparameters=request.hyperparameters))

    def RegisterTensors(self, request_iterator, context):
        first = next(request_iterator)
        header = first.header
        with self.lock:
            if (self.tensors or self.plan_hash) and header.plan_hash != self.plan_hash:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another plan_hash")
            self.plan_hash = header.plan_hash
            created = []
            for spec in header.tensors:
                if spec.name not in self.tensors:
                    self.tensors[spec.name] = torch.zeros(int(np.prod(spec.shape)))
                    self.shapes[spec.name] = tuple(spec.shape)
                    self.groups[spec.name] = spec.param_group
                    created.append(spec.name)
            for msg in request_iterator:
                for c in msg.chunks:
                    data = torch.from_numpy(np.frombuffer(c.data, "<f4").copy())
                    self.tensors[c.tensor][c.offset:c.offset + data.numel()] = data
            return pb.RegisterTensorsResponse(tensors_created=len(created),
                                              tensors_existing=len(header.tensors) - len(created),
                                              version=self.version)

    def PushGradients(self, request_iterator, context):
        first = next(request_iterator)
        header = first.header
        with self.lock:
            if header.plan_hash != self.plan_hash:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another plan_hash")
            self.push_headers.append(header)
            scale = header.grad_scale if header.HasField("grad_scale") else 1.0
            nbytes = 0
            # The header's message may carry chunks too (the C++ client packs them in).
            for msg in itertools.chain([first], request_iterator):
                for c in msg.chunks:
                    grad = decode(c.data, header.grad_dtype)
                    self.tensors[c.tensor][c.offset:c.offset + grad.numel()] -= grad / scale
                    nbytes += len(c.data)
            self.version += 1
            return pb.PushGradientsResponse(version=self.version, tensors_updated=len(
                header.tensors), grad_bytes=nbytes, round_workers=2)

    def PullParameters(self, request, context):
        self.pull_requests.append(list(request.tensors))
        names = list(request.tensors) or list(self.tensors)
        infos = [pb.TensorInfo(name=n, shape=self.shapes[n], param_group=self.groups[n],
                               numel=self.tensors[n].numel()) for n in names]
        yield pb.PullParametersResponse(header=pb.PullHeader(
            version=self.version, dtype=pb.DTYPE_FLOAT32, tensors=infos,
            tensor_count=len(names)))
        for n in names:
            if self.tensors[n].numel():
                data = self.tensors[n].numpy().astype("<f4").tobytes()
                yield pb.PullParametersResponse(chunks=[pb.TensorChunk(tensor=n, data=data)])

    def GetInfo(self, request, context):
        return pb.GetInfoResponse(
            version=self.version, backend="fake", plan_hash=self.plan_hash,
            consistency=pb.Consistency(mode=pb.CONSISTENCY_MODE_SYNC, replicas_to_aggregate=2,
                                       total_replicas=3, round_timeout_seconds=1.5))


def decode(data: bytes, dtype) -> torch.Tensor:
    if dtype == pb.DTYPE_FLOAT32:
        return torch.from_numpy(np.frombuffer(data, "<f4").copy())
    assert dtype == pb.DTYPE_BFLOAT16
    bits = np.frombuffer(data, "<u2").astype(np.uint32) << 16
    return torch.from_numpy(bits.view(np.float32).copy())


@pytest.fixture
def shards():
    fakes, servers, targets = [], [], []
    for _ in range(SHARDS):
        fake = FakeShard()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ParameterServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        fakes.append(fake)
        servers.append(server)
        targets.append(f"127.0.0.1:{port}")
    yield fakes, targets
    for server in servers:
        server.stop(grace=0)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20),
                               torch.nn.Linear(20, 7))


def test_register_places_every_slice_on_its_shard(shards):
    fakes, targets = shards
    model = make_model()
    params = dict(model.named_parameters())
    with fusedps.ShardedClient(targets, client_id="t0") as ps:
        results = ps.register_model(model, param_group={"1.weight": "no_decay"},
                                    slice_elements=SLICE)
        plan = ps.plan
        assert plan == fusedps.make_plan(
            [(n, tuple(p.shape), "no_decay" if n == "1.weight" else "default")
             for n, p in params.items()], SHARDS, SLICE)
        assert [i.plan_hash for i in ps.info()] == [plan.hash] * SHARDS
    for shard, fake in enumerate(fakes):
        slices = plan.shard_slices(shard)
        assert list(fake.tensors) == [s.server_tensor for s in slices]
        assert results[shard].tensors_created == len(slices)
        for s in slices:
            expected = params[s.tensor].detach().reshape(-1)[s.begin:s.end]
            assert torch.equal(fake.tensors[s.server_tensor], expected), s
            assert fake.shapes[s.server_tensor] == s.shape_on_server
            assert fake.groups[s.server_tensor] == s.param_group


def test_push_scatters_and_pull_gathers(shards):
    fakes, targets = shards
    model = make_model()
    with fusedps.ShardedClient(targets, client_id="t0") as ps:
        ps.register_model(model, slice_elements=SLICE)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        expected = {n: (p - p.grad / 4).detach() for n, p in model.named_parameters()}
        result = ps.push_gradients(model, grad_dtype="float32", grad_scale=4.0,
                                   sequence_number=7)
        assert result.versions == [1] * SHARDS and not result.step_skipped
        assert [r.round_workers for r in result.results] == [2] * SHARDS
        assert result.grad_bytes == 4 * sum(p.numel() for p in model.parameters())
        for fake in fakes:
            (header,) = fake.push_headers
            assert header.plan_hash == ps.plan.hash and header.client_id == "t0"
            assert header.sequence_number == 7 and header.base_version == 0
            assert list(header.tensors) == list(fake.tensors)

        fresh = make_model(seed=1)
        pulled = ps.pull_parameters(fresh)
        assert pulled.versions == [1] * SHARDS and pulled.dtype == "float32"
        for name, p in fresh.named_parameters():
            assert torch.equal(p.detach(), expected[name]), name
            assert torch.equal(pulled[name], expected[name]), name

        everything = ps.pull_parameters()
        assert list(everything) == [t.name for t in ps.plan.tensors]
        assert all(everything[n].shape == expected[n].shape for n in expected)


def test_default_dtype_is_bfloat16_on_every_shard(shards):
    fakes, targets = shards
    model = make_model()
    with fusedps.ShardedClient(targets) as ps:
        ps.register_model(model, slice_elements=SLICE)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        expected = {n: p.detach() - p.grad.bfloat16().float()
                    for n, p in model.named_parameters()}
        ps.push_gradients(model)
        pulled = ps.pull_parameters(list(expected))
    assert all(f.push_headers[0].grad_dtype == pb.DTYPE_BFLOAT16 for f in fakes)
    for name in expected:
        assert torch.equal(pulled[name], expected[name]), name


def test_base_versions_follow_each_shards_last_pull(shards):
    fakes, targets = shards
    model = make_model()
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with fusedps.ShardedClient(targets) as ps:
        ps.register_model(model, slice_elements=SLICE)
        for i, fake in enumerate(fakes):
            fake.version = 10 * (i + 1)
        ps.pull_parameters(model)
        ps.push_gradients(grads)
        assert [f.push_headers[-1].base_version for f in fakes] == [10, 20, 30]
        ps.push_gradients(grads, base_versions=[5, 6, 7])
        assert [f.push_headers[-1].base_version for f in fakes] == [5, 6, 7]
        assert ps.versions() == [12, 22, 32]
        with pytest.raises(ValueError, match="base_versions"):
            ps.push_gradients(grads, base_versions=[1, 2])


def test_a_partial_pull_or_push_reads_only_the_shards_concerned(shards):
    fakes, targets = shards
    model = make_model()
    with fusedps.ShardedClient(targets) as ps:
        ps.register_model(model, slice_elements=SLICE)
        (bias,) = ps.plan.tensor_slices("0.bias")
        pulled = ps.pull_parameters("0.bias")
        assert torch.equal(pulled["0.bias"], model[0].bias.detach())
        assert [len(f.pull_requests) for f in fakes] == [int(i == bias.shard)
                                                         for i in range(SHARDS)]
        result = ps.push_gradients({"0.bias": torch.ones(20)}, grad_dtype="float32")
        assert [r is not None for r in result.results] == [i == bias.shard for i in range(SHARDS)]
        assert list(fakes[bias.shard].push_headers[0].tensors) == ["0.bias"]


def test_register_info_and_hyperparameters_fan_out(shards):
    fakes, targets = shards
    with fusedps.ShardedClient(targets) as ps:
        groups = ps.register_param_group("g", lr=0.5)
        assert [g.lr for g in groups] == [0.5] * SHARDS
        assert [g.lr for g in ps.set_hyperparameters("g", lr=0.25)] == [0.25] * SHARDS
        info = ps.info()
    assert [i.backend for i in info] == ["fake"] * SHARDS
    assert info[0].consistency == fusedps.Consistency("sync", 2, 3, 1.5, 0, False)


def test_another_plan_is_refused_with_the_shard_named(shards):
    fakes, targets = shards
    model = make_model()
    with fusedps.ShardedClient(targets) as ps:
        ps.register_model(model, slice_elements=SLICE)
    with fusedps.ShardedClient(targets) as other:
        with pytest.raises(grpc.RpcError) as e:
            other.register_model(model, slice_elements=SLICE * 2)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "from shard 0" in "".join(getattr(e.value, "__notes__", ["from shard 0"]))


def test_mistakes_seen_before_calling(shards):
    fakes, targets = shards
    model = make_model()
    with pytest.raises(ValueError, match="2 shards"):
        fusedps.ShardedClient(targets, fusedps.make_plan(model, 2))
    with fusedps.ShardedClient(targets) as ps:
        with pytest.raises(RuntimeError, match="no plan"):
            ps.push_gradients({"0.bias": torch.ones(20)})
        ps.register_model(model, slice_elements=SLICE)
        with pytest.raises(ValueError, match="shape"):
            ps.push_gradients({"0.bias": torch.ones(21)})
        with pytest.raises(KeyError):
            ps.push_gradients({"nope": torch.ones(2)})
        with pytest.raises(KeyError):
            ps.pull_parameters(["nope"])
        with pytest.raises(ValueError, match="missing"):
            ps.register_model(model[0], prefix="0.")
        with pytest.raises(ValueError, match="no gradients"):
            ps.push_gradients(model)
    assert all(not f.push_headers for f in fakes)
    with pytest.raises(ValueError, match="closed"):
        ps.info()
