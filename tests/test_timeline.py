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


def test_the_marks_table_takes_each_launchs_median_phases():
    """Two replays of a step with two marked launches (records in the words after the
    error word, kernels.values.Marks' layout): per launch the median of each phase after
    its start, labelled by the timeline's rows of its op, and the drain to the grid's end."""
    pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    import torch

    from kimi_ops.kernels.attn_res.kernels import TAKE_MARKS
    from kimi_ops.kernels.launch import MARK_COUNT, MARK_FIRST, MARK_RECORD, MARK_WORDS
    from kimi_ops.kernels.values import MARKED

    phases = MARKED[TAKE_MARKS][1]
    words = torch.zeros(MARK_WORDS, dtype=torch.int32)
    records = words[MARK_FIRST:].view(torch.int64).view(-1, MARK_RECORD // 2)
    for replay, scale in enumerate((1000, 3000)):  # ns a phase: launch 1, then twice that for launch 2
        for launch in range(2):
            start = 10**9 + replay * 10**6 + launch * 10**5
            record = records[2 * replay + launch]
            record[0] = TAKE_MARKS
            record[1:2 + len(phases)] = torch.tensor([start + k * scale * (launch + 1) for k in range(len(phases) + 1)])
    words[MARK_COUNT] = 5  # a record past the replays' (a fifth launch) is left out
    rows = [{"op": "attn_res", "where": "embed", "busy": 3.0},
            {"op": "attn_res_take_into", "where": "layer 0", "busy": 20.0},
            {"op": "oproj", "where": "layer 1", "busy": 9.0},
            {"op": "attn_res_take", "where": "layer 0", "busy": 30.0}]
    first, second = timeline.marks_table(words, rows, replays=2)
    assert (first["op"], second["op"]) == ("attn_res_take_into", "attn_res_take")
    assert list(first["phases"]) == list(phases)
    assert list(first["phases"].values()) == pytest.approx([2.0 * k for k in range(1, len(phases) + 1)])
    assert list(second["phases"].values()) == pytest.approx([4.0 * k for k in range(1, len(phases) + 1)])
    assert first["to_grid_end"] == pytest.approx(20.0 - 2.0 * len(phases))
    words[MARK_COUNT] = 4097
    with pytest.raises(RuntimeError, match="overran"):
        timeline.marks_table(words, rows, replays=2)



def test_the_stamps_table_takes_every_ctas_phases():
    """The fused shared expert's Stamps (kernels.values: per CTA, per phase an int64 pair
    (%globaltimer, %clock64) from STAMP_FIRST on): per phase the CTAs that stamped it and
    the min / median / max µs after the first CTA's start; a phase no CTA stamped is left out,
    and so is a CTA that never started (zeros)."""
    import torch

    from kimi_ops.kernels.launch import MARK_WORDS, STAMP_CTAS, STAMP_FIRST

    phases = ("start", "x in", "never", "stored")
    words = torch.zeros(MARK_WORDS, dtype=torch.int32)
    stamps = words[STAMP_FIRST:STAMP_FIRST + STAMP_CTAS * len(phases) * 4]
    pairs = stamps.view(torch.int64).view(STAMP_CTAS, len(phases), 2)
    base = 5 * 10**9
    for cta, (start, x_in, stored) in enumerate(((2000, 3000, 9000), (0, 5000, 8000), (1000, None, 7000))):
        pairs[cta, 0, 0], pairs[cta, 3, 0] = base + start, base + stored
        if x_in is not None:
            pairs[cta, 1, 0] = base + x_in
        pairs[cta, :, 1] = 12345  # the clock, unread
    table = {row["phase"]: row for row in timeline.stamps_table(words, phases)}
    assert list(table) == ["start", "x in", "stored"]
    assert (table["start"]["ctas"], table["start"]["min"], table["start"]["median"], table["start"]["max"]) == \
        (3, 0.0, 1.0, 2.0)
    assert (table["x in"]["ctas"], table["x in"]["min"], table["x in"]["max"]) == (2, 3.0, 5.0)
    assert table["stored"]["median"] == pytest.approx(8.0)
    assert timeline.stamps_table(torch.zeros(MARK_WORDS, dtype=torch.int32), phases) == []
