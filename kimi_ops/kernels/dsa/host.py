"""The DSA kernels' host side: compiles and the adapters of ``kimi::dsa_index_front``,
``kimi::dsa_index_key_insert`` and ``kimi::dsa_index_front_keys``."""

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int64, Uint8

from ... import backend
from ...config import INDEX_DIM, INDEX_HEADS
from ...ops import dsa as dsa_op
from ..arguments import aligned, placeholder
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..gemm.host import engine_variant, tokens_of
from ..gemm.plan import MAX_BATCH, token_tile
from ..ring import CHUNK
from ..variant import Unsupported, Variant, prepare_all, reason, single
from .kernels import (
    IndexFront,
    KeyInsert,
)
from .plan import (
    N,
    index_partition,
    index_plan,
)


@compiled
def compile_index_front(k: int, tokens: int, norm: bool, keys: bool = False):
    """``keys``: with the key insert's CTAs (else its tensors are one-element placeholders)."""
    batch, slots = cute.sym_int(), cute.sym_int()
    key_args = (fake(BFloat16, (batch, INDEX_DIM), align=8), fake(BFloat16, (INDEX_DIM,), align=8),
                fake(BFloat16, (INDEX_DIM,), align=8), fake(Uint8, (slots, INDEX_DIM + 4), align=4),
                fake(Int64, (batch,), align=8)) if keys else (
        fake(BFloat16, (1, 1)), fake(BFloat16, (1,)), fake(BFloat16, (1,)), fake(Uint8, (1, 1)), fake(Int64, (1,)))
    return cute.compile(
        IndexFront(index_plan(k, tokens, norm), norm, keys),
        fake(BFloat16, (batch, k)), fake(BFloat16, (N, k)), fake(BFloat16, (k,) if norm else (1,)),
        fake(Uint8, (batch, N)), fake(BFloat16, (batch, INDEX_HEADS)), fake(BFloat16, (batch, INDEX_HEADS)), *key_args,
        Float32(1e-6), fake_stream(), options=compile_options(),
    )


@compiled
def compile_key_insert():
    batch, slots = cute.sym_int(), cute.sym_int()
    return cute.compile(
        KeyInsert(), fake(BFloat16, (batch, INDEX_DIM), align=8), fake(BFloat16, (INDEX_DIM,), align=8),
        fake(BFloat16, (INDEX_DIM,), align=8), fake(Uint8, (slots, INDEX_DIM + 4), align=4), fake(Int64, (batch,), align=8),
        Float32(1e-6), fake_stream(), options=compile_options(),
    )


def unsupported_front(k: int, batch: int, norm: bool) -> str | None:
    if batch > MAX_BATCH:
        return f"the DSA front takes at most {MAX_BATCH} tokens, got {batch}"
    if index_partition(k, token_tile(max(batch, 1)), norm) is None:
        return f"the DSA front needs K % {CHUNK} == 0 and (raw rows) the K slice in one ring (K={k})"
    return None


@functools.cache  # asked by unsupported and the call: built once a shape
def index_front_variant(k: int, batch: int, norm: bool, keys: bool = False) -> Variant:
    """A call's variant: K, the batch's bucket, the row mode, with the key insert or not
    (its plan: the engine's GemmPlan); the kernel takes the adapter's arguments.
    Unsupported (why) where none does."""
    why = unsupported_front(k, batch, norm)
    if why:
        raise Unsupported(why)
    tokens = token_tile(max(batch, 1))
    return engine_variant(lambda: compile_index_front(k, tokens, norm, keys), index_plan(k, tokens, norm))


