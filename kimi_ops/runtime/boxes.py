"""The model-owned box set of one TP group (the seeds' ``MoeTailBox``, widened to the
whole decode layer)."""

import torch
from torch import nn

from ..config import KimiConfig
from ..kernels.launch import MARK_WORDS, MARKS
from ..mailbox import PACKET
from .groups import Boxes

# The tail's latent all-reduce goes two-shot (the seeds' common.twoshot) from TP4 and 9
# tokens on: partial chunks to their column owners, summed there, gathered; each rank then
# receives 2·B·L values instead of TP·B·L (at TP2 and small batches one shot's single
# wait is cheaper).
TWO_SHOT_TP, TWO_SHOT_BATCH = 4, 9
# The kernels compile per 8-token group (KimiDecoder.buckets): a group's batches must
# all take one path.
assert (TWO_SHOT_BATCH - 1) % 8 == 0


def two_shot(tp: int, latent: int, batch: int) -> bool:
    """Whether a batch's latent all-reduce is two-shot (identical on every rank)."""
    return tp >= TWO_SHOT_TP and batch >= TWO_SHOT_BATCH and latent % (PACKET * tp) == 0


def static(box: torch.Tensor) -> torch.Tensor:
    """Mark a box's address static for torch.compile: cudagraph trees must pass the box
    itself to the ops, never a copy (peers and kernels hold its address)."""
    torch._dynamo.mark_static_address(box)
    return box


class DecodeBoxes(nn.Module):
    """Every mailbox of the decode path, allocated once (before any capture) and armed:

    - ``attn`` [1, TP, CAP, H]: o-proj partial rows, slot = rank (AttnRes input);
    - ``front`` [3, 1, CAP, L + 2E]: the front row, latent then logits as FP32 words;
    - ``latent`` [3, TP, CAP, L]: the tail's latent partials (all-reduce sources);
    - ``recv`` [3, TP, CAP, L/TP] and ``gathered`` [3, 1, CAP, L] where some batch goes
      two-shot (:func:`two_shot`): the partials' column chunk this rank owns, from every
      rank, and the summed rows of every owner (moe_latent_reduce, then moe_tail_poll);
    - ``rs`` [3, TP, CAP, H/TP]: the shared expert's reduce-scatter shards;
    - ``out`` [1, 1, CAP, H]: the tail's output rows (the next AttnRes input);
    - ``sync`` [1, TP, 1, 8]: the group barrier's tickets, a packet per rank
      (``kimi::group_barrier``; multi-process groups only call it);
    - ``error`` [1] int32 per rank: bits of the polls that found nothing; with KIMI_OPS_MARKS,
      the first word of ``marks`` [MARK_WORDS] (kernels.values.Marks' records and the fused
      shared expert's Stamps follow it);
    - ``ticket`` [1] int64 per rank: the group barrier's monotonic counter;
    - ``shared_act`` [CAP, S/TP] BF16 and ``shared_ticket`` [1] int64 per rank: the fused
      shared expert's activations (its down reads them) and its grid barrier's counter
      (``kimi::shared_expert_push``);
    - ``moe_input`` [CAP, H] BF16 per rank: the MoE sublayer's input h_normed
      (``kimi::attn_res_take_into``), owned here because the fused shared expert may
      still read it while later kernels run and allocate (PreparedFront.run);
    - ``routed_ready`` [2] int64 per rank: the route poll's CTAs counted once their
      outputs are stored, and the routed experts' CTAs past their wait for that count
      (the last zeroes both), where the experts run beside the fused shared expert.

    The boxes this process owns are buffers (``{kind}_{rank}``); ``peers(kind, rank)`` is
    the ``boxes`` argument of a publishing op on that rank.
    """

    def __init__(self, group, config: KimiConfig, device):
        super().__init__()
        tp, cap = group.tp, config.capacity
        h, l, e = config.hidden, config.latent, config.experts
        shapes = {
            "attn": (1, tp, cap, h),
            "front": (3, 1, cap, l + 2 * e),
            "latent": (3, tp, cap, l),
            "rs": (3, tp, cap, h // tp),
            "out": (1, 1, cap, h),
            "sync": (1, tp, 1, PACKET),
        }
        self.tp, self.latent = tp, l
        if two_shot(tp, l, cap):
            shapes.update(recv=(3, tp, cap, l // tp), gathered=(3, 1, cap, l))
        self.kinds = tuple(shapes)
        self.ranks = group.ranks
        self._peers: dict[str, dict[int, list[torch.Tensor]]] = {}
        for kind, shape in shapes.items():
            boxes: Boxes = group.allocate(shape, device)
            for rank, box in zip(group.ranks, boxes.owned):
                self.register_buffer(f"{kind}_{rank}", box)
            for peers in boxes.peers.values():  # the owned boxes and the peers' views
                for box in peers:
                    static(box)
            self._peers[kind] = boxes.peers
        for rank in group.ranks:
            error = torch.zeros(1, dtype=torch.int32, device=device)
            if MARKS:
                self.register_buffer(f"marks_{rank}", torch.zeros(MARK_WORDS, dtype=torch.int32, device=device))
                error = self.marks(rank)[:1]
            self.register_buffer(f"error_{rank}", static(error))
            self.register_buffer(f"ticket_{rank}", static(torch.zeros(1, dtype=torch.int64, device=device)))
            self.register_buffer(f"shared_act_{rank}", static(torch.zeros(cap, config.shared_intermediate // tp,
                                                                            dtype=torch.bfloat16, device=device)))
            self.register_buffer(f"shared_ticket_{rank}", static(torch.zeros(1, dtype=torch.int64, device=device)))
            self.register_buffer(f"moe_input_{rank}", static(torch.zeros(cap, h, dtype=torch.bfloat16, device=device)))
            self.register_buffer(f"routed_ready_{rank}", static(torch.zeros(2, dtype=torch.int64, device=device)))

    def two_shot(self, batch: int) -> bool:
        return two_shot(self.tp, self.latent, batch)

    def own(self, kind: str, rank: int) -> torch.Tensor:
        return getattr(self, f"{kind}_{rank}")

    def peers(self, kind: str, rank: int) -> list[torch.Tensor]:
        return self._peers[kind][rank]

    def error(self, rank: int) -> torch.Tensor:
        return getattr(self, f"error_{rank}")

    def marks(self, rank: int) -> torch.Tensor:
        """KIMI_OPS_MARKS: the error word and the marks' words after it."""
        return getattr(self, f"marks_{rank}")

    def ticket(self, rank: int) -> torch.Tensor:
        return getattr(self, f"ticket_{rank}")

    def shared(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused shared expert's activations and grid-barrier counter."""
        return getattr(self, f"shared_act_{rank}"), getattr(self, f"shared_ticket_{rank}")

    def moe_input(self, rank: int) -> torch.Tensor:
        return getattr(self, f"moe_input_{rank}")

    def routed_ready(self, rank: int) -> torch.Tensor:
        """The route poll's ready counter that the routed experts wait for (ops/boxes.check_ready)."""
        return getattr(self, f"routed_ready_{rank}")

    def reset(self) -> None:
        """Re-arm every box this process owns, clear its error words and restart its
        barrier tickets, the shared expert's too (in place: the addresses peers and captured
        graphs hold stay valid)."""
        for rank in self.ranks:
            for kind in self.kinds:
                torch.ops.kimi.mailbox_arm(self.own(kind, rank))
            self.error(rank).zero_()
            self.ticket(rank).zero_()
            self.shared(rank)[1].zero_()
            self.routed_ready(rank).zero_()
