"""One rank's prepared parts of a decode layer (the seeds' ``Prepared*`` runtime objects):
weight shards as buffers, the layer's parities, and the op calls of each kernel family.
CuTe kernels slot in under the ops; the parts stay as they are."""

import torch
from torch import nn

from .. import backend
from ..config import KimiConfig
from ..ops.dsa import KEY_BYTES
from ..ops.oproj import deinterleave_gate_up, interleave_gate_up
from .boxes import DecodeBoxes

kimi = torch.ops.kimi


def shard(w: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return w.chunk(tp, dim)[rank].contiguous()


class Prepared(nn.Module):
    """A part's ``prepare(batches, boxes)`` compiles (or loads) the kernels of every call its
    ``run`` makes at those batches, from its own weights' shapes and boxes: at the
    decoder's construction, never inside a capture."""

    def __init__(self, config: KimiConfig, tp: int, rank: int, **buffers: torch.Tensor):
        super().__init__()
        self.config, self.tp, self.rank = config, tp, rank
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)

    def prepare(self, batches: list[int], boxes: DecodeBoxes) -> None:
        raise NotImplementedError


class PreparedIndexFront(Prepared):
    """The DSA index front (replicated on every rank) and the layer's key cache. The three
    projections of x (wq_a, w_head, wk) are one GEMM over their stacked rows ``w_in``: x is
    read once, and the two small ones (32 and 128 rows) pay no launch of their own; their
    outputs are column views of its rows, which the consumers take as they are."""

    SPLITS = ("wq_a", "w_head", "wk")

    def __init__(self, config, tp, rank, attention):
        super().__init__(
            config, tp, rank, w_in=torch.cat([getattr(attention, name) for name in self.SPLITS]),
            q_norm_w=attention.q_norm_w, wq_b=attention.wq_b, k_norm_w=attention.k_norm_w,
            k_norm_b=attention.k_norm_b, index_cache=torch.zeros(config.index_slots, KEY_BYTES, dtype=torch.uint8),
        )
        self.sizes = [getattr(attention, name).shape[0] for name in self.SPLITS]

    def weight(self, name: str) -> torch.Tensor:
        """One projection's rows of ``w_in`` (a view)."""
        return self.w_in.split(self.sizes)[self.SPLITS.index(name)]

    def prepare(self, batches, boxes):
        backend.prepare("oproj", *self.w_in.shape, batches)
        backend.prepare("normed_oproj", *self.w_in.shape, batches)  # the buckets it serves (layer 0's)
        backend.prepare("dsa_index_front_keys", self.wq_b.shape[1], batches, (True,))  # raw rows: q_norm_w given

    def run(self, x, slots, norm_w=None):
        """q_c (the raw rows the front normalizes), the FP8 query and head weights; the
        keys go into the cache at ``slots`` in the front's launch. ``norm_w``: x holds raw
        rows, RMS-normalized with it in the stacked GEMM's launch (``kimi::normed_oproj``)."""
        if norm_w is None:
            stacked = kimi.oproj(x, self.w_in)
        else:
            stacked = kimi.normed_oproj(x, self.w_in, norm_w, self.config.eps)
        q_c, head_in, k_in = stacked.split(self.sizes, dim=1)
        q, head_w = kimi.dsa_index_front_keys(q_c, self.wq_b, head_in, self.q_norm_w, k_in, self.k_norm_w,
                                              self.k_norm_b, self.config.eps, self.index_cache, slots)
        return q_c, q, head_w


class PreparedOproj(Prepared):
    """The stand-in attention core's K/TP columns, attn = BF16(q_c @ w_core.T), and the
    o-proj producer over this rank's shard [H, K/TP]."""

    def __init__(self, config, tp, rank, attention):
        super().__init__(
            config, tp, rank, w_core=shard(attention.w_core, tp, rank), w_o=shard(attention.w_o, tp, rank, dim=1)
        )

    def prepare(self, batches, boxes):
        backend.prepare("oproj", *self.w_core.shape, batches)
        backend.prepare("oproj_publish", *self.w_o.shape, self.tp, batches, [boxes.peers("attn", self.rank)])

    def run(self, q_c, boxes: DecodeBoxes):
        kimi.oproj_publish(kimi.oproj(q_c, self.w_core), self.w_o, boxes.peers("attn", self.rank), self.rank)


