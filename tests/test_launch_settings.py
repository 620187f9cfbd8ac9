"""The compiled-in launch settings of kernels/launch.py (KIMI_OPS_SMEM_CARVEOUT,
KIMI_OPS_GEMM_ROOM, KIMI_OPS_MARKS): bad values named, each a part of the kernel cache's key, and the
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


def test_a_flag_is_0_or_1(monkeypatch):
    assert launch.flag_setting("KIMI_OPS_UNSET_SETTING") is False
    monkeypatch.setenv("KIMI_OPS_TEST_SETTING", "1")
    assert launch.flag_setting("KIMI_OPS_TEST_SETTING") is True
    monkeypatch.setenv("KIMI_OPS_TEST_SETTING", "yes")
    with pytest.raises(ValueError, match="KIMI_OPS_TEST_SETTING must be 0 or 1, got 'yes'"):
        launch.flag_setting("KIMI_OPS_TEST_SETTING")


def test_settings_read(monkeypatch):
    assert launch.percent_setting("KIMI_OPS_UNSET_SETTING") is None and launch.kb_setting("KIMI_OPS_UNSET_SETTING") == 0
    monkeypatch.setenv("KIMI_OPS_TEST_SETTING", "100")
    assert launch.percent_setting("KIMI_OPS_TEST_SETTING") == 100
    assert launch.kb_setting("KIMI_OPS_TEST_SETTING") == 100 * 1024


def in_a_process(code: str, **settings) -> str:
    """``code``'s stdout in a fresh process with only these of the compiled-in settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_OPS_SMEM_CARVEOUT", "KIMI_OPS_GEMM_ROOM", "KIMI_OPS_MARKS")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "CUTE_DSL_ARCH": "sm_90a", **settings},
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_each_setting_keys_the_cache():
    pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    code = "from kimi_ops.kernels import compile; print(compile.source_fingerprint())"
    keys = [in_a_process(code), in_a_process(code, KIMI_OPS_SMEM_CARVEOUT="100"),
            in_a_process(code, KIMI_OPS_GEMM_ROOM="112"), in_a_process(code, KIMI_OPS_MARKS="1")]
    assert len(set(keys)) == 4, keys




def test_the_setting_alone_puts_the_carveout_into_the_exported_kernel(tmp_path):
    """KIMI_OPS_SMEM_CARVEOUT set before import, nothing else: the exported object's loader
    sets attribute 9 (the carveout) to 37, where the unset build's loader has no such call."""
    pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    code = ("import sys\nfrom kimi_ops.kernels.group import host\n"
            "host.compile_barrier.build(2).export_to_c(object_file_path=sys.argv[1], function_name='func')\n")
    objects = {}
    for name, settings in (("unset", {}), ("set", {"KIMI_OPS_SMEM_CARVEOUT": "37"})):
        path = tmp_path / f"{name}.o"
        in_a_process(code.replace("sys.argv[1]", repr(str(path))), **settings)
        objects[name] = path.read_bytes()
    call = bytes.fromhex("be09000000ba25000000")  # mov $0x9, %esi; mov $0x25 (37), %edx: the attribute's call
    assert objects["set"].count(call) == 2 and objects["unset"].count(call) == 0  # cuda_load, cuda_load_to_device


def test_the_carveout_reaches_the_kernels_load_attributes(monkeypatch):
    """export_carveout: each kernel op's ``cu_attrs`` (which the exported object's loader
    sets, cuKernelSetAttribute) carry the carveout beside the DSL's own attributes."""
    pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from kimi_ops.kernels import compile as kernel_compile
    from kimi_ops.kernels.group import host as group

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
