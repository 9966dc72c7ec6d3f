"""A live Prometheus (Debian's package) scrapes two live fusedps-servers during a short
training-like run: one in async mode (pushes, pulls, skipped steps, failed pushes, checkpoints)
and one in sync mode (rounds, dropped stale pushes). Then every query of the Grafana dashboard
(deploy/grafana/fusedps.json) and every recording rule (deploy/prometheus/rules/) is evaluated
through Prometheus's HTTP API and must return data: a panel or rule without data fails the test.
The alerting rules must evaluate without error."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import tempfile
import threading
import time

import grpc
import torch
import yaml

import fusedps
from metrics_helpers import (DASHBOARD, PROMETHEUS_DIR, finite_values, metrics_server,
                             running_prometheus)

RATE_INTERVAL = "1m"  # What $__rate_interval stands for; longer than the whole run.
RUN_SECONDS = 8.0


def dashboard_panels(dashboard: dict):
    """Every panel, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard: dict):
    """(panel title, refId, expr) for every Prometheus query of the dashboard."""
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield panel["title"], target.get("refId", "?"), target["expr"]


def substitute(expr: str, instance_regex: str) -> str:
    """Grafana's variables, as Grafana would expand them for this run."""
    values = {"instance": instance_regex, "__rate_interval": RATE_INTERVAL,
              "__interval": "15s", "__range": RATE_INTERVAL}
    expanded = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: values[m.group(1) or m.group(2)], expr)
    assert "$" not in expanded, expanded
    return expanded


def recording_rules():
    """(file, record, expr) of every recording rule, and the names of the alerting rules."""
    records, alerts = [], []
    for name in sorted(os.listdir(os.path.join(PROMETHEUS_DIR, "rules"))):
        with open(os.path.join(PROMETHEUS_DIR, "rules", name)) as f:
            for group in yaml.safe_load(f)["groups"]:
                for rule in group["rules"]:
                    if "record" in rule:
                        records.append((name, rule["record"], rule["expr"]))
                    else:
                        alerts.append(rule["alert"])
    return records, alerts


