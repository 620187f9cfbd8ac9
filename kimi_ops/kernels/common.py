"""What every kernel family shares: compile-time fakes, the on-disk compile cache, and
small device helpers (bit casts, the seeds' ordered key)."""

import functools
import hashlib
import os
import pathlib
import tempfile

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

EXPORT_NAME = "func"
THREADS = 256  # every kernel's CTA (launch)
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per SM
CHUNK = 64  # K columns per ring slot: one 128-byte row, the width of TMA's 128-byte swizzle


def fake(dtype, shape, align=16):
    """A row-major fake tensor (last stride 1, the others symbolic)."""
    divisibility = max(align * 8 // dtype.width, 1)
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def arch() -> str:
    """The target: CUTE_DSL_ARCH if set (compile-only CI: sm_90a), else the current GPU's
    (asked once per device: every op call looks its compiled kernel up by it)."""
    if "CUTE_DSL_ARCH" in os.environ:
        return os.environ["CUTE_DSL_ARCH"]
    return device_arch(torch.cuda.current_device())


@functools.cache
def device_arch(device: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


@functools.cache
def source_fingerprint() -> str:
    """The kernels' sources, subpackages' included, and the toolchain: a changed kernel
    never loads a stale .o."""
    digest = hashlib.sha256(f"cutlass={cutlass.__version__} bounds={POLL_TIMEOUT_NS},{BARRIER_TIMEOUT_NS}".encode())
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("KIMI_OPS_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "kimi_ops_cache")
    path = pathlib.Path(root) / source_fingerprint()
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_options() -> str:
    """``cute.compile``'s options: TVM-FFI calls on the env stream; with KIMI_OPS_PTXAS_REMARKS
    set, also ptxas's report on stderr (registers, spills, C75xx performance notes such as
    C7512, wgmma serialized for want of registers), which the compile tests read. The code
    compiled is the same either way."""
    remarks = " remarks{ptx}" if os.environ.get("KIMI_OPS_PTXAS_REMARKS") else ""
    return "--enable-tvm-ffi" + remarks


def compiled(build):
    """Decorator: ``build(*key)`` returns a ``cute.compile`` result; cache it in memory and
    as an exported object file keyed by (source, arch, build name, key)."""
    memory = {}

    @functools.wraps(build)
    def get(*key):
        key = (arch(), *key)
        if key in memory:
            return memory[key]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{build.__name__}{key[1:]} was not compiled before CUDA-graph capture: "
                "prepare the kernels first (kimi_ops.backend.prepare, or run once outside capture)"
            )
        name = hashlib.sha256(repr((build.__qualname__, key)).encode()).hexdigest()[:24]
        path = cache_dir() / f"{name}.o"
        if path.exists():
            function = cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]
        else:
            function = build(*key[1:])
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            function.export_to_c(object_file_path=str(partial), function_name=EXPORT_NAME)
            os.replace(partial, path)  # atomic: no reader sees half a file
        memory[key] = function
        return function

    get.build = build  # compile only, no cache (CI compiles every variant on the CPU)
    return get


_addresses: dict[tuple, torch.Tensor] = {}


class _DeviceWords:
    """int64 words in memory of our own (cuMemAlloc), outside torch's allocator: a
    cudagraph tree's warm-up routes torch allocations into its pool, which it later
    reuses, and a kernel would then read another tensor's bytes as peer addresses."""

    def __init__(self, values: tuple[int, ...], device: torch.device):
        from cuda.bindings import driver

        data = torch.tensor(values, dtype=torch.int64).numpy().tobytes()
        with torch.cuda.device(device):
            error, self.pointer = driver.cuMemAlloc(len(data))
            if error == driver.CUresult.CUDA_SUCCESS:
                (error,) = driver.cuMemcpyHtoD(self.pointer, data, len(data))
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the mailbox address table: {error}")
        self.__cuda_array_interface__ = {
            "shape": (len(values),), "typestr": "<i8", "data": (int(self.pointer), False), "version": 3,
        }


def addresses(tensors) -> torch.Tensor:
    """The tensors' base addresses as a device int64 tensor (the peers' boxes), built
    once per address tuple and never freed: boxes are allocated once, and their owner
    registers them (``prepare``) before any CUDA-graph capture."""
    key = tuple(t.data_ptr() for t in tensors)
    if key not in _addresses:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the mailbox addresses were not registered before CUDA-graph capture: run once first")
        device = tensors[0].device
        _addresses[key] = torch.as_tensor(_DeviceWords(key, device), device=device)
    return _addresses[key]


def register_addresses(peer_lists) -> None:
    """Build the address tables of these box lists now (wrapper construction): never in a
    capture, and never in a cudagraph-tree warm-up, whose pool would hold them."""
    for boxes in peer_lists:
        addresses(boxes)


def hopper(tensor: torch.Tensor) -> str | None:
    return not_hopper(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


@functools.cache
def not_hopper(device: int) -> str | None:
    """Why the kernels cannot run on ``device``, or None (asked once per device)."""
    if not device_arch(device).startswith("sm_9"):
        return f"the CuTe kernels target sm_90, not {torch.cuda.get_device_name(device)}"
    return None


def launch(kernel, grid, stream, min_blocks_per_mp: int = 0) -> None:
    """Launch a traced ``kernel(...)`` call over ``grid`` CTAs of THREADS threads, with
    programmatic dependent launch; ``min_blocks_per_mp`` 1 lets ptxas take the registers
    to keep a thread's loads in flight (see tail.weighted_rows)."""
    kernel.launch(grid=[*grid, *[1] * (3 - len(grid))], block=[THREADS, 1, 1], stream=stream, use_pdl=True,
                  min_blocks_per_mp=min_blocks_per_mp)


class Release:
    """PDL release of the dependent grid: ``early`` at entry (for dependents that must
    start at once, e.g. persistent ones that first drain other work), else late, once
    this grid's outputs are written (dependents cannot take its SMs)."""

    def __init__(self, early: bool):
        self.early = early

    @cute.jit
    def release_early(self):
        if cutlass.const_expr(self.early):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def release_late(self):
        if cutlass.const_expr(not self.early):
            cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def float_bits(x: Float32) -> Uint32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Uint32], read_only_args=[x])


