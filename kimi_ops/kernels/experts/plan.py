"""The routed experts' plan: a cluster of CTAs per (token group, expert) pair while the
grid fits the SMs, the bounds of a variant."""

import functools

from ...config import TOP_K
from ..launch import multiprocessors

GATE_ROWS = 4  # gate/up rows a chunk (8·L/C bytes; a down chunk is as many bytes)
MAX_CLUSTER = 8  # portable cluster size
TOKENS = 4  # the tokens a CTA serves in its pass over the expert's weights (their partials in shared memory)
MAX_INTERMEDIATE = 16  # I = 8 or 16: whole down rows in a thread's 4 packets
MAX_LATENT = 4096  # L/8 ≤ 512 threads at a cluster of one
MAX_BATCH = 256  # the tokens' match masks in shared memory
MAX_THREADS = 512  # a CTA's chunk groups (kernels.RoutedExperts.groups): 128 registers a thread


@functools.cache
def cluster_size(latent: int) -> int:
    """C, the CTAs of a pair: whole 4-row chunks a CTA (L/8 % 4C == 0), the most busy lanes
    over the cluster's warps (C · P / P rounded up to warps: SMs and their conversion
    units at work), the larger C at a tie (a smaller slice to stream)."""
    packets = latent // 8

    def lanes(c):
        share = packets // c
        return c * share / (-(-share // 32) * 32)

    return max((c for c in range(1, MAX_CLUSTER + 1) if packets % (GATE_ROWS * c) == 0), key=lambda c: (lanes(c), c))


def cluster_for(latent: int, batch: int, device: int, tp: int = 1) -> int:
    """A call's C: :func:`cluster_size`'s while the pairs this rank is expected to serve
    (B·16/TP: a uniform routing; the other ranks' pairs end at once) fit the SMs at a CTA
    each (B = 1 at L = 3584; B ≤ 8 at a TP8 rank), else 1 — then the SMs have other pairs
    to serve, and each CTA of a cluster repeats the pair's prologue (measured by cluster
    size at 21c3e9d: benchmarks/NOTES.md). A routing that sends a rank more pairs than
    expected runs in more waves of clusters, not wrong."""
    cluster = cluster_size(latent)
    served = -(-batch * TOP_K // tp)
    return cluster if served * cluster <= multiprocessors(device) else 1
