"""A Kimi-K3 decode stack over the ``kimi`` ops and the model's mailboxes.

Per layer and rank: the DSA index front (its keys into the layer's index cache), a
stand-in attention core, the o-proj producer publishing partial rows, AttnRes over them,
the MoE front publishing the front row, routing polling it, the shared expert pushing its
reduce-scatter shards, the routed experts, and the tail publishing, polling and writing
the output rows that the next AttnRes consumes.

The attention core is a documented stand-in (not a seed kernel): attn = BF16(q_c @
w_core.T), fed by q_c, the DSA index front's input rows; each rank computes its K/TP
columns. Routed experts are a stand-in in the latent space (``kimi::routed_experts``);
rank r serves experts [r·E/TP, (r+1)·E/TP) and zeroes the rows of the others.
"""

import sys
from dataclasses import dataclass

import torch
from torch import nn

from .. import backend
from ..checks import fail_setting, is_int
from ..config import INDEX_DIM, INDEX_HEADS, PACKED, KimiConfig
from ..mailbox import KimiMailboxError, parities, raise_if_error
from ..moe import MoeWeights
from ..progress import Progress
from .boxes import DecodeBoxes
from .groups import make_group
from .prepared import PreparedFront, PreparedIndexFront, PreparedOproj, PreparedTail

kimi = torch.ops.kimi


def weight(gen, *shape, scale=None):
    """BF16 [out, in] with unit-variance outputs (scale defaults to in^-0.5)."""
    return (torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)).bfloat16()


def norm_weight(gen, n):
    return (1 + 0.1 * torch.randn(n, generator=gen)).bfloat16()


@dataclass
class AttnResWeights:
    query: torch.Tensor  # [H]
    key_norm_w: torch.Tensor  # [H]
    out_norm_w: torch.Tensor  # [H]

    @classmethod
    def random(cls, config: KimiConfig, gen):
        h = config.hidden
        return cls(weight(gen, h, scale=h**-0.5), norm_weight(gen, h), norm_weight(gen, h))


@dataclass
class AttentionWeights:
    wq_a: torch.Tensor  # [q_lora, H]: q_c, the index front's raw rows
    q_norm_w: torch.Tensor  # [q_lora]
    wq_b: torch.Tensor  # [32·128, q_lora]
    w_head: torch.Tensor  # [32, H]: the indexer's per-head weight inputs
    wk: torch.Tensor  # [128, H]: indexer keys
    k_norm_w: torch.Tensor  # [128]
    k_norm_b: torch.Tensor  # [128]
    w_core: torch.Tensor  # [K, q_lora]: the stand-in attention core
    w_o: torch.Tensor  # [H, K]

    @classmethod
    def random(cls, config: KimiConfig, gen):
        h, q, k = config.hidden, config.q_lora, config.attn_out
        return cls(
            weight(gen, q, h), norm_weight(gen, q), weight(gen, INDEX_HEADS * INDEX_DIM, q), weight(gen, INDEX_HEADS, h),
            weight(gen, INDEX_DIM, h), norm_weight(gen, INDEX_DIM), weight(gen, INDEX_DIM, scale=0.1),
            weight(gen, k, q), weight(gen, h, k),
        )


def buckets(capacity: int) -> list[int]:
    """The batches that stand for every kernel variant: one compile per 8-token MMA group
    count, the capacity the last."""
    return sorted({min(bucket, capacity) for bucket in range(8, capacity + 8, 8)})