class PreparedFront(Prepared):
    """The MoE front [router shard; down shard], routing, the shared expert
    ([gate shard; up shard] interleaved for ``kimi::gate_up_situ``, down shard [H, S/TP])
    and this rank's routed experts (experts [rank·E/TP, (rank+1)·E/TP); the others' rows
    are zero)."""

    def __init__(self, config, tp, rank, moe, parity, device: torch.device):
        """``device``: where the decoder runs (the fused forms are a CUDA decoder's choice)."""
        e, s = config.experts, config.shared_intermediate
        super().__init__(
            config, tp, rank,
            front=torch.cat([shard(moe.front[:e], tp, rank), shard(moe.front[e:], tp, rank)]),
            bias=moe.bias,
            shared_gate_up=interleave_gate_up(
                torch.cat([shard(moe.shared_gate_up[:s], tp, rank), shard(moe.shared_gate_up[s:], tp, rank)])),
            shared_down=shard(moe.shared_down, tp, rank, dim=1),
            expert_gate_up=moe.expert_gate_up, expert_down=moe.expert_down,
        )
        self.parity = parity
        # The shared expert in one launch (kimi::shared_expert_push) where the decoder serves
        # alone (its grid barrier needs its whole grid resident, which ranks sharing a GPU
        # cannot promise) and where its kernel is the faster form (the TP8 rank's shapes, not
        # kimi_k3's: SharedExpertKernel.prefers)
        self.fused_shared = tp == 1 and backend.prefers("shared_expert_push", device, *self.shared_gate_up.shape,
                                                        self.shared_down.shape[0])
        # the fused launch before routing, which runs beside it (run): RankLayer decides,
        # bench_layer --shared-last is the A/B
        self.shared_first = False
        # and the front's publish inside that launch (kimi::moe_front_shared_push) where its grid
        # takes the front's rows too: both read x, both weights stream at once (bench_layer
        # --front-apart is the A/B)
        self.front_inside = self.fused_shared and backend.prefers(
            "moe_front_shared_push", device, *self.shared_gate_up.shape, self.shared_down.shape[0], self.front.shape[0])

    def prepare(self, batches, boxes):
        config, tp, rank = self.config, self.tp, self.rank
        backend.prepare("moe_front_publish", *self.front.shape, config.experts // tp, tp, batches,
                        [boxes.peers("front", rank)])
        counted = self.leads_with_shared()  # the route poll's ready count, the experts' wait for it
        backend.prepare("moe_route_poll", config.experts, config.latent, config.renorm, (counted,))
        backend.prepare("gate_up_situ", *self.shared_gate_up.shape, 1.0, 0.0, batches)
        backend.prepare("oproj_push", *self.shared_down.shape, tp, batches, [boxes.peers("rs", rank)])
        if self.fused_shared:
            backend.prepare("shared_expert_push", *self.shared_gate_up.shape, self.shared_down.shape[0], 1.0, 0.0, tp,
                            batches, [boxes.peers("rs", rank)])
        if self.front_inside:
            backend.prepare("moe_front_shared_push", *self.shared_gate_up.shape, self.shared_down.shape[0], 1.0, 0.0,
                            tp, batches, [boxes.peers("rs", rank), boxes.peers("front", rank)], self.front.shape[0],
                            config.experts // tp)
        backend.prepare("routed_experts_counted" if counted else "routed_experts", config.latent,
                        self.expert_down.shape[2])

    def publish(self, x, boxes: DecodeBoxes):
        """The front's publish; where :meth:`fronts_shared`, the shared expert's launch with it."""
        n_logits, rank = self.config.experts // self.tp, self.rank
        if self.fronts_shared():
            kimi.moe_front_shared_push(x, self.front, n_logits, boxes.peers("front", rank), self.shared_gate_up,
                                       self.shared_down, 1.0, 0.0, *boxes.shared(rank), boxes.peers("rs", rank),
                                       self.parity, rank, boxes.error(rank))
        else:
            kimi.moe_front_publish(x, self.front, n_logits, boxes.peers("front", rank), self.parity, rank)

    def run(self, x, boxes: DecodeBoxes):
        """Route (polled), this rank's routed experts and the shared expert with its
        reduce-scatter shards pushed by its down projection's epilogue; returns this rank's
        expert rows [B, 16, L] and the routing weights.

        Where the shared expert is fused and ``shared_first`` (the default), its one launch comes
        first and releases its dependents once its predecessor has ended; neither the route
        poll after it nor the experts wait for its end (a PDL wait would: a grid ends only
        after the grids launched before it), the experts wait for the route poll's ready
        count instead, so routing and the experts run beside it (the tail waits for both).
        That is safe because nothing after it frees what it reads: its input ``x`` is
        ``DecodeBoxes.moe_input``, its workspaces the model's. Otherwise the chain is
        route, experts, then the shared expert (its gate/up streams its weights beside their
        latency-bound grids)."""
        first = self.leads_with_shared()
        if first and not self.fronts_shared():  # (else publish launched it)
            self.shared(x, boxes)
        expanded, weights = self.route_experts(x.shape[0], boxes, counted=first)
        if not first:
            self.shared(x, boxes)
        return expanded, weights

    def leads_with_shared(self) -> bool:
        return self.fused_shared and self.shared_first

    def fronts_shared(self) -> bool:
        """The front's publish and the fused shared expert in one launch (``front_inside``),
        where that launch leads routing."""
        return self.leads_with_shared() and self.front_inside

    def route_experts(self, batch, boxes: DecodeBoxes, counted: bool):
        """``counted``: the experts wait for the route poll's ready count, not its end."""
        config, rank = self.config, self.rank
        ready = boxes.routed_ready(rank) if counted else None
        ids, weights, latent = kimi.moe_route_poll(
            boxes.own("front", rank), self.bias, config.routed_scale, config.renorm,
            self.parity, batch, boxes.error(rank), ready,
        )
        if counted:
            return kimi.routed_experts_counted(latent, ids, self.expert_gate_up, self.expert_down, rank, self.tp,
                                               ready, boxes.error(rank)), weights
        return self.experts(latent, ids), weights

    def shared(self, x, boxes: DecodeBoxes):
        rank = self.rank
        if self.fused_shared:
            kimi.shared_expert_push(x, self.shared_gate_up, self.shared_down, 1.0, 0.0, *boxes.shared(rank),
                                    boxes.peers("rs", rank), self.parity, rank, boxes.error(rank))
        else:
            act = kimi.gate_up_situ(x, self.shared_gate_up, 1.0, 0.0)
            kimi.oproj_push(act, self.shared_down, boxes.peers("rs", rank), self.parity, rank)

    def shared_gate_up_rows(self) -> torch.Tensor:
        """The shared expert's gate/up shard as [gate; up] rows (a copy)."""
        return deinterleave_gate_up(self.shared_gate_up.T).T.contiguous()

    def experts(self, latent, ids):
        """This rank's routed experts' rows [B, 16, L] (the others' zero)."""
        return kimi.routed_experts(latent, ids, self.expert_gate_up, self.expert_down, self.rank, self.tp)


class PreparedTail(Prepared):
    """The MoE tail: this rank's H/TP up-projection rows, the RMS weight, and the parities
    of its MoE ordinal (publish into ``parity``; re-arm ``rearm``, the previous MoE
    layer's, for the batch it ran — the first layer re-arms the whole capacity, the
    largest batch the last layer may have published)."""

    def __init__(self, config, tp, rank, moe, parity, rearm, wrap):
        super().__init__(config, tp, rank, w_up=shard(moe.w_up, tp, rank), gamma=moe.gamma)
        self.parity, self.rearm, self.wrap = parity, rearm, wrap

    def prepare(self, batches, boxes):
        latent, tp, rank, (shard, _) = self.config.latent, self.tp, self.rank, self.w_up.shape
        gathered = [b for b in batches if boxes.two_shot(b)]
        receivers = [boxes.peers("recv", rank)] if gathered else []
        backend.prepare("moe_tail_publish", latent, tp, [boxes.peers("latent", rank)] + receivers,
                        (0, latent // tp) if gathered else (0,))
        if gathered:
            backend.prepare("moe_latent_reduce", latent // tp, tp, [boxes.peers("gathered", rank)])
        backend.prepare("moe_tail_poll", tp, shard, latent, batches, [boxes.peers("out", rank)], gathered)
        if tp == 1:  # the decoder serves the tail (KimiDecoder.serving)
            backend.prepare("moe_tail_serve", tp, shard, latent, batches, [boxes.peers("latent", rank)],
                            [boxes.peers("out", rank)])

    def publish(self, expanded, weights, boxes: DecodeBoxes):
        """The partial latent into every rank's latent box, or (two-shot) its column chunks
        into their owners' receive boxes."""
        kind = "recv" if boxes.two_shot(expanded.shape[0]) else "latent"
        kimi.moe_tail_publish(expanded, weights, boxes.peers(kind, self.rank), self.parity, self.rank)

    def rearm_batch(self, batch: int) -> int:
        return self.config.capacity if self.wrap else batch

    def reduce(self, batch: int, boxes: DecodeBoxes):
        """Two-shot: our latent chunk summed from the receive box into every rank's gathered box."""
        rank = self.rank
        kimi.moe_latent_reduce(boxes.own("recv", rank), boxes.peers("gathered", rank), boxes.error(rank), self.parity,
                               self.rearm, self.rearm_batch(batch), rank, batch)

    def run(self, batch: int, boxes: DecodeBoxes):
        rank, config = self.rank, self.config
        kimi.moe_tail_poll(
            boxes.own("gathered" if boxes.two_shot(batch) else "latent", rank), boxes.own("rs", rank), self.gamma,
            self.w_up, config.eps, boxes.peers("out", rank), boxes.error(rank), self.parity, self.rearm,
            self.rearm_batch(batch), rank, batch,
        )

    def serve(self, expanded, weights, boxes: DecodeBoxes):
        """publish and run in one op: for groups whose ranks
        run concurrently (TP1, one process a rank)."""
        rank, config, batch = self.rank, self.config, expanded.shape[0]
        kimi.moe_tail_serve(
            expanded, weights, boxes.peers("latent", rank), boxes.own("rs", rank), self.gamma, self.w_up, config.eps,
            boxes.peers("out", rank), boxes.error(rank), self.parity, self.rearm, self.rearm_batch(batch), rank,
        )
