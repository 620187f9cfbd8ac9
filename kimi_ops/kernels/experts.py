"""The routed experts' stand-in on Hopper (``kimi::routed_experts``; not a seed kernel).

Clusters of ``cluster`` CTAs (as many as fit the SMs, one CTA an SM) take the (token,
expert) pairs round robin; CTA c of a cluster owns the latent slice of packets (8 columns)
[c·P, (c+1)·P). For pair (b, k), expert e = ids[b, k]: if e is this rank's and (b, k) is
its first pair (token-major; the CTA's threads scan ids[:pair], which every CTA copies into
shared memory once), the cluster serves e for
every token routed to it; a later pair of e is skipped, so each routed expert's weights are
read once a step, with no gather and no sort. A pair of another rank's expert (or an id
outside [0, E)) gets a zero row.

For each token of e, the reference's rounding points:

1. hidden_r = FP32(Σ_l gate_up[e, r, l] · latent[b, l]) for the 2I rows: FP32 products of
   BF16 values (exact) summed in FP64 — a thread's packet, the CTA's packets in order
   (shared memory), the cluster's CTAs in rank order (DSMEM) — rounded once.
2. act_j = situ(hidden_j, hidden_{I+j}): gate and up rounded to BF16, FP32 math, BF16.
3. row_l = BF16(FP32(Σ_j act_j · down[e, l, j])), the sum in FP64.

4·P threads. Phase 1: thread t takes packet t % P of rows t // P + 4k (k < 2I/4); phase
2: threads t < 2P rows 4t..4t+3 of the slice (one 8-byte store). Both keep e's weights in
registers across its tokens. One cluster barrier a token; its slots alternate between two
buffers, so a CTA may start the next token while a peer still reads the last one's.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Float64, Int32, Uint32
from cutlass.memory import SmemAllocator

from .. import backend
from ..ops import experts as experts_op
from ..ops.route import TOP_K
from .common import (
    PDL, Release, aligned, clamp, cluster_barrier, cluster_total, compile_options, compiled, exact_dot, fake,
    fake_stream, hopper, send_to_cluster, sigmoid, unpack_words,
)
from .ptx import load_words, pack_bf16, store_shared, store_words

CLUSTERS = (8, 4, 2, 1)  # the most CTAs per expert the slice allows: more SMs' bandwidth
GROUPS = 4  # phase 1's row groups of P threads (a thread takes 2I / GROUPS gate/up rows)
ROWS_OUT = 4  # phase 2's output rows a thread writes
# A thread's weights stay in registers across the tokens: 194 registers at I = 16 (ptxas
# hoists their unpacked FP32 values out of the token loop); I = 32 spills (even with the
# down rows reloaded a token), so it runs the reference.
MAX_INTERMEDIATE = 16
MAX_BATCH = 256  # the ids (16 KB) and the tokens' match masks in shared memory
MAX_THREADS = 256  # 194 registers a thread at I = 16: more threads spill (L = 7168: 448, 140 B)


def cluster_for(latent: int, intermediate: int) -> int | None:
    """CTAs per expert: the most of CLUSTERS whose slice is a multiple of 8 packets and
    fits a CTA's threads."""
    packets = latent // 8
    return next((c for c in CLUSTERS if packets % c == 0 and (packets // c) % 8 == 0
                 and GROUPS * (packets // c) <= MAX_THREADS), None)


class RoutedExperts(Release):
    """Latent width ``latent``, expert width ``intermediate`` (see the module doc)."""

    def __init__(self, latent: int, intermediate: int, cluster: int, early: bool = False):
        super().__init__(early)
        self.latent, self.intermediate, self.cluster = latent, intermediate, cluster
        self.packets = latent // 8 // cluster  # P, per CTA
        self.threads = GROUPS * self.packets
        self.gate_rows = 2 * intermediate // GROUPS
        self.writers = self.packets * 8 // ROWS_OUT  # phase-2 threads

    @cute.jit
    def __call__(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
                 out: cute.Tensor, batch: Int32, rank: Int32, per_rank: Int32, experts: Int32, clusters: Int32,
                 stream):
        """``ids`` [B·16]; ``gate_up`` [E·2I, L]; ``down`` [E·L, I]; ``out`` [B·16, L];
        ``clusters`` ≤ B·16 clusters take the pairs round robin."""
        self.kernel(latent, ids, gate_up, down, out, batch, rank, per_rank, experts, clusters).launch(
            grid=[clusters * self.cluster, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
            stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
               out: cute.Tensor, batch: Int32, rank: Int32, per_rank: Int32, experts: Int32, clusters: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        self.release_early()
        space = self.allocate()
        writer = clamp(tid, self.writers - 1)
        column = (cta % self.cluster) * self.packets * 8 + ROWS_OUT * writer  # phase 2's first row of the slice
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()  # DSMEM needs every CTA of the cluster started
            cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()  # ids and latent: the routing's
        routed = space[5]  # the ids in shared memory: every pair's scans read them there
        for i in cutlass.range(tid, batch * (TOP_K // 4), self.threads, unroll=1):
            store_shared(routed.iterator + 4 * i, load_words(ids.iterator + 4 * i))
        cute.arch.sync_threads()
        turn = cute.make_rmem_tensor(1, Int32)  # tokens served so far: the exchange slots' buffer
        turn[0] = Int32(0)
        for pair in cutlass.range(cta // self.cluster, batch * TOP_K, clusters, unroll=1):
            expert = routed[pair]
            served = Int32(0)
            if expert >= 0:
                if expert < experts:
                    if expert // per_rank == rank:
                        served = Int32(1)
            if served == 0:
                if tid < self.writers:
                    store_words(out.iterator + pair * self.latent + column, [Uint32(0), Uint32(0)])
            elif self.first_pair(routed, expert, pair, space, tid) != 0:
                self.serve(latent, routed, gate_up, down, out, batch, expert, pair // TOP_K, cta % self.cluster, tid,
                           column, space, turn)
        self.release_late()

    @cute.jit
    def first_pair(self, ids, expert, pair, space, tid) -> Int32:
        """1 if no earlier pair (token-major) has ``expert``: the CTA's threads scan ids[:pair]."""
        flag = space[4]
        cute.arch.sync_threads()  # every thread read the last pair's flag and masks
        if tid == 0:
            flag[0] = Int32(0)
        cute.arch.sync_threads()
        for j in cutlass.range(tid, pair, self.threads, unroll=1):
            if ids[j] == expert:
                flag[0] = Int32(1)
        cute.arch.sync_threads()
        return Int32(1) - flag[0]

    @cute.jit
    def serve(self, latent, ids, gate_up, down, out, batch, expert, token, part, tid, column, space, turn):
        """Every token from ``token`` on routed to ``expert``: steps 1-3 (its masks: which of
        the token's 16 slots hold it)."""
        partials, received, acts, masks = space[:4]
        for b in cutlass.range(token + tid, batch, self.threads, unroll=1):
            mask = Int32(0)
            for k in cutlass.range_constexpr(TOP_K):
                if ids[b * TOP_K + k] == expert:
                    mask = mask | Int32(1 << k)
            masks[b] = mask
        packet, group = tid % self.packets, tid // self.packets
        offset = (part * self.packets + packet) * 8
        gate_w = [load_words(gate_up.iterator + (expert * 2 * self.intermediate + group + GROUPS * k)
                             * self.latent + offset) for k in range(self.gate_rows)]
        down_w = [[word for j in range(0, self.intermediate, 8)
                   for word in load_words(down.iterator + (expert * self.latent + column + i) * self.intermediate + j)]
                  for i in range(ROWS_OUT)]
        cute.arch.sync_threads()  # the masks
        for b in cutlass.range(token, batch, unroll=1):
            mask = masks[b]
            if mask != 0:
                buffer = turn[0] % 2
                x = unpack_words(load_words(latent.iterator + b * self.latent + offset))
                for k in cutlass.range_constexpr(self.gate_rows):
                    partials[group + GROUPS * k, packet] = exact_dot(unpack_words(gate_w[k]), x)
                cute.arch.sync_threads()
                self.share(partials, received, buffer, part, tid)
                if tid < self.intermediate:
                    gate = Float32(BFloat16(Float32(self.total(received, buffer, tid))))
                    up = Float32(BFloat16(Float32(self.total(received, buffer, tid + self.intermediate))))
                    acts[buffer, tid] = Float32(BFloat16(gate * sigmoid(gate * Float32(1.0)) * (up + Float32(0.0))))
                cute.arch.sync_threads()
                if tid < self.writers:
                    act = [acts[buffer, j] for j in range(self.intermediate)]
                    rows = [Float32(exact_dot(unpack_words(down_w[i]), act)) for i in range(ROWS_OUT)]
                    words = [pack_bf16(rows[0], rows[1]), pack_bf16(rows[2], rows[3])]
                    for k in cutlass.range_constexpr(TOP_K):
                        if ((mask >> k) & Int32(1)) != 0:
                            store_words(out.iterator + (b * TOP_K + k) * self.latent + column, words)
                turn[0] = turn[0] + Int32(1)

    @cute.jit
    def allocate(self):
        """(partials [2I, P] FP64 (rows padded: conflict-free column reads), received
        [2 · 2I, cluster] FP64 (two buffers), acts [2, I] FP32, masks [MAX_BATCH], the first-pair
        flag, the ids [MAX_BATCH · 16])."""
        smem = SmemAllocator()
        double = 2 * self.intermediate
        partials = smem.allocate_tensor(Float64, cute.make_layout((double, self.packets), stride=(self.packets + 1, 1)),
                                        16)
        received = smem.allocate_tensor(Float64, cute.make_layout((2 * double, self.cluster), stride=(self.cluster, 1)),
                                        16)
        acts = smem.allocate_tensor(Float32, cute.make_layout((2, self.intermediate), stride=(self.intermediate, 1)),
                                    16)
        masks = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH), 16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        routed = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH * TOP_K), 16)
        return partials, received, acts, masks, flag, routed

    @cute.jit
    def share(self, partials, received, buffer, part, tid):
        """The CTA's 2I sums (its packets in order) into rows [buffer·2I, (buffer + 1)·2I)
        of the cluster's exchange (:func:`~kimi_ops.kernels.common.send_to_cluster`); on
        return every thread may read them all."""
        if tid < 2 * self.intermediate:
            total = Float64(0.0)
            for q in cutlass.range_constexpr(self.packets):
                total += partials[tid, q]
            send_to_cluster(received, buffer * 2 * self.intermediate + tid, total, part, self.cluster)
        cluster_barrier(self.cluster)

    @cute.jit
    def total(self, received, buffer, row) -> Float64:
        return cluster_total(received, buffer * 2 * self.intermediate + row, self.cluster)


@compiled
def compile_routed_experts(latent: int, intermediate: int, cluster: int, early: bool = False):
    tokens, pairs, rows, gate_rows, down_rows = (cute.sym_int() for _ in range(5))
    return cute.compile(
        RoutedExperts(latent, intermediate, cluster, early), fake(BFloat16, (tokens, latent)),
        fake(Int32, (pairs,)), fake(BFloat16, (gate_rows, latent)), fake(BFloat16, (down_rows, intermediate)),
        fake(BFloat16, (rows, latent)), Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), fake_stream(),
        options=compile_options(),
    )


def unsupported_shape(latent: int, intermediate: int, batch: int) -> str | None:
    if intermediate % 8 or not 8 <= intermediate <= MAX_INTERMEDIATE:
        return (f"the kernel keeps an expert's rows in registers: I must be a multiple of 8 in "
                f"[8, {MAX_INTERMEDIATE}], got {intermediate}")
    if latent % 64 or cluster_for(latent, intermediate) is None:
        return (f"the kernel splits L over a cluster of at most {CLUSTERS[0]} CTAs, each a multiple of 8 packets "
                f"and at most {MAX_THREADS // GROUPS}: L must be a multiple of 64 up to 4096, got {latent}")
    if batch > MAX_BATCH:
        return f"the kernel matches at most {MAX_BATCH} tokens, got B = {batch}"
    return None


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def variant(latent: int, intermediate: int):
    return compile_routed_experts(latent, intermediate, cluster_for(latent, intermediate))


class RoutedExpertsKernel:
    """``kimi::routed_experts`` on CUDA."""

    check = staticmethod(experts_op.check_routed_experts)

    def prepare(self, latent: int, intermediate: int) -> None:
        if unsupported_shape(latent, intermediate, 0) is None:
            variant(latent, intermediate)

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
            clusters = min(batch * TOP_K, max(1, multiprocessors(latent.device) // cluster_for(width, intermediate)))
            variant(width, intermediate)(latent, ids.view(-1), gate_up.view(-1, width), down.view(-1, intermediate),
                                         out.view(-1, width), batch, rank, experts // tp, experts, clusters)
        return out


def register() -> None:
    backend.KERNELS["routed_experts"] = RoutedExpertsKernel()
