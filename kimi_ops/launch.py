"""Start a TP group on this machine, one process per rank:

    python -m kimi_ops.launch --tp 2 examples/decode_layer.py --config tiny --layers 6

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a free
port), multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1: the group
never creates a multicast object, on any machine), and where ranks outnumber the GPUs
(rank r runs on GPU r % count) TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE =
100 / ranks per GPU (unless set). Ranks sharing a GPU need MPS running
(``nvidia-cuda-mps-control -d``) with that share each: a rank's polling grid then holds
only its own SMs, as on a GPU of its own. Without a share, pollers of some ranks filled
the SMs a peer's producer needed (TP4 at B = 64 deadlocked until the poll bound); without
MPS the ranks time-slice (TP4: 162 ms a step; TP8: a peer's slice outlasts the bound). The script takes its group from :func:`group_from_env`
(a gloo process group, which serves several ranks on one GPU where NCCL does not, and a
:class:`~kimi_ops.runtime.groups.SymmMemGroup` over it) and ends with :func:`finish`.

The launcher waits for every rank, bounded by ``--timeout``; once a rank fails, the
others are killed after ``--grace`` seconds, so no process outlives a fault. Its exit
status is the first failed rank's (0 when all succeed).
"""

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

GLOO_TIMEOUT = datetime.timedelta(seconds=120)  # a host collective with a dead peer fails, never hangs
# Set on every rank, whatever the caller's environment: NCCL's NVLS and symmetric memory's
# rendezvous would otherwise create multicast objects on NVLink hosts (the project's rule:
# never; the boxes store to each peer instead, SymmMemGroup.multicast is then False).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ranks_per_gpu(tp: int, devices: int) -> int:
    """Ranks sharing a GPU (rank r runs on GPU r % devices)."""
    return -(-tp // max(devices, 1))


def rank_env(rank: int, tp: int, port: int, devices: int) -> dict[str, str]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(tp),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **MULTICAST_OFF}
    if tp > max(devices, 1):
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                                                  str(100 // ranks_per_gpu(tp, devices)))
    return env


def mps_pipes() -> str:
    """The MPS control daemon's pipe directory for this environment's clients."""
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def mps_running() -> bool:
    """Whether an MPS control daemon serves this environment's clients."""
    return os.path.exists(os.path.join(mps_pipes(), "control"))


def device_count() -> int:
    """GPUs, asked without initializing CUDA in the launcher (a child process asks)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def spawn(tp: int, argv: list[str], timeout: float = 600, grace: float = 10, env: dict | None = None) -> list[int]:
    """Run ``python argv...`` as ranks 0..tp-1; returns their exit codes (killed: negative)."""
    port, devices = free_port(), device_count()
    procs = [
        subprocess.Popen([sys.executable, *argv], env={**os.environ, **(env or {}), **rank_env(r, tp, port, devices)})
        for r in range(tp)
    ]
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [p.wait() for p in procs]


def group_from_env(device=None):
    """The SymmMemGroup of a process this launcher started (None outside one)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    import torch.distributed as dist

    from .runtime.groups import SymmMemGroup

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
    return SymmMemGroup(device=device)


def finish(code: int = 0, barrier: bool = True) -> None:
    """End a rank: flush its output, meet the other ranks (``barrier``; not when a peer is
    known dead) and leave through ``os._exit``, skipping an interpreter teardown of CUDA
    and symmetric memory that can hang across processes."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if barrier and dist.is_initialized():
        dist.barrier()
    os._exit(code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True, help="ranks (processes)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole group")
    parser.add_argument("--grace", type=float, default=10, help="seconds the others get once a rank fails")
    parser.add_argument("script", help="the Python script each rank runs, or a module (benchmarks.bench_tp: "
                        "run as python -m) where no such file exists")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.tp < 1:
        parser.error("--tp must be ≥ 1")
    program = [args.script] if os.path.exists(args.script) or args.script.endswith(".py") else ["-m", args.script]
    codes = spawn(args.tp, [*program, *args.args], args.timeout, args.grace)
    failed = [(rank, code) for rank, code in enumerate(codes) if code]
    for rank, code in failed:
        print(f"kimi_ops.launch: rank {rank} exited with {code}", file=sys.stderr)
    return (failed[0][1] if failed[0][1] > 0 else 1) if failed else 0


if __name__ == "__main__":
    sys.exit(main())
