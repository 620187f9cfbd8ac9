"""CuTe routing and situ kernels (the tail: test_tail_kernels.py): every variant compiles
for sm_90a without a GPU, with no spills and no ptxas performance note; on a Hopper GPU
each matches the reference backend on the same device."""

import pytest
import torch

cute_dsl = pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops.kernels.route import host as route  # noqa: E402
from kimi_ops.mailbox import KimiMailboxError, raise_if_error  # noqa: E402

from conftest import KERNEL_BATCHES, armed_box, bf16_ulps, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory


@pytest.mark.parametrize("experts", [16, 64, 896, 1024])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("lean", [True, False])
def test_route_compiles(experts, renorm, lean, clean_ptxas):
    assert route.compile_route.build(experts, renorm, lean) is not None
    clean_ptxas()


@pytest.mark.parametrize("experts, latent", [(64, 128), (896, 3584), (1024, 3584)])
@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("counted", [False, True])
def test_route_poll_compiles(experts, latent, lean, counted, clean_ptxas):
    assert route.compile_route_poll.build(experts, latent, True, lean, counted) is not None
    clean_ptxas()


@pytest.mark.parametrize("width", [768, 6144])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_situ_compiles(width, dtype, clean_ptxas):
    assert route.compile_situ.build(width, dtype) is not None
    clean_ptxas()


def assert_route_matches(logits, bias, renorm):
    ids, weights = torch.ops.kimi.moe_route(logits, bias, 2.827, renorm)
    want_ids, want_weights = reference(torch.ops.kimi.moe_route, logits, bias, 2.827, renorm)
    assert torch.equal(ids, want_ids)
    assert int(bf16_ulps(weights.cpu(), want_weights.cpu()).max()) <= 1


@on_hopper
@pytest.mark.parametrize("experts", [64, 896, 1024])
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_route_kernel(experts, batch):
    gen = torch.Generator().manual_seed(batch * experts)
    logits = (torch.randn(batch, experts, generator=gen) * 3).cuda()
    bias = (torch.randn(experts, generator=gen) * 0.1).cuda()
    for renorm in (True, False):
        assert_route_matches(logits, bias, renorm)


@on_hopper
def test_route_kernel_ties_nan_and_many_candidates():
    experts = 896
    logits = torch.randn(6, experts, generator=torch.Generator().manual_seed(0))
    logits[0] = 0.5  # every key tied: 896 candidates, the 16 lowest ids win
    logits[1, ::3] = float("nan")
    logits[2] = float("nan")
    logits[3, 100:140] = 4.0  # 40 tied leaders
    logits[4] = float("-inf")
    logits[5, 7] = float("inf")
    assert_route_matches(logits.cuda(), torch.zeros(experts, device="cuda"), True)


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_kernel(batch, dtype):
    gate_up = (torch.randn(batch, 2 * 6144, generator=torch.Generator().manual_seed(batch)) * 3).to(dtype).cuda()
    got = torch.ops.kimi.situ(gate_up, 1.0, 0.0)
    want = reference(torch.ops.kimi.situ, gate_up, 1.0, 0.0)
    ulps = bf16_ulps(got.cpu(), want.cpu())
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.01


@on_hopper
def test_route_and_situ_in_compile_and_cuda_graph():
    logits = torch.randn(8, 896, device="cuda")
    bias = torch.randn(896, device="cuda") * 0.1
    gate_up = torch.randn(8, 2 * 6144, device="cuda")

    def step(logits, bias, gate_up):
        ids, weights = torch.ops.kimi.moe_route(logits, bias, 2.827, True)
        return ids, weights, torch.ops.kimi.situ(gate_up, 1.0, 0.0)

    want = step(logits, bias, gate_up)
    compiled = torch.compile(step, fullgraph=True)
    for got, expected in zip(compiled(logits, bias, gate_up), want):
        assert torch.equal(got, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(logits, bias, gate_up)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    for got, expected in zip(outs, step(logits, bias, gate_up)):
        assert torch.equal(got, expected)


def published_front_box(batch, experts, latent, parity, capacity=64, seed=0):
    """A TP2 front box whose row ``parity`` holds both ranks' published shards."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 512, generator=gen).bfloat16().cuda()
    boxes = [armed_box(3, 1, capacity, latent + 2 * experts) for _ in range(2)]
    for rank in range(2):
        w = (torch.randn(experts // 2 + latent // 2, 512, generator=gen) * 0.05).bfloat16().cuda()
        torch.ops.kimi.moe_front_publish(x, w, experts // 2, boxes, parity, rank)
    return boxes[0]


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
@pytest.mark.parametrize("counted", [False, True])
def test_route_poll_kernel(batch, counted):
    """``counted`` (a ready counter): the same values, and its 2B CTAs counted on top of
    what the counter held (only where the kernel waits for its predecessor differs)."""
    experts, latent, parity = 896, 3584, 1
    box = published_front_box(batch, experts, latent, parity, seed=batch)
    bias = (torch.randn(experts, generator=torch.Generator().manual_seed(1)) * 0.1).cuda()
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    ready = torch.tensor([3, 0], device="cuda") if counted else None
    want_box, want_error = box.clone(), error.clone()
    want = reference(torch.ops.kimi.moe_route_poll, want_box, bias, 2.827, True, parity, batch, want_error)
    got = torch.ops.kimi.moe_route_poll(box, bias, 2.827, True, parity, batch, error, ready)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert int(bf16_ulps(got[1].cpu(), want[1].cpu()).max()) <= 1
    assert torch.equal(box.view(torch.int32), want_box.view(torch.int32))  # re-armed alike
    assert int(error) == 0
    if counted:
        assert ready.tolist() == [3 + 2 * batch, 0]


@on_hopper
def test_route_poll_kernel_times_out_into_the_error_word():
    box = armed_box(3, 1, 64, 3584 + 2 * 896)  # nothing ever published
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.ops.kimi.moe_route_poll(box, torch.zeros(896, device="cuda"), 1.0, True, 0, 4, error)
    torch.cuda.synchronize()  # returns: the poll is bounded
    assert int(error) == 1
    with pytest.raises(KimiMailboxError, match="front row"):
        raise_if_error(error)


def test_stream_benchmark_kernels_compile():
    """benchmarks/bench_stream.py's copy kernels (the HBM-rate probe the tail is judged by)."""
    from benchmarks import bench_stream

    for kernel in (bench_stream.BulkStream(132, 1, 16384, 12), bench_stream.AsyncStream(112, 8),
                   bench_stream.BulkStream(132, 1, 8192, 24, size=4718592, chained=True)):
        assert bench_stream.compile_stream(kernel) is not None


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_group_barrier_compiles(tp, clean_ptxas):
    from kimi_ops.kernels.group import host as group

    group.compile_barrier.build(tp)
    clean_ptxas()