@cute.jit
def ordered(x: Float32) -> Uint32:
    """The seeds' monotone uint32 key of a float; NaN maps to 0 (below every number)."""
    bits = float_bits(x)
    key = bits | Uint32(0x80000000)
    if (bits & Uint32(0x80000000)) != Uint32(0):
        key = ~bits
    if x != x:
        key = Uint32(0)
    return key


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + exp(−x)) with the accurate exp and an IEEE reciprocal, as torch's CUDA
    sigmoid computes it."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def bits_float(x: Uint32) -> Float32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


SENTINEL = 0x80000000  # the armed word (kimi_ops.mailbox.SENTINEL as uint32)
def bound_ns(variable: str, default_ms: float) -> int:
    return int(float(os.environ.get(variable, default_ms)) * 1_000_000)


# How long a poll that sees nothing waits before it gives up and reports (compiled in, so
# the kernel cache is keyed by them). A mailbox poll's data is one phase away: 50 ms. The
# group barrier (kernels/group.py) also absorbs the ranks' host-side skew between steps
# (first calls, lazy module loads), so it waits 1 s: a dead peer is still reported within
# 2 s, since polls after a recorded fault do not wait.
POLL_TIMEOUT_NS = bound_ns("KIMI_OPS_POLL_TIMEOUT_MS", 50)
BARRIER_TIMEOUT_NS = bound_ns("KIMI_OPS_BARRIER_TIMEOUT_MS", 1000)


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
def store_to_peers(peers: cute.Tensor, count: cutlass.Constexpr[int], offset: Int64, words,
                   fp32: cutlass.Constexpr[bool] = False):
    """One mailbox packet (four words; eight: two packets, 16 bytes apart) to byte
    ``offset`` of each of ``count`` peers' boxes (base addresses ``peers``), made unable
    to equal the sentinel: BF16 pairs by :func:`no_neg_zero`, ``fp32`` words (logits) by
    :func:`no_neg_zero_f32`."""
    clean = [no_neg_zero_f32(w) if fp32 else no_neg_zero(w) for w in words]
    # Every base first: a load after a system-scope store waits for it (ptxas keeps the order).
    bases = [Int64(peers[peer]) for peer in range(count)]
    for peer in cutlass.range_constexpr(count):
        for first in cutlass.range_constexpr(0, len(clean), 4):
            store_words(bases[peer] + offset + 4 * first, clean[first:first + 4], mailbox=True)


@cute.jit
def pack_bf16(low: Float32, high: Float32) -> Uint32:
    """Two FP32 values rounded (RNE) into one BF16x2 word, ``low`` in the low half."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[high, low]
    )


@cute.jit
def unpack_bf16(word: Uint32):
    """The two BF16 values of a word as FP32 (low half first)."""
    return bits_float(word << Uint32(16)), bits_float(word & Uint32(0xFFFF0000))


@cute.jit
def unpack_words(words):
    """A packet's BF16 values as FP32 (8 for a 16-byte packet)."""
    return [value for word in words for value in unpack_bf16(word)]


