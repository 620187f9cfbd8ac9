"""How fast one GPU streams the tail's up-projection weights (51.4 MB, L2-cold) into
shared memory, by copy mechanism: the bound under any tail kernel's time (DESIGN §7).
``--mbytes``: other sizes instead (the small projections' weights: what a call that only
streams its bytes costs above the HBM floor, launch and first round trip included, the bound
under issue 38's "floor + 1.5 µs" at small weights); ``--chained``: each call launched as
the engine's GEMMs are (PDL, dependents released at entry, the predecessor waited for
before the call ends), so back-to-back calls overlap as far as their CTAs allow.

- bulk: TMA 1D copies (cp.async.bulk + mbarrier complete_tx), ``issuers`` lanes of one
  warp per CTA, each with its own ring of ``stages`` slots of ``chunk`` bytes;
- cp.async: 16 bytes per lane, 8 warps per CTA, each warp 512 contiguous bytes per copy
  and a ring of ``stages`` commit groups (the tail's mechanism).

    python -m benchmarks.bench_stream [--mbytes 1.5 4.7 11] [--chained]
"""

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int64
from cutlass.memory import SmemAllocator

from kimi_ops.kernels.compile import fake, fake_stream

from .common import HBM_BYTES_PER_US, L2_BYTES, graph_us, print_table

BYTES = 7168 * 3584 * 2  # w_up at TP1


class Launch:
    """``size`` bytes streamed a call; ``chained``: launched with PDL, the dependents released
    at entry and the predecessor waited for at the end (the engine's calls: their stores
    wait, their weights do not)."""

    def __init__(self, size: int, chained: bool):
        self.size, self.chained = size, chained

    def launch(self, kernel, ctas: int, threads: int, stream):
        kernel.launch(grid=[ctas, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=self.chained)

    @cute.jit
    def enter(self):
        if cutlass.const_expr(self.chained):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def leave(self):
        if cutlass.const_expr(self.chained):
            cute.arch.griddepcontrol_wait()


class BulkStream(Launch):
    def __init__(self, ctas: int, issuers: int, chunk: int, stages: int, size: int = BYTES, chained: bool = False):
        super().__init__(size, chained)
        self.ctas, self.issuers, self.chunk, self.stages = ctas, issuers, chunk, stages
        self.chunks = -(-size // chunk)  # the last chunk reads past size: the buffer is whole chunks

    @cute.jit
    def __call__(self, source: cute.Tensor, stream):
        self.launch(self.kernel(source), self.ctas, 32, stream)

    @cute.kernel
    def kernel(self, source: cute.Tensor):
        self.enter()
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
        self.leave()

    @cute.jit
    def issue(self, source, ring, bars, lane, slot, chunk_index):
        bar = bars + lane * self.stages + slot
        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.chunk)
        target = ring + (lane * self.stages + slot) * self.chunk
        cute.arch.inline_ptx(
            f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{{$r0}}], [{{$r1}}], {self.chunk}, [{{$r2}}];",
            read_only_args=[target, source.iterator + Int64(chunk_index) * self.chunk, bar],
        )


class AsyncStream(Launch):
    WARPS = 8

    def __init__(self, ctas: int, stages: int, size: int = BYTES, chained: bool = False):
        super().__init__(size, chained)
        self.ctas, self.stages = ctas, stages
        self.pieces = -(-size // 512)  # one warp copy

    @cute.jit
    def __call__(self, source: cute.Tensor, stream):
        self.launch(self.kernel(source), self.ctas, 32 * self.WARPS, stream)

    @cute.kernel
    def kernel(self, source: cute.Tensor):
        self.enter()
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
        self.leave()


def padded(size: int) -> int:
    """A buffer's bytes for ``size``: whole 16 KB chunks (the largest a mechanism copies)."""
    return -(-size // 16384) * 16384


def compile_stream(kernel):
    return cute.compile(kernel, fake(cutlass.Uint8, (padded(kernel.size),), align=128), fake_stream(),
                        options="--enable-tvm-ffi")


def mechanisms(size: int, chained: bool) -> list[tuple[str, Launch]]:
    found = [(f"bulk {ctas}x{issuers} {chunk}Bx{stages}", BulkStream(ctas, issuers, chunk, stages, size, chained))
             for ctas, issuers, chunk, stages in ((132, 1, 16384, 12), (132, 1, 8192, 24), (132, 4, 4096, 12),
                                                  (264, 1, 16384, 6), (132, 32, 512, 12), (132, 32, 128, 32))]
    return found + [(f"cp.async {ctas} 512Bx{stages}", AsyncStream(ctas, stages, size, chained))
                    for ctas in (112, 132) for stages in (8, 24)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbytes", type=float, nargs="+", default=[BYTES / 1e6], help="MB streamed a call")
    parser.add_argument("--chained", action="store_true", help="PDL between calls, as the engine's GEMMs")
    args = parser.parse_args(argv)
    rows = []
    for mbytes in args.mbytes:
        size = int(mbytes * 1e6) // 16 * 16
        copies = max(2, int(L2_BYTES // size) + 1)  # together past L2
        buffers = [torch.empty(padded(size), dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(copies)]
        floor = size / HBM_BYTES_PER_US
        for name, kernel in mechanisms(size, args.chained):
            function, turn = compile_stream(kernel), [0]

            def call(function=function, turn=turn):
                function(buffers[turn[0] % copies])
                turn[0] += 1

            us = graph_us(call, calls=max(20, copies))
            rows.append((f"{size / 1e6:.2f}", name, us, size / us / 1e6, floor, us - floor))
    launched = "PDL-chained calls" if args.chained else "calls without PDL"
    print(f"{torch.cuda.get_device_name()}: L2-cold, CUDA-graph replay, {launched}")
    print_table(rows, ("MB", "mechanism", "µs", "TB/s", "floor", "µs - floor"))


if __name__ == "__main__":
    main()
