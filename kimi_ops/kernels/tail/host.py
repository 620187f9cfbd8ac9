"""The tail's host side (the seeds' ``moe/tail_runtime.py``): the compiles, the plan and
variant choices, and the ``kimi`` ops' adapters."""

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from ... import backend
from ...config import TOP_K
from ...mailbox import box_row
from ...ops import tail as tail_op
from ..arguments import addresses, aligned, placeholder, register_addresses
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..launch import multiprocessors
from ..ring import CHUNK
from ..variant import Unsupported, Variant, prepare_all, reason, single
from .fronts import LatentReduce, NormFront, PollNormFront, ShardPush, TailFront
from .split import MoeTail
from .split_plan import CLUSTER, TILE_ROWS, Plan
from .wave import MIN_POLL_WAVE_GROUPS, MIN_WAVE_GROUPS, WaveMoeTail, WavePlan

MAX_WAVE_TP = 2  # publish mode's wave (poll_wave_plan)


def groups_of(batch: int) -> int:
    """8-token MMA groups (the N of m16n8k16) a batch needs: the compile key."""
    return -(-batch // 8)


@compiled
def compile_front(latent: int, tp: int, chunk: int = 0):
    """TailFront; ``chunk`` (two-shot receive boxes): L/TP."""
    batch = cute.sym_int()
    return cute.compile(
        TailFront(latent, tp, chunk), fake(BFloat16, (batch, TOP_K, latent)), fake(BFloat16, (batch, TOP_K), align=2),
        fake(Int64, (tp,), align=8), Int32(0), fake_stream(), options=compile_options(),
    )


@compiled
def compile_norm_front(latent: int, per_sm: int):
    batch = cute.sym_int()
    return cute.compile(
        NormFront(latent, per_sm), fake(BFloat16, (batch, TOP_K, latent)), fake(BFloat16, (batch, TOP_K), align=2),
        fake(BFloat16, (latent,)), fake(BFloat16, (batch, latent)), Float32(1e-6), fake_stream(),
        options=compile_options(),
    )


@compiled
def compile_reduce(chunk: int, tp: int):
    return cute.compile(
        LatentReduce(chunk, tp), fake(BFloat16, (3, tp, cute.sym_int(), chunk)), fake(Int64, (tp,), align=8),
        fake(Int32, (1,), align=4), Int32(0), Int32(1), Int32(1), Int32(0), Int32(1), fake_stream(),
        options=compile_options(),
    )


@compiled
def compile_push(hidden: int, tp: int):
    return cute.compile(
        ShardPush(hidden, tp), fake(BFloat16, (cute.sym_int(), hidden)), fake(Int64, (tp,), align=8), Int32(0),
        fake_stream(), options=compile_options(),
    )


@functools.cache
def plan_for(tp: int, shard: int, latent: int, groups: int, sources: int = 0) -> Plan:
    """MoeTail's Plan of a shape (planned once: the dispatch asks on every call);
    Unsupported (why) where it does not take the shape."""
    if latent % (CLUSTER * CHUNK) or shard % (TILE_ROWS * 2) or tp > 16:
        raise Unsupported(f"the tail kernel needs L % {CLUSTER * CHUNK} == 0, N % {TILE_ROWS * 2} == 0 and "
                         f"TP <= 16 (L={latent}, N={shard}, TP={tp})")
    return Plan(tp, shard, latent, groups, sources)


@compiled
def compile_tail(tp: int, shard: int, latent: int, groups: int, publish: bool, stamps: bool = False,
                 sources: int = 0):
    """MoeTail; ``sources``: the latent box's (publish mode; 0: TP)."""
    plan = plan_for(tp, shard, latent, groups, sources)
    batch, capacity, peers = cute.sym_int(), cute.sym_int(), cute.sym_int()
    if publish:
        latent_in = fake(BFloat16, (3, plan.sources, capacity, latent))
        shared_in = fake(BFloat16, (3, tp, capacity, shard))
    else:
        latent_in, shared_in = fake(BFloat16, (batch, latent)), fake(BFloat16, (batch, shard))
    return cute.compile(
        MoeTail(plan, publish, stamps), latent_in, shared_in,
        fake(BFloat16, (latent,)), fake(BFloat16, (shard, latent)), fake(BFloat16, (batch, shard)),
        fake(Int64, (peers,), align=8), fake(Int32, (1,), align=4), Int32(0), Int32(0),
        Float32(1e-6), Int32(1), Int32(1), Int32(1), fake_stream(), options=compile_options(),
    )


@functools.cache
def wave_plan(shard: int, latent: int, groups: int) -> WavePlan | None:
    """WaveMoeTail's plan of a shape, or None where the wave does not take it."""
    try:
        return WavePlan(shard, latent, groups)
    except ValueError:
        return None


def wave_plan_for(shard: int, latent: int, groups: int, min_groups: int = MIN_WAVE_GROUPS) -> WavePlan | None:
    """WaveMoeTail's plan of a call, or None where MoeTail runs (fewer than ``min_groups``
    token groups, or a shape the wave does not take)."""
    return wave_plan(shard, latent, groups) if groups >= min_groups else None


def poll_wave_plan(tp: int, shard: int, latent: int, groups: int,
                   min_groups: int = MIN_POLL_WAVE_GROUPS) -> WavePlan | None:
    """WaveMoeTail's plan for publish mode, or None where MoeTail polls instead: a CTA per
    64 rows leaves TP4's shard 28 CTAs, too few SMs to stream it at the HBM's rate."""
    return wave_plan_for(shard, latent, groups, min_groups) if tp <= MAX_WAVE_TP else None


@compiled
def compile_wave_tail(shard: int, latent: int, groups: int, stamps: bool = False, tp: int = 0, front: bool = False):
    """WaveMoeTail; ``front`` (publish mode): with its own front, from the latent box."""
    batch, capacity = cute.sym_int(), cute.sym_int()
    if tp:
        shared_in, out_in = fake(BFloat16, (3, tp, capacity, shard)), fake(BFloat16, (cute.sym_int(), shard))
    else:
        shared_in, out_in = fake(BFloat16, (batch, shard)), fake(BFloat16, (batch, shard))
    xn_in = fake(BFloat16, (3, tp, capacity, latent)) if front else fake(BFloat16, (cute.sym_int(), latent))
    return cute.compile(
        WaveMoeTail(wave_plan(shard, latent, groups), stamps, tp, front), xn_in,
        shared_in, fake(BFloat16, (shard, latent)), out_in, fake(Int64, (max(tp, 1),), align=8),
        fake(Int32, (1,), align=4), Int32(0), Int32(0), fake(Int32, (1,), align=4), Int32(1),
        fake(BFloat16, (latent,)), Float32(1e-6), Int32(0), Int32(1), fake_stream(), options=compile_options(),
    )


@compiled
def compile_poll_front(latent: int, tp: int, shard: int):
    capacity = cute.sym_int()
    return cute.compile(
        PollNormFront(latent, tp), fake(BFloat16, (3, tp, capacity, latent)), fake(BFloat16, (3, tp, capacity, shard)),
        fake(BFloat16, (latent,)), fake(BFloat16, (cute.sym_int(), latent)), fake(Int32, (1,), align=4),
        Float32(1e-6), Int32(0), Int32(1), Int32(1), Int32(1), fake_stream(), options=compile_options(),
    )


def front_per_sm(shard: int, latent: int, batch: int, device: int) -> int:
    """NormFront's CTAs per SM for a batch: two (72 registers, ~9 of a thread's 16 row loads
    in flight) where all its CTAs then fit on the SMs the tail's grid leaves free, so the
    next call's tail CTAs never wait for them; else one (all 16 in flight, one round trip):
    at B = 64 a round trip added to the front costs more than the late tail CTAs it spares
    (the sweep: benchmarks/NOTES.md)."""
    free = multiprocessors(device) - functional_ctas(shard, latent, batch)
    return 2 if batch <= 2 * free else 1


def functional_ctas(shard: int, latent: int, batch: int) -> int:
    """The CTAs of the functional tail's launch (benchmarks/profile_tail.py's stamps)."""
    return functional_variant(shard, latent, groups_of(batch)).plan.ctas


@functools.cache
def functional_variant(hidden: int, latent: int, groups: int, stamps: bool = False) -> Variant:
    """``kimi::moe_tail``'s tail after NormFront: WaveMoeTail from MIN_WAVE_GROUPS token
    groups on, else MoeTail; ``arguments(normed, shared, gamma, w_up, out, stamped, eps,
    batch)``, ``stamped`` the Stamps buffer or a placeholder. Unsupported (why) where
    neither takes the shape."""
    wave = wave_plan_for(hidden, latent, groups)
    if wave:
        def arguments(normed, shared, gamma, w_up, out, stamped, eps, batch):
            unpublished = placeholder(out, torch.int64), placeholder(out, torch.int32), 0, 0
            return ((normed, shared, w_up, out, *unpublished, stamped, batch, *no_front(gamma, eps)),)

        return Variant(wave, lambda: (compile_wave_tail(hidden, latent, groups, stamps),), arguments)

    def arguments(normed, shared, gamma, w_up, out, stamped, eps, batch):
        unpublished = placeholder(out, torch.int64), stamped, 0, 0  # MoeTail stamps through the error word
        return ((normed, shared, gamma, w_up, out, *unpublished, eps, batch, 0, 1),)

    return Variant(plan_for(1, hidden, latent, groups),
                   lambda: (compile_tail(1, hidden, latent, groups, False, stamps),), arguments)


def no_front(gamma, eps) -> tuple:
    """WaveMoeTail's arguments of its own front where it has none (unused)."""
    return gamma, eps, 0, 0


@functools.cache
def poll_variant(tp: int, shard: int, latent: int, groups: int, sources: int, stamps: bool = False,
                 min_groups: int = MIN_POLL_WAVE_GROUPS, front_groups: int = 0) -> Variant:
    """``kimi::moe_tail_poll``: PollNormFront and WaveMoeTail from ``min_groups`` token
    groups on (every batch by default) at TP <= MAX_WAVE_TP, else MoeTail (which alone takes two-shot's one-source
    gathered box, ``sources`` 1); ``arguments`` takes the op's. Up to ``front_groups``
    token groups, where every xn chunk fits its slots, the wave with its own front alone
    (one launch). Unsupported (why) where neither takes the shape. ``stamps`` (MoeTail,
    benchmarks/profile_tail.py): the error word's buffer holds the Stamps after its first
    16 bytes."""
    wave = poll_wave_plan(tp, shard, latent, groups, min_groups) if sources == tp and not stamps else None
    if wave and groups <= front_groups and wave.holds_xn:
        def arguments(latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
                      rank, batch):
            out = rs_box[parity, rank]  # placeholder: publish mode writes through the peers
            return ((latent_box, rs_box, w_up, out, addresses(out_boxes), error, parity, rank,
                     placeholder(error, torch.int32), batch, gamma, eps, rearm_parity, rearm_batch),)

        return Variant(wave, lambda: (compile_wave_tail(shard, latent, groups, False, tp, True),), arguments)
    if wave:
        front = PollNormFront(latent, tp)  # its grid (ctas) per call

        def arguments(latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
                      rank, batch):
            normed = latent_box.new_empty((wave.xn_rows(batch), latent))
            out = rs_box[parity, rank]  # placeholder: publish mode writes through the peers
            ctas = front.ctas(batch, rearm_batch, shard)
            return ((latent_box, rs_box, gamma, normed[:batch], error, eps, parity, rearm_parity, rearm_batch, ctas),
                    (normed, rs_box, w_up, out, addresses(out_boxes), error, parity, rank,
                     placeholder(error, torch.int32), batch, *no_front(gamma, eps)))

        def kernels():
            return compile_poll_front(latent, tp, shard), compile_wave_tail(shard, latent, groups, False, tp)

        return Variant(wave, kernels, arguments)

    def arguments(latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch, rank,
                  batch):
        return ((latent_box, rs_box, gamma, w_up, rs_box[parity, rank], addresses(out_boxes), error, parity, rank, eps,
                 batch, rearm_parity, rearm_batch),)

    # compile_tail's key: the plain one-shot call's stays (tp, shard, latent, groups, True), one object file
    extra = () if sources == tp and not stamps else (stamps, sources)
    return Variant(plan_for(tp, shard, latent, groups, sources),
                   lambda: (compile_tail(tp, shard, latent, groups, True, *extra),), arguments)


@functools.cache
def publish_variant(latent: int, tp: int, chunk: int) -> Variant:
    """``kimi::moe_tail_publish``'s TailFront; ``chunk``: 0 for latent boxes, L/TP for
    two-shot's receive boxes."""
    return single(lambda: compile_front(latent, tp, chunk))


@functools.cache
def push_variant(hidden: int, tp: int) -> Variant:
    return single(lambda: compile_push(hidden, tp))


@functools.cache
def reduce_variant(chunk: int, tp: int) -> Variant:
    return single(lambda: compile_reduce(chunk, tp))


class TailKernel:
    """``kimi::moe_tail`` on CUDA (TP1): NormFront, then :func:`functional_variant`'s tail on
    the normalized rows. ``stamps`` (benchmarks only): an int64 buffer of Stamps pairs per
    CTA, to run the stamping variant."""

    check = staticmethod(tail_op.check_moe_tail)

    def __init__(self, stamps: torch.Tensor | None = None):
        self.stamps = stamps

    def prepare(self, latent: int, hidden: int, batches) -> None:
        """Compile what the op will run for ``batches``."""
        for per_sm in (1, 2):  # front_per_sm's choices
            compile_norm_front(latent, per_sm)
        prepare_all(lambda groups=groups: functional_variant(hidden, latent, groups, self.stamps is not None)
                    for groups in sorted({groups_of(b) for b in batches}))

    def unsupported(self, expanded, weights, shared, gamma, w_up, eps):
        if not aligned(expanded, shared, gamma, w_up):
            return "the tail kernel reads 16-byte packets: tensors must be 16-byte aligned"
        return (reason(lambda: functional_variant(w_up.shape[0], expanded.shape[2], groups_of(expanded.shape[0])))
                or hopper(expanded))

    def __call__(self, expanded, weights, shared, gamma, w_up, eps):
        out = shared.new_empty((expanded.shape[0], w_up.shape[0]))
        if out.shape[0]:
            front, tail = self.launches(expanded, weights, shared, gamma, w_up, eps, out)
            front()
            tail()
        return out

    def launches(self, expanded, weights, shared, gamma, w_up, eps, out):
        """The op's two kernels as calls (benchmarks/tail_parts.py times them apart):
        NormFront into a new xn buffer, then the tail from it into ``out``."""
        batch, hidden, latent = expanded.shape[0], w_up.shape[0], expanded.shape[2]
        variant = functional_variant(hidden, latent, groups_of(batch), self.stamps is not None)
        normed = expanded.new_empty((variant.plan.xn_rows(batch), latent))
        front = compile_norm_front(latent, front_per_sm(hidden, latent, batch, expanded.device.index))
        stamped = placeholder(out if self.stamps is None else self.stamps, torch.int32)
        (tail,) = variant.launches(normed, shared, gamma, w_up, out, stamped, eps, batch)
        return lambda: front(expanded, weights, gamma, normed[:batch], eps), tail


class TailPublishKernel:
    """``kimi::moe_tail_publish`` on CUDA."""

    check = staticmethod(tail_op.check_moe_tail_publish)

    def prepare(self, latent: int, tp: int, peer_lists=(), chunks=(0,)) -> None:
        """``chunks``: 0 for latent boxes, L/TP for two-shot receive boxes."""
        prepare_all(lambda chunk=chunk: publish_variant(latent, tp, chunk) for chunk in chunks)
        register_addresses(peer_lists)

    def unsupported(self, expanded, weights, latent_boxes, parity, rank):
        if expanded.shape[2] % 8 or not aligned(expanded, *latent_boxes):
            return "the publish kernel stores 16-byte packets: L % 8 == 0 and 16-byte aligned tensors"
        return hopper(expanded)

    def __call__(self, expanded, weights, latent_boxes, parity, rank):
        latent, width = expanded.shape[2], latent_boxes[0].shape[3]
        tp, capacity = len(latent_boxes), latent_boxes[0].shape[2]
        publish_variant(latent, tp, 0 if width == latent else width).run(
            expanded, weights, addresses(latent_boxes), box_row(parity, rank, 0, tp, capacity))


class LatentReduceKernel:
    """``kimi::moe_latent_reduce`` on CUDA."""

    check = staticmethod(tail_op.check_moe_latent_reduce)

    def prepare(self, chunk: int, tp: int, peer_lists=()) -> None:
        prepare_all([lambda: reduce_variant(chunk, tp)])
        register_addresses(peer_lists)

    def unsupported(self, recv_box, gathered_boxes, error, parity, rearm_parity, rearm_batch, rank, batch):
        if not aligned(recv_box, *gathered_boxes):
            return "the reduce kernel stores 16-byte packets: 16-byte aligned boxes"
        return hopper(recv_box)

    def __call__(self, recv_box, gathered_boxes, error, parity, rearm_parity, rearm_batch, rank, batch):
        reduce_variant(recv_box.shape[3], recv_box.shape[1]).run(
            recv_box, addresses(gathered_boxes), error, parity, rearm_parity, rearm_batch, rank, batch)


class TailPushKernel:
    """``kimi::moe_tail_push`` on CUDA."""

    check = staticmethod(tail_op.check_moe_tail_push)

    def prepare(self, hidden: int, tp: int, peer_lists=()) -> None:
        prepare_all([lambda: push_variant(hidden, tp)])
        register_addresses(peer_lists)

    def unsupported(self, shared, rs_boxes, parity, rank):
        if rs_boxes[0].shape[3] % 8 or not aligned(shared, *rs_boxes):
            return "the push kernel stores 16-byte packets: H/TP % 8 == 0 and 16-byte aligned tensors"
        return hopper(shared)

    def __call__(self, shared, rs_boxes, parity, rank):
        tp, capacity = len(rs_boxes), rs_boxes[0].shape[2]
        push_variant(shared.shape[1], tp).run(shared, addresses(rs_boxes), box_row(parity, rank, 0, tp, capacity))


class TailPollKernel:
    """``kimi::moe_tail_poll`` on CUDA: :func:`poll_variant`'s kernels."""

    check = staticmethod(tail_op.check_moe_tail_poll)
    # bench-only: the token groups from which the wave serves, and up to which it runs its
    # own front (bench_layer --wave-from-groups, --wave-front-groups set them each run; the
    # TP8 rank's A/Bs, benchmarks/NOTES.md; the front inside was 2.4-8.8 µs slower a layer)
    min_wave_groups = MIN_POLL_WAVE_GROUPS
    front_groups = 0

    def variant(self, tp: int, shard: int, latent: int, groups: int, sources: int) -> Variant:
        return poll_variant(tp, shard, latent, groups, sources, False, self.min_wave_groups, self.front_groups)

    def prepare(self, tp: int, shard: int, latent: int, batches, peer_lists=(), gathered_batches=()) -> None:
        """``gathered_batches``: those of ``batches`` that poll two-shot's gathered box (one source)."""
        prepare_all(lambda groups=groups, sources=sources: self.variant(tp, shard, latent, groups, sources)
                    for groups, sources in sorted({(groups_of(b), 1 if b in gathered_batches else tp) for b in batches}))
        register_addresses(peer_lists)

    def serves(self, tp: int, shard: int, latent: int, batches) -> bool:
        """Whether its kernels (bounded polls of the shard box, not plain loads) take every
        one of ``batches`` at these shapes (one-shot: TP latent sources)."""
        return all(reason(lambda groups=groups_of(b): self.variant(tp, shard, latent, groups, tp)) is None
                   for b in batches)

    def unsupported(self, latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity,
                    rearm_batch, rank, batch):
        if not aligned(latent_box, rs_box, gamma, w_up, *out_boxes):
            return "the tail kernel reads 16-byte packets: tensors must be 16-byte aligned"
        return reason(lambda: self.variant(rs_box.shape[1], rs_box.shape[3], latent_box.shape[3], groups_of(batch),
                                           latent_box.shape[1])) or hopper(latent_box)

    def __call__(self, latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
                 rank, batch):
        variant = self.variant(rs_box.shape[1], rs_box.shape[3], latent_box.shape[3], groups_of(batch),
                               latent_box.shape[1])
        variant.run(latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch, rank,
                    batch)


class TailServeKernel:
    """``kimi::moe_tail_serve`` on CUDA: the publish kernel, then the poll's. (MoeTail
    publishing its partial latent itself, one launch, was 3-7 µs slower at B <= 8 on the
    H200: its CTAs' loads and polls queue behind their own weight stream, where
    TailFront's run on SMs the tail leaves free; benchmarks/NOTES.md.)"""

    check = staticmethod(tail_op.check_moe_tail_serve)
    publish, poll = TailPublishKernel(), TailPollKernel()

    def prepare(self, tp: int, shard: int, latent: int, batches, latent_peers=(), out_peers=()) -> None:
        self.publish.prepare(latent, tp, latent_peers)
        self.poll.prepare(tp, shard, latent, batches, out_peers)

    def unsupported(self, expanded, weights, latent_boxes, rs_box, gamma, w_up, eps, out_boxes, error, parity,
                    rearm_parity, rearm_batch, rank):
        return (self.publish.unsupported(expanded, weights, latent_boxes, parity, rank)
                or self.poll.unsupported(latent_boxes[rank], rs_box, gamma, w_up, eps, out_boxes, error, parity,
                                         rearm_parity, rearm_batch, rank, expanded.shape[0]))

    def __call__(self, expanded, weights, latent_boxes, rs_box, gamma, w_up, eps, out_boxes, error, parity,
                 rearm_parity, rearm_batch, rank):
        self.publish(expanded, weights, latent_boxes, parity, rank)
        self.poll(latent_boxes[rank], rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
                  rank, expanded.shape[0])


def register() -> None:
    backend.KERNELS["moe_tail"] = TailKernel()
    backend.KERNELS["moe_tail_publish"] = TailPublishKernel()
    backend.KERNELS["moe_tail_push"] = TailPushKernel()
    backend.KERNELS["moe_latent_reduce"] = LatentReduceKernel()
    backend.KERNELS["moe_tail_poll"] = TailPollKernel()
    backend.KERNELS["moe_tail_serve"] = TailServeKernel()
