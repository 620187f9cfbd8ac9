"""What every kernel family shares: compile-time fakes, the on-disk compile cache, the launch
and PDL release, DSL values of several fields (``Values``, the ``Stamps`` phase clock), the
numerics of packets (BF16 pairs, butterflies, RMS) and the mailbox protocol (Lamport polls
bounded by the global timer, re-arm, peer stores). Hand-written PTX is in :mod:`.ptx`,
the TMA ↔ MMA ring in :mod:`.ring`."""

import copy
import functools
import hashlib
import operator
import os
import pathlib
import tempfile

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Float64, Int32, Int64, Uint32

from .ptx import (
    bits_float, divide, float_bits, load_words, nap, pack_values, rsqrt_like_torch, store_cluster, store_words,
)

EXPORT_NAME = "func"
THREADS = 256  # every kernel's CTA (launch)
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per SM


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
    digest = hashlib.sha256(
        f"cutlass={cutlass.__version__} bounds={POLL_TIMEOUT_NS},{BARRIER_TIMEOUT_NS} pdl={PDL}".encode())
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
    to keep a thread's loads in flight (see tail.fronts.weighted_rows)."""
    kernel.launch(grid=[*grid, *[1] * (3 - len(grid))], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL,
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


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def placeholder(tensor: torch.Tensor, dtype: torch.dtype, dims: int = 1) -> torch.Tensor:
    """One element of ``tensor`` viewed as ``dtype`` (``dims`` dimensions) for an argument
    the kernel's mode never touches (no allocation: nothing outlives the call, e.g. in a
    cudagraph-tree pool). A row view of a wider matrix gives its first row's element."""
    source = tensor.view(-1) if tensor.is_contiguous() else tensor[(0,) * (tensor.dim() - 1)]
    return source.view(dtype)[:1].view([1] * dims)


def aligned(*tensors) -> bool:
    """16-byte aligned data and rows of whole 16-byte packets (a row view of a wider
    matrix passes where its row stride does)."""
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0
                                              for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)
               for t in tensors)


class Values:
    """A DSL value made of the attributes named in ``DYNAMIC`` (their runtime parts travel
    through dynamic ifs and loops); the other attributes ride along as Python values."""

    DYNAMIC: tuple = ()

    def __extract_mlir_values__(self):
        return [v for name in self.DYNAMIC for v in cutlass.extract_mlir_values(getattr(self, name))]

    def __new_from_mlir_values__(self, values):
        new, at = copy.copy(self), 0
        for name in self.DYNAMIC:
            n = len(cutlass.extract_mlir_values(getattr(self, name)))
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[at:at + n]))
            at += n
        return new


class Stamps(Values):
    """A kernel's phase clock for benchmarks (compiled out unless ``on``): thread 0 of each
    CTA stores (%globaltimer, %clock64) of phase k of ``phases`` at int64 pair [cta][k] of
    ``buffer`` from its 16-byte piece ``first`` on (a mailbox kernel keeps its error word
    in the first; benchmarks/profile_tail.py reads the tail's, kernels.tail.common.PHASES)."""

    DYNAMIC = ("buffer", "cta", "tid")

    def __init__(self, phases: tuple, on: bool, buffer: cute.Tensor, cta, tid, first: int = 0):
        self.phases, self.on, self.buffer, self.cta, self.tid, self.first = phases, on, buffer, cta, tid, first

    @cute.jit
    def at(self, phase: cutlass.Constexpr):
        if cutlass.const_expr(self.on):
            if self.tid == 0:
                pair = self.first + self.cta * len(self.phases) + self.phases.index(phase)
                address = self.buffer.iterator + pair * 4
                cute.arch.inline_ptx("st.global.v2.b64 [{$r0}], { {$r1}, {$r2} };",
                                     read_only_args=[address, cute.arch.globaltimer(), cute.arch.clock64()])

    @cute.jit
    def slot(self, i, first: cutlass.Constexpr[int], depth: cutlass.Constexpr[int], chunks: cutlass.Constexpr[int]):
        """Ring slots (phases "first slot", "refilled slot", "last slot"): the projection's
        first (past the stash), the first refilled one and the last, once they landed."""
        if cutlass.const_expr(self.on):
            if i == first:
                self.at("first slot")
            if i == depth:
                self.at("refilled slot")
            if i == chunks - 1:
                self.at("last slot")


# Packets' numerics.

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
def situ_value(gate: Float32, up: Float32, beta, linear_beta) -> Float32:
    """situ(g, u) = g · sigmoid(beta · g) · (u + linear_beta) in FP32, left to right
    (kimi_ops.ops.route.situ's rounding points: the caller rounds it once)."""
    return gate * sigmoid(gate * beta) * (up + linear_beta)


@cute.jit
def unpack_bf16(word: Uint32):
    """The two BF16 values of a word as FP32 (low half first)."""
    return bits_float(word << Uint32(16)), bits_float(word & Uint32(0xFFFF0000))


