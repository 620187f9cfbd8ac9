"""The TP group's heartbeat page (runtime/heartbeat.py) on the host: every rank's word
moves while its process lives and stops with it; the page's name goes once every rank has
it open. (The barrier that reads it runs in tests/test_multiprocess.py, on a GPU.)"""

import os
import time
import uuid

import pytest
import torch

from kimi_ops.runtime.heartbeat import Heartbeat

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def wait_for(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_each_rank_ticks_its_word_until_it_stops():
    name = f"kimi_ops_test_{uuid.uuid4().hex}"
    first = Heartbeat(name, 2, 0, create=True, period=0.005)
    second = Heartbeat(name, 2, 1, create=False, period=0.005)
    first.unlink()
    assert not os.path.exists(f"/dev/shm/{name}")  # the mappings outlive the name
    wait_for(lambda: first.beat(1) > 3 and second.beat(0) > 3)  # each sees the other's word move
    second.stop()
    stopped = first.beat(1)
    time.sleep(0.05)
    assert first.beat(1) == stopped and second.beat(1) == stopped  # a dead rank's word stays put
    wait_for(lambda: second.beat(0) > stopped + 3)
    if not torch.cuda.is_available():
        assert first.address == 0  # no GPU to map it for
    first.close()
    second.close()


def test_a_page_is_made_once():
    name = f"kimi_ops_test_{uuid.uuid4().hex}"
    first = Heartbeat(name, 1, 0, create=True)
    with pytest.raises(FileExistsError):
        Heartbeat(name, 1, 0, create=True)
    first.unlink()
    first.close()
    with pytest.raises(FileNotFoundError):
        Heartbeat(name, 1, 0, create=False)


def test_the_word_moves_while_the_process_holds_its_gil():
    """A rank blocked in a call that keeps the GIL (a CUDA sync inside tensor.item(), a
    compile) is alive: its ticker, a process of its own, still ticks."""
    name = f"kimi_ops_test_{uuid.uuid4().hex}"
    beat = Heartbeat(name, 1, 0, create=True, period=0.005)
    beat.unlink()
    wait_for(lambda: beat.beat(0) > 0)
    before, start = beat.beat(0), time.monotonic()
    sum(range(3 * 10**7))  # one C call: no other thread of this process runs meanwhile
    assert time.monotonic() - start > 0.1 and beat.beat(0) > before + 10
    beat.close()


def test_a_killed_ranks_word_stops():
    import subprocess
    import sys

    name = f"kimi_ops_test_{uuid.uuid4().hex}"
    first = Heartbeat(name, 2, 0, create=True, period=0.005)
    rank = ("import time; from kimi_ops.runtime.heartbeat import Heartbeat; "
            f"Heartbeat({name!r}, 2, 1, create=False, period=0.005); print(flush=True); time.sleep(60)")
    second = subprocess.Popen([sys.executable, "-c", rank], stdout=subprocess.PIPE)
    second.stdout.readline()
    first.unlink()
    wait_for(lambda: first.beat(1) > 3)
    second.kill()  # no clean-up runs: its ticker sees itself orphaned
    second.wait()
    second.stdout.close()
    time.sleep(0.1)
    stopped = first.beat(1)
    time.sleep(0.1)
    assert first.beat(1) == stopped
    first.close()


def group_member(rank: int, tp: int, store: str, out: str, failing: int = -1) -> None:
    """One process of a gloo group: start the group's heartbeat, then see every peer tick
    (rank ``failing`` cannot open the page: every rank warns and goes without)."""
    import json
    import warnings

    import torch.distributed as dist

    from kimi_ops.runtime import heartbeat

    if rank == failing:
        def refuse(self, *args, **kwargs):
            raise OSError("no /dev/shm here")

        heartbeat.Heartbeat.__init__ = refuse
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        beat = heartbeat.start(dist.group.WORLD, tp, rank)
    seen = {"warned": [str(w.message) for w in caught]} if caught else {}
    if beat is not None:
        first = [beat.beat(r) for r in range(tp)]
        wait_for(lambda: all(beat.beat(r) > first[r] for r in range(tp)))
        seen = {"moved": True, "page_gone": not os.path.exists(beat.path)}
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"started": beat is not None, **seen}, f)
    dist.destroy_process_group()


def test_a_group_shares_one_page(tmp_path):
    import json

    import torch.multiprocessing as mp

    tp = 3
    mp.spawn(group_member, args=(tp, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=tp, join=True)
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(tp)]
    assert all(r == {"started": True, "moved": True, "page_gone": True} for r in results), results


def test_a_rank_without_the_page_makes_every_rank_warn(tmp_path):
    import json

    import torch.multiprocessing as mp

    tp = 3
    mp.spawn(group_member, args=(tp, str(tmp_path / "store"), str(tmp_path / "out"), 1), nprocs=tp, join=True)
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(tp)]
    for result in results:
        assert not result["started"] and len(result["warned"]) == 1, results
        assert "rank 1: OSError: no /dev/shm here" in result["warned"][0] and "1 s" in result["warned"][0]
