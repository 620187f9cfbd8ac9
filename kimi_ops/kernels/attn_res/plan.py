"""AttnRes's plan: CTAs per token (a cluster splitting H), the stash's row buckets, the
bounds of a variant (the kernels: :mod:`.kernels`)."""

CLUSTERS = (1, 2, 4, 8)  # CTAs per token (portable cluster sizes)
CTA_PACKETS = 128  # packets a CTA takes at most where H allows (H = 7168: 8 CTAs of 112)
MAX_THREADS = 1024
# One CTA a token above 16 tokens, its stash up to 64 KB (H200, H = 7168, B = 64, N <= 4:
# 4.1-6.2 µs, clusters of 8 5.3-8.2; at B <= 8 clusters of 8 are the fastest).
ONE_CTA_ABOVE, ONE_CTA_STASH = 16, 64 * 1024
# Stash capacities (rows of completed blocks) compiled: a call takes the least ≥ N. Shared
# memory is rows · P · 16 bytes a CTA (H = 7168: 1.75 KB a row), so a bucket wastes at most
# a third of it; the decoder prepares those its layers use.
ROW_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MAX_TP = 16  # sublayer sources (a thread's TP packets are in flight at once)
NEG_INF = float("-inf")


def cluster_for(hidden: int, batch: int = 1, rows: int = 0) -> int:
    """CTAs per token: one above ONE_CTA_ABOVE tokens while its stash of ``rows`` blocks
    stays within ONE_CTA_STASH (B clusters of several CTAs then pass the SMs, and each
    cluster barrier costs more than the loads it spreads: benchmarks/bench_attn_res.py);
    else the fewest of CLUSTERS that give each CTA at most CTA_PACKETS packets (more CTAs:
    more SMs' load bandwidth and stash per token, one cluster barrier a round), else the
    most that divide H's packets."""
    packets = hidden // 8
    if batch > ONE_CTA_ABOVE and rows * hidden * 2 <= ONE_CTA_STASH:
        return 1
    dividing = [c for c in CLUSTERS if packets % c == 0]
    return next((c for c in dividing if packets // c <= CTA_PACKETS), dividing[-1])


def stash_rows(count: int) -> int | None:
    """The stash bucket of N completed blocks (None past the largest)."""
    return next((rows for rows in ROW_BUCKETS if rows >= count), None)
