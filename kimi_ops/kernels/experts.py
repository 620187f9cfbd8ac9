"""The routed experts' stand-in on Hopper (``kimi::routed_experts``; not a seed kernel).

One CTA a (token, expert) pair: the grid is B·16 CTAs, which the hardware hands to SMs as
others end (a balanced schedule, no persistent loop). For pair (b, k), expert e =
ids[b, k]: if e is this rank's and (b, k) is its first pair (token-major; the CTA's
threads scan the ids, which it copies into shared memory), the CTA serves e for every
token routed to it; a later pair of e ends at once, so each routed expert's weights are
read once a step, with no gather and no sort. A pair of another rank's expert (or an id
outside [0, E)) gets a zero row. A CTA reads its whole expert (2I·L gate/up and L·I down
values), one SM streaming an expert while the others stream theirs: the first version
split L over a cluster of 8, each CTA's share too small to cover its latency, and its 16
clusters served the experts in turn (66 µs at B = 8 and 509 at B = 64 against 9.4 and
47.5 µs of weight bytes: benchmarks/NOTES.md).

For each token of e, the reference's rounding points:

1. hidden_r = FP32(Σ_l gate_up[e, r, l] · latent[b, l]) for the 2I rows: FP32 products of
   BF16 values (exact) summed in FP64 — a thread's 8 packets in order, then the row's
   threads in order (shared memory) — rounded once.
2. act_j = situ(hidden_j, hidden_{I+j}): gate and up rounded to BF16, FP32 math, BF16.
3. row_l = BF16(FP32(Σ_j act_j · down[e, l, j])), the sum in FP64.

P = L/8 threads. Step 1: thread t takes 2I/8 rows of group t // Q and the packets
t % Q + Q·j (j < 8, Q = P/8: neighbours read neighbouring packets), STEP packets of each
row a round. Step 3: thread t the 8 rows 8t … 8t+7 (one 16-byte store a pair), e's down
rows copied into shared memory by cp.async as the serve starts, so they land while step 1
streams (each thread's rows padded by a packet: no bank conflicts).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Uint32
from cutlass.memory import SmemAllocator

from .. import backend
from ..ops import experts as experts_op
from ..ops.route import TOP_K
from .common import (
    PDL, Release, aligned, compile_options, compiled, exact_dot, fake, fake_stream, hopper, sigmoid,
    unpack_words,
)
from .ptx import copy_async, load_shared, load_words, pack_bf16, store_shared, store_words

GROUPS = 8  # step 1's row groups, and the packets of a row a thread takes
STEP = 4  # the packets of its rows a thread loads a round: 2I/8 · STEP weight packets in flight
MAX_INTERMEDIATE = 16  # a thread's 8 down rows (16 packets at I = 16) in one padded stash block
MAX_LATENT = 4096  # P = L/8 ≤ 512 threads
MAX_BATCH = 256  # the ids (16 KB) and the tokens' match masks in shared memory


class RoutedExperts(Release):
    """Latent width ``latent``, expert width ``intermediate`` (see the module doc)."""

    def __init__(self, latent: int, intermediate: int, early: bool = False):
        super().__init__(early)
        self.latent, self.intermediate = latent, intermediate
        self.threads = latent // 8  # P: a packet of L each
        self.stride = self.threads // GROUPS  # Q
        self.rows = 2 * intermediate // GROUPS  # the gate/up rows a thread takes
        self.row_packets = intermediate // 8  # a down row's packets
        self.block = 8 * self.row_packets + 1  # a thread's 8 down rows in the stash, padded (packets)

    def smem_bytes(self) -> int:
        """What :meth:`allocate` takes (each piece 16-byte aligned)."""
        pieces = (8 * 2 * self.intermediate * (self.stride + 1), 4 * 2 * self.intermediate, 4 * self.intermediate,
                  4 * MAX_BATCH, 4, 4 * MAX_BATCH * TOP_K, 16 * self.threads * self.block)
        return sum(-(-piece // 16) * 16 for piece in pieces)

    @cute.jit
    def __call__(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
                 out: cute.Tensor, batch: Int32, rank: Int32, per_rank: Int32, experts: Int32, stream):
        """``ids`` [B·16]; ``gate_up`` [E·2I, L]; ``down`` [E·L, I]; ``out`` [B·16, L]."""
        self.kernel(latent, ids, gate_up, down, out, batch, rank, per_rank, experts).launch(
            grid=[batch * TOP_K, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
               out: cute.Tensor, batch: Int32, rank: Int32, per_rank: Int32, experts: Int32):
        tid, _, _ = cute.arch.thread_idx()
        pair, _, _ = cute.arch.block_idx()
        self.release_early()
        space = self.allocate()
        routed = space[5]
        cute.arch.griddepcontrol_wait()  # ids and latent: the routing's
        for i in cutlass.range(tid, batch * (TOP_K // 4), self.threads, unroll=1):
            store_shared(routed.iterator + 4 * i, load_words(ids.iterator + 4 * i))
        cute.arch.sync_threads()
        expert = routed[pair]
        served = Int32(0)
        if expert >= 0:
            if expert < experts:
                if expert // per_rank == rank:
                    served = Int32(1)
        if served == 0:
            store_words(out.iterator + pair * self.latent + 8 * tid, [Uint32(0)] * 4)
        elif self.first_pair(routed, expert, pair, space, tid) != 0:
            self.serve(latent, routed, gate_up, down, out, batch, expert, pair // TOP_K, tid, space)
        self.release_late()

    @cute.jit
    def first_pair(self, ids, expert, pair, space, tid) -> Int32:
        """1 if no earlier pair (token-major) has ``expert``: the CTA's threads scan ids[:pair]."""
        flag = space[4]
        if tid == 0:
            flag[0] = Int32(0)
        cute.arch.sync_threads()
        for j in cutlass.range(tid, pair, self.threads, unroll=1):
            if ids[j] == expert:
                flag[0] = Int32(1)
        cute.arch.sync_threads()
        return Int32(1) - flag[0]

    @cute.jit
    def serve(self, latent, ids, gate_up, down, out, batch, expert, token, tid, space):
        """Every token from ``token`` on routed to ``expert``: steps 1-3 (its masks: which of
        the token's 16 slots hold it)."""
        parts, hidden, acts, masks, _, _, stash = space
        rows = self.row_packets * 8  # a thread's down packets
        for m in cutlass.range_constexpr(rows):  # packet q = tid + P·m of e's down rows, coalesced
            q = tid + self.threads * m
            copy_async(stash + (q // rows * self.block + q % rows) * 4,
                       down.iterator + (expert * self.latent * self.intermediate + q * 8))
        cute.arch.cp_async_commit_group()
        for b in cutlass.range(token + tid, batch, self.threads, unroll=1):
            mask = Int32(0)
            for k in cutlass.range_constexpr(TOP_K):
                if ids[b * TOP_K + k] == expert:
                    mask = mask | Int32(1 << k)
            masks[b] = mask
        cute.arch.sync_threads()  # the masks
        group, lane = tid // self.stride, tid % self.stride
        first_row = expert * 2 * self.intermediate + group * self.rows
        double = 2 * self.intermediate
        for b in cutlass.range(token, batch, unroll=1):
            mask = masks[b]
            if mask != 0:
                acc = cute.make_rmem_tensor(self.rows, Float64)
                for i in cutlass.range_constexpr(self.rows):
                    acc[i] = Float64(0.0)
                for s in cutlass.range(GROUPS // STEP, unroll=1):
                    columns = [(lane + self.stride * (s * STEP + j)) * 8 for j in range(STEP)]
                    x = [unpack_words(load_words(latent.iterator + b * self.latent + c)) for c in columns]
                    w = [[load_words(gate_up.iterator + (first_row + i) * self.latent + c) for c in columns]
                         for i in range(self.rows)]
                    for i in cutlass.range_constexpr(self.rows):
                        total = acc[i]
                        for j in cutlass.range_constexpr(STEP):
                            total += exact_dot(unpack_words(w[i][j]), x[j])
                        acc[i] = total
                for i in cutlass.range_constexpr(self.rows):
                    parts[group * self.rows + i, lane] = acc[i]
                cute.arch.sync_threads()
                for r in cutlass.range(tid, double, self.threads, unroll=1):
                    total = Float64(0.0)
                    for q in cutlass.range_constexpr(self.stride):
                        total += parts[r, q]
                    hidden[r] = Float32(total)
                cute.arch.sync_threads()
                for j in cutlass.range(tid, self.intermediate, self.threads, unroll=1):
                    gate = Float32(BFloat16(hidden[j]))
                    up = Float32(BFloat16(hidden[j + self.intermediate]))
                    acts[j] = Float32(BFloat16(gate * sigmoid(gate * Float32(1.0)) * (up + Float32(0.0))))
                cute.arch.cp_async_wait_group(0)  # the thread's own copies; the barrier: everyone's
                cute.arch.sync_threads()
                act = [acts[j] for j in range(self.intermediate)]
                own = stash + tid * self.block * 4
                values = []
                for i in cutlass.range_constexpr(8):
                    row = [v for h in range(self.row_packets)
                           for v in unpack_words(load_shared(own + (i * self.row_packets + h) * 4))]
                    values.append(Float32(exact_dot(row, act)))
                words = [pack_bf16(values[i], values[i + 1]) for i in range(0, 8, 2)]
                for k in cutlass.range_constexpr(TOP_K):
                    if ((mask >> k) & Int32(1)) != 0:
                        store_words(out.iterator + (b * TOP_K + k) * self.latent + 8 * tid, words)
                cute.arch.sync_threads()  # parts, hidden and acts free for the next token

    @cute.jit
    def allocate(self):
        """(parts [2I, Q] FP64 (rows padded: conflict-free column reads), hidden [2I] FP32,
        acts [I] FP32, masks [MAX_BATCH], the first-pair flag, the ids [MAX_BATCH · 16], the
        down stash (words))."""
        smem = SmemAllocator()
        double = 2 * self.intermediate
        parts = smem.allocate_tensor(Float64, cute.make_layout((double, self.stride), stride=(self.stride + 1, 1)),
                                     16)
        hidden = smem.allocate_tensor(Float32, cute.make_layout(double), 16)
        acts = smem.allocate_tensor(Float32, cute.make_layout(self.intermediate), 16)
        masks = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH), 16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        routed = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH * TOP_K), 16)
        stash = smem.allocate_tensor(Uint32, cute.make_layout(self.threads * self.block * 4), 16).iterator
        return parts, hidden, acts, masks, flag, routed, stash


