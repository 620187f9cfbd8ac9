"""Where the time of kimi::moe_tail goes: the phase clock (kernels.Stamps) of MoeTail or
WaveMoeTail at TP1, CUDA-graph replayed with the weights L2-cold as in bench_tail.py. Per phase,
µs from the call's first CTA start: earliest / median / latest CTA (median over the
graph's calls), and the CTAs' median by their own SM clock from their own start.
``--boxes``: the serving path's (moe_tail_push, moe_tail_publish, then moe_tail_poll's
MoeTail at TP1 mailboxes); B <= 8.

    python -m benchmarks.profile_tail [--boxes] [B ...]
"""

import argparse

import torch

import kimi_ops  # noqa: F401
from kimi_ops.kernels.arguments import placeholder
from kimi_ops.kernels.tail import host
from kimi_ops.kernels.tail.common import PHASES
from kimi_ops.mailbox import parities
from kimi_ops.testing.tail_boxes import TailBoxes

from .common import COPIES, HIDDEN, LATENT, activations, graph_us, layer_weights

CALLS = COPIES * 4


def functional(batch: int, w_ups, gamma, buffers):
    """kimi::moe_tail's launches, each captured call stamping its own row of ``buffers``."""
    kernel = host.TailKernel()
    expanded, weights, shared = activations(batch)
    turn = [0]

    def call():
        kernel.stamps = buffers[turn[0] % CALLS]
        kernel(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6)
        turn[0] += 1

    return call


def mailboxes(batch: int, w_ups, gamma, buffers):
    """The mailbox path at TP1 over rotating parities (bench_tail.mailbox_chain's), its
    MoeTail stamping after the error word (the first 16 bytes of its row of ``buffers``)."""
    boxes, turn, kimi = TailBoxes(64, LATENT, HIDDEN, "cuda"), [0], torch.ops.kimi
    expanded, weights, shared = activations(batch)
    groups = host.groups_of(batch)
    variant = host.poll_variant(1, HIDDEN, LATENT, groups, 1, True)

    def call():
        parity, rearm = parities(turn[0] % CALLS, CALLS)
        error = placeholder(buffers[turn[0] % CALLS], torch.int32)
        w_up = w_ups[turn[0] % COPIES]
        kimi.moe_tail_push(shared, [boxes.rs], parity, 0)
        kimi.moe_tail_publish(expanded, weights, [boxes.latent], parity, 0)
        for launch in variant.launches(boxes.latent, boxes.rs, gamma, w_up, 1e-6, [boxes.out], error, parity, rearm,
                                       batch, 0, batch):
            launch()
        turn[0] += 1

    return call


def profile(batch: int, w_ups, gamma, mode: str) -> None:
    ctas = host.functional_ctas(HIDDEN, LATENT, batch)
    phases, first = len(PHASES), 0 if mode == "functional" else 2  # int64 words before the stamps
    buffers = torch.zeros(CALLS, first + ctas * phases * 2, dtype=torch.int64, device="cuda")
    call = (functional(batch, w_ups, gamma, buffers) if mode == "functional"
            else mailboxes(batch, w_ups, gamma, buffers))
    us = graph_us(call, calls=CALLS)
    errors = buffers[:, :1].view(torch.int32)[:, 0]  # each row's first int32 (mailbox modes: the error word)
    if first and errors.ne(0).any():
        print(f"B={batch}: the error word was set: {errors.tolist()}")
    stamps = buffers[:, first:].view(CALLS, ctas, phases, 2).cpu()
    stamped = stamps[..., 0].ne(0).any(1).all(0).tolist()  # the phases a mode passes
    table, overlap, ghz = phase_table(stamps[:, :, [i for i, s in enumerate(stamped) if s]])
    print(f"{mode} B={batch}: {us:.2f} µs per call; the next call starts {overlap:.2f} µs before the last CTA "
          f"ends; SM clock {ghz:.2f} GHz")
    print(f"{'phase':>14s} {'first':>7s} {'median':>7s} {'last':>7s} {'own clock':>9s}")
    for name, row in zip([n for n, s in zip(PHASES, stamped) if s], table):
        print(f"{name:>14s} " + " ".join(f"{v:7.2f}" for v in row[:3]) + f" {row[3]:9.2f}")


def phase_table(stamps: torch.Tensor):
    """``stamps`` [calls, CTAs, phases, (ns, clock)] of one replay → per phase (first,
    median, last CTA: µs from the call's first start; the CTAs' median by their own clock
    from their own start), each a median over the calls but the first (which waits for
    nothing); the median µs by which a call's first start precedes the previous call's
    last end; the SM clock in GHz."""
    stamps = stamps - stamps.flatten(0, 2).min(0).values  # in int64: float64 holds ns since 1970 to 256 ns only
    stamps = stamps[stamps[:, :, 0, 0].min(1).values.argsort()].double()  # calls in launch order
    timer, clock = stamps[..., 0], stamps[..., 1]
    start = timer[:, :, 0].min(1).values
    since = (timer - start[:, None, None])[1:] / 1e3
    ghz = ((clock[..., -1] - clock[..., 0]) / (timer[..., -1] - timer[..., 0])).median()
    own = ((clock - clock[:, :, :1]) / ghz / 1e3)[1:]
    table = torch.stack([since.min(1).values.median(0).values, since.median(1).values.median(0).values,
                         since.max(1).values.median(0).values, own.flatten(0, 1).median(0).values], dim=1)
    overlap = ((timer[:-1, :, -1].max(1).values - start[1:]) / 1e3).median()
    return table.tolist(), float(overlap), float(ghz)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--boxes", action="store_true", help="the serving path's MoeTail (TP1 mailboxes; B <= 8)")
    parser.add_argument("batches", type=int, nargs="*", help="B (default: 1 8 64; --boxes: 1 8)")
    args = parser.parse_intermixed_args(argv)  # --boxes anywhere among the batches
    mode = "boxes" if args.boxes else "functional"
    w_ups, gamma = layer_weights()
    for batch in args.batches or ([1, 8, 64] if mode == "functional" else [1, 8]):
        profile(batch, w_ups, gamma, mode)


if __name__ == "__main__":
    main()
