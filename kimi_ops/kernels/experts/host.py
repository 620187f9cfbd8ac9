"""The routed experts' host side: compiles and the adapters of ``kimi::routed_experts`` and
``kimi::routed_experts_counted``."""

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Int32, Int64

from ... import backend
from ...config import TOP_K
from ...ops import experts as experts_op
from ..arguments import aligned, placeholder
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..launch import multiprocessors
from ..variant import Unsupported, Variant, prepare_all, single
from .kernels import (
    RoutedExperts,
)
from .stream import StreamedExperts
from .plan import (
    MAX_BATCH,
    MAX_INTERMEDIATE,
    MAX_LATENT,
    STREAMED,
    call_plan,
    streams,
    variants,
)


def fake_tensors(latent: int, intermediate: int) -> tuple:
    """The adapter's tensors as compile placeholders: latent, ids, gate_up, down, out, ready,
    error (RoutedExpertsKernel's views)."""
    batch, pairs, rows, gate_rows, down_rows = (cute.sym_int() for _ in range(5))
    return (fake(BFloat16, (batch, latent)), fake(Int32, (pairs,)), fake(BFloat16, (gate_rows, latent)),
            fake(BFloat16, (down_rows, intermediate)), fake(BFloat16, (rows, latent)), fake(Int64, (2,), align=8),
            fake(Int32, (1,), align=4))


@compiled
def compile_routed_experts(latent: int, intermediate: int, cluster: int, per_sm: int, tokens: int, by_expert: bool,
                           counted: bool):
    """A :class:`~.plan.CallPlan`'s variant: C, the CTAs an SM, T, by expert; ``counted``:
    the ids' wait is the route poll's ready count (kernels.RoutedExperts)."""
    return cute.compile(RoutedExperts(latent, intermediate, cluster, per_sm, tokens, counted, by_expert),
                        *fake_tensors(latent, intermediate), Int32(1), Int32(0), Int32(1), Int32(1), Int32(0),
                        Int32(1), fake_stream(), options=compile_options())


@compiled
def compile_streamed_experts(latent: int, intermediate: int, counted: bool):
    """The streamed form (stream.StreamedExperts); ``counted`` as compile_routed_experts'."""
    return cute.compile(StreamedExperts(latent, intermediate, counted), *fake_tensors(latent, intermediate),
                        Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), fake_stream(), options=compile_options())


def unsupported_shape(latent: int, intermediate: int, batch: int) -> str | None:
    if intermediate % 8 or not 8 <= intermediate <= MAX_INTERMEDIATE:
        return (f"the kernel stashes a thread's 8 down rows in one block: I must be a multiple of 8 in "
                f"[8, {MAX_INTERMEDIATE}], got {intermediate}")
    if latent % 64 or not latent <= MAX_LATENT:
        return (f"a CTA's L/8 threads take 8 packets of L each: L must be a multiple of 64 up to {MAX_LATENT}, "
                f"got {latent}")
    if batch > MAX_BATCH:
        return f"the kernel matches at most {MAX_BATCH} tokens, got B = {batch}"
    return None


@functools.cache  # asked by the call: built once a shape
def experts_variant(latent: int, intermediate: int, batch: int, cluster: int, per_sm: int, tokens: int,
                    by_expert: bool, stream: bool, counted: bool = False) -> Variant:
    """A call's variant: L, I, and its :class:`~.plan.CallPlan`'s CTAs a pair, CTAs an SM,
    tokens a CTA, grid by expert and streamed form (:func:`~.plan.call_plan` picks them per
    call), with or without the ready count; the kernel takes the adapter's arguments.
    Unsupported (why) where it does not take the shape."""
    why = unsupported_shape(latent, intermediate, batch)
    if why:
        raise Unsupported(why)
    if stream:
        return single(lambda: compile_streamed_experts(latent, intermediate, counted), (*STREAMED.variant, counted))
    return single(lambda: compile_routed_experts(latent, intermediate, cluster, per_sm, tokens, by_expert, counted),
                  (cluster, per_sm, tokens, by_expert, False, counted))


def prepared_variants(latent: int, intermediate: int) -> set[tuple[int, int, int, bool, bool]]:
    """Every key :func:`~.plan.call_plan` returns at any batch, TP, E and SM count (its
    :func:`~.plan.variants`, C = 1 in one wave where cluster_for takes it, and the
    streamed form where it takes the shape; no device asked: a cache warms without one)."""
    keys = {(1, 1, 1, False)} | {variant for variant in variants(latent, intermediate) if variant}
    return {(*key, False) for key in keys} | ({STREAMED.variant} if streams(latent, intermediate) else set())


class RoutedExpertsKernel:
    """``kimi::routed_experts`` on CUDA; ``counted``: ``kimi::routed_experts_counted``."""

    def __init__(self, counted: bool = False):
        self.counted = counted
        self.check = experts_op.check_routed_experts_counted if counted else experts_op.check_routed_experts

    def prepare(self, latent: int, intermediate: int) -> None:
        if unsupported_shape(latent, intermediate, 0) is None:  # cluster_size needs a shape the kernel takes
            prepare_all(lambda key=key: experts_variant(latent, intermediate, 0, *key, self.counted)
                        for key in sorted(prepared_variants(latent, intermediate)))

    def unsupported(self, latent, ids, gate_up, down, rank, tp, ready=None, error=None) -> str | None:
        why = unsupported_shape(latent.shape[1], down.shape[2], latent.shape[0])
        if why is None and not aligned(latent, ids, gate_up, down):
            why = "the kernel reads 16-byte packets: every tensor must be 16-byte aligned"
        return why or hopper(latent)

    def __call__(self, latent, ids, gate_up, down, rank, tp, ready=None, error=None):
        batch, width = latent.shape
        experts, intermediate = gate_up.shape[0], down.shape[2]
        out = latent.new_empty((batch, TOP_K, width))
        if batch:
            plan = call_plan(width, intermediate, batch, latent.device.index, tp, experts)
            if not self.counted:  # arguments the kernel's mode never touches
                ready, error = placeholder(ids, torch.int64, elements=2), placeholder(ids, torch.int32)
            # the streamed form's grid is a CTA an SM; the others' release and spread
            grid = (multiprocessors(latent.device.index),) if plan.stream else (int(plan.wave), plan.spread)
            experts_variant(width, intermediate, batch, *plan.variant, self.counted).run(
                latent, ids.view(-1), gate_up.view(-1, width), down.view(-1, intermediate), out.view(-1, width),
                ready, error, batch, rank, experts // tp, experts, *grid)
        return out


def register() -> None:
    backend.KERNELS["routed_experts"] = RoutedExpertsKernel()
    backend.KERNELS["routed_experts_counted"] = RoutedExpertsKernel(counted=True)