def prometheus_config(*metrics_addresses: str) -> dict:
    """deploy/prometheus/prometheus.yml, pointed at these servers, scraping every second."""
    with open(os.path.join(PROMETHEUS_DIR, "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    config = copy.deepcopy(config)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [os.path.join(PROMETHEUS_DIR, path) for path in config["rule_files"]]
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "fusedps"]
    assert len(jobs) == 1, "the example config must have one job named fusedps"
    jobs[0]["static_configs"] = [{"targets": list(metrics_addresses)}]
    return config


def run_workload(target: str, seconds: float) -> dict:
    """Pushes (fp32 and bf16), pulls, some skipped steps and some failed pushes, an embedding
    table's row pushes and lookups, for `seconds`. Returns counts of what happened."""
    counts = {"applied": 0, "skipped": 0, "errors": 0, "pulls": 0}
    params = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
    params["bias"] = torch.randn(64)
    with fusedps.Client(target, max_chunk_bytes=8 << 10) as client:
        client.wait_ready(timeout=10)
        client.register_model(params)
        client.register_param_group("tables", weight_decay=0.0)
        client.register_table("emb", torch.randn(256, 8), param_group="tables")
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            i += 1
            grads = {n: torch.randn_like(t) for n, t in params.items()}
            if i % 5 == 0:
                grads["bias"][0] = math.nan
            result = client.push_gradients(grads, "bfloat16" if i % 2 else "float32")
            counts["skipped" if result.step_skipped else "applied"] += 1
            if i % 7 == 0:
                try:
                    client.push_gradients({"unknown": torch.zeros(3)})
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND
                    counts["errors"] += 1
            if i % 3 == 0:
                client.pull_parameters(params)
                counts["pulls"] += 1
            if i % 4 == 0:  # A step of its own (docs/api.md, "Embedding tables").
                keys = torch.randint(0, 256, (16,))
                client.push_rows({"emb": (keys, torch.randn(16, 8))})
                counts["applied"] += 1
                client.lookup_rows("emb", keys.unique())
            time.sleep(0.01)
    return counts


def run_sync_workload(target: str, seconds: float) -> dict:
    """Two trainers (threads, client_ids "a" and "b") push the whole model to a sync server
    with K = 1 of N = 2, each pulling after every push, for `seconds`: every push that finds its
    version is a round; the other's, for the version before, is ABORTED (stale_version).
    Returns counts of both."""
    counts = {"rounds": 0, "dropped": 0}
    lock = threading.Lock()
    params = {f"layer{i}.weight": torch.randn(32, 32) for i in range(2)}
    with fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        client.register_model(params)

    def trainer(client_id: str) -> None:
        with fusedps.Client(target, client_id=client_id) as client:
            client.pull_parameters(list(params))
            deadline = time.monotonic() + seconds
            sequence_number = 0
            while time.monotonic() < deadline:
                sequence_number += 1
                grads = {n: torch.randn_like(t) for n, t in params.items()}
                try:
                    result = client.push_gradients(grads, "float32",
                                                   sequence_number=sequence_number)
                    assert result.round_workers == 1, result
                    outcome = "rounds"
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.ABORTED, e
                    outcome = "dropped"
                with lock:
                    counts[outcome] += 1
                client.pull_parameters(list(params))
                time.sleep(0.01)

    threads = [threading.Thread(target=trainer, args=(c,)) for c in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def has_data_somewhere(prom, expr: str, instance_regexes) -> bool:
    """Whether the query has data for one of the instance regexes."""
    return any(finite_values(prom.query(substitute(expr, regex))) for regex in instance_regexes)


def test_every_dashboard_query_and_recording_rule_has_data():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = list(dashboard_queries(dashboard))
    records, alerts = recording_rules()
    assert len(queries) >= 20 and len(records) >= 10 and len(alerts) >= 6

    # Checkpoints every few versions and every second, so that the checkpoint row has data; a
    # sync server beside it, so that the round panels have data.
    sync_args = ["--mode=sync", "--total-replicas=2", "--replicas-to-aggregate=1"]
    with tempfile.TemporaryDirectory(prefix="fusedps-ckpt-") as checkpoints, \
            metrics_server([f"--checkpoint-dir={checkpoints}", "--checkpoint-every-versions=5",
                            "--checkpoint-interval-seconds=1"]) as server, \
            metrics_server(sync_args) as sync_server, \
            running_prometheus(prometheus_config(server.metrics_address,
                                                 sync_server.metrics_address)) as prom:
        instance = server.metrics_address
        sync_instance = sync_server.metrics_address
        prom.wait_for("the first scrape of both", lambda: len([
            s for s in prom.query('up{job="fusedps"}') if s["value"][1] == "1"]) == 2)
        sync_counts = {}
        sync_thread = threading.Thread(
            target=lambda: sync_counts.update(run_sync_workload(sync_server.target,
                                                                RUN_SECONDS)))
        sync_thread.start()
        counts = run_workload(server.target, RUN_SECONDS)
        sync_thread.join()
        assert counts["applied"] > 10 and counts["skipped"] > 0 and counts["errors"] > 0
        assert sync_counts["rounds"] > 10 and sync_counts["dropped"] > 0, sync_counts

        # Wait until Prometheus has scraped the final counters, and the rules have run since.
        prom.wait_for("the final step count", lambda: [
            s for s in prom.query(f'fusedps_optimizer_steps_total{{instance="{instance}"}}')
            if float(s["value"][1]) == counts["applied"]])
        prom.wait_for("the final round count", lambda: [
            s for s in prom.query(f'sum(fusedps_rounds_total{{instance="{sync_instance}"}})')
            if float(s["value"][1]) == sync_counts["rounds"]])
        prom.wait_for("the recording rules", lambda: all(
            prom.query(record) for _, record, _ in records))

        # The dashboard's instance variable lists this server.
        variable = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"][0]
        assert variable["query"]["query"] == "label_values(fusedps_build_info, instance)"
        instances = prom.api("/api/v1/label/instance/values", **{"match[]": "fusedps_build_info"})
        assert instance in instances and sync_instance in instances, instances

        # Each panel has data for All, and for one server chosen alone (Grafana's escaping):
        # the async one or the sync one (the round panels have data for the sync one only).
        one_server = [re.escape(i).replace("\\", "\\\\") for i in (instance, sync_instance)]
        failures = []
        for title, ref, expr in queries:
            for regexes, which in ((one_server, "either server alone"), ([".*"], "All")):
                if not has_data_somewhere(prom, expr, regexes):
                    failures.append(f"panel {title!r} ({ref}): no data for {which}: {expr}")
        for name, record, expr in records:
            if not finite_values(prom.query(expr)):
                failures.append(f"{name}: recording rule {record}: no data for {expr}")
            if not finite_values(prom.query(record)):
                failures.append(f"{name}: recorded series {record} has no data")
        assert not failures, "\n".join(failures)

        # The values agree with the workload (the dashboard shows the truth, not just data).
        steps = prom.query(f'fusedps_optimizer_steps_total{{instance="{instance}"}}')
        assert float(steps[0]["value"][1]) == counts["applied"]
        skipped = prom.query(f'fusedps_optimizer_steps_skipped_total{{instance="{instance}"}}')
        assert float(skipped[0]["value"][1]) == counts["skipped"]
        errors = prom.query(f'fusedps_push_requests_total{{instance="{instance}", '
                            f'code="NOT_FOUND"}}')
        assert float(errors[0]["value"][1]) == counts["errors"]
        rounds = prom.query(f'fusedps_rounds_total{{instance="{sync_instance}", '
                            f'closed_by="quorum"}}')
        assert float(rounds[0]["value"][1]) == sync_counts["rounds"]
        dropped = prom.query(f'fusedps_pushes_dropped_total{{instance="{sync_instance}", '
                             f'reason="stale_version"}}')
        assert float(dropped[0]["value"][1]) == sync_counts["dropped"]
        workers = prom.query(f'fusedps_round_workers_sum{{instance="{sync_instance}"}}')
        assert float(workers[0]["value"][1]) == sync_counts["rounds"]

        # Every rule, alerting ones included, evaluates without error.
        def evaluated_rules():
            groups = prom.api("/api/v1/rules")["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            return rules if all(r["health"] != "unknown" for r in rules) else None

        rules = prom.wait_for("every rule's first evaluation", evaluated_rules)
        assert {r["name"] for r in rules if r["type"] == "alerting"} == set(alerts)
        unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not unhealthy, unhealthy


def test_dashboard_is_portable_and_complete():
    """Every panel reads the datasource variable, ids are unique, and the issue's panels are
    there (RED by stage, bytes/s, steps and skips, launches per step, parameters, memory,
    versions, embedding tables' rows, keys, evictions and lookup misses)."""
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    panels = list(dashboard_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    exprs = " ".join(expr for _, _, expr in dashboard_queries(dashboard))
    for needed in ("fusedps_push_requests_total", 'code!="OK"', "fusedps_push_duration_seconds",
                   "by (le, stage)", "fusedps_push_bytes_total", "fusedps_optimizer_steps_total",
                   "fusedps_optimizer_steps_skipped_total", "fusedps_kernel_launches_total",
                   "fusedps_parameters", "fusedps_device_memory_bytes", "fusedps_model_version",
                   "fusedps_build_info", "up{", "fusedps_round_duration_seconds",
                   "fusedps_round_stage_duration_seconds", "fusedps_round_workers",
                   "fusedps_rounds_total", "fusedps_push_staleness", "fusedps_table_rows",
                   "fusedps_table_pushed_keys_total", "fusedps_table_lookup_keys_total",
                   "fusedps_table_lookup_misses_total", "fusedps_table_evictions_total"):
        assert needed in exprs, needed
