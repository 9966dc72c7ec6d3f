"""The self-check's report (fusedps.bench.e2e.report and print_report) on timings made up here,
with the expected parts worked out by hand. No server, no GPU: the numbers a user reads must add
up, and the limit named must be the largest cost, whether a wait or the slower compute."""

from __future__ import annotations

import argparse

import pytest

from fusedps.bench import e2e


def records(step_ms, fwd_bwd_ms, **timings_ms):
    """Per step, seconds, as e2e.run records them (the optimizer's timings merged in)."""
    out = []
    for k, (step, fwd_bwd) in enumerate(zip(step_ms, fwd_bwd_ms)):
        row = {"step_seconds": step / 1e3, "fwd_bwd_seconds": fwd_bwd / 1e3}
        row.update({key + "_seconds": value[k] / 1e3 for key, value in timings_ms.items()})
        out.append(row)
    return out


ARGS = argparse.Namespace(preset="small", grad_dtype="bfloat16", pull_dtype="bfloat16", delay=0)
LOCAL = records([13.0, 14.0, 15.0], [11.0, 12.0, 13.0])  # Medians 14 and 12: step() 2.


def remote(fwd_bwd, push_exposed, pull_exposed):
    return records([21.0, 22.0, 23.0], [fwd_bwd - 1, fwd_bwd, fwd_bwd + 1],
                   push=[10.0] * 3, push_hidden=[10.0 - push_exposed] * 3,
                   push_exposed=[push_exposed] * 3, pull=[3.0] * 3,
                   pull_hidden=[3.0 - pull_exposed] * 3, pull_exposed=[pull_exposed] * 3,
                   check=[0.2] * 3, step_wait=[2.5] * 3)


def test_the_time_over_local_is_split_into_compute_the_pull_and_step():
    # Remote: 22 ms per step, fwd+bwd 19 of which 0.6 waited for the pull. Over local (14, fwd+bwd
    # 12): +8 = (19 - 0.6 - 12 = 6.4 beside) + 0.6 + ((22 - 19) - (14 - 12) = 1.0 in step()).
    r = e2e.report(ARGS, "cpu", 19_000_000, LOCAL, remote(19.0, 1.7, 0.6), {}, "s")
    o = r["over_local_ms"]
    assert o["beside"] == pytest.approx(6.4)
    assert o["pull_wait"] == pytest.approx(0.6)
    assert o["step"] == pytest.approx(1.0)
    assert sum(o.values()) == pytest.approx(r["remote_ms"] - r["local_ms"]) == pytest.approx(8.0)
    # 6.4 ms of slower compute is larger than every wait (push 1.7, pull 0.6, check 0.2).
    assert r["limit"] == e2e.COMPUTE and r["limit_ms"] == pytest.approx(6.4)


def test_an_exposed_push_larger_than_the_slower_compute_is_the_limit(capsys):
    # fwd+bwd 13.0 with 0.5 waited for the pull: 0.5 beside local's 12; push exposed 4.
    r = e2e.report(ARGS, "cpu", 19_000_000, LOCAL, remote(13.0, 4.0, 0.5), {}, "s")
    assert r["over_local_ms"]["beside"] == pytest.approx(0.5)
    assert r["limit"] == "push" and r["limit_ms"] == pytest.approx(4.0)
    r["data_plane"] = "workspace"
    e2e.print_report(r)
    out = capsys.readouterr().out
    assert "over local: +8.00 ms per step = forward+backward beside fusedps +0.50, waiting " \
           "for the pull +0.50, step() +7.00" in out
    assert "limit: push (4.00 ms exposed per step" in out


def test_the_slower_compute_is_named_with_what_the_loop_waited(capsys):
    r = e2e.report(ARGS, "cpu", 19_000_000, LOCAL, remote(19.0, 1.7, 0.6), {}, "s")
    r["data_plane"] = "workspace"
    e2e.print_report(r)
    out = capsys.readouterr().out
    # Waited: (22 - 19) + 0.6 = 3.6 ms.
    assert ("limit: compute beside fusedps: the forward and backward took 6.40 ms per step "
            "more than local's") in out
    assert "(the loop waited 3.60 ms for fusedps itself)" in out


def test_the_push_split_adds_up_over_uneven_steps():
    # Per step push 10, 10, 2 ms with 1, 8, 0 exposed (hidden 9, 2, 2): medians would print
    # 10 = 2 / 1; the means print 22/3 = 13/3 + 3.
    rows = remote(19.0, 0.0, 0.6)
    for row, (push, exposed) in zip(rows, [(10.0, 1.0), (10.0, 8.0), (2.0, 0.0)]):
        row.update(push_seconds=push / 1e3, push_exposed_seconds=exposed / 1e3,
                   push_hidden_seconds=(push - exposed) / 1e3)
    split = e2e.report(ARGS, "cpu", 19_000_000, LOCAL, rows, {}, "s")["split_ms"]
    assert split["push"] == pytest.approx(22 / 3)
    assert split["push_hidden"] + split["push_exposed"] == pytest.approx(split["push"])
    assert split["push_exposed"] == pytest.approx(3.0)
