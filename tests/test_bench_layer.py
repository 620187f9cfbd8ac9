"""benchmarks/bench_layer.py on the CPU: the smoke mode runs every path, and the plain-PyTorch
composite (kimi_ops.testing.composite) computes the decoder's layers on the decoder's weights.

Tolerance (composite vs KimiDecoder, reference backend, KimiConfig.tiny(), 2 layers): the
composite rounds where our ops round, but its BF16 GEMMs sum in FP32 in the library's order
where the reference rounds the exact sum once, so now and then an output lands one BF16
ulp (2^-8 relative) away. Such flips pass through the RMSNorms, the AttnRes softmax and the
next layer: a token that catches some moves its h by up to about 1 % in L2 (0.5-0.9 %
measured at B = 64 on the CPU, over 6 seeds; bit-equal at B ≤ 8, where the CPU GEMMs
round exactly), while most tokens stay bit-equal. A routing change (a near-tie of the
top-16 keys flipped by such noise) is rarer still: none in those draws. So: per-token
relative L2 error of h ≤ 2 % at worst and ≤ 0.2 % on average, and ≥ 95 % of the tokens
route to the same 16 experts in every layer. On a GPU (our kernels against the composite on
cuBLAS) such a flip can happen: it moves its token's h by far more than rounding does
(0.18-0.48 at kimi_k3's shapes), so there the bounds on h hold over the tokens routed alike,
and the mean over all tokens only where every token was.
"""

import json

import pytest
import torch

from benchmarks import bench_layer as bench
from benchmarks import plot_layer as plot
import kimi_ops.runtime.prepared as prepared
from kimi_ops.testing.composite import CompositeDecoder
from kimi_ops import KimiConfig, KimiDecoder

MAX_REL_L2, MEAN_REL_L2, SAME_EXPERTS = 2e-2, 2e-3, 0.95


def ab_args(argv):
    parser = bench.argparse.ArgumentParser()
    bench.add_ab_options(parser)
    return parser.parse_args(argv)


def test_ab_options_reach_the_child_and_the_kernels(monkeypatch):
    """without_pdl's child gets the same A/B arm (the compiled-in settings through its
    environment); the arm sets the registered kernels' settings on every run (a later
    default run resets them); the title and the JSON name the compiled-in settings."""
    for argv in ([], ["--wave-from-groups", "1"], ["--wave-front-groups", "2"], ["--shared-last"],
                 ["--wave-from-groups", "1", "--wave-front-groups", "2", "--shared-last"]):
        assert bench.ab_arguments(ab_args(argv)) == argv
    monkeypatch.setattr(bench, "CARVEOUT", 100)
    monkeypatch.setattr(bench, "GEMM_ROOM", 112 * 1024)
    args = ab_args(["--wave-from-groups", "3", "--wave-front-groups", "2"])
    assert bench.ab_label(args) == " carveout 100 room 112 KB wave from 3 wave front to 2"
    assert bench.ab_settings(args) == {"smem_carveout": 100, "gemm_room_kb": 112, "wave_from_groups": 3,
                                       "wave_front_groups": 2}
    pytest.importorskip("cutlass", reason="needs CuTe DSL")
    from kimi_ops.kernels.tail import host as tail
    from kimi_ops.kernels.tail.wave import MIN_POLL_WAVE_GROUPS

    poll = tail.TailPollKernel()  # as kernels.register() does on a GPU machine
    monkeypatch.setitem(bench.backend.KERNELS, "moe_tail_poll", poll)
    monkeypatch.setattr(tail.TailPollKernel, "min_wave_groups", MIN_POLL_WAVE_GROUPS)
    monkeypatch.setattr(tail.TailPollKernel, "front_groups", 0)
    bench.apply_ab_options(args)
    assert poll.min_wave_groups == 3 and tail.TailServeKernel.poll.min_wave_groups == 3
    assert poll.front_groups == 2 and tail.TailServeKernel.poll.front_groups == 2
    bench.apply_ab_options(ab_args([]))
    assert poll.min_wave_groups == MIN_POLL_WAVE_GROUPS and poll.front_groups == 0


