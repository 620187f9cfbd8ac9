"""Warming the kernel cache ahead of serving (``python -m kimi_ops.prepare``) and the
decoder's progress report while it compiles."""

import io

import pytest

from kimi_ops import KimiArgumentError, KimiConfig, KimiDecoder, backend
from kimi_ops.progress import Progress

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops import prepare  # noqa: E402
from kimi_ops.kernels import compile as kernel_compile  # noqa: E402


def test_progress_counts_and_ends_one_line():
    out = io.StringIO()
    tally = Progress(3, stream=out)
    for cached in (True, False, False):
        tally(cached)
    tally.close()
    assert out.getvalue().startswith("3/3 kernels (1 cached), ") and out.getvalue().count("\n") == 1


def test_progress_is_none_or_a_bool():
    with pytest.raises(KimiArgumentError, match="progress must be None, True or False, got 1"):
        KimiDecoder(KimiConfig.tiny(), 2, progress=1)


class FakeKernel:
    def export_to_c(self, object_file_path, function_name):
        open(object_file_path, "wb").close()


@kernel_compile.compiled
def compile_fake(width: int):
    return FakeKernel()


def test_the_decoder_reports_what_it_compiles(tmp_path, monkeypatch, capsys):
    """The collecting pass names the kernels a prepare needs (the total), the second pass
    reports each compiled one; a kernel in memory is neither."""
    monkeypatch.setenv("KIMI_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_compile, "source_fingerprint", lambda: "test")
    monkeypatch.setattr(backend, "KERNELS", {"fake": object()})
    monkeypatch.setattr(KimiDecoder, "prepare_calls", lambda self: [compile_fake(w) for w in (8, 16, 8)])
    decoder = KimiDecoder(KimiConfig.tiny(), 2)
    decoder.prepare(progress=True)
    assert capsys.readouterr().err.startswith("2/2 kernels (0 cached), ")
    decoder.prepare(progress=True)  # both in memory now: nothing to report
    assert capsys.readouterr().err == ""


WORK_LIST = """
from kimi_ops import KimiConfig, kernels, prepare
from kimi_ops.kernels import compile as kernel_compile
assert kernels.register()
items = prepare.work_list(KimiConfig.tiny(), 1, 2)
names = {name for name, _ in items}
assert {"compile_gemm", "compile_attn_res", "compile_route_poll"} <= names, names
assert "compile_shared" in names  # a CUDA decoder's fused shared expert at tiny TP1, listed from the CPU
assert all(name in kernel_compile.BUILDS for name in names)
item = next(item for item in items if item[0] == "compile_route_poll")
assert prepare.build(item) is False  # compiled now, into the cache
"""


def test_the_work_list_is_the_decoders_and_builds_into_the_cache(tmp_path):
    """In a fresh process, as kimi_ops.prepare's workers run (a kernel this process holds
    in memory would be neither named nor built)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KIMI_OPS_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", WORK_LIST], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(tmp_path.rglob("*.o"))


def test_batches_are_one_or_a_range():
    assert prepare.batch_range("1-64") == (1, 64) and prepare.batch_range("8") == (8, 8)
    with pytest.raises(Exception, match="LOW-HIGH"):
        prepare.batch_range("9-3")
