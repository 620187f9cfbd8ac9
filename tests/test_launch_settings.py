"""The compiled-in launch settings of kernels/launch.py (KIMI_OPS_SMEM_CARVEOUT,
KIMI_OPS_GEMM_ROOM): bad values named, each a part of the kernel cache's key, and the
carveout in every exported kernel's load-time attributes."""

import os
import subprocess
import sys

import pytest

from kimi_ops.kernels import launch


@pytest.mark.parametrize("variable, value", [("KIMI_OPS_SMEM_CARVEOUT", "101"), ("KIMI_OPS_SMEM_CARVEOUT", "max"),
                                             ("KIMI_OPS_GEMM_ROOM", "227"), ("KIMI_OPS_GEMM_ROOM", "-1")])
def test_a_bad_setting_is_named(variable, value, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable} must be .*got '{value}'"):
        (launch.percent_setting if "CARVEOUT" in variable else launch.kb_setting)(variable)


def test_settings_read(monkeypatch):
    assert launch.percent_setting("KIMI_OPS_UNSET_SETTING") is None and launch.kb_setting("KIMI_OPS_UNSET_SETTING") == 0
    monkeypatch.setenv("KIMI_OPS_TEST_SETTING", "100")
    assert launch.percent_setting("KIMI_OPS_TEST_SETTING") == 100
    assert launch.kb_setting("KIMI_OPS_TEST_SETTING") == 100 * 1024


cute_dsl = pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from cutlass.cutlass_dsl.cutlass import CuTeDSL  # noqa: E402

from kimi_ops.kernels import compile as kernel_compile  # noqa: E402
from kimi_ops.kernels.group import host as group  # noqa: E402


def fingerprint(**settings) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_OPS_SMEM_CARVEOUT", "KIMI_OPS_GEMM_ROOM")}
    code = "from kimi_ops.kernels import compile; print(compile.source_fingerprint())"
    done = subprocess.run([sys.executable, "-c", code], env={**env, **settings}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_each_setting_keys_the_cache():
    keys = [fingerprint(), fingerprint(KIMI_OPS_SMEM_CARVEOUT="100"), fingerprint(KIMI_OPS_GEMM_ROOM="112")]
    assert len(set(keys)) == 3, keys


def test_the_carveout_reaches_the_kernels_load_attributes(monkeypatch):
    """export_carveout: each kernel op's ``cu_attrs`` (which the exported object's loader
    sets, cuKernelSetAttribute) carry the carveout beside the DSL's own attributes."""
    monkeypatch.setattr(CuTeDSL, "generate_func_op", CuTeDSL.generate_func_op)  # undone after the test
    kernel_compile.export_carveout(100)
    with_carveout, seen = CuTeDSL.generate_func_op, []

    def spy(dsl, *args, **kwargs):
        op = with_carveout(dsl, *args, **kwargs)
        seen.append(str(op.attributes["cu_attrs"]))
        return op

    monkeypatch.setattr(CuTeDSL, "generate_func_op", spy)
    assert group.compile_barrier.build(2) is not None
    assert seen and all("preferred_shared_memory_carveout = 100" in attrs and "max_dynamic_shared_size_bytes" in attrs
                        for attrs in seen), seen
