"""``python -m kimi_ops`` (the doctor) on this machine and on stand-ins for others."""

import subprocess
import sys

import pytest
import torch

from kimi_ops import __main__ as doctor
from kimi_ops import backend
from kimi_ops.ops import OPS


def test_runs_as_a_module_and_names_every_op(tmp_path):
    env = {"KIMI_OPS_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "kimi_ops"], capture_output=True, text=True, check=True,
                         env=env, timeout=120).stdout
    for section in ("versions:", "devices:", "ops (KIMI_OPS_BACKEND=auto):", "cache:", "multi-process:"):
        assert section in out
    for name in OPS:
        assert f"  {name} " in out
    assert f"{tmp_path} (0 files" in out


def test_the_cache_counts_files_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_OPS_CACHE_DIR", str(tmp_path))
    (tmp_path / "0123456789abcdef").mkdir()
    (tmp_path / "0123456789abcdef" / "k.o").write_bytes(b"x" * 2**20)
    assert "1 files, 1.0 MiB, 1 source versions" in doctor.cache()[0][1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answers")
def test_a_cpu_machine_runs_the_references(monkeypatch):
    assert all(value == "reference (no CUDA device)" for _, value in doctor.ops())
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    assert all(value == "reference (KIMI_OPS_BACKEND=reference)" for _, value in doctor.ops())


def test_a_hopper_machine_names_kernels_and_the_rest(monkeypatch):
    monkeypatch.setattr(doctor, "why_reference", lambda: None)
    monkeypatch.setattr(backend, "KERNELS", {"oproj": object()})
    rows = dict(doctor.ops())
    assert rows["oproj"].startswith("CuTe kernel")
    assert rows["situ"] == "reference (no CuTe kernel is registered)"


def test_mps_state_from_its_pipe_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert doctor.mps()[0][1].startswith("not running")
    (tmp_path / "control").touch()
    assert doctor.mps()[0][1] == f"control daemon running (pipe directory {tmp_path})"
