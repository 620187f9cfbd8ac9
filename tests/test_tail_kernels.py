"""The CuTe MoE tail (kernels/tail/): every variant compiles for sm_90a without a GPU,
with no spills and no ptxas performance note; on a Hopper GPU the functional op and the
mailbox ops match the reference backend, polls are bounded, and a 6-layer tail stack
replays from a CUDA graph 1000 times."""

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops import backend  # noqa: E402
from kimi_ops.kernels.launch import SMEM_BYTES  # noqa: E402
from kimi_ops.kernels.ring import CHUNK, swizzled  # noqa: E402
from kimi_ops.kernels.tail import fronts, host, split, split_plan, wave  # noqa: E402
from kimi_ops.mailbox import SENTINEL, KimiMailboxError, parities, raise_if_error  # noqa: E402
from kimi_ops.testing.tail_boxes import TailBoxes  # noqa: E402

from conftest import KERNEL_BATCHES, armed_box, assert_tail_close, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory

kimi = torch.ops.kimi
LATENT, HIDDEN, CAPACITY = 3584, 7168, 64


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("batch", [1, 4, 8, 64])
@pytest.mark.parametrize("publish", [False, True])
def test_tail_compiles(tp, batch, publish, clean_ptxas):
    assert host.compile_tail.build(tp, HIDDEN // tp, LATENT, host.groups_of(batch), publish) is not None
    clean_ptxas()


@pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in tensors: on a CPU-only machine")
@pytest.mark.parametrize("publish", [False, True])
def test_moe_tail_launcher_takes_its_adapters_arguments(publish):
    """MoeTail's launcher checks fixed sizes: with DLPack stand-ins of the adapters' shapes
    the call gets past every argument check and fails only for want of a driver."""
    from standins import cuda_standin as cuda

    tp, batch, latent, shard = 1, 4, LATENT, HIDDEN
    if publish:
        boxes = cuda((3, tp, CAPACITY, latent)), cuda((3, tp, CAPACITY, shard))
    else:
        boxes = cuda((batch, latent)), cuda((batch, shard))
    launch = host.compile_tail.build(tp, shard, latent, 1, publish)
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        launch(*boxes, cuda((latent,)), cuda((shard, latent)), cuda((batch, shard)), cuda((tp,), "i64"),
               cuda((1,), "i32"), 0, 0, 1e-6, batch, 2, batch)


@pytest.mark.parametrize("tp", [1, 8])
def test_stamping_publish_tail_compiles(tp, clean_ptxas):  # profile_tail.py --boxes: stamps after the error word
    assert host.compile_tail.build(tp, HIDDEN // tp, LATENT, 1, True, True) is not None
    clean_ptxas()


def test_stamping_tail_compiles(clean_ptxas):  # benchmarks/profile_tail.py's variant
    assert host.compile_tail.build(1, HIDDEN, LATENT, 1, False, True) is not None
    clean_ptxas()


@pytest.mark.parametrize("batch, stamps", [(32, False), (64, False), (64, True)])
def test_wave_tail_compiles(batch, stamps, clean_ptxas):
    assert host.compile_wave_tail.build(HIDDEN, LATENT, host.groups_of(batch), stamps) is not None
    clean_ptxas()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("batch", [32, 64])
def test_poll_wave_compiles(tp, batch, clean_ptxas):
    assert host.compile_poll_front.build(LATENT, tp, HIDDEN // tp) is not None
    assert host.compile_wave_tail.build(HIDDEN // tp, LATENT, host.groups_of(batch), False, tp) is not None
    clean_ptxas(2)


@pytest.mark.parametrize("tp, groups, latent", [(1, 1, 512), (1, 8, 512), (2, 2, 512), (2, 8, 512), (1, 1, 1536)])
def test_wave_with_its_front_compiles(tp, groups, latent, clean_ptxas):
    """The wave with its own front (a TP8 rank's latent, L = 512; and 1536, whose 24 xn
    chunks at 32 tokens fill the slots)."""
    assert host.compile_wave_tail.build(HIDDEN // tp, latent, groups, False, tp, True) is not None
    clean_ptxas()


def test_the_wave_runs_its_own_front_up_to_front_groups_where_xn_fits():
    """poll_variant with ``front_groups`` (bench_layer --wave-front-groups): one launch up
    to that many token groups where every xn chunk fits the wave's slots (a TP8 rank's
    L = 512: 32 KB at 32 tokens), PollNormFront + the wave past them and at L = 3584 (224 KB)."""
    def launches(latent, groups, front_groups, tp=1):
        return len(host.poll_variant(tp, HIDDEN // tp, latent, groups, tp, False, 1, front_groups).kernels())

    compiled = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host, "compile_wave_tail", lambda *key: compiled.append(key) or "wave")
        patch.setattr(host, "compile_poll_front", lambda *key: "front")
        assert [launches(512, g, 2) for g in (1, 2, 3)] == [1, 1, 2] and launches(512, 1, 2, tp=2) == 1
        assert launches(512, 1, 0) == 2 and launches(LATENT, 1, 8) == 2
    assert compiled[0] == (HIDDEN, 512, 1, False, 1, True) and compiled[2] == (HIDDEN, 512, 3, False, 1)
    assert host.wave_plan(HIDDEN, 512, 8).holds_xn and not host.wave_plan(HIDDEN, LATENT, 1).holds_xn


def test_poll_front_at_a_tp8_ranks_latent_compiles(clean_ptxas):
    assert host.compile_poll_front.build(512, 1, HIDDEN) is not None  # 64 threads a CTA
    clean_ptxas()


def test_the_polled_tail_is_the_wave_from_min_groups():
    """poll_variant's form: MoeTail below ``min_groups`` token groups, PollNormFront +
    WaveMoeTail from there (bench_layer --wave-from-groups); by default the wave at every
    batch (MIN_POLL_WAVE_GROUPS), at a TP8 rank's latent too; MoeTail for two-shot's
    gathered box (one source) at TP2."""
    assert wave.MIN_POLL_WAVE_GROUPS == 1
    for latent in (LATENT, 512):
        for groups in (1, 2, wave.MAX_WAVE_GROUPS):
            assert isinstance(host.poll_variant(1, HIDDEN, latent, groups, 1).plan, wave.WavePlan)
        assert isinstance(host.poll_variant(1, HIDDEN, latent, 2, 1, False, 3).plan, split_plan.Plan)
        assert isinstance(host.poll_variant(1, HIDDEN, latent, 3, 1, False, 3).plan, wave.WavePlan)
        assert isinstance(host.poll_variant(2, HIDDEN // 2, latent, 1, 1).plan, split_plan.Plan)


def test_poll_front_spreads_the_rearm():
    """PollNormFront's grid: a CTA a token, and enough CTAs that no thread re-arms more than
    REARM_STORES packets (a TP8 rank's first layer re-arms the whole capacity)."""
    front = fronts.PollNormFront(512, 1)
    assert front.threads == 64
    assert front.ctas(1, 64, HIDDEN) == 60 and front.ctas(64, 64, HIDDEN) == 64  # 61,440 packets
    assert front.ctas(1, 1, HIDDEN) == 1 and front.ctas(8, 8, HIDDEN) == 8
    for batch, rearm in ((1, 64), (5, 64), (17, 17), (40, 64)):
        ctas = front.ctas(batch, rearm, HIDDEN)
        assert ctas >= batch and ctas * front.threads * fronts.REARM_STORES >= rearm * (512 + HIDDEN) // 8
    wide = fronts.PollNormFront(LATENT, 2)  # kimi_k3 at TP2: a CTA a token covers the re-arm
    assert wide.ctas(17, 64, HIDDEN // 2) == 17


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_fronts_and_push_compile(tp, clean_ptxas):
    assert host.compile_front.build(LATENT, tp) is not None
    assert host.compile_push.build(HIDDEN, tp) is not None
    if tp == 1:
        for per_sm in (1, 2):
            assert host.compile_norm_front.build(LATENT, per_sm) is not None
    clean_ptxas(4 if tp == 1 else 2)


@pytest.mark.parametrize("tp", [4, 8, 16])
def test_two_shot_kernels_compile(tp, clean_ptxas):
    """The publish into the receive boxes, the owners' reduce, and MoeTail polling the
    one-source gathered box (the poll's variant past 8 tokens)."""
    assert host.compile_front.build(LATENT, tp, LATENT // tp) is not None
    assert host.compile_reduce.build(LATENT // tp, tp) is not None
    assert host.compile_tail.build(tp, HIDDEN // tp, LATENT, 2, True, sources=1) is not None
    assert host.poll_variant(tp, HIDDEN // tp, LATENT, 8, 1).plan.sources == 1
    clean_ptxas(3)


def test_stash_takes_what_the_registers_hold():
    """Functional mode holds 32 registers per stashed chunk per lane beside 12 per token
    group (ptxas -v, no spills under the 168 cap of nine warps: 156 registers at B <= 8,
    129 at B = 16, 168 at B = 32, 152 at B = 64); publish mode's polls leave no room."""
    assert [host.plan_for(1, HIDDEN, LATENT, g).stash for g in (1, 2, 4, 8)] == [4, 3, 3, 1]
    assert split.MoeTail(host.plan_for(2, HIDDEN // 2, LATENT, 1), publish=True).stashed == 0


def test_front_takes_two_per_sm_where_its_ctas_fit_beside_the_tail(monkeypatch):
    """H200 (132 SMs): the wave's 112 CTAs leave 20 SMs, 40 NormFront CTAs at two per SM;
    MoeTail's 28 clusters of 4 as well."""
    monkeypatch.setattr(host, "multiprocessors", lambda device: 132)
    assert host.functional_ctas(HIDDEN, LATENT, 16) == 112
    assert [host.front_per_sm(HIDDEN, LATENT, b, 0) for b in (1, 8, 16, 32, 40, 48, 64)] == [2, 2, 2, 2, 2, 1, 1]


def test_prepare_skips_shapes_the_kernel_does_not_take(monkeypatch):
    """L = 128 (KimiConfig.tiny) runs the reference: a decoder's prepare must not fail on it."""
    compiled = []
    monkeypatch.setattr(host, "compile_tail", lambda *key: compiled.append(key))
    monkeypatch.setattr(host, "compile_norm_front", lambda *key: None)
    host.TailKernel().prepare(128, 256, [1, 16])
    host.TailPollKernel().prepare(2, 128, 128, [1, 16])
    assert compiled == []
    host.TailKernel().prepare(256, 256, [1, 16])
    host.TailPollKernel().prepare(2, 128, 256, [16])
    assert compiled == [(1, 256, 256, 1, False, False), (1, 256, 256, 2, False, False), (2, 128, 256, 2, True)]


def test_prepare_compiles_the_wave_past_its_first_groups(monkeypatch):
    compiled = []
    monkeypatch.setattr(host, "compile_tail", lambda *key: compiled.append(("tail", *key)))
    monkeypatch.setattr(host, "compile_wave_tail", lambda *key: compiled.append(("wave", *key)))
    monkeypatch.setattr(host, "compile_norm_front", lambda *key: None)
    host.TailKernel().prepare(LATENT, HIDDEN, [1, 16, 32, 64])
    assert compiled == [("tail", 1, HIDDEN, LATENT, 1, False, False), ("tail", 1, HIDDEN, LATENT, 2, False, False),
                        ("wave", HIDDEN, LATENT, 4, False), ("wave", HIDDEN, LATENT, 8, False)]


def test_poll_prepare_compiles_the_wave_up_to_max_wave_tp(monkeypatch):
    compiled = []
    monkeypatch.setattr(host, "compile_tail", lambda *key: compiled.append(("tail", *key)))
    monkeypatch.setattr(host, "compile_wave_tail", lambda *key: compiled.append(("wave", *key)))
    monkeypatch.setattr(host, "compile_poll_front", lambda *key: compiled.append(("front", *key)))
    for tp in (1, 2, 8):
        host.TailPollKernel().prepare(tp, HIDDEN // tp, LATENT, [1, 64])
    host.TailPollKernel().prepare(8, HIDDEN // 8, LATENT, [1, 64], (), [64])  # B = 64 polls two-shot's gathered box
    assert compiled == [  # the wave at every batch up to TP2 (MIN_POLL_WAVE_GROUPS)
        ("front", LATENT, 1, HIDDEN), ("wave", HIDDEN, LATENT, 1, False, 1),
        ("front", LATENT, 1, HIDDEN), ("wave", HIDDEN, LATENT, 8, False, 1),
        ("front", LATENT, 2, HIDDEN // 2), ("wave", HIDDEN // 2, LATENT, 1, False, 2),
        ("front", LATENT, 2, HIDDEN // 2), ("wave", HIDDEN // 2, LATENT, 8, False, 2),
        ("tail", 8, HIDDEN // 8, LATENT, 1, True), ("tail", 8, HIDDEN // 8, LATENT, 8, True),
        ("tail", 8, HIDDEN // 8, LATENT, 1, True), ("tail", 8, HIDDEN // 8, LATENT, 8, True, False, 1),
    ]


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_plan_covers_every_row_once_in_one_wave(tp):
    for groups in range(1, 9):
        plan = split_plan.Plan(tp, HIDDEN // tp, LATENT, groups)
        assert plan.clusters * plan.tiles * split_plan.TILE_ROWS >= plan.shard
        assert (plan.clusters - 1) * plan.tiles * split_plan.TILE_ROWS < plan.shard
        assert plan.clusters <= split_plan.ONE_WAVE_CLUSTERS and plan.warps <= split_plan.MAX_WARPS
        assert (plan.xn_words + plan.ss_words + plan.ring_words) * 4 <= SMEM_BYTES
        assert plan.split * plan.warp_chunks * CHUNK * plan.cluster == plan.latent
        assert plan.rows <= 256 and plan.slot_bytes == plan.split * plan.rows * CHUNK * 2  # one TMA box per part
        # publish mode's polls: every round in some pass, at most LATENT_LOADS packets in flight per lane
        assert plan.rounds_per_pass * plan.tp * plan.tokens_per_pass <= max(split_plan.LATENT_LOADS, 16)
        assert plan.rounds_per_pass >= 1 and plan.rounds % plan.rounds_per_pass == 0


def test_wave_plan_covers_every_row_in_one_wave_and_fits():
    """A CTA per 64 rows over the whole K (112 at TP1: one wave, in clusters); wgmma's N in
    whole 8-row atoms per multicasting CTA; the rings and barriers within shared memory;
    each warpgroup's stash within its register budget (ptxas -v: no spills)."""
    assert host.wave_plan_for(HIDDEN, LATENT, wave.MIN_WAVE_GROUPS - 1) is None  # MoeTail's
    for groups in range(wave.MIN_WAVE_GROUPS, wave.MAX_WAVE_GROUPS + 1):
        plan = host.wave_plan_for(HIDDEN, LATENT, groups)
        assert plan.ctas * wave.WAVE_ROWS == HIDDEN and plan.ctas % wave.WAVE_CLUSTER == 0
        assert plan.ctas <= split_plan.ONE_WAVE_CLUSTERS * split_plan.CLUSTER
        assert plan.tokens >= 8 * groups and plan.tokens % (8 * wave.WAVE_CLUSTER) == 0
        assert plan.chunks * CHUNK == LATENT and plan.packets * 32 == plan.tokens
        assert 1024 + plan.xn_depth * plan.xn_bytes + plan.depth * plan.slot_bytes <= SMEM_BYTES
        assert 8 * (2 * plan.depth + 2 * plan.xn_depth + 2) <= 1024
        assert plan.accumulators + plan.tokens // 8 + 16 * plan.stash <= wave.WAVE_REGISTERS and plan.stash >= 1
        assert 2 * plan.stash + plan.depth < plan.chunks  # the ring refills
    assert wave.PRODUCER_REGISTERS * 128 + wave.CONSUMER_REGISTERS * 256 <= 64 * 1024
    assert [(p.sets, p.stash) for p in (host.wave_plan_for(HIDDEN, LATENT, g) for g in (4, 8))] == [(1, 10), (2, 7)]
    assert host.wave_plan_for(HIDDEN, LATENT, 9) is None and host.wave_plan_for(7168 - 64, LATENT, 4) is None


def test_wave_a_fragments_read_the_rows_of_their_warp():
    """WavePlan.a_piece over TMA's swizzled 64-row box: ldmatrix.x4 gives each warp the
    m16n8k16 A layout of its 16 rows (wgmma's register A), conflict-free."""
    plan = host.wave_plan_for(HIDDEN, LATENT, 8)
    gen = torch.Generator().manual_seed(5)
    slot = plan.depth - 1
    box = torch.randn(wave.WAVE_ROWS, CHUNK, generator=gen, dtype=torch.float64)
    ring = {swizzled(slot * wave.WAVE_ROWS, row, piece): box[row, 8 * piece : 8 * piece + 8]
            for row in range(wave.WAVE_ROWS) for piece in range(CHUNK // 8)}
    b = torch.randn(CHUNK, 8, generator=gen, dtype=torch.float64)
    for warp in range(wave.WAVE_WARPS):
        acc = torch.zeros(16, 8, dtype=torch.float64)
        for k16 in range(CHUNK // 16):
            a = ldmatrix_x4(ring, [plan.a_piece(slot, warp, k16, lane) for lane in range(32)])
            b_regs = [((b[16 * k16 + 2 * (l % 4), l // 4], b[16 * k16 + 2 * (l % 4) + 1, l // 4]),
                       (b[16 * k16 + 8 + 2 * (l % 4), l // 4], b[16 * k16 + 9 + 2 * (l % 4), l // 4])) for l in range(32)]
            acc += mma_m16n8k16(a, b_regs)
        torch.testing.assert_close(acc, box[16 * warp : 16 * warp + 16] @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [4, 8])
def test_wave_epilogue_hands_each_sum_to_its_half_and_stores_every_packet_once(groups):
    """CPU model of WaveMoeTail.consume's epilogue through WavePlan's maps: each warpgroup
    writes the other half's accumulators (WavePlan.partial_word) without overlap, reads
    back the other warpgroup's sum of the same (token, row), and its threads' packets
    (WavePlan.packet) cover exactly its half, every (token, 8 rows) once."""
    plan = host.wave_plan_for(HIDDEN, LATENT, groups)
    threads, half = 32 * wave.WAVE_WARPS, plan.tokens // 16

    def element(k, position):  # the m64nN C layout: (token, row) of accumulator k
        warp, g, t = position // 32, position % 32 // 4, position % 4
        return 8 * (k // 4) + 2 * t + k % 2, 16 * warp + 8 * (k % 4 // 2) + g

    handed = {}
    for writer in range(2):
        for position in range(threads):
            for j in range(half):
                for r in range(4):
                    word = plan.partial_word(writer, j, r, position)
                    assert word not in handed
                    handed[word] = (writer, element(4 * ((1 - writer) * half + j) + r, position))
    assert sorted(handed) == list(range(plan.tokens * wave.WAVE_ROWS))  # the staging starts after
    for owner in range(2):
        for position in range(threads):
            for j in range(half):
                for r in range(4):
                    writer, at = handed[plan.partial_word(1 - owner, j, r, position)]
                    assert writer == 1 - owner and at == element(4 * (owner * half + j) + r, position)
                    assert (at[0] >= plan.tokens // 2) == owner
    stored = [plan.packet(q, tid) + (tid // threads,) for tid in range(2 * threads) for q in range(plan.packets)]
    assert sorted((token, row) for token, row, _ in stored) == [(token, row) for token in range(plan.tokens)
                                                                for row in range(0, wave.WAVE_ROWS, 8)]
    assert all((token >= plan.tokens // 2) == owner for token, _, owner in stored)


def mma_m16n8k16(a_regs, b_regs):
    """The PTX fragment layout of mma.sync.m16n8k16.row.col: ``a_regs[lane]`` the four A
    registers and ``b_regs[lane]`` the two B registers of each lane, each register a pair
    of values (low first). Returns D = A·B [16, 8] in float64."""
    a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            a[g, 2 * t + e], a[g + 8, 2 * t + e] = a_regs[lane][0][e], a_regs[lane][1][e]
            a[g, 2 * t + 8 + e], a[g + 8, 2 * t + 8 + e] = a_regs[lane][2][e], a_regs[lane][3][e]
            b[2 * t + e, g], b[2 * t + 8 + e, g] = b_regs[lane][0][e], b_regs[lane][1][e]
    return a @ b


def ldmatrix_x4(pieces, rows):
    """ldmatrix.x4 of 16-byte ``pieces`` (8 BF16 each) at the 32 lanes' row addresses
    ``rows``: lane (g, t) gets the pair (row g, columns 2t, 2t + 1) of matrix m (rows from
    lanes 8m..8m + 7) in register m. Also checks that every 8x8 matrix is conflict-free:
    its eight rows in distinct 16-byte bank groups."""
    for m in range(4):
        assert len({rows[8 * m + r] % 8 for r in range(8)}) == 8, "ldmatrix rows share banks"
    return [[pieces[rows[8 * m + lane // 4]][2 * (lane % 4) : 2 * (lane % 4) + 2] for m in range(4)]
            for lane in range(32)]


@pytest.mark.parametrize("tp, groups", [(1, 1), (1, 8), (2, 3), (8, 2)])
def test_shared_memory_layouts_feed_the_mma_the_right_columns(tp, groups):
    """CPU model of one warp and one ring slot through the kernel's own index maps: TMA's
    128-byte swizzled box (Plan.ring_piece), the xn stores (MoeTail.xn_packet), the
    ldmatrix rows (Plan.a_piece, Plan.b_piece) into the PTX m16n8k16 fragment layout; the
    sums must be W · xnᵀ, and every ldmatrix conflict-free."""
    plan = split_plan.Plan(tp, HIDDEN // tp, LATENT, groups)
    kernel = split.MoeTail(plan, publish=False)
    gen = torch.Generator().manual_seed(tp * 10 + groups)
    warp, i = plan.warps - 1, plan.warp_chunks - 1
    row_group, sub, slot = warp // plan.split, warp % plan.split, i % plan.depth
    chunk = sub * plan.warp_chunks + i  # of the CTA's K slice
    box = torch.randn(plan.rows, CHUNK, generator=gen, dtype=torch.float64)  # TMA's rows × CHUNK for part sub
    xn = torch.randn(8 * groups, plan.cols, generator=gen, dtype=torch.float64)
    ring = {plan.ring_piece(slot, sub, row, piece): box[row, 8 * piece : 8 * piece + 8]
            for row in range(plan.rows) for piece in range(CHUNK // 8)}
    xn_pieces = {kernel.xn_packet(token, packet): xn[token, 8 * packet : 8 * packet + 8]
                 for token in range(8 * groups) for packet in range(plan.cols // 8)}
    assert len(ring) == plan.rows * CHUNK // 8 and len(xn_pieces) == xn.numel() // 8  # no piece overwritten
    acc = torch.zeros(split_plan.TILES_PER_WARP, groups, 16, 8, dtype=torch.float64)
    for pair in range(CHUNK // 32):
        for n in range(groups):
            b = ldmatrix_x4(xn_pieces, [plan.b_piece(chunk, n, pair, lane) for lane in range(32)])
            for u in range(2):
                for p in range(split_plan.TILES_PER_WARP):
                    a_rows = [plan.a_piece(slot, sub, row_group, p, 2 * pair + u, lane) for lane in range(32)]
                    a = ldmatrix_x4(ring, a_rows)
                    acc[p, n] += mma_m16n8k16(a, [(regs[2 * u], regs[2 * u + 1]) for regs in b])
    columns = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
    for p in range(split_plan.TILES_PER_WARP):
        rows = box[(row_group * split_plan.TILES_PER_WARP + p) * 16 : (row_group * split_plan.TILES_PER_WARP + p + 1) * 16]
        for n in range(groups):
            want = rows @ xn[n * 8 : n * 8 + 8, columns].T
            torch.testing.assert_close(acc[p, n], want, rtol=1e-12, atol=1e-12)


def test_profile_phase_table():
    """benchmarks/profile_tail.py's analysis on known stamps: calls given out of order, CTA
    a of call c at phase k at c·10 + k + a/10 µs (+7 ns) on a 2 GHz clock."""
    from benchmarks import profile_tail

    calls, ctas, phases, epoch = 4, 3, 5, 1_764_000_000_000_000_000  # ns since 1970: beyond float64's ns
    ns = torch.tensor([[[c * 10_000 + k * 1_000 + a * 100 + 7 for k in range(phases)] for a in range(ctas)]
                       for c in range(calls)], dtype=torch.int64)
    stamps = torch.stack([epoch + ns, 5_000_000 + 2 * ns], dim=-1)[torch.tensor([2, 0, 3, 1])]
    table, overlap, ghz = profile_tail.phase_table(stamps)
    want = [[k, k + 0.1, k + 0.2, k] for k in range(phases)]
    assert torch.allclose(torch.tensor(table, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-9)
    assert abs(overlap - (4.2 - 10)) < 1e-9 and abs(ghz - 2) < 1e-12


def tail_args(batch, seed, hidden=HIDDEN, latent=LATENT):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    return (
        rand(batch, 16, latent), rand(batch, 16, scale=0.2), rand(batch, hidden),
        rand(latent, scale=0.1) + 1, rand(hidden, latent, scale=latent**-0.5),
    )


def poisoned(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES + (24, 40, 57))  # 24, 40, 57: batches the wave pads
def test_tail_kernel(batch):
    args = tail_args(batch, seed=batch)
    out = kimi.moe_tail(*args, 1e-6)
    assert_tail_close(out, reference(kimi.moe_tail, *args, 1e-6), args[2])


@on_hopper
@pytest.mark.parametrize("batch", [40, 57])
def test_tail_kernel_padded_rows_stay_out(batch):
    """The wave reads xn in boxes of its padded tokens, rows the front leaves unwritten:
    freed NaN blocks of the op's allocation sizes go to those rows (and to ``out``)."""
    args = tail_args(batch, seed=batch + 1)
    tokens = host.wave_plan_for(HIDDEN, LATENT, host.groups_of(batch)).tokens
    poison = [poisoned(tokens, LATENT), poisoned(batch, HIDDEN)]
    del poison  # the caching allocator hands these blocks to the op's new_empty
    out = kimi.moe_tail(*args, 1e-6)
    assert_tail_close(out, reference(kimi.moe_tail, *args, 1e-6), args[2])


@on_hopper
def test_tail_kernel_negative_zero_and_nan_rows():
    expanded, weights, shared, gamma, w_up = tail_args(4, seed=9)
    expanded[1] = -0.0
    expanded[2, 3] = float("nan")
    got = kimi.moe_tail(expanded, weights, shared, gamma, w_up, 1e-6)
    want = reference(kimi.moe_tail, expanded, weights, shared, gamma, w_up, 1e-6)
    assert torch.isnan(got[2]).all() and not torch.isnan(got[[0, 1, 3]]).any()
    assert_tail_close(got, want, shared)
    again = tail_args(4, seed=10)  # later calls unaffected
    assert_tail_close(kimi.moe_tail(*again, 1e-6), reference(kimi.moe_tail, *again, 1e-6), again[2])


def tail_boxes():
    return TailBoxes(CAPACITY, LATENT, HIDDEN, "cuda")


def layer(boxes, expanded, weights, shared, gamma, w_up, parity, rearm_parity, rearm_batch):
    """One MoE tail through ``boxes``, then take: returns the output rows."""
    boxes.tail(expanded, weights, shared, gamma, w_up, 1e-6, parity, rearm_parity, rearm_batch)
    return kimi.mailbox_take(boxes.out, 0, expanded.shape[0], boxes.error)[0]


def armed(rows):
    return bool((rows.contiguous().view(torch.int32) == torch.tensor(SENTINEL, dtype=torch.int32)).all())


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_tail_mailbox_ops_match_the_reference(batch):
    expanded, weights, shared, gamma, w_up = tail_args(batch, seed=100 + batch)
    ours, theirs = tail_boxes(), tail_boxes()
    for boxes in (ours, theirs):  # the previous layer's parity 2 holds a published batch
        boxes.latent[2, :, :batch].normal_()
        boxes.rs[2, :, :batch].normal_()
    got = layer(ours, expanded, weights, shared, gamma, w_up, 0, 2, batch)
    want = reference(layer, theirs, expanded, weights, shared, gamma, w_up, 0, 2, batch)
    assert_tail_close(got, want, shared)
    assert torch.equal(ours.latent, theirs.latent)  # the published partial, bit for bit
    assert torch.equal(ours.rs, theirs.rs)
    assert armed(ours.latent[2]) and armed(ours.rs[2]) and armed(ours.out)
    assert int(ours.error) == 0


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_tail_serve_equals_the_three_launches(batch):
    """moe_tail_serve (the publish kernel, then the poll's, in one op) bit-equal to the
    three ops on CUDA, and against their reference: the output rows,
    the published partial bit for bit, the previous parity re-armed, no error."""
    expanded, weights, shared, gamma, w_up = tail_args(batch, seed=700 + batch)
    ours, split, theirs = tail_boxes(), tail_boxes(), tail_boxes()
    for boxes in (ours, split, theirs):
        boxes.latent[2, :, :batch].normal_()
        boxes.rs[2, :, :batch].normal_()
    ours.tail(expanded, weights, shared, gamma, w_up, 1e-6, 0, 2, batch, serve=True)
    got = kimi.mailbox_take(ours.out, 0, batch, ours.error)[0]
    assert torch.equal(got, layer(split, expanded, weights, shared, gamma, w_up, 0, 2, batch))  # the same kernels' bits
    want = reference(layer, theirs, expanded, weights, shared, gamma, w_up, 0, 2, batch)
    assert_tail_close(got, want, shared)
    assert torch.equal(ours.latent[0], theirs.latent[0]) and torch.equal(ours.rs[0], theirs.rs[0])
    assert armed(ours.latent[2]) and armed(ours.rs[2]) and armed(ours.out)
    assert int(ours.error) == 0


@on_hopper
@pytest.mark.parametrize("tp", [2, 8])
def test_tail_serve_of_the_last_rank_polls_its_peers_and_times_out_without_them(tp):
    """The last rank of TP2 / TP8 serves at parity 1 after its peers published their
    partials and pushed their shards (one device, the peers first): bit-equal to its
    publish and poll as two ops on CUDA (the peers' latent boxes too: its partial landed in
    each), the previous parity (0, junk before) re-armed; without the peers' rows the
    polls time out into the error word."""
    shard, batch, rank, parity = HIDDEN // tp, 4, tp - 1, 1
    gen = torch.Generator().manual_seed(40 + tp)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    gamma, w_up = rand(LATENT, scale=0.1) + 1, rand(shard, LATENT, scale=LATENT**-0.5)
    expanded = [rand(batch, 16, LATENT, scale=0.3) for _ in range(tp)]
    weights = [rand(batch, 16, scale=0.2) for _ in range(tp)]
    shards = rand(tp, batch, shard)
    junk = rand(tp, batch, LATENT), rand(tp, batch, shard)

    def run(serve, peers=True):
        latent_boxes = [armed_box(3, tp, CAPACITY, LATENT) for _ in range(tp)]
        rs_box, out = armed_box(3, tp, CAPACITY, shard), [armed_box(1, 1, CAPACITY, HIDDEN) for _ in range(tp)]
        latent_boxes[rank][0, :, :batch], rs_box[0, :, :batch] = junk
        rs_box[parity, rank, :batch] = shards[rank]
        for peer in range(tp - 1) if peers else ():
            rs_box[parity, peer, :batch] = shards[peer]
            kimi.moe_tail_publish(expanded[peer], weights[peer], latent_boxes, parity, peer)
        error = torch.zeros(1, dtype=torch.int32, device="cuda")
        call = (gamma, w_up, 1e-6, out, error, parity, 0, batch, rank)
        if serve:
            kimi.moe_tail_serve(expanded[rank], weights[rank], latent_boxes, rs_box, *call)
        else:
            kimi.moe_tail_publish(expanded[rank], weights[rank], latent_boxes, parity, rank)
            kimi.moe_tail_poll(latent_boxes[rank], rs_box, *call, batch)
        return latent_boxes, rs_box, out, error

    got, want = run(True), run(False)
    for ours, theirs in zip(got[0] + [got[1]] + got[2], want[0] + [want[1]] + want[2]):
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert armed(got[0][rank][0]) and armed(got[1][0]) and int(got[3]) == 0 == int(want[3])
    columns = slice(rank * shard, (rank + 1) * shard)
    reference_out = reference(lambda: run(False))[2][0][0, 0, :batch, columns]
    assert_tail_close(got[2][0][0, 0, :batch, columns], reference_out, shards.float().sum(0).bfloat16())
    *_, error = run(True, peers=False)
    torch.cuda.synchronize()  # returns: the polls are bounded
    assert int(error) == 2 | 4


@on_hopper
@pytest.mark.parametrize("batch", [8, 32, 64])  # 32, 64: WaveMoeTail's publish mode (TP <= MAX_WAVE_TP)
def test_tail_poll_sums_the_sources_of_tp2(batch):
    """TP2's polled tail, both ranks on one device: each rank's latent and reduce-scatter
    boxes hold both sources (what the ranks' publish and push leave), and each rank's
    poll writes its shard's columns of out into both output boxes; against the
    reference, the previous parity re-armed, the rows past the batch left armed."""
    tp, shard = 2, HIDDEN // 2
    gen = torch.Generator().manual_seed(500 + batch)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    gamma, w_up = rand(LATENT, scale=0.1) + 1, rand(HIDDEN, LATENT, scale=LATENT**-0.5)
    latent = rand(tp, batch, LATENT, scale=0.3)  # every rank receives both partials
    shards = [rand(tp, batch, shard) for _ in range(tp)]  # rank r's box: every source's shard r
    previous = [rand(tp, batch, width) for width in (LATENT, shard)]

    def run():
        boxes = []
        for rank in range(tp):
            latent_box, rs_box = armed_box(3, tp, CAPACITY, LATENT), armed_box(3, tp, CAPACITY, shard)
            latent_box[0, :, :batch], rs_box[0, :, :batch] = latent, shards[rank]
            latent_box[2, :, :batch], rs_box[2, :, :batch] = previous
            boxes.append((latent_box, rs_box, torch.zeros(1, dtype=torch.int32, device="cuda")))
        outs = [armed_box(1, 1, CAPACITY, HIDDEN) for _ in range(tp)]
        for rank, (latent_box, rs_box, error) in enumerate(boxes):
            kimi.moe_tail_poll(latent_box, rs_box, gamma, w_up[rank * shard:(rank + 1) * shard], 1e-6, outs, error,
                               0, 2, batch, rank, batch)
        return boxes, outs

    (boxes, outs), (_, want) = run(), reference(run)
    shared = torch.cat([s.float().sum(0).bfloat16() for s in shards], dim=1)
    for out in outs:
        assert_tail_close(out[0, 0, :batch], want[0][0, 0, :batch], shared)
        assert armed(out[0, 0, batch:])
    for latent_box, rs_box, error in boxes:
        assert armed(latent_box[2]) and armed(rs_box[2]) and int(error) == 0


@on_hopper
@pytest.mark.parametrize("tp, batch, rearm_batch", [(4, 9, 9), (4, 64, CAPACITY), (8, 33, 33)])  # CAPACITY: the wrap
def test_two_shot_equals_one_shot(tp, batch, rearm_batch):
    """TP4 / TP8's latent all-reduce two-shot, every rank on one device in turn, on the
    kernels: each rank's partial chunks pushed to their owners (moe_tail_publish into the
    receive boxes), each owner's sum gathered into every rank's box (moe_latent_reduce),
    each rank's tail polling that one-source box. The output boxes bit-equal to the
    one-shot path's (the same kernels), the receive and gathered boxes to the reference's;
    the previous parity of the receive, gathered and shared boxes (junk rows: the previous
    layer's) re-armed; without a peer's push the reduce times out into the error word."""
    shard, parity, rearm = HIDDEN // tp, 1, 0
    gen = torch.Generator().manual_seed(70 + tp + batch)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    gamma, w_up = rand(LATENT, scale=0.1) + 1, rand(HIDDEN, LATENT, scale=LATENT**-0.5)
    expanded = [rand(batch, 16, LATENT, scale=0.3) for _ in range(tp)]
    weights = [rand(batch, 16, scale=0.2) for _ in range(tp)]
    shards = [rand(tp, batch, shard) for _ in range(tp)]  # rank r's reduce-scatter box: every source's shard r
    junk = {width: rand(tp, batch, width) for width in (LATENT, LATENT // tp, shard)}

    def run(two_shot, pushes=tp):
        boxes = lambda *shape: [armed_box(*shape) for _ in range(tp)]  # noqa: E731
        latent_boxes, recv, gathered = boxes(3, tp, CAPACITY, LATENT), boxes(3, tp, CAPACITY, LATENT // tp), \
            boxes(3, 1, CAPACITY, LATENT)
        rs, outs = boxes(3, tp, CAPACITY, shard), boxes(1, 1, CAPACITY, HIDDEN)
        errors = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(tp)]
        for rank in range(tp):
            rs[rank][parity, :, :batch] = shards[rank]
            for box in (latent_boxes[rank], recv[rank], gathered[rank], rs[rank]):  # the previous layer's, consumed
                box[rearm, :, :batch] = junk[box.shape[3]][:box.shape[1]]
        for rank in range(pushes):
            kimi.moe_tail_publish(expanded[rank], weights[rank], recv if two_shot else latent_boxes, parity, rank)
        reduces = [(recv[rank], gathered, errors[rank], parity, rearm, rearm_batch, rank, batch) for rank in range(tp)]
        polls = [(gathered[rank] if two_shot else latent_boxes[rank], rs[rank], gamma, w_up[rank * shard:(rank + 1) * shard],
                  1e-6, outs, errors[rank], parity, rearm, rearm_batch, rank, batch) for rank in range(tp)]
        assert backend.KERNELS["moe_tail_publish"].unsupported(expanded[0], weights[0], recv, parity, 0) is None
        assert backend.KERNELS["moe_latent_reduce"].unsupported(*reduces[0]) is None
        assert backend.KERNELS["moe_tail_poll"].unsupported(*polls[0]) is None
        for call in reduces if two_shot else ():
            kimi.moe_latent_reduce(*call)
        if pushes < tp:
            return errors
        for call in polls:
            kimi.moe_tail_poll(*call)
        return recv, gathered, rs, outs, errors

    recv, gathered, rs, outs, errors = run(True)
    one_shot = run(False)[3]
    for ours, theirs in zip(outs, one_shot):
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    want_recv, want_gathered, _, want_outs, _ = reference(run, True)
    for ours, theirs in zip(recv + gathered, want_recv + want_gathered):
        assert torch.equal(ours[parity].view(torch.int16), theirs[parity].view(torch.int16))
    shared = torch.cat([s.float().sum(0).bfloat16() for s in shards], dim=1)
    assert_tail_close(outs[0][0, 0, :batch], want_outs[0][0, 0, :batch], shared)
    assert all(armed(box[rearm]) for box in recv + gathered + rs) and all(int(e) == 0 for e in errors)
    errors = run(True, pushes=tp - 1)  # the last rank never pushes
    torch.cuda.synchronize()  # returns: the polls are bounded
    assert [int(e) for e in errors] == [32] * tp


@on_hopper
def test_tail_poll_rearms_the_whole_capacity_past_its_tokens_ctas():
    """A TP8 rank's latent (L = 512, 64 threads a front CTA) in the wave's publish mode,
    the first layer's re-arm of the whole capacity (rearm_batch = CAP): PollNormFront's
    grid is more CTAs than tokens, the ones past the batch only re-arming. Every row of
    the previous parity re-armed, out against the reference, no error."""
    latent, batch, parity, rearm = 512, 17, 0, 2
    gen = torch.Generator().manual_seed(812)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    gamma, w_up = rand(latent, scale=0.1) + 1, rand(HIDDEN, latent, scale=latent**-0.5)
    assert host.poll_wave_plan(1, HIDDEN, latent, host.groups_of(batch)) is not None  # the wave's path
    assert fronts.PollNormFront(latent, 1).ctas(batch, CAPACITY, HIDDEN) > batch
    fresh = [rand(1, batch, latent, scale=0.3), rand(1, batch, HIDDEN)]
    junk = [rand(1, CAPACITY, latent), rand(1, CAPACITY, HIDDEN)]

    def run():
        latent_box, rs_box = armed_box(3, 1, CAPACITY, latent), armed_box(3, 1, CAPACITY, HIDDEN)
        latent_box[parity, :, :batch], rs_box[parity, :, :batch] = fresh
        latent_box[rearm], rs_box[rearm] = junk
        out, error = armed_box(1, 1, CAPACITY, HIDDEN), torch.zeros(1, dtype=torch.int32, device="cuda")
        kimi.moe_tail_poll(latent_box, rs_box, gamma, w_up, 1e-6, [out], error, parity, rearm, CAPACITY, 0, batch)
        return latent_box, rs_box, out, error

    (latent_box, rs_box, out, error), want = run(), reference(run)[2]
    assert_tail_close(out[0, 0, :batch], want[0, 0, :batch], fresh[1][0])
    assert armed(latent_box[rearm]) and armed(rs_box[rearm]) and armed(out[0, 0, batch:]) and int(error) == 0


@on_hopper
@pytest.mark.parametrize("tp, batch, rearm_batch", [(1, 1, CAPACITY), (1, 5, 5), (1, 16, 16), (1, 33, 33),
                                                    (1, 64, CAPACITY), (2, 9, CAPACITY), (2, 64, CAPACITY)])
def test_the_waves_own_front_equals_poll_norm_front(tp, batch, rearm_batch, monkeypatch):
    """moe_tail_poll at a TP8 rank's latent (L = 512) with the wave's own front (one
    launch) against PollNormFront + the wave: every rank's output rows bit for bit, the
    previous parity re-armed (the wrap's whole capacity too), the rows past the batch
    left armed, no error; and against the reference."""
    latent, shard, parity, rearm = 512, HIDDEN // tp, 1, 0
    gen = torch.Generator().manual_seed(900 + 10 * tp + batch)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()  # noqa: E731
    gamma, w_up = rand(latent, scale=0.1) + 1, rand(HIDDEN, latent, scale=latent**-0.5)
    fresh = [rand(tp, batch, latent, scale=0.3), [rand(tp, batch, shard) for _ in range(tp)]]
    junk = [rand(tp, CAPACITY, latent), rand(tp, CAPACITY, shard)]

    def run(front_groups):
        monkeypatch.setattr(host.TailPollKernel, "front_groups", front_groups)
        outs, boxes = [armed_box(1, 1, CAPACITY, HIDDEN) for _ in range(tp)], []
        for rank in range(tp):
            latent_box, rs_box = armed_box(3, tp, CAPACITY, latent), armed_box(3, tp, CAPACITY, shard)
            latent_box[parity, :, :batch], rs_box[parity, :, :batch] = fresh[0], fresh[1][rank]
            latent_box[rearm], rs_box[rearm] = junk
            error = torch.zeros(1, dtype=torch.int32, device="cuda")
            kimi.moe_tail_poll(latent_box, rs_box, gamma, w_up[rank * shard:(rank + 1) * shard], 1e-6, outs, error,
                               parity, rearm, rearm_batch, rank, batch)
            boxes.append((latent_box, rs_box, error))
        return boxes, outs

    assert len(host.TailPollKernel().variant(tp, shard, latent, host.groups_of(batch), tp).kernels()) == 2
    (_, two), (boxes, one) = run(0), run(wave.MAX_WAVE_GROUPS)
    assert len(host.TailPollKernel().variant(tp, shard, latent, host.groups_of(batch), tp).kernels()) == 1
    want = reference(run, 0)[1]
    shared = torch.cat([s.float().sum(0).bfloat16() for s in fresh[1]], dim=1)
    for got, launched_apart, expected in zip(one, two, want):
        assert torch.equal(got.view(torch.int16), launched_apart.view(torch.int16))  # bits: −0 is not +0
        assert_tail_close(got[0, 0, :batch], expected[0, 0, :batch], shared)
        assert armed(got[0, 0, batch:])
    for latent_box, rs_box, error in boxes:
        assert armed(latent_box[rearm, :, :rearm_batch]) and armed(rs_box[rearm, :, :rearm_batch]) and int(error) == 0


@on_hopper
def test_the_waves_own_front_times_out_into_the_error_word(monkeypatch):
    """Nothing published: the front's latent polls and the shared polls give up into the
    error word (bounded), as PollNormFront's do."""
    monkeypatch.setattr(host.TailPollKernel, "front_groups", wave.MAX_WAVE_GROUPS)
    latent, gen = 512, torch.Generator().manual_seed(4)
    gamma = (torch.randn(latent, generator=gen) * 0.1 + 1).bfloat16().cuda()
    w_up = (torch.randn(HIDDEN, latent, generator=gen) * latent**-0.5).bfloat16().cuda()
    latent_box, rs_box = armed_box(3, 1, CAPACITY, latent), armed_box(3, 1, CAPACITY, HIDDEN)
    out, error = armed_box(1, 1, CAPACITY, HIDDEN), torch.zeros(1, dtype=torch.int32, device="cuda")
    assert len(host.TailPollKernel().variant(1, HIDDEN, latent, 1, 1).kernels()) == 1  # the front's form
    kimi.moe_tail_poll(latent_box, rs_box, gamma, w_up, 1e-6, [out], error, 0, 2, 4, 0, 4)
    torch.cuda.synchronize()  # returns: the polls are bounded
    assert int(error) == 2 | 4


@on_hopper
def test_tail_poll_times_out_into_the_error_word():
    boxes = tail_boxes()  # nothing published
    _, _, _, gamma, w_up = tail_args(1, seed=3)
    kimi.moe_tail_poll(boxes.latent, boxes.rs, gamma, w_up, 1e-6, [boxes.out], boxes.error, 0, 2, 4, 0, 4)
    torch.cuda.synchronize()  # returns: the polls are bounded
    assert int(boxes.error) == 2 | 4
    with pytest.raises(KimiMailboxError, match="latent"):
        raise_if_error(boxes.error)


@on_hopper
def test_tail_stack_graph_replays_1000_times():
    """6 MoE tails chained through their outputs (layer i's shared input is layer i−1's
    output), parities rotating by ordinal, captured once: 1000 replays over changing
    inputs equal eager runs of the same stack; every box ends armed except the last
    layer's published parity, which the next step's first layer re-arms."""
    layers, batch = 6, 4
    gen = torch.Generator().manual_seed(7)
    gamma = [(torch.randn(LATENT, generator=gen) * 0.1 + 1).bfloat16().cuda() for _ in range(layers)]
    w_up = [(torch.randn(HIDDEN, LATENT, generator=gen) * LATENT**-0.5).bfloat16().cuda() for _ in range(layers)]
    static = [tail_args(batch, seed=200 + i)[:2] for i in range(layers)]
    shared0 = tail_args(batch, seed=300)[2]
    boxes = tail_boxes()

    def stack():
        shared = shared0
        for i in range(layers):
            parity, rearm = parities(i, layers)
            expanded, weights = static[i]
            shared = layer(boxes, expanded, weights, shared, gamma[i], w_up[i], parity, rearm,
                           CAPACITY if i == 0 else batch)
        return shared

    stack()  # warm up: compiles, address tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = stack()
    fresh = torch.Generator().manual_seed(8)
    for replay in range(1000):
        for expanded, weights in static:
            expanded.copy_(torch.randn(expanded.shape, generator=fresh).bfloat16())
        shared0.copy_(torch.randn(shared0.shape, generator=fresh).bfloat16())
        graph.replay()
        got = static_out.clone()
        assert torch.equal(got, stack()), replay
    torch.cuda.synchronize()
    assert int(boxes.error) == 0
    last = parities(layers - 1, layers)[0]
    for parity in range(3):
        rows = slice(batch, None) if parity == last else slice(None)
        assert armed(boxes.latent[parity, :, rows]) and armed(boxes.rs[parity, :, rows])
    assert armed(boxes.out)
