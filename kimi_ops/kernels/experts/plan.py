"""The routed experts' plan: a cluster of CTAs per (token group, expert) pair while the
grid fits the SMs, the bounds of a variant."""

import functools

from ...config import TOP_K
from ..launch import SMEM_BYTES, multiprocessors

GATE_ROWS = 4  # gate/up rows a chunk (8·L/C bytes; a down chunk is as many bytes)
MAX_CLUSTER = 8  # portable cluster size
TOKENS = 4  # the tokens a CTA serves in its pass over the expert's weights (their partials in shared memory)
MAX_INTERMEDIATE = 16  # I = 8 or 16: whole down rows in a thread's 4 packets
MAX_LATENT = 4096  # L/8 ≤ 512 threads at a cluster of one
MAX_BATCH = 256  # the tokens' match masks in shared memory
MAX_THREADS = 512  # a CTA's chunk groups (kernels.RoutedExperts.groups): 128 registers a thread
PAST_WAVE_PER_SM = 2  # CTAs an SM holds at once past one wave (ctas_per_sm)
SM_SHARED = SMEM_BYTES + 1024  # an SM's shared memory; each resident CTA's share keeps 1 KB for the system


# The most of an expert's bytes one CTA streams: past it a pair takes a cluster (bench_experts,
# a chunk group a gate chunk: at L = 512 one CTA the whole 48 KB expert, 3.9 / 7.2 / 17.8 µs at
# B = 1 / 8 / 64 against 6.8 / 17.1 / 83.0 in clusters of 8; at L = 3584, 344 KB, clusters of
# 4 at B = 1, 7.7 µs against 16.5 / 9.7 / 10.9 at C = 1 / 2 / 8: benchmarks/NOTES.md)
SLICE_BYTES = 96 * 1024


@functools.cache
def cluster_size(latent: int, intermediate: int) -> int:
    """C, the CTAs of a pair: the fewest with whole 4-row chunks a CTA (L/8 % 4C == 0) whose
    slice of the expert (3I values of L/C) is at most SLICE_BYTES (the most where none is)."""
    sizes = [c for c in range(1, MAX_CLUSTER + 1) if (latent // 8) % (GATE_ROWS * c) == 0]
    return next((c for c in sizes if 6 * intermediate * latent // c <= SLICE_BYTES), sizes[-1])


def cluster_for(latent: int, intermediate: int, batch: int, device: int, tp: int = 1) -> int:
    """A call's C: :func:`cluster_size`'s while the pairs this rank is expected to serve
    (B·16/TP: a uniform routing; the other ranks' pairs end at once) fit the SMs at a CTA
    each (B ≤ 2 at L = 3584), else 1 — then the SMs have other pairs
    to serve, and each CTA of a cluster repeats the pair's prologue (measured by cluster
    size at 21c3e9d: benchmarks/NOTES.md). A routing that sends a rank more pairs than
    expected runs in more waves of clusters, not wrong."""
    cluster = cluster_size(latent, intermediate)
    return cluster if one_wave(batch, cluster, device, tp) else 1


def one_wave(batch: int, cluster: int, device: int, tp: int) -> bool:
    """The pairs this rank is expected to serve (B·16/TP), C CTAs each, fit the SMs at once."""
    return -(-batch * TOP_K // tp) * cluster <= multiprocessors(device)


def releases_at_entry(batch: int, cluster: int, device: int, tp: int = 1) -> bool:
    """Whether a call releases its dependents at entry: where the pairs it is expected to
    serve are one wave at a CTA an SM (clusters: :func:`cluster_for`'s bound; a CTA a pair:
    B·16/TP CTAs): the dependent launches at once and shares SMs only with those CTAs
    (bench_layer at the TP8 rank against a release at the end: 67.9 / 78.8 / 107.2 against
    68.3 / 81.5 / 107.0 µs at B = 1 / 8 / 64, benchmarks/NOTES.md)."""
    return one_wave(batch, cluster, device, tp)


def ctas_per_sm(batch: int, cluster: int, device: int, tp: int = 1) -> int:
    """A call's CTAs an SM holds at once: one while the pairs served are one wave (each CTA
    its SM's whole share: the shortest latency), else PAST_WAVE_PER_SM. Past one wave most
    pairs' CTAs end at once, and a serving CTA's latency (its stream, its barriers) leaves
    its SM idle unless another CTA shares it: kimi_k3 (L = 3584, 220 KB a CTA alone) at
    B = 64 took 99.3 µs so against 117.8 (3/SM: 157.2); a TP8 rank's (L = 512: 61 KB and 64
    registers a thread, so two CTAs an SM already) 18.0 against 18.2 (bench_experts,
    benchmarks/NOTES.md)."""
    return 1 if one_wave(batch, cluster, device, tp) else PAST_WAVE_PER_SM


def smem_share(per_sm: int) -> int:
    """The shared bytes a CTA may take so that ``per_sm`` of them are resident on an SM."""
    return SM_SHARED // per_sm - 1024