class RankLayer(nn.Module):
    """One layer on one rank: its prepared parts, in the order the decoder drives them."""

    def __init__(self, config, attention: AttentionWeights, moe: MoeWeights, tp, rank, ordinal, count,
                 device: torch.device):
        """``device``: where the decoder runs, or stands for (the weights are built on the
        CPU, then moved): the kernels' choices of form are for it."""
        super().__init__()
        parity, rearm = parities(ordinal, count)
        self.rank = rank
        self.index = PreparedIndexFront(config, tp, rank, attention)
        self.oproj = PreparedOproj(config, tp, rank, attention)
        self.front = PreparedFront(config, tp, rank, moe, parity, device)
        self.tail = PreparedTail(config, tp, rank, moe, parity, rearm, wrap=ordinal == 0)
        # The fused shared expert leads routing only where the tail's kernel polls its shards:
        # the reference's plain loads would not wait for a shared expert still running.
        self.front.shared_first = backend.serves("moe_tail_poll", device, tp, self.tail.w_up.shape[0], config.latent,
                                                 buckets(config.capacity))

    def attention(self, x, slots, boxes: DecodeBoxes, norm_w=None):
        """The index front (keys into the cache), the stand-in core and the o-proj publish;
        ``norm_w``: x holds raw rows, RMS-normalized with it first (the embedding's AttnRes)."""
        q_c, _, _ = self.index.run(x, slots, norm_w)
        self.oproj.run(q_c, boxes)

    def front_publish(self, x, boxes: DecodeBoxes):
        self.front.publish(x, boxes)

    def experts(self, x, boxes: DecodeBoxes, serving: bool):
        """Routing, the shared expert's push, the routed experts, and the tail's publish
        unless ``serving`` (the tail phase publishes then: returns the rows and weights)."""
        expanded, weights = self.front.run(x, boxes)
        if serving:
            return expanded, weights
        self.tail.publish(expanded, weights, boxes)
        return None


