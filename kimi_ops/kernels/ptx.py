"""Hand-written PTX for every kernel family: small named helpers, one instruction (or one
fixed sequence) each, where ``cute.arch`` has none that fits. Bit casts and rounding as
torch rounds; 16-byte (and smaller) global, shared and cluster accesses, relaxed at system
scope where a peer polls; the sleep and fence of the polls; ldmatrix, mma.sync and wgmma."""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Bit casts and rounding.

@cute.jit
def float_bits(x: Float32) -> Uint32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Uint32], read_only_args=[x])


@cute.jit
def bits_float(x: Uint32) -> Float32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


@cute.jit
def pack_bf16(low: Float32, high: Float32) -> Uint32:
    """Two FP32 values rounded (RNE) into one BF16x2 word, ``low`` in the low half."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[high, low]
    )


def pack_values(values) -> list:
    """FP32 values (an even count: a packet's 8) rounded into BF16x2 words, in order."""
    return [pack_bf16(values[i], values[i + 1]) for i in range(0, len(values), 2)]


@cute.jit
def divide(x: Float32, y: Float32) -> Float32:
    """IEEE x / y (div.rn), as torch divides."""
    return cute.arch.inline_ptx("div.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[x, y])


@cute.jit
def rsqrt_like_torch(x: Float32) -> Float32:
    """rsqrt.approx.f32 without flush-to-zero: what torch.rsqrt runs on CUDA, so that xn is
    bit-equal to the reference on the same device."""
    return cute.arch.inline_ptx("rsqrt.approx.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


def f32_ptx(instruction: str, *args):
    """One FP32 instruction ``instruction d, a[, b]`` on FP32 operands."""
    operands = ", ".join(f"{{$r{i}}}" for i in range(len(args)))
    return cute.arch.inline_ptx(f"{instruction} {{$w0}}, {operands};", write_only_types=[Float32],
                                read_only_args=list(args))


abs_f32 = functools.partial(f32_ptx, "abs.f32")
max_nan = functools.partial(f32_ptx, "max.NaN.f32")  # max propagating NaN (as torch.amax and clamp_min do)
# IEEE 1/x (rcp.rn): exact for a power of two; 1/±0 = ±∞, 1/∞ = 0, as x / scale needs
reciprocal = functools.partial(f32_ptx, "rcp.rn.f32")
mul_rn = functools.partial(f32_ptx, "mul.rn.f32")  # a · b rounded on its own (ptxas never fuses .rn into an FMA)
add_rn = functools.partial(f32_ptx, "add.rn.f32")


@cute.jit
def e4m3_pair(high: Float32, low: Float32) -> Uint32:
    """Two e4m3 codes (RNE, saturated to ±448, NaN → 0x7F) in the low 16 bits, ``low`` first."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, {$r0}, {$r1}; cvt.u32.u16 {$w0}, t; }",
        write_only_types=[Uint32], read_only_args=[high, low],
    )


@cute.jit
def double_words(value: Float64):
    """An FP64 value as its two 32-bit words (low first), for st.async."""
    return cute.arch.inline_ptx("mov.b64 { {$w0}, {$w1} }, {$r0};", write_only_types=[Int32, Int32],
                                read_only_args=[value])


@cute.jit
def widened_bf16(word: Uint32):
    """The two BF16 values of a word (low half first) as FP64 times 2^-896, exact for every
    finite value (denormals and ±0 included) without a conversion unit's cvt: the BF16 bits
    (sign, then exponent and mantissa shifted 3 right) are the FP64's high word, whose
    exponent field is the BF16's (bias 127 read at 1023). Infinities and NaN come out finite."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 z, l, h; mov.b32 z, 0; shl.b32 l, {$r0}, 16; shr.s32 l, l, 3; and.b32 l, l, 0x8FFFE000;"
        " shr.s32 h, {$r0}, 3; and.b32 h, h, 0x8FFFE000; mov.b64 {$w0}, {z, l}; mov.b64 {$w1}, {z, h}; }",
        write_only_types=[Float64, Float64], read_only_args=[word],
    )


@cute.jit
def warp_max_bits(word: Uint32) -> Uint32:
    """The largest of the warp's words (unsigned), in every lane: one redux."""
    return cute.arch.inline_ptx("redux.sync.max.u32 {$w0}, {$r0}, 0xffffffff;", write_only_types=[Uint32],
                                read_only_args=[word])


# Memory: global (plain, or relaxed at system scope for mailboxes), shared, DSMEM.

@cute.jit
def load_words(address, polled: cutlass.Constexpr[bool] = False):
    """One 16-byte packet, four words, as one vector load; ``polled``: relaxed at system
    scope (a mailbox), else a plain load."""
    order = "relaxed.sys." if polled else ""
    return cute.arch.inline_ptx(
        f"ld.{order}global.v4.b32 {{ {{$w0}}, {{$w1}}, {{$w2}}, {{$w3}} }}, [{{$r0}}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[address],
    )


@cute.jit
def store_words(address, words, mailbox: cutlass.Constexpr[bool] = False):
    """Two or four words as one 8- or 16-byte vector store; ``mailbox``: relaxed at system
    scope (a packet a peer polls), else a plain store. ``address``: a pointer or a raw
    (peer) address."""
    order = "relaxed.sys." if mailbox else ""
    if cutlass.const_expr(len(words) == 2):
        cute.arch.inline_ptx(f"st.{order}global.v2.b32 [{{$r0}}], {{ {{$r1}}, {{$r2}} }};", read_only_args=[address, *words])
    else:
        cute.arch.inline_ptx(
            f"st.{order}global.v4.b32 [{{$r0}}], {{ {{$r1}}, {{$r2}}, {{$r3}}, {{$r4}} }};",
            read_only_args=[address, *words],
        )


@cute.jit
def load_pair(address):
    """Two words (four BF16 values), one 8-byte load."""
    return cute.arch.inline_ptx("ld.global.v2.b32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Uint32, Uint32],
                                read_only_args=[address])


@cute.jit
def store_word(address, word: Uint32):
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[address, word])


@cute.jit
def load_shared(address):
    """Four words from shared memory, one 16-byte load."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[address],
    )


@cute.jit
def store_shared(address, words):
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };", read_only_args=[address, *words])


@cute.jit
def load_shared_floats(address):
    """Two FP32 values from shared memory, one 8-byte load."""
    return cute.arch.inline_ptx("ld.shared.v2.f32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float32, Float32],
                                read_only_args=[address])


@cute.jit
def store_shared_floats(address, values):
    """Two FP32 values into our shared memory, one 8-byte store."""
    cute.arch.inline_ptx("st.shared.v2.f32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[address, *values])


@cute.jit
def load_shared_doubles(address):
    """Two FP64 values from shared memory, one 16-byte load."""
    return cute.arch.inline_ptx("ld.shared.v2.f64 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float64, Float64],
                                read_only_args=[address])


@cute.jit
def store_shared_doubles(address, low: Float64, high: Float64):
    """Two FP64 values into shared memory, one 16-byte store."""
    cute.arch.inline_ptx("st.shared.v2.f64 [{$r0}], { {$r1}, {$r2} };", read_only_args=[address, low, high])


@cute.jit
def copy_async(destination, source, policy=None):
    """16 bytes from global to shared memory by cp.async (L2 only: read once per CTA), with
    an L2 ``policy`` where given."""
    if cutlass.const_expr(policy is None):
        cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[destination, source])
    else:
        cute.arch.inline_ptx("cp.async.cg.shared.global.L2::cache_hint [{$r0}], [{$r1}], 16, {$r2};",
                             read_only_args=[destination, source, policy])


@cute.jit
def bulk_copy(destination, source, size: Int32, barrier, policy: Int64):
    """``size`` bytes (a multiple of 16) from global to shared memory as one bulk copy (TMA,
    no tensor map), completing on ``barrier``'s transaction count; L2 ``policy``."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [{$r0}], [{$r1}], {$r2}, [{$r3}], {$r4};",
        read_only_args=[destination, source, size, barrier, policy],
    )