@compiled
def compile_routed_experts(latent: int, intermediate: int, early: bool = False):
    tokens, pairs, rows, gate_rows, down_rows = (cute.sym_int() for _ in range(5))
    return cute.compile(
        RoutedExperts(latent, intermediate, early), fake(BFloat16, (tokens, latent)),
        fake(Int32, (pairs,)), fake(BFloat16, (gate_rows, latent)), fake(BFloat16, (down_rows, intermediate)),
        fake(BFloat16, (rows, latent)), Int32(1), Int32(0), Int32(1), Int32(1), fake_stream(),
        options=compile_options(),
    )


def unsupported_shape(latent: int, intermediate: int, batch: int) -> str | None:
    if intermediate % 8 or not 8 <= intermediate <= MAX_INTERMEDIATE:
        return (f"the kernel stashes a thread's 8 down rows in one block: I must be a multiple of 8 in "
                f"[8, {MAX_INTERMEDIATE}], got {intermediate}")
    if latent % 64 or not latent <= MAX_LATENT:
        return (f"a CTA's L/8 threads take 8 packets of L each: L must be a multiple of 64 up to {MAX_LATENT}, "
                f"got {latent}")
    if batch > MAX_BATCH:
        return f"the kernel matches at most {MAX_BATCH} tokens, got B = {batch}"
    return None


class RoutedExpertsKernel:
    """``kimi::routed_experts`` on CUDA."""

    check = staticmethod(experts_op.check_routed_experts)

    def prepare(self, latent: int, intermediate: int) -> None:
        if unsupported_shape(latent, intermediate, 0) is None:
            compile_routed_experts(latent, intermediate)

    def unsupported(self, latent, ids, gate_up, down, rank, tp) -> str | None:
        reason = unsupported_shape(latent.shape[1], down.shape[2], latent.shape[0])
        if reason is None and not aligned(latent, ids, gate_up, down):
            reason = "the kernel reads 16-byte packets: every tensor must be 16-byte aligned"
        return reason or hopper(latent)

    def __call__(self, latent, ids, gate_up, down, rank, tp):
        batch, width = latent.shape
        experts, intermediate = gate_up.shape[0], down.shape[2]
        out = latent.new_empty((batch, TOP_K, width))
        if batch:
            compile_routed_experts(width, intermediate)(
                latent, ids.view(-1), gate_up.view(-1, width), down.view(-1, intermediate), out.view(-1, width), batch,
                rank, experts // tp, experts)
        return out


def register() -> None:
    backend.KERNELS["routed_experts"] = RoutedExpertsKernel()