def prepare_residuals(config: KimiConfig, num_layers: int, tp: int, batches) -> None:
    """The AttnRes kernels of a decoder of ``num_layers`` layers: the embedding's, and after
    each sublayer the o-proj rows (TP sources) and the tail's rows, for every count of
    completed blocks a residual sees."""
    counts = range((num_layers - 1) // config.attn_res_block + 1)
    backend.prepare("attn_res", config.hidden, (1,), counts, batches)
    backend.prepare("attn_res_take", config.hidden, (tp, 1), counts, batches)


class KimiDecoder(nn.Module):
    """``num_layers`` Kimi-K3 decode layers (every layer MoE) over one TP group.

    ``tp``: 1, a rank count (a simulated group: all ranks in this process, run phase by
    phase) or a group object (:class:`~kimi_ops.runtime.groups.SymmMemGroup`). Weights are
    drawn from ``seed`` at TP1 and sharded, so decoders of any TP share them. AttnRes
    blocks hold ``config.attn_res_block`` layers; the embedding opens the first one.

    ``forward(hidden [B, H] bf16, slots [B] int64 = arange(B))`` returns the last
    AttnRes aggregate h [B, H] of rank ``group.ranks[0]``. All state lives in buffers
    allocated here; eager calls check the error words and raise
    :class:`~kimi_ops.mailbox.KimiMailboxError`; compiled and graph-replaying callers
    call :meth:`check` (a host sync) when they choose. After a fault the error word stays
    set (every later step raises) until :meth:`reset`.

    On CUDA the kernels of every batch bucket are compiled or loaded here; ``progress``
    reports them on stderr (None: where stderr is a TTY; :meth:`prepare`). The forms the
    kernels allow (the fused shared expert, its launch order) are chosen for ``target``
    (default: ``device``): a CPU decoder runs the references' form, unless it stands for a
    CUDA one whose kernels it lists (kimi_ops.prepare).

    Bad settings raise :class:`~kimi_ops.KimiArgumentError` here, bad ``forward``
    arguments there, naming what was wrong.
    """

    def __init__(self, config: KimiConfig, num_layers: int, tp=1, seed: int = 0, device=None,
                 progress: bool | None = None, target=None):
        super().__init__()
        if not isinstance(config, KimiConfig):
            fail_setting("KimiDecoder", "config", "a KimiConfig", type(config).__name__)
        if not (is_int(num_layers) and num_layers >= 1):
            fail_setting("KimiDecoder", "num_layers", "a positive int", num_layers)
        if not is_int(seed):
            fail_setting("KimiDecoder", "seed", "an int", seed)
        if not (progress is None or isinstance(progress, bool)):
            fail_setting("KimiDecoder", "progress", "None, True or False", progress)
        self.config, self.num_layers = config, num_layers
        self.group = group = make_group(tp)
        # Each rank's shard of a mailbox row is whole packets (KimiConfig checks TP1).
        for name, multiple in {**PACKED, "shared_intermediate": 1, "attn_out": 1}.items():
            if getattr(config, name) % (multiple * group.tp):
                fail_setting("KimiDecoder", f"config.{name}", f"a multiple of {multiple} · TP = {multiple * group.tp}",
                             getattr(config, name))
        device = torch.device(device or group.device or "cpu")
        target = torch.device(target or device)
        for name, where in (("device", device), ("target", target)):
            if where.type not in ("cpu", "cuda"):  # meta tensors would build and run, then fail at the host check
                fail_setting("KimiDecoder", name, "'cpu' or a CUDA device", str(where))
        if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
            fail_setting("KimiDecoder", "device", "an available device", str(device))
        for ordinal in range(num_layers):  # reject parity collisions before allocating
            parities(ordinal, num_layers)
        # Every process of the group built alike (else peers' stores land wrong): a clear
        # error on every rank, before any collective allocation could hang.
        group.agree({"num_layers": num_layers, "seed": seed,
                     **{f"config.{name}": value for name, value in vars(config).items()}})
        gen = torch.Generator().manual_seed(seed)
        self.embed_res = self.res_buffers(AttnResWeights.random(config, gen))
        self.layers = nn.ModuleList()
        self.attn_res = nn.ModuleList()
        for i in range(num_layers):
            attention = AttentionWeights.random(config, gen)
            moe = MoeWeights.random(config, gen)
            res = nn.ModuleList([self.res_buffers(AttnResWeights.random(config, gen)) for _ in range(2)])
            ranks = [RankLayer(config, attention, moe, group.tp, r, i, num_layers, target) for r in group.ranks]
            self.layers.append(nn.ModuleList(ranks))
            self.attn_res.append(res)
        # The embedding's AttnRes has no blocks and a zero partial: h = hidden (α = 1), and
        # its h_normed, rms_norm(hidden; out_norm_w), is read by layer 0's stacked GEMM alone.
        # Up to this batch kimi::normed_oproj's kernel serves that GEMM over the raw hidden, and
        # the step launches no AttnRes for the embedding (partial = h = hidden, −0 kept).
        self.embedding_folds_to = 0
        for bucket in buckets(config.capacity):
            if not backend.prefers("normed_oproj", target, *self.layers[0][0].index.w_in.shape, bucket):
                break
            self.embedding_folds_to = bucket
        # AttnRes's zero partial (the embedding's, and each block's first): rows of a buffer
        # no op writes, so a step launches no fill for them
        self.register_buffer("zero_partial", torch.zeros(config.capacity, config.hidden, dtype=torch.bfloat16),
                             persistent=False)
        self.to(device)
        self.boxes = DecodeBoxes(group, config, device)  # after .to(): static addresses
        # The tail publishes and polls in one op at TP1. A simulated group runs its ranks in
        # turn (every publish must precede the polls); ranks sharing a GPU would poll peers
        # whose grids cannot be resident beside theirs; and where the reference serves (an
        # unsupported shape) its polls would not wait for peers publishing concurrently.
        self.serving = group.tp == 1
        if device.type == "cuda":  # compile kernels now, not in a capture
            self.prepare(progress)
        # Every rank built, its kernels compiled or loaded: the first step starts together (a
        # kernel loaded inside a step delays its rank past the group barrier's bound).
        group.host_barrier()
        if device.type == "cuda" and group.barrier:
            self.warm_up()

    def prepare(self, progress: bool | None = None) -> None:
        """Every kernel of every batch bucket compiled or loaded (:meth:`prepare_calls`);
        ``progress``: ``k/N kernels (c cached)`` on stderr as they come (None: where stderr
        is a TTY)."""
        if progress is None:
            progress = sys.stderr.isatty()
        if not (progress and backend.KERNELS):
            self.prepare_calls()
            return
        from ..kernels import compile as kernel_compile  # kernels are registered: CuTe DSL is installed

        with kernel_compile.collecting() as needed:
            self.prepare_calls()
        if not needed:
            return
        tally = Progress(len(needed))
        with kernel_compile.reporting(tally):
            self.prepare_calls()
        tally.close()

    def prepare_calls(self) -> None:
        """Each part's own calls, then the residuals' and the barrier's."""
        batches, boxes, tp = self.buckets(), self.boxes, self.group.tp
        for layer in self.layers:
            for part in layer:
                for prepared in (part.index, part.oproj, part.front, part.tail):
                    prepared.prepare(batches, boxes)
        prepare_residuals(self.config, self.num_layers, tp, batches)
        if self.group.barrier:
            backend.prepare("group_barrier", tp, [boxes.peers("sync", r) for r in self.group.ranks],
                            getattr(self.group, "pulses", 0))

    @staticmethod
    def res_buffers(weights: AttnResWeights) -> nn.Module:
        module = nn.Module()
        for name, tensor in vars(weights).items():
            module.register_buffer(name, tensor)
        return module

    def residual(self, res, blocks, partial, rows):
        return kimi.attn_res(blocks, partial, rows, res.query, res.key_norm_w, res.out_norm_w, self.config.eps)

    def residual_take(self, res, box, blocks, partial, batch, error, into=None):
        """AttnRes over the sublayer's rows taken from ``box`` (parity 0): polled, re-armed;
        h_normed into the rows of the buffer ``into`` where given (a view of them returned)."""
        args = (box, 0, batch, error, blocks, partial, res.query, res.key_norm_w, res.out_norm_w, self.config.eps)
        if into is None:
            return kimi.attn_res_take(*args)
        new_partial, h = kimi.attn_res_take_into(*args, into)
        return new_partial, h, into[:batch]

    def check_inputs(self, hidden, slots) -> None:
        """forward's arguments (metadata only: no sync, so compiled and captured calls
        check them too)."""
        config, device = self.config, self.boxes.error(self.group.ranks[0]).device
        where = "KimiDecoder.forward"
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != config.hidden:
            got = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            fail_setting(where, "hidden", f"a tensor [B, {config.hidden}]", got)
        if hidden.dtype != torch.bfloat16 or hidden.device != device:
            fail_setting(where, "hidden", f"bfloat16 on {device}", f"{hidden.dtype} on {hidden.device}")
        if not hidden.is_contiguous():
            fail_setting(where, "hidden", "contiguous (hidden.contiguous())", f"strides {tuple(hidden.stride())}")
        if not 1 <= hidden.shape[0] <= config.capacity:
            fail_setting(where, "hidden", f"a batch in [1, {config.capacity}] (the mailbox capacity)", hidden.shape[0])
        if slots is None:
            if hidden.shape[0] > config.index_slots:
                fail_setting(where, "slots", f"given when B > config.index_slots = {config.index_slots} "
                             "(the default is arange(B))", None)
        elif not (isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.device == device
                  and list(slots.shape) == [hidden.shape[0]] and slots.is_contiguous()):
            got = f"{slots.dtype} {list(slots.shape)} on {slots.device}" if isinstance(slots, torch.Tensor) else slots
            fail_setting(where, "slots", f"contiguous int64 [{hidden.shape[0]}] on {device}", got)

    def forward(self, hidden: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        config, group, boxes = self.config, self.group, self.boxes
        self.check_inputs(hidden, slots)
        batch = hidden.shape[0]
        if slots is None:
            slots = torch.arange(batch, device=hidden.device)
        ranks = group.ranks
        empty = hidden.new_empty((0, batch, config.hidden))
        # The embedding is the first sublayer output of the first block.
        blocks, partial, x, h = {}, {}, {}, {}
        folded = batch <= self.embedding_folds_to
        for r in ranks:
            blocks[r] = empty
            if folded:  # layer 0's stacked GEMM normalizes hidden itself
                partial[r], h[r], x[r] = hidden, hidden, hidden
            else:
                partial[r], h[r], x[r] = self.residual(self.embed_res, empty, self.zero_partial[:batch], hidden[None])
        for i, (layer, (attn_res, moe_res)) in enumerate(zip(self.layers, self.attn_res)):
            norm_w = self.embed_res.out_norm_w if folded and i == 0 else None
            for r, part in zip(ranks, layer):
                part.attention(x[r], slots, boxes, norm_w)
            self.barrier()
            for r, part in zip(ranks, layer):
                partial[r], h[r], x[r] = self.residual_take(attn_res, boxes.own("attn", r), blocks[r], partial[r],
                                                            batch, boxes.error(r), boxes.moe_input(r))
                part.front_publish(x[r], boxes)
            self.barrier()
            rows = {r: part.experts(x[r], boxes, self.serving) for r, part in zip(ranks, layer)}
            self.barrier()
            if boxes.two_shot(batch):  # the owners' sums first: every rank's poll reads them all
                for part in layer:
                    part.tail.reduce(batch, boxes)
                self.barrier()
            for r, part in zip(ranks, layer):
                if self.serving:
                    part.tail.serve(*rows[r], boxes)
                else:
                    part.tail.run(batch, boxes)
            self.barrier()
            for r in ranks:
                partial[r], h[r], x[r] = self.residual_take(moe_res, boxes.own("out", r), blocks[r], partial[r],
                                                            batch, boxes.error(r))
                # a block boundary (static); after the last layer the blocks and partial are dead
                if (i + 1) % config.attn_res_block == 0 and i + 1 < self.num_layers:
                    blocks[r] = torch.cat([blocks[r], partial[r][None]])
                    partial[r] = self.zero_partial[:batch]
        # Host checks sync: not while tracing (short-circuits) nor capturing.
        if not torch.compiler.is_compiling() and not (
            hidden.is_cuda and torch.cuda.is_current_stream_capturing()
        ):
            self.check()
        return h[ranks[0]]

    def buckets(self) -> list[int]:
        return buckets(self.config.capacity)

    def warm_up(self) -> None:
        """A multi-process group's first step of each batch bucket, before any real one: a
        rank pays its one-time costs there (lazy module loads, allocator pools), which at TP8
        on one GPU outlasted a peer's poll bound in the first real step. A poll that times
        out meanwhile only sets an error word; every slot is −1 (no key written); reset()
        then re-arms the boxes, so the first real step equals a fresh decoder's."""
        config, device = self.config, self.boxes.error(self.group.ranks[0]).device
        for batch in self.buckets():
            try:
                self(torch.zeros(batch, config.hidden, dtype=torch.bfloat16, device=device),
                     torch.full((batch,), -1, dtype=torch.int64, device=device))
            except KimiMailboxError:
                pass
        self.reset()

    def barrier(self) -> None:
        """The end of a phase: every rank's stores into the boxes are done. A multi-process
        group waits on its peers' tickets (bounded: kimi::group_barrier); a simulated group
        runs the ranks' phases one after the other, nothing to wait for."""
        if self.group.barrier:
            for r in self.group.ranks:
                kimi.group_barrier(self.boxes.peers("sync", r), self.boxes.ticket(r), self.boxes.error(r), r)

    def check(self) -> None:
        """Raise KimiMailboxError if any poll of this process's ranks found nothing (syncs)."""
        for r in self.group.ranks:
            raise_if_error(self.boxes.error(r))

    def reset(self) -> None:
        """Recovery after a fault (DESIGN §4): re-arm every box this process owns and clear
        its error words, so that the next step equals a fresh decoder's (rows a failed step
        left published are gone). Host-side, between steps: not inside a compiled region
        or a capture (captured graphs stay valid: the boxes keep their addresses). In a
        multi-process group every rank calls it; it returns after the group's barrier, so
        no peer publishes into a box before its owner re-armed it. The index caches (the
        keys written at the steps' slots) are the caller's KV state and are kept."""
        self.group.host_barrier()  # no rank still running a step
        self.boxes.reset()
        self.group.host_barrier()  # every box re-armed before any rank publishes again