@cute.jit
def store_cluster(address, value, cta):
    """One FP32 or FP64 value, or a list of two or four FP32 values (one vector store), into
    CTA ``cta``'s shared memory (DSMEM) at our ``address``."""
    remote = cute.arch.map_dsmem_ptr(address, cta)
    if cutlass.const_expr(isinstance(value, (list, tuple))):
        names = ", ".join(f"{{$r{i + 1}}}" for i in range(len(value)))
        cute.arch.inline_ptx(f"st.shared::cluster.v{len(value)}.f32 [{{$r0}}], {{ {names} }};",
                             read_only_args=[remote, *value])
    else:
        kind = "f64" if isinstance(value, Float64) else "f32"
        cute.arch.inline_ptx(f"st.shared::cluster.{kind} [{{$r0}}], {{$r1}};", read_only_args=[remote, value])


@cute.jit
def copy_to_peer(destination, source, size: Int32, barrier, cta):
    """``size`` bytes (a multiple of 16) of our shared memory at ``source`` into CTA ``cta``'s
    at our ``destination`` address, as one bulk copy completing on its ``barrier``'s
    transaction count (the copy's end is known only there: keep ``source`` until it is in)."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[cute.arch.map_dsmem_ptr(destination, cta), source, size, cute.arch.map_dsmem_ptr(barrier, cta)],
    )


@cute.jit
def l2_evict_first() -> Int64:
    """An L2 policy that evicts first: the weights stream through once per call and must
    not push out what the latency-bound loads read (expert rows, latent, gamma, shared)."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_first.b64 {$w0}, 1.0;", write_only_types=[Int64])


