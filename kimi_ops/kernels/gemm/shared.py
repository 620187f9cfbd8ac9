"""The shared expert in one launch (``kimi::shared_expert_push``, the seeds' fused
``SharedFront``): the engine's gate/up plan with situ into the model-owned ``act``, a grid
barrier, then its down plan (one 64-row tile a CTA over the whole K, split 1) with the
reduce-scatter push, on the same CTAs and the same shared memory.

Why one launch: launched apart, the down's CTAs that are not resident beside the gate/up's
rings start only when the gate/up ends, and then pay their wave (the push added ~5 µs to the
TP8-rank layer, benchmarks/NOTES.md). Here every CTA is resident before the barrier, and
each one streams its down tile into its ring while it waits there: the down's weights do
not depend on the activations.

With the MoE front (``kimi::moe_front_shared_push``): the front publish's plan runs on CTAs
of its own before the gate/up's, both from the same x, so both weights stream at once and
the front's launch is gone (its CTAs had held the SMs the shared expert's CTAs waited for:
they start together now). Alone the two plans take 80 + 96 CTAs at the TP8 rank, past one
wave; :func:`~.plan.joint_partition` sizes them to share one (2 and 3 tiles a CTA, the
gate/up's owners uneven). The front's CTAs arrive at the barrier once their rows are
published and stream their down tile meanwhile, as the others do.

The grid (:class:`SharedPlan`): the down's tiles and the first plans' CTAs, whichever is
more, in whole clusters of the largest K split. The whole grid must be resident at once (one
CTA an SM, RESIDENT). The clusters past the first plans' CTAs only arrive at the barrier
(after their PDL wait, as every CTA: see below); those past the down's tiles leave after it.

The barrier's counter (``ticket``, monotonic, zeroed by ``DecodeBoxes.reset``) holds a
multiple of CALL_STRIDE between calls: CTA 0 adds CALL_STRIDE - grid + 1 and every other CTA
1, one atomic each, so the counter reaches the next multiple (the waiters' goal) exactly
when the last CTA arrives, and nothing moves it after. So calls of different grids may
share one ticket (the fused shared expert with and without the front: 16 and 8 CTAs at
KimiConfig.tiny()); a counter kept at a multiple of the grid instead sent a wider grid's
later CTAs to wait for the next multiple, until the bound. Every CTA arrives after its PDL
wait, so a call's arrivals follow the previous call's end: the CTAs past the first plans
arrived at entry before, and where a call followed one on the same ticket (a benchmark's
back-to-back calls) with room beside it (small grids), their arrivals counted toward the
previous call's goal, whose own last CTAs then waited for this call's, which waited for
its end.

The barrier: each CTA's activations stored (and fenced for the async proxy that reads
them), one thread adds its share to the counter (release, GPU scope), and the down's x
copier warp waits until the counter reaches the call's goal (acquire, bounded by
POLL_TIMEOUT_NS from our predecessor's end: past it the error word gets SHARED_BARRIER, the
down reads whatever ``act`` holds, and the step is lost until reset(); a straggler still
arrives before its call ends, so the counter is whole again for the next call). (The down's
split-1 CTAs keep the engine's two cluster barriers, over all CTAs of the launch's clusters:
each waits for the slowest of its cluster.)

PDL: every CTA releases the dependents once its PDL wait is over (the first plans'
consumers, the barrier's waiters), not at entry: a dependent that does not wait for our end (the
decoder's route poll, runtime/prepared.py) then starts after our predecessor ended, as if
it followed it. A dependent launches only once every CTA of ours has released it, so the
whole grid is resident by then and the barrier cannot starve.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from ...mailbox import SHARED_BARRIER
from ..launch import MARKS, PDL, STAMP_CTAS, STAMP_FIRST, STAMP_PHASES
from ..mailbox import POLL_TIMEOUT_NS
from ..ptx import nap
from ..values import Stamps
from .engine import DecodeGemm, Outputs
from .plan import THREADS, GemmPlan


# KIMI_OPS_MARKS: every CTA's phases (kernels.values.Stamps after the marks' records;
# benchmarks/timeline.py --marks): the first plan's (the gate/up's, or the front's) x in (CTAs
# past both plans stamp none), MMAs done and rows stored, the barrier passed, the down's MMAs
# done and its stores issued
SHARED_PHASES = ("start", "x in", "first MMAs", "first stored", "barrier passed", "down MMAs", "down stored")

CALL_STRIDE = 1 << 16  # what a call adds to the barrier's counter, whatever its grid


class SharedPlan:
    """The plans of one (gate/up [2I, K], down [N, I], T) variant and their grid (``grid``
    CTAs: every bucket's, see the module doc); ``front`` ([E/TP + L/TP, K], the MoE front's
    plan) where the front publish runs beside the gate/up, on the CTAs before its."""

    def __init__(self, gate_up: GemmPlan, down: GemmPlan, grid: int, front: GemmPlan | None = None):
        self.gate_up, self.down, self.grid, self.front = gate_up, down, grid, front
        self.firsts = [p for p in (front, gate_up) if p is not None]  # the plans before the barrier, in CTA order
        self.cluster = max(p.split for p in self.firsts)  # the launch's CTAs per cluster
        # each plan its own barriers (none is initialized twice): the front's and the gate/up's
        # CTAs are apart, so they share the first ones
        self.first_depth = max(p.depth for p in self.firsts)
        self.depth = self.first_depth + down.depth
        self.ring_bytes = max(down.ring_bytes, *(p.ring_bytes for p in self.firsts))


class GridBarrier:
    """The barrier between the two plans of a grid of ``grid`` CTAs (see the module doc):
    ``ticket`` the counter, ``target`` a shared word that :meth:`arrive` fills for
    :meth:`wait` (arguments: an ``if`` of the DSL carries no object that holds tensors).
    The down's :class:`DecodeGemm` holds it as its ``waiter``."""

    def __init__(self, grid: int):
        assert 0 < grid < CALL_STRIDE, grid
        self.grid = grid

    @cute.jit
    def arrive(self, tid, ticket: cute.Tensor, target: cute.Tensor):
        """Every thread's activations stored: one arrival of this CTA, and the count this
        call's last arrival reaches, for the waiters. After the PDL wait (see the module doc;
        a CTA that ran a first plan has passed it already)."""
        cute.arch.griddepcontrol_wait()
        cute.arch.fence_proxy("async.global")  # our generic stores, then other CTAs' TMA reads
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_gpu()
            cta, _, _ = cute.arch.block_idx()
            share = Int64(1)
            if cta == 0:  # the call's shares sum to the stride
                share = Int64(CALL_STRIDE - self.grid + 1)
            old = cute.arch.atomic_add(ticket.iterator, share, sem="release", scope="gpu")
            target[0] = old // CALL_STRIDE * CALL_STRIDE + CALL_STRIDE

    @cute.jit
    def wait(self, ticket: cute.Tensor, target: cute.Tensor, error: cute.Tensor):
        """The dependents' release, then until every CTA arrived (bounded). A warp's lane 0
        polls; the warp then fences for its TMA reads of the activations. The bound's clock
        starts after our predecessor ended."""
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # see the module doc
        goal = target[0]
        if cute.arch.lane_idx() == 0:
            start = cute.arch.globaltimer()
            waiting = cute.arch.load(ticket.iterator, Int64, sem="acquire", scope="gpu") < goal
            while waiting:
                nap()
                waiting = cute.arch.load(ticket.iterator, Int64, sem="acquire", scope="gpu") < goal
                if waiting & (cute.arch.globaltimer() - start > POLL_TIMEOUT_NS):
                    cute.arch.atomic_or(error.iterator, Int32(SHARED_BARRIER))
                    waiting = cutlass.Boolean(False)
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")


