"""benchmarks/ncu_hotspots.py on a small CSV in ncu's source-page form (no GPU needed)."""

import pytest

from benchmarks import ncu_hotspots

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_long_sb","stall_membar","stall_barrier (Not Issued)"')
ROWS = ['"0x10","      LDC R1, c[0x0][0x28]","2","2","96","0","0","0"',
        '"0x20","@!P1  NANOSLEEP.SYNCS 0x989680","30","30","5000","30","0","0"',
        '"0x30","      MEMBAR.ALL.GPU","9","9","96","4","5","0"',
        '"0x40","@P0   NANOSLEEP.SYNCS 0x989680","1","1","96","1","0","0"']


def write(tmp_path):
    """Two launches, as ncu writes a step's: the second kernel has two instructions."""
    path = tmp_path / "kernel.csv"
    path.write_text("\n".join(["==PROF== Connected to process 1", '"Kernel Name","IndexFront_0",', HEADER, *ROWS,
                               "==PROF== Disconnected", '"Kernel Name","DecodeGemm_1",', HEADER, *ROWS[2:]]) + "\n")
    return str(path)


def test_reads_each_launchs_rows_after_ncus_own_lines(tmp_path):
    kernels = ncu_hotspots.read_kernels(write(tmp_path))
    assert [(name, len(rows)) for name, _, rows in kernels] == [("IndexFront_0", 4), ("DecodeGemm_1", 2)]
    _, header, rows = kernels[0]
    assert header[2] == ncu_hotspots.SAMPLES and [row[0] for row in rows] == ["0x10", "0x20", "0x30", "0x40"]
    assert ncu_hotspots.stalls(header, rows[2]) == [("membar", 5), ("long_sb", 4)]  # not-issued columns apart
    assert ncu_hotspots.opcode(rows[1][1]) == ncu_hotspots.opcode(rows[3][1]) == "NANOSLEEP.SYNCS"


def test_report_ranks_instructions_and_sums_opcodes(tmp_path, capsys):
    ncu_hotspots.report(write(tmp_path), top=2, context=1, kernel="Index")
    out = capsys.readouterr().out
    assert "1 launches" in out and "DecodeGemm" not in out and "4 instructions, 42 warp samples" in out
    ranked, opcodes = out.split("samples by opcode:")
    hot = [line for line in ranked.splitlines() if "%" in line]
    assert len(hot) == 2 and "30  71.4%" in hot[0] and "long_sb 30" in hot[0]  # in address order
    assert "MEMBAR.ALL.GPU" in hot[1] and "membar 5, long_sb 4" in hot[1]
    assert "0x989680" in ranked.split(hot[1])[0].splitlines()[-1]  # the context line before MEMBAR
    assert "NANOSLEEP.SYNCS                  31" in opcodes  # both predicated sleeps, one opcode


def test_cubins_name_each_instructions_line(tmp_path, monkeypatch, capsys):
    """A kernel compiled under KIMI_OPS_LINE_TABLES leaves a cubin whose line tables map its
    instructions to our files; the report then names each hot instruction's line and sums
    the samples by line (a CSV of that kernel's name and instruction count)."""
    pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    pytest.importorskip("elftools", reason="pyelftools is not installed")
    from kimi_ops.kernels import compile as kernel_compile
    from kimi_ops.kernels.dsa import host as dsa

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    (tmp_path / "cubins" / "key_insert").mkdir(parents=True)  # as compiled() makes it
    monkeypatch.setattr(kernel_compile, "_dump_dir", str(tmp_path / "cubins" / "key_insert"))
    assert "--generate-line-info" in kernel_compile.compile_options()
    dsa.compile_key_insert.build()
    ((name, count), tables), = ncu_hotspots.line_tables(str(tmp_path / "cubins")).items()
    lines, = tables
    assert "KeyInsert" in name and len(lines) == count > 8
    assert all(line.startswith("kernels/") for line in lines[:-1])  # the last: the padding after EXIT
    assert any(line.startswith("kernels/dsa/kernels.py:") for line in lines)
    rows = [f'"0x{16 * i:x}","      NOP","{int(i == 3) * 5}","0","1","{int(i == 3) * 5}","0","0"' for i in range(count)]
    path = tmp_path / "step.csv"
    path.write_text("\n".join([f'"Kernel Name","{name}",', HEADER, *rows]) + "\n")
    ncu_hotspots.report(str(path), top=1, context=0, cubins=str(tmp_path / "cubins"))
    out = capsys.readouterr().out
    assert f"samples by line:\n  {lines[3]:28s}      5 100.0%" in out and "NOP" in out
