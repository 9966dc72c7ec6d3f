"""The scrape check: a fusedps-server runs a known workload, then its /metrics must pass
`promtool check metrics` and every value must be what the workload implies."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

import fusedps
from metrics_helpers import metrics_server, parse_metrics, promtool, scrape

CONTRACT = {  # DESIGN.md "Metrics" / docs/metrics.md: name -> type.
    "fusedps_push_requests_total": "counter",
    "fusedps_push_bytes_total": "counter",
    "fusedps_push_duration_seconds": "histogram",
    "fusedps_stage_duration_seconds": "histogram",
    "fusedps_push_ingest_seconds": "histogram",
    "fusedps_staging_pool_capacity_bytes": "gauge",
    "fusedps_staging_pool_in_use_bytes": "gauge",
    "fusedps_staging_pool_waiters": "gauge",
    "fusedps_kernel_launches_total": "counter",
    "fusedps_optimizer_steps_total": "counter",
    "fusedps_optimizer_steps_skipped_total": "counter",
    "fusedps_pull_requests_total": "counter",
    "fusedps_pull_bytes_total": "counter",
    "fusedps_parameters": "gauge",
    "fusedps_device_memory_bytes": "gauge",
    "fusedps_model_version": "gauge",
    "fusedps_build_info": "gauge",
}
STAGES = ("receive", "h2d", "apply", "ack")


def model_params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(257, generator=g),
            "s": torch.randn((), generator=g)}


def test_metrics_pass_promtool_and_match_the_workload():
    params = model_params()
    numel = sum(t.numel() for t in params.values())
    with metrics_server() as server:
        # Before any call: every contract name is there, and the text is valid.
        text = scrape(server.metrics_url)
        for name, kind in CONTRACT.items():
            assert f"# TYPE {name} {kind}\n" in text, name
        # Small chunks, so that pushes and pulls take several messages each.
        with fusedps.Client(server.target, max_chunk_bytes=16 << 10) as client:
            client.wait_ready(timeout=10)
            client.register_model(params)
            ok_pushes = []
            for i in range(5):
                grads = {n: torch.randn_like(t) for n, t in params.items()}
                ok_pushes.append(client.push_gradients(grads, "float32"))
            for i in range(2):  # bf16, one tensor only.
                ok_pushes.append(client.push_gradients({"w": torch.randn(300, 257)}, "bfloat16"))
            bad = {n: torch.randn_like(t) for n, t in params.items()}
            bad["b"][3] = math.inf
            ok_pushes.append(client.push_gradients(bad, "float32"))  # Skipped: non-finite.
            retry = {n: torch.randn_like(t) for n, t in params.items()}
            ok_pushes.append(client.push_gradients(retry, "float32", client_id="t",
                                                   sequence_number=1))
            ok_pushes.append(client.push_gradients(retry, "float32", client_id="t",
                                                   sequence_number=1))
            assert ok_pushes[-1].duplicate and not ok_pushes[-2].duplicate
            assert ok_pushes[7].step_skipped

            with pytest.raises(grpc.RpcError) as e:
                client.push_gradients({"nope": torch.zeros(4)})
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:  # 10 of b's 257 elements: chunks missing.
                client.push_gradients({"b": torch.zeros(10)}, "float32")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            invalid_push_bytes = 10 * 4  # Accepted before the push failed.

            pulled = client.pull_parameters()
            client.pull_parameters(["w"], dtype="bfloat16")
            with pytest.raises(grpc.RpcError) as e:
                client.pull_parameters(["nope"])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            info = client.info()

        text = scrape(server.metrics_url)

    check = promtool("check", "metrics", stdin=text)
    assert check.returncode == 0, f"promtool check metrics:\n{check.stdout}{check.stderr}"

    m = parse_metrics(text)
    applied = [r for r in ok_pushes if not r.step_skipped and not r.duplicate]
    assert len(applied) == 8
    assert m.value("fusedps_optimizer_steps_total", model="default") == len(applied)
    assert m.value("fusedps_optimizer_steps_skipped_total", model="default",
                   reason="non_finite_grad") == 1
    assert m.value("fusedps_model_version", model="default") == applied[-1].version == pulled.version == 8
    assert info.version == 8

    assert m.value("fusedps_push_requests_total", code="OK") == len(ok_pushes)
    assert m.value("fusedps_push_requests_total", code="NOT_FOUND") == 1
    assert m.value("fusedps_push_requests_total", code="INVALID_ARGUMENT") == 1
    # A retry is answered from its header: its chunks are never read, so its bytes are not
    # received (its reply repeats the first push's grad_bytes).
    received = sum(r.grad_bytes for r in ok_pushes if not r.duplicate)
    # 7 full fp32 pushes read (and the retry of the last, not read), 2 of w in bf16.
    assert received == 7 * numel * 4 + 2 * 300 * 257 * 2
    assert m.value("fusedps_push_bytes_total") == received + invalid_push_bytes
    assert m.value("fusedps_push_duplicates_total") == 1

    # Durations: one observation per successful push that was not a retry, in the histogram and
    # in every stage; the stages add up to the push.
    count = m.value("fusedps_push_duration_seconds_count")
    assert count == len(ok_pushes) - 1
    assert m.value("fusedps_push_duration_seconds_bucket", le="+Inf") == count
    total = m.value("fusedps_push_duration_seconds_sum")
    assert 0 < total < 60
    stage_sum = 0.0
    for stage in STAGES:
        assert m.value("fusedps_stage_duration_seconds_count", stage=stage) == count, stage
        stage_sum += m.value("fusedps_stage_duration_seconds_sum", stage=stage)
    assert stage_sum == pytest.approx(total, rel=1e-9, abs=1e-9)
    # Ingest (reading messages into staging) is part of receive; one call per push here.
    assert m.value("fusedps_push_ingest_seconds_count") == count
    ingest = m.value("fusedps_push_ingest_seconds_sum")
    assert 0 < ingest <= m.value("fusedps_stage_duration_seconds_sum", stage="receive")
    buckets = sorted((float(labels["le"]), v)
                     for labels, v in m.series("fusedps_push_duration_seconds_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets), "buckets not cumulative"
    assert buckets[0][0] == 50e-6 and buckets[-2][0] == 10

    assert m.value("fusedps_pull_requests_total", code="OK") == 2
    assert m.value("fusedps_pull_requests_total", code="NOT_FOUND") == 1
    assert m.value("fusedps_pull_bytes_total") == numel * 4 + 300 * 257 * 2

    # The CPU backend makes one parallel pass per applied step (skips and retries make none).
    assert m.value("fusedps_kernel_launches_total", kernel="cpu_adamw_apply") == len(applied)
    assert m.value("fusedps_parameters", model="default") == numel
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert m.value("fusedps_device_memory_bytes", kind=kind) >= numel * 4, kind
    assert m.value("fusedps_device_memory_bytes", kind="max_exp_avg_sq") == 0  # No amsgrad.
    assert m.value("fusedps_device_memory_bytes", kind="param_copy") == 0  # No param copy.
    assert m.value("fusedps_build_info", version=info.server_version, backend="cpu",
                   device=info.device) == 1


def test_param_copy_and_amsgrad_memory_is_reported():
    with metrics_server(["--param-copy-dtype=bf16"]) as server:
        with fusedps.Client(server.target) as client:
            client.wait_ready(timeout=10)
            client.register_param_group("ams", amsgrad=True)
            client.register_model({"w": torch.zeros(1000)}, param_group="ams")
        m = parse_metrics(scrape(server.metrics_url))
    assert m.value("fusedps_device_memory_bytes", kind="param_copy") >= 1000 * 2
    assert m.value("fusedps_device_memory_bytes", kind="max_exp_avg_sq") >= 1000 * 4