class SharedExpert:
    """The kernel of one :class:`SharedPlan`: ``situ`` (beta, linear_beta), the down's
    reduce-scatter over ``tp`` boxes; with the plan's front, ``n_logits`` of its rows are
    logits, and it publishes into ``tp`` front boxes (``kimi::moe_front_publish``'s rows)."""

    def __init__(self, plan: SharedPlan, situ: tuple, tp: int, n_logits: int = 0):
        assert plan.grid <= STAMP_CTAS and len(SHARED_PHASES) <= STAMP_PHASES, "the stamps fit their words"
        self.plan = plan
        cluster, front = plan.cluster, plan.front
        self.front = None if front is None else DecodeGemm(
            front, Outputs(front.n, True, n_logits, tp), cluster, release_waited=True)
        self.gate_up = DecodeGemm(plan.gate_up, Outputs(plan.gate_up.n, situ=situ), cluster, release_waited=True,
                                  offset=0 if front is None else front.ctas)
        self.down = DecodeGemm(plan.down, Outputs(plan.down.n, tp=tp, scatter=True), cluster, GridBarrier(plan.grid))
        self.front_loads = self.front or self.gate_up  # w_front's descriptor (without a front: unread)

    @cute.jit
    def __call__(self, x: cute.Tensor, w_gate_up: cute.Tensor, act: cute.Tensor, w_down: cute.Tensor,
                 second: cute.Tensor, peers: cute.Tensor, ticket: cute.Tensor, error: cute.Tensor, row0: Int32,
                 w_front: cute.Tensor, front_peers: cute.Tensor, front_row0: Int32, col0: Int32, col1: Int32,
                 stream):
        """``w_front`` … ``col1``: the front's weight, boxes and :meth:`Outputs.store`'s
        arguments (without a front: any, unread)."""
        gate_up_copy, gate_up_boxes = self.gate_up.weight_copy(w_gate_up)
        front_copy, front_boxes = self.front_loads.weight_copy(w_front)
        x_copy, x_boxes = self.gate_up.x_copy(x)
        down_copy, down_boxes = self.down.weight_copy(w_down)
        act_copy, act_boxes = self.down.x_copy(act)
        self.kernel(gate_up_copy, gate_up_boxes, x_copy, x_boxes, down_copy, down_boxes, act_copy, act_boxes, x, act,
                    second, peers, ticket, error, row0, front_copy, front_boxes, front_peers, front_row0, col0,
                    col1).launch(
            grid=[self.plan.grid, 1, 1], block=[THREADS, 1, 1], cluster=[self.plan.cluster, 1, 1],
            stream=stream, use_pdl=PDL, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, gate_up_copy: cute.CopyAtom, gate_up_boxes: cute.Tensor, x_copy: cute.CopyAtom,
               x_boxes: cute.Tensor, down_copy: cute.CopyAtom, down_boxes: cute.Tensor, act_copy: cute.CopyAtom,
               act_boxes: cute.Tensor, x: cute.Tensor, act: cute.Tensor, second: cute.Tensor, peers: cute.Tensor,
               ticket: cute.Tensor, error: cute.Tensor, row0: Int32, front_copy: cute.CopyAtom,
               front_boxes: cute.Tensor, front_peers: cute.Tensor, front_row0: Int32, col0: Int32, col1: Int32):
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        stamps = Stamps(SHARED_PHASES, MARKS, error, cta, tid, STAMP_FIRST // 4)
        stamps.at("start")
        full, ring = DecodeGemm.allocate(plan.depth, plan.ring_bytes)
        target = SmemAllocator().allocate_tensor(Int64, cute.make_layout(1), 8)
        firsts = (stamps, SHARED_PHASES[1:4])
        # (a plan's CTAs are whole clusters: a cluster past one plan's CTAs skips it whole)
        if cutlass.const_expr(self.front is not None):
            if cta < plan.front.ctas:
                self.front.body(front_copy, front_boxes, (x_copy, x_boxes), x,
                                (act, second, front_peers, front_row0, col0, col1), storage=(full, ring),
                                stamped=firsts)
        gate_up_from = self.gate_up.offset
        if (cta >= gate_up_from) & (cta < gate_up_from + plan.gate_up.ctas):
            self.gate_up.body(gate_up_copy, gate_up_boxes, (x_copy, x_boxes), x, (act, second, peers, 0, 0, 0),
                              storage=(full, ring), stamped=firsts)
        self.down.waiter.arrive(tid, ticket, target)
        cute.arch.fence_proxy("async.shared", space="cta")  # the epilogue's reads of the ring, then TMA's writes
        if cta < plan.down.ctas:
            self.down.body(down_copy, down_boxes, (act_copy, act_boxes), act, (act, second, peers, row0, 0, 0),
                           storage=(full + 2 * plan.first_depth, ring), inputs=(ticket, target, error),
                           stamped=(stamps, SHARED_PHASES[4:]))
