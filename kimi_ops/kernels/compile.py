"""Compiling the kernels: compile-time fakes, the target arch, and the on-disk compile
cache keyed by the kernels' sources, the toolchain and the compiled-in settings."""

import contextlib
import functools
import hashlib
import os
import pathlib

import cutlass
import cutlass.cute as cute
import torch
from cutlass._mlir import ir
from cutlass._mlir.dialects import cuda
from cutlass.cutlass_dsl.cutlass import CuTeDSL

from . import cache_root
from .launch import CARVEOUT, GEMM_ROOM, MARKS, PDL
from .mailbox import BARRIER_ALIVE_NS, BARRIER_TIMEOUT_NS, POLL_TIMEOUT_NS

EXPORT_NAME = "func"
# KIMI_OPS_LINE_TABLES=DIR: every kernel compiled keeps its cubin with line tables (SASS address
# → our .py file and line; the SASS is the same: checked for the routed experts), one folder a
# compile key, for benchmarks/ncu_hotspots.py --cubins. Part of the cache key, so that a cached
# kernel compiles again and leaves its cubin.
LINE_TABLES = os.environ.get("KIMI_OPS_LINE_TABLES", "")
_dump_dir = ""  # the compile in progress's folder under LINE_TABLES


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
        f"cutlass={cutlass.__version__} bounds={POLL_TIMEOUT_NS},{BARRIER_TIMEOUT_NS},{BARRIER_ALIVE_NS} pdl={PDL} "
        f"carveout={CARVEOUT} room={GEMM_ROOM} marks={MARKS} lines={bool(LINE_TABLES)}".encode())
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    path = cache_root() / source_fingerprint()
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_options() -> str:
    """``cute.compile``'s options: TVM-FFI calls on the env stream; with KIMI_OPS_PTXAS_REMARKS
    set, also ptxas's report on stderr (registers, spills, C75xx performance notes such as
    C7512, wgmma serialized for want of registers), which the compile tests read; under
    LINE_TABLES, the cubin with line tables in the compile's folder. The code compiled is
    the same either way."""
    remarks = " remarks{ptx}" if os.environ.get("KIMI_OPS_PTXAS_REMARKS") else ""
    lines = f" --generate-line-info --keep-cubin --dump-dir {_dump_dir}" if _dump_dir else ""
    return "--enable-tvm-ffi" + remarks + lines


def export_carveout(carveout: int) -> None:
    """Every kernel compiled from now on sets its preferred shared-memory carveout as its
    module loads (launch.CARVEOUT). The DSL applies a launch's ``preferred_smem_carveout``
    in its own Python loader only; our kernels load from exported TVM-FFI objects, whose
    code sets the attributes of the kernel op's ``cu_attrs`` (the opt-in shared memory,
    clusters past 8), so the carveout joins them there."""
    generate = CuTeDSL.generate_func_op
    CuTeDSL.generate_func_op = lambda dsl, *args, **kwargs: with_carveout(generate(dsl, *args, **kwargs), carveout)


def with_carveout(op, carveout: int):
    """The kernel op ``op`` with the carveout among its ``cu_attrs``."""
    attributes = ir.DictAttr(op.attributes["cu_attrs"])  # every kernel op has them (a KeyError: the DSL changed)
    entries = {attributes[i].name: attributes[i].attr for i in range(len(attributes))}
    entries[str(cuda.CUFunctionAttribute.preferred_shared_memory_carveout)] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), carveout)
    op.attributes["cu_attrs"] = ir.DictAttr.get(entries)
    return op


if CARVEOUT is not None:
    export_carveout(CARVEOUT)

BUILDS = {}  # every compiled() getter by its build's name: kimi_ops.prepare's processes call them
_collected: set | None = None  # collecting(): the kernels a block would compile or load
_report = None  # reporting(): told of each kernel compiled or loaded


@contextlib.contextmanager
def collecting():
    """Within the block a kernel not yet in memory is only named: its getter adds (build
    name, key) to the yielded set and returns None (what a prepare would compile or load:
    the decoder's progress total, kimi_ops.prepare's work list)."""
    global _collected
    before, _collected = _collected, set()
    try:
        yield _collected
    finally:
        _collected = before


@contextlib.contextmanager
def reporting(report):
    """Within the block ``report(cached)`` follows each kernel compiled (False) or loaded
    from the on-disk cache (True); kernels already in memory are not reported."""
    global _report
    before, _report = _report, report
    try:
        yield
    finally:
        _report = before


def compiled(build):
    """Decorator: ``build(*key)`` returns a ``cute.compile`` result; cache it in memory and
    as an exported object file keyed by (source, arch, build name, key)."""
    memory = {}

    @functools.wraps(build)
    def get(*key):
        key = (arch(), *key)
        if key in memory:
            return memory[key]
        if _collected is not None:
            _collected.add((build.__qualname__, key[1:]))
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{build.__name__}{key[1:]} was not compiled before CUDA-graph capture: "
                "prepare the kernels first (kimi_ops.backend.prepare, or run once outside capture)"
            )
        name = hashlib.sha256(repr((build.__qualname__, key)).encode()).hexdigest()[:24]
        path = cache_dir() / f"{name}.o"
        cached = path.exists()
        if cached:
            function = cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]
        else:
            global _dump_dir
            _dump_dir = os.path.join(LINE_TABLES, name) if LINE_TABLES else ""
            if _dump_dir:
                os.makedirs(_dump_dir, exist_ok=True)  # the DSL writes into an existing folder only
            try:
                function = build(*key[1:])
            finally:
                _dump_dir = ""
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            function.export_to_c(object_file_path=str(partial), function_name=EXPORT_NAME)
            os.replace(partial, path)  # atomic: no reader sees half a file
        memory[key] = function
        if _report is not None:
            _report(cached)
        return function

    get.build = build  # compile only, no cache (CI compiles every variant on the CPU)
    BUILDS[build.__qualname__] = get
    return get


def hopper(tensor: torch.Tensor) -> str | None:
    return not_hopper(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


@functools.cache
def not_hopper(device: int) -> str | None:
    """Why the kernels cannot run on ``device``, or None (asked once per device)."""
    if not device_arch(device).startswith("sm_9"):
        return f"the CuTe kernels target sm_90, not {torch.cuda.get_device_name(device)}"
    return None
