"""The routed experts' plan: a cluster of CTAs per (token group, expert) pair while the
grid fits the SMs, the bounds of a variant."""

import functools
from typing import NamedTuple

from ...config import TOP_K
from ..launch import SMEM_BYTES, multiprocessors

GATE_ROWS = 4  # gate/up rows a chunk (8·L/C bytes; a down chunk is as many bytes)
MAX_CLUSTER = 8  # portable cluster size
TOKENS = 4  # the most tokens a CTA serves in its pass over the expert's weights past one wave (call_plan)
MAX_INTERMEDIATE = 16  # I = 8 or 16: whole down rows in a thread's 4 packets
MAX_LATENT = 4096  # L/8 ≤ 512 threads at a cluster of one
MAX_BATCH = 256  # the tokens' match masks in shared memory
MAX_THREADS = 512  # a CTA's chunk groups (kernels.RoutedExperts.groups): 128 registers a thread
PAST_WAVE_PER_SM = 2  # CTAs an SM holds at once past one wave (call_plan)
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


class CallPlan(NamedTuple):
    """A call's variant and its release (:func:`call_plan`)."""

    cluster: int  # C, the CTAs of a pair (cluster_for)
    per_sm: int  # the CTAs an SM holds at once
    tokens: int  # T, the most of an expert's tokens a CTA serves
    # the pairs served are one wave: the dependents are released at entry, and share SMs only
    # with those CTAs (bench_layer at the TP8 rank against a release at the end: 67.9 / 78.8 /
    # 107.2 against 68.3 / 81.5 / 107.0 µs at B = 1 / 8 / 64, benchmarks/NOTES.md)
    wave: bool

    @property
    def variant(self) -> tuple[int, int, int]:
        """The compile key past (L, I)."""
        return self.cluster, self.per_sm, self.tokens


def call_plan(latent: int, intermediate: int, batch: int, device: int, tp: int = 1) -> CallPlan:
    """While the pairs served are one wave, each CTA takes its SM's whole share and serves
    one token: a pair of a repeated expert re-reads its weights from L2, the grid ends with
    its slowest pair (with T = TOKENS a CTA served up to 4 tokens one after another: a TP8
    rank at B = 8 took 8.45 µs against 3.85 at B = 1). Past one wave most pairs' CTAs end
    at once, so each CTA serves TOKENS tokens (an expert's weights read once per TOKENS) and
    PAST_WAVE_PER_SM share an SM: a serving CTA's latency (its stream, its barriers) leaves
    its SM idle unless another CTA shares it (kimi_k3, L = 3584, 220 KB a CTA alone, at
    B = 64: 99.3 µs against 117.8; 3 an SM 157.2; a TP8 rank's, L = 512, 61 KB and 64
    registers a thread, two an SM already: 18.0 against 18.2; bench_experts,
    benchmarks/NOTES.md)."""
    cluster = cluster_for(latent, intermediate, batch, device, tp)
    wave = one_wave(batch, cluster, device, tp)
    return CallPlan(cluster, 1, 1, True) if wave else CallPlan(cluster, PAST_WAVE_PER_SM, TOKENS, False)


def smem_share(per_sm: int) -> int:
    """The shared bytes a CTA may take so that ``per_sm`` of them are resident on an SM."""
    return SM_SHARED // per_sm - 1024