@cute.jit
def unpack_words(words):
    """A packet's BF16 values as FP32 (8 for a 16-byte packet)."""
    return [value for word in words for value in unpack_bf16(word)]


@cute.jit
def butterfly(value, lanes: cutlass.Constexpr[int], combine=operator.add, stride: cutlass.Constexpr[int] = 1):
    """``combine`` (associative and commutative: +, a max) of ``value`` over each aligned
    group of ``lanes`` lanes (a power of 2), in every lane of the group: log2(lanes)
    butterfly shuffles; ``stride`` (a power of 2): over the group's lanes that many apart
    (the lanes of a group with the same lane % stride), log2(lanes / stride) shuffles."""
    total = value
    for shift in cutlass.range_constexpr(stride.bit_length() - 1, lanes.bit_length() - 1):
        total = combine(total, cute.arch.shuffle_sync_bfly(total, offset=1 << shift))
    return total


@cute.jit
def butterfly_sum(value, lanes: cutlass.Constexpr[int]):
    """Σ of ``value`` over each aligned group of ``lanes`` lanes (:func:`butterfly`)."""
    return butterfly(value, lanes)


@cute.jit
def exact_dot(a, b) -> Float64:
    """Σ a · b of BF16 values (as FP32): FP32 products, exact, added in FP64 in order."""
    total = Float64(0.0)
    for x, y in zip(a, b):
        total += Float64(x * y)
    return total


# A cluster's exchange of per-CTA sums: ``received`` [rows, cluster] FP64 in every CTA, one
# column a CTA; each CTA stores its value of a row into column ``part`` of every CTA's
# (DSMEM; at a cluster of one, its own), a barrier, then every thread adds the columns in
# rank order: the same bits in every CTA and every run.
@cute.jit
def send_to_cluster(received, row, value: Float64, part, cluster: cutlass.Constexpr[int]):
    if cutlass.const_expr(cluster == 1):
        received[row, 0] = value
    else:
        for c in cutlass.range_constexpr(cluster):
            store_cluster(received.iterator + row * cluster + part, value, c)


@cute.jit
def cluster_barrier(cluster: cutlass.Constexpr[int]):
    """Every CTA's sends landed (release / acquire); a CTA barrier at a cluster of one."""
    if cutlass.const_expr(cluster == 1):
        cute.arch.sync_threads()
    else:
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


@cute.jit
def cluster_total(received, row, cluster: cutlass.Constexpr[int]) -> Float64:
    """Row ``row``'s sum over the cluster's CTAs, in rank order."""
    total = Float64(0.0)
    for c in cutlass.range_constexpr(cluster):
        total += received[row, c]
    return total


@cute.jit
def clamp(value: Int32, high: Int32) -> Int32:
    result = value
    if value > high:
        result = high
    return result


@cute.jit
def inverse_rms(total: Float64, latent: int, eps: Float32) -> Float32:
    """inv = rsqrt.approx(ss / L + eps) from the exact FP64 ss, rounded to FP32 first, as
    the reference's float32 ss."""
    return rsqrt_like_torch(divide(Float32(total), Float32(latent)) + eps)


@cute.jit
def normalized(values, inv: Float32, scale):
    """A packet of xn = BF16((latent · inv) · gamma) as four BF16x2 words."""
    normed = [(values[i] * inv) * scale[i] for i in range(8)]
    return pack_values(normed)


# The mailbox protocol (kimi_ops.mailbox): Lamport polls of 16-byte packets against the sentinel.

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
# KIMI_OPS_PDL=0: every kernel launched without programmatic dependent launch (each starts
# when its predecessor has ended): bench_layer's "without PDL" row. Part of the cache key.
PDL = os.environ.get("KIMI_OPS_PDL", "1") != "0"


@cute.jit
def peer_bases(peers: cute.Tensor, count: cutlass.Constexpr[int]):
    """The first ``count`` peers' box base addresses of ``peers``, for :func:`store_to_peers`:
    loaded once, before a kernel's first mailbox store (a load after a system-scope store
    waits for it: ptxas keeps the order, and per packet that was a round trip each)."""
    return [Int64(peers[peer]) for peer in range(count)]


@cute.jit
def store_to_peers(bases, offset: Int64, words, fp32: cutlass.Constexpr[bool] = False):
    """One mailbox packet (four words; eight: two packets, 16 bytes apart) to byte
    ``offset`` of each peer's box (``bases``: :func:`peer_bases`), made unable to equal
    the sentinel: BF16 pairs by :func:`no_neg_zero`, ``fp32`` words (logits) by
    :func:`no_neg_zero_f32`."""
    clean = [no_neg_zero_f32(w) if fp32 else no_neg_zero(w) for w in words]
    for base in bases:
        for first in cutlass.range_constexpr(0, len(clean), 4):
            store_words(base + offset + 4 * first, clean[first:first + 4], mailbox=True)


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
def arrived(words):
    sentinel = Uint32(SENTINEL)
    return (words[0] != sentinel) & (words[1] != sentinel) & (words[2] != sentinel) & (words[3] != sentinel)
