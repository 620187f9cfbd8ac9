"""Where a kernel's warps wait, from Nsight Compute's warp-state samples per SASS instruction:
the top instructions by samples with their stall reasons, and the samples by opcode, for
each kernel of the file (``--kernel``: those whose name matches).

On the GPU machine (Firecracker kinds: KINDS.md), one launch of a kernel of a script, or
every kernel of one decode step (benchmarks/ncu_step.py):

    ncu --clock-control none --kernel-name regex:IndexFront --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --page source --print-source sass --csv \\
        python3 script.py > kernel.csv
    ncu --clock-control none --profile-from-start off --section SourceCounters --page source \\
        --print-source sass --csv python3 -m benchmarks.ncu_step --tp8-rank --batch 64 > step.csv
    python -m benchmarks.ncu_hotspots step.csv [--kernel IndexFront] [--top 25] [--context 3] \
        [--cubins DIR]

``--cubins``: the cubins the kernels compiled to with line tables (``KIMI_OPS_LINE_TABLES=DIR``
set for the profiled run, or for a CPU compile of the same keys: the SASS is the same), so
that each instruction names its kimi_ops file and line (the innermost: a helper's, not its
caller's), and the samples are summed by line too. A cubin is a kernel's where its text
section has the kernel's name and instruction count (names are truncated: several variants
may share one; those whose lines differ too leave the kernel without lines). Needs pyelftools (the ``test`` and ``bench`` extras).

Samples are warps' states at a fixed interval: a phase's share of a warp group's samples is
its share of that group's time (producer and consumer warps sample apart; the instruction
addresses tell them apart). How the twenty-third session read the DSA front's: NOTES.md.
"""

import argparse
import csv
import gzip
import pathlib
import re
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
INSTRUCTION_BYTES = 16  # a Hopper SASS instruction


