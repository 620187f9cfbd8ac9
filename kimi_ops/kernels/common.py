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
from cutlass import Float32, Uint32

EXPORT_NAME = "func"
TORCH_TO_CUTE = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.int32: cutlass.Int32}


def fake(dtype, shape, align=16):
    """A row-major fake tensor (last stride 1, the others symbolic)."""
    divisibility = max(align * 8 // dtype.width, 1)
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def arch() -> str:
    """The target: CUTE_DSL_ARCH if set (compile-only CI: sm_90a), else the current GPU's."""
    if "CUTE_DSL_ARCH" in os.environ:
        return os.environ["CUTE_DSL_ARCH"]
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


@functools.cache
def source_fingerprint() -> str:
    """The kernels' sources and the toolchain: a changed kernel never loads a stale .o."""
    digest = hashlib.sha256(f"cutlass={cutlass.__version__}".encode())
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("KIMI_OPS_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "kimi_ops_cache")
    path = pathlib.Path(root) / source_fingerprint()
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiled(build):
    """Decorator: ``build(*key)`` returns a ``cute.compile`` result; cache it in memory and
    as an exported object file keyed by (source, arch, build name, key)."""
    memory = {}

    @functools.wraps(build)
    def get(*key):
        key = (arch(), *key)
        if key in memory:
            return memory[key]
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
