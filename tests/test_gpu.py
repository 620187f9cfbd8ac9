"""CUDA: the ops' CUDA path against the CPU reference, and the decoder captured in CUDA
graphs (by hand and through torch.compile's reduce-overhead mode). Skipped without CUDA."""

import pytest
import torch
from torch._dynamo.utils import counters

from kimi_ops import KimiConfig, KimiDecoder, KimiMailboxError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = KimiConfig.tiny(latent=256, expert_intermediate=16)  # the tail kernel takes L % 256 == 0, the experts I ≤ 16


def inputs(steps, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, CONFIG.hidden, generator=gen).bfloat16().cuda() for _ in range(steps)]


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_cuda_graph_replays_equal_eager(tp):
    eager = KimiDecoder(CONFIG, 6, tp=tp, seed=11, device="cuda")
    graphed = KimiDecoder(CONFIG, 6, tp=tp, seed=11, device="cuda")
    steps = inputs(100, 5)
    static_x = steps[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (first-call warnings, allocator) off-capture
        graphed(static_x)
    torch.cuda.current_stream().wait_stream(side)
    eager(static_x)  # the same step count on both, so their boxes stay in step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graphed(static_x)
    for x in steps:
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, eager(x))
    graphed.check()


def test_decoder_serving_tail_equals_the_split_tail():
    """TP1 serves the tail with moe_tail_serve (publish and poll in one op); the same decoder
    with publish and poll apart gives the same bits, at 1, 5 and 8 tokens and past 8."""
    serving = KimiDecoder(CONFIG, 6, tp=1, seed=16, device="cuda")
    split = KimiDecoder(CONFIG, 6, tp=1, seed=16, device="cuda")
    assert serving.serving
    split.serving = False
    for batch in (1, 5, 8, 13):
        for x in inputs(2, batch, seed=batch):
            assert torch.equal(serving(x), split(x))


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_embedding_folded_equals_its_attn_res(tp):
    """Up to embedding_folds_to (every batch at this config) layer 0's stacked GEMM takes
    the raw hidden (kimi::normed_oproj's kernel) and the step launches no embedding AttnRes;
    the same decoder with the AttnRes kernel and kimi::oproj gives the same bits (the AttnRes
    kernel's h_normed is rms_norm(hidden; out_norm_w), bit for bit)."""
    folded = KimiDecoder(CONFIG, 3, tp=tp, seed=18, device="cuda")
    plain = KimiDecoder(CONFIG, 3, tp=tp, seed=18, device="cuda")
    assert folded.embedding_folds_to == CONFIG.capacity
    plain.embedding_folds_to = 0
    for batch in (1, 8, 16, 64):
        for x in inputs(2, batch, seed=batch):
            assert torch.equal(folded(x), plain(x))


def test_decoder_fused_shared_expert_equals_the_two_ops():
    """TP1's shared expert in one launch, the front's publish inside it (the decoder's default
    there) gives the two ops' (and the front publish's) bits, eager at 1, 5 and 13 tokens and in 20 CUDA-graph replays (its barrier's counter
    moving on every replay: the kernel ran, not the reference); reset() restarts the counter."""
    fused = KimiDecoder(CONFIG, 3, tp=1, seed=17, device="cuda")
    two = KimiDecoder(CONFIG, 3, tp=1, seed=17, device="cuda")
    assert all(layer[0].front.fused_shared for layer in fused.layers)
    assert all(layer[0].front.fronts_shared() for layer in fused.layers)  # the front's publish in its launch
    for layer in two.layers:
        layer[0].front.fused_shared = False
    for batch in (1, 5, 13):
        for x in inputs(2, batch, seed=batch):
            assert torch.equal(fused(x), two(x)), batch
    ticket = fused.boxes.shared(0)[1]
    static_x = inputs(1, 5)[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused(static_x)
    before = int(ticket[0])
    for x in inputs(20, 5, seed=3):
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, two(x))
    assert int(ticket[0]) > before > 0
    fused.check()
    fused.reset()
    assert int(ticket[0]) == 0


@pytest.mark.parametrize("tp", [1, 2])  # TP1: the fused shared expert ahead of routing, the MoE input the model's
def test_decoder_reduce_overhead_graphs_without_skips(tp):
    torch._dynamo.reset()
    counters.clear()
    eager = KimiDecoder(CONFIG, 3, tp=tp, seed=12, device="cuda")
    compiled = torch.compile(KimiDecoder(CONFIG, 3, tp=tp, seed=12, device="cuda"), mode="reduce-overhead",
                             fullgraph=True)
    for x in inputs(20, 5, seed=1):
        assert torch.equal(compiled(x).clone(), eager(x))
    assert not counters["inductor"].get("cudagraph_skips", 0)


def test_reset_recovers_after_a_fault_on_cuda():
    """Rank 1 skips its tail publish: the polled tail kernels time out into the error word
    (no hang), in an eager step and in a graph replay; after reset() the next step, eager
    and graph-replayed (a graph captured before the fault), equals a fresh decoder's."""
    decoder = KimiDecoder(CONFIG, 3, tp=2, seed=15, device="cuda")
    fresh = KimiDecoder(CONFIG, 3, tp=2, seed=15, device="cuda")
    x, y, z = inputs(3, 5, seed=3)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decoder(static_x)  # warm-up off-capture
    torch.cuda.current_stream().wait_stream(side)
    healthy, faulty = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(healthy):
        static_out = decoder(static_x)
    part = decoder.layers[1][1]
    part.tail.publish = lambda *args: None  # rank 1 is dead for a step
    with torch.cuda.graph(faulty):
        decoder(static_x)
    with pytest.raises(KimiMailboxError, match="tail's latent sources"):
        decoder(x)
    del part.tail.publish
    decoder.reset()
    assert torch.equal(decoder(y), fresh(y))
    faulty.replay()
    with pytest.raises(KimiMailboxError, match=r"KimiDecoder\.reset\(\)"):
        decoder.check()
    decoder.reset()
    static_x.copy_(z)
    healthy.replay()
    decoder.check()
    assert torch.equal(static_out, fresh(z))
