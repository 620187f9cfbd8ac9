"""Composition bugs injected on purpose into a decoder's op calls (issue 35): each is one
a fused kernel could plausibly make, leaves every op's own test green, and must take the
decoder guard's drift far outside the reference's spread. Each is a dispatch mode over
the ``kimi`` calls of one decoder, so it bites the reference and the CuTe path alike."""

import torch

from kimi_ops.debug import KimiOpMode

kimi = torch.ops.kimi


def bugs(decoder) -> dict:
    """Each bug's name → a factory of its mode over ``decoder`` (the stale parity in its
    last layer, the skipped share that of its last rank)."""
    return {
        "stale parity": lambda: StaleParity(decoder, len(decoder.layers) - 1),
        "drop slot 15": lambda: DropSlot(15),
        "drop slot 0": lambda: DropSlot(0),
        "skip a rank's shared partial": lambda: SkipShared(decoder.group.ranks[-1]),
    }


class StaleParity(KimiOpMode):
    """Layer ``layer``'s tail consumer reads the previous MoE layer's parity and re-arms its
    own (the two arguments swapped): it sums last layer's latent and shared rows, which are
    still published there, so no poll times out. The serving op is split into its publish
    (right parity) and the swapped poll."""

    def __init__(self, decoder, layer: int):
        super().__init__()
        self.w_up = {part.tail.w_up.data_ptr() for part in decoder.layers[layer]}

    def kimi_op(self, func, args, kwargs):
        if func is kimi.moe_tail_poll.default and args[3].data_ptr() in self.w_up:
            args[7], args[8] = args[8], args[7]
        elif func is kimi.moe_tail_serve.default and args[5].data_ptr() in self.w_up:
            (expanded, weights, latent_boxes, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm, rearm_batch,
             rank) = args
            kimi.moe_tail_publish(expanded, weights, latent_boxes, parity, rank)
            return kimi.moe_tail_poll(latent_boxes[rank], rs_box, gamma, w_up, eps, out_boxes, error, rearm, parity,
                                      rearm_batch, rank, expanded.shape[0])
        return func(*args, **kwargs)


class DropSlot(KimiOpMode):
    """Every tail leaves expert slot ``slot`` out of the weighted sum (a loop bound one short
    for slot 15)."""

    def __init__(self, slot: int):
        super().__init__()
        self.slot = slot

    def kimi_op(self, func, args, kwargs):
        if func in (kimi.moe_tail_publish.default, kimi.moe_tail_serve.default):
            expanded = args[0].clone()
            expanded[:, self.slot] = 0
            args[0] = expanded
        return func(*args, **kwargs)


class SkipShared(KimiOpMode):
    """Rank ``rank``'s shared-expert shards never reach the tail's sum: it pushes zeros."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def kimi_op(self, func, args, kwargs):
        if func is kimi.oproj_push.default and args[4] == self.rank:  # zero rows in: zero shards out
            args[0] = torch.zeros_like(args[0])
        return func(*args, **kwargs)