@cute.jit
def l2_evict_last() -> Int64:
    """An L2 policy that evicts last: rows many CTAs read again (the streamed experts' latent)."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_last.b64 {$w0}, 1.0;", write_only_types=[Int64])


# The polls' sleep and the group barrier's fence.

@cute.jit
def nap():
    """A short sleep between polls (64 ns), so spinning warps leave the SM's issue slots to others."""
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Uint32(64)])


@cute.jit
def fence_system():
    cute.arch.inline_ptx("fence.sc.sys;")


# Tensor cores: ldmatrix and mma.sync (MoeTail), wgmma (the wave, the projection engine).

@cute.jit
def load_matrices(address):
    """ldmatrix.x4: lane l gives the address of row l % 8 of 8x8 matrix l // 8 (16 bytes);
    lane (g, t) receives the BF16 pair (row g, columns 2t, 2t + 1) of each matrix."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[address],
    )


@cute.jit
def mma_bf16(a, b, c):
    """D = A·B + C, mma.sync m16n8k16, BF16 inputs, FP32 accumulators."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { {$w0}, {$w1}, {$w2}, {$w3} },"
        " { {$r0}, {$r1}, {$r2}, {$r3} }, { {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c],
    )


@cute.jit
def mma_f64(a: Float64, b: Float64, c):
    """D = A·B + C, mma.sync m8n8k4 in FP64 (DMMA): lane l holds A[l // 4, l % 4],
    B[l % 4, l // 4] and C, D[l // 4, 2·(l % 4) + i] for i = 0, 1."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 { {$w0}, {$w1} }, { {$r0} }, { {$r1} }, { {$r2}, {$r3} };",
        write_only_types=[Float64] * 2, read_only_args=[a, b, *c],
    )


@dsl_user_op
def wgmma_bf16(acc, a, b, accumulate: bool = True, *, loc=None, ip=None):
    """acc + A·B by wgmma.mma_async m64nNk16 (N = 2 · len(acc)), BF16 → FP32 (``accumulate``
    False: A·B alone, acc's registers only receive it): A a shared descriptor or, from
    registers, four words in mma.sync's m16n8k16 A layout per warp; B a descriptor
    (K-major). Asynchronous: the results are not to be read before wgmma.wait_group (then
    through ``pinned``)."""
    n = len(acc)
    registers = isinstance(a, (list, tuple))
    a_values = [Uint32(w).ir_value(loc=loc, ip=ip) for w in a] if registers else [Int64(a).ir_value(loc=loc, ip=ip)]
    at = 2 * n  # after the outputs and the tied accumulators
    a_text = "{" + ", ".join(f"${at + k}" for k in range(4)) + "}" if registers else f"${at}"
    b_at = at + len(a_values)
    transpose = "" if registers else ", 0"  # K-major A: register A takes no transpose flag
    ptx = (f"{{ .reg .pred p; setp.ne.b32 p, ${b_at + 1}, 0; wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.bf16.bf16 "
           + "{" + ", ".join(f"${k}" for k in range(n)) + f"}}, {a_text}, ${b_at}, p, 1, 1{transpose}, 0; }}")
    constraints = ",".join(["=f"] * n + [str(k) for k in range(n)] + ["r" if registers else "l"] * len(a_values)
                           + ["l", "r"])
    operands = [Float32(x).ir_value(loc=loc, ip=ip) for x in acc] + a_values + [
        Int64(b).ir_value(loc=loc, ip=ip), Int32(int(accumulate)).ir_value(loc=loc, ip=ip)]
    return unpacked(llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * n), operands, ptx, constraints,
                                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                    loc=loc, ip=ip), n, loc, ip)


@dsl_user_op
def pinned(values, *, loc=None, ip=None):
    """``values`` through an empty volatile asm: their uses stay after what precedes it
    (wgmma.wait_group; the compiler would otherwise move arithmetic above it)."""
    n = len(values)
    result = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * n),
                             [Float32(x).ir_value(loc=loc, ip=ip) for x in values], "",
                             ",".join(["=f"] * n + [str(k) for k in range(n)]), has_side_effects=True,
                             is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return unpacked(result, n, loc, ip)


def unpacked(struct, n, loc, ip):
    return [Float32(llvm.extractvalue(T.f32(), struct, [k], loc=loc, ip=ip)) for k in range(n)]