@cute.jit
def no_neg_zero(word: Uint32) -> Uint32:
    """A BF16 pair made unable to equal the sentinel: −0 halves become +0 and NaN halves
    the canonical NaN (kimi_ops.mailbox.no_neg_zero)."""
    return clean_half(word & Uint32(0xFFFF)) | (clean_half(word >> Uint32(16)) << Uint32(16))


@cute.jit
def no_neg_zero_f32(word: Uint32) -> Uint32:
    """An FP32 word made unable to equal the sentinel: −0 becomes +0 and NaN the canonical
    NaN (kimi_ops.mailbox.no_neg_zero on float32)."""
    result = word
    if word == Uint32(SENTINEL):
        result = Uint32(0)
    if (word & Uint32(0x7FFFFFFF)) > Uint32(0x7F800000):
        result = Uint32(0x7FC00000)
    return result


@cute.jit
def clean_half(half: Uint32) -> Uint32:
    result = half
    if half == Uint32(0x8000):
        result = Uint32(0)
    if (half & Uint32(0x7FFF)) > Uint32(0x7F80):
        result = Uint32(0x7FC0)
    return result


@cute.jit
def butterfly_sum(value, lanes: cutlass.Constexpr[int]):
    """Σ of ``value`` over each aligned group of ``lanes`` lanes (a power of 2), in every
    lane of the group: log2(lanes) butterfly shuffles."""
    total = value
    for shift in cutlass.range_constexpr(lanes.bit_length() - 1):
        total += cute.arch.shuffle_sync_bfly(total, offset=1 << shift)
    return total


@cute.jit
def rearm(address):
    """Write the sentinel over a consumed packet (relaxed, system scope)."""
    armed = Uint32(SENTINEL)
    store_words(address, [armed] * 4, mailbox=True)


@cute.jit
def poll(address, error: cute.Tensor, code: cutlass.Constexpr[int]):
    """Lamport poll of one packet (see :func:`poll_all`)."""
    return poll_all([address], error, code)[0]


@cute.jit
def poll_all(addresses, error: cute.Tensor, code: cutlass.Constexpr[int]):
    """Lamport poll of several packets at once (their loads in flight together) until no
    word holds the sentinel, bounded by the global timer: past POLL_TIMEOUT_NS it sets
    ``code`` in the error word and returns what it read (the wrapper raises on its next
    host check). Returns each packet's four words."""
    count = len(addresses)
    values = cute.make_rmem_tensor((count, 4), Uint32)
    start = cute.arch.globaltimer()
    waiting = cutlass.Boolean(True)
    first = cutlass.Boolean(True)
    faulted = error[0] != cutlass.Int32(0)  # a fault is recorded: one look, no wait (the step is lost)
    while waiting:
        if not first:
            nap()
        first = cutlass.Boolean(False)
        waiting = cutlass.Boolean(False)
        for i in cutlass.range_constexpr(count):
            words = load_words(addresses[i], polled=True)
            for k in cutlass.range_constexpr(4):
                values[i, k] = words[k]
            waiting = waiting | (arrived(words) == cutlass.Boolean(False))
        if waiting & (faulted | (cute.arch.globaltimer() - start > POLL_TIMEOUT_NS)):
            cute.arch.atomic_or(error.iterator, cutlass.Int32(code))
            waiting = cutlass.Boolean(False)
    return [[values[i, k] for k in range(4)] for i in range(count)]


@cute.jit
def nap():
    """A short sleep between polls (64 ns), so spinning warps leave the SM's issue slots to others."""
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Uint32(64)])


@cute.jit
def arrived(words):
    sentinel = Uint32(SENTINEL)
    return (words[0] != sentinel) & (words[1] != sentinel) & (words[2] != sentinel) & (words[3] != sentinel)


# Rings, shared-memory layouts and wgmma (the tail's and the projection engine's).

@cute.jit
def paced(i, lag: cutlass.Constexpr[int], depth: cutlass.Constexpr[int], full, fronted, waited=None):
    """Before chunk ``i`` of a weight stream through ``depth`` slots: a whole ring queued at
    once (21 MB) holds every other load 2-5 µs behind it (measured), and the front's and
    xn's loads are the critical path. So until xn is in (``fronted``), ``lag`` slots stay
    in flight (chunk i - lag has landed); with ``waited``, none once our predecessor is
    done, so that xn's loads queue behind at most ``lag`` slots. Measured: the hold gains
    WaveMoeTail 0.2-0.5 µs per call at 32-64 tokens (xn is its critical path) and costs
    MoeTail 0.2 µs at B <= 8 (its ring and stash cover the wait)."""
    if not cute.arch.mbarrier_test_wait(fronted, 0):  # lanes may differ: each only waits
        landed(full, i - lag, depth)
        if cutlass.const_expr(waited is not None):
            if cute.arch.mbarrier_test_wait(waited, 0):
                cute.arch.mbarrier_wait(fronted, 0)