def test_smoke_runs_every_path(tmp_path):
    path = tmp_path / "layer.json"
    out = bench.main(["--smoke", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert [row["B"] for row in out["rows"]] == list(bench.BATCHES)
    for row in out["rows"]:  # each assertion names the row: a GPU run's failure says which bound
        assert row["floor_us"] > 0 and row["ours_us"] is None, row  # smoke: no timing claims
        assert SAME_EXPERTS <= row["same_routes"] <= 1 and row["rel_l2_max_same_routes"] <= MAX_REL_L2, row
        assert row["rel_l2_max_same_routes"] <= row["rel_l2_max"], row
        if row["same_routes"] == 1:
            assert row["rel_l2_max"] <= MAX_REL_L2 and row["rel_l2_mean"] <= MEAN_REL_L2, row
    for ops in out["breakdown"].values():
        names = [op["op"] for op in ops]
        assert len(names) == len(set(names)) == 15
        assert all(op["floor_us"] >= 0 and op["us"] is None for op in ops)
        assert sum(op["weight_bytes"] > 0 for op in ops) >= 10  # every op that reads a weight counts it
    for row in out["rows"]:  # the layer's ops read the layer's weights (layers differ in their experts)
        layer = sum(op["floor_us"] for op in out["breakdown"][str(row["B"])] if op["in_layer"])
        assert 0.5 * row["floor_us"] <= layer <= 1.5 * row["floor_us"]
    code = plot.main([str(path), "--out", str(tmp_path / "layer.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 1  # a clear message instead of a plot
    else:
        assert code == 0 and (tmp_path / "layer.png").stat().st_size > 0


@pytest.mark.parametrize("batch", [8, 64])
def test_composite_matches_decoder(batch, monkeypatch):
    routed = []  # the decoder's ids per layer, as its routed experts receive them
    experts = prepared.PreparedFront.experts

    def spy(self, latent, ids):
        routed.append(ids)
        return experts(self, latent, ids)

    monkeypatch.setattr(prepared.PreparedFront, "experts", spy)
    config = KimiConfig.tiny()
    decoder = KimiDecoder(config, bench.LAYERS, tp=1, seed=3)
    layers = CompositeDecoder(decoder)
    hidden = torch.randn(batch, config.hidden, generator=torch.Generator().manual_seed(batch)).bfloat16()
    slots = torch.randperm(config.index_slots, generator=torch.Generator().manual_seed(1))[:batch]
    trace = {}
    want = decoder(hidden, slots)
    got, indexer = layers(hidden, slots, trace)
    err = bench.rel_l2(got, want)
    assert float(err.max()) <= MAX_REL_L2 and float(err.mean()) <= MEAN_REL_L2, err
    assert len(routed) == len(trace["ids"]) == bench.LAYERS
    for ours, theirs in zip(routed, trace["ids"]):
        same = (ours.long().sort(-1).values == theirs.sort(-1).values).all(-1)
        assert float(same.double().mean()) >= SAME_EXPERTS
    # The index keys went to the same slots (bytes may differ where a key's BF16 flipped).
    for part, layer in zip(decoder.layers, layers.layers):
        written = layer.index_cache.any(-1)
        assert torch.equal(written, part[0].index.index_cache.any(-1)) and int(written.sum()) == batch
    assert len(indexer) == bench.LAYERS and indexer[0][0].dtype == torch.float8_e4m3fn


def test_same_routes_needs_every_layer_to_agree():
    ours = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6], [7, 8]])]
    theirs = [torch.tensor([[2, 1], [3, 4]]), torch.tensor([[5, 6], [7, 9]])]  # order within a set is free
    assert bench.same_routes(ours, theirs).tolist() == [True, False]
    with pytest.raises(ValueError):
        bench.same_routes(ours, theirs[:1])


def test_tp8_rank_config_runs_the_shard_shapes():
    config = bench.tp8_rank(KimiConfig.kimi_k3())
    assert (config.attn_out, config.shared_intermediate) == (1536, 768)
    assert (config.experts, config.hidden) == (112, 7168)
    assert config.latent % 256 == 0  # the tail kernel's K (kernels.tail.host.plan_for), not the reference
