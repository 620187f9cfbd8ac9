"""The TP group as real processes (issue 22): SymmMemGroup boxes through torch symmetric
memory, one process per rank, ranks sharing the GPU (gloo; see kimi_ops.launch). The
launcher itself is tested on the CPU; the groups need an sm_90 GPU (the kernels)."""

import json
import os
import pathlib
import sys

import pytest
import torch

from kimi_ops import KimiDecoder, launch
from kimi_ops.checks import KimiArgumentError

from conftest import on_hopper

WORKER = str(pathlib.Path(__file__).parent / "tp_worker.py")


def test_launcher_kills_the_others_when_a_rank_fails(tmp_path):
    """Rank 1 fails at once; ranks 0 and 2 would sleep for a minute: they are killed after
    the grace period, and each rank saw its own environment."""
    code = (
        "import os, sys, time, pathlib\n"
        "rank = int(os.environ['RANK'])\n"
        f"pathlib.Path(r'{tmp_path}', f'rank{{rank}}').write_text(os.environ['WORLD_SIZE'])\n"
        "sys.exit(3) if rank == 1 else time.sleep(60)\n"
    )
    codes = launch.spawn(3, ["-c", code], timeout=30, grace=0.5)
    assert codes[1] == 3 and codes[0] < 0 and codes[2] < 0
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == ["3"] * 3


def test_every_rank_runs_with_multicast_off(tmp_path, monkeypatch):
    """The launcher turns NCCL's NVLS and symmetric memory's multicast off on every rank,
    over a caller's environment that turned them on."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    code = (
        "import os, pathlib\n"
        f"pathlib.Path(r'{tmp_path}', os.environ['RANK']).write_text("
        "os.environ['NCCL_NVLS_ENABLE'] + os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'])\n"
    )
    assert launch.spawn(2, ["-c", code], timeout=30) == [0, 0]
    assert [(tmp_path / str(r)).read_text() for r in range(2)] == ["01", "01"]


def test_a_symm_mem_group_turns_multicast_off_before_anything_else(monkeypatch):
    """Built outside the launcher (a serving engineer's torchrun), the group still sets
    TORCH_SYMM_MEM_DISABLE_MULTICAST before any rendezvous, and keeps a caller's own choice."""
    import torch.distributed as dist

    from kimi_ops.runtime.groups import SymmMemGroup

    if torch.cuda.is_available():
        pytest.skip("checks the setting where the group then stops, with no CUDA device")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for given, kept in ((None, "1"), ("0", "0")):
            if given is None:
                monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
            else:
                monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", given)
            with pytest.raises(KimiArgumentError, match="device"):
                SymmMemGroup()
            assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == kept
    finally:
        dist.destroy_process_group()


def run_group(tp: int, scenario: str, out: pathlib.Path, timeout: float = 300) -> list[dict]:
    codes = launch.spawn(tp, [WORKER, scenario, str(out)], timeout=timeout, grace=20)
    results = []
    for rank in range(tp):
        path = out / f"{scenario}_{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": f"exit {codes[rank]}"})
    return results


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """The simulated group's outputs on the same kernels and weights, per TP (this also
    fills the kernel cache that the ranks then load)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import tp_worker

    def make(tp: int) -> pathlib.Path:
        out = tmp_path_factory.mktemp(f"tp{tp}")
        decoder = KimiDecoder(tp_worker.CONFIG, tp_worker.LAYERS, tp=tp, seed=tp_worker.SEED, device="cuda")
        torch.save({b: [decoder(x.cuda()).cpu() for x in tp_worker.inputs(b)] for b in tp_worker.BATCHES},
                   out / "expected.pt")
        return out

    return make


@on_hopper
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_processes_equal_the_simulated_group(tp, expected):
    if launch.ranks_per_gpu(tp, torch.cuda.device_count()) > 4 and not launch.mps_running():
        pytest.skip("more than 4 ranks a GPU time-slice past the poll bound without MPS (nvidia-cuda-mps-control -d)")
    results = run_group(tp, "equal", expected(tp))
    for rank, result in enumerate(results):
        assert result["ok"], result.get("error")
        for batch, row in result.items():
            if batch == "ok":
                continue
            assert row["eager"] and row["replays_equal"] == 100 and row["armed"], (rank, batch, row)
    print(f"TP{tp}: " + json.dumps(results[0]))


@on_hopper
def test_a_silent_rank_faults_every_rank_within_two_seconds_and_reset_recovers(expected):
    results = run_group(4, "silent", expected(4))
    for result in results:
        assert result["ok"], result.get("error")
        assert result["healthy"] and "front row" in result["raised"] and result["seconds"] < 2, result
        assert result["recovered"], result
    print("silent: " + json.dumps([r["seconds"] for r in results]))


@on_hopper
def test_a_rank_stalled_on_the_host_but_alive_does_not_trip_the_group(expected):
    results = run_group(4, "stalled", expected(4))
    for result in results:
        assert result["ok"], result.get("error")
        assert result["heartbeat"] and result["healthy"] and result["equal"], result
        assert result["seconds"] >= 5, result  # every rank waited for the sleeper
    print("stalled: " + json.dumps([r["seconds"] for r in results]))


@on_hopper
def test_a_dead_rank_faults_the_survivors_within_two_seconds(expected):
    results = run_group(4, "dead", expected(4))
    for result in results[:-1]:
        assert result["ok"], result.get("error")
        assert "group barrier" in result["raised"] and result["seconds"] < 2, result
    print("dead: " + json.dumps([r.get("seconds") for r in results[:-1]]))


@on_hopper
def test_ranks_built_differently_fail_at_construction(tmp_path):
    for result in run_group(2, "mismatch", tmp_path, timeout=120):
        assert result["ok"], result.get("error")
        assert "config.capacity must be the same on every rank" in result["raised"], result
