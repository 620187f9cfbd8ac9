"""AttnRes's host side: compiles, a call's variant, the adapters of ``kimi::attn_res``
and ``kimi::attn_res_take``."""

import functools

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from ... import backend
from ...mailbox import box_row as host_box_row
from ...ops import attn_res as attn_res_op
from ..arguments import aligned
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..launch import SMEM_BYTES, check_marks_room
from ..variant import Unsupported, Variant, prepare_all, reason, single
from .kernels import (
    AttnRes,
    AttnResTake,
)
from .plan import (
    MAX_TP,
    ROW_BUCKETS,
    cluster_for,
    stash_rows,
)


@compiled
def compile_attn_res(hidden: int, tp: int, cluster: int, rows: int, polled: bool = False):
    """AttnRes, or ``polled`` AttnResTake (the box and the error word after ``sublayer``'s
    place, the box's first row and CAP after ``count``)."""
    batch, block_rows, source_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    vectors = [fake(BFloat16, (hidden,)) for _ in range(3)]
    token_rows = [fake(BFloat16, (batch, hidden)) for _ in range(4)]
    kernel = (AttnResTake if polled else AttnRes)(hidden, tp, cluster, rows)
    box = [fake(BFloat16, (source_rows, hidden))] + [fake(Int32, (1,), align=4)] * polled
    return cute.compile(
        kernel, fake(BFloat16, (block_rows, hidden)), token_rows[0], *box, *vectors, *token_rows[1:], Int32(0),
        *[Int32(0), Int32(1)] * polled, Float32(1e-6), fake_stream(), options=compile_options(),
    )


def unsupported_shape(hidden: int, tp: int, count: int, batch: int = 1) -> str | None:
    if hidden <= 0 or hidden % 8:
        return f"the kernel reads 16-byte packets: H must be a positive multiple of 8, got {hidden}"
    if tp > MAX_TP:
        return f"the kernel sums at most {MAX_TP} sublayer sources, got TP = {tp}"
    rows = stash_rows(count)
    if rows is None:
        return f"the kernel stashes at most {ROW_BUCKETS[-1]} completed blocks, got N = {count}"
    if AttnRes(hidden, tp, cluster_for(hidden, batch, rows), rows).smem_bytes() > SMEM_BYTES:
        return f"N = {count} blocks of H = {hidden} pass a CTA's shared memory"
    return None


@functools.cache  # asked by unsupported and the call: built once a shape
def attn_res_variant(hidden: int, tp: int, count: int, polled: bool, batch: int) -> Variant:
    """A call's variant: H, the sources, N's stash bucket, the batch (its plan: (cluster,
    stash rows)); the kernel takes the adapter's arguments as they are. Unsupported (why)
    where no variant takes the shape."""
    why = unsupported_shape(hidden, tp, count, batch)
    if why:
        raise Unsupported(why)
    rows = stash_rows(count)
    cluster = cluster_for(hidden, batch, rows)
    return single(lambda: compile_attn_res(hidden, tp, cluster, rows, polled), (cluster, rows))


class AttnResKernel:
    """``kimi::attn_res`` on CUDA."""

    check = staticmethod(attn_res_op.check_attn_res)
    polled = False

    def prepare(self, hidden: int, tps, counts, batches=(1,)) -> None:
        """Every variant calls with these source counts (TP, or the box's sources), block
        counts and batches take."""
        buckets = sorted({stash_rows(count) for count in counts})  # a bucket is its own bucket
        prepare_all(lambda tp=tp, rows=rows, batch=batch: attn_res_variant(hidden, tp, rows, self.polled, batch)
                    for tp in tps for rows in buckets for batch in sorted(set(batches)))

    def unsupported_call(self, hidden, tp, count, batch, tensors) -> str | None:
        why = reason(lambda: attn_res_variant(hidden, tp, count, self.polled, batch))
        if why is None and not aligned(*tensors):
            why = "the kernel reads 16-byte packets: every tensor must be 16-byte aligned"
        return why or hopper(tensors[0])

    def unsupported(self, blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps):
        return self.unsupported_call(partial.shape[1], sublayer_out.shape[0], blocks.shape[0], partial.shape[0],
                                     (partial, blocks, sublayer_out, query, key_norm_w, out_norm_w))

    def __call__(self, blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps):
        batch, hidden = partial.shape
        count, tp = blocks.shape[0], sublayer_out.shape[0]
        outputs = [partial.new_empty((batch, hidden)) for _ in range(3)]
        if batch:
            sources = sublayer_out.view(-1, hidden) if tp else partial  # an empty tensor is never read
            attn_res_variant(hidden, tp, count, False, batch).run(block_rows(blocks, partial), partial, sources, query,
                                                           key_norm_w, out_norm_w, *outputs, count, eps)
        return tuple(outputs)


class AttnResTakeKernel(AttnResKernel):
    """``kimi::attn_res_take`` on CUDA."""

    check = staticmethod(attn_res_op.check_attn_res_take)
    polled = True

    def unsupported(self, box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps):
        return self.unsupported_call(box.shape[3], box.shape[1], blocks.shape[0], batch,
                                     (box, blocks, partial, query, key_norm_w, out_norm_w))

    def __call__(self, box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps):
        return self.take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps)

    def take(self, box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps, h_normed=None):
        """(new_partial, h, h_normed): h_normed into the given rows, if any."""
        hidden, tp, capacity = box.shape[3], box.shape[1], box.shape[2]
        check_marks_room("attn_res_take", error)
        outputs = [partial.new_empty((batch, hidden)) for _ in range(2)]
        outputs.append(partial.new_empty((batch, hidden)) if h_normed is None else h_normed)
        attn_res_variant(hidden, tp, blocks.shape[0], True, batch).run(
            block_rows(blocks, partial), partial, box.view(-1, hidden), error, query, key_norm_w, out_norm_w,
            *outputs, blocks.shape[0], host_box_row(parity, 0, 0, tp, capacity), capacity, eps)
        return tuple(outputs)


class AttnResTakeIntoKernel(AttnResTakeKernel):
    """``kimi::attn_res_take_into`` on CUDA: the same kernel, h_normed's rows in the caller's buffer."""

    check = staticmethod(attn_res_op.check_attn_res_take_into)

    def unsupported(self, box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps, h_normed):
        return self.unsupported_call(box.shape[3], box.shape[1], blocks.shape[0], batch,
                                     (box, blocks, partial, query, key_norm_w, out_norm_w, h_normed))

    def __call__(self, box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps, h_normed):
        return self.take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps,
                         h_normed[:batch])[:2]


def block_rows(blocks, partial):
    """``blocks`` as rows [N · B, H]; at N = 0 ``partial`` stands in (an empty tensor is
    never read)."""
    return blocks.view(-1, blocks.shape[2]) if blocks.shape[0] else partial


def register() -> None:
    backend.KERNELS["attn_res"] = AttnResKernel()
    backend.KERNELS["attn_res_take"] = AttnResTakeKernel()
    backend.KERNELS["attn_res_take_into"] = AttnResTakeIntoKernel()
