"""How fast one GPU streams the tail's up-projection weights (51.4 MB, L2-cold) into
shared memory, by copy mechanism: the bound under any tail kernel's time (DESIGN §7).

- bulk: TMA 1D copies (cp.async.bulk + mbarrier complete_tx), ``issuers`` lanes of one
  warp per CTA, each with its own ring of ``stages`` slots of ``chunk`` bytes;
- cp.async: 16 bytes per lane, 8 warps per CTA, each warp 512 contiguous bytes per copy
  and a ring of ``stages`` commit groups (the tail's mechanism).

    python -m benchmarks.bench_stream
"""

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int64
from cutlass.memory import SmemAllocator

from kimi_ops.kernels.compile import fake, fake_stream

from .common import graph_us, print_table

BYTES, COPIES = 7168 * 3584 * 2, 5  # w_up at TP1; 5 copies exceed L2


class BulkStream:
    def __init__(self, ctas: int, issuers: int, chunk: int, stages: int):
        self.ctas, self.issuers, self.chunk, self.stages = ctas, issuers, chunk, stages
        self.chunks = BYTES // chunk

    @cute.jit
    def __call__(self, source: cute.Tensor, stream):
        self.kernel(source).launch(grid=[self.ctas, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, source: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        bars = smem.allocate_tensor(Int64, cute.make_layout(self.issuers * self.stages), 8).iterator
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.issuers * self.stages * self.chunk), 128).iterator
        if lane < self.issuers:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(bars + lane * self.stages + s, 1)
        cute.arch.mbarrier_init_fence()
        streamer = cta * self.issuers + lane
        count = (self.chunks - streamer + self.ctas * self.issuers - 1) // (self.ctas * self.issuers)
        if lane < self.issuers:
            for s in cutlass.range_constexpr(self.stages):
                if s < count:
                    self.issue(source, ring, bars, lane, s, streamer + s * self.ctas * self.issuers)
            for i in cutlass.range(count, unroll=1):
                slot = i % self.stages
                cute.arch.mbarrier_wait(bars + lane * self.stages + slot, (i // self.stages) % 2)
                if i + self.stages < count:
                    self.issue(source, ring, bars, lane, slot, streamer + (i + self.stages) * self.ctas * self.issuers)

    @cute.jit
    def issue(self, source, ring, bars, lane, slot, chunk_index):
        bar = bars + lane * self.stages + slot
        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.chunk)
        target = ring + (lane * self.stages + slot) * self.chunk
        cute.arch.inline_ptx(
            f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{{$r0}}], [{{$r1}}], {self.chunk}, [{{$r2}}];",
            read_only_args=[target, source.iterator + Int64(chunk_index) * self.chunk, bar],
        )


class AsyncStream:
    WARPS = 8

    def __init__(self, ctas: int, stages: int):
        self.ctas, self.stages = ctas, stages
        self.pieces = BYTES // 512  # one warp copy

    @cute.jit
    def __call__(self, source: cute.Tensor, stream):
        self.kernel(source).launch(grid=[self.ctas, 1, 1], block=[32 * self.WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, source: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        smem = SmemAllocator()
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.WARPS * self.stages * 512), 128).iterator
        streamer, streamers = cta * self.WARPS + warp, self.ctas * self.WARPS
        count = (self.pieces - streamer + streamers - 1) // streamers
        for i in cutlass.range(count + self.stages, unroll=1):
            if i >= self.stages:
                cute.arch.cp_async_wait_group(self.stages - 1)
            if i < count:
                target = ring + ((warp * self.stages + i % self.stages) * 32 + lane) * 16
                address = source.iterator + (Int64(streamer + i * streamers) * 32 + lane) * 16
                cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[target, address])
            cute.arch.cp_async_commit_group()


def compile_stream(kernel):
    return cute.compile(kernel, fake(cutlass.Uint8, (BYTES,), align=128), fake_stream(), options="--enable-tvm-ffi")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    buffers = [torch.empty(BYTES, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(COPIES)]
    rows = []

    def measure(name, kernel):
        function = compile_stream(kernel)
        turn = [0]

        def call():
            function(buffers[turn[0] % COPIES])
            turn[0] += 1

        us = graph_us(call, calls=COPIES * 4)
        rows.append((name, us, BYTES / us / 1e6))

    for ctas, issuers, chunk, stages in (
        (132, 1, 16384, 12), (132, 1, 8192, 24), (132, 4, 4096, 12), (264, 1, 16384, 6),
        (132, 32, 512, 12), (132, 32, 128, 32),
    ):
        measure(f"bulk {ctas}x{issuers} {chunk}Bx{stages}", BulkStream(ctas, issuers, chunk, stages))
    for ctas in (112, 132):
        for stages in (8, 24):
            measure(f"cp.async {ctas} 512Bx{stages}", AsyncStream(ctas, stages))
    print(f"{torch.cuda.get_device_name()}: streaming {BYTES / 1e6:.1f} MB, L2-cold, CUDA-graph replay")
    print_table(rows, ("mechanism", "µs", "TB/s"))


if __name__ == "__main__":
    main()
