"""The engine's host side: its compiles, a call's variant (chosen once by
:func:`gemm_variant`, which every adapter's ``prepare``, ``unsupported`` and call ask) and
the adapters of ``kimi::oproj``, ``kimi::normed_oproj``, ``kimi::gate_up_situ``,
``kimi::moe_front``, ``kimi::oproj_publish``, ``kimi::oproj_push``,
``kimi::moe_front_publish`` and ``kimi::shared_expert_push`` (the two plans of
:mod:`.shared`)."""

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from ... import backend
from ...mailbox import box_row
from ...ops import front as front_op
from ...ops import oproj as oproj_op
from ...ops.oproj import PAIRED
from ..arguments import addresses, aligned, placeholder, register_addresses, tma_rows
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..launch import check_marks_room
from ..ring import CHUNK
from ..variant import Unsupported, Variant, prepare_all, reason
from .engine import DecodeGemm, NormedGemm, Outputs
from .plan import (
    MAX_BATCH,
    RESIDENT,
    SPLITS,
    TILE,
    TOKEN_TILES,
    GemmPlan,
    gemm_plan,
    joint_partition,
    partition,
    raw_rows_plan,
    token_tile,
)
from .shared import SharedExpert, SharedPlan

# Compiles: one per (N, K, T, outputs). The tensors an epilogue does not use are
# one-element placeholders (kernels.arguments.placeholder).


