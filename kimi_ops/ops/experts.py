"""The routed experts' stand-in (DESIGN §2: rows [B, 16, L] of this rank's experts; not a
seed kernel): ``kimi::routed_experts``, and ``kimi::routed_experts_counted`` after a route
poll that counts its outputs."""

import torch

from ..checks import check_placement, check_same_device, check_tensor, fail, is_int
from ..config import TOP_K
from ..mailbox import EXPERTS_READY
from .boxes import check_error, check_ready
from .route import situ


def check_routed_experts(latent, ids, gate_up, down, rank, tp, op="routed_experts") -> tuple[int, int, int, int]:
    """Returns (B, L, E, I)."""
    check_tensor(op, "latent", latent, torch.bfloat16, (None, None))
    batch, width = latent.shape
    check_tensor(op, "ids", ids, torch.int32, (batch, TOP_K))
    check_tensor(op, "gate_up", gate_up, torch.bfloat16, (None, None, width))
    experts, double = gate_up.shape[:2]
    if double % 2 or not experts:
        fail(op, "gate_up", "[E ≥ 1, 2I, L] (an even 2I)", list(gate_up.shape))
    check_tensor(op, "down", down, torch.bfloat16, (experts, width, double // 2))
    if not (is_int(tp) and tp >= 1 and experts % tp == 0):
        fail(op, "tp", f"a positive int dividing E = {experts}", tp)
    if not (is_int(rank) and 0 <= rank < tp):
        fail(op, "rank", f"in [0, {tp})", rank)
    check_same_device(op, latent=latent, ids=ids, gate_up=gate_up, down=down)
    return batch, width, experts, double // 2


def mine(ids, experts: int, rank: int, tp: int) -> torch.Tensor:
    """[B, 16] bool: the pairs whose expert this rank serves (ids outside [0, E): none)."""
    return (ids >= 0) & (ids < experts) & (ids // (experts // tp) == rank)


def routed_experts(latent, ids, gate_up, down, rank: int, tp: int):
    """Each token's 16 experts on its latent row: [B, 16, L] bf16, the rows of experts
    another rank serves (and of ids outside [0, E)) zero. Per expert a SwiGLU in the latent
    space: hidden = FP32(gate_up[e] · latent), act = situ(hidden) (BF16), row =
    BF16(FP32(down[e] · act)). Each dot product of BF16 values is formed in float64 (exact
    products, a sum that every order gives alike but at float64's own rounding) and
    rounded once to FP32, so no summation order (eager's, Inductor's, a kernel's) changes
    a bit. The CUDA kernel's pair and by-expert forms do the same and take finite weights
    (they widen them from their bits); its streamed form (kernels/experts/stream.py, large
    batches) sums in FP32 on tensor cores: each row within an ulp at its terms' scale, a
    small share of rows not bit-equal, every run the same bits."""
    return expert_rows(latent, ids, gate_up, down, rank, tp, check_routed_experts(latent, ids, gate_up, down, rank, tp))


def expert_rows(latent, ids, gate_up, down, rank, tp, shape) -> torch.Tensor:
    """:func:`routed_experts`' rows, its arguments checked (``shape``: the check's)."""
    batch, _, experts, intermediate = shape
    served = mine(ids, experts, rank, tp)
    index = torch.where(served, ids, 0).long()
    hidden = torch.einsum("bl,bril->bri", latent.double(), gate_up[index].double()).float()
    # the row width spelled out: at B = 0 a reshape cannot infer it
    act = situ(hidden.reshape(batch * TOP_K, 2 * intermediate), 1.0, 0.0).view(batch, TOP_K, intermediate)
    rows = torch.einsum("bri,brli->brl", act.double(), down[index].double()).float().bfloat16()
    return torch.where(served.unsqueeze(-1), rows, torch.zeros_like(rows))


def routed_experts_fake(latent, ids, gate_up, down, rank, tp):
    batch, width, _, _ = check_routed_experts(latent, ids, gate_up, down, rank, tp)
    return latent.new_empty((batch, TOP_K, width))


def check_routed_experts_counted(latent, ids, gate_up, down, rank, tp, ready, error) -> tuple[int, int, int, int]:
    op = "routed_experts_counted"
    shape = check_routed_experts(latent, ids, gate_up, down, rank, tp, op)
    check_ready(op, ready)
    check_error(op, error)
    check_placement(op, dict(ready=ready, error=error), dict(latent=latent, ids=ids, gate_up=gate_up, down=down))
    return shape


def routed_experts_counted(latent, ids, gate_up, down, rank: int, tp: int, ready, error):
    """:func:`routed_experts` of ``kimi::moe_route_poll``'s ``ids`` and ``latent`` when that
    poll counted its outputs into ``ready``: the kernel waits until ``ready[0]`` counts the
    poll's 2B CTAs (bounded: past it the error word gets EXPERTS_READY) instead of the end
    of every kernel launched before it, and zeroes the counter for the next step."""
    shape = check_routed_experts_counted(latent, ids, gate_up, down, rank, tp, ready, error)
    error.bitwise_or_((ready[0] < 2 * shape[0]).to(torch.int32) * EXPERTS_READY)
    ready.zero_()
    return expert_rows(latent, ids, gate_up, down, rank, tp, shape)


def routed_experts_counted_fake(latent, ids, gate_up, down, rank, tp, ready, error):
    batch, width, _, _ = check_routed_experts_counted(latent, ids, gate_up, down, rank, tp, ready, error)
    return latent.new_empty((batch, TOP_K, width))
