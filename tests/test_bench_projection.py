"""bench_projection's peer columns on the CPU: quack's results from its child process
merged by (N, K, B), its errors kept apart from the timings, ours over the best peer."""

import json
import subprocess

import pytest

from benchmarks import bench_projection as bench

SHAPES = [((7168, 1536), [("o_proj/TP8", 1, 7.0, 8.0, "-", 5.2, 7.3, 9.1), ("o_proj/TP8", 8, 7.2, 8.1, "-", 5.2, 7.4, 9.0)])]


def fake_child(rows):
    def run(command, **_):
        path = command[command.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"quack": "0.6.5", "rows": rows}, f)
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


def test_quack_column_merges_the_childs_rows_and_errors(monkeypatch):
    monkeypatch.setattr(subprocess, "run", fake_child([{"N": 7168, "K": 1536, "B": 1, "us": 7.5, "config": "x", "ok": True},
                                                        {"N": 7168, "K": 1536, "B": 8, "error": "RuntimeError: boom"}]))
    quack = bench.quack_column(SHAPES)
    assert quack == {(7168, 1536, 1): {"us": 7.5, "config": "x", "ok": True}, (7168, 1536, 8): "RuntimeError: boom"}
    timed, failed = (bench.with_peers(SHAPES[0][0], row, quack) for row in SHAPES[0][1])
    assert timed[:6] == ("o_proj/TP8", 1, 7.0, 8.0, 7.5, pytest.approx(7.0 / 7.5))
    assert timed[6:] == ("-", 5.2, 7.3, 9.1, "x")
    assert failed[4] == "error" and failed[5] == pytest.approx(7.2 / 8.1) and failed[-1] == "-"  # cuBLAS the peer
    assert bench.with_peers(SHAPES[0][0], SHAPES[0][1][0], {})[4:6] == ("-", pytest.approx(7.0 / 8.0))
    off = {(7168, 1536, 1): {"us": 6.0, "config": "x", "ok": False}}
    assert bench.with_peers(SHAPES[0][0], SHAPES[0][1][0], off)[-1] == "x (output off)"


def test_quack_column_says_why_when_the_child_gives_nothing(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 1, "", "no GPU"))
    assert set(bench.quack_column(SHAPES).values()) == {"quack_peer failed: no GPU"}

    def slow(command, timeout, **_):
        raise subprocess.TimeoutExpired(command, timeout)
    monkeypatch.setattr(subprocess, "run", slow)
    assert set(bench.quack_column(SHAPES, timeout=5).values()) == {"no result in 5 s"}