@cute.jit
def landed(full, i, depth: cutlass.Constexpr[int]):
    """Wait until chunk ``i`` of a ring of ``depth`` slots has landed (phase i // depth of
    its slot's full barrier)."""
    cute.arch.mbarrier_wait(full + i % depth, (i // depth) % 2)


@cute.jit
def released(empty, i, depth: cutlass.Constexpr[int]):
    """Before chunk ``i`` goes into a ring of ``depth`` slots: wait until the readers of the
    slot's previous chunk have handed it back."""
    if i >= depth:
        cute.arch.mbarrier_wait(empty + i % depth, (i // depth + 1) % 2)


@cute.jit
def expect(full, slot, size: cutlass.Constexpr[int], lane):
    """Lane 0 arms slot ``slot``'s full barrier for ``size`` bytes of TMA copies, which the
    warp then issues."""
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(full + slot, size)
    cute.arch.sync_warp()


@cute.jit
def release(empty, lane):
    """The warp is done with its part of a slot: the producer may refill it."""
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(empty)


def swizzled(first, row, piece):
    """The 16-byte piece ``piece`` of 128-byte row ``first + row`` (``first`` a multiple of
    8) in TMA's 128-byte swizzle (at piece XOR row % 8), so that the eight rows of an
    ldmatrix 8x8 matrix fall in distinct banks."""
    return (first + row) * 8 + (piece ^ (row % 8))


def swizzled_stages(rows, stages):
    """``stages`` boxes of rows × CHUNK BF16 in the 128-byte swizzle (``swizzled``), as TMA
    stores them and wgmma's descriptors read them."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    return cute.tile_to_shape(atom, (rows, CHUNK, stages), (0, 1, 2))


@cute.jit
def clamp(value: Int32, high: Int32) -> Int32:
    result = value
    if value > high:
        result = high
    return result


@cute.jit
def copy_async(destination, source):
    """16 bytes from global to shared memory by cp.async (L2 only: read once per CTA)."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[destination, source])


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
def l2_evict_first() -> Int64:
    """An L2 policy that evicts first: the weights stream through once per call and must
    not push out what the latency-bound loads read (expert rows, latent, gamma, shared)."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_first.b64 {$w0}, 1.0;", write_only_types=[Int64])


# wgmma's shared-memory matrix descriptor, all but the start address: the 128-byte swizzle
# (bits 62-63), 8-row groups 1024 bytes apart (stride, bits 32-45), leading offset unused (1)
DESCRIPTOR_FIELDS = (1 << 62) | ((1024 >> 4) << 32) | (1 << 16)


@cute.jit
def descriptor(address: Int32) -> Int64:
    """wgmma's descriptor of a K-major [rows, 64] BF16 tile in the 128-byte swizzle at
    shared ``address`` (a 1024-aligned box, + 32 bytes per k16 step within its rows)."""
    return Int64(DESCRIPTOR_FIELDS) | Int64((address >> 4) & 0x3FFF)


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


def placeholder(tensor: torch.Tensor, dtype: torch.dtype, dims: int = 1) -> torch.Tensor:
    """One element of ``tensor`` viewed as ``dtype`` (``dims`` dimensions) for an argument
    the kernel's mode never touches (no allocation: nothing outlives the call, e.g. in a
    cudagraph-tree pool)."""
    return tensor.view(-1).view(dtype)[:1].view([1] * dims)


def aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


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
def divide(x: Float32, y: Float32) -> Float32:
    """IEEE x / y (div.rn), as torch divides."""
    return cute.arch.inline_ptx("div.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[x, y])


@cute.jit
def rsqrt_like_torch(x: Float32) -> Float32:
    """rsqrt.approx.f32 without flush-to-zero: what torch.rsqrt runs on CUDA, so that xn is
    bit-equal to the reference on the same device."""
    return cute.arch.inline_ptx("rsqrt.approx.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


@cute.jit
def inverse_rms(total: Float64, latent: int, eps: Float32) -> Float32:
    """inv = rsqrt.approx(ss / L + eps) from the exact FP64 ss, rounded to FP32 first, as
    the reference's float32 ss."""
    return rsqrt_like_torch(divide(Float32(total), Float32(latent)) + eps)


@cute.jit
def normalized(values, inv: Float32, scale):
    """A packet of xn = BF16((latent · inv) · gamma) as four BF16x2 words."""
    normed = [(values[i] * inv) * scale[i] for i in range(8)]
    return [pack_bf16(normed[i], normed[i + 1]) for i in range(0, 8, 2)]
