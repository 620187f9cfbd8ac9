"""Routing's host side: compiles, each call's variant and the adapters of
``kimi::moe_route``, ``kimi::moe_route_poll`` and ``kimi::situ``."""

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from ... import backend
from ...config import TOP_K
from ...mailbox import box_row
from ...ops import route as route_op
from ..arguments import placeholder
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..variant import Unsupported, Variant, prepare_all, reason, single
from .kernels import LEAN_ABOVE, Route, RoutePoll, Situ


@compiled
def compile_route(experts: int, renorm: bool, lean: bool):
    batch = cute.sym_int()
    return cute.compile(
        Route(experts, renorm, lean),
        fake(Float32, (batch, experts), align=4), fake(Float32, (experts,), align=4),
        fake(Int32, (batch, TOP_K)), fake(BFloat16, (batch, TOP_K)), Float32(1.0), fake_stream(),
        options=compile_options(),
    )


@compiled
def compile_route_poll(experts: int, latent: int, renorm: bool, lean: bool, counted: bool):
    rows, batch = cute.sym_int(), cute.sym_int()
    return cute.compile(
        RoutePoll(experts, latent, renorm, lean, counted),
        fake(BFloat16, (rows, latent + 2 * experts)), fake(Float32, (experts,), align=4),
        fake(Int32, (batch, TOP_K)), fake(BFloat16, (batch, TOP_K)), fake(BFloat16, (batch, latent)),
        fake(Int32, (1,), align=4), fake(Int64, (2,), align=8), Float32(1.0), Int32(0), fake_stream(),
        options=compile_options(),
    )


@compiled
def compile_situ(width: int, dtype: str):
    batch = cute.sym_int()
    source = Float32 if dtype == "float32" else BFloat16
    return cute.compile(
        Situ(width, source), fake(source, (batch, 2 * width)), fake(BFloat16, (batch, width)),
        Float32(1.0), Float32(0.0), fake_stream(), options=compile_options(),
    )


@functools.cache
def route_variant(experts: int, renorm: bool, batch: int) -> Variant:
    """``kimi::moe_route``'s kernel for a batch: the lean ranking above LEAN_ABOVE tokens."""
    return single(lambda: compile_route(experts, renorm, batch > LEAN_ABOVE))


@functools.cache
def route_poll_variant(experts: int, latent: int, renorm: bool, batch: int, counted: bool = False) -> Variant:
    """``kimi::moe_route_poll``'s kernel for a batch (``counted``: with a ready counter);
    Unsupported (why) where none takes it."""
    if experts % 4 or latent % 8:
        raise Unsupported(f"the polled kernel needs E % 4 == 0 and L % 8 == 0 (E={experts}, L={latent})")
    return single(lambda: compile_route_poll(experts, latent, renorm, batch > LEAN_ABOVE, counted))


@functools.cache
def situ_variant(width: int, dtype: str) -> Variant:
    if width % 8:
        raise Unsupported(f"the kernel reads 16-byte packets: S must be a multiple of 8, got {width}")
    return single(lambda: compile_situ(width, dtype))


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class RouteKernel:
    """``kimi::moe_route`` on CUDA."""

    check = staticmethod(route_op.check_moe_route)

    def prepare(self, experts: int, renorm: bool) -> None:
        prepare_all(lambda batch=batch: route_variant(experts, renorm, batch) for batch in (1, LEAN_ABOVE + 1))

    def unsupported(self, logits, bias, scale, renorm):
        return hopper(logits)

    def __call__(self, logits, bias, scale, renorm):
        batch = logits.shape[0]
        ids = logits.new_empty((batch, TOP_K), dtype=torch.int32)
        weights = logits.new_empty((batch, TOP_K), dtype=torch.bfloat16)
        if batch:
            route_variant(logits.shape[1], bool(renorm), batch).run(logits, bias, ids, weights, scale)
        return ids, weights


class SituKernel:
    """``kimi::situ`` on CUDA."""

    check = staticmethod(route_op.check_situ)

    def prepare(self, width: int, dtype: str) -> None:
        prepare_all([lambda: situ_variant(width, dtype)])

    def unsupported(self, gate_up, beta, linear_beta):
        return reason(lambda: situ_variant(gate_up.shape[1] // 2, dtype_name(gate_up))) or hopper(gate_up)

    def __call__(self, gate_up, beta, linear_beta):
        batch, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((batch, width), dtype=torch.bfloat16)
        if batch:
            situ_variant(width, dtype_name(gate_up)).run(gate_up, out, beta, linear_beta)
        return out


class RoutePollKernel:
    """``kimi::moe_route_poll`` on CUDA."""

    check = staticmethod(route_op.check_moe_route_poll)

    def prepare(self, experts: int, latent: int, renorm: bool, counts=(False,)) -> None:
        prepare_all(lambda batch=batch, counted=counted: route_poll_variant(experts, latent, renorm, batch, counted)
                    for batch in (1, LEAN_ABOVE + 1) for counted in counts)

    def unsupported(self, box, bias, scale, renorm, parity, batch, error, ready=None):
        experts = bias.shape[0]
        return (reason(lambda: route_poll_variant(experts, box.shape[3] - 2 * experts, bool(renorm), batch,
                                                  ready is not None)) or hopper(box))

    def __call__(self, box, bias, scale, renorm, parity, batch, error, ready=None):
        experts = bias.shape[0]
        latent_width = box.shape[3] - 2 * experts
        ids = box.new_empty((batch, TOP_K), dtype=torch.int32)
        weights = box.new_empty((batch, TOP_K))
        latent = box.new_empty((batch, latent_width))
        counter = placeholder(ids, torch.int64, elements=2) if ready is None else ready
        route_poll_variant(experts, latent_width, bool(renorm), batch, ready is not None).run(
            box.view(-1, box.shape[3]), bias, ids, weights, latent, error, counter, scale,
            box_row(parity, 0, 0, 1, box.shape[2]))
        return ids, weights, latent


def register() -> None:
    backend.KERNELS["moe_route"] = RouteKernel()
    backend.KERNELS["moe_route_poll"] = RoutePollKernel()
    backend.KERNELS["situ"] = SituKernel()
