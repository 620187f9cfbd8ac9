"""``python -m kimi_ops``, the doctor: the versions, the devices, which implementation serves
each ``kimi`` op here and why, the kernel cache, and MPS (TP ranks sharing one GPU).

    python -m kimi_ops
"""

import argparse
import importlib.metadata
import importlib.util
import platform
import shutil
import subprocess

import torch

from . import backend, launch
from .kernels import cache_root
from .ops import OPS

PACKAGES = ("nvidia-cutlass-dsl", "cuda-python", "apache-tvm-ffi")


def versions() -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()),
            ("torch", torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"))]
    for package in PACKAGES:
        try:
            rows.append((package, importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            rows.append((package, "not installed"))
    rows.append(("CUDA driver", driver_version()))
    return rows


def driver_version() -> str:
    if not shutil.which("nvidia-smi"):
        return "none (no nvidia-smi)"
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi failed)"
    return out[0] if out else "unknown"


def devices() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        return [("devices", "no CUDA device: every op runs its PyTorch reference")]
    rows = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        rows.append((f"cuda:{index}", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                                      f"{p.total_memory / 2**30:.0f} GiB"))
    return rows


def why_reference() -> str | None:
    """Why no op can take a CuTe kernel on this machine (the current device), or None."""
    if backend.selected() == "reference":
        return "KIMI_OPS_BACKEND=reference"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("cutlass") is None:
        return "CuTe DSL (nvidia-cutlass-dsl) is not installed"
    from .kernels.compile import not_hopper

    return not_hopper(torch.cuda.current_device())


def ops() -> list[tuple[str, str]]:
    """Per op, what serves it on the current device: the kernel (shapes it does not take
    still run the reference, with a one-time warning naming why) or the reference."""
    machine = why_reference()
    rows = []
    for name in OPS:
        if machine:
            rows.append((name, f"reference ({machine})"))
        elif name in backend.KERNELS:
            rows.append((name, "CuTe kernel (the reference where a call's shape is not the kernel's: it warns once)"))
        else:
            rows.append((name, "reference (no CuTe kernel is registered)"))
    return rows


def cache() -> list[tuple[str, str]]:
    root = cache_root()
    files = [path for path in root.rglob("*") if path.is_file()] if root.is_dir() else []
    size = sum(path.stat().st_size for path in files)
    folders = sum(1 for path in root.iterdir() if path.is_dir()) if root.is_dir() else 0
    return [("kernel cache", f"{root} ({len(files)} files, {size / 2**20:.1f} MiB, {folders} source versions; "
                             "set KIMI_OPS_CACHE_DIR to move it)")]


def mps() -> list[tuple[str, str]]:
    if launch.mps_running():
        return [("MPS", f"control daemon running (pipe directory {launch.mps_pipes()})")]
    hint = "nvidia-cuda-mps-control -d" if shutil.which("nvidia-cuda-mps-control") else "no nvidia-cuda-mps-control"
    return [("MPS", f"not running: TP ranks sharing one GPU need it ({hint})")]


def report() -> list[tuple[str, list[tuple[str, str]]]]:
    return [("versions", versions()), ("devices", devices()), (f"ops (KIMI_OPS_BACKEND={backend.selected()})", ops()),
            ("cache", cache()), ("multi-process", mps())]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    for title, rows in report():
        print(f"{title}:")
        width = max(len(key) for key, _ in rows)
        for key, value in rows:
            print(f"  {key:<{width}s}  {value}")


if __name__ == "__main__":
    main()