@compiled
def compile_gemm(n: int, k: int, tokens: int, front: bool = False, n_logits: int = 0, tp: int = 0,
                 scatter: bool = False, situ: tuple | None = None, parts: tuple[int, int] | None = None):
    """``parts``: (tiles, split) instead of the plan's (:func:`forced_variant`)."""
    batch = cute.sym_int()
    if tp or not front:
        rows = fake(BFloat16, (batch, n // 2 if situ else n))
        latent, logits = (fake(BFloat16, (1, 1)) if tp else rows), fake(Float32, (1, 1))
    else:
        latent = fake(BFloat16, (batch, n - n_logits)) if n > n_logits else fake(BFloat16, (1, 1))
        logits = fake(Float32, (batch, n_logits)) if n_logits else fake(Float32, (1, 1))
    return cute.compile(
        DecodeGemm(plan_of(n, k, tokens, situ, parts), Outputs(n, front, n_logits, tp, scatter, situ)),
        fake(BFloat16, (batch, k)), fake(BFloat16, (n, k)), latent, logits, fake(Int64, (max(tp, 1),), align=8),
        Int32(0), Int32(0), Int32(0), fake_stream(), options=compile_options(),
    )


def owned_rows(situ) -> int:
    """A CTA's owned rows are a multiple of this: a packet, or situ's gate and up packets."""
    return 2 * PAIRED if situ else 8


def plan_of(n: int, k: int, tokens: int, situ, parts: tuple[int, int] | None = None) -> GemmPlan:
    """A variant's plan: its CTAs own whole packets, or situ's pairs of them; ``parts``:
    (tiles, split) instead of :func:`~.plan.partition`'s."""
    return GemmPlan(n, k, tokens, parts) if parts else gemm_plan(n, k, tokens, owned_rows(situ))


def unsupported_shape(n: int, k: int, batch: int, n_logits: int = 0, owned: int = 8) -> str | None:
    if batch > MAX_BATCH:
        return f"the decode GEMM takes at most {MAX_BATCH} tokens, got {batch}"
    if n_logits % 8:
        return f"the decode GEMM stores 8-row packets: n_logits % 8 == 0, got {n_logits}"
    if partition(n, k, token_tile(batch), owned) is None:
        return (f"the decode GEMM needs K % {CHUNK} == 0, N % 8 == 0 and one wave of CTAs owning {owned}-row "
                f"multiples (N={n}, K={k})")
    return None


def tokens_of(batches) -> list[int]:
    """The compile buckets of ``batches`` (every bucket when None; batches past MAX_BATCH
    run the reference)."""
    if batches is None:
        return list(TOKEN_TILES)
    return sorted({token_tile(b) for b in batches if 0 < b <= MAX_BATCH})


@functools.cache  # asked by unsupported and the call: built once a shape
def gemm_variant(n: int, k: int, batch: int, outputs: tuple = ()) -> Variant:
    """The engine's variant for ``batch`` tokens of an [N, K] weight; ``outputs``:
    compile_gemm's key past (N, K, T) — () rows, (True, n_logits) the front, (False, 0,
    TP) o-proj's boxes, (True, n_logits, TP) the front's boxes, (False, 0, TP, True) the
    reduce-scatter boxes, (False, 0, 0, False, (beta, linear_beta)) situ's activations.
    Its kernel takes the adapter's arguments as they are. Unsupported (why) where the
    engine does not take it."""
    situ = outputs[4] if len(outputs) > 4 else None
    why = unsupported_shape(n, k, batch, outputs[1] if len(outputs) > 1 else 0, owned_rows(situ))
    if why:
        raise Unsupported(why)
    tokens = token_tile(batch)
    plan = plan_of(n, k, tokens, situ)
    if outputs[3:] == (True,) and (n % outputs[2] or (n // outputs[2]) % plan.owned):
        raise Unsupported(f"the reduce-scatter epilogue stores a CTA's {plan.owned} rows into one owner: "
                          f"N/TP must be a multiple of them (N={n}, TP={outputs[2]})")
    return engine_variant(lambda: compile_gemm(n, k, tokens, *outputs), plan)


def forced_variant(n: int, k: int, batch: int, parts: tuple[int, int]) -> Variant:
    """``kimi::oproj``'s variant at ``batch`` tokens with the weight partitioned as ``parts``
    (tiles, split) instead of :func:`~.plan.partition`'s (bench_projection --partitions)."""
    tokens = token_tile(batch)
    return engine_variant(lambda: compile_gemm(n, k, tokens, False, 0, 0, False, None, parts),
                          plan_of(n, k, tokens, None, parts))


def engine_variant(kernel, plan: GemmPlan) -> Variant:
    """The variant of one engine kernel (``kernel()`` compiles or loads it): the adapter's
    arguments, x (the first) as its TMA descriptor takes it (:func:`~..arguments.tma_rows`)."""
    return Variant(plan, lambda: (kernel(),), lambda x, *rest: ((tma_rows(x), *rest),))


class GemmKernel:
    """An op on the engine: ``shape(*call)`` gives its (N, K, batch, outputs); the variant,
    ``unsupported`` and ``prepare`` derive from it. ``writes``: what the alignment message
    names (the publishing ops store into boxes)."""

    writes = "reads 16-byte packets: x and w must be"

    def shape(self, *call) -> tuple:
        raise NotImplementedError

    def variant(self, *call) -> Variant:
        return gemm_variant(*self.shape(*call))

    def unsupported(self, x, w, *rest):
        boxes = [t for arg in rest if isinstance(arg, list) for t in arg]
        if not aligned(x, w, *boxes):
            return f"the decode GEMM {self.writes} 16-byte aligned"
        return reason(lambda: self.variant(x, w, *rest)) or hopper(x)

    @staticmethod
    def prepare_buckets(n: int, k: int, outputs: tuple, batches, peer_lists=()) -> None:
        prepare_all(lambda tokens=tokens: gemm_variant(n, k, tokens, outputs) for tokens in tokens_of(batches))
        register_addresses(peer_lists)


class OprojKernel(GemmKernel):
    """``kimi::oproj`` on CUDA: every projection of the decoder (o-proj, the shared
    expert's gate/up and down, the stand-in core, the DSA helper projections)."""

    check = staticmethod(oproj_op.check_oproj)

    def shape(self, x, w):
        return w.shape[0], w.shape[1], x.shape[0]

    def prepare(self, n: int, k: int, batches=None) -> None:
        self.prepare_buckets(n, k, (), batches)

    def __call__(self, x, w):
        return self.rows(self.variant(x, w), x, w)

    @staticmethod
    def rows(variant: Variant, x, w):
        """x · wᵀ by ``variant`` (the call's, or a :func:`forced_variant`)."""
        out = x.new_empty((x.shape[0], w.shape[0]))
        if x.shape[0]:
            variant.run(x, w, out, placeholder(out, torch.float32, 2), placeholder(out, torch.int64), 0, 0, 0)
        return out


@compiled
def compile_normed(n: int, k: int, tokens: int):
    """``kimi::normed_oproj`` at one (N, K, T): raw rows of x, BF16 rows out."""
    batch = cute.sym_int()
    return cute.compile(
        NormedGemm(raw_rows_plan(n, k, tokens)), fake(BFloat16, (batch, k)), fake(BFloat16, (n, k)),
        fake(BFloat16, (k,)), fake(BFloat16, (batch, n)), Float32(0), fake_stream(), options=compile_options(),
    )


@functools.cache
def normed_variant(n: int, k: int, batch: int) -> Variant:
    why = unsupported_shape(n, k, batch)
    if why:
        raise Unsupported(why)
    tokens = token_tile(batch)
    return engine_variant(lambda: compile_normed(n, k, tokens), raw_rows_plan(n, k, tokens))


class NormedOprojKernel(GemmKernel):
    """``kimi::normed_oproj`` on CUDA: the producers normalize x's raw rows into the ring
    (every K part's Σ x² shared over the cluster), then the engine as ``kimi::oproj``."""

    check = staticmethod(oproj_op.check_normed_oproj)

    def variant(self, x, w, norm_w, eps):
        return normed_variant(w.shape[0], w.shape[1], x.shape[0])

    def unsupported(self, x, w, norm_w, eps):
        if not aligned(x, w, norm_w):
            return "the decode GEMM reads 16-byte packets: x, w and norm_w must be 16-byte aligned"
        return reason(lambda: self.variant(x, w, norm_w, eps)) or hopper(x)

    def prefers(self, n: int, k: int, batch: int) -> bool:
        """Where the kernel serves ``batch`` tokens: one launch instead of a norm's (the
        decoder's embedding AttnRes, which added 9.9 / 9.9 / 7.2 µs a step at B = 1 / 8 / 64 on
        the H200's TP8-rank timeline, 8d1af04) and the projection's. Not yet measured
        itself: the layer A/B against 49cc56c (benchmarks/NOTES.md) keeps or drops it."""
        return reason(lambda: normed_variant(n, k, batch)) is None

    def prepare(self, n: int, k: int, batches=None) -> None:
        prepare_all(lambda tokens=tokens: normed_variant(n, k, tokens) for tokens in tokens_of(batches))

    def __call__(self, x, w, norm_w, eps):
        out = x.new_empty((x.shape[0], w.shape[0]))
        if x.shape[0]:
            self.variant(x, w, norm_w, eps).run(x, w, norm_w, out, float(eps))
        return out


class GateUpSituKernel(GemmKernel):
    """``kimi::gate_up_situ`` on CUDA: the shared expert's gate/up rows (interleaved) and
    situ in the epilogue, [B, I] activations in one launch."""

    check = staticmethod(oproj_op.check_gate_up_situ)

    def shape(self, x, w, beta, linear_beta):
        return w.shape[0], w.shape[1], x.shape[0], (False, 0, 0, False, (float(beta), float(linear_beta)))

    def prepare(self, n: int, k: int, beta: float, linear_beta: float, batches=None) -> None:
        self.prepare_buckets(n, k, (False, 0, 0, False, (float(beta), float(linear_beta))), batches)

    def __call__(self, x, w, beta, linear_beta):
        out = x.new_empty((x.shape[0], w.shape[0] // 2))
        if x.shape[0]:
            self.variant(x, w, beta, linear_beta).run(
                x, w, out, placeholder(out, torch.float32, 2), placeholder(out, torch.int64), 0, 0, 0)
        return out


class FrontKernel(GemmKernel):
    """``kimi::moe_front`` on CUDA: logits FP32, latent BF16, one pass over the weights."""

    check = staticmethod(front_op.check_moe_front)

    def shape(self, x, w, n_logits):
        return w.shape[0], w.shape[1], x.shape[0], (True, n_logits)

    def prepare(self, n: int, k: int, n_logits: int, batches=None) -> None:
        self.prepare_buckets(n, k, (True, n_logits), batches)

    def __call__(self, x, w, n_logits):
        batch, n = x.shape[0], w.shape[0]
        logits = x.new_empty((batch, n_logits), dtype=torch.float32)
        latent = x.new_empty((batch, n - n_logits))
        if batch:
            self.variant(x, w, n_logits).run(
                x, w, latent if n > n_logits else placeholder(x, torch.bfloat16, 2),
                logits if n_logits else placeholder(x, torch.float32, 2), placeholder(x, torch.int64), 0, 0, 0,
            )
        return logits, latent


class OprojPublishKernel(GemmKernel):
    """``kimi::oproj_publish`` on CUDA: the partial rows into every rank's AttnRes box
    [1, TP, CAP, N] at source slot ``rank``."""

    check = staticmethod(oproj_op.check_oproj_publish)
    writes = "stores 16-byte packets: x, w and the boxes must be"

    def shape(self, x, w, boxes, rank):
        return w.shape[0], w.shape[1], x.shape[0], (False, 0, len(boxes))

    def prepare(self, n: int, k: int, tp: int, batches=None, peer_lists=()) -> None:
        self.prepare_buckets(n, k, (False, 0, tp), batches, peer_lists)

    def __call__(self, x, w, boxes, rank):
        self.variant(x, w, boxes, rank).run(
            x, w, placeholder(x, torch.bfloat16, 2), placeholder(x, torch.float32, 2), addresses(boxes),
            box_row(0, rank, 0, len(boxes), boxes[0].shape[2]), 0, 0,
        )


class OprojPushKernel(GemmKernel):
    """``kimi::oproj_push`` on CUDA: the shared expert's down projection, each row block
    into its owner's reduce-scatter box [3, TP, CAP, N/TP] at source ``rank`` (the push's
    stores in the GEMM's epilogue: no launch of their own)."""

    check = staticmethod(oproj_op.check_oproj_push)
    writes = "stores 16-byte packets: x, w and the boxes must be"

    def shape(self, x, w, rs_boxes, parity, rank):
        return w.shape[0], w.shape[1], x.shape[0], (False, 0, len(rs_boxes), True)

    def prepare(self, n: int, k: int, tp: int, batches=None, peer_lists=()) -> None:
        self.prepare_buckets(n, k, (False, 0, tp, True), batches, peer_lists)

    def __call__(self, x, w, rs_boxes, parity, rank):
        self.variant(x, w, rs_boxes, parity, rank).run(
            x, w, placeholder(x, torch.bfloat16, 2), placeholder(x, torch.float32, 2), addresses(rs_boxes),
            box_row(parity, rank, 0, len(rs_boxes), rs_boxes[0].shape[2]), 0, 0,
        )


class FrontPublishKernel(GemmKernel):
    """``kimi::moe_front_publish`` on CUDA: logits (FP32 words) and the latent shard into
    the front row of every rank's box [3, 1, CAP, TP·(L/TP + 2·E/TP)]."""

    check = staticmethod(front_op.check_moe_front_publish)
    writes = "stores 16-byte packets: x, w and the boxes must be"

    def shape(self, x, w, n_logits, boxes, parity, rank):
        return w.shape[0], w.shape[1], x.shape[0], (True, n_logits, len(boxes))

    def prepare(self, n: int, k: int, n_logits: int, tp: int, batches=None, peer_lists=()) -> None:
        self.prepare_buckets(n, k, (True, n_logits, tp), batches, peer_lists)

    def __call__(self, x, w, n_logits, boxes, parity, rank):
        tp, latent_shard = len(boxes), w.shape[0] - n_logits
        self.variant(x, w, n_logits, boxes, parity, rank).run(
            x, w, placeholder(x, torch.bfloat16, 2), placeholder(x, torch.float32, 2), addresses(boxes),
            box_row(parity, 0, 0, 1, boxes[0].shape[2]), rank * latent_shard, tp * latent_shard + 2 * rank * n_logits,
        )


# The fused shared expert (kernels/gemm/shared.py): its plans and grid, one compile per
# (gate/up N, K, down N, T, TP, situ, front N, n_logits); no front: 0, 0.


@compiled
def compile_shared(n_gate_up: int, k: int, n_down: int, tokens: int, tp: int, situ: tuple, n_front: int = 0,
                   n_logits: int = 0):
    batch, inner = cute.sym_int(), n_gate_up // 2
    return cute.compile(
        SharedExpert(shared_plan(n_gate_up, k, n_down, tokens, n_front), situ, tp, n_logits),
        fake(BFloat16, (batch, k)), fake(BFloat16, (n_gate_up, k)), fake(BFloat16, (batch, inner)),
        fake(BFloat16, (n_down, inner)), fake(Float32, (1, 1)), fake(Int64, (tp,), align=8),
        fake(Int64, (1,), align=8), fake(Int32, (1,), align=4), Int32(0),
        fake(BFloat16, (n_front or n_gate_up, k)), fake(Int64, (tp,), align=8), Int32(0), Int32(0), Int32(0),
        fake_stream(), options=compile_options(),
    )


def first_plans(n_gate_up: int, k: int, tokens: int, n_front: int) -> tuple[GemmPlan | None, GemmPlan]:
    """The plans before the barrier: the gate/up's (situ's) alone, or with the front's
    (:func:`~.plan.joint_partition`: one grid streams both)."""
    if not n_front:
        return None, plan_of(n_gate_up, k, tokens, True)
    parts = joint_partition([(n_front, 8), (n_gate_up, owned_rows(True))], k, tokens)
    if parts is None:
        raise ValueError(f"the front [{n_front}, {k}] and the gate/up [{n_gate_up}, {k}] take more than one wave "
                         f"of {tokens}-token CTAs together")
    return GemmPlan(n_front, k, tokens, parts[0]), GemmPlan(n_gate_up, k, tokens, parts[1], unit=owned_rows(True))


@functools.cache
def shared_plan(n_gate_up: int, k: int, n_down: int, tokens: int, n_front: int) -> SharedPlan:
    """The plans before the barrier (:func:`first_plans`; ``n_front`` 0: no front), the down's one tile a CTA over its
    whole K, and the grid of every bucket: the most CTAs the plans take at any T, in
    clusters of the largest split (every bucket's cluster size divides it). Unsupported
    where that grid is not resident at once or a plan does not fit."""
    inner = n_gate_up // 2
    try:
        firsts = {t: first_plans(n_gate_up, k, t, n_front) for t in TOKEN_TILES}
        down = GemmPlan(n_down, inner, tokens, (1, 1))
    except ValueError as why:
        raise Unsupported(f"the fused shared expert's plans: {why}") from None
    unit = max(SPLITS)
    widest = max(sum(p.ctas for p in plans if p is not None) for plans in firsts.values())
    grid = -(-max(down.ctas, widest) // unit) * unit
    plan = SharedPlan(firsts[tokens][1], down, grid, firsts[tokens][0])
    if down.ctas % plan.cluster:
        raise Unsupported(f"the fused shared expert's down tiles ({down.ctas}) must fill whole clusters of "
                          f"{plan.cluster} (a cluster past them skips the down whole)")
    if grid > RESIDENT[plan.cluster]:
        raise Unsupported(f"the fused shared expert's grid of {grid} CTAs is not resident at once in clusters of "
                          f"{plan.cluster} ({RESIDENT[plan.cluster]}: "
                          + ", ".join(f"{name} {p.ctas}" for name, p in zip(("front", "gate/up", "down"),
                                                                            (plan.front, plan.gate_up, down)) if p)
                          + " CTAs)")
    return plan


@functools.cache  # asked by unsupported and the call, as gemm_variant
def shared_variant(n_gate_up: int, k: int, n_down: int, batch: int, tp: int, situ: tuple, n_front: int = 0,
                   n_logits: int = 0) -> Variant:
    why = unsupported_shape(n_gate_up, k, batch, 0, owned_rows(situ)) or unsupported_shape(n_down, n_gate_up // 2, batch)
    if n_front:
        why = why or unsupported_shape(n_front, k, batch, n_logits)
    if why:
        raise Unsupported(why)
    tokens = token_tile(batch)
    plan = shared_plan(n_gate_up, k, n_down, tokens, n_front)
    if (n_down // tp) % TILE:
        raise Unsupported(f"the fused shared expert's down stores a CTA's {TILE} rows into one owner: N/TP must be a "
                          f"multiple of them (N={n_down}, TP={tp})")
    return engine_variant(lambda: compile_shared(n_gate_up, k, n_down, tokens, tp, situ, n_front, n_logits), plan)


class SharedExpertKernel(GemmKernel):
    """``kimi::shared_expert_push`` on CUDA: gate/up, situ, down and the reduce-scatter push
    in one launch, the activations through ``act``, a grid barrier on ``ticket``."""

    op = "shared_expert_push"
    check = staticmethod(oproj_op.check_shared_expert_push)
    writes = "stores 16-byte packets: x, the weights, act and the boxes must be"

    @staticmethod
    def split(x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank, error):
        """The call's shared expert arguments, and its front's (none here: (w, n_logits, boxes))."""
        return (x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank, error), None

    def variant(self, *call):
        (x, w_gate_up, w_down, beta, linear_beta, _, _, rs_boxes, *_), front = self.split(*call)
        n_front, n_logits = (front[0].shape[0], front[1]) if front else (0, 0)
        return shared_variant(w_gate_up.shape[0], w_gate_up.shape[1], w_down.shape[0], x.shape[0], len(rs_boxes),
                              (float(beta), float(linear_beta)), n_front, n_logits)

    def unsupported(self, *call):
        (x, w_gate_up, w_down, _, _, act, _, rs_boxes, *_), front = self.split(*call)
        if not aligned(x, w_gate_up, w_down, act, *rs_boxes, *(front[0], *front[2]) if front else ()):
            return f"the decode GEMM {self.writes} 16-byte aligned"
        return reason(lambda: self.variant(*call)) or hopper(x)

    def prefers(self, n_gate_up: int, k: int, n_down: int, n_front: int = 0) -> bool:
        """Where the push's own plan also takes the whole K in one CTA at every bucket (as the
        fused down does): one launch and one wave less, the same down. Where the push splits K
        it streams faster than the fused one-CTA tiles: at kimi_k3 TP1 (K = 6144) the fused op
        took 65.3 / 65.8 / 78.8 µs against the two ops' 62.6 / 63.3 / 75.0 at B = 1 / 8 / 64;
        at the TP8 rank (K = 768, split 1) the layer 67.2 / 78.7 / 107.1 against 68.1 / 79.6 /
        107.5 (benchmarks/NOTES.md). ``n_front``: and a grid that takes the front's rows too."""
        pushes = [partition(n_down, n_gate_up // 2, tokens) for tokens in TOKEN_TILES]
        return all(parts is not None and parts[1] == 1 for parts in pushes) and all(
            reason(lambda tokens=tokens: shared_plan(n_gate_up, k, n_down, tokens, n_front)) is None
            for tokens in TOKEN_TILES)

    def prepare(self, n_gate_up: int, k: int, n_down: int, beta: float, linear_beta: float, tp: int, batches=None,
                peer_lists=(), n_front: int = 0, n_logits: int = 0) -> None:
        prepare_all(lambda tokens=tokens: shared_variant(n_gate_up, k, n_down, tokens, tp,
                                                         (float(beta), float(linear_beta)), n_front, n_logits)
                    for tokens in tokens_of(batches))
        register_addresses(peer_lists)

    def __call__(self, *call):
        check_marks_room(self.op, call[-1])  # MARKS: every CTA's stamps after the error word
        (x, w_gate_up, w_down, _, _, act, ticket, rs_boxes, parity, rank, error), front = self.split(*call)
        batch, tp = x.shape[0], len(rs_boxes)
        if front:  # moe_front_publish's rows and columns (FrontPublishKernel)
            w_front, n_logits, front_boxes = front
            latent_shard = w_front.shape[0] - n_logits
            front_args = (w_front, addresses(front_boxes), box_row(parity, 0, 0, 1, front_boxes[0].shape[2]),
                          rank * latent_shard, tp * latent_shard + 2 * rank * n_logits)
        else:
            front_args = (w_gate_up, placeholder(x, torch.int64, 1, tp), 0, 0, 0)
        self.variant(*call).run(
            x, w_gate_up, tma_rows(act[:batch]), w_down, placeholder(x, torch.float32, 2), addresses(rs_boxes),
            ticket, error, box_row(parity, rank, 0, tp, rs_boxes[0].shape[2]), *front_args,
        )


class FrontSharedKernel(SharedExpertKernel):
    """``kimi::moe_front_shared_push`` on CUDA: the fused shared expert's launch with the MoE
    front's publish on CTAs of its own before the gate/up's (kernels/gemm/shared.py)."""

    op = "moe_front_shared_push"
    check = staticmethod(oproj_op.check_moe_front_shared_push)

    @staticmethod
    def split(x, w_front, n_logits, front_boxes, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity,
              rank, error):
        return (x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank, error), \
            (w_front, n_logits, front_boxes)


def register() -> None:
    backend.KERNELS.update(oproj=OprojKernel(), normed_oproj=NormedOprojKernel(), gate_up_situ=GateUpSituKernel(),
                           moe_front=FrontKernel(), oproj_publish=OprojPublishKernel(),
                           oproj_push=OprojPushKernel(), moe_front_publish=FrontPublishKernel(),
                           shared_expert_push=SharedExpertKernel(), moe_front_shared_push=FrontSharedKernel())
