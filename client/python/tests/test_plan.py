"""Tests of fusedps.plan against docs/sharding.md: balance, coverage, a plan worked out by hand
with its exact hash text, determinism, errors. No server needed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random

import pytest
import torch

from fusedps.plan import PlanSlice, make_plan

import gpt_shapes

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
C = 1 << 20


def check_covers_every_element_once(tensors, plan):
    """Each tensor's slices are [0, C), [C, 2C), ... up to its element count (one slice [0, n)
    when n <= C), on shards in range, and the loads add up."""
    by_tensor = {}
    for s in plan.slices:
        by_tensor.setdefault(s.tensor, []).append(s)
        assert 0 <= s.shard < plan.shards
        assert 0 <= s.begin <= s.end and s.end - s.begin <= plan.slice_elements
    assert set(by_tensor) == {name for name, _ in tensors}
    for name, shape in tensors:
        n = math.prod(shape)
        slices = by_tensor[name]
        assert slices[0].begin == 0 and slices[-1].end == n, name
        for a, b in zip(slices, slices[1:]):
            assert a.end == b.begin, f"{name}: a gap or an overlap"
        assert len(slices) == (1 if n <= plan.slice_elements else -(-n // plan.slice_elements))
    loads = [0] * plan.shards
    for s in plan.slices:
        loads[s.shard] += s.end - s.begin
    assert tuple(loads) == plan.loads
    assert sum(loads) == sum(math.prod(shape) for _, shape in tensors)


@pytest.mark.parametrize("model", ["gpt2_small", "gpt_1_3b"])
@pytest.mark.parametrize("shards", range(2, 9))
def test_balance_bound_and_coverage_on_gpt(model, shards):
    tensors = getattr(gpt_shapes, model)()
    plan = make_plan(tensors, shards)
    assert plan.slice_elements == C and plan.shards == shards
    mean = sum(plan.loads) / shards
    assert max(plan.loads) / mean <= 1 + C / mean
    check_covers_every_element_once(tensors, plan)


def test_gpt_sizes():
    small = sum(math.prod(s) for _, s in gpt_shapes.gpt2_small())
    large = sum(math.prod(s) for _, s in gpt_shapes.gpt_1_3b())
    assert small == 124_439_808
    assert 1.25e9 < large < 1.35e9  # 1,315,723,264 with the untied wpe of context 2048.


def test_data_file_is_gpt2_small():
    with open(os.path.join(REPO_ROOT, "tests", "data", "gpt2_small_tensors.json"),
              encoding="utf-8") as f:
        listed = [(t["name"], tuple(t["shape"])) for t in json.load(f)]
    assert listed == gpt_shapes.gpt2_small()


def test_hand_computed_plan_and_hash_text():
    # S = 2, C = 4. Step 1 sorts by UTF-8 bytes: "Z" (0x5A) < "a" < "b" < "é" (0xC3 0xA9).
    # Step 2: Z [0,0) (no elements); a [0,3); b (10 elements) [0,4) [4,8) [8,10); é [0,1).
    # Step 3, largest first, ties in step-2 order: b[0:4] b[4:8] a b[8:10] é Z.
    # Step 4 (loads before -> shard):
    #   b[0:4]  (0, 0) -> 0     b[4:8] (4, 0) -> 1     a       (4, 4) -> 0
    #   b[8:10] (7, 4) -> 1     é      (7, 6) -> 1     Z       (7, 7) -> 0;  loads (7, 7).
    tensors = [("b", (2, 5)), ("é", ()), ("a", (3,), "no_decay"), ("Z", (0, 2))]
    plan = make_plan(tensors, shards=2, slice_elements=4)
    assert list(plan.slices) == [
        PlanSlice("Z", "Z", (0, 2), "default", 0, 0, 0),
        PlanSlice("a", "a", (3,), "no_decay", 0, 3, 0),
        PlanSlice("b", "b[0:4]", (4,), "default", 0, 4, 0),
        PlanSlice("b", "b[4:8]", (4,), "default", 4, 8, 1),
        PlanSlice("b", "b[8:10]", (2,), "default", 8, 10, 1),
        PlanSlice("é", "é", (), "default", 0, 1, 1),
    ]
    assert plan.loads == (7, 7)
    assert [s.server_tensor for s in plan.shard_slices(0)] == ["Z", "a", "b[0:4]"]
    assert [s.server_tensor for s in plan.shard_slices(1)] == ["b[4:8]", "b[8:10]", "é"]
    text = ("fusedps-plan-v1 shards=2 slice_elements=4\n"
            "1:Z [0,2] 7:default 0 0 0\n"
            "1:a [3] 8:no_decay 0 3 0\n"
            "1:b [2,5] 7:default 0 4 0\n"
            "1:b [2,5] 7:default 4 8 1\n"
            "1:b [2,5] 7:default 8 10 1\n"
            "2:é [] 7:default 0 1 1\n")
    assert plan.hash_text() == text
    assert plan.hash == hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
    assert plan.to_dict() == {
        "hash": plan.hash, "shards": 2, "slice_elements": 4,
        "slices": [["Z", 0, 0, 0], ["a", 0, 3, 0], ["b", 0, 4, 0], ["b", 4, 8, 1],
                   ["b", 8, 10, 1], ["é", 0, 1, 1]]}
    assert plan.to_json() == (
        '{"hash": "%s", "shards": 2, "slice_elements": 4, "slices": [["Z", 0, 0, 0], '
        '["a", 0, 3, 0], ["b", 0, 4, 0], ["b", 4, 8, 1], ["b", 8, 10, 1], ["é", 0, 1, 1]]}'
        % plan.hash)
    assert make_plan([("a", (3,), "")], 1).tensors[0].param_group == "default"


def test_docs_example_line():
    # docs/sharding.md: `6:wpe.wb [1024,768] 7:default 0 786432 1`.
    plan = make_plan([("wpe.wb", (1024, 768)), ("big", (2_000_000,))], 2)
    assert "\n6:wpe.wb [1024,768] 7:default 0 786432 1\n" in plan.hash_text()


def test_the_hash_changes_with_every_input():
    base = make_plan(gpt_shapes.gpt2_small(), 4)
    others = [
        make_plan(gpt_shapes.gpt2_small(), 5),
        make_plan(gpt_shapes.gpt2_small(), 4, C // 2),
        make_plan(gpt_shapes.gpt2_small(), 4, param_group="other"),
        make_plan(gpt_shapes.gpt2_small()[:-1], 4),
        # wpe as [768, 1024]: the same slices, another shape.
        make_plan([(n, (768, 1024) if n == "transformer.wpe.weight" else s)
                   for n, s in gpt_shapes.gpt2_small()], 4),
    ]
    assert [s[1:] for s in others[-1].to_dict()["slices"]] == [
        s[1:] for s in base.to_dict()["slices"]]
    assert len({base.hash} | {p.hash for p in others}) == 1 + len(others)
    assert len(base.hash) == 32 and int(base.hash, 16) >= 0 and base.hash == base.hash.lower()


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_the_same_plan_in_any_input_order(shards):
    tensors = gpt_shapes.gpt2_small() + [("ÿ", (5,)), ("Ā", (3, 3)), ("~", ())]
    plan = make_plan(tensors, shards, 100_000)
    rng = random.Random(shards)
    for _ in range(3):
        shuffled = tensors[:]
        rng.shuffle(shuffled)
        assert make_plan(shuffled, shards, 100_000) == plan
    check_covers_every_element_once(tensors, plan)


def test_a_module_a_mapping_and_shapes_give_one_plan():
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = make_plan(shapes, 2, 100)
    assert make_plan(model, 2, 100) == plan
    assert make_plan(list(model.named_parameters()), 2, 100) == plan
    assert make_plan(dict(model.named_parameters()), 2, 100) == plan
    assert [s.server_tensor for s in plan.tensor_slices("0.weight")] == [
        "0.weight[0:100]", "0.weight[100:200]", "0.weight[200:300]", "0.weight[300:400]",
        "0.weight[400:500]", "0.weight[500:600]"]
    assert plan.tensor_slices("0.bias")[0].shape_on_server == (20,)


def test_one_shard_holds_everything_whole_or_cut():
    plan = make_plan([("w", (3, 4)), ("v", (5,))], 1, 4)
    assert all(s.shard == 0 for s in plan.slices) and plan.loads == (17,)
    assert [s.server_tensor for s in plan.slices] == ["v[0:4]", "v[4:5]", "w[0:4]", "w[4:8]",
                                                       "w[8:12]"]


def test_more_shards_than_slices_leaves_some_empty():
    plan = make_plan([("a", (2,)), ("b", (3,))], 4)
    assert plan.loads == (3, 2, 0, 0)
    assert plan.shard_slices(3) == []
    with pytest.raises(IndexError):
        plan.shard_slices(4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensors=[("a", (1,))], shards=0), "shards must be >= 1"),
    (dict(tensors=[("a", (1,))], shards=2, slice_elements=0), "slice_elements must be >= 1"),
    (dict(tensors=[("a", (1,)), ("a", (2,))], shards=2), "appears twice"),
    (dict(tensors=[("a", (3, -1))], shards=2), "negative dim"),
    (dict(tensors=[("\ud800", (1,))], shards=2), "no UTF-8 encoding"),
    (dict(tensors=[("", (1,))], shards=2), "empty name"),
    (dict(tensors=[("a", (1 << 62, 2))], shards=2), "2\\*\\*63 - 1"),
])
def test_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_plan(**kwargs)


@pytest.mark.parametrize("tensors", [
    [(1, (2,))], [("a", (2.5,))], [("a", (1,), 7)], [("a",)], "ab", [("a", 3)]])
def test_type_errors(tensors):
    with pytest.raises(TypeError):
        make_plan(tensors, 2)
