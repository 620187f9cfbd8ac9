"""benchmarks/timeline.py's analysis on known kernel times (the profiling needs a GPU)."""

import pytest

from benchmarks import timeline


def labels(*names):
    return [{"kernel": n, "op": n.upper(), "where": "layer 0", "bytes": 1000} for n in names]


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


def test_a_kernel_missing_from_the_eager_step_raises():
    with pytest.raises(RuntimeError, match="not in the eager"):
        timeline.timeline(labels("a"), [[{"kernel": "b", "start": 0.0, "end": 1.0}]])


def test_short_names():
    assert timeline.short("kernel_cutlass_kernel_kimi_opskernelstailfrontsTailFront_object_at_0x1") == "tailfrontsTailFront"