def read_kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each profiled launch's (kernel name, header, instruction rows), in the file's order
    (ncu's own lines skipped; .gz read)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    kernels = []
    for row in rows:
        if row[0] == "Kernel Name":
            kernels.append((row[1], None, []))
        elif row[0] == "Address" and kernels:
            kernels[-1] = (kernels[-1][0], row, [])
        elif kernels and kernels[-1][1] is not None and len(row) == len(kernels[-1][1]):
            kernels[-1][2].append(row)
    return [kernel for kernel in kernels if kernel[1] is not None]


def stalls(header: list[str], row: list[str]) -> list[tuple[str, int]]:
    """The row's nonzero stall reasons (all samples), most first."""
    reasons = [(name.removeprefix("stall_"), int(row[i])) for i, name in enumerate(header)
               if name.startswith("stall_") and "Not Issued" not in name and row[i].isdigit() and int(row[i])]
    return sorted(reasons, key=lambda item: -item[1])


def opcode(source: str) -> str:
    """The SASS opcode of an instruction line (its predicate dropped)."""
    words = re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split()
    return words[0] if words else "?"


def line_tables(folder: str) -> dict[tuple[str, int], list[list[str]]]:
    """(kernel name, instructions) → each instruction's "file:line" (kimi_ops-relative), one
    list per cubin with that name and size under ``folder``."""
    tables = {}
    for path in sorted(pathlib.Path(folder).rglob("*.cubin")):
        found = cubin_lines(path)
        if found:
            name, lines = found
            tables.setdefault((name, len(lines)), []).append(lines)
    return tables


def cubin_lines(path) -> tuple[str, list[str]] | None:
    """A one-kernel cubin's kernel name and each instruction's "file:line" (None without a
    line table). A cubin has .debug_line but no .debug_info, so pyelftools' public path (by
    compilation unit) finds nothing: its line programs are read at their offsets."""
    from elftools.dwarf.structs import DWARFStructs
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        texts = [section for section in elf.iter_sections() if section.name.startswith(".text.")]
        dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False)
        if len(texts) != 1 or dwarf.debug_line_sec is None:
            return None
        lines = [""] * (texts[0]["sh_size"] // INSTRUCTION_BYTES)
        data, offset = dwarf.debug_line_sec.stream.getvalue(), 0
        while offset < dwarf.debug_line_sec.size:  # a line program a unit (DWARF 32-bit)
            version = int.from_bytes(data[offset + 4:offset + 6], "little")
            program = dwarf._parse_line_program_at_offset(
                offset, DWARFStructs(little_endian=True, dwarf_format=32, address_size=8, dwarf_version=version))
            directories = [d.decode() for d in program["include_directory"]]
            files = [f"{directories[e.dir_index - 1]}/{e.name.decode()}" if e.dir_index else e.name.decode()
                     for e in program["file_entry"]]
            states = [e.state for e in program.get_entries() if e.state is not None]
            for state, following in zip(states, states[1:]):  # a state holds until the next one's address
                name = files[state.file - 1].split("kimi_ops/", 1)[-1]
                for index in range(state.address // INSTRUCTION_BYTES,
                                   min(following.address // INSTRUCTION_BYTES, len(lines))):
                    lines[index] = f"{name}:{state.line}"
            offset += program.header["unit_length"] + 4
        return texts[0].name.removeprefix(".text."), lines


def report(path: str, top: int, context: int, kernel: str = "", cubins: str = "") -> None:
    kernels = [k for k in read_kernels(path) if re.search(kernel, k[0])]
    tables = line_tables(cubins) if cubins else {}
    print(f"{path}: {len(kernels)} launches (warp samples, kernel)")
    for name, header, rows in kernels:
        print(f"{sum(int(row[header.index(SAMPLES)]) for row in rows):8d}  {name[:100]}")
    for name, header, rows in kernels:
        print(f"\n== {name[:100]}")
        found = {tuple(lines) for lines in tables.get((name, len(rows)), [])}  # variants alike in size and lines: one
        if cubins and len(found) != 1:
            print(f"({len(found)} line tables of this name and {len(rows)} instructions: no lines)")
        report_kernel(header, rows, top, context, list(found.pop()) if len(found) == 1 else None)


def report_kernel(header: list[str], rows: list[list[str]], top: int, context: int,
                  lines: list[str] | None = None) -> None:
    samples, executed = header.index(SAMPLES), header.index(EXECUTED)
    total = sum(int(row[samples]) for row in rows) or 1
    where = (lambda i: f"  {lines[i]}") if lines else (lambda i: "")
    print(f"{len(rows)} instructions, {total} warp samples")
    print(f"\ntop {top} instructions (index, samples, share, executed, instruction, stall reasons"
          f"{', line' if lines else ''}):")
    hot = sorted(range(len(rows)), key=lambda i: -int(rows[i][samples]))[:top]
    for i in sorted(hot):
        row = rows[i]
        reasons = ", ".join(f"{name} {count}" for name, count in stalls(header, row)[:3])
        for j in range(max(0, i - context), i):  # what the warp waits behind
            print(f"{'':29s}  {rows[j][1].strip()[:60]}{where(j)}")
        print(f"{i:6d} {int(row[samples]):6d} {100 * int(row[samples]) / total:5.1f}% {int(row[executed]):8d}  "
              f"{row[1].strip()[:60]:60s} {reasons}{where(i)}")
    groups = [("opcode", lambda i: opcode(rows[i][1]))] + ([("line", lambda i: lines[i] or "?")] if lines else [])
    for title, key in groups:
        counts = Counter()
        for i, row in enumerate(rows):
            counts[key(i)] += int(row[samples])
        print(f"\nsamples by {title}:")
        for name, count in counts.most_common(15):
            print(f"  {name:28s} {count:6d} {100 * count / total:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", help="ncu --page source --print-source sass --csv output (may be .gz)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--context", type=int, default=0, help="instructions shown before each hot one")
    parser.add_argument("--kernel", default="", help="only the kernels whose name matches this regex")
    parser.add_argument("--cubins", default="", help="KIMI_OPS_LINE_TABLES's folder: each instruction's file:line")
    args = parser.parse_args()
    report(args.csv, args.top, args.context, args.kernel, args.cubins)


if __name__ == "__main__":
    main()
