"""benchmarks/timeline.py's analysis on known kernel times (the profiling needs a GPU)."""

import pytest

from benchmarks import timeline


def labels(*names):
    return [{"kernel": n, "op": n.upper(), "where": "layer 0", "part": "seed kernels", "bytes": 1000} for n in names]


def test_rows_from_the_median_replay():
    run = [{"kernel": "a", "start": 100.0, "end": 104.0}, {"kernel": "b", "start": 103.0, "end": 110.0},
           {"kernel": "c", "start": 112.0, "end": 113.0}]
    slow = [dict(k, end=k["end"] + 50) for k in run]
    result = timeline.timeline(labels("a", "x", "b", "c"), [slow, run, slow])  # x: eager only
    assert result["step_us"] == pytest.approx(63.0)  # the median replay is a slow one: 2 of 3
    result = timeline.timeline(labels("a", "x", "b", "c"), [run, run, slow])
    a, b, c = result["rows"]
    assert (a["start"], a["end"], a["beside"], a["gap"]) == (0.0, 4.0, 0.0, 0.0)
    assert (b["op"], b["start"], b["beside"], b["gap"]) == ("B", 3.0, 1.0, 0.0)
    assert (c["beside"], c["gap"]) == (0.0, 2.0)
    assert result["idle_us"] == 2.0 and result["step_us"] == 13.0
    assert [r["adds"] for r in (a, b, c)] == [4.0, 6.0, 3.0]  # the ends past the reach: they sum to the step
    assert a["gbs"] == pytest.approx(1000 / 4.0 / 1e3)


def test_the_steps_parts_sum_their_adds_against_their_floor():
    """part_of by op and weight names; parts() sums each part's adds and weight floor."""
    assert timeline.part_of("attn_res_take", []) == "AttnRes"
    assert timeline.part_of("oproj", ["oproj.w_core"]) == "stand-ins"
    assert timeline.part_of("routed_experts_counted", ["front.expert_gate_up", "front.expert_down"]) == "stand-ins"
    assert timeline.part_of("oproj", ["index.w_in"]) == timeline.part_of("moe_route_poll", []) == "seed kernels"
    run = [{"kernel": k, "start": s, "end": e} for k, s, e in (("a", 0.0, 4.0), ("b", 3.0, 10.0), ("c", 10.0, 12.0))]
    named = [dict(label, part=part, bytes=nbytes) for label, part, nbytes in
             zip(labels("a", "b", "c"), ("seed kernels", "stand-ins", "seed kernels"), (4.26e6, 0, 2.13e6))]
    result = timeline.timeline(named, [run])
    seeds, stand_ins = result["parts"]["seed kernels"], result["parts"]["stand-ins"]
    assert seeds["adds_us"] == 6.0 and seeds["floor_us"] == pytest.approx(1.5) and seeds["ratio"] == pytest.approx(4.0)
    assert stand_ins == {"adds_us": 6.0, "floor_us": 0.0, "ratio": None}
    assert sum(p["adds_us"] for p in result["parts"].values()) == result["step_us"]


def test_a_kernel_missing_from_the_eager_step_raises():
    with pytest.raises(RuntimeError, match="not in the eager"):
        timeline.timeline(labels("a"), [[{"kernel": "b", "start": 0.0, "end": 1.0}]])


def test_short_names():
    assert timeline.short("kernel_cutlass_kernel_kimi_opskernelstailfrontsTailFront_object_at_0x1") == "tailfrontsTailFront"