class IndexFrontKernel:
    """``kimi::dsa_index_front`` on CUDA: both row modes, per batch bucket."""

    check = staticmethod(dsa_op.check_dsa_index_front)
    keys = False

    def prepare(self, k: int, batches=None, modes=(True, False)) -> None:
        """``modes``: raw rows (q_norm_w given) and / or normalized rows."""
        prepare_all(lambda norm=norm, tokens=tokens: index_front_variant(k, tokens, norm, self.keys)
                    for norm in modes for tokens in tokens_of(batches))

    def unsupported(self, rows, wq_b, head_in, q_norm_w, eps):
        if not aligned(rows, wq_b, head_in, *([q_norm_w] if q_norm_w is not None else [])):
            return "the DSA front reads 16-byte packets: rows, wq_b, head_in and q_norm_w must be 16-byte aligned"
        return reason(lambda: index_front_variant(rows.shape[1], rows.shape[0], q_norm_w is not None)) or hopper(rows)

    def __call__(self, rows, wq_b, head_in, q_norm_w, eps):
        return self.run(rows, wq_b, head_in, q_norm_w, eps, None)

    def run(self, rows, wq_b, head_in, q_norm_w, eps, key_args):
        """``key_args`` (k_in, k_norm_w, k_norm_b, cache, slots): the keys too, else None."""
        batch, k = rows.shape
        q = rows.new_empty((batch, INDEX_HEADS, INDEX_DIM), dtype=torch.float8_e4m3fn)
        head_w = rows.new_empty((batch, INDEX_HEADS))
        if batch:
            norm = q_norm_w is not None
            placeholders = (placeholder(rows, torch.bfloat16, 2), placeholder(rows, torch.bfloat16),
                            placeholder(rows, torch.bfloat16), placeholder(rows, torch.uint8, 2),
                            placeholder(rows, torch.int64))
            index_front_variant(k, batch, norm, key_args is not None).run(
                rows, wq_b, q_norm_w if norm else placeholder(rows, torch.bfloat16), q.view(torch.uint8).view(batch, N),
                head_w, head_in, *(key_args or placeholders), eps,
            )
        return q, head_w


class IndexFrontKeysKernel(IndexFrontKernel):
    """``kimi::dsa_index_front_keys`` on CUDA: the front's launch with the key insert's
    CTAs (the slots' host check first, as ``kimi::dsa_index_key_insert``'s)."""

    check = staticmethod(dsa_op.check_dsa_index_front_keys)
    keys = True

    def unsupported(self, rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots):
        return (super().unsupported(rows, wq_b, head_in, q_norm_w, eps)
                or key_insert_unsupported(k_in, k_norm_w, k_norm_b, cache, slots))

    def __call__(self, rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots):
        dsa_op.check_slot_values(cache, slots, "dsa_index_front_keys")
        keys = (k_in, k_norm_w, k_norm_b, cache, slots) if cache.shape[0] else None  # no rows: every slot is -1
        return self.run(rows, wq_b, head_in, q_norm_w, eps, keys)


@functools.cache
def key_insert_variant(rows: int) -> Variant:
    """Unsupported (why) past the kernel's Int32 row index."""
    if rows >= 2**31:
        raise Unsupported(f"the key insert indexes at most 2^31 cache rows, got {rows}")
    return single(lambda: compile_key_insert())


def key_insert_unsupported(k_in, norm_w, norm_b, cache, slots) -> str | None:
    if not (all(t.data_ptr() % 8 == 0 for t in (k_in, norm_w, norm_b, slots)) and k_in.stride(0) % 4 == 0
            and cache.data_ptr() % 4 == 0):
        return ("the key insert reads 8-byte packets and stores words: align k_in (and its row stride), its norm's "
                "weights and the cache")
    return reason(lambda: key_insert_variant(cache.shape[0])) or hopper(k_in)


class KeyInsertKernel:
    """``kimi::dsa_index_key_insert`` on CUDA (the op's host slot check first)."""

    check = staticmethod(dsa_op.check_dsa_index_key_insert)

    def prepare(self) -> None:
        prepare_all([lambda: key_insert_variant(0)])

    def unsupported(self, k_in, norm_w, norm_b, eps, cache, slots):
        return key_insert_unsupported(k_in, norm_w, norm_b, cache, slots)

    def __call__(self, k_in, norm_w, norm_b, eps, cache, slots):
        dsa_op.check_slot_values(cache, slots)  # a clear error on the host path; under capture the kernel drops them
        if k_in.shape[0] and cache.shape[0]:
            key_insert_variant(cache.shape[0]).run(k_in, norm_w, norm_b, cache, slots, eps)


def register() -> None:
    backend.KERNELS["dsa_index_front"] = IndexFrontKernel()
    backend.KERNELS["dsa_index_key_insert"] = KeyInsertKernel()
    backend.KERNELS["dsa_index_front_keys"] = IndexFrontKeysKernel()
