"""The decoder guard (issue 35) at the tiny config on the reference backend: a rounding-level
drift sits inside the reference's own spread, and each injected composition bug leaves
it by a wide margin; the op recorder replays each call's reference bit for bit and points
at the op an injected bug changed."""

import pytest
import torch

from conftest import bf16_ulps
from decoder_bugs import DropSlot, bugs
from kimi_ops import KimiConfig, KimiDecoder
from kimi_ops.debug import OpRecorder, replay, summary
from kimi_ops.testing import guard

CONFIG = KimiConfig.tiny()
SETUPS = [(1, 3), (8, 2)]  # (TP, layers): TP8 simulated; layer counts ≡ 1 mod 3 collide
MARGIN = 5  # an injected bug's drift: at least this many times the guard's bound


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"tp{s[0]}-{s[1]}layers")
def decoder(request):
    tp, layers = request.param
    return KimiDecoder(CONFIG, layers, tp=tp, seed=3)


def test_nudged_moves_each_row_by_one_ulp_at_the_share():
    x = torch.randn(5, 7168, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[0, :100] = 0
    y = guard.nudged(x, 1e-3, torch.Generator().manual_seed(1))
    ulps = bf16_ulps(y, x)
    assert int(ulps.max()) == 1
    assert ((ulps > 0).sum(1) == 7).all()  # round(7168 · 1e-3) a row
    small = guard.nudged(x[:, :64], 1e-3, torch.Generator().manual_seed(1))
    assert ((bf16_ulps(small, x[:, :64]) > 0).sum(1) == 1).all()  # at least one a row


def rounding_level_drift_passes(decoder, batch):
    x = guard.random_steps(decoder, batch)
    want = guard.reference(decoder, x)
    spread = guard.sensitivity(decoder, x, want)
    verdict = guard.judge(guard.sensitivity(decoder, x, want, draws=1, seed=99), spread)
    assert verdict.passed, verdict
    assert guard.guard(decoder, x).margin == 0  # the reference against itself


@pytest.mark.parametrize("batch", [1, 8])
def test_rounding_level_drift_passes(decoder, batch):
    """A candidate whose drift is rounding (another nudge draw of the reference) sits inside."""
    rounding_level_drift_passes(decoder, batch)


def test_rounding_level_drift_passes_at_capacity():
    """TP1 at 64 tokens (TP8 there, the two-shot path, runs in the GPU test: 17 s here)."""
    rounding_level_drift_passes(KimiDecoder(CONFIG, 3, tp=1, seed=3), 64)


@pytest.mark.parametrize("bug", ["stale parity", "drop slot 15", "drop slot 0", "skip a rank's shared partial"])
@pytest.mark.parametrize("batch", [1, 8])
def test_injected_bugs_leave_the_spread(decoder, bug, batch):
    x = guard.random_steps(decoder, batch)
    verdict = guard.guard(decoder, x, bugs(decoder)[bug])
    assert verdict.margin > MARGIN, verdict
    assert torch.equal(guard.reference(decoder, x)[0], guard.reference(decoder, x)[0])  # reset() restored the boxes


def test_recorder_replays_every_op_bit_for_bit(decoder):
    with torch.no_grad(), OpRecorder(decoder) as recorder:
        decoder(guard.random_steps(decoder, 8)[0])
    ops = {call.op for call in recorder.calls}
    assert {"oproj", "dsa_index_front_keys", "oproj_publish", "attn_res_take_into", "attn_res_take", "moe_front_publish",
            "moe_route_poll", "gate_up_situ", "oproj_push", "routed_experts", "attn_res"} <= ops
    layers = {call.where.split(" rank")[0] for call in recorder.calls}
    assert layers == {"embed"} | {f"layer {i}" for i in range(len(decoder.layers))}
    rows = replay(recorder.calls)
    assert all(row.not_equal == 0 and row.max_ulps in (None, 0.0) for row in rows), rows


def test_recorder_points_at_the_op_a_bug_changed(decoder):
    """Recorded inside a bug's mode, each call keeps the arguments the decoder passed: the
    replay finds the tail's output changed (and every op before it bit-equal)."""
    with torch.no_grad(), DropSlot(0), OpRecorder(decoder) as recorder:
        decoder(guard.random_steps(decoder, 8)[0])
    decoder.reset()
    lines = summary(replay(recorder.calls))
    first = next(i for i, (_, _, _, not_equal) in enumerate(lines) if not_equal > 0)
    assert lines[first][0].startswith(("moe_tail_serve", "moe_tail_publish")), lines[first]
    assert lines[first][1] == "layer 0"
